"""A tensor's pieces swept by several threads at once ("lanes"), one intra-op thread each.

A piece is a few MB (:data:`hubsoup.engine.lowrank.PIECE_BYTES`): too small for torch's own
intra-op threads to pay off (each op forks and joins a team; ``bincount`` and boolean indexing
run on one core anyway). Sweeping the pieces in lanes instead — each lane takes the next piece
not yet taken, with torch set to one thread — keeps every core busy: on a 1B-parameter model and 2 cores,
TIES 24.1 → 19.9 s and task arithmetic 8.1 → 5.9 s (``benchmarks/bench_merge.py --profile 1b``).

Each piece sees the same operations as in one lane, so results are the same bit for bit; a
statistics pass is split with :meth:`~hubsoup.methods.StatsPass.fork` (one accumulator per
lane) and put together with :meth:`~hubsoup.methods.StatsPass.join` (counts: any order adds up
the same).
"""

from __future__ import annotations

import threading
from concurrent.futures import wait
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

import torch

from hubsoup.linalg import one_thread_pool
from hubsoup.methods import StatsPass, TensorContext

if TYPE_CHECKING:
    from hubsoup.engine import PieceSweep

T = TypeVar("T")


def count(allowed: int | None = None, n_pieces: int | None = None) -> int:
    """How many lanes: ``allowed``, or torch's intra-op threads when None; at most one per piece."""
    want = torch.get_num_threads() if allowed is None else allowed
    return max(1, want if n_pieces is None else min(want, n_pieces))


class Shared:
    """A sweep's pieces (their start offsets), each handed to whichever lane asks first: lanes finish
    together whatever their pieces cost (a page fault, the writer, another process)."""

    def __init__(self, starts: Sequence[int]):
        self.starts = starts
        self._taken = 0
        self._lock = threading.Lock()  # a piece goes to one lane, with or without a GIL

    def __iter__(self) -> "Shared":
        return self

    def __next__(self) -> int:
        with self._lock:
            i, self._taken = self._taken, self._taken + 1
        if i >= len(self.starts):
            raise StopIteration
        return self.starts[i]

    def stop(self) -> None:
        """Hand out no more pieces: every lane ends with the piece it has (an interrupted sweep)."""
        with self._lock:
            self._taken = len(self.starts)


def forked(p: StatsPass, n: int) -> list[StatsPass]:
    """``[p, p.fork(), ...]``: one accumulator per lane, or ``[p]`` if ``p`` is fed from one thread only."""
    out = [p]
    for _ in range(n - 1):
        f = p.fork()
        if f is None:
            return [p]
        out.append(f)
    return out


def feed(forks: list[StatsPass], ctx: TensorContext, sweep: "PieceSweep") -> None:
    """Every piece of ``sweep`` to a statistics pass: lane j's pieces to ``forks[j]`` (one lane per fork)."""
    n = max(1, min(len(forks), len(sweep.starts)))  # the forks were made for the lanes wanted
    queue = Shared(sweep.starts) if n > 1 else None

    def lane(j: int) -> None:
        for start, _, b, stack in sweep(only=queue):
            forks[j].update(replace(ctx, offset=start), b, stack)

    run(lane, n, stop=queue.stop if queue is not None else None)


def run(fn: Callable[[int], T], n: int, stop: Callable[[], None] | None = None) -> list[T]:
    """``[fn(0), ..., fn(n - 1)]``, each call in a lane thread of its own (torch at one intra-op thread
    there); this thread waits. The first exception is raised once every lane has stopped.

    Interrupted while it waits (Ctrl-C, SIGTERM: raised in this thread), lanes not yet started are
    cancelled, ``stop()`` (e.g. :meth:`Shared.stop`) ends the others after their current piece, and the
    interrupt is raised once none runs: nothing of the sweep writes after the caller cleans up."""
    if n <= 1:
        return [fn(0)]
    # the calling thread keeps its own torch threads: merges running side by side in an app's threads
    # never see each other's settings
    futures: list[Future[T]] = []
    try:
        pool = one_thread_pool(n, "hubsoup-lane")
        for j in range(n):
            futures.append(pool.submit(fn, j))
        wait(futures)
    except BaseException:
        for f in futures:
            f.cancel()
        if stop is not None:
            stop()
        wait(futures)  # a piece is a few MB: the lanes end at once
        raise
    return [f.result() for f in futures]
