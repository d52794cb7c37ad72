"""What a tensor is, from its name and shape: the roles the structure-aware methods need.

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

import re
from typing import Sequence

EMBEDDING_HINTS = ("embed", "wte", "wpe", "shared", "position", "token_type", "relative_attention_bias",
                   "class_embedding", "cls_token", "pos_emb")
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
