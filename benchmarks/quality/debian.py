"""Benchmark-only helpers of the quality benchmark: Debian package descriptions as a corpus, cache keys, timings.

The Debian tasks label package long descriptions by archive section: the ``Packages`` +
``Translation-en`` lists under ``/var/lib/apt/lists``, fetched by
``apt-get update -o Acquire::Languages=en`` (:func:`debian_descriptions`). Compressed lists
are read through apt's own decompressor (``apt-helper cat-file``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import subprocess
import sys
from typing import Iterable, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from hubsoup.demo.data import Example  # noqa: E402
from hubsoup.errors import HubsoupError  # noqa: E402

_SPACE = re.compile(r"\s+")

APT_LISTS = "/var/lib/apt/lists"


def _apt_cat(path: str) -> str:
    """A (possibly compressed) apt list file as text, through apt's own decompressor."""
    helper = "/usr/lib/apt/apt-helper"
    if path.endswith((".lz4", ".gz", ".xz", ".bz2", ".zst")):
        if not os.path.exists(helper):
            raise HubsoupError(f"cannot decompress {path}: {helper} not found")
        return subprocess.run([helper, "cat-file", path], check=True, capture_output=True).stdout.decode(
            "utf-8", errors="replace")
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _deb822(text: str) -> Iterable[dict[str, str]]:
    for para in text.split("\n\n"):
        d: dict[str, str] = {}
        key = None
        for line in para.split("\n"):
            if line.startswith((" ", "\t")) and key:
                d[key] += "\n" + line
            elif ":" in line:
                key, v = line.split(":", 1)
                d[key] = v.strip()
        if d:
            yield d


def debian_lists(lists_dir: str = APT_LISTS) -> tuple[list[str], list[str]]:
    packages = sorted(p for p in glob.glob(os.path.join(lists_dir, "*_Packages*")) if not p.endswith(".diff_Index"))
    translations = sorted(glob.glob(os.path.join(lists_dir, "*_i18n_Translation-en*")))
    return packages, translations


def debian_descriptions(sections: dict[str, Sequence[str]], lists_dir: str = APT_LISTS) -> list[Example]:
    """Package descriptions (synopsis + long description) labelled by archive section.

    Joins each ``Packages`` entry's ``Section`` (the part after ``contrib/`` etc.) with the
    ``Translation-en`` long description of the same ``Description-md5``; one example per
    distinct description. Needs ``apt-get update -o Acquire::Languages=en`` to have run.
    """
    packages, translations = debian_lists(lists_dir)
    if not packages or not translations:
        raise HubsoupError(f"no Debian package lists with English descriptions under {lists_dir}; "
                           "run: apt-get update -o Acquire::Languages=en")
    desc: dict[str, str] = {}
    for path in translations:
        for d in _deb822(_apt_cat(path)):
            if "Description-md5" in d and "Description-en" in d:
                desc[d["Description-md5"]] = d["Description-en"]
    owner = {s: label for label, secs in sections.items() for s in secs}
    seen: set[str] = set()
    out = []
    for path in packages:
        for d in _deb822(_apt_cat(path)):
            label = owner.get(d.get("Section", "").split("/")[-1])
            md5 = d.get("Description-md5")
            if label is None or md5 not in desc or md5 in seen:
                continue
            seen.add(md5)
            lines = desc[md5].split("\n")
            body = " ".join(l.strip() for l in lines[1:] if l.strip() != ".")
            text = _SPACE.sub(" ", f"{lines[0].strip()}. {body}").strip()
            if len(text.split()) >= 8:
                out.append((" ".join(text.split()[:80]), label))
    return out


def fingerprint(*parts) -> str:
    """A short hash of anything JSON-serialisable (cache keys)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def fmt_seconds(s: float) -> str:
    return f"{int(s // 60)}m{s % 60:04.1f}s" if s >= 60 else f"{s:.1f}s"
