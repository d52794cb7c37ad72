"""WiSE-FT: interpolate between the pre-trained and one fine-tuned model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hubsoup.methods import Method, param, register

if TYPE_CHECKING:
    import torch

    from hubsoup.methods import TensorContext


@dataclass
class WiseFtParams:
    gamma: float = param(0.5, "interpolation weight of the fine-tune: θ = (1-γ)θ_0 + γθ_ft", range=(0.0, 1.0))


@register
class WiseFt(Method[WiseFtParams]):
    name = "wise_ft"
    summary = "Weight-space ensemble of the pre-trained model and one fine-tune."
    paper = "Robust fine-tuning of zero-shot models (Wortsman et al., 2022)"
    paper_url = "https://arxiv.org/abs/2109.01903"
    Params = WiseFtParams
    min_inputs = max_inputs = 1
    search_grid = {"gamma": [round(0.1 * i, 1) for i in range(0, 11)]}  # γ = 0..1, the paper's interpolation curve

    def linear_coefficients(self, params: WiseFtParams, n_inputs: int) -> list[float] | None:
        return [params.gamma]

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: WiseFtParams,
              ctx: TensorContext) -> torch.Tensor:
        return deltas[0] * params.gamma
