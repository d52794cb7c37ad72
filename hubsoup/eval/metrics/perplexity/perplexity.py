"""Perplexity from per-example summed negative log-likelihoods and token counts (shipped with hubsoup).

exp(Σ nll / Σ tokens): the corpus-level perplexity, every token weighted equally.
"""

import math
from typing import Any

import datasets
import evaluate


class Perplexity(evaluate.Metric):  # type: ignore[misc]  # evaluate ships no type information: Metric is Any
    def _info(self) -> Any:  # evaluate.MetricInfo (evaluate ships no type information)
        return evaluate.MetricInfo(
            description="Corpus perplexity exp(sum of token NLLs / number of tokens).",
            citation="",
            inputs_description="predictions: summed NLL (nats) per example; references: its number of predicted tokens",
            features=datasets.Features({"predictions": datasets.Value("float64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions: list[float], references: list[int]) -> dict[str, float]:
        tokens = sum(references)
        if tokens <= 0:
            raise ValueError("perplexity needs at least one predicted token")
        mean = sum(predictions) / tokens
        # a model whose losses overflow has an infinite perplexity (NaN stays NaN): a value, not an OverflowError
        return {"perplexity": math.exp(mean) if mean < 709.0 or math.isnan(mean) else math.inf, "tokens": tokens}
