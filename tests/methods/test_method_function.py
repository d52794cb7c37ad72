"""A method as one decorated function (issue 47, item 3): ``@hubsoup.method`` reads the parameters from the
signature and registers a :class:`Method` in the one registry, so it merges, validates, lists and records like a
built-in method."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from typing import Literal

import pytest
import torch
from safetensors.torch import load_file

import hubsoup
from hubsoup.errors import MethodError, ParameterError
from hubsoup.methods import Method, _base, available, get_method, param, register
from hubsoup.testing import make_base, make_finetune, merge_tensors


@pytest.fixture
def registry(monkeypatch):
    """A copy of the registry for the test: what it registers is gone afterwards."""
    monkeypatch.setattr(_base, "_REGISTRY", dict(_base._REGISTRY))
    return _base._REGISTRY


def _define_weighted_mean():
    @hubsoup.method("fn_weighted_mean", paper="(a test method)", search_grid={"alpha": [0.5, 1.0]})
    def fn_weighted_mean(deltas: list[torch.Tensor], base: torch.Tensor, *, alpha: float = 0.5,
                         mode: Literal["mean", "sum"] = "mean",
                         weights: tuple[float, ...] | None = param(None, "one weight per input", range=(0.0, None),
                                                                   per_input=True)) -> torch.Tensor:
        """Weighted mean (or sum) of the task vectors, times alpha, plus 0 * base.

        Args:
            alpha: λ, the scale of the merged task vector
        """
        w = weights or (1.0,) * len(deltas)
        out = sum(wi * d for wi, d in zip(w, deltas)) * alpha
        return out / len(deltas) if mode == "mean" else out + 0 * base

    return fn_weighted_mean


@dataclass
class _HandParams:
    alpha: float = param(0.5, "")
    mode: Literal["mean", "sum"] = param("mean", "")
    weights: tuple[float, ...] | None = param(None, "", per_input=True)


class _Hand(Method[_HandParams]):  # the same math, written as a class
    name = "hand_weighted_mean"
    summary = "the same, by hand"
    Params = _HandParams

    def merge(self, base, deltas, params, ctx):
        w = params.weights or (1.0,) * len(deltas)
        out = sum(wi * d for wi, d in zip(w, list(deltas.unbind(0)))) * params.alpha
        return out / len(deltas) if params.mode == "mean" else out + 0 * base


def test_a_decorated_function_is_a_registered_method_with_the_signatures_parameters(registry):
    fn = _define_weighted_mean()
    cls = available()["fn_weighted_mean"]
    assert issubclass(cls, Method) and cls.__module__ == __name__
    assert getattr(fn, "__hubsoup_method__") is cls  # the function itself is returned, callable as plain math
    row = next(m for m in hubsoup.list_methods() if m["name"] == "fn_weighted_mean")
    assert row["summary"] == "Weighted mean (or sum) of the task vectors, times alpha, plus 0 * base."
    assert [(p["name"], p["type"], p["default"], p["source"]) for p in row["params"]] == [
        ("alpha", "float", 0.5, "ours"), ("mode", "choice", "mean", "ours"), ("weights", "floats", None, "ours")]
    params = {p["name"]: p for p in row["params"]}
    assert params["alpha"]["help"] == "λ, the scale of the merged task vector"  # from the docstring's Args:
    assert params["weights"]["range"] == [0.0, None] and params["mode"]["choices"] == ["mean", "sum"]
    assert cls.search_grid == {"alpha": [0.5, 1.0]} and cls.scale_param is None
    json.dumps(hubsoup.list_methods())


def test_a_decorated_method_merges_bit_exact_with_the_hand_written_one(registry):
    _define_weighted_mean()
    register(_Hand)
    g = torch.Generator().manual_seed(0)
    taus = torch.randn(3, 4, 5, generator=g)
    for given in ({}, {"alpha": 0.3, "mode": "sum"}, {"weights": "0.2,0.5,1.5", "alpha": "2"}):
        got = merge_tensors("fn_weighted_mean", taus.clone(), **given)
        want = merge_tensors("hand_weighted_mean", taus.clone(), **given)
        assert torch.equal(got, want), given
        assert get_method("fn_weighted_mean").describe_params(get_method("fn_weighted_mean").parse(given)) == \
            get_method("hand_weighted_mean").describe_params(get_method("hand_weighted_mean").parse(given))


def test_decorated_parameters_are_validated_by_name(registry):
    _define_weighted_mean()
    m = get_method("fn_weighted_mean")
    with pytest.raises(ParameterError, match="parameter 'alpha': expected float"):
        m.parse({"alpha": "lots"})
    with pytest.raises(ParameterError, match="no parameter 'alhpa' .*did you mean 'alpha'"):
        m.parse({"alhpa": 1.0})
    with pytest.raises(ParameterError, match="parameter 'mode'"):
        m.parse({"mode": "median"})
    with pytest.raises(ParameterError, match="parameter 'weights' = -1.0 is out of range"):
        m.parse({"weights": "1,-1"})
    with pytest.raises(MethodError, match="2 weights given for 3 inputs"):
        m.check_inputs(m.parse({"weights": "1,1"}), 3)


def test_the_scale_parameter_and_the_stack(registry):
    @hubsoup.method("fn_scaled_max", summary="max |τ| with its sign, scaled", elementwise=True)
    def fn_scaled_max(deltas: torch.Tensor, ctx: hubsoup.methods.TensorContext, *, scale: float = 1.0) -> torch.Tensor:
        assert ctx.n_inputs == deltas.shape[0]
        idx = deltas.abs().argmax(dim=0, keepdim=True)
        return deltas.gather(0, idx)[0].mul_(scale)

    cls = available()["fn_scaled_max"]
    assert cls.scale_param == "scale" and cls.elementwise and cls.linear_coefficients is Method.linear_coefficients
    assert get_method("lines").parse({"base_method": "fn_scaled_max"}).inner_params.scale == 1.0  # LiNeS finds λ
    taus = torch.tensor([[1.0, -3.0], [-2.0, 2.0]])
    assert merge_tensors("fn_scaled_max", taus, scale=0.5).tolist() == [-1.0, -1.5]


def test_lines_over_a_method_whose_scale_defaults_to_none_says_what_it_needs(registry):
    @hubsoup.method("fn_auto_scale", summary="the mean, its scale resolved by the method", elementwise=True)
    def fn_auto_scale(deltas: torch.Tensor, ctx: hubsoup.methods.TensorContext, *,
                      scale: float | None = None) -> torch.Tensor:
        return deltas.mean(dim=0) * (1.0 if scale is None else scale)

    taus = torch.tensor([[1.0, -3.0], [-2.0, 2.0]])
    with pytest.raises(MethodError, match="lines over 'fn_auto_scale': its scale parameter 'scale' defaults to None"):
        merge_tensors("lines", taus, base_method="fn_auto_scale", alpha=0.5)
    got = merge_tensors("lines", taus, base_method="fn_auto_scale", alpha=0.5, beta=0.5)  # β given: no λ needed
    assert torch.isfinite(got).all()


def test_a_decorated_method_merges_real_checkpoints_as_its_math_says(registry, tmp_path):
    _define_weighted_mean()
    base = make_base("llama", str(tmp_path / "base"))
    fts = [make_finetune(base, str(tmp_path / f"ft{i}"), seed=i) for i in (1, 2)]
    res = hubsoup.merge(fts, "fn_weighted_mean", base=base, out=str(tmp_path / "soup"), alpha=0.8, quiet=True)
    got, b = load_file(os.path.join(res.path, "model.safetensors")), load_file(os.path.join(base, "model.safetensors"))
    ins = [load_file(os.path.join(f, "model.safetensors")) for f in fts]
    for k in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight"):
        taus = [i[k].float() - b[k].float() for i in ins]
        want = (b[k].float() + (1.0 * taus[0] + 1.0 * taus[1]) * 0.8 / 2).to(b[k].dtype)
        assert torch.equal(got[k], want), k
    assert res.recipe.method == "fn_weighted_mean" and res.recipe.params["alpha"] == 0.8
    assert "fn_weighted_mean" in res.card


def test_a_decorated_function_named_by_an_entry_point_is_loaded(registry, monkeypatch):
    import types

    mod = types.ModuleType("hubsoup_fn_plugin_test")

    def fn_plugin(deltas: torch.Tensor, *, k: int = 2) -> torch.Tensor:
        """A plug-in function."""
        return deltas.sum(dim=0) * k

    mod.fn_plugin = hubsoup.method("fn_plugin")(fn_plugin)
    registry.pop("fn_plugin")  # as if the module had not been imported yet: loading the entry point registers it
    monkeypatch.setitem(__import__("sys").modules, "hubsoup_fn_plugin_test", mod)
    ep = EntryPoint(name="fn_plugin", value="hubsoup_fn_plugin_test:fn_plugin", group=_base.ENTRY_POINT_GROUP)
    monkeypatch.setattr(_base, "entry_points", lambda group: [ep] if group == _base.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(_base, "_plugins_loaded", False)
    assert available()["fn_plugin"] is getattr(mod.fn_plugin, "__hubsoup_method__")


@pytest.mark.parametrize("src, message", [
    ("def f(x: torch.Tensor, *, a: float = 1.0) -> torch.Tensor: return x", "parameter 'deltas'"),
    ("def f(deltas: torch.Tensor, *, a=1.0) -> torch.Tensor: return deltas", "'a' needs a type annotation"),
    ("def f(deltas: torch.Tensor, *, a: float) -> torch.Tensor: return deltas", "'a' needs a default"),
    ("def f(deltas: torch.Tensor, **kw: float) -> torch.Tensor: return deltas", "name each one"),
])
def test_a_signature_the_decorator_cannot_read_is_refused_by_name(registry, src, message):
    ns = {"torch": torch}
    exec(src, ns)
    with pytest.raises(MethodError, match=message):
        hubsoup.method("fn_bad", summary="bad")(ns["f"])
    assert "fn_bad" not in available()
    with pytest.raises(MethodError, match="unknown keyword 'linear'"):
        hubsoup.method("fn_bad", linear=True)


def test_the_params_dataclass_is_a_plain_dataclass(registry):
    _define_weighted_mean()
    p = get_method("fn_weighted_mean").parse({"alpha": "0.25"})
    assert dataclasses.is_dataclass(p) and p.alpha == 0.25 and type(p).__name__ == "FnWeightedMeanParams"
