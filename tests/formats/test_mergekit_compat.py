"""mergekit configs run by hubsoup give mergekit's models (issue 14).

Every config under ``tests/fixtures/mergekit/`` (the shapes model cards publish: slerp with
gradients and filters, ties/dare_ties with per-model weights and densities, task arithmetic,
linear with and without normalize, breadcrumbs, della, model_stock, nuslerp, passthrough
frankenmerges, per-slice merges, tokenizer_source, dtypes) is run by hubsoup on tiny Llama
models rebuilt from seeds, and compared with the output mergekit 0.1.5 produced from the same
models (checked in; ``tests/tools/make_mergekit_compat_fixtures.py`` regenerates them):

* deterministic methods: every tensor equal within the rounding of the output dtype — float32:
  |diff| ≤ 1e-6 (hubsoup and mergekit sum in different orders); bfloat16 / float16: at most one
  unit in the last place at the tensor's largest magnitude (mergekit casts the inputs to that
  dtype and computes in it when the config says ``dtype: bfloat16``, so its error is the inputs'
  rounding, of that order; hubsoup computes in float32 and rounds once);
* random methods (dare_ties, dare_linear, della, della_linear): equal in distribution over the
  model's task vector τ = θ − θ₀ — the kept fraction (a binomial proportion over n entries), the
  mean and standard deviation of the kept entries and the L1 norm (its ratio to the unmasked
  Σ wᵢτᵢ's is the rescale). Each hubsoup–mergekit difference must be within 4.5 standard errors
  of a two-sample difference (the errors estimated from the data: p(1−p)/n for the fraction,
  σ²/n for the mean, σ²(κ−1)/(4n) for the standard deviation), so a seed change fails with
  probability < 1e-5 per check; on these tiny models (~2 900 entries) a kept-fraction shift of
  about 0.05 or more, or a change of scale (another rescale or normalisation) of a few percent in
  L1, is detected. For the linear variants the
  kept fraction is also checked against its exact expectation 1 − Πᵢ(1 − dᵢ).

The table of results is written to ``benchmarks/results/mergekit_compat.md`` when every config
has run and ``HUBSOUP_WRITE_RESULTS=1`` is set (a plain test run leaves the tree untouched):
``HUBSOUP_WRITE_RESULTS=1 python -m pytest -q tests/formats/test_mergekit_compat.py``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys

import pytest
import torch
import yaml

from paths import TESTS as HERE
sys.path.insert(0, os.path.join(HERE, "tools"))
from make_mergekit_compat_fixtures import CONFIGS, build_models, model_tensors  # noqa: E402

FIX = os.path.join(HERE, "fixtures", "mergekit")
TABLE = os.path.join(os.path.dirname(HERE), "benchmarks", "results", "mergekit_compat.md")
with open(os.path.join(FIX, "manifest.json"), encoding="utf-8") as _f:
    MANIFEST = json.load(_f)
NAMES = sorted(MANIFEST["configs"])
ROWS: dict[str, dict] = {}
Z_MAX = 4.5
REAL_SECTION = "<!-- mergekit_real -->"  # where tests/formats/test_mergekit_real.py writes its rows


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny input models under a fresh folder, bit-identical to those mergekit read."""
    root = str(tmp_path_factory.mktemp("mk-models"))
    digests = build_models(root)
    if digests != MANIFEST["models"]:
        bad = [k for k in digests if digests[k] != MANIFEST["models"].get(k)]
        pytest.fail(f"rebuilt input models differ from those of the fixtures ({', '.join(bad)}): torch's "
                    "seeded draws changed? regenerate with tests/tools/make_mergekit_compat_fixtures.py")
    return root


@pytest.fixture(scope="module", autouse=True)
def write_table():
    yield
    if set(ROWS) == set(NAMES) and os.environ.get("HUBSOUP_WRITE_RESULTS") == "1":
        os.makedirs(os.path.dirname(TABLE), exist_ok=True)
        tail = ""  # the real configs' section (tests/formats/test_mergekit_real.py) stays
        if os.path.isfile(TABLE):
            with open(TABLE, encoding="utf-8") as f:
                old = f.read()
            if REAL_SECTION in old:
                tail = "\n" + REAL_SECTION + old.split(REAL_SECTION, 1)[1]
        with open(TABLE, "w", encoding="utf-8") as f:
            f.write(render_table() + tail)


def render_table() -> str:
    lines = ["# mergekit compatibility: hubsoup vs mergekit 0.1.5 on the same tiny Llama models", "",
             "Written by `HUBSOUP_WRITE_RESULTS=1 python -m pytest -q tests/formats/test_mergekit_compat.py` (fixtures: `tests/fixtures/mergekit/`, made by "
             "`tests/tools/make_mergekit_compat_fixtures.py` with the real mergekit). Deterministic methods: "
             "max |diff| over every tensor (and in units in the last place of the output dtype at each tensor's largest magnitude). Random "
             "methods: statistics of τ = θ − θ₀ over the whole model, hubsoup / mergekit, and the largest "
             "two-sample z-score (pass: ≤ 4.5).", "",
             "| config | mergekit method | hubsoup method (options) | dtype | layers | result | pass |",
             "|---|---|---|---|---|---|---|"]
    for name in NAMES:
        r = ROWS[name]
        lines.append(f"| `{name}` | {r['mk']} | {r['hub']} | {r['dtype']} | {r['layers']} | {r['result']} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines) + "\n"


BENCH = os.path.join(os.path.dirname(TABLE), "mergekit_real_bench.json")


def render_bench(path: str = BENCH) -> str:
    """The speed section of ``mergekit_compat.md``: ``benchmarks/bench_mergekit_real.py``'s last run (its JSON),
    hubsoup and mergekit side by side on the largest real configs (wall time, peak RSS); "" without the JSON."""
    if not os.path.isfile(path):
        return ""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    meta, machine = data["meta"], data["meta"].get("machine", {})
    lines = ["", "## Speed and memory on the largest real configs", "",
             f"From `benchmarks/results/{os.path.basename(path)}`, written by `python benchmarks/bench_mergekit_real.py "
             f"--hidden {meta['hidden']} --vocab {meta['vocab']}`: each config on stand-ins of its architecture and "
             f"depth at hidden {meta['hidden']}, each merge its own process, both tools in the same run on "
             f"{machine.get('cpu', '?')} ({machine.get('cores', '?')} cores, shared: load {meta.get('load1', 0):.1f}; "
             f"hubsoup at {machine.get('hubsoup_git_head', '?')}). Speed-up = mergekit wall ÷ hubsoup wall; "
             "memory = mergekit peak RSS ÷ hubsoup's.", "",
             "| config | method | models | layers | hubsoup wall (s) | mergekit wall (s) | speed-up | "
             "hubsoup peak RSS (MB) | mergekit peak RSS (MB) | memory |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def cell(run: dict, key: str) -> str:
        return f"{run[key]:g}" if run.get("rc") == 0 else f"failed: {str(run.get('error', '?'))[:80]}"

    for r in data["rows"]:
        h, m = r["hubsoup"], r["mergekit"]
        lines.append(f"| `{r['config']}` | {r['method']} | {r['models']} | {r['layers']} | {cell(h, 'wall_s')} | "
                     f"{cell(m, 'wall_s')} | {r.get('speedup', '—')}× | {cell(h, 'maxrss_mb')} | "
                     f"{cell(m, 'maxrss_mb')} | {r.get('memory_ratio', '—')}× |")
    return "\n".join(lines) + "\n"


def test_the_speed_section_is_the_benchmarks_and_holds_no_local_path(tmp_path):
    """Every benchmarked config is a row with both tools' wall time and peak RSS; nothing local is committed."""
    with open(BENCH, encoding="utf-8") as f:
        raw = f.read()
    assert "/tmp" not in raw and "/work/" not in raw and "/home/" not in raw
    data = json.loads(raw)
    text = render_bench()
    for r in data["rows"]:
        row = next(ln for ln in text.splitlines() if ln.startswith(f"| `{r['config']}` |"))
        assert f"{r['hubsoup']['wall_s']:g}" in row and f"{r['mergekit']['maxrss_mb']:g}" in row
        assert f"{r['speedup']}×" in row
    assert render_bench(str(tmp_path / "none.json")) == ""


def load_dir(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for fn in sorted(os.listdir(folder)):
        if fn.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, fn)))
    return out


def run_hubsoup(name: str, models: str, tmp_path, monkeypatch):
    import hubsoup

    monkeypatch.chdir(models)  # mergekit resolves `tiny-llama/base` against the working folder; so does hubsoup
    return hubsoup.run_recipe(os.path.join(FIX, f"{name}.yml"), str(tmp_path / name), quiet=True)


def ulp(t: torch.Tensor, dtype: torch.dtype) -> float:
    """One unit in the last place of ``dtype`` at the largest magnitude of ``t``."""
    mag = max(float(t.double().abs().max()), torch.finfo(dtype).tiny)
    return 2.0 ** math.floor(math.log2(mag)) * torch.finfo(dtype).eps


def assert_like_mergekit(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    """hubsoup's tensors against mergekit's: the same names, dtypes and shapes, each within 1e-5 relative
    (of the largest magnitude) or one ulp of its dtype."""
    assert sorted(got) == sorted(ref)
    for k, r in ref.items():
        g = got[k]
        assert g.dtype == r.dtype and g.shape == r.shape, k
        diff = (g.float() - r.float()).abs().max().item()
        rel = diff / max(r.float().abs().max().item(), 1e-30)
        assert rel <= 1e-5 or diff <= ulp(r, r.dtype), f"{k}: {rel:.3g} relative from mergekit's"


def tau_stats(tensors: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> dict[str, float]:
    tau = torch.cat([(tensors[k].double() - base[k].double()).flatten() for k in sorted(base)])
    kept = tau[tau != 0]
    m = kept.mean()
    sd = kept.std()
    kurt = float(((kept - m) ** 4).mean() / sd ** 4)
    return {"n": tau.numel(), "kept": kept.numel() / tau.numel(), "mean": float(m), "std": float(sd),
            "kurt": kurt, "l1": float(tau.abs().sum()), "n_kept": kept.numel()}


def unmasked_l1(name: str, base: dict[str, torch.Tensor]) -> tuple[float, list[float]]:
    """L1 of Σ wᵢ τᵢ (no pruning, no consensus) and the densities, from the config."""
    cfg = yaml.safe_load(CONFIGS[name][1])
    seeds = {"tiny-llama/base": 0, "tiny-llama/ft-a": 1, "tiny-llama/ft-b": 2, "tiny-llama/ft-c": 3}
    total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in base.items()}
    dens = []
    for m in cfg["models"]:
        p = m.get("parameters") or {}
        if m["model"] == cfg["base_model"]:
            continue
        ft = model_tensors(seeds[m["model"]])
        for k in total:
            total[k] += p["weight"] * (ft[k].double() - base[k].double())
        dens.append(p["density"])
    return float(sum(v.abs().sum() for v in total.values())), dens


def hub_method(result) -> str:
    opts = {k: v for k, v in result.recipe.params.items() if k in ("convention", "scope", "then", "combine", "merge",
                                                                   "use_base", "normalize")}
    return f"`{result.method}` " + ", ".join(f"{k}={v}" for k, v in opts.items())


@pytest.mark.parametrize("name", NAMES)
def test_config_matches_mergekit(name, models, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    info = MANIFEST["configs"][name]
    cfg = yaml.safe_load(CONFIGS[name][1])
    result = run_hubsoup(name, models, tmp_path, monkeypatch)
    ref = load_file(os.path.join(FIX, f"{name}.safetensors"))
    out = load_dir(result.path)
    row = {"mk": cfg["merge_method"], "hub": hub_method(result), "dtype": info["dtype"],
           "layers": info["num_hidden_layers"], "ok": False, "result": "failed"}
    ROWS[name] = row

    assert sorted(out) == sorted(ref), "the output's tensor names differ from mergekit's"
    for k in ref:
        assert out[k].shape == ref[k].shape, k
        assert out[k].dtype == ref[k].dtype, f"{k}: {out[k].dtype} vs mergekit's {ref[k].dtype}"
    with open(os.path.join(result.path, "config.json"), encoding="utf-8") as f:
        out_cfg = json.load(f)
    assert out_cfg["num_hidden_layers"] == info["num_hidden_layers"]
    assert (out_cfg.get("torch_dtype") or out_cfg.get("dtype")) == info["dtype"]
    for fn in info["tokenizer_files"]:
        assert os.path.isfile(os.path.join(result.path, fn)), f"no {fn} in the output"

    if info["kind"] == "exact":
        diff = max(float((out[k].double() - ref[k].double()).abs().max()) for k in ref)
        dtype = next(iter(ref.values())).dtype
        if dtype == torch.float32:
            row["result"] = f"max \\|diff\\| {diff:.2e}"
            assert diff <= 1e-6, f"max |diff| {diff:.3g} > 1e-6"
        else:
            ulps = max(float((out[k].double() - ref[k].double()).abs().max()) / ulp(ref[k], dtype) for k in ref)
            row["result"] = f"max \\|diff\\| {diff:.2e} ({ulps:.0f} ulp of {str(dtype)[6:]})"
            assert ulps <= 1, f"max |diff| is {ulps} ulp of {dtype}"
    else:
        base = model_tensors(0)
        h, m = tau_stats(out, base), tau_stats(ref, base)
        z_kept = abs(h["kept"] - m["kept"]) / math.sqrt(2 * m["kept"] * (1 - m["kept"]) / m["n"])
        z_mean = abs(h["mean"] - m["mean"]) / math.sqrt((h["std"] ** 2 + m["std"] ** 2) / m["n_kept"])
        se_std = m["std"] * math.sqrt(max(m["kurt"] - 1, 0.0) / (4 * m["n_kept"]))
        z_std = abs(h["std"] - m["std"]) / (math.sqrt(2) * se_std)
        l1_ref, dens = unmasked_l1(name, base)
        zs = {"kept": z_kept, "mean": z_mean, "std": z_std}
        if cfg["merge_method"].endswith("_linear"):  # no sign election: P(kept) = 1 − Π(1 − dᵢ) exactly
            p = 1 - math.prod(1 - d for d in dens)
            zs["kept vs theory"] = abs(h["kept"] - p) / math.sqrt(p * (1 - p) / h["n"])
        row["result"] = (f"kept {h['kept']:.3f} / {m['kept']:.3f}; rescale (L1 ÷ unmasked) {h['l1'] / l1_ref:.3f} / "
                         f"{m['l1'] / l1_ref:.3f}; kept mean {h['mean']:+.1e} / {m['mean']:+.1e}, std "
                         f"{h['std']:.4f} / {m['std']:.4f}; max z {max(zs.values()):.1f}")
        for what, z in zs.items():
            assert z <= Z_MAX, f"{what}: z = {z:.2f} (hubsoup {h}, mergekit {m})"
        assert abs(h["l1"] / m["l1"] - 1) <= 0.05, f"L1 of τ: hubsoup {h['l1']:.4g}, mergekit {m['l1']:.4g}"
    row["ok"] = True


# --- the reader: errors, records, round trips --------------------------------------------------------

def write(tmp_path, text: str) -> str:
    p = tmp_path / "mk.yml"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("text, key", [
    ("merge_method: ties\nbase_model: a/b\nmodels:\n  - model: c/d\nfoo: 1\n", "'weight' is required"),
    ("merge_method: linear\nmodels:\n  - model: c/d\n    parameters: {weight: 1}\nchat_template: chatmlx\n",
     "chat_template: 'chatmlx'"),
    ("merge_method: ties\nbase_model: a/b\nmodels:\n  - model: c/d\n    parameters: {weight: one}\n",
     "'models[0].parameters.weight' = 'one' is not a number"),
    ("merge_method: linear\nmodules:\n  text: {}\n", "'modules'"),
    ("merge_method: ties\nmodels:\n  - model: c/d\n    parameters: {weight: 1}\n", "needs 'base_model'"),
    ("merge_method: ties\nbase_model: a/b\nmodels:\n  - model: c/d\n", "'weight' is required"),
    ("merge_method: frobnicate\nbase_model: a/b\nmodels:\n  - model: c/d\n", "'frobnicate'"),
    ("merge_method: slerp\nbase_model: a/b\nmodels:\n  - model: c/d\n  - model: e/f\nparameters: {t: 0.5}\n",
     "exactly one other model"),
    ("merge_method: linear\nslices:\n  - sources:\n      - model: a/b\n        layer_range: [0, 2]\n"
     "      - model: c/d\n        layer_range: [0, 3]\n", "same number of layers"),
    ("merge_method: ties\nbase_model: a/b\nmodels:\n  - model: c/d\n    parameters: {weight: 1}\ndtype: int8\n",
     "'dtype'"),
])
def test_bad_configs_name_the_key(text, key):
    from hubsoup.errors import ParameterError
    from hubsoup.formats.mergekit import read_config

    with pytest.raises(ParameterError) as e:
        read_config(text, resolve=False)
    assert key in str(e.value)
    assert "\n" not in str(e.value)


def test_keys_mergekit_ignores_are_ignored_with_a_warning(caplog):
    """mergekit's config classes drop unknown keys and a method reads only the parameters it declares:
    hubsoup accepts the same configs, reads them the same way, and names each dropped key once."""
    from hubsoup.formats.mergekit import read_config

    text = """name: stage-1
merge_method: ties
base_model: a/b
select_topk: 0.5
int8_mask: true
pad_to_multiple_of: 64
models:
  - model: c/d
    weight: 1
    parameters:
      weight: "1e-1"
      dens: 0.5
      normalize: [true, false]
      density:
        - pattern: mlp
          value: 0.3
        - value: 0.2
parameters:
  normalize: "true"
  tol: 1e-10
"""
    with caplog.at_level("WARNING", logger="hubsoup.formats.mergekit"):
        m = read_config(text, resolve=False)
    # values as mergekit 0.1.5 resolves them (checked with its MergeConfiguration and evaluate_setting):
    # a string weight is a number, `pattern` is dropped so the first entry applies to every tensor
    assert m.params["weights"] == [0.1] and m.params["densities"] == [0.3] and m.params["merge"] == "mean"
    dropped = ["name", "select_topk", "int8_mask", "pad_to_multiple_of", "models[0].weight", "parameters.tol",
               "models[0].parameters.dens", "models[0].parameters.normalize", "models[0].parameters.density.pattern"]
    assert m.ignored == dropped
    said = [r.getMessage() for r in caplog.records]
    assert all(sum(f"'{k}' is ignored" in x for x in said) == 1 for k in dropped)
    # a slice's residual_weight and a source's revision: read by mergekit's classes, used nowhere
    m = read_config("merge_method: passthrough\nslices:\n  - sources:\n      - model: a/b\n        layer_range: [0, 2]\n"
                    "        revision: main\n    residual_weight: 0.5\n", resolve=False)
    assert m.ignored == ["slices[0].residual_weight", "slices[0].sources[0].revision"]


def test_named_and_auto_chat_templates(models, tmp_path, monkeypatch):
    """chat_template: a mergekit name is mergekit's template; auto is the plurality of the models' own."""
    import hubsoup
    from transformers import AutoTokenizer

    from hubsoup.formats.chat_template import NAMES, resolve

    assert set(NAMES) == {"alpaca", "chatml", "exaone", "llama3", "mistral"}
    monkeypatch.chdir(models)
    r = hubsoup.run_recipe(write(tmp_path, CONFIGS["task_arithmetic"][1] + "chat_template: chatml\n"),
                           str(tmp_path / "named"), quiet=True)
    tok = AutoTokenizer.from_pretrained(r.path)
    assert tok.chat_template == resolve("chatml")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "<|im_start|>user\nhi<|im_end|>\n"
    # auto: two models carry template B, one carries A (the base, first in order): B wins
    for ref, t in (("tiny-llama/base", "{{ 'A' }}{% for m in messages %}{{ m['content'] }}{% endfor %}"),
                   ("tiny-llama/ft-a", "{{ 'B' }}{% for m in messages %}{{ m['content'] }}{% endfor %}"),
                   ("tiny-llama/ft-b", "{{ 'B' }}{% for m in messages %}{{ m['content'] }}{% endfor %}")):
        with open(os.path.join(models, ref, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(t + "\n")
    try:
        r = hubsoup.run_recipe(write(tmp_path, CONFIGS["task_arithmetic"][1] + "chat_template: auto\n"),
                               str(tmp_path / "auto"), quiet=True)
    finally:
        for ref in ("tiny-llama/base", "tiny-llama/ft-a", "tiny-llama/ft-b"):
            os.remove(os.path.join(models, ref, "chat_template.jinja"))
    tok = AutoTokenizer.from_pretrained(r.path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "Bx"


def test_lora_on_the_base_is_the_adapter_input():
    from hubsoup.formats.mergekit import read_config

    m = read_config("merge_method: task_arithmetic\nbase_model: org/base\nmodels:\n"
                    "  - model: org/base+org/adapter@v1\n    parameters: {weight: 0.5}\n", resolve=False)
    assert m.inputs == ["org/adapter@v1"] and m.base == "org/base" and m.params["weights"] == [0.5]


def test_precedence_model_slice_top_and_filters():
    """mergekit's precedence (model, then top level), filters falling through to the next scope."""
    from hubsoup.formats.mergekit import read_config

    m = read_config("merge_method: ties\nbase_model: b/b\nparameters:\n  density: 0.3\n  weight: 0.1\nmodels:\n"
                    "  - model: a/a\n    parameters:\n      density:\n        - filter: mlp\n          value: [0.1, 0.9]\n"
                    "  - model: c/c\n    parameters: {weight: 2, density: 0.7}\n", resolve=False)
    assert m.params["densities"] == [[{"filter": "mlp", "value": [0.1, 0.9]}, {"value": 0.3}], 0.7]
    assert m.params["weights"] == [0.1, 2]
    assert m.params["merge"] == "mean" and m.params["scope"] == "tensor" and m.params["scale"] == 1.0


def test_run_records_config_card_yaml_and_reruns(models, tmp_path, monkeypatch):
    """The output's recipe keeps the config, its card shows it as YAML, and `hubsoup run OUTPUT` repeats it."""
    from hubsoup.cli import main
    from hubsoup.recipe import RECIPE_FILE, Recipe

    monkeypatch.chdir(models)
    cfg = os.path.join(FIX, "slerp_per_slice.yml")
    out = str(tmp_path / "a")
    assert main(["run", cfg, "--out", out, "--quiet"]) == 0
    with open(os.path.join(out, RECIPE_FILE), encoding="utf-8") as f:
        recipe = Recipe.from_yaml(f.read())
    with open(cfg, encoding="utf-8") as f:
        assert recipe.mergekit["config"] == f.read()
    assert recipe.options["layout"] == [[["tiny-llama/base", 0, 2], ["tiny-llama/ft-b", 0, 2]],
                                        [["tiny-llama/base", 2, 4], ["tiny-llama/ft-b", 2, 4]]]
    with open(os.path.join(out, "README.md"), encoding="utf-8") as f:
        card = f.read()
    assert "## mergekit configuration" in card and "```yaml" in card and "merge_method: slerp" in card
    assert models not in card  # local folders by name and digest only
    again = str(tmp_path / "b")
    assert main(["run", out, "--out", again, "--quiet"]) == 0
    a, b = load_dir(out), load_dir(again)
    assert all(torch.equal(a[k], b[k]) for k in a)
    with open(os.path.join(again, RECIPE_FILE), encoding="utf-8") as f:
        assert Recipe.from_yaml(f.read()).hash == recipe.hash


def test_layout_changes_the_hash(models, tmp_path, monkeypatch):
    """A frankenmerge of the same models is another merge: its layout is in the recipe hash."""
    import hubsoup

    monkeypatch.chdir(models)
    a = hubsoup.run_recipe(os.path.join(FIX, "passthrough_frankenmerge.yml"), str(tmp_path / "a"), quiet=True)
    (tmp_path / "other.yml").write_text(CONFIGS["passthrough_frankenmerge"][1].replace("[1, 4]", "[0, 3]"))
    b = hubsoup.run_recipe(str(tmp_path / "other.yml"), str(tmp_path / "b"), quiet=True)
    assert a.recipe.hash != b.recipe.hash
    assert a.recipe.options["donors"] and a.recipe.options["donors"][0]["path"].endswith("ft-b")


def test_hubsoup_method_from_mergekit_yaml(models, tmp_path, monkeypatch):
    """hubsoup's own methods (sftm, soup, ...) from the same YAML, with their own parameters."""
    import hubsoup

    monkeypatch.chdir(models)
    text = ("merge_method: soup\nbase_model: tiny-llama/base\nmodels:\n  - model: tiny-llama/ft-a\n"
            "  - model: tiny-llama/ft-b\nparameters:\n  scale: 0.7\n")
    r = hubsoup.run_recipe(write(tmp_path, text), str(tmp_path / "mk"), quiet=True)
    direct = hubsoup.merge(["tiny-llama/ft-a", "tiny-llama/ft-b"], method="soup", base="tiny-llama/base",
                           out=str(tmp_path / "direct"), scale=0.7, quiet=True)
    assert r.recipe.hash == direct.recipe.hash
    a, b = load_dir(r.path), load_dir(direct.path)
    assert all(torch.equal(a[k], b[k]) for k in a)
    text = text.replace("soup", "sftm").replace("scale: 0.7", "eta: 0.3")
    r = hubsoup.run_recipe(write(tmp_path, text), str(tmp_path / "sftm"), quiet=True)
    assert r.method == "sftm" and r.recipe.params["eta"] == 0.3


def test_tokenizer_source_of_another_vocabulary_re_maps_rows(models, tmp_path, monkeypatch):
    """A tokenizer_source of another vocabulary: the output takes it, every model's rows re-indexed to it
    (tests/formats/test_mergekit_vocab.py compares such merges with mergekit's own output)."""
    import hubsoup
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from hubsoup.testing import save_tiny_tokenizer

    other = os.path.join(models, "tiny-llama", "ft-other-vocab")
    shutil.copytree(os.path.join(models, "tiny-llama", "ft-a"), other)
    save_tiny_tokenizer(other, vocab=20)  # the first 20 tokens of the others', at the same ids
    monkeypatch.chdir(models)
    text = CONFIGS["linear_out_dtype_bfloat16"][1].replace("tokenizer_source: tiny-llama/ft-b",
                                                           "tokenizer_source: tiny-llama/ft-other-vocab")
    r = hubsoup.run_recipe(write(tmp_path, text), str(tmp_path / "out"), quiet=True)
    out, ref = load_dir(r.path), load_file(os.path.join(FIX, "linear_out_dtype_bfloat16.safetensors"))
    with open(os.path.join(r.path, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["vocab_size"] == 20
    assert AutoTokenizer.from_pretrained(r.path).get_vocab() == AutoTokenizer.from_pretrained(other).get_vocab()
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        assert out[k].shape == (20, 8)
        assert torch.equal(out[k], ref[k][:20]), k


def test_export_config_round_trip(models, tmp_path, monkeypatch, capsys):
    """export-config: a hubsoup merge → a mergekit config that hubsoup (and mergekit) run to the same model."""
    import hubsoup
    from hubsoup.cli import main

    monkeypatch.chdir(models)
    r = hubsoup.merge(["tiny-llama/ft-a", "tiny-llama/ft-b"], method="ties", base="tiny-llama/base",
                      out=str(tmp_path / "ties"), convention="mergekit", scope="tensor", densities=[0.5, 0.3],
                      weights=[1.0, 0.5], quiet=True)
    cfg = str(tmp_path / "exported.yml")
    assert main(["export-config", r.path, "-o", cfg]) == 0
    assert capsys.readouterr().out.startswith("wrote ")
    with open(cfg, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    assert data["merge_method"] == "ties" and data["models"][1]["parameters"] == {"weight": 0.5, "density": 0.3}
    again = hubsoup.run_recipe(cfg, str(tmp_path / "again"), quiet=True)
    a, b = load_dir(r.path), load_dir(again.path)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # a merge made from a mergekit config gives its config back
    mk = hubsoup.run_recipe(os.path.join(FIX, "slerp_gradient_filters.yml"), str(tmp_path / "mk"), quiet=True)
    assert main(["export-config", mk.path]) == 0
    with open(os.path.join(FIX, "slerp_gradient_filters.yml"), encoding="utf-8") as f:
        assert capsys.readouterr().out == f.read()
    # a merge computed in bfloat16 (compute_dtype, as mergekit computes a `dtype: bfloat16` config) exports that
    # dtype, and the exported config recomputes it so; float32 compute exports `dtype: float32` + out_dtype
    kw = dict(method="model_stock", base="tiny-llama/base", dtype="bfloat16", quiet=True)
    h = hubsoup.merge(["tiny-llama/ft-a", "tiny-llama/ft-b"], out=str(tmp_path / "ms-bf16"),
                      params={"compute_dtype": "bfloat16"}, **kw)
    f = hubsoup.merge(["tiny-llama/ft-a", "tiny-llama/ft-b"], out=str(tmp_path / "ms-f32"), **kw)
    assert main(["export-config", h.path, "-o", cfg]) == 0
    with open(cfg, encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    assert data["dtype"] == "bfloat16" and "out_dtype" not in data
    a, b = load_dir(h.path), load_dir(hubsoup.run_recipe(cfg, str(tmp_path / "ms-again"), quiet=True).path)
    assert all(torch.equal(a[k], b[k]) for k in a) and any(not torch.equal(a[k], v) for k, v in load_dir(f.path).items())
    assert main(["export-config", f.path, "-o", cfg]) == 0
    with open(cfg, encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    assert (data["dtype"], data["out_dtype"]) == ("float32", "bfloat16")
    capsys.readouterr()
    # no mergekit equivalent: one line naming the method
    s = hubsoup.merge(["tiny-llama/ft-a", "tiny-llama/ft-b"], method="sftm", base="tiny-llama/base",
                      out=str(tmp_path / "sftm"), quiet=True)
    assert main(["export-config", s.path]) == 2
    err = capsys.readouterr().err
    assert "sftm" in err and "no mergekit equivalent" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("method,inputs,params", [
    ("nearswap", ["tiny-llama/ft-a"], {"t": 0.01}),
    ("ram", ["tiny-llama/ft-a", "tiny-llama/ft-b"], {"epsilon": 0.01}),
    ("ramplus_tl", ["tiny-llama/ft-a", "tiny-llama/ft-b"], {"r": 0.5, "alpha": 0.5, "epsilon": 0.02}),
    ("ramplus_tl", ["tiny-llama/ft-a", "tiny-llama/ft-b"], {"epsilon": 0.02, "compute_dtype": "bfloat16"}),
    ("arcee_fusion", ["tiny-llama/ft-c"], {}),
])
def test_export_config_of_mergekits_last_methods_runs_back(method, inputs, params, models, tmp_path, monkeypatch):
    """nearswap, ram, ramplus_tl and arcee_fusion merges export as the mergekit config of the same merge (their
    parameters under mergekit's names; `out_dtype` wherever mergekit would otherwise store another dtype:
    ramplus_tl and arcee_fusion return float32 whatever they compute in), and that config runs to the same model."""
    import hubsoup
    from hubsoup.formats.mergekit import METHODS, export_config

    monkeypatch.chdir(models)
    r = hubsoup.merge(inputs, method=method, base="tiny-llama/base", dtype="bfloat16", out=str(tmp_path / "m"),
                      params=params, quiet=True)
    data = yaml.safe_load(export_config(r.recipe))
    assert data["merge_method"] == method and data["base_model"].endswith("tiny-llama/base")
    given = {k: v for k, v in params.items() if k != "compute_dtype"}
    assert given.items() <= data.get("parameters", {}).items()
    assert set(data.get("parameters", {})) <= set(METHODS[method].params)  # mergekit's names only
    assert (data["dtype"], data["out_dtype"]) == (params.get("compute_dtype", "float32"), "bfloat16")
    cfg = tmp_path / "exported.yml"
    cfg.write_text(export_config(r.recipe), encoding="utf-8")
    a, b = load_dir(r.path), load_dir(hubsoup.run_recipe(str(cfg), str(tmp_path / "again"), quiet=True).path)
    assert sorted(a) == sorted(b) and all(a[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in a)


def test_distribution_check_catches_another_density(models, tmp_path, monkeypatch):
    """The statistics catch a slip: DARE keeping 0.7 instead of 0.4 of one input fails the kept-fraction check.

    (Power: with the model's ~2 900 entries a two-sample difference of the kept fraction is
    detected from about 0.05 up; 0.88 against 0.76 is about ten standard errors.)
    """
    import hubsoup
    from safetensors.torch import load_file

    monkeypatch.chdir(models)
    text = CONFIGS["dare_linear"][1].replace("density: 0.4", "density: 0.7")
    r = hubsoup.run_recipe(write(tmp_path, text), str(tmp_path / "out"), quiet=True)
    base = model_tensors(0)
    h = tau_stats(load_dir(r.path), base)
    m = tau_stats(load_file(os.path.join(FIX, "dare_linear.safetensors")), base)
    z = abs(h["kept"] - m["kept"]) / math.sqrt(2 * m["kept"] * (1 - m["kept"]) / m["n"])
    assert z > Z_MAX  # 1 − 0.3·0.4 = 0.88 against 1 − 0.6·0.4 = 0.76


def test_chat_template_literal(models, tmp_path, monkeypatch):
    """chat_template: a literal Jinja template is saved with the output's tokenizer; names are refused (above)."""
    import hubsoup
    from transformers import AutoTokenizer

    monkeypatch.chdir(models)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    text = CONFIGS["task_arithmetic"][1] + f"chat_template: \"{template}\"\n"
    r = hubsoup.run_recipe(write(tmp_path, text), str(tmp_path / "out"), quiet=True)
    tok = AutoTokenizer.from_pretrained(r.path)
    assert tok.chat_template == template
    assert r.recipe.options["chat_template"]


def test_overwrite_never_deletes_a_slice_donor(models, tmp_path, monkeypatch):
    """--overwrite onto a model a slice copies from (not an input of the job) is refused, and the model stays."""
    import hubsoup
    from hubsoup.errors import ParameterError

    from hubsoup.errors import OutputExistsError
    from hubsoup.output.folder import MARKER, write_marker

    monkeypatch.chdir(models)
    donor = os.path.join(models, "tiny-llama", "ft-b")
    with pytest.raises(OutputExistsError, match="hubsoup did not make it"):  # a model folder: not hubsoup's (issue 44)
        hubsoup.run_recipe(os.path.join(FIX, "passthrough_frankenmerge.yml"), donor, overwrite=True, quiet=True)
    write_marker(donor, "merge")  # even a folder hubsoup made, when a slice copies from it
    try:
        with pytest.raises(ParameterError, match="would delete it"):
            hubsoup.run_recipe(os.path.join(FIX, "passthrough_frankenmerge.yml"), donor, overwrite=True, quiet=True)
    finally:
        os.remove(os.path.join(donor, MARKER))
    assert os.path.isfile(os.path.join(donor, "model.safetensors"))


# --- mergekit-yaml's command line and mergekit-multi's stages --------------------------------------

def test_run_takes_mergekit_yaml_arguments(models, tmp_path, monkeypatch, caplog):
    """`hubsoup run CONFIG OUT_PATH` with mergekit-yaml's flags: honoured where they mean something here."""
    from hubsoup.cli import main
    from hubsoup.recipe import RECIPE_FILE, Recipe

    monkeypatch.chdir(models)
    cfg = write(tmp_path, CONFIGS["dare_linear"][1])
    out = str(tmp_path / "out")
    with caplog.at_level("WARNING"):
        rc = main(["run", cfg, out, "--no-copy-tokenizer", "--allow-crimes", "--lazy-unpickle",
                   "--lora-merge-cache", "/tmp/x", "--out-shard-size", "1K", "--random-seed", "3", "-q"])
    assert rc == 0
    files = os.listdir(out)
    assert not any(f.startswith("tokenizer") for f in files) and "config.json" in files
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 3 and all(os.path.getsize(os.path.join(out, f)) < 1000 * 4 + 4096 for f in shards)
    with open(os.path.join(out, RECIPE_FILE), encoding="utf-8") as f:
        assert Recipe.from_yaml(f.read()).params["seed"] == 3
    said = " ".join(r.getMessage() for r in caplog.records)
    for flag in ("--allow-crimes", "--lazy-unpickle", "--lora-merge-cache"):
        assert f"{flag}: accepted for mergekit-yaml compatibility, no effect here" in said
    # the same config with another seed draws other masks
    assert main(["run", cfg, "--out", str(tmp_path / "seed4"), "--random-seed", "4", "-q"]) == 0
    a, b = load_dir(out), load_dir(str(tmp_path / "seed4"))
    assert any(not torch.equal(a[k], b[k]) for k in a)
    assert main(["run", cfg, str(tmp_path / "x"), "--unsafe-truncate-embeddings"]) == 2


STAGES = """\
name: blend
merge_method: linear
models:
  - model: tiny-llama/ft-a
    parameters: {weight: 0.7}
  - model: tiny-llama/ft-b
    parameters: {weight: 0.3}
---
merge_method: slerp
base_model: tiny-llama/base
models:
  - model: blend
parameters:
  t: [0.2, 0.8]
dtype: float32
"""


def test_multi_stage_config_merges_each_stage_in_order(models, tmp_path, monkeypatch):
    """A mergekit-multi stream: the named stage is merged first, kept, and the final stage merges it."""
    import hubsoup

    monkeypatch.chdir(models)
    inter = tmp_path / "stages"
    r = hubsoup.run_recipe(write(tmp_path, STAGES), str(tmp_path / "final"), quiet=True,
                           intermediate_dir=str(inter))
    assert os.listdir(inter) == ["blend"]
    # the same two merges by hand: the stage's output, then the final config naming its folder
    first, _, second = STAGES.partition("---\n")
    hubsoup.run_recipe(write(tmp_path, first.replace("name: blend\n", "")), str(tmp_path / "blend"), quiet=True)
    (tmp_path / "second.yml").write_text(second.replace("model: blend", f"model: {tmp_path / 'blend'}"))
    by_hand = hubsoup.run_recipe(str(tmp_path / "second.yml"), str(tmp_path / "by-hand"), quiet=True)
    a, b = load_dir(r.path), load_dir(by_hand.path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    card = r.card
    assert "## Merge stages" in card and "**blend**" in card and "**final merge**" in card
    stages = card.split("## Merge stages", 1)[1].split("\n## ", 1)[0]
    assert str(tmp_path) not in stages and "model: blend@sha256:" in stages  # a stage's folder by its public form


@pytest.mark.parametrize("text, message", [
    ("name: a\nmerge_method: linear\nmodels: [{model: b}]\n---\nname: b\nmerge_method: linear\nmodels: [{model: a}]\n",
     "in a circle"),
    ("name: a\nmerge_method: linear\nmodels: [{model: x/y}]\n---\nname: a\nmerge_method: linear\nmodels: [{model: a}]\n",
     "two stages are named 'a'"),
    ("merge_method: linear\nmodels: [{model: x/y}]\n---\nmerge_method: linear\nmodels: [{model: x/z}]\n",
     "more than one unnamed"),
    ("merge_method: linear\nmodels: [{model: x/y}]\n---\na: &a [x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
     "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n"
     "f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n", "too many YAML nodes"),  # an alias bomb in a later document
])
def test_bad_stage_streams_are_refused(text, message):
    from hubsoup.errors import ParameterError
    from hubsoup.formats.stages import read_stages

    with pytest.raises(ParameterError, match=message):
        read_stages(text)


@pytest.mark.parametrize("name, method, kwargs", [
    ("exported_ties_bfloat16", "ties", dict(inputs=["tiny-llama/ft-a", "tiny-llama/ft-b"], convention="mergekit",
                                           scope="tensor", densities=[0.5, 0.3], weights=[1.0, 0.5], dtype="bfloat16")),
    ("exported_wise_ft_float16", "wise_ft", dict(inputs=["tiny-llama/ft-a"], gamma=0.3, dtype="float16")),
])
def test_export_config_makes_mergekit_reproduce_the_merge(name, method, kwargs, models, tmp_path, monkeypatch):
    """export-config of a half-precision merge says `dtype: float32` + `out_dtype` (mergekit computes in `dtype`;
    `dtype: bfloat16` alone made it recompute in bf16, 82 ulp off), WiSE-FT as the task arithmetic it is; the
    fixture is mergekit's own output on exactly the exported config, and equals hubsoup's merge."""
    import hubsoup
    from safetensors.torch import load_file

    from hubsoup.formats.mergekit import export_config

    monkeypatch.chdir(models)
    inputs = kwargs.pop("inputs")
    r = hubsoup.merge(inputs, method=method, base="tiny-llama/base", out=str(tmp_path / name), quiet=True, **kwargs)
    exported = yaml.safe_load(export_config(r.recipe))
    rel = lambda ref: os.path.relpath(ref, models)  # noqa: E731 - the recipe pins local inputs by absolute path
    exported["base_model"] = rel(exported["base_model"])
    for m in exported["models"]:
        m["model"] = rel(m["model"])
    assert exported == yaml.safe_load(CONFIGS[name][1])
    ref, out = load_file(os.path.join(FIX, f"{name}.safetensors")), load_dir(r.path)
    assert sorted(out) == sorted(ref)
    for k in ref:
        assert out[k].dtype == ref[k].dtype
        assert float((out[k].double() - ref[k].double()).abs().max()) <= ulp(ref[k], ref[k].dtype), k


@pytest.mark.parametrize("name", ["ties_compute_bfloat16", "breadcrumbs_ties_compute_float16", "sce_compute_bfloat16",
                                  "task_arithmetic_float16", "ram_compute_bfloat16", "ramplus_tl_compute_bfloat16"])
def test_half_precision_configs_compute_as_mergekit(name, models, tmp_path, monkeypatch):
    """mergekit computes in its config's dtype (every step rounds: τ, masks, weights, signs, sums): hubsoup then
    does too (compute_dtype), and its output is mergekit's bit for bit; in float32 it is not (ranks and signs
    change on the rounded deltas). ramplus_tl's result is float32 (mergekit's float32 scale promotes it): stored
    so, under a config.json that names the config's dtype, as mergekit's."""
    from safetensors.torch import load_file

    from hubsoup.formats.mergekit import read_config

    half = "bfloat16" if "bfloat16" in name else "float16"
    assert read_config(CONFIGS[name][1], resolve=False).params["compute_dtype"] == half
    ref = load_file(os.path.join(FIX, f"{name}.safetensors"))
    out = load_dir(run_hubsoup(name, models, tmp_path, monkeypatch).path)
    if all(r.dtype == torch.float32 for r in ref.values()):  # ramplus_tl: float32 out of a bf16 computation
        # the engine adds τ to the base in float32: where mergekit's float32 result r − θ₀ needs more bits than a
        # float32 holds (r and θ₀ in different binades), τ = fl(r − θ₀) rounds, and θ₀ + τ lands within one ulp
        # of τ or of r (the larger) from r: bit for bit elsewhere
        base, near = model_tensors(0), 0
        for k, r in ref.items():
            tau = (r - base[k]).abs()
            ulps = torch.maximum(torch.nextafter(tau, tau + 1) - tau, torch.nextafter(r.abs(), r.abs() + 1) - r.abs())
            assert bool(((out[k] - r).abs() <= ulps).all()), k
            near += int((out[k] != r).sum())
        assert near <= 0.02 * sum(r.numel() for r in ref.values()), near
    else:
        assert all(torch.equal(out[k], ref[k]) for k in ref)
    # the same merge computed in float32 (hubsoup's own default) is not mergekit's
    import hubsoup

    m = read_config(CONFIGS[name][1], resolve=False)
    params = {**m.params, "compute_dtype": "float32"}
    r = hubsoup.merge(m.inputs, method=m.method, base=m.base, params=params, dtype=m.dtype,
                      out=str(tmp_path / "f32"), quiet=True)
    f32 = load_dir(r.path)
    assert sum(int((f32[k] != ref[k]).sum()) for k in ref) > 10


def test_magnitude_ties_at_the_cut_off_fall_as_in_mergekit():
    """Equal magnitudes at the density cut-off: the kept ones are those mergekit's own argsort keeps."""
    from hubsoup.methods._sparsify import magnitude_mask

    x = torch.tensor([0.5, -1.0, 0.5, 2.0, -0.5, 0.5, 0.25, 0.5] * 64)
    for density in (0.3, 0.5, 0.6):
        k = max(1, int(density * x.numel()))
        want = torch.zeros(x.numel(), dtype=torch.bool)
        want[torch.argsort(x.abs().float(), descending=True)[:k]] = True  # mergekit's sparsify.magnitude
        got = magnitude_mask(x, density)
        assert int(got.sum()) == k and torch.equal(got, want)


def test_a_default_module_is_the_plain_config():
    """`modules: {default: ...}` (a text model's one module) reads as the same config without it; the module's
    parameters come before the top level's; several modules (multimodal), read as one merge, are refused naming
    them (run_config merges them one by one: tests/formats/test_mergekit_modules.py)."""
    from hubsoup.errors import ParameterError
    from hubsoup.formats.mergekit import read_config

    plain = read_config("merge_method: ties\nbase_model: b/b\nmodels:\n  - model: a/a\n    parameters: {weight: 1}\n"
                        "parameters:\n  density:\n    - filter: mlp\n      value: 0.3\n    - value: 0.5\n", resolve=False)
    mod = read_config("merge_method: ties\nbase_model: b/b\nmodules:\n  default:\n    models:\n      - model: a/a\n"
                      "        parameters: {weight: 1}\n    parameters:\n      density:\n        - filter: mlp\n"
                      "          value: 0.3\nparameters:\n  density: 0.5\n", resolve=False)
    assert mod.params == plain.params and mod.inputs == plain.inputs and mod.base == plain.base
    with pytest.raises(ParameterError, match="'modules' \\(text_decoder, vision_tower\\): a multimodal") as e:
        read_config("merge_method: linear\nmodules:\n  text_decoder: {}\n  vision_tower: {}\n", resolve=False)
    assert "\n" not in str(e.value) and "one by one" in str(e.value)
