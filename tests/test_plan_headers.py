"""`hubsoup plan` on Hub inputs reads configs, cards and safetensors headers only (issue 11, item 4)."""

import os

from hubsoup.cli import main
from hubsoup.testing import make_finetune, tiny_model


def _publish(hub, tmp_path):
    """A sharded base (shards over 100 kB: a header read is a real partial read) and two fine-tunes."""
    base = tmp_path / "base"
    tiny_model("llama", hidden=128, vocab=512, seed=0).save_pretrained(base, max_shard_size="300KB")
    hub.seed("alice/base", str(base))
    sizes = {}
    for i in (1, 2):
        ft = make_finetune(str(base), str(tmp_path / f"ft{i}"), seed=i, base_model="alice/base")
        hub.seed(f"alice/ft{i}", ft)
        sizes[f"alice/ft{i}"] = sum(os.path.getsize(os.path.join(ft, f)) for f in os.listdir(ft)
                                    if f.endswith(".safetensors"))
    sizes["alice/base"] = sum(os.path.getsize(base / f) for f in os.listdir(base) if f.endswith(".safetensors"))
    assert len([f for f in os.listdir(base) if f.endswith(".safetensors")]) >= 2
    return sizes


def _cached_weights() -> set[str]:
    """The safetensors files in the (session-wide) Hub cache."""
    return {os.path.join(d, f) for d, _, fs in os.walk(os.environ["HF_HOME"]) for f in fs if f.endswith(".safetensors")}


def _weight_gets(hub):
    return [c for c in hub.calls("GET", r"/resolve/") if c["path"].endswith(".safetensors")]


def test_plan_of_hub_inputs_reads_headers_only(hub, tmp_path, capsys):
    sizes = _publish(hub, tmp_path)
    hub.requests.clear()
    cached_before = _cached_weights()
    rc = main(["plan", "alice/ft1", "alice/ft2", "--method", "task_arithmetic",
               "--device-map", '{"model.layers.0": "cpu:0", "": "cpu:1"}', "--max-memory", "cpu:0=1GiB,cpu:1=1GiB"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "predicted peak" in out and "cpu:0" in out and "cpu:1" in out
    for repo, size in sizes.items():
        line = next(ln for ln in out.splitlines() if ln.startswith(f"download {repo}@"))
        assert f": {size:,} bytes of weights" in line, (repo, size, line)
    gets = _weight_gets(hub)
    assert gets, "the planner read no safetensors header from the Hub"
    # every weight-file request asked for a byte range (the header), none for the whole file
    assert all(c["range"] and c["status"] == 206 for c in gets), gets
    assert all(int(c["range"].split("-")[-1]) < 100_001 for c in gets)
    # nothing landed in the cache but metadata (the cache is shared with earlier tests: compare with before)
    assert _cached_weights() == cached_before


def test_plan_refuses_a_block_that_fits_nowhere_without_downloading(hub, tmp_path, capsys):
    _publish(hub, tmp_path)
    hub.requests.clear()
    rc = main(["plan", "alice/ft1", "alice/ft2", "--method", "task_arithmetic",
               "--device-map", "sequential", "--max-memory", "cpu=1KiB"])
    err = capsys.readouterr().err
    assert rc == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: block '") and "fits on no device" in lines[0], err
    assert all(c["range"] and c["status"] == 206 for c in _weight_gets(hub))


def test_plan_counts_cached_shards_as_downloaded(hub, tmp_path, capsys):
    sizes = _publish(hub, tmp_path)
    from huggingface_hub import snapshot_download

    snapshot_download("alice/ft1")  # a merge fetched it before
    assert main(["plan", "alice/ft1"]) == 0
    out = capsys.readouterr().out
    assert f"download alice/ft1@" in out and f": 0 bytes of weights ({sizes['alice/ft1']:,} of" in out
