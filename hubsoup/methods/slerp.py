"""Spherical linear interpolation between two models, tensor by tensor."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hubsoup.methods import Method, register
from hubsoup.methods import param


def slerp(a: torch.Tensor, b: torch.Tensor, t: float, eps: float = 1e-8, dot_threshold: float = 0.9995) -> torch.Tensor:
    """Interpolate along the great circle between the directions of a and b.

    Falls back to linear interpolation when they are (anti)parallel or zero, where
    the angle is ill-conditioned.
    """
    a64, b64 = a.double().flatten(), b.double().flatten()
    na, nb = a64.norm(), b64.norm()
    if na < eps or nb < eps:
        return torch.lerp(a, b, t)
    dot = torch.clamp((a64 / na) @ (b64 / nb), -1.0, 1.0)
    if abs(float(dot)) > dot_threshold:
        return torch.lerp(a, b, t)
    omega = torch.arccos(dot)
    so = torch.sin(omega)
    out = (torch.sin((1 - t) * omega) / so) * a64 + (torch.sin(t * omega) / so) * b64
    return out.reshape(a.shape).to(a.dtype)


@dataclass
class SlerpParams:
    t: float = param(0.5, "position between the first (0) and second (1) input", range=(0.0, 1.0))


@register
class Slerp(Method):
    name = "slerp"
    summary = "Spherical interpolation between two fine-tunes, per tensor."
    paper = "Sampling Generative Networks (White, 2016); as popularised for LLM merging by mergekit"
    paper_url = "https://arxiv.org/abs/1609.04468"
    Params = SlerpParams
    min_inputs = max_inputs = 2

    def merge(self, base, deltas, params, ctx):
        return slerp(base + deltas[0], base + deltas[1], params.t) - base
