#!/usr/bin/env python3
"""Where task arithmetic's default λ comes from (issue 35): the inputs' statistics and the validation curves.

Task arithmetic's best λ differs between the benchmarks' settings (4 full encoder fine-tunes want 1.0,
8 want 0.3, 4 LM domains 0.3), so no single value can be its default. This script puts, side by side
for every setting of the two quality benchmarks:

- what hubsoup can see before merging: the number of inputs N, LoRA or full, the task vectors'
  norms relative to the base's, their mean pairwise cosine and the norm ratio ‖Σ τ_i‖ / mean ‖τ_i‖,
  computed from the cached fine-tunes (``benchmarks/.work/quality*/finetunes``) over the tensors
  some input changes (a LoRA's ΔW = (α/r)·B·A), in float64;
- the validation score of every λ of task arithmetic's whole grid (``--search scale=...`` in the
  benchmarks' tuned runs, ``grid_scores`` in ``quality.json`` / ``quality_lm.json``);
- what each candidate rule picks and the share of the validation gain over the base it keeps
  (its λ snapped to the nearest grid point: only grid points were scored).

Task arithmetic's default stays 0.3 until a rule is chosen from this table (validation splits only;
the guard reads the test splits afterwards) and both benchmarks are re-run with it. Run::

    python -m benchmarks.ta_scale_rule        # writes benchmarks/results/ta_scale_rule.{md,json}
    python -m benchmarks.ta_scale_rule --encoder-results X.json --lm-results Y.json   # other runs' curves
"""

from __future__ import annotations

import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(REPO, "benchmarks", "results")
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def _files(folder: str) -> list[str]:
    return [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.endswith(".safetensors")]


def _lora_deltas(folder: str, base_names: set[str]) -> dict | None:
    """name -> float64 ΔW = (α/r)·B·A of a LoRA adapter folder, or None when ``folder`` is a full model."""
    from safetensors.torch import load_file

    path = os.path.join(folder, "adapter_config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    r, alpha = cfg["r"], cfg.get("lora_alpha", cfg["r"])
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    ad: dict = {}
    for p in _files(folder):
        ad.update(load_file(p))
    out = {}
    for k, a in ad.items():
        if ".lora_A." not in k:
            continue
        b = ad[k.replace(".lora_A.", ".lora_B.")]
        mod = k.split(".lora_A.")[0]
        for prefix in ("base_model.model.", "base_model."):
            if mod.startswith(prefix):
                mod = mod[len(prefix):]
                break
        name = next((n for n in (f"{mod}.weight", f"model.{mod}.weight") if n in base_names), None)
        if name is None:
            raise SystemExit(f"{folder}: adapter module {mod} matches no base tensor")
        out[name] = scale * (b.double() @ a.double())
    return out


def input_stats(base_dir: str, folders: list[str]) -> dict:
    """Statistics of the task vectors of ``folders`` over ``base_dir`` (see the module docstring), one tensor
    at a time (the models are never held whole)."""
    from contextlib import ExitStack

    import torch
    from safetensors import safe_open

    with ExitStack() as stack:
        def opened(folder):
            handles = [stack.enter_context(safe_open(p, "pt")) for p in _files(folder)]
            return {k: h for h in handles for k in h.keys()}

        base = opened(base_dir)
        lora = [_lora_deltas(f, set(base)) for f in folders]
        full = [opened(f) if lo is None else None for f, lo in zip(folders, lora)]
        n = len(folders)
        gram = torch.zeros(n, n, dtype=torch.float64)
        base_sq, names = 0.0, 0
        for name, h in base.items():
            ref = h.get_tensor(name)
            if not ref.is_floating_point():
                continue
            ref = ref.double()
            rows = []
            for lo, fu in zip(lora, full):
                if lo is not None:
                    d = lo.get(name)
                else:
                    d = fu[name].get_tensor(name).double() - ref if name in fu else None
                rows.append(torch.zeros(ref.numel(), dtype=torch.float64) if d is None else d.reshape(-1))
            stack_ = torch.stack(rows)
            if not bool(stack_.any()):
                continue  # no input changes it
            gram += stack_ @ stack_.T
            base_sq += float(ref.pow(2).sum())
            names += 1
    norms = gram.diag().sqrt()
    cos = [float(gram[i, j] / (norms[i] * norms[j])) for i in range(n) for j in range(i + 1, n)]
    return {"n": n, "tensors": names, "base_norm": math.sqrt(base_sq),
            "rel_norms": [float(x) / math.sqrt(base_sq) for x in norms],
            "mean_cos": sum(cos) / len(cos) if cos else 0.0,
            "sum_norm_ratio": math.sqrt(float(gram.sum())) / float(norms.mean()),
            "rel_sum_norm": math.sqrt(float(gram.sum())) / math.sqrt(base_sq)}


def settings(encoder_results: list[str], lm_results: list[str]) -> list[dict]:
    """The benchmarks' settings with their inputs' folders and the results file that has their curves."""
    from benchmarks.quality import data as qdata
    from benchmarks.quality_lm import data as lmdata

    out = []
    q = os.path.join(REPO, "benchmarks", ".work", "quality")
    for kind in ("full", "lora"):
        for n in (4, 8):
            out.append({"benchmark": "encoder", "setting": f"{kind}-{n}", "kind": kind,
                        "base": os.path.join(q, "base"),
                        "inputs": [os.path.join(q, "finetunes", kind, t) for t in qdata.IN_DOMAIN[:n]],
                        "results": encoder_results})
    lm = os.path.join(REPO, "benchmarks", ".work", "quality_lm")
    for kind in ("lora", "full"):
        out.append({"benchmark": "decoder-lm", "setting": kind, "kind": kind, "base": os.path.join(lm, "base"),
                    "inputs": [os.path.join(lm, "finetunes", kind, d) for d in lmdata.IN_DOMAIN],
                    "results": lm_results})
    return out


def curve(results: list[str], setting: str) -> dict[float, float] | None:
    """λ -> validation score of task arithmetic's tuned search in ``setting`` (from the first of the ``results``
    files that has it), or None (not run)."""
    for path in results:
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            run = json.load(f).get("settings", {}).get(setting, {}).get("rows", {}).get("task arithmetic", {})
        grid = (run.get("tuned") or {}).get("grid_scores")
        if grid:
            return {float(g["params"]["scale"]): g["score"] for g in grid}
    return None


# Candidate rules, each a function of the statistics (what hubsoup sees before merging) -> λ.
RULES = {
    "0.3 (the old fixed default)": lambda s: 0.3,
    "1/N": lambda s: 1 / s["n"],
    "1/sqrt(N)": lambda s: 1 / math.sqrt(s["n"]),
    "norm-preserving: mean‖τ‖/‖Στ‖": lambda s: 1 / s["sum_norm_ratio"],
    "2·mean‖τ‖/‖Στ‖, ≤ 1": lambda s: min(1.0, 2 / s["sum_norm_ratio"]),
}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--encoder-results", action="append", help="results files with the encoder's curves "
                    "(repeatable; default: results/quality.json)")
    ap.add_argument("--lm-results", action="append", help="the same for the LM (default: results/quality_lm.json)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "ta_scale_rule"), help="results path without extension")
    args = ap.parse_args()
    rows = []
    for st in settings(args.encoder_results or [os.path.join(RESULTS, "quality.json")],
                       args.lm_results or [os.path.join(RESULTS, "quality_lm.json")]):
        if not all(os.path.isfile(os.path.join(p, "train_stats.json")) for p in st["inputs"]):  # a finished one
            print(f"{st['benchmark']} {st['setting']}: fine-tunes not cached, skipped")
            continue
        stats = input_stats(st["base"], st["inputs"])
        rows.append({**{k: st[k] for k in ("benchmark", "setting", "kind")}, "stats": stats,
                     "curve": curve(st["results"], st["setting"])})
        print(st["benchmark"], st["setting"], json.dumps(stats), rows[-1]["curve"])
    lines = ["# Task arithmetic's λ: the inputs' statistics and the validation curves", "",
             "Generated by `python -m benchmarks.ta_scale_rule` (see its docstring). Curves read from: "
             + ", ".join(f"`{os.path.relpath(p, REPO)}`" for p in (args.encoder_results or []) + (args.lm_results or []))
             + " (default: the committed results); statistics from the cached fine-tunes of the same runs.", "",
             "| benchmark | setting | N | mean ‖τ‖/‖θ₀‖ | ‖Στ‖/‖θ₀‖ | mean cos | ‖Στ‖/mean‖τ‖ | validation score by λ | best λ |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, c = r["stats"], r["curve"]
        best = max(c, key=c.get) if c else None
        lines.append(f"| {r['benchmark']} | {r['setting']} | {s['n']} | {sum(s['rel_norms']) / s['n']:.4f} | "
                     f"{s['rel_sum_norm']:.4f} | {s['mean_cos']:.3f} | {s['sum_norm_ratio']:.2f} | "
                     + (", ".join(f"{k:g}: {v:.4f}" for k, v in sorted(c.items())) if c else "not run")
                     + f" | {best if best is not None else '—'} |")
    lines += ["", "Each rule's λ per setting, and the share of the best validation gain over the worst grid point "
                  "it keeps (λ snapped to the nearest grid point):", "",
              "| rule | " + " | ".join(f"{r['benchmark']} {r['setting']}" for r in rows) + " | worst |",
              "|---|" + "---|" * (len(rows) + 1)]
    for name, rule in RULES.items():
        cells, worst = [], 1.0
        for r in rows:
            lam = rule(r["stats"])
            c = r["curve"]
            if not c:
                cells.append(f"{lam:.2f}")
                continue
            near = min(c, key=lambda g: abs(math.log(g) - math.log(lam)))
            lo, hi = min(c.values()), max(c.values())
            keep = 1.0 if hi == lo else (c[near] - lo) / (hi - lo)
            worst = min(worst, keep)
            cells.append(f"{lam:.2f} → {near:g}: {keep:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {worst:.2f} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".md", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
