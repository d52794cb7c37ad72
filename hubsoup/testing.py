"""Tiny models built on the fly, for tests, the demo and benchmarks; and a harness for merge methods.

Example:
    >>> from hubsoup.testing import make_base, make_finetune, merge_tensors
    >>> base = make_base("llama", "/tmp/base")                     # doctest: +SKIP
    >>> ft = make_finetune(base, "/tmp/ft-a", seed=1)              # doctest: +SKIP
    >>> merge_tensors("ties", [tau_a, tau_b], density=0.2)         # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import random
from typing import TYPE_CHECKING, Any, Sequence

import torch
import transformers as tf
from huggingface_hub import ModelCard, ModelCardData
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hubsoup.methods import TensorContext, get_method

if TYPE_CHECKING:
    from peft import PeftConfig

    from hubsoup.methods import Method
    from hubsoup.plan import BlockInfo

ARCHS = ("llama", "mistral", "qwen2", "gpt2", "bert", "t5", "clip_vision")


def tiny_model(arch: str, *, layers: int = 2, hidden: int = 32, vocab: int = 128, seed: int = 0) -> tf.PreTrainedModel:
    """A randomly initialised transformers model of architecture ``arch`` (2-4 layers)."""
    torch.manual_seed(seed)
    heads = 4
    if arch in ("llama", "mistral", "qwen2"):
        cfg_cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config}[arch]
        cfg = cfg_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
        model_cls = {"llama": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM, "qwen2": tf.Qwen2ForCausalLM}[arch]
    elif arch == "gpt2":
        cfg = tf.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=64)
        model_cls = tf.GPT2LMHeadModel
    elif arch == "bert":
        cfg = tf.BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            intermediate_size=hidden * 2, max_position_embeddings=64)
        model_cls = tf.BertModel
    elif arch == "t5":
        # transformers' T5Config takes decoder_start_token_id through PreTrainedConfig's **kwargs, unlike its typing
        cfg = tf.T5Config(vocab_size=vocab, d_model=hidden, d_kv=hidden // heads, d_ff=hidden * 2, num_layers=layers,  # type: ignore[call-arg]
                          num_decoder_layers=layers, num_heads=heads, decoder_start_token_id=0)
        model_cls = tf.T5ForConditionalGeneration
    elif arch == "clip_vision":
        cfg = tf.CLIPVisionConfig(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                                  num_attention_heads=heads, image_size=16, patch_size=8)
        model_cls = tf.CLIPVisionModel
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {ARCHS}")
    model: tf.PreTrainedModel = model_cls(cfg)
    model.eval()  # type: ignore[no-untyped-call]  # transformers overrides PreTrainedModel.eval untyped
    return model


def make_base(arch: str, folder: str, *, seed: int = 0, dtype: torch.dtype | None = None, **kw: Any) -> str:
    """Save a tiny pre-trained stand-in of ``arch`` to ``folder``; returns the folder."""
    model = tiny_model(arch, seed=seed, **kw)
    if dtype is not None:
        model = model.to(dtype)  # type: ignore[arg-type]  # transformers' PreTrainedModel.to: a functools.wraps wrapper, typed wrong
    model.save_pretrained(folder)
    return folder


def make_finetune(base: str, folder: str, *, seed: int, scale: float = 0.02, base_model: str | None = None,
                  only: str | None = None) -> str:
    """A 'fine-tune' of ``base``: every float tensor plus seeded Gaussian noise.

    ``base_model`` is written into the model card's metadata (as a Hub fine-tune's
    card would say). ``only``: perturb just tensors whose name contains it.
    """
    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for fname in os.listdir(base):
        src = os.path.join(base, fname)
        if fname.endswith(".safetensors"):
            sd = load_file(src)
            for k, v in sd.items():
                if v.dtype.is_floating_point and (only is None or only in k):
                    noise = torch.randn(v.shape, generator=g) * scale
                    sd[k] = (v.float() + noise).to(v.dtype)
            save_file(sd, os.path.join(folder, fname), metadata={"format": "pt"})
        elif os.path.isfile(src) and fname != "README.md":
            with open(src, "rb") as f_in, open(os.path.join(folder, fname), "wb") as f_out:
                f_out.write(f_in.read())
    if base_model:
        write_card_metadata(folder, base_model=base_model)
    return folder


def write_card_metadata(folder: str, **metadata: Any) -> None:
    ModelCard.from_template(ModelCardData(**metadata)).save(os.path.join(folder, "README.md"))


def save_tiny_tokenizer(folder: str, vocab: int = 128) -> None:
    """A word-level tokenizer over the words ``w0 .. w{vocab-5}`` (plus [PAD] [UNK] [CLS] [SEP] [EOS])."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[EOS]"]
    words = specials + [f"w{i}" for i in range(vocab - len(specials))]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    # transformers: PreTrainedTokenizerFast.__init__ is unannotated
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",  # type: ignore[no-untyped-call]
                                   sep_token="[SEP]", eos_token="[EOS]")
    fast.save_pretrained(folder)


# --- merge methods on hand-made tensors ---------------------------------------------------------


LLAMA_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_lm_family(root: str, *, base_model: str, n: int = 2) -> tuple[str, list[str]]:
    """A tiny Llama base in ``root/base`` with a word-level tokenizer and an apache-2.0 card, and ``n`` fine-tunes of
    it (``root/ft1``..: seeds 1..n, noise 0.05, each with the tokenizer) whose cards name ``base_model`` (the base's
    Hub ID where the tests seed it). Returns the base's folder and the fine-tunes'."""
    base = make_base("llama", os.path.join(root, "base"))
    save_tiny_tokenizer(base)
    write_card_metadata(base, license="apache-2.0")
    fts = []
    for i in range(1, n + 1):
        ft = make_finetune(base, os.path.join(root, f"ft{i}"), seed=i, scale=0.05, base_model=base_model)
        save_tiny_tokenizer(ft)
        fts.append(ft)
    return base, fts


CHOICE_TASK = """task: {task}
dataset_path: {path}
{data}output_type: multiple_choice
{extra}doc_to_text: "{{{{query}}}}"
doc_to_choice: choices
doc_to_target: gold
metric_list:
{metrics}"""


def choice_task_yaml(task: str, data: str, *, hub_dataset: bool = False, metrics: Sequence[str] = ("acc",),
                     extra: str = "") -> str:
    """A custom lm-evaluation-harness task (lm-eval's own YAML) of multiple choice over rows ``{"query", "choices",
    "gold"}`` (:func:`choice_rows`): ``data`` is a JSON-lines file, read by lm-eval's ``json`` builder as the
    validation split, or with ``hub_dataset`` a Hub dataset ID (its train split). ``extra``: more YAML lines
    (``process_docs: ...``).

    >>> print(choice_task_yaml("toy", "org/data", hub_dataset=True).splitlines()[1:3])
    ['dataset_path: org/data', 'validation_split: train']
    """
    if hub_dataset:
        path, where = data, "validation_split: train\n"
    else:
        path, where = "json", f"dataset_kwargs:\n  data_files:\n    validation: {data}\nvalidation_split: validation\n"
    rows = "".join(f"  - metric: {m}\n    aggregation: mean\n    higher_is_better: true\n" for m in metrics)
    return CHOICE_TASK.format(task=task, path=path, data=where, extra=extra, metrics=rows)


def choice_rows(n: int = 6, *, seed: int = 0, words: int = 100) -> str:
    """``n`` JSON lines of :func:`choice_task_yaml`'s rows: a 5-word query of ``w0``..``w{words-1}`` (the words of
    :func:`save_tiny_tokenizer`), three 2-word choices, the index of the gold one; fixed by ``seed``."""
    rng = random.Random(seed)
    return "".join(json.dumps({"query": " ".join(f"w{rng.randrange(words)}" for _ in range(5)),
                               "choices": [f"w{rng.randrange(words)} w{rng.randrange(words)}" for _ in range(3)],
                               "gold": rng.randrange(3)}) + "\n" for _ in range(n))


def write_adapter(folder: str, base: str, *, seed: int, r: int, targets: Sequence[str] = LLAMA_LINEAR) -> str:
    """A peft LoRA adapter of the checkpoint in ``base`` (every ``targets`` linear of every layer), float32.

    Written straight from the base's safetensors headers, as peft saves one, without building the
    model: for bases too large to instantiate cheaply (the memory tests and benchmarks).
    lora_B is random too, so the update is not 0.
    """
    os.makedirs(folder)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for path in sorted(os.path.join(base, f) for f in os.listdir(base) if f.endswith(".safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                module, _, leaf = name.rpartition(".")
                if leaf != "weight" or module.rsplit(".", 1)[-1] not in targets:
                    continue
                out_f, in_f = f.get_slice(name).get_shape()
                key = f"base_model.model.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, in_f, generator=g) / in_f ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, r, generator=g) * 0.01
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 2 * r,
                   "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none",
                   "fan_in_fan_out": False, "base_model_name_or_path": base, "use_rslora": False,
                   "use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "init_lora_weights": True}, f)
    return folder


def merge_tensors(method: str | Method[Any], taus: Sequence[torch.Tensor] | torch.Tensor,
                  base: torch.Tensor | None = None, *, name: str = "w", block: BlockInfo | None = None,
                  stats: dict[str, Any] | None = None, recipe_hash: str = "", **params: Any) -> torch.Tensor:
    """A method's merged task vector of one tensor, called as the engine calls it.

    Parses ``params`` (CLI strings or Python values) and checks the inputs as a merge does;
    unless ``stats`` is given, runs the method's statistics passes over this one tensor (so
    a "whole-model" statistic, such as TIES's global threshold, is this tensor's); then
    merges a fresh stack of ``taus``, which the method may overwrite. A method that must
    run the models first (:meth:`~hubsoup.methods.Method.prepare`, e.g. LOT) needs its
    statistics given.

    Args:
        method: a registered method's name, or a :class:`~hubsoup.methods.Method`.
        taus: the inputs' task vectors τᵢ of one shape (a list, or an ``(N, *shape)`` stack); never modified.
        base: the base tensor θ₀ (default: zeros, enough for every method that reads only the τᵢ).
        name: the tensor's name, which methods that treat tensors by role read (SFTM, OPCM).
        block: the transformer block holding the tensor, which depth schedules read (LiNeS).
        stats: the statistics the merge reads, as the engine would leave them (e.g. a TIES
            threshold of the whole model, ``plan.stacks``); when given, no pass is run.
        recipe_hash: the recipe's hash, which seeds random methods (DARE) with the tensor name.
        **params: the method's parameters.

    Returns:
        The merged task vector (add it to the base for the merged weight).

    Example:
        >>> import torch
        >>> merge_tensors("task_arithmetic", [torch.ones(2), torch.full((2,), 3.0)], scale=0.5)
        tensor([2., 2.])
    """
    m = get_method(method) if isinstance(method, str) else method
    p = m.parse(params)
    stacked = taus if isinstance(taus, torch.Tensor) else torch.stack(list(taus))
    n = stacked.shape[0]
    m.check_inputs(p, n)
    base = torch.zeros_like(stacked[0]) if base is None else base
    if stats is None:
        stats = {}
        for sp in m.passes(p, n):
            sp.update(TensorContext(name, block, n, stats, recipe_hash), base, stacked)
            sp.finish(stats)
    ctx = TensorContext(name=name, block=block, n_inputs=n, stats=stats, recipe_hash=recipe_hash)
    return m.merge(base, stacked.clone(), p, ctx)


def make_adapter(folder: str | os.PathLike[str], arch: str = "llama", seed: int = 1, model_kw: dict[str, Any] | None = None,
                 model_cls: str | None = None, config_cls: type[PeftConfig] | None = None, **cfg: Any) -> str:
    """A peft LoRA adapter of the tiny ``arch`` base with every trainable tensor randomised.

    peft initialises lora_B (and lora_embedding_A) to zero, so without this the update would be 0.
    ``cfg`` goes to ``LoraConfig`` (or ``config_cls``); ``model_cls`` adapts a sub-model (e.g. the bare
    ``model`` inside a causal LM).
    """
    # lazy: peft (~1.5 s here after transformers) only for the LoRA adapter fixtures
    from peft import LoraConfig, get_peft_model

    model = tiny_model(arch, **(model_kw or {}))
    if model_cls is not None:
        model = getattr(model, model_cls)
    pm = get_peft_model(model, (config_cls or LoraConfig)(**cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in pm.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    pm.save_pretrained(str(folder))
    return str(folder)
