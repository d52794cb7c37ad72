"""Weighted average of models (uniform model soup when weights are equal)."""

from __future__ import annotations

from dataclasses import dataclass

from hubsoup.errors import ParameterError
from hubsoup.methods import Method, param, register
from hubsoup.methods._kernels import weighted_average


@dataclass
class LinearParams:
    weights: tuple[float, ...] | None = param(None, "one weight per input (default: equal = uniform soup)")
    normalize: bool = param(True, "divide by the sum of weights (a true average)", source="ours")

    def validate(self):
        if self.weights is not None and self.normalize and sum(self.weights) == 0:
            raise ParameterError("parameter 'weights' sums to 0; cannot normalize")


@register
class Linear(Method):
    name = "linear"
    summary = "Weighted average of the models; equal weights give the uniform model soup."
    paper = "Model soups: averaging weights of multiple fine-tuned models improves accuracy without increasing inference time (Wortsman et al., 2022)"
    paper_url = "https://arxiv.org/abs/2203.05482"
    Params = LinearParams

    def linear_coefficients(self, params, n_inputs):
        weights = list(params.weights or [1.0] * n_inputs)
        total = sum(weights) if params.normalize else 1.0
        return [w / total for w in weights]

    def merge(self, base, deltas, params, ctx):
        weights = params.weights or [1.0] * len(deltas)
        return weighted_average(deltas, weights, params.normalize)
