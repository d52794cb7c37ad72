"""Build the merged-vocabulary fixtures: tiny Llamas whose tokenizers differ, configs, mergekit's outputs.

``tests/formats/test_mergekit_vocab.py`` runs hubsoup on every config of :data:`CONFIGS` (``tokenizer_source:
union | base | <model>`` and ``tokenizer:`` sections) and compares its output with what the real
mergekit 0.1.5 wrote from the same inputs, checked in under ``tests/fixtures/mergekit_vocab/``:
``<name>.safetensors`` (every output tensor), ``<name>.json`` (the output's ``config.json``
vocabulary size, its tokenizer's vocabulary ``token → id`` and added tokens, the contents of its
``tokenizer.json`` and ``tokenizer_config.json``), ``manifest.json``
(mergekit's version, the models' digests, the model order each config ran with).

The input models (:data:`MODELS`), rebuilt bit-identically from seeds by :func:`build_models`:

* ``tiny-vocab/base``: 32 tokens (``[PAD] [UNK] [CLS] [SEP] [EOS] w0 .. w26``), 32 embedding rows;
* ``tiny-vocab/chat``: the base's tokens + special added tokens ``<|im_start|>`` (32) and
  ``<|im_end|>`` (33), the embedding resized to 34 rows;
* ``tiny-vocab/padded``: the base's tokens + a plain added token ``<tool>`` (32), the embedding
  padded to 40 rows (``vocab_size: 40``: 7 rows no token uses);
* ``tiny-vocab/shuffled``: the same words at other ids (``w3`` and ``w5`` swapped), ``w26``
  replaced by ``zeta`` (a token only it has), and ``<|im_end|>`` at id 32 (``chat`` has it at 33);
* ``tiny-vocab/bpe``: a BPE tokenizer of 35 tokens (``xyz``, ``qq`` and the added ``<|eot|>`` at
  ids 32-34) over 32 embedding rows (``vocab_size: 32``: mergekit strips those three from the base's
  tokenizer); ``tiny-vocab/bpe-ft``: the same tokenizer over 35 rows.

A fine-tune's row of a token the base has is the base's row (at the base's id) plus noise; a
new token's row is its own draw.

mergekit builds the union vocabulary (and, without ``base_model``, picks the tokenizer's base and
the output's config) in the order of a Python ``set`` of model references, which changes from run
to run (it hashes ``None``, whose hash is its address in Python 3.11). hubsoup's order is fixed:
``base_model`` (else the first model of the config), then the models in the order the config names
them. So mergekit runs here with its ``MergeConfiguration.referenced_models`` returning the set's
models sorted into hubsoup's order, and a tokenizer's ``get_vocab()`` (the same mapping) in id order:
mergekit adds a model's new tokens to the union in that dict's order, which is the ``tokenizers``
library's hash map order, random from run to run; hubsoup adds them in id order
(:data:`_ORDERED_MERGEKIT`: one of the orders mergekit's run may take, nothing else changed). So the
outputs are comparable id for id.

Regenerate, from the repository root (about 20 s per config)::

    . .venv/bin/activate
    python tests/tools/make_mergekit_vocab_fixtures.py \\
        --mergekit benchmarks/.work/mergekit-venv/bin/mergekit-yaml [--only NAME ...]
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

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "mergekit_vocab")
MERGEKIT_VERSION = "0.1.5"
SEED = 0

SHAPE = {"hidden": 8, "intermediate": 16, "layers": 2, "heads": 2, "kv_heads": 1}
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[EOS]"]
BASE_WORDS = SPECIALS + [f"w{i}" for i in range(27)]


def _shuffled_words() -> list[str]:
    words = list(BASE_WORDS)
    i3, i5 = words.index("w3"), words.index("w5")
    words[i3], words[i5] = words[i5], words[i3]
    words[words.index("w26")] = "zeta"
    return words


# A BPE vocabulary: the specials, a..z, "ab" (merged from a b), then "xyz" and "qq" (no merge makes them)
BPE_WORDS = SPECIALS + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["ab", "xyz", "qq"]
BPE_MERGES = [("a", "b")]

# ref → (seed, words of the word-level model (BPE: the BPE_ list), added tokens [(token, special)], embedding rows)
MODELS: dict[str, tuple[int, list[str], list[tuple[str, bool]], int]] = {
    "tiny-vocab/base": (0, BASE_WORDS, [], 32),
    "tiny-vocab/chat": (1, BASE_WORDS, [("<|im_start|>", True), ("<|im_end|>", True)], 34),
    "tiny-vocab/padded": (2, BASE_WORDS, [("<tool>", False)], 40),
    "tiny-vocab/shuffled": (3, _shuffled_words(), [("<|im_end|>", True)], 33),
    # a BPE tokenizer with 35 tokens over a 32-row embedding (vocab_size 32: xyz, qq, <|eot|> unused)
    "tiny-vocab/bpe": (4, BPE_WORDS, [("<|eot|>", True)], 32),
    "tiny-vocab/bpe-ft": (5, BPE_WORDS, [("<|eot|>", True)], 35),
}


def save_tokenizer(folder: str, words: list[str], added: list[tuple[str, bool]]) -> dict[str, int]:
    """A word-level tokenizer over ``words`` (ids in that order) plus ``added`` tokens; returns its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if words is BPE_WORDS:
        tk = Tokenizer(models.BPE({w: i for i, w in enumerate(words)}, BPE_MERGES, unk_token="[UNK]"))
    else:
        tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", eos_token="[EOS]")
    for tok, special in added:
        fast.add_tokens([tok], special_tokens=special)
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder).get_vocab()


def layer_shapes() -> dict[str, tuple[int, ...]]:
    h, i = SHAPE["hidden"], SHAPE["intermediate"]
    kv = h // SHAPE["heads"] * SHAPE["kv_heads"]
    shapes = {}
    for n in range(SHAPE["layers"]):
        p = f"model.layers.{n}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    shapes["model.norm.weight"] = (h,)
    return shapes


def model_config(rows: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": SHAPE["hidden"],
            "intermediate_size": SHAPE["intermediate"], "num_hidden_layers": SHAPE["layers"],
            "num_attention_heads": SHAPE["heads"], "num_key_value_heads": SHAPE["kv_heads"],
            "vocab_size": rows, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
            "hidden_act": "silu", "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
            "bos_token_id": 2, "eos_token_id": 4, "pad_token_id": 0}


def model_tensors(ref: str, vocab: dict[str, int]) -> dict[str, torch.Tensor]:
    """A model's tensors: the base's from seed 0; a fine-tune's = the base's + seeded noise, rows re-indexed."""
    seed, _, _, rows = MODELS[ref]
    h = SHAPE["hidden"]
    g0 = torch.Generator().manual_seed(0)
    base = {}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        base[name] = torch.randn((32, h), generator=g0) * 0.2
    for name, shape in layer_shapes().items():
        t = torch.randn(shape, generator=g0)
        base[name] = t.mul_(0.1).add_(1.0) if len(shape) == 1 else t.mul_(0.2)
    if seed == 0:
        return base
    base_ids = {w: i for i, w in enumerate(BASE_WORDS)}
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for k, (name, t) in enumerate(base.items()):
        scale = 0.01 * (1 + (k + seed) % 4)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            new = torch.randn((rows, h), generator=g) * 0.2  # rows of new tokens and padding: own draws
            noise = torch.randn((rows, h), generator=g) * scale
            for tok, i in vocab.items():
                if tok in base_ids and i < rows:
                    new[i] = t[base_ids[tok]] + noise[i]
            out[name] = new
        else:
            out[name] = t + torch.randn(t.shape, generator=g) * scale
    return out


def digest(tensors: dict[str, torch.Tensor]) -> str:
    hs = hashlib.sha256()
    for name in sorted(tensors):
        hs.update(name.encode())
        hs.update(tensors[name].contiguous().numpy().tobytes())
    return hs.hexdigest()


def build_models(root: str) -> dict[str, str]:
    """Write the input models (weights, config, tokenizer) under ``root``; returns ref → digest."""
    from safetensors.torch import save_file

    digests = {}
    for ref, (_, words, added, rows) in MODELS.items():
        folder = os.path.join(root, ref)
        os.makedirs(folder, exist_ok=True)
        vocab = save_tokenizer(folder, words, added)
        tensors = model_tensors(ref, vocab)
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump(model_config(rows), f, indent=2)
        digests[ref] = digest(tensors)
    digests[EMB_LORA] = build_embedding_lora(root)
    return digests


EMB_LORA = "tiny-vocab/emb-lora"
"""A LoRA of ``tiny-vocab/base`` (q/v projections) that also saves the token embeddings whole (``modules_to_save``)."""


def build_embedding_lora(root: str) -> str:
    """Write :data:`EMB_LORA` (seeded); returns its digest. mergekit merges it into the base before reading it."""
    from safetensors.torch import load_file, save_file

    from hubsoup.testing import write_adapter

    folder = os.path.join(root, EMB_LORA)
    base = os.path.join(root, "tiny-vocab/base")
    write_adapter(folder, base, seed=5, r=2, targets=("q_proj", "v_proj"))
    path = os.path.join(folder, "adapter_model.safetensors")
    t = load_file(path)
    emb = load_file(os.path.join(base, "model.safetensors"))["model.embed_tokens.weight"]
    g = torch.Generator().manual_seed(11)
    t["base_model.model.model.embed_tokens.weight"] = emb + torch.randn(emb.shape, generator=g) * 0.05
    save_file(t, path, metadata={"format": "pt"})
    with open(os.path.join(folder, "adapter_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["modules_to_save"] = ["embed_tokens"]
    with open(os.path.join(folder, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return digest(t)


# name → config (every method here is deterministic: compared within float32 rounding)
CONFIGS: dict[str, str] = {
    "union_linear": """\
models:
  - model: tiny-vocab/chat
    parameters:
      weight: 0.4
  - model: tiny-vocab/base
    parameters:
      weight: 0.2
  - model: tiny-vocab/padded
    parameters:
      weight: 0.25
  - model: tiny-vocab/shuffled
    parameters:
      weight: 0.15
merge_method: linear
tokenizer_source: union
dtype: float32
""",
    "union_ties": """\
models:
  - model: tiny-vocab/chat
    parameters:
      density: 0.5
      weight: 0.5
  - model: tiny-vocab/padded
    parameters:
      density: 0.7
      weight: 0.3
  - model: tiny-vocab/shuffled
    parameters:
      density: 0.6
      weight: 0.4
merge_method: ties
base_model: tiny-vocab/base
tokenizer_source: union
dtype: float32
""",
    "source_model": """\
models:
  - model: tiny-vocab/chat
    parameters:
      weight: 0.7
  - model: tiny-vocab/shuffled
    parameters:
      weight: 0.5
merge_method: task_arithmetic
base_model: tiny-vocab/base
tokenizer_source: tiny-vocab/shuffled
dtype: float32
""",
    "section_tokens": """\
models:
  - model: tiny-vocab/chat
    parameters:
      weight: 0.6
  - model: tiny-vocab/padded
    parameters:
      weight: 0.3
  - model: tiny-vocab/shuffled
    parameters:
      weight: 0.5
merge_method: task_arithmetic
base_model: tiny-vocab/base
tokenizer:
  source: union
  tokens:
    <|im_start|>:
      source: tiny-vocab/chat
    <|im_end|>:
      source:
        kind: model_token
        model: tiny-vocab/shuffled
        token: <|im_end|>
      force: true
    <think>:
      source:
        kind: zero
    w3:
      source:
        kind: model_token
        model: tiny-vocab/chat
        token_id: 7
      force: true
    zeta:
      source: tiny-vocab/shuffled
  pad_to_multiple_of: 16
dtype: float32
""",
    "section_base_slerp": """\
models:
  - model: tiny-vocab/chat
  - model: tiny-vocab/shuffled
merge_method: slerp
base_model: tiny-vocab/chat
parameters:
  t: 0.3
tokenizer:
  source: base
dtype: float32
""",
    "base_padded_truncated": """\
models:
  - model: tiny-vocab/chat
    parameters:
      weight: 0.8
merge_method: task_arithmetic
base_model: tiny-vocab/padded
tokenizer_source: base
dtype: float32
""",
    "union_pad_no_base_average": """\
models:
  - model: tiny-vocab/chat
    parameters:
      weight: 1.0
  - model: tiny-vocab/shuffled
    parameters:
      weight: 1.0
  - model: tiny-vocab/padded
    parameters:
      weight: 2.0
merge_method: linear
parameters:
  normalize: true
tokenizer:
  pad_to_multiple_of: 48
dtype: float32
""",
    "bpe_base_stripped": """\
models:
  - model: tiny-vocab/bpe-ft
    parameters:
      weight: 0.7
merge_method: task_arithmetic
base_model: tiny-vocab/bpe
tokenizer_source: base
dtype: float32
""",
    "bpe_union": """\
models:
  - model: tiny-vocab/bpe
    parameters:
      weight: 0.5
  - model: tiny-vocab/bpe-ft
    parameters:
      weight: 0.5
merge_method: linear
base_model: tiny-vocab/bpe
tokenizer_source: union
dtype: float32
""",
    # a base+lora input whose adapter saves the embeddings whole: mergekit merges the adapter into the base first
    # and reads that model's rows by the base's tokenizer
    "union_lora_embeddings": """\
models:
  - model: tiny-vocab/base+tiny-vocab/emb-lora
    parameters:
      weight: 0.6
  - model: tiny-vocab/chat
    parameters:
      weight: 0.4
merge_method: task_arithmetic
base_model: tiny-vocab/base
tokenizer_source: union
dtype: float32
""",
    "union_passthrough_slices": """\
slices:
  - sources:
      - model: tiny-vocab/chat
        layer_range: [0, 1]
  - sources:
      - model: tiny-vocab/shuffled
        layer_range: [1, 2]
merge_method: passthrough
tokenizer_source: union
dtype: float32
""",
}


def hubsoup_order(config: str) -> list[str]:
    """The model order hubsoup uses: base_model (else the first model), then the others as the config names them."""
    import yaml

    data = yaml.safe_load(config)
    order = [data["base_model"]] if data.get("base_model") else []
    for m in data.get("models") or []:
        order.append(m["model"])
    for s in data.get("slices") or []:
        for src in s["sources"]:
            order.append(src["model"])
    return list(dict.fromkeys(order))


_ORDERED_MERGEKIT = """
import json, os, sys
import mergekit.config as config
from mergekit.scripts.run_yaml import main

_refs = config.MergeConfiguration.referenced_models
_want = json.loads(os.environ["HUBSOUP_MODEL_ORDER"])

def referenced_models(self):  # the set's models, in hubsoup's order (one of the orders mergekit's set gives)
    return sorted(_refs(self), key=lambda r: _want.index(str(r)))

config.MergeConfiguration.referenced_models = referenced_models

from transformers.tokenization_utils_tokenizers import TokenizersBackend

_get_vocab = TokenizersBackend.get_vocab

def get_vocab(self):  # the same mapping, in id order (the tokenizers library's hash map order is random)
    return dict(sorted(_get_vocab(self).items(), key=lambda kv: kv[1]))

TokenizersBackend.get_vocab = get_vocab
sys.argv[0] = "mergekit-yaml"
sys.exit(main())
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mergekit", default="benchmarks/.work/mergekit-venv/bin/mergekit-yaml",
                    help="the mergekit-yaml script of a mergekit 0.1.5 environment")
    ap.add_argument("--only", action="append", help="regenerate only these configs (repeatable)")
    args = ap.parse_args(argv)
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    mergekit_yaml = os.path.abspath(args.mergekit)
    python = os.path.join(os.path.dirname(mergekit_yaml), "python")
    os.makedirs(FIXTURES, exist_ok=True)
    manifest_path = os.path.join(FIXTURES, "manifest.json")
    manifest: dict = {"configs": {}}
    if os.path.isfile(manifest_path) and args.only:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    with tempfile.TemporaryDirectory() as root:
        manifest.update({"mergekit": MERGEKIT_VERSION, "random_seed": SEED, "models": build_models(root)})
        for name, config in CONFIGS.items():
            if args.only and name not in args.only:
                continue
            cfg_path = os.path.join(root, f"{name}.yml")
            with open(cfg_path, "w", encoding="utf-8") as f:
                f.write(config)
            order = hubsoup_order(config)
            out = os.path.join(root, "out", name)
            print(f"mergekit: {name} (models in the order {order})", file=sys.stderr)
            cmd = [python, "-c", _ORDERED_MERGEKIT, cfg_path, out, "--random-seed", str(SEED), "--quiet",
                   "--allow-crimes", "--no-write-model-card", "--lora-merge-cache", os.path.join(root, "_lora_cache")]
            proc = subprocess.run(cmd, cwd=root, env={**env, "HUBSOUP_MODEL_ORDER": json.dumps(order)},
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"mergekit failed on {name}:\n{proc.stderr[-3000:]}")
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
            tok = AutoTokenizer.from_pretrained(out)
            files = {}
            for fn in ("tokenizer.json", "tokenizer_config.json"):
                if os.path.isfile(os.path.join(out, fn)):
                    with open(os.path.join(out, fn), encoding="utf-8") as f:
                        files[fn] = json.load(f)
            with open(os.path.join(FIXTURES, f"{name}.json"), "w", encoding="utf-8") as f:
                json.dump({"vocab_size": cfg.get("vocab_size"),
                           "vocab": dict(sorted(tok.get_vocab().items(), key=lambda kv: kv[1])),
                           "added_tokens": (files.get("tokenizer.json") or {}).get("added_tokens"),
                           "tokenizer_files": sorted(fn for fn in os.listdir(out)
                                                     if fn.startswith(("tokenizer", "special_tokens"))),
                           "files": files},
                          f, indent=1, ensure_ascii=False)
            manifest["configs"][name] = {"model_order": order}
            for line in proc.stderr.splitlines():  # mergekit's warnings (a token no model has, ...)
                if "WARNING" in line or "ERROR" in line:
                    print("  " + line, file=sys.stderr)
    with open(manifest_path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    print(f"wrote {len(manifest['configs'])} fixtures to {FIXTURES}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
