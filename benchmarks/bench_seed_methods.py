#!/usr/bin/env python3
"""The seed papers' methods on the CPU against task arithmetic, in the same run (issue 50).

Every method merges the same base + 3 fine-tunes, each merge its own process through the CLI
(``python -m hubsoup merge``), measured as ``bench_merge.py`` measures (wall time, CPU time, ``ru_maxrss``,
sampled anonymous RSS); task arithmetic runs again before every method, so each ratio is to a TA run minutes
apart under the same load (the 1-minute load average is recorded with every run). Optionally a cProfile of
chosen methods (on one thread, so the profile sees every step; SFTM's steps otherwise run on threads of
their own) and SFTM as it was before issue 50 (``HUBSOUP_SFTM_CPU=svd``: one float64 SVD per task matrix).

Models (built once, cached under ``benchmarks/.work/``, git-ignored):

* ``124m``: a Mistral-shaped model in bfloat16 (vocab 32000, hidden 768, MLP 2048, 12 layers, 12 heads, 4 KV
  heads; 124.7M parameters, 0.25 GB), base + 3 fine-tunes (base + N(0, 0.01²) noise, as ``bench_merge.py``).
* ``1b``: ``bench_merge.py --profile 1b``'s TinyLlama-1.1B shape in bfloat16 (2.2 GB per model; the same
  folder, built by either script).
* ``1b-L2``: the same tensor shapes, 2 layers (for the before/after profile of SFTM, whose cost is per layer).

LOT needs exemplars: each model folder gets a word-level tokenizer (``hubsoup.testing.save_tiny_tokenizer``) and
each fine-tune a file of 16 random sentences of its words (``LOT_PARAMS``: 16 exemplars of ≤ 32 tokens); LOT's
time includes running the three experts on them.

Usage::

    python benchmarks/bench_seed_methods.py                       # 124m and 1b, every method (~1.5 h on 2 idle cores)
    python benchmarks/bench_seed_methods.py --sizes 124m          # the small model only (~10 min)
    python benchmarks/bench_seed_methods.py --sizes 1b --only sftm,opcm   # re-run some, keep the other rows
    python benchmarks/bench_seed_methods.py --sizes 1b-L2 --only sftm --profile sftm --sftm-before  # the profiles

Writes ``benchmarks/results/seed_methods_cpu.{md,json}`` (the runs of every size kept across invocations).
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import random
import subprocess
import sys
import time
from dataclasses import asdict

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]
import bench_merge as bm  # noqa: E402  (models, the measured launcher, machine facts)

MISTRAL_124M = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                    num_attention_heads=12, num_key_value_heads=4)
LOT_PARAMS = ["--param", "n_exemplars=16", "--param", "max_length=32", "--param", "batch_size=8"]
TOKENIZER_VOCAB = 1000  # words w0 .. w994 of save_tiny_tokenizer

# (label, CLI arguments after the inputs); the default parameters unless the benchmarks fixed them
METHODS: list[tuple[str, list[str]]] = [
    ("task_arithmetic", ["--method", "task_arithmetic"]),
    ("ties", ["--method", "ties"]),
    ("dare_ties", ["--method", "dare", "--param", "then=ties", "--param", "p=0.8", "--param", "convention=mergekit"]),
    ("consensus", ["--method", "consensus"]),
    ("soup", ["--method", "soup"]),
    ("lines", ["--method", "lines"]),
    ("lwptv", ["--method", "lwptv"]),
    ("sftm", ["--method", "sftm"]),
    ("opcm", ["--method", "opcm"]),
    ("lot", ["--method", "lot", *LOT_PARAMS]),
]
SFTM_BEFORE = "sftm (before: float64 SVDs)"

# Why a method costs what it costs against task arithmetic (printed under the tables; TA itself streams each
# tensor once in cache-sized pieces, in lanes: ~4 element-wise passes per entry, no whole-tensor copy).
WHY = {
    "ties": "a statistics pass over every input (the model-wide magnitude threshold) before the merge: two sweeps "
            "of the inputs, each with radix-select histograms and the sign election.",
    "dare_ties": "a per-tensor pass sums each task vector's L1 norm before and after its drop (mergekit's rescale), "
                 "then the merge draws the same masks again: two hashed draws per entry and input.",
    "consensus": "a statistics-free merge, but TALL masks need each input's task vector against the sum: a few "
                 "more element-wise passes per input.",
    "lwptv": "a statistics pass (each layer's saliency) reads every input once more before its base method merges.",
    "sftm": "its linear algebra, by design (no cheaper exact route exists): per linear weight and input a float64 "
            "eigen-decomposition of the p × p Gram matrix (p = min(m, n)) and two float64 products; per weight a "
            "Gram system of r = T·p unknowns (blocks between tasks: T(T−1)/2 products over the long side), solved "
            "by conjugate gradients on its blocks, and M = U diag(β) Vᵀ (m·n·r multiply-adds). At the 1.1B shape "
            "that is ~50 CPU-seconds per layer (~64 before OpenBLAS's `syevd` and `syrk`; both under load 15), "
            "37 % of it in `syevd` (1.3 CPU-s per 2048 × 2048 Gram matrix, MKL's took 2.0), where task "
            "arithmetic spends ~0.3. Memory: whole-tensor stacks (the trim needs the whole tensor: the embedding and "
            "head stacks, 3 × 262 MB at 1.1B, are the largest), the blocks between tasks in float64 (3 × 34 MB at "
            "p = 2048; G itself, r² · 8 B = 302 MB at r = 6144, is formed only for a direct solve) and the "
            "singular vectors (189 MB for a 5632 × 2048 weight).",
    SFTM_BEFORE: "as SFTM, with one float64 SVD per task matrix (twice the eigen-decomposition's time), a Cholesky "
                 "factor of G and LAPACK on torch's threads (which spin on a loaded machine).",
    "opcm": "by design sequential linear algebra: for each input after the first, a thin SVD of the merged update S "
            "of every projected weight (float64 Gram eigen-decompositions) and the projection's products, each "
            "step needing the one before (on one thread: two spin on a loaded machine, 3.4× the CPU time at 124M); "
            "adaptive λ adds a statistics pass over the model (S kept on disk for "
            "the merge). Memory: whole-tensor stacks (the projection needs whole matrices; OPCM declares no "
            "element-wise path, so the unprojected embedding is merged whole too), and the head's triplets.",
    "lot": "running the three experts forward on their exemplars to capture each op's input Gram (the 1.1B "
           "model held once as a skeleton, float32), then per linear weight a float64 eigen-decomposition of the "
           "Gram sum (on one thread: two spin on a loaded machine): the model in memory is most of its peak.",
}
RESULTS = os.path.join(HERE, "results", "seed_methods_cpu")


def build(work: str, size: str, log) -> tuple[str, list[str], dict]:
    """Base + 3 fine-tunes of ``size`` (cached), each with a tokenizer; the fine-tunes' exemplar files."""
    from hubsoup.testing import save_tiny_tokenizer

    if size == "124m":
        shape, layers, root = MISTRAL_124M, MISTRAL_124M["num_hidden_layers"], os.path.join(work, "models-124m")
        base, fts = build_mistral(root, shape, log)
    else:
        shape = bm.BIG
        layers = 2 if size == "1b-L2" else shape["num_hidden_layers"]
        root = os.path.join(work, "models-1b" if size == "1b" else "models-1b-L2")
        base, fts = bm.build_models(root, shape, layers, log, dtype="bfloat16")
    for folder in (base, *fts):
        if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
            save_tiny_tokenizer(folder, vocab=TOKENIZER_VOCAB)
    for i, ft in enumerate(fts, 1):
        path = ft + ".exemplars.jsonl"
        if not os.path.isfile(path):
            rng = random.Random(i)
            with open(path, "w", encoding="utf-8") as f:
                for _ in range(16):
                    words = " ".join(f"w{rng.randrange(TOKENIZER_VOCAB - 5)}" for _ in range(rng.randint(12, 30)))
                    f.write(json.dumps({"text": words}) + "\n")
    return base, fts, {"shape": shape, "layers": layers, "dtype": "bfloat16",
                       "bytes_per_model": bm.dir_bytes([base]), "input_bytes": bm.dir_bytes([base, *fts])}


def build_mistral(root: str, shape: dict, log) -> tuple[str, list[str]]:
    import torch
    import transformers as tf

    from hubsoup.testing import make_finetune

    want = {"version": 1, "arch": "mistral", "shape": shape, "noise": bm.NOISE, "seeds": list(bm.SEEDS)}
    base, fts = os.path.join(root, "base"), [os.path.join(root, f"ft{s}") for s in bm.SEEDS]
    if bm.built(root, want):
        return base, fts
    torch.manual_seed(0)
    cfg = tf.MistralConfig(**shape, max_position_embeddings=2048, tie_word_embeddings=False, dtype="bfloat16")
    model = tf.MistralForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(base, max_shard_size=bm.SHARD_BYTES)
    log(f"  built {root}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    del model
    for s, ft in zip(bm.SEEDS, fts):
        make_finetune(base, ft, seed=s, scale=bm.NOISE)
    bm.stamp(root, want)
    return base, fts


def command(label: str, args: list[str], base: str, fts: list[str], out: str) -> list[str]:
    cmd = [sys.executable, "-m", "hubsoup", "merge", *fts, "--base", base, *args, "--out", out, "--overwrite",
           "--quiet", "--shard-size", str(bm.SHARD_BYTES)]
    if label == "lot":
        for ft in fts:  # one --exemplars per input
            cmd += ["--exemplars", f"{os.path.basename(ft)}={ft}.exemplars.jsonl"]
    return cmd


def env_for(label: str, threads: int | None = None) -> dict:
    env = bm.child_env()
    env.update(HF_DATASETS_OFFLINE="1", PYTHONPATH=REPO)  # this tree, whatever is installed
    if label == SFTM_BEFORE:
        env["HUBSOUP_SFTM_CPU"] = "svd"
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)  # torch's threads, which hubsoup's lanes and SFTM's jobs follow
    return env


def profile(label: str, args: list[str], base: str, fts: list[str], work: str, size: str, top: int = 25) -> dict:
    """cProfile of one merge on one thread (every step on the profiled thread): the top entries by own time."""
    slug = "".join(c if c.isalnum() else "_" for c in f"{size}-{label}")
    out, prof = os.path.join(work, "out-seed", slug), os.path.join(work, "logs", f"seed-{slug}.prof")
    cmd = command(label, args, base, fts, out)
    cmd[1:3] = ["-m", "cProfile", "-o", prof, "-m", "hubsoup"]  # python -m cProfile -o F -m hubsoup merge ...
    t0, c0 = time.perf_counter(), os.times()
    r = subprocess.run(cmd, env=env_for(label, threads=1), cwd=REPO, capture_output=True, text=True)
    wall, c1 = time.perf_counter() - t0, os.times()
    if r.returncode:
        return {"error": r.stderr.strip()[-500:]}
    st = pstats.Stats(prof)
    total = st.total_tt
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]:
        where = fn if file == "~" else f"{os.path.relpath(file, REPO) if file.startswith(REPO) else os.path.basename(file)}:{line}({fn})"
        rows.append({"function": where, "calls": nc, "own_s": round(tt, 2), "cumulative_s": round(ct, 2),
                     "share": round(tt / total, 3) if total else 0.0})
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    return {"wall_s": round(wall, 1), "cpu_s": round(c1.children_user - c0.children_user
                                                     + c1.children_system - c0.children_system, 1),
            "profiled_s": round(total, 1), "load1": round(os.getloadavg()[0], 2), "top": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="124m,1b", help="comma-separated: 124m, 1b, 1b-L2")
    ap.add_argument("--only", help="only these methods (labels, comma-separated); task arithmetic always runs")
    ap.add_argument("--sftm-before", action="store_true", help="also SFTM as before issue 50 (float64 SVDs)")
    ap.add_argument("--profile", default="", help="methods to cProfile on one thread (comma-separated; 'sftm' "
                                                  "with --sftm-before profiles both)")
    ap.add_argument("--no-timing", action="store_true", help="only the profiles")
    ap.add_argument("--work", default=os.path.join(HERE, ".work"))
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="only merge the runs and profiles of these results "
                                                                "files (written with --results) into --results")
    ap.add_argument("--readme", action="store_true", help="only rewrite README.md's cost column from the results")
    ap.add_argument("--results", default=RESULTS, help="results path without .md/.json (default: %(default)s)")
    args = ap.parse_args()
    if args.merge:  # runs made side by side into files of their own (--results), into the results
        for path in args.merge:
            with open(path.removesuffix(".json") + ".json") as f:
                part = json.load(f)
            for size, entry in part["sizes"].items():
                save(part, size, timed=bool(entry["runs"]), results=args.results,
                     replaced={r["paired_with"] for r in entry["runs"]})
        return 0
    if args.readme:
        with open(args.results + ".json") as f, open(os.path.join(HERE, "results", "gpu_bench.json")) as g:
            update_readme(os.path.join(REPO, "README.md"), cost_cells(json.load(f), json.load(g)))
        return 0
    work = os.path.abspath(args.work)
    os.makedirs(os.path.join(work, "logs"), exist_ok=True)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    res: dict = {}
    if os.path.isfile(args.results + ".json"):
        with open(args.results + ".json") as f:
            res = json.load(f)
    res.setdefault("sizes", {})
    res["machine"] = bm.machine_info()
    res["versions"] = bm.versions(sys.executable, ["torch", "transformers", "safetensors", "numpy"])
    only = set(args.only.split(",")) if args.only else None
    plan = [(lab, a) for lab, a in METHODS if lab != "task_arithmetic" and (only is None or lab in only)]
    if args.sftm_before and (only is None or "sftm" in only or SFTM_BEFORE in only):
        plan.append((SFTM_BEFORE, ["--method", "sftm"]))
    ta_args = METHODS[0][1]
    for size in args.sizes.split(","):
        log(f"models: {size}")
        base, fts, facts = build(work, size, log)
        entry = res["sizes"].setdefault(size, {"runs": [], "profiles": {}})
        entry["model"] = facts
        if not args.no_timing:
            kept = [r for r in entry["runs"] if r["label"] not in {lab for lab, _ in plan}]
            fresh: list[dict] = []
            date = time.strftime("%Y-%m-%d %H:%M:%S %Z")
            for label, margs in plan:
                for lab, a in (("task_arithmetic", ta_args), (label, margs)):
                    bm.read_all([p for d in (base, *fts) for p in bm.shard_files(d)])  # warm inputs, alike
                    # the process id in the name: invocations side by side never share an output folder
                    slug = "".join(c if c.isalnum() else "_" for c in f"{size}-{lab}-{os.getpid()}")
                    out = os.path.join(work, "out-seed", slug)
                    run = bm.Run(lab, "hubsoup", lab, "-", facts["layers"], out)
                    bm.measure(command(lab, a, base, fts, out), run, env_for(lab),
                               os.path.join(work, "logs", f"seed-{slug}.log"))
                    row = asdict(run)
                    row.update(date=date, load1_end=round(os.getloadavg()[0], 2), code=bm.code_fingerprint(),
                               paired_with=label)
                    log(f"  {size} {lab:<28} {run.wall_s:7.1f} s  cpu {run.user_s + run.sys_s:7.1f} s  "
                        f"rss {run.maxrss_mb:6.0f} MB  anon {run.peak_anon_mb:6.0f} MB  load {run.load1}  rc={run.rc}")
                    fresh.append(row)
                    import shutil

                    shutil.rmtree(out, ignore_errors=True)
                # one TA row per method: the run just before it; saved after each method (a stopped run keeps it)
                entry["runs"] = [r for r in kept if r["label"] != "task_arithmetic" or r["paired_with"] not in
                                 {lab for lab, _ in plan}] + fresh
                save(res, size, results=args.results, replaced={lab for lab, _ in plan})
        for label in [p for p in args.profile.split(",") if p]:
            spec = dict(METHODS).get(label)
            if spec is None:
                raise SystemExit(f"unknown method {label!r} for --profile")
            which = [(label, spec)] + ([(SFTM_BEFORE, spec)] if label == "sftm" and args.sftm_before else [])
            for lab, a in which:
                log(f"  profiling {size} {lab} (one thread)")
                entry["profiles"][lab] = profile(lab, a, base, fts, work, size)
                p = entry["profiles"][lab]
                log(f"    {p.get('wall_s')} s wall, {p.get('profiled_s')} s profiled" if "error" not in p
                    else f"    failed: {p['error']}")
        save(res, size, timed=not args.no_timing, results=args.results)  # after each size: a run stopped later keeps it; runs of other sizes side by side kept
        log(f"wrote {os.path.relpath(args.results, REPO)}.{{md,json}} ({size})")
    return 0


def save(res: dict, size: str, timed: bool = True, results: str = RESULTS, replaced: set | None = None) -> None:
    """Write this run's ``size`` into the results as they are on disk now (another invocation may have written
    other sizes, runs or profiles since this one started): the runs of the methods it measured (``replaced``;
    with their TA runs), its profiles by name."""
    disk: dict = {}
    if os.path.isfile(results + ".json"):
        with open(results + ".json") as f:
            disk = json.load(f)
    ours, theirs = res["sizes"][size], disk.setdefault("sizes", {}).setdefault(size, {"runs": [], "profiles": {}})
    theirs["model"] = ours["model"]
    if timed:
        mine = replaced if replaced is not None else {r["paired_with"] for r in ours["runs"]}
        theirs["runs"] = [r for r in theirs.get("runs", []) if r["paired_with"] not in mine] + \
            [r for r in ours["runs"] if r["paired_with"] in mine]
    theirs.setdefault("profiles", {}).update(ours.get("profiles", {}))
    disk.update(machine=res["machine"], versions=res["versions"], date=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    with open(results + ".json.tmp", "w") as f:
        json.dump(disk, f, indent=2, default=str)
    os.replace(results + ".json.tmp", results + ".json")
    write_report(disk, results + ".md")


# The README's method table: its "cost" column (× TA's wall on the CPU from these results, merge GB/s on a GPU
# from gpu_bench.json), by the table's method name; tests/test_readme_costs.py holds the README to it.
README_CPU = {"task_arithmetic": "task_arithmetic", "ties": "ties", "dare": "dare_ties", "consensus": "consensus",
              "soup": "soup", "lines": "lines", "lwptv": "lwptv", "sftm": "sftm", "opcm": "opcm", "lot": "lot"}
README_GPU = {"task_arithmetic": "task_arithmetic", "ties": "ties", "dare": "dare_ties", "slerp": "slerp",
              "sftm": "sftm"}
README_SIZES = ("124m", "1b")


def cost_cells(seed: dict, gpu: dict | None) -> dict[str, str]:
    """The README's cost cell of each method: ``A× / B×`` (TA's wall = 1, on the 124M / 1.1B model) and
    ``· G GB/s`` (hubsoup's merge GB/s on a GPU), "—" where neither was measured."""
    ratios: dict[str, list[str]] = {}
    for size in README_SIZES:
        rows = {r["label"]: r for r in summarize(seed["sizes"].get(size, {"runs": []})) if r["rc"] == 0}
        for name, label in README_CPU.items():
            x = 1.0 if label == "task_arithmetic" and rows else rows.get(label, {}).get("x_wall")
            ratios.setdefault(name, []).append("—" if x is None else f"{x:.1f}×")
    gbs = {}
    for r in (gpu or {}).get("rows", []):
        if r.get("tool") == "hubsoup" and r.get("ok") and r.get("merge_gb_per_s") and r["method"] not in gbs:
            gbs[r["method"]] = r["merge_gb_per_s"]
    cells = {}
    for name in {*README_CPU, *README_GPU}:
        cpu = " / ".join(ratios.get(name, []))
        cpu = "" if not cpu or set(ratios[name]) == {"—"} else cpu
        g = gbs.get(README_GPU.get(name, ""))
        gpu_text = f"{g:.2f} GB/s" if g else ""
        cells[name] = " · ".join(t for t in (cpu, gpu_text) if t) or "—"
    return cells


COST_HEADER = ("cost (× TA's wall on 2 CPU cores, 124M / 1.1B bf16 base + 3, [results](benchmarks/results/"
               "seed_methods_cpu.md); merge GB/s on a GPU, [results](benchmarks/results/gpu_bench.md))")


def readme_method_rows(text: str) -> list[tuple[int, list[str]]]:
    """(line index, cells) of each row of the README's method table (the table under ``## Methods``)."""
    lines, rows, inside = text.split("\n"), [], False
    for i, line in enumerate(lines):
        if line.startswith("## "):
            inside = line.strip() == "## Methods"
        elif inside and line.startswith("| `"):
            rows.append((i, [c.strip() for c in line.strip().strip("|").split(" | ")]))
        elif inside and rows and not line.startswith("|"):
            break
    return rows


def update_readme(path: str, cells: dict[str, str]) -> None:
    """Write the cost column of the README's method table (added as its last column if absent)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    rows = readme_method_rows("\n".join(lines))
    first = rows[0][0]
    header, rule = lines[first - 2], lines[first - 1]
    if not header.rstrip().endswith(COST_HEADER + " |"):
        lines[first - 2], lines[first - 1] = header.rstrip() + f" {COST_HEADER} |", rule.rstrip() + "---|"
        width = None
    else:
        width = len(header.strip().strip("|").split(" | "))
    for i, row in rows:
        name = row[0].strip("`")
        body = row if width is None else row[:-1]
        lines[i] = "| " + " | ".join([*body, cells.get(name, "—")]) + " |"
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def summarize(entry: dict) -> list[dict]:
    """One row per method: its run and the TA run paired with it (the one just before)."""
    rows = []
    runs = entry["runs"]
    for r in runs:
        if r["label"] == "task_arithmetic":
            continue
        ta = next((t for t in runs if t["label"] == "task_arithmetic" and t["paired_with"] == r["label"]
                   and t["date"] == r["date"]), None)
        row = {"label": r["label"], "rc": r["rc"], "wall_s": r["wall_s"], "cpu_s": round(r["user_s"] + r["sys_s"], 1),
               "maxrss_mb": r["maxrss_mb"], "peak_anon_mb": r["peak_anon_mb"], "load1": r["load1"],
               "others_cpu": r["others_cpu"], "date": r["date"]}
        if ta:
            row.update(ta_wall_s=ta["wall_s"], ta_cpu_s=round(ta["user_s"] + ta["sys_s"], 1), ta_maxrss_mb=ta["maxrss_mb"],
                       x_wall=round(r["wall_s"] / ta["wall_s"], 2) if ta["wall_s"] else None,
                       x_cpu=round((r["user_s"] + r["sys_s"]) / max(ta["user_s"] + ta["sys_s"], 1e-9), 2),
                       x_rss=round(r["maxrss_mb"] / ta["maxrss_mb"], 2) if ta["maxrss_mb"] else None)
        rows.append(row)
    order = {lab: i for i, (lab, _) in enumerate(METHODS)}
    order[SFTM_BEFORE] = order["sftm"] + 0.5
    return sorted(rows, key=lambda x: order.get(x["label"], 99))


def write_report(res: dict, path: str) -> None:
    m, v = res["machine"], res["versions"]
    L = ["# The seed methods on the CPU, against task arithmetic (issue 50)", "",
         f"`python benchmarks/bench_seed_methods.py` (last written {res['date']}). Machine: {m['cpu']}, {m['cores']} "
         f"cores, {m['mem_mib'] / 1024:.1f} GiB; torch {v.get('torch')}, transformers {v.get('transformers')}, "
         f"numpy {v.get('numpy')}. Each merge is its own process (`python -m hubsoup merge`, inputs warm in the page "
         "cache, wall time with interpreter start and imports); task arithmetic (TA) runs again just before every "
         "method and each ratio is to that run, so the ratios hold under load where the times do not (**load** is "
         "the 1-minute load average when the method's run started; 2 cores). Peak RSS is `ru_maxrss` (mapped "
         "input pages count in it), peak anon the sampled `RssAnon` (memory the merge allocated).", "",
         "Limits the issue sets: a method above **5× TA's wall** or **1.5× TA's peak RSS** is explained below or "
         "brought under.", ""]
    for size, entry in res["sizes"].items():
        md = entry.get("model", {})
        L += [f"## {size}: {md.get('shape')} ({md.get('layers')} layers), {md.get('dtype')}, base + 3 fine-tunes, "
              f"{md.get('input_bytes', 0) / 1e9:.2f} GB of inputs", ""]
        rows = summarize(entry)
        if rows:
            L += ["| method | wall s | CPU s | peak RSS MB | peak anon MB | TA wall s | TA RSS MB | × TA wall | "
                  "× TA CPU | × TA RSS | load | run |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
            for r in rows:
                if r["rc"] != 0:
                    L.append(f"| {r['label']} | failed (exit {r['rc']}) | | | | | | | | | {r['load1']} | {r['date']} |")
                    continue
                flag = lambda x, lim: f"**{x}**" if x is not None and x > lim else f"{x}"  # noqa: E731
                L.append(f"| {r['label']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['maxrss_mb']:.0f} | "
                         f"{r['peak_anon_mb']:.0f} | {r.get('ta_wall_s', '—')} | {r.get('ta_maxrss_mb', '—')} | "
                         f"{flag(r.get('x_wall'), 5)} | {r.get('x_cpu', '—')} | {flag(r.get('x_rss'), 1.5)} | "
                         f"{r['load1']} | {r['date']} |")
            L.append("")
            flagged = [r for r in rows if r["rc"] == 0 and ((r.get("x_wall") or 0) > 5 or (r.get("x_rss") or 0) > 1.5)]
            if flagged:
                L += ["Above 5× TA's wall or 1.5× its peak RSS, and why:", ""]
                L += [f"- **{r['label']}** ({r.get('x_wall')}× wall, {r.get('x_rss')}× RSS): {WHY.get(r['label'], '')}"
                      for r in flagged]
                L.append("")
        for lab, p in entry.get("profiles", {}).items():
            if "error" in p:
                L += [f"### Profile: {lab} — failed", "", "```", p["error"], "```", ""]
                continue
            L += [f"### Profile of {lab} on one thread ({size})", "",
                  f"{p['wall_s']} s wall, {p['cpu_s']} s CPU, {p['profiled_s']} s profiled, load {p['load1']}. "
                  "Top entries by own time:", "", "| function | calls | own s | cumulative s | share |",
                  "|---|---:|---:|---:|---:|"]
            for t in p["top"][:15]:
                L.append(f"| `{t['function']}` | {t['calls']} | {t['own_s']} | {t['cumulative_s']} | {t['share']:.1%} |")
            L.append("")
    for size, entry in res.get("before", {}).items():  # rows of an earlier code, kept for the comparison
        rows = summarize(entry)
        L += [f"## Before: {size}, {entry.get('code', '')}", "",
              "| method | wall s | CPU s | peak RSS MB | × TA wall | × TA CPU | × TA RSS | load |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
        L += [f"| {r['label']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['maxrss_mb']:.0f} | {r.get('x_wall')} | "
              f"{r.get('x_cpu')} | {r.get('x_rss')} | {r['load1']} |" for r in rows if r["rc"] == 0]
        L.append("")
    notes = res.get("notes", [])
    if notes:
        L += ["## Notes", ""] + [f"- {n}" for n in notes]
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")


if __name__ == "__main__":
    sys.exit(main())
