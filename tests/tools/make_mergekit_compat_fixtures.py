"""Build the mergekit compatibility fixtures: tiny Llama inputs, configs, and mergekit's outputs.

``tests/formats/test_mergekit_compat.py`` runs hubsoup on every config of :data:`CONFIGS` and compares its
output with the output the real mergekit produced from the same inputs, checked in under
``tests/fixtures/mergekit/`` (``<name>.yml``: the config as a model card carries it;
``<name>.safetensors``: mergekit's output tensors; ``manifest.json``: mergekit's version and
seed, the input models' digests, each output's config fields).

The input models are rebuilt bit-identically by :func:`build_models` from fixed seeds (plain
``torch.Generator`` draws, no model initialiser), so only the outputs are checked in; the test
refuses to compare if a rebuilt model's digest differs from the manifest's.

Regenerate (after changing :data:`CONFIGS` or the models), from the repository root, with the
mergekit 0.1.5 environment that ``benchmarks/bench_merge.py`` creates
(``benchmarks/.work/mergekit-venv``: ``pip install -c constraints.txt torch==2.13.0 mergekit==0.1.5``)::

    . .venv/bin/activate
    python tests/tools/make_mergekit_compat_fixtures.py \\
        --mergekit benchmarks/.work/mergekit-venv/bin/mergekit-yaml [--only NAME ...]

hubsoup's environment builds the models; mergekit runs as its own process (``mergekit-yaml``),
never imported. No network: the configs name the models as ``tiny-llama/base``, ... which
exist as folders under the working folder, which is how mergekit (and hubsoup) resolve a
reference that exists on disk. Random methods run with ``--random-seed 0``. About 20 s per config.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import torch

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "mergekit")
MERGEKIT_VERSION = "0.1.5"
SEED = 0

# A tiny Llama: 4 layers (enough for gradients and frankenmerges), hidden 8, 2 heads (1 KV head), vocab 32.
SHAPE = {"hidden": 8, "intermediate": 16, "layers": 4, "heads": 2, "kv_heads": 1, "vocab": 32}
MODELS = {"tiny-llama/base": 0, "tiny-llama/ft-a": 1, "tiny-llama/ft-b": 2, "tiny-llama/ft-c": 3}
"""Model reference (a folder under the models root) → seed; seed 0 is the base, the others fine-tunes of it."""


def tensor_shapes(layers: int = SHAPE["layers"]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tiny Llama, in ``save_pretrained`` naming, in a fixed order."""
    h, i, v = SHAPE["hidden"], SHAPE["intermediate"], SHAPE["vocab"]
    kv = h // SHAPE["heads"] * SHAPE["kv_heads"]
    shapes = {"model.embed_tokens.weight": (v, h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    return shapes


def model_config(layers: int = SHAPE["layers"]) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": SHAPE["hidden"],
            "intermediate_size": SHAPE["intermediate"], "num_hidden_layers": layers,
            "num_attention_heads": SHAPE["heads"], "num_key_value_heads": SHAPE["kv_heads"],
            "vocab_size": SHAPE["vocab"], "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
            "hidden_act": "silu", "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
            "bos_token_id": 2, "eos_token_id": 4, "pad_token_id": 0}


def model_tensors(seed: int) -> dict[str, torch.Tensor]:
    """The base's tensors (seed 0) or a fine-tune's (base + seeded noise of per-tensor scale)."""
    g0 = torch.Generator().manual_seed(0)
    base = {}
    for name, shape in tensor_shapes().items():
        t = torch.randn(shape, generator=g0, dtype=torch.float32)
        base[name] = t.mul_(0.1).add_(1.0) if len(shape) == 1 else t.mul_(0.2)
    if seed == 0:
        return base
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for k, (name, t) in enumerate(base.items()):
        scale = 0.01 * (1 + (k + seed) % 4)  # fine-tunes move tensors by different amounts
        out[name] = t + torch.randn(t.shape, generator=g, dtype=torch.float32) * scale
    return out


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().numpy().tobytes())
    return h.hexdigest()


def build_models(root: str) -> dict[str, str]:
    """Write the input models (weights, config, a word-level tokenizer) under ``root``; returns ref → digest."""
    from safetensors.torch import save_file

    from hubsoup.testing import save_tiny_tokenizer

    digests = {}
    for ref, seed in MODELS.items():
        folder = os.path.join(root, ref)
        os.makedirs(folder, exist_ok=True)
        tensors = model_tensors(seed)
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump(model_config(), f, indent=2)
        save_tiny_tokenizer(folder, vocab=SHAPE["vocab"])
        digests[ref] = digest(tensors)
    for ref, (target, seed) in ADAPTERS.items():
        folder = os.path.join(root, ref)
        os.makedirs(folder, exist_ok=True)
        tensors = adapter_tensors(seed)
        save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(folder, "adapter_config.json"), "w", encoding="utf-8") as f:
            json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 2, "lora_alpha": 4,
                       "target_modules": ["q_proj", "v_proj", "down_proj"], "lora_dropout": 0.0, "bias": "none",
                       "fan_in_fan_out": False, "base_model_name_or_path": target}, f, indent=2)
        digests[ref] = digest(tensors)
    return digests


ADAPTERS = {"tiny-llama/lora-a": ("tiny-llama/ft-a", 11), "tiny-llama/lora-base": ("tiny-llama/base", 12)}
"""LoRA adapter (a folder under the models root) → (the model it names as its base, seed): rank 2 on q, v, down."""


def adapter_tensors(seed: int) -> dict[str, torch.Tensor]:
    """A rank-2 LoRA's factors, as peft saves them (``base_model.model.<module>.lora_A/B.weight``)."""
    g = torch.Generator().manual_seed(2000 + seed)
    shapes = tensor_shapes()
    out = {}
    for name, shape in shapes.items():
        if name.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight")):
            mod = "base_model.model." + name[: -len(".weight")]
            out[mod + ".lora_A.weight"] = torch.randn((2, shape[1]), generator=g) * 0.1
            out[mod + ".lora_B.weight"] = torch.randn((shape[0], 2), generator=g) * 0.1
    return out


# name → (kind, config). kind: "exact" (deterministic: equal within rounding) or "random" (in distribution).
CONFIGS: dict[str, tuple[str, str]] = {
    "slerp_gradient_filters": ("exact", """\
slices:
  - sources:
      - model: tiny-llama/ft-a
        layer_range: [0, 4]
      - model: tiny-llama/ft-b
        layer_range: [0, 4]
merge_method: slerp
base_model: tiny-llama/ft-a
parameters:
  t:
    - filter: self_attn
      value: [0, 0.5, 0.3, 0.7, 1]
    - filter: mlp
      value: [1, 0.5, 0.7, 0.3, 0]
    - value: 0.5
dtype: bfloat16
"""),
    "slerp_models": ("exact", """\
models:
  - model: tiny-llama/ft-a
  - model: tiny-llama/ft-c
merge_method: slerp
base_model: tiny-llama/ft-a
parameters:
  t: 0.3
dtype: float32
"""),
    "ties_weights_densities": ("exact", """\
models:
  - model: tiny-llama/base
    # no parameters necessary for base model
  - model: tiny-llama/ft-a
    parameters:
      density: 0.5
      weight: 0.5
  - model: tiny-llama/ft-b
    parameters:
      density: 0.3
      weight: 0.3
  - model: tiny-llama/ft-c
    parameters:
      density: 0.7
      weight: 0.2
merge_method: ties
base_model: tiny-llama/base
parameters:
  normalize: true
dtype: float32
"""),
    "ties_unnormalized_gradient": ("exact", """\
models:
  - model: tiny-llama/ft-a
    parameters:
      density: [1, 0.7, 0.1]
      weight: 1.0
  - model: tiny-llama/ft-b
    parameters:
      density: 0.5
      weight: [0, 0.3, 0.7, 1]
merge_method: ties
base_model: tiny-llama/base
parameters:
  normalize: false
  int8_mask: true
dtype: float32
"""),
    "dare_ties": ("random", """\
models:
  - model: tiny-llama/base
  - model: tiny-llama/ft-a
    parameters:
      density: 0.53
      weight: 0.4
  - model: tiny-llama/ft-b
    parameters:
      density: 0.53
      weight: 0.3
  - model: tiny-llama/ft-c
    parameters:
      density: 0.53
      weight: 0.3
merge_method: dare_ties
base_model: tiny-llama/base
parameters:
  int8_mask: true
dtype: float32
"""),
    "dare_linear": ("random", """\
models:
  - model: tiny-llama/ft-a
    parameters:
      weight: 0.6
      density: 0.4
  - model: tiny-llama/ft-b
    parameters:
      weight: 0.4
      density: 0.6
merge_method: dare_linear
base_model: tiny-llama/base
dtype: float32
"""),
    "task_arithmetic": ("exact", """\
models:
  - model: tiny-llama/ft-a
    parameters:
      weight: 1.0
  - model: tiny-llama/ft-b
    parameters:
      weight: 0.5
  - model: tiny-llama/ft-c
    parameters:
      weight: -0.3
merge_method: task_arithmetic
base_model: tiny-llama/base
parameters:
  lambda: 0.8
dtype: float32
"""),
    "linear_normalized": ("exact", """\
models:
  - model: tiny-llama/ft-a
    parameters:
      weight: 1.0
  - model: tiny-llama/ft-b
    parameters:
      weight: 0.5
  - model: tiny-llama/ft-c
    parameters:
      weight: 0.5
merge_method: linear
dtype: float32
"""),
    "linear_unnormalized": ("exact", """\
models:
  - model: tiny-llama/ft-a
    parameters:
      weight: 0.7
  - model: tiny-llama/ft-b
    parameters:
      weight: 0.5
merge_method: linear
parameters:
  normalize: false
dtype: float32
"""),
    "linear_filters": ("exact", """\
models:
  - model: tiny-llama/ft-a
    parameters:
      weight:
        - filter: mlp
          value: [0.2, 0.8]
        - value: 0.5
  - model: tiny-llama/ft-b
    parameters:
      weight:
        - filter: mlp
          value: [0.8, 0.2]
        - value: 0.5
merge_method: linear
dtype: float32
"""),
    "breadcrumbs": ("exact", """\
models:
  - model: tiny-llama/ft-a
    parameters:
      weight: 0.5
      density: 0.8
      gamma: 0.05
  - model: tiny-llama/ft-b
    parameters:
      weight: 0.5
      density: 0.8
      gamma: 0.05
merge_method: breadcrumbs
base_model: tiny-llama/base
dtype: float32
"""),
    "breadcrumbs_ties": ("exact", """\
models:
  - model: tiny-llama/ft-a
    parameters:
      weight: 0.6
      density: 0.7
      gamma: 0.02
  - model: tiny-llama/ft-b
    parameters:
      weight: 0.4
      density: 0.6
      gamma: 0.02
merge_method: breadcrumbs_ties
base_model: tiny-llama/base
parameters:
  normalize: true
dtype: float32
"""),
    "della": ("random", """\
models:
  - model: tiny-llama/ft-a
    parameters:
      weight: 0.5
      density: 0.5
      epsilon: 0.1
  - model: tiny-llama/ft-b
    parameters:
      weight: 0.5
      density: 0.5
      epsilon: 0.1
merge_method: della
base_model: tiny-llama/base
parameters:
  lambda: 1.0
dtype: float32
"""),
    "della_linear": ("random", """\
models:
  - model: tiny-llama/ft-a
    parameters:
      weight: 0.6
      density: 0.6
      epsilon: 0.15
  - model: tiny-llama/ft-b
    parameters:
      weight: 0.4
      density: 0.6
      epsilon: 0.15
merge_method: della_linear
base_model: tiny-llama/base
parameters:
  lambda: 0.9
dtype: float32
"""),
    "model_stock": ("exact", """\
models:
  - model: tiny-llama/ft-a
  - model: tiny-llama/ft-b
  - model: tiny-llama/ft-c
merge_method: model_stock
base_model: tiny-llama/base
dtype: float32
"""),
    "nuslerp_base": ("exact", """\
models:
  - model: tiny-llama/ft-a
    parameters:
      weight: 0.6
  - model: tiny-llama/ft-b
    parameters:
      weight: 0.4
merge_method: nuslerp
base_model: tiny-llama/base
dtype: float32
"""),
    "nuslerp_rowwise": ("exact", """\
models:
  - model: tiny-llama/ft-a
    parameters:
      weight: 1.0
  - model: tiny-llama/ft-c
    parameters:
      weight: 3.0
merge_method: nuslerp
parameters:
  nuslerp_flatten: false
  nuslerp_row_wise: true
dtype: float32
"""),
    "passthrough_frankenmerge": ("exact", """\
slices:
  - sources:
      - model: tiny-llama/ft-a
        layer_range: [0, 3]
  - sources:
      - model: tiny-llama/ft-b
        layer_range: [1, 4]
merge_method: passthrough
dtype: float32
"""),
    "passthrough_base_self_stack": ("exact", """\
slices:
  - sources:
      - model: tiny-llama/base
        layer_range: [0, 2]
  - sources:
      - model: tiny-llama/ft-c
        layer_range: [1, 3]
  - sources:
      - model: tiny-llama/base
        layer_range: [2, 4]
merge_method: passthrough
base_model: tiny-llama/base
dtype: bfloat16
"""),
    "passthrough_scale_filters": ("exact", """\
slices:
  - sources:
      - model: tiny-llama/ft-a
        layer_range: [0, 3]
  - sources:
      - model: tiny-llama/ft-b
        layer_range: [2, 4]
        parameters:
          scale:
            - filter: o_proj
              value: 0.0
            - filter: down_proj
              value: 0.5
            - value: 1.0
merge_method: passthrough
dtype: float32
"""),
    "linear_partial_slice": ("exact", """\
slices:
  - sources:
      - model: tiny-llama/ft-a
        layer_range: [1, 3]
        parameters:
          weight: [0.2, 0.8]
      - model: tiny-llama/ft-c
        layer_range: [1, 3]
        parameters:
          weight: 0.5
merge_method: linear
dtype: float32
"""),
    "slerp_per_slice": ("exact", """\
slices:
  - sources:
      - model: tiny-llama/base
        layer_range: [0, 2]
      - model: tiny-llama/ft-b
        layer_range: [0, 2]
    parameters:
      t: 0.2
  - sources:
      - model: tiny-llama/base
        layer_range: [2, 4]
      - model: tiny-llama/ft-b
        layer_range: [2, 4]
    parameters:
      t: [0.1, 0.9]
merge_method: slerp
base_model: tiny-llama/base
parameters:
  t: 0.5
dtype: float32
"""),
    "ties_tokenizer_base": ("exact", """\
models:
  - model: tiny-llama/ft-a
    parameters:
      density: 0.4
      weight: 1.0
  - model: tiny-llama/ft-b
    parameters:
      density: 0.4
      weight: 1.0
merge_method: ties
base_model: tiny-llama/base
tokenizer_source: base
dtype: float32
"""),
    "task_arithmetic_float16": ("exact", """\
models:
  - model: tiny-llama/ft-a
    parameters:
      weight: 0.5
  - model: tiny-llama/ft-b
    parameters:
      weight: 0.5
merge_method: task_arithmetic
base_model: tiny-llama/base
dtype: float16
"""),
    # what `hubsoup export-config` writes for two hubsoup merges (tests/formats/test_mergekit_compat.py
    # test_export_config_computes_in_float32 checks it writes exactly these): mergekit must reproduce them
    "exported_ties_bfloat16": ("exact", """\
# mergekit config written by hubsoup export-config
merge_method: ties
base_model: tiny-llama/base
models:
- model: tiny-llama/ft-a
  parameters:
    weight: 1.0
    density: 0.5
- model: tiny-llama/ft-b
  parameters:
    weight: 0.5
    density: 0.3
parameters:
  normalize: true
  lambda: 1.0
  rescale: false
dtype: float32
out_dtype: bfloat16
"""),
    "exported_wise_ft_float16": ("exact", """\
# mergekit config written by hubsoup export-config
merge_method: task_arithmetic
base_model: tiny-llama/base
models:
- model: tiny-llama/ft-a
  parameters:
    weight: 0.3
parameters:
  lambda: 1.0
  normalize: false
dtype: float32
out_dtype: float16
"""),
    # half-precision compute: mergekit casts the inputs to `dtype` and computes in it (hubsoup: compute_dtype)
    "ties_compute_bfloat16": ("exact", """\
models:
  - model: tiny-llama/ft-a
    parameters:
      weight: 1.0
      density: 0.5
  - model: tiny-llama/ft-b
    parameters:
      weight: 0.7
      density: 0.3
  - model: tiny-llama/ft-c
    parameters:
      weight: 0.4
      density: 0.7
merge_method: ties
base_model: tiny-llama/base
parameters:
  normalize: true
dtype: bfloat16
"""),
    "breadcrumbs_ties_compute_float16": ("exact", """\
models:
  - model: tiny-llama/ft-a
    parameters:
      weight: 0.6
      density: 0.8
      gamma: 0.05
  - model: tiny-llama/ft-b
    parameters:
      weight: 0.4
      density: 0.7
      gamma: 0.02
merge_method: breadcrumbs_ties
base_model: tiny-llama/base
parameters:
  normalize: true
  rescale: true
dtype: float16
"""),
    "sce_compute_bfloat16": ("exact", """\
models:
  - model: tiny-llama/ft-a
  - model: tiny-llama/ft-b
  - model: tiny-llama/ft-c
merge_method: sce
base_model: tiny-llama/base
parameters:
  select_topk: 0.6
dtype: bfloat16
"""),
    # mergekit 0.1.5's RAM methods (issue 49; no community config uses them yet): sparse updates are RL's, here
    # every entry moves, so epsilon decides which count as changed; ramplus_tl returns float32 from bf16 inputs
    # (its scale is a float32 tensor), which mergekit stores without an out_dtype
    "ram_compute_bfloat16": ("exact", """\
models:
  - model: tiny-llama/ft-a
  - model: tiny-llama/ft-b
  - model: tiny-llama/ft-c
merge_method: ram
base_model: tiny-llama/base
parameters:
  epsilon: 0.01
dtype: bfloat16
"""),
    "ramplus_tl_compute_bfloat16": ("exact", """\
models:
  - model: tiny-llama/ft-a
  - model: tiny-llama/ft-b
merge_method: ramplus_tl
base_model: tiny-llama/base
parameters:
  r: 0.5
  alpha: 0.5
  epsilon: 0.02
dtype: bfloat16
"""),
    "ram_float32": ("exact", """\
models:
  - model: tiny-llama/ft-a
  - model: tiny-llama/ft-b
merge_method: ram
base_model: tiny-llama/base
parameters:
  epsilon: 0.015
dtype: float32
out_dtype: bfloat16
"""),
    # LoRA references (mergekit merges the adapter into the model it follows): on a fine-tune, and on the base
    "lora_on_models_and_base": ("exact", """\
models:
  - model: tiny-llama/ft-a+tiny-llama/lora-a
    parameters:
      weight: 0.6
  - model: tiny-llama/ft-b
    parameters:
      weight: 0.4
merge_method: task_arithmetic
base_model: tiny-llama/base+tiny-llama/lora-base
dtype: float32
"""),
    "linear_out_dtype_bfloat16": ("exact", """\
models:
  - model: tiny-llama/ft-a
    parameters:
      weight: 0.5
  - model: tiny-llama/ft-b
    parameters:
      weight: 0.5
merge_method: linear
dtype: float32
out_dtype: bfloat16
tokenizer_source: tiny-llama/ft-b
"""),
    "sce": ("exact", """\
models:
  - model: tiny-llama/ft-a
  - model: tiny-llama/ft-b
  - model: tiny-llama/ft-c
merge_method: sce
base_model: tiny-llama/base
parameters:
  select_topk: 0.5
dtype: float32
"""),
    "karcher": ("exact", """\
models:
  - model: tiny-llama/ft-a
  - model: tiny-llama/ft-b
  - model: tiny-llama/ft-c
merge_method: karcher
parameters:
  max_iter: 20
dtype: float32
"""),
    "multislerp": ("exact", """\
models:
  - model: tiny-llama/ft-a
    parameters:
      weight: 1.0
  - model: tiny-llama/ft-b
    parameters:
      weight: 2.0
  - model: tiny-llama/ft-c
    parameters:
      weight: 1.0
merge_method: multislerp
base_model: tiny-llama/base
dtype: float32
"""),
}


def run_mergekit(mergekit_yaml: str, models_root: str, name: str, config: str, out: str) -> None:
    cfg_path = os.path.join(models_root, f"{name}.yml")
    with open(cfg_path, "w", encoding="utf-8") as f:
        f.write(config)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    cmd = [mergekit_yaml, cfg_path, out, "--random-seed", str(SEED), "--quiet", "--allow-crimes",
           "--no-write-model-card", "--lora-merge-cache", os.path.join(models_root, ".lora-cache")]  # the card generator asks the Hub about every model reference
    proc = subprocess.run(cmd, cwd=models_root, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"mergekit failed on {name}:\n{proc.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mergekit", default="benchmarks/.work/mergekit-venv/bin/mergekit-yaml",
                    help="the mergekit-yaml script of a mergekit 0.1.5 environment")
    ap.add_argument("--only", action="append", help="regenerate only these configs (repeatable)")
    args = ap.parse_args(argv)
    from safetensors import safe_open
    from safetensors.torch import save_file

    mergekit_yaml = os.path.abspath(args.mergekit)
    os.makedirs(FIXTURES, exist_ok=True)
    manifest_path = os.path.join(FIXTURES, "manifest.json")
    manifest: dict = {"configs": {}}
    if os.path.isfile(manifest_path) and args.only:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
    with tempfile.TemporaryDirectory() as root:
        manifest.update({"mergekit": MERGEKIT_VERSION, "random_seed": SEED, "shape": SHAPE,
                         "models": build_models(root)})
        for name, (kind, config) in CONFIGS.items():
            if args.only and name not in args.only:
                continue
            out = os.path.join(root, "out", name)
            print(f"mergekit: {name}", file=sys.stderr)
            run_mergekit(mergekit_yaml, root, name, config, out)
            tensors = {}
            for fn in sorted(os.listdir(out)):
                if fn.endswith(".safetensors"):
                    with safe_open(os.path.join(out, fn), framework="pt") as h:
                        tensors.update({k: h.get_tensor(k) for k in h.keys()})
            save_file(tensors, os.path.join(FIXTURES, f"{name}.safetensors"), metadata={"mergekit": MERGEKIT_VERSION})
            with open(os.path.join(FIXTURES, f"{name}.yml"), "w", encoding="utf-8") as f:
                f.write(config)
            with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
                cfg = json.load(f)
            files = sorted(fn for fn in os.listdir(out) if fn.startswith(("tokenizer", "special_tokens")))
            manifest["configs"][name] = {
                "kind": kind, "num_hidden_layers": cfg.get("num_hidden_layers"),
                "dtype": cfg.get("torch_dtype") or cfg.get("dtype"), "vocab_size": cfg.get("vocab_size"),
                "tokenizer_files": files}
    with open(manifest_path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    print(f"wrote {len(manifest['configs'])} fixtures to {FIXTURES}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
