"""The Space app on ZeroGPU (issue 48, item 1), through the `spaces` package's real worker queue.

``tests/zerogpu_space.py`` runs the app of a Space folder made by ``hubsoup space create --hardware zero-a10g``
in a process of its own with ``SPACES_ZERO_GPU=true``: ``@spaces.GPU`` is then `spaces`' real wrapper, which forks
a worker, pickles the call's arguments to it and each yield back. What is stubbed is the GPU alone (the device
API that lends it, torch's CUDA build, and moving tensors onto it): that script's docstring lists it.

It checks that a merge runs in the worker (another process), its progress comes back through the queue, the
push runs in the app's process, Cancel crosses the boundary (the worker's generator is closed, the merge
cancelled, nothing pushed or left behind), and that what the app sent before (a closure, a threading.Event)
does not cross a pickling queue at all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hubsoup import space
from hubsoup.testing import make_base, make_finetune
import paths  # tests/paths.py: the repository's root, wherever a test module sits

pytestmark = pytest.mark.slow

ROOT = Path(paths.ROOT)
HELPER = Path(paths.TESTS) / "zerogpu_space.py"


def test_zerogpu_space_merges_reports_and_cancels_through_the_spaces_worker(hub, tmp_path):
    pytest.importorskip("spaces", reason="the ZeroGPU test needs the `spaces` package (the test extra)")
    base = make_base("llama", str(tmp_path / "base"), layers=8, hidden=64)
    for name, seed in (("ft-a", 1), ("ft-b", 2)):
        hub.seed(f"alice/{name}", make_finetune(base, str(tmp_path / name), seed=seed, base_model="alice/base"))
    hub.seed("alice/base", base)
    folder = tmp_path / "space"
    space.write_space(str(folder), "alice/merger", hardware="zero-a10g")
    assert json.loads((folder / "hubsoup_space.json").read_text())["zerogpu"] is True
    readme = (folder / "README.md").read_text()
    assert yaml.safe_load(readme.split("---\n")[1])["python_version"] == "3.10.13"  # as the Hub documents ZeroGPU

    result = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_TOKEN")}
    env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp_path / "hf-home"), HOME=str(tmp_path / "home"),
               HF_TOKEN=hub.token("alice"), ZEROGPU_TOKEN=hub.token("alice"), GRADIO_ANALYTICS_ENABLED="False",
               TMPDIR=str(tmp_path), PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    (tmp_path / "home").mkdir()
    log = open(tmp_path / "app.log", "wb")
    # a session of its own: the `spaces` package's forked GPU workers outlive the app's os._exit and are ended
    # with it, as a Space's container ends them
    proc = subprocess.Popen([sys.executable, str(HELPER), str(folder), str(result)], env=env, cwd=tmp_path,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(300)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # nothing of it left
            pass
        proc.wait()
        log.close()
    text = (tmp_path / "app.log").read_text(errors="replace")
    assert proc.returncode == 0 and result.exists(), text[-4000:]
    got = json.loads(result.read_text())
    assert got["zerogpu"] and "spaces/zero/wrappers" in got["wrapped"], got  # spaces' own wrapper, not ours

    # 1. merged in the worker (the device API was asked to allow a pid that is not the app's), pushed from the app
    merge = got["merge"]
    assert merge["error"] is None and merge["url"], merge
    allowed = [int(c["pid"]) for c in got["calls"] if c["path"] == "/allow"]
    assert allowed and got["main_pid"] not in allowed, got["calls"]
    stages = [stage for _, stage, _ in merge["progress"]]
    assert "download" in stages and "merge" in stages and "push" in stages, stages  # the worker's, then the push
    done = [d for d, _, _ in merge["progress"]]
    assert done == sorted(done) and done[-1] == 1.0 and any(0 < d < 0.5 for d in done), done
    assert merge["runs_left"] == []
    files = hub.files("alice/zero-soup")
    assert any(f.endswith(".safetensors") for f in files) and "\n# zero-soup\n" in files["README.md"].decode()
    assert "zero-soup" in merge["card"] and str(tmp_path) not in merge["card"]

    # 2. Cancel crossed the boundary: the worker's generator closed, the merge cancelled, nothing pushed or left
    cancel = got["cancel"]
    assert cancel["cancelled"], cancel
    assert cancel["progress"][-1][1] == "merge"  # cancelled in the worker's merge (SFTM's SVDs), not before it
    # when the worker handed back (close() returns once its generator is closed there): no output, no temporary
    assert cancel["ended"]["output"] is False and cancel["ended"]["temporary"] == [], cancel["ended"]
    assert not hub.exists("alice/zero-cancelled")
    assert cancel["runs_left"] == [], cancel
    assert not list(tmp_path.glob("**/.hubsoup-*")), "a temporary output was left"
    releases = [c for c in got["calls"] if c["path"] == "/release"]
    assert len(releases) >= 2, got["calls"]  # the GPU was given back after each run

    # 3. the app's former call (a closure, a threading.Event) cannot cross a pickling queue
    assert got["closure"].startswith(("PicklingError", "TypeError", "AttributeError")), got["closure"]
    assert "pickle" in got["closure"].lower(), got["closure"]
    assert hub.token("alice") not in text
    print(f"\nZeroGPU path: merge progress {len(merge['progress'])} reports, the worker stopped "
          f"{cancel['ended']['seconds']:.2f} s after the cancel, device API calls: "
          f"{[c['path'] for c in got['calls']]}; a closure: {got['closure'][:80]}")
