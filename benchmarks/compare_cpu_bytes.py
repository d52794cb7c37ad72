"""Same bytes as another checkout: every listed method merged on the CPU by this tree and by ``--other``.

Runs each merge in a subprocess with ``PYTHONPATH`` set to the tree under test, on tiny test models
(float32 and bf16), and compares the output shards byte for byte. ``--fed`` also merges through an
instrumented host feed on the CPU (the device path's order of operations, :mod:`hubsoup.engine.hostfeed`).

    python benchmarks/compare_cpu_bytes.py --other /work/main --work /tmp/cmp
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = [("task_arithmetic", {"scale": 0.5}), ("ties", {"density": 0.3}), ("ties", {"density": 0.3, "scope": "tensor"}),
           ("dare", {"p": 0.5, "then": "ties"}), ("dare", {"p": 0.5}), ("della", {}), ("consensus", {}), ("sftm", {}),
           ("opcm", {}), ("slerp", {}), ("lines", {"base_method": "ties"}), ("breadcrumbs", {}), ("model_stock", {}),
           ("ties", {"density": 0.3, "convention": "mergekit"}),
           ("ties", {"density": 0.3, "convention": "mergekit", "compute_dtype": "bfloat16"}),
           ("dare", {"p": 0.5, "convention": "mergekit"})]  # the last differs on purpose: counter-based masks

CHILD = r"""
import hashlib, json, os, sys, torch
import hubsoup
from hubsoup.testing import make_base, make_finetune
work, method, params, dtype, fed = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4], sys.argv[5] == "1"
dt = {"float32": None, "bfloat16": torch.bfloat16}[dtype]
zoo = os.path.join(work, "zoo-" + dtype)
if not os.path.exists(os.path.join(zoo, "ft3")):
    base = make_base("llama", os.path.join(zoo, "base"), dtype=dt)
    for i in (1, 2, 3):
        make_finetune(base, os.path.join(zoo, f"ft{i}"), seed=i)
base = os.path.join(zoo, "base")
fts = [os.path.join(zoo, f"ft{i}") for i in (1, 2, 3)]
if fed:
    from hubsoup.engine import hostfeed
    hostfeed.for_device = lambda d: hostfeed.Feed(d, transfer=lambda t: t.clone())
inputs = fts[:2] if method == "slerp" else fts
out = os.path.join(work, "out")
hubsoup.merge(inputs, method, base=base, out=out, params=params, quiet=True, overwrite=True)
h = hashlib.sha256()
for f in sorted(os.listdir(out)):
    if f.endswith(".safetensors"):
        h.update(open(os.path.join(out, f), "rb").read())
print(h.hexdigest())
"""


def digest(tree: str, work: str, method: str, params: dict, dtype: str, fed: bool) -> str:
    env = {**os.environ, "PYTHONPATH": tree + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    r = subprocess.run([sys.executable, "-c", CHILD, work, method, json.dumps(params), dtype, "1" if fed else "0"],
                       env=env, capture_output=True, text=True, cwd=work)
    if r.returncode:
        return "FAILED: " + r.stderr.strip().splitlines()[-1]
    return r.stdout.strip().splitlines()[-1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--other", default="/work/main")
    ap.add_argument("--work", default="/tmp/hubsoup-cmp")
    ap.add_argument("--fed", action="store_true")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--methods", nargs="*", help="only these methods")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    bad = 0
    for dtype in args.dtypes.split(","):
        for method, params in METHODS:
            if args.methods and method not in args.methods:
                continue
            a = digest(args.other, args.work, method, params, dtype, False)
            b = digest(ROOT, args.work, method, params, dtype, False)
            row = f"{dtype:<9} {method:<16} {json.dumps(params):<40} other={a[:12]} this={b[:12]}"
            ok = a == b and not a.startswith("FAILED")
            if args.fed:
                c = digest(ROOT, args.work, method, params, dtype, True)
                row += f" fed={c[:12]}"
                ok = ok and c == b
            bad += not ok
            print(row + ("  same" if ok else "  DIFFERENT"), flush=True)
    print(f"{bad} different")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
