"""Every method family on a CUDA device gives the CPU's result (≤ 1e-5 relative), through the one engine.

Marked ``gpu``: skipped, with the reason, where CUDA is absent (CI's machines have no GPU).
Run on a GPU machine with ``python -m pytest -q -m gpu tests/test_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from method_helpers import state as weights  # noqa: E402  (tests/ is on sys.path)

import hubsoup
from hubsoup import continual
from hubsoup.testing import make_base, make_finetune

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]

FAMILIES = [  # (method, params): element-wise, statistics passes, random, SVD, modifiers, interpolation
    ("task_arithmetic", {"scale": 0.5}),
    ("ties", {"density": 0.3}),
    ("ties", {"density": 0.3, "scope": "tensor"}),
    ("dare", {"p": 0.5, "then": "ties"}),
    ("consensus", {}),
    ("sftm", {}),
    ("opcm", {}),
    ("lines", {"base_method": "ties"}),
    ("lwptv", {"base_method": "task_arithmetic"}),
    ("slerp", {}),
]


def assert_close_rel(got: dict, want: dict, tol: float = 1e-5):
    assert got.keys() == want.keys()
    for k in want:
        a, b = got[k].double(), want[k].double()
        if not b.is_floating_point():
            assert torch.equal(got[k], want[k]), k
            continue
        err = float((a - b).norm())
        assert err <= tol * max(float(b.norm()), 1e-12), f"{k}: relative error {err / float(b.norm()):.2e}"


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    base = make_base("llama", str(root / "base"))
    fts = [make_finetune(base, str(root / f"ft{i}"), seed=i) for i in (1, 2, 3)]
    return root, base, fts


PLACES = {"cuda": {"device": "cuda"},
          # two entries: one block on the GPU, the rest on the CPU, merged concurrently
          "map": {"device_map": {"model.layers.0": 0, "": "cpu"}}}


@pytest.mark.parametrize("where", list(PLACES))
@pytest.mark.parametrize("method,params", FAMILIES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(FAMILIES)])
def test_method_on_cuda_matches_cpu(zoo, tmp_path, method, params, where):
    root, base, fts = zoo
    inputs = fts[:2] if method == "slerp" else fts
    cpu = hubsoup.merge(inputs, method, base=base, out=str(tmp_path / "cpu"), params=params, quiet=True)
    gpu = hubsoup.merge(inputs, method, base=base, out=str(tmp_path / "gpu"), params=params, quiet=True,
                        **PLACES[where])
    assert gpu.recipe.hash == cpu.recipe.hash  # the device is not part of what is merged
    assert_close_rel(weights(gpu.path), weights(cpu.path))


def test_lora_output_on_cuda_matches_cpu(zoo, tmp_path):
    root, base, fts = zoo
    kw = dict(base=base, quiet=True, output_format="lora", rank=8)
    cpu = hubsoup.merge(fts, "ties", out=str(tmp_path / "cpu"), **kw)
    gpu = hubsoup.merge(fts, "ties", out=str(tmp_path / "gpu"), device="cuda", **kw)
    a, b = weights(gpu.path), weights(cpu.path)
    # factors are defined up to sign per singular pair: compare the products B A
    for k in b:
        if k.endswith("lora_A.weight"):
            kb = k.replace("lora_A", "lora_B")
            pa, pb = (a[kb].double() @ a[k].double()), (b[kb].double() @ b[k].double())
            assert float((pa - pb).norm()) <= 1e-4 * float(pb.norm()), k
    assert abs(gpu.lora["aggregate_rel_error"] - cpu.lora["aggregate_rel_error"]) < 1e-5


def test_continual_add_on_cuda_matches_cpu(zoo, tmp_path):
    root, base, fts = zoo
    for dev in ("cpu", "cuda"):
        continual.init(fts[:2], base=base, out=str(tmp_path / dev), quiet=True, device=dev)
        continual.add(str(tmp_path / dev), [fts[2]], quiet=True, device=dev)
    assert_close_rel(weights(str(tmp_path / "cuda")), weights(str(tmp_path / "cpu")))
