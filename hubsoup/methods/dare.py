"""DARE: drop a fraction p of each task vector at random and rescale the rest by 1/(1-p)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from hubsoup.methods import Method, TensorContext, param, register
from hubsoup.methods._kernels import task_arithmetic, ties_combine_


def dare_drop_(delta: torch.Tensor, p: float, generator: torch.Generator, rescale: bool = True) -> torch.Tensor:
    """In place: zero each entry with probability p; rescale survivors by 1/(1-p).

    The mask is drawn on the generator's device (the CPU's, from the engine) and moved to
    ``delta``'s: the same recipe gives the same masks on every device.
    """
    if p == 0:
        return delta
    keep = torch.bernoulli(torch.full(delta.shape, 1.0 - p, dtype=delta.dtype, device=generator.device),
                           generator=generator)
    delta.mul_(keep.to(delta.device))
    return delta.div_(1.0 - p) if rescale else delta


@dataclass
class DareParams:
    p: float = param(0.9, "drop rate (the DARE paper drops up to 90-99% of delta parameters)", range=(0.0, 0.9999))
    then: Literal["sum", "ties"] = param("sum", "combine the sparsified vectors by weighted sum (task arithmetic) "
                                              "or by TIES sign election + disjoint mean (dare_ties)")
    scale: float = param(1.0, "λ applied to the combined task vector", range=(None, None))
    weights: tuple[float, ...] | None = param(None, "per-input weights (default 1 each)")
    rescale: bool = param(True, "rescale kept entries by 1/(1-p)")
    seed: int = param(0, "extra seed mixed with the recipe and tensor name", source="ours")


@register
class Dare(Method):
    name = "dare"
    summary = "Randomly drop delta parameters and rescale (Drop And REscale), then sum or TIES-combine."
    paper = "Language Models are Super Mario: Absorbing Abilities from Homologous Models as a Free Lunch (Yu et al., 2024)"
    paper_url = "https://arxiv.org/abs/2311.03099"
    Params = DareParams
    search_grid = {"scale": [round(0.1 * i, 1) for i in range(1, 11)]}  # λ = 0.1..1.0
    scale_param = "scale"

    def merge(self, base, deltas, params, ctx: TensorContext):
        for i, row in enumerate(deltas):
            dare_drop_(row, params.p, ctx.generator(f"dare:{params.seed}:{i}"), params.rescale)
        if params.then == "ties":
            return ties_combine_(deltas, params.weights, "mean").mul_(params.scale)
        return task_arithmetic(deltas, params.weights or [1.0] * len(deltas), params.scale)
