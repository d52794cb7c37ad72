"""Consensus merging with TALL masks: drop weights that fewer than k tasks use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from hubsoup.errors import MethodError
from hubsoup.methods import Method, param, register

if TYPE_CHECKING:
    from hubsoup.methods import TensorContext


def tall_mask_counts(deltas: torch.Tensor, lambdas: Sequence[float], strict: bool = False) -> torch.Tensor:
    """How many tasks' TALL masks keep each entry: m_t = 1[|τ_t| ≥ λ_t·|Σ_j τ_j − τ_t|]."""
    total = deltas.sum(dim=0)
    count = torch.zeros_like(total)
    for d, lam in zip(deltas, lambdas):
        lhs, rhs = d.abs(), (total - d).abs_().mul_(lam)
        count.add_(lhs > rhs if strict else lhs >= rhs)
    return count


@dataclass
class ConsensusParams:
    k: int = param(2, "minimum number of tasks whose TALL mask keeps a weight (k=0: task arithmetic)", range=(0, None))
    lambdas: tuple[float, ...] = param((0.4,), "TALL-mask λ_t, one value for all tasks or one per task "
                                               "(papers search 0.2..0.6)", range=(0.0, None), source="ours")
    scale: float = param(0.7, "λ of task arithmetic applied to the masked sum (the mask drops most entries, so it "
                               "wants a larger λ than plain task arithmetic: λ = 0.3 recovered 0.25-0.40 of the "
                               "encoders' gain; 0.7 was best on the LM's validation and within 0.02 of the best, "
                               "1.0, on the encoder's)", range=(None, None), source="measured")
    strict: bool = param(False, "use > instead of ≥ in the TALL mask (the authors' code)")


@register
class Consensus(Method[ConsensusParams]):
    name = "consensus"
    summary = "Task arithmetic restricted to weights that at least k tasks' TALL masks select."
    paper = "Localizing Task Information for Improved Model Merging and Compression (Wang et al., 2024)"
    paper_url = "https://arxiv.org/abs/2405.07813"
    Params = ConsensusParams
    elementwise = True  # each entry's masks and sum read that entry's task vectors only: merged in pieces, in lanes
    search_grid = {"scale": [round(0.1 * i, 1) for i in range(1, 11)], "k": [1, 2],  # the paper's grids
                   "lambdas": [0.2, 0.3, 0.4, 0.5, 0.6]}
    scale_param = "scale"

    def check_inputs(self, params: ConsensusParams, n_inputs: int) -> None:
        super().check_inputs(params, n_inputs)
        if len(params.lambdas) not in (1, n_inputs):
            raise MethodError(f"method 'consensus': give 1 or {n_inputs} lambdas, got {len(params.lambdas)}")

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: ConsensusParams,
              ctx: TensorContext) -> torch.Tensor:
        if params.k == 0:
            return deltas.sum(dim=0).mul_(params.scale)
        lambdas = list(params.lambdas) * len(deltas) if len(params.lambdas) == 1 else list(params.lambdas)
        keep = tall_mask_counts(deltas, lambdas, params.strict) >= params.k
        return deltas.sum(dim=0).mul_(keep).mul_(params.scale)
