"""Modifiers: methods that wrap another (inner) method.

A modifier (LiNeS depth scaling, LwPTV layer masks) names its inner method with the
``base_method`` parameter. The value may be a chain joined by ``+``: for
``lwptv`` with ``base_method=lines+ties`` the inner method is ``lines`` whose own
inner method is ``ties``. The user's parameters are one flat dict: each modifier
keeps the keys its ``Params`` declares and hands every other key down the chain,
so ``eta`` goes to ``lwptv``, ``beta`` to ``lines`` and ``density`` to ``ties``.
A key nobody declares is an error naming every method of the chain.

The parsed parameters are a :class:`Composed`: the modifier's own dataclass plus
the inner method and its parsed parameters. The recipe stores them nested:
``{"base_method": "ties", "alpha": ..., "base_params": {...}}``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, cast

from hubsoup.errors import ParameterError
from hubsoup.methods import Method, StatsPass, TensorContext, get_method
from hubsoup.methods import parse_params, to_dict

if TYPE_CHECKING:
    import torch

    from hubsoup.methods import PrepareContext

O = TypeVar("O")
"""A modifier's own parameter dataclass: ``class Lines(Modifier[LinesParams])`` types ``params.own``."""


@dataclass
class Composed(Generic[O]):
    """Parsed parameters of a modifier: its own, and the inner method with its own."""

    own: O
    inner: Method[Any]
    inner_params: Any


class Modifier(Method[Composed[O]]):
    """A method wrapping ``base_method``; subclasses declare ``base_method`` in ``Params``."""

    #: The modifier applies its own global scale (LiNeS' depth factors): the base method's declared
    #: :attr:`~hubsoup.methods.Method.scale_param` is set to 1 unless the user gives it, so the merged
    #: task vector is not scaled twice.
    replaces_scale: ClassVar[bool] = False

    def leaf_defaults(self, leaf: Method[Any]) -> dict[str, Any]:
        """The parameters this modifier sets on ``leaf``, the base method at the end of its chain."""
        if self.replaces_scale and leaf.scale_param is not None:
            return {leaf.scale_param: 1.0}
        return {}

    def parse(self, given: dict[str, Any]) -> Composed[O]:
        if isinstance(given.get("base_params"), dict):  # the nested form a recipe stores
            given = given_from_description(given)
        own_names = _fields(self)
        own = {k: v for k, v in given.items() if k in own_names}
        rest = {k: v for k, v in given.items() if k not in own_names}
        p = parse_params(self.Params, own, method=self.name)
        chain = [n.strip() for n in str(p.base_method).split("+")]
        if not all(chain):
            raise ParameterError(f"method '{self.name}': base_method={p.base_method!r} names an empty method")
        if self.name in chain:
            raise ParameterError(f"method '{self.name}' cannot wrap itself (base_method={p.base_method!r})")
        methods = [get_method(n) for n in chain]
        for outer in methods[:-1]:
            if not isinstance(outer, Modifier):
                raise ParameterError(f"method '{self.name}': base_method={p.base_method!r} chains past "
                                     f"'{outer.name}', which wraps no method")
        declared = set().union(own_names, *(_fields(m) for m in methods))
        unknown = sorted(set(rest) - declared)
        if unknown:
            names = ", ".join(f"'{n}'" for n in [self.name, *chain])
            raise ParameterError(f"parameter '{unknown[0]}' belongs to none of {names} "
                                 "(`hubsoup methods NAME` lists each one's parameters)")
        # the modifiers' defaults for the base method at the end of the chain (the user's values win)
        leaf = methods[-1]
        for mod in [self, *cast("list[Modifier[Any]]", methods[:-1])]:  # each checked above
            for k, v in mod.leaf_defaults(leaf).items():
                if k in _fields(leaf) and k not in rest:
                    rest[k] = v
        if len(chain) > 1:
            rest["base_method"] = "+".join(chain[1:])
        return Composed(p, methods[0], methods[0].parse(rest))

    def describe_params(self, params: Composed[O]) -> dict[str, Any]:
        return {**to_dict(params.own), "base_params": params.inner.describe_params(params.inner_params)}

    def check_inputs(self, params: Composed[O], n_inputs: int) -> None:
        super().check_inputs(cast(Any, params.own), n_inputs)  # the input counts and the own per-input fields
        params.inner.check_inputs(params.inner_params, n_inputs)

    def prepare(self, params: Composed[O], ctx: PrepareContext) -> dict[str, Any]:
        return params.inner.prepare(params.inner_params, ctx)  # e.g. LiNeS over LOT: LOT's exemplar features

    def finish(self, params: Composed[O], stats: dict[str, Any]) -> None:
        params.inner.finish(params.inner_params, stats)

    def workspace_bytes(self, shape: tuple[int, ...], n_inputs: int, params: Composed[O], name: str = "") -> int:
        """The inner method's workspace (TIES' selection, SFTM's SVDs...) plus this modifier's own."""
        return params.inner.workspace_bytes(shape, n_inputs, params.inner_params, name) + \
            self.own_workspace_bytes(shape, n_inputs, params, name)

    def own_workspace_bytes(self, shape: tuple[int, ...], n_inputs: int, params: Composed[O], name: str = "") -> int:
        """What the modifier itself needs for one tensor beyond the inner merge (default none)."""
        return 0

    def inner_passes(self, params: Composed[O], n_inputs: int) -> list[StatsPass]:
        return params.inner.passes(params.inner_params, n_inputs)

    def tensor_passes(self, params: Composed[O], n_inputs: int) -> list[StatsPass] | None:
        """None: a modifier's merge is element-wise only where it says so (see LiNeS, LwPTV)."""
        return None

    def inner_tensor_passes(self, params: Composed[O], n_inputs: int) -> list[StatsPass] | None:
        return params.inner.tensor_passes(params.inner_params, n_inputs)

    def piece_multiple(self, params: Composed[O]) -> int:
        return params.inner.piece_multiple(params.inner_params)

    def inner_merge(self, base: torch.Tensor, deltas: torch.Tensor, params: Composed[O],
                    ctx: TensorContext) -> torch.Tensor:
        return params.inner.merge(base, deltas, params.inner_params, ctx)

    def card_notes(self, described: dict[str, Any], stats: dict[str, Any], n_inputs: int) -> list[str]:
        """Model-card notes (markdown paragraphs): the inner method's, if it has any."""
        inner = get_method(str(described["base_method"]).split("+")[0].strip())
        return inner.card_notes(described.get("base_params") or {}, stats, n_inputs)


def given_from_description(described: dict[str, Any]) -> dict[str, Any]:
    """The flat parameter dict that :meth:`Modifier.parse` turns back into ``described``'s params."""
    out = {k: v for k, v in described.items() if k != "base_params"}
    inner = dict(described.get("base_params") or {})
    if "base_params" in inner:  # a modifier below: the chain string at the top already names it
        inner = given_from_description(inner)
        inner.pop("base_method", None)
    return {**inner, **out}


def _fields(method: Method[Any]) -> set[str]:
    return {f.name for f in dataclasses.fields(method.Params)}
