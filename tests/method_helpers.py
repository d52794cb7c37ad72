"""Helpers for method tests: run a method's passes and merge on hand-made tensors, as the engine would.

One tensor: :func:`hubsoup.testing.merge_tensors` (``merge_one`` below is it with a positional block).
Several tensors sharing the statistics passes: ``run_stats`` and ``merge_all``.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from hubsoup.methods import TensorContext, get_method
from hubsoup.testing import merge_tensors


def ctx(name="w", block=None, n=1, stats=None):
    return TensorContext(name=name, block=block, n_inputs=n, stats={} if stats is None else stats, recipe_hash="abc")


def merge_one(method, taus, block=None, stats=None, name="w", **params):
    """The merged task vector of one tensor; the method's passes run over it unless ``stats`` is given."""
    return merge_tensors(method, taus, name=name, block=block, stats=stats, recipe_hash="abc", **params)


def run_stats(method, tensors, **params):
    """Every statistics pass of ``method`` over ``tensors`` = {name: (block, [τ_i])}; returns (method, params, stats)."""
    m = get_method(method)
    p = m.parse(params)
    n = len(next(iter(tensors.values()))[1])
    m.check_inputs(p, n)
    stats = {}
    for sp in m.passes(p, n):
        for name, (block, taus) in tensors.items():
            sp.update(ctx(name, block, n, stats), torch.zeros_like(taus[0]), torch.stack(taus))
        sp.finish(stats)
    return m, p, stats


def merge_all(method, tensors, **params):
    """Passes, then the merged task vector of every tensor: {name: τ_merged}, stats."""
    m, p, stats = run_stats(method, tensors, **params)
    n = len(next(iter(tensors.values()))[1])
    out = {name: m.merge(torch.zeros_like(ts[0]), torch.stack(ts).clone(), p, ctx(name, block, n, stats))
           for name, (block, ts) in tensors.items()}
    return out, stats


def state(folder):
    """Every tensor of a checkpoint folder (all its safetensors shards)."""
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def tiny_lm_zoo(root) -> tuple[str, list[str], str]:
    """``(base, [ft1, ft2], val.jsonl)``: a tiny Llama with a tokenizer, two small fine-tunes and a perplexity
    validation file, the inputs of the search, evolve and executor tests."""
    import json

    from hubsoup.testing import make_base, make_finetune, save_tiny_tokenizer

    base = make_base("llama", str(root / "base"))
    save_tiny_tokenizer(base)
    fts = [make_finetune(base, str(root / f"ft{i}"), seed=i, scale=0.05) for i in (1, 2)]
    data = root / "val.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(f"w{(i * 7 + j * 3) % 100}" for j in range(12))}) + "\n"
                            for i in range(10)))
    return base, fts, str(data)
