"""lm-evaluation-harness as a hubsoup task kind: ``lm-eval:TASKS[,key=value...]``.

``lm-eval:arc_easy,hellaswag,num_fewshot=0,limit=200`` runs ``lm_eval.simple_evaluate`` on the model
held in memory (an ``HFLM`` wrapping the model instance: no save and reload per candidate), with
lm-eval's own task definitions, prompts, few-shot sampling, seeds and metrics, so its numbers are
lm-eval's. Keys (``pip install 'hubsoup[lmeval]'``):

* ``task_dir=DIR`` — a folder of custom task YAMLs (lm-eval's ``--include_path``); its
  ``dataset_kwargs.data_files`` paths are read as lm-eval reads them (relative to the working folder);
* ``num_fewshot=K``, ``limit=N`` (per task), ``batch_size=B``, ``apply_chat_template=true``;
* ``metric=M`` — the metric a search maximises (default: the task's first), e.g. ``acc_norm`` or
  ``exact_match,strict-match`` (lm-eval's ``METRIC,FILTER``; the filter ``none`` is left out);
* ``model_args=K=V;K=V`` / ``gen_kwargs=K=V;K=V`` — passed through to ``HFLM`` / ``simple_evaluate``
  (``;`` between pairs, since ``,`` separates the spec's keys); a mapping in Python or YAML.

Each lm-eval task gives one :class:`~hubsoup.eval.TaskResult` named by lm-eval's task name, whose
metrics carry lm-eval's metric names; ``eval_results.json`` keeps lm-eval's own output for it
(``lm_eval``: results, config, n-shot, higher_is_better, versions) and the card's model-index names the
task and metric as lm-eval does.

Example:
    >>> from hubsoup.eval import TaskSpec
    >>> t = TaskSpec.parse("lm-eval:arc_easy,hellaswag,num_fewshot=0,limit=200,model_args=max_length=2048")
    >>> t.kind, t.data, t.limit, t.extra["num_fewshot"], t.extra["model_args"]
    ('lm-eval', 'arc_easy,hellaswag', 200, 0, {'max_length': 2048})
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import re
import threading
from typing import Any

import numpy as np

from hubsoup.errors import ParameterError
from hubsoup.eval.run import TaskResult
from hubsoup.eval.tasks import TaskSpec

KIND = "lm-eval"
_INT_KEYS = ("num_fewshot", "limit", "batch_size")
_KEYS = ("task_dir", "num_fewshot", "limit", "batch_size", "metric", "apply_chat_template", "model_args",
         "gen_kwargs", "name")
_MANAGERS: dict[tuple, Any] = {}
_MANAGERS_LOCK = threading.Lock()


def _value(text: str) -> Any:
    """``true``/``false``, numbers, else the string (as lm-eval's ``simple_parse_args_string``)."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


def _pairs(spec: str, key: str, text: Any) -> dict[str, Any]:
    if isinstance(text, dict):
        return dict(text)
    out = {}
    for part in (p for p in str(text).split(";") if p.strip()):
        k, sep, v = part.partition("=")
        if not sep or not k.strip():
            raise ParameterError(f"task spec {spec!r}: {key} expects K=V pairs joined by ';', got {part!r}")
        out[k.strip()] = _value(v)
    return out


def parse(spec: str, rest: str):
    """The :class:`~hubsoup.eval.TaskSpec` of ``lm-eval:REST`` (see the module doc)."""
    tasks, kw = [], {}
    for part in (p.strip() for p in rest.split(",")):
        if not part:
            continue
        if "=" not in part:
            if kw:  # a bare name after key=value: likely a typo'd key
                raise ParameterError(f"task spec {spec!r}: task names come first, before key=value (got {part!r})")
            tasks.append(part)
            continue
        k, v = part.split("=", 1)
        if k not in _KEYS:
            raise ParameterError(f"task spec {spec!r}: unknown key {k!r} (lm-eval keys: {', '.join(_KEYS)})")
        kw[k] = v
    if not tasks:
        raise ParameterError(f"task spec {spec!r}: name at least one lm-eval task (lm-eval:arc_easy,...)")
    return from_options(spec, tasks, kw)


def from_options(spec: str, tasks: list[str], kw: dict[str, Any]):
    extra: dict[str, Any] = {}
    limit = None
    for k, v in kw.items():
        if k in _INT_KEYS:
            try:
                n = int(v)
            except (TypeError, ValueError):
                raise ParameterError(f"task spec {spec!r}: {k} must be an integer, got {v!r}") from None
            if n < (0 if k == "num_fewshot" else 1):
                raise ParameterError(f"task spec {spec!r}: {k} must be {'>= 0' if k == 'num_fewshot' else '>= 1'}, "
                                     f"got {n}")
            if k == "limit":
                limit = n
            else:
                extra[k] = n
        elif k == "apply_chat_template":
            b = _value(str(v)) if not isinstance(v, bool) else v
            if not isinstance(b, bool):
                raise ParameterError(f"task spec {spec!r}: apply_chat_template must be true or false, got {v!r}")
            extra[k] = b
        elif k in ("model_args", "gen_kwargs"):
            extra[k] = _pairs(spec, k, v)
        elif k == "task_dir":
            extra[k] = os.path.expanduser(str(v))
        elif k != "name":
            extra[k] = str(v)
    bad = sorted(set(extra.get("model_args", {})) & {"pretrained", "trust_remote_code"})
    if bad:
        raise ParameterError(f"task spec {spec!r}: model_args '{bad[0]}' cannot be set: the model is the merge "
                             f"itself, and remote code is never run")
    return TaskSpec(kind=KIND, data=",".join(tasks), name=str(kw.get("name") or ",".join(tasks)), limit=limit,
                    extra=extra)


def task_names(task) -> list[str]:
    return [t for t in task.data.split(",") if t]


def _import():
    try:
        # lazy: optional extra (lm_eval)
        import lm_eval  # noqa: F401
        # lazy: optional extra (lm_eval)
        from lm_eval.tasks import TaskManager  # noqa: F401
    except ImportError:
        raise ParameterError("lm-eval tasks need lm-evaluation-harness: pip install 'hubsoup[lmeval]'") from None


def _task_dir(task) -> str | None:
    """The task's ``task_dir``, absolute; a named folder that is not one is an error."""
    task_dir = task.extra.get("task_dir")
    if not task_dir:
        return None
    if not os.path.isdir(task_dir):
        raise ParameterError(f"task '{task.name}': task_dir {task_dir} is not a folder")
    return os.path.abspath(task_dir)


def _manager(task_dir: str | None, defaults: bool):
    """lm-eval's ``TaskManager`` of ``task_dir``'s tasks, with its built-in ones or not (one per process)."""
    from lm_eval.tasks import TaskManager  # lazy: optional extra (lm_eval)

    with _MANAGERS_LOCK:
        key = (task_dir, defaults)
        if key not in _MANAGERS:
            _MANAGERS[key] = TaskManager(include_path=task_dir, include_defaults=defaults, verbosity="ERROR")
        return _MANAGERS[key]


def task_manager(task):
    """lm-eval's ``TaskManager`` for the task's ``task_dir`` (one per process and folder). Custom tasks alone
    when they are all in ``task_dir`` (indexing lm-eval's ~15k built-in tasks takes most of a minute)."""
    _import()
    task_dir = _task_dir(task)
    if task_dir:
        tm = _manager(task_dir, False)
        if all(n in tm.all_tasks for n in task_names(task)):
            return tm
    return _manager(task_dir, True)


def _unwritten_builtins(names: list[str]) -> list[str]:
    """Of ``names``, those that no file of lm-eval's built-in task folder contains as text. lm-eval names a
    built-in task, group or tag only by a ``task:``, ``group:`` or ``tag:`` value written in a config of that
    folder or in a file one of them includes (which need not end in ``.yaml``, and lies in that folder too), so
    such a name is certainly not built in. A read of the folder's bytes (~0.6 s for its ~16k files, 15 MB)
    instead of lm-eval's index of it (most of a minute), so that a misspelt name is reported at once; a name
    found somewhere is left to the index (``tests/test_lmeval.py`` checks the names lm-eval's own index finds
    in half its folders, the templated ones among them)."""
    import lm_eval.tasks  # lazy: optional extra (lm_eval)

    texts = []
    for folder, _, files in os.walk(os.path.dirname(lm_eval.tasks.__file__)):
        for f in files:
            try:
                with open(os.path.join(folder, f), "rb") as fh:
                    texts.append(fh.read())
            except OSError:
                continue  # nor can lm-eval read it
    text = b"\0".join(texts)
    # many names (a test of every built-in one): the text's words first, a substring search for the rest
    words = set(re.findall(rb"[\w.+-]+", text)) if len(names) > 64 else set()
    return [n for n in names if n.encode() not in words and n.encode() not in text]


def check(task) -> None:
    """lm-eval is installed, the task folder exists and every task name is known to lm-eval."""
    _import()
    names, task_dir = task_names(task), _task_dir(task)
    # a task_dir's own index is quick; it may include files from anywhere, the built-in ones only each other
    rest = [n for n in names if n not in _manager(task_dir, False).all_tasks] if task_dir else names
    unknown = _unwritten_builtins(rest)
    if rest and not unknown:
        unknown = [n for n in rest if n not in task_manager(task).all_tasks]
    if unknown:
        where = f" or in {task.extra['task_dir']}" if task.extra.get("task_dir") else ""
        raise ParameterError(f"task '{task.name}': lm-eval has no task '{unknown[0]}'{where} "
                             f"(`lm-eval ls tasks` lists them; custom tasks go in task_dir=DIR)")


def _metric_name(key: str) -> str:
    metric, _, filt = key.partition(",")
    return metric if filt in ("", "none") else key


class Runner:
    """lm-eval's tasks of ``task`` built once (lm-eval's ``TaskManager.load``, with the overrides ``simple_evaluate``
    applies), then run on any number of models: each :meth:`evaluate` is ``lm_eval.evaluator.evaluate`` with
    ``simple_evaluate``'s seeds set again, so each model gets the numbers ``simple_evaluate`` would give it
    (``tests/test_lmeval.py`` compares them), without rebuilding the tasks and their datasets, without the run's
    environment report (a ``pip list`` subprocess) and git probe. The ``HFLM`` wrapper is built once per model
    instance (a search's candidate model has its weights replaced in place). An lm-eval without
    ``TaskManager.load`` (before 0.4.10) gets ``simple_evaluate`` each time.

    Example:
        >>> runner = Runner(TaskSpec.parse("lm-eval:wordppl,task_dir=tasks"), tok, limit=None, batch_size=1,
        ...                 device="cpu")                                            # doctest: +SKIP
        >>> runner.evaluate(model)[0].metrics["word_perplexity"]                     # doctest: +SKIP
        323.8477304254
    """

    def __init__(self, task, tokenizer, *, limit: int | None, batch_size: int, device: str, quiet: bool = False):
        _import()
        self.task, self.tokenizer, self.device, self.quiet = task, tokenizer, device, quiet
        self.limit = limit if limit is not None else task.limit
        self.batch_size = task.extra.get("batch_size", batch_size)
        self._lm: Any = None
        self._model: Any = None
        self._loaded: Any = None
        manager = task_manager(task)
        if hasattr(manager, "load"):
            from lm_eval.defaults import DEFAULT_OTHER_SEED  # lazy: optional extra (lm_eval)

            ex = task.extra
            self._loaded = manager.load(task_names(task))
            gen_kwargs = ex.get("gen_kwargs") or None
            for obj in self._loaded["tasks"].values():  # simple_evaluate's overrides, applied once
                if gen_kwargs is not None and obj.get_config("output_type") == "generate_until":
                    obj.set_config(key="generation_kwargs", value=gen_kwargs, update=True)
                num_fewshot = ex.get("num_fewshot")
                if num_fewshot is not None:
                    if obj.get_config("num_fewshot") != 0:
                        obj.set_config(key="num_fewshot", value=num_fewshot)
                elif obj.get_config("num_fewshot") is None:
                    obj.set_config(key="num_fewshot", value=0)
            self._fewshot_seed = DEFAULT_OTHER_SEED

    def _wrapper(self, model):
        if self._model is not model:
            from lm_eval.models.huggingface import HFLM  # lazy: optional extra (lm_eval)

            self._lm = HFLM(pretrained=model, tokenizer=self.tokenizer, batch_size=self.batch_size,
                            device=self.device, **self.task.extra.get("model_args", {}))
            self._model = model
        return self._lm

    def evaluate(self, model) -> list:
        """The lm-eval tasks on ``model`` (a causal LM instance): one :class:`~hubsoup.eval.TaskResult` per task."""
        import lm_eval  # lazy: optional extra (lm_eval)

        ex, lm = self.task.extra, self._wrapper(model)
        if self._loaded is None:  # an older lm-eval: its tasks built on every call
            out = lm_eval.simple_evaluate(
                model=lm, tasks=task_names(self.task), num_fewshot=ex.get("num_fewshot"), limit=self.limit,
                task_manager=task_manager(self.task), apply_chat_template=ex.get("apply_chat_template", False),
                gen_kwargs=ex.get("gen_kwargs") or None, log_samples=False, bootstrap_iters=0, verbosity="ERROR")
            return _results(out, self.task)
        from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED  # lazy: optional extra (lm_eval)
        from lm_eval.evaluator import evaluate  # lazy: optional extra (lm_eval)
        from lm_eval.utils import set_torch_seed  # lazy: optional extra (lm_eval)

        random.seed(DEFAULT_RANDOM_SEED)  # what simple_evaluate sets before each run
        np.random.seed(DEFAULT_OTHER_SEED)
        set_torch_seed(DEFAULT_OTHER_SEED)
        for obj in self._loaded["tasks"].values():
            obj.set_fewshot_seed(seed=self._fewshot_seed)
        chat = ex.get("apply_chat_template", False)
        with _bars(not self.quiet):
            out = evaluate(lm=lm, task_dict=self._loaded, limit=self.limit, bootstrap_iters=0, log_samples=False,
                           apply_chat_template=chat, fewshot_as_multiturn=True)
        return _results(out, self.task)


@contextlib.contextmanager
def _bars(shown: bool):
    """lm-eval's progress bars, or none (tqdm's ``TQDM_DISABLE``): quiet, a search's trial prints nothing, and at
    batch size 1 lm-eval draws one bar per batch, each a write to the terminal."""
    if shown or os.environ.get("TQDM_DISABLE"):
        yield
        return
    os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        os.environ.pop("TQDM_DISABLE", None)


def evaluate(model, tokenizer, task, *, limit: int | None, batch_size: int, device: str) -> list:
    """Run the lm-eval tasks of ``task`` on ``model`` (a causal LM instance) with ``tokenizer``; one
    :class:`~hubsoup.eval.TaskResult` per lm-eval task (a :class:`Runner` used once)."""
    return Runner(task, tokenizer, limit=limit, batch_size=batch_size, device=device).evaluate(model)


def _results(out: dict, task) -> list:
    """One :class:`~hubsoup.eval.TaskResult` per lm-eval task of ``task`` from lm-eval's output ``out``."""
    ex = task.extra
    results = []
    for name in task_names(task):
        row = out["results"].get(name)
        if row is None:
            raise ParameterError(f"task '{task.name}': lm-eval returned no results for '{name}'")
        # lm-eval's metrics are METRIC,FILTER keys (alias, name, sample_len are not metrics)
        metrics = {_metric_name(k): float(v) for k, v in row.items()
                   if "," in k and "_stderr" not in k and isinstance(v, (int, float)) and not isinstance(v, bool)
                   and math.isfinite(float(v))}
        hib = {_metric_name(k): v for k, v in (out.get("higher_is_better", {}).get(name) or {}).items()}
        main = ex.get("metric") or next(iter(metrics), None)
        if main not in metrics:
            raise ParameterError(f"task '{task.name}': lm-eval task '{name}' has no metric '{main}' "
                                 f"(it has: {', '.join(metrics)})")
        cfg = (out.get("configs") or {}).get(name) or {}
        spec = TaskSpec(kind=KIND, data=name, name=name, limit=task.limit,
                        split=str(cfg.get("test_split") or cfg.get("validation_split") or "validation"),
                        config=cfg.get("dataset_name"),
                        extra={**ex, "dataset_path": cfg.get("dataset_path"), "main_metric": main})
        lm_out = {"results": row, "n-shot": (out.get("n-shot") or {}).get(name),
                  "higher_is_better": (out.get("higher_is_better") or {}).get(name),
                  "n-samples": (out.get("n-samples") or {}).get(name), "versions": (out.get("versions") or {}).get(name),
                  "config": cfg}
        n = (out.get("n-samples") or {}).get(name, {}).get("effective") or 0
        results.append(TaskResult(spec, metrics, int(n), {
            "lm_eval": lm_out, "main_metric": main,
            "lower_is_better": [k for k, v in hib.items() if v is False]}))
    return results
