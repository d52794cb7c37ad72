"""mergekit ``modules:`` configs: a multimodal model merged module by module, as mergekit 0.1.5 does.

mergekit defines some architectures by modules (its ``_data/architectures/*.json`` of kind
``modular``: a vision-language model's ``text_decoder``, ``vision_tower`` and
``multi_modal_projector``; an encoder-decoder's ``encoder`` and ``decoder``, T5's ``shared``), and a
config may give each module its own ``models`` or ``slices`` and ``parameters``::

    merge_method: slerp
    base_model: org/vlm-base
    modules:
      text_decoder:
        slices: [...]                 # its own frankenmerge, gradients over its own layers
        parameters: {t: [0, 1]}
      vision_tower:
        models: [{model: org/vlm-base}, {model: org/vlm-ft}]

hubsoup runs each module as the single-module config it is (:func:`module_config`: the module's
``models``/``slices``; its ``parameters`` between a slice's and the top level's, mergekit's
precedence), restricted to that module's tensors (:class:`Module`), through the one engine
(:func:`hubsoup.merge` with a :class:`~hubsoup.formats.mergekit.MergekitLayout`); the modules'
outputs are then assembled into one folder (their shards renamed, one index; no tensor is read
again) and committed at once. As mergekit: a module given as ``slices`` writes its layer count to
its config key (``text_config.num_hidden_layers``); tensors of no module are not written (a
warning names them); the base model (else the first model named) gives the config and tokenizer.

A module holds the tensors mergekit's definition lists (:data:`ARCHITECTURES`, with mergekit
0.1.5's lists in ``modules.json``, written by ``tests/tools/make_mergekit_module_table.py``;
T5's ``shared`` module is ``shared.weight`` and ``lm_head.weight``): a checkpoint tensor under a
module's prefix that the list lacks is not written (one warning names it), as with mergekit. Each
model of a module's merge is seen as that module's tensors only, a tied tensor it does not store read
from its tie source (T5's ``encoder.embed_tokens.weight`` from ``shared.weight``) when some model of
the merge stores it. A plain config over such a model (``models:``) is the ``modules:`` config
mergekit reads it as (:func:`plain_as_modules`), and a merged vocabulary (``tokenizer_source`` /
``tokenizer``) is built once over every module's models, each module's embedding and head rows
re-mapped to it.

Example:
    >>> from hubsoup.formats.mergekit.modules import ARCHITECTURES, module_config
    >>> ARCHITECTURES["Mistral3ForConditionalGeneration"]["vision_tower"].holds("vision_tower.ln_pre.weight")
    True
    >>> cfg = module_config({"merge_method": "linear", "parameters": {"weight": 1.0},
    ...                      "modules": {"text_decoder": {"models": [{"model": "a"}, {"model": "b"}]},
    ...                                  "vision_tower": {"models": [{"model": "a"}],
    ...                                                   "parameters": {"weight": 0.5}}}}, "vision_tower", [])
    >>> cfg["models"], cfg["parameters"]
    ([{'model': 'a'}], {'weight': [{'value': 0.5}, {'value': 1.0}]})
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

from hubsoup.errors import HubsoupError, ParameterError
from hubsoup.formats.mergekit.config import check_keys, model_ref, params_map
from hubsoup.output.folder import OutputFolder
from hubsoup.public import dump_config
from hubsoup.recipe import RECIPE_FILE
from hubsoup.sources.resolve import open_input
from hubsoup.untrusted import owned_path

if TYPE_CHECKING:
    from hubsoup.hubclient import Token
    from hubsoup.recipe import Recipe
    from hubsoup.sources.checkpoint import Checkpoint, InputRef

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Weight:
    """One tensor mergekit's definition of a module lists (``${layer_index}`` in a layer's name)."""

    name: str
    vocab: bool = False
    """Indexed by token (``vocabulary_axis``): re-mapped by a merged vocabulary."""
    optional: bool = False
    """Written only when some merged model stores it (or one of its ``aliases``)."""
    sources: tuple[str, ...] = ()
    """Where a model that does not store it reads it from, in order (mergekit's ``aliases``, then ``tied_names``)."""
    stored_as: tuple[str, ...] = ()
    """Names that count as storing it for an optional weight (its ``aliases``; not its tie sources)."""
    part: str = "layer"
    """``pre`` (before the layers: the first slice's models merge it), ``layer`` or ``post`` (the last slice's)."""


@dataclass(frozen=True)
class Module:
    """One module of a modular architecture: its tensors and its layer count's config key.

    ``weights`` (mergekit's list, :data:`_TABLE`) decide which tensors it holds; ``prefixes`` and
    ``excludes`` say where they lie (a tensor under a prefix that the list lacks is one mergekit drops).
    """

    prefixes: tuple[str, ...]
    excludes: tuple[str, ...] = ()
    layers_key: str | None = None
    """Dotted config key of the module's layer count (``text_config.num_hidden_layers``); None: no layers."""
    before: tuple[str, ...] = ()
    """Prefixes of tensors before the layers (mergekit's ``pre_weights``, taken from the first slice) that
    their names do not tell (Whisper's ``conv1``)."""
    weights: tuple[Weight, ...] = ()
    """mergekit 0.1.5's list of the module's tensors (empty: every tensor under the prefixes)."""
    vocab_key: str = "vocab_size"
    """Dotted ``config.json`` key of the model's vocabulary size (mergekit's ``vocab_size_config_key``)."""

    @functools.cached_property
    def _pattern(self) -> re.Pattern[str] | None:
        if not self.weights:
            return None
        return re.compile("|".join(re.escape(w.name).replace(re.escape("${layer_index}"), r"\d+")
                                   for w in self.weights))

    def under(self, name: str) -> bool:
        """Whether tensor ``name`` lies under this module's prefixes (listed by mergekit or not)."""
        return name.startswith(self.prefixes) and not name.startswith(self.excludes)

    def holds(self, name: str) -> bool:
        """Whether tensor ``name`` belongs to this module: under its prefixes and in mergekit's list."""
        return self.under(name) and (self._pattern is None or self._pattern.fullmatch(name) is not None)

    @property
    def vocab(self) -> frozenset[str]:
        """The module's tensors indexed by token (re-mapped by a merged vocabulary)."""
        return frozenset(w.name for w in self.weights if w.vocab)

    @property
    def tied(self) -> tuple[Weight, ...]:
        """The module's tensors a model may not store, read from a tie source instead (T5's embeddings, a head)."""
        return tuple(w for w in self.weights if w.sources and "${" not in w.name)


_QWEN_VL = {"vision_tower": Module(("visual.",), ("visual.merger.",), "vision_config.depth"),
            "multi_modal_projector": Module(("visual.merger.",))}
_QWEN3_VL = {"text_decoder": Module(("model.language_model.", "lm_head."), (), "text_config.num_hidden_layers"),
             "vision_tower": Module(("model.visual.",), ("model.visual.merger.", "model.visual.deepstack_merger_list."),
                                    "vision_config.depth"),
             "multi_modal_projector": Module(("model.visual.merger.", "model.visual.deepstack_merger_list."))}

ARCHITECTURES: dict[str, dict[str, Module]] = {
    "Mistral3ForConditionalGeneration": {
        "text_decoder": Module(("language_model.",), (), "text_config.num_hidden_layers"),
        "multi_modal_projector": Module(("multi_modal_projector.",)),
        "vision_tower": Module(("vision_tower.",), (), "vision_config.num_hidden_layers")},
    "Gemma3ForConditionalGeneration": {
        "text_decoder": Module(("language_model.",), (), "text_config.num_hidden_layers"),
        "multi_modal_projector": Module(("multi_modal_projector.",)),
        "vision_tower": Module(("vision_tower.vision_model.",), (), "vision_config.num_hidden_layers")},
    "Llama4ForConditionalGeneration": {
        "text_decoder": Module(("language_model.",), (), "text_config.num_hidden_layers"),
        "multi_modal_projector": Module(("multi_modal_projector.",)),
        "vision_model": Module(("vision_model.",), (), "vision_config.num_hidden_layers")},
    "Qwen2VLForConditionalGeneration": {
        "text_decoder": Module(("model.", "lm_head."), (), "num_hidden_layers"), **_QWEN_VL},
    "Qwen2_5_VLForConditionalGeneration": {
        "text_decoder": Module(("model.", "lm_head."), (), "text_config.num_hidden_layers"), **_QWEN_VL},
    "Qwen3VLForConditionalGeneration": _QWEN3_VL,
    "Qwen3VLMoeForConditionalGeneration": _QWEN3_VL,
    # mergekit's encoder key is num_hidden_layers, which T5Config maps to num_layers (the key config.json holds)
    "T5ForConditionalGeneration": {
        "decoder": Module(("decoder.",), (), "num_decoder_layers"),
        "encoder": Module(("encoder.",), (), "num_layers"),
        "shared": Module(("shared.", "lm_head."))},
    "WhisperForConditionalGeneration": {
        "decoder": Module(("model.decoder.",), (), "decoder_layers"),
        "encoder": Module(("model.encoder.",), (), "encoder_layers",
                          ("model.encoder.conv1.", "model.encoder.conv2.", "model.encoder.embed_positions."))},
}
"""mergekit 0.1.5's modular architectures (``kind: modular``) that hubsoup merges module by module."""

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "modules.json"), encoding="utf-8") as _f:
    _TABLE: dict[str, Any] = json.load(_f)["architectures"]
"""mergekit 0.1.5's lists of each module's tensors (``tests/tools/make_mergekit_module_table.py`` writes them)."""


def _listed(arch: str, name: str) -> tuple[Weight, ...]:
    return tuple(Weight(w["name"], w.get("vocabulary_axis") is not None, bool(w.get("optional")),
                        tuple(w.get("aliases") or ()) + tuple(w.get("tied_names") or ()), tuple(w.get("aliases") or ()),
                        w["part"])
                 for w in _TABLE[arch]["modules"][name]["weights"])


ARCHITECTURES = {arch: {name: dataclasses.replace(mod, weights=_listed(arch, name),
                                                  vocab_key=_TABLE[arch].get("vocab_size_config_key") or "vocab_size")
                         for name, mod in mods.items()}
                 for arch, mods in ARCHITECTURES.items()}

_MERGEKIT_FAILS = {
    ("WhisperForConditionalGeneration", "decoder"):
        "mergekit 0.1.5 cannot merge it: its definition's weight prefix 'model.decoder' lacks the dot, so it asks "
        "every model for 'model.decoderembed_tokens.weight' and stops",
}
"""Modules that mergekit 0.1.5 defines but fails on for every checkpoint: refused here before anything is read."""


def several_modules(data: Any) -> bool:
    """Whether a parsed config merges a model module by module (``modules:`` other than a lone ``default``)."""
    mods = data.get("modules") if isinstance(data, dict) else None
    return isinstance(mods, dict) and bool(mods) and set(mods) != {"default"}


def plain_as_modules(data: Any, token: Token = None, allow_pickle: bool = False) -> dict[str, Any] | None:
    """A plain config (``models:`` or ``slices:``) over a model mergekit defines by several modules (T5,
    Whisper, a vision-language model) as the ``modules:`` config mergekit reads it as (its
    ``normalize_config``): every module merged with the same ``models``, each of mergekit's listed tensors
    only; ``slices`` are refused, as mergekit refuses them. None: the model is not one of those.

    Example:
        >>> plain_as_modules({"merge_method": "linear", "modules": {"default": {}}}) is None
        True
    """
    if not isinstance(data, dict) or data.get("modules") is not None:
        return None
    ref = data.get("base_model")
    try:
        if ref is None:
            first = data["models"][0] if data.get("models") else data["slices"][0]["sources"][0]
            ref = first.get("model")
        ckpt = open_input(str(ref).strip().split("+")[0], allow_pickle=allow_pickle, token=token, headers_only=True)
    except (AttributeError, KeyError, IndexError, TypeError, HubsoupError):
        return None  # the config's own checks name what is wrong
    archs = ckpt.config.get("architectures") or []
    mods = ARCHITECTURES.get(archs[0]) if isinstance(archs, list) and len(archs) == 1 else None
    if mods is None or len(mods) < 2:
        return None
    if data.get("slices") is not None:
        raise ParameterError(f"mergekit config: 'slices' over '{ref}', a {archs[0]}: mergekit merges it by modules "
                             f"({', '.join(mods)}) and refuses slices at the top level (\"Model has multiple modules, "
                             "must use modules: config syntax to work with slices\"); give 'modules:' with each "
                             "module's slices")
    log.info("mergekit config: '%s' is a %s, which mergekit merges module by module (%s): each with the config's "
             "models", ref, archs[0], ", ".join(mods))
    out = {k: v for k, v in data.items() if k != "models"}
    out["modules"] = {name: {"models": data.get("models")} for name in mods}
    return out


def module_config(data: dict[str, Any], name: str, dropped: list[str]) -> dict[str, Any]:
    """The single-module config of module ``name``: its ``models``/``slices`` at the top level, its
    ``parameters`` before the top level's (each parameter's module entries first: mergekit's precedence)."""
    mods: Any = data.get("modules")  # parsed YAML
    if data.get("models") is not None or data.get("slices") is not None:
        raise ParameterError("mergekit config: give exactly one of 'models', 'slices' and 'modules'")
    mod = check_keys(mods[name], {"slices", "models", "parameters"}, ["modules", name], dropped)
    if (mod.get("models") is None) == (mod.get("slices") is None):
        raise ParameterError(f"mergekit config: module '{name}': give exactly one of 'models' and 'slices'")
    out = {k: v for k, v in data.items() if k != "modules"}
    for k in ("slices", "models"):
        if mod.get(k) is not None:
            out[k] = mod[k]
    top = dict(params_map(data.get("parameters"), ["parameters"]))
    for k, v in params_map(mod.get("parameters"), ["modules", name, "parameters"]).items():
        if k in top:
            top[k] = _as_entries(v) + _as_entries(top[k])
        else:
            top[k] = v
    if top:
        out["parameters"] = top
    else:
        out.pop("parameters", None)
    return out


def _as_entries(v: Any) -> list[Any]:
    if isinstance(v, list) and v and all(isinstance(e, dict) for e in v):
        return list(v)
    return [v] if isinstance(v, dict) else [{"value": v}]


def architecture_modules(data: dict[str, Any], token: Token = None,
                         allow_pickle: bool = False) -> tuple[dict[str, Module], Checkpoint]:
    """The modules of the architecture the config merges (from its base model, else its first model's config)
    and that model's opened checkpoint (headers only); refuses a module the architecture does not have."""
    ref = data.get("base_model")
    if ref is None:  # mergekit: the first model the config names gives the output's config
        try:
            first = next(iter(data["modules"].values()))
            entry = first["models"][0] if first.get("models") else first["slices"][0]["sources"][0]
            ref = entry.get("model")
        except (AttributeError, KeyError, IndexError, TypeError):
            ref = None
    ref = model_ref(ref, ["base_model"])
    ckpt = open_input(ref.split("+")[0], allow_pickle=allow_pickle, token=token, headers_only=True)
    archs = ckpt.config.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else None
    mods = ARCHITECTURES.get(arch)  # type: ignore[arg-type]
    names = list(data["modules"])
    if mods is None:
        raise ParameterError(f"mergekit config: 'modules' ({', '.join(map(str, names))[:80]}): '{ref}' is a "
                             f"{arch or 'model of no single architecture'}, which mergekit does not define by "
                             f"modules (modular: {', '.join(sorted(ARCHITECTURES))})")
    unknown = [n for n in names if n not in mods]
    if unknown:
        raise ParameterError(f"mergekit config: module '{str(unknown[0])[:80]}' is not one of {arch}'s modules "
                             f"({', '.join(mods)})")
    for n in names:
        why = _MERGEKIT_FAILS.get((str(arch), str(n)))
        if why:
            raise ParameterError(f"mergekit config: module '{n}' of {arch}: {why}; leave the module out (a "
                                 "'models:' list at the top level merges every module, this one too, and fails alike)")
    return mods, ckpt


class ModuleResult(Protocol):
    """What :func:`run_modules` reads and sets of a module's merge result (a :class:`hubsoup.MergeResult`)."""

    path: str
    recipe: Recipe
    inputs: list[InputRef]
    notes: list[str]
    restricted: list[dict[str, str]]

    def write_card(self, folder: str) -> object: ...


R = TypeVar("R", bound=ModuleResult)


def run_modules(text: str, data: dict[str, Any], out: str, run_module: Callable[[str, Module, str, list[str]], R], *,
                overwrite: bool = False, token: Token = None, allow_pickle: bool = False) -> R:
    """Merge every module of a ``modules:`` config and assemble one output; returns the first module's
    :class:`hubsoup.MergeResult`, pointing at the assembled output.

    ``run_module(text, module, out, referenced)`` merges one module's config (:func:`module_config`, as
    YAML) restricted to ``module``'s tensors into the folder ``out``; ``referenced``: every model the
    whole config names (a merged vocabulary is built over them all, as mergekit builds it).
    """
    mods, base = architecture_modules(data, token=token, allow_pickle=allow_pickle)
    dropped: list[str] = []
    configs = {name: module_config(data, name, dropped) for name in data["modules"]}
    for key in dropped:
        log.warning("mergekit config: '%s' is ignored (mergekit ignores it too)", key)
    # a merged vocabulary: one, over every module's models (mergekit's referenced_models), each module's
    # embedding and head rows re-mapped to it; every module's merge builds the same, the first's is written
    referenced = _referenced(data)
    used = [mods[n] for n in configs]
    outside = [k for k in base.keys() if not any(m.holds(k) for m in used)]
    unlisted = {k: n for k in outside for n in configs if mods[n].under(k)}
    if unlisted:  # mergekit plans the tensors its definition lists, one by one: the others are not written
        log.warning("mergekit config: %d tensor(s) of '%s' lie in a module but are not in mergekit 0.1.5's list of "
                    "its tensors, and are not written, as with mergekit: %s", len(unlisted), base.label,
                    ", ".join(f"{k} ({n})" for k, n in list(unlisted.items())[:5]) + (", ..." if len(unlisted) > 5 else ""))
    outside = [k for k in outside if k not in unlisted]
    if outside:  # mergekit plans only the modules' tensors: the rest is not in its output either
        log.warning("mergekit config: %d tensor(s) of '%s' belong to no merged module and are not written, as "
                    "with mergekit (e.g. %s)", len(outside), base.label, ", ".join(outside[:3]))
    folder = OutputFolder(out, overwrite=overwrite)
    try:
        parts: list[tuple[str, str]] = []
        results = []
        for name, cfg in configs.items():
            part = owned_path(folder.path, name, prefix=".module-", what="module name")
            results.append(run_module(dump_config(cfg), mods[name], part, referenced))
            parts.append((name, part))
        _assemble(folder.path, parts, configs, mods)
        result = _whole(results, list(configs))
        result.path = folder.target
        with open(os.path.join(folder.path, RECIPE_FILE), "w", encoding="utf-8") as f:
            f.write(result.recipe.to_yaml())
        result.write_card(folder.path)
        folder.commit()
    except BaseException as e:
        raise folder.fail(e)
    return result


def _referenced(data: dict[str, Any]) -> list[str]:
    """Every model a ``modules:`` config names, once each: ``base_model``, then the modules' models in the
    config's order (mergekit's ``referenced_models``, in the order hubsoup builds a merged vocabulary)."""
    refs = [data["base_model"]] if data.get("base_model") is not None else []
    for mod in data["modules"].values():
        for m in mod.get("models") or []:
            refs.append(m.get("model") if isinstance(m, dict) else m)
        for sl in mod.get("slices") or []:
            refs.extend(src.get("model") if isinstance(src, dict) else src for src in (sl or {}).get("sources") or [])
    return list(dict.fromkeys(model_ref(r, ["modules"]) for r in refs))


def _whole(results: list[R], names: list[str]) -> R:
    """The first module's result as the whole merge's: every module's inputs (once each) and restricted inputs;
    its recipe's hash covering every module's (each module's recipe hash in its options)."""
    result = results[0]
    inputs: dict[str, Any] = {}
    for res in results:
        for ref in res.inputs:
            inputs.setdefault(ref.spec, ref)
    result.inputs = list(inputs.values())
    result.recipe.inputs = list(inputs.values())
    result.recipe.options = {**result.recipe.options,
                             "modules": {n: res.recipe.hash for n, res in zip(names, results)}}
    result.notes.append(f"**Modules:** merged module by module ({', '.join(f'`{n}`' for n in names)}), each as the "
                        f"mergekit configuration below says; the hyperparameters above are module `{names[0]}`'s.")
    seen = {r["repo"]: r for res in results for r in res.restricted}
    result.restricted = [seen[k] for k in sorted(seen)]
    return result


def _weight_files(folder: str) -> list[tuple[str, list[str], int]]:
    """``(file, tensor names, bytes of tensor data)`` of every safetensors file of an output folder (headers only)."""
    out = []
    for fn in sorted(os.listdir(folder)):
        if fn.endswith(".safetensors"):
            with open(os.path.join(folder, fn), "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(n))
            names = [k for k in header if k != "__metadata__"]
            out.append((fn, names, os.path.getsize(os.path.join(folder, fn)) - 8 - n))
    return out


def _assemble(folder: str, parts: list[tuple[str, str]], configs: dict[str, dict[str, Any]], mods: dict[str, Module]) -> None:
    """The modules' outputs (``parts``: name, folder) as one checkpoint in ``folder``: shards renamed and
    indexed, the first module's other files (config, tokenizer, recipe), each sliced module's layer count."""
    files = [(part, fn, names, size) for _, part in parts for fn, names, size in _weight_files(part)]
    total = len(files)
    weight_map: dict[str, str] = {}
    for i, (part, fn, names, _) in enumerate(files):
        new = "model.safetensors" if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        os.replace(os.path.join(part, fn), os.path.join(folder, new))
        weight_map.update((k, new) for k in names)
    first = parts[0][1]
    for fn in os.listdir(first):  # config, tokenizer, recipe: every module's are the base's
        src = os.path.join(first, fn)
        if os.path.isfile(src) and not fn.endswith(".safetensors") and fn != "model.safetensors.index.json":
            os.replace(src, os.path.join(folder, fn))
    if total > 1:
        with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": sum(s for *_, s in files)},
                       "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    cfg_path = os.path.join(folder, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    for name, mc in configs.items():  # mergekit: a module given as slices gets their total depth, at its key
        if mc.get("slices") is None:
            continue
        n = sum(s["sources"][0]["layer_range"][1] - s["sources"][0]["layer_range"][0] for s in mc["slices"])
        key = mods[name].layers_key
        if key is None:
            if n:
                log.warning("mergekit config: module '%s' has no config key for its layer count (%d)", name, n)
            continue
        node = cfg
        parts_k = key.split(".")
        for p in parts_k[:-1]:
            node = node.get(p) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            log.warning("mergekit config: cannot set '%s' = %d in the output's config.json", key, n)
            continue
        node[parts_k[-1]] = n
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    for _, part in parts:
        shutil.rmtree(part, ignore_errors=True)
