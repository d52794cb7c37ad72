"""SCE (Select, Calculate, Erase): FuseChat 2.0's fusion of task vectors.

Wan et al. (2024), as mergekit's ``sce``: **select** the entries whose variance across the
task vectors is in the top ``select_topk`` fraction of the entries with non-zero variance
(``k = int(nonzero · select_topk)``; ``select_topk >= 1`` keeps all); **calculate** each
task vector's weight as its mean squared entry (after selection) over the sum of them
(uniform if the sum is below 1e-6); **erase** the entries whose sign disagrees with the
elected sign (sign of the sum, + at 0); the merged task vector is
``Σ wᵢ·mᵢ·τᵢ / max(Σ wᵢ·mᵢ, 1e-6)`` per entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hubsoup.methods import Method, param, register


@dataclass
class SceParams:
    select_topk: float = param(1.0, "fraction of entries with the highest variance across inputs kept",
                               range=(0.0, 1.0), source="mergekit")


@register
class Sce(Method):
    name = "sce"
    summary = "Select high-variance entries, weight task vectors by their energy, erase minority signs (FuseChat 2.0)."
    paper = "FuseChat: Knowledge Fusion of Chat Models (Wan et al., 2024), SCE merging"
    paper_url = "https://arxiv.org/abs/2408.07990"
    Params = SceParams

    def merge(self, base, deltas, params, ctx):
        n = len(deltas)
        k_frac = params.select_topk
        if k_frac < 1:
            if k_frac <= 0:
                deltas.zero_()
            else:
                var = deltas.var(dim=0, unbiased=False)
                k = int(int(torch.count_nonzero(var)) * k_frac)
                mask = torch.zeros(var.numel(), dtype=torch.bool, device=var.device)
                if k > 0:
                    mask[torch.topk(var.flatten(), k).indices] = True
                deltas.mul_(mask.reshape(var.shape))
        energy = deltas.square().reshape(n, -1).mean(dim=1)
        total = float(energy.sum())
        w = torch.full_like(energy, 1.0 / n) if abs(total) < 1e-6 else energy / total
        w = w.reshape(-1, *[1] * (deltas.dim() - 1))
        elected = torch.where(deltas.sum(dim=0) >= 0, 1.0, -1.0)
        kept_w = w * (torch.sign(deltas) == elected)
        return (deltas * kept_w).sum(dim=0).div_(kept_w.sum(dim=0).clamp_(min=1e-6))
