"""NearSwap: take the fine-tune's value where it is already near the base's, keep the base's elsewhere.

mergekit's ``nearswap`` (mergekit 0.1.5 ``merge_methods/nearswap.py`` is the definition; the method comes
from the model card of alchemonaut/QuartetAnemoi-70B-t0.0001, there is no paper): for the base θ₀ and one
model θ₁, entry by entry ``w = clamp(t / max(|θ₀ − θ₁|, 1e-6), 0, 1)`` and ``θ = w·θ₁ + (1 − w)·θ₀``. Entries
closer than ``t`` take θ₁ whole; farther ones move towards it by ``t / |θ₀ − θ₁|``. ``t`` is tiny in the
community's configs (1e-4 .. 1e-3), a gradient over the layers where they give one.

Computed as mergekit computes it, step for step, in ``compute_dtype`` (a mergekit config's ``dtype``):
``w·θ₁ + (1 − w)·θ₀`` is not exactly θ₀ where θ₁ = θ₀ (w is 1 there and the sum rounds), so the method
does not declare itself zero-preserving and every tensor is merged, as mergekit merges it.

Example:
    >>> import torch
    >>> from hubsoup.methods.nearswap import nearswap
    >>> nearswap(torch.tensor([0.0, 0.0, 0.0]), torch.tensor([0.05, 0.2, -1.0]), 0.1).tolist()
    [0.05000000074505806, 0.10000000149011612, -0.10000000149011612]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hubsoup.methods import Method, param, register
from hubsoup.methods._sparsify import ComputeDtype, compute_dtype, compute_dtype_param

if TYPE_CHECKING:
    from hubsoup.methods import TensorContext


def nearswap(a: torch.Tensor, b: torch.Tensor, t: float) -> torch.Tensor:
    """``w·b + (1 − w)·a`` with ``w = clamp(t / max(|a − b|, 1e-6), 0, 1)``, in the tensors' dtype (mergekit's
    operations, in its order)."""
    weight = (t / torch.abs(a - b).clamp(min=1e-6)).clamp(min=0, max=1)
    return weight * b + (1 - weight) * a


@dataclass
class NearswapParams:
    t: float = param(0.001, "distance below which the fine-tune's value is taken whole; farther entries move "
                            "t/|θ₁ − θ₀| of the way (mergekit requires it; community configs use 1e-4..1e-3)",
                     range=(0.0, None), source="mergekit")
    compute_dtype: ComputeDtype = compute_dtype_param()


@register
class Nearswap(Method[NearswapParams]):
    name = "nearswap"
    summary = "Take the fine-tune's entries where they are within t of the base's, interpolate by t/|Δ| elsewhere."
    paper = "NearSwap (alchemonaut, QuartetAnemoi-70B-t0.0001's model card; mergekit's nearswap; no paper)"
    paper_url = "https://huggingface.co/alchemonaut/QuartetAnemoi-70B-t0.0001"
    Params = NearswapParams
    min_inputs = max_inputs = 1
    zero_preserving = False  # w·θ₀ + (1 − w)·θ₀ rounds: an unchanged tensor is merged as mergekit merges it
    elementwise = True

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: NearswapParams,
              ctx: TensorContext) -> torch.Tensor:
        dtype = compute_dtype(params.compute_dtype, ctx)
        a = base.to(dtype)
        out = nearswap(a, (base + deltas[0]).to(dtype), params.t)
        return out.to(torch.float32).sub_(base)
