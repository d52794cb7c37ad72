"""Untrusted text, bounded: YAML read with a size and node limit, values quoted short and escaped.

Every YAML that may come from someone else (a mergekit config, a recipe, a pipeline file, a
recipe downloaded from the Hub) is read with :func:`load_yaml`: text over
:data:`MAX_YAML_BYTES` is refused before it is parsed, and the parse stops at
:data:`MAX_YAML_NODES` nodes *counting every alias as the whole node it repeats*, so a
"billion laughs" alias bomb of a few hundred bytes is refused in milliseconds with one line,
instead of expanding into gigabytes. Error messages show an untrusted value through
:func:`short`: at most :data:`SHORT` characters of its ``repr`` (control characters escaped),
then ``...``.

Example:
    >>> from hubsoup.untrusted import load_yaml, short
    >>> load_yaml("a: [1, 2]", "recipe")
    {'a': [1, 2]}
    >>> bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\\n" + "".join(
    ...     f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\\n"
    ...     for p, c in zip("abcdefgh", "bcdefghi"))
    >>> load_yaml(bomb, "mergekit config")
    Traceback (most recent call last):
    ...
    hubsoup.errors.ParameterError: mergekit config: too many YAML nodes (over 200000, aliases counted as what they repeat); refusing to expand it
    >>> short("x" * 10**9), len(short("x" * 10**9))
    ("'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...", 67)
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, TypeVar, cast

import yaml

from hubsoup.errors import ParameterError

MAX_YAML_BYTES = 1 << 20
"""The largest YAML text read (1 MiB: a config or recipe is a few KiB)."""
MAX_YAML_NODES = 200_000
"""The most nodes a YAML may stand for, each alias counted as the size of the node it repeats."""
SHORT = 64
"""Characters of an untrusted value an error message shows."""
MAX_LABEL = 100
"""The longest label (:func:`label`)."""
_LABEL = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.()-]*$")
_T = TypeVar("_T")


def short(value: Any, limit: int = SHORT) -> str:
    """``repr(value)`` cut to ``limit`` characters (then ``...``): safe to put in a one-line message.

    ``repr`` escapes newlines and control characters; a huge value is never formatted whole
    (containers are summarised by their type and length first).

    >>> short("a\\nb")
    "'a\\\\nb'"
    >>> short(list(range(10**6)))
    'list of 1000000 items'
    """
    if isinstance(value, (list, tuple, dict, set)) and len(value) > 16:
        return f"{type(value).__name__} of {len(value)} items"
    if isinstance(value, (str, bytes)) and len(value) > 4 * limit:
        value = value[: 4 * limit]  # repr of the prefix only: never the whole string
        text = repr(value)
        return text[:limit] + "..."
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _why_not_label(text: Any) -> str | None:
    if not isinstance(text, str):
        return f"must be text, got a {type(text).__name__}"
    if not text:
        return "is empty"
    if len(text) > MAX_LABEL:
        return f"is longer than {MAX_LABEL} characters"
    if text in (".", ".."):
        return "is '.' or '..'"
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        return "holds a control character"
    if text.startswith(("/", "\\", "~")):
        return "is an absolute path"
    if "/" in text or "\\" in text or os.sep in text or (os.altsep and os.altsep in text):
        return "holds a path separator"
    if re.match(r"^[A-Za-z]:", text):
        return "is a drive"
    if not _LABEL.match(text) or text.endswith("."):
        return "may hold only letters, digits, '_', '-', '(', ')' and '.' (not first or last)"
    return None


def label(text: Any, what: str) -> str:
    """``text`` (a name from a config, recipe, card or Hub file: a stage, a module, a folder) if it is a label;
    else a one-line :class:`~hubsoup.errors.ParameterError` naming ``what``.

    A label is 1 to :data:`MAX_LABEL` letters, digits, ``_``, ``-``, ``(``, ``)`` and ``.`` (a ``.`` neither first
    nor last; lm-eval's task names all fit):
    never ``.`` or ``..``, a path separator, an absolute form, a drive letter, a control character or empty. A
    path is made from it only by :func:`owned_path`, inside a folder hubsoup owns.

    >>> label("stage-1", "stage name")
    'stage-1'
    >>> label("../x", "stage name")
    Traceback (most recent call last):
    ...
    hubsoup.errors.ParameterError: stage name '../x' holds a path separator: a name in a config is a label, never a path
    """
    why = _why_not_label(text)
    if why is not None:
        raise ParameterError(f"{what} {short(text)} {why}: a name in a config is a label, never a path")
    return cast(str, text)  # _why_not_label refuses anything but text


def owned_path(root: str, name: str, *, prefix: str = "", what: str = "name") -> str:
    """The folder (or file) ``root/PREFIX+NAME``: ``name`` checked as a :func:`label` (``what`` names it in the
    refusal), ``prefix`` hubsoup's own constant; the result is always a direct child of ``root`` (absolute).

    >>> owned_path("/srv/run/stages", "first", what="stage name")
    '/srv/run/stages/first'
    >>> owned_path("/srv/run/stages", "..", what="stage name")
    Traceback (most recent call last):
    ...
    hubsoup.errors.ParameterError: stage name '..' is '.' or '..': a name in a config is a label, never a path
    """
    label(name, what)
    root = os.path.abspath(root)
    path = os.path.join(root, prefix + name)
    if os.path.dirname(path) != root:  # cannot happen for a label and a constant prefix; a guard against both
        raise ParameterError(f"{what} {short(name)}: not a name inside its folder")
    return path


class _Counting(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no stubs (types-PyYAML not installed)
    """A safe loader that counts the nodes the document stands for, aliases as the size of their anchor's node."""

    def __init__(self, stream: str, max_nodes: int):
        super().__init__(stream)
        self._max_nodes = max_nodes
        self._sizes: dict[int, int] = {}

    def compose_document(self) -> Any:  # noqa: D102 - yaml's hook: the whole tree, then its size
        node = super().compose_document()
        self._sizes = {}  # nodes are known by id(): a finished document's may be reused by this one's
        self._weigh(node)
        return node

    def _weigh(self, node: Any, depth: int = 0) -> int:
        key = id(node)
        if key in self._sizes:  # an alias (or a repeated anchor): it costs what it repeats, again
            size = self._sizes[key]
        else:
            if depth > 500:
                raise ParameterError("YAML nested too deeply")
            size = 1
            if isinstance(node, yaml.SequenceNode):
                for child in node.value:
                    size += self._weigh(child, depth + 1)
                    self._check(size)
            elif isinstance(node, yaml.MappingNode):
                for k, v in node.value:
                    size += self._weigh(k, depth + 1) + self._weigh(v, depth + 1)
                    self._check(size)
            self._sizes[key] = size
        self._check(size)
        return size

    def _check(self, size: int) -> None:
        if size > self._max_nodes:
            raise _TooBig()


class _CountingAnyTag(_Counting):
    """:class:`_Counting` that reads a node of any unknown tag (``!function x``, ``!!python/...``) as None: the
    data of a file that a tool with its own tags reads, for checks only (nothing is constructed from a tag)."""


_CountingAnyTag.add_constructor(None, lambda loader, node: None)


class _TooBig(Exception):
    pass


def read_json(path: str | None, *, lenient: bool = False) -> Any:
    """The value of the JSON file at ``path``, or None when there is no such file; ``lenient``: None too when it
    cannot be read or is not JSON (a file read only for a hint, such as a config read for its class), else the
    error is raised. The one reader of a JSON file of a folder (an output's reports, a model's configs).

    >>> read_json("/no/such/file.json") is None
    True
    """
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        if lenient:
            return None
        raise


def load_yaml(text: str | bytes, what: str, *, max_bytes: int = MAX_YAML_BYTES, max_nodes: int = MAX_YAML_NODES,
              any_tag: bool = False) -> Any:
    """``yaml.safe_load(text)``, refusing (one line naming ``what``) text over ``max_bytes`` and documents that
    stand for more than ``max_nodes`` nodes (an alias bomb); a syntax error is one line too. ``any_tag``: a node
    of a tag the safe loader does not know (another tool's, e.g. lm-eval's ``!function``) reads as None.

    >>> load_yaml("[1, 2", "recipe")
    Traceback (most recent call last):
    ...
    hubsoup.errors.ParameterError: recipe: not valid YAML (while parsing a flow sequence)
    """
    return _load(text, what, max_bytes, max_nodes, lambda loader: loader.get_single_data(),
                 _CountingAnyTag if any_tag else _Counting)


def load_yaml_all(text: str | bytes, what: str, *, max_bytes: int = MAX_YAML_BYTES,
                  max_nodes: int = MAX_YAML_NODES) -> list[Any]:
    r"""Every document of a YAML stream (``yaml.safe_load_all``), bounded as :func:`load_yaml`: the whole
    text by ``max_bytes``, each document by ``max_nodes``.

    >>> load_yaml_all("a: 1\n---\nb: 2\n", "config")
    [{'a': 1}, {'b': 2}]
    """
    def every(loader: Any) -> list[Any]:
        docs = []
        while loader.check_data():
            docs.append(loader.get_data())
        return docs

    return _load(text, what, max_bytes, max_nodes, every)


def _load(text: str | bytes, what: str, max_bytes: int, max_nodes: int, read: Callable[[Any], _T],
          loader_class: Any = None) -> _T:
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise ParameterError(f"{what}: expected YAML text, got {type(text).__name__}")
    if len(text) > max_bytes:
        raise ParameterError(f"{what}: {len(text)} characters of YAML, more than the {max_bytes} read")
    loader = (loader_class or _Counting)(text, max_nodes)
    try:
        return read(loader)
    except _TooBig:
        raise ParameterError(f"{what}: too many YAML nodes (over {max_nodes}, aliases counted as what they "
                             "repeat); refusing to expand it") from None
    except RecursionError:
        raise ParameterError(f"{what}: YAML nested too deeply") from None
    except yaml.YAMLError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ParameterError(f"{what}: not valid YAML ({first[:120]})") from None
    finally:
        loader.dispose()


__all__ = ["load_yaml", "load_yaml_all", "short", "label", "owned_path", "MAX_YAML_BYTES", "MAX_YAML_NODES",
           "MAX_LABEL"]
