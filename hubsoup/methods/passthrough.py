"""Passthrough: one input's tensors, copied (optionally scaled): the building block of slices.

mergekit's ``passthrough`` copies its single input, times ``scale`` when given (hubsoup: ``weight_scale``, as ``scale`` is a task-vector λ elsewhere). Frankenmerges
(layer stacks assembled from slices of models) use it per slice; in hubsoup the layout is the
config reader's work and this method only copies: θ = weight_scale · θ₁ (the merged task vector is
``weight_scale·(θ₀ + τ₁) − θ₀``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hubsoup.methods import Method, param, register

if TYPE_CHECKING:
    import torch

    from hubsoup.methods import TensorContext


@dataclass
class PassthroughParams:
    weight_scale: float = param(1.0, "factor on the copied weights (mergekit's per-model scale)", range=(None, None),
                         source="mergekit")


@register
class Passthrough(Method[PassthroughParams]):
    name = "passthrough"
    summary = "Copy one input's weights unchanged (or scaled); the building block of slices and frankenmerges."
    paper = "mergekit's passthrough (Goddard et al., Arcee's MergeKit, 2024)"
    paper_url = "https://arxiv.org/abs/2403.13257"
    Params = PassthroughParams
    min_inputs = max_inputs = 1

    def needs_base(self, params: PassthroughParams, n_inputs: int) -> bool:
        return False

    def preserves_zero(self, params: PassthroughParams) -> bool:
        return params.weight_scale == 1.0

    def linear_coefficients(self, params: PassthroughParams, n_inputs: int) -> list[float] | None:
        return [1.0] if params.weight_scale == 1.0 else None

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: PassthroughParams,
              ctx: TensorContext) -> torch.Tensor:
        if params.weight_scale == 1.0:
            return deltas[0]
        return deltas[0].add_(base).mul_(params.weight_scale).sub_(base)
