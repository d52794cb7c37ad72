"""Linear algebra shared by methods and sinks: thin SVDs of products, PSD solves, chunked Grams.

Everything here is plain tensor math (no I/O, no knowledge of models). Small LAPACK
calls run on one thread (:func:`single_thread`): at these sizes threading only costs,
badly so on a busy machine. Large independent ones (a method's several eigen-decompositions of one
tensor) run side by side on threads of their own, one LAPACK thread each (:func:`run_jobs`).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from threadpoolctl import ThreadpoolController


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
def single_thread() -> Iterator[None]:
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
    return float(sum(float(c.double().square().sum()) for c in torch.split(x, CHUNK, dim=1)))


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
    for c in torch.split(x, CHUNK, dim=1):
        c = c.double()
        g.addmm_(c, c.T)
    return g


def mm_t_chunked(u: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``uᵀ @ x`` in float64 (u: m×r float64, x: m×n), over column chunks of x."""
    return torch.cat([u.T @ c.double() for c in torch.split(x, CHUNK, dim=1)], dim=1)


def mm_chunked(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``x @ v`` in float64 (x: m×n, v: n×r float64), over row chunks of x."""
    return torch.cat([c.double() @ v for c in torch.split(x, CHUNK, dim=0)], dim=0)


# --- thin SVDs from the smaller Gram matrix's eigen-decomposition, in float64 ---------------------------------

GRAM_CHUNK = 1024
"""Columns of the long side converted to float64 at a time by :func:`small_gram` and :func:`other_side`."""


def small_gram(X: torch.Tensor, chunk: int = GRAM_CHUNK, syrk: bool = False) -> torch.Tensor:
    """The lower triangle of X Xᵀ (X: p × q, p ≤ q) in float64, X converted ``chunk`` columns at a time, in 2×2
    blocks: three of the four products (LAPACK's ``syevd`` reads one triangle). The upper triangle is 0.

    ``syrk``: a CPU ``X`` converted whole and its Gram taken by BLAS's ``syrk`` as numpy calls it (one triangle:
    half the products; the caller holds :func:`blas_one_thread`); both triangles are then filled.

    Example:
        >>> X = torch.randn(5, 9)
        >>> K = small_gram(X)
        >>> torch.allclose(K, torch.tril(X.double() @ X.double().T))
        True
    """
    if syrk and X.device.type == "cpu":
        x = X.double().numpy()
        return torch.from_numpy(x @ x.T)
    p = X.shape[0]
    h = p // 2
    K = torch.zeros(p, p, dtype=torch.float64, device=X.device)
    for a in range(0, X.shape[1], chunk):
        c = X[:, a:a + chunk].double()
        if h:
            K[:h, :h].addmm_(c[:h], c[:h].mT)
            K[h:, :h].addmm_(c[h:], c[:h].mT)
            K[h:, h:].addmm_(c[h:], c[h:].mT)
        else:
            K.addmm_(c, c.mT)
    return K.tril_() if h else K


def eigh_descending(K: torch.Tensor, openblas: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """σ = √λ (clamped at 0) and the eigenvectors of the symmetric ``K`` (lower triangle read), largest first.

    ``openblas``: LAPACK's ``syevd`` as numpy ships it (OpenBLAS) instead of torch's (MKL), for a CPU ``K``; the
    caller holds :func:`blas_one_thread`. Measured on one core of the benchmarks' AMD EPYC, 2048 × 2048 float64:
    1.2-1.3 CPU-s against 2.0-2.1 (MKL's eigenvalues alone take 0.5 s: its divide and conquer is the slow part);
    the eigenvalues agree to 5e-16 of the largest."""
    if openblas and K.device.type == "cpu":
        lam_np, W_np = np.linalg.eigh(K.numpy(), UPLO="L")
        lam, W = torch.from_numpy(lam_np), torch.from_numpy(W_np)
    else:
        lam, W = torch.linalg.eigh(K, UPLO="L")
    return lam.flip(0).clamp_(min=0).sqrt_(), W.flip(1)


@contextlib.contextmanager
def blas_one_thread() -> Iterator[None]:
    """numpy's BLAS and LAPACK (OpenBLAS) on one thread while the block runs, process-wide (``threadpoolctl``):
    :func:`run_jobs` keeps torch's at one thread per job, but OpenBLAS's thread count is the process's, and two
    jobs each starting OpenBLAS's threads would contend for the same cores."""
    global _BLAS_CONTROLLER
    if _BLAS_CONTROLLER is None:  # the loaded libraries, scanned once (numpy's OpenBLAS is loaded with numpy)
        _BLAS_CONTROLLER = ThreadpoolController()
    with _BLAS_CONTROLLER.limit(limits=1, user_api="blas"):
        yield


_BLAS_CONTROLLER: Any = None  # threadpoolctl.ThreadpoolController (untyped package), made on first use


def other_side(X: torch.Tensor, W: torch.Tensor, s: torch.Tensor, dtype: torch.dtype,
               chunk: int = GRAM_CHUNK, out: torch.Tensor | None = None, start: int = 0,
               stop: int | None = None) -> torch.Tensor:
    """Xᵀ W Σ⁻¹ (q × k) in float64, returned in ``dtype``: the other side's singular vectors; columns with σ = 0
    are 0. ``out``, ``start``, ``stop``: only rows ``start:stop`` (``start`` a multiple of ``chunk``), written into
    ``out``; each chunk's rows are the same whatever the range."""
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    O = torch.empty(X.shape[1], W.shape[1], dtype=dtype, device=X.device) if out is None else out
    stop = X.shape[1] if stop is None else stop
    for a in range(start, stop, chunk):
        z = min(a + chunk, stop)
        O[a:z] = (X[:, a:z].double().mT @ W).mul_(inv)
    return O


def thin_svd_gram(A: torch.Tensor, dtype: torch.dtype | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``U, s, V`` (A ≈ U diag(s) Vᵀ; U: m × p, V: n × p, p = min(m, n); s float64, descending) from the float64
    eigen-decomposition of A's smaller Gram matrix, the vectors in ``dtype`` (default A's).

    Half a float64 SVD's time on the CPU (``benchmarks/results/seed_methods_cpu.md``); squaring costs the σ's
    below ~1e-8·σ_max their accuracy (their vectors are noise), so it serves callers that cut singular values at
    a float32 tolerance (max(m, n)·eps of float32 ≫ 1e-8), where the kept triplets are a float64 SVD's to ~1e-12.

    Example:
        >>> A = torch.randn(7, 4, dtype=torch.float64)
        >>> U, s, V = thin_svd_gram(A)
        >>> torch.allclose((U * s) @ V.T, A), torch.allclose(s, torch.linalg.svdvals(A))
        (True, True)
    """
    dtype = dtype or A.dtype
    wide = A.shape[0] <= A.shape[1]
    X = A if wide else A.mT
    s, W = eigh_descending(small_gram(X))
    O = other_side(X, W, s, dtype)
    W = W.to(dtype)
    return (W, s, O) if wide else (O, s, W)


# --- independent linear algebra side by side -----------------------------------------------------

@dataclass
class Job:
    """One step of :func:`run_jobs`: ``fn()``, once the jobs at the indices ``after`` are done."""

    fn: Callable[[], Any]
    after: Sequence[int] = ()


def run_jobs(jobs: Sequence[Job], threads: int | None = None) -> list[Any]:
    """Every job's result, in order; up to ``threads`` (default: torch's intra-op threads) at once, each on a
    thread of its own with torch (MKL, LAPACK) at one thread, a job starting once its ``after`` are done.

    Why not torch's own threads: LAPACK's eigen-solvers and SVDs use two cores poorly (half their work is
    matrix-vector products), and under load their OpenMP threads spin: measured on 2 shared cores, three
    2048×2048 float64 SVDs took 29 s on one thread and 99 s on two. Independent calls side by side keep each
    core on its own call. Every job runs on one thread whatever ``threads`` is, so results do not depend on
    it. ``jobs`` must be listed in an order that runs (each after its ``after``); earlier jobs start first.

    Example:
        >>> run_jobs([Job(lambda: 2), Job(lambda: 3), Job(lambda: 4, after=(0, 1))], threads=2)
        [2, 3, 4]
    """
    n = torch.get_num_threads() if threads is None else threads
    if n <= 1 or len(jobs) <= 1:
        with single_thread():
            return [job.fn() for job in jobs]
    results: list[Any] = [None] * len(jobs)
    pending = list(range(len(jobs)))
    done: set[int] = set()
    running: dict[Future[Any], int] = {}
    pool = one_thread_pool(n, "hubsoup-linalg")
    try:
        while pending or running:
            for i in list(pending):
                if len(running) >= n:
                    break
                if all(d in done for d in jobs[i].after):
                    running[pool.submit(jobs[i].fn)] = i
                    pending.remove(i)
            if not running:
                raise ValueError("run_jobs: a job waits for one that never runs (list them in an order that runs)")
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in finished:
                i = running.pop(f)
                results[i] = f.result()
                done.add(i)
    except BaseException:  # a job failed or this thread was interrupted: none may still write when it returns
        for f in running:
            f.cancel()
        wait(running)
        raise
    return results


_POOLS: dict[tuple[int, int, str], ThreadPoolExecutor] = {}
_POOL_LOCK = threading.Lock()


def one_thread_pool(n: int, name: str) -> ThreadPoolExecutor:
    """``n`` threads named ``name``, each with torch at one thread, kept for every call (starting threads per
    tensor cost ~1 s over a 1B model); a forked child makes its own (its parent's threads do not exist there).
    Pools of different names are distinct: a job started from one never waits for a thread of its own pool."""
    key = (os.getpid(), n, name)
    with _POOL_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            default = torch.get_num_threads()
            pool = ThreadPoolExecutor(n, thread_name_prefix=name, initializer=_one_thread)
            started = threading.Barrier(n + 1)
            try:
                for _ in range(n):  # every thread started (each waits for the others), so each ran _one_thread
                    pool.submit(_wait, started)
                started.wait()
            except BaseException:  # interrupted while the threads start: none may stay waiting (exit would hang)
                started.abort()
                pool.shutdown(wait=False, cancel_futures=True)
                raise
            # set_num_threads also sets the default that threads started later take up: the process's again
            torch.set_num_threads(default)
            _POOLS[key] = pool
        return pool


def _wait(barrier: threading.Barrier) -> None:
    try:
        barrier.wait()
    except threading.BrokenBarrierError:  # the start was interrupted (abort): this thread just ends
        pass


def _one_thread() -> None:
    torch.get_num_threads()  # torch's lazy per-thread setup first: it would undo what follows
    torch.set_num_threads(1)


# --- symmetric positive (semi)definite systems -----------------------------------------------------

def cg_solve(G: torch.Tensor | Callable[[torch.Tensor], torch.Tensor], rhs: torch.Tensor, *, ridge: float = 0.0,
             tol: float = 1e-14, max_iter: int = 60) -> tuple[torch.Tensor, dict[str, Any]]:
    """Conjugate gradients on (G + ridge·I) x = rhs, G symmetric PSD, in G's dtype (float64 for an exact solve).
    ``G`` may instead be the function v ↦ G v (float64), for a G never formed.

    Returns ``x`` and ``{"iterations", "converged", "kappa", "residual"}``: ``kappa`` is the ratio of the
    extreme eigenvalues of the Lanczos matrix the iterations build (a lower bound on κ(G) that the extreme
    eigenvalues reached by ``rhs`` approach within a few iterations), ``residual`` the true relative residual
    ‖rhs − (G + ridge·I)x‖/‖rhs‖ recomputed at the end. ``converged``: the residual reached ``tol`` within
    ``max_iter`` iterations. A caller takes ``x`` as the exact solution when it converged and ``kappa`` is
    small (relative error ≤ κ·residual), else solves directly. Nearly orthogonal tasks give G ≈ I: a few
    iterations of r² work where a Cholesky factor takes r³/3.

    Example:
        >>> G = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
        >>> x, info = cg_solve(G, torch.tensor([1.0, 2.0], dtype=torch.float64))
        >>> info["converged"], torch.allclose(G @ x, torch.tensor([1.0, 2.0], dtype=torch.float64))
        (True, True)
    """
    matvec = G.__matmul__ if isinstance(G, torch.Tensor) else G
    b = rhs.to(G.dtype if isinstance(G, torch.Tensor) else torch.float64)
    bnorm = float(torch.linalg.vector_norm(b))
    x = torch.zeros_like(b)
    if bnorm == 0.0:
        return x, {"iterations": 0, "converged": True, "kappa": 1.0, "residual": 0.0}

    def apply(v: torch.Tensor) -> torch.Tensor:
        out = matvec(v)
        return out.add_(v, alpha=ridge) if ridge else out

    r = b.clone()
    p = r.clone()
    rr = float(r @ r)
    alphas: list[float] = []
    betas: list[float] = []
    converged = False
    for _ in range(max_iter):
        Gp = apply(p)
        pGp = float(p @ Gp)
        if not pGp > 0.0:  # a direction G does not see (singular G) or not a number: not this solver's case
            break
        alpha = rr / pGp
        x.add_(p, alpha=alpha)
        r.sub_(Gp, alpha=alpha)
        rr_new = float(r @ r)
        alphas.append(alpha)
        if math.sqrt(rr_new) <= tol * bnorm:
            converged = True
            break
        beta = rr_new / rr
        betas.append(beta)
        p.mul_(beta).add_(r)
        rr = rr_new
    k = len(alphas)
    kappa = math.inf
    if k:  # the Lanczos matrix of the iterations: its extreme eigenvalues estimate G's from inside
        T = torch.zeros(k, k, dtype=torch.float64)
        for j in range(k):
            T[j, j] = 1.0 / alphas[j] + (betas[j - 1] / alphas[j - 1] if j else 0.0)
            if j + 1 < k:
                T[j, j + 1] = T[j + 1, j] = math.sqrt(betas[j]) / alphas[j]
        ev = torch.linalg.eigvalsh(T)
        kappa = float(ev[-1] / ev[0]) if float(ev[0]) > 0 else math.inf
    residual = float(torch.linalg.vector_norm(b - apply(x))) / bnorm
    return x, {"iterations": k, "converged": converged and residual <= 10 * tol, "kappa": kappa,
               "residual": residual}
