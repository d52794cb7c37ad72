"""Karcher mean: the Fréchet mean of the models on the hypersphere, rescaled by their mean norm.

Each input's tensor θᵢ (the models' own weights) is split into a norm and a direction; the
directions' weighted Riemannian (Karcher/Fréchet) mean is found by fixed-point iteration
(Karcher, 1977): start from the normalised weighted Euclidean mean (the first direction if
that vanishes), repeatedly map every direction to the tangent space at the mean
(log map ``Ω/sin Ω · (u − cos Ω · m)``, directions within ``tol`` of it skipped), average,
and step along the geodesic (exp map), until the step is below ``tol`` or ``max_iter``
steps. The result is the mean direction times Σ αᵢ‖θᵢ‖ (αᵢ = 1/N). Inputs with norm ≤ tol
are left out of the direction (not of the norm). As mergekit's ``karcher``, with uniform
weights; norms and angles in float64. With ``compute_dtype`` (set from a mergekit config's ``dtype``)
the directions and every step on them are computed in that dtype and the norms in float32, as mergekit
does (:func:`karcher_mean_in_dtype`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from hubsoup.methods import Method, param, register
from hubsoup.methods._sparsify import ComputeDtype, compute_dtype, compute_dtype_param

if TYPE_CHECKING:
    from hubsoup.methods import TensorContext


def karcher_mean(tensors: list[torch.Tensor], alphas: list[float], max_iter: int = 10,
                 tol: float = 1e-5) -> torch.Tensor:
    """Weighted Karcher mean of ``tensors``' directions, scaled by Σ αᵢ‖tᵢ‖ (computed in float64).

    Example:
        >>> karcher_mean([torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])], [0.5, 0.5])
        tensor([0.7071, 0.7071])
    """
    if len(tensors) == 1:
        return tensors[0].clone()
    x = [t.double().flatten() for t in tensors]
    norms = [float(torch.linalg.vector_norm(v)) for v in x]
    valid = [i for i, nrm in enumerate(norms) if nrm > tol]
    if not valid:
        return torch.zeros_like(tensors[0])
    total = sum(alphas[i] for i in valid)
    a = [alphas[i] / total for i in valid]
    units = [x[i] / norms[i] for i in valid]
    mean = cast(torch.Tensor, sum(ai * u for ai, u in zip(a, units)))  # a tensor: ``valid`` is not empty
    mn = float(torch.linalg.vector_norm(mean))
    mean = units[0].clone() if mn < tol else mean / mn
    for _ in range(max_iter):
        tangent = torch.zeros_like(mean)
        for ai, u in zip(a, units):
            dot = torch.clamp(mean @ u, -1.0, 1.0)
            omega = torch.arccos(dot)
            if float(omega) < tol:
                continue
            tangent += ai * (omega / torch.sin(omega)) * (u - dot * mean)
        tn = torch.linalg.vector_norm(tangent)
        if float(tn) < tol:
            break
        mean = torch.cos(tn) * mean + torch.sin(tn) * (tangent / tn)
        un = float(torch.linalg.vector_norm(mean))
        if un > tol:
            mean = mean / un
    scale = sum(al * nrm for al, nrm in zip(alphas, norms))
    return (scale * mean).reshape(tensors[0].shape).to(tensors[0].dtype)


def karcher_mean_in_dtype(tensors: list[torch.Tensor], alphas: list[float], max_iter: int = 10,
                          tol: float = 1e-5) -> torch.Tensor:
    """:func:`karcher_mean` as mergekit computes it on half-precision tensors, step for step.

    Norms (of the inputs, the mean, the tangent) are float32 scalars; the directions, dot products,
    angles, tangents and every geodesic step stay in the tensors' dtype, each operation rounding
    there (a float32 scalar times a half tensor gives a half tensor). Returns the tensors' dtype.

    Example:
        >>> x = [torch.tensor([1.0, 0.0, 0.5]).bfloat16(), torch.tensor([0.0, 1.0, 0.5]).bfloat16()]
        >>> karcher_mean_in_dtype(x, [0.5, 0.5])
        tensor([0.6445, 0.6445, 0.6445], dtype=torch.bfloat16)
    """
    if len(tensors) == 1:
        return tensors[0].clone()
    norms: list[torch.Tensor] = [torch.linalg.vector_norm(t.to(torch.float32)) for t in tensors]  # float32 0-d tensors, kept as such
    units = [torch.zeros_like(t) if float(nrm) == 0.0 else t / nrm for t, nrm in zip(tensors, norms)]
    valid = [i for i, nrm in enumerate(norms) if float(nrm) > tol]
    if not valid:
        return torch.zeros_like(tensors[0])
    total = sum(alphas[i] for i in valid)
    a = [alphas[i] / total for i in valid]
    units = [units[i] for i in valid]
    mean = torch.zeros_like(units[0])
    for ai, u in zip(a, units):
        mean += ai * u
    mn = torch.linalg.vector_norm(mean.to(torch.float32))
    mean = units[0].clone() if float(mn) < tol else mean / mn
    seen: dict[bytes, int] | None = {}
    k = 0
    while k < max_iter:
        # in half precision the iteration often ends in a cycle instead of converging (max_iter: 1200 is seen in
        # real configs): a step depends on the mean alone, so once a mean repeats, the rest of the cycle decides
        # the final one, and steps are skipped by whole cycles
        if seen is not None:
            key = hashlib.blake2b(mean.contiguous().view(torch.int16).cpu().numpy(),  # type: ignore[arg-type]  # numpy stubs: __buffer__ on 3.12+ only
                                  digest_size=16).digest()
            if key in seen:
                period = k - seen[key]
                k = max_iter - (max_iter - k) % period
                seen = None
                if k >= max_iter:
                    break
            else:
                seen[key] = k
        k += 1
        tangent = torch.zeros_like(mean)
        for ai, u in zip(a, units):
            dot = torch.clamp(torch.dot(mean.flatten(), u.flatten()), -1.0, 1.0)
            omega = torch.arccos(dot)
            if float(omega) < tol:
                continue
            tangent += ai * (omega / torch.sin(omega)) * (u - dot * mean)
        tn = torch.linalg.vector_norm(tangent.to(torch.float32))
        if float(tn) < tol:
            break
        mean = torch.cos(tn) * mean + torch.sin(tn) * (tangent / tn)
        un = torch.linalg.vector_norm(mean.to(torch.float32))
        if float(un) > tol:
            mean = mean / un
    scale = sum(al * nrm for al, nrm in zip(alphas, norms))
    return scale * mean


@dataclass
class KarcherParams:
    max_iter: int = param(10, "most fixed-point iterations", range=(1, None), source="mergekit")
    tol: float = param(1e-5, "convergence tolerance (tangent norm; angles and norms below it are zero)",
                       range=(0.0, None), source="mergekit")
    compute_dtype: ComputeDtype = compute_dtype_param()


@register
class Karcher(Method[KarcherParams]):
    name = "karcher"
    summary = "Riemannian (Karcher/Fréchet) mean of the models' directions on the sphere, times their mean norm."
    paper = "Riemannian center of mass and mollifier smoothing (Karcher, 1977); as in mergekit's karcher"
    paper_url = "https://doi.org/10.1002/cpa.3160300502"
    Params = KarcherParams

    def needs_base(self, params: KarcherParams, n_inputs: int) -> bool:
        return False

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: KarcherParams,
              ctx: TensorContext) -> torch.Tensor:
        n = len(deltas)
        experts = list(deltas.add_(base))
        dtype = compute_dtype(params.compute_dtype, ctx)
        if dtype != torch.float32:
            experts = [x.to(dtype) for x in experts]  # θᵢ as stored (θ₀ + τᵢ in float32 is exact for them)
            out = karcher_mean_in_dtype(experts, [1.0 / n] * n, params.max_iter, params.tol)
            return out.to(torch.float32).sub_(base)
        return karcher_mean(experts, [1.0 / n] * n, params.max_iter, params.tol).sub_(base)
