"""Fixed cost of a merge: `hubsoup merge` of two tiny models, wall time including interpreter start.

Writes benchmarks/results/startup.md and .json. Target (issue 11): ≤ 2.5 s on the 2-core machines.

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
           "loadavg": os.getloadavg()[0], "target_s": 2.5, "rows": rows}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "startup.json"), "w") as f:
        json.dump(res, f, indent=2)
    lines = ["# Fixed cost of a merge", "",
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
