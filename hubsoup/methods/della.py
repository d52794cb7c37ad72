"""DELLA: magnitude-ranked random drops (MagPrune), rescale, then TIES-style fusion.

Deep et al. (2024) drop each entry of a task vector with a probability that falls with its
magnitude rank: in mergekit's implementation (the paper's reference code), entry j of a
row keeps with probability ``density − ε + 2ε · rank_j/(n − 1)`` (ranks of |τ| along dim 1,
the whole vector for a 1-D tensor; :func:`hubsoup.methods._sparsify.della_probabilities`),
and with ``rescale`` the survivors are rescaled so the task vector keeps its L1 norm.
``della`` then elects signs on the weighted vectors and (``normalize``, default true)
divides by the agreeing weights; ``della_linear`` adds the weighted vectors (normalize
default false). λ = ``scale`` last. ``density ± epsilon`` must lie in (0, 1).

Masks are seeded from the recipe hash, the tensor name and the input; they agree with
mergekit's in distribution, not bit for bit.

With ``compute_dtype`` (set from a mergekit config's ``dtype``) every step is computed as mergekit computes it
in that dtype (:func:`~hubsoup.methods._sparsify.gta_in_dtype`): the drop and the L1 rescale in bfloat16, or
in float32 for float16 (mergekit's ``della_magprune`` upcasts there), the rest in the half dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hubsoup.errors import ParameterError
from hubsoup.methods import Method, param, register
from hubsoup.methods._sparsify import (ComputeDtype, apply_mask_, compute_dtype, compute_dtype_param, della_mask,
                                       gta_combine_, gta_in_dtype, per_input, random_work_dtype)

if TYPE_CHECKING:
    from hubsoup.methods import TensorContext


@dataclass
class DellaParams:
    density: float = param(0.7, "mean kept fraction of each task vector", range=(0.0, 1.0), source="ours")
    epsilon: float = param(0.15, "spread of the keep probabilities around density, by magnitude rank",
                           range=(0.0, 1.0), source="mergekit")
    scale: float = param(1.0, "λ applied to the combined task vector (mergekit's lambda)", range=(None, None))
    weights: tuple[float, ...] | None = param(None, "per-input weights (default 1 each)", per_input=True)
    densities: tuple[float, ...] | None = param(None, "per-input density (overrides density)", range=(0.0, 1.0),
                                                per_input=True, source="mergekit")
    epsilons: tuple[float, ...] | None = param(None, "per-input epsilon (overrides epsilon)", range=(0.0, 1.0),
                                               per_input=True, source="mergekit")
    normalize: bool = param(True, "divide by the sum of the (agreeing) weights", source="mergekit")
    rescale: bool = param(True, "rescale each pruned task vector to its L1 norm", source="mergekit")
    seed: int = param(0, "extra seed mixed with the recipe and tensor name", source="ours")
    compute_dtype: ComputeDtype = compute_dtype_param()

    def validate(self) -> None:
        pairs = zip(self.densities or [self.density], self.epsilons or [self.epsilon])
        for d, e in pairs:
            if 0 < d < 1 and not (0 < d - e and d + e < 1):
                raise ParameterError(f"parameters 'density' {d} and 'epsilon' {e}: density ± epsilon must lie "
                                     "in (0, 1)")


class _Della(Method[DellaParams]):
    Params = DellaParams
    paper = "DELLA-Merging: Reducing Interference in Model Merging through Magnitude-Based Sampling (Deep et al., 2024)"
    paper_url = "https://arxiv.org/abs/2406.11617"
    search_grid = {"scale": [round(0.1 * i, 1) for i in range(1, 11)]}
    scale_param = "scale"
    consensus = True

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: DellaParams,
              ctx: TensorContext) -> torch.Tensor:
        n = len(deltas)
        dens, eps = per_input(params.density, params.densities, n), per_input(params.epsilon, params.epsilons, n)

        def mask_of(i: int, row: torch.Tensor) -> torch.Tensor | None:
            if dens[i] >= 1:
                return None
            return (row != row) if dens[i] <= 0 else della_mask(row, dens[i], eps[i],
                                                                 ctx.generator(f"della:{params.seed}:{i}"))

        dtype = compute_dtype(params.compute_dtype, ctx)
        if dtype != torch.float32:  # mergekit's della(_linear) in its config's dtype, step for step
            return gta_in_dtype(base, deltas, dtype, mask_of, params.weights or [1.0] * n, consensus=self.consensus,
                                normalize=params.normalize, scale=params.scale, rescale=params.rescale,
                                sparsify_dtype=random_work_dtype(dtype))
        for i, row in enumerate(deltas):
            mask = mask_of(i, row)
            if mask is not None:
                apply_mask_(row, mask, params.rescale)
        return gta_combine_(deltas, params.weights or [1.0] * n, consensus=self.consensus,
                            normalize=params.normalize, scale=params.scale)


@register
class Della(_Della):
    name = "della"
    summary = "Drop entries at random with magnitude-ranked probabilities (MagPrune), rescale, TIES-style fusion."


@dataclass
class DellaLinearParams(DellaParams):
    normalize: bool = param(False, "divide by the sum of the weights", source="mergekit")


@register
class DellaLinear(_Della):
    name = "della_linear"
    summary = "DELLA's MagPrune and rescale, then a weighted sum of the task vectors (no sign consensus)."
    Params = DellaLinearParams
    consensus = False
