"""Rewarded soups: interpolate policies fine-tuned on different rewards, optionally with LiNeS.

θ = θ_SFT + Σ_i λ_i τ_i with τ_i = θ_i − θ_SFT and λ on the simplex (the user's
preference over the rewards). With ``lines=true`` the interpolated residual is
depth-scaled as in LiNeS Sec. 5.4 (α = β = 1: the deepest block's update is doubled).
The inputs are usually LoRA policies of the SFT model; the method only sees their
task vectors. ``hubsoup sweep`` writes one model per preference vector.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hubsoup.errors import MethodError, ParameterError
from hubsoup.methods import Method, TensorContext, param, register
from hubsoup.methods._depth import DepthParams, depth_factor, schedule_note
from hubsoup.methods._kernels import weighted_average

if TYPE_CHECKING:
    import torch

SIMPLEX_TOL = 1e-6


@dataclass
class _RewardedSoupsOwn:
    lambdas: tuple[float, ...] | None = param(
        None, "preference λ_i, one per input, on the simplex (λ_i ≥ 0, Σ λ_i = 1); default uniform 1/N",
        range=(0.0, 1.0))
    lines: bool = param(False, "apply LiNeS depth scaling to the interpolated residual (LiNeS Sec. 5.4); "
                               "default off = the original rewarded soups", source="ours")
    alpha: float = param(1.0, "LiNeS α when lines=true (paper: 1)")
    beta: float = param(1.0, "LiNeS β when lines=true (paper: 1, the last block gets α+β = 2)")


@dataclass
class RewardedSoupsParams(DepthParams, _RewardedSoupsOwn):  # fields: the preference first, then the schedule's
    def validate(self) -> None:
        super().validate()
        if self.lambdas is not None and abs(sum(self.lambdas) - 1.0) > SIMPLEX_TOL:
            raise ParameterError(f"parameter 'lambdas' must sum to 1 (a point on the simplex), "
                                 f"got {list(self.lambdas)} summing to {sum(self.lambdas):.6g}")


@register
class RewardedSoups(Method[RewardedSoupsParams]):
    name = "rewarded_soups"
    summary = "Interpolate reward-specific policies of one SFT model by a preference λ on the simplex (+ LiNeS)."
    paper = ("Rewarded soups: towards Pareto-optimal alignment by interpolating weights fine-tuned on diverse "
             "rewards (Ramé et al., 2023); with LiNeS (Wang, Dimitriadis et al., 2025)")
    paper_url = "https://arxiv.org/abs/2306.04488"
    Params = RewardedSoupsParams
    min_inputs = 2

    def check_inputs(self, params: RewardedSoupsParams, n_inputs: int) -> None:
        super().check_inputs(params, n_inputs)
        if params.lambdas is not None and len(params.lambdas) != n_inputs:
            raise MethodError(f"method 'rewarded_soups': {len(params.lambdas)} lambdas given for {n_inputs} inputs")

    @staticmethod
    def lambdas(params: RewardedSoupsParams, n: int) -> list[float]:
        return list(params.lambdas) if params.lambdas is not None else [1.0 / n] * n

    def linear_coefficients(self, params: RewardedSoupsParams, n_inputs: int) -> list[float] | None:
        # LiNeS makes the coefficients depend on the tensor's depth: no single set, dense path
        return None if params.lines else self.lambdas(params, n_inputs)

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: RewardedSoupsParams,
              ctx: TensorContext) -> torch.Tensor:
        out = weighted_average(deltas, self.lambdas(params, len(deltas)), normalize=False)
        if params.lines:
            out.mul_(depth_factor(ctx.block, params.alpha, params.beta, params, ctx.stats.get("plan.stacks")))
        return out

    def card_notes(self, described: dict[str, Any], stats: dict[str, Any], n_inputs: int) -> list[str]:
        params = self.parse(described)
        lam = ", ".join(f"{x:.4g}" for x in self.lambdas(params, n_inputs))
        notes = [f"**Rewarded soup** at preference λ = ({lam})."]
        if params.lines:
            notes.append(schedule_note(params.alpha, params.beta, "given", params, stats.get("plan.stacks") or {}))
        return notes
