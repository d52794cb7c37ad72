"""DARE: drop a fraction p of each task vector at random and rescale the rest.

Two conventions (``convention``):

* ``paper`` (default): survivors rescaled by 1/(1 − p); ``then=ties`` elects signs on the
  unweighted vectors and takes the disjoint mean over agreeing entries (peft's
  ``dare_ties``); ``then=sum`` is λ Σ wᵢ τᵢ.
* ``mergekit``: mergekit's ``dare_ties`` / ``dare_linear``: each entry kept with
  probability density = 1 − p (per input with ``densities``), survivors rescaled so the task
  vector keeps its L1 norm (``rescale``); then weights, and for ``then=ties`` signs elected on
  the weighted sum with ``merge=sum`` (mergekit's default ``normalize: false``, a disjoint sum)
  or ``merge=mean`` (divide by the agreeing weights); for ``then=sum``, ``normalize``
  divides by Σ wᵢ. λ last.

Masks are seeded from the recipe hash, the tensor name and the input: reruns repeat exactly;
against mergekit they agree in distribution (kept fraction, rescale), not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from hubsoup.errors import ParameterError
from hubsoup.methods import Method, TensorContext, param, register
from hubsoup.methods._kernels import task_arithmetic, ties_combine_
from hubsoup.methods._sparsify import apply_mask_, bernoulli_mask, gta_combine_


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
    then: Literal["sum", "ties"] = param("sum", "combine the sparsified vectors by weighted sum (task arithmetic, "
                                              "dare_linear) or by TIES sign election + disjoint merge (dare_ties)")
    scale: float | None = param(
        None, "λ applied to the combined task vector; none = the combining method's own default: 0.3 for then=sum "
              "(task arithmetic's λ; λ = 1 summed N rescaled vectors and cost 19 control points at 8 tasks), 1 for "
              "then=ties and for convention=mergekit (mergekit's lambda)", range=(None, None), source="measured")
    weights: tuple[float, ...] | None = param(None, "per-input weights (default 1 each)", per_input=True)
    rescale: bool = param(True, "rescale kept entries: by 1/(1-p) (paper) or to the L1 norm (mergekit)")
    seed: int = param(0, "extra seed mixed with the recipe and tensor name", source="ours")
    convention: Literal["paper", "mergekit"] = param(
        "paper", "paper: 1/(1-p) rescale, signs on unweighted vectors; mergekit: L1-norm rescale, signs on "
                 "weighted vectors, merge/normalize as mergekit's dare_ties/dare_linear", source="mergekit")
    densities: tuple[float, ...] | None = param(None, "per-input kept fraction (mergekit's per-model density; "
                                                      "overrides p = 1 - density)", range=(0.0, 1.0),
                                                per_input=True, source="mergekit")
    merge: Literal["mean", "sum"] = param("mean", "then=ties: disjoint mean or disjoint sum (mergekit's "
                                                  "dare_ties default, normalize: false)")
    normalize: bool = param(False, "then=sum: divide by the sum of the weights (mergekit's normalize)",
                            source="mergekit")

    def validate(self):
        if self.densities is not None and self.convention != "mergekit":
            raise ParameterError("parameter 'densities' needs convention=mergekit (the paper convention has one p)")


@register
class Dare(Method):
    name = "dare"
    summary = "Randomly drop delta parameters and rescale (Drop And REscale), then sum or TIES-combine."
    paper = "Language Models are Super Mario: Absorbing Abilities from Homologous Models as a Free Lunch (Yu et al., 2024)"
    paper_url = "https://arxiv.org/abs/2311.03099"
    Params = DareParams
    search_grid = {"scale": [round(0.1 * i, 1) for i in range(1, 11)]}  # λ = 0.1..1.0
    scale_param = "scale"

    @staticmethod
    def resolved_scale(params) -> float:
        """λ of this merge: the given scale, else the combining method's default (see ``scale``)."""
        if params.scale is not None:
            return params.scale
        return 0.3 if params.then == "sum" and params.convention == "paper" else 1.0

    def merge(self, base, deltas, params, ctx: TensorContext):
        weights = params.weights or [1.0] * len(deltas)
        scale = self.resolved_scale(params)
        if params.convention == "mergekit":
            densities = params.densities or [1.0 - params.p] * len(deltas)
            for i, (row, density) in enumerate(zip(deltas, densities)):
                if density < 1.0:
                    mask = bernoulli_mask(row.shape, density, ctx.generator(f"dare:{params.seed}:{i}"), row.device)
                    apply_mask_(row, mask, params.rescale)
            normalize = params.merge == "mean" if params.then == "ties" else params.normalize
            return gta_combine_(deltas, weights, consensus=params.then == "ties", normalize=normalize,
                                scale=scale)
        for i, row in enumerate(deltas):
            dare_drop_(row, params.p, ctx.generator(f"dare:{params.seed}:{i}"), params.rescale)
        if params.then == "ties":
            return ties_combine_(deltas, params.weights, params.merge).mul_(scale)
        out = task_arithmetic(deltas, weights, scale)
        return out.div_(sum(weights)) if params.normalize and abs(sum(weights)) >= 1e-8 else out
