"""Spherical linear interpolation between two models, tensor by tensor.

With one input, SLERP goes from the base (``t = 0``) to the input (``t = 1``): mergekit's
``slerp``, whose ``base_model`` is the t = 0 end. With two inputs it goes from the first
(t = 0) to the second (t = 1) and needs no base (the base, if any, is only the layout
reference). Each tensor is flattened; its two endpoints' directions give the angle Ω
(computed in float64), and θ = sin((1−t)Ω)/sin Ω · a + sin(tΩ)/sin Ω · b. Where
|cos Ω| > ``dot_threshold`` (0.9995, mergekit's DOT_THRESHOLD) or an endpoint is (near)
zero, it falls back to linear interpolation. mergekit instead treats a zero endpoint as
orthogonal (θ = sin(tπ/2)·b); both agree everywhere else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hubsoup.linalg import dot_chunked
from hubsoup.methods import Method, register
from hubsoup.methods import param


def slerp(a: torch.Tensor, b: torch.Tensor, t: float, eps: float = 1e-8, dot_threshold: float = 0.9995) -> torch.Tensor:
    """Interpolate along the great circle between the directions of a and b.

    Falls back to linear interpolation when they are (anti)parallel or zero, where
    the angle is ill-conditioned. Norms, the cosine and the coefficients in float64; the
    combination in the inputs' dtype (two temporaries, not float64 copies of both ends).
    """
    na, nb = math.sqrt(dot_chunked(a, a)), math.sqrt(dot_chunked(b, b))
    if na < eps or nb < eps:
        return torch.lerp(a, b, t)
    dot = min(max(dot_chunked(a, b) / (na * nb), -1.0), 1.0)
    if abs(dot) > dot_threshold:
        return torch.lerp(a, b, t)
    omega = math.acos(dot)
    so = math.sin(omega)
    return torch.add(a * (math.sin((1 - t) * omega) / so), b, alpha=math.sin(t * omega) / so)


@dataclass
class SlerpParams:
    t: float = param(0.5, "position between the first end (0: the base with one input, the first input with "
                          "two) and the second (1)", range=(0.0, 1.0))


@register
class Slerp(Method):
    name = "slerp"
    summary = "Spherical interpolation between two models (base → input, or input → input), per tensor."
    paper = "Sampling Generative Networks (White, 2016); as popularised for LLM merging by mergekit"
    paper_url = "https://arxiv.org/abs/1609.04468"
    Params = SlerpParams
    min_inputs, max_inputs = 1, 2

    def needs_base(self, params, n_inputs):
        return n_inputs < 2

    def merge(self, base, deltas, params, ctx):
        # the ends rebuilt in place in the task vectors' buffers (the method owns them)
        if len(deltas) == 1:
            return slerp(base, deltas[0].add_(base), params.t).sub_(base)
        return slerp(deltas[0].add_(base), deltas[1].add_(base), params.t).sub_(base)
