"""TIES-merging: trim, elect sign, disjoint merge.

The three steps are the kernels ``trim_``, ``elect_sign`` and ``disjoint_merge_`` of
:mod:`hubsoup.methods._kernels` (DARE's ``then=ties`` shares them).

Two conventions (``convention``):

* ``paper`` (default): per-input weights applied *after* the sign election on the
  unweighted trimmed vectors, the disjoint mean divides by the number of agreeing entries,
  entries summing to 0 take the model-wide majority sign (peft's ``ties``); the trim keeps
  ``|τ| ≥`` the k-th largest magnitude.
* ``mergekit``: mergekit's ``ties``: each τᵢ keeps exactly its top ``max(1, int(density·n))``
  magnitudes (optionally L1-rescaled, ``rescale``), is multiplied by its weight, signs are
  elected on the weighted sum (+ where it is 0), and ``merge=mean`` divides by the sum of
  the agreeing entries' weights (mergekit ``normalize: true``); ``merge=sum`` is its
  ``normalize: false``. It always ranks per tensor, as mergekit does (``scope`` is ignored).

In both, a positive density keeps at least one entry of each task vector.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, MutableMapping

import torch

from hubsoup.errors import ParameterError
from hubsoup.methods import Method, StatsPass, param, register
from hubsoup.methods._kernels import keep_topk_, kth_largest_abs, kth_largest_abs_t, ties_combine_, trim_
from hubsoup.methods._schedule import Schedule
from hubsoup.methods._select import KthLargestPass
from hubsoup.methods._sparsify import (ComputeDtype, apply_mask_, compute_dtype, compute_dtype_param, gta_combine_,
                                      gta_in_dtype, magnitude_mask, per_input)

if TYPE_CHECKING:
    from hubsoup.methods import TensorContext


PAPER_SCALE = 0.7
"""TIES' λ by default with convention=paper [measured] (``scale``; benchmarks/results/defaults.md)."""


@dataclass
class TiesParams:
    density: float = param(0.2, "kept fraction of each task vector's entries, the largest by magnitude (the paper's "
                                "k, as a fraction)", range=(0.0, 1.0))
    scope: Literal["model", "tensor"] = param(
        "model", "rank magnitudes over the whole model per task (as in the TIES paper) or per tensor (peft, mergekit)")
    merge: Literal["mean", "sum"] = param("mean", "disjoint mean (paper) or disjoint sum (dis-sum variant; "
                                                  "mergekit's normalize: false)")
    scale: float | None = param(
        None, "λ applied to the merged task vector; none = 0.7 for convention=paper (chosen on validation in 4 of "
              "hubsoup's 6 benchmark settings; λ = 1 was worse than the base on a single task with 4 and 8 LoRA "
              "inputs; the paper searches 0.8..1.8), 1 for convention=mergekit (mergekit's lambda)",
        range=(None, None), source="measured")
    weights: tuple[float, ...] | None = param(None, "per-input weights (paper convention: applied after trimming "
                                                    "and sign election, as peft)", per_input=True)
    convention: Literal["paper", "mergekit"] = param(
        "paper", "paper: signs on unweighted vectors, mean over agreeing entries; mergekit: signs on weighted "
                 "vectors, mean over the agreeing weights, exactly top-k kept", source="mergekit")
    densities: tuple[float, ...] | None = param(None, "per-input density (mergekit's per-model density); "
                                                      "overrides density", range=(0.0, 1.0), per_input=True,
                                                source="mergekit")
    rescale: bool = param(False, "rescale each trimmed task vector to its L1 norm (mergekit's rescale; "
                                 "convention=mergekit)", source="mergekit")
    compute_dtype: ComputeDtype = compute_dtype_param('convention=mergekit: ')

    def validate(self) -> None:
        if self.scope == "model" and self.convention == "paper" and (isinstance(self.density, Schedule) or self.densities is not None):
            raise ParameterError("parameter 'density': per-layer schedules and per-input densities need "
                                 "scope=tensor (scope=model ranks one threshold over the whole model)")
        if self.rescale and self.convention != "mergekit":
            raise ParameterError("parameter 'rescale' needs convention=mergekit")
        if self.compute_dtype != "float32" and self.convention != "mergekit":
            raise ParameterError("parameter 'compute_dtype' needs convention=mergekit")


@register
class Ties(Method[TiesParams]):
    name = "ties"
    summary = "Trim each task vector to its top-k magnitudes, elect signs by mass, average the agreeing entries."
    paper = "TIES-Merging: Resolving Interference When Merging Models (Yadav et al., 2023)"
    paper_url = "https://arxiv.org/abs/2306.01708"
    Params = TiesParams
    search_grid = {"scale": [round(0.1 * i, 1) for i in range(1, 16)]}  # λ = 0.1..1.5, the TIES paper's grid
    scale_param = "scale"

    @staticmethod
    def resolved_scale(params: TiesParams, n_inputs: int = 0) -> float:
        """λ of this merge: the given scale, else the convention's default (see ``scale``)."""
        if params.scale is not None:
            return params.scale
        return PAPER_SCALE if params.convention == "paper" else 1.0

    def card_notes(self, described: dict[str, Any], stats: dict[str, Any], n_inputs: int) -> list[str]:
        """The λ a default scale resolved to (it depends on the convention)."""
        if described.get("scale") is not None or described.get("convention") != "paper":
            return []
        return [f"**λ = {PAPER_SCALE:g}**: TIES' default scale with convention=paper [measured] (chosen on "
                "validation in most of hubsoup's quality benchmarks; λ = 1, the paper's usual value, was worse "
                "than the base model on single tasks with LoRA inputs). A λ searched on validation data can "
                "recover more of the fine-tunes' gains."]

    def passes(self, params: TiesParams, n_inputs: int) -> list[StatsPass]:
        if params.scope == "model" and params.convention == "paper" and params.density < 1.0:
            return KthLargestPass("ties.threshold", n_inputs, params.density).passes()
        return []

    def stats_key(self, params: TiesParams) -> tuple[str, str, str, str]:
        """The whole-model threshold reads the densities only: a search over λ ranks the model once."""
        return (params.scope, params.convention, repr(params.density), repr(params.densities))

    def workspace_bytes(self, shape: tuple[int, ...], n_inputs: int, params: TiesParams, name: str = "") -> int:
        """Beyond the stack, the base and the result: 3.25 float32 copies of the tensor, when choosing a
        row's threshold (|τ|, its radix keys as int32 and ``torch.bincount``'s int64 copy of them, a
        mask; the result does not exist yet). Merging needs less (signs, counts, one row's mask:
        2.25). Measured: tests/test_memory_plan.py."""
        return 13 * math.prod(shape)

    def tensor_passes(self, params: TiesParams, n_inputs: int) -> list[StatsPass] | None:
        """Per tensor, in pieces: the k-th largest |τᵢ| (scope=tensor; radix select, two passes) and
        the majority sign of the elected signs; the mergekit convention ranks whole rows: None."""
        if params.convention != "paper":
            return None
        densities = per_input(params.density, params.densities, n_inputs)
        out: list[StatsPass] = []
        if params.scope == "tensor" and any(d < 1.0 for d in densities):
            out += KthLargestPass(_TENSOR_THRESHOLD, n_inputs, densities).passes()
        return [*out, _MajorityPass()]

    @staticmethod
    def thresholds(deltas: torch.Tensor, params: TiesParams, ctx: TensorContext) -> list[float]:
        densities = per_input(params.density, params.densities, len(deltas))
        if params.scope == "model":
            return ctx.stats["ties.threshold"] if params.density < 1.0 else [0.0] * len(deltas)
        if _TENSOR_THRESHOLD in ctx.stats:  # merged in pieces: the whole tensor's, from tensor_passes
            return [0.0 if d >= 1.0 else t for d, t in zip(densities, ctx.stats[_TENSOR_THRESHOLD])]
        out = []
        for d, density in zip(deltas, densities):
            k = max(1, int(density * d.numel())) if density > 0 else 0  # a positive density keeps one entry
            out.append(0.0 if density >= 1.0 else kth_largest_abs(d, k))
        return out

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: TiesParams,
              ctx: TensorContext) -> torch.Tensor:
        if params.convention == "mergekit":
            densities = per_input(params.density, params.densities, len(deltas))
            dtype = compute_dtype(params.compute_dtype, ctx)
            if dtype != torch.float32:
                return gta_in_dtype(base, deltas, dtype, lambda i, tau: magnitude_mask(tau, densities[i]),
                                    params.weights or [1.0] * len(deltas), consensus=True,
                                    normalize=params.merge == "mean", scale=self.resolved_scale(params),
                                    rescale=params.rescale)
            for row, density in zip(deltas, densities):
                apply_mask_(row, magnitude_mask(row, density), params.rescale)
            return gta_combine_(deltas, params.weights or [1.0] * len(deltas), consensus=True,
                                normalize=params.merge == "mean", scale=self.resolved_scale(params))
        if deltas.device.type != "cpu" and params.scope == "tensor" and _TENSOR_THRESHOLD not in ctx.stats:
            _trim_on_device_(deltas, per_input(params.density, params.densities, len(deltas)))
        else:
            trim_(deltas, self.thresholds(deltas, params, ctx))
        tally = ctx.stats.get(_TALLY)  # merged in pieces: the majority sign is being learned
        out = ties_combine_(deltas, params.weights, params.merge, ctx.stats.get(_MAJORITY),
                            observe=tally.observe if tally is not None else None)
        scale = self.resolved_scale(params)
        return out if scale == 1.0 else out.mul_(scale)  # λ = 1: x·1 is x


def _trim_on_device_(deltas: torch.Tensor, densities: list[float]) -> None:
    """:func:`trim_` with each row's threshold (:meth:`Ties.thresholds`, scope=tensor) selected and applied on
    the rows' device (:func:`keep_topk_`): no value read back. Keeps |x| ≥ t exactly as ``trim_`` does."""
    for d, density in zip(deltas, densities):
        if density >= 1.0:
            continue
        if density <= 0:
            d.zero_()
            continue
        keep_topk_(d, ties="keep_ties", threshold=kth_largest_abs_t(d, max(1, int(density * d.numel()))))


_TENSOR_THRESHOLD = "ties.tensor_threshold"
_MAJORITY = "ties.majority"
_TALLY = "ties.majority.tally"


class _MajorityPass(StatsPass):
    """The majority sign of one tensor merged in pieces: the sign of Σ sign(Σᵢ trimmed τᵢ), which the
    entries whose trimmed τᵢ sum to 0 (and are not all 0) take.

    Learned by the merge sweep itself (``during_merge``): every piece is merged with a provisional +1
    and reports its own signs' sum and whether it has such an entry; when the tensor's majority turns out
    to be -1, the engine merges those pieces again (few: an exact 0 sum of non-zero entries is rare).
    """

    during_merge = True
    _GUESS = 1.0

    def __init__(self) -> None:
        self.total, self.flagged = 0.0, False

    def begin(self, stats: MutableMapping[str, Any]) -> None:
        self.total, self.flagged = 0.0, False
        stats[_MAJORITY] = self._GUESS
        stats[_TALLY] = self

    def observe(self, own_signs: float, used_majority: bool) -> None:
        self.total += own_signs  # ±1 and 0: exact in every piece
        self.flagged = self.flagged or used_majority

    def fork(self) -> "_MajorityPass":
        return _MajorityPass()

    def join(self, other: "_MajorityPass") -> None:
        self.total += other.total  # sums of ±1: exact, in any order

    def piece_done(self) -> bool:
        flagged, self.flagged = self.flagged, False
        return flagged

    def finish(self, stats: MutableMapping[str, Any]) -> None:
        stats.pop(_TALLY, None)
        stats[_MAJORITY] = 1.0 if self.total >= 0 else -1.0

    def confirmed(self, stats: MutableMapping[str, Any]) -> bool:
        return bool(stats[_MAJORITY] == self._GUESS)  # stats hold Any; a float compared is a bool
