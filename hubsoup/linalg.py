"""Linear algebra shared by methods and sinks: thin SVDs of products, PSD solves, chunked Grams.

Everything here is plain tensor math (no I/O, no knowledge of models). Small LAPACK
calls run on one thread (:func:`single_thread`): at these sizes threading only costs,
badly so on a busy machine.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


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


# --- dense matrices in column/row chunks: float64 accuracy without a float64 copy of the matrix ---

CHUNK = 4096


def sq_norm_chunked(x: torch.Tensor) -> float:
    """‖x‖²_F in float64, over column chunks of the 2-D ``x``."""
    return float(sum(float(c.double().square().sum()) for c in x.split(CHUNK, dim=1)))


DOT_BLOCK = 4096
"""Entries per partial sum of :func:`block_sums`; a piece of a tensor merged in pieces starts at a multiple."""


def block_sums(x: torch.Tensor, y: torch.Tensor | None = None, absolute: bool = False,
               chunk: int = 1 << 20, once: bool | None = None) -> list[float]:
    """Σ x (Σ x·y with ``y``; Σ |x| with ``absolute``) of each block of :data:`DOT_BLOCK` consecutive
    entries (the last may be shorter), in float64.

    A block's sum does not depend on torch's thread count (it is one row of a row-wise reduction), nor on
    where a piece of the flattened tensors starts, if at a multiple of the block: the exactly rounded
    sum of the blocks' sums (``math.fsum``) is then the same over the whole tensor or over its pieces,
    in any order. Converted ``chunk`` entries at a time (no float64 copy of the tensor). ``once``: read the
    sums back once at the end instead of per chunk (default: off the CPU, where each read-back is a sync).

    Example:
        >>> import math
        >>> x = torch.arange(10000.0)
        >>> math.fsum(block_sums(x, x)) == math.fsum(block_sums(x[:4096], x[:4096]) + block_sums(x[4096:], x[4096:]))
        True
    """
    on_device = x.device.type != "cpu" if once is None else once
    if x.device.type != "cpu":  # each op a launch there: a float64 chunk of 128 MiB, not 8
        chunk = max(chunk, 1 << 24)
    if on_device:  # an accelerator's block sums, read back once at the end
        return block_sums_t(x, y, absolute, chunk).tolist()
    x = x.reshape(-1)
    y = None if y is None else y.reshape(-1)
    out: list[float] = []
    for c in _float64_chunks(x, y, absolute, chunk):
        full = c.numel() // DOT_BLOCK * DOT_BLOCK
        out += c[:full].view(-1, DOT_BLOCK).sum(1).tolist()
        if full < c.numel():
            out.append(float(c[full:].sum()))
    return out


def block_sums_t(x: torch.Tensor, y: torch.Tensor | None = None, absolute: bool = False,
                 chunk: int = 1 << 24) -> torch.Tensor:
    """:func:`block_sums` left on ``x``'s device (a float64 tensor, nothing read back): an accelerator's caller
    gathers several and reads them back at once (``torch.cat(...).tolist()``), the same values."""
    x = x.reshape(-1)
    parts: list[torch.Tensor] = []
    for c in _float64_chunks(x, None if y is None else y.reshape(-1), absolute, chunk):
        full = c.numel() // DOT_BLOCK * DOT_BLOCK
        parts.append(c[:full].view(-1, DOT_BLOCK).sum(1))
        if full < c.numel():
            parts.append(c[full:].sum().reshape(1))
    return torch.cat(parts) if parts else x.new_zeros(0, dtype=torch.float64)


def _float64_chunks(x: torch.Tensor, y: torch.Tensor | None, absolute: bool, chunk: int) -> Iterator[torch.Tensor]:
    """``x`` (|x|, x·y) in float64, ``chunk`` entries at a time (a multiple of :data:`DOT_BLOCK`)."""
    chunk = max(DOT_BLOCK, chunk // DOT_BLOCK * DOT_BLOCK)
    for a in range(0, x.numel(), chunk):
        c = x[a:a + chunk].double()
        if absolute:
            c.abs_()
        if y is not None:
            c.mul_(y[a:a + chunk].double())  # float32 products are exact in float64
        yield c


def gram_chunked(x: torch.Tensor) -> torch.Tensor:
    """``x @ xᵀ`` in float64, accumulated over column chunks (x: m×n, m ≤ n)."""
    g = torch.zeros(x.shape[0], x.shape[0], dtype=torch.float64, device=x.device)
    for c in x.split(CHUNK, dim=1):
        c = c.double()
        g.addmm_(c, c.T)
    return g


def mm_t_chunked(u: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``uᵀ @ x`` in float64 (u: m×r float64, x: m×n), over column chunks of x."""
    return torch.cat([u.T @ c.double() for c in x.split(CHUNK, dim=1)], dim=1)


def mm_chunked(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``x @ v`` in float64 (x: m×n, v: n×r float64), over row chunks of x."""
    return torch.cat([c.double() @ v for c in x.split(CHUNK, dim=0)], dim=0)
