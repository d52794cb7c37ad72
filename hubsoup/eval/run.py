"""Running evaluation tasks on a model folder (or Hub repo)."""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Callable, Iterator, Sequence

import torch
from huggingface_hub import EvalResult
from tqdm.auto import tqdm

from hubsoup.errors import HubsoupError, ParameterError
from hubsoup.eval.heads import head_labels, load_head, mean_pool
from hubsoup.eval import lmeval
from hubsoup.eval.tasks import TaskResult, TaskSpec
from hubsoup.hubclient import Token
from hubsoup.progress import Monitor
from hubsoup.public import looks_local, public_file_ref

EVAL_FILE = "eval_results.json"
_METRICS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metrics")
_TASK_TYPES = {"classification": "text-classification", "perplexity": "text-generation", "lm-eval": "text-generation"}


@functools.lru_cache(maxsize=None)
def load_metric(name: str) -> Any:
    """One of hubsoup's shipped metric modules (accuracy, macro_f1, perplexity), via ``evaluate.load`` (once per
    process: a module's ``compute`` holds no state between calls)."""
    import evaluate  # lazy: evaluate (with datasets) costs ~9 s to import here (torch ~6 s); only a metric needs it

    path = os.path.join(_METRICS_DIR, name)
    if not os.path.isdir(path):
        raise ParameterError(f"no shipped metric {name!r} (have: {', '.join(sorted(os.listdir(_METRICS_DIR)))})")
    return evaluate.load(path)


METRIC_NAMES = {"accuracy": "Accuracy", "macro_f1": "Macro-F1", "perplexity": "Perplexity"}
"""Display names of the metrics hubsoup reports (``metric_type`` → the model-index ``name``)."""


# datasets' packaged builders: lm-eval's ``dataset_path: json`` reads local files, it names no dataset
_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "pandas", "sql", "webdataset", "imagefolder",
             "audiofolder", "videofolder", "xml"}


def dataset_type(result: TaskResult) -> str:
    """The model-index ``dataset.type`` of a result: the Hub dataset its scores come from (its repo ID; for an
    lm-eval task, the ``dataset_path`` its config reads), else the task's name — a local file is never a dataset
    type. (huggingface_hub groups a model-index's results by ``dataset.type``: one shared word for every local task
    would fold them into one entry, so each keeps its own name.)

    Example:
        >>> dataset_type(TaskResult(TaskSpec(kind="perplexity", data="org/wiki-sample"), {}, 0))
        'org/wiki-sample'
        >>> dataset_type(TaskResult(TaskSpec(kind="classification", data="./val.csv", name="sst"), {}, 0))
        'sst'
    """
    data = result.task.data
    if result.task.kind == "lm-eval":  # the dataset lm-eval's task reads (its task name is the dataset's name)
        data = str(((result.details.get("lm_eval") or {}).get("config") or {}).get("dataset_path") or "")
    if (not data or looks_local(data) or os.path.exists(os.path.expanduser(data)) or "@sha256:" in data
            or data.endswith("@local") or data.lower() in _BUILDERS):
        return local_dataset_type(result.task.name)
    return data


def local_dataset_type(name: str | None) -> str:
    """``dataset.type`` for data that is no Hub dataset: the task's name (a label, never a path), else ``custom``."""
    name = os.path.basename(str(name or "").rstrip("/\\"))
    return name if name and not looks_local(name) else "custom"


def to_eval_results(results: Sequence[TaskResult]) -> list[EvalResult]:
    """``huggingface_hub.EvalResult`` entries for a card's model-index.

    The metric ``type`` is exact (``macro_f1``, not ``f1``); a score computed through a frozen
    head from outside the model says so in its ``name`` (``Accuracy (frozen head sst.safetensors@sha256:...)``).
    ``dataset.type`` is a Hub dataset's ID or the task's name (:func:`dataset_type`), never a file.
    """
    out = []
    for r in results:
        head = r.head
        for metric, value in r.metrics.items():
            if metric == "tokens":
                continue
            name = METRIC_NAMES.get(metric, metric)
            if head:
                name = f"{name} (frozen head {head['file']})"
            out.append(EvalResult(task_type=_TASK_TYPES[r.task.kind], dataset_type=dataset_type(r),
                                  dataset_name=r.task.name, dataset_split=r.task.split, dataset_config=r.task.config,
                                  metric_type=metric, metric_name=name, metric_value=round(float(value), 6)))
    return out


class _Models:
    """Loads each kind of model once per evaluation."""

    def __init__(self, model: Any, device: str, tokenizer: str | None, quiet: bool = False, tok: Any = None,
                 token: Token = None):
        self.device, self.tokenizer_path, self.quiet = device, tokenizer, quiet
        self._token = token  # the run's, for a model or tokenizer named by Hub repo ID
        self._cache: dict[str, Any] = {} if tok is None else {"tok": tok}
        self.instance = None if isinstance(model, (str, os.PathLike)) else model
        self.path = str(model) if self.instance is None else (tokenizer or "the model in memory")

    def get(self, kind: str) -> Any:
        if self.instance is not None:  # a model held in memory (a search's candidate): used as given
            return self.instance.to(self.device).eval()
        if kind not in self._cache:
            # lazy: transformers costs ~4 s to import here (torch ~6 s); only an evaluation needs it
            import transformers

            cls = {"encoder": transformers.AutoModel, "seqcls": transformers.AutoModelForSequenceClassification,
                   "causal": transformers.AutoModelForCausalLM}[kind]
            bar = transformers.utils.logging.is_progress_bar_enabled()
            if self.quiet:  # no "Loading weights" bar in a quiet run
                transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers
            try:
                model = cls.from_pretrained(self.path, token=self._token)
            except (OSError, ValueError) as e:
                raise HubsoupError(f"cannot load {self.path} as {cls.__name__}: {e}") from e
            finally:
                if self.quiet and bar:
                    transformers.utils.logging.enable_progress_bar()  # type: ignore[no-untyped-call]  # as above
            self._cache[kind] = model.to(self.device).eval()
        return self._cache[kind]

    def tokenizer(self) -> Any:
        if "tok" not in self._cache:
            # lazy: transformers costs ~4 s to import here (torch ~6 s); only an evaluation needs it
            from transformers import AutoTokenizer

            try:
                tok = AutoTokenizer.from_pretrained(self.tokenizer_path or self.path, token=self._token)
            except (OSError, ValueError) as e:
                raise HubsoupError(f"no tokenizer for {self.path}; pass one (tokenizer=...): {e}") from e
            if tok.pad_token is None:
                tok.pad_token = tok.eos_token or tok.unk_token
            self._cache["tok"] = tok
        return self._cache["tok"]


def _label_ids(values: list[Any], names: list[str] | None, task: TaskSpec) -> list[int]:
    if all(isinstance(v, (int,)) or (isinstance(v, float) and float(v).is_integer()) for v in values):
        return [int(v) for v in values]
    if names is None:
        raise ParameterError(f"task '{task.name}': labels are strings but the head/model gives no label names")
    index = {n: i for i, n in enumerate(names)}
    unknown = sorted({str(v) for v in values} - set(index))
    if unknown:
        raise ParameterError(f"task '{task.name}': label {unknown[0]!r} is not one of the model's labels {names}")
    return [index[str(v)] for v in values]


class _TaskData:
    """A task's examples and their encoding by a tokenizer, loaded once (for every model an evaluator scores)."""

    def __init__(self, task: TaskSpec, token: Token):
        self.task = task
        self.ds = task.load(token)
        if len(self.ds) == 0:
            raise ParameterError(f"task '{task.name}': no examples in {task.data}")
        self._encoded: tuple[Any, Any] | None = None

    def column(self, name: str) -> list[Any]:
        return list(self.ds[name])

    def encoded(self, tok: Any, texts: list[str], pairs: list[str] | None) -> Any:
        if self._encoded is None or self._encoded[0] is not tok:
            self._encoded = (tok, tok(texts, pairs, truncation=True, max_length=self.task.max_length))
        return self._encoded[1]


def _batches(tok: Any, task: TaskSpec, texts: list[str], pairs: list[str] | None, batch_size: int, quiet: bool,
             data: _TaskData | None = None) -> Iterator[tuple[list[int], Any]]:
    """(indices, encoding) per batch, the examples taken shortest first.

    Batches of similar lengths pad little (a third less compute on the quality benchmark's
    texts). An example's result does not depend on its batch beyond rounding (padding is
    masked); callers put the results back in dataset order by the indices. ``data``: where the
    encoding is kept between calls (an :class:`Evaluator`'s).
    """
    # once; batches only pad
    encoded = data.encoded(tok, texts, pairs) if data is not None else \
        tok(texts, pairs, truncation=True, max_length=task.max_length)
    order = sorted(range(len(texts)), key=lambda i: (len(encoded["input_ids"][i]), i))
    for start in tqdm(range(0, len(order), batch_size), desc=f"eval {task.name}", disable=quiet, leave=False):
        idx = order[start:start + batch_size]
        yield idx, tok.pad({k: [v[i] for i in idx] for k, v in encoded.items()}, padding=True, return_tensors="pt")


def _classify(models: _Models, task: TaskSpec, data: _TaskData, batch_size: int, quiet: bool) -> TaskResult:
    tok = models.tokenizer()
    ds = data.ds
    if task.head:
        weight, bias, meta = load_head(task.head)
        names = head_labels(meta)
        pooling = meta.get("pooling", task.pooling)
        model = models.get("encoder")
    else:
        model = models.get("seqcls")
        cfg = model.config
        names = [cfg.id2label[i] for i in range(cfg.num_labels)] if getattr(cfg, "id2label", None) else None
    refs = _label_ids(data.column(task.label), names, task)
    preds: list[int] = [0] * len(refs)
    pairs = data.column(task.text_pair) if task.text_pair else None
    for idx, enc in _batches(tok, task, data.column(task.text), pairs, batch_size, quiet, data):
        enc = enc.to(models.device)
        with torch.no_grad():
            if task.head:
                logits = pooled_logits(model, enc, weight.to(models.device), bias.to(models.device), pooling)
            else:
                logits = model(**enc).logits
        for i, p in zip(idx, logits.argmax(-1).tolist()):
            preds[i] = p
    acc = load_metric("accuracy").compute(predictions=preds, references=refs)
    f1 = load_metric("macro_f1").compute(predictions=preds, references=refs)
    # per-example outcomes, for paired confidence intervals (not written to eval_results.json)
    details: dict[str, Any] = {"correct": [int(p == r) for p, r in zip(preds, refs)]}
    if task.head:  # the scores are this head's on the model's features: the card must say so
        details["head"] = {"file": public_file_ref(task.head), "pooling": pooling,
                           **({"source": meta["source"]} if meta.get("source") else {})}
    return TaskResult(task, {"accuracy": acc["accuracy"], "macro_f1": f1["macro_f1"]}, len(refs), details)


def pooled_logits(model: Any, enc: Any, weight: torch.Tensor, bias: torch.Tensor,
                  pooling: str = "mean") -> torch.Tensor:
    """Logits of a frozen linear head on the encoder's pooled output."""
    hidden: torch.Tensor = model(**enc).last_hidden_state
    if pooling == "cls":
        pooled = hidden[:, 0]
    else:
        pooled = mean_pool(hidden, enc["attention_mask"])
    return pooled.float() @ weight.T + bias


def _perplexity(models: _Models, task: TaskSpec, data: _TaskData, batch_size: int, quiet: bool) -> TaskResult:
    tok = models.tokenizer()
    model = models.get("causal")
    ds = data.ds
    nlls, counts = [0.0] * len(ds), [0] * len(ds)
    informative = False
    for idx, enc in _batches(tok, task, data.column(task.text), None, batch_size, quiet, data):
        enc = enc.to(models.device)
        with torch.no_grad():
            logits = model(**enc).logits[:, :-1].float()
        target = enc["input_ids"][:, 1:]
        mask = enc["attention_mask"][:, 1:].bool() & enc["attention_mask"][:, :-1].bool()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none") * mask
        for i, v, c in zip(idx, nll.sum(1).double().tolist(), mask.sum(1).tolist()):
            nlls[i], counts[i] = v, c
        if not informative:
            lo, hi = logits.amin(-1), logits.amax(-1)
            informative = bool(((hi > lo) | ~torch.isfinite(hi))[mask].any())
    if not informative and any(counts):
        # e.g. weights so large that the norm layers' squares overflow: every hidden state is zeroed, every
        # logit equal; its "perplexity" would be the vocabulary size, a score that could win a selection
        raise HubsoupError(f"task '{task.name}': the model gives every token the same score at every position "
                           "(constant logits): a degenerate model, e.g. weights too large for float32; no perplexity")
    res = load_metric("perplexity").compute(predictions=nlls, references=counts)
    # per-sequence NLL sums and token counts, for paired confidence intervals (not in eval_results.json)
    return TaskResult(task, {"perplexity": res["perplexity"]}, len(counts),
                      {"tokens": res["tokens"], "nll": nlls, "counts": counts})


def evaluate_model(model: Any, tasks: Sequence[TaskSpec], *, batch_size: int = 32, limit: int | None = None,
                   device: str = "cpu", tokenizer: str | None = None, quiet: bool = False,
                   before_task: Callable[[int, TaskSpec], None] | None = None, token: Token = None) -> list[TaskResult]:
    """Evaluate ``model`` (a folder or Hub repo ID, or a ``transformers`` model in memory) on each task.

    Args:
        model: a folder or Hub repo ID; or a model instance of the kind the tasks need (a causal LM for
            perplexity), with ``tokenizer`` naming where its tokenizer is.
        limit: use at most this many examples per task (overrides a task's own ``limit``).
        tokenizer: where to take the tokenizer from (default: the model's).
        before_task: called with (index, task) before each task (progress reports, cancellation).
        token: the run's Hub token, for every Hub dataset, lm-eval task repo, model or tokenizer the evaluation
            reads (None: huggingface_hub's own, ``HF_TOKEN`` or the login). Never shown.

    Many models on the same tasks: :class:`Evaluator` (what does not depend on the model is built once).
    """
    with Evaluator(tasks, batch_size=batch_size, limit=limit, device=device, tokenizer=tokenizer,
                   quiet=quiet, token=token) as ev:
        return ev.evaluate(model, before_task=before_task)


def evaluate_output(folder: str, tasks: Sequence[TaskSpec], *, limit: int | None, device: str, quiet: bool,
                    monitor: Monitor, token: Token = None) -> list[TaskResult]:
    """A merge's output in ``folder`` evaluated on ``tasks`` before it is committed (stage ``eval`` of ``monitor``:
    one report and one cancel check per task), the results written beside it (:data:`EVAL_FILE`)."""
    monitor.stage("eval", f"evaluating {len(tasks)} task(s)")
    monitor.segment(len(tasks))

    def before_task(i: int, task: TaskSpec) -> None:  # one report and one cancel check per task
        if i:
            monitor.step(f"evaluated {i}/{len(tasks)} task(s)")
        monitor.check()

    results = evaluate_model(folder, tasks, limit=limit, device=device, quiet=quiet, before_task=before_task,
                             token=token)
    monitor.step(f"evaluated {len(tasks)} task(s)")
    write_results(results, os.path.join(folder, EVAL_FILE))
    return results


class Evaluator:
    """Tasks that score many models (a search's candidates), with what does not depend on the model built once:
    the tokenizer (given ``tokenizer``), each task's data and its encoding, the metric modules, lm-eval's task
    objects (:class:`hubsoup.eval.lmeval.Runner`). Each :meth:`evaluate` gives what :func:`evaluate_model` gives.

    Example:
        >>> ev = Evaluator([TaskSpec.parse("perplexity:val.jsonl")], tokenizer="./base", batch_size=8)  # doctest: +SKIP
        >>> [ev.evaluate(m)[0].metrics["perplexity"] for m in candidates]                               # doctest: +SKIP
    """

    def __init__(self, tasks: Sequence[TaskSpec], *, batch_size: int = 32, limit: int | None = None,
                 device: str = "cpu", tokenizer: str | None = None, quiet: bool = False, token: Token = None):
        self.tasks = [TaskSpec(**{**t.__dict__, "limit": limit}) if limit is not None else t for t in tasks]
        self.batch_size, self.device, self.tokenizer, self.quiet = batch_size, device, tokenizer, quiet
        self._token = token  # the run's (see evaluate_model); never shown
        self._tok: Any = None  # the tokenizer of `tokenizer`, once loaded
        self._data: dict[int, _TaskData] = {}
        self._runners: dict[int, lmeval.Runner] = {}

    def prepare(self, model: Any = None) -> None:
        """Build now what :meth:`evaluate` would build on its first call: the tokenizer, each task's data, its
        encoding and metric modules, lm-eval's tasks (and its wrapper of ``model``, a model instance)."""
        models = _Models(model, self.device, self.tokenizer, self.quiet, self._tok, self._token)
        for i, task in enumerate(self.tasks):
            if task.kind == "lm-eval":
                runner = self._runner(i, task, models)
                if model is not None:
                    runner._wrapper(models.get("causal"))
                if i not in self._runners:  # nothing of it can be kept (each model its own tokenizer)
                    runner.close()
                continue
            if i not in self._data:
                self._data[i] = _TaskData(task, self._token)
            data, tok = self._data[i], models.tokenizer()
            pairs = data.column(task.text_pair) if task.kind == "classification" and task.text_pair else None
            data.encoded(tok, data.column(task.text), pairs)
            for name in ("accuracy", "macro_f1") if task.kind == "classification" else ("perplexity",):
                load_metric(name)
        if self.tokenizer is not None and "tok" in models._cache:
            self._tok = models._cache["tok"]

    def evaluate(self, model: Any, *, before_task: Callable[[int, TaskSpec], None] | None = None
                 ) -> list[TaskResult]:
        """Evaluate ``model`` (a folder or Hub repo ID, or a model instance) on every task (see :func:`evaluate_model`)."""
        models = _Models(model, self.device, self.tokenizer, self.quiet, self._tok, self._token)
        results = []
        for i, task in enumerate(self.tasks):
            if before_task is not None:
                before_task(i, task)
            if task.kind == "lm-eval":  # lm-eval's own loading, prompts and metrics, on the model in memory
                runner = self._runner(i, task, models)
                try:
                    results.extend(runner.evaluate(models.get("causal")))
                finally:
                    if i not in self._runners:  # made for this model only: what it fetched goes now
                        runner.close()
                continue
            if i not in self._data:
                self._data[i] = _TaskData(task, self._token)
            run = _classify if task.kind == "classification" else _perplexity
            results.append(run(models, task, self._data[i], self.batch_size, self.quiet))
        if self.tokenizer is not None and "tok" in models._cache:  # the same tokenizer for the next model
            self._tok = models._cache["tok"]
        return results

    def _runner(self, i: int, task: TaskSpec, models: _Models) -> lmeval.Runner:
        if self.tokenizer is None:  # each model its own tokenizer: nothing lm-eval builds can be kept
            return lmeval.Runner(task, models.tokenizer(), limit=task.limit, batch_size=self.batch_size,
                                 device=self.device, quiet=self.quiet, token=self._token)
        if i not in self._runners:
            self._runners[i] = lmeval.Runner(task, models.tokenizer(), limit=task.limit,
                                             batch_size=self.batch_size, device=self.device, quiet=self.quiet,
                                             token=self._token)
        return self._runners[i]

    def close(self) -> None:
        """Let go of what the evaluator keeps for lm-eval (a ``hub_only`` run's fetched task repos are removed)."""
        runners, self._runners = list(self._runners.values()), {}
        for runner in runners:
            runner.close()

    def __enter__(self) -> "Evaluator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def write_results(results: Sequence[TaskResult], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump([r.to_dict() for r in results], f, indent=2)


def read_results(path: str) -> list[TaskResult]:
    """The results :func:`write_results` wrote (``eval_results.json``); [] when there is no such file.

    Older files, which named macro-F1 ``f1``, read back with ``macro_f1``.
    """
    if not os.path.isfile(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)
        return [TaskResult.from_dict(row) for row in rows]
    except (ValueError, KeyError, TypeError) as e:
        raise ParameterError(f"cannot read evaluation results {path}: {e}") from e
