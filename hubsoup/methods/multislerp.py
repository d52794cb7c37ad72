"""Multi-SLERP: barycentric interpolation of several task vectors (or models) on the hypersphere.

mergekit's ``multislerp`` (C. Goddard): the flattened vectors vᵢ (task vectors with
``use_base``, the models' weights without) are projected to the unit sphere
(uᵢ = vᵢ / (‖vᵢ‖ + eps)); their weighted mean m (weights normalised to sum 1 with
``normalize_weights``) is normalised; the uᵢ are projected onto the tangent space at m,
averaged with the weights into g, mapped back with the exponential map
``m cos‖g‖ + g sin‖g‖/‖g‖`` (‖g‖ + eps), and scaled by the weighted mean of the norms ‖vᵢ‖.
One input is returned as is. When ‖m‖ < eps (antipodal inputs balancing out) two inputs fall
back to their weighted sum and more are an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hubsoup.errors import MethodError
from hubsoup.methods import Method, param, register


@dataclass
class MultiSlerpParams:
    weights: tuple[float, ...] | None = param(None, "one weight per input (default equal)", per_input=True,
                                              source="mergekit")
    normalize_weights: bool = param(True, "divide the weights by their sum", source="mergekit")
    eps: float = param(1e-8, "numerical floor of the norms", range=(0.0, None), source="mergekit")
    use_base: bool = param(True, "interpolate the task vectors around the base (mergekit with base_model) or "
                                 "the models' own weights (without)", source="mergekit")


@register
class MultiSlerp(Method):
    name = "multislerp"
    summary = "Weighted barycentre of several task vectors (or models) on the hypersphere, via the tangent space."
    paper = "Multi-SLERP (C. Goddard, 2025), as implemented in mergekit"
    paper_url = "https://goddard.blog/posts/multislerp-wow-what-a-cool-idea"
    Params = MultiSlerpParams

    def needs_base(self, params, n_inputs):
        return params.use_base

    def merge(self, base, deltas, params, ctx):
        n, shape = len(deltas), deltas.shape[1:]
        v = deltas if params.use_base else deltas.add_(base)
        if n == 1:
            out = v[0].clone()
            return out if params.use_base else out.sub_(base)
        flat = v.reshape(n, -1)
        w = torch.tensor(list(params.weights or [1.0] * n), dtype=flat.dtype, device=flat.device)
        if params.normalize_weights:
            w = w / w.sum()
        eps = params.eps
        norms = torch.linalg.vector_norm(flat, dim=-1, keepdim=True)
        units = flat / (norms + eps)
        mean = (units * w.view(-1, 1)).sum(0)
        mean_norm = torch.linalg.vector_norm(mean)
        if mean_norm < eps:
            if n == 2:
                out = (flat[0] * w[0] + flat[1] * w[1]).reshape(shape)
                return out if params.use_base else out.sub_(base)
            raise MethodError(f"multislerp: tensor '{ctx.name}': the weighted inputs cancel out (antipodal "
                              "vectors with balancing weights); use other weights")
        mean = mean / mean_norm
        tangent = units - (units * mean).sum(-1, keepdim=True) * mean
        g = (tangent * w.view(-1, 1)).sum(0)
        gn = torch.linalg.vector_norm(g) + eps
        out = (mean * torch.cos(gn) + g * (torch.sin(gn) / gn)) * (norms.squeeze(-1) * w).sum()
        out = out.reshape(shape)
        return out if params.use_base else out.sub_(base)
