"""Reading a mergekit config: :func:`read_config` turns its text into the hubsoup merge it means
(:class:`MergekitMerge`: method, parameters, base, inputs, slices, vocabulary), with mergekit's semantics
(see :mod:`hubsoup.formats.mergekit`): its methods table (:mod:`~hubsoup.formats.mergekit.methods`), its
parameter precedence (a model's, then its slice's, then the top level's), the keys it drops without a word
dropped too, each named in one warning."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hubsoup.errors import ParameterError
from hubsoup.formats import chat_template
from hubsoup.formats.mergekit.config import (DTYPES, IGNORED_SLICE_KEYS, TOP_KEYS, UNSUPPORTED_TOP, Slice, Source,
                                             check_keys, is_mergekit_config, key_path, load_text, model_ref,
                                             params_map)
from hubsoup.formats.mergekit.layout import MergekitLayout
from hubsoup.formats.mergekit.methods import METHODS, REQUIRED, MkMethod, MkParam
from hubsoup.formats.mergekit.modules import module_config
from hubsoup.formats.mergekit.vocab import VocabSpec, parse_vocab
from hubsoup.hubclient import Token
from hubsoup.methods import available, get_method
from hubsoup.untrusted import load_yaml, short

if TYPE_CHECKING:
    from hubsoup.formats.mergekit.modules import Module

log = logging.getLogger(__name__)


@dataclass
class MergekitMerge:
    """A mergekit config as the hubsoup merge it means (see :func:`read_config`)."""

    text: str
    """The config as given (what the card shows)."""
    merge_method: str
    method: str
    params: dict[str, Any]
    base: str | None
    """The base model's spec (for methods that need none and were given none: the first input, τ = 0)."""
    inputs: list[str]
    dtype: str | None
    slices: list[Slice] | None
    """None: ``models`` (every layer of every model, mergekit's gradient position over the whole depth)."""
    vocab: VocabSpec | None = None
    """The merged vocabulary ``tokenizer_source`` / ``tokenizer`` ask for (None: the base's tokenizer, copied)."""
    chat_template: str | None = None
    models_mode_sources: list[Source] = field(default_factory=list)
    guarded: list[str] = field(default_factory=list, repr=False)
    """mergekit parameters set per slice (several slices): resolved by :func:`_guard_params` from the tensor names."""
    top: dict[str, Any] = field(default_factory=dict, repr=False)
    chat_template_text: str | None = None
    """The template ``chat_template`` names (None for ``auto``: chosen from the models when the merge is planned)."""
    ignored: list[str] = field(default_factory=list)
    """Keys and parameters mergekit would drop without a word (warned about, and listed on the card)."""
    config_dtype: str | None = None
    """The dtype the output's ``config.json`` names when it is not the stored one (``base``: the base's own):
    mergekit stores a float32 result (:attr:`MkMethod.result_dtype`) under the config's ``dtype``."""
    module: Module | None = None
    """One module of a modular model (:class:`hubsoup.formats.mergekit.modules.Module`): the merge covers
    its tensors only, its layers counted alone (None: the whole model)."""

    def merge_kwargs(self) -> dict[str, Any]:
        """The :func:`hubsoup.merge` arguments (inputs apart) of this merge."""
        return {"method": self.method, "base": self.base, "params": dict(self.params), "dtype": self.dtype,
                "layout": MergekitLayout(self)}


def read_config(source: str, *, resolve: bool = True, token: Token = None, allow_pickle: bool = False,
                module: Module | None = None) -> MergekitMerge:
    """The hubsoup merge a mergekit config means.

    Args:
        source: the config's YAML text, or a path to it (or to a folder holding ``mergekit_config.yml``).
        resolve: read the models' configs and tensor names (local folders, or the Hub) to check
            layer ranges; False reads the config alone.
        module: the config is one module's of a ``modules:`` config
            (:mod:`hubsoup.formats.mergekit.modules`): only that module's tensors are merged.

    Raises:
        hubsoup.errors.ParameterError: naming the key at fault (unknown, unsupported, or invalid).
    """
    text = source if "\n" in source or ":" in source and not os.path.exists(source) else load_text(source)
    data = load_yaml(text, "mergekit config")
    if not is_mergekit_config(data):
        raise ParameterError("mergekit config: no 'merge_method' key (is this a hubsoup recipe?)")
    dropped: list[str] = []
    data = check_keys(data, TOP_KEYS, [], dropped, UNSUPPORTED_TOP)
    data = _hoist_default_module(data, dropped)
    mk_name = data["merge_method"]
    if not isinstance(mk_name, str):
        raise ParameterError(f"mergekit config: 'merge_method' must be a method name, got {mk_name!r}")
    base_ref = model_ref(data["base_model"], ["base_model"]) if data.get("base_model") is not None else None
    top = params_map(data.get("parameters"), ["parameters"])
    if (data.get("models") is None) == (data.get("slices") is None):
        raise ParameterError("mergekit config: give exactly one of 'models' and 'slices'")

    slices = _read_slices(data, dropped) if data.get("slices") is not None else None
    models = _read_models(data, dropped) if slices is None else []
    dtype, config_dtype = _read_dtype(data, mk_name)

    vocab = parse_vocab(data)  # tokenizer_source / tokenizer: a merged vocabulary (hubsoup.formats.mergekit.vocab)
    chat = data.get("chat_template")
    chat_text = chat_template.resolve(chat) if chat is not None else None  # a name or a bad value: refused now

    merge = _build(text, mk_name, base_ref, top, models, slices, dtype, dropped)
    if mk_name in METHODS:  # mergekit computes in its `dtype` (else the inputs' own): rounding included
        compute = DTYPES[data["dtype"]] if data.get("dtype") is not None else "inputs"
        if compute != "float32" and "compute_dtype" in {f.name for f in dataclasses.fields(get_method(merge.method).Params)}:
            merge.params["compute_dtype"] = compute
    merge.chat_template, merge.top = chat, top
    merge.config_dtype = config_dtype
    merge.vocab = vocab
    merge.chat_template_text = chat_text
    merge.ignored = dropped
    merge.module = module
    for key in dropped:  # mergekit drops them silently; the author meant something by each: say so
        log.warning("mergekit config: '%s' is ignored (mergekit ignores it too)", key)
    if resolve:
        naming = MergekitLayout(merge).check_sources(token=token, allow_pickle=allow_pickle)
        if merge.guarded:
            assert naming is not None  # per-slice parameters are guarded only where there are slices
            _guard_params(merge, METHODS[mk_name], *naming)
    elif merge.guarded:
        raise ParameterError(f"mergekit config: per-slice parameters ({', '.join(merge.guarded)}) need the models "
                             "(read_config(..., resolve=True))")
    return merge


def _read_models(data: dict[str, Any], dropped: list[str]) -> list[Source]:
    """``models:``: every model with its parameters (every layer of each)."""
    models: list[Source] = []
    if not isinstance(data["models"], list) or not data["models"]:
        raise ParameterError("mergekit config: 'models' must be a non-empty list")
    for i, m in enumerate(data["models"]):
        w = ["models", i]
        m = check_keys(m, {"model", "parameters"}, w, dropped)
        if any(x.model == m.get("model") for x in models):
            raise ParameterError(f"mergekit config: 'models' names '{str(m.get('model'))[:80]}' twice; mergekit "
                                 "refuses duplicate merge inputs")
        models.append(Source(model_ref(m.get("model"), w + ["model"]), None,
                             params_map(m.get("parameters"), w + ["parameters"])))
    return models


def _read_slices(data: dict[str, Any], dropped: list[str]) -> list[Slice]:
    """``slices:``: each slice's sources (a model and its layer range) and parameters."""
    if not isinstance(data["slices"], list) or not data["slices"]:
        raise ParameterError("mergekit config: 'slices' must be a non-empty list")
    slices: list[Slice] = []
    for i, s in enumerate(data["slices"]):
        w = ["slices", i]
        s = check_keys(s, {"sources", "parameters"} | set(IGNORED_SLICE_KEYS), w, dropped,
                       {"base_model": "a per-slice base_model is not supported; use the top-level base_model"})
        dropped.extend(key_path(w + [k]) for k in IGNORED_SLICE_KEYS if k in s)
        if not isinstance(s.get("sources"), list) or not s["sources"]:
            raise ParameterError(f"mergekit config: '{key_path(w + ['sources'])}' must be a non-empty list")
        srcs = []
        for j, src in enumerate(s["sources"]):
            ws = w + ["sources", j]
            src = check_keys(src, {"model", "layer_range", "parameters"}, ws, dropped)
            lr = src.get("layer_range")
            if (not isinstance(lr, (list, tuple)) or len(lr) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in lr)
                    or lr[0] < 0 or lr[1] <= lr[0]):
                raise ParameterError(f"mergekit config: '{key_path(ws + ['layer_range'])}' must be [start, end) "
                                     f"with 0 <= start < end, got {lr!r}")
            srcs.append(Source(model_ref(src.get("model"), ws + ["model"]), (lr[0], lr[1]),
                               params_map(src.get("parameters"), ws + ["parameters"])))
        dup = next((x.model for k, x in enumerate(srcs) if any(y.model == x.model for y in srcs[:k])), None)
        if dup is not None:
            raise ParameterError(f"mergekit config: '{key_path(w + ['sources'])}' names '{dup[:80]}' twice; "
                                 "mergekit refuses duplicate merge inputs")
        lengths = {lr[1] - lr[0] for lr in (x.layer_range for x in srcs) if lr is not None}  # all set above
        if len(lengths) > 1:
            raise ParameterError(f"mergekit config: '{key_path(w)}': all sources of a slice must have the same "
                                 f"number of layers, got {sorted(lengths)}")
        slices.append(Slice(srcs, params_map(s.get("parameters"), w + ["parameters"])))
    return slices


def _read_dtype(data: dict[str, Any], mk_name: str) -> tuple[str | None, str | None]:
    """``(the stored dtype, the dtype config.json names when it differs)`` from ``dtype`` / ``out_dtype``."""
    dtype = None
    for key in ("dtype", "out_dtype"):  # out_dtype (the stored one) wins over dtype (mergekit's compute dtype)
        if data.get(key) is not None:
            if data[key] not in DTYPES:
                raise ParameterError(f"mergekit config: '{key}' = {data[key]!r} is not supported "
                                     f"(one of {', '.join(sorted(set(DTYPES.values())))})")
            dtype = DTYPES[data[key]]
    config_dtype = None
    result = METHODS[mk_name].result_dtype if mk_name in METHODS else None
    if result is not None and data.get("out_dtype") is None:
        # mergekit stores what its kernel returns (float32 for arcee_fusion, ramplus_tl) while config.json names
        # the config's dtype (none: the base's own): the weights and the config's dtype then differ, as mergekit's
        config_dtype = dtype or "base"
        dtype = result
    return dtype, config_dtype


def _hoist_default_module(data: dict[str, Any], dropped: list[str]) -> dict[str, Any]:
    """``modules: {default: {...}}`` as the plain config it is for a model of one module (a text model).

    mergekit reads a module's ``slices`` or ``models`` as the top level's and its ``parameters``
    between a slice's and the top level's; with one module, ``default``, that is the config with those
    hoisted (each parameter's module entries before the top level's). Several modules (the vision and
    text towers of a multimodal model, each with its own models, slices and parameters) are merged one by one
    by :func:`run_config` (:mod:`hubsoup.formats.mergekit.modules`); read alone, such a config is refused.
    """
    mods = data.get("modules")
    if mods is None:
        return data
    if not isinstance(mods, dict) or set(mods) != {"default"}:
        names = ", ".join(map(str, mods)) if isinstance(mods, dict) else type(mods).__name__
        raise ParameterError(f"mergekit config: 'modules' ({names[:80]}): a multimodal model's modules are "
                             "merged one by one (run the config with run_config / hubsoup run)")
    return module_config(data, "default", dropped)


def _lora_input(ref: str, base_ref: str | None, where: str) -> str:
    """A ``model+adapter`` reference as hubsoup's input: the adapter alone when ``model`` is the base (τ = ΔW,
    merged from its factors), else the reference itself (the model with the adapter applied on read,
    :mod:`hubsoup.sources.adapted`)."""
    if "+" not in ref:
        return ref
    model, adapter = ref.split("+", 1)
    if base_ref is not None and model == base_ref:
        return adapter
    return ref


def _build(text: str, mk_name: str, base_ref: str | None, top: dict[str, Any], models: list[Source],
           slices: list[Slice] | None, dtype: str | None, dropped: list[str]) -> MergekitMerge:
    spec = METHODS.get(mk_name)
    if spec is None:
        return _build_native(text, mk_name, base_ref, top, models, slices, dtype)
    if spec.base == "required" and base_ref is None:
        raise ParameterError(f"mergekit config: merge_method '{mk_name}' needs 'base_model'")
    # every model merged, in order of first appearance (models mode: mergekit adds base_model if not listed)
    if slices is None:
        sources = list(models)
        if base_ref is not None and all(s.model != base_ref for s in sources):
            sources.append(Source(base_ref, None, {}))
        merging = [sources]
    else:
        sources = [s for sl in slices for s in sl.sources]
        merging = [sl.sources for sl in slices if len(sl.sources) > 1]
    order: list[str] = []
    for s in sources:
        if s.model not in order:
            order.append(s.model)
    if mk_name == "passthrough":
        for i, sl in enumerate(slices or [Slice(models, {})]):
            if len(sl.sources) != 1:
                raise ParameterError(f"mergekit config: passthrough takes one model per slice; "
                                     f"{'slices' if slices else 'models'}[{i}] has {len(sl.sources)}")
        first = (slices[0].sources[0] if slices else models[0]).model
        ref = base_ref or first
        inputs = [ref]
        base = ref
    else:
        merged_models = [m for m in order if any(m in {s.model for s in srcs} for srcs in merging)]
        sets = [{s.model for s in srcs} for srcs in merging]
        if sets and any(st != set(merged_models) for st in sets):
            raise ParameterError("mergekit config: every slice that merges must take the same models "
                                 f"({', '.join(merged_models)}); slices merging different sets are not supported")
        if slices is not None and base_ref is not None and merging and base_ref not in merged_models:
            raise ParameterError(f"mergekit config: base_model '{base_ref}' must be one of the sources of every "
                                 "slice that merges")
        inputs = merged_models if spec.base_is_input else [m for m in merged_models if m != base_ref]
        if not inputs and base_ref is not None and base_ref in order:
            inputs = [base_ref]  # only the base is named (e.g. base+lora, "lorablation"): mergekit returns it, τ = 0
        if not inputs:
            raise ParameterError(f"mergekit config: merge_method '{mk_name}' has no model to merge besides base_model")
        if mk_name == "slerp" and len(inputs) != 1:
            raise ParameterError(f"mergekit config: slerp takes base_model and exactly one other model, got "
                                 f"{len(inputs)} others ({', '.join(inputs)})")
        base = base_ref if base_ref is not None else inputs[0]
        if base_ref is None:  # mergekit takes one from a set of the models: a different one from run to run
            log.warning("mergekit config: no base_model: the output's config and tokenizer are '%s''s (the first "
                        "model of the config; mergekit picks one of the models, which may change between runs)",
                        base)
    params = dict(spec.fixed)
    if spec.use_base_flag:
        params["use_base"] = base_ref is not None
    merge = MergekitMerge(text, mk_name, spec.hub, params, base, inputs, dtype, slices,
                          models_mode_sources=models)
    _fill_params(merge, spec, top, dropped)
    merge.base = _lora_input(merge.base, None, "base_model") if merge.base else None
    merge.inputs = [_lora_input(m, base_ref, "models") for m in merge.inputs]
    return merge


def _build_native(text: str, name: str, base_ref: str | None, top: dict[str, Any], models: list[Source],
                  slices: list[Slice] | None, dtype: str | None) -> MergekitMerge:
    """A hubsoup method from a mergekit-shaped config: its own parameters, ``weight`` per model if it has ``weights``."""

    methods = available()
    if name not in methods:
        raise ParameterError(f"mergekit config: merge_method '{name}' is neither one of mergekit's that hubsoup "
                             f"reproduces ({', '.join(sorted(METHODS))}) nor a hubsoup method "
                             f"({', '.join(sorted(methods))})")
    if slices is not None:
        raise ParameterError(f"mergekit config: hubsoup's method '{name}' takes 'models', not 'slices'")
    fields = {f.name for f in dataclasses.fields(methods[name].Params)}
    inputs = [m.model for m in models if m.model != base_ref]
    params = dict(top)
    weights = []
    for i, m in enumerate(x for x in models if x.model != base_ref):
        extra = set(m.parameters) - {"weight"}
        if extra:
            raise ParameterError(f"mergekit config: models[{i}].parameters.{sorted(extra)[0]}: hubsoup's method "
                                 f"'{name}' takes per-model 'weight' only; give its parameters at the top level")
        weights.append(m.parameters.get("weight"))
    if any(w is not None for w in weights):
        if "weights" not in fields:
            raise ParameterError(f"mergekit config: hubsoup's method '{name}' has no per-model weights")
        if any(w is None for w in weights):
            raise ParameterError("mergekit config: give 'weight' for every model or for none")
        params["weights"] = weights
    return MergekitMerge(text, name, name, params, base_ref, [_lora_input(m, base_ref, "models") for m in inputs],
                         dtype, None, models_mode_sources=models)


def _entries(setting: Any, where: str) -> list[dict[str, Any]]:
    """A mergekit ParameterSetting as ``[{filter?, value}]`` entries (a scalar or gradient: one unfiltered entry)."""
    if setting is None:
        return []
    if isinstance(setting, dict):
        setting = [setting]
    if isinstance(setting, (bool, int, float, str)):
        return [{"value": setting}]
    if isinstance(setting, list):
        if not setting:
            return []
        if all(not isinstance(e, dict) for e in setting):
            if any(isinstance(e, (list, tuple)) for e in setting):
                raise ParameterError(f"mergekit config: '{where}': a gradient is a list of numbers, got {short(setting)}")
            return [{"value": list(setting)}]
        out = []
        for e in setting:
            if not isinstance(e, dict) or "value" not in e:
                raise ParameterError(f"mergekit config: '{where}': an entry is {{filter: NAME, value: V}}, got {short(e)}")
            e = {k: v for k, v in e.items() if k in ("filter", "value")}  # other keys were dropped (and warned of)
            if e.get("filter") is not None and not isinstance(e["filter"], str):
                raise ParameterError(f"mergekit config: '{where}': filter {short(e['filter'])} is not a string")
            out.append({"value": e["value"]} if e.get("filter") in (None, "*") else dict(e))
        return out
    raise ParameterError(f"mergekit config: '{where}': unexpected value {short(setting)}")


def _typed_setting(setting: Any, p: MkParam, where: str, dropped: list[str]) -> Any:
    """A parameter setting with mergekit's pydantic reading: numbers written as strings (``tol: "1e-10"``) are
    numbers for a numeric parameter, and keys of a ``{filter, value}`` entry other than those two
    (``pattern:``) are dropped, so such an entry applies to every tensor, as in mergekit."""
    def scalar(v: Any) -> Any:
        if isinstance(v, str) and p.kind in (float, int):
            try:
                x = float(v.strip())
            except ValueError:
                raise ParameterError(f"mergekit config: '{where}' = {v!r} is not a number") from None
            return int(x) if p.kind is int and x.is_integer() else x
        return v

    def value(v: Any) -> Any:
        return [scalar(x) for x in v] if isinstance(v, list) else scalar(v)

    if isinstance(setting, dict):
        setting = [setting]
        single = True
    else:
        single = False
    if isinstance(setting, list) and setting and all(isinstance(e, dict) for e in setting):
        out = []
        for e in setting:
            extra = [k for k in e if k not in ("filter", "value")]
            dropped.extend(f"{where}.{k}" for k in extra)
            out.append({k: (value(v) if k == "value" else v) for k, v in e.items() if k not in extra})
        return out[0] if single else out
    return value(setting)


def _chain(parts: list[tuple[Any, str]], p: MkParam, name: str) -> list[dict[str, Any]]:
    """mergekit's precedence: the first scope's entries, then the next's...; cut after an unfiltered entry."""
    out: list[dict[str, Any]] = []
    for setting, where in parts:
        for e in _entries(setting, where):
            out.append(e)
            if "filter" not in e:
                return out
    if p.default is REQUIRED:
        raise ParameterError(f"mergekit config: parameter '{name}' is required for every tensor"
                             f"{' of every model' if p.per_input else ''} (mergekit has no default for it)")
    out.append({"value": p.default})
    return out


def _value(entries: list[dict[str, Any]], p: MkParam, name: str) -> Any:
    """hubsoup's value for a resolved chain: a plain value, a gradient list, or schedule entries."""
    if len(entries) == 1 and not isinstance(entries[0]["value"], list):
        v = entries[0]["value"]
        if p.kind is bool:
            v = _bool(v, name)
        return p.convert(v) if p.convert else v
    if p.kind is not float and p.kind is not int:
        raise ParameterError(f"mergekit config: parameter '{name}': gradients and filters of a true/false "
                             "parameter are not supported")
    if len(entries) == 1:
        return list(entries[0]["value"])
    return [dict(e) for e in entries]


def _bool(v: Any, name: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    raise ParameterError(f"mergekit config: parameter '{name}' must be true or false, got {short(v)}")


def _fill_params(merge: MergekitMerge, spec: MkMethod, top: dict[str, Any], dropped: list[str]) -> None:
    """Every mergekit parameter of the config, resolved to hubsoup's (single-scope chains; slices: per slice later).

    A parameter the method does not declare, or a whole-merge parameter given for one model, is
    dropped into ``dropped``: mergekit resolves only the parameters a method declares, each at the
    scopes it is looked up at, and never reads the others."""
    known = set(spec.params)
    src: Source | None  # a source of the config (None: an input no slice names)
    scopes: list[tuple[dict[str, Any], str, bool]] = [(top, "parameters", False)]
    for i, s in enumerate(merge.models_mode_sources):
        scopes.append((s.parameters, f"models[{i}].parameters", True))
    for i, sl in enumerate(merge.slices or []):
        scopes.append((sl.parameters, f"slices[{i}].parameters", False))
        for j, src in enumerate(sl.sources):
            scopes.append((src.parameters, f"slices[{i}].sources[{j}].parameters", True))
    for d, where, per_model in scopes:
        for k in list(d):
            if k not in known or (per_model and not spec.params[k].per_input):
                dropped.append(f"{where}.{k}")
                del d[k]
            else:
                d[k] = _typed_setting(d[k], spec.params[k], f"{where}.{k}", dropped)
    multi = merge.slices is not None and len(merge.slices) > 1
    for name, p in spec.params.items():
        if p.hub is None:
            continue
        if not p.per_input:
            if multi and any(name in sl.parameters for sl in merge.slices or []):
                merge.guarded.append(name)  # per-slice values: resolved with the models' tensor names
            sl0 = merge.slices[0].parameters if merge.slices else {}
            merge.params[p.hub] = _value(_chain([(sl0.get(name), "slices[0].parameters"), (top.get(name), "parameters")],
                                                p, name), p, name)
            continue
        values = []
        for inp in merge.inputs:
            parts = []
            if merge.merge_method == "passthrough":
                src = (merge.slices[0].sources[0] if merge.slices else merge.models_mode_sources[0])
                parts.append((src.parameters.get(name), "sources.parameters"))
            elif merge.slices:
                src = next((s for s in merge.slices[0].sources if s.model == inp), None)
                if src is not None:
                    parts.append((src.parameters.get(name), f"parameters of {inp}"))
            else:
                for s in merge.models_mode_sources:
                    if s.model == inp:
                        parts.append((s.parameters.get(name), f"parameters of {inp}"))
                        break
            if merge.slices:
                parts.append((merge.slices[0].parameters.get(name), "slices[0].parameters"))
            parts.append((top.get(name), "parameters"))
            values.append(_value(_chain(parts, p, name), p, name))
        if multi and any(name in x for sl in merge.slices or [] for x in (sl.parameters, *(s.parameters for s in sl.sources))):
            merge.guarded.append(name)  # per-slice values: resolved with the models' tensor names
        merge.params[p.hub] = values[0] if merge.merge_method == "passthrough" else values


def _guard_params(merge: MergekitMerge, spec: MkMethod, stack: str, suffixes: list[str], pre: list[str],
                  post: list[str]) -> None:
    """Per-slice settings of several slices as one schedule per parameter, each entry guarded by its slice's tensors.

    A slice's entries match only its own output tensors: an unfiltered entry through each of its
    layers' prefix (``model.layers.5.``) and its non-layer tensors' names (the first slice's
    embeddings, the last slice's head); a filtered one through every such tensor the filter matches.
    The top-level parameters follow, unguarded: mergekit's precedence, tensor by tensor.
    """
    slices = merge.slices
    assert slices is not None  # parameters are guarded per slice only where there are several slices
    groups: list[list[str]] = []
    k = 0
    for i, sl in enumerate(slices):
        lr = sl.sources[0].layer_range
        assert lr is not None  # a slice's sources have their layer ranges (_read_slices)
        n = lr[1] - lr[0]
        prefixes = [f"{stack}.{k + j}." for j in range(n)]
        k += n
        names = ([*pre] if i == 0 else []) + ([*post] if i == len(slices) - 1 else [])
        groups.append([*prefixes, *names])

    def full_names(group: list[str]) -> list[str]:
        return [g + suf for g in group if g.endswith(".") for suf in suffixes] + [g for g in group if not g.endswith(".")]

    for name in merge.guarded:
        p = spec.params[name]
        assert p.hub is not None  # guarded only when hubsoup has the parameter (_fill_params)
        per_model = p.per_input and merge.merge_method != "passthrough"
        owners = merge.inputs if per_model else [None]
        values = []
        for inp in owners:
            entries: list[dict[str, Any]] = []
            covered = True
            for i, sl in enumerate(slices):
                if merge.merge_method == "passthrough":
                    parts = [sl.sources[0].parameters.get(name)]
                else:
                    parts = [s.parameters.get(name) for s in sl.sources if per_model and s.model == inp and len(sl.sources) > 1]
                parts.append(sl.parameters.get(name))
                chain: list[dict[str, Any]] = []
                for setting in parts:
                    for e in _entries(setting, f"slices[{i}].parameters.{name}"):
                        chain.append(e)
                        if "filter" not in e:
                            break
                    if chain and "filter" not in chain[-1]:
                        break
                covered &= bool(chain) and "filter" not in chain[-1]
                for e in chain:
                    if "filter" not in e:
                        entries.extend({"filter": g, "value": e["value"]} for g in groups[i])
                    else:
                        entries.extend({"filter": x, "value": e["value"]} for x in full_names(groups[i])
                                       if e["filter"] in x)
            try:
                entries.extend(_chain([(merge.top.get(name), "parameters")], p, name))
            except ParameterError:
                if not covered:
                    raise
            if p.kind is bool:
                raise ParameterError(f"mergekit config: parameter '{name}': per-slice values of a true/false "
                                     "parameter are not supported")
            values.append(entries)
        merge.params[p.hub] = values if per_model else values[0]
