"""A mergekit config's keys, model references and parameter maps, read as mergekit's config classes read them.

The shared vocabulary of the reader (:mod:`~hubsoup.formats.mergekit.read`), the ``modules:`` configs
(:mod:`~hubsoup.formats.mergekit.modules`) and the exporter: the keys mergekit knows (:data:`TOP_KEYS`), its dtype
names (:data:`DTYPES`), a key's path as a message names it (:func:`key_path`), and the checks every section goes
through (:func:`check_keys`, :func:`model_ref`, :func:`params_map`). A config's text is written back by
:func:`hubsoup.public.dump_config`.

Example:
    >>> key_path(["slices", 0, "sources", 1, "layer_range"])
    'slices[0].sources[1].layer_range'
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from hubsoup.errors import ParameterError
from hubsoup.public import map_models
from hubsoup.sources.access import hub_only, require_hub_id
from hubsoup.untrusted import short

CONFIG_FILE = "mergekit_config.yml"
"""The name mergekit gives the config it writes beside a merge."""

TOP_KEYS = {"merge_method", "base_model", "models", "slices", "parameters", "dtype", "out_dtype",
            "tokenizer_source", "tokenizer", "chat_template", "modules"}

UNSUPPORTED_TOP: dict[str, str] = {}

IGNORED_SLICE_KEYS = {"residual_weight": "mergekit 0.1.5 reads it but never uses it"}

DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32", "float16": "float16",
          "fp16": "float16", "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}


@dataclass
class Source:
    """One source of a slice: a model reference and its layer range (None: every layer)."""

    model: str
    layer_range: tuple[int, int] | None
    parameters: dict[str, Any]


@dataclass
class Slice:
    sources: list[Source]
    parameters: dict[str, Any]


def is_mergekit_config(data: Any) -> bool:
    """Whether a parsed YAML document is a mergekit config (it has ``merge_method``), not a hubsoup recipe."""
    return isinstance(data, dict) and "merge_method" in data


def load_text(path: str) -> str:
    """A config file's text (an output folder: its ``mergekit_config.yml``)."""
    if os.path.isdir(path):
        path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ParameterError(f"mergekit config '{path}' not found")
    with open(path, encoding="utf-8") as f:
        return f.read()


def key_path(path: list[Any]) -> str:
    """A key's place in the config as messages name it (``slices[0].sources[1]``)."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def check_keys(d: Any, allowed: set[str], where: list[Any], dropped: list[str],
               unsupported: dict[str, str] | None = None) -> dict[str, Any]:
    """``d`` as a mapping; a key mergekit does not know is dropped (mergekit's config classes drop it too) and
    recorded in ``dropped`` for the warning; a key mergekit uses and hubsoup cannot reproduce is refused."""
    if not isinstance(d, dict):
        raise ParameterError(f"mergekit config: '{key_path(where)}' must be a mapping, got {short(d)}")
    for k in d:
        if unsupported and k in unsupported:
            raise ParameterError(f"mergekit config: key '{key_path(where + [k])}' is not supported: {unsupported[k]}")
        if k not in allowed:
            dropped.append(key_path(where + [k]))
    return {k: v for k, v in d.items() if k in allowed}


def model_ref(value: object, where: list[Any]) -> str:
    """The model reference at ``where`` (``org/name[@revision]``, a folder, ``model+adapter``), stripped."""
    if not isinstance(value, str) or not value.strip():
        raise ParameterError(f"mergekit config: '{key_path(where)}' must be a model reference (org/name[@revision] "
                             f"or a folder), got {short(value)}")
    value = value.strip()
    if value.count("@") > 1 or value.count("+") > 1:
        raise ParameterError(f"mergekit config: '{key_path(where)}' = {short(value)} is not a model reference")
    return value


def params_map(d: Any, where: list[Any]) -> dict[str, Any]:
    """The ``parameters`` mapping at ``where`` (none: ``{}``), its keys parameter names."""
    if d is None:
        return {}
    if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
        raise ParameterError(f"mergekit config: '{key_path(where)}' must be a mapping of parameter names, got {short(d)}")
    return d


def check_hub_only(data: Any) -> None:
    """In a ``hub_only`` run, refuse a parsed config naming any model (a LoRA's too) that is not a Hub repo ID."""

    if not hub_only():
        return

    def check(ref: Any) -> Any:
        if isinstance(ref, str):
            for part in ref.strip().split("+"):
                require_hub_id(part, "mergekit config: model")
        return ref

    map_models(data, check)
