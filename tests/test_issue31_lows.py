"""Issue 31's low items outside the pipeline: each a clear error (or a retry), and nothing half-done.

* a transient 5xx on a safetensors header range read is retried as huggingface_hub retries downloads;
* ``--out`` equal to a mergekit ``tokenizer_source`` folder is refused, even with ``--overwrite``;
* a slice beyond the layers of a model whose config has no layer count is a clear error (no KeyError);
* passthrough slices of models with different hidden sizes are refused before anything is written.
(The commit's atomic exchange, which leaves ``--out`` in place through a crash, is in tests/output/test_faults.py.)
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file

import hubsoup
from hubsoup.errors import ParameterError
from hubsoup.workflows.rerun import run_config
from hubsoup.testing import make_base, make_finetune, save_tiny_tokenizer


@pytest.fixture(scope="module")
def sizes(tmp_path_factory):
    root = tmp_path_factory.mktemp("lows")
    small = make_base("llama", str(root / "small"), layers=2, hidden=32)
    big = make_base("llama", str(root / "big"), layers=2, hidden=64)
    counted = str(root / "no-layer-count")
    shutil.copytree(small, counted)
    with open(os.path.join(counted, "config.json")) as f:
        cfg = json.load(f)
    del cfg["num_hidden_layers"]
    with open(os.path.join(counted, "config.json"), "w") as f:
        json.dump(cfg, f)
    return {"root": str(root), "small": small, "big": big, "no-layer-count": counted}


def slices(*parts: tuple[str, int, int]) -> str:
    return "merge_method: passthrough\nslices:\n" + "".join(
        f"  - sources:\n      - model: {m}\n        layer_range: [{a}, {b}]\n" for m, a, b in parts)


def test_a_transient_5xx_on_a_header_read_is_retried(hub, tmp_path, monkeypatch):
    import hubsoup.sources.resolve as resolve

    waits: list[float] = []
    monkeypatch.setattr(resolve, "_sleep", waits.append)
    base = make_base("llama", str(tmp_path / "base"))
    hub.seed("alice/base", base)
    hub.seed("alice/ft", make_finetune(base, str(tmp_path / "ft"), seed=1))
    hub.fail_next(2, status=500, method="GET", path=r"^/alice/ft/resolve/.*model\.safetensors$")
    res = hubsoup.merge(["alice/ft"], "linear", base="alice/base", out=str(tmp_path / "soup"), quiet=True)
    assert hub.pending_failures == 0 and waits == [1.0, 2.0]  # two 500s on the header, then its answer
    assert load_file(os.path.join(res.path, "model.safetensors"))
    # a persistent error still ends, naming the repo and the status
    hub.seed("alice/ft2", make_finetune(base, str(tmp_path / "ft2"), seed=2))
    hub.fail_next(100, status=503, method="GET", path=r"^/alice/ft2/resolve/.*model\.safetensors$")
    with pytest.raises(hubsoup.HubsoupError, match="alice/ft2.*503"):
        hubsoup.merge(["alice/ft2"], "linear", base="alice/base", out=str(tmp_path / "soup2"), quiet=True)
    hub.clear_failures()
    assert len(waits) == 2 + 5 and not os.path.exists(tmp_path / "soup2")


def test_out_equal_to_the_tokenizer_source_is_refused_even_with_overwrite(sizes, tmp_path):
    base = str(tmp_path / "base")
    shutil.copytree(sizes["small"], base)
    save_tiny_tokenizer(base)
    ft = make_finetune(base, str(tmp_path / "ft"), seed=1)
    tok = str(tmp_path / "tok")
    shutil.copytree(base, tok)
    before = sorted(os.listdir(tok))
    text = (f"merge_method: linear\nmodels:\n  - model: {base}\n    parameters: {{weight: 0.5}}\n"
            f"  - model: {ft}\n    parameters: {{weight: 0.5}}\ntokenizer_source: {tok}\n")
    from hubsoup.errors import OutputExistsError
    from hubsoup.output.folder import write_marker

    with pytest.raises(OutputExistsError, match="hubsoup did not make it"):  # a model folder (issue 44)
        run_config(text, tok, overwrite=True, quiet=True)
    write_marker(tok, "merge")  # even a folder hubsoup made, when it is the tokenizer source
    before = sorted(os.listdir(tok))
    with pytest.raises(ParameterError, match="would delete it"):
        run_config(text, tok, overwrite=True, quiet=True)
    assert sorted(os.listdir(tok)) == before
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tok.")] == []


def test_a_slice_beyond_the_layers_of_a_model_without_a_layer_count_is_a_clear_error(sizes, tmp_path):
    model = sizes["no-layer-count"]
    with pytest.raises(ParameterError, match=r"layer_range' = \[0, 4\] but .* has 2 layers"):
        run_config(slices((model, 0, 4)), str(tmp_path / "out"), quiet=True)
    assert not os.path.exists(tmp_path / "out")


def test_passthrough_slices_of_different_hidden_sizes_are_refused_before_writing(sizes, tmp_path):
    for parts in [((sizes["small"], 0, 2), (sizes["big"], 0, 2)), ((sizes["big"], 0, 1), (sizes["small"], 1, 2))]:
        with pytest.raises(ParameterError, match="models of different sizes .* cannot be stacked"):
            run_config(slices(*parts), str(tmp_path / "out"), quiet=True)
        assert [p for p in os.listdir(tmp_path) if "out" in p] == []
    # same sizes stack as before
    res = run_config(slices((sizes["small"], 0, 2), (sizes["small"], 0, 1)), str(tmp_path / "out"), quiet=True)
    assert json.load(open(os.path.join(res.path, "config.json")))["num_hidden_layers"] == 3


def test_read_ahead_closes_when_interrupted_before_its_thread_started(monkeypatch, tmp_path):
    """Ctrl-C between the read-ahead thread's creation and its start: close() must not raise
    ('cannot join thread before it is started'), and no thread is left behind."""
    import threading

    from hubsoup.engine.prefetch import ReadAhead

    data = tmp_path / "f"
    data.write_bytes(b"x" * 4096)
    real_start = threading.Thread.start

    def interrupted(self):
        if self.name == "hubsoup-readahead":
            raise KeyboardInterrupt
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", interrupted)
    ahead = ReadAhead()
    with pytest.raises(KeyboardInterrupt):
        ahead.request([(str(data), 0, 4096)])
    ahead.close()  # the engine's cleanup
    ahead.close()
    assert not [t for t in threading.enumerate() if t.name == "hubsoup-readahead"]


def test_lanes_interrupted_while_starting_leave_no_thread_waiting(monkeypatch):
    """Ctrl-C while the main thread waits for the lane threads to start: none stays in Barrier.wait
    (which made the interpreter hang at exit)."""
    import threading
    import time

    from hubsoup import linalg
    from hubsoup.engine import lanes

    slow = linalg._one_thread  # the lanes' pool is linalg's one_thread_pool
    monkeypatch.setattr(linalg, "_one_thread", lambda: (time.sleep(0.2), slow()))
    monkeypatch.setattr(linalg, "_POOLS", {})
    real_wait = threading.Barrier.wait

    def wait(self, timeout=None):
        if threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt  # as a signal arriving while the lanes start
        return real_wait(self, timeout)

    earlier = set(threading.enumerate())  # lane threads of earlier merges in this process (kept per process)
    monkeypatch.setattr(threading.Barrier, "wait", wait)
    with pytest.raises(KeyboardInterrupt):
        lanes.run(lambda j: j, 3)

    def started() -> list:
        return [t for t in threading.enumerate() if t.name.startswith("hubsoup-lane") and t not in earlier]

    deadline = time.monotonic() + 10
    while started() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not started()
    assert linalg._POOLS == {}
    monkeypatch.setattr(threading.Barrier, "wait", real_wait)
    assert lanes.run(lambda j: j * 2, 3) == [0, 2, 4]  # the next run makes a new pool
