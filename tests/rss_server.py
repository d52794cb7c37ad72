"""Peak-RSS measurements of hubsoup calls in fresh processes: the one measuring server.

Used by ``tests/engine/test_memory_depth.py``, ``tests/test_memory_plan.py`` and
``benchmarks/bench_memory.py`` (which puts this folder on ``sys.path``). It lives with the
tests, not the benchmarks: the tests are what must run everywhere, and a test importing
from ``benchmarks/`` would make the suite depend on optional tooling.

A server, started once per :class:`RssServer`: a fresh interpreter that imports torch,
transformers, hubsoup (and peft / datasets, which some paths import lazily) and then does
nothing but fork. Every measurement is a fork of that pristine interpreter (as fresh as
``python -c`` after its imports, without paying ~3 s of imports per measurement). The
forked process optionally fixes glibc's mmap threshold (see ``test_memory_depth``'s
docstring for why), runs the warm-up call (the same path on a small model: lazy imports
and first-call caches, not measured), writes 5 to ``/proc/self/clear_refs`` (Linux: resets
the peak resident set, VmHWM, to the current one), says ``START`` with its pid, runs the
measured call and reports ``VmHWM - VmRSS-at-start``. Several specs sent together run side
by side (memory is per process). With ``sample=True`` this process also samples each
measured process's anonymous and file-backed (mmapped inputs) RSS from /proc/PID/status
every 5 ms from its START on (may miss short peaks).

A spec is ``{"measure": (kind, kwargs), "warmup": (kind, kwargs) | None,
"mmap_threshold": bytes | None}``; kinds: ``merge`` (:func:`hubsoup.merge`),
``continual_init`` / ``continual_add`` (:mod:`hubsoup.continual`).

Example::

    with RssServer() as server:
        (r,) = server.measure([{"measure": ("merge", dict(inputs=[...], method="task_arithmetic", ...))}])
        r["growth_mib"], r["measure_s"]
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time

CHILD_TIMEOUT_S = 300  # per batch of specs (they run side by side)
MMAP_THRESHOLD = 128 * 1024  # glibc's initial M_MMAP_THRESHOLD, to fix (see test_memory_depth's docstring)

_SERVER = r"""
import ctypes, json, os, re, sys, time, traceback
import torch, transformers, safetensors
import hubsoup
for name in ("peft", "datasets"):
    try:
        __import__(name)
    except ImportError:
        pass

def field(name):
    with open("/proc/self/status", encoding="ascii") as f:
        return int(re.search(name + r":\s+(\d+)", f.read()).group(1)) / 1024

def continual_module():
    from hubsoup import continual
    return continual

def run(call):
    kind, kw = call
    if kind == "merge":
        return hubsoup.merge(**kw)
    if kind == "continual_init":
        return continual_module().init(**kw)
    if kind == "continual_add":
        return continual_module().add(**kw)
    raise ValueError(kind)

def fix_mmap_threshold(nbytes):
    try:
        return bool(ctypes.CDLL(None).mallopt(-3, nbytes))  # M_MMAP_THRESHOLD; also stops glibc's adjusting it
    except (AttributeError, OSError):  # not glibc
        return False

def measure(index, spec):
    fixed = fix_mmap_threshold(spec["mmap_threshold"]) if spec.get("mmap_threshold") else False
    t0 = time.perf_counter()
    if spec.get("warmup"):
        run(spec["warmup"])  # the same path on a small model: lazy imports and first-call caches, not measured
    warm_s = time.perf_counter() - t0
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # VmHWM := VmRSS
    start = {k: field(k) for k in ("VmRSS", "RssAnon", "RssFile")}
    # one os.write of one short line (< PIPE_BUF) on the saved stdout: side-by-side children's START
    # lines never interleave (print may split a line into two writes), and nothing else reaches it
    os.write(REPORT_FD, ("START " + json.dumps({"index": index, "pid": os.getpid(), **start}) + "\n").encode())
    t1 = time.perf_counter()
    res = run(spec["measure"])
    return {"growth_mib": field("VmHWM") - start["VmRSS"], "start_rss_mib": start["VmRSS"],
            "start_anon_mib": start["RssAnon"], "start_file_mib": start["RssFile"],
            "measure_s": time.perf_counter() - t1, "warmup_s": warm_s, "path": res.path,
            "stats": sorted(res.stats), "fixed_mmap_threshold": fixed, "hubsoup": hubsoup.__file__}

while True:
    line = sys.stdin.readline()
    if not line:
        break
    jobs = []
    for index, spec in enumerate(json.loads(line)):  # side by side
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            REPORT_FD = os.dup(1)
            os.dup2(2, 1)  # whatever the measured call prints goes to stderr, never into the report lines
            try:
                payload = {"ok": measure(index, spec)}
            except BaseException:
                payload = {"error": traceback.format_exc()}
            with os.fdopen(w, "w") as f:
                f.write(json.dumps(payload))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        os.close(w)
        jobs.append((pid, r))
    out = []
    for pid, r in jobs:
        with os.fdopen(r) as f:
            out.append(json.loads(f.read() or '{"error": "the measuring process died (killed?)"}'))
        os.waitpid(pid, 0)
    print("RESULTS " + json.dumps(out), flush=True)
"""


class MeasureError(RuntimeError):
    """The server died, timed out, or a measured call failed (the message has the traceback / stderr tail)."""


class RssServer:
    """The forking server (see the module docstring); :meth:`measure` runs a batch of specs side by side.

    ``env``: extra environment for the server (on top of this process's, with the working tree's
    hubsoup first on ``PYTHONPATH`` and ``TOKENIZERS_PARALLELISM=false``, ``OMP_NUM_THREADS=1``
    unless given).
    """

    def __init__(self, env: dict[str, str] | None = None, timeout_s: float = CHILD_TIMEOUT_S):
        import hubsoup

        # the server imports this very hubsoup (the working tree, not whatever the venv has installed)
        self.src = os.path.dirname(os.path.dirname(os.path.abspath(hubsoup.__file__)))
        full = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", **(env or {})}
        full["PYTHONPATH"] = os.pathsep.join(p for p in (self.src, full.get("PYTHONPATH")) if p)
        self.timeout_s = timeout_s
        self.err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, env=full, cwd=self.src)

    def __enter__(self) -> "RssServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.err.close()

    def stderr_tail(self, n: int = 3000) -> str:
        self.err.seek(0)
        return self.err.read()[-n:]

    def measure(self, specs: list[dict], *, sample: bool = False) -> list[dict]:
        """One result per spec (in order); ``sample``: add ``anon_growth_mib`` / ``file_growth_mib``."""
        self.proc.stdin.write(json.dumps(specs) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + self.timeout_s
        stop = threading.Event()
        samplers: dict[int, tuple[threading.Thread, dict, dict]] = {}
        try:
            while True:
                ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
                line = self.proc.stdout.readline() if ready else ""
                if not line:
                    raise MeasureError(f"the measuring server died or timed out:\n{self.stderr_tail()}")
                if line.startswith("START ") and sample:
                    start = json.loads(line[6:])
                    peak = {"RssAnon": 0.0, "RssFile": 0.0}
                    th = threading.Thread(target=_sample, args=(start["pid"], peak, stop), daemon=True)
                    th.start()
                    samplers[start["index"]] = (th, start, peak)
                elif line.startswith("RESULTS "):
                    results = json.loads(line[8:])
                    break
        finally:
            stop.set()
            for th, _, _ in samplers.values():
                th.join()
        out = []
        for i, r in enumerate(results):
            if "ok" not in r:
                raise MeasureError(f"spec {i}: the measured call failed:\n{r['error'][-3000:]}")
            res = r["ok"]
            if sample:
                if i not in samplers:
                    raise MeasureError(f"spec {i}: no START line was read from its process:\n{self.stderr_tail()}")
                _, start, peak = samplers[i]
                res["anon_growth_mib"] = max(peak["RssAnon"] - start["RssAnon"], 0.0)
                res["file_growth_mib"] = max(peak["RssFile"] - start["RssFile"], 0.0)
            out.append(res)
        return out


def _sample(pid: int, peak: dict, stop: threading.Event) -> None:
    """The largest RssAnon / RssFile (MiB) of process ``pid`` until ``stop`` or its end, every 5 ms."""
    while not stop.is_set():
        try:
            with open(f"/proc/{pid}/status", encoding="ascii") as f:
                for line in f:
                    k = line.split(":", 1)[0]
                    if k in peak:
                        peak[k] = max(peak[k], int(line.split()[1]) / 1024)
        except (OSError, ValueError, IndexError):
            return
        time.sleep(0.005)
