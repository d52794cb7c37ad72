"""Read-ahead and compute cost: a merge of a ~270M-parameter bf16 Llama-shaped model, base + 3 fine-tunes.

Two measurements, each merge in its own process (wall time, user+sys CPU time, peak RSS):

* ``--io``: task arithmetic with the read-ahead on and off (``prefetch=``), from a cold page
  cache (every input file evicted with ``posix_fadvise(DONTNEED)`` before the run; the
  machine-wide ``drop_caches`` is not used, the machine is shared) and from a warm one.
* ``--compute``: task arithmetic and TIES (``scope=model`` and ``scope=tensor``), warm cache,
  CPU time — run it on a tree before and after a change and compare (``--label``).

Results are appended to ``benchmarks/results/prefetch.json`` (one record per run, with the
load average, so noisy numbers can be told apart); ``benchmarks/results/prefetch.md`` is
written by hand from them.

    python benchmarks/bench_prefetch.py --io --repeat 2
    python benchmarks/bench_prefetch.py --compute --label after
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SIZE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
            num_attention_heads=16, num_key_value_heads=16)
SEEDS = (1, 2, 3)


def build(root: str) -> tuple[str, list[str]]:
    """Base + 3 bf16 fine-tunes under ``root`` (cached)."""
    base, fts = os.path.join(root, "base"), [os.path.join(root, f"ft{s}") for s in SEEDS]
    stamp = os.path.join(root, "built.json")
    if os.path.isfile(stamp) and json.load(open(stamp)) == SIZE:
        return base, fts
    import torch
    import transformers as tf

    from hubsoup.testing import make_finetune

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(**SIZE, max_position_embeddings=2048, tie_word_embeddings=False)
    model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(base, max_shard_size="200MB")
    del model
    for s, ft in zip(SEEDS, fts):
        make_finetune(base, ft, seed=s, scale=0.01)
    json.dump(SIZE, open(stamp, "w"))
    return base, fts


def files(folders: list[str]) -> list[str]:
    return sorted(p for d in folders for p in glob.glob(os.path.join(d, "*.safetensors")))


def evict(paths: list[str]) -> None:
    """Drop these files' pages from the page cache (only clean, unmapped pages go: written files are synced)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def one(args) -> None:
    """Child: one merge, prints its measurements as JSON."""
    import hubsoup

    params = json.loads(args.params)
    t0 = time.perf_counter()
    hubsoup.merge(args.inputs, args.method, base=args.base, out=args.out, params=params, quiet=True,
                  overwrite=True, prefetch=args.prefetch == "on", shard_size="200MB")
    wall = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"wall_s": round(wall, 2), "user_s": round(ru.ru_utime, 2), "sys_s": round(ru.ru_stime, 2),
                      "peak_rss_mb": round(ru.ru_maxrss / 1024)}))


def run_one(base, fts, out, method, params, prefetch_on: bool) -> dict:
    cmd = [sys.executable, __file__, "--one", "--base", base, "--out", out, "--method", method,
           "--params", json.dumps(params), "--prefetch", "on" if prefetch_on else "off", "--inputs", *fts]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": REPO})
    if res.returncode:
        raise SystemExit(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=os.path.join(HERE, ".work", "prefetch"))
    ap.add_argument("--io", action="store_true", help="read-ahead on/off, cold and warm cache")
    ap.add_argument("--compute", action="store_true", help="CPU time of TA and TIES (warm cache)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--label", default="")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--base"), ap.add_argument("--out"), ap.add_argument("--method")
    ap.add_argument("--params", default="{}"), ap.add_argument("--prefetch", default="on")
    ap.add_argument("--inputs", nargs="*")
    args = ap.parse_args()
    if args.one:
        one(args)
        return 0
    sys.path.insert(0, REPO)
    base, fts = build(os.path.join(args.work, "models"))
    out = os.path.join(args.work, "out")
    inputs = files([base, *fts])
    size_mb = sum(os.path.getsize(p) for p in inputs) / 2**20
    records = []

    def record(kind, method, params, cache, prefetch_on):
        if cache == "cold":
            evict(inputs)
        r = run_one(base, fts, out, method, params, prefetch_on)
        r.update(kind=kind, method=method, params=params, cache=cache, prefetch=prefetch_on, label=args.label,
                 input_mb=round(size_mb), loadavg=[round(x, 2) for x in os.getloadavg()], nproc=os.cpu_count(),
                 time=time.strftime("%Y-%m-%d %H:%M:%S"))
        print(json.dumps(r), flush=True)
        records.append(r)

    for _ in range(args.repeat):
        if args.io:
            for cache in ("cold", "warm"):
                for on in (False, True):  # interleaved, so drifting load hits both alike
                    record("io", "task_arithmetic", {}, cache, on)
        if args.compute:
            for method, params in (("task_arithmetic", {}), ("ties", {"density": 0.2}),
                                   ("ties", {"density": 0.2, "scope": "tensor"})):
                record("compute", method, params, "warm", True)
    path = os.path.join(HERE, "results", "prefetch.json")
    old = json.load(open(path)) if os.path.isfile(path) else []
    json.dump(old + records, open(path, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
