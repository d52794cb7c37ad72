"""Write eval.jsonl: real English text for the example pipeline's perplexity task.

The text is the first paragraph of the docstrings of public functions and classes in a fixed list
of Python standard library modules (CPython's documentation strings, under the Python Software
Foundation License), as this interpreter has them; whitespace is normalised, doctest lines and
paragraphs that are not one sentence or more (60 to 600 characters, ending with a full stop) are
left out, and duplicates removed.

    python examples/pipelines/data/make_eval.py      # rewrites examples/pipelines/data/eval.jsonl
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys

MODULES = ["argparse", "asyncio", "base64", "bisect", "calendar", "collections", "configparser", "contextlib",
           "csv", "datetime", "decimal", "difflib", "email.message", "fractions", "ftplib", "functools", "gzip",
           "heapq", "hmac", "html.parser", "http.client", "imaplib", "ipaddress", "itertools", "json", "logging",
           "mailbox", "math", "mimetypes", "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "sched",
           "secrets", "selectors", "shlex", "shutil", "smtplib", "socket", "sqlite3", "statistics", "string",
           "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback",
           "typing", "unittest", "urllib.parse", "uuid", "warnings", "wave", "weakref", "xml.dom.minidom",
           "zipfile", "zlib"]


def paragraphs():
    for name in MODULES:
        mod = importlib.import_module(name)
        objs = [mod] + [getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_")]
        for obj in objs:
            if obj is not mod and (getattr(obj, "__module__", None) or "").split(".")[0] != name.split(".")[0]:
                continue
            doc = inspect.getdoc(obj) if (obj is mod or inspect.isroutine(obj) or inspect.isclass(obj)) else None
            for para in (doc or "").split("\n\n")[:1]:
                if ">>>" in para or "::" in para or para.lstrip().startswith(("-", "*", ":")):
                    continue
                text = " ".join(para.split())
                if (60 <= len(text) <= 600 and text.isascii() and text[0].isupper() and text.endswith(".")
                        and text.count(" ") >= 8):
                    yield text


def main() -> None:
    seen: set[str] = set()
    rows = [t for t in paragraphs() if not (t in seen or seen.add(t))]
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "eval.jsonl")
    with open(out, "w", encoding="utf-8") as f:
        for t in rows:
            f.write(json.dumps({"text": t}) + "\n")
    print(f"{len(rows)} rows from {len(MODULES)} modules (Python {sys.version.split()[0]}) -> {out}")


if __name__ == "__main__":
    main()
