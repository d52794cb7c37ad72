"""LOT on experts larger than one device (issue 11, item 3): accelerate big-model inference for the capture.

With ``max_memory`` too small for a whole expert, each expert is dispatched by accelerate with
part of it offloaded to disk (in a folder inside the output's temporary folder); the merged
model must equal the capture without offload, and the offload folder must be gone afterwards.
"""

from __future__ import annotations

import os

import accelerate.utils
import pytest
import torch
from safetensors.torch import load_file
from tests.methods.test_lot import add_char_tokenizer, write_exemplars  # noqa: E402

import hubsoup
from hubsoup.errors import PlacementError
from hubsoup.exemplars.dispatch import expert_device_map, meta_model
from hubsoup.testing import make_finetune, tiny_model

BUDGET = {"cpu": "150KB"}  # the merge's largest block fits; a float32 expert (≈180 KB) does not


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("lot-offload")
    base = str(root / "base")
    tiny_model("llama", layers=4, seed=0).save_pretrained(base)
    add_char_tokenizer(base)
    fts = [make_finetune(base, str(root / f"ft{i}"), seed=i) for i in (1, 2)]
    ex = {str(i + 1): write_exemplars(root / f"ex{i}.jsonl", seed=i, n=4, lo=6, hi=16) for i in (0, 1)}
    return base, fts, ex


def test_expert_map_offloads_what_does_not_fit(zoo):
    base, _, _ = zoo
    dm = expert_device_map(meta_model(base), None, BUDGET)
    assert "cpu" in dm.values() and "disk" in dm.values(), dm
    # cpu:N workers are one host's memory: pooled into accelerate's "cpu"
    assert expert_device_map(meta_model(base), None, {"cpu": "75KB", "cpu:1": "75KB"}) == dm
    with pytest.raises(PlacementError, match="no device room"):
        from hubsoup.exemplars.dispatch import DispatchedExperts

        DispatchedExperts(base, max_memory={"cpu": "1KB"})


@pytest.mark.slow  # two LOT merges: ~10 s on 2 busy cores
def test_lot_with_disk_offloaded_experts_equals_the_plain_capture(zoo, tmp_path, monkeypatch):
    base, fts, ex = zoo
    kw = {"method": "lot", "base": base, "quiet": True, "exemplars": ex, "n_exemplars": 4, "batch_size": 4}
    plain = hubsoup.merge(fts, out=str(tmp_path / "plain"), **kw)

    folders, real = [], accelerate.utils.offload_weight

    def spy(weight, name, folder, index=None):
        folders.append(folder)
        assert os.path.isdir(folder)
        return real(weight, name, folder, index)

    monkeypatch.setattr(accelerate.utils, "offload_weight", spy)
    out = tmp_path / "off"
    off = hubsoup.merge(fts, out=str(out), max_memory=BUDGET, **kw)
    assert folders, "no weight was offloaded to disk"
    # one folder per expert, inside the output's temporary folder, removed after use
    assert len(set(folders)) == 2
    for f in set(folders):
        assert os.path.basename(os.path.dirname(f)).startswith(".off.partial-"), f
        assert not os.path.exists(f)
    assert sorted(os.listdir(tmp_path)) == ["off", "plain"]
    assert not [n for n in os.listdir(off.path) if "offload" in n]
    a, b = load_file(os.path.join(plain.path, "model.safetensors")), load_file(os.path.join(off.path, "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k  # same weights, same ops on the CPU: bit-identical
    assert any(not torch.equal(a[k], t) for k, t in load_file(os.path.join(base, "model.safetensors")).items())
