"""RAM and RAM+ (tensor-local): merge reinforcement-learned agents by where their updates overlap.

Reinforced Agent Merging (arXiv 2601.13572), as mergekit 0.1.5 defines it (``merge_methods/ram.py``; that
code is the definition hubsoup reproduces): an entry of task vector τᵢ is *active* when ``|τᵢ| > epsilon``
(RL updates are sparse, so most entries are exactly unchanged). Per entry, with ``c`` the number of active
inputs there: an entry only one input changed (*unique*) keeps that input's value whole; an entry several
changed (*overlapping*) takes the mean of the active values, ``Σ active τᵢ / c``. Averaging everything
would dilute each agent's unique updates by N.

``ramplus_tl`` (RAM+, tensor-local) amplifies each input's unique entries by ``λᵢ = 1 + r·clamp(ρᵢ, 0, α)``,
``ρᵢ = (its overlapping active entries) / (its unique active entries)`` counted over the tensor (the
denominator at least ``epsilon``): an input whose updates mostly overlap others' gets its few unique ones
scaled up.

Computed as mergekit computes them, step for step, in ``compute_dtype`` (a mergekit config's ``dtype``).
In half precision mergekit's ``ramplus_tl`` returns float32 (λ is a float32 tensor and promotes the sum), so
the result is rounded to float32, not to the half dtype; a mergekit config without ``out_dtype`` then stores
float32 (:mod:`hubsoup.formats.mergekit`). The engine adds the merged task vector to the base in float32: where
that float32 result and the base differ in sign, no float32 τ gives ``θ₀ + τ`` exactly, and the stored entry
is a neighbour of mergekit's, one float32 ulp away (a float32 output only; a half one rounds back to it).

Example:
    >>> import torch
    >>> from hubsoup.testing import merge_tensors
    >>> taus = [torch.tensor([1.0, 0.0, 2.0]), torch.tensor([3.0, 4.0, 0.0])]
    >>> merge_tensors("ram", taus).tolist()      # overlap → mean; unique → kept whole
    [2.0, 4.0, 2.0]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from hubsoup.methods import Method, param, register
from hubsoup.methods._sparsify import ComputeDtype, compute_dtype, compute_dtype_param

if TYPE_CHECKING:
    from hubsoup.methods import TensorContext


def _task_vectors(base: torch.Tensor, deltas: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """τᵢ = θᵢ − θ₀ computed in ``dtype`` from the inputs cast to it (as mergekit: it subtracts the cast weights),
    flattened: ``(N, numel)``."""
    base_h = base.to(dtype)
    return torch.stack([(base + d).to(dtype) - base_h for d in deltas]).view(len(deltas), -1)


def ram_combine(tv: torch.Tensor, epsilon: float) -> torch.Tensor:
    """RAM's merged task vector of flattened task vectors ``tv`` ``(N, numel)``, in their dtype: unique active
    entries whole, overlapping ones averaged over the active inputs (mergekit's operations, in its order)."""
    active = tv.abs() > epsilon
    counts = active.sum(dim=0, keepdim=True)
    tv_z = tv * active
    return ((tv_z * (counts == 1)) + (tv_z * (counts > 1) / counts.clamp(min=1))).sum(dim=0, keepdim=True)


def ramplus_tl_combine(tv: torch.Tensor, r: float, alpha: float, epsilon: float) -> torch.Tensor:
    """RAM+ (tensor-local): as :func:`ram_combine`, each input's unique entries scaled by
    ``1 + r·clamp(overlapping / max(unique, epsilon), 0, alpha)`` (its counts over the tensor). Float32 when
    ``tv`` is half precision: the scale is a float32 tensor (as in mergekit)."""
    active = tv.abs() > epsilon
    counts = active.sum(dim=0, keepdim=True)
    overlap, unique = counts > 1, counts == 1
    shared = (active & overlap).sum(dim=1)
    own = (active & unique).sum(dim=1)
    rho = shared / own.clamp(min=epsilon)  # an integer count clamped at a float: float32, as in mergekit
    lam = 1 + r * rho.clamp(min=0, max=alpha)
    tv_z = tv * active
    return ((tv_z * unique * lam.unsqueeze(-1)) + (tv_z * overlap / counts.clamp(min=1))).sum(dim=0, keepdim=True)


@dataclass
class RamParams:
    epsilon: float = param(1e-5, "an entry of a task vector counts as changed when |τ| > epsilon",
                           range=(0.0, None), source="mergekit")
    compute_dtype: ComputeDtype = compute_dtype_param()


@dataclass
class RamplusParams:
    r: float = param(0.1, "strength of the unique entries' amplification: λ = 1 + r·clamp(ρ, 0, alpha)",
                     range=(0.0, None), source="mergekit")
    alpha: float = param(0.2, "cap on ρ, an input's overlapping over unique changed entries in the tensor",
                         range=(0.0, None), source="mergekit")
    epsilon: float = param(1e-5, "an entry of a task vector counts as changed when |τ| > epsilon",
                           range=(0.0, None), source="mergekit")
    compute_dtype: ComputeDtype = compute_dtype_param()


_RamP = TypeVar("_RamP", RamParams, RamplusParams)  # RAM's and RAM+'s hooks each see their own params


class _Ram(Method[_RamP]):
    paper = "Reinforced Agent Merging (arXiv 2601.13572), as mergekit 0.1.5 implements it"
    paper_url = "https://arxiv.org/abs/2601.13572"

    def preserves_zero(self, params: _RamP) -> bool:
        # computed in a half dtype given by the config, an unchanged tensor comes out as the base rounded to it
        return params.compute_dtype in ("float32", "inputs")

    def _result(self, base: torch.Tensor, tv: torch.Tensor, merged: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        """θ₀ + merged in mergekit's dtype (the half dtype, or float32 where the merge promoted to it), as the
        float32 task vector the engine adds to the base."""
        base_h = base.to(dtype)
        return (base_h + merged.reshape(base.shape)).to(torch.float32).sub_(base)


@register
class Ram(_Ram[RamParams]):
    name = "ram"
    summary = "Keep entries one agent changed whole, average those several changed (Reinforced Agent Merging)."
    Params = RamParams
    elementwise = True

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: RamParams,
              ctx: TensorContext) -> torch.Tensor:
        dtype = compute_dtype(params.compute_dtype, ctx)
        tv = _task_vectors(base, deltas, dtype)
        return self._result(base, tv, ram_combine(tv, params.epsilon), dtype)


@register
class RamplusTl(_Ram[RamplusParams]):
    name = "ramplus_tl"
    summary = "RAM with each agent's unique entries amplified by its overlap ratio in the tensor (RAM+, tensor-local)."
    Params = RamplusParams

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: RamplusParams,
              ctx: TensorContext) -> torch.Tensor:
        dtype = compute_dtype(params.compute_dtype, ctx)
        tv = _task_vectors(base, deltas, dtype)
        return self._result(base, tv, ramplus_tl_combine(tv, params.r, params.alpha, params.epsilon), dtype)
