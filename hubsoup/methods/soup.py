"""Model soup with a task-arithmetic scale: θ = θ_0 + λ_ta · mean_i(θ_i − θ_0)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hubsoup.methods import Method, param, register
from hubsoup.methods._kernels import weighted_average

if TYPE_CHECKING:
    import torch

    from hubsoup.methods import TensorContext


@dataclass
class SoupParams:
    scale: float = param(1.0, "λ_ta on the soup's task vector; 1 = the vanilla uniform soup (LiNeS App. B.3 "
                              "searches 1.0..2.0)", range=(None, None))


@register
class Soup(Method[SoupParams]):
    name = "soup"
    summary = ("Uniform model soup with the task-arithmetic scale of LiNeS App. B.3; for the greedy soup see "
               "hubsoup.soups.greedy_soup, for soup + LiNeS use lines with base_method=soup.")
    paper = ("Model soups (Wortsman et al., 2022); task-arithmetic scaling of soups as in LiNeS "
             "(Wang, Dimitriadis et al., 2025), App. B.3")
    paper_url = "https://arxiv.org/abs/2203.05482"
    Params = SoupParams
    scale_param = "scale"

    def linear_coefficients(self, params: SoupParams, n_inputs: int) -> list[float] | None:
        return [params.scale / n_inputs] * n_inputs

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: SoupParams,
              ctx: TensorContext) -> torch.Tensor:
        return weighted_average(deltas, [1.0] * len(deltas), normalize=True).mul_(params.scale)
