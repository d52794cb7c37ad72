"""The recipe: everything that determines a merge, with a stable hash.

The CLI flags and the Python API both build a recipe; it is stored in the output's
safetensors metadata and as ``hubsoup_recipe.yaml`` beside the weights, and its
hash seeds every random choice (e.g. DARE's masks), so a rerun repeats exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from hubsoup.errors import ParameterError
from hubsoup.sources.checkpoint import InputRef

RECIPE_FILE = "hubsoup_recipe.yaml"


@dataclass
class Recipe:
    """Everything that determines a merge: method, parameters, exact inputs, dtype, result-changing options.

    ``base`` and ``inputs`` are :class:`~hubsoup.sources.InputRef` (Hub inputs pinned to their
    commit SHA). ``options`` holds the options that change *what* is merged (``shape_mismatch``,
    ``ignore_extra``; inside the hash); ``output`` how the result is stored (``format: lora``,
    ``rank``, ``energy``; outside the hash: it does not change τ); ``continual`` the count and λ
    of a continual soup.
    """

    method: str
    params: dict[str, Any]
    base: InputRef
    inputs: list[InputRef]
    dtype: str | None = None
    hubsoup_version: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    output: dict[str, Any] = field(default_factory=dict)
    continual: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.base = _ref(self.base)
        self.inputs = [_ref(r) for r in self.inputs]

    def identity(self) -> dict[str, Any]:
        """What the hash covers: method, parameters, exact inputs (by SHA when on the Hub), dtype, options."""
        def pin(ref: InputRef) -> dict:
            d = ref.to_dict()
            return {k: d.get(k) for k in ("repo_id", "sha", "path", "kind") if d.get(k) is not None}
        ident = {"method": self.method, "params": self.params, "base": pin(self.base),
                 "inputs": [pin(i) for i in self.inputs], "dtype": self.dtype}
        if self.options:
            ident["options"] = self.options
        return ident

    @property
    def hash(self) -> str:
        blob = json.dumps(self.identity(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        d = {"method": self.method, "params": self.params, "base": self.base.to_dict(),
             "inputs": [i.to_dict() for i in self.inputs], "dtype": self.dtype,
             "hubsoup_version": self.hubsoup_version}
        extra = {k: v for k, v in (("options", self.options), ("output", self.output),
                                   ("continual", self.continual)) if v}
        d["extra"] = extra  # the file layout of hubsoup 0.1 (the hash is unchanged)
        d["hash"] = self.hash
        return d

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

    @classmethod
    def from_yaml(cls, text: str) -> "Recipe":
        d = yaml.safe_load(text)
        if not isinstance(d, dict):
            raise ParameterError("a recipe is a YAML mapping (method, params, base, inputs, ...)")
        d.pop("hash", None)
        extra = d.pop("extra", None) or {}
        if not isinstance(extra, dict):
            raise ParameterError("recipe: 'extra' must be a mapping")
        unknown = sorted(set(extra) - {"options", "output", "continual"})
        if unknown:
            raise ParameterError(f"recipe: unknown entry 'extra.{unknown[0]}'")
        fields_ = {"method", "params", "base", "inputs", "dtype", "hubsoup_version"}
        unknown = sorted(set(d) - fields_)
        if unknown:
            raise ParameterError(f"recipe: unknown key '{unknown[0]}'")
        if not isinstance(d.get("params", {}), dict) or not isinstance(d.get("inputs"), list):
            raise ParameterError("recipe: 'params' must be a mapping and 'inputs' a list")
        return cls(**d, **{k: extra.get(k) or {} for k in ("options", "output", "continual")})


def _ref(r: InputRef | dict) -> InputRef:
    if isinstance(r, InputRef):
        return r
    if not isinstance(r, dict):
        raise ParameterError(f"recipe: an input must be a mapping (spec, repo_id, sha, path), got {r!r}")
    return InputRef.from_dict(r)


def recipe_merge_args(recipe) -> tuple[list[str], dict[str, Any]]:
    """The ``hubsoup.merge`` arguments that repeat ``recipe`` exactly (Hub inputs pinned to their SHAs)."""
    kwargs: dict[str, Any] = {"method": recipe.method, "base": recipe.base.pinned_spec,
                              "params": dict(recipe.params), "dtype": recipe.dtype}
    for k, v in recipe.options.items():  # only the options that change the result are in a recipe
        if k not in ("shape_mismatch", "ignore_extra"):
            raise ParameterError(f"recipe: option '{k}' cannot come from a recipe")
        kwargs[k] = v
    if recipe.output.get("format") == "lora":
        kwargs.update(output_format="lora", rank=recipe.output.get("rank"), energy=recipe.output.get("energy"))
    return [i.pinned_spec for i in recipe.inputs], kwargs


def run_recipe(path: str, out: str, **overrides: Any):
    """Merge again from a recipe file (or an output folder holding one); returns the MergeResult."""
    from hubsoup.api import merge
    if os.path.isdir(path):
        path = os.path.join(path, RECIPE_FILE)
    if not os.path.isfile(path):
        raise ParameterError(f"recipe '{path}' not found")
    try:
        with open(path, encoding="utf-8") as f:
            recipe = Recipe.from_yaml(f.read())
    except Exception as e:  # noqa: BLE001 - a malformed file gets one clear line
        raise ParameterError(f"recipe '{path}' cannot be read: {e}") from e
    inputs, kwargs = recipe_merge_args(recipe)
    result = merge(inputs, out=out, **{**kwargs, **overrides})
    if result.recipe.hash != recipe.hash:
        import logging

        logging.getLogger(__name__).warning("recipe hash changed (%s -> %s): an input or parameter differs",
                                            recipe.hash[:12], result.recipe.hash[:12])
    return result
