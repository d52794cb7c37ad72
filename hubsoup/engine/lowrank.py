"""The engine's one fast-path policy: what a tensor's merge needs, from cheapest to dearest.

The general path materialises every input's task vector of a tensor densely and stacks
them (``(N, *shape)`` float32). :func:`decide` avoids that where it can:

* **Copy**: integer and boolean tensors (buffers, masks) are the base's, untouched.
* **Unchanged**: no input changes the tensor (a LoRA that does not adapt it has τ = 0).
  For a method with ``zero_preserving`` (all-zero task vectors merge to zero; true of
  every built-in method and the default of :class:`~hubsoup.methods.Method`) the result
  is the base tensor, and nothing else is allocated.
* **LowRank**: methods whose merged task vector is a fixed linear combination Σ cᵢ τᵢ
  (``linear``, ``task_arithmetic``, ``wise_ft``: those whose
  :meth:`~hubsoup.methods.Method.linear_coefficients` is not None) on a 2-D tensor whose
  inputs are all plain LoRA updates (or untouched: a full fine-tune, a DoRA or a saved
  full tensor is not). Then Σ cᵢ τᵢ = [c₁P₁ … c_NP_N] @ [Q₁; …; Q_N], the stacked factors
  of total rank Σ rᵢ: a full checkpoint forms only base + P @ Q (no stack), a LoRA output
  never forms anything larger than (out + in) × Σ rᵢ.
* **Dense** from factors: a method with its own low-rank path
  (:meth:`~hubsoup.methods.Method.merge_factors`, e.g. SFTM) gets the list of
  ``(Pᵢ, Qᵢ)`` (None for an untouched input) and returns the merged τ, or None.
* **Weights** in pieces: a method whose merge is element-wise once some per-tensor
  statistics are known (:meth:`~hubsoup.methods.Method.tensor_passes`: none for a linear
  method, TIES' threshold and majority sign), whose inputs all hold the tensor whole (full
  fine-tunes), for a consumer that takes the merged weights themselves (``weights_dtype``: a
  full checkpoint). The passes and then the method's own
  :meth:`~hubsoup.methods.Method.merge` run on cache-sized pieces of the flattened tensor,
  each piece's θ₀ + τ is cast straight into the output: no float32 copy of the whole tensor
  or of the stack, and every value passes through the cache instead of a dozen times over
  memory. Same operations, element for element, as the dense path; only a non-finite
  result sends the tensor down the dense path, which names the input or the overflow.
* **Dense**: every other case — the method's :meth:`~hubsoup.methods.Method.merge` on the stack.

Low-rank outcomes are offered only where the consumer takes them (``lowrank_ok``).
"""

from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Collection, Mapping, Union

import torch

from hubsoup.engine import lanes
from hubsoup.methods._schedule import layer_position, resolve_params
from hubsoup.plan import Block, Plan, TensorEntry

if TYPE_CHECKING:
    from hubsoup.engine import TensorWork
    from hubsoup.engine.lanes import Shared
    from hubsoup.methods import StatsPass, TensorContext


@dataclass
class Copy:
    """A non-float tensor: the base's, as stored."""


@dataclass
class Unchanged:
    """τ = 0: the result is the base tensor."""


@dataclass
class LowRank:
    """τ = p @ q (p: out × r, q: r × in, float32, base orientation), never formed."""

    p: torch.Tensor
    q: torch.Tensor


@dataclass
class Dense:
    """τ as a dense float32 tensor of the base's shape; the consumer owns it (may modify it)."""

    tau: torch.Tensor


@dataclass
class Weights:
    """θ = θ₀ + τ itself, already cast to the consumer's dtype and checked finite."""

    theta: torch.Tensor


Outcome = Union[Copy, Unchanged, LowRank, Dense, Weights]
Extremes = tuple[torch.Tensor, torch.Tensor]  # a merged piece's (min, max)

# float32 bytes a piece spans over its N + 1 buffers: in L3, and large enough that both threads share each op
PIECE_BYTES = 4 << 20
MIN_PIECE = 1 << 14  # entries; below it torch's per-call cost outweighs the cache


def tensor_position(block: Block, entry: TensorEntry) -> float:
    """A tensor's gradient position t for per-layer schedules (mergekit's: its slice's, else its block's)."""
    src = entry.source
    if src is not None and src.position is not None:
        return src.position
    return layer_position(block.info)


def tensor_params(params: Any, block: Block, entry: TensorEntry) -> Any:
    """The method's parameters for one tensor: per-layer schedules and name filters resolved at its position,
    so the method sees plain numbers. The one owner of that decision: the merge (:func:`decide`) and the
    planner (:func:`hubsoup.engine.placement.place_blocks`: pieces, workspaces) both ask here.

    Example:
        >>> from hubsoup.methods import get_method
        >>> from hubsoup.methods._schedule import Schedule
        >>> from hubsoup.plan import BlockInfo
        >>> p = get_method("ties").Params(density=Schedule.parse([0.2, 0.6], name="density"))  # over the layers
        >>> e = TensorEntry("model.layers.1.mlp.up_proj.weight", (4, 4), torch.float32)
        >>> round(tensor_params(p, Block("model.layers.1", BlockInfo("model.layers", 1, 3), [e]), e).density, 6)
        0.4
    """
    return resolve_params(params, entry.name, tensor_position(block, entry))


def resolve_all(params: Any, plan: Plan) -> dict[str, Any]:
    """Every mergeable entry's parameters (:func:`tensor_params`), resolved once, by entry name: what the session
    (:mod:`hubsoup.session`) hands the planner and the merge (:attr:`hubsoup.engine.Job.resolved`). A name the
    plan holds twice is left out (each occurrence is then resolved where it is asked for)."""
    out: dict[str, Any] = {}
    twice: set[str] = set()
    for block in plan.blocks:
        for e in block.tensors:
            if not e.mergeable:
                continue
            if e.name in out:
                twice.add(e.name)
            out[e.name] = tensor_params(params, block, e)
    for name in twice:
        del out[name]
    return out


def params_of(resolved: Mapping[str, Any] | None, params: Any, block: Block, entry: TensorEntry) -> Any:
    """``entry``'s parameters: from ``resolved`` (:func:`resolve_all`) when it holds them, else resolved now."""
    if resolved is not None:
        got = resolved.get(entry.name)
        if got is not None:
            return got
    return tensor_params(params, block, entry)


def decide(work: "TensorWork", *, lowrank_ok: bool = True, weights_dtype: torch.dtype | None = None) -> Outcome:
    """The cheapest way to the merged task vector of ``work``'s tensor (see the module docs)."""
    job, entry = work.job, work.entry
    if not entry.mergeable:
        return Copy()
    method = job.need_method()
    params = params_of(job.resolved, job.params, work.block, entry)
    if method.preserves_zero(params) and work.untouched():
        return Unchanged()
    if weights_dtype is not None:
        theta = merge_in_pieces(work, params, weights_dtype)
        if theta is not None:
            return Weights(theta)
    if lowrank_ok and len(entry.shape) == 2:
        coefs = method.linear_coefficients(params, len(job.inputs))
        if coefs is not None:
            f = _stacked(work, coefs)
            if f is not None:
                return LowRank(*f)
        fs = work.input_factors()
        if fs is not None:
            tau = method.merge_factors(tuple(entry.shape), fs, params, work.context())
            if tau is not None:
                return Dense(tau)
    return Dense(method.merge(work.base(), work.deltas(), params, work.context()))


def reads_base(work: "TensorWork", *, lowrank_ok: bool) -> bool:
    """Whether :func:`decide` reads ``work``'s base tensor for a consumer that reads it only for a :class:`Dense`
    or :class:`Weights` outcome (the LoRA sink): not for integer tensors, tensors no input changes, nor LoRA
    inputs merged by a linear method from their factors. A prediction, made without reading anything: the
    read-ahead of Hub files read in place fetches only what it says (a wrong guess is read when asked)."""
    job, entry = work.job, work.entry
    if not entry.mergeable:
        return False
    method = job.need_method()
    params = params_of(job.resolved, job.params, work.block, entry)
    if method.preserves_zero(params) and work.untouched():
        return False
    return not (lowrank_ok and len(entry.shape) == 2 and job.adapters
                and method.linear_coefficients(params, len(job.inputs)) is not None)


def piece_size(n_inputs: int) -> int:
    """Entries per piece: N + 1 float32 buffers in :data:`PIECE_BYTES`, a multiple of 4096."""
    return max(MIN_PIECE, PIECE_BYTES // (4 * (n_inputs + 1)) // 4096 * 4096)


def merge_in_pieces(work: "TensorWork", params: Any, dtype: torch.dtype) -> torch.Tensor | None:
    """θ₀ + method.merge(θ₀, τ) over pieces of the flattened tensor, cast to ``dtype``; None when the
    method needs the whole tensor (no :meth:`~hubsoup.methods.Method.tensor_passes`), an input does
    not hold it whole, the block is not on the CPU, or the result is not finite (the dense path says why).

    Each of the method's tensor passes sweeps the pieces first (τ recomputed from the stored bytes
    every sweep: cheaper than holding the float32 stack), then the merge sweep writes the output.
    """
    method, n = work.job.need_method(), len(work.job.inputs)
    passes = method.tensor_passes(params, n)
    if passes is None:
        return None
    pieces = work.pieces(method.piece_multiple(params))
    if pieces is None:
        return None
    ctx = work.context()
    ctx.stats = ChainMap({}, ctx.stats)  # this tensor's statistics over the merge's
    want = lanes.count(work.job.lanes, len(pieces.starts))
    during = [p for p in passes if p.during_merge]
    for p in (p for p in passes if not p.during_merge):
        accumulators = lanes.forked(p, want)
        lanes.feed(accumulators, ctx, pieces)
        for other in accumulators[1:]:
            p.join(other)
        p.finish(ctx.stats)
    # the merge sweep: one set of the passes learned during it per lane, each begun on the lane's own stats
    forks = [lanes.forked(p, want) for p in during]
    n_lanes = want if all(len(f) == want for f in forks) else 1
    queue = lanes.Shared(pieces.starts) if n_lanes > 1 else None
    contexts = [ctx] + [replace(ctx, stats=ChainMap({}, ctx.stats)) for _ in range(n_lanes - 1)]
    for p in during:
        p.begin(ctx.stats)
    for f in forks:
        for j in range(1, n_lanes):
            f[j].begin(contexts[j].stats)
    numel = work.entry.numel
    out = torch.empty(numel, dtype=dtype)

    def merging(queue: "Shared | Collection[int] | None", contexts: list["TensorContext"],
                forks: list[list["StatsPass"]]) -> Callable[[int], tuple[dict[int, Extremes], set[int]]]:
        def lane(j: int) -> tuple[dict[int, Extremes], set[int]]:
            mine = [f[j] for f in forks]
            extremes: dict[int, Extremes] = {}
            again: set[int] = set()  # pieces merged with a provisional statistic that may turn out wrong
            for start, k, b, stack in pieces(only=queue):
                merged = method.merge(b, stack, params, replace(contexts[j], offset=start)).add_(b)
                lo, hi = torch.aminmax(merged)  # while the piece is in cache
                extremes[start] = (lo, hi)
                out[start:start + k] = merged
                if any([p.piece_done() for p in mine]):  # a list: every pass hears of every piece
                    again.add(start)
            return extremes, again
        return lane

    extremes: dict[int, Extremes] = {}
    again: set[int] = set()
    for e, a in lanes.run(merging(queue, contexts, forks), n_lanes, stop=queue.stop if queue is not None else None):
        extremes.update(e)
        again |= a
    for p, f in zip(during, forks):
        for other in f[1:n_lanes]:
            p.join(other)
        p.finish(ctx.stats)
    if again and not all(p.confirmed(ctx.stats) for p in during):
        # merged again with the learned statistics, in lanes too (on bf16 weights ties are common: a tensor
        # whose majority is -1 may merge most of its pieces twice)
        n_again = lanes.count(work.job.lanes, len(again))
        shared_again = lanes.Shared(sorted(again)) if n_again > 1 else None
        contexts = [replace(ctx, stats=ChainMap({}, ctx.stats)) for _ in range(n_again)]
        stop = shared_again.stop if shared_again is not None else None
        for e, _ in lanes.run(merging(shared_again if shared_again is not None else again, contexts, []), n_again,
                              stop=stop):
            extremes.update(e)
    # NaN/inf in an input or the result propagates to the extremes (NaN fails the test); a value beyond
    # the output dtype's range might round to inf: the dense path decides (and names the overflow)
    peak = float(torch.stack([x for pair in extremes.values() for x in pair]).abs().max()) if extremes else 0.0
    if not peak <= torch.finfo(dtype).max:
        return None
    return out.view(tuple(work.entry.shape))


def _stacked(work: "TensorWork", coefs: list[float]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(P, Q)`` with Σ cᵢ τᵢ = P @ Q, or None if some input is not low-rank (or all are zero) here."""
    fs = work.input_factors()
    if fs is None:
        return None
    ps, qs = [], []
    for c, f in zip(coefs, fs):
        if f is None or c == 0:
            continue
        ps.append(f[0] * c)
        qs.append(f[1])
    if not ps:
        return None
    return torch.cat(ps, 1), torch.cat(qs, 0)
