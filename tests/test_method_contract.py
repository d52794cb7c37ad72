"""The contract every registered method keeps: the registry, the declared class attributes, the hooks."""

import dataclasses
import json
import typing

import pytest
import torch

from hubsoup.errors import MethodError
from hubsoup.methods import Method, available, get_method, param, register
from hubsoup.methods._compose import Modifier
from hubsoup.methods.task_arithmetic import TaskArithmetic
from hubsoup.testing import merge_tensors

METHODS = sorted(available())


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls.Params)}


# --- the registry ------------------------------------------------------------------------------

@dataclasses.dataclass
class _ImpostorParams:
    scale: float = param(1.0, "a scale")


def test_register_refuses_a_taken_name():
    class Impostor(Method):  # another module and qualname than the registered 'ties'
        name = "ties"
        summary = "not TIES"
        Params = _ImpostorParams

        def merge(self, base, deltas, params, ctx):
            return deltas.sum(dim=0)

    with pytest.raises(MethodError, match="'ties' is taken by hubsoup.methods.ties.Ties"):
        register(Impostor)
    assert type(get_method("ties")).__module__ == "hubsoup.methods.ties"  # the registry is unchanged


def test_register_accepts_the_same_class_again():
    cls = available()["ties"]
    assert register(cls) is cls  # e.g. a module imported twice
    assert available()["ties"] is cls


# --- declared class attributes -----------------------------------------------------------------

@pytest.mark.parametrize("name", METHODS)
def test_search_grid_keys_are_declared_parameters_and_parse(name):
    cls = available()[name]
    m = get_method(name)
    assert set(cls.search_grid) <= _fields(cls), f"{name}.search_grid names parameters it does not declare"
    for key, values in cls.search_grid.items():
        assert isinstance(values, list) and values, f"{name}.search_grid[{key!r}] is empty"
        for v in values:
            m.parse({key: v})  # every grid point is a valid value


@pytest.mark.parametrize("name", METHODS)
def test_scale_param_names_a_declared_float_parameter(name):
    cls = available()[name]
    if cls.scale_param is None:
        return
    hints = typing.get_type_hints(cls.Params)
    assert cls.scale_param in hints, f"{name}.scale_param={cls.scale_param!r} is not a parameter"
    # float, or float | None where the default depends on other parameters (DARE: resolved_scale)
    tp = hints[cls.scale_param]
    assert tp is float or (set(typing.get_args(tp)) == {float, type(None)} and hasattr(cls, "resolved_scale")), \
        f"{name}.scale_param={cls.scale_param!r} is not a float parameter"


@pytest.mark.parametrize("name", METHODS)
def test_a_parameter_called_scale_is_the_declared_scale_param(name):
    """A method's ``scale`` is its global λ unless it says otherwise: LiNeS must know to replace it."""
    cls = available()[name]
    if "scale" in _fields(cls):
        assert cls.scale_param == "scale", (f"{name} has a 'scale' parameter but no scale_param: declare "
                                            "scale_param = 'scale' if it scales the whole merged task vector")


@pytest.mark.parametrize("name", [n for n in METHODS if available()[n].scale_param is not None])
def test_lines_sets_the_base_methods_scale_to_one_unless_given(name):
    lines = get_method("lines")
    scale = available()[name].scale_param
    assert getattr(lines.parse({"base_method": name}).inner_params, scale) == 1.0
    assert getattr(lines.parse({"base_method": name, scale: 0.5}).inner_params, scale) == 0.5


def test_chained_modifiers_leave_the_base_method_its_defaults():
    lwptv = get_method("lwptv")
    ties = lwptv.parse({"base_method": "ties"}).inner_params
    assert (ties.merge, ties.scale) == ("mean", 1.0)  # TIES' own defaults
    under_lines = lwptv.parse({"base_method": "lines+ties"}).inner_params.inner_params
    assert (under_lines.merge, under_lines.scale) == ("mean", 1.0)  # LiNeS's λ = 1 (its β scales instead)
    given = lwptv.parse({"base_method": "lines+ties", "merge": "sum", "scale": 0.3}).inner_params.inner_params
    assert (given.merge, given.scale) == ("sum", 0.3)  # the paper's TIES setting, when asked for


# --- hooks ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", METHODS)
def test_described_parameters_round_trip_through_parse(name):
    cls = available()[name]
    required = [f.name for f in dataclasses.fields(cls.Params)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if required:
        pytest.skip(f"{name} requires {required}")
    m = get_method(name)
    params = m.parse({})
    described = m.describe_params(params)
    stored = json.loads(json.dumps(described))  # as a recipe stores it
    again = m.parse(stored)
    assert m.describe_params(again) == described
    if not isinstance(m, Modifier):  # a Composed holds Method instances, compared by identity
        assert again == params


def test_overriding_merge_drops_the_inherited_linearity_claim():
    class Clipped(TaskArithmetic):  # not registered
        def merge(self, base, deltas, params, ctx):
            return super().merge(base, deltas, params, ctx).clamp_(-1, 1)

    p = TaskArithmetic().parse({"scale": 0.5})
    assert TaskArithmetic().linear_coefficients(p, 2) == [0.5, 0.5]
    assert Clipped().linear_coefficients(p, 2) is None

    class Rescaled(TaskArithmetic):  # overrides both: keeps its own claim
        def merge(self, base, deltas, params, ctx):
            return super().merge(base, deltas, params, ctx).mul_(2)

        def linear_coefficients(self, params, n_inputs):
            return [2 * c for c in super().linear_coefficients(params, n_inputs)]

    assert Rescaled().linear_coefficients(p, 2) == [1.0, 1.0]


def test_every_hook_has_a_default_on_method():
    """The engine calls hooks directly, never through getattr: each has a default on Method."""
    for hook in ("parse", "describe_params", "check_inputs", "linear_coefficients", "passes", "prepare",
                 "finish", "merge_factors", "card_notes"):
        assert hook in vars(Method), hook


# --- the public harness ----------------------------------------------------------------------------

def test_merge_tensors_runs_the_statistics_passes():
    g = torch.Generator().manual_seed(0)
    taus = [torch.randn(16, 12, generator=g) for _ in range(3)]
    copies = [t.clone() for t in taus]
    # scope=model on one tensor: the passes' exact global threshold is this tensor's top-k, as scope=tensor
    model = merge_tensors("ties", taus, density=0.2)
    assert torch.equal(model, merge_tensors("ties", taus, density=0.2, scope="tensor"))
    # given stats: no pass runs, the merge reads them
    with pytest.raises(KeyError):
        merge_tensors("ties", taus, stats={}, density=0.2)
    assert all(torch.equal(t, c) for t, c in zip(taus, copies))  # the inputs are never modified
