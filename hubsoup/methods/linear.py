"""Weighted average of models (uniform model soup when weights are equal).

``combine`` says what ``normalize: false`` sums:

* ``deltas`` (default): the task vectors, θ₀ + Σ wᵢ τᵢ (task arithmetic with the weights);
* ``models``: the models' weights themselves, Σ wᵢ θᵢ, as mergekit's ``linear`` does
  (with ``normalize: true`` both are Σ wᵢ θᵢ / Σ wᵢ). No base model is needed: without
  one, the first input is the layout reference, and a base that mergekit merges as one of
  the models is given as an input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from hubsoup.errors import ParameterError
from hubsoup.methods import Method, param, register
from hubsoup.methods._kernels import weighted_average

if TYPE_CHECKING:
    import torch

    from hubsoup.methods import TensorContext


@dataclass
class LinearParams:
    weights: tuple[float, ...] | None = param(None, "one weight per input (default: equal = uniform soup)",
                                              per_input=True)
    normalize: bool = param(True, "divide by the sum of weights (a true average)", source="ours")
    combine: Literal["deltas", "models"] = param(
        "deltas", "what normalize=false sums: the task vectors (θ₀ + Σwτ) or the models (Σwθ, mergekit)",
        source="mergekit")

    def validate(self) -> None:
        if self.weights is not None and self.normalize and sum(self.weights) == 0:
            raise ParameterError("parameter 'weights' sums to 0; cannot normalize")


@register
class Linear(Method[LinearParams]):
    name = "linear"
    summary = "Weighted average of the models; equal weights give the uniform model soup."
    paper = "Model soups: averaging weights of multiple fine-tuned models improves accuracy without increasing inference time (Wortsman et al., 2022)"
    paper_url = "https://arxiv.org/abs/2203.05482"
    Params = LinearParams

    def needs_base(self, params: LinearParams, n_inputs: int) -> bool:
        return not params.normalize and params.combine == "deltas"

    def preserves_zero(self, params: LinearParams) -> bool:
        return params.normalize or params.combine == "deltas" or sum(params.weights or ()) == 1.0

    def linear_coefficients(self, params: LinearParams, n_inputs: int) -> list[float] | None:
        if not self.preserves_zero(params):
            return None  # Σwθ − θ₀ = (Σw − 1)θ₀ + Σwτ: affine in τ
        weights = list(params.weights or [1.0] * n_inputs)
        total = sum(weights) if params.normalize else 1.0
        return [w / total for w in weights]

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: LinearParams,
              ctx: TensorContext) -> torch.Tensor:
        weights = params.weights or [1.0] * len(deltas)
        out = weighted_average(deltas, weights, params.normalize)
        if not params.normalize and params.combine == "models":
            out.add_(base, alpha=sum(weights) - 1.0)  # Σwθ − θ₀ = Σwτ + (Σw − 1)θ₀
        return out
