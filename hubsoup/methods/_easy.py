"""A method as one decorated function: its signature declares its parameters (mergekit's ``easy_define``).

:func:`method` turns ``def f(deltas, base, *, alpha: float = 0.5) -> Tensor`` into a :class:`Method` subclass
whose ``Params`` dataclass is built from the keyword parameters (names, annotations, defaults; a default
written with :func:`param` keeps its help, range and choices) and registers it with :func:`register`: the one
registry, so ``hubsoup methods``, parameter checks, schedules, recipes, cards, LiNeS wrapping and the contract
tests treat it as any other method. A method that needs statistics passes, ``prepare`` or a low-rank path
is still a :class:`Method` class.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import re
import typing
from typing import Any, Callable, TypeVar

import torch

from hubsoup.errors import MethodError
from hubsoup.methods._base import Method, TensorContext, register
from hubsoup.methods._params import param

F = TypeVar("F", bound=Callable[..., torch.Tensor])

ENGINE_ARGS = ("deltas", "base", "ctx")
"""The parameters the engine fills: the task vectors, the base tensor, the :class:`TensorContext`."""

ATTRIBUTES = ("paper", "paper_url", "min_inputs", "max_inputs", "zero_preserving", "search_grid", "scale_param",
              "elementwise", "workspace_copies")
"""The :class:`Method` class attributes :func:`method` accepts as keywords."""

METHOD_ATTRIBUTE = "__hubsoup_method__"
"""The attribute of a decorated function holding its :class:`Method` class."""


def method(name: str, *, summary: str | None = None, **attributes: Any) -> Callable[[F], F]:
    """Register the decorated function as the merge method ``name``; the function is returned unchanged.

    The function gets ``deltas`` (required: the inputs' float32 task vectors, the ``(N, *shape)`` stack
    when annotated ``Tensor``, which it may overwrite, or a list of the N tensors when annotated
    ``list[Tensor]``), optionally ``base`` (the base tensor) and ``ctx`` (the :class:`TensorContext`), and
    its keyword-only parameters, each with a type annotation and a default (a plain value or
    :func:`param`); it returns the merged task vector (float32, the base's shape). ``summary``: default the
    docstring's first line; a parameter's help: its line under ``Args:`` in the docstring. Other keywords
    set the class attributes of :data:`ATTRIBUTES` (``scale_param`` defaults to ``"scale"`` when there is
    a parameter of that name).

    Example:
        >>> import torch
        >>> from hubsoup.methods import method
        >>> from hubsoup.testing import merge_tensors
        >>> @method("doc_mean", elementwise=True)
        ... def doc_mean(deltas: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        ...     '''The mean task vector, scaled.
        ...
        ...     Args:
        ...         scale: λ, the merged task vector's scale
        ...     '''
        ...     return deltas.mean(dim=0).mul_(scale)
        >>> merge_tensors("doc_mean", torch.tensor([[1.0, 2.0], [3.0, 4.0]]), scale=0.5).tolist()
        [1.0, 1.5]
    """
    unknown = sorted(set(attributes) - set(ATTRIBUTES))
    if unknown:
        raise MethodError(f"method '{name}': unknown keyword '{unknown[0]}' (it takes: summary, {', '.join(ATTRIBUTES)})")

    def decorate(func: F) -> F:
        cls = register(_method_class(func, name, summary, attributes))
        setattr(func, METHOD_ATTRIBUTE, cls)  # the entry point may name the function: load_plugins finds the class
        return func

    return decorate


def _method_class(func: Callable[..., torch.Tensor], name: str, summary: str | None,
                  attributes: dict[str, Any]) -> type[Method[Any]]:
    where = f"method '{name}' ({func.__module__}.{func.__qualname__})"
    sig = inspect.signature(func)
    hints = typing.get_type_hints(func)
    engine = [p.name for p in sig.parameters.values() if p.name in ENGINE_ARGS]
    if "deltas" not in engine:
        raise MethodError(f"{where}: the function must take the task vectors as its parameter 'deltas'")
    for p in sig.parameters.values():
        if p.name in ENGINE_ARGS and p.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise MethodError(f"{where}: parameter '{p.name}' must not be positional-only")
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise MethodError(f"{where}: *{p.name} / **{p.name} cannot be declared as parameters; name each one")
    as_list = typing.get_origin(hints.get("deltas")) in (list, collections.abc.Sequence)
    helps = _arg_help(func.__doc__ or "")
    Params = dataclasses.make_dataclass(  # noqa: N806 - the class attribute's name
        f"{_camel(name)}Params", [_field(where, p, hints, helps) for p in sig.parameters.values()
                                  if p.name not in ENGINE_ARGS])
    Params.__module__ = func.__module__  # parameter provenance (`ours` outside hubsoup) and error messages
    names = [f.name for f in dataclasses.fields(Params)]
    doc = (summary or inspect.getdoc(func) or "").strip().splitlines()
    if not doc:
        raise MethodError(f"{where}: give a summary= or a docstring")
    attrs = {"scale_param": "scale" if "scale" in names else None, **attributes}

    def merge(self: Method[Any], base: torch.Tensor, deltas: torch.Tensor, params: Any,
              ctx: TensorContext) -> torch.Tensor:
        kwargs = {n: getattr(params, n) for n in names}
        given = {"deltas": list(deltas.unbind(0)) if as_list else deltas, "base": base, "ctx": ctx}
        return func(**{k: given[k] for k in engine}, **kwargs)

    cls = type(_camel(name), (Method,), {"name": name, "summary": doc[0], "Params": Params, "merge": merge,
                                         "__module__": func.__module__, "__qualname__": func.__qualname__,
                                         "__doc__": func.__doc__, **attrs})
    return cls


def _field(where: str, p: inspect.Parameter, hints: dict[str, Any],
           helps: dict[str, str]) -> tuple[str, Any, dataclasses.Field[Any]]:
    if p.name not in hints:
        raise MethodError(f"{where}: parameter '{p.name}' needs a type annotation (float, int, bool, str, "
                          f"Literal[...], tuple[float, ...], ...)")
    if p.default is inspect.Parameter.empty:
        raise MethodError(f"{where}: parameter '{p.name}' needs a default")
    default = p.default
    if not isinstance(default, dataclasses.Field):
        default = param(default, helps.get(p.name, ""))
    elif not default.metadata.get("help") and p.name in helps:
        default.metadata = type(default.metadata)({**default.metadata, "help": helps[p.name]})
    return p.name, hints[p.name], default


def _arg_help(doc: str) -> dict[str, str]:
    """``name: text`` lines under a docstring's ``Args:`` heading (Google style), by name."""
    out: dict[str, str] = {}
    section = False
    for line in inspect.cleandoc(doc).splitlines():
        if re.fullmatch(r"\s*(Args|Arguments|Parameters):\s*", line):
            section = True
            continue
        if section and line and not line[0].isspace():
            section = False
        m = re.match(r"\s+(\w+)\s*(?:\([^)]*\))?:\s*(.+)", line) if section else None
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in re.split(r"[^0-9A-Za-z]+", name) if part) or "Method"
