"""What one run may reach: Hub repo IDs only (``hub_only``), its own download cache, a download budget.

A server that runs hubsoup for visitors (a Gradio Space, a bot) must not let a visitor's text name a
file of the server: ``MergeOptions(hub_only=True)`` (``--hub-only``) makes every model spec, base,
tokenizer source, continual soup, exemplar and evaluation dataset a Hub ID, refused as a plain
string check **before** anything on the disk is looked at, with a message that says nothing about
the host (the same whether or not such a path exists). ``cache_dir`` gives the run a Hub cache of
its own (a snapshot another token filled is never opened), and ``max_download`` a budget in bytes,
charged from the Hub's file sizes before each download.

Every entry point (:func:`hubsoup.merge`, continual merging, ``run`` of a recipe or mergekit config,
the pipeline) enters :func:`scope` with its options; :func:`hubsoup.sources.resolve.open_input`, the
one place where a spec becomes a checkpoint, asks :func:`current` — so a spec that reaches it by any
path (a mergekit slice, ``tokenizer_source``, a card naming its base) is held to the same rule.

Example:
    >>> from hubsoup.sources.access import require_hub_id
    >>> require_hub_id("../secret", "input")
    Traceback (most recent call last):
    ...
    hubsoup.errors.InputError: input '../secret': only Hub repo IDs (org/name[@revision]) are accepted here, not local paths
"""

from __future__ import annotations

import contextvars
import fnmatch
import os
import shutil
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, TypeGuard

from huggingface_hub import constants, try_to_load_from_cache

from hubsoup.errors import InputError
from hubsoup.hubclient import Token, is_hub_id
from hubsoup.untrusted import short

_DATA_SUFFIXES = (".csv", ".tsv", ".json", ".jsonl", ".parquet", ".txt", ".arrow")


def is_hub_dataset(spec: Any) -> TypeGuard[str]:
    """A Hub dataset ID (``org/name``, optionally ``:split`` or ``@revision``), never a file name or a path."""
    if not isinstance(spec, str):
        return False
    name = spec.split(":", 1)[0]
    return is_hub_id(name) and not name.lower().endswith(_DATA_SUFFIXES)


def refusal(role: str, spec: Any, kind: str = "Hub repo IDs (org/name[@revision])") -> InputError:
    """The one message a ``hub_only`` run gives for a spec that is not a Hub ID: it depends on the text alone."""
    what = f"'{spec}'" if isinstance(spec, str) and len(spec) <= 100 and spec.isprintable() else short(spec)
    return InputError(f"{role} {what}: only {kind} are accepted here, not local paths")


def require_hub_id(spec: Any, role: str) -> str:
    """``spec`` if it is a Hub repo ID; else :func:`refusal` (nothing on the disk is looked at)."""
    if not is_hub_id(spec):
        raise refusal(role, spec)
    return spec


def require_hub_model(spec: Any, role: str) -> str:
    """``spec`` if it is a Hub repo ID or a ``model+adapter`` reference of two Hub repo IDs (a LoRA applied on
    read, :mod:`hubsoup.sources.adapted`); else :func:`refusal`, by the text alone."""
    if isinstance(spec, str) and spec.count("+") == 1:
        model, adapter = (part.strip() for part in spec.split("+"))
        if is_hub_id(model) and is_hub_id(adapter):
            return spec
        raise refusal(role, spec)
    return require_hub_id(spec, role)


def require_hub_dataset(spec: Any, role: str) -> str:
    if not is_hub_dataset(spec):
        raise refusal(role, spec, "Hub dataset IDs (org/name)")
    return spec


TASK_REPOS = "Hub dataset or Space repos (org/name, hf://datasets/org/name, hf://spaces/org/name)"


def require_task_repo(spec: Any, role: str) -> tuple[str, str, str | None]:
    """``(repo_type, repo_id, revision)`` of a Hub repo that holds lm-eval tasks (a ``task_dir`` in a ``hub_only``
    run), by its text alone: ``org/name[@rev]`` (a dataset), ``hf://datasets/org/name[@rev]`` or
    ``hf://spaces/org/name[@rev]``; anything else is :func:`refusal` (nothing on the disk is looked at).

    >>> require_task_repo("hf://spaces/org/tasks@v1", "task_dir")
    ('space', 'org/tasks', 'v1')
    >>> require_task_repo("./tasks", "task_dir")
    Traceback (most recent call last):
    ...
    hubsoup.errors.InputError: task_dir './tasks': only Hub dataset or Space repos (org/name, hf://datasets/org/name, hf://spaces/org/name) are accepted here, not local paths
    """
    text, kind = spec if isinstance(spec, str) else "", "dataset"
    for prefix, k in (("hf://datasets/", "dataset"), ("hf://spaces/", "space")):
        if text.startswith(prefix):
            text, kind = text[len(prefix):], k
            break
    if not is_hub_id(text):
        raise refusal(role, spec, TASK_REPOS)
    repo_id, _, revision = text.partition("@")
    return kind, repo_id, revision or None


@dataclass
class Access:
    """The rules of one run (see the module's docstring). ``spent``: bytes charged to ``max_download`` so far."""

    hub_only: bool = False
    cache_dir: str | None = None
    max_download: int | None = None
    spent: int = 0
    cache_inputs: bool = False
    """Hub inputs' weight files are downloaded into the cache (False: read in place, :mod:`hubsoup.sources.remote`)."""
    read_ahead: int | None = None
    """Bytes a stream fetches ahead of the merge from Hub inputs read in place (None: the default, 256 MiB)."""
    fetched: int = 0
    """Bytes of weight files received from the Hub by range requests in this run (headers included)."""
    needed: int = 0
    """Of those, the bytes the run asked for: its tensors' (each once per pass) and the files' headers."""
    verified: list[str] = field(default_factory=list, repr=False)
    """``repo@sha/file`` of every file read whole and found equal to the Hub's sha256 of it."""
    unverified: list[tuple[str, str]] = field(default_factory=list, repr=False)
    """``(repo@sha/file, why)`` of files read in place that could not be checked against a sha256."""
    remote_files: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)
    """``{(repo, sha, file, token): RemoteFile}``: the Hub files this run reads in place, opened once."""
    allow_task_code: bool = False
    """In a ``hub_only`` run: the operator lets an lm-eval task repo's Python (``!function``, ``.py`` files) run."""
    _charged: set[tuple[str, str, str, str]] = field(default_factory=set, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def spend(self, n: int, who: str) -> None:
        """Count ``n`` bytes just received by a range read; past ``max_download`` it raises :class:`InputError`
        (what the plan predicted was checked before; this is the hard stop)."""
        with self._lock:
            self.fetched += n
            if self.max_download is not None and self.spent + n > self.max_download:
                raise InputError(f"{who}: this run may download at most {_fmt(self.max_download)}, and reading on "
                                 f"would bring it to {_fmt(self.spent + n)}; stopped")
            self.spent += n

    def asked(self, n: int) -> None:
        """Count ``n`` bytes the run needed (see :attr:`needed`)."""
        with self._lock:
            self.needed += n

    @property
    def limited(self) -> bool:
        return self.max_download is not None

    def charge(self, repo_id: str, sha: str, sizes: dict[str, int | None], patterns: Iterable[str] | None,
               who: str, *, repo_type: str = "model") -> int:
        """Charge the files of ``repo_id@sha`` that ``patterns`` select (all when None) to the budget, before
        they are downloaded; files already charged or already in this run's cache cost nothing. Raises
        :class:`InputError` (nothing downloaded) when the budget would be exceeded or the Hub gave no size."""
        limit = self.max_download
        if limit is None:
            return 0
        pats = list(patterns) if patterns is not None else None
        names = [n for n in sizes if pats is None or any(fnmatch.fnmatch(n, p) for p in pats)]
        new: dict[str, int] = {}
        for name in names:
            key = (repo_type, repo_id, sha, name)
            if key in self._charged or self._cached(repo_id, sha, name, repo_type):
                continue
            size = sizes[name]
            if size is None:
                raise InputError(f"{who}: the Hub gave no size for '{name}', and this run may download at most "
                                 f"{_fmt(self.max_download)}")
            new[name] = int(size)
        with self._lock:
            total = self.spent + sum(new.values())
            if total > limit:
                raise InputError(f"{who}: this run may download at most {_fmt(limit)}, and its files "
                                 f"would bring it to {_fmt(total)} (sizes from the Hub); nothing more was downloaded")
            self.spent = total
            self._charged.update((repo_type, repo_id, sha, n) for n in new)
        return sum(new.values())

    def check_total(self, planned: int, who: str = "the inputs") -> None:
        """Refuse early when ``planned`` more bytes would exceed the budget (before any weight is downloaded)."""
        if self.max_download is not None and self.spent + planned > self.max_download:
            raise InputError(f"{who}: this run may download at most {_fmt(self.max_download)}, and the weights "
                             f"would bring it to {_fmt(self.spent + planned)} (sizes from the Hub); nothing was "
                             "downloaded")

    def _cached(self, repo_id: str, sha: str, name: str, repo_type: str) -> bool:
        try:
            hit = try_to_load_from_cache(repo_id, name, revision=sha, cache_dir=self.cache_dir, repo_type=repo_type)
        except Exception:  # noqa: BLE001 - an odd name: not cached
            return False
        return isinstance(hit, str)


def _fmt(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


_CURRENT: contextvars.ContextVar[Access | None] = contextvars.ContextVar("hubsoup_access", default=None)


def current() -> Access:
    """The rules of the run in progress in this thread (none: a run of the library's defaults)."""
    return _CURRENT.get() or Access()


def hub_only() -> bool:
    return current().hub_only


@contextmanager
def scope(options: Any = None, **kw: Any) -> Iterator[Access]:
    """Enter a run's rules (from :class:`~hubsoup.options.MergeOptions`' ``hub_only``, ``cache_dir`` and
    ``max_download``, or keywords). The run's token is not one of them: it travels as an argument to every call
    that asks the Hub (a path an argument missed must not fall back to the host's login). A scope inside another (a recipe's run calling :func:`hubsoup.merge`)
    keeps the outer one (its budget and cache); it can only make it stricter: ``hub_only`` added, a cache
    where it had none, a smaller limit (a new budget then)."""
    if "token" in kw:  # one channel for the token: the argument of each call that asks the Hub
        raise TypeError("scope() takes no token; pass it to the calls that ask the Hub")
    want_hub_only = bool(kw.get("hub_only", getattr(options, "hub_only", False)))
    cache_dir = kw.get("cache_dir", getattr(options, "cache_dir", None))
    limit = kw.get("max_download", getattr(options, "max_download_bytes", None))
    cache_inputs = bool(kw.get("cache_inputs", getattr(options, "cache_inputs", False)))
    read_ahead = kw.get("read_ahead", getattr(options, "read_ahead_bytes", None))
    allow_code = bool(kw.get("allow_task_code", getattr(options, "allow_task_code", False)))
    outer = _CURRENT.get()
    if outer is not None:
        stricter = (want_hub_only and not outer.hub_only) or (cache_dir and not outer.cache_dir) or (
            limit is not None and (outer.max_download is None or limit < outer.max_download - outer.spent)) or (
            cache_inputs and not outer.cache_inputs)
        if not stricter:
            yield outer
            return
        want_hub_only = want_hub_only or outer.hub_only
        cache_dir = outer.cache_dir or cache_dir
        cache_inputs = cache_inputs or outer.cache_inputs  # a search inside a run keeps its inputs, as asked
        read_ahead = outer.read_ahead if outer.read_ahead is not None else read_ahead
        if outer.max_download is not None and (limit is None or outer.max_download - outer.spent < limit):
            limit = outer.max_download - outer.spent
    access = Access(hub_only=want_hub_only, cache_dir=cache_dir, max_download=limit,
                    cache_inputs=cache_inputs, read_ahead=read_ahead,
                    allow_task_code=outer.allow_task_code if outer is not None else allow_code)
    entered = _CURRENT.set(access)
    try:
        yield access
    finally:
        _CURRENT.reset(entered)


def check_specs(*, inputs: Iterable[Any] = (), base: Any = None, soup: Any = None, tasks: Iterable[Any] = (),
                exemplars: Any = None, roles: tuple[str, str] = ("input", "base")) -> None:
    """In a ``hub_only`` run, refuse (by their text alone) every spec a caller gave that is not a Hub ID:
    models, the base, a continual soup, evaluation tasks' data (and a classifier head: a file), exemplars.
    ``tasks`` are :class:`hubsoup.eval.TaskSpec` (every caller parses them first)."""
    if not hub_only():
        return
    for s in inputs:
        require_hub_model(s, roles[0])
    if isinstance(base, str) or (base is not None and not hasattr(base, "ref")):
        require_hub_model(base, roles[1])
    if soup is not None:
        require_hub_id(soup, "soup")
    for t in tasks or ():  # parsed task specs (hubsoup.eval.TaskSpec: sources sit below eval)
        if getattr(t, "kind", None) == "lm-eval":  # lm-eval's task names (labels); a task folder is a Hub repo
            task_dir = (getattr(t, "extra", None) or {}).get("task_dir")
            if task_dir:
                require_task_repo(task_dir, f"task {short(t.name)} task_dir")
            continue
        require_hub_dataset(getattr(t, "data", None), "evaluation data")
        if getattr(t, "head", None):
            raise refusal(f"task '{short(t.name)}' head", t.head, "Hub datasets")
    if isinstance(exemplars, dict):
        for task, spec in exemplars.items():
            require_hub_dataset(spec, f"exemplars for task {short(task)}")
    elif exemplars:
        for item in ([exemplars] if isinstance(exemplars, str) else exemplars):
            spec = item.split("=", 1)[1].strip() if isinstance(item, str) and "=" in item else item
            require_hub_dataset(spec, "exemplars")


def load_hub_dataset(name: str, role: str, *, token: Token, config: str | None = None,
                     split: str | None = "train") -> Any:  # a datasets.Dataset (datasets is imported lazily)
    """A Hub dataset for a ``hub_only`` run, by its ID alone (``org/name[@revision]``): never a folder of the host
    that has the same name (``datasets.load_dataset`` looks for one first), never a packaged builder (``csv``,
    ``json``: they read files of the working folder), never a copy another token left in the shared datasets
    cache (the Hub is asked with ``token``, the run's, which every caller passes: no default, so a caller that
    forgets it fails instead of asking with the host's login; the data goes to this run's ``cache_dir``, or to a
    temporary folder removed at once, the rows kept in memory).

    >>> load_hub_dataset("csv", "evaluation data", token=None)
    Traceback (most recent call last):
    ...
    hubsoup.errors.InputError: evaluation data 'csv': only Hub dataset IDs (org/name) are accepted here, not local paths
    """
    import datasets  # lazy: datasets costs ~7 s to import here (torch ~6 s); only Hub datasets need it
    # lazy: datasets costs ~7 s to import here (torch ~6 s); only Hub datasets need it
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    require_hub_dataset(name, role)
    repo_id, _, revision = name.partition("@")
    if repo_id in _PACKAGED_DATASETS_MODULES:
        raise refusal(role, name, "Hub dataset IDs (org/name)")
    acc = current()
    own = os.path.join(acc.cache_dir, "datasets") if acc.cache_dir else None
    cache = own or tempfile.mkdtemp(prefix="hubsoup-datasets-")
    try:  # hf://datasets/: the Hub only (datasets skips its look for a local folder of that name)
        return datasets.load_dataset(f"hf://datasets/{repo_id}", config, split=split, revision=revision or None,
                                     cache_dir=cache, token=token, keep_in_memory=own is None)
    finally:
        if own is None:
            shutil.rmtree(cache, ignore_errors=True)


def check_offline(who: str) -> None:
    """A ``hub_only`` run offline reads only a cache of its own (``cache_dir``): a snapshot another user's token
    filled must never be opened without the Hub checking this run's token."""
    acc = current()
    if acc.hub_only and constants.HF_HUB_OFFLINE and not acc.cache_dir:
        raise InputError(f"{who}: a hub_only run offline (HF_HUB_OFFLINE=1) needs a cache of its own (cache_dir); "
                         "the shared Hub cache is not opened without asking the Hub with this run's token")


__all__ = ["Access", "current", "scope", "check_specs", "hub_only", "is_hub_dataset",
           "require_hub_id", "require_hub_model", "require_task_repo",
           "require_hub_dataset", "refusal", "check_offline", "load_hub_dataset"]
