"""Task arithmetic: θ = θ_0 + λ Σ_i w_i τ_i."""

from __future__ import annotations

from dataclasses import dataclass

from hubsoup.methods import Method, param, register
from hubsoup.methods._kernels import task_arithmetic


@dataclass
class TaskArithmeticParams:
    scale: float = param(0.3, "λ, the scale of the summed task vectors (papers search 0.1..1.0; 0.3 is "
                              "LwPTV's fixed vision setting and was best or near-best on validation in 5 of 6 "
                              "searches; 4 full encoder fine-tunes wanted 1.0, 4 LM domains 0.3: no rule in N held)",
                         range=(None, None), source="measured")
    weights: tuple[float, ...] | None = param(None, "per-input weights inside the sum (default 1 each)",
                                              per_input=True)
    normalize: bool = param(False, "divide the weighted sum by the sum of the weights (mergekit's normalize; "
                                   "|Σw| < 1e-8 leaves it undivided)", source="mergekit")


@register
class TaskArithmetic(Method):
    name = "task_arithmetic"
    summary = "Add the scaled sum of task vectors to the base."
    paper = "Editing Models with Task Arithmetic (Ilharco et al., 2023)"
    paper_url = "https://arxiv.org/abs/2212.04089"
    Params = TaskArithmeticParams
    search_grid = {"scale": [round(0.1 * i, 1) for i in range(1, 11)]}  # λ = 0.1..1.0, as the papers search
    scale_param = "scale"

    @staticmethod
    def _divisor(weights) -> float:
        total = float(sum(weights))
        return 1.0 if abs(total) < 1e-8 else total

    def linear_coefficients(self, params, n_inputs):
        weights = params.weights or [1.0] * n_inputs
        d = self._divisor(weights) if params.normalize else 1.0
        return [w / d * params.scale for w in weights]

    def merge(self, base, deltas, params, ctx):
        weights = params.weights or [1.0] * len(deltas)
        out = task_arithmetic(deltas, weights, params.scale)
        return out.div_(self._divisor(weights)) if params.normalize else out
