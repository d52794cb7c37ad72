"""What a tensor or module is: roles from names and shapes, module kinds and ties from the architecture.

One home for every "what is this tensor" question, so the answers agree:

* :func:`tensor_role` — the role the structure-aware methods need, from the name and shape;
* :func:`model_layout` — module types and tied parameters, asked of transformers itself
  (the architecture built on the meta device, never remote code), with
  :func:`module_kind`, :func:`tied_groups` and :func:`tie_heads` on top;
* :func:`before_blocks` — whether a tensor outside the transformer blocks runs before them;
* :func:`model_class` — the transformers class named by a config;
* :func:`auto_class` — the Auto class that loads it and its Hub ``pipeline_tag`` (the card's snippet).

Roles
-----

SFTM, OPCM and LOT treat linear weights differently from biases, normalisation
parameters and embeddings. The engine hands a method only a tensor's name and
values, so the role is read off the name (HF naming conventions) and the rank:

- ``linear``: a 2-D projection weight (``nn.Linear``, GPT-2 ``Conv1D``).
- ``conv``: a weight of 3 or more dimensions (convolution kernels, e.g. ViT patch embedding).
- ``embedding``: a lookup table or additive input (token / position / token-type
  embeddings, T5 relative-attention bias tables, CLIP ``class_embedding``).
- ``head``: the untied output projection (``lm_head``); methods decide whether it is a matrix.
- ``norm``: a 1-D weight or bias of a normalisation layer (LayerNorm, RMSNorm, ``ln_*``).
- ``bias``: every other 1-D (or 0-D) tensor.

Example:
    >>> tensor_role("model.layers.0.self_attn.q_proj.weight", (32, 32))
    'linear'
    >>> tensor_role("transformer.h.0.ln_1.bias", (32,))
    'norm'
    >>> tensor_role("model.embed_tokens.weight", (128, 32))
    'embedding'
    >>> tensor_role("lm_head.weight", (128, 32))
    'head'
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

log = logging.getLogger(__name__)

EMBEDDING_HINTS = ("embed", "wte", "wpe", "shared", "position", "token_type", "relative_attention_bias",
                   "class_embedding", "cls_token", "pos_emb")
# Tensors outside the blocks that run before them: embeddings plus input-side norms and patch projections.
PRE_BLOCK_HINTS = EMBEDDING_HINTS + ("patch", "pre_layrnorm", "pre_layernorm", "ln_pre")
HEAD_MODULES = ("lm_head", "embed_out")
_NORM_RE = re.compile(r"(norm|^ln(_|\d|$)|^ln[a-z_]*$)")


def tensor_role(name: str, shape: Sequence[int]) -> str:
    """The role of tensor ``name`` of the given shape (see the module docstring)."""
    parts = name.lower().split(".")
    module = parts[:-1] if len(parts) > 1 else parts
    last = module[-1] if module else ""
    ndim = len(shape)
    if ndim >= 3:
        return "conv"
    if ndim == 2:
        if last in HEAD_MODULES:
            return "head"
        if any(h in p for p in module for h in EMBEDDING_HINTS) or any(h in parts[-1] for h in EMBEDDING_HINTS):
            return "embedding"
        return "linear"
    if last and _NORM_RE.search(last):
        return "norm"
    if any(h in p for p in parts for h in EMBEDDING_HINTS):
        return "embedding"
    return "bias"


def before_blocks(name: str) -> bool:
    """True for a tensor outside the blocks that the forward pass reaches before them."""
    return any(h in name.lower() for h in PRE_BLOCK_HINTS)


# --- the architecture, asked of transformers -------------------------------------------------

@dataclass
class ModuleInfo:
    kind: str
    """``linear``, ``conv1d`` (GPT-2 style, weight stored (in, out)), ``embedding`` or ``other``."""
    params: tuple[str, ...]
    """Local names of the module's state-dict entries (``weight``, ``bias``, ...)."""


@dataclass
class Layout:
    modules: dict[str, ModuleInfo]
    ties: list[list[str]] = field(default_factory=list)
    """Groups of parameter names sharing one tensor, including names absent from the checkpoint."""


def model_layout(folder: str) -> Layout | None:
    """Module types and tied parameters of the model in ``folder``, or None if it cannot be built.

    The model class is built on the meta device from ``config.json`` (never remote code).
    """
    cfg = os.path.join(folder, "config.json")
    return _layout(folder, os.path.getmtime(cfg) if os.path.isfile(cfg) else 0.0)


@functools.lru_cache(maxsize=16)
def _layout(folder: str, _mtime: float) -> Layout | None:
    try:
        # lazy: transformers costs ~4 s to import here (torch ~6 s); only reading a folder's model layout needs it
        import transformers
        # lazy: accelerate comes with transformers' model code (~13 s here); only the layout needs it
        from accelerate.utils import find_tied_parameters
        # lazy: transformers costs ~4 s to import here (torch ~6 s); only reading a folder's model layout needs it
        from transformers import AutoConfig
        # lazy: transformers' model classes cost ~13 s to import here (torch ~6 s); only the layout needs them
        from transformers.pytorch_utils import Conv1D

        cfg = AutoConfig.from_pretrained(folder, trust_remote_code=False)
        cls = model_class(cfg)
        with torch.device("meta"):
            model = cls.from_config(cfg) if cls is transformers.AutoModel else cls(cfg)
        modules = {}
        for name, mod in model.named_modules():
            if next(mod.children(), None) is not None:
                continue
            kind = ("conv1d" if isinstance(mod, Conv1D) else "embedding" if isinstance(mod, nn.Embedding)
                    else "linear" if isinstance(mod, nn.Linear) else "other")
            modules[name] = ModuleInfo(kind, tuple(mod.state_dict().keys()))
        ties = [list(g) for g in find_tied_parameters(model)]
        return Layout(modules, ties)
    except Exception as e:  # noqa: BLE001 - unknown architectures fall back to shape heuristics
        log.debug("model layout of %s unavailable: %s", folder, e)
        return None


class TensorHeader(Protocol):
    """What a checkpoint's header says of a tensor (``hubsoup.sources.checkpoint.TensorInfo``)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...


def tied_groups(folder: str, keys: list[str], infos: Mapping[str, TensorHeader] | None = None,
                config: Mapping[str, Any] | None = None) -> list[list[str]]:
    """Groups of checkpoint keys that the architecture ties together.

    A tie matters only when two of its names are both in the checkpoint (``save_pretrained``
    keeps one). Given the header ``infos`` and the ``config``, that is ruled out without
    building the model when no two embedding/head tensors share a shape and dtype, or when
    ``tie_word_embeddings`` is false in a decoder-only or encoder-only model; otherwise (and
    without them) the ties are asked of transformers itself (see :func:`model_layout`) — the
    architecture built on the meta device, which costs seconds of imports. Unknown
    architectures report no ties.
    """
    if infos is not None and config is not None and not _may_tie(keys, infos, config):
        return []
    layout = model_layout(os.path.abspath(folder))
    if layout is None:
        return []
    present = set(keys)
    if config is not None and config.get("tie_word_embeddings") is False:
        # the config says the head is its own (T5 v1.1: transformers ties it anyway, mergekit merges it apart)
        present = {n for n in present if n.rsplit(".", 1)[0].split(".")[-1] not in HEAD_MODULES}
    out = []
    for group in layout.ties:
        names = [n for n in group if n in present]
        if len(names) > 1:
            out.append(sorted(names, key=keys.index))
    return out


def _may_tie(keys: list[str], infos: Mapping[str, TensorHeader], config: Mapping[str, Any]) -> bool:
    groups: dict[tuple[tuple[int, ...], torch.dtype], int] = {}
    for k in keys:
        info = infos[k]
        if info.dtype.is_floating_point and tensor_role(k, tuple(info.shape)) in ("embedding", "head"):
            sig = (tuple(info.shape), info.dtype)
            groups[sig] = groups.get(sig, 0) + 1
    if all(n < 2 for n in groups.values()):
        return False
    return not (config.get("tie_word_embeddings") is False and not config.get("is_encoder_decoder"))


def module_kind(layout: Layout | None, module: str, shape: tuple[int, ...]) -> str:
    """Kind of ``module`` from the layout, else guessed from its name."""
    if layout is not None and module in layout.modules:
        return layout.modules[module].kind
    if len(shape) != 2:
        return "other"
    return "embedding" if any(h in module.split(".")[-1].lower() for h in EMBEDDING_HINTS) else "linear"


def tie_heads(layout: Layout | None, base_keys: list[str]) -> dict[str, str]:
    """Every tied name (present in the checkpoint or not) → the tensor the plan merges for it."""
    out: dict[str, str] = {}
    if layout is None:
        return out
    order = {k: i for i, k in enumerate(base_keys)}
    for group in layout.ties:
        present = sorted((n for n in group if n in order), key=order.__getitem__)
        if present:
            for n in group:
                if n != present[0]:
                    out[n] = present[0]
    return out


def model_class(config: PreTrainedConfig) -> type[Any]:
    """The transformers class of ``config.architectures[0]`` (``AutoModel`` if it names none)."""
    # lazy: transformers costs ~4 s to import here (torch ~6 s); only the model class of a card's snippet needs it
    import transformers

    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    return cls or transformers.AutoModel


# Which transformers Auto class loads an architecture, and the Hub's pipeline tag for it: asked of
# transformers' own auto mappings (``MODEL_FOR_*_MAPPING_NAMES``), most specific head first. An
# architecture in several mappings (BART: seq2seq, masked LM, pre-training) takes the first.
_AUTO_CLASSES = (
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM", "text-generation"),
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM", "text2text-generation"),
    ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "AutoModelForImageTextToText", "image-text-to-text"),
    ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "AutoModelForSpeechSeq2Seq", "automatic-speech-recognition"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForSequenceClassification", "text-classification"),
    ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "AutoModelForTokenClassification", "token-classification"),
    ("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "AutoModelForQuestionAnswering", "question-answering"),
    ("MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES", "AutoModelForMultipleChoice", None),
    ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification", "image-classification"),
    ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "AutoModelForAudioClassification", "audio-classification"),
    ("MODEL_FOR_CTC_MAPPING_NAMES", "AutoModelForCTC", "automatic-speech-recognition"),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM", "fill-mask"),
    ("MODEL_FOR_PRETRAINING_MAPPING_NAMES", "AutoModelForPreTraining", None),
    ("MODEL_MAPPING_NAMES", "AutoModel", "feature-extraction"),
)


@functools.lru_cache(maxsize=1)
def _auto_mappings() -> dict[str, dict[str, str]]:
    """transformers' ``MODEL_FOR_*_MAPPING_NAMES`` (model type → architecture names).

    They are literals in ``transformers/models/auto/modeling_auto.py``: read from its source
    (~50 ms) unless the module is loaded already, since importing it imports transformers
    (~1.7 s, the largest fixed cost of a merge, paid only to write the card's snippet). Any
    surprise in the source falls back to the import.
    """
    loaded = sys.modules.get("transformers.models.auto.modeling_auto")
    wanted = [m for m, _, _ in _AUTO_CLASSES]
    if loaded is None:
        try:
            spec = importlib.util.find_spec("transformers")  # finds the package without importing it
            if spec is None or spec.origin is None:  # no source to read: the import below says what is wrong
                raise ValueError("transformers not found")
            path = os.path.join(os.path.dirname(spec.origin), "models", "auto", "modeling_auto.py")
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            found = {}
            for node in tree.body:
                if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                        and node.targets[0].id in wanted and isinstance(node.value, ast.Call)
                        and len(node.value.args) == 1):
                    found[node.targets[0].id] = dict(ast.literal_eval(node.value.args[0]))
            if set(found) == set(wanted):
                return found
        except (OSError, ValueError, SyntaxError, TypeError, AttributeError):
            pass
        # lazy: transformers' model classes cost ~13 s to import here (torch ~6 s); see the docstring
        from transformers.models.auto import modeling_auto as loaded
    return {m: dict(getattr(loaded, m, {})) for m in wanted}


@dataclass(frozen=True)
class AutoClass:
    """How to load a model: the transformers Auto class and the Hub ``pipeline_tag`` (None: no tag fits)."""

    name: str
    pipeline_tag: str | None
    architecture: str | None = None


def auto_class(config: Mapping[str, Any] | None) -> AutoClass:
    """The Auto class that loads a model with ``config`` (a ``config.json`` dict), from ``architectures[0]``.

    An architecture transformers does not know (remote code) or a config naming none loads with
    ``AutoModel`` and gets no pipeline tag. A bare encoder of images (no ``vocab_size``) is tagged
    ``image-feature-extraction``.

    Example:
        >>> auto_class({"architectures": ["LlamaForCausalLM"]})
        AutoClass(name='AutoModelForCausalLM', pipeline_tag='text-generation', architecture='LlamaForCausalLM')
        >>> auto_class({"architectures": ["BertModel"], "vocab_size": 30522}).name
        'AutoModel'
    """
    archs = (config or {}).get("architectures") or []
    arch = archs[0] if archs and isinstance(archs[0], str) else None
    if arch:
        mappings = _auto_mappings()
        for mapping, cls, tag in _AUTO_CLASSES:
            for names in mappings.get(mapping, {}).values():
                if arch == names or (isinstance(names, (tuple, list)) and arch in names):
                    if cls == "AutoModel" and "vocab_size" not in (config or {}):
                        tag = "image-feature-extraction" if "image_size" in (config or {}) else None
                    return AutoClass(cls, tag, arch)
    return AutoClass("AutoModel", None, arch)


# the transformers Auto class of a base -> peft's ``task_type`` for an adapter of it (peft's TaskType names);
# ``AutoPeftModelFor<Task>.from_pretrained(adapter)`` needs it to know which class loads the base
PEFT_TASK_TYPES = {"AutoModelForCausalLM": "CAUSAL_LM", "AutoModelForSequenceClassification": "SEQ_CLS",
                   "AutoModelForTokenClassification": "TOKEN_CLS", "AutoModelForSeq2SeqLM": "SEQ_2_SEQ_LM",
                   "AutoModelForQuestionAnswering": "QUESTION_ANS", "AutoModel": "FEATURE_EXTRACTION"}


def peft_task_type(config: Mapping[str, Any] | None) -> str | None:
    """peft's ``task_type`` for a LoRA adapter of a model with ``config`` (None: peft names no task for it).

    Example:
        >>> peft_task_type({"architectures": ["LlamaForCausalLM"]})
        'CAUSAL_LM'
        >>> peft_task_type({"architectures": ["BertForSequenceClassification"]})
        'SEQ_CLS'
        >>> peft_task_type({"architectures": ["BertModel"], "vocab_size": 30522})
        'FEATURE_EXTRACTION'
        >>> peft_task_type({"architectures": ["BertForMaskedLM"]}) is None
        True
    """
    if not (config or {}).get("architectures"):
        return None
    return PEFT_TASK_TYPES.get(auto_class(config).name)
