"""NuSLERP: spherical interpolation of two task vectors (or models), whole-tensor, per row or per column.

mergekit's ``nuslerp``: with weights w₁, w₂ the position is ``t = w₂ / (w₁ + w₂)`` (0.5 when
|w₁ + w₂| < 1e-6). With ``use_base`` (a base model is given) it interpolates the task
vectors τ₁, τ₂ and adds the result to the base; without, the models' weights θ₁, θ₂.
``nuslerp_flatten`` (default) treats the tensor as one vector; otherwise each row (last
dimension) is interpolated on its own, or each column with ``nuslerp_row_wise`` (mergekit's
name: the vectors run along dim 0). Vectors are normalised with their norms clamped at 1e-7;
where 1 − cos² ≤ 1e-16 (colinear) it falls back to linear interpolation. The unnormalised
endpoints are combined: ``(sin((1−t)Ω)·a + sin(tΩ)·b) / sin Ω``. With ``compute_dtype`` (set from a
mergekit config's ``dtype``) every step is computed in that dtype, as mergekit does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hubsoup.errors import ParameterError
from hubsoup.methods import Method, param, register
from hubsoup.methods._sparsify import ComputeDtype, compute_dtype, compute_dtype_param

if TYPE_CHECKING:
    from hubsoup.methods import TensorContext


def nuslerp(t: float, a: torch.Tensor, b: torch.Tensor, *, flatten: bool = True, row_wise: bool = False,
            eps: float = 1e-8) -> torch.Tensor:
    """SLERP of ``a`` and ``b`` over whole tensors (``flatten``), rows, or columns (``row_wise``), in their dtype.

    Example:
        >>> nuslerp(0.5, torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))
        tensor([0.7071, 0.7071])
    """
    shape = a.shape
    if flatten:
        a, b = a.reshape(-1), b.reshape(-1)
    elif row_wise:
        a, b = a.transpose(0, -1), b.transpose(0, -1)
    au = a / torch.linalg.vector_norm(a, dim=-1, keepdim=True).clamp(min=1e-7)
    bu = b / torch.linalg.vector_norm(b, dim=-1, keepdim=True).clamp(min=1e-7)
    cos = (au * bu).sum(dim=-1, keepdim=True).clamp(-1, 1)
    colinear = (1 - cos.square()) <= eps ** 2
    omega = torch.acos(torch.where(colinear, torch.zeros_like(cos), cos))
    out = (torch.sin((1 - t) * omega) * a + torch.sin(t * omega) * b) / torch.sin(omega)
    out = torch.where(colinear, (1 - t) * a + t * b, out)
    if not flatten and row_wise:
        out = out.transpose(0, -1)
    return out.reshape(shape)


@dataclass
class NuSlerpParams:
    weights: tuple[float, ...] | None = param(None, "the two inputs' weights; t = w2/(w1+w2) (default equal)",
                                              per_input=True, source="mergekit")
    nuslerp_flatten: bool = param(True, "interpolate the whole tensor as one vector", source="mergekit")
    nuslerp_row_wise: bool = param(False, "without flatten: interpolate along dim 0 (columns) instead of rows",
                                   source="mergekit")
    use_base: bool = param(True, "interpolate the task vectors around the base (mergekit with base_model) or "
                                 "the models' own weights (without)", source="mergekit")
    compute_dtype: ComputeDtype = compute_dtype_param()

    def validate(self) -> None:
        if self.weights is not None and len(self.weights) != 2:
            raise ParameterError(f"parameter 'weights': nuslerp takes 2 weights, got {len(self.weights)}")


@register
class NuSlerp(Method[NuSlerpParams]):
    name = "nuslerp"
    summary = "SLERP of two task vectors (or models) by weight, over whole tensors, rows or columns (mergekit)."
    paper = "mergekit's NuSLERP (Goddard et al., Arcee's MergeKit, 2024)"
    paper_url = "https://arxiv.org/abs/2403.13257"
    Params = NuSlerpParams
    min_inputs = max_inputs = 2

    def needs_base(self, params: NuSlerpParams, n_inputs: int) -> bool:
        return params.use_base

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: NuSlerpParams,
              ctx: TensorContext) -> torch.Tensor:
        w = params.weights or (1.0, 1.0)
        total = w[0] + w[1]
        t = 0.5 if abs(total) < 1e-6 else w[1] / total
        kw = dict(flatten=params.nuslerp_flatten, row_wise=params.nuslerp_row_wise)
        dtype = compute_dtype(params.compute_dtype, ctx)
        if dtype != torch.float32:
            return nuslerp_in_dtype(t, base, deltas, dtype, use_base=params.use_base, **kw)
        if params.use_base:
            return nuslerp(t, deltas[0], deltas[1], **kw)
        return nuslerp(t, base + deltas[0], base + deltas[1], **kw) - base


def nuslerp_in_dtype(t: float, base: torch.Tensor, deltas: torch.Tensor, dtype: torch.dtype, *, use_base: bool,
                     flatten: bool, row_wise: bool) -> torch.Tensor:
    """NuSLERP computed in ``dtype`` step for step, as mergekit computes it in its config's dtype: the models
    θᵢ cast to ``dtype``, τᵢ = θᵢ − θ₀ and θ₀ + the interpolation rounded there too (with ``use_base``).
    Returns the merged task vector in float32 (the low-precision result minus ``base``).

    Example:
        >>> base, deltas = torch.zeros(3), torch.tensor([[1.0, 0.001, 0.0], [0.0, 1.0, 0.3]])
        >>> nuslerp_in_dtype(0.5, base, deltas, torch.bfloat16, use_base=True, flatten=True, row_wise=False)
        tensor([0.7070, 0.7070, 0.2129])
    """
    a, b = ((base + d).to(dtype) for d in deltas)  # θᵢ as stored (θ₀ + τᵢ in float32 is exact for them)
    if not use_base:
        return nuslerp(t, a, b, flatten=flatten, row_wise=row_wise).to(torch.float32).sub_(base)
    base_h = base.to(dtype)
    out = base_h + nuslerp(t, a - base_h, b - base_h, flatten=flatten, row_wise=row_wise)
    return out.to(torch.float32).sub_(base)
