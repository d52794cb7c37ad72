"""TIES-merging: trim, elect sign, disjoint merge.

The three steps are the kernels ``trim_``, ``elect_sign`` and ``disjoint_merge_`` of
:mod:`hubsoup.methods._kernels` (DARE's ``then=ties`` shares them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from hubsoup.methods import Method, param, register
from hubsoup.methods._kernels import kth_largest_abs, ties_combine_, trim_
from hubsoup.methods._select import KthLargestPass


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
    search_grid = {"scale": [round(0.1 * i, 1) for i in range(1, 16)]}  # λ = 0.1..1.5, the TIES paper's grid
    scale_param = "scale"

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
