"""The one-file method of examples/custom_method.py: registered by import, merged end to end."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

import hubsoup
from hubsoup.methods import available, get_method
from hubsoup.testing import make_base, make_finetune, merge_tensors
import paths  # tests/paths.py: the repository's root, wherever a test module sits

EXAMPLE = os.path.join(paths.ROOT, "examples", "custom_method.py")


@pytest.fixture(scope="module")
def median_method():
    spec = importlib.util.spec_from_file_location("custom_method", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["custom_method"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_example_method_registers_and_computes_the_median(median_method):
    assert "median" in available()
    taus = torch.tensor([[1.0, -2.0], [3.0, 0.0], [10.0, 1.0]])
    out = merge_tensors("median", taus, scale=0.5)
    torch.testing.assert_close(out, torch.tensor([1.5, 0.0]))
    even = merge_tensors("median", taus[:2])
    torch.testing.assert_close(even, torch.tensor([2.0, -1.0]))


def test_example_method_merges_real_checkpoints(median_method, tmp_path):
    base = make_base("llama", str(tmp_path / "base"))
    fts = [make_finetune(base, str(tmp_path / f"ft{i}"), seed=i) for i in range(3)]
    res = hubsoup.merge(fts, "median", base=base, out=str(tmp_path / "soup"), scale=0.8, quiet=True)
    got = load_file(os.path.join(res.path, "model.safetensors"))
    b = load_file(os.path.join(base, "model.safetensors"))
    ins = [load_file(os.path.join(f, "model.safetensors")) for f in fts]
    name = next(k for k in b if k.endswith("q_proj.weight"))
    taus = torch.stack([i[name].float() - b[name].float() for i in ins])
    want = b[name].float() + 0.8 * taus.median(dim=0).values
    torch.testing.assert_close(got[name].float(), want, rtol=1e-5, atol=1e-6)
    assert "median" in res.card and res.recipe.method == "median"
    # a modifier finds its scale through the declared scale_param: LiNeS over the median sets it to 1
    parsed = get_method("lines").parse({"base_method": "median"})
    assert parsed.inner_params.scale == 1.0
