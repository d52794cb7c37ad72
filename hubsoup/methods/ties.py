"""TIES-merging: trim, elect sign, disjoint merge."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from hubsoup.methods.base import Method, register
from hubsoup.methods.select import KthLargestPass
from hubsoup.params import param


def kth_largest_abs(x: torch.Tensor, k: int) -> float:
    """The k-th largest |x| (k ≥ 1); +inf for k = 0."""
    if k <= 0:
        return float("inf")
    flat = x.abs().flatten()
    return float(torch.kthvalue(flat, flat.numel() - min(k, flat.numel()) + 1).values)


def trim_(stacked: torch.Tensor, thresholds: Sequence[float]) -> torch.Tensor:
    """In place: row i keeps entries with |x| ≥ thresholds[i], the rest become 0."""
    for row, t in zip(stacked, thresholds):
        if t > 0:
            row.masked_fill_(row.abs() < t, 0.0)
    return stacked


def elect_sign(stacked: torch.Tensor) -> torch.Tensor:
    """Sign of the summed mass per entry; entries summing to 0 take the majority sign."""
    sign = torch.sign(stacked.sum(dim=0))
    majority = 1.0 if float(sign.sum()) >= 0 else -1.0
    return sign.masked_fill_(sign == 0, majority)


def disjoint_merge_(stacked: torch.Tensor, sign: torch.Tensor, mode: str = "mean") -> torch.Tensor:
    """Sum (or mean) over rows of the non-zero entries that agree with ``sign``. Overwrites ``stacked``."""
    # times the elected sign, agreeing entries are > 0; clamping drops the rest (and zeros)
    stacked.mul_(sign).clamp_(min=0)
    total = stacked.sum(dim=0).mul_(sign)
    if mode == "sum":
        return total
    count = (stacked > 0).sum(dim=0, dtype=torch.float32)
    return total.div_(count.clamp_(min=1))


def ties_combine_(stacked: torch.Tensor, weights: Sequence[float] | None, mode: str = "mean") -> torch.Tensor:
    """Elect signs on the (already trimmed) rows, then weight them and merge disjointly.

    Signs are elected on the unweighted rows, as peft's ``merge_utils.ties`` does
    (the TIES paper has no per-model weights). Overwrites ``stacked``.
    """
    sign = elect_sign(stacked)
    if weights is not None:
        for row, w in zip(stacked, weights):
            row.mul_(w)
    return disjoint_merge_(stacked, sign, mode)


@dataclass
class TiesParams:
    density: float = param(0.2, "kept fraction of each task vector by magnitude (k=20%)", range=(0.0, 1.0))
    scope: Literal["model", "tensor"] = param(
        "model", "rank magnitudes over the whole model per task (as in the TIES paper) or per tensor (peft, mergekit)")
    merge: Literal["mean", "sum"] = param("mean", "disjoint mean (paper) or disjoint sum (dis-sum variant)")
    scale: float = param(1.0, "λ applied to the merged task vector", range=(None, None))
    weights: tuple[float, ...] | None = param(None, "per-input weights applied after trimming and sign election (as peft)")


@register
class Ties(Method):
    name = "ties"
    summary = "Trim each task vector to its top-k magnitudes, elect signs by mass, average the agreeing entries."
    paper = "TIES-Merging: Resolving Interference When Merging Models (Yadav et al., 2023)"
    paper_url = "https://arxiv.org/abs/2306.01708"
    Params = TiesParams

    def passes(self, params, n_inputs):
        if params.scope == "model" and params.density < 1.0:
            return KthLargestPass("ties.threshold", n_inputs, params.density).passes()
        return []

    @staticmethod
    def thresholds(deltas: torch.Tensor, params, ctx) -> list[float]:
        if params.density >= 1.0:
            return [0.0] * len(deltas)
        if params.scope == "model":
            return ctx.stats["ties.threshold"]
        k = int(params.density * deltas[0].numel())
        return [kth_largest_abs(d, k) for d in deltas]

    def merge(self, base, deltas, params, ctx):
        trim_(deltas, self.thresholds(deltas, params, ctx))
        return ties_combine_(deltas, params.weights, params.merge).mul_(params.scale)
