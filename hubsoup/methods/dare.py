"""DARE: drop a fraction p of each task vector at random and rescale the rest.

Two conventions (``convention``):

* ``paper`` (default): survivors rescaled by 1/(1 − p); ``then=ties`` elects signs on the
  unweighted vectors and takes the disjoint mean over agreeing entries (peft's
  ``dare_ties``); ``then=sum`` is λ Σ wᵢ τᵢ.
* ``mergekit``: mergekit's ``dare_ties`` / ``dare_linear``: each entry kept with
  probability density = 1 − p (per input with ``densities``), survivors rescaled so the task
  vector keeps its L1 norm (``rescale``); then weights, and for ``then=ties`` signs elected on
  the weighted sum with ``merge=sum`` (mergekit's default ``normalize: false``, a disjoint sum)
  or ``merge=mean`` (divide by the agreeing weights); for ``then=sum``, ``normalize``
  divides by Σ wᵢ. λ last.

Masks are seeded from the recipe hash, the tensor name and the input: reruns repeat exactly;
against mergekit they agree in distribution (kept fraction, rescale), not bit for bit. The paper
convention draws each mask as peft does (one ``torch.bernoulli`` over the tensor: the same masks as
peft's ``dare_linear`` / ``dare_ties`` for the same seed), so it merges whole tensors; on an
accelerator that mask is still drawn on the CPU (peft's stream exists only there) and copied over.
The mergekit convention draws its masks with a counter-based generator
(:func:`~hubsoup.methods._sparsify.counter_mask`): entry j's draw depends only on the seed and j, so
the masks are the same on the CPU and on a GPU (drawn there, at the device's speed), and a tensor is
merged in pieces (in lanes): one pass sums each task vector's L1 norm before and after the drop (for
``rescale``), then every piece drops, rescales and combines. On the CPU the drop is
:func:`~hubsoup.methods._sparsify.counter_keep_` (the same draws, no boolean mask). (0.2 draws in blocks of
2¹⁶ entries, one hash round per entry under a per-block key, half the work of 0.1's two rounds per entry;
before that, each block came from a CPU generator: outputs of earlier versions differ, in distribution the
same.)

With ``compute_dtype`` (set from a mergekit config's ``dtype``) the mergekit convention computes as mergekit
does in that dtype, step for step (:func:`~hubsoup.methods._sparsify.gta_in_dtype`): the drop and the L1
rescale in bfloat16, or in float32 for float16 (mergekit's ``bernoulli`` upcasts there), then the weights,
the sign election, the sums, the division and λ in the half dtype; whole tensors (the rescale's sums round).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, MutableMapping

import torch

from hubsoup.errors import ParameterError
from hubsoup.linalg import block_sums, block_sums_t
from hubsoup.methods import Method, StatsPass, TensorContext, param, register
from hubsoup.methods._kernels import task_arithmetic, ties_combine_
from hubsoup.methods.task_arithmetic import default_scale
from hubsoup.methods._sparsify import (MASK_BLOCK, counter_keep_, counter_mask, gta_combine_, l1_norm, per_input,
                                       rescale_to_norm_)
from hubsoup.methods._sparsify import ComputeDtype, compute_dtype, compute_dtype_param, gta_in_dtype, random_work_dtype


def dare_drop_(delta: torch.Tensor, p: float, generator: torch.Generator, rescale: bool = True) -> torch.Tensor:
    """In place: zero each entry with probability p; rescale survivors by 1/(1-p).

    The mask is drawn on the generator's device (the CPU's, from the engine) and moved to
    ``delta``'s: the same recipe gives the same masks on every device.
    """
    if p == 0:
        return delta
    keep = torch.bernoulli(torch.full(delta.shape, 1.0 - p, dtype=delta.dtype, device=generator.device),
                           generator=generator)
    delta.mul_(keep.to(delta.device))
    return delta.div_(1.0 - p) if rescale else delta


@dataclass
class DareParams:
    p: float = param(0.9, "drop rate (the DARE paper drops up to 90-99% of delta parameters)", range=(0.0, 0.9999))
    then: Literal["sum", "ties"] = param("sum", "combine the sparsified vectors by weighted sum (task arithmetic, "
                                              "dare_linear) or by TIES sign election + disjoint merge (dare_ties)")
    scale: float | None = param(
        None, "λ applied to the combined task vector; none = the combining method's own default: 1/N for then=sum "
              "(task arithmetic's λ; λ = 1 summed N rescaled vectors and cost 39 control points at 8 encoder tasks), 1 for "
              "then=ties and for convention=mergekit (mergekit's lambda)", range=(None, None), source="measured")
    weights: tuple[float, ...] | None = param(None, "per-input weights (default 1 each)", per_input=True)
    rescale: bool = param(True, "rescale kept entries: by 1/(1-p) (paper) or to the L1 norm (mergekit)")
    seed: int = param(0, "extra seed mixed with the recipe and tensor name", source="ours")
    convention: Literal["paper", "mergekit"] = param(
        "paper", "paper: 1/(1-p) rescale, signs on unweighted vectors; mergekit: L1-norm rescale, signs on "
                 "weighted vectors, merge/normalize as mergekit's dare_ties/dare_linear", source="mergekit")
    densities: tuple[float, ...] | None = param(None, "per-input kept fraction (mergekit's per-model density; "
                                                      "overrides p = 1 - density)", range=(0.0, 1.0),
                                                per_input=True, source="mergekit")
    merge: Literal["mean", "sum"] = param("mean", "then=ties: disjoint mean or disjoint sum (mergekit's "
                                                  "dare_ties default, normalize: false)")
    normalize: bool = param(False, "then=sum: divide by the sum of the weights (mergekit's normalize)",
                            source="mergekit")
    compute_dtype: ComputeDtype = compute_dtype_param("convention=mergekit: ")

    def validate(self) -> None:
        if self.densities is not None and self.convention != "mergekit":
            raise ParameterError("parameter 'densities' needs convention=mergekit (the paper convention has one p)")
        if self.compute_dtype != "float32" and self.convention != "mergekit":
            raise ParameterError("parameter 'compute_dtype' needs convention=mergekit")


@register
class Dare(Method[DareParams]):
    name = "dare"
    summary = "Randomly drop delta parameters and rescale (Drop And REscale), then sum or TIES-combine."
    paper = "Language Models are Super Mario: Absorbing Abilities from Homologous Models as a Free Lunch (Yu et al., 2024)"
    paper_url = "https://arxiv.org/abs/2311.03099"
    Params = DareParams
    search_grid = {"scale": [round(0.1 * i, 1) for i in range(1, 11)]}  # λ = 0.1..1.0
    scale_param = "scale"

    @staticmethod
    def resolved_scale(params: DareParams, n_inputs: int) -> float:
        """λ of this merge: the given scale, else the combining method's default (see ``scale``)."""
        if params.scale is not None:
            return params.scale
        return default_scale(n_inputs) if params.then == "sum" and params.convention == "paper" else 1.0

    def tensor_passes(self, params: DareParams, n_inputs: int) -> list[StatsPass] | None:
        """The mergekit convention merges in pieces: with ``rescale``, after a pass summing each task
        vector's L1 norm before and after its drop; the paper convention draws peft's mask: None."""
        if params.convention != "mergekit" or params.compute_dtype != "float32":
            return None  # (a half compute dtype: the L1 sums round in it, over the whole tensor)
        rescaled = params.rescale and any(d < 1.0 for d in _densities(params, n_inputs))
        return [_NormsPass(params, n_inputs)] if rescaled else []

    def piece_multiple(self, params: DareParams) -> int:
        return MASK_BLOCK  # a piece draws whole blocks of the masks

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: DareParams,
              ctx: TensorContext) -> torch.Tensor:
        weights = params.weights or [1.0] * len(deltas)
        scale = self.resolved_scale(params, len(deltas))
        if params.convention == "mergekit":
            densities = _densities(params, len(deltas))
            dtype = compute_dtype(params.compute_dtype, ctx)
            if dtype != torch.float32:  # mergekit's dare_* in its config's dtype, step for step
                return gta_in_dtype(base, deltas, dtype,
                                    lambda i, tau: _mask(tau, densities[i], params, ctx, i) if densities[i] < 1.0 else None,
                                    weights, consensus=params.then == "ties",
                                    normalize=params.merge == "mean" if params.then == "ties" else params.normalize,
                                    scale=scale, rescale=params.rescale, sparsify_dtype=random_work_dtype(dtype))
            norms = ctx.stats.get(_NORMS)  # the whole vectors' (merged in pieces), else computed here
            dropped = norms is None and params.rescale and deltas.device.type != "cpu"
            if dropped:  # an accelerator: the drops done, every norm read back at once
                norms = _drop_on_device(deltas, densities, params, ctx)
            for i, (row, density) in enumerate(zip(deltas, densities)):
                if density < 1.0:
                    if params.rescale:
                        before, after = norms[i] if norms else (l1_norm(row), None)
                    if not dropped:
                        _drop_(row, density, params, ctx, i)
                    if params.rescale:
                        rescale_to_norm_(row, before, after=after)
            normalize = params.merge == "mean" if params.then == "ties" else params.normalize
            return gta_combine_(deltas, weights, consensus=params.then == "ties", normalize=normalize,
                                scale=scale)
        for i, row in enumerate(deltas):
            dare_drop_(row, params.p, ctx.generator(f"dare:{params.seed}:{i}"), params.rescale)
        if params.then == "ties":
            return ties_combine_(deltas, params.weights, params.merge).mul_(scale)
        out = task_arithmetic(deltas, weights, scale)
        return out.div_(sum(weights)) if params.normalize and abs(sum(weights)) >= 1e-8 else out


def _densities(params: DareParams, n: int) -> list[float]:
    return per_input(1.0 - params.p, params.densities, n)


def _drop_on_device(deltas: torch.Tensor, densities: list[float], params: DareParams,
                    ctx: TensorContext) -> list[tuple[float, float] | None]:
    """Each row's drop (mergekit convention) on an accelerator, and its L1 norms before and after, read back
    at once: one wait for the device per tensor, not two per row; the same exactly rounded sums as
    :func:`~hubsoup.methods._sparsify.l1_norm`, so the same bytes as the CPU. None for a row kept whole."""
    sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, (row, density) in enumerate(zip(deltas, densities)):
        if density < 1.0:
            before = block_sums_t(row, absolute=True)
            row.masked_fill_(~_mask(row, density, params, ctx, i), 0.0)
            sums[i] = before, block_sums_t(row, absolute=True)
    values = torch.cat([t for pair in sums.values() for t in pair]).tolist() if sums else []
    out: list[tuple[float, float] | None] = [None] * len(densities)
    pos = 0
    for i, (b, a) in sums.items():
        mid, end = pos + b.numel(), pos + b.numel() + a.numel()
        out[i] = math.fsum(values[pos:mid]), math.fsum(values[mid:end])
        pos = end
    return out


def _mask(row: torch.Tensor, density: float, params: DareParams, ctx: TensorContext, i: int) -> torch.Tensor:
    """Input i's mask (mergekit convention) over the entries ``row`` holds, from ``ctx.offset``: drawn on
    ``row``'s device by the counter-based generator, the same masks on every device."""
    return counter_mask(row.numel(), density, ctx.seed(f"dare:{params.seed}:{i}"), ctx.offset,
                        row.device).view(row.shape)


def _drop_(row: torch.Tensor, density: float, params: DareParams, ctx: TensorContext, i: int) -> None:
    """In place: input i's drop (mergekit convention) on the entries ``row`` holds, from ``ctx.offset``: on the CPU
    :func:`~hubsoup.methods._sparsify.counter_keep_` (no boolean mask), elsewhere the mask of :func:`_mask` filled
    in; the same entries set to +0.0."""
    if row.device.type == "cpu":
        counter_keep_(row, density, ctx.seed(f"dare:{params.seed}:{i}"), ctx.offset)
    else:
        row.masked_fill_(~_mask(row, density, params, ctx, i), 0.0)


_NORMS = "dare.l1"


class _NormsPass(StatsPass):
    """Each task vector's L1 norm before and after its drop (mergekit's rescale), over the pieces: block
    sums gathered, summed exactly (in any order, the whole tensor's)."""

    piecewise = True

    def __init__(self, params: DareParams, n_inputs: int) -> None:
        self.params, self.n = params, n_inputs
        self.sums: list[tuple[list[float], list[float]]] = [([], []) for _ in range(n_inputs)]  # block sums before, after

    def update(self, ctx: TensorContext, base: torch.Tensor, deltas: torch.Tensor) -> None:
        for i, (row, density) in enumerate(zip(deltas, _densities(self.params, self.n))):
            if density < 1.0:
                before, after = self.sums[i]
                before += block_sums(row, absolute=True)
                _drop_(row, density, self.params, ctx, i)  # the sweep's buffer
                after += block_sums(row, absolute=True)

    def fork(self) -> "_NormsPass":
        return _NormsPass(self.params, self.n)

    def join(self, other: "_NormsPass") -> None:
        for (b, a), (ob, oa) in zip(self.sums, other.sums):
            b += ob
            a += oa

    def finish(self, stats: MutableMapping[str, Any]) -> None:
        stats[_NORMS] = [(math.fsum(b), math.fsum(a)) for b, a in self.sums]
