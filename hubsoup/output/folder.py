"""The output folder: written in a temporary folder beside the target, renamed at the end.

An interrupted merge never leaves a folder that looks done: everything goes into
``.NAME.partial-XXXX`` beside the target, which becomes the target only on
:meth:`OutputFolder.commit`.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from hubsoup.errors import OutputExistsError


def parse_size(size: str | int) -> int:
    """``"5GB"`` → 5·10⁹ bytes (``GiB`` → 2³⁰), as transformers' ``max_shard_size``."""
    if isinstance(size, int):
        return size
    s = size.strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12, "B": 1}
    for u, mult in units.items():
        if s.endswith(u):
            return int(float(s[: -len(u)]) * mult)
    return int(s)


def check_output(target: str, overwrite: bool) -> None:
    """Refuse to replace an existing output unless ``overwrite``; called before any work starts."""
    if os.path.exists(target) and not overwrite:
        raise OutputExistsError(f"output '{target}' already exists; pass --overwrite (overwrite=True) to replace it")


class OutputFolder:
    """A temporary folder beside ``target`` that becomes ``target`` on :meth:`commit`."""

    def __init__(self, target: str, overwrite: bool = False):
        self.target = os.path.abspath(target)
        check_output(target, overwrite)
        parent = os.path.dirname(self.target)
        os.makedirs(parent, exist_ok=True)
        self.path = tempfile.mkdtemp(prefix=f".{os.path.basename(self.target)}.partial-", dir=parent)

    def commit(self) -> str:
        if os.path.exists(self.target):
            old = self.target + ".old-" + os.path.basename(self.path)
            os.rename(self.target, old)
            os.rename(self.path, self.target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(self.path, self.target)
        return self.target

    def abort(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


