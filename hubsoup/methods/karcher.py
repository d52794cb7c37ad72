"""Karcher mean: the Fréchet mean of the models on the hypersphere, rescaled by their mean norm.

Each input's tensor θᵢ (the models' own weights) is split into a norm and a direction; the
directions' weighted Riemannian (Karcher/Fréchet) mean is found by fixed-point iteration
(Karcher, 1977): start from the normalised weighted Euclidean mean (the first direction if
that vanishes), repeatedly map every direction to the tangent space at the mean
(log map ``Ω/sin Ω · (u − cos Ω · m)``, directions within ``tol`` of it skipped), average,
and step along the geodesic (exp map), until the step is below ``tol`` or ``max_iter``
steps. The result is the mean direction times Σ αᵢ‖θᵢ‖ (αᵢ = 1/N). Inputs with norm ≤ tol
are left out of the direction (not of the norm). As mergekit's ``karcher``, with uniform
weights; norms and angles in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hubsoup.methods import Method, param, register


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
    mean = sum(ai * u for ai, u in zip(a, units))
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


@dataclass
class KarcherParams:
    max_iter: int = param(10, "most fixed-point iterations", range=(1, None), source="mergekit")
    tol: float = param(1e-5, "convergence tolerance (tangent norm; angles and norms below it are zero)",
                       range=(0.0, None), source="mergekit")


@register
class Karcher(Method):
    name = "karcher"
    summary = "Riemannian (Karcher/Fréchet) mean of the models' directions on the sphere, times their mean norm."
    paper = "Riemannian center of mass and mollifier smoothing (Karcher, 1977); as in mergekit's karcher"
    paper_url = "https://doi.org/10.1002/cpa.3160300502"
    Params = KarcherParams

    def needs_base(self, params, n_inputs):
        return False

    def merge(self, base, deltas, params, ctx):
        n = len(deltas)
        experts = list(deltas.add_(base))
        return karcher_mean(experts, [1.0 / n] * n, params.max_iter, params.tol).sub_(base)
