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
* **Dense**: every other case — the method's :meth:`~hubsoup.methods.Method.merge` on the stack.

Low-rank outcomes are offered only where the consumer takes them (``lowrank_ok``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import torch

from hubsoup.methods._schedule import resolve_params

if TYPE_CHECKING:
    from hubsoup.engine import TensorWork


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


Outcome = Union[Copy, Unchanged, LowRank, Dense]


def decide(work: "TensorWork", *, lowrank_ok: bool = True) -> Outcome:
    """The cheapest way to the merged task vector of ``work``'s tensor (see the module docs)."""
    job, entry = work.job, work.entry
    method = job.method
    if not entry.mergeable:
        return Copy()
    # per-layer schedules and name filters resolved for this tensor: the method sees plain numbers
    params = resolve_params(job.params, entry.name, work.position)  # t: its block's, or its slice's
    if method.preserves_zero(params) and work.untouched():
        return Unchanged()
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
