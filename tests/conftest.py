"""Test configuration.

Environment variables must be set before anything imports huggingface_hub:
``HF_ENDPOINT`` points at the local Hub server that the suite starts (see
``hub_server.py``), ``HF_HUB_OFFLINE=1`` keeps every other test from ever
reaching for the network, and ``HF_HOME`` is a throwaway folder.
"""

import os
import socket
import sys
import tempfile

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HUB_PORT = _free_port()
_HF_HOME = tempfile.mkdtemp(prefix="hubsoup-test-hf-home-")
os.environ["HF_ENDPOINT"] = f"http://127.0.0.1:{HUB_PORT}"
os.environ["HF_HOME"] = _HF_HOME
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_XET"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ.pop("HF_TOKEN", None)
os.environ["TOKENIZERS_PARALLELISM"] = "false"
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
# pytest-xdist's workers share the cores: each worker (and what it starts) gets its share of them as torch's
# threads, where each would otherwise take them all (2 workers × 2 OpenMP threads on 2 cores: the suite took
# 21.1 min of CPU time, 19.0 with one thread each, most of the difference threads waiting for each other).
# A value the caller set is kept.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, CORES // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

sys.path.insert(0, os.path.dirname(__file__))

pytest_plugins = ["tiny_models", "hub_server", "ray_cluster"]


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without it (-p no:xdist) the suite still runs
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per core and one more. Many tests wait on what they start (a merge in a process of
    its own, a Hub server, a browser, a Ray node): with one worker per core a core was idle a sixth of the time.
    On 2 cores: 11.6 min with 2 workers, 10.9 with 3 (both with one torch thread per worker)."""
    return CORES + 1


def pytest_configure(config):
    # pytest-xdist's loadfile hands out the files with the most tests first; the order below is by time instead
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    """Under pytest-xdist (README: ``-n auto --dist loadfile``), files holding slow tests are handed out first: a
    long file started last would leave the other worker idle at the end. A plain run keeps the usual order."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        slow_files = {item.path for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: item.path not in slow_files)  # stable: the order within each part is kept


@pytest.fixture()
def small_disk(tmp_path):
    """``mount(size, ro=False)`` → a fresh tmpfs of that size (a disk that really fills up); needs root (skipped with
    the reason otherwise). Unmounted when the test ends."""
    import subprocess

    mounted = []

    def mount(size: str = "64k", ro: bool = False) -> str:
        if os.geteuid() != 0:
            pytest.skip("needs root to mount a small tmpfs")
        mnt = tmp_path / f"disk{len(mounted)}"
        mnt.mkdir()
        try:
            proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}" + (",ro" if ro else ""), "tmpfs",
                                   str(mnt)], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"cannot mount a tmpfs here: {e}")
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
        mounted.append(mnt)
        return str(mnt)

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture
def probes(monkeypatch):
    """Every path the process stats, lists or opens from now on (``os.path.exists`` & co. call ``os.stat``)."""
    import builtins

    seen: list[str] = []

    def wrap(mod, name):
        real = getattr(mod, name)

        def rec(path, *a, **k):
            if isinstance(path, (str, bytes, os.PathLike)):
                seen.append(os.fsdecode(path))
            return real(path, *a, **k)

        monkeypatch.setattr(mod, name, rec)

    for name in ("stat", "lstat", "listdir", "scandir"):
        wrap(os, name)
    wrap(builtins, "open")
    return seen
