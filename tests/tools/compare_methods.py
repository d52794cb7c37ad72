"""Merge every registered method on the tiny test models with two hubsoup trees and compare the outputs byte for
byte (issue 33: a refactoring that moves code must not change a single output bit).

    python tests/tools/compare_methods.py --old /work/main --new . [--arch llama] [--methods ties,dare]

Each merge runs in its own process with ``PYTHONPATH=<tree>`` (so each tree's own code is imported), on the same
input folders; a method is merged with three inputs, or two or one where it takes no more (SLERP, ...), and LOT
with the char tokenizer and exemplars of tests/methods/test_lot.py. Compared: every ``*.safetensors`` file's tensor bytes
and header metadata (the public recipe, hash included), and ``hubsoup_recipe.yaml`` with the output's own path
left out. Exit status 1 when any output differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)

WORKER = r"""
import json, sys, os
import hubsoup
from hubsoup.errors import HubsoupError
spec = json.loads(sys.argv[1])
last = None
for n in (3, 2, 1):
    kw = dict(spec["params"])
    if spec["method"] == "lot":
        kw["exemplars"] = {str(i + 1): spec["exemplars"][i % len(spec["exemplars"])] for i in range(n)}
        kw.update(n_exemplars=8, batch_size=8)
    try:
        hubsoup.merge(spec["inputs"][:n], method=spec["method"], base=spec["base"], out=spec["out"], quiet=True,
                      overwrite=True, **kw)
    except HubsoupError as e:
        last = e
        continue
    print(json.dumps({"n": n}))
    break
else:
    print(json.dumps({"error": f"{type(last).__name__}: {last}"}))
"""


def _methods(tree: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", "import json, hubsoup.methods as m; print(json.dumps(sorted(m.available())))"],
                         env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _files(folder: str) -> dict[str, bytes]:
    out = {}
    for fn in sorted(os.listdir(folder)):
        p = os.path.join(folder, fn)
        if os.path.isfile(p) and (fn.endswith(".safetensors") or fn == "hubsoup_recipe.yaml"):
            with open(p, "rb") as f:
                data = f.read()
            out[fn] = data.replace(os.path.abspath(folder).encode(), b"<out>")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--methods", default="")
    args = ap.parse_args()
    old, new = os.path.abspath(args.old), os.path.abspath(args.new)
    sys.path[:0] = [TESTS, new, os.path.dirname(TESTS)]
    from hubsoup.testing import make_base, make_finetune
    from tests.methods.test_lot import add_char_tokenizer, write_exemplars

    names = sorted(set(_methods(old)) & set(_methods(new)))
    if args.methods:
        names = [n for n in names if n in args.methods.split(",")]
    only = sorted(set(_methods(old)) ^ set(_methods(new)))
    rows, bad = [], 0
    with tempfile.TemporaryDirectory(prefix="hubsoup-compare-") as tmp:
        base = add_char_tokenizer(make_base(args.arch, os.path.join(tmp, "base")))
        fts = [make_finetune(base, os.path.join(tmp, f"ft{i}"), seed=i) for i in (1, 2, 3)]
        ex = [write_exemplars(os.path.join(tmp, f"ex{i}.jsonl"), seed=i) for i in (1, 2, 3)]
        for name in names:
            outs = {}
            for label, tree in (("old", old), ("new", new)):
                out = os.path.join(tmp, f"{name}-{label}")
                spec = {"method": name, "inputs": fts, "base": base, "out": out, "params": {}, "exemplars": ex}
                r = subprocess.run([sys.executable, "-c", WORKER, json.dumps(spec)], capture_output=True, text=True,
                                   env={**os.environ, "PYTHONPATH": tree, "HF_HUB_OFFLINE": "1"}, cwd=tmp)
                last = (r.stdout.strip().splitlines() or ["{}"])[-1]
                res = json.loads(last) if last.startswith("{") else {"error": r.stderr.strip()[-300:]}
                outs[label] = (res, _files(out) if "n" in res else {})
            (ro, fo), (rn, fn_) = outs["old"], outs["new"]
            if "error" in ro or "error" in rn:
                same = ro == rn
                what = f"not merged: old {ro.get('error', 'ok')!r}, new {rn.get('error', 'ok')!r}"
            else:
                same = ro == rn and fo == fn_
                what = (f"{ro['n']} inputs, {len(fo)} files, "
                        f"{sum(len(v) for v in fo.values())} bytes" if same else
                        f"DIFFERENT: {sorted(k for k in set(fo) | set(fn_) if fo.get(k) != fn_.get(k))}")
            bad += not same
            rows.append(f"{'same' if same else 'DIFF'}  {name:16s} {what}")
            print(rows[-1], flush=True)
    if only:
        print("registered in one tree only (not compared):", ", ".join(only))
    print(f"{len(names) - bad} of {len(names)} methods byte-identical ({args.arch})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
