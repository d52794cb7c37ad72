"""Typed method parameters: dataclasses whose fields carry help text and ranges.

A method declares ``Params`` as a dataclass; each field's ``metadata`` may hold
``help`` (one line), ``range`` (inclusive ``(lo, hi)``, either end None) and
``choices``. :func:`parse_params` builds it from CLI strings or Python values and
raises :class:`~hubsoup.errors.ParameterError` naming the parameter at fault.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Literal, get_args, get_origin

from hubsoup.errors import ParameterError


def param(default: Any, help: str, *, range: tuple | None = None, choices: tuple | None = None,
          source: str = "paper") -> Any:
    """A method parameter with its default, one-line help, allowed range and provenance."""
    md = {"help": help, "range": range, "choices": choices, "source": source}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: default, metadata=md)
    return dataclasses.field(default=default, metadata=md)


def _convert(name: str, tp: Any, value: Any) -> Any:
    origin = get_origin(tp)
    args = get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            if type(None) in args:
                return None
        last: Exception | None = None
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(name, a, value)
            except ParameterError as e:
                last = e
        raise last or ParameterError(f"parameter '{name}': cannot parse {value!r}")
    if origin is Literal:
        if value not in args:
            raise ParameterError(f"parameter '{name}': {value!r} is not one of {', '.join(map(str, args))}")
        return value
    if origin in (tuple, list):
        inner = args[0] if args else float
        if isinstance(value, str):
            value = [v for v in value.replace(";", ",").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            value = [value]
        return tuple(_convert(name, inner, v) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise ParameterError(f"parameter '{name}': expected true/false, got {value!r}")
    if tp in (int, float):
        if isinstance(value, bool):
            raise ParameterError(f"parameter '{name}': expected a number, got {value!r}")
        if isinstance(value, str):
            value = value.strip()
        try:
            v = tp(value) if not (tp is int and isinstance(value, str) and "." in value) else int(float(value))
        except OverflowError:  # int(inf), int("1e999.")
            raise ParameterError(f"parameter '{name}': expected a finite number, got {value!r}") from None
        except (TypeError, ValueError):
            raise ParameterError(f"parameter '{name}': expected {tp.__name__}, got {value!r}") from None
        if tp is float and not math.isfinite(v):  # NaN/inf pass every range check and poison the merge
            raise ParameterError(f"parameter '{name}': expected a finite number, got {value!r}")
        if tp is int and isinstance(value, float) and not float(value).is_integer():
            raise ParameterError(f"parameter '{name}': expected an integer, got {value!r}")
        return v
    if tp is str:
        return str(value)
    return value


def _check_range(name: str, value: Any, md: dict) -> None:
    rng = md.get("range")
    values = value if isinstance(value, tuple) else (value,)
    for v in values:  # defaults and validate()'d values too; an unbounded range is still finite
        if isinstance(v, float) and not math.isfinite(v):
            raise ParameterError(f"parameter '{name}': expected a finite number, got {v}")
    if rng and value is not None:
        lo, hi = rng
        for v in values:
            if (lo is not None and v < lo) or (hi is not None and v > hi):
                bounds = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
                raise ParameterError(f"parameter '{name}' = {v} is out of range {bounds}")
    choices = md.get("choices")
    if choices and value not in choices:
        raise ParameterError(f"parameter '{name}': {value!r} is not one of {', '.join(map(str, choices))}")


def parse_params(cls: type, given: dict[str, Any], *, method: str = "") -> Any:
    """Build the parameter dataclass ``cls`` from ``given`` (strings or values)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        known = ", ".join(fields) or "none"
        raise ParameterError(f"method '{method}' has no parameter '{unknown[0]}' (its parameters: {known})")
    values = {}
    for name, value in given.items():
        v = _convert(name, hints[name], value)
        _check_range(name, v, fields[name].metadata)
        values[name] = v
    obj = cls(**values)
    for f in dataclasses.fields(cls):  # defaults are checked too (they may depend on each other)
        _check_range(f.name, getattr(obj, f.name), f.metadata)
    if hasattr(obj, "validate"):
        obj.validate()
    return obj


def to_dict(params: Any) -> dict[str, Any]:
    """Plain values (tuples as lists) for recipes and cards."""
    out = {}
    for f in dataclasses.fields(params):
        v = getattr(params, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def describe(cls: type) -> list[dict[str, Any]]:
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        tp = hints[f.name]
        rows.append({"name": f.name, "type": getattr(tp, "__name__", str(tp).replace("typing.", "")),
                     "default": default, **{k: v for k, v in f.metadata.items() if v is not None}})
    return rows
