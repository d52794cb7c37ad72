"""The Space (examples/space/app.py) with two visitors in one process, its functions called directly.

alice merges her private fine-tune; bob, in the same app process, can neither read, merge nor push it
(by its repo ID, by the path its snapshot had, or by any folder of the server), every run's folder
(output and its own Hub cache) is gone when it ends (success, error or cancel), and stopping the app
(SIGTERM) removes its temporary folder. The browser test (tests/test_space.py) drives the same app.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from hubsoup.errors import HubsoupError, InputError, MergeCancelled
from hubsoup.footprint import fmt
from hubsoup.testing import make_base, make_finetune
import paths  # tests/paths.py: the repository's root, wherever a test module sits

pytestmark = pytest.mark.slow  # importing gradio takes seconds

ROOT = Path(paths.ROOT)
APP = ROOT / "examples" / "space" / "app.py"


@pytest.fixture(params=["file hashes", "no file hashes"])
def hub(hub, request):
    """Each test that uses the Hub runs on the test Hub and on a Hub that reports no file hashes (issue 31)."""
    hub.file_hashes = request.param == "file hashes"
    return hub


_APP: list = []


@pytest.fixture
def app(hub, monkeypatch):
    """The app's module, imported once (Gradio's local sign-in mock asks the test Hub who the token is)."""
    pytest.importorskip("gradio", reason="the Space needs gradio (the test extra)")
    if not _APP:
        spec = importlib.util.spec_from_file_location("space_app", APP)
        module = importlib.util.module_from_spec(spec)
        with monkeypatch.context() as mp:
            mp.setenv("HF_TOKEN", hub.token("alice"))
            spec.loader.exec_module(module)
        _APP.append(module)
    return _APP[0]


@pytest.fixture
def zoo(hub, tmp_path):
    base = make_base("llama", str(tmp_path / "base"))
    hub.seed("alice/base", base)
    hub.seed("alice/private-ft", make_finetune(base, str(tmp_path / "ft-a"), seed=1, base_model="alice/base"),
             private=True)
    ft = make_finetune(base, str(tmp_path / "ft-b"), seed=2, base_model="alice/base")
    hub.seed("bob/ft", ft)
    return {"base": base, "ft": ft}


def runs_left(app) -> list[str]:
    return os.listdir(app.RUNS_DIR)


def run(app, hub, user: str, inputs: list[str], repo: str, *, base: str | None = "alice/base",
        cancel: threading.Event | None = None) -> dict:
    state = app.merge_and_push(inputs, "linear", base=base, params={}, token=hub.token(user), repo_id=f"{user}/{repo}",
                               private=True, cancel=cancel or threading.Event())
    assert runs_left(app) == [], "a run's folder (output or Hub cache) was left"
    return state


def test_a_second_session_cannot_read_merge_or_push_the_first_ones_private_input(app, hub, zoo, tmp_path):
    from huggingface_hub import constants

    spied: list[str] = []
    real = app.hubsoup.merge

    def spy(*a, **k):  # the cache folder of each run, to try its path as bob
        spied.append(k["cache_dir"])
        return real(*a, **k)

    shared = os.path.join(constants.HF_HUB_CACHE, "models--alice--private-ft")

    def files(folder: str) -> set[str]:  # an earlier test of the session may have cached a repo of that name
        return {os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs}

    before = files(shared)
    app.hubsoup.merge = spy
    try:
        ok = run(app, hub, "alice", ["alice/private-ft"], "soup")
    finally:
        app.hubsoup.merge = real
    assert "error" not in ok, ok.get("error")
    assert hub.exists("alice/soup") and ok["url"]
    alice_cache = spied[0]
    assert not os.path.exists(alice_cache)  # removed with the run
    assert files(shared) == before  # nothing of the run in the shared cache

    snapshot = os.path.join(alice_cache, "models--alice--private-ft", "snapshots", hub.head("alice/private-ft"))
    attempts = {
        "by its repo ID": (["alice/private-ft", "bob/ft"], "alice/base", "not found"),
        "at its commit": ([f"alice/private-ft@{hub.head('alice/private-ft')}"], "alice/base", "not found"),
        "by its snapshot's path": ([snapshot], "alice/base", "not local paths"),
        "a server folder as input": ([str(ROOT)], "alice/base", "not local paths"),
        "a server folder as base": (["bob/ft"], app.RUNS_DIR, "not local paths"),
        "the server's home": (["bob/ft"], "~", "not local paths"),
    }
    for what, (inputs, base, words) in attempts.items():
        state = run(app, hub, "bob", inputs, "stolen", base=base)
        error = state.get("error")
        assert isinstance(error, InputError) and words in str(error), (what, error)
        assert "is a file" not in str(error) and "config.json" not in str(error), what  # nothing of the host
        assert not hub.exists("bob/stolen"), what
    # bob's own model merges and pushes: the refusals above were not a broken app
    state = run(app, hub, "bob", ["bob/ft"], "own")
    assert "error" not in state and hub.exists("bob/own")


def test_every_run_ends_with_its_folder_removed(app, hub, zoo):
    # an error before any download, an error after downloads (a push bob may not make), a cancel, a success
    state = run(app, hub, "bob", ["bob/ft"], "x", base="./base")
    assert isinstance(state["error"], InputError)
    state = app.merge_and_push(["bob/ft"], "linear", base="alice/base", params={}, token=hub.token("bob"),
                               repo_id="alice/not-bobs", private=True, cancel=threading.Event())
    assert isinstance(state["error"], HubsoupError) and runs_left(app) == []
    cancel = threading.Event()
    cancel.set()
    state = run(app, hub, "bob", ["bob/ft"], "cancelled", cancel=cancel)
    assert isinstance(state["error"], MergeCancelled) and not hub.exists("bob/cancelled")
    state = run(app, hub, "bob", ["bob/ft"], "done")
    assert state.get("url") and hub.exists("bob/done")


def test_a_refused_public_push_tells_the_visitor_without_server_paths_or_flags(app, hub, zoo):
    """alice's merge of her private fine-tune, to a public repo: refused before anything is sent, and what she
    reads names her model and the box to tick, never the server's run folder or a command line's flags (issue 44)."""
    from hubsoup.errors import PrivateInputsError, PushError

    state = app.merge_and_push(["alice/private-ft"], "linear", base="alice/base", params={}, token=hub.token("alice"),
                               repo_id="alice/public-soup", private=False, cancel=threading.Event())
    error = state["error"]
    assert isinstance(error, PrivateInputsError) and not hub.exists("alice/public-soup")
    assert "--private" in str(error)  # the command line's message names the flag (a streamed push: no folder)
    msg = app.visitor_message(error, "alice/public-soup")
    assert "`alice/private-ft`" in msg and 'Tick "Private repo"' in msg, msg
    for leak in (app.RUNS_DIR, "/tmp", "--", "hubsoup push", "allow_private_inputs"):
        assert leak not in msg, (leak, msg)
    # any other push error that names the run's folder: not shown either
    other = PushError(f"push of '{app.RUNS_DIR}/run-x/merge' to alice/s failed: network error (is "
                      f"{app.RUNS_DIR}/run-x/merge/model.safetensors readable?). The local output is intact; retry "
                      f"with: hubsoup push {app.RUNS_DIR}/run-x/merge alice/s")
    msg = app.visitor_message(other, "alice/s")
    assert app.RUNS_DIR not in msg and "hubsoup push" not in msg and "network error" in msg, msg


def test_the_mergekit_tabs_valid_check_refuses_tokenizer_bombs(app):
    """The "Valid" check reads the config as a merge does, under the same limits (issue 44: it said "Valid" for
    ``pad_to_multiple_of: 1e12``, a MemoryError, and a 20,000-token section cost minutes, now linear)."""
    head = app.EXAMPLE_CONFIG.rstrip("\n") + "\n"
    # (the limit of tokenizer.tokens, read by the same function, is tests/formats/test_mergekit_vocab.py's: a YAML of
    # 65,537 entries takes seconds to parse)
    for extra, why in [("tokenizer: {pad_to_multiple_of: 1.0e+12}\n", "at most 1024"),
                       ("tokenizer: {pad_to_multiple_of: 2048}\n", "at most 1024")]:
        shown = app.validate_config(head + extra)
        assert shown.startswith("**Not valid:**") and why in shown, shown[:200]
    assert app.validate_config(head + "tokenizer: {pad_to_multiple_of: 64}\n").startswith("**Valid**")


def test_the_download_limit_holds_for_a_visitor(app, hub, zoo, monkeypatch):
    monkeypatch.setattr(app, "MAX_DOWNLOAD", "1kB")
    state = run(app, hub, "bob", ["bob/ft"], "big")
    assert isinstance(state["error"], InputError) and "may download at most" in str(state["error"])
    assert not hub.exists("bob/big")




def test_a_merge_larger_than_the_spaces_disk_is_streamed_to_the_hub(app, hub, small_disk, tmp_path, monkeypatch):
    """Inputs read in place and the output streamed: a merge whose inputs and output are each several times the
    Space's disk runs there, under a ``max_disk`` equal to that disk: the peak the form predicted."""
    import hubsoup
    from hubsoup.errors import DiskFullError, DiskLimitError
    from hubsoup.output.shards import SHARDS_IN_FLIGHT

    base = make_base("llama", str(tmp_path / "big-base"), layers=4, hidden=64)  # 0.4 MB of weights
    ft = make_finetune(base, str(tmp_path / "big-ft"), seed=3, base_model="alice/big-base")
    hub.seed("alice/big-base", base)
    hub.seed("bob/big-ft", ft)
    monkeypatch.setattr(app, "SHARD_SIZE", "20kB")
    figures = app.figures(["bob/big-ft"], "alice/big-base", hub.token("bob"))  # what the form shows before the start
    cap = figures["disk"]  # the Space's disk for its runs (their output and their own Hub cache): the predicted peak
    disk = small_disk(f"{-(-cap // 4096) * 4}k")
    monkeypatch.setattr(app, "RUNS_DIR", disk)
    monkeypatch.setattr(app, "MAX_DISK", str(cap))
    inputs = sum(len(v) for repo in ("bob/big-ft", "alice/big-base") for k, v in hub.files(repo).items()
                 if k.endswith(".safetensors"))
    assert inputs > 4 * cap  # the inputs alone could not be downloaded to that disk
    # the controls: that disk cannot hold the output written whole, and max_disk says so before anything moves
    with pytest.raises(DiskFullError):
        hubsoup.merge([ft], method="linear", base=base, out=os.path.join(disk, "whole"), shard_size="20kB",
                      quiet=True)
    with pytest.raises(DiskLimitError, match="over --max-disk"):
        hubsoup.merge(["bob/big-ft"], method="linear", base="alice/big-base", out=os.path.join(disk, "whole"),
                      shard_size="20kB", max_disk=cap, token=hub.token("bob"), quiet=True)
    assert os.listdir(disk) == []

    served = hub.served_bytes(r"/resolve/")
    state = run(app, hub, "bob", ["bob/big-ft"], "big", base="alice/big-base")
    assert "error" not in state, state.get("error")
    pushed = hub.files("bob/big")
    weights = sum(len(v) for k, v in pushed.items() if k.endswith(".safetensors"))
    assert len([k for k in pushed if k.endswith(".safetensors")]) > 10 and weights > 2 * cap
    assert os.listdir(disk) == []  # and nothing left on it
    # what the merge read of the inputs: their bytes, each once (the tensors of both, in place)
    assert inputs <= hub.served_bytes(r"/resolve/") - served <= inputs + 64 * 1024
    # the figures the form showed before the start: what is fetched and goes up; the disk: K + 1 shards beside the
    # small files (the output's and the Hub cache's)
    small = sum(len(v) for k, v in pushed.items() if not k.endswith(".safetensors") and k != ".gitattributes")
    assert weights + small <= figures["upload"] <= weights + small + 32 * 1024
    assert figures["download"] == inputs
    largest = sorted((-(-len(v) // 4096) * 4096 for k, v in pushed.items() if k.endswith(".safetensors")),
                     reverse=True)[:SHARDS_IN_FLIGHT + 1]  # in whole blocks
    assert sum(largest) < figures["disk"] <= sum(largest) + 64 * 1024
    line = app.figures_line(figures)
    assert f"uploads {fmt(figures['upload'])}" in line and f"holds at most {fmt(figures['disk'])}" in line


def test_stopping_the_app_removes_its_temporary_folder(hub, tmp_path):
    pytest.importorskip("gradio")
    tmp = tmp_path / "app-tmp"
    tmp.mkdir()
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_TOKEN")}
    env.update(HF_ENDPOINT=hub.endpoint, HF_TOKEN=hub.token("alice"), TMPDIR=str(tmp), GRADIO_SERVER_PORT=port,
               GRADIO_SERVER_NAME="127.0.0.1", GRADIO_ANALYTICS_ENABLED="False", GRADIO_TEMP_DIR=str(tmp / "gradio"),
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(APP)], cwd=APP.parent, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:  # serving
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode(errors="replace")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).read()
                break
            except OSError:
                time.sleep(0.2)
        assert [p for p in tmp.iterdir() if p.name.startswith("soup-space-runs-")]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = [p.name for p in tmp.iterdir() if p.name.startswith(("soup-space-runs-", "hubsoup"))]
    assert left == [], (left, out.decode(errors="replace")[-2000:])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
