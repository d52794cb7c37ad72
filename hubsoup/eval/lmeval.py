"""lm-evaluation-harness as a hubsoup task kind: ``lm-eval:TASKS[,key=value...]``.

``lm-eval:arc_easy,hellaswag,num_fewshot=0,limit=200`` runs ``lm_eval.simple_evaluate`` on the model
held in memory (an ``HFLM`` wrapping the model instance: no save and reload per candidate), with
lm-eval's own task definitions, prompts, few-shot sampling, seeds and metrics, so its numbers are
lm-eval's. Keys (``pip install 'hubsoup[lmeval]'``):

* ``task_dir=DIR`` — a folder of custom task YAMLs (lm-eval's ``--include_path``); its
  ``dataset_kwargs.data_files`` paths are read as lm-eval reads them (relative to the working folder).
  In a ``hub_only`` run (a server) it is a Hub repo instead — ``org/name`` (a dataset),
  ``hf://datasets/org/name`` or ``hf://spaces/org/name``, ``@revision`` allowed — fetched with the run's token
  (the ``token`` argument of :class:`Runner` / :meth:`TaskSpec.check`)
  into a fresh folder (inside its ``cache_dir``, or a temporary one) removed after the evaluation; never a
  folder of the host. Its Python (``!function`` tags, ``.py`` files) is refused unless the operator sets
  ``allow_task_code``; YAML tags other than those, an ``include:`` leaving the folder and data files that are
  not on the Hub are refused always. A ``hub_only`` run's task data are the Hub datasets of those names (asked
  with the run's token, never a folder of the working directory) and its Jinja prompts render in jinja2's
  sandbox;
* ``num_fewshot=K``, ``limit=N`` (per task), ``batch_size=B``, ``apply_chat_template=true``;
* ``metric=M`` — the metric a search maximises (default: the task's first), e.g. ``acc_norm`` or
  ``exact_match,strict-match`` (lm-eval's ``METRIC,FILTER``; the filter ``none`` is left out);
* ``model_args=K=V;K=V`` / ``gen_kwargs=K=V;K=V`` — passed through to ``HFLM`` / ``simple_evaluate``
  (``;`` between pairs, since ``,`` separates the spec's keys); a mapping in Python or YAML.

Each lm-eval task gives one :class:`~hubsoup.eval.TaskResult` named by lm-eval's task name, whose
metrics carry lm-eval's metric names; ``eval_results.json`` keeps lm-eval's own output for it
(``lm_eval``: results, config, n-shot, higher_is_better, versions) and the card's model-index names the
task and metric as lm-eval does. The config is kept as it may be published: a custom task's local files
(``dataset_kwargs.data_files``, ``config_source``, a local ``dataset_path``) by name and content hash
(:func:`hubsoup.public.public_value`), never by path.

Example:
    >>> from hubsoup.eval import TaskSpec
    >>> t = TaskSpec.parse("lm-eval:arc_easy,hellaswag,num_fewshot=0,limit=200,model_args=max_length=2048")
    >>> t.kind, t.data, t.limit, t.extra["num_fewshot"], t.extra["model_args"]
    ('lm-eval', 'arc_easy,hellaswag', 200, 0, {'max_length': 2048})
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import re
import subprocess
import threading
from contextlib import contextmanager
from typing import Any, Iterator, cast

import numpy as np
import yaml

from hubsoup.errors import InputError, ParameterError
from hubsoup.public import public_value
from hubsoup.eval.tasks import TaskKind, TaskResult, TaskSpec, add_kind
from hubsoup.hubclient import Token
from hubsoup.sources.access import current, hub_only, is_hub_dataset, refusal, require_task_repo
from hubsoup.sources.resolve import fetched_repo
from hubsoup.untrusted import MAX_YAML_BYTES, label, load_yaml, short

KIND = "lm-eval"
_INT_KEYS = ("num_fewshot", "limit", "batch_size")
_KEYS = ("task_dir", "num_fewshot", "limit", "batch_size", "metric", "apply_chat_template", "model_args",
         "gen_kwargs", "name")
_MANAGERS: dict[tuple[str | None, bool], Any] = {}
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


def parse(spec: str, rest: str) -> TaskSpec:
    """The :class:`~hubsoup.eval.TaskSpec` of ``lm-eval:REST`` (see the module doc)."""
    tasks: list[str] = []
    kw: dict[str, Any] = {}
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


def from_options(spec: str, tasks: list[str], kw: dict[str, Any]) -> TaskSpec:
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
            extra[k] = str(v)  # as given: a hub_only run reads it as text alone (expanded only for a local folder)
        elif k != "name":
            extra[k] = str(v)
    for t in tasks:  # lm-eval's names, never paths: lm-eval loads a task "name" that is a file as a task YAML
        label(t, f"task spec {short(spec)}: lm-eval task name")
        if t.lower().endswith((".yaml", ".yml")):
            raise ParameterError(f"task spec {short(spec)}: lm-eval task name {short(t)} is a file name; custom tasks "
                                 "go in task_dir=DIR")
    bad = sorted(set(extra.get("model_args", {})) & {"pretrained", "trust_remote_code"})
    if bad:
        raise ParameterError(f"task spec {spec!r}: model_args '{bad[0]}' cannot be set: the model is the merge "
                             f"itself, and remote code is never run")
    # what hubsoup gives HFLM itself (twice: a TypeError deep in lm-eval)
    own = {"batch_size": "give it as a key of its own: batch_size=N", "device": "the run's device is used",
           "tokenizer": "the model's own tokenizer is used"}
    bad = sorted(set(extra.get("model_args", {})) & set(own))
    if bad:
        raise ParameterError(f"task spec {spec!r}: model_args '{bad[0]}' cannot be set there: {own[bad[0]]}")
    return TaskSpec(kind=KIND, data=",".join(tasks), name=str(kw.get("name") or ",".join(tasks)), limit=limit,
                    extra=extra)


def task_names(task: TaskSpec) -> list[str]:
    return [t for t in task.data.split(",") if t]


def _import() -> None:
    try:
        # lazy: optional extra (lm_eval)
        import lm_eval  # noqa: F401
        # lazy: optional extra (lm_eval)
        from lm_eval.tasks import TaskManager  # noqa: F401
    except ImportError:
        raise ParameterError("lm-eval tasks need lm-evaluation-harness: pip install 'hubsoup[lmeval]'") from None


def _local_task_dir(task: TaskSpec) -> str | None:
    """The task's local ``task_dir``, absolute; a named folder that is not one is an error (never in hub_only)."""
    task_dir: str | None = task.extra.get("task_dir")
    if not task_dir:
        return None
    task_dir = os.path.expanduser(task_dir)
    if not os.path.isdir(task_dir):
        raise ParameterError(f"task '{task.name}': task_dir {task_dir} is not a folder")
    return os.path.abspath(task_dir)


_CORE_TAGS = {f"!!{t}" for t in ("str", "int", "float", "bool", "null", "seq", "map", "timestamp", "binary",
                                 "omap", "pairs", "set", "merge", "value")}
_CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyd", ".so", ".pth")
_PACKAGED = ("json", "csv", "parquet", "arrow", "text", "pandas", "webdataset", "imagefolder", "audiofolder",
             "videofolder", "xml", "sql", "generator", "spark", "cache")


def _tags(text: str) -> list[str]:
    """The YAML tags a text uses (``!function``, ``!!python/name:...``), read by the scanner (never constructed)."""
    found = []
    try:
        for token in yaml.scan(text, Loader=yaml.SafeLoader):
            if isinstance(token, yaml.TagToken):
                handle, suffix = token.value
                found.append((handle or "") + suffix)
    except yaml.YAMLError:
        pass  # not YAML from here on: lm-eval's loader stops at the same place
    return found


def _hub_data(value: Any) -> bool:
    """Every path in a ``data_files`` / ``data_dir`` value is on the Hub (``hf://``)."""
    if isinstance(value, str):
        return value.startswith("hf://")
    if isinstance(value, (list, tuple)):
        return all(_hub_data(v) for v in value)
    if isinstance(value, dict):
        return all(_hub_data(v) for v in value.values())
    return False


def check_task_folder(folder: str, who: str, *, allow_code: bool) -> None:
    """Refuse a task repo fetched for a ``hub_only`` run that would run code or read the host: Python (``.py`` files,
    ``!function`` tags) unless ``allow_code``; any other YAML tag (``!!python/...``); an ``include:`` that is absolute
    or leaves the folder; data (``dataset_path``, ``dataset_kwargs`` files) that are not on the Hub; remote code.
    Messages name the repo (``who``) and the file inside it, never a path of the host."""
    root = os.path.realpath(folder)

    def refuse(rel: str, why: str) -> InputError:
        return InputError(f"{who}: {rel} {why}; a hub_only run runs no code from a task repo and reads nothing of the "
                          "host" + (" (the operator may allow the repo's Python with allow_task_code / "
                                    "--allow-task-code)" if "Python" in why or "!function" in why else ""))

    for dirpath, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not (dirpath == folder and d == ".cache"))  # huggingface_hub's own
        for fn in sorted(files):
            path = os.path.join(dirpath, fn)
            rel = os.path.relpath(path, folder).replace(os.sep, "/")
            if fn.endswith(_CODE_SUFFIXES):
                if not allow_code:
                    raise refuse(rel, "is Python")
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read(MAX_YAML_BYTES + 1)
            except (OSError, UnicodeDecodeError):
                continue  # not text: lm-eval reads no task from it
            for tag in _tags(text):
                if tag in _CORE_TAGS or (tag == "!function" and allow_code):
                    continue
                raise refuse(rel, f"uses the YAML tag {short(tag)}" + (" (Python)" if tag == "!function" else ""))
            try:
                cfg = load_yaml(text, rel, any_tag=True)
            except ParameterError:
                continue
            if not isinstance(cfg, dict):
                continue
            includes = cfg.get("include")
            for inc in includes if isinstance(includes, list) else ([includes] if includes is not None else []):
                if not isinstance(inc, str) or not inc or inc.startswith(("/", "\\", "~")) or re.match(r"^[A-Za-z]:", inc) \
                        or any(part == ".." for part in re.split(r"[/\\]", inc)):
                    raise refuse(rel, f"includes {short(inc)}, which is not a file of the repo")
                inside = os.path.realpath(os.path.join(dirpath, inc))
                if not inside.startswith(root + os.sep):
                    raise refuse(rel, f"includes {short(inc)}, which is not a file of the repo")
            kwargs = cfg.get("dataset_kwargs")
            kwargs = kwargs if isinstance(kwargs, dict) else {}
            for key in ("data_files", "data_dir"):
                if kwargs.get(key) is not None and not _hub_data(kwargs[key]):
                    raise refuse(rel, f"reads dataset_kwargs.{key} {short(kwargs[key])}, which are not on the Hub "
                                      "(hf://datasets/...)")
            if kwargs.get("trust_remote_code"):
                raise refuse(rel, "asks for the dataset's remote code (trust_remote_code)")
            path_ = cfg.get("dataset_path")
            if path_ is not None and not (is_hub_dataset(path_) and path_ not in _PACKAGED) and not (
                    path_ in _PACKAGED and kwargs.get("data_files") is not None):
                raise refuse(rel, f"reads dataset_path {short(path_)}, which is not a Hub dataset")


@contextmanager
def task_folder(task: TaskSpec, token: Token) -> Iterator[str | None]:
    """The folder of the task's ``task_dir`` for the time of the block (None: no ``task_dir``).

    Outside ``hub_only``: the local folder. In a ``hub_only`` run: the Hub repo it names (by its text alone;
    anything else is refused without looking at the disk), fetched into a fresh folder with ``token`` (the run's)
    and checked by :func:`check_task_folder`; the folder is removed when the block ends.
    """
    if not task.extra.get("task_dir"):
        yield None
        return
    if not hub_only():
        yield _local_task_dir(task)
        return
    who = f"task {short(task.name)} task_dir {short(task.extra['task_dir'])}"
    kind, repo_id, revision = require_task_repo(task.extra["task_dir"], f"task {short(task.name)} task_dir")
    with fetched_repo(kind, repo_id, revision, who, token=token) as folder:
        check_task_folder(folder, who, allow_code=current().allow_task_code)
        yield folder


def _manager(task_dir: str | None, defaults: bool, keep: bool = True) -> Any:
    """lm-eval's ``TaskManager`` of ``task_dir``'s tasks, with its built-in ones or not (one per process and local
    folder; a fetched task repo's, ``keep=False``, is made for its run only: its folder goes with it)."""
    from lm_eval.tasks import TaskManager  # lazy: optional extra (lm_eval)

    if not keep:
        return TaskManager(include_path=task_dir, include_defaults=defaults, verbosity="ERROR")
    with _MANAGERS_LOCK:
        key = (task_dir, defaults)
        if key not in _MANAGERS:
            _MANAGERS[key] = TaskManager(include_path=task_dir, include_defaults=defaults, verbosity="ERROR")
        return _MANAGERS[key]


def task_manager(task: TaskSpec, folder: str | None = None) -> Any:
    """lm-eval's ``TaskManager`` for the task's ``task_dir`` (``folder``: where :func:`task_folder` put it; one per
    process and local folder). Custom tasks alone when they are all in ``task_dir`` (indexing lm-eval's ~15k
    built-in tasks takes most of a minute)."""
    _import()
    keep = not hub_only()
    if folder is None and keep:
        folder = _local_task_dir(task)
    if folder:
        tm = _manager(folder, False, keep)
        if all(n in tm.all_tasks for n in task_names(task)):
            return tm
    return _manager(folder, True, keep or not folder)


def _unwritten_builtins(names: list[str]) -> list[str]:
    """Of ``names``, those that no file of lm-eval's built-in task folder contains as text. lm-eval names a
    built-in task, group or tag only by a ``task:``, ``group:`` or ``tag:`` value written in a config of that
    folder or in a file one of them includes (which need not end in ``.yaml``, and lies in that folder too), so
    such a name is certainly not built in. A read of the folder's bytes (~0.6 s for its ~16k files, 15 MB)
    instead of lm-eval's index of it (most of a minute), so that a misspelt name is reported at once; a name
    found somewhere is left to the index (``tests/eval/test_lmeval.py`` checks the names lm-eval's own index finds
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


def check(task: TaskSpec, token: Token) -> None:
    """lm-eval is installed, the task folder exists and every task name is known to lm-eval (a ``hub_only`` run's
    task repo fetched with ``token``)."""
    _import()
    with task_folder(task, token) as task_dir:
        names, keep = task_names(task), not hub_only()
        # a task_dir's own index is quick; it may include files from anywhere, the built-in ones only each other
        rest = [n for n in names if n not in _manager(task_dir, False, keep).all_tasks] if task_dir else names
        unknown = _unwritten_builtins(rest)
        if rest and not unknown:
            unknown = [n for n in rest if n not in task_manager(task, task_dir).all_tasks]
    if unknown:
        where = f" or in {task.extra['task_dir']}" if task.extra.get("task_dir") else ""
        raise ParameterError(f"task '{task.name}': lm-eval has no task '{unknown[0]}'{where} "
                             f"(`lm-eval ls tasks` lists them; custom tasks go in task_dir=DIR)")


add_kind("lm-eval", TaskKind(parse=parse, check=check))  # ``lm-eval:TASKS[,key=value...]``


_GUARD_LOCK = threading.Lock()


def _guard_lm_eval() -> None:
    """What a ``hub_only`` run needs of lm-eval (installed once per process, a no-op for every other run): a task's
    dataset is the Hub dataset of that name, asked with the token its :class:`Runner` lends (never a folder of the
    working directory, a packaged builder over local files, or remote code), and its Jinja prompts render in
    jinja2's sandbox."""
    import jinja2.sandbox  # lazy: only lm-eval's evaluation renders prompts
    import lm_eval.api.task  # lazy: optional extra (lm_eval)
    import lm_eval.utils  # lazy: optional extra (lm_eval)

    with _GUARD_LOCK:
        if getattr(lm_eval.api.task.datasets, "_hubsoup_guard", False):
            return
        env = lm_eval.utils.env
        sandbox = jinja2.sandbox.ImmutableSandboxedEnvironment(
            loader=env.loader, undefined=env.undefined, keep_trailing_newline=env.keep_trailing_newline)
        sandbox.filters.update(env.filters)
        lm_eval.utils.env = sandbox  # the same prompts for any task; no attribute of Python's reachable from one
        lm_eval.api.task.datasets = _GuardedDatasets(lm_eval.api.task.datasets)


class _GuardedDatasets:
    """lm-eval's ``datasets`` module as its tasks see it: ``load_dataset`` held to the run's rules in a ``hub_only``
    run, everything else (and every other run) the module's own.

    lm-eval's tasks load their data from lm-eval's code, which no argument of hubsoup's reaches: the
    :class:`Runner`, given the run's token as an argument, lends it (:meth:`lend`) to the loads its own calls into
    lm-eval make on its thread, and only for those calls. A ``hub_only`` load with no token lent is refused: it
    never falls back to the host's login (``HF_TOKEN``, the stored token: on a Space, the server's)."""

    _hubsoup_guard = True

    def __init__(self, module: Any):
        self._module = module
        self._lent: dict[int, Token] = {}  # thread id → the token a Runner's call lent; read by that thread only

    @contextmanager
    def lend(self, token: Token) -> Iterator[None]:
        """``token`` for the loads this thread makes inside the block (lm-eval building or running a Runner's tasks)."""
        me = threading.get_ident()
        nested, before = me in self._lent, self._lent.get(me)
        self._lent[me] = token
        try:
            yield
        finally:
            if nested:
                self._lent[me] = before
            else:
                del self._lent[me]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def load_dataset(self, path: Any = None, name: Any = None, **kwargs: Any) -> Any:
        if not hub_only():
            return self._module.load_dataset(path=path, name=name, **kwargs)
        role = "lm-eval task data"
        if kwargs.pop("trust_remote_code", None):
            raise refusal(role, path, "Hub datasets without remote code")
        for key in ("data_files", "data_dir"):
            if kwargs.get(key) is not None and not _hub_data(kwargs[key]):
                raise refusal(f"{role} {short(path)}", kwargs[key], "files on the Hub (hf://datasets/...)")
        for key in ("cache_dir", "token"):  # the run's own, never the task's
            kwargs.pop(key, None)
        lent = self._lent.get(threading.get_ident(), _NOT_LENT)
        if lent is _NOT_LENT:  # a load outside a Runner's call: no token of the run's reached it
            raise InputError(f"{role} {short(path)}: loaded outside an evaluation that was given the run's token; "
                             "it is not asked of the Hub with the host's login")
        acc = current()
        own = os.path.join(acc.cache_dir, "datasets") if acc.cache_dir else None
        import tempfile  # lazy: only a hub_only evaluation without a cache of its own
        import shutil  # lazy: only a hub_only evaluation without a cache of its own

        cache = own or tempfile.mkdtemp(prefix="hubsoup-datasets-")
        try:
            if path in _PACKAGED and kwargs.get("data_files") is not None:  # a builder over Hub files only
                where = path
            else:
                if path in _PACKAGED or not is_hub_dataset(path):
                    raise refusal(role, path, "Hub dataset IDs (org/name)")
                repo_id, _, revision = str(path).partition("@")
                where = f"hf://datasets/{repo_id}"  # the Hub only: datasets skips its look for a local folder
                kwargs.setdefault("revision", revision or None)
            return self._module.load_dataset(where, name, cache_dir=cache, token=lent,
                                             keep_in_memory=own is None, **kwargs)
        finally:
            if own is None:
                shutil.rmtree(cache, ignore_errors=True)


_NOT_LENT: Any = object()


def _lending(token: Token) -> contextlib.AbstractContextManager[None]:
    """The run's ``token`` lent to lm-eval's data loads in the block (a ``hub_only`` run's guard), or nothing."""
    import lm_eval.api.task  # lazy: optional extra (lm_eval)

    guard = lm_eval.api.task.datasets
    return guard.lend(token) if isinstance(guard, _GuardedDatasets) else contextlib.nullcontext()


def _plain(value: Any, folder: str | None = None, repo: str | None = None) -> Any:
    """lm-eval's task config as JSON: a ``!function`` (a Python function) by its name only (lm-eval names the
    module by its file's path, a folder of this machine); a fetched task repo's folder (``folder``) by the repo's
    name (``repo``): a server's paths never go into the results."""
    if isinstance(value, dict):
        return {str(k): _plain(v, folder, repo) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, folder, repo) for v in value]
    if callable(value):
        return f"!function {getattr(value, '__name__', type(value).__name__)}"
    if folder and isinstance(value, str):
        for form in sorted({folder, os.path.realpath(folder)}, key=len, reverse=True):
            value = value.replace(form, str(repo))
    return value


def _metric_name(key: str) -> str:
    metric, _, filt = key.partition(",")
    return metric if filt in ("", "none") else key


def _git_hash_quietly() -> str | None:
    """lm-eval's ``get_git_commit_hash`` (it records the working folder's commit in its output, which hubsoup does
    not keep) with git's stderr captured: outside a repository git says "fatal: not a git repository" once per
    evaluation, which reads as an error. The same answer otherwise (lm-eval's fallback included)."""
    from lm_eval.loggers.utils import get_commit_from_path  # lazy: optional extra (lm_eval)

    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return get_commit_from_path(os.getcwd())  # type: ignore[no-any-return]  # lm-eval ships no type information


def _quiet_git() -> None:
    """Give lm-eval's evaluator :func:`_git_hash_quietly` (once per process; lm-eval calls it by that name)."""
    import lm_eval.evaluator  # lazy: optional extra (lm_eval)

    if getattr(lm_eval.evaluator, "get_git_commit_hash", None) is not _git_hash_quietly:
        lm_eval.evaluator.get_git_commit_hash = _git_hash_quietly


@contextlib.contextmanager
def _quiet_libraries(quiet: bool) -> Iterator[None]:
    """With ``quiet``: no progress bars or warnings from lm-eval, datasets and transformers while lm-eval runs
    (each turned back as it was); ``-v`` (``quiet=False``) shows them."""
    if not quiet:
        yield
        return
    import datasets  # lazy: lm-eval imports it anyway; only an lm-eval task gets here
    import lm_eval.api.model  # lazy: optional extra (lm_eval)
    import lm_eval.api.task  # lazy: optional extra (lm_eval)
    import lm_eval.models.huggingface  # lazy: optional extra (lm_eval)
    import transformers  # lazy: lm-eval imports it anyway; only an lm-eval task gets here
    from tqdm import tqdm  # lazy: as above

    # lm-eval's own bars (tokenizing, requests, building contexts) are plain tqdm
    class _Hidden(tqdm):  # type: ignore[misc]  # tqdm ships no type information: tqdm is Any
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    barred = [m for m in (lm_eval.api.model, lm_eval.api.task, lm_eval.models.huggingface)
              if getattr(m, "tqdm", None) is tqdm]
    loggers = [logging.getLogger(n) for n in ("lm-eval", "lm_eval")]
    levels = [lg.level for lg in loggers]
    bars = datasets.is_progress_bar_enabled(), transformers.utils.logging.is_progress_bar_enabled()
    tf_level = transformers.utils.logging.get_verbosity()
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers: unannotated
    transformers.utils.logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # as above
    for m in barred:
        m.tqdm = _Hidden
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        for m in barred:
            m.tqdm = tqdm
        transformers.utils.logging.set_verbosity(tf_level)
        if bars[1]:
            transformers.utils.logging.enable_progress_bar()  # type: ignore[no-untyped-call]  # as above
        if bars[0]:
            datasets.enable_progress_bars()


def public_config(config: dict[str, Any]) -> dict[str, Any]:
    """An lm-eval task config as it is kept and published: every local file or folder it names (a custom task's
    ``dataset_kwargs.data_files``, ``config_source``, a local ``dataset_path``) by name and content hash."""
    return cast(dict[str, Any], public_value(config))  # a dict stays a dict (public_value maps values only)


class Runner:
    """lm-eval's tasks of ``task`` built once (lm-eval's ``TaskManager.load``, with the overrides ``simple_evaluate``
    applies), then run on any number of models: each :meth:`evaluate` is ``lm_eval.evaluator.evaluate`` with
    ``simple_evaluate``'s seeds set again, so each model gets the numbers ``simple_evaluate`` would give it
    (``tests/eval/test_lmeval.py`` compares them), without rebuilding the tasks and their datasets, without the run's
    environment report (a ``pip list`` subprocess) and git probe. The ``HFLM`` wrapper is built once per model
    instance (a search's candidate model has its weights replaced in place). An lm-eval without
    ``TaskManager.load`` (before 0.4.10) gets ``simple_evaluate`` each time.

    In a ``hub_only`` run the task repo is fetched into a fresh folder and checked (:func:`task_folder`), lm-eval's
    data loading guarded (with ``token``, the run's, lent to it for the runner's own calls into lm-eval), and the
    folder kept until :meth:`close` (a ``with`` block closes it); lm-eval and its
    libraries print nothing (no bars, no warnings) unless the root logger is at DEBUG (``-v``) and ``quiet`` is off.

    Example:
        >>> runner = Runner(TaskSpec.parse("lm-eval:wordppl,task_dir=tasks"), tok, limit=None, batch_size=1,
        ...                 device="cpu")                                            # doctest: +SKIP
        >>> runner.evaluate(model)[0].metrics["word_perplexity"]                     # doctest: +SKIP
        323.8477304254
    """

    def __init__(self, task: TaskSpec, tokenizer: Any, *, limit: int | None, batch_size: int, device: str,
                 quiet: bool = False, token: Token = None) -> None:
        _import()
        self.task, self.tokenizer, self.device, self.quiet = task, tokenizer, device, quiet
        self._token = token  # the run's: lent to lm-eval's data loads (_lending); never shown
        self.limit = limit if limit is not None else task.limit
        self.batch_size = task.extra.get("batch_size", batch_size)
        self._lm: Any = None
        self._model: Any = None
        self._loaded: Any = None
        self._stack = contextlib.ExitStack()
        _quiet_git()
        if hub_only():
            _guard_lm_eval()
        try:
            self.folder = self._stack.enter_context(task_folder(task, token))
            with self._quieted(), _lending(token):
                self.manager = task_manager(task, self.folder)
                unknown = [n for n in task_names(task) if n not in self.manager.all_tasks]
                if unknown:  # never a "name" lm-eval would read as a file of the working folder
                    raise ParameterError(f"task '{task.name}': lm-eval has no task '{unknown[0]}'")
                if hasattr(self.manager, "load"):
                    self._load()
        except BaseException:
            self.close()
            raise

    def _load(self) -> None:
        from lm_eval.defaults import DEFAULT_OTHER_SEED  # lazy: optional extra (lm_eval)

        ex = self.task.extra
        self._loaded = self.manager.load(task_names(self.task))
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

    def _quieted(self) -> contextlib.AbstractContextManager[None]:
        # lm-eval's and its libraries' bars and warnings are third-party noise: shown only when debugging (-v)
        return _quiet_libraries(self.quiet or not logging.getLogger().isEnabledFor(logging.DEBUG))

    def close(self) -> None:
        """Remove what the runner fetched (a ``hub_only`` run's task repo)."""
        self._stack.close()

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _wrapper(self, model: Any) -> Any:
        if self._model is not model:
            from lm_eval.models.huggingface import HFLM  # lazy: optional extra (lm_eval)

            self._lm = HFLM(pretrained=model, tokenizer=self.tokenizer, batch_size=self.batch_size,
                            device=self.device, **self.task.extra.get("model_args", {}))
            self._model = model
        return self._lm

    def evaluate(self, model: Any) -> list[TaskResult]:
        """The lm-eval tasks on ``model`` (a causal LM instance): one :class:`~hubsoup.eval.TaskResult` per task."""
        import lm_eval  # lazy: optional extra (lm_eval)

        ex = self.task.extra
        with self._quieted(), _lending(self._token):
            lm = self._wrapper(model)
            if self._loaded is None:  # an older lm-eval: its tasks built on every call
                out = lm_eval.simple_evaluate(
                    model=lm, tasks=task_names(self.task), num_fewshot=ex.get("num_fewshot"), limit=self.limit,
                    task_manager=self.manager, apply_chat_template=ex.get("apply_chat_template", False),
                    gen_kwargs=ex.get("gen_kwargs") or None, log_samples=False, bootstrap_iters=0, verbosity="ERROR")
                return _results(out, self.task, self.folder)
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
        return _results(out, self.task, self.folder)


@contextlib.contextmanager
def _bars(shown: bool) -> Iterator[None]:
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


def evaluate(model: Any, tokenizer: Any, task: TaskSpec, *, limit: int | None, batch_size: int, device: str,
             quiet: bool = True, token: Token = None) -> list[TaskResult]:
    """Run the lm-eval tasks of ``task`` on ``model`` (a causal LM instance) with ``tokenizer``; one
    :class:`~hubsoup.eval.TaskResult` per lm-eval task (a :class:`Runner` used once; ``token``: the run's)."""
    with Runner(task, tokenizer, limit=limit, batch_size=batch_size, device=device, quiet=quiet,
                token=token) as runner:
        return runner.evaluate(model)


def _results(out: dict[str, Any], task: TaskSpec, folder: str | None = None) -> list[TaskResult]:
    """One :class:`~hubsoup.eval.TaskResult` per lm-eval task of ``task`` from lm-eval's output ``out`` (``folder``:
    where a ``hub_only`` run fetched the task repo; its path is never kept)."""
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
        cfg = public_config((out.get("configs") or {}).get(name) or {})  # no local path kept, none published
        spec = TaskSpec(kind=KIND, data=name, name=name, limit=task.limit,
                        split=str(cfg.get("test_split") or cfg.get("validation_split") or "validation"),
                        config=cfg.get("dataset_name"),
                        extra={**ex, "dataset_path": cfg.get("dataset_path"), "main_metric": main})
        lm_out = {"results": row, "n-shot": (out.get("n-shot") or {}).get(name),
                  "higher_is_better": (out.get("higher_is_better") or {}).get(name),
                  "n-samples": (out.get("n-samples") or {}).get(name), "versions": (out.get("versions") or {}).get(name),
                  "config": _plain(cfg, folder if hub_only() else None, ex.get("task_dir"))}
        n = (out.get("n-samples") or {}).get(name, {}).get("effective") or 0
        results.append(TaskResult(spec, metrics, int(n), {
            "lm_eval": lm_out, "main_metric": main,
            "lower_is_better": [k for k, v in hib.items() if v is False]}))
    return results
