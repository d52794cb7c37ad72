"""``hubsoup demo``: the whole job on a small embedded default, with no network.

Builds a tiny Llama base, fine-tunes it briefly on three synthetic "tasks" (each a
different next-token rule), merges the three with TIES, and shows each model's loss
on every task: the merge should do well on all three at once, each fine-tune only
on its own.
"""

from __future__ import annotations

import os

import torch

VOCAB, SEQ = 64, 16


def _task_batch(task: int, n: int, g: torch.Generator) -> torch.Tensor:
    # task k: x_{t+1} = (x_t + step_k) mod V, on its own third of the vocabulary as start tokens
    step = (3, 7, 11)[task]
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    return (start + step * torch.arange(SEQ)) % VOCAB


def _loss(model, batch: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=batch, labels=batch).loss)


def _train(base_dir: str, out_dir: str, task: int, steps: int = 60) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(100 + task)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(task)
    for _ in range(steps):
        batch = _task_batch(task, 32, g)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out_dir)


def run_demo(out: str = "hubsoup-demo", quiet: bool = False) -> str:
    from transformers import AutoModelForCausalLM

    import hubsoup
    from hubsoup.testing import make_base, write_card_metadata

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    base_dir = os.path.join(out, "base")
    if not os.path.isdir(base_dir):
        make_base("llama", base_dir, vocab=VOCAB, hidden=64, layers=2, seed=0)
    fts = []
    for task in range(3):
        ft_dir = os.path.join(out, f"finetune-task{task}")
        if not os.path.isdir(ft_dir):
            print(f"fine-tuning task {task} ...")
            _train(base_dir, ft_dir, task)
            write_card_metadata(ft_dir, base_model=base_dir)
        fts.append(ft_dir)
    merged_dir = os.path.join(out, "merged-ties")
    print(f"merging {len(fts)} fine-tunes with TIES (base resolved from their model cards) ...")
    result = hubsoup.merge(fts, method="ties", out=merged_dir, overwrite=True, quiet=quiet,
                           params={"density": 0.5, "scale": 1.0})

    g = torch.Generator().manual_seed(1234)
    evals = [_task_batch(t, 64, g) for t in range(3)]
    rows = [("base", base_dir)] + [(f"finetune-task{t}", d) for t, d in enumerate(fts)] + [("merged (ties)", merged_dir)]
    print("\nloss per task (lower is better)")
    print(f"{'model':<18}" + "".join(f"{'task' + str(t):>9}" for t in range(3)) + f"{'mean':>9}")
    for label, path in rows:
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        losses = [_loss(model, b) for b in evals]
        print(f"{label:<18}" + "".join(f"{v:9.3f}" for v in losses) + f"{sum(losses) / 3:9.3f}")
    print(f"\n{result}")
    print(f"model card: {os.path.join(result.path, 'README.md')}")
    print(f"recipe:     {os.path.join(result.path, 'hubsoup_recipe.yaml')}")
    return result.path
