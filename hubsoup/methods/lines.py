"""LiNeS: layer-increasing network scaling of a (merged) task vector.

θ = θ_0 + λ(b) · τ_MTL, where τ_MTL is the inner method's merged task vector
(task arithmetic, TIES, consensus, a model soup, WiSE-FT...) and the factor of
transformer block b of a stack with L blocks is λ(b) = α + β·(b/(L−1))^p: block 0
gets α, the last block α+β. LiNeS replaces the inner method's global λ, so the
inner ``scale`` is 1 unless the user gives one.

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

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from hubsoup.errors import MethodError, ParameterError
from hubsoup.methods._compose import Composed, Modifier
from hubsoup.methods.base import StatsPass, TensorContext, register
from hubsoup.methods.linear import weighted_average
from hubsoup.params import param
from hubsoup.plan import BlockInfo

# Base methods whose α is fixed by the paper instead of the Eq. 2 heuristic.
_FIXED_ALPHA = {"linear": 1.0, "soup": 1.0, "wise_ft": 0.5}
_FIXED_BETA = {"wise_ft": 0.5}
_DEFAULT_BETA = 1.0


@dataclass
class DepthParams:
    """The depth schedule's shape, shared by every method that applies LiNeS."""

    p: float = param(1.0, "exponent of the schedule α + β·(b/(L−1))^p (a one-block stack gets α): 1 = linear (paper); "
                          "0.5 (sqrt) and 2 (quadratic) are the paper's ablations", range=(0.0, None))
    outside_scale: str = param(
        "alpha", "factor of tensors outside the scaled blocks (embeddings, final norm, head, and the stacks that "
                 "`stacks` leaves out, e.g. T5's encoder): alpha (the paper's fallback for unmatched keys), "
                 "alpha_plus_beta (the 'encoder not downscaled' reading of App. C.5), or a number", source="ours")
    stacks: str = param(
        "auto", "stacks given the depth schedule, each with its own depth L from the config: auto = only the "
                "decoder stacks when the model has one (T5 `decoder.block`, as the paper), every stack otherwise; "
                "all; decoder; or comma-separated stack names (`hubsoup plan` shows them)", source="ours")

    def validate(self) -> None:
        if not self.p > 0:
            raise ParameterError(f"parameter 'p' = {self.p} must be > 0 (p = 0 would give block 0 the factor α+β)")
        if self.outside_scale not in ("alpha", "alpha_plus_beta"):
            try:
                float(self.outside_scale)
            except ValueError:
                raise ParameterError(f"parameter 'outside_scale': {self.outside_scale!r} is not alpha, "
                                     "alpha_plus_beta or a number") from None
        if not self.stacks.strip():
            raise ParameterError("parameter 'stacks' is empty")


def _is_decoder(stack: str) -> bool:
    return "decoder" in stack.split(".")


def stack_scaled(stack: str, spec: str, plan_stacks: dict | None) -> bool:
    """Whether blocks of ``stack`` follow the depth schedule under the ``stacks`` setting ``spec``.

    ``plan_stacks`` (stack → number of layers, which the engine puts in the stats as
    ``plan.stacks``) tells ``auto`` whether the model has a decoder stack.
    """
    if spec == "all":
        return True
    if spec == "decoder":
        return _is_decoder(stack)
    if spec == "auto":
        has_decoder = any(_is_decoder(s) for s in (plan_stacks or {stack: 0}))
        return _is_decoder(stack) or not has_decoder
    return stack in {s.strip() for s in spec.split(",")}


def depth_factor(block: BlockInfo | None, alpha: float, beta: float, sched: DepthParams,
                 plan_stacks: dict | None = None) -> float:
    """λ of a tensor: α + β·(b/(L−1))^p inside a scaled block, else the outside scale.

    A stack of one block (L = 1) gets α [ours: the paper's (ℓ−1)/(L−1) is undefined there].
    """
    if block is None or not stack_scaled(block.stack, sched.stacks, plan_stacks):
        if sched.outside_scale == "alpha":
            return alpha
        if sched.outside_scale == "alpha_plus_beta":
            return alpha + beta
        return float(sched.outside_scale)
    return alpha + beta * block.depth ** sched.p


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
        None, "β, the last block gets α+β; none = 0.5 for wise_ft (paper), else 1.0 (the appendix pseudocode's "
              "default; the paper tunes β on validation: TA/consensus 0.1..1.0, TIES 0.1..1.5, soups 0..1)",
        source="ours")
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

    def __init__(self, method: "Lines", params: Composed, n: int):
        self.method, self.params, self.n = method, params, n
        self.kind = params.own.alpha_norm
        self.sum = self.mtl = 0.0

    def update(self, ctx: TensorContext, base: torch.Tensor, deltas: torch.Tensor) -> None:
        total = weighted_average(deltas, [1.0] * len(deltas), normalize=False)  # as task arithmetic sums
        self.sum += _norm(total, self.kind)
        del total
        merged = self.method.inner_merge(base, deltas.clone(), self.params, ctx)  # merge may overwrite its input
        self.mtl += _norm(merged, self.kind)

    def finish(self, stats: dict[str, Any]) -> None:
        s, m = (self.sum, self.mtl) if self.kind == "l1" else (math.sqrt(self.sum), math.sqrt(self.mtl))
        if m == 0:
            raise MethodError("lines: the inner method's merged task vector is zero everywhere; the α heuristic "
                              "(1/N)·‖Σ τ‖/‖τ_MTL‖ is undefined — give alpha")
        stats["lines.norm_sum"], stats["lines.norm_mtl"] = s, m
        stats["lines.alpha"] = (s / m) / self.n  # exactly 1/N when the norms agree


@register
class Lines(Modifier):
    name = "lines"
    summary = ("LiNeS: scale the (merged) task vector by a factor rising linearly with block depth, "
               "α at the first block to α+β at the last, on top of a base method.")
    paper = ("LiNeS: Post-training Layer Scaling Prevents Forgetting and Enhances Model Merging "
             "(Wang, Dimitriadis et al., 2025)")
    paper_url = "https://arxiv.org/abs/2410.17146"
    Params = LinesParams
    inner_defaults = {m: {"scale": 1.0} for m in ("task_arithmetic", "ties", "consensus", "dare", "soup")}
    defaults_priority = 10  # β replaces the base method's λ, whatever other modifiers of the chain prefer

    def check_inputs(self, params: Composed, n_inputs: int) -> None:
        super().check_inputs(params, n_inputs)
        if params.own.edit_gamma is not None and n_inputs != 1:
            raise MethodError(f"method 'lines': edit_gamma edits a single fine-tune; got {n_inputs} inputs")

    @staticmethod
    def _ta_alpha(params: Composed, n: int) -> float | None:
        """Eq. 2 in closed form for unweighted task arithmetic at scale 1: exactly 1/N."""
        ip = params.inner_params
        if params.inner.name == "task_arithmetic" and ip.weights is None and ip.scale == 1.0:
            return 1.0 / n
        return None

    def _needs_pass(self, params: Composed, n: int) -> bool:
        own = params.own
        return (own.alpha is None and own.edit_gamma is None and params.inner.name not in _FIXED_ALPHA
                and self._ta_alpha(params, n) is None)

    def passes(self, params: Composed, n_inputs: int) -> list[StatsPass]:
        inner = self.inner_passes(params, n_inputs)
        return inner + ([_HeuristicPass(self, params, n_inputs)] if self._needs_pass(params, n_inputs) else [])

    def alpha_beta(self, params: Composed, ctx: TensorContext) -> tuple[float, float, str]:
        """α and β of this merge, and where α comes from."""
        own = params.own
        if own.edit_gamma is not None:
            return own.edit_gamma, 1.0 - own.edit_gamma, "single-task edit: α = γ, β = 1 − γ"
        beta = own.beta if own.beta is not None else _FIXED_BETA.get(params.inner.name, _DEFAULT_BETA)
        if own.alpha is not None:
            return own.alpha, beta, "given"
        if params.inner.name in _FIXED_ALPHA:
            return _FIXED_ALPHA[params.inner.name], beta, f"the paper's value for {params.inner.name}"
        alpha = self._ta_alpha(params, ctx.n_inputs)
        if alpha is not None:
            return alpha, beta, "Eq. 2 heuristic, exactly 1/N for task arithmetic"
        stats = ctx.stats
        return stats["lines.alpha"], beta, (f"Eq. 2 heuristic (1/N)·‖Σ τ_i‖/‖τ_MTL‖ = {stats['lines.norm_sum']:.6g} "
                                            f"/ ({ctx.n_inputs} · {stats['lines.norm_mtl']:.6g}), "
                                            f"{params.own.alpha_norm.upper()} norm")

    def factor(self, params: Composed, ctx: TensorContext) -> float:
        alpha, beta, _ = self.alpha_beta(params, ctx)
        return depth_factor(ctx.block, alpha, beta, params.own, ctx.stats.get("plan.stacks"))

    def merge(self, base, deltas, params: Composed, ctx: TensorContext):
        lam = self.factor(params, ctx)
        return self.inner_merge(base, deltas, params, ctx).mul_(lam)

    def card_notes(self, described: dict[str, Any], stats: dict[str, Any], n_inputs: int) -> list[str]:
        """Model-card lines: the α and β used and each stack's factors."""
        params = self.parse(described)
        alpha, beta, why = self.alpha_beta(params, TensorContext("", None, n_inputs, stats))
        return [schedule_note(alpha, beta, why, params.own, stats.get("plan.stacks") or {}),
                *super().card_notes(described, stats, n_inputs)]


def schedule_note(alpha: float, beta: float, why: str, sched: DepthParams, plan_stacks: dict[str, int]) -> str:
    """Markdown describing the depth factors a merge used, for the model card."""
    lines = [f"**LiNeS depth scaling.** α = {alpha:.6g} ({why}), β = {beta:.6g}, p = {sched.p:g}: "
             "block b of a scaled stack of L blocks gets α + β·(b/(L−1))^p.", ""]
    for stack, n in plan_stacks.items():
        if stack_scaled(stack, sched.stacks, plan_stacks):
            last = depth_factor(BlockInfo(stack, n - 1, n), alpha, beta, sched, plan_stacks)
            lines.append(f"- `{stack}` ({n} blocks): scaled, block 0 → {alpha:.6g}, block {n - 1} → {last:.6g}")
        else:
            lines.append(f"- `{stack}` ({n} blocks): not scaled (`stacks={sched.stacks}`), gets the outside factor")
    outside = depth_factor(None, alpha, beta, sched, plan_stacks)
    lines.append(f"- tensors outside scaled blocks (`outside_scale={sched.outside_scale}`): {outside:.6g}")
    return "\n".join(lines)
