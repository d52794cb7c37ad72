"""The depth schedule of LiNeS, shared by every method that applies it (``lines``, ``rewarded_soups``).

A tensor of transformer block b in a scaled stack of L blocks gets the factor
λ(b) = α + β·(b/(L−1))^p; tensors outside the scaled blocks (embeddings, final norm,
head, stacks left out) get the ``outside_scale``. :class:`DepthParams` holds the
schedule's shape as typed parameters that a method's ``Params`` inherits;
:func:`depth_factor` is the factor, :func:`schedule_note` its model-card paragraph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from hubsoup.errors import ParameterError
from hubsoup.methods import param
from hubsoup.plan import BlockInfo


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


def stack_scaled(stack: str, spec: str, plan_stacks: dict[str, int] | None) -> bool:
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
                 plan_stacks: dict[str, int] | None = None) -> float:
    """λ of a tensor: α + β·(b/(L−1))^p inside a scaled block, else the outside scale.

    A stack of one block (L = 1) gets α [ours: the paper's (ℓ−1)/(L−1) is undefined there].
    """
    if block is None or not stack_scaled(block.stack, sched.stacks, plan_stacks):
        if sched.outside_scale == "alpha":
            return alpha
        if sched.outside_scale == "alpha_plus_beta":
            return alpha + beta
        return float(sched.outside_scale)
    return alpha + beta * cast(float, block.depth ** sched.p)  # depth ≥ 0, p > 0: a real power


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
