"""Fixed cost of the CLI: `hubsoup --help`, `hubsoup --version` and `hubsoup merge` of two tiny models, wall time
of the whole process (interpreter start included).

Writes benchmarks/results/startup.md and .json. Targets: a merge ≤ 2.5 s (issue 11), --help and --version
< 0.5 s without importing torch (issue 32) on the 2-core machines.

    python benchmarks/bench_startup.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from hubsoup.testing import make_base, make_finetune

    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}
    cli = {}
    for flag in ("--help", "--version"):
        times = []
        for _ in range(args.repeat + 1):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "hubsoup", flag], check=True, env=env, capture_output=True)
            times.append(time.perf_counter() - t0)
        imported = subprocess.run([sys.executable, "-X", "importtime", "-m", "hubsoup", flag], check=True, env=env,
                                  capture_output=True, text=True).stderr
        heavy = sorted({m for m in ("torch", "transformers", "safetensors", "huggingface_hub", "numpy")
                        if any(line.rstrip().endswith(f"| {m}") or line.rstrip().endswith(f"|   {m}")
                               or line.split("|")[-1].strip() == m for line in imported.splitlines())})
        cli[flag] = {"median_s": statistics.median(times[1:]), "min_s": min(times[1:]), "runs_s": times[1:],
                     "heavy_imports": heavy}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True, env=env)
    bare_python_s = time.perf_counter() - t0
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("llama", "gpt2"):
            base = make_base(arch, os.path.join(tmp, f"{arch}-base"))
            fts = [make_finetune(base, os.path.join(tmp, f"{arch}-ft{i}"), seed=i) for i in (1, 2)]
            times = []
            for r in range(args.repeat + 1):  # the first run warms the file cache and is dropped
                out = os.path.join(tmp, f"{arch}-out{r}")
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-m", "hubsoup", "merge", *fts, "--base", base, "--method",
                                "task_arithmetic", "--out", out, "-q"], check=True, env=env, capture_output=True)
                times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", "import torch"], check=True, env=env)
            torch_s = time.perf_counter() - t0
            rows[arch] = {"median_s": statistics.median(times[1:]), "min_s": min(times[1:]), "runs_s": times[1:],
                          "python_import_torch_s": torch_s}
    import torch
    import transformers

    res = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
           "versions": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__},
           "loadavg": os.getloadavg()[0], "target_s": 2.5, "cli_target_s": 0.5, "cli": cli,
           "bare_python_s": bare_python_s, "rows": rows}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "startup.json"), "w") as f:
        json.dump(res, f, indent=2)
    lines = ["# Fixed cost of the CLI", "",
             f"Whole process (`python -m hubsoup FLAG`, interpreter start included), median of {args.repeat} runs "
             f"after one warm-up. Target < {res['cli_target_s']} s, without importing torch. A bare "
             f"`python -c pass`: {bare_python_s:.2f} s.", "",
             "| command | median (s) | min (s) | heavy modules imported (`python -X importtime`) |", "|---|---|---|---|"]
    for flag, r in cli.items():
        lines.append(f"| `hubsoup {flag}` | {r['median_s']:.2f} | {r['min_s']:.2f} | "
                     f"{', '.join(r['heavy_imports']) or 'none (no torch, transformers, numpy, huggingface_hub)'} |")
    lines += ["", "## A tiny merge", "",
             "`python -m hubsoup merge ft1 ft2 --base base --method task_arithmetic` on tiny models (the whole "
             "process: interpreter start, imports, planning, merge, card), median of "
             f"{args.repeat} runs after one warm-up. Target ≤ {res['target_s']} s.", "",
             f"Machine: {res['machine']}; Python {res['versions']['python']}, torch {res['versions']['torch']}, "
             f"transformers {res['versions']['transformers']}; load average {res['loadavg']:.1f}.", "",
             "| model | median (s) | min (s) | `python -c 'import torch'` alone (s) |", "|---|---|---|---|"]
    for arch, r in rows.items():
        lines.append(f"| tiny {arch} | {r['median_s']:.2f} | {r['min_s']:.2f} | {r['python_import_torch_s']:.2f} |")
    lines += ["", "Reproduce: `python benchmarks/bench_startup.py`."]
    with open(os.path.join(RESULTS, "startup.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
