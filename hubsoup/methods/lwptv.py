"""LwPTV: layer-wise pruning of task vectors, as a mask over a base method.

A statistics pass scores every layer l of every task vector by its mean absolute
deviation from the cross-task mean, s_k^l = (1/d_l)·Σ_i |τ_k^l[i] − τ̄^l[i]|
(float64 sums). Each task keeps its L − ⌊ηL⌋ highest-scoring layers; a layer is
kept if any task keeps it (the OR mask m̂). The inner method then merges the masked
task vectors {m̂ ⊙ τ_k} — in its own statistics passes too, so TIES's global top-k
counts the zeros of pruned layers — and pruned layers come back as the base,
bit for bit (the merged delta is exactly 0).

"Layer" is one named tensor (the paper's reading, see the spec); ``unit=block``
groups a transformer block's tensors instead (not in the paper).

Usage::

    hubsoup merge A B C --base B0 --method lwptv --param eta=0.3 --param base_method=ties --out soup
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, MutableMapping

import torch

from hubsoup.errors import MethodError
from hubsoup.linalg import DOT_BLOCK
from hubsoup.methods import StatsPass, TensorContext, param, register
from hubsoup.methods._compose import Composed, Modifier


@dataclass
class LwptvParams:
    base_method: str = param(
        "task_arithmetic", "inner method merging the masked task vectors, at its own defaults: "
                           "task_arithmetic, ties (the paper's setting: merge=sum, scale=0.3), consensus, or a "
                           "chain such as lines+ties; give its parameters alongside")
    eta: float = param(0.3, "pruning ratio η: each task drops its ⌊ηL⌋ lowest-saliency layers (η = 0 is the base "
                            "method, η = 1 the base model). The paper's 0.7 (every vision run) cost 0.09-0.15 of "
                            "the gain against the base method on the LM and the 8-task encoder; η = 0.1-0.3 scored "
                            "within 0.01 of the best on every validation search, 0.3 the largest such η (the "
                            "mask still prunes)", range=(0.0, 1.0), source="measured")
    eq6_literal: bool = param(
        False, "threshold as Eq. 6 is printed, sorted(s_k)[⌊ηL⌋] read 0-based: drops one more layer and prunes "
               "even at η = 0; default false follows the text (the ⌊ηL⌋-th smallest, η = 0 prunes nothing)",
        source="ours")
    score: Literal["deviation", "abs_mean"] = param(
        "deviation", "saliency: mean |τ_k − τ̄| (paper) or mean |τ_k| (the paper's ablation)")
    combine: Literal["union", "per_task"] = param(
        "union", "union: one shared mask, the OR of the tasks' masks (paper); per_task: each task's own mask "
                 "gates its own vector (the paper's ablation)")
    unit: Literal["tensor", "block"] = param(
        "tensor", "what a layer is: one named tensor (the paper's reading) or a whole transformer block "
                  "(tensors outside blocks stay their own layer; not in the paper)", source="ours")
    zero_layers: Literal["count", "exclude"] = param(
        "count", "layers whose task vectors are zero for every task (frozen parts): count them in L, where they "
                 "score 0 and use up the pruning budget (faithful), or leave them out of the ranking", source="ours")


def unit_of(ctx: TensorContext, unit: str) -> str:
    if unit == "block" and ctx.block is not None:
        return f"{ctx.block.stack}.{ctx.block.index}"
    return ctx.name


def layer_masks(scores: list[list[float]], eta: float, literal: bool = False) -> list[list[bool]]:
    """Per-task keep masks (Eq. 6): task k keeps layer l iff s_k^l > t_k.

    q = ⌊ηL⌋; t_k is the q-th smallest score (1-based; q = 0 keeps everything), or with
    ``literal`` the element at 0-based index q of the sorted scores (q = L prunes all).
    The test is strict, so layers tied at the threshold are all pruned.
    """
    out = []
    for s in scores:
        n = len(s)
        q = math.floor(eta * n + 1e-9)
        ranked = sorted(s)
        if literal:
            t = ranked[q] if q < n else math.inf
        else:
            t = ranked[q - 1] if q > 0 else -math.inf
        out.append([v > t for v in s])
    return out


_CHUNK = 1 << 20  # entries per task scored at a time (a multiple of DOT_BLOCK)


class _SaliencyPass(StatsPass):
    """Σ|τ_k − τ̄| (or Σ|τ_k|) per layer and task, over the pieces of each tensor (no whole-tensor stack: peak
    memory as task arithmetic's), in lanes: float64 sums of blocks of :data:`~hubsoup.linalg.DOT_BLOCK` entries,
    added exactly at the end (``math.fsum``), so the scores do not depend on where pieces start or which lane
    took them; the tensors' order is the stream's, kept in a list the forks share."""

    piecewise = True

    def __init__(self, own: LwptvParams, n: int, order: list[str] | None = None) -> None:
        self.own, self.n = own, n
        self.units: dict[str, dict[str, Any]] = {}
        self.order = [] if order is None else order  # tensor names in stream order, shared with the forks
        self.unit_of: dict[str, str] = {}

    def update(self, ctx: TensorContext, base: torch.Tensor, deltas: torch.Tensor) -> None:
        unit = unit_of(ctx, self.own.unit)
        u = self.units.setdefault(unit, {"abs": [[] for _ in range(self.n)], "numel": 0, "nonzero": False})
        if ctx.offset == 0:  # one piece per tensor starts at 0; tensors are streamed one after the other
            self.order.append(ctx.name)
        self.unit_of[ctx.name] = unit
        flat = deltas.reshape(self.n, -1)
        for start in range(0, flat.shape[1], _CHUNK):  # float64 in chunks: exact enough, bounded memory
            part = flat[:, start:start + _CHUNK].double()
            if self.own.score == "deviation":
                part.sub_(part.sum(dim=0).div_(self.n))
            part.abs_()
            full = part.shape[1] // DOT_BLOCK * DOT_BLOCK
            sums = part[:, :full].reshape(self.n, -1, DOT_BLOCK).sum(dim=2)
            tail = part[:, full:].sum(dim=1, keepdim=True) if full < part.shape[1] else None
            rows = (torch.cat([sums, tail], dim=1) if tail is not None else sums).tolist()
            for k, row in enumerate(rows):
                u["abs"][k] += row
        u["numel"] += flat.shape[1]
        u["nonzero"] = u["nonzero"] or bool(deltas.any())

    def fork(self) -> "_SaliencyPass":
        return _SaliencyPass(self.own, self.n, self.order)

    def join(self, other: "_SaliencyPass") -> None:
        for unit, ou in other.units.items():
            u = self.units.setdefault(unit, {"abs": [[] for _ in range(self.n)], "numel": 0, "nonzero": False})
            for k in range(self.n):
                u["abs"][k] += ou["abs"][k]
            u["numel"] += ou["numel"]
            u["nonzero"] = u["nonzero"] or ou["nonzero"]
        self.unit_of.update(other.unit_of)

    def finish(self, stats: MutableMapping[str, Any]) -> None:
        tensors: dict[str, list[str]] = {}  # unit -> its tensors, units and tensors in stream order
        for name in self.order:
            tensors.setdefault(self.unit_of[name], []).append(name)
        units = {unit: {**self.units[unit], "tensors": names} for unit, names in tensors.items()}
        for u in units.values():
            u["abs"] = [math.fsum(v) for v in u["abs"]]
        self.units = units
        ranked = [name for name, u in self.units.items() if u["nonzero"] or self.own.zero_layers == "count"]
        scores = [[self.units[name]["abs"][k] / max(self.units[name]["numel"], 1) for name in ranked]
                  for k in range(self.n)]
        masks = layer_masks(scores, self.own.eta, self.own.eq6_literal)
        keep_tasks = {name: [True] * self.n for name in self.units}  # unranked (all-zero) layers are kept
        for i, name in enumerate(ranked):
            keep_tasks[name] = [m[i] for m in masks]
        keep = {name: any(ks) for name, ks in keep_tasks.items()}
        pruned = [t for name, u in self.units.items() if not keep[name] for t in u["tensors"]]
        total = sum(u["numel"] for u in self.units.values())
        kept = sum(u["numel"] for name, u in self.units.items() if keep[name])
        stats["lwptv.keep"] = keep
        if self.own.combine == "per_task":
            stats["lwptv.keep_tasks"] = keep_tasks
        stats["lwptv.scores"] = {name: [s[i] for s in scores] for i, name in enumerate(ranked)}
        stats["lwptv.layers"] = len(ranked)
        stats["lwptv.pruned_per_task"] = math.floor(self.own.eta * len(ranked) + 1e-9)
        stats["lwptv.pruned"] = pruned
        stats["lwptv.kept_layers"] = sum(keep.values())
        stats["lwptv.kept_param_fraction"] = kept / total if total else 1.0


class _MaskedPass(StatsPass):
    """An inner method's statistics pass, shown the masked task vectors."""

    def __init__(self, inner: StatsPass, own: LwptvParams) -> None:
        self.inner, self.own = inner, own
        self.piecewise = inner.piecewise  # the mask is per tensor: a piece is masked as its tensor
        # learned in the merge sweep (TIES' majority sign): the merge masks the pieces itself
        self.during_merge = inner.during_merge

    def update(self, ctx: TensorContext, base: torch.Tensor, deltas: torch.Tensor) -> None:
        self.inner.update(ctx, base, masked(deltas, ctx, self.own, copy=True))

    def finish(self, stats: MutableMapping[str, Any]) -> None:
        self.inner.finish(stats)

    def fork(self) -> "_MaskedPass | None":
        inner = self.inner.fork()
        return None if inner is None else _MaskedPass(inner, self.own)

    def join(self, other: "_MaskedPass") -> None:
        self.inner.join(other.inner)

    def begin(self, stats: MutableMapping[str, Any]) -> None:
        self.inner.begin(stats)

    def piece_done(self) -> bool:
        return self.inner.piece_done()

    def confirmed(self, stats: MutableMapping[str, Any]) -> bool:
        return self.inner.confirmed(stats)


def masked(deltas: torch.Tensor, ctx: TensorContext, own: LwptvParams, copy: bool) -> torch.Tensor:
    """m̂ ⊙ τ for one tensor (per task with ``combine=per_task``); in place unless ``copy``."""
    unit = unit_of(ctx, own.unit)
    if not ctx.stats["lwptv.keep"][unit]:
        return torch.zeros_like(deltas) if copy else deltas.zero_()
    if own.combine == "per_task":
        tasks = ctx.stats["lwptv.keep_tasks"][unit]
        if not all(tasks):
            deltas = deltas.clone() if copy else deltas
            for row, keep in zip(deltas, tasks):
                if not keep:
                    row.zero_()
    return deltas


@register
class Lwptv(Modifier[LwptvParams]):
    name = "lwptv"
    summary = ("LwPTV: reset to the base the layers whose task vectors deviate least from the tasks' mean "
               "(kept where any task ranks them in its top 1−η), then merge with a base method.")
    paper = "Merging Smarter, Generalizing Better: Enhancing Model Merging on OOD Data (Zhang et al., 2025)"
    paper_url = "https://arxiv.org/abs/2506.09093"
    Params = LwptvParams
    min_inputs = 2
    search_grid = {"eta": [round(0.1 * i, 1) for i in range(1, 8)]}  # η = 0.1..0.7
    # The inner method keeps its own defaults. The paper ran TIES as a disjoint sum at λ = 0.3
    # (--param merge=sum --param scale=0.3): measured at η = 0.3 it recovered 0.43-0.61 of the
    # fine-tunes' gain where TIES' mean at λ = 1 recovered 0.56-0.74 (benchmarks/results/defaults.md).

    def check_inputs(self, params: Composed[LwptvParams], n_inputs: int) -> None:
        if n_inputs < 2:
            raise MethodError("method 'lwptv' needs at least 2 inputs: with one task every saliency is 0")
        super().check_inputs(params, n_inputs)

    def passes(self, params: Composed[LwptvParams], n_inputs: int) -> list[StatsPass]:
        return [_SaliencyPass(params.own, n_inputs),
                *(_MaskedPass(p, params.own) for p in self.inner_passes(params, n_inputs))]

    def tensor_passes(self, params: Composed[LwptvParams], n_inputs: int) -> list[StatsPass] | None:
        inner = self.inner_tensor_passes(params, n_inputs)  # a mask per tensor: element-wise as its base
        return None if inner is None else [_MaskedPass(p, params.own) for p in inner]

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: Composed[LwptvParams],
              ctx: TensorContext) -> torch.Tensor:
        if not ctx.stats["lwptv.keep"][unit_of(ctx, params.own.unit)]:
            return torch.zeros_like(base)  # base + 0.0 is the base, bit for bit
        return self.inner_merge(base, masked(deltas, ctx, params.own, copy=False), params, ctx)

    def card_notes(self, described: dict[str, Any], stats: dict[str, Any], n_inputs: int) -> list[str]:
        if "lwptv.keep" not in stats:
            return super().card_notes(described, stats, n_inputs)
        pruned = stats["lwptv.pruned"]
        what = "tensors" if described.get("unit", "tensor") == "tensor" else "layers (blocks or tensors)"
        rule = ("the literal Eq. 6 threshold, sorted(s)[⌊ηL⌋] 0-based" if described.get("eq6_literal")
                else "each task drops its ⌊ηL⌋ lowest scores")
        head = (f"**LwPTV layer mask.** η = {described.get('eta')}: of L = {stats['lwptv.layers']} ranked {what}, "
                f"{rule} ({stats['lwptv.pruned_per_task']}); a layer is kept if "
                f"{'any task keeps it' if described.get('combine', 'union') == 'union' else 'its own task keeps it'}. "
                f"Kept: {stats['lwptv.kept_layers']} layers, {100 * stats['lwptv.kept_param_fraction']:.1f}% of the "
                f"merged parameters. {len(pruned)} tensor(s) were reverted to the base model exactly.")
        body = "\n".join(f"- `{t}`" for t in pruned)
        note = head + (f"\n\n<details><summary>Reverted tensors</summary>\n\n{body}\n\n</details>" if pruned else "")
        return [note, *super().card_notes(described, stats, n_inputs)]
