"""Build the real-config fixtures: tiny stand-ins for every model the community's configs name, and mergekit's outputs.

``tests/fixtures/mergekit_real/*.yml`` are mergekit configs written by the community (mergekit's own
examples and docs, model cards of published merges), each unchanged but for a ``# source:`` comment
naming where it comes from. ``tests/formats/test_mergekit_real.py`` runs hubsoup on every one and compares
with what mergekit 0.1.5 made of the same config on the same stand-ins, checked in here:

* ``<name>.safetensors``: mergekit's output tensors (the final stage's, for a mergekit-multi stream);
* ``manifest.json``: per config, whether mergekit accepted it (and its error if not), the method, its kind
  (``random``: DARE / DELLA dropping entries, compared in distribution; else ``exact``),
  the output's ``config.json`` fields, its tokenizer (files, the whole vocabulary: a few dozen
  entries) and chat template; per stand-in, its digest.

The stand-ins are rebuilt bit-identically by :func:`build_models` from seeds: for every model
reference, a model of the RIGHT architecture family and depth (a 40-layer Mistral for a
Mistral-Nemo-12B config, so ``layer_range: [0, 40]`` and gradients of 40 values mean what they
meant, an 80-layer Llama for 70B configs, a 42-layer Gemma-2 for Gemma-2-9B, GPT-2's 12 layers,
...), hidden size 8, vocabulary 32 — a family's models share a "pre-trained" draw and each adds
its own seeded "fine-tune" noise, so task vectors are small against the weights as in real
merges. Where a config merges vocabularies (``tokenizer_source``, ``tokenizer:``) some of its
models carry added tokens (:data:`EXTRA_TOKENS`: more embedding rows), so the merge is not
trivial; models carry one of two chat templates (:data:`ALT_TEMPLATE`), so ``chat_template:
auto`` chooses; a ``model+lora`` reference gets a tiny peft LoRA adapter. References resolve as
folders under one root, the working folder, as both tools treat an existing folder as local.

Regenerate (after changing a config, :data:`CONFIG_FAMILY` or the models), from the repository root::

    python tests/tools/make_mergekit_real_fixtures.py \\
        --mergekit benchmarks/.work/mergekit-venv/bin/mergekit-yaml [--only NAME ...]

mergekit runs as its own processes (``mergekit-yaml``; ``mergekit-multi`` for a YAML stream of
several documents), ``--random-seed 0``, ``PYTHONHASHSEED=0`` (with no base model mergekit copies
the tokenizer from a model picked out of a set), offline. A config mergekit refuses is recorded
as refused, with the last line of its error.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the vocabulary tool's ordered runner
import zlib
from typing import Any, Iterator

import torch
import yaml

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(HERE, "fixtures", "mergekit_real")
MERGEKIT_VERSION = "0.1.5"
SEED = 0
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 8, 16, 2, 1, 4, 32
RANDOM_METHODS = ("dare_ties", "dare_linear", "della", "della_linear")

# family → (architecture, layers, tied embeddings); the depth is the real model's.
FAMILIES: dict[str, tuple[str, int, bool]] = {
    "mistral-7b": ("mistral", 32, False),       # Mistral-7B-v0.1 and its fine-tunes
    "llama2-13b": ("llama", 40, False),         # Llama-2-13B
    "gpt2": ("gpt2", 12, True),                 # gpt2 (124M)
    "mistral-nemo-12b": ("mistral", 40, False),  # Mistral-Nemo-12B
    "mistral-small-24b": ("mistral", 40, False),  # Mistral-Small-3.2-24B
    "llama3-8b": ("llama", 32, False),          # Llama-3/3.1-8B
    "llama3-70b": ("llama", 80, False),         # Llama-3.x-70B
    "llama3.2-1b": ("llama", 16, True),         # Llama-3.2-1B (tied embeddings)
    "gemma2-9b": ("gemma2", 42, True),          # Gemma-2-9B (tied embeddings)
}

# config → the family of every model it names (a model named by several configs must agree).
CONFIG_FAMILY: dict[str, str] = {
    "mk_bio_merge": "mistral-7b", "mk_multimerge_doc": "mistral-7b", "neuralsynthesis_model_stock": "mistral-7b",
    "med_law_dolphin_beagle_breadcrumbs": "mistral-7b", "dpopenhermes_11b_revision": "mistral-7b",
    "neuralpipe_9b_passthrough": "mistral-7b", "neuralhermes_slerp_lazymergekit": "mistral-7b",
    "mk_gradient_slerp": "llama2-13b", "mk_linear": "llama2-13b", "mk_orcamini_platy_44layer": "llama2-13b",
    "mk_mega": "llama2-13b", "orca2_pyg_passthrough_local": "llama2-13b", "orca2flat_task_arithmetic": "llama2-13b",
    "tiefighter_medllama_task_arithmetic": "llama2-13b",
    "mk_gpt2_small": "gpt2",
    "angelslayer_della_linear_union_chatml": "mistral-nemo-12b", "velvet_orchid_stage1_karcher": "mistral-nemo-12b",
    "velvet_orchid_stage2_modules": "mistral-nemo-12b", "dark_quill_della_linear_tokenizer_model": "mistral-nemo-12b",
    "hekate_model_stock_weights": "mistral-nemo-12b", "aurora_sce_lora_base": "mistral-nemo-12b",
    "kansensakura_zero_multi": "mistral-nemo-12b", "retreatcost_multislerp_gradient40": "mistral-nemo-12b",
    "kansensakura_symbiosis_multislerp": "mistral-nemo-12b", "lunar_abyss_della_filters": "mistral-nemo-12b",
    "abyssal_seraph_multi_nearswap": "mistral-nemo-12b", "megamoon_karcher_union_17": "mistral-nemo-12b",
    "fiery_lynx_della_linear_union": "mistral-small-24b",
    "athena_apollo_model_stock_name": "llama3-8b", "huatuo_lora_model_stock": "llama3-8b",
    "wingless_moon_maiden_della_union_llama3": "llama3-8b", "pt_gl_dare_linear_local_path": "llama3-8b",
    "eggs_and_bread_rp_pt1_dare_ties": "llama3-8b", "eggs_and_bread_rp_pt2_breadcrumbs_ties": "llama3-8b",
    "eggs_and_bread_rp_slerp_gradient13": "llama3-8b",
    "genetic_lemonade_base6_sce": "llama3-70b", "genetic_lemonade_final_sce_union": "llama3-70b",
    "strawberrylemonade_nuslerp": "llama3-70b", "smarteaz_task_arithmetic_lora_base": "llama3-70b",
    "smarteaz_model_stock_toplevel_normalize": "llama3-70b",
    "sce_union_chat_auto_llama32": "llama3.2-1b", "novaciano_pervert_arcee_fusion": "llama3.2-1b",
    "gemma_moon_dare_ties_chat_auto": "gemma2-9b", "gemma2_lora_dpo_dare_ties_local": "gemma2-9b",
    # issue 49: nearswap, arcee_fusion in bf16, and half-precision task arithmetic / dare / della with lambda
    "esotericsage_nearswap_gradient": "mistral-nemo-12b",
    "absa_nearswap_local": "llama3-8b", "absa_arcee_fusion_bf16_local": "llama3-8b",
    "absa_task_arithmetic_lambda_07": "llama3-8b", "absa_dare_ties_dense_lambda_11": "llama3-8b",
    "absa_dare_linear_dense_rescale": "llama3-8b", "absa_dare_ties_lambda_11": "llama3-8b",
    "absa_della_linear_lambda_12": "llama3-8b", "papers_explained_nearswap_fp16": "llama3-8b",
    "papers_explained_dare_linear_fp16": "llama3-8b", "papers_explained_task_arithmetic_fp16": "llama3-8b",
}

# Added tokens (as a fine-tune that learned a chat format adds them): only on models of configs that
# merge or choose vocabularies (tokenizer_source / tokenizer:), so that those merges are not trivial.
EXTRA_TOKENS: dict[str, list[str]] = {
    "ArliAI/Mistral-Nemo-12B-ArliAI-RPMax-v1.2": ["<|im_start|>", "<|im_end|>"],
    "DavidAU/MN-GRAND-Gutenberg-Lyra4-Lyra-12B-DARKNESS": ["<|extra_0|>"],
    "Vortex5/Scarlet-Ink-12B": ["<|im_start|>", "<|im_end|>"],
    "Vortex5/Harmonic-Moon-12B": ["<|im_start|>", "<|im_end|>", "<|ext|>"],
    "Vortex5/Poetic-Rune-12B": ["<|fim_middle|>"],
    "taozi555/MN-12B-Mag-Mell-R1-KTO": ["<|im_start|>", "<|im_end|>"],
    "zerofata/MS3.2-PaintedFantasy-v2-24B": ["<|im_start|>", "<|im_end|>"],
    "yamatazen/LinearWriter-12B": ["<|im_start|>", "<|im_end|>"],
    "yamatazen/ForgottenMaid-12B": ["<|im_start|>", "<|im_end|>"],  # merged with LinearWriter by nearswap: same vocab
    "CodeAtCMU/Llama-3.2-1B-GenerativePerturbations_full_sft_code_data_120K_imaginary": ["<|fim_prefix|>"],
    "Novaciano/Alice-In-The-Dark-RP-NSFW-3.2-1B": ["<|im_start|>", "<|im_end|>"],
    "LatitudeGames/Wayfarer-Large-70B-Llama-3.3": ["<|im_start|>", "<|im_end|>"],
    "crestf411/L3.1-nemotron-sunfall-v0.7.0": ["<|extra_a|>"],
    "OpenBuddy/openbuddy-llama3.3-70b-v24.1-131k": ["<|role|>"],
    "sophosympatheia/strawberrylemonade-70b-v1.1.0": ["<|im_start|>", "<|im_end|>"],
    "Retreatcost/KansenSakura-Radiance-RP-12b": ["<|im_start|>", "<|im_end|>"],
    "Vortex5/Abyssal-Seraph-12B": ["<|im_start|>", "<|im_end|>"],
    "Sao10K/L3-8B-Lunaris-v1": ["<|im_start|>", "<|im_end|>"],
    "spacematt/Gemma-Lingua-2-9B-it": ["<|im_start|>"],
    "rootxhacker/Apollo-exp-8B": ["<|im_start|>", "<|im_end|>"],
}

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
TEMPLATE_ALT = "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
ALT_TEMPLATE = {"CodeAtCMU/Llama-3.2-1B-GenerativePerturbations_full_sft_code_data_120K_imaginary",
                "spacematt/Gemma-Lingua-2-9B-it", "ArliAI/Mistral-Nemo-12B-ArliAI-RPMax-v1.2",
                "Sao10K/L3-8B-Lunaris-v1", "Vortex5/Scarlet-Ink-12B"}
"""Models whose tokenizer carries :data:`TEMPLATE_ALT`; every other stand-in carries :data:`TEMPLATE`."""


# --- the configs ------------------------------------------------------------------------------------

def config_names() -> list[str]:
    return sorted(fn[:-4] for fn in os.listdir(FIXTURES) if fn.endswith(".yml"))


def config_text(name: str) -> str:
    with open(os.path.join(FIXTURES, f"{name}.yml"), encoding="utf-8") as f:
        return f.read()


def _random_order(doc: dict) -> bool:
    """Whether mergekit's output on this config depends on a Python set's order (a merged vocabulary, auto)."""
    tok = doc.get("tokenizer")
    return (doc.get("tokenizer_source") == "union" or (isinstance(tok, dict) and tok.get("source", "union") == "union")
            or doc.get("chat_template") == "auto")


def documents(name: str) -> list[dict]:
    """The YAML documents of a config (several for a mergekit-multi stream); [] if it does not parse."""
    try:
        return [d for d in yaml.safe_load_all(config_text(name)) if d is not None]
    except yaml.YAMLError:
        return []


def source_of(name: str) -> str:
    first = config_text(name).split("\n", 1)[0]
    return first.split(":", 1)[1].strip() if first.startswith("# source:") else ""


def _refs(node: Any) -> Iterator[str]:
    """Every model reference in a config document (models, slices, modules, base, tokenizer sources)."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("model", "base_model") and isinstance(v, str):
                yield v
            elif k in ("source", "tokenizer_source") and isinstance(v, str) and v not in ("union", "base"):
                yield v
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def stage_names(name: str) -> set[str]:
    return {str(d["name"]).strip() for d in documents(name) if isinstance(d, dict) and d.get("name")}


def model_refs(name: str) -> set[str]:
    """The stand-ins a config needs: its references, LoRA references split, stage names left out."""
    docs = documents(name)
    stages = stage_names(name) if len(docs) > 1 else set()
    out = set()
    for ref in (r for d in docs for r in _refs(d)):
        for part in ref.split("+"):
            part = part.split("@")[0]
            if part and part not in stages:
                out.add(part)
    return out


def lora_pairs(name: str) -> set[tuple[str, str]]:
    """(model, adapter) for every ``model+adapter`` reference."""
    return {tuple(r.split("+", 1)) for d in documents(name) for r in _refs(d) if "+" in r}  # type: ignore[misc]


def _densities(node: Any) -> Iterator[float]:
    """Every ``density`` value a config document gives (scalars, gradients, filtered entries)."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "density":
                for e in (v if isinstance(v, list) else [v]):
                    e = e.get("value") if isinstance(e, dict) else e
                    for x in (e if isinstance(e, list) else [e]):
                        try:
                            yield float(x)
                        except (TypeError, ValueError):
                            pass
            else:
                yield from _densities(v)
    elif isinstance(node, list):
        for v in node:
            yield from _densities(v)


def kind_of(name: str) -> str:
    """``random`` when a stage drops entries at random (a DARE / DELLA method with some density below 1), else
    ``exact``: with every density 1 (mergekit's default) such a method drops nothing and is deterministic."""
    for d in documents(name):
        if isinstance(d, dict) and str(d.get("merge_method")) in RANDOM_METHODS and any(x < 1 for x in _densities(d)):
            return "random"
    return "exact"


def features(name: str) -> list[str]:
    """What a config uses, for the results table."""
    text = config_text(name)
    docs = documents(name)
    out: list[str] = []
    if len(docs) > 1:
        out.append(f"{len(docs)} stages")
    for d in docs:
        if not isinstance(d, dict):
            continue
        if d.get("slices"):
            out.append("slices")
        if d.get("modules"):
            out.append("modules")
        if d.get("tokenizer_source") is not None:
            out.append(f"tokenizer_source: {d['tokenizer_source'] if d['tokenizer_source'] in ('union', 'base') else 'model'}")
        if "tokenizer" in d:
            src = (d["tokenizer"] or {}).get("source", "union (default)")
            out.append(f"tokenizer.source: {src if src in ('union', 'base', 'union (default)') else 'model'}")
        if d.get("chat_template"):
            out.append(f"chat_template: {d['chat_template']}")
        if d.get("out_dtype"):
            out.append("out_dtype")
    known = {"modules", "slices", "models", "merge_method", "base_model", "dtype", "tokenizer_source", "tokenizer",
             "chat_template", "out_dtype", "parameters"}
    for d in docs:
        for k in sorted(set(d) - known if isinstance(d, dict) else ()):
            out.append(f"key mergekit ignores: {k}")
    if re.search(r":\s*\.?\d+e-?\d+\s*$", text, re.M):
        out.append("number read as a string")
    if any(r.startswith(("./", "output/", "D:/")) for r in _refs(docs)):
        out.append("local folder")
    if "+" in "".join(_refs(docs)):
        out.append("LoRA reference")
    if re.search(r"^\s+-?\s*filter:", text, re.M):
        out.append("filters")
    if re.search(r"^\s+-?\s*pattern:", text, re.M):
        out.append("pattern:")
    if re.search(r"(weight|density|t|value): \[", text):
        out.append("gradients")
    if "revision:" in text:
        out.append("revision")
    return list(dict.fromkeys(out))


# --- the stand-ins -----------------------------------------------------------------------------------

def family_of_refs() -> dict[str, str]:
    fam: dict[str, str] = {}
    for name in config_names():
        f = CONFIG_FAMILY.get(name)
        if f is None:
            raise SystemExit(f"{name}.yml: no family in CONFIG_FAMILY")
        for ref in model_refs(name):
            if fam.setdefault(ref, f) != f:
                raise SystemExit(f"{ref}: named as {fam[ref]} and as {f} ({name})")
    for name in config_names():
        for _, adapter in lora_pairs(name):
            fam.pop(adapter.split("@")[0], None)  # adapters are built against their model, not as models
    return fam


def hf_config(family: str, vocab: int):
    import transformers as tf

    arch, layers, tied = FAMILIES[family]
    common = dict(vocab_size=vocab, tie_word_embeddings=tied, bos_token_id=2, eos_token_id=4, pad_token_id=0)
    if arch == "gpt2":
        cfg = tf.GPT2Config(n_embd=HIDDEN, n_layer=layers, n_head=HEADS, n_positions=64, **common)
        cfg.architectures = ["GPT2LMHeadModel"]
    else:
        cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "gemma2": tf.Gemma2Config}[arch]
        cfg = cls(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  max_position_embeddings=64, **common)
        cfg.architectures = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                              "gemma2": "Gemma2ForCausalLM"}[arch]]
    cfg.dtype = "bfloat16"
    return cfg


@functools.lru_cache(maxsize=None)
def tensor_shapes(family: str, vocab: int) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors (tied ones once), from the architecture built on the meta device."""
    import transformers as tf

    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(hf_config(family, vocab))
    return {k: tuple(p.shape) for k, p in model.named_parameters()}  # named_parameters drops tied duplicates


def _seed(text: str) -> int:
    return zlib.crc32(text.encode())


def model_tensors(family: str, ref: str) -> dict[str, torch.Tensor]:
    """A family's shared draw plus the model's own seeded noise; added tokens get their own rows."""
    extra = EXTRA_TOKENS.get(ref, [])
    shapes = tensor_shapes(family, VOCAB)
    g0 = torch.Generator().manual_seed(_seed(family))
    g = torch.Generator().manual_seed(_seed(ref))
    out = {}
    for k, (name, shape) in enumerate(shapes.items()):
        t = torch.randn(shape, generator=g0)
        if len(shape) == 1:
            t = t.mul_(0.02) if name.endswith("bias") else t.mul_(0.1).add_(1.0)
        else:
            t = t.mul_(0.2)
        t = t + torch.randn(shape, generator=g) * 0.01 * (1 + (k + _seed(ref)) % 4)
        if extra and shape[0] == VOCAB and len(shape) == 2:  # embeddings / lm_head: rows for the added tokens
            t = torch.cat([t, torch.randn(len(extra), shape[1], generator=g) * 0.2])
        out[name] = t.to(torch.bfloat16)
    return out


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_tokenizer(folder: str, extra: list[str], template: str) -> None:
    """A word-level tokenizer over ``w0 ..`` (as :func:`hubsoup.testing.save_tiny_tokenizer`), plus added tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[BOS]", "[SEP]", "[EOS]"]
    words = specials + [f"w{i}" for i in range(VOCAB - len(specials))]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
                                   sep_token="[SEP]", eos_token="[EOS]")
    if extra:
        fast.add_tokens(extra, special_tokens=True)
    fast.chat_template = template
    fast.save_pretrained(folder)


def build_models(root: str, only: list[str] | None = None) -> dict[str, str]:
    """Write every stand-in (weights, config, tokenizer) and LoRA adapter under ``root``; returns ref → digest.

    ``only``: just the models these configs name.
    """
    from safetensors.torch import load_file, save_file

    from hubsoup.testing import write_adapter

    digests = {}
    wanted = set().union(*(model_refs(n) for n in only)) if only is not None else None
    for ref, family in sorted(family_of_refs().items()):
        if wanted is not None and ref not in wanted:
            continue
        folder = os.path.join(root, ref)
        os.makedirs(folder, exist_ok=True)
        tensors = model_tensors(family, ref)
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        hf_config(family, VOCAB + len(EXTRA_TOKENS.get(ref, []))).save_pretrained(folder)
        save_tokenizer(folder, EXTRA_TOKENS.get(ref, []), TEMPLATE_ALT if ref in ALT_TEMPLATE else TEMPLATE)
        digests[ref] = digest(tensors)
    for name in config_names() if only is None else only:
        for model, adapter in sorted(lora_pairs(name)):
            folder = os.path.join(root, adapter)
            if not os.path.isdir(folder):  # one adapter may be named by several configs
                write_adapter(folder, os.path.join(root, model), seed=_seed(adapter), r=2)
            digests[adapter] = digest(load_file(os.path.join(folder, "adapter_model.safetensors")))
    return digests


# --- mergekit --------------------------------------------------------------------------------------

def run_mergekit(mergekit_yaml: str, root: str, name: str, out: str) -> tuple[bool, str]:
    """Run mergekit on a config under ``root`` (the working folder); returns (accepted, error's last lines)."""
    cfg_path = os.path.join(root, f"{name}.yml")
    with open(cfg_path, "w", encoding="utf-8") as f:
        f.write(config_text(name))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", PYTHONHASHSEED="0")
    opts = ["--random-seed", str(SEED), "--allow-crimes", "--no-write-model-card", "--quiet",
            "--lora-merge-cache", os.path.join(root, "_lora_cache")]  # mergekit merges a model+lora there first
    docs = documents(name)
    if len(docs) > 1:
        multi = os.path.join(os.path.dirname(mergekit_yaml), "mergekit-multi")
        cmd = [multi, cfg_path, "--intermediate-dir", os.path.join(root, "_stages", name), "--out-path", out, *opts]
    elif _random_order(docs[0]):
        # mergekit orders a union vocabulary (and `chat_template: auto`'s ties) by a Python set, which changes
        # from run to run: run it with that set in hubsoup's order, one of the orders it may take (the
        # merged-vocabulary fixtures do the same: tests/tools/make_mergekit_vocab_fixtures.py)
        from make_mergekit_vocab_fixtures import _ORDERED_MERGEKIT, hubsoup_order

        python = os.path.join(os.path.dirname(mergekit_yaml), "python")
        cmd = [python, "-c", _ORDERED_MERGEKIT, cfg_path, out, *opts]
        env["HUBSOUP_MODEL_ORDER"] = json.dumps(hubsoup_order(config_text(name)))
    else:
        cmd = [mergekit_yaml, cfg_path, out, *opts]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode == 0 and os.path.isfile(os.path.join(out, "config.json")):
        return True, ""
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return False, "\n".join(lines[-3:])[-600:]


def tokenizer_summary(folder: str) -> dict:
    from transformers import AutoTokenizer

    files = sorted(fn for fn in os.listdir(folder)
                   if fn.startswith(("tokenizer", "special_tokens", "chat_template", "added_tokens")))
    if not files:
        return {"files": []}
    tok = AutoTokenizer.from_pretrained(folder)
    return {"files": files, "vocab": dict(sorted(tok.get_vocab().items(), key=lambda kv: kv[1])),
            "chat_template": tok.chat_template}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mergekit", default="benchmarks/.work/mergekit-venv/bin/mergekit-yaml",
                    help="the mergekit-yaml script of a mergekit 0.1.5 environment (mergekit-multi beside it)")
    ap.add_argument("--only", action="append", help="regenerate only these configs (repeatable)")
    ap.add_argument("--keep", help="build under this folder and keep it (default: a temporary folder)")
    ap.add_argument("--relabel", action="store_true",
                    help="only recompute every config's kind and features in the manifest (mergekit not run)")
    args = ap.parse_args(argv)
    if args.relabel:
        path = os.path.join(FIXTURES, "manifest.json")
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        for name, entry in manifest["configs"].items():
            entry.update(kind=kind_of(name), features=features(name))
        with open(path, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
        return 0
    from safetensors import safe_open
    from safetensors.torch import save_file

    mergekit_yaml = os.path.abspath(args.mergekit)
    manifest_path = os.path.join(FIXTURES, "manifest.json")
    manifest: dict = {"configs": {}}
    if os.path.isfile(manifest_path) and args.only:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
    tmp = None if args.keep else tempfile.TemporaryDirectory()
    root = args.keep or tmp.name  # type: ignore[union-attr]
    os.makedirs(root, exist_ok=True)
    manifest.update({"mergekit": MERGEKIT_VERSION, "random_seed": SEED, "pythonhashseed": 0,
                     "shape": {"hidden": HIDDEN, "intermediate": INTERMEDIATE, "heads": HEADS,
                               "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab": VOCAB},
                     "models": build_models(root)})
    for name in config_names():
        if args.only and name not in args.only:
            continue
        out = os.path.join(root, "_out", name)
        print(f"mergekit: {name}", file=sys.stderr, flush=True)
        ok, err = run_mergekit(mergekit_yaml, root, name, out)
        docs = documents(name)
        final = docs[-1] if docs and isinstance(docs[-1], dict) else {}
        entry: dict[str, Any] = {"source": source_of(name), "features": features(name),
                                 "method": str(final.get("merge_method", "?")),
                                 "stages": len(docs), "family": CONFIG_FAMILY[name], "accepted": ok}
        entry["kind"] = kind_of(name)
        base = final.get("base_model")
        entry["base_model"] = base if isinstance(base, str) else None
        path = os.path.join(FIXTURES, f"{name}.safetensors")
        if not ok:
            entry["mergekit_error"] = err
            print(f"  refused: {err.splitlines()[-1] if err else '?'}", file=sys.stderr)
            if os.path.exists(path):
                os.remove(path)
        else:
            tensors = {}
            for fn in sorted(os.listdir(out)):
                if fn.endswith(".safetensors"):
                    with safe_open(os.path.join(out, fn), framework="pt") as h:
                        tensors.update({k: h.get_tensor(k) for k in h.keys()})
            save_file(tensors, path, metadata={"mergekit": MERGEKIT_VERSION})
            with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
                cfg = json.load(f)
            entry["config"] = {k: cfg.get(k) for k in ("architectures", "model_type", "num_hidden_layers", "n_layer",
                                                         "vocab_size", "tie_word_embeddings")}
            entry["config"]["dtype"] = cfg.get("dtype") or cfg.get("torch_dtype")
            entry["tokenizer"] = tokenizer_summary(out)
        manifest["configs"][name] = entry
    with open(manifest_path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
