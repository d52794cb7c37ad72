"""The device kernels behind issue 34's figures, timed alone on a GPU: what to choose, and why.

1. **k-th largest magnitude** (TIES' trim, SFTM's): ``torch.topk``'s selection against the two radix passes
   counted with ``index_add_`` (:data:`hubsoup.methods._kernels.DEVICE_SELECT`), on float32 vectors of 4M-64M
   entries; both must give the CPU's exact value.
2. **SFTM's stages** on a 1B Llama's matrix shapes, three task matrices each (random, trimmed to η = 0.2):
   the trim, the singular triplets by one batched float32 SVD (cuSOLVER's drivers) or by float64 Gram
   eigen-decompositions (:data:`hubsoup.methods.sftm.DEVICE_SVD`), the Gram system's solve; and the merged
   matrix's relative error against the CPU's float64 path.

Device times are medians of CUDA-synchronised repeats after a warm-up. Prints a table and writes
``gpu_probe.json`` to ``--out``.

    python benchmarks/gpu_probe.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(fn, repeat: int = 5, warm: bool = True) -> float:
    """Median seconds of ``fn()`` on the device (synchronised), after one warm-up call (``warm``)."""
    import torch

    if warm:
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def probe_select(sizes: list[int], density: float) -> list[dict]:
    import torch

    from hubsoup.methods import _kernels as K

    rows = []
    for n in sizes:
        x = torch.randn(n, device="cuda") * 0.002
        k = max(1, int(density * n))
        exact = K.kth_largest_abs(x.cpu(), k)
        row = {"numel": n, "k": k}
        for how in ("topk", "histogram"):
            K.DEVICE_SELECT = how
            got = float(K.kth_largest_abs_t(x, k))
            row[how + "_s"] = timed(lambda: K.kth_largest_abs_t(x, k))
            row[how + "_exact"] = got == exact
        K.DEVICE_SELECT = "topk"
        # the whole trim of one row: select + mask, as TIES does on a device
        row["trim_topk_s"] = timed(lambda: K.keep_topk_(x.clone(), k, ties="keep_ties"))
        rows.append(row)
        print(f"select n={n:>10,}: topk {row['topk_s'] * 1e3:7.2f} ms (exact {row['topk_exact']}), histogram "
              f"{row['histogram_s'] * 1e3:7.2f} ms (exact {row['histogram_exact']}), trim row {row['trim_topk_s'] * 1e3:7.2f} ms",
              flush=True)
    return rows


def probe_sftm(shapes: list[tuple[int, int]], n_tasks: int, eta: float, check: set[tuple[int, int]]) -> list[dict]:
    import torch

    from hubsoup.methods import sftm as S

    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for m, n in shapes:
        mats = torch.randn((n_tasks, m, n), generator=g, device="cuda") * 0.002
        row: dict = {"shape": [n_tasks, m, n]}

        def trim():
            t = mats.clone()
            for r in t:
                S.trim_topk_(r, eta)
            return t

        row["trim_s"] = timed(trim, 3)
        trimmed = trim()
        first = not rows  # the solver's handles and workspaces: warmed on the first shape only
        row["svd_float32_s"] = timed(lambda: S.singular_features_batched(trimmed), 1, warm=first)
        for driver in ("gesvdj", "gesvda"):
            try:
                row[f"svd_{driver}_s"] = timed(lambda: torch.linalg.svd(trimmed, full_matrices=False, driver=driver),
                                               1, warm=first)
            except Exception as e:  # noqa: BLE001 - a driver that refuses a shape is a finding
                row[f"svd_{driver}_s"] = f"{type(e).__name__}: {e}"[:120]
        row["gram_float64_s"] = timed(lambda: S.singular_features_gram(trimmed), 1, warm=first)
        feats = S.singular_features_gram(trimmed)
        row["superpose_s"] = timed(lambda: S.superpose(feats, out_dtype=torch.float32), 1, warm=first)
        _, info = S.superpose(feats, out_dtype=torch.float32)
        row["solver"] = info.get("solver")
        if (m, n) in check:  # against the CPU's float64 SVDs (the reference path)
            cpu = trimmed.cpu()
            ref, _ = S.superpose([S.singular_features(M) for M in cpu], out_dtype=torch.float32)
            for name, fn in (("svd_float32", S.singular_features_batched), ("gram_float64", S.singular_features_gram)):
                got, _ = S.superpose(fn(trimmed), out_dtype=torch.float32)
                row[name + "_rel_err"] = float((got.cpu() - ref).norm() / ref.norm())
        rows.append(row)
        print("sftm " + json.dumps(row), flush=True)
        del mats, trimmed, feats
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--skip-sftm", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_probe.py needs a CUDA device")
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    t0 = time.perf_counter()
    res["select"] = probe_select([1 << 22, 1 << 24, 1 << 26], 0.2)
    if not args.skip_sftm:
        res["sftm"] = probe_sftm([(2048, 2048), (512, 2048), (5632, 2048), (2048, 5632)], 3, 0.2,
                                 check={(512, 2048), (2048, 2048)})
    res["seconds"] = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_probe.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(f"probe done in {res['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
