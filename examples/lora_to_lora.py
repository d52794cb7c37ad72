"""Merge two PEFT LoRA adapters into ONE LoRA adapter, then load it with peft.

The adapters are merged with TIES; instead of a full checkpoint, the merged task vector
is written as a new adapter of the same base (``output_format="lora"``), each module
truncated to the smallest rank that keeps 99% of its energy (‖τ‖²_F), at most 16.
The result is loaded with ``peft.PeftModel`` over the base and its logits are compared
with the same TIES merge written as a full checkpoint: they differ only by the truncation.

Everything is built here (a tiny Llama base and two randomised adapters); no network.

Run:
    python examples/lora_to_lora.py [--out DIR]

CLI equivalent:
    hubsoup merge A B --base BASE --method ties -p density=0.5 \\
        --output-format lora --energy 0.99 --rank 16 --out merged-lora
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import tempfile

import torch

import hubsoup
from hubsoup.testing import make_adapter, make_base


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Merge LoRA adapters into one LoRA adapter.")
    parser.add_argument("--out", help="folder for everything this example writes (default: a temporary folder, removed at exit)")
    args = parser.parse_args(argv)
    root = args.out or tempfile.mkdtemp(prefix="hubsoup-example-lora-")
    os.makedirs(root, exist_ok=True)
    if not args.out:  # a temporary folder, removed at exit (--out DIR keeps everything)
        atexit.register(shutil.rmtree, root, True)
    # torch makes its compile cache in TMPDIR when torch._dynamo is first imported: here, under root
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, ".torch-cache"))

    # a tiny Llama and two adapters of it that touch partly different modules, with different ranks
    base = make_base("llama", os.path.join(root, "base"))
    adapter_a = make_adapter(os.path.join(root, "adapter-a"), "llama", seed=1, r=4, lora_alpha=8,
                             target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    adapter_b = make_adapter(os.path.join(root, "adapter-b"), "llama", seed=2, r=2, lora_alpha=4,
                             target_modules=["q_proj", "down_proj"], task_type="CAUSAL_LM")

    options = hubsoup.MergeOptions(overwrite=True, quiet=True)
    lora = hubsoup.merge([adapter_a, adapter_b], "ties", base=base, out=os.path.join(root, "merged-lora"),
                         params={"density": 0.5}, options=options, output_format="lora", energy=0.99, rank=16)
    full = hubsoup.merge([adapter_a, adapter_b], "ties", base=base, out=os.path.join(root, "merged-full"),
                         params={"density": 0.5}, options=options)
    print(lora)
    config = json.load(open(os.path.join(lora.path, "adapter_config.json"), encoding="utf-8"))
    ranks = {m["module"]: m["rank"] for m in lora.lora["modules"]}
    print(f"adapter: {lora.path} (peft {config['peft_type']}, r={config['r']}, "
          f"{len(ranks)} modules, ranks {min(ranks.values())}..{max(ranks.values())})")

    # load the merged adapter the usual peft way and compare with the full-checkpoint merge
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.arange(1, 17).reshape(2, 8)
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(base).eval()
        base_logits = plain(ids).logits
        peft_logits = PeftModel.from_pretrained(plain, lora.path).eval()(ids).logits
        full_logits = AutoModelForCausalLM.from_pretrained(full.path).eval()(ids).logits
    vs_full = float((peft_logits - full_logits).abs().max())
    vs_base = float((peft_logits - base_logits).abs().max())
    print(f"max |logit difference|: merged LoRA vs base {vs_base:.4f}, vs the full TIES merge {vs_full:.4f} "
          f"(relative truncation error {lora.lora['aggregate_rel_error']:.2e})")
    # the adapter changes the model, and is (up to the 1% energy it drops) the same model as the full merge
    if not vs_full < 0.5 * vs_base:
        print("unexpected: the LoRA output is not close to the full merge")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
