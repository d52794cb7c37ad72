"""Rooms of one concern (issue 47, item 5): no function of ``hubsoup/`` is longer than :data:`MAX_LINES` lines unless
it says why, with a ``# long: <why>`` comment at its top (on the line of its ``def`` or between it and its first
statement after the docstring).

A function's length is its lines from ``def`` to its last line, its docstring left out (the functions nested in it
count: a function made of long closures is long). Cut a long function into named steps instead where you can.

Measured on main 33969cb: 6 functions over 80 lines counted so (``lora_source`` 167, ``evolve`` 152, ``api.merge``
145, ``resolve._hub`` 142, ``mergekit.read_config`` 102, ``MergekitLayout._slice_plan`` 89). After issue 47's part A:
2, both in files other work was changing then (:data:`PENDING`); after part B's Hub client work, 1: ``resolve._hub`` is
the class ``_HubInput``, one method per step; after ``api.merge`` became its orchestration (69 lines, each block in
the module that owns it), none.
"""

from __future__ import annotations

import ast
import os

from paths import ROOT
MAX_LINES = 80
MARK = "# long:"

PENDING: dict[str, str] = {}
"""Long functions known and planned away, each with why it is still long; an entry no longer long fails the test."""


def long_functions(source: str, filename: str = "<source>", limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """``(name, length)`` of each function of ``source`` longer than ``limit`` (docstring left out) without a
    ``# long:`` comment at its top."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = node.end_lineno - node.lineno + 1
        body = node.body
        doc = body[0] if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str) else None
        if doc is not None:
            length -= doc.end_lineno - doc.lineno + 1
        first = next((s for s in body if s is not doc), body[0])
        top = lines[node.lineno - 1: first.lineno - 1]
        if length > limit and not any(MARK in line for line in top):
            out.append((node.name, length))
    return out


def package_long_functions() -> dict[str, int]:
    found = {}
    for d, _, files in os.walk(os.path.join(ROOT, "hubsoup")):
        for fn in sorted(files):
            if fn.endswith(".py"):
                path = os.path.join(d, fn)
                with open(path, encoding="utf-8") as f:
                    rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
                    for name, n in long_functions(f.read(), rel):
                        found[f"{rel}:{name}"] = n
    return found


def test_no_long_function_without_a_reason():
    found = package_long_functions()
    bad = {k: n for k, n in found.items() if k not in PENDING}
    assert not bad, (f"functions over {MAX_LINES} lines (docstring left out): cut them into named steps, or say why "
                     f"at their top with '{MARK} <why>':\n" + "\n".join(f"{k}: {n}" for k, n in sorted(bad.items())))
    gone = [k for k in PENDING if k not in found]
    assert not gone, f"no longer long (remove them from PENDING): {gone}"


def test_the_length_check_can_fail():
    body = "".join(f"    x{i} = {i}\n" for i in range(5))
    src = (f'def short():\n    """A docstring\n    of three\n    lines."""\n{body}'
           f"def long():\n{body}{body}\n"
           f"def explained():  # long: one table, read as one\n{body}{body}"
           f'def explained_below():\n    """Doc."""\n    # long: as above\n{body}{body}')
    assert long_functions(src, limit=8) == [("long", 11)]


MERGE_LINES = 70
"""``api.merge`` without its docstring (127 lines on main 70881c6, 69 after issue 47's item 1 was finished)."""


def test_api_merge_is_only_its_orchestration():
    """Issue 47 item 1: ``hubsoup.merge`` reads as its steps (validate, session, engine, output, card and push,
    result), each block in the module that owns it; it must not grow back into a room of its own."""
    with open(os.path.join(ROOT, "hubsoup", "api.py"), encoding="utf-8") as f:
        lengths = dict(long_functions(f.read(), "hubsoup/api.py", limit=0))
    assert lengths["merge"] <= MERGE_LINES, (f"api.merge is {lengths['merge']} lines (docstring left out), over "
                                             f"{MERGE_LINES}: move the new block into the module that owns it")
