"""The recipe: everything that determines a merge, with a stable hash.

The CLI flags and the Python API both build a recipe; it is stored in the output's
safetensors metadata and as ``hubsoup_recipe.yaml`` beside the weights, and its
hash seeds every random choice (e.g. DARE's masks), so a rerun repeats exactly.
"""

from __future__ import annotations

import dataclasses

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from hubsoup.errors import ParameterError
from hubsoup.sources.access import scoped
from hubsoup.sources.checkpoint import InputRef
from hubsoup.untrusted import MAX_YAML_BYTES, load_yaml, short

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
    mergekit: dict[str, Any] = field(default_factory=dict)
    """A merge run from a mergekit config: ``{"config": its YAML text}`` (outside the hash; its effect,
    the layout and tokenizer source, is in ``options``). ``hubsoup run`` repeats it from the config."""

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
                                   ("continual", self.continual), ("mergekit", self.mergekit)) if v}
        d["extra"] = extra  # the file layout of hubsoup 0.1 (the hash is unchanged)
        d["hash"] = self.hash
        return d

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

    def public_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` as it may be published: nothing local.

        A local input (or base) is its folder name and content digest (:meth:`InputRef.public_dict`),
        never its path; a parameter that names a local file (LOT's exemplars) is the file's name and
        a hash of its content. The hash is the recipe's own (computed from the paths), so it still
        identifies the merge and seeds the same random choices. Used by the card, the safetensors
        metadata and the ``hubsoup_recipe.yaml`` that ``hubsoup push`` uploads; the local
        ``hubsoup_recipe.yaml`` keeps the paths, for ``hubsoup run``.
        """
        d = self.to_dict()
        d["base"] = self.base.public_dict()
        d["inputs"] = [i.public_dict() for i in self.inputs]
        d["params"] = public_value(self.params)
        d["extra"] = public_value(d["extra"])
        if self.mergekit.get("config"):  # its model references: local folders by name and digest
            from hubsoup.formats.mergekit import public_config_text

            d["extra"]["mergekit"] = {**d["extra"]["mergekit"], "config": public_config_text(self.mergekit["config"])}
        return d

    def public_yaml(self) -> str:
        return yaml.safe_dump(self.public_dict(), sort_keys=False, allow_unicode=True)

    def metadata(self) -> dict[str, str]:
        """The safetensors ``__metadata__`` of an output: the public recipe (no shard rewrite at push time)."""
        return {"hubsoup_recipe": json.dumps(self.public_dict(), default=str)}

    def local_paths(self) -> dict[str, str]:
        """Every local path this recipe names, mapped to what may be published instead of it."""
        out: dict[str, str] = {}
        for ref in (self.base, *self.inputs):
            if ref.repo_id:
                continue
            for p in (ref.path, ref.spec):
                if p and looks_local(p):
                    for form in {p, os.path.abspath(os.path.expanduser(p)), os.path.realpath(os.path.expanduser(p))}:
                        if form not in ("/", ".", ""):
                            out[form] = ref.public
        _collect_paths(self.params, out)
        return out

    @classmethod
    def from_yaml(cls, text: str) -> "Recipe":
        d = load_yaml(text, "recipe")
        if not isinstance(d, dict):
            raise ParameterError("a recipe is a YAML mapping (method, params, base, inputs, ...)")
        d.pop("hash", None)
        extra = d.pop("extra", None) or {}
        if not isinstance(extra, dict):
            raise ParameterError("recipe: 'extra' must be a mapping")
        unknown = sorted(set(extra) - {"options", "output", "continual", "mergekit"})
        if unknown:
            raise ParameterError(f"recipe: unknown entry 'extra.{unknown[0]}'")
        fields_ = {"method", "params", "base", "inputs", "dtype", "hubsoup_version"}
        unknown = sorted(set(d) - fields_)
        if unknown:
            raise ParameterError(f"recipe: unknown key '{unknown[0]}'")
        if not isinstance(d.get("params", {}), dict) or not isinstance(d.get("inputs"), list):
            raise ParameterError("recipe: 'params' must be a mapping and 'inputs' a list")
        for key in ("method", "base", "inputs"):
            if d.get(key) in (None, "", []):
                raise ParameterError(f"recipe: '{key}' is missing or empty")
        if not isinstance(d["method"], str):
            raise ParameterError(f"recipe: 'method' must be a method name, got {short(d['method'])}")
        bad = [k for k in d.get("params") or {} if not isinstance(k, str)]
        if bad:
            raise ParameterError(f"recipe: parameter names must be strings, got {short(bad[0])}")
        if d.get("dtype") is not None and not isinstance(d["dtype"], str):
            raise ParameterError(f"recipe: 'dtype' must be a dtype name (float32, float16, bfloat16), got {short(d['dtype'])}")
        if d.get("hubsoup_version") is not None:
            if not isinstance(d["hubsoup_version"], (str, int, float)):
                raise ParameterError(f"recipe: 'hubsoup_version' must be a version, got {short(d['hubsoup_version'])}")
            d["hubsoup_version"] = str(d["hubsoup_version"])
        for i, ref in enumerate([d["base"], *d["inputs"]]):
            what = "base" if i == 0 else f"inputs[{i - 1}]"
            if not isinstance(ref, dict):
                raise ParameterError(f"recipe: '{what}' must be a mapping (spec, repo_id, sha, path), got {short(ref)}")
            for k in ("spec", "repo_id", "revision", "sha", "path", "kind", "digest", "name"):
                if ref.get(k) is not None and not isinstance(ref[k], str):
                    raise ParameterError(f"recipe: '{what}.{k}' must be a string, got {short(ref[k])}")
        for k in ("options", "output", "continual", "mergekit"):
            if not isinstance(extra.get(k) or {}, dict):
                raise ParameterError(f"recipe: 'extra.{k}' must be a mapping, got {short(extra[k])}")
        if not isinstance((extra.get("mergekit") or {}).get("config", ""), str):
            raise ParameterError("recipe: 'extra.mergekit.config' must be the config's YAML text")
        return cls(**d, **{k: extra.get(k) or {} for k in ("options", "output", "continual", "mergekit")})


def looks_local(value: Any) -> bool:
    """Whether a string names a file or folder of this machine (not a Hub ID or a plain value)."""
    if not isinstance(value, str) or not value or "\n" in value:
        return False
    if value.startswith(("/", "~", "./", "../", "\\")) or re.match(r"^[A-Za-z]:[\\/]", value):
        return True
    return ("/" in value or os.sep in value) and os.path.exists(value)


def public_file_ref(path: str) -> str:
    """A local file or folder named without its path: ``name@sha256:<12 hex>`` of its content.

    A file is hashed whole; a folder by its files' relative names, sizes and first 64 KiB. A path
    that no longer exists keeps only its name (its path is never hashed: that could be guessed).
    """
    p = os.path.expanduser(path)
    name = os.path.basename(os.path.normpath(p)) or "local"
    h = hashlib.sha256()
    if os.path.isfile(p):
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    elif os.path.isdir(p):
        for root, dirs, files in os.walk(p):
            dirs.sort()
            for fn in sorted(files):
                fp = os.path.join(root, fn)
                h.update(f"{os.path.relpath(fp, p)}\0{os.path.getsize(fp)}\0".encode())
                with open(fp, "rb") as f:
                    h.update(f.read(64 * 1024))
    else:
        return f"{name}@local"
    return f"{name}@sha256:{h.hexdigest()[:12]}"


def public_value(value: Any) -> Any:
    """``value`` with every string that names a local file replaced by :func:`public_file_ref` (also ``KEY=PATH``)."""
    if isinstance(value, dict):
        return {k: public_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [public_value(v) for v in value]
    if isinstance(value, str):
        if looks_local(value):
            return public_file_ref(value)
        key, sep, rest = value.partition("=")
        if sep and looks_local(rest):
            return f"{key}={public_file_ref(rest)}"
    return value


def _collect_paths(value: Any, out: dict[str, str]) -> None:
    if isinstance(value, dict):
        for v in value.values():
            _collect_paths(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect_paths(v, out)
    elif isinstance(value, str):
        path = value if looks_local(value) else value.partition("=")[2]
        if looks_local(path):
            public = public_file_ref(path)
            for form in {path, os.path.abspath(os.path.expanduser(path))}:
                if form not in ("/", ".", ""):
                    out[form] = public


def public_recipe_yaml(text: str) -> str:
    """The publishable form (:meth:`Recipe.public_yaml`) of a local ``hubsoup_recipe.yaml``'s text."""
    return Recipe.from_yaml(text).public_yaml()


def _ref(r: InputRef | dict) -> InputRef:
    if isinstance(r, InputRef):
        return r
    if not isinstance(r, dict):
        raise ParameterError(f"recipe: an input must be a mapping (spec, repo_id, sha, path), got {short(r)}")
    return InputRef.from_dict(r)


def recipe_merge_args(recipe) -> tuple[list[str], dict[str, Any]]:
    """The ``hubsoup.merge`` arguments that repeat ``recipe`` exactly (Hub inputs pinned to their SHAs)."""
    kwargs: dict[str, Any] = {"method": recipe.method, "base": recipe.base.pinned_spec,
                              "params": dict(recipe.params), "dtype": recipe.dtype}
    for k, v in recipe.options.items():  # only the options that change the result are in a recipe
        if k not in ("shape_mismatch", "ignore_extra"):
            raise ParameterError(f"recipe: option '{k}' cannot come from a recipe")
        if k == "ignore_extra" and not isinstance(v, bool):
            raise ParameterError(f"recipe: option 'ignore_extra' must be true or false, got {short(v)}")
        kwargs[k] = v
    if recipe.output.get("format") not in (None, "full", "lora"):
        raise ParameterError(f"recipe: output format must be full or lora, got {short(recipe.output['format'])}")
    if recipe.output.get("format") == "lora":
        kwargs.update(output_format="lora", rank=recipe.output.get("rank"), energy=recipe.output.get("energy"))
    return [i.pinned_spec for i in recipe.inputs], kwargs


@scoped
def run_recipe(path: str, out: str, **overrides: Any):
    """Merge again from a recipe file (or an output folder holding one); returns the MergeResult.

    ``path`` may also be a mergekit YAML config (a file with ``merge_method``, or a folder holding
    ``mergekit_config.yml``): it is merged with mergekit's semantics
    (:func:`hubsoup.formats.mergekit.run_config`; model folders relative to the working folder), or a
    stream of them (mergekit-multi's stages, :func:`hubsoup.formats.stages.run_stages`).
    With ``hub_only=True``, ``path`` is the recipe's (or config's) YAML *text*, never a path, and every
    model it names must be a Hub repo ID. mergekit-yaml's options (``copy_tokenizer``, ``random_seed``,
    ``out_shard_params``, ``intermediate_dir``) apply to mergekit configs only.
    """
    from hubsoup.formats import mergekit, stages
    from hubsoup.sources.access import check_specs, hub_only

    mk = {k: overrides.pop(k) for k in ("copy_tokenizer", "random_seed", "out_shard_params", "intermediate_dir")
          if k in overrides}
    mk = {k: v for k, v in mk.items() if v is not None and not (k == "copy_tokenizer" and v is True)}
    if hub_only():  # a server's run: the text itself; nothing on the disk is read or probed
        if not isinstance(path, str):
            raise ParameterError("recipe: with hub_only, give the recipe's YAML text")
        text, where = path, "recipe"
    else:
        if os.path.isdir(path):
            if not os.path.isfile(os.path.join(path, RECIPE_FILE)) and os.path.isfile(os.path.join(path, mergekit.CONFIG_FILE)):
                path = os.path.join(path, mergekit.CONFIG_FILE)
            else:
                path = os.path.join(path, RECIPE_FILE)
        if not os.path.isfile(path):
            raise ParameterError(f"recipe '{path}' not found")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read(MAX_YAML_BYTES + 1)
        except OSError as e:
            raise ParameterError(f"recipe '{path}' cannot be read: {type(e).__name__}") from e
        where = f"recipe '{path}'"
    if stages.is_multi_stage(text):  # mergekit-multi's stream of configs
        return stages.run_stages(text, out, **mk, **overrides)
    mk.pop("intermediate_dir", None)
    data = load_yaml(text, where)
    if mergekit.is_mergekit_config(data):
        return mergekit.run_config(text, out, **mk, **overrides)
    try:
        recipe = Recipe.from_yaml(text)
    except ParameterError:
        raise
    except Exception as e:  # noqa: BLE001 - a malformed file gets one clear line
        raise ParameterError(f"{where} cannot be read: {short(str(e))}") from e
    if hub_only():
        check_specs(inputs=[r.pinned_spec for r in recipe.inputs], base=recipe.base.pinned_spec)
    if mk and not recipe.mergekit.get("config"):
        raise ParameterError(f"{', '.join(sorted(mk))}: mergekit-yaml's options apply to mergekit configs; "
                             f"{where} is a hubsoup recipe")
    return _rerun(recipe, out, overrides, mk)


def _rerun(recipe: "Recipe", out: str, overrides: dict[str, Any], mk: dict[str, Any] | None = None):
    from hubsoup.api import merge
    from hubsoup.formats import mergekit

    if recipe.mergekit.get("config"):  # repeat the mergekit config, its Hub models pinned to the recorded SHAs
        refs = [*(recipe.base, *recipe.inputs), *(r.adapter for r in (recipe.base, *recipe.inputs) if r.adapter)]
        pins = {r.spec: dataclasses.replace(r, adapter=None).pinned_spec for r in refs if r.spec and r.repo_id}
        result = mergekit.run_config(recipe.mergekit["config"], out, pins=pins, **(mk or {}), **overrides)
    else:
        inputs, kwargs = recipe_merge_args(recipe)
        result = merge(inputs, out=out, **{**kwargs, **overrides})
    if result.recipe.hash != recipe.hash:
        import logging

        logging.getLogger(__name__).warning("recipe hash changed (%s -> %s): an input or parameter differs",
                                            recipe.hash[:12], result.recipe.hash[:12])
    return result
