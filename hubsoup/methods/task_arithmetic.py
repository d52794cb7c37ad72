"""Task arithmetic: θ = θ_0 + λ Σ_i w_i τ_i.

With ``compute_dtype`` (set from a mergekit config's ``dtype``) every step is computed in that dtype as
mergekit's ``task_arithmetic`` computes it (τᵢ, the weights, wᵢ·τᵢ, the sum, the division by Σ wᵢ, λ, θ₀ +
merged, each rounded there; :func:`~hubsoup.methods._sparsify.gta_in_dtype`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import torch

from hubsoup.methods import Method, param, register
from hubsoup.methods._kernels import task_arithmetic
from hubsoup.methods._sparsify import ComputeDtype, compute_dtype, compute_dtype_param, gta_in_dtype

if TYPE_CHECKING:
    from hubsoup.methods import StatsPass, TensorContext


def default_scale(n_inputs: int) -> float:
    """Task arithmetic's λ when none is given: 1/N [ours], the mean of the task vectors.

    At 1/N the merge is θ_0 + mean τ_i, the same model as a uniform soup of the inputs. Chosen by the
    defaults guard (issue 35, benchmarks/results/defaults.md): across the encoder benchmark's four settings
    (4 and 8 tasks, full and LoRA) it is the only λ rule tried that is nowhere worse than the base on an
    in-domain task while keeping ≥ 0.8 of the tuned gain; 1/√N (λ 0.35 at 8 inputs) cost up to 7 points on
    single tasks. On the validation curves (benchmarks/results/ta_scale_rule.md) it keeps ≥ 0.81 of the
    best λ's gain everywhere. Tune ``scale`` on validation data for more (``--search``).

    >>> default_scale(4), default_scale(8)
    (0.25, 0.125)
    """
    return 1.0 / max(1, n_inputs)


@dataclass
class TaskArithmeticParams:
    scale: float | None = param(
        None, "λ, the scale of the summed task vectors; none = 1/N for N inputs [ours]: the mean task vector, the "
              "same model as a uniform soup (papers search 0.1..1.0; one fixed λ cannot serve every setting, "
              "and larger rules hurt single tasks at 8 inputs or LoRA inputs: benchmarks/results/defaults.md; "
              "search scale on validation data for more)",
        range=(None, None), source="ours")
    weights: tuple[float, ...] | None = param(None, "per-input weights inside the sum (default 1 each)",
                                              per_input=True)
    normalize: bool = param(False, "divide the weighted sum by the sum of the weights (mergekit's normalize; "
                                   "|Σw| < 1e-8 leaves it undivided)", source="mergekit")
    compute_dtype: ComputeDtype = compute_dtype_param()


@register
class TaskArithmetic(Method[TaskArithmeticParams]):
    name = "task_arithmetic"
    summary = "Add the scaled sum of task vectors to the base."
    paper = "Editing Models with Task Arithmetic (Ilharco et al., 2023)"
    paper_url = "https://arxiv.org/abs/2212.04089"
    Params = TaskArithmeticParams
    search_grid = {"scale": [round(0.1 * i, 1) for i in range(1, 11)]}  # λ = 0.1..1.0, as the papers search
    scale_param = "scale"

    @staticmethod
    def resolved_scale(params: TaskArithmeticParams, n_inputs: int) -> float:
        """λ of this merge: the given scale, else 1/N (see ``scale``)."""
        return default_scale(n_inputs) if params.scale is None else params.scale

    @staticmethod
    def _divisor(weights: Iterable[float]) -> float:
        total = float(sum(weights))
        return 1.0 if abs(total) < 1e-8 else total

    def linear_coefficients(self, params: TaskArithmeticParams, n_inputs: int) -> list[float] | None:
        if params.compute_dtype != "float32":  # every step rounds in the half dtype: not Σ cᵢ τᵢ in float32
            return None
        weights = params.weights or [1.0] * n_inputs
        d = self._divisor(weights) if params.normalize else 1.0
        return [w / d * self.resolved_scale(params, n_inputs) for w in weights]

    def tensor_passes(self, params: TaskArithmeticParams, n_inputs: int) -> list[StatsPass] | None:
        return []  # element-wise in any compute dtype

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: TaskArithmeticParams,
              ctx: TensorContext) -> torch.Tensor:
        weights = params.weights or [1.0] * len(deltas)
        dtype = compute_dtype(params.compute_dtype, ctx)
        if dtype != torch.float32:  # mergekit's task_arithmetic in its config's dtype, step for step
            return gta_in_dtype(base, deltas, dtype, lambda i, tau: None, weights, consensus=False,
                                normalize=params.normalize, scale=self.resolved_scale(params, len(deltas)),
                                rescale=False)
        out = task_arithmetic(deltas, weights, self.resolved_scale(params, len(deltas)))
        return out.div_(self._divisor(weights)) if params.normalize else out

    def card_notes(self, described: dict[str, Any], stats: dict[str, Any], n_inputs: int) -> list[str]:
        """The λ a default scale resolved to (1/N depends on the inputs: the card says which value was used)."""
        if described.get("scale") is not None:
            return []
        return [f"**λ = 1/N = {default_scale(n_inputs):.4g}** for N = {n_inputs} inputs: task arithmetic's "
                "default scale [ours], the mean task vector (the same model as a uniform soup of the inputs; "
                "the largest λ rule that was nowhere worse than the base model on hubsoup's quality benchmarks). "
                "A λ searched on validation data can recover more of the fine-tunes' gains."]
