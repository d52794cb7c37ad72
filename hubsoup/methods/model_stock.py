"""Model Stock: average the fine-tunes, then pull the average towards the base by their angle.

Jang et al. (2024): with N fine-tunes θᵢ of θ₀, the task vectors τᵢ = θᵢ − θ₀, and cos θ the
mean pairwise cosine similarity of the τᵢ, the merged weight is
``t·mean(θᵢ) + (1 − t)·θ₀`` with ``t = N cos θ / (1 + (N − 1) cos θ)``, i.e. the merged task
vector is ``t · mean(τᵢ)``. As mergekit computes it: per tensor (or per row of the last
dimension with ``filter_wise``; a 1-D tensor is then one row), cosines with the product of
norms clamped at 1e-6 and clipped to [−1, 1], and where ``1 + (N − 1) cos θ`` is below 1e-6
in magnitude the base is kept (t = 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hubsoup.methods import Method, param, register


@dataclass
class ModelStockParams:
    filter_wise: bool = param(False, "one t per row (last dimension) instead of per tensor", source="mergekit")


@register
class ModelStock(Method):
    name = "model_stock"
    summary = "Average the fine-tunes and interpolate towards the base by their mean pairwise angle."
    paper = "Model Stock: All we need is just a few fine-tuned models (Jang et al., 2024)"
    paper_url = "https://arxiv.org/abs/2403.19522"
    Params = ModelStockParams
    min_inputs = 2

    def merge(self, base, deltas, params, ctx):
        n = len(deltas)
        shape = deltas.shape[1:]
        if params.filter_wise:
            v = deltas.unsqueeze(1) if deltas.dim() == 2 else deltas  # 1-D tensors: one row
        else:
            v = deltas.reshape(n, -1)
        norms = torch.linalg.vector_norm(v, dim=-1)
        cos = []
        for i in range(n):
            for j in range(i + 1, n):
                dot = (v[i] * v[j]).sum(dim=-1)
                cos.append((dot / (norms[i] * norms[j]).clamp(min=1e-6)).clamp(-1, 1))
        c = torch.stack(cos).mean(dim=0).unsqueeze(-1)
        denom = 1 + (n - 1) * c
        singular = denom.abs() < 1e-6
        t = torch.where(singular, torch.zeros_like(c), n * c / torch.where(singular, torch.ones_like(denom), denom))
        mean = v.mean(dim=0)
        return (t * mean).reshape(shape)
