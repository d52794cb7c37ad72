#!/usr/bin/env python3
"""SFTM's CPU path against SFTM as it was (issue 50): the same merge, tensor by tensor, within 1e-6.

Merges base + fine-tunes with SFTM twice, output in float32 (``--dtype float32``: a bfloat16 output would round
both to 2⁻⁸ and hide or magnify 1e-6 differences): with the reference — this tree's float64 SVDs
(``HUBSOUP_SFTM_CPU=svd``, the code path of every version before issue 50) or another checkout (``--reference
PATH``, e.g. ``git archive``'s export of an earlier commit) — and with this tree's default. Each tensor's
merged task vector (output − base) is compared: the largest difference relative to the reference's largest
entry, and the Frobenius norm of the difference relative to the reference's. Every tensor must be within
``--tol`` (1e-6) on both.

    python benchmarks/check_sftm_cpu.py --sizes 124m,1b-L2            # models of bench_seed_methods.py
    python benchmarks/check_sftm_cpu.py --reference /tmp/hubsoup-before --sizes 124m

Writes ``benchmarks/results/sftm_cpu_check.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]
import bench_merge as bm  # noqa: E402
import bench_seed_methods as bsm  # noqa: E402

RESULTS = os.path.join(HERE, "results", "sftm_cpu_check")


def merge(tree: str, svd: bool, base: str, fts: list[str], out: str, log_path: str) -> float:
    env = bm.child_env()
    env.update(PYTHONPATH=tree)
    if svd:
        env["HUBSOUP_SFTM_CPU"] = "svd"
    cmd = [sys.executable, "-m", "hubsoup", "merge", *fts, "--base", base, "--method", "sftm", "--dtype", "float32",
           "--out", out, "--overwrite", "--quiet"]
    t0 = time.perf_counter()
    with open(log_path, "w") as f:  # run from the tree: `python -m` puts the working folder first on sys.path
        subprocess.run(cmd, env=env, cwd=tree, stdout=f, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - t0


def compare(base: str, ref: str, new: str) -> list[dict]:
    b, r, n = bm._open_all(base), bm._open_all(ref), bm._open_all(new)
    rows = []
    for k in sorted(r):
        x0 = b[k].get_tensor(k).double()
        dr = r[k].get_tensor(k).double() - x0
        dn = n[k].get_tensor(k).double() - x0
        scale, norm = float(dr.abs().max()), float(dr.norm())
        diff = dn - dr
        rows.append({"tensor": k, "shape": list(dr.shape),
                     "max_rel": float(diff.abs().max()) / scale if scale else float(diff.abs().max()),
                     "frob_rel": float(diff.norm()) / norm if norm else float(diff.norm()),
                     "n_diff": int((diff != 0).sum()), "numel": diff.numel()})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="124m,1b-L2", help="models of bench_seed_methods.py (124m, 1b, 1b-L2)")
    ap.add_argument("--reference", default="svd", help="'svd' (this tree, HUBSOUP_SFTM_CPU=svd) or another "
                                                       "checkout's folder")
    ap.add_argument("--tol", type=float, default=1e-6)
    ap.add_argument("--work", default=os.path.join(HERE, ".work"))
    args = ap.parse_args()
    work = os.path.abspath(args.work)
    os.makedirs(os.path.join(work, "logs"), exist_ok=True)
    res: dict = {"sizes": {}}
    if os.path.isfile(RESULTS + ".json"):  # other sizes' checks are kept
        with open(RESULTS + ".json") as f:
            res = json.load(f)
    res.update(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), tol=args.tol, machine=bm.machine_info())
    ok = True
    for size in args.sizes.split(","):
        base, fts, facts = bsm.build(work, size, print)
        ref_out, new_out = os.path.join(work, "out-check", f"{size}-ref"), os.path.join(work, "out-check", f"{size}-new")
        svd = args.reference == "svd"
        tree = REPO if svd else os.path.abspath(args.reference)
        t_ref = merge(tree, svd, base, fts, ref_out, os.path.join(work, "logs", f"check-{size}-ref.log"))
        t_new = merge(REPO, False, base, fts, new_out, os.path.join(work, "logs", f"check-{size}-new.log"))
        rows = compare(base, ref_out, new_out)
        worst = max(rows, key=lambda r: max(r["max_rel"], r["frob_rel"]))
        passed = all(r["max_rel"] <= args.tol and r["frob_rel"] <= args.tol for r in rows)
        ok = ok and passed
        res["sizes"][size] = {"model": facts, "reference": args.reference, "date": res["date"],
                              "threads": os.environ.get("OMP_NUM_THREADS", "default"), "wall_reference_s": round(t_ref, 1), "wall_new_s": round(t_new, 1),
                              "load1": round(os.getloadavg()[0], 2), "tensors": len(rows),
                              "identical": sum(r["n_diff"] == 0 for r in rows), "passed": passed,
                              "max_rel": max(r["max_rel"] for r in rows), "frob_rel": max(r["frob_rel"] for r in rows),
                              "worst": worst, "rows": rows}
        print(f"{size}: {len(rows)} tensors, worst {worst['tensor']} max_rel {worst['max_rel']:.2e} frob_rel "
              f"{worst['frob_rel']:.2e}: {'within' if passed else 'NOT within'} {args.tol:g}", flush=True)
        import shutil

        shutil.rmtree(ref_out, ignore_errors=True)
        shutil.rmtree(new_out, ignore_errors=True)
    with open(RESULTS + ".json", "w") as f:
        json.dump(res, f, indent=2)
    L = ["# SFTM on the CPU against SFTM as it was (issue 50)", "",
         "`python benchmarks/check_sftm_cpu.py`; reference per model below: `svd` is this tree with "
         "HUBSOUP_SFTM_CPU=svd (the float64 SVDs of every earlier version), a path another checkout. "
         "Output in float32; each tensor's merged task vector (output − base) compared: the largest difference "
         "relative to the reference's largest entry (max rel) and the difference's Frobenius norm relative to the "
         f"reference's (frob rel). Tolerance {args.tol:g}.", "",
         "| model | reference | tensors | identical | worst max rel | worst frob rel | worst tensor | within | "
         "reference s | new s | threads | load | date |", "|---|---|---:|---:|---:|---:|---|---|---:|---:|---|---:|---|"]
    for size, e in res["sizes"].items():
        L.append(f"| {size} | {e.get('reference')} | {e['tensors']} | {e['identical']} | {e['max_rel']:.2e} | "
                 f"{e['frob_rel']:.2e} | `{e['worst']['tensor']}` | {'yes' if e['passed'] else '**no**'} | "
                 f"{e['wall_reference_s']} | {e['wall_new_s']} | {e.get('threads')} | {e['load1']} | {e.get('date')} |")
    for size, e in res["sizes"].items():
        L += ["", f"## {size}: the ten largest differences", "", "| tensor | shape | max rel | frob rel |",
              "|---|---|---:|---:|"]
        for r in sorted(e["rows"], key=lambda r: -r["max_rel"])[:10]:
            L.append(f"| `{r['tensor']}` | {r['shape']} | {r['max_rel']:.2e} | {r['frob_rel']:.2e} |")
    with open(RESULTS + ".md", "w") as f:
        f.write("\n".join(L) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
