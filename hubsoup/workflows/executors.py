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
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Sequence

import torch

from hubsoup.engine import shared
from hubsoup.engine.shared import shared_statistics
from hubsoup.errors import ParameterError
from hubsoup.sources.access import hub_only
from hubsoup.workflows.trial import TrialSessions, run_trial


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
        block = shared.SharedStatistics(scratch=tempfile.mkdtemp(prefix=".hubsoup-worker-"))
        shared._CURRENT.set(block)

        def close() -> None:
            block.close()
            shutil.rmtree(block.scratch, ignore_errors=True)

        atexit.register(close)


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
            address = address or os.environ.get("RAY_ADDRESS") or None
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                      "configure_logging": False, **(init or {})}
            if address is None:
                kwargs.setdefault("num_cpus", max(cpus, 1))
            ray.init(address=address, **kwargs)
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
        index = {self._task.remote({**p, "hub_only": bool(p.get("hub_only")) or strict}): i
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
    raise ParameterError(f"executor must be 'local', 'ray' or 'ray://HOST:PORT', got {spec!r}")


def is_local(spec: Any) -> bool:
    """Whether ``spec`` runs candidates in this process the workflow's own way (``None`` or ``"local"``)."""
    return spec is None or spec == "local"


def make_executor(spec: Any, cfg: Any = None, *, resources: dict[str, Any] | None = None):
    """``"local"``, ``"ray"``, ``"ray://HOST:PORT"`` (or an executor object, returned as it is).

    ``resources`` (or ``cfg.resources``): per candidate, ``cpus`` (default 1), ``gpus`` (default 0) and
    ``memory`` (bytes) that each Ray task requests.
    """
    check_executor(spec)
    if not isinstance(spec, str):
        return spec
    if spec == "local":
        return LocalExecutor()
    res = resources if resources is not None else (getattr(cfg, "resources", {}) or {})
    return RayExecutor(None if spec == "ray" else spec, cpus=int(res.get("cpus") or 1),
                       gpus=float(res.get("gpus") or 0), memory=res.get("memory"))


__all__ = ["LocalExecutor", "RayExecutor", "make_executor", "check_executor", "is_local"]
