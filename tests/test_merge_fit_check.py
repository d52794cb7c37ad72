"""`hubsoup merge` runs the planner's fit check from file headers before any weight moves (issue 11, item 4).

Hub inputs: a block that fits on no device is refused after ranged reads of the safetensors
headers only, no weight file downloaded; local inputs: before any tensor is read. Either way the
error is one line naming the block and the device, and no output, temporary folder or lock is left.
"""

from __future__ import annotations

import os

import pytest
from safetensors.torch import load_file

import hubsoup
from hubsoup.cli import main
from hubsoup.errors import PlacementError
from hubsoup.sources.checkpoint import Checkpoint
from hubsoup.testing import make_finetune, tiny_model


def _publish(hub, tmp_path, org: str) -> None:
    """A sharded base (shards over 100 kB: a header read is a real partial read) and two fine-tunes."""
    base = tmp_path / "base"
    tiny_model("llama", hidden=128, vocab=512, seed=0).save_pretrained(base, max_shard_size="300KB")
    hub.seed(f"{org}/base", str(base))
    for i in (1, 2):
        hub.seed(f"{org}/ft{i}", make_finetune(str(base), str(tmp_path / f"ft{i}"), seed=i, base_model=f"{org}/base"))


def _weight_gets(hub) -> list[dict]:
    return [c for c in hub.calls("GET", r"/resolve/") if c["path"].endswith(".safetensors")]


def _leftovers(out) -> list[str]:
    return sorted(p for p in os.listdir(os.path.dirname(out)) if os.path.basename(out) in p)


def test_merge_of_hub_inputs_refuses_a_block_that_fits_nowhere_before_downloading(hub, tmp_path, capsys):
    _publish(hub, tmp_path, "fitcheck")
    hub.requests.clear()
    out = str(tmp_path / "soup")
    rc = main(["merge", "fitcheck/ft1", "fitcheck/ft2", "--method", "task_arithmetic", "--out", out,
               "--device-map", "sequential", "--max-memory", "cpu=1KiB"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: block '") and "fits on no device" in lines[0], err
    assert "(cpu=" in lines[0], lines[0]  # names the device and its budget
    gets = _weight_gets(hub)
    assert gets, "the fit check read no safetensors header from the Hub"
    # only the headers were asked for (byte ranges answered 206), never a weight file's body
    assert all(c["range"] and c["status"] == 206 for c in gets), gets
    assert all(int(c["range"].split("-")[-1]) < 100_001 for c in gets), gets
    assert not os.path.exists(out) and _leftovers(out) == []

    # with room enough the same merge downloads the weights (cache_inputs: by default they are read in place,
    # tests/sources/test_hub_stream.py) and writes the same output
    res = hubsoup.merge(["fitcheck/ft1", "fitcheck/ft2"], method="task_arithmetic", out=out, quiet=True,
                        device_map="sequential", max_memory={"cpu": "1GiB"}, cache_inputs=True)
    bodies = [c for c in _weight_gets(hub) if not c["range"]]
    assert {c["path"].split("/")[1] for c in bodies} >= {"fitcheck"} and len(bodies) >= 4  # base shards + 2 fts
    local = hubsoup.merge([str(tmp_path / "ft1"), str(tmp_path / "ft2")], method="task_arithmetic",
                          base=str(tmp_path / "base"), out=str(tmp_path / "local"), quiet=True)
    a, b = load_file(os.path.join(res.path, "model.safetensors")), load_file(os.path.join(local.path, "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)

    # once in the local cache, the headers are read there: a second merge asks the Hub for no weight file at all
    hub.requests.clear()
    hubsoup.merge(["fitcheck/ft1", "fitcheck/ft2"], method="task_arithmetic", out=str(tmp_path / "again"),
                  quiet=True, max_memory={"cpu": "1GiB"})
    assert _weight_gets(hub) == []


def test_merge_of_local_inputs_refuses_before_any_tensor_is_read(tmp_path, monkeypatch):
    base = tmp_path / "base"
    tiny_model("llama", seed=0).save_pretrained(base)
    fts = [make_finetune(str(base), str(tmp_path / f"ft{i}"), seed=i) for i in (1, 2)]

    def no_read(self, *a, **k):
        raise AssertionError("a weight was read before the fit check")

    monkeypatch.setattr(Checkpoint, "tensor", no_read)
    out = str(tmp_path / "soup")
    with pytest.raises(PlacementError, match=r"^block '[^']+' needs .* fits on no device") as e:
        hubsoup.merge(fts, method="ties", base=str(base), out=out, quiet=True, device_map="auto",
                      max_memory={"cpu": "1KiB"})
    assert "\n" not in str(e.value)
    assert not os.path.exists(out) and _leftovers(out) == []
