"""LOT Merging with exemplars: a few unlabelled texts per task steer the merge.

LOT Merging (layer-wise optimal task-vector merging) runs each fine-tune on a few
unlabelled exemplars of its own task, records what every linear layer sees, and solves
per layer for the merged weights that drift least from each expert on its own task's
inputs (a Gram-matrix pseudo-inverse; scale-weighted means for norms, means for biases).
The exemplars are named per input, by the input's folder name (or position).

The script merges two fine-tunes of a tiny Llama with LOT and, for comparison, with a
plain weight average, then measures the feature drift on each task's exemplars: how far
the merged model's last hidden states are from that task's expert (relative to the
expert's own change from the base). LOT's drift is lower.

Everything is built here (model, tokenizer, fine-tunes, exemplar files); no network.

Run:
    python examples/lot_exemplars.py [--out DIR]

CLI equivalent:
    hubsoup merge ft-math ft-poetry --base BASE --method lot \\
        --exemplars ft-math=math.jsonl --exemplars ft-poetry=poetry.jsonl -p n_exemplars=16 --out lot-soup
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import random
import tempfile

import torch

import hubsoup
from hubsoup.testing import make_base, make_finetune, save_tiny_tokenizer

TASK_WORDS = {"math": range(5, 45), "poetry": range(60, 100)}  # each task's texts use their own words


def write_exemplars(path: str, words: range, n: int, seed: int) -> str:
    """``n`` unlabelled texts (JSON lines with a ``text`` field) of 6-12 of the task's words."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            f.write(json.dumps({"text": " ".join(f"w{rng.choice(words)}" for _ in range(rng.randint(6, 12)))}) + "\n")
    return path


def hidden_states(model_dir: str, tokenizer_dir: str, texts_file: str) -> torch.Tensor:
    """The last hidden state of every real (non-padding) token of the texts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with open(texts_file, encoding="utf-8") as f:
        enc = tok([json.loads(line)["text"] for line in f], padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc, output_hidden_states=True).hidden_states[-1]
    return h[enc["attention_mask"].bool()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="LOT Merging with a few unlabelled exemplars per task.")
    parser.add_argument("--out", help="folder for everything this example writes (default: a temporary folder, removed at exit)")
    args = parser.parse_args(argv)
    root = args.out or tempfile.mkdtemp(prefix="hubsoup-example-lot-")
    os.makedirs(root, exist_ok=True)
    if not args.out:  # a temporary folder, removed at exit (--out DIR keeps everything)
        atexit.register(shutil.rmtree, root, True)
    # torch makes its compile cache in TMPDIR when torch._dynamo is first imported: here, under root
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, ".torch-cache"))

    base = make_base("llama", os.path.join(root, "base"))
    save_tiny_tokenizer(base)
    experts, exemplars = {}, {}
    for i, (task, words) in enumerate(TASK_WORDS.items(), start=1):
        experts[task] = make_finetune(base, os.path.join(root, f"ft-{task}"), seed=i, scale=0.1)
        exemplars[f"ft-{task}"] = write_exemplars(os.path.join(root, f"{task}.jsonl"), words, 16, seed=i)

    lot = hubsoup.merge(list(experts.values()), "lot", base=base, out=os.path.join(root, "lot-soup"),
                        exemplars=exemplars, n_exemplars=16, quiet=True, overwrite=True)
    avg = hubsoup.merge(list(experts.values()), "linear", base=base, out=os.path.join(root, "average"),
                        quiet=True, overwrite=True)
    print(lot)
    print(f"exemplars: {', '.join(f'{k}={v}' for k, v in exemplars.items())}")

    print("feature drift from each task's expert on its own exemplars (last hidden state, relative):")
    better = True
    for task, expert in experts.items():
        ex = exemplars[f"ft-{task}"]
        h_expert, h_base = hidden_states(expert, base, ex), hidden_states(base, base, ex)
        drift = {name: float((hidden_states(res.path, base, ex) - h_expert).norm() / (h_expert - h_base).norm())
                 for name, res in (("LOT", lot), ("average", avg))}
        better &= drift["LOT"] < drift["average"]
        print(f"  {task}: LOT {drift['LOT']:.4f}   weight average {drift['average']:.4f}")
    print(f"LOT drifts less than the weight average on every task: {better}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
