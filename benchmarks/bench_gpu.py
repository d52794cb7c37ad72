"""Merge throughput on a GPU: input GB/s per method on a ~1B-parameter bf16 Llama-shaped model.

Base + 3 fine-tunes are made locally (random weights, the shapes of a 1B Llama), then each method
merges them with ``--device cuda`` (hubsoup's engine, one process per method, inputs warm in the
page cache). Input GB/s = bytes of all inputs (base + fine-tunes) / merge wall time.

    python benchmarks/bench_gpu.py --work /tmp/gpu-bench --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = [("task_arithmetic", []), ("ties", []), ("dare", ["-p", "then=ties", "-p", "p=0.9"]),
           ("sftm", []), ("slerp", [])]


def make_models(work: str, layers: int) -> tuple[str, list[str]]:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False, torch_dtype="bfloat16")
    shapes = {"model.embed_tokens.weight": (32000, 2048), "model.norm.weight": (2048,), "lm_head.weight": (32000, 2048)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (2048, 2048), p + "self_attn.k_proj.weight": (512, 2048),
                       p + "self_attn.v_proj.weight": (512, 2048), p + "self_attn.o_proj.weight": (2048, 2048),
                       p + "mlp.gate_proj.weight": (5632, 2048), p + "mlp.up_proj.weight": (5632, 2048),
                       p + "mlp.down_proj.weight": (2048, 5632), p + "input_layernorm.weight": (2048,),
                       p + "post_attention_layernorm.weight": (2048,)})
    g = torch.Generator(device="cuda").manual_seed(0)
    base = {k: (torch.randn(s, generator=g, device="cuda") * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    folders = []
    for j in range(4):
        d = os.path.join(work, "base" if j == 0 else f"ft{j}")
        os.makedirs(d, exist_ok=True)
        tensors = base if j == 0 else {k: (v.float() + torch.randn(v.shape, generator=g, device="cuda") * 0.002
                                           ).to(torch.bfloat16) for k, v in base.items()}
        save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, os.path.join(d, "model.safetensors"))
        cfg.save_pretrained(d)
        folders.append(d)
    n_params = sum(v.numel() for v in base.values())
    return folders[0], folders[1:], n_params


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/hubsoup-gpu-bench")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--layers", type=int, default=16)
    args = ap.parse_args()
    import torch

    t0 = time.perf_counter()
    base, fts, n_params = make_models(args.work, args.layers)
    made_s = time.perf_counter() - t0
    size = os.path.getsize(os.path.join(base, "model.safetensors"))
    env = {**os.environ, "PYTHONPATH": ROOT}
    rows = []
    for method, extra in METHODS:
        inputs = fts[:2] if method == "slerp" else fts
        out = os.path.join(args.work, f"out-{method}")
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "hubsoup", "merge", *inputs, "--base", base, "--method", method,
                            *extra, "--device", "cuda", "--out", out, "--overwrite", "-q"],
                           env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t
        read = size * (len(inputs) + 1)
        rows.append({"method": method, "inputs": len(inputs), "wall_s": wall, "input_gb": read / 1e9,
                     "input_gb_per_s": read / 1e9 / wall, "ok": r.returncode == 0, "stderr": r.stderr[-400:]})
        print(f"{method:<16} {wall:6.1f} s  {read / 1e9 / wall:5.2f} GB/s input  rc={r.returncode}", flush=True)
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "python": platform.python_version(),
           "params": n_params, "model_gb": size / 1e9, "made_s": made_s, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump(res, f, indent=2)
    lines = ["# Merge throughput on a GPU", "",
             f"{res['device']}, torch {res['torch']}. A {n_params / 1e9:.2f}B-parameter Llama-shaped bf16 model "
             f"({size / 1e9:.2f} GB), base + 3 fine-tunes (2 for slerp), made locally; `hubsoup merge --device cuda`, "
             "one process per method (interpreter start and imports included), inputs warm in the page cache.", "",
             "| method | inputs | wall (s) | input GB read | input GB/s |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['inputs']} + base | {r['wall_s']:.1f} | {r['input_gb']:.1f} | "
                     f"{r['input_gb_per_s']:.2f} |" + ("" if r["ok"] else " (failed)"))
    lines += ["", "Reproduce (on a machine with a GPU): `python benchmarks/bench_gpu.py`."]
    with open(os.path.join(args.out, "gpu_bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
