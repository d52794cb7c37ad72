"""Exact k-th largest magnitude over a whole model, in two streaming passes.

TIES as published ranks each task vector over the *whole flattened model*. Holding
all magnitudes to sort them would cost a model's worth of memory, so we radix-select
instead: a non-negative float32's bit pattern orders like its value, so pass 1
counts the high 16 bits (32,768 bins), which pins the bin holding the k-th largest,
and pass 2 counts the low 16 bits inside that bin, which pins the exact value.
Memory: one small histogram per task.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hubsoup.methods import StatsPass, TensorContext
from hubsoup.methods._kernels import walk_from_top as _walk_from_top

_HIGH = 1 << 15  # |x| has sign bit 0, so its int32 bits >> 16 fit in 15 bits
_LOW = 1 << 16


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().abs().float().contiguous().view(torch.int32).flatten()


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


class _HighPass(StatsPass):
    piecewise = True  # histograms: any split of a tensor's entries counts the same

    def __init__(self, sel: KthLargestPass):
        self.sel = sel
        self.hist = [torch.zeros(_HIGH, dtype=torch.int64) for _ in range(sel.n)]
        self.total = 0

    def update(self, ctx: TensorContext, base: torch.Tensor, deltas: torch.Tensor) -> None:
        self.total += base.numel()
        for i, d in enumerate(deltas):
            self.hist[i] += torch.bincount(_bits(d) >> 16, minlength=_HIGH).cpu()

    def finish(self, stats: dict) -> None:
        sel = self.sel
        state = []
        for h, fraction in zip(self.hist, sel.fractions):
            # a positive density keeps at least one entry (as mergekit's magnitude pruning does)
            k = max(1, int(fraction * self.total)) if fraction > 0 else 0
            if k <= 0:
                state.append(None)
            else:
                state.append(_walk_from_top(h, min(k, self.total)))
        stats[sel.key + ".high"] = state


class _LowPass(StatsPass):
    piecewise = True

    def __init__(self, sel: KthLargestPass):
        self.sel = sel
        self.hist = [torch.zeros(_LOW, dtype=torch.int64) for _ in range(sel.n)]
        self.high = None

    def update(self, ctx: TensorContext, base: torch.Tensor, deltas: torch.Tensor) -> None:
        if self.high is None:
            self.high = ctx.stats[self.sel.key + ".high"]
        for i, d in enumerate(deltas):
            if self.high[i] is None:
                continue
            bits = _bits(d)
            inside = bits[(bits >> 16) == self.high[i][0]]
            if inside.numel():
                self.hist[i] += torch.bincount(inside & 0xFFFF, minlength=_LOW).cpu()

    def finish(self, stats: dict) -> None:
        high = stats.pop(self.sel.key + ".high")
        out = []
        for i, h in enumerate(self.hist):
            if high[i] is None:
                out.append(float("inf"))
                continue
            bin_hi, rank = high[i]
            low, _ = _walk_from_top(h, rank)
            bits = torch.tensor([(bin_hi << 16) | low], dtype=torch.int32)
            out.append(float(bits.view(torch.float32)[0]))
        stats[self.sel.key] = out
