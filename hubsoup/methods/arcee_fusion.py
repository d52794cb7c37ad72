"""Arcee Fusion: keep a fine-tune's changes only where they matter most, by an outlier threshold.

mergekit's ``arcee_fusion`` (Arcee AI; mergekit 0.1.5 ``merge_methods/arcee_fusion.py`` is the
definition, there is no paper): for the base θ₀ and one model θ₁, each entry's importance is
``|θ₁ − θ₀| · KL(softmax(θ₁) ‖ softmax(θ₀))``, the divergence taken along the last dimension
(``eps = 1e-8`` added to both distributions); entries whose importance reaches
``median + 1.5 · (q3 − q1)`` (the quartiles read off the sorted importances at index
``⌊q · (n − 1)⌋``; above 10⁶ entries from a sample of 10⁶ drawn with replacement) take θ₁'s value,
the others keep θ₀'s. The sample is drawn from the tensor's own generator (seeded by the
recipe), so for tensors above 10⁶ entries the threshold equals mergekit's in distribution.

Computed as mergekit computes it, in ``compute_dtype`` (a mergekit config's ``dtype``, else the inputs'
own): softmaxes, divergence, importance and threshold all round there, which decides ~8 % of a bf16
mask differently from float32. mergekit's result is ``θ₀ + (θ₁ − θ₀)·mask`` with a *float32* mask, so in
half precision the sum is float32: ``θ₀ + round(θ₁ − θ₀)`` rounded to float32, not to the half dtype, and a
mergekit config without ``out_dtype`` stores float32 (:mod:`hubsoup.formats.mergekit`).

The threshold is a comparison of computed values: an importance within a rounding of the threshold can
fall either way from one CPU's kernels to another's (AVX2 and AVX-512 sum a softmax in different orders),
as it does in mergekit; ``tests/formats/test_mergekit_real.py`` tells such entries apart from any other difference.

Example:
    >>> import torch
    >>> from hubsoup.methods.arcee_fusion import fusion_mask
    >>> importance = torch.tensor([[0.1, 0.2, 0.1, 5.0]])
    >>> fusion_mask(importance, torch.Generator()).tolist()
    [[False, False, False, True]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from hubsoup.methods import Method, register
from hubsoup.methods._sparsify import ComputeDtype, compute_dtype, compute_dtype_param

if TYPE_CHECKING:
    from hubsoup.methods import TensorContext

SAMPLE = 1_000_000
"""Entries above which the quartiles come from a sample (with replacement), as mergekit takes them."""


@dataclass
class ArceeFusionParams:
    compute_dtype: ComputeDtype = compute_dtype_param()


def importance(theta: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """``|θ₁ − θ₀| · KL(softmax(θ₁) ‖ softmax(θ₀))`` along the last dimension."""
    p = torch.softmax(theta, dim=-1) + 1e-8
    q = torch.softmax(base, dim=-1) + 1e-8
    return (theta - base).abs() * torch.sum(p * torch.log(p / q), dim=-1, keepdim=True)


def fusion_mask(scores: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Entries whose importance reaches the median plus 1.5 interquartile ranges."""
    flat = scores.reshape(-1)
    if flat.numel() > SAMPLE:
        flat = flat[torch.randint(flat.numel(), (SAMPLE,), generator=generator)]
    ordered = torch.sort(flat).values
    q1, median, q3 = ordered[(torch.tensor([0.25, 0.5, 0.75]) * (ordered.numel() - 1)).long()]
    return cast(torch.Tensor, scores >= median + 1.5 * (q3 - q1))  # torch's stubs: a tensor unpacks to Any


@register
class ArceeFusion(Method[ArceeFusionParams]):
    name = "arcee_fusion"
    summary = "Keep one fine-tune's changes where |Δ|·KL(softmax) is an outlier (mergekit's arcee_fusion)."
    paper = "Arcee Fusion (Arcee AI, mergekit; no paper)"
    paper_url = "https://github.com/arcee-ai/mergekit"
    Params = ArceeFusionParams
    min_inputs = max_inputs = 1

    def preserves_zero(self, params: ArceeFusionParams) -> bool:
        # computed in a half dtype given by the config, an unchanged tensor comes out as the base rounded to it
        return params.compute_dtype in ("float32", "inputs")

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: ArceeFusionParams,
              ctx: TensorContext) -> torch.Tensor:
        dtype = compute_dtype(params.compute_dtype, ctx)
        if dtype == torch.float32:
            tau = deltas[0]
            keep = fusion_mask(importance(base + tau, base), ctx.generator("arcee_fusion"))
            return tau * keep
        return fusion_in_dtype(base, deltas[0], dtype, ctx.generator("arcee_fusion"))


def fusion_in_dtype(base: torch.Tensor, tau: torch.Tensor, dtype: torch.dtype,
                    generator: torch.Generator) -> torch.Tensor:
    """Arcee Fusion computed in ``dtype`` step for step, as mergekit computes it in its config's dtype; the
    result ``θ₀ + (θ₁ − θ₀)·mask`` is float32 (mergekit's mask is), returned as the float32 task vector."""
    b, t = base.to(dtype), (base + tau).to(dtype)
    keep = fusion_mask(importance(t, b), generator).to(torch.float32)
    return (b + (t - b) * keep).sub_(base)
