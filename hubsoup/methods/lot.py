"""LOT Merging: layer-wise optimal task-vector merging from a few unlabelled exemplars.

Per parametrised op, the merged task vector minimises the feature drift
Σ_k ‖f(X_k; θ_0 + τ) − f(X_k; θ_0 + τ_k)‖², X_k the op's inputs inside expert k on
task k's exemplars (captured once, from the experts, by :mod:`hubsoup.exemplars`):

- matrix multiply (Linear, GPT-2 Conv1D, Conv2d via im2col), PyTorch layout
  y = x Wᵀ: Δ* = (Σ_k Δ_k G_k)(Σ_k G_k)⁺ with G_k = X_kᵀX_k. The pseudo-inverse is the
  minimum-norm solution: directions no exemplar excites keep θ_0. With Σ G_k invertible
  and λ = 1, θ_0 + Δ* is RegMean's closed form.
- element-wise scale (norm weight γ): δ*_j = Σ_k s_kj δ_kj / Σ_k s_kj, s_k = Σ_x x̂_j²
  (x̂ the op's normalised input); 0 where no exemplar reached.
- element-wise add (biases, norm shift β; position embeddings and other additive
  parameters [ours]): δ* = Σ_k n_k δ_k / Σ_k n_k, n_k the rows (tokens) task k sent through.
- token embeddings (a lookup is a matmul with one-hot inputs, an extension the paper
  did not evaluate): per row, the token-count-weighted mean; unseen tokens keep θ_0.
- θ = θ_0 + λ·τ* (``scale``) for every merged tensor. Tensors the exemplars never
  reach keep θ_0.

Solving [ours]: the Gram sum in float64; ``solver=pinv`` (default) eigen-decomposes it
and drops eigenvalues below ``eps``·λ_max; ``solver=ridge`` solves with
(Σ G_k + eps·mean(diag Σ G_k)·I), which slightly shrinks weakly excited directions.
A tied output head / token embedding takes the output head's (matrix) solution.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Literal, cast

import torch

from hubsoup.errors import ParameterError
from hubsoup.linalg import single_thread
from hubsoup.exemplars import capture, match_tasks, parse_exemplar_specs
from hubsoup.methods import Method, register
from hubsoup.methods import param

if TYPE_CHECKING:
    from hubsoup.exemplars.capture import FeatureStore
    from hubsoup.methods import PrepareContext, TensorContext

log = logging.getLogger(__name__)


# --- the closed forms ---------------------------------------------------------------------

def solve_right(B: torch.Tensor, A: torch.Tensor, *, eps: float = 1e-6, solver: str = "pinv") -> torch.Tensor:
    """X with X·A = B for a symmetric PSD A (float64): X = B A⁺ (pinv) or B (A + ε̄I)⁻¹ (ridge)."""
    A = A.to(torch.float64)
    B = B.to(torch.float64)
    scale = float(A.diagonal().abs().max()) if A.numel() else 0.0
    if scale == 0.0:
        return torch.zeros_like(B)
    if solver == "ridge":
        lam = eps * float(A.diagonal().mean())
        L = torch.linalg.cholesky(A + lam * torch.eye(A.shape[0], dtype=A.dtype, device=A.device))
        return torch.cholesky_solve(B.mT, L).mT
    w: torch.Tensor
    Q: torch.Tensor
    w, Q = torch.linalg.eigh(A)
    keep = w > eps * float(w.max())
    Qk = Q[:, keep]
    return ((B @ Qk) / w[keep]) @ Qk.mT


def lot_linear(deltas: torch.Tensor, grams: Iterable[torch.Tensor | None], *, eps: float = 1e-6,
               solver: str = "pinv") -> torch.Tensor:
    """Δ* = (Σ_k Δ_k G_k)(Σ_k G_k)⁺ for task vectors ``deltas`` (T, out, in) and Grams (in, in).

    ``grams`` is a sequence (or iterator) of per-task Grams, None for a task whose exemplars
    never reached the op; they are consumed one at a time (A and B accumulate).
    """
    if deltas.device.type == "cpu":  # one thread: see hubsoup.methods.opcm.project (a second one spins under load)
        with single_thread():
            return _lot_linear(deltas, grams, eps, solver)
    return _lot_linear(deltas, grams, eps, solver)


def _lot_linear(deltas: torch.Tensor, grams: Iterable[torch.Tensor | None], eps: float, solver: str) -> torch.Tensor:
    A: torch.Tensor | None = None
    B: torch.Tensor | None = None
    for d, G in zip(deltas, grams):
        if G is None:
            continue
        G = G.to(device=d.device, dtype=torch.float64)
        A = G.clone() if A is None else A.add_(G)
        DG = d.to(torch.float64) @ G
        B = DG if B is None else B.add_(DG)
        del G, DG
    if A is None:
        return torch.zeros_like(deltas[0])
    return solve_right(cast(torch.Tensor, B), A, eps=eps, solver=solver).to(deltas.dtype)  # B is set with A


def weighted_mean(deltas: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_k w_k δ_k / Σ_k w_k elementwise along the leading dims of ``weights`` ((T,) or (T, d…)); 0 where Σ w = 0."""
    w = weights.to(torch.float64)
    while w.dim() < deltas.dim():
        w = w.unsqueeze(-1)
    num = (w * deltas.to(torch.float64)).sum(0)
    den = w.sum(0)
    out = torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num))
    return out.to(deltas.dtype)


# --- the method -------------------------------------------------------------------------------

@dataclass
class LotParams:
    exemplars: tuple[str, ...] = param((), "TASK=PATH_OR_DATASET per input (--exemplars): datasets-loadable "
                                           "files/folders or Hub dataset IDs (org/name[:split])")
    n_exemplars: int = param(64, "unlabelled exemplars per task (paper: 64; 16 is enough, 4-64 tested)",
                             range=(1, None))
    scale: float = param(1.5, "λ: scale of the merged task vector (paper: 1.0-1.5; 1.2 ViT-B/32, 1.5 ViT-L/14); "
                              "1.5 was chosen on validation in all four benchmark settings (1.0 recovered 0.45 of "
                              "the encoder's gain at 8 tasks, below the defaults guard)",
                         range=(None, None), source="measured")
    eps: float = param(1e-6, "pinv: drop Gram eigenvalues < eps·λ_max; ridge: add eps·mean(diag)·I",
                       range=(0.0, 1.0), source="ours")
    solver: Literal["pinv", "ridge"] = param("pinv", "pseudo-inverse (min-norm; W_0 kept where unexcited) or ridge",
                                             source="ours")
    gram_reduction: Literal["sum", "per_task_mean"] = param(
        "sum", "sum the Gram matrices (paper; tasks weighted by token count) or average each per row first",
        source="ours")
    max_length: int = param(512, "truncate exemplars to this many tokens (and the model's maximum)",
                            range=(1, None), source="ours")
    batch_size: int = param(8, "exemplars per forward pass", range=(1, None), source="ours")
    seed: int = param(0, "seed of the random exemplar sample when a dataset has more rows", source="ours")
    text_column: str | None = param(None, "the column to tokenize (default: 'text' or the only string column)",
                                    source="ours")
    gram_budget_gb: float = param(4.0, "GB of float64 Gram matrices held at once while capturing; a smaller "
                                       "budget means more forward passes over the exemplars", range=(0.0, None),
                                  source="ours")

    def validate(self) -> None:
        parse_exemplar_specs(self.exemplars)  # TASK=PATH syntax, no task twice


@register
class Lot(Method[LotParams]):
    name = "lot"
    needs_base_files = True  # the exemplar capture runs the base model, built from its folder
    summary = ("Per layer, the closed-form task vector that minimises feature drift from each expert on a few "
               "unlabelled exemplars per task (linear: Gram pseudo-inverse; norms: scale-weighted; biases: mean).")
    paper = ("Towards Minimizing Feature Drift in Model Merging: Layer-wise Task Vector Fusion for Adaptive "
             "Knowledge Integration (LOT Merging)")
    paper_url = ("https://arxiv.org/search/?query=Towards+Minimizing+Feature+Drift+in+Model+Merging"
                 "&searchtype=title")
    Params = LotParams
    scale_param = "scale"  # θ_0 + λ·τ* on every merged tensor

    def check_inputs(self, params: LotParams, n_inputs: int) -> None:
        super().check_inputs(params, n_inputs)
        if not params.exemplars:
            raise ParameterError("method 'lot' needs a few unlabelled exemplars per input model: "
                                 "--exemplars TASK=PATH_OR_DATASET (exemplars={...} in Python), one per input")

    def parse(self, given: dict[str, Any]) -> LotParams:
        ex = given.get("exemplars")
        if isinstance(ex, dict):  # {task: path} from Python: the TASK=PATH strings the CLI gives
            given = {**given, "exemplars": [f"{k}={v}" for k, v in ex.items()]}
        return super().parse(given)

    def stats_key(self, params: LotParams) -> tuple[Any, ...]:
        """The capture reads these; λ (``scale``), ``eps``, ``solver`` and ``gram_reduction`` only act in the
        merge, so a search over them runs the experts on their exemplars once."""
        return (params.exemplars, params.n_exemplars, params.max_length, params.batch_size, params.seed,
                params.text_column, params.gram_budget_gb)

    def prepare(self, params: LotParams, ctx: PrepareContext) -> dict[str, Any]:
        tasks = match_tasks(ctx.inputs, parse_exemplar_specs(params.exemplars))
        return {"lot.features": capture(ctx, params, tasks)}

    def finish(self, params: LotParams, stats: dict[str, Any]) -> None:
        store = stats.get("lot.features")
        if store is not None:
            store.close()  # the scratch folder of Grams

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: LotParams,
              ctx: TensorContext) -> torch.Tensor:
        store: FeatureStore = ctx.stats["lot.features"]
        op = store.ops.get(ctx.name)
        T = deltas.shape[0]
        if op is None:
            log.debug("LOT: no exemplar reaches %s; it keeps the base's value", ctx.name)
            return torch.zeros_like(base)
        per_task = params.gram_reduction == "per_task_mean"

        def rows(k: int, key: str) -> float:
            return store.n_rows(k, key)

        if op.kind == "linear":
            if op.layout == "in_out":
                D = deltas.transpose(1, 2)
            else:
                D = deltas.reshape(T, base.shape[0], -1)

            def grams() -> Iterator[torch.Tensor | None]:
                for k in range(T):
                    key = store.gram_key(k, op.key)
                    if key is None or not store.has(k, key):
                        yield None
                        continue
                    G = store.tensor(k, key)
                    n = rows(k, f"rows::{op.key}")
                    yield G / n if per_task and n > 0 else G

            out = lot_linear(D, grams(), eps=params.eps, solver=params.solver)
            out = out.mT if op.layout == "in_out" else out.reshape(base.shape)
            return out.contiguous().mul_(params.scale)
        if op.kind in ("scale", "lookup"):
            mod = op.key.split("::", 1)[1]
            w = []
            for k in range(T):
                if store.has(k, op.key):
                    v = store.tensor(k, op.key).to(deltas.device)
                    n: float | torch.Tensor = rows(k, f"rows::{mod}")  # a tensor below
                    w.append(v / n if per_task and n > 0 else v)
                else:
                    w.append(torch.zeros(deltas.shape[1], dtype=torch.float64, device=deltas.device))
            return weighted_mean(deltas, torch.stack(w)).mul_(params.scale)
        n = torch.tensor([rows(k, op.key) for k in range(T)], dtype=torch.float64)
        if per_task:
            n = (n > 0).to(torch.float64)
        return weighted_mean(deltas, n.to(deltas.device)).mul_(params.scale)
