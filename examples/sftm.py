"""SFTM: merge three LoRA adapters so that every task keeps its singular features.

SFTM (Superpose Singular Features for Model Merging, Qiu, Wu, Yao) takes the SVD of
each task matrix ΔW_i = Σ σ u vᵀ and solves for the merged matrix M that answers every
kept singular direction exactly as its task does: u_aᵀ M v_a = σ_a (then scales M by
γ). Task arithmetic just adds the matrices, so each task's directions also pick up the
other tasks' updates. This script merges three LoRA adapters both ways and prints, for
one attention matrix, each task's top singular response u₁ᵀ ΔM v₁ / σ₁: SFTM gives
exactly γ for every task, task arithmetic (at the same scale γ) does not. For LoRA
inputs SFTM takes the singular triplets from the adapters' factors: ΔW_i is never formed.

Everything is built here (a tiny Llama base and three randomised adapters); no network.

Run:
    python examples/sftm.py [--out DIR]

CLI equivalent:
    hubsoup merge A B C --base BASE --method sftm -p gamma=0.6 --out sftm-soup
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import load_file

import hubsoup
from hubsoup.testing import make_adapter, make_base

MODULE = "model.layers.1.self_attn.q_proj"
GAMMA = 0.6


def lora_delta(adapter: str, module: str) -> torch.Tensor:
    """ΔW = (lora_alpha / r)·B·A of one module of a peft adapter, as peft applies it."""
    cfg = json.load(open(os.path.join(adapter, "adapter_config.json"), encoding="utf-8"))
    sd = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    a, b = (sd[f"base_model.model.{module}.lora_{x}.weight"].double() for x in ("A", "B"))
    return cfg["lora_alpha"] / cfg["r"] * b @ a


def weight_delta(model: str, base: str, module: str) -> torch.Tensor:
    key = f"{module}.weight"
    return (load_file(os.path.join(model, "model.safetensors"))[key].double()
            - load_file(os.path.join(base, "model.safetensors"))[key].double())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="SFTM merge of three LoRA adapters.")
    parser.add_argument("--out", help="folder for everything this example writes (default: a temporary folder, removed at exit)")
    args = parser.parse_args(argv)
    root = args.out or tempfile.mkdtemp(prefix="hubsoup-example-sftm-")
    os.makedirs(root, exist_ok=True)
    if not args.out:  # a temporary folder, removed at exit (--out DIR keeps everything)
        atexit.register(shutil.rmtree, root, True)
    # torch makes its compile cache in TMPDIR when torch._dynamo is first imported: here, under root
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, ".torch-cache"))

    base = make_base("llama", os.path.join(root, "base"))
    adapters = [make_adapter(os.path.join(root, f"adapter-{name}"), "llama", seed=seed, r=2, lora_alpha=4,
                             target_modules=["q_proj", "v_proj", "o_proj"])
                for seed, name in enumerate(("a", "b", "c"), start=1)]

    sftm = hubsoup.merge(adapters, "sftm", base=base, out=os.path.join(root, "sftm-soup"), gamma=GAMMA,
                         quiet=True, overwrite=True)
    ta = hubsoup.merge(adapters, "task_arithmetic", base=base, out=os.path.join(root, "ta-soup"), scale=GAMMA,
                       quiet=True, overwrite=True)
    print(sftm)
    print(ta)

    merged = {"sftm": weight_delta(sftm.path, base, MODULE), "task_arithmetic": weight_delta(ta.path, base, MODULE)}
    print(f"{MODULE}: top singular response u1' dM v1 / sigma1 of each task (gamma = {GAMMA})")
    worst = 0.0
    for adapter in adapters:
        u, s, vh = torch.linalg.svd(lora_delta(adapter, MODULE))
        resp = {k: float(u[:, 0] @ dm @ vh[0]) / float(s[0]) for k, dm in merged.items()}
        worst = max(worst, abs(resp["sftm"] - GAMMA))
        print(f"  {os.path.basename(adapter)}: sigma1={float(s[0]):.4f}  SFTM {resp['sftm']:.4f}  "
              f"task arithmetic {resp['task_arithmetic']:.4f}")
    print(f"SFTM keeps every task's response at gamma: max deviation {worst:.1e}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
