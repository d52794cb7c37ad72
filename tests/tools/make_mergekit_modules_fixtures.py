"""Build the ``modules:`` fixtures: tiny Mistral3 (vision-language) stand-ins and mergekit's outputs on them.

mergekit 0.1.5 defines some multimodal architectures by modules (``mergekit/_data/architectures/
mistral3.json``: ``text_decoder`` under ``language_model.``, ``vision_tower`` under ``vision_tower.``,
``multi_modal_projector``), and a config may merge each module its own way (``modules: {NAME:
{models|slices, parameters}}``). ``tests/fixtures/mergekit_modules/*.yml`` are such configs;
``tests/test_mergekit_modules.py`` runs hubsoup on each and compares with mergekit's output stored
here (``<name>.safetensors`` and ``manifest.json``: the output's ``config.json`` and the stand-ins'
digests). The stand-ins are rebuilt bit-identically by :func:`build_models` (seeded): text decoder
hidden 8, 4 layers; vision tower hidden 8, 3 layers; vocabulary 32; bfloat16.

Regenerate from the repository root::

    python tests/tools/make_mergekit_modules_fixtures.py --mergekit benchmarks/.work/mergekit-venv/bin/mergekit-yaml
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zlib

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(HERE, "fixtures", "mergekit_modules")
MERGEKIT_VERSION = "0.1.5"
MODELS = ("mm-base", "mm-ft-a", "mm-ft-b")
TEXT_LAYERS, VISION_LAYERS, HIDDEN, INTER, VOCAB, PATCH = 4, 3, 8, 16, 32, 2


def config() -> dict:
    """A Mistral3ForConditionalGeneration config of the stand-ins' size (what AutoConfig reads back)."""
    text = {"model_type": "mistral", "hidden_size": HIDDEN, "intermediate_size": INTER,
            "num_hidden_layers": TEXT_LAYERS, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
            "vocab_size": VOCAB, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    vision = {"model_type": "pixtral", "hidden_size": HIDDEN, "intermediate_size": INTER,
              "num_hidden_layers": VISION_LAYERS, "num_attention_heads": 2, "head_dim": 4, "patch_size": PATCH,
              "image_size": 8, "num_channels": 3}
    return {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
            "text_config": text, "vision_config": vision, "image_token_index": 10, "spatial_merge_size": 2,
            "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "vision_feature_layer": -1,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def shapes() -> dict[str, tuple[int, ...]]:
    """mergekit's mistral3 tensors (its architecture file's names) at the stand-ins' size."""
    out: dict[str, tuple[int, ...]] = {"language_model.model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(TEXT_LAYERS):
        p = f"language_model.model.layers.{i}."
        out.update({p + "input_layernorm.weight": (HIDDEN,), p + "self_attn.q_proj.weight": (8, HIDDEN),
                    p + "self_attn.k_proj.weight": (4, HIDDEN), p + "self_attn.v_proj.weight": (4, HIDDEN),
                    p + "self_attn.o_proj.weight": (HIDDEN, 8), p + "post_attention_layernorm.weight": (HIDDEN,),
                    p + "mlp.up_proj.weight": (INTER, HIDDEN), p + "mlp.gate_proj.weight": (INTER, HIDDEN),
                    p + "mlp.down_proj.weight": (HIDDEN, INTER)})
    out.update({"language_model.model.norm.weight": (HIDDEN,), "language_model.lm_head.weight": (VOCAB, HIDDEN)})
    out.update({"vision_tower.patch_conv.weight": (HIDDEN, 3, PATCH, PATCH), "vision_tower.ln_pre.weight": (HIDDEN,)})
    for i in range(VISION_LAYERS):
        p = f"vision_tower.transformer.layers.{i}."
        out.update({p + "ffn_norm.weight": (HIDDEN,), p + "feed_forward.down_proj.weight": (HIDDEN, INTER),
                    p + "feed_forward.gate_proj.weight": (INTER, HIDDEN), p + "feed_forward.up_proj.weight": (INTER, HIDDEN),
                    p + "attention_norm.weight": (HIDDEN,), p + "attention.k_proj.weight": (HIDDEN, HIDDEN),
                    p + "attention.o_proj.weight": (HIDDEN, HIDDEN), p + "attention.q_proj.weight": (HIDDEN, HIDDEN),
                    p + "attention.v_proj.weight": (HIDDEN, HIDDEN)})
    out.update({"multi_modal_projector.linear_1.weight": (HIDDEN, HIDDEN),
                "multi_modal_projector.linear_2.weight": (HIDDEN, HIDDEN),
                "multi_modal_projector.norm.weight": (HIDDEN,),
                "multi_modal_projector.patch_merger.merging_layer.weight": (HIDDEN, 4 * HIDDEN)})
    return out


def model_tensors(ref: str) -> dict[str, torch.Tensor]:
    """A shared "pre-trained" draw plus the model's own seeded noise (small task vectors, as in real merges)."""
    g0 = torch.Generator().manual_seed(7)
    g = torch.Generator().manual_seed(zlib.crc32(ref.encode()))
    out = {}
    for k, (name, shape) in enumerate(shapes().items()):
        t = torch.randn(shape, generator=g0)
        t = t.mul_(0.1).add_(1.0) if len(shape) == 1 else t.mul_(0.2)
        if ref != "mm-base":
            t = t + torch.randn(shape, generator=g) * 0.01 * (1 + k % 4)
        out[name] = t.to(torch.bfloat16)
    return out


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def build_models(root: str) -> dict[str, str]:
    """Write the stand-ins (weights and config.json) under ``root``; returns name → digest."""
    from safetensors.torch import save_file

    out = {}
    for ref in MODELS:
        folder = os.path.join(root, ref)
        os.makedirs(folder, exist_ok=True)
        tensors = model_tensors(ref)
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config(), f, indent=2)
        out[ref] = digest(tensors)
    return out


def config_names() -> list[str]:
    return sorted(fn[:-4] for fn in os.listdir(FIXTURES) if fn.endswith(".yml"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mergekit", default="benchmarks/.work/mergekit-venv/bin/mergekit-yaml")
    args = ap.parse_args(argv)
    from safetensors import safe_open
    from safetensors.torch import save_file

    manifest: dict = {"mergekit": MERGEKIT_VERSION, "configs": {}}
    with tempfile.TemporaryDirectory() as root:
        manifest["models"] = build_models(root)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONHASHSEED="0")
        for name in config_names():
            out = os.path.join(root, "_out", name)
            cmd = [os.path.abspath(args.mergekit), os.path.join(FIXTURES, f"{name}.yml"), out, "--random-seed", "0",
                   "--no-write-model-card", "--quiet"]
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-2000:], file=sys.stderr)
                raise SystemExit(f"mergekit refused {name}")
            tensors = {}
            for fn in sorted(os.listdir(out)):
                if fn.endswith(".safetensors"):
                    with safe_open(os.path.join(out, fn), framework="pt") as h:
                        tensors.update({k: h.get_tensor(k) for k in h.keys()})
            save_file(tensors, os.path.join(FIXTURES, f"{name}.safetensors"), metadata={"mergekit": MERGEKIT_VERSION})
            with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
                cfg = json.load(f)
            manifest["configs"][name] = {"config": {k: cfg.get(k) for k in ("architectures", "model_type",
                                                                              "torch_dtype", "dtype")},
                                         "text_layers": cfg["text_config"]["num_hidden_layers"],
                                         "vision_layers": cfg["vision_config"]["num_hidden_layers"]}
            print(f"mergekit: {name}: {len(tensors)} tensors", file=sys.stderr)
    with open(os.path.join(FIXTURES, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
