"""Bad values (issue 12, items 3 and 7): refused with one line naming the value, never a NaN model.

Every CLI case asserts the exit code, the one-line message (no traceback) and that neither
the output folder nor its ``.partial-*`` temporary folder is left behind.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import typing

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

import hubsoup
from hubsoup import testing
from hubsoup import errors
from hubsoup.cli import main
from hubsoup.methods import available, get_method
from hubsoup.methods._params import parse_params
from hubsoup.options import MergeOptions
from hubsoup.testing import make_finetune


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def cli(capsys, *argv: str) -> tuple[int, str]:
    """Run the CLI in-process; returns (exit code, the one error line)."""
    rc = main(list(argv))
    _, err = capsys.readouterr()
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("WARNING:")]
    assert len(lines) == 1, err
    return rc, lines[0]


def assert_no_output(folder, name: str = "out") -> None:
    leftovers = [p for p in os.listdir(folder) if p == name or p.startswith(f".{name}.partial")]
    assert leftovers == [], leftovers


def merge_argv(inputs, base, out, *extra: str) -> list[str]:
    return ["merge", *inputs, "--base", base, "--out", str(out), "-q", *extra]


@pytest.fixture()
def llama(model_dir):
    return model_dir("llama"), [model_dir("llama", "ft1"), model_dir("llama", "ft2")]


def make_adapter(folder, seed: int = 1, **cfg) -> str:
    """A peft LoRA adapter of the tiny Llama (the base of ``model_dir('llama')``), lora_B non-zero."""
    pytest.importorskip("peft")
    return testing.make_adapter(folder, seed=seed, **{"r": 4, "lora_alpha": 8,
                                                      "target_modules": ["q_proj", "v_proj"], **cfg})


def edit_json(path: str, fn) -> None:
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    fn(d)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(d, f, allow_nan=True)  # NaN as the bare token, as a diverged run's config would have it


def edit_tensors(path: str, fn) -> None:
    sd = load_file(path)
    fn(sd)
    save_file(sd, path, metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------
# 3. parameters: NaN/inf refused at parse time, naming the parameter
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,param,name", [
    ("task_arithmetic", "scale=nan", "scale"),
    ("task_arithmetic", "scale=inf", "scale"),
    ("task_arithmetic", "scale=-inf", "scale"),
    ("linear", "weights=nan,1", "weights"),
    ("linear", "weights=1,inf", "weights"),
    ("slerp", "t=nan", "t"),
    ("ties", "density=nan", "density"),   # was a KeyError traceback
    ("dare", "p=nan", "p"),               # was a torch RuntimeError traceback
    ("ties", "scale=1e999", "scale"),     # a finite-looking literal that overflows to inf
])
def test_param_nan_inf_refused_cli(method, param, name, llama, tmp_path, capsys):
    base, fts = llama
    rc, line = cli(capsys, *merge_argv(fts, base, tmp_path / "out", "--method", method, "-p", param))
    assert rc == 2
    assert line.startswith("error: ") and f"parameter '{name}'" in line and "finite" in line, line
    assert_no_output(tmp_path)


def test_param_out_of_range_still_refused(llama, tmp_path, capsys):
    base, fts = llama
    rc, line = cli(capsys, *merge_argv(fts, base, tmp_path / "out", "--method", "ties", "-p", "density=1.5"))
    assert rc == 2 and "parameter 'density' = 1.5 is out of range [0.0, 1.0]" in line
    assert_no_output(tmp_path)


def test_param_nan_refused_python_api(llama, tmp_path):
    base, fts = llama
    with pytest.raises(errors.ParameterError, match="parameter 'scale': expected a finite number"):
        hubsoup.merge(fts, "task_arithmetic", base=base, out=str(tmp_path / "out"), scale=float("nan"), quiet=True)
    with pytest.raises(errors.ParameterError, match="parameter 'weights': expected a finite number"):
        hubsoup.merge(fts, "linear", base=base, out=str(tmp_path / "out"), weights=[1.0, math.inf], quiet=True)
    assert_no_output(tmp_path)


def _float_params(cls) -> list[str]:
    """Names of the float-valued fields of a Params dataclass (float, float | None, tuple[float, ...])."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        args = typing.get_args(tp)
        inner = [a for a in args if a is not type(None)]
        if tp is float or float in inner or any(typing.get_args(a)[:1] == (float,) for a in inner) \
                or typing.get_args(tp)[:1] == (float,):
            out.append(f.name)
    return out


def test_every_method_refuses_nonfinite_floats():
    """Every registered method, every float parameter (unbounded ranges included): NaN and ±inf refused."""
    checked = 0
    for name, cls in available().items():
        m = get_method(name)
        for pname in _float_params(cls.Params):
            for bad in ("nan", "inf", "-inf", float("nan"), float("inf")):
                with pytest.raises(errors.ParameterError, match=f"parameter '{pname}'"):
                    m.parse({pname: bad})
                checked += 1
    assert checked >= 5 * 15  # scale, weights, density, p, t, alpha, beta, eta, gamma, lambdas, ...


def test_finite_unbounded_and_int_params():
    """An unbounded range still takes any finite value; an int parameter refuses inf instead of crashing."""
    ta = get_method("task_arithmetic")
    assert ta.parse({"scale": "-7.5"}).scale == -7.5
    assert ta.parse({"scale": "1e30"}).scale == 1e30
    consensus = get_method("consensus")
    for bad in ("inf", "1e999.", float("inf"), "nan"):
        with pytest.raises(errors.ParameterError, match="parameter 'k'"):
            consensus.parse({"k": bad})
    # a non-finite default (a method's own bug) is refused too, naming the field
    @dataclasses.dataclass
    class P:
        x: float = float("nan")
    with pytest.raises(errors.ParameterError, match="parameter 'x'"):
        parse_params(P, {})


# ---------------------------------------------------------------------------------------------
# 3. the output is checked after the cast: overflow and NaN abort the merge
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def big_ft(model_dir, tmp_path_factory):
    """A 'fine-tune' whose weights reach ~1e5: finite in float32, not in float16."""
    return make_finetune(model_dir("llama"), str(tmp_path_factory.mktemp("big") / "ft"), seed=3, scale=1e5)


def test_float16_overflow_aborts_cli(big_ft, model_dir, tmp_path, capsys):
    base = model_dir("llama")
    rc, line = cli(capsys, *merge_argv([big_ft], base, tmp_path / "out", "--method", "task_arithmetic",
                                       "-p", "scale=1", "--dtype", "float16"))
    assert rc == 2
    assert line.startswith("error: output tensor '") and "overflows float16 (max 65504); use --dtype float32 or bfloat16" \
        in line, line
    assert_no_output(tmp_path)
    # and the suggestion works
    assert main(merge_argv([big_ft], base, tmp_path / "out", "--method", "task_arithmetic", "-p", "scale=1",
                           "--dtype", "bfloat16")) == 0
    sd = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.isfinite(v.float()).all() for v in sd.values() if v.is_floating_point())


def test_overflow_keeps_existing_output(big_ft, model_dir, tmp_path, capsys):
    """--overwrite over a good output: the failed merge leaves the old output as it was."""
    base = model_dir("llama")
    out = tmp_path / "out"
    assert main(merge_argv([big_ft], base, out, "--method", "task_arithmetic")) == 0
    before = {p: os.path.getmtime(out / p) for p in os.listdir(out)}
    capsys.readouterr()
    rc, line = cli(capsys, *merge_argv([big_ft], base, out, "--method", "task_arithmetic", "--dtype", "float16",
                                       "--overwrite"))
    assert rc == 2 and "overflows float16" in line
    assert {p: os.path.getmtime(out / p) for p in os.listdir(out)} == before
    assert [p for p in os.listdir(tmp_path) if p.startswith(".out.partial")] == []


def test_float32_overflow_of_the_merge_aborts(model_dir, tmp_path, capsys):
    """Finite inputs and parameters whose merge overflows float32: NaN/inf output refused, naming the tensor."""
    base = model_dir("llama")
    ft = str(tmp_path / "huge")
    shutil.copytree(model_dir("llama", "ft1"), ft)
    edit_tensors(os.path.join(ft, "model.safetensors"),
                 lambda sd: sd["model.layers.0.mlp.up_proj.weight"].__setitem__((0, 0), 3e38))
    rc, line = cli(capsys, *merge_argv([ft, model_dir("llama", "ft2")], base, tmp_path / "out",
                                       "--method", "task_arithmetic", "-p", "scale=10"))
    assert rc == 2
    assert "output tensor 'model.layers.0.mlp.up_proj.weight' has NaN/inf values after merging" in line, line
    assert_no_output(tmp_path)


def test_continual_overflow_aborts(big_ft, model_dir, tmp_path, capsys):
    """The continual workflow writes through CheckpointSink: the same check after the cast."""
    rc, line = cli(capsys, "continual", "init", big_ft, "--base", model_dir("llama"), "--out", str(tmp_path / "out"),
                   "--dtype", "float16", "-q")
    assert rc == 2 and "overflows float16 (max 65504); use --dtype float32 or bfloat16" in line, line
    assert_no_output(tmp_path)


def test_lora_output_full_tensor_overflow(big_ft, model_dir, tmp_path, capsys):
    """LoRA output: a full tensor (a norm) that overflows its dtype is refused by its adapter key."""
    rc, line = cli(capsys, *merge_argv([big_ft], model_dir("llama"), tmp_path / "out", "--method", "task_arithmetic",
                                       "--output-format", "lora", "--rank", "4", "--dtype", "float16"))
    assert rc == 2
    assert "output tensor 'base_model.model." in line and "overflows float16 (max 65504)" in line, line
    assert_no_output(tmp_path)


def test_lora_output_factor_overflow(model_dir, tmp_path, capsys):
    """LoRA output: factors (√σ ~ 1e5) that overflow float16 are refused by their adapter key."""
    base = model_dir("llama")
    ft = make_finetune(base, str(tmp_path / "ft"), seed=4, scale=1e10, only="self_attn.q_proj")
    rc, line = cli(capsys, *merge_argv([ft], base, tmp_path / "out", "--method", "task_arithmetic",
                                       "--output-format", "lora", "--rank", "4", "--dtype", "float16"))
    assert rc == 2
    assert "q_proj.lora_" in line and "overflows float16 (max 65504)" in line, line
    assert_no_output(tmp_path)


# ---------------------------------------------------------------------------------------------
# 3 / 7. LoRA adapters: malformed config values, NaN factors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key,value,needle", [
    ("lora_alpha", float("nan"), "lora_alpha=nan"),
    ("lora_alpha", "sixteen", "lora_alpha='sixteen'"),
    ("lora_alpha", float("inf"), "lora_alpha=inf"),
    ("r", "four", "r='four'"),
    ("r", 0, "r=0"),
    ("r", -4, "r=-4"),
    ("r", 2.5, "r=2.5"),
    ("rank_pattern", {"q_proj": "two"}, "rank_pattern['q_proj']='two'"),
    ("rank_pattern", {"q_proj": 0}, "rank_pattern['q_proj']=0"),
    ("alpha_pattern", {"v_proj": float("nan")}, "alpha_pattern['v_proj']=nan"),
    ("alpha_pattern", [3], "alpha_pattern=[3]"),
    ("rank_pattern", {"q_proj(": 4}, "rank_pattern key 'q_proj('"),
])
def test_malformed_adapter_config(key, value, needle, model_dir, tmp_path, capsys):
    adapter = make_adapter(tmp_path / "adapter")
    edit_json(os.path.join(adapter, "adapter_config.json"), lambda d: d.__setitem__(key, value))
    rc, line = cli(capsys, *merge_argv([adapter], model_dir("llama"), tmp_path / "out", "--method", "linear"))
    assert rc == 2
    assert f"adapter '{adapter}'" in line and "adapter_config.json" in line and needle in line, line
    assert_no_output(tmp_path)


def test_valid_patterns_still_open(model_dir, tmp_path):
    adapter = make_adapter(tmp_path / "adapter", rank_pattern={"v_proj": 4}, alpha_pattern={"q_proj": 3.5})
    res = hubsoup.merge([adapter], "linear", base=model_dir("llama"), out=str(tmp_path / "out"), quiet=True)
    assert os.path.isdir(res.path)


@pytest.mark.parametrize("output_format", ["full", "lora"])
def test_nan_in_lora_b_on_the_lowrank_fast_path(output_format, model_dir, tmp_path, capsys):
    """A linear merge of adapters takes their factors (never the dense ΔW): NaN there is caught by the engine."""
    adapter = make_adapter(tmp_path / "adapter")
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    edit_tensors(os.path.join(adapter, "adapter_model.safetensors"), lambda sd: sd[key].__setitem__((0, 0), math.nan))
    other = make_adapter(tmp_path / "other", seed=2)
    extra = ["--output-format", "lora", "--rank", "4"] if output_format == "lora" else []
    rc, line = cli(capsys, *merge_argv([adapter, other], model_dir("llama"), tmp_path / "out", "--method", "linear",
                                       *extra))
    assert rc == 2
    # "the LoRA factors of": the fast path's check (engine._load_factors), not the dense update's
    assert f"input '{adapter}': the LoRA factors of 'model.layers.1.self_attn.v_proj.weight' have NaN/inf" in line, line
    assert_no_output(tmp_path)


# ---------------------------------------------------------------------------------------------
# 7. --shard-size
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size,why", [
    ("0", "not a positive size"),
    ("-5MB", "not a positive size"),
    ("0.1B", "not a positive size"),
    ("5XB", "not a size"),
    ("nanGB", "not a size"),
    ("lots", "not a size"),
])
def test_bad_shard_size(size, why, llama, tmp_path, capsys):
    base, fts = llama
    rc, line = cli(capsys, *merge_argv(fts, base, tmp_path / "out", "--method", "linear", f"--shard-size={size}"))
    assert rc == 2 and "--shard-size" in line and why in line, line
    assert_no_output(tmp_path)


def test_shard_size_python():
    assert MergeOptions(shard_size="2GiB").shard_bytes == 2 * 2**30
    assert MergeOptions(shard_size=" 1.5 gb").shard_bytes == 1_500_000_000
    assert MergeOptions(shard_size=1234).shard_bytes == 1234
    for bad in (0, -1, "0GB", "5XB", True, 1.5):
        with pytest.raises(errors.ParameterError, match="--shard-size"):
            MergeOptions(shard_size=bad)


# ---------------------------------------------------------------------------------------------
# 7. --eval data checked before the merge starts
# ---------------------------------------------------------------------------------------------
@pytest.fixture()
def no_merge(monkeypatch):
    """Fail the test if the merge gets as far as opening the models."""
    def boom(*a, **k):
        raise AssertionError("the merge started before the eval data was checked")
    monkeypatch.setattr("hubsoup.session.open_models", boom)


def test_eval_missing_file_before_merge(llama, tmp_path, capsys, no_merge):
    base, fts = llama
    missing = tmp_path / "nope.csv"
    rc, line = cli(capsys, *merge_argv(fts, base, tmp_path / "out", "--method", "linear",
                                       "--eval", f"classification:{missing},name=sst"))
    assert rc == 2 and line == f"error: task 'sst': data file {missing} not found", line
    assert_no_output(tmp_path)


def test_eval_missing_column_before_merge(llama, tmp_path, capsys, no_merge):
    base, fts = llama
    data = tmp_path / "val.csv"
    data.write_text("sentence,label\ngood,1\nbad,0\n")
    rc, line = cli(capsys, *merge_argv(fts, base, tmp_path / "out", "--method", "linear",
                                       "--eval", f"classification:{data}"))  # text= defaults to 'text'
    assert rc == 2 and "task 'val': column 'text' not in" in line and "columns: sentence, label" in line, line
    assert_no_output(tmp_path)


def test_eval_missing_head_and_bad_limit_before_merge(llama, tmp_path, capsys, no_merge):
    base, fts = llama
    data = tmp_path / "val.csv"
    data.write_text("text,label\ngood,1\nbad,0\n")
    rc, line = cli(capsys, *merge_argv(fts, base, tmp_path / "out", "--method", "linear",
                                       "--eval", f"classification:{data},head={tmp_path / 'head.safetensors'}"))
    assert rc == 2 and "classifier head" in line and "not found" in line, line
    rc, line = cli(capsys, *merge_argv(fts, base, tmp_path / "out", "--method", "linear",
                                       "--eval", f"classification:{data},limit=ten"))
    assert rc == 2 and "limit must be a positive integer, got 'ten'" in line, line
    assert_no_output(tmp_path)


# ---------------------------------------------------------------------------------------------
# 7. a recipe (`hubsoup run`) with wrong types
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_recipe(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("recipe") / "soup"
    hubsoup.merge([model_dir("llama", "ft1"), model_dir("llama", "ft2")], "ties", base=model_dir("llama"),
                  out=str(out), quiet=True)
    with open(out / "hubsoup_recipe.yaml", encoding="utf-8") as f:
        return yaml.safe_load(f)


def _set(path: str, value):
    def fn(d):
        *parents, last = path.split(".")
        for p in parents:
            d = d[int(p)] if isinstance(d, list) else d.setdefault(p, {})
        d[last] = value
    return fn


@pytest.mark.parametrize("edit,needle", [
    (_set("params", [1, 2]), "'params' must be a mapping"),
    (_set("params.scale", float("nan")), "parameter 'scale': expected a finite number"),
    (_set("params.density", "abc"), "parameter 'density': expected float"),
    (_set("params.density", [1, 2]), "parameter 'density'"),
    (_set("method", 123), "'method' must be a method name"),
    (_set("method", ["ties"]), "'method' must be a method name"),
    (_set("dtype", ["x"]), "'dtype' must be a dtype name"),
    (_set("inputs", "abc"), "'inputs' a list"),
    (_set("inputs", []), "'inputs' is missing or empty"),
    (_set("inputs.0.path", 5), "'inputs[0].path' must be a string"),
    (_set("base", "abc"), "'base' must be a mapping"),
    (_set("extra", {"options": [1]}), "'extra.options' must be a mapping"),
    (_set("extra", {"output": "lora"}), "'extra.output' must be a mapping"),
    (_set("extra", {"options": {"ignore_extra": "yes"}}), "'ignore_extra' must be true or false"),
    (_set("extra", {"output": {"format": "lora", "rank": "four"}}), "rank must be a positive integer"),
    (_set("extra", {"output": {"format": "lora", "rank": 4, "energy": "most"}}), "energy must be a number"),
    (_set("hubsoup_version", [1]), "'hubsoup_version' must be a version"),
    (lambda d: d.pop("base"), "'base' is missing"),
    # security options come only from the command line, never from a recipe
    (_set("extra", {"options": {"allow_pickle": True}}), "option 'allow_pickle' cannot come from a recipe"),
    (_set("extra", {"options": {"token": "hf_x"}}), "option 'token' cannot come from a recipe"),
])
def test_recipe_wrong_types(edit, needle, good_recipe, tmp_path, capsys):
    d = yaml.safe_load(yaml.safe_dump(good_recipe))
    edit(d)
    d.pop("hash", None)  # written by hand: no hash to check (an edited one is refused naming 'hash': issue 44)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(d))
    rc, line = cli(capsys, "run", str(path), "--out", str(tmp_path / "out"), "--quiet")
    assert rc == 2 and line.startswith("error: ") and needle in line, line
    assert_no_output(tmp_path)


def test_good_recipe_still_runs(good_recipe, tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(good_recipe))
    assert main(["run", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 0


def test_nonfinite_grids_are_refused_before_any_merge(tmp_path, capsys):
    from hubsoup.workflows.search import parse_grid as search_grid
    from hubsoup.workflows.sweep import parse_grid as sweep_grid

    for spec in ("scale=nan:1:0.1", "scale=0:inf:0.1"):
        with pytest.raises(errors.ParameterError, match="finite"):
            search_grid(spec)
    for spec in ("0.1,nan", "0:inf:0.5", [0.1, float("inf")]):
        with pytest.raises(errors.ParameterError, match="finite"):
            sweep_grid(spec)
