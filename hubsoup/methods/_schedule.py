"""Per-layer schedules and name filters for method parameters, with mergekit's semantics.

Every numeric parameter of every method (and every element of a per-input tuple such as
``weights``) may be a :class:`Schedule` instead of a number: a **gradient** over the
layers, values chosen by **filters** on the tensor name, or both. The engine resolves a
method's parameters once per tensor (:func:`resolve_params`, called in
``hubsoup.engine.lowrank.decide``), so methods only ever see plain numbers; the recipe
stores the schedule in mergekit's YAML shape (:meth:`Schedule.to_plain`), so the recipe
hash is stable and a recipe re-parses to the same schedule.

Semantics (``mergekit/config.py: evaluate_setting``, ``plan.py: plan_slice``):

* gradient ``[v0, ..., vn]`` at layer position ``t``: ``s = t·n``, ``i0 = int(s)``,
  ``i1 = min(n, i0 + 1)``, ``(1 − f)·v[i0] + f·v[i1]`` with ``f = s − i0``;
* filters ``[{filter: F, value: V}, ..., {value: D}]``: the first entry whose filter is
  missing, ``"*"`` or a substring of the tensor name wins; none → the parameter's default;
* ``t`` (:func:`layer_position`): block i of a stack of L blocks → i/(L − 1) (1.0 when
  L = 1); tensors outside the blocks (embeddings, final norm, head) → 0.

CLI syntax (``--param``): ``t=0.5``; ``t=0,0.5,1`` or ``t=[0,0.5,1]`` (gradient);
``t=[0,0.5,1]@self_attn;[1,0.5,0]@mlp;0.5`` (``VALUE@FILTER`` entries joined by ``;``, an
entry without ``@`` matches everything); or any YAML flow value starting with ``[``/``{``,
e.g. ``weights=[[0,1],{filter: mlp, value: 0.3}]`` (a per-input tuple of schedules).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, cast

from hubsoup.errors import ParameterError
from hubsoup.untrusted import load_yaml, short


CLI_HELP = """\
Schedules: every numeric parameter (and each value of a per-input list such as weights) may vary
by layer and by tensor name, with mergekit's semantics:
  --param t=0,0.5,1                      gradient over the layers (block i of L at t = i/(L-1);
                                         embeddings, final norm, head at t = 0)
  --param 't=[0,0.5,1]@self_attn;[1,0.5,0]@mlp;0.5'
                                         VALUE@FILTER entries, first filter contained in the tensor
                                         name wins; an entry without @ matches every tensor
  --param 'weights=[[0,1],{filter: mlp, value: 0.3}]'
                                         any YAML flow value (mergekit's config shapes)
[mergekit] marks an option that selects mergekit's convention or comes from mergekit."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A numeric parameter that depends on the tensor: gradients over layers and name filters.

    Example:
        >>> s = Schedule.parse([0.0, 0.5, 1.0])
        >>> s.value("model.layers.3.mlp.up_proj.weight", 0.25)
        0.25
        >>> Schedule.parse([{"filter": "mlp", "value": 0.3}, {"value": 0.7}]).value("x.self_attn.q", 0.0)
        0.7
        >>> Schedule.parse("[0,1]@self_attn;0.5").to_plain()
        [{'filter': 'self_attn', 'value': [0.0, 1.0]}, {'value': 0.5}]
    """

    entries: tuple[tuple[str | None, tuple[float, ...]], ...]
    """(filter, anchors) in order: one anchor is a constant; filter None matches every tensor."""
    integer: bool = False

    @classmethod
    def parse(cls, raw: Any, *, name: str = "", integer: bool = False) -> "Schedule":
        """From mergekit's YAML shapes (a list of numbers; ``{filter, value}`` dicts) or the CLI syntax."""
        if isinstance(raw, str):
            raw = _parse_text(name, raw)
        if isinstance(raw, dict):
            raw = [raw]
        if not isinstance(raw, (list, tuple)) or not raw:
            raise ParameterError(f"parameter '{name}': expected a number, a gradient list or filter entries, "
                                 f"got {short(raw)}")
        if all(not isinstance(e, dict) for e in raw):
            return cls(((None, _anchors(name, raw)),), integer)
        entries = []
        for e in raw:
            if not isinstance(e, dict) or "value" not in e or set(e) - {"filter", "value"}:
                raise ParameterError(f"parameter '{name}': a filter entry is {{filter: NAME, value: V}}, got {short(e)}")
            f = e.get("filter")
            if f is not None and not isinstance(f, str):
                raise ParameterError(f"parameter '{name}': filter {short(f)} is not a string")
            v = e["value"]
            if isinstance(v, str) and v.strip().startswith("["):
                v = yaml_value(name, v)
            entries.append((f, _anchors(name, v if isinstance(v, (list, tuple)) else [v])))
        return cls(tuple(entries), integer)

    def value(self, tensor: str, t: float) -> float | None:
        """The value for the tensor named ``tensor`` at layer position ``t``; None when no filter matches."""
        for f, anchors in self.entries:
            if f is None or f == "*" or (tensor and f in tensor):
                return _interpolate(anchors, t, self.integer)
        return None

    def numbers(self) -> list[float]:
        """Every anchor (the interpolated values lie between them): for range checks."""
        return [v for _, a in self.entries for v in a]

    def to_plain(self) -> Any:
        """mergekit's YAML shape: a list of numbers, or a list of ``{filter, value}`` entries."""
        if len(self.entries) == 1 and self.entries[0][0] is None:
            return list(self.entries[0][1])
        out = []
        for f, a in self.entries:
            e: dict[str, Any] = {} if f is None else {"filter": f}
            e["value"] = a[0] if len(a) == 1 else list(a)
            out.append(e)
        return out


def _interpolate(anchors: tuple[float, ...], t: float, integer: bool) -> float:
    n = len(anchors) - 1
    scaled = t * n
    i0 = int(scaled)
    i1 = min(n, i0 + 1)
    frac = scaled - i0
    v = (1 - frac) * anchors[i0] + frac * anchors[i1]
    return int(v) if integer else v


def _anchors(name: str, values: Any) -> tuple[float, ...]:
    out = []
    for v in values:
        if isinstance(v, (bool, dict, list, tuple)):
            raise ParameterError(f"parameter '{name}': gradient anchors must be numbers, got {short(v)}")
        try:
            x = float(v.strip() if isinstance(v, str) else v)
        except (TypeError, ValueError):
            raise ParameterError(f"parameter '{name}': gradient anchor {short(v)} is not a number") from None
        if not math.isfinite(x):
            raise ParameterError(f"parameter '{name}': expected finite numbers, got {short(v)}")
        out.append(x)
    if not out:
        raise ParameterError(f"parameter '{name}': an empty gradient")
    return tuple(out)


def yaml_value(name: str, text: str) -> Any:
    """A YAML flow value (``[0, 1]``, ``{filter: mlp, value: 0.3}``) read safely."""
    return load_yaml(text, f"parameter '{name}'", max_bytes=64 * 1024)


def _parse_text(name: str, text: str) -> Any:
    text = text.strip()
    if text.startswith(("[", "{")) and "@" not in text and ";" not in text:
        return yaml_value(name, text)
    entries = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        value, _, filt = part.partition("@")
        e: dict[str, Any] = {"value": [v for v in value.strip().strip("[]").split(",") if v.strip()]}
        if filt.strip():
            e["filter"] = filt.strip()
        entries.append(e)
    if len(entries) == 1 and "filter" not in entries[0]:
        return entries[0]["value"]
    return entries


def is_schedule_value(value: Any) -> bool:
    """Whether a value given for a scalar numeric parameter is a schedule (a list, a dict, or CLI syntax)."""
    if isinstance(value, (list, tuple, dict)):
        return True
    if isinstance(value, str):
        v = value.strip()
        return v.startswith(("[", "{")) or any(c in v for c in ",;@")
    return False


def layer_position(block: Any) -> float:
    """mergekit's ``t`` of a tensor: i/(L−1) for block i of L (1.0 when L = 1), 0 outside the blocks.

    Example:
        >>> from hubsoup.plan import BlockInfo
        >>> layer_position(BlockInfo("layers", 2, 5)), layer_position(None), layer_position(BlockInfo("layers", 0, 1))
        (0.5, 0.0, 1.0)
    """
    if block is None:
        return 0.0
    return block.index / (block.num_layers - 1) if block.num_layers > 1 else 1.0


def has_schedule(params: Any) -> bool:
    """Whether any field of ``params`` (nested parameter dataclasses included) is a :class:`Schedule`."""
    if not dataclasses.is_dataclass(params) or isinstance(params, type):
        return False
    for f in dataclasses.fields(params):
        v = getattr(params, f.name)
        if isinstance(v, Schedule) or (isinstance(v, tuple) and any(isinstance(x, Schedule) for x in v)):
            return True
        if has_schedule(v):
            return True
    return False


def resolve_params(params: Any, tensor: str, t: float) -> Any:
    """``params`` with every :class:`Schedule` replaced by its value for ``tensor`` at position ``t``.

    Returns ``params`` itself when it holds no schedule. A schedule whose filters do not
    match gives the field's default (in a per-input tuple: 1.0 when the default is None).
    The result is validated again (the dataclass's ``validate()``), naming the tensor.

    Example:
        >>> from hubsoup.methods import get_method
        >>> p = get_method("slerp").parse({"t": [0, 1]})
        >>> resolve_params(p, "model.layers.1.mlp.weight", 0.5).t
        0.5
    """
    if not has_schedule(params):
        return params
    changes = {}
    for f in dataclasses.fields(params):
        v = getattr(params, f.name)
        if isinstance(v, Schedule):
            r = v.value(tensor, t)
            changes[f.name] = _default(f) if r is None else r
        elif isinstance(v, tuple) and any(isinstance(x, Schedule) for x in v):
            fallback = _default(f)
            out = []
            for i, x in enumerate(v):
                r = x.value(tensor, t) if isinstance(x, Schedule) else x
                if r is None:
                    r = fallback[i] if isinstance(fallback, tuple) and i < len(fallback) else 1.0
                out.append(r)
            changes[f.name] = tuple(out)
        elif has_schedule(v):
            changes[f.name] = resolve_params(v, tensor, t)
    out = dataclasses.replace(params, **changes)
    if hasattr(out, "validate"):
        try:
            out.validate()
        except ParameterError as e:
            raise ParameterError(f"tensor '{tensor}': {e}") from None
    return out


def _default(f: dataclasses.Field[Any]) -> Any:
    return f.default if f.default is not dataclasses.MISSING else cast(Callable[[], Any], f.default_factory)()
