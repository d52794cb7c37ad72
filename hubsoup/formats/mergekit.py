"""mergekit YAML configs, read with mergekit's semantics (and written back from hubsoup recipes).

Thousands of model cards carry a mergekit config. :func:`read_config` turns one into the
hubsoup merge it means and :func:`hubsoup.workflows.rerun.run_config` runs it (``hubsoup run CONFIG.yml`` and
:func:`hubsoup.run_recipe` detect such a file by its ``merge_method`` key):

* ``merge_method`` picks the hubsoup method *with mergekit's convention* (:data:`METHODS`:
  e.g. ``ties`` → hubsoup ``ties`` with ``convention=mergekit, scope=tensor``; ``lambda`` →
  ``scale``; per-model ``weight``/``density``/``gamma``/``epsilon`` → the per-input tuples
  ``weights``/``densities``/``gammas``/``epsilons``). A hubsoup method that mergekit lacks
  (``sftm``, ``lines``, ``opcm``, ``lot``, ...) is used as is, its ``parameters`` in hubsoup's names.
* Parameters follow mergekit's precedence (a model's, then its slice's, then the top-level
  ``parameters``); gradients and ``filter`` entries become per-tensor schedules
  (:mod:`hubsoup.methods._schedule`), resolved by the engine with mergekit's ``t``.
* ``slices`` (frankenmerges, per-slice merges) become a *layout*: the output's tensors are
  renumbered source layers (:class:`hubsoup.plan.TensorSource`), streamed by the one engine;
  the output config gets the new layer count.
* ``dtype`` / ``out_dtype`` set the output dtype; a method that mergekit computes in its ``dtype`` (else
  the inputs' own) does so here too (its ``compute_dtype``), and where mergekit's kernel returns float32
  whatever it computes in (arcee_fusion, ramplus_tl: :attr:`MkMethod.result_dtype`), a config without
  ``out_dtype`` stores float32 under a ``config.json`` naming its ``dtype``, as mergekit's does;
  ``chat_template`` may be a Jinja template, one of mergekit's names or ``auto``
  (:mod:`hubsoup.formats.chat_template`).
* ``tokenizer_source`` (``base``, ``union``, a model) and the ``tokenizer`` section (``source``,
  ``tokens``, ``pad_to_multiple_of``) give the output mergekit's merged vocabulary: every input's
  embedding and head rows re-indexed to it as the engine streams them
  (:mod:`hubsoup.formats.mergekit_vocab`).
* Keys and parameters mergekit drops without a word (its config classes ignore unknown keys,
  a method reads only the parameters it declares) are dropped too, each named in one warning
  and on the card (:attr:`MergekitMerge.ignored`); numbers written as strings are numbers.
* A stream of configs (mergekit-multi's stages) is run by :mod:`hubsoup.formats.stages`.
* ``modules:`` of a multimodal model (each module its own models, slices and parameters) is run module
  by module by :mod:`hubsoup.formats.mergekit_modules`; a lone ``default`` module reads as the plain config.

Where hubsoup differs: a per-model ``filter`` matches the *output* tensor's name (mergekit: the
input's, which differs only in the layer number within a slice); slices that merge must all take
the same models.

Model references are resolved as mergekit does: a folder that exists (relative to the working
folder) is local, anything else a Hub repo ``org/name[@revision]``; ``base+adapter`` (a LoRA
on the base model) is the adapter as an input, and ``model+adapter`` anywhere else (base_model
included) is the model with the adapter applied tensor by tensor (:mod:`hubsoup.sources.adapted`).

Example:
    >>> from hubsoup.formats.mergekit import read_config
    >>> m = read_config('''
    ... merge_method: ties
    ... base_model: org/base
    ... models:
    ...   - model: org/ft-a
    ...     parameters: {weight: 1.0, density: 0.5}
    ... ''', resolve=False)
    >>> m.method, m.params["convention"], m.params["weights"], m.params["densities"]
    ('ties', 'mergekit', [1.0], [0.5])
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from hubsoup.arch import before_blocks, tied_groups
from hubsoup.errors import ParameterError
from hubsoup.formats import chat_template
from hubsoup.formats.mergekit_vocab import VocabLayout, VocabSpec, parse_vocab
from hubsoup.hubclient import Token
from hubsoup.methods import available, get_method
from hubsoup.methods.task_arithmetic import default_scale
from hubsoup.output.checkpoint import _COPY_FROM_BASE
from hubsoup.plan import Plan, TensorSource, block_of, build_plan, layout_plan
# a config's model references and public text: in hubsoup.public (the recipe and the push need them too)
from hubsoup.public import _map_models, dump_config, public_config_text  # noqa: F401
from hubsoup.sources.access import hub_only, require_hub_id
from hubsoup.sources.adapted import open_adapted
from hubsoup.sources.compat import open_models
from hubsoup.sources.remap import AliasedCheckpoint
from hubsoup.sources.resolve import open_input
from hubsoup.untrusted import load_yaml, short

log = logging.getLogger(__name__)

CONFIG_FILE = "mergekit_config.yml"
"""The name mergekit gives the config it writes beside a merge."""

_TOP_KEYS = {"merge_method", "base_model", "models", "slices", "parameters", "dtype", "out_dtype",
             "tokenizer_source", "tokenizer", "chat_template", "modules"}
_UNSUPPORTED_TOP: dict[str, str] = {}
_IGNORED_SLICE_KEYS = {"residual_weight": "mergekit 0.1.5 reads it but never uses it"}
_DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32", "float16": "float16",
           "fp16": "float16", "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
REQUIRED = object()


def _mean_or_sum(v: bool) -> str:
    return "mean" if v else "sum"


@dataclass(frozen=True)
class MkParam:
    """How one mergekit parameter maps onto hubsoup's."""

    hub: str | None
    """hubsoup's parameter (None: accepted and ignored, it does not change the result, e.g. int8_mask)."""
    per_input: bool = False
    default: Any = REQUIRED
    kind: type = float
    convert: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class MkMethod:
    """A mergekit merge method: the hubsoup method and options with its semantics."""

    hub: str
    params: dict[str, MkParam]
    fixed: dict[str, Any] = field(default_factory=dict)
    base: str = "required"
    """``required``, ``optional`` or ``none`` (mergekit's base policy)."""
    base_is_input: bool = False
    """mergekit merges base_model as one of the models (linear, karcher)."""
    use_base_flag: bool = False
    """hubsoup's ``use_base`` says whether base_model was given (nuslerp, multislerp)."""
    result_dtype: str | None = None
    """The dtype mergekit's kernel returns whatever it computes in (None: the compute dtype). ``float32`` for
    arcee_fusion (its mask) and ramplus_tl (its scale): float32 tensors that promote a half-precision result,
    which mergekit then stores when the config has no ``out_dtype``."""


def _scale_of(p: dict) -> float:
    """The λ a recipe merged with (a DARE scale left at None resolves to mergekit's lambda, 1)."""
    return 1.0 if p.get("scale") is None else p["scale"]


def _gta(hub: str, fixed: dict, normalize: bool, rescale: bool, *, normalize_as: str = "normalize",
         extra: dict | None = None, sparsify: bool = True) -> MkMethod:
    conv = _mean_or_sum if normalize_as == "merge" else None
    params = {"weight": MkParam("weights", True),
              "density": MkParam("densities" if sparsify else None, True, 1.0),
              "lambda": MkParam("scale", default=1.0),
              "normalize": MkParam(normalize_as, default=normalize, kind=bool, convert=conv),
              "rescale": MkParam("rescale" if sparsify else None, default=rescale, kind=bool),
              "int8_mask": MkParam(None, default=False, kind=bool)}
    params.update(extra or {})
    return MkMethod(hub, params, fixed)


_GAMMA = {"gamma": MkParam("gammas", True, 0.01)}
_EPSILON = {"epsilon": MkParam("epsilons", True, 0.15)}
_MK = {"convention": "mergekit"}

METHODS: dict[str, MkMethod] = {
    "linear": MkMethod("linear", {"weight": MkParam("weights", True), "normalize": MkParam("normalize", default=True, kind=bool)},
                       {"combine": "models"}, base="optional", base_is_input=True),
    "task_arithmetic": _gta("task_arithmetic", {}, False, False, sparsify=False),
    "ties": _gta("ties", {**_MK, "scope": "tensor"}, True, False, normalize_as="merge"),
    "dare_ties": _gta("dare", {**_MK, "then": "ties"}, False, True, normalize_as="merge"),
    "dare_linear": _gta("dare", {**_MK, "then": "sum"}, False, True),
    "breadcrumbs": _gta("breadcrumbs", {}, False, False, extra=_GAMMA),
    "breadcrumbs_ties": _gta("breadcrumbs_ties", {}, False, False, extra=_GAMMA),
    "della": _gta("della", {}, True, True, extra=_EPSILON),
    "della_linear": _gta("della_linear", {}, False, True, extra=_EPSILON),
    "model_stock": MkMethod("model_stock", {"filter_wise": MkParam("filter_wise", default=False, kind=bool)}),
    "slerp": MkMethod("slerp", {"t": MkParam("t")}),
    "nuslerp": MkMethod("nuslerp", {"weight": MkParam("weights", True),
                                    "nuslerp_flatten": MkParam("nuslerp_flatten", default=True, kind=bool),
                                    "nuslerp_row_wise": MkParam("nuslerp_row_wise", default=False, kind=bool)},
                        base="optional", use_base_flag=True),
    "multislerp": MkMethod("multislerp", {"weight": MkParam("weights", True),
                                          "normalize_weights": MkParam("normalize_weights", default=True, kind=bool),
                                          "eps": MkParam("eps", default=1e-8)},
                           base="optional", use_base_flag=True),
    "karcher": MkMethod("karcher", {"max_iter": MkParam("max_iter", default=10, kind=int),
                                    "tol": MkParam("tol", default=1e-5)}, base="optional", base_is_input=True),
    "sce": MkMethod("sce", {"select_topk": MkParam("select_topk", default=1.0),
                            "int8_mask": MkParam(None, default=False, kind=bool)}),
    "passthrough": MkMethod("passthrough", {"scale": MkParam("weight_scale", True, 1.0)}, base="none"),
    "arcee_fusion": MkMethod("arcee_fusion", {}, result_dtype="float32"),
    "nearswap": MkMethod("nearswap", {"t": MkParam("t")}),
    "ram": MkMethod("ram", {"epsilon": MkParam("epsilon", default=1e-5)}),
    "ramplus_tl": MkMethod("ramplus_tl", {"r": MkParam("r", default=0.1), "alpha": MkParam("alpha", default=0.2),
                                          "epsilon": MkParam("epsilon", default=1e-5)}, result_dtype="float32"),
}
"""mergekit 0.1.5's merge methods that hubsoup reproduces (``merge_method`` → method, parameters, options)."""


# --- reading ----------------------------------------------------------------------------------------

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
    module: Any = None
    """One module of a modular model (:class:`hubsoup.formats.mergekit_modules.Module`): the merge covers
    its tensors only, its layers counted alone (None: the whole model)."""

    def merge_kwargs(self) -> dict[str, Any]:
        """The :func:`hubsoup.merge` arguments (inputs apart) of this merge."""
        return {"method": self.method, "base": self.base, "params": dict(self.params), "dtype": self.dtype,
                "layout": MergekitLayout(self)}


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


def _where(path: list) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _check_keys(d: Any, allowed: set[str], where: list, dropped: list[str],
                unsupported: dict[str, str] | None = None) -> dict:
    """``d`` as a mapping; a key mergekit does not know is dropped (mergekit's config classes drop it too) and
    recorded in ``dropped`` for the warning; a key mergekit uses and hubsoup cannot reproduce is refused."""
    if not isinstance(d, dict):
        raise ParameterError(f"mergekit config: '{_where(where)}' must be a mapping, got {short(d)}")
    for k in d:
        if unsupported and k in unsupported:
            raise ParameterError(f"mergekit config: key '{_where(where + [k])}' is not supported: {unsupported[k]}")
        if k not in allowed:
            dropped.append(_where(where + [k]))
    return {k: v for k, v in d.items() if k in allowed}


def _model_ref(value: Any, where: list) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ParameterError(f"mergekit config: '{_where(where)}' must be a model reference (org/name[@revision] "
                             f"or a folder), got {short(value)}")
    value = value.strip()
    if value.count("@") > 1 or value.count("+") > 1:
        raise ParameterError(f"mergekit config: '{_where(where)}' = {short(value)} is not a model reference")
    return value


def _params_map(d: Any, where: list) -> dict[str, Any]:
    if d is None:
        return {}
    if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
        raise ParameterError(f"mergekit config: '{_where(where)}' must be a mapping of parameter names, got {short(d)}")
    return d


def read_config(source: str, *, resolve: bool = True, token: Token = None, allow_pickle: bool = False,
                module: Any = None) -> MergekitMerge:
    """The hubsoup merge a mergekit config means.

    Args:
        source: the config's YAML text, or a path to it (or to a folder holding ``mergekit_config.yml``).
        resolve: read the models' configs and tensor names (local folders, or the Hub) to check
            layer ranges; False reads the config alone.
        module: the config is one module's of a ``modules:`` config
            (:mod:`hubsoup.formats.mergekit_modules`): only that module's tensors are merged.

    Raises:
        hubsoup.errors.ParameterError: naming the key at fault (unknown, unsupported, or invalid).
    """
    text = source if "\n" in source or ":" in source and not os.path.exists(source) else load_text(source)
    data = load_yaml(text, "mergekit config")
    if not is_mergekit_config(data):
        raise ParameterError("mergekit config: no 'merge_method' key (is this a hubsoup recipe?)")
    dropped: list[str] = []
    data = _check_keys(data, _TOP_KEYS, [], dropped, _UNSUPPORTED_TOP)
    data = _hoist_default_module(data, dropped)
    mk_name = data["merge_method"]
    if not isinstance(mk_name, str):
        raise ParameterError(f"mergekit config: 'merge_method' must be a method name, got {mk_name!r}")
    base_ref = _model_ref(data["base_model"], ["base_model"]) if data.get("base_model") is not None else None
    top = _params_map(data.get("parameters"), ["parameters"])
    if (data.get("models") is None) == (data.get("slices") is None):
        raise ParameterError("mergekit config: give exactly one of 'models' and 'slices'")

    slices: list[Slice] | None = None
    models: list[Source] = []
    if data.get("models") is not None:
        if not isinstance(data["models"], list) or not data["models"]:
            raise ParameterError("mergekit config: 'models' must be a non-empty list")
        for i, m in enumerate(data["models"]):
            w = ["models", i]
            m = _check_keys(m, {"model", "parameters"}, w, dropped)
            if any(x.model == m.get("model") for x in models):
                raise ParameterError(f"mergekit config: 'models' names '{str(m.get('model'))[:80]}' twice; mergekit "
                                     "refuses duplicate merge inputs")
            models.append(Source(_model_ref(m.get("model"), w + ["model"]), None,
                                 _params_map(m.get("parameters"), w + ["parameters"])))
    else:
        if not isinstance(data["slices"], list) or not data["slices"]:
            raise ParameterError("mergekit config: 'slices' must be a non-empty list")
        slices = []
        for i, s in enumerate(data["slices"]):
            w = ["slices", i]
            s = _check_keys(s, {"sources", "parameters"} | set(_IGNORED_SLICE_KEYS), w, dropped,
                            {"base_model": "a per-slice base_model is not supported; use the top-level base_model"})
            dropped.extend(_where(w + [k]) for k in _IGNORED_SLICE_KEYS if k in s)
            if not isinstance(s.get("sources"), list) or not s["sources"]:
                raise ParameterError(f"mergekit config: '{_where(w + ['sources'])}' must be a non-empty list")
            srcs = []
            for j, src in enumerate(s["sources"]):
                ws = w + ["sources", j]
                src = _check_keys(src, {"model", "layer_range", "parameters"}, ws, dropped)
                lr = src.get("layer_range")
                if (not isinstance(lr, (list, tuple)) or len(lr) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in lr)
                        or lr[0] < 0 or lr[1] <= lr[0]):
                    raise ParameterError(f"mergekit config: '{_where(ws + ['layer_range'])}' must be [start, end) "
                                         f"with 0 <= start < end, got {lr!r}")
                srcs.append(Source(_model_ref(src.get("model"), ws + ["model"]), (lr[0], lr[1]),
                                   _params_map(src.get("parameters"), ws + ["parameters"])))
            dup = next((x.model for k, x in enumerate(srcs) if any(y.model == x.model for y in srcs[:k])), None)
            if dup is not None:
                raise ParameterError(f"mergekit config: '{_where(w + ['sources'])}' names '{dup[:80]}' twice; "
                                     "mergekit refuses duplicate merge inputs")
            lengths = {b - a for a, b in (x.layer_range for x in srcs)}
            if len(lengths) > 1:
                raise ParameterError(f"mergekit config: '{_where(w)}': all sources of a slice must have the same "
                                     f"number of layers, got {sorted(lengths)}")
            slices.append(Slice(srcs, _params_map(s.get("parameters"), w + ["parameters"])))

    dtype = None
    for key in ("dtype", "out_dtype"):  # out_dtype (the stored one) wins over dtype (mergekit's compute dtype)
        if data.get(key) is not None:
            if data[key] not in _DTYPES:
                raise ParameterError(f"mergekit config: '{key}' = {data[key]!r} is not supported "
                                     f"(one of {', '.join(sorted(set(_DTYPES.values())))})")
            dtype = _DTYPES[data[key]]
    config_dtype = None
    result = METHODS[mk_name].result_dtype if mk_name in METHODS else None
    if result is not None and data.get("out_dtype") is None:
        # mergekit stores what its kernel returns (float32 for arcee_fusion, ramplus_tl) while config.json names
        # the config's dtype (none: the base's own): the weights and the config's dtype then differ, as mergekit's
        config_dtype = dtype or "base"
        dtype = result

    vocab = parse_vocab(data)  # tokenizer_source / tokenizer: a merged vocabulary (hubsoup.formats.mergekit_vocab)
    chat = data.get("chat_template")
    chat_text = chat_template.resolve(chat) if chat is not None else None  # a name or a bad value: refused now

    merge = _build(text, mk_name, base_ref, top, models, slices, dtype, dropped)
    if mk_name in METHODS:  # mergekit computes in its `dtype` (else the inputs' own): rounding included
        compute = _DTYPES[data["dtype"]] if data.get("dtype") is not None else "inputs"
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
            _guard_params(merge, METHODS[mk_name], *naming)
    elif merge.guarded:
        raise ParameterError(f"mergekit config: per-slice parameters ({', '.join(merge.guarded)}) need the models "
                             "(read_config(..., resolve=True))")
    return merge


def _hoist_default_module(data: dict, dropped: list[str]) -> dict:
    """``modules: {default: {...}}`` as the plain config it is for a model of one module (a text model).

    mergekit reads a module's ``slices`` or ``models`` as the top level's and its ``parameters``
    between a slice's and the top level's; with one module, ``default``, that is the config with those
    hoisted (each parameter's module entries before the top level's). Several modules (the vision and
    text towers of a multimodal model, each with its own models, slices and parameters) are merged one by one
    by :func:`run_config` (:mod:`hubsoup.formats.mergekit_modules`); read alone, such a config is refused.
    """
    mods = data.get("modules")
    if mods is None:
        return data
    if not isinstance(mods, dict) or set(mods) != {"default"}:
        names = ", ".join(map(str, mods)) if isinstance(mods, dict) else type(mods).__name__
        raise ParameterError(f"mergekit config: 'modules' ({names[:80]}): a multimodal model's modules are "
                             "merged one by one (run the config with run_config / hubsoup run)")
    from hubsoup.formats.mergekit_modules import module_config  # lazy: mergekit_modules imports this module (cycle)

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


def _build(text: str, mk_name: str, base_ref: str | None, top: dict, models: list[Source],
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


def _build_native(text, name, base_ref, top, models, slices, dtype) -> MergekitMerge:
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


def _entries(setting: Any, where: str) -> list[dict]:
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


def _chain(parts: list[tuple[Any, str]], p: MkParam, name: str) -> list[dict]:
    """mergekit's precedence: the first scope's entries, then the next's...; cut after an unfiltered entry."""
    out: list[dict] = []
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


def _value(entries: list[dict], p: MkParam, name: str) -> Any:
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


def _fill_params(merge: MergekitMerge, spec: MkMethod, top: dict, dropped: list[str]) -> None:
    """Every mergekit parameter of the config, resolved to hubsoup's (single-scope chains; slices: per slice later).

    A parameter the method does not declare, or a whole-merge parameter given for one model, is
    dropped into ``dropped``: mergekit resolves only the parameters a method declares, each at the
    scopes it is looked up at, and never reads the others."""
    known = set(spec.params)
    scopes: list[tuple[dict, str, bool]] = [(top, "parameters", False)]
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
            if multi and any(name in sl.parameters for sl in merge.slices):
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
        if multi and any(name in x for sl in merge.slices for x in (sl.parameters, *(s.parameters for s in sl.sources))):
            merge.guarded.append(name)  # per-slice values: resolved with the models' tensor names
        merge.params[p.hub] = values[0] if merge.merge_method == "passthrough" else values


# --- the layout: slices → output tensors ------------------------------------------------------------

class MergekitLayout:
    """How a mergekit config lays out the output: its plan (slices renumber layers), output config, tokenizer.

    Passed to :func:`hubsoup.merge` as ``layout``: ``plan()`` gives the plan the one engine streams
    (for ``models`` configs, the base's own plan), ``donors`` the other checkpoints it reads
    from, ``finish()`` fixes the output folder (layer count, tokenizer, chat template).
    """

    def __init__(self, merge: MergekitMerge):
        self.merge = merge
        self.donors: list = []
        self.copy_tokenizer = True
        """False (``--no-copy-tokenizer``): the output holds no tokenizer files, as with mergekit-yaml."""
        self._num_layers: int | None = None
        self._vocab = self._vocab_layout() if merge.vocab is not None else None
        self._views: dict[str, Any] = {}
        self._base_config: dict | None = None
        """The models as :meth:`open_inputs` opened them (re-mapped, tied tensors aliased), by reference."""

    # --- the merged vocabulary (tokenizer_source / tokenizer): hubsoup.formats.mergekit_vocab ---------

    def _vocab_layout(self) -> VocabLayout:
        merge = self.merge
        spec = merge.vocab
        if merge.slices is None:  # mergekit: the models, then base_model when it is not one of them
            sources = [s.model for s in merge.models_mode_sources]
            first = last = sources + ([spec.base_model] if spec.base_model and spec.base_model not in sources else [])
        else:
            first = [s.model for s in merge.slices[0].sources]
            last = [s.model for s in merge.slices[-1].sources]
        first, last = list(dict.fromkeys(first)), list(dict.fromkeys(last))  # a model named twice counts once
        order = list(dict.fromkeys(([spec.base_model] if spec.base_model else []) + first
                                   + [s.model for sl in merge.slices or [] for s in sl.sources] + last))
        module = merge.module
        if spec.referenced:  # one module of several: the vocabulary of every module's models
            order = list(dict.fromkeys(spec.referenced + order))

        def group(name: str) -> list[str]:  # the embeddings: the first slice's models; the head: the last's
            if module is not None:  # a module's: its pre_weights the first slice's, the others the last's
                return first if any(w.name == name and w.part == "pre" for w in module.weights) else last
            return first if _before(name) else last

        if module is not None:
            return VocabLayout(merge, spec, order, group, module.vocab.__contains__, module.vocab_key)
        return VocabLayout(merge, spec, order, group)

    @property
    def reads(self) -> list:
        """Every checkpoint the output is made from beyond the inputs and the base: the models slices copy
        from and a tokenizer source (never to be overwritten by the output, pinned like the inputs)."""
        tok = self._vocab.source_ckpt if self._vocab is not None else None
        return [*self.donors, *([tok] if tok is not None else [])]

    @property
    def opens_inputs(self) -> bool:
        """Whether :func:`hubsoup.merge` must open the inputs through :meth:`open_inputs` (a merged vocabulary,
        or a module whose tied tensors a model may not store)."""
        return self._vocab is not None or self.merge.module is not None

    def _ties(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The models of a module's merge, each seen as that module's tensors only (mergekit reads no other),
        with the module's tied tensors it does not store read from their tie source (mergekit's
        ``tied_names``: T5's ``encoder.embed_tokens.weight`` from ``shared.weight``); an optional one only
        when some model of the merge stores it, as mergekit plans it."""
        module = self.merge.module
        if module is None:
            return raw
        merge = self.merge
        mine = [r for r in dict.fromkeys([*([merge.base] if merge.base else []),
                                          *(s.model for s in merge.models_mode_sources),
                                          *(s.model for sl in merge.slices or [] for s in sl.sources)]) if r in raw]
        aliases: dict[str, dict[str, str]] = {r: {} for r in raw}
        for w in module.tied:
            if w.optional and not any(raw[r].has(n) for r in mine for n in (w.name, *w.stored_as)):
                continue
            for r, c in raw.items():
                if not c.has(w.name):
                    src = next((n for n in w.sources if c.has(n)), None)
                    if src is not None:
                        aliases[r][w.name] = src
        for r, a in aliases.items():
            if a:
                log.info("mergekit config: '%s' does not store %s: read from %s, as mergekit reads tied tensors",
                         r, ", ".join(a), ", ".join(dict.fromkeys(a.values())))
        return {r: AliasedCheckpoint(c, aliases[r], module.holds) for r, c in raw.items()}

    def _open_tied(self, opts, monitor=None) -> dict[str, Any]:
        """Every model of a module's merge opened (headers only), seen as the module (:meth:`_ties`)."""
        merge = self.merge
        refs = [merge.base] if merge.base else []
        refs += [s.model for s in merge.models_mode_sources] + [s.model for sl in merge.slices or [] for s in sl.sources]
        raw = {r: open_adapted(r, open_input, allow_pickle=opts.allow_pickle, token=opts.token, monitor=monitor,
                               headers_only=True, role="base" if r == merge.base else "input")
               for r in dict.fromkeys(refs)}
        return self._ties(raw)

    def open_inputs(self, inputs, base, opts, monitor=None):
        """The base and the inputs' task vectors, every model seen through the merged vocabulary (re-mapped
        rows) and with a module's tied tensors it does not store (:meth:`_ties`)."""

        views = self._vocab.open(opts, monitor, wrap=self._ties) if self._vocab is not None \
            else self._open_tied(opts, monitor)
        self._views = views
        specs = [views.get(i, i) for i in inputs]  # a LoRA (base+adapter) input: the adapter, as is
        if self._vocab is not None:  # ... unless it changes the embeddings: then the base with the adapter
            specs = [self._adapted_view(i, views) or s for i, s in zip(inputs, specs)]  # applied, re-mapped
        base_ckpt, sources = open_models(specs, base=views[base], allow_pickle=opts.allow_pickle,
                                         ignore_extra=opts.ignore_extra, shape_mismatch=opts.shape_mismatch,
                                         token=opts.token, headers_only=True,
                                         monitor=monitor if any(isinstance(s, str) for s in specs) else None)
        if self._vocab is not None:
            self._vocab.check_sources(sources)
        return base_ckpt, sources

    def _adapted_view(self, spec: str, views: dict[str, Any]) -> Any:
        """A ``base+adapter`` input (else merged as the adapter alone): the base with the adapter applied,
        re-mapped as a model of its own (mergekit merges the adapter into the base first and reads that model's
        rows by the base's tokenizer: its embeddings if the adapter saves them, ``modules_to_save`` or trainable
        tokens, and the default rows of the tokens the base lacks); None for any other input."""
        base = self.merge.base
        for ref, view in views.items():
            model, sep, adapter = ref.partition("+")
            if sep and model == base and adapter == spec:
                return view
        return None

    @property
    def hashed(self) -> dict[str, Any]:
        """What the recipe hash must cover beyond method, parameters and inputs."""
        out: dict[str, Any] = {}
        if self.merge.slices is not None and not self._trivial_slices():
            out["layout"] = [[[s.model, *s.layer_range] for s in sl.sources] for sl in self.merge.slices]
            # the models a slice copies from without merging: pinned (Hub SHA, or folder) like the inputs
            out["donors"] = [{k: v for k, v in c.ref.to_dict().items() if k in ("repo_id", "sha", "path") and v}
                             for c in self.donors]
        if self._vocab is not None:
            out["tokenizer"] = self._vocab.hashed()
        if self.merge.chat_template:
            out["chat_template"] = self.merge.chat_template
        return out

    def recipe_extra(self) -> dict[str, Any]:
        return {"config": self.merge.text}

    def _trivial_slices(self, num_layers: int | None = None) -> bool:
        """One slice taking every layer of every model: the same as ``models`` (no renumbering)."""
        sl = self.merge.slices
        if sl is None:
            return True
        n = num_layers if num_layers is not None else self._num_layers
        return (len(sl) == 1 and len(sl[0].sources) > 1 and n is not None
                and all(s.layer_range == (0, n) for s in sl[0].sources))

    def check_sources(self, token: Token = None, allow_pickle: bool = False) -> tuple | None:
        """Read the sliced models' configs (layer ranges within each model's depth); returns their naming.

        The naming: ``(stack, layer suffixes, names before the layers, names after)`` of the
        first sliced model, from its safetensors headers (no weight is read).
        """
        if self.merge.slices is None:
            return None

        naming = None
        for i, sl in enumerate(self.merge.slices):
            for j, s in enumerate(sl.sources):
                ckpt = open_input(s.model.split("+")[0], allow_pickle=allow_pickle, token=token)
                n = _depth(ckpt, self.merge.module)
                if n is not None and s.layer_range[1] > n:
                    raise ParameterError(f"mergekit config: 'slices[{i}].sources[{j}].layer_range' = "
                                         f"{list(s.layer_range)} but '{s.model}' has {n} layers")
                if naming is None:
                    naming = _naming(ckpt, self.merge.module)
        return naming

    def plan(self, base, sources, opts):
        """The plan of the output (the base's own for ``models``), with every donor checkpoint opened."""

        if self.merge.chat_template == "auto":
            self.merge.chat_template_text = self._auto_chat_template(base, opts)
        module = self.merge.module
        self._base_config = base.config
        self._num_layers = _layers(base.config) if module is None else _depth(base, module)
        if self._trivial_slices():
            if module is None:
                return Plan.of(base, opts.device)
            return _module_plan(base, module, opts.device)
        return self._slice_plan(base, sources, opts)

    def _slice_plan(self, base, sources, opts):
        merge = self.merge
        ref_model = merge.inputs[0] if merge.merge_method == "passthrough" else (merge.base or merge.inputs[0])
        keys = [k for k in base.keys() if merge.module is None or merge.module.holds(k)]
        stack, suffixes, pre, post = _naming(base, merge.module)

        # the checkpoints θ₀ may come from: the base (-1) or a donor (every other model named by a slice)
        origin: dict[str, int] = {ref_model: -1}
        for sl in merge.slices:
            for s in sl.sources:
                if s.model not in origin:
                    ckpt = self._views.get(s.model) or \
                        open_adapted(s.model, open_input, allow_pickle=opts.allow_pickle, token=opts.token)
                    origin[s.model] = len(self.donors)
                    self.donors.append(ckpt)
        n_in = len(merge.inputs)

        def ckpt_of(model: str):
            return base if origin[model] < 0 else self.donors[origin[model]]

        out: dict[str, TensorSource] = {}
        infos: dict[str, Any] = {}
        have = {id(c): set(c.keys()) for c in (base, *self.donors)}

        def checked(s: Source, tensor: str, name: str):
            """The tensor a slice takes from ``s.model``: it exists, and has the shape of the output's (the
            base's) tensor in its place — models of another size cannot be stacked, whatever their configs say."""
            ckpt = ckpt_of(s.model)
            if tensor not in have[id(ckpt)]:
                raise ParameterError(f"mergekit config: a slice takes {short(tensor)} from {short(s.model)}, which "
                                     f"has no such tensor (layer_range {list(s.layer_range)} beyond its layers?)")
            info = ckpt.info(tensor)
            ref = name if offset_free(name) else f"{stack}.0.{name}"
            if ref in have[id(base)] and tuple(base.info(ref).shape) != tuple(info.shape):
                raise ParameterError(f"mergekit config: a slice takes {short(tensor)} of shape {list(info.shape)} "
                                     f"from {short(s.model)}, but the output is laid out as '{base.label}', whose "
                                     f"'{ref}' is {list(base.info(ref).shape)}: models of different sizes (hidden "
                                     "size, heads, ...) cannot be stacked")
            return info

        def offset_free(name: str) -> bool:
            return name in pre or name in post

        def add(name: str, sl: Slice, offset: int | None, position: float | None) -> None:
            def src_name(s: Source) -> str:
                return name if offset is None else f"{stack}.{s.layer_range[0] + offset}.{name}"

            out_name = name if offset is None else f"{stack}.{k_out}.{name}"
            if len(sl.sources) == 1 or merge.merge_method == "passthrough":
                s = sl.sources[0]
                ts = TensorSource(src_name(s), (None,) * n_in, position, origin[s.model])
                infos[out_name] = checked(s, src_name(s), name)
            else:
                by_model = {s.model: s for s in sl.sources}
                for s in sl.sources:
                    checked(s, src_name(s), name)
                r = by_model[ref_model]
                names = tuple(src_name(by_model[m]) if m in by_model else None for m in merge.inputs)
                ts = TensorSource(src_name(r), names, position, -1)
                infos[out_name] = base.info(src_name(r))
            out[out_name] = ts

        # a layer tensor some of the base's own layers lack (T5's relative_attention_bias, layer 0's only) is

        depth = {b[1] for k in keys if (b := block_of(k)) and b[0] == stack}
        optional = {suf for suf in suffixes if any(f"{stack}.{i}.{suf}" not in have[id(base)] for i in depth)}
        k_out = 0
        for k in pre:
            add(k, merge.slices[0], None, None)
        for sl in merge.slices:
            a, b = sl.sources[0].layer_range
            n = b - a
            for j in range(n):
                t = j / (n - 1) if n > 1 else 1.0
                for suf in suffixes:
                    if suf in optional and not any(f"{stack}.{s.layer_range[0] + j}.{suf}" in have[id(ckpt_of(s.model))]
                                                   for s in sl.sources):
                        continue
                    add(suf, sl, j, t)
                k_out += 1
        for k in post:
            add(k, merge.slices[-1], None, None)
        self._num_layers = k_out
        config = dict(base.config)
        _set_layers(config, k_out)
        stored = [k for k in keys if k in set(_stored_keys(base))]
        ties = [g for g in tied_groups(base.folder, stored, {k: base.info(k) for k in stored}, base.config)
                if all(n in out for n in g)]
        return layout_plan(out, infos, config, ties=ties, device=opts.device)

    def _auto_chat_template(self, base, opts) -> str | None:
        """``chat_template: auto``: the template most of the config's models carry (config order breaks ties)."""

        refs = [r.split("+")[0] for r in _referenced(self.merge)]
        folders = []
        for ref in refs:
            if ref == self.merge.base:
                folders.append((ref, base.folder))
            else:
                ckpt = open_input(ref, allow_pickle=opts.allow_pickle, token=opts.token, with_tokenizer=True,
                                  headers_only=True)
                folders.append((ref, ckpt.folder))
        found = chat_template.plurality((ref, chat_template.template_of(f)) for ref, f in folders)
        if found is None:
            log.warning("mergekit config: chat_template: auto, but none of the models has a chat template: "
                        "the tokenizer keeps its own")
            return None
        log.warning("mergekit config: chat_template: auto chose the template of '%s' (%d of %d models carry it)",
                    found[0], sum(chat_template.template_of(f) == found[1] for _, f in folders), len(folders))
        return found[1]

    def finish(self, folder: str) -> None:
        """The output's config (layer count, vocabulary size), tokenizer (``tokenizer_source``) and chat template."""
        cfg_path = os.path.join(folder, "config.json")
        if self._num_layers is not None and self.merge.slices is not None and self.merge.module is None \
                and os.path.isfile(cfg_path):  # a module's layer count: set when the modules are assembled
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
            _set_layers(cfg, self._num_layers)
            with open(cfg_path, "w", encoding="utf-8") as f:
                json.dump(cfg, f, indent=2)
        if self.merge.config_dtype is not None and os.path.isfile(cfg_path):
            self._name_config_dtype(cfg_path)
        if self._vocab is not None:  # the merged vocabulary's tokenizer and config.json's vocab_size: written
            self._vocab.finish(folder)  # with --no-copy-tokenizer too, as mergekit writes a merged tokenizer
        elif not self.copy_tokenizer:
            _remove_tokenizer_files(folder)
            return
        if self.merge.chat_template:  # mergekit then saves the tokenizer again (not a file copy), template or not
            # lazy: transformers costs ~4 s to import here (torch ~6 s); only a config's tokenizer source needs it
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(folder)
            if self.merge.chat_template_text:
                tok.chat_template = self.merge.chat_template_text
            tok.save_pretrained(folder)

    def _name_config_dtype(self, cfg_path: str) -> None:
        """config.json's dtype as mergekit writes it beside a float32 result: the config's ``dtype``, else the
        base's own (mergekit sets it only from ``out_dtype`` or ``dtype``)."""
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        want = self.merge.config_dtype
        if want == "base":
            base = getattr(self, "_base_config", None) or {}
            for key in ("dtype", "torch_dtype"):
                if key in base:
                    cfg[key] = base[key]
                else:
                    cfg.pop(key, None)
        else:
            cfg["dtype"] = want
            if "torch_dtype" in cfg:
                cfg["torch_dtype"] = want
        with open(cfg_path, "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)

    def card_section(self) -> dict[str, str]:
        """The card's section showing the config as YAML (what community cards carry)."""
        return {"title": "mergekit configuration",
                "body": "This model was merged by hubsoup from the following mergekit configuration, with "
                        "mergekit's semantics:\n\n```yaml\n" + public_config_text(self.merge.text).rstrip()
                        + "\n```" + ("\n\nIgnored, as mergekit ignores them: "
                                     + ", ".join(f"`{k}`" for k in self.merge.ignored) + "."
                                     if self.merge.ignored else "")}


def _remove_tokenizer_files(folder: str) -> None:
    """Remove the tokenizer files copied from the base into an output folder (its config stays)."""

    for fname in _COPY_FROM_BASE:
        if fname not in ("config.json", "generation_config.json", "preprocessor_config.json"):
            p = os.path.join(folder, fname)
            if os.path.isfile(p):
                os.remove(p)


def _referenced(merge: MergekitMerge) -> list[str]:
    """Every model the config names, once each, in the config's order (base_model first)."""
    data = load_yaml(merge.text, "mergekit config")
    refs = [data.get("base_model")] if isinstance(data, dict) and data.get("base_model") else []
    refs += [s.model for s in merge.models_mode_sources]
    refs += [s.model for sl in merge.slices or [] for s in sl.sources]
    return list(dict.fromkeys(r for r in refs if isinstance(r, str)))


def _naming(ckpt, module: Any = None) -> tuple[str, list[str], list[str], list[str]]:
    """``(stack, layer suffixes, names before the layers, names after)`` of a checkpoint (or of one of its
    modules) with one stack of layers."""

    keys = [k for k in ckpt.keys() if module is None or module.holds(k)]
    stacks = {block_of(k)[0] for k in keys if block_of(k)}
    if len(stacks) != 1:
        raise ParameterError(f"mergekit config: slices need a model with one stack of layers; "
                             f"'{ckpt.label}' has {len(stacks)} ({', '.join(sorted(stacks))})")
    stack = stacks.pop()
    suffixes = [k[len(f"{stack}.0."):] for k in keys if block_of(k) == (stack, 0)]
    others = [k for k in keys if not block_of(k)]
    before = module.before if module is not None else ()
    pre = [k for k in others if _before(k) or k.startswith(before)]
    return stack, suffixes, pre, [k for k in others if k not in pre]


def _guard_params(merge: MergekitMerge, spec: MkMethod, stack: str, suffixes: list[str], pre: list[str],
                  post: list[str]) -> None:
    """Per-slice settings of several slices as one schedule per parameter, each entry guarded by its slice's tensors.

    A slice's entries match only its own output tensors: an unfiltered entry through each of its
    layers' prefix (``model.layers.5.``) and its non-layer tensors' names (the first slice's
    embeddings, the last slice's head); a filtered one through every such tensor the filter matches.
    The top-level parameters follow, unguarded: mergekit's precedence, tensor by tensor.
    """
    slices = merge.slices
    groups: list[list[str]] = []
    k = 0
    for i, sl in enumerate(slices):
        n = sl.sources[0].layer_range[1] - sl.sources[0].layer_range[0]
        prefixes = [f"{stack}.{k + j}." for j in range(n)]
        k += n
        names = ([*pre] if i == 0 else []) + ([*post] if i == len(slices) - 1 else [])
        groups.append([*prefixes, *names])

    def full_names(group: list[str]) -> list[str]:
        return [g + suf for g in group if g.endswith(".") for suf in suffixes] + [g for g in group if not g.endswith(".")]

    for name in merge.guarded:
        p = spec.params[name]
        per_model = p.per_input and merge.merge_method != "passthrough"
        owners = merge.inputs if per_model else [None]
        values = []
        for inp in owners:
            entries: list[dict] = []
            covered = True
            for i, sl in enumerate(slices):
                if merge.merge_method == "passthrough":
                    parts = [sl.sources[0].parameters.get(name)]
                else:
                    parts = [s.parameters.get(name) for s in sl.sources if per_model and s.model == inp and len(sl.sources) > 1]
                parts.append(sl.parameters.get(name))
                chain: list[dict] = []
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


def _before(name: str) -> bool:
    return before_blocks(name)


def _layers(config: dict) -> int | None:
    for k in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(config.get(k), int):
            return config[k]
    return None


def _depth(ckpt, module: Any = None) -> int | None:
    """The model's (or module's) layer count: its config's, or (a config without one) counted from its tensors' names."""
    n = _layers(ckpt.config) if module is None else _config_value(ckpt.config, module.layers_key)
    if isinstance(n, int) and not isinstance(n, bool):
        return n

    indices = [b[1] for k in ckpt.keys() if (module is None or module.holds(k)) and (b := block_of(k))]
    return max(indices) + 1 if indices else None


def _config_value(config: dict, key: str | None) -> Any:
    """A dotted key's value in a config (``text_config.num_hidden_layers``), or None."""
    node: Any = config
    for part in (key or "").split(".") if key else []:
        node = node.get(part) if isinstance(node, dict) else None
    return node if key else None


def _module_plan(base, module: Any, device: str):
    """The plan of one module of ``base``: its tensors, laid out as in the base."""
    keys = [k for k in base.keys() if module.holds(k)]
    infos = {k: base.info(k) for k in keys}
    stored = _stored_keys(base)  # a tied name read from its tie source is merged on its own, as in mergekit
    ties = [g for g in tied_groups(base.folder, stored, {k: base.info(k) for k in stored}, base.config)
            if all(module.holds(n) for n in g)]
    return build_plan(keys, infos, base.config, ties=ties, device=device)


def _stored_keys(ckpt) -> list[str]:
    """The tensors a checkpoint stores (not those a view reads from a tie source: :class:`AliasedCheckpoint`)."""
    aliased = getattr(ckpt, "tie_aliases", None) or {}
    return [k for k in ckpt.keys() if k not in aliased]


def _set_layers(config: dict, n: int) -> None:
    for k in ("num_hidden_layers", "n_layer", "num_layers"):
        if k in config:
            config[k] = n
            return
    config["num_hidden_layers"] = n


# --- running ----------------------------------------------------------------------------------------

def check_hub_only(data: Any) -> None:
    """In a ``hub_only`` run, refuse a parsed config naming any model (a LoRA's too) that is not a Hub repo ID."""

    if not hub_only():
        return

    def check(ref: Any) -> Any:
        if isinstance(ref, str):
            for part in ref.strip().split("+"):
                require_hub_id(part, "mergekit config: model")
        return ref

    _map_models(data, check)


# --- writing: a hubsoup recipe as a mergekit config -------------------------------------------------

@dataclass
class _Export:
    """One recipe on its way to a mergekit config: what each method's entry of :data:`EXPORTS` fills in."""

    method: str
    p: dict[str, Any]
    base: str | None
    inputs: list[str]
    cfg: dict[str, Any] = field(default_factory=dict)
    per: dict[str, list[Any]] = field(default_factory=dict)
    """Per-model parameters, one value per input."""

    @property
    def n(self) -> int:
        return len(self.inputs)

    def weights(self, default: float = 1.0) -> list[Any]:
        w = self.p.get("weights")
        return list(w) if w is not None else [default] * self.n

    def per_input(self, name: str, hub_tuple: str, hub_scalar: str | None) -> None:
        v = self.p.get(hub_tuple)
        if v is None and hub_scalar is not None:
            v = [self.p[hub_scalar]] * self.n
        if v is not None:
            self.per[name] = list(v)

    def fail(self, why: str) -> None:
        raise ParameterError(f"method '{self.method}'{why} has no mergekit equivalent; export-config cannot write it")


def _export_linear(x: _Export) -> None:
    p, cfg, per = x.p, x.cfg, x.per
    if p.get("normalize", True):
        cfg.update(merge_method="linear", parameters={"normalize": True})
        per["weight"] = x.weights()
        x.base = None
    elif p.get("combine") == "models":
        cfg.update(merge_method="linear", parameters={"normalize": False})
        per["weight"] = x.weights()
        x.base = None
    else:
        cfg.update(merge_method="task_arithmetic")
        per["weight"] = x.weights()


def _export_task_arithmetic(x: _Export) -> None:
    p = x.p
    lam = default_scale(x.n) if p.get("scale") is None else p["scale"]  # hubsoup's 1/N, written out
    x.cfg.update(merge_method="task_arithmetic", parameters={"lambda": lam,
                                                             "normalize": bool(p.get("normalize"))})
    x.per["weight"] = x.weights()


def _export_wise_ft(x: _Export) -> None:  # (1 − γ)θ₀ + γθ₁ = θ₀ + γτ: task arithmetic with weight γ
    x.cfg.update(merge_method="task_arithmetic", parameters={"lambda": 1.0, "normalize": False})
    x.per["weight"] = [x.p.get("gamma", 0.5)]


def _export_soup(x: _Export) -> None:
    x.cfg.update(merge_method="task_arithmetic", parameters={"lambda": _scale_of(x.p), "normalize": True})
    x.per["weight"] = [1.0] * x.n


def _export_ties(x: _Export) -> None:
    p = x.p
    if p.get("convention") != "mergekit" or p.get("scope") != "tensor":
        x.fail(" with convention=paper or scope=model (hubsoup's TIES; mergekit elects signs on weighted "
               "deltas, per tensor: use convention=mergekit scope=tensor)")
    x.cfg.update(merge_method="ties", parameters={"normalize": p.get("merge") == "mean",
                                                  "lambda": _scale_of(p), "rescale": bool(p.get("rescale"))})
    if p.get("merge") not in ("mean", "sum"):
        x.fail(f" with merge={p.get('merge')}")
    x.per["weight"] = x.weights()
    x.per_input("density", "densities", "density")


def _export_dare(x: _Export) -> None:
    p, cfg, per = x.p, x.cfg, x.per
    if p.get("convention") != "mergekit":
        x.fail(" with convention=paper (mergekit's DARE rescales to keep each tensor's L1 norm: use "
               "convention=mergekit)")
    then = p.get("then")
    if then not in ("ties", "sum"):
        x.fail(f" with then={then}")
    cfg["merge_method"] = "dare_ties" if then == "ties" else "dare_linear"
    params = {"lambda": _scale_of(p), "rescale": bool(p.get("rescale", True))}
    params["normalize"] = p.get("merge") == "mean" if then == "ties" else bool(p.get("normalize"))
    cfg["parameters"] = params
    per["weight"] = x.weights()
    if p.get("densities") is not None:
        per["density"] = list(p["densities"])
    else:
        per["density"] = [round(1.0 - float(p.get("p", 0.9)), 12)] * x.n


def _export_sparsified(x: _Export) -> None:  # breadcrumbs, breadcrumbs_ties, della, della_linear: mergekit's names
    p, method = x.p, x.method
    x.cfg.update(merge_method=method, parameters={"lambda": _scale_of(p), "normalize": bool(p.get("normalize")),
                                                  "rescale": bool(p.get("rescale"))})
    x.per["weight"] = x.weights()
    x.per_input("density", "densities", "density")
    if method.startswith("breadcrumbs"):
        x.per_input("gamma", "gammas", "gamma")
    else:
        x.per_input("epsilon", "epsilons", "epsilon")


def _export_named(*keys: str, use_base: bool = True) -> Callable[[_Export], None]:
    """A method mergekit has under the same name, whose ``keys`` are passed as they are."""
    def export(x: _Export) -> None:
        x.cfg.update(merge_method=x.method, parameters={k: x.p[k] for k in keys if k in x.p})
        if not use_base:
            x.base = None
    return export


def _export_interpolation(*keys: str) -> Callable[[_Export], None]:  # nuslerp, multislerp: weights, maybe a base
    def export(x: _Export) -> None:
        x.cfg.update(merge_method=x.method, parameters={k: x.p[k] for k in keys if k in x.p})
        x.per["weight"] = x.weights()
        if not x.p.get("use_base", True):
            x.base = None
    return export


def _export_slerp(x: _Export) -> None:
    x.cfg.update(merge_method="slerp", parameters={"t": x.p.get("t", 0.5)})
    if x.n == 2:  # hubsoup interpolates input 0 → input 1: mergekit's base_model is the t = 0 end
        x.base = x.inputs[0]
        x.inputs = x.inputs[1:]


def _export_passthrough(x: _Export) -> None:
    x.cfg.update(merge_method="passthrough")
    if x.p.get("weight_scale", 1.0) != 1.0:
        x.per["scale"] = [x.p["weight_scale"]]
    x.base = None


EXPORTS: dict[str, Callable[[_Export], None]] = {
    "linear": _export_linear,
    "task_arithmetic": _export_task_arithmetic,
    "wise_ft": _export_wise_ft,
    "soup": _export_soup,
    "ties": _export_ties,
    "dare": _export_dare,
    "breadcrumbs": _export_sparsified,
    "breadcrumbs_ties": _export_sparsified,
    "della": _export_sparsified,
    "della_linear": _export_sparsified,
    "model_stock": _export_named("filter_wise"),
    "sce": _export_named("select_topk"),
    "karcher": _export_named("max_iter", "tol", use_base=False),
    "nuslerp": _export_interpolation("nuslerp_flatten", "nuslerp_row_wise"),
    "multislerp": _export_interpolation("normalize_weights", "eps"),
    "slerp": _export_slerp,
    "passthrough": _export_passthrough,
    "arcee_fusion": _export_named(),
    "nearswap": _export_named("t"),
    "ram": _export_named("epsilon"),
    "ramplus_tl": _export_named("r", "alpha", "epsilon"),
}
"""How each hubsoup method is written as a mergekit config (``hubsoup export-config``): one entry per method
mergekit has, instead of a chain of conditions on method names; a method not here has no mergekit equivalent."""


def export_config(recipe, out_dtype: str | None = None) -> str:
    """The mergekit config equivalent of a hubsoup :class:`~hubsoup.recipe.Recipe`.

    A recipe made from a mergekit config gives that config back. Otherwise the method and
    parameters are mapped onto mergekit's (see :data:`EXPORTS`); a method or option with no
    mergekit equivalent raises :class:`~hubsoup.errors.ParameterError` naming it. hubsoup
    computes in float32, and mergekit in its ``dtype``: the config says ``dtype: float32`` (the
    method's ``compute_dtype`` where the recipe sets one) and stores the output as hubsoup did with
    ``out_dtype`` (the recipe's dtype, else ``out_dtype``, the output's stored dtype, when the caller
    knows it).
    """
    if recipe.mergekit.get("config"):
        return recipe.mergekit["config"]
    if recipe.options.get("shape_mismatch") not in (None, "error"):
        raise ParameterError("recipe option 'shape_mismatch' has no mergekit equivalent")
    method = recipe.method
    export = EXPORTS.get(method)
    if export is None:
        raise ParameterError(f"method '{method}' has no mergekit equivalent; export-config writes only methods "
                             f"mergekit has ({', '.join(sorted(METHODS))})")
    x = _Export(method, dict(recipe.params), recipe.base.pinned_spec, [i.pinned_spec for i in recipe.inputs])
    export(x)
    p, cfg, per, base, inputs = x.p, x.cfg, x.per, x.base, x.inputs  # p: main's tail reads compute_dtype from it
    if not cfg.get("parameters"):
        cfg.pop("parameters", None)
    models = []
    for i, ref in enumerate(inputs):
        entry: dict[str, Any] = {"model": ref}
        params = {k: v[i] for k, v in per.items() if i < len(v)}
        if params:
            entry["parameters"] = params
        models.append(entry)
    out: dict[str, Any] = {"merge_method": cfg["merge_method"]}
    if base is not None:
        out["base_model"] = base
    out["models"] = models
    if cfg.get("parameters"):
        out["parameters"] = cfg["parameters"]
    compute = p.get("compute_dtype") or "float32"  # mergekit computes in `dtype`: hubsoup's own arithmetic's
    if compute != "inputs":  # (none: mergekit computes in the inputs' dtype, as compute_dtype=inputs does)
        out["dtype"] = compute
    stored = recipe.dtype or out_dtype
    result = METHODS[out["merge_method"]].result_dtype if out["merge_method"] in METHODS else None
    if stored:
        stored = _DTYPES.get(stored, stored)
        # mergekit stores in `dtype` (none: the inputs'), or what its kernel returns (result_dtype), unless
        # out_dtype says
        if stored != (result or out.get("dtype")):
            out["out_dtype"] = stored
    return "# mergekit config written by hubsoup export-config (recipe " + recipe.hash[:12] + ")\n" + dump_config(out)
