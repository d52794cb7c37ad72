"""Who runs a search's trials: this process (:class:`LocalExecutor`) or a Ray cluster (:class:`RayExecutor`).

An executor takes a generation's trial payloads and returns their results in the payloads' order,
calling ``on_result`` as each arrives (in whatever order they finish); the driver alone talks to the
study's storage and tells each result as it arrives. A trial is :func:`hubsoup.workflows.trial.run_trial`
everywhere, so where it ran never changes its result; each process running trials keeps its
:class:`~hubsoup.workflows.trial.TrialSession` (inputs in memory, one model, the evaluator) between them: this
process for the executor's life, each Ray worker process for its own.

Ray (``pip install hubsoup[ray]``): ``executor="ray"`` joins the cluster ``RAY_ADDRESS`` names, or starts
a local one; ``"ray://HOST:PORT"`` joins that one. Each trial is one task requesting the config's
``resources`` (``cpus``, ``gpus``, ``memory``); a task whose node dies is retried elsewhere by Ray
(``max_retries``), and as the driver tells each trial once, a retried trial is still one trial.
Inputs are pinned to commit SHAs on the driver, so every node merges the same models; each node
downloads them once into its own Hub cache.

Example:
    >>> exe = make_executor("ray://head:10001", cfg)                         # doctest: +SKIP
    >>> exe.run(payloads, on_result=print); exe.close()                      # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import math
import os
import re
import shutil
import socket
import tempfile
import time
from typing import Any, Callable, Protocol, Sequence, cast

import torch

from hubsoup.engine import shared
from hubsoup.engine.shared import shared_statistics
from hubsoup.errors import ParameterError
from hubsoup.sources.access import current, hub_only
from hubsoup.untrusted import short
from hubsoup.workflows.trial import TrialSessions, run_trial


class Executor(Protocol):
    """What the workflows ask of an executor (:class:`LocalExecutor`, :class:`RayExecutor`, or an object of the
    caller's with the same two methods)."""

    def run(self, payloads: Sequence[dict[str, Any]], *, on_result: Callable[[dict[str, Any]], None] | None = None,
            monitor: Any = None) -> list[dict[str, Any]]:
        """Each payload's trial; the results in the payloads' order, ``on_result`` called as each arrives."""

    def close(self) -> None:
        """Free what the trials kept (sessions, a cluster connection)."""


class LocalExecutor:
    """Trials one after another in this process, inside one shared-statistics block (candidates whose
    preparation is the same share it) with the inputs' files staying in the page cache between trials."""

    name = "local"

    def __init__(self, scratch: str | None = None):
        self._scratch = tempfile.mkdtemp(prefix=".hubsoup-evolve-", dir=scratch)
        self._block = shared_statistics(scratch=self._scratch)
        self._block.__enter__()
        self._sessions = TrialSessions()  # inputs, candidate model and evaluator kept from one trial to the next

    def run(self, payloads: Sequence[dict[str, Any]], *, on_result: Callable[[dict[str, Any]], None] | None = None,
            monitor: Any = None) -> list[dict[str, Any]]:
        out = []
        threads = torch.get_num_threads()
        try:
            for p in payloads:
                if monitor is not None:
                    monitor.check("between trials (the study is saved; run again to resume)")
                t0 = time.perf_counter()
                r = run_trial({**p, "scratch": self._scratch,
                               "cancel": monitor.cancelled if monitor is not None and monitor.active else None},
                              self._sessions)
                r["wall"] = round(time.perf_counter() - t0, 4)
                out.append(r)
                if on_result is not None:
                    on_result(r)
        finally:
            torch.set_num_threads(threads)  # a trial runs with the config's threads; the caller gets its own back
        return out

    def close(self) -> None:
        self._sessions.close()
        try:
            self._block.__exit__(None, None, None)
        finally:
            shutil.rmtree(self._scratch, ignore_errors=True)


def _ray_trial(payload: dict[str, Any]) -> dict[str, Any]:
    _worker_shared_statistics()
    return run_trial(payload, _WORKER_SESSIONS)


_WORKER_SESSIONS = TrialSessions()
"""A Ray worker process' session (inputs, candidate model, evaluator), kept between the trials it runs: Ray runs a
search's tasks in a pool of worker processes, each one session (one model) for its life."""


def _worker_shared_statistics() -> None:
    """A Ray worker process keeps one shared-statistics block for its life, as the local executor does for the
    study: consecutive trials on it whose preparation is the same share it (finished when the process exits)."""
    if shared.current() is None:
        scratch = tempfile.mkdtemp(prefix=".hubsoup-worker-")
        block = shared.SharedStatistics(scratch=scratch)
        shared._CURRENT.set(block)

        def close() -> None:
            block.close()
            shutil.rmtree(scratch, ignore_errors=True)

        atexit.register(close)


def ray_reason(e: BaseException) -> str:
    """One line for why Ray refused: its message's first line, and where that only introduces what follows (Ray
    Client's "Initialization failure from server:" over the server's traceback), the last line too: the reason.

    Example:
        >>> ray_reason(ConnectionAbortedError("Initialization failure from server:\\nTraceback (most recent call "
        ...            "last):\\n  File ...\\nRuntimeError: Proxy failed to Connect to backend!"))
        'Initialization failure from server: RuntimeError: Proxy failed to Connect to backend!'
    """
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    return f"{lines[0]} {lines[-1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


class RayExecutor:
    """Each trial a Ray task with the config's resource requests; results collected as they finish."""

    name = "ray"

    def __init__(self, address: str | None = None, *, cpus: int = 1, gpus: float = 0, memory: int | None = None,
                 max_retries: int = 3, init: dict[str, Any] | None = None,
                 trial: Callable[[dict[str, Any]], dict[str, Any]] | None = None):
        try:
            import ray  # lazy: optional extra (ray)
        except ImportError:
            raise ParameterError("the Ray executor needs Ray: pip install 'hubsoup[ray]'") from None
        self.ray = ray
        self._owns = False
        if not ray.is_initialized():
            where = "the executor" if address else "RAY_ADDRESS"
            address = address or os.environ.get("RAY_ADDRESS") or None
            if address is not None:
                check_ray_address(address, where)
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                      "configure_logging": False, **(init or {})}
            if address is None:
                kwargs.setdefault("num_cpus", max(cpus, 1))
            try:
                ray.init(address=address, **kwargs)
            except Exception as e:  # noqa: BLE001 - Ray raises many kinds (ConnectionError, ValueError, RuntimeError)
                raise ParameterError(f"cannot join the Ray cluster at {short(address) if address else '(a new local one)'}"
                                     f": {ray_reason(e)[:300]}") from None
            self._owns = True
        opts: dict[str, Any] = {"num_cpus": cpus, "num_gpus": gpus, "max_retries": max_retries}
        if memory:
            opts["memory"] = int(memory)
        # `trial`: what a task runs (default run_trial; a wrapper that, e.g., logs where each attempt ran)
        self._task = ray.remote(trial or _ray_trial).options(**opts)

    def run(self, payloads: Sequence[dict[str, Any]], *, on_result: Callable[[dict[str, Any]], None] | None = None,
            monitor: Any = None) -> list[dict[str, Any]]:
        ray = self.ray
        t0 = time.perf_counter()

        strict = hub_only()  # the driver's rule travels with each task (a worker has no scope of its own)
        code = current().allow_task_code
        index = {self._task.remote({**p, "hub_only": bool(p.get("hub_only")) or strict,
                                    "allow_task_code": code}): i
                 for i, p in enumerate(payloads)}
        results: list[dict[str, Any] | None] = [None] * len(payloads)
        pending = list(index)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1, timeout=0.5)
                if monitor is not None:
                    monitor.check("between trials (the study is saved; run again to resume)")
                for ref in ready:
                    i = index[ref]
                    try:
                        r = ray.get(ref)
                    except ray.exceptions.RayError as e:  # retries exhausted (a node lost each time), or killed
                        r = {"number": payloads[i].get("number"), "state": "fail", "score": None, "metrics": {},
                             "reason": f"{type(e).__name__}: {' '.join(str(e).split())[:500]}", "seconds": {}}
                    r["wall"] = round(time.perf_counter() - t0, 4)
                    results[i] = r
                    if on_result is not None:
                        on_result(r)
        except BaseException:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
        return results  # type: ignore[return-value]

    def close(self) -> None:
        if self._owns:
            self.ray.shutdown()


RAY_CONNECT_TIMEOUT_ENV = "HUBSOUP_RAY_CONNECT_TIMEOUT"
"""Seconds to wait for a Ray cluster's address to answer before giving up (default 10)."""
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.\-]*[A-Za-z0-9])?):(\d{1,5})$")


def _connect_timeout() -> float:
    try:
        t = float(os.environ.get(RAY_CONNECT_TIMEOUT_ENV, "") or 10.0)
    except ValueError:
        return 10.0
    return t if math.isfinite(t) and t > 0 else 10.0


def check_ray_address(address: str, where: str = "the executor") -> None:
    """Refuse, in one line and within :data:`RAY_CONNECT_TIMEOUT_ENV` seconds, a Ray address that cannot be
    joined: not ``auto``, ``local``, ``HOST:PORT`` or ``ray://HOST:PORT``; ``ray://`` without Ray's client
    (``ray[client]``, in ``hubsoup[ray]``); a host that does not answer at that port. (Ray itself retries an
    unreachable address for minutes and answers a malformed one with a traceback.)

    >>> check_ray_address("head node:6379", "RAY_ADDRESS")
    Traceback (most recent call last):
    ...
    hubsoup.errors.ParameterError: RAY_ADDRESS 'head node:6379' is not a Ray address: give HOST:PORT (a cluster's GCS, e.g. head:6379), ray://HOST:PORT (its client server, e.g. ray://head:10001) or auto
    """
    if address in ("auto", "local"):
        return
    client = address.startswith("ray://")
    m = _HOST_PORT.match(address[len("ray://"):] if client else address)
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise ParameterError(f"{where} {short(address)} is not a Ray address: give HOST:PORT (a cluster's GCS, e.g. "
                             "head:6379), ray://HOST:PORT (its client server, e.g. ray://head:10001) or auto")
    if client:
        try:
            # lazy: optional extra (ray[client]: Ray's client needs grpcio)
            import grpc  # noqa: F401
        except ImportError:
            raise ParameterError(f"{where} {short(address)} needs Ray's client, which is not installed: "
                                 "pip install 'hubsoup[ray]' (it brings ray[client])") from None
    host, port, timeout = m.group(1).strip("[]"), int(m.group(2)), _connect_timeout()
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        reason = f"no answer within {timeout:g} s" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__)
        raise ParameterError(f"cannot reach the Ray cluster at {short(address)} ({where}): {reason}") from None
    with sock:
        if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
            return  # a TLS cluster: Ray's own connect decides
        if not _speaks_http2(sock):
            raise ParameterError(f"the server at {short(address)} ({where}) is not a Ray cluster (no gRPC answer "
                                 f"within {timeout:g} s)")


def _speaks_http2(sock: socket.socket) -> bool:
    """Whether the server on ``sock`` answers an HTTP/2 client preface with its SETTINGS frame (type 4), as every
    HTTP/2 server does at once: Ray's GCS and client servers speak gRPC, i.e. HTTP/2."""
    try:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        head = b""
        while len(head) < 9:
            got = sock.recv(9 - len(head))
            if not got:
                return False
            head += got
    except OSError:  # silence (the timeout) or a reset
        return False
    return head[3] == 4


def check_executor(spec: Any) -> Any:
    """``spec`` if it names an executor (``None``/``"local"``, ``"ray"``, ``"ray://HOST:PORT"``, an object with
    ``run``/``close``); else a :class:`ParameterError` naming it, before any work.

    >>> check_executor("ray://head:10001"), check_executor(None)
    ('ray://head:10001', None)
    """
    if spec is None or (not isinstance(spec, str) and callable(getattr(spec, "run", None))):
        return spec
    if isinstance(spec, str) and (spec in ("local", "ray") or spec.startswith("ray://")):
        return spec
    raise ParameterError(f"executor must be 'local', 'ray' or 'ray://HOST:PORT', got {short(spec)}")


def is_local(spec: Any) -> bool:
    """Whether ``spec`` runs candidates in this process the workflow's own way (``None`` or ``"local"``)."""
    return spec is None or spec == "local"


def make_executor(spec: Any, cfg: Any = None, *, resources: dict[str, Any] | None = None) -> Executor:
    """``"local"``, ``"ray"``, ``"ray://HOST:PORT"`` (or an executor object, returned as it is).

    ``resources`` (or ``cfg.resources``): per candidate, ``cpus`` (default 1), ``gpus`` (default 0) and
    ``memory`` (bytes) that each Ray task requests.
    """
    check_executor(spec)
    if spec is None or spec == "local":  # None: the default (is_local), not an executor object
        return LocalExecutor()
    if not isinstance(spec, str):
        return cast(Executor, spec)  # an object with run() (check_executor)
    res = resources if resources is not None else (getattr(cfg, "resources", {}) or {})
    return RayExecutor(None if spec == "ray" else spec, cpus=int(res.get("cpus") or 1),
                       gpus=float(res.get("gpus") or 0), memory=res.get("memory"))


__all__ = ["LocalExecutor", "RayExecutor", "make_executor", "check_executor", "is_local"]
