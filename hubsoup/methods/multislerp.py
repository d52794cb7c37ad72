"""Multi-SLERP: barycentric interpolation of several task vectors (or models) on the hypersphere.

mergekit's ``multislerp`` (C. Goddard): the flattened vectors vᵢ (task vectors with
``use_base``, the models' weights without) are projected to the unit sphere
(uᵢ = vᵢ / (‖vᵢ‖ + eps)); their weighted mean m (weights normalised to sum 1 with
``normalize_weights``) is normalised; the uᵢ are projected onto the tangent space at m,
averaged with the weights into g, mapped back with the exponential map
``m cos‖g‖ + g sin‖g‖/‖g‖`` (‖g‖ + eps), and scaled by the weighted mean of the norms ‖vᵢ‖.
One input is returned as is. When ‖m‖ < eps (antipodal inputs balancing out) two inputs fall
back to their weighted sum and more are an error. With ``compute_dtype`` (set from a mergekit config's
``dtype``) every step is computed in that dtype, as mergekit does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hubsoup.errors import MethodError
from hubsoup.methods import Method, param, register
from hubsoup.methods._sparsify import ComputeDtype, compute_dtype, compute_dtype_param

if TYPE_CHECKING:
    from hubsoup.methods import TensorContext


@dataclass
class MultiSlerpParams:
    weights: tuple[float, ...] | None = param(None, "one weight per input (default equal)", per_input=True,
                                              source="mergekit")
    normalize_weights: bool = param(True, "divide the weights by their sum", source="mergekit")
    eps: float = param(1e-8, "numerical floor of the norms", range=(0.0, None), source="mergekit")
    use_base: bool = param(True, "interpolate the task vectors around the base (mergekit with base_model) or "
                                 "the models' own weights (without)", source="mergekit")
    compute_dtype: ComputeDtype = compute_dtype_param()


@register
class MultiSlerp(Method[MultiSlerpParams]):
    name = "multislerp"
    summary = "Weighted barycentre of several task vectors (or models) on the hypersphere, via the tangent space."
    paper = "Multi-SLERP (C. Goddard, 2025), as implemented in mergekit"
    paper_url = "https://goddard.blog/posts/multislerp-wow-what-a-cool-idea"
    Params = MultiSlerpParams

    def needs_base(self, params: MultiSlerpParams, n_inputs: int) -> bool:
        return params.use_base

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: MultiSlerpParams,
              ctx: TensorContext) -> torch.Tensor:
        weights = list(params.weights or [1.0] * len(deltas))
        dtype = compute_dtype(params.compute_dtype, ctx)
        if dtype != torch.float32:  # mergekit's arithmetic in its config's dtype: θᵢ, τᵢ and θ₀ + result rounded
            base_h = base.to(dtype)
            v = torch.stack([(base + d).to(dtype) for d in deltas])  # θᵢ as stored (θ₀ + τᵢ exact for them)
            if len(v) == 1:  # the one model as it is (θ₀ + (θ₁ − θ₀) would round twice)
                return v[0].to(torch.float32).sub_(base)
            if params.use_base:
                v -= base_h
            out = multislerp(v, weights, params.normalize_weights, params.eps, ctx.name)
            return (base_h + out if params.use_base else out).to(torch.float32).sub_(base)
        v = deltas if params.use_base else deltas.add_(base)
        out = multislerp(v, weights, params.normalize_weights, params.eps, ctx.name)
        return out if params.use_base else out.sub_(base)


def multislerp(v: torch.Tensor, weights: list[float], normalize_weights: bool = True, eps: float = 1e-8,
               name: str = "") -> torch.Tensor:
    """The barycentre of the ``(N, *shape)`` stack ``v`` (see the module), computed in ``v``'s dtype.

    Example:
        >>> multislerp(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), [1.0, 1.0])
        tensor([0.7071, 0.7071])
    """
    n, shape = len(v), v.shape[1:]
    if n == 1:
        return v[0].clone()
    flat = v.reshape(n, -1)
    w = torch.tensor(weights, dtype=flat.dtype, device=flat.device)
    if normalize_weights:
        w = w / w.sum()
    norms: torch.Tensor = torch.linalg.vector_norm(flat, dim=-1, keepdim=True)
    units = flat / (norms + eps)
    mean = (units * w.view(-1, 1)).sum(0)
    mean_norm: torch.Tensor = torch.linalg.vector_norm(mean)
    if mean_norm < eps:
        if n == 2:
            return (flat[0] * w[0] + flat[1] * w[1]).reshape(shape)
        raise MethodError(f"multislerp: tensor '{name}': the weighted inputs cancel out (antipodal "
                          "vectors with balancing weights); use other weights")
    mean = mean / mean_norm
    tangent = units - (units * mean).sum(-1, keepdim=True) * mean
    g = (tangent * w.view(-1, 1)).sum(0)
    gn: torch.Tensor = torch.linalg.vector_norm(g) + eps
    out = (mean * torch.cos(gn) + g * (torch.sin(gn) / gn)) * (norms.squeeze(-1) * w).sum()
    return out.reshape(shape)
