"""The contract every registered method keeps: the registry, the declared class attributes, the hooks."""

import dataclasses
import importlib.util
import json
import os
import sys
import typing

import pytest
import torch

from hubsoup.errors import MethodError
from hubsoup.methods import Method, available, get_method, param, register
from hubsoup.methods._compose import Modifier
from hubsoup.methods.task_arithmetic import TaskArithmetic
from hubsoup.testing import merge_tensors
import paths  # tests/paths.py: the repository's root, wherever a test module sits


def _load_example(path: str) -> None:
    """Register the example method of examples/custom_method.py (one decorated function): the contract covers it."""
    spec = importlib.util.spec_from_file_location("custom_method", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("custom_method", mod)
    spec.loader.exec_module(mod)


_load_example(os.path.join(paths.ROOT, "examples", "custom_method.py"))
METHODS = sorted(available())


def test_the_contract_covers_a_method_written_as_one_decorated_function():
    cls = available()["median"]
    assert "median" in METHODS and cls.__qualname__ == "median" and cls.__module__ == "custom_method"
    assert cls.Params.__name__ == "MedianParams" and cls.scale_param == "scale" and cls.elementwise


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
    assert (ties.merge, ties.scale) == ("mean", None)  # TIES' own defaults (λ resolves to 0.7)
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


# --- the method contract (issue 33): elementwise, workspace, provenance ----------------------------

def test_an_elementwise_method_says_so_in_one_word():
    @dataclasses.dataclass
    class P:
        scale: float = param(1.0, "a scale")

    class SignMax(Method):  # not registered
        name, summary, Params = "sign_max_test", "test", P
        elementwise = True

        def merge(self, base, deltas, params, ctx):
            return deltas.sign().mean(dim=0) * deltas.abs().amax(dim=0)

    class NotSaid(SignMax):  # overrides merge without saying: the claim does not carry over
        def merge(self, base, deltas, params, ctx):
            return deltas.sum(dim=0)

    assert SignMax().tensor_passes(P(), 2) == []
    assert NotSaid().tensor_passes(P(), 2) is None
    assert get_method("karcher").tensor_passes(get_method("karcher").parse({}), 2) is None
    assert get_method("task_arithmetic").tensor_passes(get_method("task_arithmetic").parse({}), 2) == []


def test_workspace_default_is_honest_for_a_method_defined_elsewhere():
    @dataclasses.dataclass
    class P:
        scale: float = param(1.0, "a scale")

    class Mine(Method):  # defined in this test module: one float32 copy of the stack unless declared
        name, summary, Params = "mine_test", "test", P

    class Declared(Mine):
        workspace_copies = 2

    assert Mine().workspace_bytes((10, 4), 3, P()) == 3 * 40 * 4
    assert Declared().workspace_bytes((10, 4), 3, P()) == 2 * 40 * 4
    assert get_method("task_arithmetic").workspace_bytes((10, 4), 3, None) == 0  # in place, as before


def test_param_provenance_defaults_to_ours_outside_the_package():
    from hubsoup.methods import describe

    @dataclasses.dataclass
    class P:
        k: float = param(1.0, "mine")
        m: float = param(1.0, "from a paper", source="paper")

    assert [r["source"] for r in describe(P)] == ["ours", "paper"]
    ties = {r["name"]: r["source"] for r in describe(available()["ties"].Params)}
    assert ties["density"] == "paper"  # the package's methods: their papers', as declared before


# --- every registered method, whole, in pieces, on a device map: the same bytes ----------------

MAP = {"model.embed_tokens": "cpu:1", "model.layers.0": "cpu:2", "model.layers.1": "cpu:1", "": "cpu"}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    from hubsoup.testing import make_base, make_finetune
    from tests.methods.test_lot import add_char_tokenizer, write_exemplars

    root = tmp_path_factory.mktemp("contract")
    base = add_char_tokenizer(make_base("llama", str(root / "base"), dtype=torch.bfloat16))
    fts = [make_finetune(base, str(root / f"ft{i}"), seed=i) for i in (1, 2, 3)]
    ex = [write_exemplars(root / f"ex{i}.jsonl", seed=i) for i in (1, 2, 3)]
    return base, fts, ex


def _files(folder):
    import os

    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with open(os.path.join(folder, f), "rb") as fh:
                out[f] = fh.read()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", METHODS)
def test_every_method_merges_the_same_whole_in_pieces_and_on_a_device_map(zoo, tmp_path, monkeypatch, name):
    """A method (built in, or a user's: every registered one) merges to the same bytes whole (the dense path),
    in ragged pieces of 1000 entries swept by the engine's lanes, and on a device map over CPU workers."""
    import hubsoup
    from hubsoup.engine import TensorWork, lowrank
    from hubsoup.output.checkpoint import CheckpointSink

    base, fts, ex = zoo
    cls = available()[name]
    n = max(cls.min_inputs, min(3, cls.max_inputs or 3))
    params = {"exemplars": {str(i + 1): ex[i] for i in range(n)}, "n_exemplars": 8, "batch_size": 8} \
        if name == "lot" else {}

    def run(out, **kw):
        return _files(hubsoup.merge(fts[:n], name, base=base, out=str(tmp_path / out), params=params, quiet=True,
                                    **kw).path)

    with monkeypatch.context() as m:
        m.setattr(lowrank, "PIECE_BYTES", 4 * 4 * 1000)
        m.setattr(lowrank, "MIN_PIECE", 1000)
        pieces = run("pieces")
    mapped = run("mapped", device_map=MAP)
    monkeypatch.setattr(CheckpointSink, "weights_dtype", lambda self, entry: None)
    monkeypatch.setattr(TensorWork, "pieces", lambda self: None)
    whole = run("whole")
    assert pieces == whole, f"{name}: in pieces differs from whole"
    assert mapped == whole, f"{name}: on a device map differs from whole"
