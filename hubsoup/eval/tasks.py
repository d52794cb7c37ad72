"""Task specs and results: what to evaluate, on which data, how, and what it scored.

A task's kind (``classification``, ``perplexity``, ``lm-eval``) is a row of :data:`KINDS`: how its spec is read
after ``KIND:`` and how its data is checked before a merge. The built-in kinds are here; :mod:`hubsoup.eval.lmeval`
adds its own row (:func:`add_kind`) when the package imports it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable

from hubsoup.errors import InputError, ParameterError
from hubsoup.eval.heads import load_head
from hubsoup.hubclient import Token
from hubsoup.sources.access import hub_only, load_hub_dataset, require_hub_dataset, require_task_repo

if TYPE_CHECKING:  # for types only: datasets costs ~7 s to import (loaded lazily where data is read)
    import datasets


@dataclass(frozen=True)
class TaskKind:
    """How one kind of task is read and checked (a row of :data:`KINDS`)."""

    parse: Callable[[str, str], "TaskSpec"] | None = None
    """``parse(spec, rest)``: the spec from the text after ``KIND:`` (None: ``DATA[,key=value...]``)."""
    check: Callable[["TaskSpec", Token], None] | None = None
    """``check(task, token)``: read what the task needs now (from the Hub with ``token``, the run's), so that a bad
    task fails before a merge (None: its data)."""


KINDS: dict[str, TaskKind] = {"classification": TaskKind(), "perplexity": TaskKind()}
"""Every kind of task by name: :meth:`TaskSpec.parse` and :meth:`TaskSpec.check` dispatch through it."""


def add_kind(name: str, kind: TaskKind) -> None:
    """Add a kind of task (``lm-eval``: :mod:`hubsoup.eval.lmeval`, imported with :mod:`hubsoup.eval`)."""
    KINDS[name] = kind

_LOCAL_FORMATS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@dataclass
class TaskSpec:
    """One evaluation task.

    Written on the command line as ``KIND:DATA[,key=value...]``, e.g.
    ``classification:data/val.csv,text=sentence,label=label,name=sst`` or
    ``perplexity:org/wiki-sample,split=test,text=text``, or lm-evaluation-harness tasks:
    ``lm-eval:arc_easy,num_fewshot=0,limit=200`` (:mod:`hubsoup.eval.lmeval`; its options in ``extra``).
    """

    kind: str
    data: str
    name: str = ""
    split: str = "validation"
    config: str | None = None
    text: str = "text"
    text_pair: str | None = None
    label: str = "label"
    head: str | None = None
    """A frozen classifier head (safetensors with ``weight`` [C, H] and ``bias`` [C]) applied to the
    pooled encoder output; without one the model must have its own classification head."""
    pooling: str = "mean"
    max_length: int = 256
    limit: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ParameterError(f"task kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.pooling not in ("mean", "cls"):
            raise ParameterError(f"task '{self.display_name}': pooling must be mean or cls, got {self.pooling!r}")
        if not self.name:
            self.name = os.path.splitext(os.path.basename(self.data.rstrip("/")))[0] or self.data

    @property
    def display_name(self) -> str:
        return self.name or self.data

    @property
    def is_local(self) -> bool:
        if self.kind == "lm-eval":  # lm-eval's own task names; a custom task_dir is a local folder (hub_only: a repo)
            if hub_only() and self.extra.get("task_dir"):
                require_task_repo(self.extra["task_dir"], "lm-eval task_dir")
            return False
        if hub_only():  # a server's run: Hub datasets only, by their name alone
            require_hub_dataset(self.data, "evaluation data")
            return False
        return os.path.exists(os.path.expanduser(self.data))

    @classmethod
    def parse(cls, spec: str) -> "TaskSpec":
        if ":" not in spec:
            raise ParameterError(f"task spec {spec!r}: expected KIND:DATA[,key=value...] with KIND one of {', '.join(KINDS)}")
        kind, rest = spec.split(":", 1)
        own = KINDS.get(kind.strip())
        if own is not None and own.parse is not None:
            return own.parse(spec, rest)
        parts = [p for p in rest.split(",") if p]
        if not parts:
            raise ParameterError(f"task spec {spec!r}: no data given")
        known = {f.name for f in fields(cls)} - {"kind", "data", "extra"}
        kw: dict[str, Any] = {}
        v: str | int
        for part in parts[1:]:
            if "=" not in part:
                raise ParameterError(f"task spec {spec!r}: expected key=value, got {part!r}")
            k, v = part.split("=", 1)
            if k not in known:
                raise ParameterError(f"task spec {spec!r}: unknown key {k!r} (known: {', '.join(sorted(known))})")
            if k in ("max_length", "limit"):
                try:
                    v = int(v)
                except ValueError:
                    raise ParameterError(f"task spec {spec!r}: {k} must be a positive integer, got {v!r}") from None
                if v < 1:
                    raise ParameterError(f"task spec {spec!r}: {k} must be a positive integer, got {v}")
            kw[k] = v
        return cls(kind=kind.strip(), data=parts[0], **kw)

    def check(self, token: Token = None) -> None:
        """Read the data (and the head) now, so that a missing file or column fails before a merge, not after.
        ``token``: the run's, for data on the Hub (None: huggingface_hub's own, ``HF_TOKEN`` or the login).

        Raises :class:`~hubsoup.errors.ParameterError` naming the task: data that cannot be
        loaded, a missing column, no examples, an unreadable ``head``.
        """
        own = KINDS[self.kind]
        if own.check is not None:
            return own.check(self, token)
        import datasets  # lazy: datasets costs ~7 s to import here (torch ~6 s); only an evaluation's data needs it

        shown = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # a check, not the evaluation: no "Generating train split" bars
        try:
            ds = self.load(token)
        finally:
            if shown:
                datasets.enable_progress_bars()
        if len(ds) == 0:
            raise ParameterError(f"task '{self.name}': no examples in {self.data}")
        if self.head:
            if not os.path.isfile(self.head):
                raise ParameterError(f"task '{self.name}': classifier head {self.head} not found")
            load_head(self.head)

    def load(self, token: Token = None) -> datasets.Dataset:
        """The task's examples as a ``datasets.Dataset`` (a Hub dataset asked with ``token``, the run's)."""
        import datasets  # lazy: datasets costs ~7 s to import here (torch ~6 s); only an evaluation's data needs it

        try:
            if self.is_local:
                path = os.path.expanduser(self.data)
                fmt = _LOCAL_FORMATS.get(os.path.splitext(path)[1].lower())
                if fmt is None:
                    raise ParameterError(f"task '{self.name}': cannot tell the format of {path} "
                                         f"(use one of {', '.join(_LOCAL_FORMATS)})")
                kw = {"delimiter": "\t"} if path.endswith(".tsv") else {}
                ds = datasets.load_dataset(fmt, data_files=path, split="train", **kw)
            elif self.data.startswith((".", "/", "~")) or os.path.splitext(self.data)[1].lower() in _LOCAL_FORMATS:
                raise ParameterError(f"task '{self.name}': data file {self.data} not found")
            elif hub_only():  # the Hub with this run's token and cache, never a folder of the host
                ds = load_hub_dataset(self.data, "evaluation data", token=token, config=self.config, split=self.split)
            else:
                ds = datasets.load_dataset(self.data, self.config, split=self.split, token=token)
        except (ParameterError, InputError):  # ours (a hub_only refusal): already one clear line
            raise
        except Exception as e:  # noqa: BLE001 - one clear line for the user
            why = " ".join(str(e).split())
            raise ParameterError(f"task '{self.name}': cannot load data {self.data!r}: {why}") from e
        need = [self.text] + ([self.label] if self.kind == "classification" else []) + ([self.text_pair] if self.text_pair else [])
        missing = [c for c in need if c not in ds.column_names]
        if missing:
            raise ParameterError(f"task '{self.name}': column {missing[0]!r} not in {self.data} "
                                 f"(columns: {', '.join(ds.column_names)}); set text=/label= in the task spec")
        if self.limit is not None:
            ds = ds.select(range(min(self.limit, len(ds))))
        for col in [self.text] + ([self.text_pair] if self.text_pair else []):
            bad = next(((i, v) for i, v in enumerate(ds[col]) if not isinstance(v, str)), None)
            if bad is not None:  # a tokenizer given a number or a null fails deep inside; say where it is
                shown = repr(bad[1])
                raise ParameterError(f"task '{self.name}': row {bad[0] + 1} of {self.data}: {col!r} must be text, got "
                                     f"{shown[:40] + '...' if len(shown) > 40 else shown}")
        return ds


@dataclass
class TaskResult:
    task: TaskSpec
    metrics: dict[str, float]
    n_examples: int
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def main_metric(self) -> str:
        if self.task.kind == "lm-eval":  # the spec's metric=, else the lm-eval task's first metric
            return self.details.get("main_metric") or self.task.extra.get("main_metric") or next(iter(self.metrics))
        return "accuracy" if self.task.kind == "classification" else "perplexity"

    @property
    def score(self) -> float:
        """Higher is better, one convention everywhere a score is ranked or averaged (search, evolve, pipelines):
        accuracy; ``-log(perplexity)`` (the mean log-likelihood per token: perplexities of different tasks average
        as a geometric mean); an lm-eval metric (negated where lm-eval says lower is better)."""
        v = self.metrics[self.main_metric]
        if self.task.kind == "lm-eval":
            return -v if self.main_metric in (self.details.get("lower_is_better") or ()) else v
        return v if self.task.kind == "classification" else -math.log(v)

    @property
    def head(self) -> dict[str, Any] | None:
        """The frozen head the scores were computed with (``{"file", "pooling", "source"}``), or None.

        ``file`` is the head file's public name (``name@sha256:...``), never its path.
        """
        return self.details.get("head")

    def to_dict(self) -> dict[str, Any]:
        out = {"task": self.task.name, "kind": self.task.kind, "data": self.task.data, "split": self.task.split,
               "config": self.task.config, "n_examples": self.n_examples, "metrics": self.metrics}
        if self.head:
            out["head"] = self.head
        if "lm_eval" in self.details:  # lm-eval's own output for this task
            out["main_metric"] = self.main_metric
            out["lm_eval"] = self.details["lm_eval"]
        return out

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> "TaskResult":
        """A result read back from ``eval_results.json``; files written before 0.1.1 named macro-F1 ``f1``."""
        metrics = {("macro_f1" if k == "f1" and row.get("kind") == "classification" else k): float(v)
                   for k, v in (row.get("metrics") or {}).items()}
        task = TaskSpec(kind=row["kind"], data=row["data"], name=row.get("task") or "",
                        split=row.get("split") or "validation", config=row.get("config"))
        details: dict[str, Any] = {"head": row["head"]} if isinstance(row.get("head"), dict) else {}
        if row.get("kind") == "lm-eval" and isinstance(row.get("lm_eval"), dict):
            hib = row["lm_eval"].get("higher_is_better") or {}
            details.update(lm_eval=row["lm_eval"], main_metric=row.get("main_metric"),
                           lower_is_better=[k.split(",")[0] for k, v in hib.items() if v is False])
        return cls(task, metrics, int(row.get("n_examples") or 0), details)
