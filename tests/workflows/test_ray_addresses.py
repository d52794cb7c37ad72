"""Ray addresses: ``ray://`` works (the ``[ray]`` extra brings ``ray[client]``); a ``RAY_ADDRESS`` (or executor)
that is garbage, refused, or not a Ray server is one line within a bounded time, never Ray's minutes of
retries. (The evolve config's limits are in tests/workflows/test_evolve.py.)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import types

import pytest

from hubsoup.errors import ParameterError
import paths  # tests/paths.py: the repository's root, wherever a test module sits


@pytest.fixture
def silent_server():
    """A TCP server that accepts connections and never says a word (not a Ray cluster)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    stop = threading.Event()
    conns = []

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join()
        for c in conns:
            c.close()
        srv.close()


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_ray_addresses_that_cannot_be_joined_are_one_line_at_once(silent_server, monkeypatch):
    """Garbage, a refused port, a server that is not Ray, ``ray://`` without Ray's client: one line each, within
    the connect timeout, before Ray is started (Ray itself retries minutes or raises a traceback)."""
    ray = pytest.importorskip("ray", reason="hubsoup[ray] is not installed")
    from hubsoup.workflows.executors import RayExecutor, check_ray_address

    monkeypatch.setenv("HUBSOUP_RAY_CONNECT_TIMEOUT", "2")
    # Ray's client present or not here: the address checks past its import are the same (its absence: below)
    monkeypatch.setitem(sys.modules, "grpc", sys.modules.get("grpc") or types.ModuleType("grpc"))
    assert not ray.is_initialized()
    cases = [("garbage", "RAY_ADDRESS 'garbage' is not a Ray address"),
             ("head:port", "is not a Ray address"),
             ("ray://head", "is not a Ray address"),
             (f"127.0.0.1:{_closed_port()}", "cannot reach the Ray cluster at .*: Connection refused"),
             (f"127.0.0.1:{silent_server}", "is not a Ray cluster \\(no gRPC answer within 2 s\\)"),
             (f"ray://127.0.0.1:{silent_server}", "is not a Ray cluster \\(no gRPC answer within 2 s\\)"),
             ("ray://nosuchhost.invalid:10001", "cannot reach the Ray cluster")]
    for address, message in cases:
        monkeypatch.setenv("RAY_ADDRESS", address)
        with pytest.raises(ParameterError, match=message) as e:
            RayExecutor()
        assert "\n" not in str(e.value)
        assert not ray.is_initialized()  # refused before ray.init: none of Ray's retries
    monkeypatch.setitem(sys.modules, "grpc", None)  # Ray's client absent: the extra said so
    with pytest.raises(ParameterError, match="needs Ray's client, which is not installed: pip install 'hubsoup\\[ray\\]'"):
        check_ray_address(f"ray://127.0.0.1:{silent_server}")


def test_the_ray_extra_brings_rays_client():
    """``pip install hubsoup[ray]`` installs ``ray[client]`` (grpcio): ``ray://`` needs it."""
    import tomllib

    with open(os.path.join(paths.ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert any(r.startswith("ray[client]") for r in extras["ray"]), extras["ray"]


@pytest.mark.slow
def test_ray_client_address_runs_trials_in_the_cluster(tmp_path):
    """``ray://HOST:PORT`` (Ray Client) joins a real cluster started here with ``ray start --head`` and runs the
    trials in its worker processes (every address failed before: the extra lacked ``ray[client]``)."""
    pytest.importorskip("ray", reason="hubsoup[ray] is not installed")
    pytest.importorskip("grpc", reason="Ray's client (ray[client], in hubsoup[ray]) is not installed: reinstall the "
                                       "[ray] extra")
    gcs, client = _closed_port(), _closed_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_agent_register_timeout_ms": "180000",
           "RAY_worker_register_timeout_seconds": "180",
           # the head's client proxy forks a server per client while its own gRPC threads run; with gRPC's fork
           # support on, that server died at start in 3 of 10 joins here ("Starting Ray client server failed"), 0 of
           # 12 with it off (2026-11-28, this `ray start` on 2 idle cores; CI failed on it once)
           "GRPC_ENABLE_FORK_SUPPORT": "false"}
    short_tmp = f"/tmp/hs44-{os.getpid()}"  # Ray's socket paths must stay short
    head = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block",
                             f"--port={gcs}", f"--ray-client-server-port={client}", "--num-cpus=1",
                             "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={short_tmp}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        for line in head.stdout:  # wait on Ray's own word that the head is up, not on a clock
            if "Ray runtime started" in line or "--block" in line:
                break
        code = ("import os, sys\nfrom hubsoup.workflows.executors import RayExecutor\n"
                "exe = RayExecutor(sys.argv[1], trial=lambda p: {'number': p['number'], 'state': 'complete', "
                "'score': p['number'] * 2, 'pid': os.getpid()})\n"
                "res = exe.run([{'number': 1}, {'number': 2}])\nexe.close()\n"
                "print([r['score'] for r in res], all(r['pid'] != os.getpid() for r in res))\n")
        done = subprocess.run([sys.executable, "-c", code, f"ray://127.0.0.1:{client}"], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == "[2, 4] True"
    finally:
        _stop_ray_head(head, short_tmp)


def _stop_ray_head(head: subprocess.Popen, folder: str) -> None:
    """Stop the head this test started and every Ray process of its session (found by its temporary folder)."""
    import shutil

    import psutil

    os.killpg(head.pid, 15)
    head.wait(timeout=120)
    ours = [p for p in psutil.process_iter(["cmdline"]) if any(folder in a for a in (p.info["cmdline"] or []))]
    for p in ours:
        p.terminate()
    _, alive = psutil.wait_procs(ours, timeout=30)
    for p in alive:
        p.kill()
    shutil.rmtree(folder, ignore_errors=True)
