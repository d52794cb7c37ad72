"""The README's method table states each method's cost from benchmark results in this tree (issue 50).

The "cost" column is × task arithmetic's wall on the CPU (``benchmarks/results/seed_methods_cpu.json``, written
by ``benchmarks/bench_seed_methods.py``) and hubsoup's merge GB/s on a GPU (``benchmarks/results/gpu_bench.json``);
``python benchmarks/bench_seed_methods.py --readme`` rewrites the column. A figure edited by hand, or results
re-measured without the README following, fails here.
"""

from __future__ import annotations

import importlib.util
import json
import os

from paths import ROOT


def _bench():
    spec = importlib.util.spec_from_file_location("bench_seed_methods",
                                                  os.path.join(ROOT, "benchmarks", "bench_seed_methods.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_cost_column_is_the_benchmarks():
    bsm = _bench()
    with open(os.path.join(ROOT, "benchmarks", "results", "seed_methods_cpu.json")) as f:
        seed = json.load(f)
    with open(os.path.join(ROOT, "benchmarks", "results", "gpu_bench.json")) as f:
        gpu = json.load(f)
    cells = bsm.cost_cells(seed, gpu)
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    rows = bsm.readme_method_rows(text)
    assert len(rows) > 20, "the README's method table was not found under '## Methods'"
    header = text.split("\n")[rows[0][0] - 2]
    assert header.rstrip().endswith(bsm.COST_HEADER + " |"), "the method table has no cost column"
    width = len(header.strip().strip("|").split(" | "))
    stated = {}
    for _, row in rows:
        assert len(row) == width, f"README method row {row[0]} has {len(row)} cells, the header {width}"
        stated[row[0].strip("`")] = row[-1]
    # every method with a measurement shows it, every other one a dash
    expected = {name: cells.get(name, "—") for name in stated}
    assert stated == expected
    # the seed papers' methods are all measured on the CPU (at least on the 124M model)
    for name in ("ties", "dare", "consensus", "lines", "lwptv", "sftm", "opcm", "lot"):
        assert stated[name].split(" / ")[0].endswith("×"), f"{name}: {stated[name]!r} lacks the 124M CPU ratio"
