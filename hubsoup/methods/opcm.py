"""OPCM: orthogonal-projection continual merging (Tang et al.), one-shot over an ordered list.

Models arrive in order. The state is S, the *unscaled* accumulated update (one tensor
per model tensor), the number of models t, the task-vector norms and λ_t:

- t = 1: S = τ_1, λ_1 = 1.
- t ≥ 2: every linear weight's new task vector is projected off the dominant
  singular subspace of S_W (the top-k × top-k block, k = #{j : c_j ≤ α} with c the
  cumulative share of the singular values) and, with ``zero_diagonal``, off every
  diagonal direction u_i v_iᵀ, which makes ⟨P(τ), S_W⟩_F = 0 exactly (Thm 5.1);
  everything else is added unprojected. Then λ_t = ‖S‖ / mean_i ‖τ_i‖ (``adaptive``,
  norms over the whole flattened model) or √t (``sqrt``), and θ^(t) = θ_0 + S / λ_t.

S does not depend on λ, so this module's merge computes S per tensor by looping over
the inputs in order; λ is global, so ``adaptive`` runs one statistics pass first
(the same loop, keeping ‖S‖² and the ‖τ_i‖²), which also keeps each projected weight's S on disk
(the output's scratch folder, 4 bytes per parameter of those weights, until the merge ends) so the
merge reads it instead of repeating its SVDs: the same result in about half the time. ``hubsoup continual`` keeps S on
disk to add models later without the earlier ones (see :mod:`hubsoup.continual`);
both paths call :func:`opcm_update` and :func:`opcm_lambda`, so they agree bit for bit.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, MutableMapping, Sequence

import torch

from hubsoup.errors import ParameterError
from hubsoup.linalg import single_thread, thin_svd_gram
from hubsoup.methods import Method, StatsPass, TensorContext, register
from hubsoup.arch import tensor_role
from hubsoup.methods import param

if TYPE_CHECKING:
    from hubsoup.methods import PrepareContext

PROJECTED_ROLES = ("linear", "head")
"""Projected tensors: 2-D projection weights and the untied output head (nn.Linear in the
authors' code). Embeddings, convolutions, norms and biases are summed unprojected."""


def split_rank(s: torch.Tensor, alpha: float) -> int:
    """k = #{j : c_j ≤ α}, c_j = (Σ_{i≤j} s_i)/(Σ_i s_i): the size of the projected top block.

    >>> split_rank(torch.tensor([4.0, 3.0, 2.0, 1.0]), 0.5)
    1
    """
    total = float(s.sum())
    if total <= 0:
        return 0
    c = torch.cumsum(s.double(), 0) / total
    return int((c <= alpha).sum())


def project(S: torch.Tensor, X: torch.Tensor, alpha: float, zero_diagonal: bool = True,
            rank_tol: float | None = None) -> torch.Tensor:
    """P_S(X): X without its top-k × top-k block and (optionally) diagonal in S's singular basis.

    Thin form, never the full SVD: X − U_k (U_kᵀ X V_k) V_kᵀ − Σ_{i=k+1..p'} (u_iᵀ X v_i) u_i v_iᵀ,
    where p' counts singular values above ``rank_tol``·s_1 (default max(m, n)·eps): the
    diagonal is removed only where S's singular directions are defined. S = 0 (a frozen
    layer) gives P = identity.
    """
    out = X.clone()
    if not bool(S.any()):
        return out
    # On the CPU on one thread: at a layer's sizes a second LAPACK/BLAS thread gains little on two idle cores and
    # spins on a loaded machine (124M model, load 9 on 2 cores: 1.2 CPU-s per 768 × 768 projection on two
    # threads, 0.14 s on one). Every caller (the merge, `hubsoup continual`) projects here: the same bits.
    with single_thread() if X.device.type == "cpu" else contextlib.nullcontext():
        return _project(S, X, out, alpha, zero_diagonal, rank_tol)


def _project(S: torch.Tensor, X: torch.Tensor, out: torch.Tensor, alpha: float, zero_diagonal: bool,
             rank_tol: float | None) -> torch.Tensor:
    U, s, Vh = singular_triplets(S)
    k = split_rank(s, alpha)
    if k:
        Uk, Vk = U[:, :k], Vh[:k].mT
        out.sub_(Uk @ (Uk.mT @ X @ Vk) @ Vk.mT)
    if zero_diagonal:
        tol = (rank_tol if rank_tol is not None else max(S.shape) * torch.finfo(s.dtype).eps) * float(s[0])
        p = int((s > tol).sum())
        if p > k:
            Ud, Vd = U[:, k:p], Vh[k:p]
            d = ((Ud.mT @ X) * Vd).sum(dim=1)  # u_iᵀ X v_i
            out.sub_((Ud * d) @ Vd)
    return out


def singular_triplets(S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``U, s, Vh`` of S's thin SVD in S's dtype. A float32 S on the CPU (every merge's): from the float64
    eigen-decomposition of its smaller Gram matrix (:func:`hubsoup.linalg.thin_svd_gram`, half the SVD's time):
    the triplets :func:`project` uses are those above max(m, n)·eps of float32, a float64 SVD's to ~1e-12. Else
    the float64 SVD, its factors back in S's dtype (LAPACK and cuSOLVER then agree to rounding; a float64 S keeps
    σ's down to float64's cut, below what squaring resolves)."""
    if S.device.type == "cpu" and S.dtype == torch.float32:
        U, s, V = thin_svd_gram(S)
        return U, s.to(S.dtype), V.mT
    U, s, Vh = (t.to(S.dtype) for t in torch.linalg.svd(S.double(), full_matrices=False))
    return U, s, Vh


def _projected(name: str, x: torch.Tensor) -> bool:
    return x.dim() == 2 and tensor_role(name, tuple(x.shape)) in PROJECTED_ROLES


def opcm_update(S: torch.Tensor | None, tau: torch.Tensor, name: str, params: OpcmParams) -> torch.Tensor:
    """S_t = S_{t−1} + P_{S_{t−1}}(τ_t) for projected tensors, S_{t−1} + τ_t otherwise (S_1 = τ_1)."""
    if S is None:
        return tau.clone()
    if _projected(name, tau):
        return S + project(S, tau, params.alpha, params.zero_diagonal, params.rank_tol)
    return S + tau


def opcm_lambda(scaling: str, s_norm: float, task_norms: Sequence[float]) -> float:
    """λ_t: ‖S‖ / ((1/t) Σ_i ‖τ_i‖) (adaptive) or √t; λ_1 = 1."""
    t = len(task_norms)
    if t <= 1:
        return 1.0
    if scaling == "sqrt":
        return math.sqrt(t)
    mean = sum(task_norms) / t
    if mean == 0.0 or s_norm == 0.0:
        return 1.0
    return s_norm / mean


def sq_norm(x: torch.Tensor) -> float:
    """‖x‖² accumulated in float64."""
    return float(torch.linalg.vector_norm(x.reshape(-1), dtype=torch.float64)) ** 2


def sequential_update(deltas: torch.Tensor, name: str, params: OpcmParams) -> torch.Tensor:
    """S_T of the stack ``deltas`` (only read): :func:`opcm_update` step by step, S added to in place (the same
    bits as ``S + ...``, one copy of the tensor fewer at a time)."""
    S = deltas[0].clone()
    projected = _projected(name, S)
    for tau in deltas[1:]:
        S.add_(project(S, tau, params.alpha, params.zero_diagonal, params.rank_tol) if projected else tau)
    return S


@dataclass
class OpcmParams:
    alpha: float = param(0.5, "α: projection threshold on the cumulative share of S's singular values "
                              "(best 0.4-0.6)", range=(0.0, 1.0))
    scaling: Literal["adaptive", "sqrt"] = param(
        "adaptive", "λ_t: adaptive keeps ‖θ−θ_0‖ at the mean task-vector norm; sqrt uses λ_t = √t")
    zero_diagonal: bool = param(True, "also remove the diagonal of S's singular basis (exact orthogonality, "
                                      "Thm 5.1; false reproduces the early published code)", source="ours")
    rank_tol: float | None = param(None, "remove diagonal terms only for s_i > rank_tol·s_1 "
                                         "(default max(m,n)·eps)", range=(0.0, 1.0), source="ours")

    def validate(self) -> None:
        if not 0.0 <= self.alpha < 1.0:
            raise ParameterError(f"parameter 'alpha' = {self.alpha} must be in [0, 1): α ≥ 1 would mean "
                                 "no projected block, as α = 0 does in the authors' code")


class _NormPass(StatsPass):
    """‖τ_i‖² and ‖S_T‖² over the whole model (λ is global)."""

    def __init__(self, params: OpcmParams, n: int) -> None:
        self.params = params
        self.sq_tau = [0.0] * n
        self.sq_S = 0.0

    def update(self, ctx: TensorContext, base: torch.Tensor, deltas: torch.Tensor) -> None:
        for i, tau in enumerate(deltas):
            self.sq_tau[i] += sq_norm(tau)
        S = sequential_update(deltas, ctx.name, self.params)
        self.sq_S += sq_norm(S)
        kept = ctx.stats.get("opcm.kept")
        if kept is not None and _projected(ctx.name, S):  # the rest costs a sum: recomputed in the merge
            kept.put(ctx.name, S)

    def finish(self, stats: MutableMapping[str, Any]) -> None:
        norms = [math.sqrt(v) for v in self.sq_tau]
        s_norm = math.sqrt(self.sq_S)
        stats["opcm.task_norms"] = norms
        stats["opcm.s_norm"] = s_norm
        stats["opcm.lambda"] = opcm_lambda(self.params.scaling, s_norm, norms)


@register
class Opcm(Method[OpcmParams]):
    name = "opcm"
    summary = ("Continual merging, one-shot over the inputs in the given order: project each new task "
               "vector off the merged update's top singular subspace and diagonal, add, rescale.")
    paper = ("Merging Models on the Fly Without Retraining: A Sequential Approach to Scalable Continual "
             "Model Merging (Tang et al.)")
    paper_url = "https://github.com/tanganke/opcm"
    Params = OpcmParams

    def passes(self, params: OpcmParams, n_inputs: int) -> list[StatsPass]:
        return [_NormPass(params, n_inputs)] if self._two_sweeps(params, n_inputs) else []

    @staticmethod
    def _two_sweeps(params: OpcmParams, n_inputs: int) -> bool:
        return params.scaling == "adaptive" and n_inputs > 1

    def prepare(self, params: OpcmParams, ctx: PrepareContext) -> dict[str, Any]:
        return {"opcm.kept": ctx.keep_tensors("opcm")} if self._two_sweeps(params, len(ctx.inputs)) else {}

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: OpcmParams,
              ctx: TensorContext) -> torch.Tensor:
        lam = ctx.stats.get("opcm.lambda")
        if lam is None:
            lam = opcm_lambda(params.scaling, 0.0, [0.0] * ctx.n_inputs) if params.scaling == "sqrt" else 1.0
        kept = ctx.stats.get("opcm.kept")
        S = kept.get(ctx.name, deltas.device) if kept is not None else None
        if S is None:
            S = sequential_update(deltas, ctx.name, params)
        del deltas
        return S.div_(lam)
