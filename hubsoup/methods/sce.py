"""SCE (Select, Calculate, Erase): FuseChat 2.0's fusion of task vectors.

Wan et al. (2024), as mergekit's ``sce``: **select** the entries whose variance across the
task vectors is in the top ``select_topk`` fraction of the entries with non-zero variance
(``k = int(nonzero · select_topk)``; ``select_topk >= 1`` keeps all; ties at the cut-off as mergekit's
``torch.topk``: :func:`~hubsoup.methods._kernels.topk_mask` with ``ties="mergekit_topk"``); **calculate** each
task vector's weight as its mean squared entry (after selection) over the sum of them
(uniform if the sum is below 1e-6); **erase** the entries whose sign disagrees with the
elected sign (sign of the sum, + at 0); the merged task vector is
``Σ wᵢ·mᵢ·τᵢ / max(Σ wᵢ·mᵢ, 1e-6)`` per entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hubsoup.methods import Method, param, register
from hubsoup.methods._kernels import topk_mask
from hubsoup.methods._sparsify import ComputeDtype, compute_dtype, compute_dtype_param

if TYPE_CHECKING:
    from hubsoup.methods import TensorContext


@dataclass
class SceParams:
    select_topk: float = param(1.0, "fraction of entries with the highest variance across inputs kept",
                               range=(0.0, 1.0), source="mergekit")
    compute_dtype: ComputeDtype = compute_dtype_param()


@register
class Sce(Method[SceParams]):
    name = "sce"
    summary = "Select high-variance entries, weight task vectors by their energy, erase minority signs (FuseChat 2.0)."
    paper = "FuseChat: Knowledge Fusion of Chat Models (Wan et al., 2024), SCE merging"
    paper_url = "https://arxiv.org/abs/2408.07990"
    Params = SceParams

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: SceParams,
              ctx: TensorContext) -> torch.Tensor:
        n = len(deltas)
        k_frac = params.select_topk
        dtype = compute_dtype(params.compute_dtype, ctx)
        if dtype != torch.float32:
            return sce_in_dtype(base, deltas, dtype, k_frac)
        if k_frac < 1:
            if k_frac <= 0:
                deltas.zero_()
            else:
                var = deltas.var(dim=0, unbiased=False)
                k = int(int(torch.count_nonzero(var)) * k_frac)
                deltas.mul_(topk_mask(var, k, ties="mergekit_topk"))
        energy = deltas.square().reshape(n, -1).mean(dim=1)
        total = float(energy.sum())
        w = torch.full_like(energy, 1.0 / n) if abs(total) < 1e-6 else energy / total
        w = w.reshape(-1, *[1] * (deltas.dim() - 1))
        elected = torch.where(deltas.sum(dim=0) >= 0, 1.0, -1.0)
        kept_w = w * (torch.sign(deltas) == elected)
        return (deltas * kept_w).sum(dim=0).div_(kept_w.sum(dim=0).clamp_(min=1e-6))


def sce_in_dtype(base: torch.Tensor, deltas: torch.Tensor, dtype: torch.dtype, select_topk: float) -> torch.Tensor:
    """SCE computed in ``dtype`` step for step, as mergekit computes it in its config's dtype (each step rounds);
    returns the merged task vector in float32 (the low-precision result minus ``base``)."""
    base_h = base.to(dtype)
    tvs = torch.stack([(base + d).to(dtype) - base_h for d in deltas])
    if select_topk < 1:
        var = torch.var(tvs, dim=0, unbiased=False)
        k = int(int(torch.count_nonzero(var)) * select_topk) if select_topk > 0 else 0
        tvs = tvs * topk_mask(var, k, ties="mergekit_topk").to(var.dtype).unsqueeze(0)
    sign = tvs.sign()
    agree = sign == (tvs.sum(dim=0) >= 0).to(dtype) * 2 - 1
    energy = tvs.square().reshape(len(tvs), -1).mean(dim=1)
    total = torch.sum(energy).item()
    w = torch.ones_like(energy) / energy.shape[0] if abs(total) < 1e-6 else energy / total
    w = w.reshape(-1, *[1] * (tvs.dim() - 1))
    kept = w * agree
    merged = (tvs * kept).sum(dim=0) / torch.sum(kept, dim=0).clamp(min=1e-6)
    return (base_h + merged).to(torch.float32).sub_(base)
