#!/usr/bin/env python3
"""Benchmark: merging 4 LoRA adapters of a ~0.5 GB model — peak memory and wall time.

What it does:

1. Builds, once, under ``benchmarks/.work/lora`` (git-ignored): a LlamaForCausalLM base of
   ~134M parameters in float32 (~0.54 GB, one ``model.safetensors``; random weights written
   tensor by tensor from the meta-device model's shapes) and 4 PEFT LoRA adapters of it
   (r=16, lora_alpha=32, on q/k/v/o/gate/up/down of every layer: the usual "all linear"
   recipe; ``adapter_config.json`` + ``adapter_model.safetensors`` as peft writes them).
2. Runs each merge in a fresh process and records its peak RSS (``ru_maxrss`` via
   ``os.wait4``) plus the peak anonymous / file-backed RSS sampled from
   ``/proc/PID/status`` every 20 ms (file-backed = pages of the memory-mapped inputs):
   * ``import``: the interpreter with torch, transformers, peft and hubsoup imported (the floor);
   * ``task_arithmetic -> full``: a full checkpoint (linear method: LoRA factors, no stack);
   * ``task_arithmetic -> lora r=64``: a LoRA adapter (factors + QR; rank 64 = sum of input
     ranks, so the truncation error must be ~0);
   * ``ties -> full`` (scope=tensor): the dense path, every input's ΔW materialised per tensor;
   * ``ties -> lora r=32``: the dense path, then SVD per module.
3. Writes ``benchmarks/results/lora_bench.{md,json}``.

What it must show: peak RSS near one model plus a few layers' worth of tensors (the largest
tensor is the 32000 x 768 float32 embedding, 94 MiB), not one model per adapter.

Usage::

    python benchmarks/bench_lora.py            # ~1-2 min on 2 cores
    python benchmarks/bench_lora.py --quick    # tiny smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MB = 1024 * 1024
N_ADAPTERS, RANK, ALPHA = 4, 16, 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FULL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
            num_attention_heads=12, num_key_value_heads=12)
QUICK = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=8)
BUILD_VERSION = 1


def build(root: str, size: dict, log) -> tuple[str, list[str]]:
    import torch
    import transformers as tf
    from safetensors.torch import save_file

    stamp = os.path.join(root, "BUILD")
    tag = json.dumps({"v": BUILD_VERSION, "size": size, "n": N_ADAPTERS, "r": RANK})
    base = os.path.join(root, "base")
    adapters = [os.path.join(root, f"lora{i}") for i in range(N_ADAPTERS)]
    if os.path.isfile(stamp) and open(stamp).read() == tag:
        return base, adapters
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(base)
    cfg = tf.LlamaConfig(**size, max_position_embeddings=2048, tie_word_embeddings=False, dtype="float32")
    cfg.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    sd = {}
    for name, p in model.state_dict().items():
        sd[name] = (torch.ones(p.shape) if name.endswith("norm.weight")
                    else torch.randn(p.shape, generator=g) * 0.02)
    save_file(sd, os.path.join(base, "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(base)
    linear = {n[: -len(".weight")]: tuple(t.shape) for n, t in sd.items()
              if n.endswith(".weight") and n.split(".")[-2] in TARGETS}
    del sd
    log(f"built base: {sum(os.path.getsize(os.path.join(base, f)) for f in os.listdir(base)) / MB:.0f} MiB")
    for i, folder in enumerate(adapters):
        os.makedirs(folder)
        g = torch.Generator().manual_seed(100 + i)
        tensors = {}
        for module, (out_f, in_f) in linear.items():
            key = f"base_model.model.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, in_f, generator=g) / in_f ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, RANK, generator=g) * 0.01
        save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA,
                       "target_modules": TARGETS, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
                       "base_model_name_or_path": base, "use_rslora": False, "use_dora": False,
                       "rank_pattern": {}, "alpha_pattern": {}, "init_lora_weights": True}, f, indent=2)
    with open(stamp, "w") as f:
        f.write(tag)
    return base, adapters


_CHILD = r"""
import json, sys, time
import torch, transformers, peft, hubsoup
spec = json.loads(sys.argv[1])
t0 = time.perf_counter()
out = {}
if spec.get("merge"):
    res = hubsoup.merge(**spec["merge"])
    out["lora"] = {k: v for k, v in (res.lora or {}).items() if k != "modules"}
out["seconds"] = time.perf_counter() - t0
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
out["vmhwm"] = int(status["VmHWM"].split()[0]) * 1024  # peak RSS of this process image (reset by exec)
print("RESULT " + json.dumps(out))
"""


def measure(spec: dict) -> dict:
    """Run one merge in a fresh process: wall time, ru_maxrss, sampled peak anon/file RSS."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    peak = {"RssAnon": 0, "RssFile": 0}
    done = threading.Event()

    def sample():
        path = f"/proc/{proc.pid}/status"
        while not done.is_set():
            try:
                for line in open(path):
                    k = line.split(":")[0]
                    if k in peak:
                        peak[k] = max(peak[k], int(line.split()[1]) * 1024)
            except OSError:
                pass
            time.sleep(0.02)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    th.join()
    wall = time.perf_counter() - t0
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    if status != 0:
        raise RuntimeError(f"child failed ({status}):\n{stderr[-3000:]}")
    result = json.loads(next(line[7:] for line in stdout.splitlines() if line.startswith("RESULT ")))
    return {"peak_rss_mib": result["vmhwm"] / MB, "ru_maxrss_mib": usage.ru_maxrss / 1024,
            "anon_mib": peak["RssAnon"] / MB, "file_mib": peak["RssFile"] / MB,
            "wall_s": wall, "merge_s": result["seconds"], "lora": result.get("lora")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model (smoke test)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, REPO)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    size = QUICK if args.quick else FULL
    root = os.path.join(HERE, ".work", "lora-quick" if args.quick else "lora")
    if args.build_only:
        build(root, size, log)
        return 0
    # build in a child: this process stays small (a forked child's ru_maxrss starts at its parent's)
    subprocess.run([sys.executable, __file__, "--build-only", *(["--quick"] if args.quick else [])], check=True)
    base = os.path.join(root, "base")
    adapters = [os.path.join(root, f"lora{i}") for i in range(N_ADAPTERS)]
    work = os.path.join(root, "out")
    model_mib = os.path.getsize(os.path.join(base, "model.safetensors")) / MB
    adapter_mib = sum(os.path.getsize(os.path.join(a, "adapter_model.safetensors")) for a in adapters) / MB
    with open(os.path.join(base, "model.safetensors"), "rb") as f:  # the header: no torch in this process
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    largest = max(math.prod(v["shape"]) * 4 for k, v in header.items() if k != "__metadata__") / MB

    def merge_spec(name, method, params, **kw):
        return {"merge": {"inputs": adapters, "method": method, "base": base, "out": os.path.join(work, name),
                          "overwrite": True, "quiet": True, "params": params, **kw}}

    runs = [
        ("import (floor)", {}),
        ("task_arithmetic -> full", merge_spec("ta-full", "task_arithmetic", {"scale": 1.0})),
        (f"task_arithmetic -> lora r={N_ADAPTERS * RANK}",
         merge_spec("ta-lora", "task_arithmetic", {"scale": 1.0}, output_format="lora", rank=N_ADAPTERS * RANK)),
        ("ties (scope=tensor) -> full", merge_spec("ties-full", "ties", {"density": 0.2, "scope": "tensor"})),
        ("ties (scope=tensor) -> lora r=32",
         merge_spec("ties-lora", "ties", {"density": 0.2, "scope": "tensor"}, output_format="lora", rank=32)),
    ]
    rows = []
    load_before = os.getloadavg()[1]
    for name, spec in runs:
        r = measure(spec)
        rows.append({"run": name, **r})
        log(f"{name:<34} peak RSS {r['peak_rss_mib']:7.0f} MiB  anon {r['anon_mib']:7.0f}  file {r['file_mib']:7.0f}  "
            f"{r['merge_s']:6.1f}s")
    shutil.rmtree(work, ignore_errors=True)
    floor = rows[0]["peak_rss_mib"]
    info = {"model_mib": model_mib, "largest_tensor_f32_mib": largest, "adapters": N_ADAPTERS, "rank": RANK,
            "adapters_mib": adapter_mib, "import_floor_mib": floor, "python": platform.python_version(),
            "machine": platform.machine(), "cpus": os.cpu_count(), "quick": args.quick,
            "loadavg_5min": [load_before, os.getloadavg()[1]]}
    os.makedirs(args.out, exist_ok=True)
    name = "lora_bench_quick" if args.quick else "lora_bench"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump({"info": info, "runs": rows}, f, indent=2)
    lines = [
        "# LoRA merge benchmark",
        "",
        f"Base: LlamaForCausalLM, {size['num_hidden_layers']} layers, hidden {size['hidden_size']}, vocab "
        f"{size['vocab_size']}: **{model_mib:.0f} MiB** float32 (largest tensor {largest:.0f} MiB). "
        f"{N_ADAPTERS} LoRA adapters, r={RANK}, on q/k/v/o/gate/up/down of every layer ({adapter_mib:.0f} MiB in all). "
        f"Each run is a fresh process ({platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}).",
        "",
        "Peak RSS = the merging process's own high-water mark (`VmHWM`, read by it at exit; `ru_maxrss` from "
        "`os.wait4` agrees, and is in the JSON); anon / file = peak anonymous and file-backed (mmapped inputs) RSS "
        "sampled every 20 ms. "
        f"'Above floor' subtracts the {floor:.0f} MiB of an interpreter with torch, transformers, peft and hubsoup "
        "imported.",
        "",
        "| Run | Peak RSS (MiB) | Above floor (MiB) | x model | Peak anon (MiB) | Peak file (MiB) | Merge time (s) | Truncation error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        above = r["peak_rss_mib"] - floor
        err = f"{r['lora']['aggregate_rel_error']:.1e}" if r.get("lora") else "-"
        lines.append(f"| {r['run']} | {r['peak_rss_mib']:.0f} | {above:.0f} | {above / model_mib:.2f} | "
                     f"{r['anon_mib']:.0f} | {r['file_mib']:.0f} | {r['merge_s']:.1f} | {err} |")
    lines += [
        "",
        f"Load average (5 min) before / after the runs: {load_before:.1f} / {os.getloadavg()[1]:.1f} on "
        f"{os.cpu_count()} CPUs: times on a busy machine are inflated; the memory figures are not affected.",
        "",
        f"One model per adapter would be {N_ADAPTERS} x {model_mib:.0f} = {N_ADAPTERS * model_mib:.0f} MiB above the floor.",
        "Linear methods (task arithmetic) work on the adapters' stacked factors: the full output reads each base",
        "tensor once and adds P @ Q (file-backed pages of the base are what shows); the LoRA output never reads",
        "the base for tensors only LoRAs touch, and takes the SVD of the stacked factors via QR (rank 64 = the",
        "sum of the input ranks, so its error is float rounding). TIES is element-wise, so each input's dW is",
        "materialised per tensor (the (N+2) x largest-tensor bound); tensors no adapter touches are skipped.",
        "",
        "Reproduce: `python benchmarks/bench_lora.py`.",
    ]
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
