"""A merge method in one file: the element-wise median of the task vectors.

Import this file (or put it in ``hubsoup/methods/``, where every public module is
imported automatically) and the method is available by name, with typed parameters,
a recipe hash, a model card and the CLI's ``--param`` parsing, for full fine-tunes and
LoRA adapters alike:

    >>> import hubsoup, custom_method                                   # doctest: +SKIP
    >>> hubsoup.merge(["ft-a", "ft-b", "ft-c"], method="median", base="base",
    ...               out="soup", scale=0.8)                            # doctest: +SKIP

The engine hands ``merge`` the base tensor and the inputs' task vectors stacked as one
float32 ``(N, *shape)`` tensor (the method may overwrite it) and adds the returned merged
task vector to the base. Nothing here reads a file or knows about devices, shards or
output formats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hubsoup.methods import Method, param, register


@dataclass
class MedianParams:
    scale: float = param(1.0, "λ: scale of the median task vector", range=(None, None))


@register
class Median(Method):
    name = "median"
    summary = "Element-wise median of the task vectors, scaled: robust to one outlying fine-tune."
    paper = "(an example method: the coordinate-wise median, a classic robust aggregate)"
    Params = MedianParams
    min_inputs = 1
    scale_param = "scale"  # LiNeS (`--method lines --param base_method=median`) replaces it by its depth factor
    search_grid = {"scale": [0.5, 0.75, 1.0, 1.25]}

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: MedianParams, ctx) -> torch.Tensor:
        # torch.median picks the lower middle for an even N; the mean of the two middles is symmetric
        n = deltas.shape[0]
        s = deltas.sort(dim=0).values
        mid = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
        return mid.mul_(params.scale)
