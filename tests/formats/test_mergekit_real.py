"""The community's own mergekit configs: every one mergekit 0.1.5 runs, hubsoup runs, with mergekit's output (issue 29).

``tests/fixtures/mergekit_real/`` holds 44 configs written by others (mergekit's examples and
docs, model cards of published merges; each names its source in its first line) and what
mergekit made of each on tiny stand-ins of the right architecture and depth, rebuilt here from
seeds by ``tests/tools/make_mergekit_real_fixtures.py`` (which says how they are built).

For every config mergekit accepted, ``hubsoup run`` (:func:`hubsoup.run_recipe`, what the CLI
calls) must accept it too — a refusal is a failure, not a skip — and produce mergekit's model:

* the same tensor names, shapes and dtypes;
* deterministic methods: every tensor within 1e-5 relative (to the tensor's largest magnitude) or
  one unit in the last place of the output dtype at that magnitude (DARE / DELLA with every density 1
  drop nothing and are deterministic); a thresholded method (arcee_fusion) may differ at entries whose
  decision sits at the threshold within the rounding of the compute dtype, as mergekit's own output does
  from one CPU's kernels to another's (:func:`threshold_flips`);
* random methods (dare_*, della*): the same distribution of τ = θ − θ_base, by the two-sample
  checks of ``tests/formats/test_mergekit_compat.py`` (kept fraction, mean and spread of the kept
  entries, z ≤ 4.5; L1 within 5%), over the tensors shaped as the base's;
* the same ``config.json`` changes (architecture, layer count after slices, vocabulary size,
  tied embeddings, dtype), the same tokenizer files, vocabulary and chat template.

A config mergekit refuses (recorded in the manifest) must be refused by hubsoup too, with one
line naming what is wrong, and no output left behind.

``HUBSOUP_WRITE_RESULTS=1 python -m pytest -q tests/formats/test_mergekit_real.py`` writes one row per
config into ``benchmarks/results/mergekit_compat.md`` (its "real configs" section), followed by the speed
comparison with mergekit from ``benchmarks/results/mergekit_real_bench.json``.
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
import yaml

from paths import TESTS as HERE
sys.path.insert(0, os.path.join(HERE, "tools"))
from make_mergekit_real_fixtures import FIXTURES, build_models, tokenizer_summary  # noqa: E402
from tests.formats.test_mergekit_compat import REAL_SECTION as SECTION  # noqa: E402
from tests.formats.test_mergekit_compat import TABLE, Z_MAX, load_dir, render_bench, tau_stats, ulp  # noqa: E402

pytestmark = pytest.mark.slow  # ~140 stand-ins to build and 44 merges: minutes on a shared CPU

with open(os.path.join(FIXTURES, "manifest.json"), encoding="utf-8") as _f:
    MANIFEST = json.load(_f)
ACCEPTED = sorted(n for n, c in MANIFEST["configs"].items() if c["accepted"])
REFUSED = sorted(n for n, c in MANIFEST["configs"].items() if not c["accepted"])
ROWS: dict[str, dict] = {}
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Every stand-in under one folder (the working folder of a run), bit-identical to those mergekit read."""
    folder = str(tmp_path_factory.mktemp("mk-real"))
    digests = build_models(folder)
    bad = sorted(k for k in MANIFEST["models"] if digests.get(k) != MANIFEST["models"][k])
    if bad:
        pytest.fail(f"rebuilt stand-ins differ from those of the fixtures ({', '.join(bad[:5])}): torch's seeded "
                    "draws changed? regenerate with tests/tools/make_mergekit_real_fixtures.py")
    return folder


@pytest.fixture(scope="module", autouse=True)
def write_table():
    yield
    if set(ROWS) == set(MANIFEST["configs"]) and os.environ.get("HUBSOUP_WRITE_RESULTS") == "1":
        write_section(TABLE, render_table())


def write_section(path: str, text: str) -> None:
    """Replace (or append) the real-configs section of the results file, leaving the rest as it is."""
    old = ""
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            old = f.read()
    head = old.split(SECTION)[0].rstrip("\n")
    notes = NOTES + old.split(NOTES, 1)[1] if NOTES in old else ""  # hand-written sections after it: kept
    with open(path, "w", encoding="utf-8") as f:
        f.write((head + "\n\n" if head else "") + SECTION + "\n" + text + ("\n" + notes if notes else ""))


NOTES = "<!-- notes -->"
"""Where the hand-written sections of the results file begin (the ``modules:`` fixtures' results)."""


def render_table() -> str:
    ok = sum(r["ok"] for r in ROWS.values())
    lines = ["## Real configs written by the community", "",
             "Written by `HUBSOUP_WRITE_RESULTS=1 python -m pytest -q tests/formats/test_mergekit_real.py` (configs and "
             "mergekit 0.1.5's outputs: `tests/fixtures/mergekit_real/`, made by "
             "`tests/tools/make_mergekit_real_fixtures.py` on tiny stand-ins of each model's architecture and depth). "
             "Deterministic methods: the largest |diff| ÷ max|mergekit| over the tensors (pass: ≤ 1e-5 or ≤ 1 ulp "
             "of the output dtype; DARE / DELLA with every density 1 drop nothing and count as deterministic; "
             "arcee_fusion: besides, at most 2 entries decided the other way at the threshold, each within 4 ε of "
             "the compute dtype in KL, as AVX2 and AVX-512 kernels decide them: \"at the threshold\"); random "
             "methods: τ statistics, hubsoup / mergekit (pass: z ≤ 4.5, L1 within 5%). The configs in half precision "
             "marked so in `test_half_precision_configs_are_mergekits_bit_for_bit` are also compared bit for bit.",
             "", f"{ok} of {len(ROWS)} pass; mergekit accepts {len(ACCEPTED)}, refuses {len(REFUSED)}.", "",
             "| config | source | method | features | mergekit | hubsoup | max rel. diff | pass |",
             "|---|---|---|---|---|---|---|---|"]
    for name in sorted(ROWS):
        c, r = MANIFEST["configs"][name], ROWS[name]
        src = c["source"].replace("|", "\\|")
        lines.append(f"| `{name}` | {src} | {c['method']} | {', '.join(c['features']) or '—'} | "
                     f"{'runs' if c['accepted'] else 'refuses'} | {r['result']} | {r.get('diff', '—')} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines) + "\n" + render_bench()  # the speed comparison (benchmarks/bench_mergekit_real.py)


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "\\|")[:200]


def run_hubsoup(name: str, root: str, out: str, monkeypatch):
    import hubsoup

    monkeypatch.chdir(root)  # mergekit resolves `org/model` and `./folder` against the working folder; so does hubsoup
    return hubsoup.run_recipe(os.path.join(FIXTURES, f"{name}.yml"), out, quiet=True)


def base_tensors(root: str, base: str | None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not base:
        pytest.fail("a random method without a base model: nothing to measure τ against")
    return load_file(os.path.join(root, base.split("+")[0], "model.safetensors"))


@pytest.mark.parametrize("name", ACCEPTED)
def test_config_runs_as_mergekit_runs_it(name, root, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    info = MANIFEST["configs"][name]
    row = {"ok": False, "result": "failed"}
    ROWS[name] = row
    try:
        result = run_hubsoup(name, root, str(tmp_path / "out"), monkeypatch)
    except Exception as e:  # noqa: BLE001 - a refusal is the finding: recorded, then failed
        row["result"] = f"refuses: {one_line(e)}"
        pytest.fail(f"hubsoup refused a config mergekit runs: {type(e).__name__}: {e}")
    row["result"] = "runs, differs"
    ref = load_file(os.path.join(FIXTURES, f"{name}.safetensors"))
    out = load_dir(result.path)

    missing, extra = sorted(set(ref) - set(out)), sorted(set(out) - set(ref))
    assert not missing and not extra, f"tensor names differ: missing {missing[:4]}, extra {extra[:4]}"
    for k in ref:
        assert out[k].shape == ref[k].shape, f"{k}: shape {tuple(out[k].shape)} vs mergekit's {tuple(ref[k].shape)}"
        assert out[k].dtype == ref[k].dtype, f"{k}: {out[k].dtype} vs mergekit's {ref[k].dtype}"

    with open(os.path.join(result.path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    got = {k: cfg.get(k) for k in info["config"] if k != "dtype"}
    got["dtype"] = cfg.get("dtype") or cfg.get("torch_dtype")
    assert got == info["config"], f"config.json differs: {got} vs mergekit's {info['config']}"

    tok, mine = info["tokenizer"], tokenizer_summary(result.path)
    assert set(tok["files"]) <= set(mine["files"]), f"tokenizer files: {mine['files']} vs mergekit's {tok['files']}"
    if tok["files"]:
        assert mine["vocab"] == tok["vocab"], (
            f"vocabulary differs: {len(mine['vocab'])} vs mergekit's {len(tok['vocab'])} entries; only here: "
            f"{sorted(set(mine['vocab']) - set(tok['vocab']))[:5]}, only mergekit's: "
            f"{sorted(set(tok['vocab']) - set(mine['vocab']))[:5]}")
        assert mine["chat_template"] == tok["chat_template"], (
            f"chat template differs: {str(mine['chat_template'])[:60]!r} vs mergekit's {str(tok['chat_template'])[:60]!r}")

    if info["kind"] == "exact":
        flips = threshold_flips(name, root, out, ref) if info["method"] == "arcee_fusion" else {}
        for k, entries in flips.items():  # each checked to be a decision at the threshold: mergekit's value there
            for i in entries:
                out[k][i] = ref[k][i]
        worst, worst_ulps, where = 0.0, 0.0, ""
        for k in ref:
            diff = float((out[k].double() - ref[k].double()).abs().max()) if ref[k].numel() else 0.0
            mag = float(ref[k].double().abs().max()) if ref[k].numel() else 0.0
            rel = diff / mag if mag else diff
            ulps = diff / ulp(ref[k], ref[k].dtype) if ref[k].dtype.is_floating_point else diff
            if rel > REL_TOL and ulps > 1 and rel > worst:
                where = k
            worst, worst_ulps = max(worst, rel), max(worst_ulps, ulps)
        n_flips = sum(len(v) for v in flips.values())
        row["diff"] = f"{worst:.1e} ({worst_ulps:.0f} ulp)" + (f"; {n_flips} at the threshold" if n_flips else "")
        assert not where, f"{where}: {worst:.3g} relative, {worst_ulps:.0f} ulp of {ref[where].dtype} from mergekit's"
    else:
        base = base_tensors(root, info["base_model"])
        same = {k: v for k, v in base.items() if k in ref and ref[k].shape == v.shape}
        h, m = tau_stats({k: out[k] for k in same}, same), tau_stats({k: ref[k] for k in same}, same)
        zs = {"kept": abs(h["kept"] - m["kept"]) / math.sqrt(2 * m["kept"] * (1 - m["kept"]) / m["n"]),
              "mean": abs(h["mean"] - m["mean"]) / math.sqrt((h["std"] ** 2 + m["std"] ** 2) / m["n_kept"])}
        se_std = m["std"] * math.sqrt(max(m["kurt"] - 1, 0.0) / (4 * m["n_kept"]))
        zs["std"] = abs(h["std"] - m["std"]) / (math.sqrt(2) * se_std)
        l1 = h["l1"] / m["l1"] - 1
        row["diff"] = (f"kept {h['kept']:.3f}/{m['kept']:.3f}, std {h['std']:.4f}/{m['std']:.4f}, "
                       f"L1 {l1:+.1%}, max z {max(zs.values()):.1f}")
        for what, z in zs.items():
            assert z <= Z_MAX, f"τ {what}: z = {z:.2f} (hubsoup {h}, mergekit {m})"
        assert abs(l1) <= 0.05, f"L1 of τ: hubsoup {h['l1']:.4g}, mergekit {m['l1']:.4g}"
    row["ok"] = True
    row["result"] = "runs, same model"


THRESHOLD_K = 4.0
"""How far, in units of the compute dtype's epsilon, a row's KL divergence may be from the value at which an
entry's arcee_fusion decision flips, for that entry to differ from mergekit's (:func:`threshold_flips`)."""
MAX_FLIPS = 2
"""Entries per config that may sit at the threshold (measured: one per config, on AVX2 or AVX-512)."""


def threshold_flips(name: str, root: str, out: dict, ref: dict) -> dict[str, list[tuple[int, ...]]]:
    """arcee_fusion's entries where hubsoup and mergekit decided differently, each proved to sit at the threshold.

    arcee_fusion keeps θ₁'s entry where ``|θ₁ − θ₀|·KL(softmax(θ₁) ‖ softmax(θ₀))`` reaches a threshold. The KL
    of two close softmaxes is a sum of nearly cancelling terms: a softmax rounded one ulp differently (AVX2 and
    AVX-512 kernels sum a row in different orders) moves it by a few ε absolute (measured ≤ 2.7 ε of float32 over
    the 1 089 rows of novaciano_pervert_arcee_fusion), i.e. ~1e-4 relative, far more than one ulp of the
    importance. So an entry may differ from mergekit's fixture only where its decision is that close: recomputed
    here in the compute dtype (hubsoup's own functions), its importance must be within ``THRESHOLD_K·ε·(1 + KL)``
    KL units of the threshold (``|imp − thr| / |θ₁ − θ₀|``), and mergekit's value there must be exactly the
    other decision's (θ₀ for a kept entry, θ₀ + (θ₁ − θ₀) for a dropped one); at most :data:`MAX_FLIPS` such
    entries. Any other difference stays a failure (the caller compares the rest as usual)."""
    from safetensors.torch import load_file

    from hubsoup.methods.arcee_fusion import fusion_mask, importance

    cfg = MANIFEST["configs"][name]
    with open(os.path.join(FIXTURES, f"{name}.yml"), encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    base_ref = doc["base_model"]
    (other,) = [m["model"] for m in doc["models"] if m["model"] != base_ref]
    b_all = load_file(os.path.join(root, base_ref, "model.safetensors"))
    m_all = load_file(os.path.join(root, other, "model.safetensors"))
    found: dict[str, list[tuple[int, ...]]] = {}
    for k in ref:
        if torch.equal(out[k], ref[k]):
            continue
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
            doc.get("dtype"), b_all[k].dtype)
        b, m = b_all[k].to(dtype), m_all[k].to(dtype)
        eps = torch.finfo(dtype).eps
        imp = importance(m, b)
        s = torch.sort(imp.reshape(-1)).values
        q1, med, q3 = s[(torch.tensor([0.25, 0.5, 0.75]) * (s.numel() - 1)).long()]
        thr = float(med + 1.5 * (q3 - q1))
        keep = fusion_mask(imp, torch.Generator())
        assert bool(((imp >= thr) == keep).all())
        kl = imp.float() / (m - b).abs().float().clamp(min=torch.finfo(torch.float32).tiny)
        other_choice = b + (m - b) * (~keep).to(torch.float32)  # mergekit's θ₀ + (θ₁ − θ₀)·mask, the mask flipped
        for idx in (out[k] != ref[k]).nonzero():
            i = tuple(idx.tolist())
            assert float(ref[k][i]) == float(other_choice[i].to(ref[k].dtype)), (
                f"{k}{list(i)}: {float(out[k][i])} vs mergekit's {float(ref[k][i])} is not a decision at the "
                "threshold taken the other way")
            dtheta = float((m[i].float() - b[i].float()).abs())
            margin = abs(float(imp[i]) - thr) / dtheta
            bound = THRESHOLD_K * eps * (1 + abs(float(kl[i])))
            assert margin <= bound, (f"{k}{list(i)}: decided differently from mergekit's, but its KL is "
                                     f"{margin / eps:.2f} ε from the threshold's (≤ {bound / eps:.2f} ε allowed)")
            found.setdefault(k, []).append(i)
    n = sum(len(v) for v in found.values())
    assert n <= MAX_FLIPS, f"{n} entries at the threshold decided differently from mergekit's (≤ {MAX_FLIPS})"
    assert cfg["method"] == "arcee_fusion"
    return found


# configs whose half-precision nuslerp / multislerp / karcher (mergekit computes each step in the config's dtype;
# hubsoup with compute_dtype) came out 2-7 ulp apart when hubsoup computed in float32; issue 49: nearswap, and
# task_arithmetic / dare_* (every density 1: nothing dropped) with lambda and rescale in bf16 and fp16, 2-170 ulp
# apart until hubsoup computed them step for step as mergekit does
HALF_PRECISION = ["kansensakura_zero_multi", "retreatcost_multislerp_gradient40", "velvet_orchid_stage1_karcher",
                  "absa_nearswap_local", "esotericsage_nearswap_gradient", "papers_explained_nearswap_fp16",
                  "absa_task_arithmetic_lambda_07", "papers_explained_task_arithmetic_fp16",
                  "absa_dare_ties_dense_lambda_11", "absa_dare_linear_dense_rescale", "pt_gl_dare_linear_local_path",
                  "papers_explained_dare_linear_fp16"]


@pytest.mark.parametrize("name", HALF_PRECISION)
def test_half_precision_configs_are_mergekits_bit_for_bit(name, tmp_path, monkeypatch):
    """Only this config's stand-ins built: every output tensor equal to mergekit's, bit for bit."""
    from safetensors.torch import load_file

    root = str(tmp_path / "models")
    digests = build_models(root, only=[name])
    assert all(MANIFEST["models"][k] == v for k, v in digests.items() if k in MANIFEST["models"])
    out = load_dir(run_hubsoup(name, root, str(tmp_path / "out"), monkeypatch).path)
    ref = load_file(os.path.join(FIXTURES, f"{name}.safetensors"))
    assert sorted(out) == sorted(ref)
    differ = [k for k in ref if not torch.equal(out[k], ref[k])]
    assert not differ, f"{len(differ)} tensors differ from mergekit's, e.g. {differ[0]}"


def test_arcee_fusion_without_dtype_stores_float32_as_mergekit(tmp_path, monkeypatch):
    """absa_arcee_fusion_bf16_local without its `dtype: bfloat16`: mergekit then computes in the inputs' own bf16,
    the same computation, and stores what its kernel returns, float32, under the base's config.json dtype; so does
    hubsoup (the fixture's model, the entries at the threshold told apart as above)."""
    import hubsoup

    name = "absa_arcee_fusion_bf16_local"
    root = str(tmp_path / "models")
    build_models(root, only=[name])
    with open(os.path.join(FIXTURES, f"{name}.yml"), encoding="utf-8") as f:
        text = f.read()
    assert "\ndtype: bfloat16\n" in text
    cfg = tmp_path / "no_dtype.yml"
    cfg.write_text(text.replace("\ndtype: bfloat16\n", "\n"), encoding="utf-8")
    monkeypatch.chdir(root)
    r = hubsoup.run_recipe(str(cfg), str(tmp_path / "out"), quiet=True)
    assert r.recipe.params["compute_dtype"] == "inputs" and r.recipe.dtype == "float32"
    from safetensors.torch import load_file

    out, ref = load_dir(r.path), load_file(os.path.join(FIXTURES, f"{name}.safetensors"))
    flips = threshold_flips(name, root, out, ref)
    for k in ref:
        assert out[k].dtype == torch.float32
        for i in flips.get(k, []):
            out[k][i] = ref[k][i]
        assert torch.equal(out[k], ref[k]), k
    with open(os.path.join(r.path, "config.json"), encoding="utf-8") as f:
        saved = json.load(f)
    assert (saved.get("dtype") or saved.get("torch_dtype")) == "bfloat16" == MANIFEST["configs"][name]["config"]["dtype"]


@pytest.mark.parametrize("name", REFUSED)
def test_config_mergekit_refuses_is_refused(name, root, tmp_path, monkeypatch):
    """Where mergekit refuses, hubsoup refuses too: one line, no output folder."""
    from hubsoup.errors import HubsoupError

    row = {"ok": False, "result": "runs (mergekit refuses)"}
    ROWS[name] = row
    out = tmp_path / "out"
    with pytest.raises(HubsoupError) as e:
        run_hubsoup(name, root, str(out), monkeypatch)
    row["result"] = f"refuses: {one_line(e.value)}"
    assert "\n" not in str(e.value)
    assert not out.exists()
    row["ok"] = True


def test_corpus_covers_the_issue():
    """≥ 40 configs, every method the issue names, and the features it lists."""
    configs = MANIFEST["configs"]
    assert len(configs) >= 40
    methods = {c["method"] for c in configs.values()}
    for m in ("slerp", "ties", "dare_ties", "dare_linear", "della", "della_linear", "model_stock", "karcher", "sce",
              "nuslerp", "multislerp", "breadcrumbs", "breadcrumbs_ties", "passthrough", "task_arithmetic", "linear",
              "nearswap", "arcee_fusion"):
        assert m in methods, m
    feats = {f.split(":")[0] for c in configs.values() for f in c["features"]}
    for f in ("slices", "filters", "gradients", "tokenizer_source", "tokenizer.source", "chat_template", "modules",
              "LoRA reference", "key mergekit ignores", "number read as a string", "pattern", "revision"):
        assert f in feats, f
    assert any(c["stages"] > 1 and c["accepted"] for c in configs.values())
    assert all(c["source"] for c in configs.values())
