"""Typed method parameters: dataclasses whose fields carry help text and ranges.

A method declares ``Params`` as a dataclass; each field's ``metadata`` may hold
``help`` (one line), ``range`` (inclusive ``(lo, hi)``, either end None) and
``choices``. :func:`parse_params` builds it from CLI strings or Python values and
raises :class:`~hubsoup.errors.ParameterError` naming the parameter at fault.

Every numeric parameter (and every element of a per-input tuple such as ``weights``) may
also be a :class:`Schedule`: a gradient over the layers and/or values chosen by a filter
on the tensor name, with mergekit's exact semantics. The engine resolves schedules once
per tensor (:func:`resolve_params`), so methods only ever see plain numbers.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from typing import Any, Callable, Literal, Mapping, cast, get_args, get_origin

from hubsoup.errors import ParameterError
from hubsoup.methods._schedule import Schedule, has_schedule, is_schedule_value, yaml_value
from hubsoup.untrusted import short


MEASURED = ("measured: best or near-best across hubsoup's quality benchmarks (encoder MiniLM-L6 at 4 and 8 "
            "tasks, decoder LM SmolLM2-135M on 4 domains; full and LoRA fine-tunes), "
            "see benchmarks/results/defaults.md")
"""The evidence of a default chosen from measurements (``source="measured"``)."""

SOURCES = ("paper", "ours", "mergekit", "measured")


def param(default: Any, help: str, *, range: tuple[Any, Any] | None = None, choices: tuple[Any, ...] | None = None,
          source: str | None = None, per_input: bool = False, evidence: str | None = None,
          recorded_when_set: bool = False) -> Any:
    """A method parameter with its default, one-line help, allowed range and provenance.

    ``source``: where the default comes from: ``paper``, ``ours`` (a choice where the paper is
    silent), ``mergekit`` (that tool's convention) or ``measured`` (chosen on hubsoup's quality
    benchmarks; ``evidence`` says which, default :data:`MEASURED`). Not given: ``paper`` for the methods
    of this package (each implements its paper), ``ours`` for a method defined anywhere else (a user's
    parameter is not a paper's).
    ``per_input``: a tuple with one value per input model (checked against the number of inputs).
    ``recorded_when_set``: left out of recipes (and so of their hash) at its default, so that adding
    it changes no earlier recipe.
    """
    if source is not None and source not in SOURCES:
        raise ValueError(f"param source must be one of {', '.join(SOURCES)}, got {short(source)}")
    md: dict[str, Any] = {"help": help, "range": range, "choices": choices, "source": source}  # None: see default_source
    if source == "measured":
        md["evidence"] = evidence or MEASURED
    if per_input:
        md["per_input"] = True
    if recorded_when_set:
        md["recorded_when_set"] = True
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
        raise last or ParameterError(f"parameter '{name}': cannot parse {short(value)}")
    if origin is Literal:
        if value not in args:
            raise ParameterError(f"parameter '{name}': {short(value)} is not one of {', '.join(map(str, args))}")
        return value
    if origin in (tuple, list):
        inner = args[0] if args else float
        if isinstance(value, str) and value.strip().startswith(("[", "{")):
            value = yaml_value(name, value)
        if isinstance(value, str):
            value = [v for v in value.replace(";", ",").split(",") if v.strip()]
        if isinstance(value, dict) or not isinstance(value, (list, tuple)):
            value = [value]
        # per-input values: each one a number or (numeric inner types) a schedule of its own
        return tuple(Schedule.parse(v, name=name, integer=inner is int)
                     if inner in (int, float) and isinstance(v, (list, tuple, dict)) else _convert(name, inner, v)
                     for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise ParameterError(f"parameter '{name}': expected true/false, got {short(value)}")
    if tp in (int, float):
        if isinstance(value, Schedule):
            return value
        if is_schedule_value(value):
            return Schedule.parse(value, name=name, integer=tp is int)
        if isinstance(value, bool):
            raise ParameterError(f"parameter '{name}': expected a number, got {short(value)}")
        if isinstance(value, str):
            value = value.strip()
        try:
            v = tp(value) if not (tp is int and isinstance(value, str) and "." in value) else int(float(value))
        except OverflowError:  # int(inf), int("1e999.")
            raise ParameterError(f"parameter '{name}': expected a finite number, got {short(value)}") from None
        except (TypeError, ValueError):
            raise ParameterError(f"parameter '{name}': expected {tp.__name__}, got {short(value)}") from None
        if tp is float and not math.isfinite(v):  # NaN/inf pass every range check and poison the merge
            raise ParameterError(f"parameter '{name}': expected a finite number, got {short(value)}")
        if tp is int and isinstance(value, float) and not float(value).is_integer():
            raise ParameterError(f"parameter '{name}': expected an integer, got {short(value)}")
        return v
    if tp is str:
        return str(value)
    return value


def _check_range(name: str, value: Any, md: Mapping[str, Any]) -> None:
    rng = md.get("range")
    values = value if isinstance(value, tuple) else (value,)
    # a schedule's anchors bound every value it interpolates
    values = tuple(x for v in values for x in (v.numbers() if isinstance(v, Schedule) else (v,)))
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
    if choices and not isinstance(value, Schedule) and value not in choices:
        raise ParameterError(f"parameter '{name}': {short(value)} is not one of {', '.join(map(str, choices))}")


def parse_params(cls: type, given: dict[str, Any], *, method: str = "") -> Any:
    """Build the parameter dataclass ``cls`` from ``given`` (strings or values)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        known = ", ".join(fields) or "none"
        close = difflib.get_close_matches(unknown[0], list(fields), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ParameterError(f"method '{method}' has no parameter '{unknown[0]}' ({hint}its parameters: {known})")
    values = {}
    for name, value in given.items():
        v = _convert(name, hints[name], value)
        _check_range(name, v, fields[name].metadata)
        values[name] = v
    obj = cls(**values)
    for f in dataclasses.fields(cls):  # defaults are checked too (they may depend on each other)
        _check_range(f.name, getattr(obj, f.name), f.metadata)
    if hasattr(obj, "validate"):
        # with schedules, validate() runs on the resolved values, per tensor (resolve_params); here it
        # checks what it can: each value a schedule can take at its anchors, tensor by tensor later
        if has_schedule(obj):
            _validate_corners(obj)
        else:
            obj.validate()
    return obj


def _validate_corners(obj: Any) -> None:
    """validate() on the schedules' anchor values where a field has one schedule only (a cheap early check)."""
    try:  # rules about schedules themselves (e.g. TIES: no density schedule with one model-wide threshold)
        obj.validate()
    except TypeError:  # arithmetic on a schedule: checked on the resolved values, per tensor
        pass
    scheds = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)
              if isinstance(getattr(obj, f.name), Schedule)]
    if len(scheds) != 1:
        return
    name, s = scheds[0]
    for v in s.numbers():
        dataclasses.replace(obj, **{name: int(v) if s.integer else v}).validate()


def to_dict(params: Any) -> dict[str, Any]:
    """Plain values (tuples as lists) for recipes and cards."""
    out = {}
    for f in dataclasses.fields(params):
        v = getattr(params, f.name)
        if f.metadata.get("recorded_when_set") and v == f.default:
            continue
        if isinstance(v, tuple):
            v = [x.to_plain() if isinstance(x, Schedule) else x for x in v]
        out[f.name] = v.to_plain() if isinstance(v, Schedule) else v
    return out


def _kind(tp: Any) -> tuple[str, bool, list[Any] | None]:
    """(machine type, may be None, choices) of a parameter's annotation: ``float``, ``int``, ``bool``,
    ``str``, ``choice`` (a ``Literal``), ``floats``/``ints``/``strs`` (tuples), else ``json``."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        rest = [a for a in args if a is not type(None)]
        kind, _, choices = _kind(rest[0]) if len(rest) == 1 else ("json", False, None)
        return kind, type(None) in args, choices
    if origin is Literal:
        return "choice", False, list(args)
    if origin in (tuple, list):
        inner = args[0] if args else float
        return {float: "floats", int: "ints", str: "strs"}.get(inner, "json"), False, None
    return {float: "float", int: "int", bool: "bool", str: "str"}.get(tp, "json"), False, None


def _plain(v: Any) -> Any:
    """JSON-serialisable: tuples as lists, anything else unknown as its string."""
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


def default_source(cls: type) -> str:
    """The provenance of a parameter declared without one: ``paper`` in this package's methods, else ``ours``."""
    return "paper" if cls.__module__.startswith("hubsoup.") else "ours"


def describe(cls: type) -> list[dict[str, Any]]:
    """Each parameter of ``cls`` as plain (JSON-serialisable) data, for ``hubsoup methods``, cards and apps.

    ``{"name", "type", "nullable", "default", "range", "choices", "help", "source"}``: ``type`` is one of
    ``float``, ``int``, ``bool``, ``str``, ``choice`` (``choices`` lists the values), ``floats``, ``ints``,
    ``strs`` (a list; a comma-separated string is accepted too) or ``json``; ``nullable``: None is allowed
    (``range`` and ``choices`` are None when there are none); ``source``: the provenance declared with
    :func:`param`: ``paper``, ``ours`` (a choice where the paper is silent), ``measured`` (chosen on
    hubsoup's quality benchmarks; ``evidence`` names them, None otherwise), or another tool's convention.

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class P:
    ...     k: Literal["a", "b"] = param("a", "which")
    ...     w: tuple[float, ...] | None = param(None, "weights", range=(0.0, None), source="ours")
    >>> [(r["name"], r["type"], r["nullable"], r["choices"], r["range"]) for r in describe(P)]
    [('k', 'choice', False, ['a', 'b'], None), ('w', 'floats', True, None, [0.0, None])]
    """
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else cast(Callable[[], Any], f.default_factory)()
        kind, nullable, choices = _kind(hints[f.name])
        md = f.metadata
        if md.get("choices"):
            kind, choices = "choice", list(md["choices"])
        rows.append({"name": f.name, "type": kind, "nullable": nullable or default is None,
                     "default": _plain(default), "range": _plain(md.get("range")), "choices": _plain(choices),
                     "help": md.get("help", ""), "source": md.get("source") or default_source(cls),
                     "evidence": md.get("evidence")})
    return rows
