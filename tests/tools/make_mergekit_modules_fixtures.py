"""Build the ``modules:`` fixtures: tiny Mistral3, T5 and Whisper stand-ins and mergekit's outputs on them.

mergekit 0.1.5 defines some multimodal architectures by modules (``mergekit/_data/architectures/
mistral3.json``: ``text_decoder`` under ``language_model.``, ``vision_tower`` under ``vision_tower.``,
``multi_modal_projector``), and a config may merge each module its own way (``modules: {NAME:
{models|slices, parameters}}``). ``tests/fixtures/mergekit_modules/*.yml`` are such configs;
``tests/formats/test_mergekit_modules.py`` runs hubsoup on each and compares with mergekit's output stored
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
FAMILIES = ("mm", "t5", "wh")
MODELS = tuple(f"{f}-{r}" for f in FAMILIES for r in ("base", "ft-a", "ft-b"))
TEXT_LAYERS, VISION_LAYERS, HIDDEN, INTER, VOCAB, PATCH = 4, 3, 8, 16, 32, 2
T5_ENC, T5_DEC, WH_ENC, WH_DEC, MELS = 3, 2, 2, 3, 4
LAYER_KEYS = {"mm": ("text_config.num_hidden_layers", "vision_config.num_hidden_layers"),
              "t5": ("num_layers", "num_decoder_layers"), "wh": ("encoder_layers", "decoder_layers")}
"""Each family's layer-count keys in config.json (what the manifest records of mergekit's output)."""


def config(family: str = "mm") -> dict:
    """The stand-ins' config.json (what AutoConfig reads back)."""
    if family == "t5":
        return {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "d_model": HIDDEN, "d_kv": 4,
                "d_ff": INTER, "num_layers": T5_ENC, "num_decoder_layers": T5_DEC, "num_heads": 2,
                "relative_attention_num_buckets": 8, "relative_attention_max_distance": 16,
                "feed_forward_proj": "gated-gelu", "vocab_size": VOCAB, "layer_norm_epsilon": 1e-6,
                "is_encoder_decoder": True, "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 1,
                "decoder_start_token_id": 0, "torch_dtype": "bfloat16"}
    if family == "wh":
        return {"architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper", "d_model": HIDDEN,
                "encoder_layers": WH_ENC, "decoder_layers": WH_DEC, "encoder_attention_heads": 2,
                "decoder_attention_heads": 2, "encoder_ffn_dim": INTER, "decoder_ffn_dim": INTER,
                "num_mel_bins": MELS, "vocab_size": VOCAB, "max_source_positions": 6, "max_target_positions": 10,
                "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1,
                "is_encoder_decoder": True, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
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


def _t5_shapes() -> dict[str, tuple[int, ...]]:
    """A T5 v1.1 checkpoint as transformers saves it: embeddings tied to ``shared.weight`` (not stored), own head."""
    out: dict[str, tuple[int, ...]] = {"shared.weight": (VOCAB, HIDDEN)}
    att = ("q", "k", "v", "o")
    for stack, n in (("encoder", T5_ENC), ("decoder", T5_DEC)):
        for i in range(n):
            p = f"{stack}.block.{i}.layer."
            out.update({p + f"0.SelfAttention.{w}.weight": (HIDDEN, HIDDEN) for w in att})
            if i == 0:
                out[p + "0.SelfAttention.relative_attention_bias.weight"] = (8, 2)
            out[p + "0.layer_norm.weight"] = (HIDDEN,)
            ff = 1
            if stack == "decoder":
                out.update({p + f"1.EncDecAttention.{w}.weight": (HIDDEN, HIDDEN) for w in att})
                out[p + "1.layer_norm.weight"] = (HIDDEN,)
                ff = 2
            out.update({p + f"{ff}.DenseReluDense.wi_0.weight": (INTER, HIDDEN),
                        p + f"{ff}.DenseReluDense.wi_1.weight": (INTER, HIDDEN),
                        p + f"{ff}.DenseReluDense.wo.weight": (HIDDEN, INTER), p + f"{ff}.layer_norm.weight": (HIDDEN,)})
        out[f"{stack}.final_layer_norm.weight"] = (HIDDEN,)
    out["lm_head.weight"] = (VOCAB, HIDDEN)
    return out


def _whisper_shapes() -> dict[str, tuple[int, ...]]:
    """A Whisper checkpoint as transformers saves it (``proj_out`` tied to the decoder's embeddings, not stored)."""
    out: dict[str, tuple[int, ...]] = {"model.encoder.conv1.weight": (HIDDEN, MELS, 3), "model.encoder.conv1.bias": (HIDDEN,),
                                       "model.encoder.conv2.weight": (HIDDEN, HIDDEN, 3),
                                       "model.encoder.conv2.bias": (HIDDEN,),
                                       "model.encoder.embed_positions.weight": (6, HIDDEN)}
    out.update({"model.decoder.embed_tokens.weight": (VOCAB, HIDDEN), "model.decoder.embed_positions.weight": (10, HIDDEN)})
    for stack, n in (("encoder", WH_ENC), ("decoder", WH_DEC)):
        for i in range(n):
            p = f"model.{stack}.layers.{i}."
            for att in ("self_attn",) + (("encoder_attn",) if stack == "decoder" else ()):
                for w in ("q", "k", "v", "out"):
                    out[p + f"{att}.{w}_proj.weight"] = (HIDDEN, HIDDEN)
                    if w != "k":
                        out[p + f"{att}.{w}_proj.bias"] = (HIDDEN,)
                out.update({p + f"{att}_layer_norm.weight": (HIDDEN,), p + f"{att}_layer_norm.bias": (HIDDEN,)})
            out.update({p + "fc1.weight": (INTER, HIDDEN), p + "fc1.bias": (INTER,), p + "fc2.weight": (HIDDEN, INTER),
                        p + "fc2.bias": (HIDDEN,), p + "final_layer_norm.weight": (HIDDEN,),
                        p + "final_layer_norm.bias": (HIDDEN,)})
        out.update({f"model.{stack}.layer_norm.weight": (HIDDEN,), f"model.{stack}.layer_norm.bias": (HIDDEN,)})
    return out


def shapes(family: str = "mm") -> dict[str, tuple[int, ...]]:
    """The family's tensors (mergekit's architecture file's names) at the stand-ins' size."""
    if family == "t5":
        return _t5_shapes()
    if family == "wh":
        return _whisper_shapes()
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
    for k, (name, shape) in enumerate(shapes(ref.split("-")[0]).items()):
        t = torch.randn(shape, generator=g0)
        t = t.mul_(0.1).add_(1.0) if len(shape) == 1 else t.mul_(0.2)
        if not ref.endswith("-base"):
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
            json.dump(config(ref.split("-")[0]), f, indent=2)
        out[ref] = digest(tensors)
    return out


def family_of(config_name: str) -> str:
    """The stand-ins a fixture config merges: ``t5_*`` T5, ``whisper_*`` Whisper, the others Mistral3."""
    return "t5" if config_name.startswith("t5_") else "wh" if config_name.startswith("whisper_") else "mm"


def layers(cfg: dict, key: str):
    """A dotted key's value in a config.json."""
    for part in key.split("."):
        cfg = cfg.get(part) if isinstance(cfg, dict) else None
    return cfg


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
                                         "layers": {k: layers(cfg, k) for k in LAYER_KEYS[family_of(name)]}}
            print(f"mergekit: {name}: {len(tensors)} tensors", file=sys.stderr)
    with open(os.path.join(FIXTURES, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
