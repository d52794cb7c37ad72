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
from typing import TYPE_CHECKING, cast

import torch

from hubsoup.methods import Method, param, register
from hubsoup.methods._sparsify import ComputeDtype, compute_dtype, compute_dtype_param

if TYPE_CHECKING:
    from hubsoup.methods import TensorContext


@dataclass
class ModelStockParams:
    filter_wise: bool = param(False, "one t per row (last dimension) instead of per tensor", source="mergekit")
    compute_dtype: ComputeDtype = compute_dtype_param()


@register
class ModelStock(Method[ModelStockParams]):
    name = "model_stock"
    summary = "Average the fine-tunes and interpolate towards the base by their mean pairwise angle."
    paper = "Model Stock: All we need is just a few fine-tuned models (Jang et al., 2024)"
    paper_url = "https://arxiv.org/abs/2403.19522"
    Params = ModelStockParams
    min_inputs = 2

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: ModelStockParams,
              ctx: TensorContext) -> torch.Tensor:
        n = len(deltas)
        shape = deltas.shape[1:]
        dtype = compute_dtype(params.compute_dtype, ctx)
        if dtype != torch.float32:
            return model_stock_in_dtype(base, deltas, dtype, params.filter_wise)
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


def model_stock_in_dtype(base: torch.Tensor, deltas: torch.Tensor, dtype: torch.dtype,
                         filter_wise: bool) -> torch.Tensor:
    """Model Stock computed in ``dtype`` step for step, as mergekit computes it in its config's dtype (on the
    weights θᵢ, θ₀ themselves); returns the merged task vector in float32 (the result minus ``base``)."""
    w0 = base.to(dtype)
    ws = [(base + d).to(dtype) for d in deltas]
    shape = w0.shape
    if filter_wise:
        if w0.dim() == 1:
            w0, ws = w0.unsqueeze(0), [w.unsqueeze(0) for w in ws]
    else:
        w0, ws = w0.reshape(-1), [w.reshape(-1) for w in ws]
    offsets = [w - w0 for w in ws]
    cos = []
    for i, a in enumerate(offsets):
        for b in offsets[i + 1:]:
            norms = torch.norm(a, dim=-1) * torch.norm(b, dim=-1)
            cos.append(((a * b).sum(dim=-1) / norms.clamp(min=1e-6)).clamp(-1, 1))
    c = torch.stack(cos).mean(dim=0).unsqueeze(-1)
    n = len(ws)
    denom = 1 + (n - 1) * c
    singular = denom.abs() < 1e-6
    t = torch.where(singular, torch.zeros_like(c), (n * c) / torch.where(singular, torch.ones_like(denom), denom))
    average = cast(torch.Tensor, sum(ws)) / n  # a tensor: two inputs at least
    return (t * average + (1 - t) * w0).reshape(shape).to(torch.float32).sub_(base)
