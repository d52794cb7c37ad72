"""LiNeS over TIES, with β chosen by a search on validation data.

Two tiny BERT encoders are really fine-tuned here, each on its own toy task (is a
sentence mostly "warm" or "cool" words? mostly "small" or "large" ones?), through a
frozen linear head per task, as the LiNeS paper's experts are trained under frozen
zero-shot heads. They are then merged with LiNeS on top of TIES: the merged task vector
is scaled by α at the first block rising to α+β at the last (α from the paper's Eq. 2).
``hubsoup.search`` merges once per β, scores each merge on both tasks' validation CSVs
(mean accuracy normalised by each fine-tune's own accuracy, as in the paper) and keeps
the best as the output, whose card records the grid and every score. On a toy this
small the search may well pick β = 0 (plain TIES scaled by α): finding that out is what
the validation data is for.

Everything is built here (model, tokenizer, data, heads); no network; on a CPU.

Run:
    python examples/lines_ties_search.py [--out DIR]

CLI equivalent:
    hubsoup merge FT_A FT_B --base BASE --method lines -p base_method=ties -p density=0.2 \\
        --search beta=0:1.5:0.5 --eval classification:warm.csv,head=warm.safetensors \\
        --eval classification:size.csv,head=size.safetensors --out soup
"""

from __future__ import annotations

import argparse
import atexit
import csv
import os
import shutil
import random
import tempfile

import torch

import hubsoup
from hubsoup.eval import TaskSpec
from hubsoup.eval.heads import mean_pool, save_head
from hubsoup.testing import make_base, save_tiny_tokenizer

# two toy tasks over the tiny tokenizer's words w0..w122: each class has its own 12 words
TASKS = {
    "warm": ([f"w{i}" for i in range(5, 17)], [f"w{i}" for i in range(17, 29)]),
    "size": ([f"w{i}" for i in range(40, 52)], [f"w{i}" for i in range(52, 64)]),
}
FILLER = [f"w{i}" for i in range(70, 120)]  # words no task cares about


def write_split(path: str, task: str, n: int, seed: int) -> None:
    """``n`` labelled sentences: 3 words of the label's class, 1 of the other, 3 fillers, shuffled."""
    rng = random.Random(seed)
    with open(path, "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(["text", "label"])
        for i in range(n):
            label = i % 2
            words = (rng.sample(TASKS[task][label], 3) + rng.sample(TASKS[task][1 - label], 1)
                     + rng.sample(FILLER, 3))
            rng.shuffle(words)
            out.writerow([" ".join(words), label])


def fine_tune(base: str, out: str, train_csv: str, head: str, *, steps: int = 40, seed: int = 0) -> str:
    """Full fine-tune of the encoder under the task's frozen head (AdamW, cross-entropy, full batch)."""
    from transformers import AutoModel, AutoTokenizer

    from hubsoup.eval.heads import load_head

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModel.from_pretrained(base)  # left in eval mode: no dropout, so the toy is deterministic
    weight, bias, _ = load_head(head)
    with open(train_csv, encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    enc = tok([r["text"] for r in rows], padding=True, return_tensors="pt")
    labels = torch.tensor([int(r["label"]) for r in rows])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        pooled = mean_pool(model(**enc).last_hidden_state, enc["attention_mask"])
        loss = torch.nn.functional.cross_entropy(pooled @ weight.T + bias, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="LiNeS over TIES with a β search on validation data.")
    parser.add_argument("--out", help="folder for everything this example writes (default: a temporary folder, removed at exit)")
    args = parser.parse_args(argv)
    root = args.out or tempfile.mkdtemp(prefix="hubsoup-example-lines-")
    os.makedirs(root, exist_ok=True)
    if not args.out:  # a temporary folder, removed at exit (--out DIR keeps everything)
        atexit.register(shutil.rmtree, root, True)
    # torch makes its compile cache in TMPDIR when torch._dynamo is first imported: here, under root
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, ".torch-cache"))
    base = make_base("bert", os.path.join(root, "base"), layers=4)
    save_tiny_tokenizer(base)
    fine_tunes, tasks = [], []
    for i, task in enumerate(TASKS):
        train, val = os.path.join(root, f"{task}-train.csv"), os.path.join(root, f"{task}-val.csv")
        write_split(train, task, 64, seed=10 + i)
        write_split(val, task, 48, seed=20 + i)
        head = os.path.join(root, f"{task}-head.safetensors")
        g = torch.Generator().manual_seed(30 + i)
        save_head(head, torch.randn(2, 32, generator=g), torch.zeros(2), labels=["0", "1"], task=task)
        fine_tunes.append(fine_tune(base, os.path.join(root, f"ft-{task}"), train, head, seed=i))
        tasks.append(TaskSpec("classification", val, name=task, head=head, split="validation"))
    print(f"fine-tuned {', '.join(fine_tunes)}")

    found = hubsoup.search(fine_tunes, "lines", base=base, out=os.path.join(root, "soup"),
                           grid={"beta": [0.0, 0.5, 1.0, 1.5]}, tasks=tasks,
                           params={"base_method": "ties", "density": 0.2}, quiet=True, overwrite=True)
    print(f"selection: {found.selection}")
    for row in found.scores:
        accs = ", ".join(f"{t} {m['accuracy']:.3f}" for t, m in row["metrics"].items())
        print(f"  beta={row['params']['beta']}: score {row['score']:.4f} ({accs})")
    print(f"chosen beta={found.best['beta']} (score {found.best_score:.4f}); "
          f"alpha={found.result.stats.get('lines.alpha', float('nan')):.4f} from Eq. 2")
    print(f"merged model: {found.result.path}")
    print(f"card: {os.path.join(found.result.path, 'README.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
