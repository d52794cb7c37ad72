"""The community merge methods with mergekit's semantics, and per-layer schedules / name filters.

Three kinds of check:
* hand-computed expectations on small tensors (``hubsoup.testing.merge_tensors``);
* mergekit's own output on the same tensors: tests/fixtures/mergekit_methods/*.safetensors,
  generated once by tests/tools/make_mergekit_method_fixtures.py with mergekit 0.1.5's kernels in a
  separate venv (this suite never needs mergekit);
* random methods (DARE, DELLA): equal to mergekit in distribution (kept fraction, L1 rescale); in half
  precision, given the masks mergekit drew (kept in the fixture), equal to its output bit for bit.

mergekit's method registry (tests/fixtures/mergekit_methods/registry.json, written from mergekit 0.1.5 by
the same tool) is covered by hubsoup's mergekit method table, every method and parameter.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import torch
from safetensors import safe_open

import hubsoup
from hubsoup.errors import MethodError, ParameterError
from hubsoup.methods import get_method
from hubsoup.methods._schedule import Schedule, layer_position, resolve_params
from hubsoup.plan import BlockInfo
from hubsoup.testing import make_base, make_finetune, merge_tensors
import paths  # tests/paths.py: the repository's root, wherever a test module sits

FIXTURES = os.path.join(paths.TESTS, "fixtures", "mergekit_methods")
DETERMINISTIC = sorted(f[:-12] for f in os.listdir(FIXTURES) if f.endswith(".safetensors") and "_stats" not in f)


def _tensors(name):
    with safe_open(os.path.join(FIXTURES, f"{name}.safetensors"), "pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}


def load_case(name):
    meta, t = _tensors(name)
    models = [t[f"m{i}"] for i in range(sum(bool(re.fullmatch(r"m\d+", k)) for k in t))]
    return t["base"], models, t["out"], json.loads(meta["hubsoup"]), json.loads(meta["with_base"])


def load_masks(name):
    """The masks mergekit drew in a ``_masked_`` case, one per input with density < 1, in input order."""
    _, t = _tensors(name)
    return [t[f"mask{i}"] for i in range(sum(k.startswith("mask") for k in t))]


MASKED = [c for c in DETERMINISTIC if "_masked_" in c]
"""Random methods in half precision with the masks mergekit drew: deterministic given those masks."""
HALF = [c for c in DETERMINISTIC if c.endswith(("_bf16", "_fp16")) and c not in MASKED]
"""Inputs stored in half precision, which mergekit computes in (its config's dtype): hubsoup with compute_dtype."""


def hubsoup_output(base, models, spec, with_base, name="model.layers.0.mlp.weight", out_dtype=None, **override):
    """hubsoup's merged weight: the base is mergekit's base, or (no base) the first model as layout reference.

    Half-precision inputs go through the engine's float32 task vectors and come back in ``out_dtype`` (default
    their own; float32 where mergekit's result is: arcee_fusion, ramplus_tl)."""
    ref = base if with_base else models[0]
    ref32 = ref.float()
    taus = [m.float() - ref32 for m in models]
    params = {**spec["params"], **override}
    out = ref32 + merge_tensors(spec["method"], taus, ref32, name=name, recipe_hash="abc", **params)
    return out.to(out_dtype or ref.dtype)


def test_fixtures_are_present():
    assert len(DETERMINISTIC) >= 25, "run tests/tools/make_mergekit_method_fixtures.py with the mergekit venv"
    assert {c.split("_")[0] for c in HALF} == {"nuslerp", "multislerp", "karcher", "nearswap", "ram", "ramplus",
                                               "arcee", "task", "dare"}
    assert {c.rsplit("_masked_", 1)[0] for c in MASKED} == {"dare_ties", "dare_linear", "della", "della_linear"}


@pytest.mark.parametrize("case", [c for c in DETERMINISTIC if c not in HALF and c not in MASKED])
def test_equals_mergekit_output(case):
    base, models, want, spec, with_base = load_case(case)
    got = hubsoup_output(base, models, spec, with_base)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("case", HALF)
def test_half_precision_equals_mergekit_output_bit_for_bit(case):
    """mergekit computes every method step by step in its config's bf16/fp16 (nuslerp, multislerp, karcher,
    nearswap, ram, ramplus_tl, arcee_fusion, and task_arithmetic and dare_* with lambda, rescale and normalize);
    so does hubsoup with compute_dtype: the same bits. Computed in float32 and rounded once, the result is not
    mergekit's. arcee_fusion and ramplus_tl return float32 from half inputs, as mergekit's do."""
    base, models, want, spec, with_base = load_case(case)
    assert models[0].dtype in (torch.bfloat16, torch.float16) and spec["params"]["compute_dtype"] != "float32"
    promotes = spec["method"] in ("arcee_fusion", "ramplus_tl")
    assert want.dtype == (torch.float32 if promotes else models[0].dtype)
    got = hubsoup_output(base, models, spec, with_base, out_dtype=want.dtype)
    assert got.dtype == want.dtype and torch.equal(got, want), (
        f"{int((got != want).sum())} of {want.numel()} entries differ from mergekit's")
    f32 = hubsoup_output(base, models, spec, with_base, out_dtype=want.dtype, compute_dtype="float32")
    assert not torch.equal(f32, want)


@pytest.mark.parametrize("case", MASKED)
def test_half_precision_random_methods_given_mergekits_masks_are_mergekits(case, monkeypatch):
    """DARE and DELLA in half precision, step for step as mergekit's: given the masks mergekit drew, hubsoup's
    drop, L1 rescale (bf16, or float32 for fp16 as mergekit's sparsifiers upcast there), weights, sign election,
    sums, normalisation and λ give mergekit's output bit for bit (the masks themselves agree in distribution)."""
    import hubsoup.methods.dare as dare
    import hubsoup.methods.della as della

    base, models, want, spec, with_base = load_case(case)
    masks = iter(load_masks(case))
    monkeypatch.setattr(dare, "_mask", lambda row, *a: next(masks).reshape(row.shape))
    monkeypatch.setattr(della, "della_mask", lambda x, *a: next(masks).reshape(x.shape))
    got = hubsoup_output(base, models, spec, with_base)
    assert next(masks, None) is None, "a mask mergekit drew was not used"
    assert got.dtype == want.dtype and torch.equal(got, want), (
        f"{int((got != want).sum())} of {want.numel()} entries differ from mergekit's")
    masks = iter(load_masks(case))
    f32 = hubsoup_output(base, models, spec, with_base, compute_dtype="float32")
    assert not torch.equal(f32, want)


# --- mergekit's registry: every method and parameter in hubsoup's table ---------------------------

def _check_table_covers(registry: dict[str, dict]) -> None:
    from hubsoup.formats.mergekit import METHODS, REQUIRED

    missing = sorted(set(registry) - set(METHODS))
    assert not missing, f"mergekit methods hubsoup's table lacks: {', '.join(missing)}"
    same_meaning = {("passthrough", "scale"): (None, 1.0)}  # mergekit's None: no scaling, hubsoup's 1.0
    for name, info in registry.items():
        table = METHODS[name].params
        for p, spec in info["parameters"].items():
            assert p in table, f"{name}: mergekit's parameter '{p}' is not in hubsoup's table"
            mine = table[p]
            assert spec["required"] == (mine.default is REQUIRED), f"{name}.{p}: required differs"
            if not spec["required"]:
                want = same_meaning.get((name, p), (spec["default"], spec["default"]))
                assert (spec["default"], mine.default) == want, \
                    f"{name}.{p}: default {mine.default} vs mergekit's {spec['default']}"


def test_method_table_covers_mergekits_registry_snapshot():
    """The snapshot of mergekit 0.1.5's registry (written from mergekit itself by
    tests/tools/make_mergekit_method_fixtures.py --registry): each of its methods is in hubsoup's table, with
    every parameter, whether it is required, and its default."""
    with open(os.path.join(FIXTURES, "registry.json"), encoding="utf-8") as f:
        snap = json.load(f)
    assert snap["mergekit"] == "0.1.5" and len(snap["methods"]) == 20
    assert {"nearswap", "ram", "ramplus_tl", "arcee_fusion"} <= set(snap["methods"])
    _check_table_covers(snap["methods"])
    # the check fails on a method, or a parameter, that the table lacks
    with pytest.raises(AssertionError, match="lacks: model_soup_v2"):
        _check_table_covers({**snap["methods"], "model_soup_v2": {"parameters": {}}})
    extra = json.loads(json.dumps(snap["methods"]))
    extra["nearswap"]["parameters"]["s"] = {"required": False, "default": 1.0, "scope": "shared"}
    with pytest.raises(AssertionError, match="parameter 's'"):
        _check_table_covers(extra)


MERGEKIT_PYTHON = os.environ.get("HUBSOUP_MERGEKIT_PYTHON") or os.path.join(
    paths.ROOT, "benchmarks", ".work", "mergekit-venv", "bin", "python")


@pytest.mark.skipif(not os.path.isfile(MERGEKIT_PYTHON),
                    reason="LIVE CHECK NOT RUN: mergekit is not installed (benchmarks/.work/mergekit-venv, or "
                           "HUBSOUP_MERGEKIT_PYTHON); test_method_table_covers_mergekits_registry_snapshot holds the "
                           "table to mergekit 0.1.5's registry as recorded")
def test_method_table_covers_the_installed_mergekits_registry():
    """Where mergekit is installed (its own venv: it never enters hubsoup's), its live registry: every method
    hubsoup's table must have, and, for mergekit 0.1.5, the same as the snapshot."""
    code = ("import json; import tests.tools.make_mergekit_method_fixtures as t; "
            "print(json.dumps(t.registry_snapshot()))")
    root = paths.ROOT
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = root
    proc = subprocess.run([MERGEKIT_PYTHON, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    live = json.loads(proc.stdout.strip().splitlines()[-1])
    _check_table_covers(live["methods"])
    if live["mergekit"] == "0.1.5":
        with open(os.path.join(FIXTURES, "registry.json"), encoding="utf-8") as f:
            assert json.load(f) == live, "registry.json is not mergekit 0.1.5's registry: regenerate it"


# --- random methods: mergekit's distribution -------------------------------------------------

def _runs(case, seeds=range(8)):
    base, models, want, spec, with_base = load_case(case)
    outs = []
    for s in seeds:
        params = {**spec["params"], "seed": s}
        taus = [m - base for m in models]
        outs.append(merge_tensors(spec["method"], taus, base, name="w", recipe_hash="abc", **params))
    return base, models, want - base, outs


@pytest.mark.parametrize("case", ["dare_linear_stats", "dare_ties_stats"])
def test_dare_mergekit_convention_matches_in_distribution(case):
    base, models, mk, outs = _runs(case)
    # two inputs kept with probability 0.3 each: ~1 − 0.7² of the entries are non-zero (union of the masks)
    frac_mk = float((mk != 0).float().mean())
    fracs = [float((o != 0).float().mean()) for o in outs]
    assert abs(frac_mk - 0.51) < 0.04 and all(abs(f - 0.51) < 0.04 for f in fracs)
    # the L1 rescale: the merged vector's L1 norm is mergekit's within sampling noise
    l1_mk = float(mk.abs().sum())
    l1 = sum(float(o.abs().sum()) for o in outs) / len(outs)
    assert abs(l1 / l1_mk - 1) < 0.06, (l1, l1_mk)


def test_della_keep_probability_rises_with_magnitude_as_mergekit():
    base, (m0,), mk, outs = _runs("della_linear_stats")
    tau = m0 - base
    ranks = tau.abs().argsort(dim=1).argsort(dim=1)  # 64 per row
    quart = ranks // 16

    def per_quartile(out):
        kept = out != 0
        return [float(kept[quart == q].float().mean()) for q in range(4)]

    q_mk = per_quartile(mk)
    q_hs = [sum(v) / len(outs) for v in zip(*(per_quartile(o) for o in outs))]
    for a, b in zip(q_mk, q_hs):
        assert abs(a - b) < 0.06, (q_mk, q_hs)
    assert q_hs[0] < q_hs[3] - 0.3  # density 0.4 ± 0.3 across the ranks
    kept = outs[0] != 0  # rescale=False: kept entries are the task vector's own
    assert torch.equal(outs[0][kept], tau[kept])


def test_dare_mergekit_rescale_keeps_each_l1_norm_exactly():
    tau = torch.randn(40, 30, generator=torch.Generator().manual_seed(3))
    out = merge_tensors("dare", [tau], p=0.6, convention="mergekit", then="sum", recipe_hash="x")
    assert 0.3 < float((out != 0).float().mean()) < 0.5
    torch.testing.assert_close(out.abs().sum(), tau.abs().sum(), rtol=1e-5, atol=0)
    # the paper convention rescales by 1/(1 − p) instead: kept entries are τ/(0.4)
    paper = merge_tensors("dare", [tau], p=0.6, scale=1.0, recipe_hash="x")
    kept = paper != 0
    torch.testing.assert_close(paper[kept], tau[kept] / 0.4)
    # at its default λ, then=sum is task arithmetic's 1/N: 1 for one input, 1/2 for two
    torch.testing.assert_close(merge_tensors("dare", [tau], p=0.6, recipe_hash="x"), paper)
    two = merge_tensors("dare", [tau, tau], p=0.6, scale=1.0, recipe_hash="x")
    torch.testing.assert_close(merge_tensors("dare", [tau, tau], p=0.6, recipe_hash="x"), two / 2)


# --- hand-computed conventions ------------------------------------------------------------------

def test_ties_mergekit_weighted_sign_election_and_divisor():
    t1 = torch.tensor([1.0, -2.0, 3.0, 0.0])
    t2 = torch.tensor([-3.0, 1.0, 1.0, 0.0])
    # weights 1 and 0.5: weighted rows [1,-2,3,0] and [-1.5,.5,.5,0]; sums [-.5,-1.5,3.5,0] → signs [-,-,+,+]
    got = merge_tensors("ties", [t1, t2], density=1.0, convention="mergekit", weights=[1.0, 0.5])
    # entry 0: only t2 agrees (−1.5 / 0.5 = −3); 1: t1 (−2/1); 2: both (3.5/1.5); 3: nobody → 0
    torch.testing.assert_close(got, torch.tensor([-3.0, -2.0, 3.5 / 1.5, 0.0]))
    summed = merge_tensors("ties", [t1, t2], density=1.0, convention="mergekit", weights=[1.0, 0.5], merge="sum")
    torch.testing.assert_close(summed, torch.tensor([-1.5, -2.0, 3.5, 0.0]))
    # the paper convention elects on unweighted rows: entry 0 sums to −2 → t2 only, divided by the count
    paper = merge_tensors("ties", [t1, t2], density=1.0, weights=[1.0, 0.5], scale=1.0)
    torch.testing.assert_close(paper, torch.tensor([-1.5, -2.0, 1.75, 0.0]))  # (3 + 0.5·1)/2 agreeing


@pytest.mark.parametrize("extra", [{"scope": "tensor"}, {"scope": "model"}, {"convention": "mergekit"}])
def test_ties_density_times_size_below_one_keeps_one_entry(extra):
    tau = torch.tensor([0.1, -0.5, 0.2, 0.05, 0.3])
    got = merge_tensors("ties", [tau], density=0.1, scale=1.0, **extra)
    torch.testing.assert_close(got, torch.tensor([0.0, -0.5, 0.0, 0.0, 0.0]))


def test_linear_combine_models_sums_the_models_and_needs_no_base():
    base = torch.tensor([1.0, 2.0])
    th = [torch.tensor([2.0, 2.0]), torch.tensor([0.0, 4.0])]
    taus = [t - base for t in th]
    got = base + merge_tensors("linear", taus, base, weights=[0.5, 2.0], normalize=False, combine="models")
    torch.testing.assert_close(got, 0.5 * th[0] + 2.0 * th[1])
    old = base + merge_tensors("linear", taus, base, weights=[0.5, 2.0], normalize=False)
    torch.testing.assert_close(old, base + 0.5 * taus[0] + 2.0 * taus[1])
    m = get_method("linear")
    p = m.parse({"weights": [0.5, 2.0], "normalize": False, "combine": "models"})
    assert not m.preserves_zero(p) and m.linear_coefficients(p, 2) is None
    assert not m.needs_base(m.parse({}), 2) and m.needs_base(m.parse({"normalize": False}), 2)


def test_slerp_one_input_goes_from_the_base():
    base, th = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    got = base + merge_tensors("slerp", [th - base], base, t=0.5)
    torch.testing.assert_close(got, torch.tensor([0.7071068, 0.7071068]))
    assert torch.allclose(base + merge_tensors("slerp", [th - base], base, t=0.0), base)


def test_model_stock_hand_computed():
    # two orthogonal task vectors of equal norm: cos = 0 → t = 0, the base is kept
    assert torch.equal(merge_tensors("model_stock", [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])]),
                       torch.zeros(2))
    # identical task vectors: cos = 1 → t = 2·1/(1+1) = 1, the average
    tau = torch.tensor([0.5, -1.0])
    torch.testing.assert_close(merge_tensors("model_stock", [tau, tau]), tau)


def test_breadcrumbs_drops_outliers_and_small_entries():
    tau = torch.tensor([5.0, 1.0, -4.0, 2.0, 3.0, 0.5, -0.1, 0.2, 6.0, 0.3])
    # density 0.5 → 5 kept; gamma 0.1 → the largest (6.0) dropped; then the 5 next largest by magnitude
    got = merge_tensors("breadcrumbs", [tau], density=0.5, gamma=0.1)
    torch.testing.assert_close(got, torch.tensor([5.0, 1.0, -4.0, 2.0, 3.0, 0, 0, 0, 0, 0]))


def test_sce_erases_minority_signs_and_weights_by_energy():
    t1, t2 = torch.tensor([1.0, 2.0]), torch.tensor([-3.0, 2.0])
    # energies: mean squares 2.5 and 6.5 → weights 2.5/9, 6.5/9; entry 0: sum −2 → only t2 (−3)
    got = merge_tensors("sce", [t1, t2])
    torch.testing.assert_close(got, torch.tensor([-3.0, 2.0]))


def test_passthrough_copies_its_input_scaled():
    base, th = torch.tensor([1.0, 1.0]), torch.tensor([2.0, -4.0])
    torch.testing.assert_close(base + merge_tensors("passthrough", [th - base], base, weight_scale=0.5), th * 0.5)
    with pytest.raises(MethodError, match="exactly 1"):
        merge_tensors("passthrough", [th, th])


def test_multislerp_antipodal_inputs_are_a_clear_error():
    a = torch.tensor([1.0, 0.0])
    with pytest.raises(MethodError, match="cancel out"):
        merge_tensors("multislerp", [a, -a, a * 0 + torch.tensor([0.0, 0.0])], weights=[0.5, 0.5, 0.0],
                      normalize_weights=False)


def test_della_rejects_density_epsilon_outside_unit_interval():
    with pytest.raises(ParameterError, match="density ± epsilon"):
        get_method("della").parse({"density": 0.9, "epsilon": 0.15})


def test_per_input_tuples_are_checked_against_the_inputs():
    with pytest.raises(MethodError, match="2 densities given for 3 inputs"):
        merge_tensors("breadcrumbs", [torch.ones(4)] * 3, densities=[0.5, 0.5])


# --- schedules: gradients and filters -----------------------------------------------------------

def _gradients():
    with open(os.path.join(FIXTURES, "gradients.json")) as f:
        return json.load(f)


def test_gradients_and_filters_equal_mergekit_for_every_layer_count():
    data = _gradients()
    assert len(data["values"]) > 100
    for row in data["values"]:
        s = Schedule.parse(data["settings"][row["setting"]])
        block = None if row["n_layers"] is None else BlockInfo("layers", row["layer"], row["n_layers"])
        assert s.value(row["name"], layer_position(block)) == pytest.approx(row["value"], abs=1e-12), row


def test_schedules_parse_from_cli_yaml_and_python_alike():
    py = [{"filter": "self_attn", "value": [0, 0.5, 1]}, {"filter": "mlp", "value": 0.3}, {"value": 0.5}]
    assert Schedule.parse("[0,0.5,1]@self_attn;0.3@mlp;0.5") == Schedule.parse(py)
    assert Schedule.parse("[{filter: self_attn, value: [0, 0.5, 1]}, {filter: mlp, value: 0.3}, {value: 0.5}]") \
        == Schedule.parse(py)
    assert Schedule.parse("0,0.5,1") == Schedule.parse([0, 0.5, 1]) == Schedule.parse("[0, 0.5, 1]")
    m = get_method("slerp")
    p = m.parse({"t": "[0,0.5,1]@self_attn;0.3@mlp;0.5"})
    assert m.describe_params(p) == {"t": [{"filter": "self_attn", "value": [0.0, 0.5, 1.0]},
                                          {"filter": "mlp", "value": 0.3}, {"value": 0.5}]}
    again = m.parse(json.loads(json.dumps(m.describe_params(p))))  # a recipe re-parses to the same schedule
    assert again == p


def test_schedule_ranges_and_bad_values_are_one_line_errors():
    with pytest.raises(ParameterError, match="'t' = 1.5 is out of range"):
        get_method("slerp").parse({"t": [0, 1.5]})
    with pytest.raises(ParameterError, match="not a number"):
        get_method("slerp").parse({"t": "[0,x]"})
    with pytest.raises(ParameterError, match="scope=tensor"):
        get_method("ties").parse({"density": [0.2, 0.8]})


def test_resolve_params_per_tensor_and_per_input():
    m = get_method("ties")
    p = m.parse({"density": "[0.2,1.0]@mlp;0.5", "scope": "tensor",
                 "weights": [[0, 1], {"filter": "self_attn", "value": 2.0}]})
    r = resolve_params(p, "model.layers.3.mlp.up.weight", 0.25)
    assert r.density == pytest.approx(0.4) and r.weights == (0.25, 1.0)  # unmatched per-input filter → 1
    r = resolve_params(p, "model.layers.0.self_attn.q.weight", 0.0)
    assert r.density == 0.5 and r.weights == (0.0, 2.0)
    assert resolve_params(m.parse({}), "x", 0.3) == m.parse({})


def test_schedule_in_a_real_merge_follows_the_layers(tmp_path):
    """slerp with t over the layers: layer 0 is the first model, the last layer the second."""
    base = make_base("llama", str(tmp_path / "base"), layers=3)
    a = make_finetune(base, str(tmp_path / "a"), seed=1, scale=0.5)
    b = make_finetune(base, str(tmp_path / "b"), seed=2, scale=0.5)
    res = hubsoup.merge([a, b], method="slerp", out=str(tmp_path / "o"), quiet=True,
                        t="[0,1]@self_attn;0.5")  # no base and none in the cards: the first input is the layout
    from method_helpers import state

    got, sa, sb = state(res.path), state(a), state(b)
    q0, q2 = "model.layers.0.self_attn.q_proj.weight", "model.layers.2.self_attn.q_proj.weight"
    torch.testing.assert_close(got[q0], sa[q0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[q2], sb[q2], rtol=1e-5, atol=1e-6)
    mlp = "model.layers.1.mlp.up_proj.weight"
    assert not torch.allclose(got[mlp], sa[mlp]) and not torch.allclose(got[mlp], sb[mlp])
    assert res.recipe.params["t"][0] == {"filter": "self_attn", "value": [0.0, 1.0]}


def test_schedule_from_the_command_line_equals_the_api(tmp_path):
    """`--param 't=[0,1]@self_attn;0.5'` on the CLI is the same schedule, and the same model, as the API's."""
    from hubsoup.cli import main
    from method_helpers import state

    base = make_base("llama", str(tmp_path / "base"), layers=3)
    a = make_finetune(base, str(tmp_path / "a"), seed=1, scale=0.5)
    b = make_finetune(base, str(tmp_path / "b"), seed=2, scale=0.5)
    api = hubsoup.merge([a, b], method="slerp", out=str(tmp_path / "api"), quiet=True, t="[0,1]@self_attn;0.5")
    rc = main(["merge", a, b, "--method", "slerp", "--param", "t=[0,1]@self_attn;0.5", "--out",
               str(tmp_path / "cli"), "--quiet"])
    assert rc == 0
    got, want = state(str(tmp_path / "cli")), state(api.path)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert hubsoup.MergeResult.from_folder(str(tmp_path / "cli")).recipe.hash == api.recipe.hash


def _lowbias32(x: int) -> int:  # the reference, in Python integers
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def _draw(seed: int, j: int) -> int:  # entry j's 24 bits: its block's key, then one round over its place in it
    k1, k2 = seed & 0xFFFFFFFF, seed >> 32
    key = _lowbias32(_lowbias32(((j >> 16) & 0xFFFFFFFF) ^ k1) ^ k2)
    return _lowbias32((j & 0xFFFF) ^ key) >> 8


def test_counter_masks_are_one_stream_whole_in_pieces_and_by_reference():
    """DARE's mergekit-convention masks (hubsoup.methods._sparsify.counter_mask): entry j's draw depends on
    the seed and j only (so a GPU draws the same mask: tests/engine/test_gpu.py), uniform, independent across seeds,
    across entries and across blocks of 2¹⁶."""
    from hubsoup.methods._sparsify import COUNTER_CHUNK, counter_bits, counter_mask

    seed = 0x5DEECE66D_1234567 & ((1 << 63) - 1)
    for j in (0, 1, 2, 4095, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 5, 2**48 + 3):  # blocks past 2³²
        assert int(counter_bits(seed, j, 1)[0]) == _draw(seed, j), j
    for start in (0, 65536 - 1000, 2**31 - 1000, 2**32 - 777):  # across blocks, the sign bit and 2³²
        got = counter_bits(seed, start, 2003).tolist()
        assert got == [_draw(seed, start + i) for i in range(2003)]
    n = COUNTER_CHUNK + 12345
    whole = counter_mask(n, 0.3, seed)
    parts = torch.cat([counter_mask(5000, 0.3, seed), counter_mask(n - 5000, 0.3, seed, offset=5000)])
    assert torch.equal(whole, parts)
    assert abs(float(whole.float().mean()) - 0.3) < 0.003
    other = counter_mask(n, 0.3, seed + 1)  # another input or tensor: independent
    assert abs(float((whole & other).float().mean()) - 0.09) < 0.002
    w = whole.float()
    assert abs(float((w[1:] * w[:-1]).mean()) - 0.09) < 0.002  # neighbours: independent
    blocks = w[:16 * 65536].view(16, 65536)
    assert abs(float((blocks[1:] * blocks[:-1]).mean()) - 0.09) < 0.002  # the same place in the next block
    top = counter_bits(seed, 0, 1 << 20) >> 16  # the top 8 of the 24 bits: flat
    counts = torch.bincount(top.long(), minlength=256).double()
    assert float(((counts - counts.mean()) ** 2 / counts.mean()).sum()) < 330  # chi², 255 dof: p ≈ 0.001
    low = counter_bits(seed, 0, 1 << 20) & 0xFF  # and the low 8
    counts = torch.bincount(low.long(), minlength=256).double()
    assert float(((counts - counts.mean()) ** 2 / counts.mean()).sum()) < 330
    assert not counter_mask(n, 0.0, seed).any() and counter_mask(n, 1.0, seed).all()
