"""Accuracy: the fraction of predictions equal to the references (shipped with hubsoup)."""

from typing import Any

import datasets
import evaluate


class Accuracy(evaluate.Metric):  # type: ignore[misc]  # evaluate ships no type information: Metric is Any
    def _info(self) -> Any:  # evaluate.MetricInfo (evaluate ships no type information)
        return evaluate.MetricInfo(
            description="Fraction of predictions equal to the references.",
            citation="",
            inputs_description="predictions, references: lists of integer class ids",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions: list[int], references: list[int]) -> dict[str, float]:
        if not references:
            raise ValueError("accuracy of an empty set")
        return {"accuracy": sum(int(p == r) for p, r in zip(predictions, references)) / len(references)}
