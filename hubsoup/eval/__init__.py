"""Evaluation: text-classification accuracy / macro-F1 and causal-LM perplexity.

Data comes from ``datasets`` (local csv/json/jsonl/parquet files or Hub dataset IDs);
metrics are modules shipped inside hubsoup and loaded with ``evaluate.load(path)``,
since Hub-hosted metrics are unreachable offline.

Example:
    >>> from hubsoup.eval import TaskSpec, evaluate_model
    >>> task = TaskSpec.parse("classification:val.csv,text=sentence,label=label,name=sst")  # doctest: +SKIP
    >>> results = evaluate_model("./soup", [task], limit=200)                               # doctest: +SKIP
    >>> results[0].metrics                                                                  # doctest: +SKIP
    {'accuracy': 0.91, 'macro_f1': 0.90}
"""

from hubsoup.eval.run import METRIC_NAMES, Evaluator, TaskResult, evaluate_model, load_metric, read_results, to_eval_results
from hubsoup.eval.tasks import TaskSpec

__all__ = ["TaskSpec", "TaskResult", "Evaluator", "evaluate_model", "load_metric", "read_results", "to_eval_results", "METRIC_NAMES"]
