"""Task arithmetic: θ = θ_0 + λ Σ_i w_i τ_i."""

from __future__ import annotations

from dataclasses import dataclass

from hubsoup.methods import Method, param, register
from hubsoup.methods._kernels import task_arithmetic


@dataclass
class TaskArithmeticParams:
    scale: float = param(0.3, "λ, the scale of the summed task vectors (papers search 0.1..1.0; 0.3 is "
                              "LwPTV's fixed vision setting)", range=(None, None), source="ours")
    weights: tuple[float, ...] | None = param(None, "per-input weights inside the sum (default 1 each)")


@register
class TaskArithmetic(Method):
    name = "task_arithmetic"
    summary = "Add the scaled sum of task vectors to the base."
    paper = "Editing Models with Task Arithmetic (Ilharco et al., 2023)"
    paper_url = "https://arxiv.org/abs/2212.04089"
    Params = TaskArithmeticParams
    search_grid = {"scale": [round(0.1 * i, 1) for i in range(1, 11)]}  # λ = 0.1..1.0, as the papers search
    scale_param = "scale"

    def linear_coefficients(self, params, n_inputs):
        return [w * params.scale for w in (params.weights or [1.0] * n_inputs)]

    def merge(self, base, deltas, params, ctx):
        return task_arithmetic(deltas, params.weights or [1.0] * len(deltas), params.scale)
