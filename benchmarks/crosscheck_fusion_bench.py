"""Cross-check hubsoup's merge methods against fusion-bench's implementations.

Run in its own venv (fusion-bench pins an older stack; see the results file for the install):

    benchmarks/.work/fusion-venv/bin/python benchmarks/crosscheck_fusion_bench.py

Inputs: a tiny Llama (4 layers, hidden 32, ``hubsoup.testing.make_base``, seed 0) and four
"fine-tunes" (``make_finetune``, seeds 1-4, Gaussian noise of std 0.02 on every tensor).
For every method both libraries implement, fusion-bench's code runs on the models loaded
with transformers, hubsoup's on the same folders through ``hubsoup.api.merge``; the merged
weights are compared tensor by tensor. Writes benchmarks/results/fusion_bench_check.{md,json}.
Nothing here changes hubsoup: differences are reported with their cause.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import sys
import tempfile
import time
import types
from copy import deepcopy

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

import fusion_bench  # noqa: E402,F401
from fusion_bench.method.dare import DareTaskArithmetic  # noqa: E402
from fusion_bench.method.simple_average import SimpleAverageAlgorithm  # noqa: E402
from fusion_bench.method.tall_mask import task_arithmetic as fb_tall_ta  # noqa: E402
from fusion_bench.method.tall_mask.utils import generate_task_masks  # noqa: E402
from fusion_bench.method.task_arithmetic import TaskArithmeticAlgorithm  # noqa: E402
from fusion_bench.method.ties_merging import TiesMergingAlgorithm  # noqa: E402
from fusion_bench.method.ties_merging.ties_merging_utils import (  # noqa: E402
    state_dict_to_vector, ties_merging, vector_to_state_dict)
from fusion_bench.modelpool import BaseModelPool  # noqa: E402

# fusion_bench/method/opcm/__init__.py imports opcm.py, which imports the CLIP task pool, which
# imports transformers' CLIPVisionTransformer (gone in transformers 5). The general OPCM class
# (opcm_general.py) needs none of it: register the package without running its __init__.
_OPCM_DIR = os.path.join(os.path.dirname(fusion_bench.__file__), "method", "opcm")
_pkg = types.ModuleType("fusion_bench.method.opcm")
_pkg.__path__ = [_OPCM_DIR]
sys.modules.setdefault("fusion_bench.method.opcm", _pkg)
from fusion_bench.method.opcm.opcm_general import OPCM  # noqa: E402

import lightning as L  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from hubsoup import api  # noqa: E402
from hubsoup.testing import make_base, make_finetune  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
TOL = 1e-5
N_FT = 4
SEEDS = {"base": 0, "finetunes": list(range(1, N_FT + 1)), "finetune_noise_std": 0.02}
ARCH = {"arch": "llama", "layers": 4, "hidden": 32, "vocab": 128}


# --- inputs and helpers -------------------------------------------------------------------------

def build_inputs(root: str) -> tuple[str, list[str]]:
    base = make_base(ARCH["arch"], os.path.join(root, "base"), seed=SEEDS["base"], layers=ARCH["layers"],
                     hidden=ARCH["hidden"], vocab=ARCH["vocab"])
    fts = [make_finetune(base, os.path.join(root, f"ft{s}"), seed=s, scale=SEEDS["finetune_noise_std"])
           for s in SEEDS["finetunes"]]
    return base, fts


def load(folder: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def pool(base: str, fts: list[str], with_base: bool = True) -> BaseModelPool:
    """A fresh fusion-bench model pool of in-memory models (fusion-bench merges some in place)."""
    models = {f"ft{i + 1}": load(f) for i, f in enumerate(fts)}
    if with_base:
        models = {"_pretrained_": load(base), **models}
    return BaseModelPool(models)


def state(model_or_folder) -> dict[str, torch.Tensor]:
    if isinstance(model_or_folder, str):
        sd = {}
        for f in sorted(os.listdir(model_or_folder)):
            if f.endswith(".safetensors"):
                sd.update(load_file(os.path.join(model_or_folder, f)))
        return {k: v.float() for k, v in sd.items()}
    return {k: v.detach().float().clone() for k, v in model_or_folder.state_dict().items()}


def hub_merge(root: str, tag: str, base: str, fts: list[str], method: str, params: dict) -> dict[str, torch.Tensor]:
    out = os.path.join(root, f"out-{tag}")
    api.merge(list(fts), method, base=base, out=out, params=params, quiet=True, overwrite=True)
    return state(out)


def compare(fb: dict[str, torch.Tensor], hs: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> dict:
    """Max |Δ| over the weights; relative: per tensor max|Δ| / max|merged task vector| (fusion-bench's),
    the max over tensors (relative to the edit, which is stricter than relative to the weights)."""
    if set(fb) != set(hs):
        raise SystemExit(f"tensor names differ: {sorted(set(fb) ^ set(hs))}")
    max_abs = max_rel = 0.0
    worst, n_diff, n_total = "", 0, 0
    for k in sorted(fb):
        d = (fb[k] - hs[k]).abs()
        tau = (fb[k] - base[k]).abs().max().item()
        a = d.max().item()
        r = a / tau if tau > 0 else (0.0 if a == 0 else float("inf"))
        n_diff += int((d > TOL * max(tau, 1e-12)).sum())
        n_total += d.numel()
        if r > max_rel:
            worst = k
        max_abs, max_rel = max(max_abs, a), max(max_rel, r)
    return {"max_abs_diff": max_abs, "max_rel_diff": max_rel, "agree": max_rel <= TOL, "worst_tensor": worst,
            "n_entries_differing": n_diff, "n_entries": n_total}


def flat(sd: dict[str, torch.Tensor]) -> torch.Tensor:
    return state_dict_to_vector(sd)  # fusion-bench's flattening (keys sorted)


# --- the checks ---------------------------------------------------------------------------------

def check_simple_average(root, base, fts, B):
    fb = state(SimpleAverageAlgorithm().run(pool(base, fts, with_base=False)))
    hs = hub_merge(root, "avg", base, fts, "linear", {})
    return [dict(method="simple average / uniform soup",
                 fusion_bench="SimpleAverageAlgorithm().run(BaseModelPool({ft1..ft4}))",
                 hubsoup="api.merge(fts, 'linear', base=base)  # normalize=True: θ0 + mean τ",
                 **compare(fb, hs, B),
                 reason="same math: fusion-bench averages the weights Σθ_i/N, hubsoup adds the mean task vector "
                        "to θ0; equal up to float32 rounding")]


def check_task_arithmetic(root, base, fts, B):
    out = []
    for lam in (0.3, 1.0):
        fb = state(TaskArithmeticAlgorithm(scaling_factor=lam).run(pool(base, fts)))
        hs = hub_merge(root, f"ta{lam}", base, fts, "task_arithmetic", {"scale": lam})
        out.append(dict(method=f"task arithmetic λ={lam}",
                        fusion_bench=f"TaskArithmeticAlgorithm(scaling_factor={lam}).run(pool)",
                        hubsoup=f"api.merge(fts, 'task_arithmetic', scale={lam})", **compare(fb, hs, B),
                        reason="same math θ0 + λ Σ τ_i"))
    return out


def check_ties(root, base, fts, B):
    out = []
    taus = torch.vstack([flat({k: v - B[k] for k, v in state(f).items()}) for f in fts])
    d = taus.shape[1]
    k_hub = max(1, int(0.2 * d))
    kept_fb = [int((t.abs() >= t.abs().kthvalue(d - int(d * 0.2)).values).sum()) for t in taus]
    for merge_func in ("mean", "sum"):
        fb = state(TiesMergingAlgorithm(scaling_factor=1.0, threshold=20, remove_keys=[],
                                        merge_func=merge_func).run(pool(base, fts)))
        hs = hub_merge(root, f"ties-{merge_func}", base, fts, "ties",
                       {"density": 0.2, "scope": "model", "merge": merge_func, "scale": 1.0})
        out.append(dict(
            method=f"TIES (density 0.2, whole-model top-k, disjoint {merge_func}, λ=1)",
            fusion_bench=f"TiesMergingAlgorithm(scaling_factor=1.0, threshold=20, remove_keys=[], "
                         f"merge_func='{merge_func}').run(pool)",
            hubsoup=f"api.merge(fts, 'ties', density=0.2, scope='model', merge='{merge_func}', scale=1.0)",
            **compare(fb, hs, B),
            reason=(f"trim count off by one: fusion-bench's topk_values_mask (from the TIES authors' code) keeps "
                    f"|τ| ≥ the (d − int(d·K))-th smallest, i.e. int(d·K)+1 = {kept_fb} entries per task of "
                    f"d = {d}; hubsoup keeps the k = int(density·d) = {k_hub} largest. The one extra entry per task "
                    f"(the (k+1)-th largest) changes the entries where it lands"),
        ))
        # the same count: fusion-bench's K chosen so that int(d·K) + 1 = k_hub
        k_frac = (k_hub - 0.5) / d
        merged = ties_merging(taus.clone(), reset_thresh=k_frac, merge_func=merge_func)
        fbv = vector_to_state_dict(flat(B) + 1.0 * merged, deepcopy(B))
        out.append(dict(
            method=f"TIES, disjoint {merge_func}, fusion-bench's K set to keep hubsoup's k",
            fusion_bench=f"ties_merging(τ_flat, reset_thresh=(k−0.5)/d = {k_frac!r}, merge_func='{merge_func}')",
            hubsoup="(same hubsoup run as the row above)", **compare(dict(fbv), hs, B),
            reason="with the same kept count the trim, sign election (sign of the sum; fusion-bench's 0-sum tie rule "
                   "differs but no entry sums to exactly 0 here) and disjoint mean/sum coincide"))
    return out


def check_opcm(root, base, fts, B):
    out = []
    fabric = L.Fabric(accelerator="cpu", devices=1)
    for order_name, order in (("ft1→ft4", fts), ("ft4→ft1", fts[::-1])):
        algo = OPCM(alpha=0.5, shuffle_order=False, seed=None, save_on_every_step=False,
                    evaluate_on_every_step=False)
        algo.fabric = fabric
        models = {"_pretrained_": load(base), **{os.path.basename(f): load(f) for f in order}}
        fb = state(algo.run(BaseModelPool(models)))
        for zd in (True, False):
            hs = hub_merge(root, f"opcm-{order_name[:3]}-{zd}", base, order, "opcm",
                           {"alpha": 0.5, "zero_diagonal": zd})
            out.append(dict(
                method=f"OPCM α=0.5, order {order_name}, hubsoup zero_diagonal={zd}",
                fusion_bench="opcm_general.OPCM(alpha=0.5, shuffle_order=False, save_on_every_step=False, "
                             "evaluate_on_every_step=False).run(BaseModelPool({_pretrained_, fts in order}))",
                hubsoup=f"api.merge(fts_in_order, 'opcm', alpha=0.5, zero_diagonal={zd})  # scaling=adaptive",
                **compare(fb, hs, B),
                reason=("same algorithm: split rank #{c_j ≤ α} (fusion-bench: argmax(c > α)), top-k×top-k block "
                        "and the whole diagonal of Uᵀ τ V zeroed for nn.Linear weights (incl. lm_head), other "
                        "tensors added, λ_t = ‖S_t‖/mean‖τ_i‖ over the whole model; residual = float32 SVD "
                        "(fusion-bench) vs float64 SVD (hubsoup)") if zd else
                       ("expected to differ: fusion-bench zeros the diagonal "
                        "(projected_task_tv.diagonal().fill_(0)), i.e. hubsoup's default zero_diagonal=True; "
                        "this row shows the diagonal term is not negligible"),
            ))
    # the residual above is float32 SVD rounding: fusion-bench's OPCM on float64 copies of the same models
    algo = OPCM(alpha=0.5, shuffle_order=False, seed=None, save_on_every_step=False, evaluate_on_every_step=False)
    algo.fabric = fabric
    models = {"_pretrained_": load(base, torch.float64), **{f"ft{i}": load(f, torch.float64) for i, f in enumerate(fts)}}
    fb64 = state(algo.run(BaseModelPool(models)))
    hs = hub_merge(root, "opcm-64", base, fts, "opcm", {"alpha": 0.5})
    out.append(dict(
        method="OPCM α=0.5, order ft1→ft4, fusion-bench in float64, hubsoup default (float32 I/O, float64 SVD)",
        fusion_bench="same OPCM(...).run on models loaded with dtype=torch.float64",
        hubsoup="api.merge(fts, 'opcm', alpha=0.5)", **compare(fb64, hs, B),
        reason="with fusion-bench's SVD in float64 the gap falls to float32 output rounding: the float32 rows' "
               "residual is fusion-bench's float32 SVD, not a difference of method"))
    return out


def check_consensus(root, base, fts, B):
    out = []
    sds = [state(f) for f in fts]
    flat_ft = torch.vstack([flat(sd) for sd in sds])
    flat_ptm = flat(B)
    tv = flat_ft - flat_ptm
    for k in (1, 2):
        masks = generate_task_masks(tv, flat_ft, flat_ptm, tv=None, tall_mask_lambda=0.4)
        # construct_consensus_mask's rule (it reads masks back from .npy files; the rule is this line):
        consensus = masks.float().sum(0) >= k
        merged = vector_to_state_dict(flat_ptm + 0.3 * tv.sum(0) * consensus, deepcopy(B))
        for strict in (True, False):
            hs = hub_merge(root, f"cons{k}{strict}", base, fts, "consensus",
                           {"k": k, "lambdas": [0.4], "scale": 0.3, "strict": strict})
            out.append(dict(
                method=f"consensus TA (TALL λ=0.4, k={k}, scale 0.3), hubsoup strict={strict}",
                fusion_bench="tall_mask.utils.generate_task_masks(τ, θ_t, θ0, tv=None, tall_mask_lambda=0.4); "
                             f"consensus = Σ_t mask_t ≥ {k} (construct_consensus_mask's rule); θ0 + 0.3·consensus⊙Στ",
                hubsoup=f"api.merge(fts, 'consensus', k={k}, lambdas=[0.4], scale=0.3, strict={strict})",
                **compare(dict(merged), hs, B),
                reason="same rule |τ_t| vs λ|Σ_j τ_j − τ_t| (authors' code uses >, hubsoup's default ≥: "
                       "they differ only on exact ties, none here)"))
    # fusion-bench's TallMaskTaskArithmeticAlgorithm calls its own generate_task_masks with θ0 where the
    # paper (and tall_mask.utils) have 0 in task-vector space: |θ0 − τ_t| > λ|τ_MTL − τ_t|.
    tvs = [{k: v - B[k] for k, v in sd.items()} for sd in sds]
    mtl = {k: sum(t[k] for t in tvs) for k in B}
    lam = 0.4
    as_run = fb_tall_ta.generate_task_masks(mtl, tvs[0], B, tall_mask_lambda=lam)
    as_paper = fb_tall_ta.generate_task_masks(mtl, tvs[0], {k: torch.zeros_like(v) for k, v in B.items()},
                                              tall_mask_lambda=lam)
    ref = generate_task_masks(tv, flat_ft, flat_ptm, tall_mask_lambda=lam)[0].float()
    n_differ = int((flat({k: v.float() for k, v in as_run.items()}) != ref).sum())
    dens = lambda m: float(flat({k: v.float() for k, v in m.items()}).mean())  # noqa: E731
    agree_paper = bool(torch.equal(flat({k: v.float() for k, v in as_paper.items()}), ref))
    out.append(dict(
        method="TALL mask of task 1 (λ=0.4): fusion-bench TallMaskTaskArithmeticAlgorithm vs tall_mask.utils",
        fusion_bench="tall_mask.task_arithmetic.generate_task_masks(τ_MTL, τ_1, θ0 (as run() passes it), 0.4)",
        hubsoup="(reference: tall_mask.utils.generate_task_masks, which hubsoup's consensus matches above)",
        max_abs_diff=float((flat({k: v.float() for k, v in as_run.items()}) - ref).abs().max()),
        max_rel_diff=None, agree=False,
        mask_entries_differing=f"{n_differ}/{ref.numel()}", mask_density_as_run=dens(as_run), mask_density_paper=float(ref.mean()),
        mask_density_with_zero_base=dens(as_paper), zero_base_equals_reference=agree_paper,
        reason="fusion-bench bug (not hubsoup's): TallMaskTaskArithmeticAlgorithm.run passes the pre-trained "
               "weights θ0 as `pretrained_task_vector` next to task vectors, so the mask compares |θ0 − τ_t| "
               "with λ|τ_MTL − τ_t|, a mask that depends on the pre-trained weights; with 0 in place of θ0 it equals "
               "tall_mask.utils (the authors' |θ0 − θ_t| > λ|θ_MTL − θ_t|)"))
    return out


def check_dare(root, base, fts, B):
    out = []
    fb = state(DareTaskArithmetic(scaling_factor=0.3, sparsity_ratio=0.0, only_on_linear_weights=False,
                                  rescale=True).run(pool(base, fts)))
    hs = hub_merge(root, "dare0", base, fts, "dare", {"p": 0.0, "then": "sum", "scale": 0.3})
    out.append(dict(method="DARE + TA, p=0 (deterministic limit)",
                    fusion_bench="DareTaskArithmetic(scaling_factor=0.3, sparsity_ratio=0.0, "
                                 "only_on_linear_weights=False, rescale=True).run(pool)",
                    hubsoup="api.merge(fts, 'dare', p=0.0, then='sum', scale=0.3)", **compare(fb, hs, B),
                    reason="p = 0 drops nothing: both are task arithmetic"))
    # p = 0.5, one input: the masks are random (different RNGs), so compare the law, not the bits:
    # every entry must be 0 or λ/(1−p)·τ, and the kept share ≈ 1 − p.
    p, lam = 0.5, 0.3
    torch.manual_seed(0)
    fb1 = state(DareTaskArithmetic(scaling_factor=lam, sparsity_ratio=p, only_on_linear_weights=False,
                                   rescale=True).run(pool(base, fts[:1])))
    hs1 = hub_merge(root, "dare5", base, fts[:1], "dare", {"p": p, "then": "sum", "scale": lam})
    tau = flat({k: v - B[k] for k, v in state(fts[0]).items()})
    stats = {}
    for name, sd in (("fusion_bench", fb1), ("hubsoup", hs1)):
        m = flat({k: v - B[k] for k, v in sd.items()})
        kept = m != 0
        # |m − λ/(1−p)·τ| on kept entries, relative to max|τ| (a ratio m/τ would amplify the float32
        # rounding of θ − θ0 on tiny entries)
        ratio_err = float((m[kept] - lam / (1 - p) * tau[kept]).abs().max() / tau.abs().max())
        stats[name] = {"kept_share": float(kept.float().mean()), "max_err_kept_ratio_vs_λ/(1-p)": ratio_err}
    n = tau.numel()
    ok = all(abs(s["kept_share"] - (1 - p)) < 4 * (p * (1 - p) / n) ** 0.5 and
             s["max_err_kept_ratio_vs_λ/(1-p)"] < 1e-4 for s in stats.values())
    out.append(dict(method="DARE + TA, p=0.5, one input (random masks: law compared)",
                    fusion_bench="DareTaskArithmetic(scaling_factor=0.3, sparsity_ratio=0.5, ...).run(pool of ft1)",
                    hubsoup="api.merge([ft1], 'dare', p=0.5, then='sum', scale=0.3)",
                    max_abs_diff=None, max_rel_diff=None, agree=ok, per_library=stats,
                    reason="masks come from different RNGs (fusion-bench: torch.rand_like > p; hubsoup: Bernoulli "
                           "seeded by recipe hash + tensor name), so not bitwise; both keep each entry w.p. 1−p "
                           "(within 4σ) and rescale kept entries by 1/(1−p)"))
    return out


INSTALL = ["python3 -m venv benchmarks/.work/fusion-venv",
           "benchmarks/.work/fusion-venv/bin/pip install -c constraints.txt torch==2.13.0",
           "benchmarks/.work/fusion-venv/bin/pip install -c constraints.txt fusion-bench==0.2.33",
           "benchmarks/.work/fusion-venv/bin/pip install --no-deps -e ."]

ABSENT = {
    "LiNeS (layer-increasing network scaling)": "no module, class or config in fusion_bench 0.2.33 "
                                                "(grep -ril 'lines\\|layer.increas' fusion_bench/method, configs)",
    "LOT merging": "not in fusion_bench 0.2.33",
    "SFTM (superpose singular features)": "not in fusion_bench 0.2.33",
    "LwPTV": "not in fusion_bench 0.2.33",
}


def fmt(x):
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.2e}"
    return str(x)


def main() -> None:
    t0 = time.time()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hubsoup-fbcheck-") as root:
        base, fts = build_inputs(root)
        B = state(base)
        for check in (check_simple_average, check_task_arithmetic, check_ties, check_opcm, check_consensus,
                      check_dare):
            t = time.time()
            for r in check(root, base, fts, B):
                r["seconds"] = round(time.time() - t, 2)
                rows.append(r)
            print(f"{check.__name__}: {time.time() - t:.1f}s", file=sys.stderr)
    versions = {p: md.version(p) for p in ("fusion-bench", "torch", "transformers", "lightning", "hubsoup")}
    result = {"benchmark": "fusion_bench_crosscheck", "versions": versions, "inputs": {**ARCH, **SEEDS},
              "tolerance_rel": TOL, "rows": rows, "absent_in_fusion_bench": ABSENT,
              "seconds": round(time.time() - t0, 1), "install": INSTALL,
              "notes": ["max_rel_diff: per tensor max|Δ| / max|fusion-bench's merged task vector|, max over tensors",
                        "fusion_bench.method.opcm's __init__ is bypassed (it imports CLIP code that transformers 5 "
                        "lacks); opcm_general.OPCM itself is unchanged"]}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "fusion_bench_check.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    lines = ["# hubsoup vs fusion-bench: merge-method cross-check", "",
             f"Versions: {', '.join(f'{k} {v}' for k, v in versions.items())}. Inputs: tiny Llama "
             f"({ARCH['layers']} layers, hidden {ARCH['hidden']}), base seed {SEEDS['base']}, fine-tunes seeds "
             f"{SEEDS['finetunes']} (N(0, {SEEDS['finetune_noise_std']}²) noise on every tensor). "
             f"Agree = max relative diff ≤ {TOL:g} (relative to the merged task vector's max |entry| per tensor). "
             f"Run: `benchmarks/.work/fusion-venv/bin/python benchmarks/crosscheck_fusion_bench.py` "
             f"({result['seconds']} s). Exact calls: fusion_bench_check.json.", "",
             "| method | max abs diff | max rel diff | entries differing | agree? | reason |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        nd = f"{r['n_entries_differing']}/{r['n_entries']}" if "n_entries" in r else "—"
        extra = ""
        if "per_library" in r:
            extra = " " + "; ".join(f"{k}: kept {v['kept_share']:.4f}, ratio err "
                                    f"{v['max_err_kept_ratio_vs_λ/(1-p)']:.1e}" for k, v in r["per_library"].items())
        if "mask_density_as_run" in r:
            extra = (f" Mask entries differing: {r['mask_entries_differing']}. Mask density: as run {r['mask_density_as_run']:.3f}, paper/utils {r['mask_density_paper']:.3f}, "
                     f"with 0 for θ0 {r['mask_density_with_zero_base']:.3f} (equal to utils: "
                     f"{r['zero_base_equals_reference']}).")
        lines.append(f"| {r['method']} | {fmt(r['max_abs_diff'])} | {fmt(r['max_rel_diff'])} | {nd} | "
                     f"{'yes' if r['agree'] else 'no'} | {r['reason']}{extra} |")
    lines += ["", "Install (from the repo root): " + "; ".join(f"`{c}`" for c in INSTALL) + "."]
    lines += ["", "Not in fusion-bench (nothing to compare):", ""]
    lines += [f"- {k}: {v}" for k, v in ABSENT.items()]
    with open(os.path.join(RESULTS, "fusion_bench_check.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
