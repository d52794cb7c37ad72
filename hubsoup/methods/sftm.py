"""SFTM: superpose the singular features of every task matrix (Qiu, Wu, Yao).

Per linear (or reshaped convolution) weight: trim each task matrix M_i to its
⌈η·m·n⌉ largest magnitudes, take its thin SVD M_i = Σ_k σ u vᵀ, and find the merged
M = Σ_a β_a u_a v_aᵀ (a running over every kept triplet of every task) that keeps
every task's singular response: u_aᵀ M v_a = σ_a. With G = (UᵀU) ⊙ (VᵀV), the Gram
matrix of the rank-1 components, that is the symmetric system G β = σ, which is the
paper's (G·diag σ) α = σ with β = σ ⊙ α (same M, better conditioned). When G is
nonsingular, M is the minimum-Frobenius-norm matrix meeting all constraints.

Solving stably (the paper gives no guidance) [ours]: G and σ in float64; Cholesky of
G + ridge·I; if that fails, if the Cholesky pivots say cond(G) > 1e10, or if the
residual is not tiny, fall back to the eigen-decomposition pseudo-inverse that drops
eigenvalues below ``rcond``·λ_max: the minimum-norm least-squares solution. Duplicate
tasks (singular G) are then averaged, not added.

LoRA inputs: when every input's update of a matrix is a plain LoRA (τᵢ = PᵢQᵢ), the
singular triplets come from the factors (thin QRs of Pᵢ and Qᵢᵀ, then a ρ×ρ SVD) and
ΔW is never formed; the paper does not say whether LoRA products were trimmed, and
trimming destroys their low rank, so by default they are not (``lora_trim=true``
trims the dense B·A with η instead). Inputs mixing full fine-tunes and LoRAs take the
dense path, where every task matrix is trimmed with η.

In a search over γ alone, the points share each matrix's unscaled superposition (kept on disk by the
first point, :meth:`PrepareContext.keep_tensors`): γ scales it last, so every point is the merge it
would be on its own, bit for bit, for one set of SVDs and solves.

Non-matrix tensors follow Alg. 2: trim each τ_i to its top-η entries, then biases and
embeddings take γ·Σ τ_i (task arithmetic) and normalisation parameters take the
plain mean of the τ_i, without γ.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Hashable, Literal, Sequence

import torch

from hubsoup.arch import tensor_role
from hubsoup.linalg import (GRAM_CHUNK, Job, blas_one_thread, cg_solve, eigh_descending, other_side, run_jobs,
                            single_thread, small_gram)
from hubsoup.methods import Method, param, register
from hubsoup.methods._kernels import keep_topk_

if TYPE_CHECKING:
    from hubsoup.methods import PrepareContext, TensorContext
    from hubsoup.methods._kept import KeptTensors

log = logging.getLogger(__name__)

COND_LIMIT = 1e10
"""Above this (lower bound from the Cholesky pivots) the pseudo-inverse path is used."""


def keep_count(fraction: float, numel: int) -> int:
    """⌈fraction·numel⌉, robust to float noise (0.2·10 is 2, not 3)."""
    return min(numel, math.ceil(round(fraction * numel, 9)))


def trim_topk_(x: torch.Tensor, fraction: float) -> torch.Tensor:
    """In place: keep exactly ⌈fraction·numel⌉ largest |x|, zero the rest.

    Ties at the threshold are broken by flat index (lowest first), so the count is
    exact and reruns are identical (:func:`~._kernels.keep_topk_`, tie rule ``"first_index"``).
    """
    return keep_topk_(x, keep_count(fraction, x.numel()), ties="first_index")


@dataclass
class Features:
    """Kept singular triplets of one task matrix: M ≈ U diag(s) Vᵀ."""

    U: torch.Tensor  # (m, r)
    s: torch.Tensor  # (r,)
    V: torch.Tensor  # (n, r)


def _drop_small(U: torch.Tensor, s: torch.Tensor, V: torch.Tensor, shape: Sequence[int],
                rank_tol: float | None) -> Features:
    if s.numel() == 0 or float(s[0]) == 0.0:
        return Features(U[:, :0], s[:0], V[:, :0])
    tol = rank_tol if rank_tol is not None else max(shape) * torch.finfo(s.dtype).eps
    keep = s > tol * s[0]
    return Features(U[:, keep], s[keep], V[:, keep])


def singular_features(M: torch.Tensor, rank_tol: float | None = None) -> Features:
    """Thin SVD of ``M`` with numerically zero singular values dropped.

    ``rank_tol`` is relative to σ_max; by default max(m, n)·eps of the dtype (numpy's
    matrix_rank rule). A zero-σ triplet would add the constraint uᵀMv = 0 and erase
    other tasks' features in that direction.
    """
    # the SVD in float64, its factors back in M's dtype: LAPACK and cuSOLVER then agree to rounding
    U, s, Vh = (t.to(M.dtype) for t in torch.linalg.svd(M.double(), full_matrices=False))
    return _drop_small(U, s, Vh.mH, M.shape, rank_tol)


def singular_features_batched(mats: torch.Tensor, rank_tol: float | None = None) -> list[Features]:
    """:func:`singular_features` of every matrix of the ``(N, m, n)`` stack, in one float32 SVD call: the
    device path (an accelerator's float64 SVD is many times slower; see :data:`FLOAT32_SVD_TOL` for what
    it costs in accuracy). The superposition's Gram system is still solved in float64 (:func:`solve_gram`)."""
    U, s, Vh = torch.linalg.svd(mats.float(), full_matrices=False)
    return [_drop_small(U[i].to(mats.dtype), s[i].to(mats.dtype), Vh[i].mH.to(mats.dtype), tuple(mats.shape[1:]),
                        rank_tol) for i in range(mats.shape[0])]


def singular_features_gram(mats: torch.Tensor, rank_tol: float | None = None) -> list[Features]:
    """:func:`singular_features_batched` from the eigen-decomposition of each matrix's smaller Gram matrix, in
    float64: M Mᵀ = U Σ² Uᵀ (or MᵀM = V Σ² Vᵀ), then V = MᵀU Σ⁻¹ (U = M V Σ⁻¹). An accelerator's symmetric
    eigen-solver is several times faster than its SVD; squaring costs σ's below ~1e-8·σ_max, far under the
    rank cut-off (max(m, n)·eps of float32), so the kept triplets are those of a float64 SVD to ~1e-12."""
    m, n = mats.shape[-2:]
    a = mats.double()
    wide = m <= n
    lam, W = torch.linalg.eigh(a @ a.mT if wide else a.mT @ a)  # ascending
    lam, W = lam.flip(-1), W.flip(-1)
    s = lam.clamp_(min=0).sqrt_()
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s)).unsqueeze(-2)
    other = (a.mT @ W if wide else a @ W).mul_(inv)  # V (or U): the other side's singular vectors
    U, V = (W, other) if wide else (other, W)
    return [_drop_small(U[i].to(mats.dtype), s[i].to(mats.dtype), V[i].to(mats.dtype), (m, n), rank_tol)
            for i in range(mats.shape[0])]


DEVICE_SVD = os.environ.get("HUBSOUP_SFTM_SVD", "gram")
"""How an accelerator takes the task matrices' singular triplets: ``"gram"`` (float64 eigen-decompositions of
the Gram matrices, :func:`singular_features_gram`) or ``"svd"`` (one batched float32 SVD,
:func:`singular_features_batched`). Measured on an H200 (``benchmarks/results/gpu_probe.json``, three trimmed
task matrices of 2048×2048): 0.084 s and a merged matrix within 9e-7 of the CPU's float64 SVDs, against
0.66 s and 2e-3 for the float32 SVD. The environment variable is a measurement aid."""


CPU_PATH = os.environ.get("HUBSOUP_SFTM_CPU", "eigh")
"""How the CPU merges a matrix: ``"eigh"`` (:func:`superpose_eigh`: float64 eigen-decompositions of the Gram
matrices, the system solved by conjugate gradients when it is well conditioned, independent steps side by
side on the cores) or ``"svd"`` (one float64 SVD per task matrix and a Cholesky solve, as before 0.2: a
measurement aid, ``benchmarks/bench_seed_methods.py``). The environment variable is read at import."""


FLOAT32_SVD_TOL = 5e-5
"""Relative Frobenius error of a merged matrix from float32 SVDs against float64 ones that tests allow
(``tests/methods/test_sftm.py``, trimmed random task matrices, 2-4 correlated tasks, up to 1024×512: measured
3e-6 to 7e-6 on the CPU)."""


F32_GRAM_KAPPA = 2.0
"""κ(G) up to which :func:`superpose_eigh` keeps the Gram matrix's blocks from float32 products (twice as fast as
float64): each entry is then off by float32 rounding (~1e-7 relative), and β = G⁻¹σ by at most κ times that.
Measured (``tests/methods/test_sftm.py``): κ 1.0-1.05 moved the merged matrix by ~1e-7 (Frobenius, relative), κ = 332 by
1.4e-6; above this κ the blocks are recomputed in float64."""

CG_KAPPA = 1e4
"""κ(G) (Lanczos estimate) up to which conjugate gradients' solution is taken: relative error ≤ κ × its
residual (≤ 1e-13), far below float32 rounding. Above it, or without convergence, :func:`solve_gram` (Cholesky,
else the pseudo-inverse) solves as before."""

CG_MIN_RANK = 1024
"""Smaller systems are solved directly (:func:`solve_gram`): a Cholesky factor costs little there."""


class _EighTriplets:
    """One task matrix's kept singular triplets from the float64 eigen-decomposition of its smaller Gram matrix
    (:func:`hubsoup.linalg.thin_svd_gram`), in steps that :func:`superpose_eigh` runs as separate jobs:
    ``gram`` (X Xᵀ by BLAS's ``syrk``, X the matrix or its transpose with the short side first), ``eigen``
    (LAPACK's ``syevd`` as numpy ships it: OpenBLAS's takes 1.3 CPU-s at 2048 × 2048 where torch's MKL takes 2.0
    on this AMD machine; σ = √λ, the rank cut of :func:`singular_features` on σ in the matrix's dtype), ``other``
    (the other side's vectors, Xᵀ W Σ⁻¹, in float64; two jobs of half the rows each) and ``finish``.

    Accuracy: squaring costs σ's below ~1e-8·σ_max, far under the rank cut-off (max(m, n)·eps of float32: the
    triplets dropped and kept are a float64 SVD's), and the kept triplets are a float64 SVD's to ~1e-12
    (``tests/methods/test_sftm.py``). A float64 matrix (this package's exact tests) takes :func:`singular_features`: its
    cut (max(m, n)·eps of float64) lies below what squaring resolves. Cost on one core of the 1B benchmark's
    machine, 2048 × 5632: 2.6 s against 6.8 s for the float64 SVD (``syrk`` 0.5 s, ``syevd`` 1.3 s, the other
    side 0.85 s)."""

    def __init__(self, A: torch.Tensor, rank_tol: float | None):
        self.A, self.rank_tol = A, rank_tol
        self.wide = A.shape[0] <= A.shape[1]
        self.X = A if self.wide else A.mT  # p × q, p ≤ q: the Gram X Xᵀ is p × p
        self.features: Features | None = None

    def gram(self) -> None:
        if self.A.dtype != torch.float64:
            self.K = small_gram(self.X, syrk=True)

    def eigen(self) -> None:
        dtype = self.A.dtype
        if dtype == torch.float64:
            self.features = singular_features(self.A, self.rank_tol)
            return
        s64, W = eigh_descending(self.K, openblas=True)
        del self.K
        s = s64.to(dtype)
        if s.numel() == 0 or float(s[0]) == 0.0:
            keep = torch.zeros(s.numel(), dtype=torch.bool)
        else:  # as _drop_small: the cut on σ in the matrix's dtype
            tol = self.rank_tol if self.rank_tol is not None else max(self.A.shape) * torch.finfo(dtype).eps
            keep = s > tol * s[0]
        self.W = W[:, keep]
        self.s64, self.s = s64[keep], s[keep]
        self.O = torch.empty(self.X.shape[1], self.W.shape[1], dtype=dtype)

    def other(self, top: bool) -> None:
        """The first or second half of the other side's rows, split at a chunk of :func:`other_side`: two jobs
        (the last task's would otherwise run alone), the same values as one call."""
        if self.features is not None:
            return
        q = self.X.shape[1]
        mid = min(q, (-(-q // GRAM_CHUNK) + 1) // 2 * GRAM_CHUNK)
        other_side(self.X, self.W, self.s64, self.A.dtype, out=self.O, start=0 if top else mid,
                   stop=mid if top else q)

    def finish(self) -> None:
        if self.features is not None:
            return
        Wd = self.W.to(self.A.dtype)
        U, V = (Wd, self.O) if self.wide else (self.O, Wd)
        self.features = Features(U, self.s, V)
        del self.W, self.O


def superpose_eigh(mats: torch.Tensor, *, rank_tol: float | None = None, ridge: float = 0.0, rcond: float = 1e-10,
                   eta: float | None = None, threads: int | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """:func:`_superpose_eigh` with numpy's OpenBLAS (its eigen-decompositions) on one thread per job."""
    with blas_one_thread():
        return _superpose_eigh(mats, rank_tol=rank_tol, ridge=ridge, rcond=rcond, eta=eta, threads=threads)


def _superpose_eigh(mats: torch.Tensor, *, rank_tol: float | None = None, ridge: float = 0.0, rcond: float = 1e-10,
                    eta: float | None = None, threads: int | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """The CPU's :func:`superpose` of the ``(T, m, n)`` task matrices ``mats`` (trimmed here first, in place, when
    ``eta`` is given): the same merged matrix as the float64 SVDs' (:func:`singular_features`) to float32 rounding,
    the cheapest exact way found for each step (``benchmarks/results/seed_methods_cpu.md``):

    - triplets: :class:`_EighTriplets` (float64 Gram eigen-decompositions: half an SVD's time);
    - the Gram system: the blocks between tasks from float32 products when κ(G) ≤ :data:`F32_GRAM_KAPPA`, else
      float64; solved by conjugate gradients (:func:`hubsoup.linalg.cg_solve`: nearly orthogonal tasks make
      G ≈ I, a few r² iterations instead of an r³/3 factor; on the blocks, G never formed) when it converges with
      κ ≤ :data:`CG_KAPPA`, else by :func:`solve_gram` as before;
    - M = Σᵢ Uᵢ diag(βᵢ) Vᵢᵀ in ``mats``' dtype, in two fixed halves of rows;
    - the independent steps (trims, Grams, eigen-decompositions, halves of the other sides, halves of the rows of
      the products of each pair of tasks, the halves of M) side by side on ``threads`` (default: torch's), each on
      one BLAS/LAPACK thread (:func:`hubsoup.linalg.run_jobs`, numpy's OpenBLAS held at one thread by
      :func:`hubsoup.linalg.blas_one_thread`): the result does not depend on the thread count.
    """
    # long: one job graph over the tasks' steps (trims, Grams, eigen, other sides, blocks, solve, M); the closures
    # share its indices and the tasks' triplets, and split apart they would pass a dozen arguments each
    T, m, n = mats.shape
    dtype = mats.dtype
    exact = dtype == torch.float64  # float64 task matrices (tests): every product in float64
    tasks = [_EighTriplets(mats[i], rank_tol) for i in range(T)]
    jobs: list[Job] = []
    if eta is not None:
        jobs += [Job(functools.partial(trim_topk_, mats[i], eta)) for i in range(T)]
    base = len(jobs)
    jobs += [Job(t.gram, after=(i,) if eta is not None else ()) for i, t in enumerate(tasks)]
    jobs += [Job(t.eigen, after=(base + i,)) for i, t in enumerate(tasks)]
    jobs += [Job(functools.partial(t.other, top), after=(base + T + i,)) for i, t in enumerate(tasks)
             for top in (True, False)]
    jobs += [Job(t.finish, after=(base + 2 * T + 2 * i, base + 2 * T + 2 * i + 1)) for i, t in enumerate(tasks)]
    pairs = [(i, j) for i in range(T) for j in range(i + 1, T)]
    work_dtype = torch.float64 if exact else torch.float32

    def block(i: int, j: int, wd: torch.dtype) -> torch.Tensor | None:
        fi, fj = tasks[i].features, tasks[j].features
        assert fi is not None and fj is not None
        if not fi.s.numel() or not fj.s.numel():
            return None
        return (fi.U.to(wd).mT @ fj.U.to(wd)).mul_(fi.V.to(wd).mT @ fj.V.to(wd))

    def block_rows(i: int, j: int, wd: torch.dtype, top: bool) -> torch.Tensor | None:
        """The top or bottom half of :func:`block`'s rows: T(T-1) equal jobs, no lane idle at the end."""
        fi, fj = tasks[i].features, tasks[j].features
        assert fi is not None and fj is not None
        if not fi.s.numel() or not fj.s.numel():
            return None
        h = fi.s.numel() // 2
        rows = slice(0, h) if top else slice(h, None)
        return (fi.U[:, rows].to(wd).mT @ fj.U.to(wd)).mul_(fi.V[:, rows].to(wd).mT @ fj.V.to(wd))

    jobs += [Job(functools.partial(block_rows, i, j, work_dtype, top), after=(base + 4 * T + i, base + 4 * T + j))
             for i, j in pairs for top in (True, False)]
    halves = run_jobs(jobs, threads)[len(jobs) - 2 * len(pairs):]
    blocks = [None if a is None or b is None else torch.cat([a, b]) for a, b in zip(halves[::2], halves[1::2])]
    del halves
    feats = [f for f in (t.features for t in tasks) if f is not None]
    assert len(feats) == T
    sizes = [f.s.numel() for f in feats]
    r = sum(sizes)
    if r == 0:
        return torch.zeros(m, n, dtype=dtype), {"rank": 0}
    starts = [sum(sizes[:i]) for i in range(T)]
    s = torch.cat([f.s for f in feats]).double()

    def assemble(blks: Sequence[torch.Tensor | None]) -> torch.Tensor:
        G = torch.eye(r, dtype=torch.float64)
        for (i, j), blk in zip(pairs, blks):
            if blk is not None:
                G[starts[i]:starts[i] + sizes[i], starts[j]:starts[j] + sizes[j]] = blk
                G[starts[j]:starts[j] + sizes[j], starts[i]:starts[i] + sizes[i]] = blk.mT
        return G

    def gram_op(blks: list[torch.Tensor | None]) -> Callable[[torch.Tensor], torch.Tensor]:
        """v ↦ G v from the blocks between tasks (the diagonal blocks are identities): G is never formed."""
        def apply(v: torch.Tensor) -> torch.Tensor:
            out = v.clone()
            for (i, j), blk in zip(pairs, blks):
                if blk is not None:
                    si, sj = slice(starts[i], starts[i] + sizes[i]), slice(starts[j], starts[j] + sizes[j])
                    out[si].addmv_(blk, v[sj])
                    out[sj].addmv_(blk.mT, v[si])
            return out
        return apply

    blocks = [None if b is None else b.double() for b in blocks]  # float32 products are exact in float64
    info: dict[str, Any] = {"rank": r}
    beta = None
    if r >= CG_MIN_RANK:
        with single_thread():
            x, cg = cg_solve(gram_op(blocks), s, ridge=ridge)
        if not exact and not (cg["converged"] and cg["kappa"] <= F32_GRAM_KAPPA):  # the float64 products
            del blocks
            blocks = run_jobs([Job(functools.partial(block, i, j, torch.float64)) for i, j in pairs], threads)
            with single_thread():
                x, cg = cg_solve(gram_op(blocks), s, ridge=ridge)
            info["gram"] = "float64"
        else:
            info["gram"] = "float64" if exact else "float32"
        if cg["converged"] and cg["kappa"] <= CG_KAPPA:
            beta = x
            info.update(solver="cg", cond=cg["kappa"], iterations=cg["iterations"])
    elif not exact:  # a direct solve: the float64 products, as superpose takes them
        del blocks
        blocks = run_jobs([Job(functools.partial(block, i, j, torch.float64)) for i, j in pairs], threads)
    if beta is None:
        G = assemble(blocks)
        del blocks
        beta, solved = solve_gram(G, s, ridge=ridge, rcond=rcond)
        info.update(solved)
        del G
    else:
        del blocks
    b = beta.to(dtype)
    V = torch.cat([f.V for f in feats], dim=1)  # superpose takes it: its rounding, not a sum of T products
    for t in tasks:  # the per-task copies: feats holds them until M is made
        t.features = None
    M = torch.empty(m, n, dtype=dtype)
    half = m // 2  # fixed halves: the same products whatever the thread count

    def rows(a: int, z: int) -> None:  # U diag(β) (one product over every triplet, as superpose takes it)
        torch.mm(torch.cat([f.U[a:z] for f in feats], dim=1).mul_(b), V.mT, out=M[a:z])

    run_jobs([Job(lambda: rows(0, half)), Job(lambda: rows(half, m))], threads)
    return M, info


def lora_features(B: torch.Tensor, A: torch.Tensor, scale: float = 1.0,
                  rank_tol: float | None = None) -> Features:
    """Singular triplets of ΔW = scale·B·A without forming ΔW (B: m×ρ, A: ρ×n).

    B = Q_B R_B and Aᵀ = Q_A R_A (thin QR), SVD of scale·R_B R_Aᵀ = Ũ Σ Ṽᵀ, then
    U = Q_B Ũ and V = Q_A Ṽ: O((m+n)ρ²) instead of O(m·n·min(m,n)).
    """
    Qb, Rb = torch.linalg.qr(B)
    Qa, Ra = torch.linalg.qr(A.mH)
    u, s, vh = torch.linalg.svd(scale * (Rb @ Ra.mH))
    return _drop_small(Qb @ u, s, Qa @ vh.mH, (B.shape[0], A.shape[1]), rank_tol)


def solve_gram(G: torch.Tensor, rhs: torch.Tensor, *, ridge: float = 0.0,
               rcond: float = 1e-10) -> tuple[torch.Tensor, dict[str, Any]]:
    """Solve the symmetric PSD system (G + ridge·I) x = rhs in float64, stably.

    Cholesky first; the eigen pseudo-inverse (eigenvalues < rcond·λ_max dropped,
    i.e. the minimum-norm least-squares solution) when G is singular or too badly
    conditioned. Returns the solution and ``{"solver", "cond"}``.
    """
    G = G.to(torch.float64)
    rhs = rhs.to(torch.float64)
    if ridge > 0:
        G = G + ridge * torch.eye(G.shape[0], dtype=G.dtype, device=G.device)
    L, info = torch.linalg.cholesky_ex(G)
    if int(info) == 0:
        d = L.diagonal()
        cond_lb = float((d.max() / d.min()) ** 2) if float(d.min()) > 0 else math.inf
        if cond_lb <= COND_LIMIT:
            x = torch.cholesky_solve(rhs.unsqueeze(-1), L).squeeze(-1)
            resid = float(torch.linalg.vector_norm(G @ x - rhs))
            if resid <= 1e-8 * max(float(torch.linalg.vector_norm(rhs)), 1e-300):
                return x, {"solver": "cholesky", "cond": cond_lb}
    w, Q = torch.linalg.eigh(G)
    wmax = float(w.max()) if w.numel() else 0.0
    keep = w > rcond * wmax
    x = Q[:, keep] @ ((Q[:, keep].mT @ rhs) / w[keep])
    cond = wmax / float(w[keep].min()) if bool(keep.any()) else math.inf
    dropped = int((~keep).sum())
    if dropped:
        log.debug("SFTM: Gram matrix rank-deficient (%d of %d eigenvalues dropped); min-norm solution",
                  dropped, G.shape[0])
    return x, {"solver": "pinv", "cond": cond, "dropped": dropped}


def gram(features: Sequence[Features]) -> torch.Tensor:
    """G = (UᵀU) ⊙ (VᵀV) in float64, the Gram matrix of the rank-1 components u_a v_aᵀ.

    Each task's U and V have orthonormal columns, so its diagonal block is exactly the identity;
    only the blocks between two tasks are computed, each once: (1 - 1/T)/2 of the full products'
    work for T tasks.
    """
    sizes = [f.s.numel() for f in features]
    ref = features[0].s
    G = torch.eye(sum(sizes), dtype=torch.float64, device=ref.device)
    Us = [f.U.to(torch.float64) for f in features]
    Vs = [f.V.to(torch.float64) for f in features]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for i in range(len(features)):
        for j in range(i + 1, len(features)):
            if sizes[i] and sizes[j]:
                blk = (Us[i].mT @ Us[j]).mul_(Vs[i].mT @ Vs[j])
                G[starts[i]:starts[i] + sizes[i], starts[j]:starts[j] + sizes[j]] = blk
                G[starts[j]:starts[j] + sizes[j], starts[i]:starts[i] + sizes[i]] = blk.mT
    return G


def superpose(features: Sequence[Features], *, ridge: float = 0.0, rcond: float = 1e-10,
              out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """Merged task matrix M = Σ_a β_a u_a v_aᵀ with G β = σ (Alg. 1, symmetric form).

    ``features``: each task's kept triplets with orthonormal U and V, as
    :func:`singular_features` and :func:`lora_features` give.
    """
    U = torch.cat([f.U for f in features], dim=1)
    V = torch.cat([f.V for f in features], dim=1)
    s = torch.cat([f.s for f in features])
    dtype = out_dtype or U.dtype
    if s.numel() == 0:
        return torch.zeros(U.shape[0], V.shape[0], dtype=dtype, device=U.device), {"rank": 0}
    beta, info = solve_gram(gram(features), s, ridge=ridge, rcond=rcond)
    info["rank"] = int(s.numel())
    M = (U.to(dtype) * beta.to(dtype)) @ V.to(dtype).mT
    return M, info


LORA_GAMMA, FULL_GAMMA = 0.3, 0.6
"""SFTM's default γ for LoRA adapters and for full fine-tunes [measured] (``gamma``)."""


@dataclass
class SftmParams:
    eta: float = param(0.2, "η: kept fraction of each task matrix / vector by magnitude, per tensor "
                            "(paper sweeps 0.10-0.50, best < 0.4)", range=(0.0, 1.0), source="ours")
    gamma: float | None = param(
        None, "γ: scale of the merged task matrices, biases and embeddings; not of norm layers; none = 0.3 when "
              "every input is a LoRA adapter, else 0.6 (paper sweeps 0.5-1.2, best < 0.8; on the benchmarks' "
              "validation, scored task by task, 8 LoRA inputs harmed no task up to 0.3 and one at 0.4, 4 gained "
              "most at 0.2-0.3; full fine-tunes chose 0.4 to 1.2, 0.6 the compromise)", range=(None, None),
        source="measured")
    lm_head: Literal["task_arithmetic", "sftm"] = param(
        "task_arithmetic", "the untied output head: like an embedding (task arithmetic) or as a matrix",
        source="ours")
    rank_tol: float | None = param(None, "drop singular values ≤ rank_tol·σ_max (default max(m,n)·eps)",
                                   range=(0.0, 1.0), source="ours")
    ridge: float = param(0.0, "ε added to the Gram matrix diagonal before solving", range=(0.0, None),
                         source="ours")
    rcond: float = param(1e-10, "pseudo-inverse cut-off (relative eigenvalue) when G is singular",
                         range=(0.0, 1.0), source="ours")
    lora_trim: bool = param(False, "trim LoRA task matrices too (their dense B·A, by eta); default: a LoRA "
                                   "input's ΔW is used untrimmed, straight from its factors", source="ours")


@register
class Sftm(Method[SftmParams]):
    name = "sftm"
    summary = ("Per linear weight, superpose the singular features of the trimmed task matrices by solving "
               "a linear system; task arithmetic for biases/embeddings, mean for norm layers.")
    paper = "Superpose Singular Features for Model Merging (Qiu, Wu, Yao)"
    paper_url = "https://arxiv.org/search/?query=Superpose+Singular+Features+for+Model+Merging&searchtype=title"
    Params = SftmParams

    @staticmethod
    def _is_matrix(name: str, shape: Sequence[int], params: SftmParams) -> bool:
        role = tensor_role(name, tuple(shape))
        return role in ("linear", "conv") or (role == "head" and params.lm_head == "sftm")

    def workspace_bytes(self, shape: tuple[int, ...], n_inputs: int, params: SftmParams, name: str = "") -> int:
        """Beyond the stack: per task matrix (m × n, r = min(m, n)) its kept triplets, and the worst of
        the float64 SVD (the input's copy, LAPACK's own copy, U and Vᵀ) and the superposition (every
        task's U, V concatenated, their float64 copies, two (N·r)² Grams). Other tensors: the trim's
        temporaries (|τ|, its 16-bit radix keys, masks: ~2.25 float32 copies of the tensor).

        Measured (tests/test_memory_plan.py, a 32768×128 head, 2 inputs): peak RSS growth 213 MiB,
        the planner 226 MiB with this (64 MiB without: the SVD workspace is most of the peak)."""
        numel = math.prod(shape) if shape else 1
        trim = 9 * numel  # 2.25 float32 copies
        if len(shape) < 2 or (name and not self._is_matrix(name, shape, params)):  # no name: the worst case
            return trim
        m, n = shape[0], numel // max(shape[0], 1)
        r = min(m, n)
        triplets = 4 * r * (m + n)  # one task's kept U, V (float32)
        svd = 16 * m * n + 8 * r * (m + n) + 8 * 4 * r * r  # float64 input + LAPACK's copy, U/Vᵀ, gesdd's work
        # the SVD phase: the earlier tasks' triplets, the SVD, and this task's triplets once cast to float32
        superpose = 12 * n_inputs * r * (m + n) + 16 * (n_inputs * r) ** 2  # cat, its float64 copy, Grams
        return max(trim, (n_inputs - 1) * triplets + svd + triplets, n_inputs * triplets + superpose)

    def merge_factors(self, shape: tuple[int, ...], factors: list[tuple[torch.Tensor, torch.Tensor] | None],
                      params: SftmParams, ctx: TensorContext) -> torch.Tensor | None:
        """The low-rank path (every input a plain LoRA for this tensor, τᵢ = PᵢQᵢ): SVD from the factors
        (two thin QRs and a ρ×ρ SVD per input), never forming ΔW. None: take the dense path."""
        if params.lora_trim or not self._is_matrix(ctx.name, shape, params):
            return None
        dev = next(f[0].device for f in factors if f is not None)
        feats = []
        for f in factors:
            if f is None:  # this input leaves the tensor alone: no singular features
                feats.append(Features(torch.zeros(shape[0], 0, device=dev), torch.zeros(0, device=dev),
                                      torch.zeros(shape[1], 0, device=dev)))
            else:
                feats.append(lora_features(f[0].float(), f[1].float(), 1.0, params.rank_tol))
        M, _ = superpose(feats, ridge=params.ridge, rcond=params.rcond, out_dtype=torch.float32)
        return M.mul_(self.resolved_gamma(params, ctx))

    @staticmethod
    def resolved_gamma(params: SftmParams, ctx: TensorContext) -> float:
        """γ of this merge: the given one, else 0.3 for LoRA adapters and 0.6 for full fine-tunes (see ``gamma``)."""
        if params.gamma is not None:
            return params.gamma
        return LORA_GAMMA if ctx.adapters else FULL_GAMMA

    def card_notes(self, described: dict[str, Any], stats: dict[str, Any], n_inputs: int) -> list[str]:
        """Which γ a default resolves to (it depends on the inputs' kind, which the card's inputs list shows)."""
        if described.get("gamma") is not None:
            return []
        return [f"**γ = {LORA_GAMMA:g}** when every input is a LoRA adapter, **{FULL_GAMMA:g}** otherwise: "
                "SFTM's default scale [measured] (chosen on hubsoup's quality benchmarks' validation splits, "
                "task by task: the largest gain that left no task worse than the base). "
                "A γ searched on validation data can recover more of the fine-tunes' gains."]

    def stats_key(self, params: SftmParams) -> Hashable:
        """γ scales the merged matrices last: points of a search over γ alone share their superpositions."""
        return repr(dataclasses.replace(params, gamma=None))

    def prepare(self, params: SftmParams, ctx: PrepareContext) -> dict[str, Any]:
        return {"sftm.kept": ctx.keep_tensors("sftm")} if ctx.shared else {}

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: SftmParams,
              ctx: TensorContext) -> torch.Tensor:
        role = tensor_role(ctx.name, tuple(base.shape))
        if self._is_matrix(ctx.name, base.shape, params):
            kept: KeptTensors | None = ctx.stats.get("sftm.kept")
            M = kept.get(ctx.name, deltas.device) if kept is not None else None
            if M is None:
                M = self._superposed(base, deltas, params, ctx.name)
                if kept is not None:
                    kept.put(ctx.name, M)
            return M.mul_(self.resolved_gamma(params, ctx))
        for row in deltas:
            trim_topk_(row, params.eta)
        if role == "norm":
            return deltas.mean(dim=0)
        return deltas.sum(dim=0).mul_(self.resolved_gamma(params, ctx))

    @staticmethod
    def _superposed(base: torch.Tensor, deltas: torch.Tensor, params: SftmParams, name: str) -> torch.Tensor:
        """The unscaled merged matrix: trim each task matrix, its singular features, their superposition."""
        mats = deltas.reshape(deltas.shape[0], base.shape[0], -1)  # conv [out, in, kh, kw] -> [out, in·kh·kw]
        if mats.device.type == "cpu" and CPU_PATH == "eigh":  # trims, triplets and products side by side
            M, info = superpose_eigh(mats, rank_tol=params.rank_tol, ridge=params.ridge, rcond=params.rcond,
                                     eta=params.eta)
            log.debug("SFTM %s: r=%d solver=%s cond=%.3g", name, info.get("rank", 0),
                      info.get("solver", "-"), info.get("cond", 0.0))
            return M.reshape(base.shape)
        for row in mats:
            trim_topk_(row, params.eta)
        if mats.device.type == "cpu":  # float64 SVDs, one per task matrix (HUBSOUP_SFTM_CPU=svd: before 0.2)
            feats = [singular_features(M, params.rank_tol) for M in mats]
        elif DEVICE_SVD == "svd":  # an accelerator, the older way: one batched float32 SVD (same shapes)
            feats = singular_features_batched(mats, params.rank_tol)
        else:  # an accelerator: float64 Gram eigen-decompositions, batched; the solve in float64 as on the CPU
            feats = singular_features_gram(mats, params.rank_tol)
        del mats
        M, info = superpose(feats, ridge=params.ridge, rcond=params.rcond, out_dtype=deltas.dtype)
        log.debug("SFTM %s: r=%d solver=%s cond=%.3g", name, info.get("rank", 0),
                  info.get("solver", "-"), info.get("cond", 0.0))
        return M.reshape(base.shape)
