"""Macro-averaged F1 over the classes present in references or predictions (shipped with hubsoup)."""

from typing import Any

import datasets
import evaluate


class MacroF1(evaluate.Metric):  # type: ignore[misc]  # evaluate ships no type information: Metric is Any
    def _info(self) -> Any:  # evaluate.MetricInfo (evaluate ships no type information)
        return evaluate.MetricInfo(
            description="Unweighted mean of per-class F1 (a class absent from both sides is skipped).",
            citation="",
            inputs_description="predictions, references: lists of integer class ids",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions: list[int], references: list[int]) -> dict[str, float]:
        classes = sorted(set(references) | set(predictions))
        scores = []
        for c in classes:
            tp = sum(1 for p, r in zip(predictions, references) if p == c and r == c)
            fp = sum(1 for p, r in zip(predictions, references) if p == c and r != c)
            fn = sum(1 for p, r in zip(predictions, references) if p != c and r == c)
            denom = 2 * tp + fp + fn
            scores.append(2 * tp / denom if denom else 0.0)
        return {"macro_f1": sum(scores) / len(scores) if scores else 0.0}
