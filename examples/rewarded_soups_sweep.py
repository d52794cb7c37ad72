"""A Rewarded Soups sweep: one merged model per preference, tracing a front between two policies.

Rewarded Soups (Ramé et al., 2023) fine-tunes one policy per reward and interpolates
their weights, θ = θ_0 + Σ λ_i τ_i with λ on the simplex, to serve any trade-off
between the rewards without training again. Here two tiny causal LMs are really
fine-tuned, each on its own "style" of text (counting up through one set of words,
counting down through another); ``hubsoup.sweep`` writes one model per λ =
(v, 1 − v), v = 0, 0.25, …, 1, evaluates each on both styles' held-out text
(perplexity, lower is better) and lists them in ``sweep.json``. The printed table is
the front: moving λ trades one style for the other.

Everything is built here (model, tokenizer, text); no network; on a CPU.

Run:
    python examples/rewarded_soups_sweep.py [--out DIR]

CLI equivalent:
    hubsoup sweep POLICY_A POLICY_B --base SFT --method rewarded_soups --grid 0:1:0.25 --out front
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
from hubsoup.eval import TaskSpec
from hubsoup.testing import make_base, save_tiny_tokenizer

STYLES = {
    "up": [f"w{i}" for i in range(5, 25)],  # w5 w6 w7 ...
    "down": [f"w{i}" for i in range(60, 40, -1)],  # w60 w59 w58 ...
}


def write_texts(path: str, style: str, n: int, seed: int) -> None:
    """``n`` lines of 8 consecutive words of the style, from a random start (JSON lines, ``text``)."""
    rng = random.Random(seed)
    words = STYLES[style]
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            start = rng.randrange(len(words) - 8)
            f.write(json.dumps({"text": " ".join(words[start:start + 8])}) + "\n")


def fine_tune(base: str, out: str, texts: str, *, steps: int = 20, seed: int = 0) -> str:
    """A causal-LM fine-tune of the whole model on ``texts`` (AdamW, next-token loss)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base).train()
    with open(texts, encoding="utf-8") as f:
        batch = tok([json.loads(line)["text"] for line in f], return_tensors="pt")  # all 8 words: no padding
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = model(**batch, labels=batch["input_ids"]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Rewarded Soups: one merged model per preference vector.")
    parser.add_argument("--out", help="folder for everything this example writes (default: a temporary folder, removed at exit)")
    parser.add_argument("--grid", default="0:1:0.25", help="preference grid START:STOP:STEP (default 0:1:0.25)")
    args = parser.parse_args(argv)
    root = args.out or tempfile.mkdtemp(prefix="hubsoup-example-rewarded-soups-")
    os.makedirs(root, exist_ok=True)
    if not args.out:  # a temporary folder, removed at exit (--out DIR keeps everything)
        atexit.register(shutil.rmtree, root, True)
    # torch makes its compile cache in TMPDIR when torch._dynamo is first imported: here, under root
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, ".torch-cache"))

    sft = make_base("llama", os.path.join(root, "sft"))  # the shared starting point of both policies
    save_tiny_tokenizer(sft)
    policies, tasks = [], []
    for i, style in enumerate(STYLES):
        train, held_out = os.path.join(root, f"{style}-train.jsonl"), os.path.join(root, f"{style}-test.jsonl")
        write_texts(train, style, 32, seed=i)
        write_texts(held_out, style, 16, seed=100 + i)
        policies.append(fine_tune(sft, os.path.join(root, f"policy-{style}"), train, seed=i))
        tasks.append(TaskSpec("perplexity", held_out, name=style, split="test"))
    print(f"policies: {', '.join(policies)}")

    front = hubsoup.sweep(policies, "rewarded_soups", os.path.join(root, "front"), args.grid, base=sft,
                          evaluate=tasks, quiet=True, overwrite=True)
    print(f"sweep: {len(front.points)} models in {front.path} (index: sweep.json)")
    print(f"  {'lambda (up, down)':<20}{'perplexity on up':>18}{'perplexity on down':>20}   folder")
    for point in front.points:
        ppl = {r.task.name: r.metrics["perplexity"] for r in point.result.evaluation}
        lam = "(" + ", ".join(f"{x:.2f}" for x in point.value) + ")"
        print(f"  {lam:<20}{ppl['up']:>18.2f}{ppl['down']:>20.2f}   {os.path.basename(point.result.path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
