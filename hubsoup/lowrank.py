"""Merging without the dense (N, *shape) stack when the inputs of a tensor are low-rank.

The engine's general path materialises every input's task vector of a tensor densely
and stacks them (``(N, *shape)`` float32). When the inputs are LoRA adapters that is
wasteful, and for two cases it is avoided:

* **Untouched tensors**: no input changes the tensor (a LoRA that does not adapt it
  has τ = 0). For any method with ``zero_preserving`` (all-zero task vectors merge to
  zero; true of every built-in method and the default of :class:`~hubsoup.methods.Method`)
  the result is the base tensor, which is written without allocating anything else.
* **Linear methods on low-rank inputs**: methods whose merged task vector is a fixed
  linear combination Σ cᵢ τᵢ (``linear``, ``task_arithmetic``, ``wise_ft``: those that
  implement :meth:`~hubsoup.methods.Method.linear_coefficients`) and inputs that are all
  plain LoRA updates for the tensor (or untouched: a full fine-tune, a DoRA or a saved
  full tensor is not). Then Σ cᵢ τᵢ = [c₁P₁ … c_NP_N] @ [Q₁; …; Q_N], the stacked
  factors of total rank Σ rᵢ. The full-checkpoint output forms only base + P @ Q (one
  dense tensor, no stack); the LoRA output (``hubsoup.lora_out``) never forms anything
  larger than (out + in) × Σ rᵢ: it takes the SVD of the stacked factors through two
  thin QR decompositions.

* **Methods with their own low-rank path**: a method defining
  ``merge_factors(shape, factors, params, ctx)`` gets, for a 2-D tensor every input updates by
  a plain LoRA or leaves alone, the list of ``(Pᵢ, Qᵢ)`` (None for an untouched input) and
  returns the merged τ, or None for the dense path. ``ctx.stats`` is empty there. SFTM uses
  it to take each task matrix's SVD from its factors.

Every other method (``ties``, ``dare``, ``consensus``, ``slerp``, ...) is element-wise
non-linear in the task vectors, so it gets the dense stack as usual.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch

from hubsoup.errors import NonFiniteTensorError
from hubsoup.sources.deltas import all_finite


def linear_coefficients(method, params: Any, n_inputs: int) -> list[float] | None:
    """The cᵢ with merged τ = Σ cᵢ τᵢ, if the method is linear in the task vectors (else None)."""
    fn = getattr(method, "linear_coefficients", None)
    if fn is None or _owner(type(method), "linear_coefficients") is not _owner(type(method), "merge"):
        return None  # a subclass that changed merge() but not linear_coefficients(): trust neither
    return fn(params, n_inputs)


def _owner(cls: type, attr: str) -> type | None:
    return next((c for c in cls.__mro__ if attr in vars(c)), None)


def untouched(sources: Sequence, name: str) -> bool:
    """True when every source says it leaves tensor ``name`` unchanged (τ = 0)."""
    return all(getattr(s, "touches", None) is not None and not s.touches(name) for s in sources)


def stacked_factors(sources: Sequence, name: str, coefs: Sequence[float],
                    device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(P, Q)`` with Σ cᵢ τᵢ = P @ Q for a 2-D tensor, or None if some input is not low-rank there."""
    ps, qs = [], []
    for c, src in zip(coefs, sources):
        touches, factors = getattr(src, "touches", None), getattr(src, "factors", None)
        if touches is None or factors is None:
            return None
        if not touches(name) or c == 0:
            continue
        f = factors(name)
        if f is None:
            return None
        ps.append(f[0].to(device) * c)
        qs.append(f[1].to(device))
    if not ps:
        return None
    return torch.cat(ps, 1), torch.cat(qs, 0)


def input_factors(sources: Sequence, name: str, device: str | torch.device = "cpu"
                  ) -> list[tuple[torch.Tensor, torch.Tensor] | None] | None:
    """Per input, ``(P, Q)`` with τᵢ = P @ Q (None: τᵢ = 0), or None if some input is not low-rank there."""
    out = []
    for src in sources:
        touches, factors = getattr(src, "touches", None), getattr(src, "factors", None)
        if touches is None or factors is None:
            return None
        if not touches(name):
            out.append(None)
            continue
        f = factors(name)
        if f is None:
            return None
        out.append((f[0].to(device), f[1].to(device)))
    return out


def merge_without_stack(job, block, entry) -> torch.Tensor | None:
    """The merged weight (base + τ, float32) of ``entry`` if it can be had without the stack.

    None means: use the engine's general path.
    """
    method = job.method
    if untouched(job.inputs, entry.name) and getattr(method, "zero_preserving", False):
        return _base(job, block, entry)
    if len(entry.shape) != 2:
        return None
    if getattr(method, "merge_factors", None) is not None:  # a method with its own low-rank path (SFTM)
        fs = input_factors(job.inputs, entry.name, block.device)
        if fs is not None:
            from hubsoup.methods.base import TensorContext

            ctx = TensorContext(entry.name, block.info, len(job.inputs), {}, job.recipe_hash)
            tau = method.merge_factors(tuple(entry.shape), fs, job.params, ctx)
            if tau is not None:
                return tau.add_(_base(job, block, entry))
    coefs = linear_coefficients(method, job.params, len(job.inputs))
    if coefs is None:
        return None
    f = stacked_factors(job.inputs, entry.name, coefs, block.device)
    if f is None:
        return None
    base = _base(job, block, entry)
    return torch.addmm(base, *f)  # not in place: a float32 base read may share storage with the source


def _base(job, block, entry) -> torch.Tensor:
    base = job.base.tensor(entry.name).to(block.device, torch.float32)
    if not all_finite(base):
        raise NonFiniteTensorError(f"base '{job.base.label}': tensor '{entry.name}' has NaN/inf values")
    return base


def svd_of_product(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD ``U, S, Vh`` of ``p @ q`` (p: m×k, q: k×n) without forming the m×n product.

    ``p = Q_p R_p`` and ``qᵀ = Q_q R_q`` (thin QR), so ``p q = Q_p (R_p R_qᵀ) Q_qᵀ`` and the
    SVD of the k×k core gives the rest. Computed in float64 (the factors are small), on one
    thread: LAPACK calls this small only lose to threading overhead (badly on a busy machine).
    """
    with single_thread():
        p64, q64 = p.double(), q.double()
        qp, rp = torch.linalg.qr(p64)
        qq, rq = torch.linalg.qr(q64.T)
        u, s, vh = torch.linalg.svd(rp @ rq.T, full_matrices=False)
        return qp @ u, s, vh @ qq.T


@contextlib.contextmanager
def single_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
