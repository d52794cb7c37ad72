"""The pipeline's work folder: a cache, verified before anything in it is published.

Each merge made there (``merges/HASH``, or a ``config:`` merge's id) gets a manifest (``merges/HASH.manifest.json``:
its recipe hash and every file's sha256, the card apart, since it is rendered again before a push); a merge is
reused or pushed only while its files still match it.
"""

from __future__ import annotations

import hashlib
import json
import os

from hubsoup.workflows.pipeline.context import Run
from hubsoup.workflows.pipeline.report import PlannedMerge


def out_path(run: Run, m: PlannedMerge) -> str:
    """Where ``m`` is made in the work folder."""
    return os.path.join(run.work, "merges", m.work_key or m.recipe_hash[:16])


def manifest_path(run: Run, m: PlannedMerge) -> str:
    """Where its manifest is."""
    return os.path.join(run.work, "merges", f"{m.work_key or m.recipe_hash[:16]}.manifest.json")


def write_manifest(run: Run, m: PlannedMerge, folder: str) -> None:
    """The recipe hash and every file's sha256 of a merge just made (the card is rendered again at push)."""
    data = {"recipe_hash": m.recipe_hash, "files": checksums(folder), **({"work_key": m.work_key} if m.work_key else {})}
    path = manifest_path(run, m)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def verify(run: Run, m: PlannedMerge, folder: str) -> str | None:
    """None when ``folder`` holds exactly the merge this run (or an earlier one) made, else what differs."""
    try:
        with open(manifest_path(run, m), encoding="utf-8") as f:
            want = json.load(f)
    except FileNotFoundError:
        return "has no manifest (a run was stopped before it was written)"
    except (OSError, ValueError):
        return "has an unreadable manifest"
    if not isinstance(want, dict) or not isinstance(want.get("files"), dict) or (
            want.get("work_key") != m.work_key if m.work_key else want.get("recipe_hash") != m.recipe_hash):
        return "has a manifest of another recipe"
    try:
        have = checksums(folder)
    except OSError as e:
        return f"cannot be read ({type(e).__name__})"
    for name in sorted(set(want["files"]) | set(have)):
        if want["files"].get(name) != have.get(name):
            what = "is missing" if name not in have else ("was added" if name not in want["files"] else "changed")
            return f"differs from its manifest ({name} {what})"
    return None


def checksums(folder: str) -> dict[str, str]:
    """sha256 of every file under ``folder`` but its card (``README.md``, rendered again before a push)."""
    out = {}
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder).replace(os.sep, "/")
            if rel == "README.md":
                continue
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            out[rel] = h.hexdigest()
    return out


def remove(path: str) -> None:
    """Remove a file if it is there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
