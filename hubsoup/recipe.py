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
from typing import Any, Sequence, cast

import yaml

from hubsoup import __version__
from hubsoup.errors import ParameterError
from hubsoup.methods import plugin_distributions
from hubsoup.options import MergeOptions
from hubsoup.public import looks_local, public_config_text, public_file_ref, public_value
from hubsoup.sources.checkpoint import InputRef
from hubsoup.untrusted import load_yaml, short

RECIPE_FILE = "hubsoup_recipe.yaml"
_EXTRA = ("options", "output", "continual", "mergekit", "plugins")
"""The recipe's entries under ``extra:`` (none of them in the hash but ``options``)."""


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
    plugins: dict[str, Any] = field(default_factory=dict)
    """The methods that come from installed packages (entry points), by name: ``{"distribution", "version"}`` of
    each (:func:`hubsoup.methods.plugin_distributions`; outside the hash). ``hubsoup run`` on a machine without
    the package names the one to install."""

    def __post_init__(self) -> None:
        self.base = _ref(self.base)
        self.inputs = [_ref(r) for r in self.inputs]

    def identity(self) -> dict[str, Any]:
        """What the hash covers: method, parameters, exact inputs (by SHA when on the Hub), dtype, options."""
        def pin(ref: InputRef) -> dict[str, Any]:
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
                                   ("continual", self.continual), ("mergekit", self.mergekit),
                                   ("plugins", self.plugins)) if v}
        d["extra"] = extra  # the file layout of hubsoup 0.1 (the hash is unchanged)
        d["hash"] = self.hash
        return d

    def to_yaml(self) -> str:
        return cast(str, yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True))  # no stream: the text

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
            d["extra"]["mergekit"] = {**d["extra"]["mergekit"], "config": public_config_text(self.mergekit["config"])}
        return d

    def public_yaml(self) -> str:
        return cast(str, yaml.safe_dump(self.public_dict(), sort_keys=False, allow_unicode=True))  # as to_yaml

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

    def verify(self, recorded: Any) -> None:
        """Refuse a recipe that does not say what it was: ``recorded`` (its ``hash:``) other than the hash of what it
        records, or an input whose ``spec`` and ``path`` (or ``repo_id``) name different things. One line naming the
        field. A public recipe's local inputs (a name and digest, no path) cannot be checked: nor can they be rerun.

        >>> r = Recipe("linear", {}, InputRef("org/base", "org/base", sha="1" * 40), [InputRef("org/a", "org/a")])
        >>> r.verify(r.hash)
        >>> r.verify("0" * 64)
        Traceback (most recent call last):
        ...
        hubsoup.errors.ParameterError: recipe: 'hash' is 000000000000..., but what the recipe records hashes to ...
        """
        for i, ref in enumerate([self.base, *self.inputs]):
            what = "base" if i == 0 else f"inputs[{i - 1}]"
            for where, r in ((what, ref), (f"{what}.adapter", ref.adapter)):
                if r is not None:
                    _check_ref(r, where)
        if recorded is None:  # written by hand: nothing recorded to check (the inputs still are, before a rerun)
            return
        if not isinstance(recorded, str):
            raise ParameterError(f"recipe: 'hash' must be the recipe's SHA-256, got {short(recorded)}")
        if any(not (r.repo_id or r.path) for r in (self.base, *self.inputs)):
            return  # a public recipe: its local inputs' paths were never published, so its hash cannot be recomputed
        if recorded != self.hash:
            raise ParameterError(f"recipe: 'hash' is {recorded[:12]}..., but what the recipe records hashes to "
                                 f"{self.hash[:12]}...: it was edited (a method, parameter, input or the hash); "
                                 "merge again instead of rerunning it")

    @classmethod
    def from_yaml(cls, text: str, *, verify: bool = True) -> "Recipe":
        """The recipe a ``hubsoup_recipe.yaml`` holds, checked (``verify``) by :meth:`verify`."""
        d = load_yaml(text, "recipe")
        if not isinstance(d, dict):
            raise ParameterError("a recipe is a YAML mapping (method, params, base, inputs, ...)")
        recorded = d.pop("hash", None)
        extra = d.pop("extra", None) or {}
        if not isinstance(extra, dict):
            raise ParameterError("recipe: 'extra' must be a mapping")
        unknown = sorted(set(extra) - set(_EXTRA))
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
        for k in _EXTRA:
            if not isinstance(extra.get(k) or {}, dict):
                raise ParameterError(f"recipe: 'extra.{k}' must be a mapping, got {short(extra[k])}")
        if not isinstance((extra.get("mergekit") or {}).get("config", ""), str):
            raise ParameterError("recipe: 'extra.mergekit.config' must be the config's YAML text")
        for name, rec in (extra.get("plugins") or {}).items():
            if not isinstance(rec, dict) or not all(isinstance(rec.get(k), str) for k in ("distribution", "version")):
                raise ParameterError(f"recipe: 'extra.plugins' entry {short(name)} must name a package: "
                                     f"{{distribution: NAME, version: VERSION}}, got {short(rec)}")
        extras: dict[str, Any] = {k: extra.get(k) or {} for k in _EXTRA}
        recipe = cls(**d, **extras)
        if verify:
            recipe.verify(recorded)
        return recipe


def _parts(path: str) -> list[str]:
    return [p for p in os.path.normpath(path).replace("\\", "/").split("/") if p not in ("", ".", "..")]


def _check_ref(ref: InputRef, what: str) -> None:
    """A recorded input's ``spec`` (as the user gave it) and where it was read (``repo_id``, ``path``) agree."""
    spec = ref.spec
    if not spec:
        return
    if ref.repo_id:
        repo_id, revision = (spec.rsplit("@", 1) + [None])[:2] if "@" in spec else (spec, None)
        if repo_id != ref.repo_id or (revision and ref.revision and revision != ref.revision):
            raise ParameterError(f"recipe: '{what}.spec' {short(spec)} and '{what}.repo_id' {short(ref.repo_id)}"
                                 + (f"@{short(ref.revision)}" if ref.revision else "") + " name different repos")
        if ref.path:
            raise ParameterError(f"recipe: '{what}' names both a Hub repo and a local path")
        return
    if not ref.path:
        return
    given, path = os.path.expanduser(spec), ref.path
    same = (os.path.normpath(given) == os.path.normpath(path)) if os.path.isabs(given) else (
        _parts(path)[-len(_parts(given)):] == _parts(given) if _parts(given) else True)
    if not same or not os.path.isabs(path):
        raise ParameterError(f"recipe: '{what}.spec' {short(spec)} and '{what}.path' {short(path)} name different "
                             "folders")


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
    """The publishable form (:meth:`Recipe.public_yaml`) of a local ``hubsoup_recipe.yaml``'s text (an edited one
    too: what is published never names a local path, whatever the recipe's hash says)."""
    return Recipe.from_yaml(text, verify=False).public_yaml()


def recipe_for(method: str, params: dict[str, Any], base: InputRef, inputs: Sequence[InputRef], *,
               dtype: str | None, options: MergeOptions | None = None, layout: Any = None,
               output: dict[str, Any] | None = None, continual: dict[str, Any] | None = None) -> Recipe:
    """The recipe of a merge: the one place that decides what its hash covers (:func:`hubsoup.merge`, the
    pipeline's prediction of a merge's name, continual merging's outputs all build it here).

    ``params``: the method's described parameters (:meth:`hubsoup.methods.Method.describe_params`);
    ``options``: the merge's options, of which those that change the result are hashed
    (:attr:`MergeOptions.hashed`; None for a continual soup, whose state holds them); ``layout``: a mergekit
    config's layout (its hashed options and its config text, outside the hash); ``output``: how the result is
    stored (a LoRA adapter's format, rank, energy; outside the hash); ``continual``: a continual soup's count and λ.
    A method from an installed package is recorded with the package's name and version (``plugins``, outside the
    hash).

    Example:
        >>> r = recipe_for("linear", {"weights": None}, InputRef("org/base", "org/base", sha="1" * 40),
        ...                [InputRef("org/a", "org/a", sha="2" * 40)], dtype=None)
        >>> len(r.hash), r.identity()["inputs"]
        (64, [{'repo_id': 'org/a', 'sha': '2222222222222222222222222222222222222222', 'kind': 'full'}])
    """
    hashed = {**(options.hashed if options is not None else {}), **(layout.hashed if layout is not None else {})}
    return Recipe(method=method, params=params, base=base, inputs=list(inputs), dtype=dtype,
                  hubsoup_version=__version__, options=hashed,
                  mergekit=layout.recipe_extra() if layout is not None else {},
                  output=output or {}, continual=continual or {}, plugins=plugin_distributions(method, params))


def _ref(r: InputRef | dict[str, Any]) -> InputRef:
    if isinstance(r, InputRef):
        return r
    if not isinstance(r, dict):
        raise ParameterError(f"recipe: an input must be a mapping (spec, repo_id, sha, path), got {short(r)}")
    return InputRef.from_dict(r)


