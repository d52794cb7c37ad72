"""Exact k-th largest magnitude over a whole model, in two streaming passes.

TIES as published ranks each task vector over the *whole flattened model*. Holding
all magnitudes to sort them would cost a model's worth of memory, so we radix-select
instead: a non-negative float32's bit pattern orders like its value, so pass 1
counts the high 16 bits (32,768 bins), which pins the bin holding the k-th largest,
and pass 2 counts the low 16 bits inside that bin, which pins the exact value.
Memory: one small histogram per task.
"""

from __future__ import annotations

from typing import Any, MutableMapping, Sequence

import torch

from hubsoup.methods import StatsPass, TensorContext
from hubsoup.methods._kernels import high_half_histogram, low_half_values
from hubsoup.methods._kernels import walk_from_top as _walk_from_top

_HIGH = 1 << 15  # |x| has sign bit 0, so its int32 bits >> 16 fit in 15 bits
_LOW = 1 << 16


class KthLargestPass:
    """Two passes that store ``stats[key][i]``: the k_i-th largest |τ_i| over the model.

    ``fraction`` is the kept share (density), one for every input or one per input:
    k_i = max(1, int(fraction_i · total elements)) (0 for a zero fraction).
    A threshold of +inf means keep nothing; keeping ``|τ| >= threshold`` keeps exactly
    k_i entries when magnitudes are distinct.
    """

    def __init__(self, key: str, n_inputs: int, fraction: float | Sequence[float]):
        self.key, self.n = key, n_inputs
        self.fractions = [fraction] * n_inputs if isinstance(fraction, (int, float)) else list(fraction)

    def passes(self) -> list[StatsPass]:
        return [_HighPass(self), _LowPass(self)]


def _accumulate(hists: list[torch.Tensor | None], i: int, counts: torch.Tensor | None) -> None:
    """``hists[i] += counts``, the first counts (ours to keep) standing for the histogram."""
    if counts is not None:  # (blocks on several devices: counted where the first was)
        have = hists[i]  # (a local: mypy narrows no list item)
        hists[i] = counts if have is None else have.add_(counts.to(have.device))


class _HighPass(StatsPass):
    piecewise = True  # histograms: any split of a tensor's entries counts the same

    def __init__(self, sel: KthLargestPass):
        self.sel = sel
        # made by the first count: passes are made per tensor (and per lane), a zeroed histogram each is
        # measurable on a 1B model
        self.hist: list[torch.Tensor | None] = [None] * sel.n
        self.total = 0

    def update(self, ctx: TensorContext, base: torch.Tensor, deltas: torch.Tensor) -> None:
        self.total += base.numel()
        for i, d in enumerate(deltas):
            _accumulate(self.hist, i, high_half_histogram(d))  # on an accelerator: counted there, read once

    def fork(self) -> "_HighPass":
        return _HighPass(self.sel)

    def join(self, other: "_HighPass") -> None:
        self.total += other.total
        for i, theirs in enumerate(other.hist):
            _accumulate(self.hist, i, theirs)

    def finish(self, stats: MutableMapping[str, Any]) -> None:
        sel = self.sel
        state: list[tuple[int, int] | None] = []
        for h, fraction in zip(self.hist, sel.fractions):
            # a positive density keeps at least one entry (as mergekit's magnitude pruning does)
            k = max(1, int(fraction * self.total)) if fraction > 0 else 0
            if k <= 0:
                state.append(None)
            else:
                state.append(_walk_from_top(torch.zeros(_HIGH, dtype=torch.int64) if h is None else h,
                                            min(k, self.total)))
        stats[sel.key + ".high"] = state


class _LowPass(StatsPass):
    piecewise = True
    BUFFER = 1 << 22  # at most this many low halves held per input before they are counted (16 MB)

    def __init__(self, sel: KthLargestPass):
        self.sel = sel
        self.hist: list[torch.Tensor | None] = [None] * sel.n  # made by the first count, as _HighPass's
        # one buffer per input: thousands of small tensors kept alive among the pieces' large
        # temporaries would fragment the heap (measured: +4 GB RSS on a 1B model)
        self.held = [torch.empty(0, dtype=torch.int32) for _ in range(sel.n)]
        self.n_held = [0] * sel.n
        self.high: list[tuple[int, int] | None] | None = None

    def update(self, ctx: TensorContext, base: torch.Tensor, deltas: torch.Tensor) -> None:
        if self.high is None:
            self.high = ctx.stats[self.sel.key + ".high"]
        for i, d in enumerate(deltas):
            high = self.high[i]
            if high is not None:
                # the entries in the k-th largest's bin are few: held, then counted or ranked at once
                self._hold(i, low_half_values(d, high[0]).cpu())

    def _hold(self, i: int, values: torch.Tensor) -> None:
        held, n, m = self.held[i], self.n_held[i], values.numel()
        if n + m > self.BUFFER:  # full: count what is held (and a piece too large to hold)
            self._count(i)
            n = 0
            if m > self.BUFFER:
                _accumulate(self.hist, i, torch.bincount(values, minlength=_LOW))
                return
        if n + m > held.numel():  # grown by doubling, up to BUFFER
            grown = torch.empty(min(self.BUFFER, max(2 * held.numel(), n + m, 1 << 16)), dtype=torch.int32)
            grown[:n] = held[:n]
            self.held[i] = held = grown
        held[n:n + m] = values
        self.n_held[i] = n + m

    def fork(self) -> "_LowPass":
        return _LowPass(self.sel)

    def join(self, other: "_LowPass") -> None:
        for i in range(self.sel.n):
            self._hold(i, other.held[i][:other.n_held[i]])
            _accumulate(self.hist, i, other.hist[i])

    def _count(self, i: int) -> None:
        if self.n_held[i]:
            _accumulate(self.hist, i, torch.bincount(self.held[i][:self.n_held[i]], minlength=_LOW))
            self.n_held[i] = 0

    def _low(self, i: int, rank: int) -> int:
        """The low 16 bits of the rank-th largest entry of the bin."""
        n = self.n_held[i]
        if self.hist[i] is None and 0 < rank <= n:  # all of the bin held (one tensor's): rank it, no histogram
            return int(torch.kthvalue(self.held[i][:n], n - rank + 1).values)
        self._count(i)
        h = self.hist[i]
        return _walk_from_top(torch.zeros(_LOW, dtype=torch.int64) if h is None else h, rank)[0]

    def finish(self, stats: MutableMapping[str, Any]) -> None:
        high = stats.pop(self.sel.key + ".high")
        out = []
        for i in range(self.sel.n):
            if high[i] is None:
                out.append(float("inf"))
                continue
            bin_hi, rank = high[i]
            bits = torch.tensor([(bin_hi << 16) | self._low(i, rank)], dtype=torch.int32)
            out.append(float(bits.view(torch.float32)[0]))
        stats[self.sel.key] = out
