#!/usr/bin/env python3
"""Benchmark: peak memory (RSS) of a merge against model depth, for every streaming code path.

The full-checkpoint merge unmaps the safetensors files after every block, so its resident
memory stays at about (N+2) tensors whatever the depth. This measures whether the other paths
do the same, on a Llama-shaped model at several depths with the SAME tensor sizes:

* ``full``: ``hubsoup.merge(fts, "task_arithmetic")`` -> a full checkpoint (the reference);
* ``lora-from-lora``: task arithmetic of 2 LoRA adapters (r=128, all linear modules) ->
  ``output_format="lora", rank=8``;
* ``lora-from-full``: task arithmetic of 2 full fine-tunes -> ``output_format="lora", rank=8``
  (per-module SVD of the dense merged task vector);
* ``continual-add``: ``continual.init([ft1, ft2])`` (made beforehand, not measured), then
  ``continual.add(soup, [ft3], out=...)`` is measured;
* ``lot``: LOT Merging of 2 fine-tunes with 4 exemplars per task (``max_length=16``), Gram
  budget 11 MB (~3 layers' float64 Grams at the default shape, so the Grams held at once are
  bounded at every depth): runs each expert θ0+τ with forward hooks, then merges.

How (as ``tests/engine/test_memory_depth.py``, which asserts the same bound at 12 vs 24 layers):
everything is built by this process under ``benchmarks/.work/memory`` (git-ignored, cached). A
server interpreter (``tests/rss_server.py``, the tests' own) imports torch, transformers, hubsoup (and peft, datasets) once; each
measurement is a fork of it (as fresh as ``python -c`` after its imports), which runs the same
path once on a 2-layer model of the same shapes (lazy imports, first-call caches: not measured),
then writes 5 to ``/proc/self/clear_refs`` (Linux: resets the peak RSS, VmHWM, to the current
RSS) and reports VmHWM - VmRSS-at-start around the measured call; this process samples its
anonymous and file-backed (mmapped inputs) RSS from /proc/PID/status every 5 ms. A path is
"flat" when growth(deepest) <= 1.25 x growth(shallowest) + 8 MiB.

Each measurement is made twice (``--malloc both``): with glibc's mmap threshold fixed at its
initial 128 KiB (``mallopt``; what the test does: temporaries are always mapped and unmapped,
so the number is what the code holds, the same every run) and with glibc's defaults (what a
user gets: the threshold rises after large frees and heap fragmentation can add a few MiB per
block, varying from process to process; ``--repeat N`` runs N rounds, each with a fresh server).

Writes ``benchmarks/results/memory_depth.{md,json}``: machine, versions, each path's growth at
each depth, the ratio deepest/shallowest.

Usage::

    python benchmarks/bench_memory.py                        # 12 and 24 layers, all paths (~1-2 min, 2 cores)
    python benchmarks/bench_memory.py --repeat 3             # 3 rounds (fresh servers): min and max growth
    python benchmarks/bench_memory.py --layers 12 24 48      # more depths (the ratio is deepest / shallowest)
    python benchmarks/bench_memory.py --paths full lot       # some paths only
    python benchmarks/bench_memory.py --quick                # tiny smoke test of the script
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.metadata
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]  # hubsoup from this tree; the measuring server (rss_server)
from rss_server import MMAP_THRESHOLD  # noqa: E402  (glibc's initial threshold; "fixed" mode pins it there)

MB = 1024 * 1024
WARMUP_LAYERS = 2
RATIO, SLACK_MIB = 1.25, 8.0  # the flatness bound, as in tests/engine/test_memory_depth.py
HELD_MODELS = {"lot": 1}  # model copies a path holds by design (taken off before judging flatness)
LORA_INPUT_RANK, LORA_OUTPUT_RANK = 128, 8  # inputs: 2 MiB per layer per adapter at the default shape
LOT_PARAMS = {"n_exemplars": 4, "max_length": 16, "batch_size": 4, "gram_budget_gb": 0.011}
COMMON = dict(vocab_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              tie_word_embeddings=False)
BUILD_VERSION = 1  # bump when the way models are built changes (invalidates the cache)

PATHS = {
    "full": "task_arithmetic -> full checkpoint (reference)",
    "lora-from-lora": f"task_arithmetic of 2 LoRAs (r={LORA_INPUT_RANK}) -> LoRA r={LORA_OUTPUT_RANK}",
    "lora-from-full": f"task_arithmetic of 2 full fine-tunes -> LoRA r={LORA_OUTPUT_RANK}",
    "continual-add": "continual.add of 1 fine-tune to a soup of 2 (OPCM)",
    "lot": "LOT of 2 fine-tunes (expert capture + merge)",
}


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------
def _weights(folder: str) -> list[str]:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))




def _write_exemplars(path: str, seed: int, n: int = 8) -> None:
    rng = random.Random(seed)
    words = COMMON["vocab_size"] - 5  # save_tiny_tokenizer's words w0 .. w{vocab-6}
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            text = " ".join(f"w{rng.randrange(words)}" for _ in range(rng.randint(6, 14)))
            f.write(json.dumps({"text": text}) + "\n")


def build(root: str, shape: dict, layers: int, log) -> dict:
    """Base (float32, with a tiny tokenizer), 3 fine-tunes, 2 LoRA adapters; cached. The 2 exemplar files are
    shared by every depth: the warm-up's load fills the datasets cache, which the measured call then reads."""
    d = os.path.join(root, f"L{layers}")
    z = {"root": d, "base": os.path.join(d, "base"), "fts": [os.path.join(d, f"ft{i}") for i in (1, 2, 3)],
         "loras": [os.path.join(d, f"lora{i}") for i in (1, 2)],
         "ex": [os.path.join(root, f"ex{i}.jsonl") for i in (1, 2)], "soup": os.path.join(d, "soup")}
    for i, e in enumerate(z["ex"], 1):
        if not os.path.isfile(e):
            os.makedirs(root, exist_ok=True)
            _write_exemplars(e, seed=i)
    stamp = os.path.join(d, "BUILD")
    tag = json.dumps({"v": BUILD_VERSION, "shape": shape, "layers": layers, "lora_r": LORA_INPUT_RANK})
    if os.path.isfile(stamp) and open(stamp).read() == tag:
        return z
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hubsoup.testing import make_finetune, save_tiny_tokenizer, write_adapter

    t0 = time.perf_counter()
    shutil.rmtree(d, ignore_errors=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **shape)).to(torch.float32).eval()
    model.save_pretrained(z["base"])
    del model
    save_tiny_tokenizer(z["base"], vocab=COMMON["vocab_size"])
    for i, ft in enumerate(z["fts"], 1):
        make_finetune(z["base"], ft, seed=i)
    for i, a in enumerate(z["loras"], 1):
        write_adapter(a, z["base"], seed=10 + i, r=LORA_INPUT_RANK)
    with open(stamp, "w") as f:
        f.write(tag)
    log(f"built {layers} layers: {model_mib(z['base']):.1f} MiB per model ({time.perf_counter() - t0:.1f} s)")
    return z


def model_mib(folder: str) -> float:
    return sum(os.path.getsize(p) for p in _weights(folder)) / MB


# --------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------
# The measuring server is the tests' (tests/rss_server.py, one copy for both): a fresh interpreter that imports
# torch, transformers, hubsoup once and forks one process per measurement; with sample=True this process samples
# the measured process's RssAnon / RssFile every 5 ms.
def child_env(work: str) -> dict:
    return {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HOME": os.path.join(work, "hf-home"), "TOKENIZERS_PARALLELISM": "false",
            # one thread unless told otherwise: on a shared 2-core machine OpenMP's spinning threads can make a
            # small eigh or SVD 30x slower; memory is what is measured here, times are only indicative
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


class Server:
    """The forking server of ``tests/rss_server.py``; ``measure(spec)`` runs one measurement at a time."""

    def __init__(self, work: str):
        from rss_server import RssServer

        self.server = RssServer(env=child_env(work), timeout_s=3600)  # deep LOT runs take minutes

    def close(self) -> None:
        self.server.close()

    def measure(self, spec: dict) -> dict:
        """One spec; adds the sampled peak growth of anonymous / file-backed RSS."""
        (r,) = self.server.measure([spec], sample=True)
        return r


def call(path: str, z: dict, out: str) -> list:
    """The measured call of ``path`` on the models ``z``, as (kind, kwargs) for the child."""
    common = dict(base=z["base"], out=out, quiet=True, overwrite=True)
    if path == "full":
        return ["merge", dict(inputs=z["fts"][:2], method="task_arithmetic", **common)]
    if path == "lora-from-lora":
        return ["merge", dict(inputs=z["loras"], method="task_arithmetic", output_format="lora",
                              rank=LORA_OUTPUT_RANK, **common)]
    if path == "lora-from-full":
        return ["merge", dict(inputs=z["fts"][:2], method="task_arithmetic", output_format="lora",
                              rank=LORA_OUTPUT_RANK, **common)]
    if path == "continual-add":
        return ["continual_add", dict(soup=z["soup"], models=[z["fts"][2]], out=out, quiet=True, overwrite=True)]
    if path == "lot":
        return ["merge", dict(inputs=z["fts"][:2], method="lot", exemplars={"1": z["ex"][0], "2": z["ex"][1]},
                              params=dict(LOT_PARAMS), **common)]
    raise ValueError(path)


def ensure_soup(z: dict, server: Server, log) -> None:
    """continual.init([ft1, ft2]) -> z["soup"] (in a forked process; cached next to the models)."""
    stamp = os.path.join(z["soup"] + ".BUILD")
    if os.path.isfile(stamp) and os.path.isdir(z["soup"]):
        return
    t0 = time.perf_counter()
    server.measure({"measure": ["continual_init", dict(models=z["fts"][:2], base=z["base"], out=z["soup"],
                                                        quiet=True, overwrite=True)]})
    with open(stamp, "w") as f:
        f.write("ok")
    log(f"continual soup of {os.path.basename(z['root'])}: {time.perf_counter() - t0:.1f} s")


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------
def versions() -> dict:
    out = {"python": platform.python_version()}
    for m in ("torch", "transformers", "safetensors", "peft", "datasets", "tokenizers", "numpy"):
        try:
            out[m] = importlib.metadata.version(m)
        except importlib.metadata.PackageNotFoundError:
            out[m] = "-"
    import hubsoup

    out["hubsoup"] = hubsoup.__version__
    return out


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True).stdout.strip()


def code_info() -> dict:
    h = hashlib.sha1()
    for p in sorted(glob.glob(os.path.join(REPO, "hubsoup", "**", "*.py"), recursive=True)):
        h.update(os.path.relpath(p, REPO).encode())
        with open(p, "rb") as f:
            h.update(f.read())
    return {"git_head": _git("rev-parse", "--short", "HEAD") or "?",
            "working_tree_changes_in_hubsoup": bool(_git("status", "--porcelain", "--", "hubsoup")),
            "sources_sha1": h.hexdigest()[:10]}


def machine_info() -> dict:
    cpu, mem = "?", 0
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
        with open("/proc/meminfo") as f:
            mem = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) // 1024
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_mib": mem, "kernel": platform.release(),
            "platform": platform.platform(), "machine": platform.machine()}


def write_report(res: dict, out_dir: str, name: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(res, f, indent=2)
    depths = res["layers"]
    lo, hi = depths[0], depths[-1]
    m, v, c = res["machine"], res["versions"], res["code"]
    sh = res["shape"]
    L = ["# Peak memory against model depth", ""]
    L.append(f"LlamaForCausalLM, hidden {sh['hidden_size']}, intermediate {sh['intermediate_size']}, vocab "
             f"{sh['vocab_size']}, float32 safetensors: "
             + ", ".join(f"{d} layers = **{res['model_mib'][str(d)]:.1f} MiB**" for d in depths)
             + f" per model (same tensor sizes at every depth). Inputs: 2 full fine-tunes (3 for continual), or 2 "
               f"LoRA adapters, r={LORA_INPUT_RANK} on all linear modules ("
             + " / ".join(f"{res['lora_mib'][str(d)]:.1f}" for d in depths) + " MiB each).")
    L.append("")
    L.append(f"Machine: {m['cpu']}, {m['cores']} CPUs, {m['mem_mib']} MiB RAM, {m['platform']}. Python "
             f"{v['python']}, torch {v['torch']}, transformers {v['transformers']}, safetensors {v['safetensors']}, "
             f"peft {v['peft']}, datasets {v['datasets']}; hubsoup {v['hubsoup']} (git {c['git_head']}"
             f"{' + uncommitted changes in hubsoup/' if c['working_tree_changes_in_hubsoup'] else ''}, sources "
             f"{c['sources_sha1']}). Load average (1 min) before / after: {res['loadavg'][0]:.1f} / "
             f"{res['loadavg'][1]:.1f}; OMP_NUM_THREADS={res['omp_threads']} in the measured processes.")
    rep = res["repeat"]
    L += ["",
          "Growth = peak RSS during the measured call minus RSS just before it, in a fresh process (a fork of an "
          "interpreter that has only imported torch, transformers and hubsoup) that first ran the same path on a "
          "2-layer model (imports, caches) and then reset its peak with `/proc/self/clear_refs`. Anon / file = peak "
          "growth of anonymous / file-backed (mmapped inputs) RSS, sampled from outside every 5 ms (may miss short "
          f"peaks). Flat = growth({hi}) <= {RATIO} x growth({lo}) + {SLACK_MIB:.0f} MiB (the assertion of "
          "`tests/engine/test_memory_depth.py`)"
          + (f"; {rep} rounds, each with its own server (its own address-space layout): the smallest growth, "
             "the largest in brackets." if rep > 1 else "."), ""]
    notes = {
        "fixed": f"glibc's mmap threshold fixed at {MMAP_THRESHOLD // 1024} KiB (`mallopt(M_MMAP_THRESHOLD)`, as "
                 "the test does): temporaries of 128 KiB or more are mapped and unmapped, so this is what the code "
                 "holds.",
        "default": "glibc's defaults (what a user gets): the mmap threshold rises each time a large block is "
                   "freed, after which temporaries of that size come from the heap, where small long-lived "
                   "allocations made between them can pin it (fragmentation): RSS can creep up with the number "
                   "of blocks, by an amount that changes from process to process.",
    }
    for mode in res["malloc_modes"]:
        L += [f"## Allocator: {mode}", "", notes[mode], ""]
        head = ("| Path | " + " | ".join(f"{d} layers (MiB)" for d in depths) + f" | Ratio {hi}/{lo} | Flat? | "
                + " | ".join(f"Anon / file at {d} (MiB)" for d in (lo, hi)) + " | Merge time (s) |")
        L += [head, "|" + "---|" * (head.count("|") - 1)]
        for p, rows in res["paths"].items():
            row = rows[mode]
            g = row["growth_mib"]
            cell = (lambda d: f"{g[str(d)]:.1f}" + (f" ({row['growth_max_mib'][str(d)]:.1f})" if rep > 1 else ""))
            L.append(f"| {PATHS[p]} | " + " | ".join(cell(d) for d in depths)
                     + f" | {row['ratio']:.2f} | {('yes' if row['flat'] else '**no**') + (' (beyond the model it runs)' if row['held_models'] else '')} | "
                     + " | ".join(f"{row['anon_mib'][str(d)]:.0f} / {row['file_mib'][str(d)]:.0f}" for d in (lo, hi))
                     + " | " + " / ".join(f"{row['merge_s'][str(d)]:.1f}" for d in depths) + " |")
        L.append("")
    L += ["Holding one model's worth of anything (mapped input pages not released, a float32 copy of the model, "
          "the whole output before writing it) adds one model's size per held model from one depth to the next; "
          "a path that releases its files after every block (the reference) stays at a few tensors.",
          "",
          f"Reproduce: `python benchmarks/bench_memory.py --layers {' '.join(map(str, depths))}"
          f"{f' --repeat {rep}' if rep > 1 else ''}`."]
    text = "\n".join(L) + "\n"
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(text)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[12, 24], help="depths to measure (default: 12 24)")
    ap.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds, each with a fresh server (the smallest growth is kept, the largest shown)")
    ap.add_argument("--malloc", choices=["both", "fixed", "default"], default="both",
                    help="glibc mmap threshold fixed at 128 KiB (as the test), glibc's defaults, or both")
    ap.add_argument("--quick", action="store_true", help="tiny smoke test: hidden 64, layers 2 4")
    ap.add_argument("--work", default=os.path.join(HERE, ".work", "memory"), help="cache folder (git-ignored)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    if not os.path.exists("/proc/self/clear_refs"):
        print("needs Linux /proc/self/clear_refs (to reset the peak RSS)", file=sys.stderr)
        return 2
    if args.quick:
        args.hidden, args.intermediate, args.layers = 64, 128, [2, 4]
    depths = sorted(set(args.layers))
    if len(depths) < 2:
        ap.error("--layers needs at least two depths")
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    shape = dict(hidden_size=args.hidden, intermediate_size=args.intermediate, **COMMON)
    root = os.path.join(args.work, f"h{args.hidden}-i{args.intermediate}")
    zoo = {d: build(root, shape, d, log) for d in sorted({WARMUP_LAYERS, *depths})}
    modes = ["fixed", "default"] if args.malloc == "both" else [args.malloc]
    res = {"layers": depths, "shape": shape, "machine": machine_info(), "versions": versions(), "code": code_info(),
           "bound": {"ratio": RATIO, "slack_mib": SLACK_MIB}, "repeat": args.repeat, "malloc_modes": modes,
           "mmap_threshold": MMAP_THRESHOLD,
           "model_mib": {str(d): model_mib(zoo[d]["base"]) for d in depths},
           "lora_mib": {str(d): model_mib(zoo[d]["loras"][0]) for d in depths}, "paths": {}}
    runs = {p: {m: {d: [] for d in depths} for m in modes} for p in args.paths}
    for rnd in range(args.repeat):
        server = Server(args.work)
        try:
            if rnd == 0 and "continual-add" in args.paths:
                for z in zoo.values():
                    ensure_soup(z, server, log)
            for p in args.paths:
                for m in modes:
                    for d in depths:
                        warm = zoo[WARMUP_LAYERS]
                        spec = {"warmup": call(p, warm, os.path.join(warm["root"], f"out-{p}")),
                                "measure": call(p, zoo[d], os.path.join(zoo[d]["root"], f"out-{p}")),
                                "mmap_threshold": MMAP_THRESHOLD if m == "fixed" else None}
                        r = server.measure(spec)
                        runs[p][m][d].append(r)
                        log(f"{PATHS[p]:<58} {m:>7} malloc {d:>3} layers: growth {r['growth_mib']:6.1f} MiB "
                            f"(anon {r['anon_growth_mib']:.0f}, file {r['file_growth_mib']:.0f}), "
                            f"{r['measure_s']:.1f} s")
                        shutil.rmtree(os.path.join(zoo[d]["root"], f"out-{p}"), ignore_errors=True)
        finally:
            server.close()
    for p in args.paths:
        res["paths"][p] = {}
        for m in modes:
            row = {k: {} for k in ("growth_mib", "growth_max_mib", "anon_mib", "file_mib", "merge_s")}
            for d in depths:
                rs = runs[p][m][d]
                best = min(rs, key=lambda r: r["growth_mib"])
                row["growth_mib"][str(d)] = best["growth_mib"]
                row["growth_max_mib"][str(d)] = max(r["growth_mib"] for r in rs)
                row["anon_mib"][str(d)] = best["anon_growth_mib"]
                row["file_mib"][str(d)] = best["file_growth_mib"]
                row["merge_s"][str(d)] = min(r["measure_s"] for r in rs)
            g_lo, g_hi = row["growth_mib"][str(depths[0])], row["growth_mib"][str(depths[-1])]
            row["ratio"] = g_hi / g_lo if g_lo > 0 else float("inf")
            # LOT runs the model forward: one float32 copy of it is held by design; flat is judged beyond it
            held = HELD_MODELS.get(p, 0)
            row["held_models"] = held
            b_lo = g_lo - held * res["model_mib"][str(depths[0])]
            b_hi = g_hi - held * res["model_mib"][str(depths[-1])]
            row["flat"] = b_hi <= RATIO * b_lo + SLACK_MIB
            row["runs"] = {str(d): runs[p][m][d] for d in depths}
            res["paths"][p][m] = row
    res["loadavg"] = [load_before, os.getloadavg()[0]]
    res["omp_threads"] = child_env(args.work)["OMP_NUM_THREADS"]
    res["seconds"] = time.perf_counter() - t_start
    text = write_report(res, args.out, "memory_depth_quick" if args.quick else "memory_depth")
    print(text)
    log(f"total {res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
