"""LiNeS: layer-increasing network scaling of a (merged) task vector.

θ = θ_0 + λ(b) · τ_MTL, where τ_MTL is the inner method's merged task vector
(task arithmetic, TIES, consensus, a model soup, WiSE-FT...) and the factor of
transformer block b of a stack with L blocks is λ(b) = α + β·(b/(L−1))^p: block 0
gets α, the last block α+β (the schedule is in :mod:`hubsoup.methods._depth`). LiNeS
replaces the inner method's global λ, so the parameter the inner method declares as
its ``scale_param`` is 1 unless the user gives it.

α is given, or (multi-task) the paper's Eq. 2 heuristic
α = (1/N)·‖Σ_i τ_i‖₁ / ‖τ_MTL‖₁ over the whole model, accumulated in float64 by a
statistics pass that runs the inner merge on a copy of each tensor's stack; the
model is never held. For task arithmetic that ratio is exactly 1/N and no pass
is run.

Usage::

    hubsoup merge A B C --base B0 --method lines --param base_method=ties \\
        --param beta=1.4 --param density=0.2 --out soup     # density goes to ties
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, MutableMapping, Protocol, cast

import torch

from hubsoup.errors import MethodError, ParameterError
from hubsoup.methods import StatsPass, TensorContext, param, register
from hubsoup.methods._compose import Composed, Modifier
from hubsoup.methods._depth import DepthParams, depth_factor, schedule_note
from hubsoup.methods._kernels import weighted_average

# Base methods whose α (and β) the paper fixes instead of the Eq. 2 heuristic: LiNeS's own findings
# about those methods (model soups keep α = 1; WiSE-FT's edit uses α = β = 0.5), so they stay here.
_FIXED_ALPHA = {"linear": 1.0, "soup": 1.0, "wise_ft": 0.5}
_FIXED_BETA = {"wise_ft": 0.5}
_SOUP_BETA = 1.0  # soups (α = 1): the appendix pseudocode's β; the paper tunes it in 0..1


def _budget_beta(alpha: float, lam: float) -> float:
    """β with which the last block gets λ, the base method's own scale, and shallower blocks less: LiNeS
    shrinks the shallow blocks' edit and enlarges none (β = λ − α, ≥ 0).

    For TIES (λ = 0.7, α ≈ 0.21) β ≈ 0.5, the value validation chose most often for LiNeS + TIES on the
    quality benchmarks. Issue 16's rule, β = 2·(λ − α) (the factors' mean λ), took the last blocks to
    2λ − α and was worse than the base on a task in three of the encoder's four settings (issue 35); the
    fixed β = 1 before it, 3-4× task arithmetic's λ, lost to the base method on every benchmark
    (benchmarks/results/defaults.md).
    """
    return max(lam - alpha, 0.0)


@dataclass
class _LinesOwn:
    base_method: str = param(
        "task_arithmetic", "inner method whose merged task vector is scaled: task_arithmetic, ties, consensus "
                           "(paper), linear or soup (model soups), wise_ft, or a chain such as lwptv+ties; give its "
                           "parameters alongside (e.g. density=0.2). Its global `scale` is forced to 1 unless given")
    alpha: float | None = param(
        None, "α, the factor of the first block; none = the paper's default for the base method: Eq. 2 heuristic "
              "(1/N)·‖Σ τ_i‖/‖τ_MTL‖ for multi-task methods (1/N for task arithmetic), 1 for linear/soup, "
              "0.5 for wise_ft")
    beta: float | None = param(
        None, "β, the last block gets α+β; none = 0.5 for wise_ft (paper), 1.0 for linear/soup (the appendix "
              "pseudocode's), else λ − α ≥ 0 with λ the base method's default scale (1/N for task arithmetic, "
              "so 0 there, 0.7 for TIES and consensus): the last block gets λ and shallower ones less, so LiNeS "
              "shrinks the shallow blocks' edit and enlarges none (the paper tunes β on validation: "
              "TA/consensus 0.1..1.0, TIES 0.1..1.5, soups 0..1)",
        source="measured")
    edit_gamma: float | None = param(
        None, "single-task edit of one fine-tune (paper Sec. 3): α = γ, β = 1 − γ", range=(0.0, 1.0))
    alpha_norm: Literal["l1", "l2"] = param(
        "l1", "norm of the Eq. 2 heuristic (the paper does not name it; the authors' code uses L1)", source="ours")


@dataclass
class LinesParams(DepthParams, _LinesOwn):  # fields: _LinesOwn's first, then the schedule's
    def validate(self) -> None:
        super().validate()
        if self.edit_gamma is not None and (self.alpha is not None or self.beta is not None):
            raise ParameterError("parameter 'edit_gamma' sets α = γ and β = 1 − γ; do not give alpha or beta with it")


def _norm(x: torch.Tensor, kind: str) -> float:
    """‖x‖₁, or ‖x‖₂² (the square root is taken once the whole model is summed), in float64."""
    if kind == "l1":
        return float(torch.linalg.vector_norm(x, 1, dtype=torch.float64))
    return float(torch.linalg.vector_norm(x, 2, dtype=torch.float64)) ** 2


class _HeuristicPass(StatsPass):
    """Eq. 2 norms: ‖Σ_i τ_i‖ and ‖τ_MTL‖ over every merged tensor, in float64."""

    def __init__(self, method: "Lines", params: Composed[LinesParams], n: int) -> None:
        self.method, self.params, self.n = method, params, n
        self.kind = params.own.alpha_norm
        self.sum = self.mtl = 0.0

    def update(self, ctx: TensorContext, base: torch.Tensor, deltas: torch.Tensor) -> None:
        total = weighted_average(deltas, [1.0] * len(deltas), normalize=False)  # as task arithmetic sums
        self.sum += _norm(total, self.kind)
        del total
        merged = self.method.inner_merge(base, deltas.clone(), self.params, ctx)  # merge may overwrite its input
        self.mtl += _norm(merged, self.kind)

    def finish(self, stats: MutableMapping[str, Any]) -> None:
        s, m = (self.sum, self.mtl) if self.kind == "l1" else (math.sqrt(self.sum), math.sqrt(self.mtl))
        if m == 0:
            raise MethodError("lines: the inner method's merged task vector is zero everywhere; the α heuristic "
                              "(1/N)·‖Σ τ‖/‖τ_MTL‖ is undefined — give alpha")
        stats["lines.norm_sum"], stats["lines.norm_mtl"] = s, m
        stats["lines.alpha"] = (s / m) / self.n  # exactly 1/N when the norms agree


class _ResolvesScale(Protocol):
    """A base method whose default scale depends on N and its other parameters (task arithmetic, TIES, DARE)."""

    def resolved_scale(self, params: Any, n_inputs: int) -> float: ...


@register
class Lines(Modifier[LinesParams]):
    name = "lines"
    summary = ("LiNeS: scale the (merged) task vector by a factor rising linearly with block depth, "
               "α at the first block to α+β at the last, on top of a base method.")
    paper = ("LiNeS: Post-training Layer Scaling Prevents Forgetting and Enhances Model Merging "
             "(Wang, Dimitriadis et al., 2025)")
    paper_url = "https://arxiv.org/abs/2410.17146"
    Params = LinesParams
    search_grid = {"beta": [round(0.1 * i, 1) for i in range(1, 11)]}  # β = 0.1..1.0 (the paper's TA grid)
    replaces_scale = True  # the depth factors replace the base method's λ (its scale_param): 1 unless given

    def check_inputs(self, params: Composed[LinesParams], n_inputs: int) -> None:
        super().check_inputs(params, n_inputs)
        if params.own.edit_gamma is not None and n_inputs != 1:
            raise MethodError(f"method 'lines': edit_gamma edits a single fine-tune; got {n_inputs} inputs")

    @staticmethod
    def _ta_alpha(params: Composed[LinesParams], n: int) -> float | None:
        """Eq. 2 in closed form for unweighted task arithmetic at scale 1: exactly 1/N."""
        ip = params.inner_params
        if params.inner.name == "task_arithmetic" and ip.weights is None and ip.scale == 1.0:
            return 1.0 / n
        return None

    def _needs_pass(self, params: Composed[LinesParams], n: int) -> bool:
        own = params.own
        return (own.alpha is None and own.edit_gamma is None and params.inner.name not in _FIXED_ALPHA
                and self._ta_alpha(params, n) is None)

    def stats_key(self, params: Composed[LinesParams]) -> tuple[str, str, str]:
        """β only sets the depth factors of the merge itself; the base method's passes and the Eq. 2 pass
        (which runs the base merge) read everything else: a search over β prepares once."""
        return repr(dataclasses.replace(params.own, beta=None)), params.inner.name, repr(params.inner_params)

    def passes(self, params: Composed[LinesParams], n_inputs: int) -> list[StatsPass]:
        inner = self.inner_passes(params, n_inputs)
        return inner + ([_HeuristicPass(self, params, n_inputs)] if self._needs_pass(params, n_inputs) else [])

    def alpha_beta(self, params: Composed[LinesParams], ctx: TensorContext) -> tuple[float, float, str]:
        """α and β of this merge, and where α comes from."""
        own = params.own
        if own.edit_gamma is not None:
            return own.edit_gamma, 1.0 - own.edit_gamma, "single-task edit: α = γ, β = 1 − γ"
        alpha, why = self._alpha(params, ctx)
        if own.beta is not None:
            return alpha, own.beta, why
        inner = params.inner.name
        if inner in _FIXED_BETA or inner in _FIXED_ALPHA:
            return alpha, _FIXED_BETA.get(inner, _SOUP_BETA), why
        lam = self.base_scale(params, ctx.n_inputs)
        return alpha, _budget_beta(alpha, lam), f"{why}; β = λ − α with the base method's λ = {lam:g}"

    def _alpha(self, params: Composed[LinesParams], ctx: TensorContext) -> tuple[float, str]:
        own = params.own
        if own.alpha is not None:
            return own.alpha, "α given"
        if params.inner.name in _FIXED_ALPHA:
            return _FIXED_ALPHA[params.inner.name], f"the paper's α for {params.inner.name}"
        alpha = self._ta_alpha(params, ctx.n_inputs)
        if alpha is not None:
            return alpha, "Eq. 2 heuristic, exactly 1/N for task arithmetic"
        stats = ctx.stats
        return stats["lines.alpha"], (f"Eq. 2 heuristic (1/N)·‖Σ τ_i‖/‖τ_MTL‖ = {stats['lines.norm_sum']:.6g} "
                                      f"/ ({ctx.n_inputs} · {stats['lines.norm_mtl']:.6g}), "
                                      f"{params.own.alpha_norm.upper()} norm")

    def base_scale(self, params: Composed[LinesParams], n_inputs: int) -> float:
        """λ the base method uses on its own by default (through any modifiers between); 1 when it
        has no scale. A scale the user gives multiplies the
        inner merge as before and does not move β, so a recipe re-runs to the same factors."""
        leaf, leaf_params = params.inner, params.inner_params
        while isinstance(leaf, Modifier):
            leaf, leaf_params = leaf_params.inner, leaf_params.inner_params
        name = leaf.scale_param
        if name is None:
            return 1.0
        default: Any = next(f.default for f in dataclasses.fields(leaf.Params) if f.name == name)
        if default is None:  # a default that depends on N and other parameters (task arithmetic: 1/N)
            if not callable(getattr(leaf, "resolved_scale", None)):  # a plug-in's: β needs the λ it resolves to
                raise MethodError(f"lines over '{leaf.name}': its scale parameter '{name}' defaults to None, and "
                                  f"LiNeS needs the value it stands for: give {name}= or beta=, or define "
                                  f"{type(leaf).__name__}.resolved_scale(params, n_inputs)")
            default = cast(_ResolvesScale, leaf).resolved_scale(leaf.parse({k: v for k, v in leaf.describe_params(leaf_params).items()
                                                      if k != name}), n_inputs)
        return float(default)

    def factor(self, params: Composed[LinesParams], ctx: TensorContext) -> float:
        alpha, beta, _ = self.alpha_beta(params, ctx)
        return depth_factor(ctx.block, alpha, beta, params.own, ctx.stats.get("plan.stacks"))

    def own_workspace_bytes(self, shape: tuple[int, ...], n_inputs: int, params: Composed[LinesParams],
                            name: str = "") -> int:
        """The Eq. 2 pass merges a copy of the stack (the inner merge may overwrite its input) next to
        the task vectors' sum: N + 1 float32 copies of the tensor, when that pass runs."""
        if not self._needs_pass(params, n_inputs):
            return 0
        return 4 * (n_inputs + 1) * math.prod(shape)

    def tensor_passes(self, params: Composed[LinesParams], n_inputs: int) -> list[StatsPass] | None:
        return self.inner_tensor_passes(params, n_inputs)  # a factor per tensor: element-wise as its base

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: Composed[LinesParams],
              ctx: TensorContext) -> torch.Tensor:
        lam = self.factor(params, ctx)
        return self.inner_merge(base, deltas, params, ctx).mul_(lam)

    def card_notes(self, described: dict[str, Any], stats: dict[str, Any], n_inputs: int) -> list[str]:
        """Model-card lines: the α and β used and each stack's factors."""
        params = self.parse(described)
        alpha, beta, why = self.alpha_beta(params, TensorContext("", None, n_inputs, stats))
        return [schedule_note(alpha, beta, why, params.own, stats.get("plan.stacks") or {}),
                *super().card_notes(described, stats, n_inputs)]
