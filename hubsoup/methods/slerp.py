"""Spherical linear interpolation between two models, tensor by tensor.

With one input, SLERP goes from the base (``t = 0``) to the input (``t = 1``): mergekit's
``slerp``, whose ``base_model`` is the t = 0 end. With two inputs it goes from the first
(t = 0) to the second (t = 1) and needs no base (the base, if any, is only the layout
reference). Each tensor is flattened; its two endpoints' directions give the angle Ω
(computed in float64), and θ = sin((1−t)Ω)/sin Ω · a + sin(tΩ)/sin Ω · b. Where
|cos Ω| > ``dot_threshold`` (0.9995, mergekit's DOT_THRESHOLD) or an endpoint is (near)
zero, it falls back to linear interpolation. mergekit instead treats a zero endpoint as
orthogonal (θ = sin(tπ/2)·b); both agree everywhere else.

A tensor is merged in pieces (the engine's cache-sized sweeps): one pass gathers the dot products'
sums over blocks of 4096 entries and adds them exactly (``math.fsum``), so the angle is the whole
tensor's, bit for bit, whatever the pieces and their order; then every piece interpolates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, MutableMapping

import torch

from hubsoup.linalg import DOT_BLOCK, block_sums
from hubsoup.methods import Method, StatsPass, param, register

if TYPE_CHECKING:
    from hubsoup.methods import TensorContext


def slerp(a: torch.Tensor, b: torch.Tensor, t: float, eps: float = 1e-8, dot_threshold: float = 0.9995,
          dots: tuple[float, float, float] | None = None) -> torch.Tensor:
    """Interpolate along the great circle between the directions of a and b.

    Falls back to linear interpolation when they are (anti)parallel or zero, where
    the angle is ill-conditioned. Norms, the cosine and the coefficients in float64; the
    combination in the inputs' dtype (two temporaries, not float64 copies of both ends).
    ``dots``: (a·a, b·b, a·b) of the whole tensors, when a and b are pieces of them.
    """
    aa, bb, ab = dots if dots is not None else _dots(a, b)
    na, nb = math.sqrt(aa), math.sqrt(bb)
    if na < eps or nb < eps:
        return torch.lerp(a, b, t)
    dot = min(max(ab / (na * nb), -1.0), 1.0)
    if abs(dot) > dot_threshold:
        return torch.lerp(a, b, t)
    omega = math.acos(dot)
    so = math.sin(omega)
    return torch.add(a * (math.sin((1 - t) * omega) / so), b, alpha=math.sin(t * omega) / so)


def _block_dots(a: torch.Tensor, b: torch.Tensor) -> tuple[list[float], list[float], list[float]]:
    """The block sums of a·a, b·b and a·b (:func:`hubsoup.linalg.block_sums`)."""
    return block_sums(a, a), block_sums(b, b), block_sums(a, b)


def _dots(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    """(a·a, b·b, a·b), each the exactly rounded sum of block sums: the same whole or in pieces."""
    aa, bb, ab = (math.fsum(sums) for sums in _block_dots(a, b))
    return aa, bb, ab


def _ends(base: torch.Tensor, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two ends, rebuilt in place in the task vectors' buffers (θᵢ = τᵢ + θ₀): base → input with one
    input, input → input with two."""
    if len(deltas) == 1:
        return base, deltas[0].add_(base)
    return deltas[0].add_(base), deltas[1].add_(base)


_DOTS = "slerp.dots"


class _DotsPass(StatsPass):
    """(a·a, b·b, a·b) of one tensor's two ends, from its pieces: block sums gathered, summed exactly."""

    piecewise = True

    def __init__(self) -> None:
        self.blocks: tuple[list[float], list[float], list[float]] = ([], [], [])

    def update(self, ctx: TensorContext, base: torch.Tensor, deltas: torch.Tensor) -> None:
        a, b = _ends(base, deltas)  # the sweep's buffers: this pass's to overwrite
        for acc, sums in zip(self.blocks, _block_dots(a, b)):
            acc += sums

    def fork(self) -> "_DotsPass":
        return _DotsPass()

    def join(self, other: "_DotsPass") -> None:
        for acc, theirs in zip(self.blocks, other.blocks):
            acc += theirs

    def finish(self, stats: MutableMapping[str, Any]) -> None:
        stats[_DOTS] = tuple(math.fsum(acc) for acc in self.blocks)  # fsum: in any order, the same


@dataclass
class SlerpParams:
    t: float = param(0.5, "position between the first end (0: the base with one input, the first input with "
                          "two) and the second (1)", range=(0.0, 1.0))


@register
class Slerp(Method[SlerpParams]):
    name = "slerp"
    summary = "Spherical interpolation between two models (base → input, or input → input), per tensor."
    paper = "Sampling Generative Networks (White, 2016); as popularised for LLM merging by mergekit"
    paper_url = "https://arxiv.org/abs/1609.04468"
    Params = SlerpParams
    min_inputs, max_inputs = 1, 2

    def needs_base(self, params: SlerpParams, n_inputs: int) -> bool:
        return n_inputs < 2

    def tensor_passes(self, params: SlerpParams, n_inputs: int) -> list[StatsPass] | None:
        """The ends' norms and dot product, summed over the pieces (the merge is element-wise)."""
        return [_DotsPass()]

    def piece_multiple(self, params: SlerpParams) -> int:
        return DOT_BLOCK  # pieces made of whole blocks of the dot products' sums

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: SlerpParams,
              ctx: TensorContext) -> torch.Tensor:
        a, b = _ends(base, deltas)  # the method owns the task vectors' buffers
        return slerp(a, b, params.t, dots=ctx.stats.get(_DOTS)).sub_(base)
