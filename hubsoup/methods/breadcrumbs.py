"""Model Breadcrumbs: drop each task vector's largest outliers and its small entries, then add.

Davari & Belilovsky (2023) mask, per tensor, the ``gamma`` fraction of a task vector's
largest magnitudes (outliers) and the smallest ones, keeping a ``density`` fraction
(:func:`hubsoup.methods._sparsify.outliers_mask`, mergekit's ``magnitude_outliers``:
``k = int(density·n)`` kept, ``int(gamma·n)`` largest dropped, fewer when both do not fit;
``density >= 1`` keeps everything). The masked vectors are weighted and summed
(``breadcrumbs``), or combined with TIES' sign consensus (``breadcrumbs_ties``); with
``normalize`` divided by the (agreeing) weights; then λ = ``scale``. Defaults follow
mergekit (normalize false, rescale false, gamma 0.01).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hubsoup.methods import Method, param, register
from hubsoup.methods._sparsify import (ComputeDtype, apply_mask_, compute_dtype, compute_dtype_param, gta_combine_,
                                      gta_in_dtype, outliers_mask, per_input)

if TYPE_CHECKING:
    from hubsoup.methods import TensorContext


@dataclass
class BreadcrumbsParams:
    density: float = param(0.9, "kept fraction of each task vector (after dropping outliers and small entries)",
                           range=(0.0, 1.0), source="ours")
    gamma: float = param(0.01, "fraction of largest magnitudes dropped as outliers", range=(0.0, 1.0),
                         source="mergekit")
    scale: float = param(1.0, "λ applied to the combined task vector (mergekit's lambda)", range=(None, None))
    weights: tuple[float, ...] | None = param(None, "per-input weights (default 1 each)", per_input=True)
    densities: tuple[float, ...] | None = param(None, "per-input density (overrides density)", range=(0.0, 1.0),
                                                per_input=True, source="mergekit")
    gammas: tuple[float, ...] | None = param(None, "per-input gamma (overrides gamma)", range=(0.0, 1.0),
                                             per_input=True, source="mergekit")
    normalize: bool = param(False, "divide by the sum of the (agreeing) weights", source="mergekit")
    rescale: bool = param(False, "rescale each masked task vector to its L1 norm", source="mergekit")
    compute_dtype: ComputeDtype = compute_dtype_param()


@register
class Breadcrumbs(Method[BreadcrumbsParams]):
    name = "breadcrumbs"
    summary = "Drop each task vector's outliers and small entries (Model Breadcrumbs), then weighted sum."
    paper = "Model Breadcrumbs: Scaling Multi-Task Model Merging with Sparse Masks (Davari & Belilovsky, 2023)"
    paper_url = "https://arxiv.org/abs/2312.06795"
    Params = BreadcrumbsParams
    search_grid = {"scale": [round(0.1 * i, 1) for i in range(1, 11)]}
    scale_param = "scale"
    consensus = False

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: BreadcrumbsParams,
              ctx: TensorContext) -> torch.Tensor:
        n = len(deltas)
        dens, gammas = per_input(params.density, params.densities, n), per_input(params.gamma, params.gammas, n)
        dtype = compute_dtype(params.compute_dtype, ctx)
        if dtype != torch.float32:
            return gta_in_dtype(base, deltas, dtype, lambda i, tau: outliers_mask(tau, dens[i], gammas[i]),
                                params.weights or [1.0] * n, consensus=self.consensus, normalize=params.normalize,
                                scale=params.scale, rescale=params.rescale)
        for row, d, g in zip(deltas, dens, gammas):
            apply_mask_(row, outliers_mask(row, d, g), params.rescale)
        return gta_combine_(deltas, params.weights or [1.0] * n, consensus=self.consensus,
                            normalize=params.normalize, scale=params.scale)


@register
class BreadcrumbsTies(Breadcrumbs):
    name = "breadcrumbs_ties"
    summary = "Model Breadcrumbs masks, then TIES sign consensus over the weighted vectors (mergekit's breadcrumbs_ties)."
    consensus = True
