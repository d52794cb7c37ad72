"""Is an input a fine-tune of this base? Configs, names and shapes checked before any weight is read.

:func:`task_vector` turns an opened input into its task-vector source (a
:class:`~hubsoup.sources.taskvector.FullDelta` or a LoRA
:class:`~hubsoup.sources.lora.LoraDelta`) after checking it against the base;
:func:`resolve_base` finds the base the inputs' cards name.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Sequence

from hubsoup.errors import BaseModelError, BaseNotNamedError, IncompatibleInputError, ParameterError
from hubsoup.hubclient import Token, parse_spec
from hubsoup.sources.access import hub_only
from hubsoup.sources.adapted import open_adapted
from hubsoup.sources.checkpoint import Checkpoint
from hubsoup.sources.lora import lora_source
from hubsoup.sources.resolve import REPO_ID, open_input
from hubsoup.sources.taskvector import FullDelta, shape_message

if TYPE_CHECKING:
    import torch

    from hubsoup.progress import Monitor
    from hubsoup.sources.checkpoint import TensorInfo
    from hubsoup.sources.lora import LoraDelta

log = logging.getLogger(__name__)

# Config fields that must agree between the base and every input (first one present counts).
_ARCH_FIELDS = {
    "hidden size": ("hidden_size", "n_embd", "d_model", "dim"),
    "number of layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "number of decoder layers": ("num_decoder_layers", "decoder_layers"),
    "attention heads": ("num_attention_heads", "n_head", "num_heads"),
    "intermediate size": ("intermediate_size", "n_inner", "d_ff", "ffn_dim"),
}
def _pick(cfg: dict[str, Any], keys: Sequence[str]) -> Any:
    for k in keys:
        if k in cfg:
            return cfg[k]
    return None


def check_config(base: Checkpoint, ckpt: Checkpoint) -> None:
    """Refuse an input whose architecture differs from the base's, before any weight is read."""
    b, c = base.config, ckpt.config
    if c.get("quantization_config") and not b.get("quantization_config"):
        method = (c["quantization_config"] or {}).get("quant_method", "?") if isinstance(c["quantization_config"], dict) else "?"
        raise IncompatibleInputError(
            f"input '{ckpt.label}' is quantized ({method}; config.json has quantization_config) but the base "
            f"'{base.label}' is not: a quantized checkpoint? Its weights are not a fine-tune's; merge the "
            "full-precision fine-tune")
    if b.get("model_type") and c.get("model_type") and b["model_type"] != c["model_type"]:
        raise IncompatibleInputError(
            f"input '{ckpt.label}' is a {c['model_type']} model but the base '{base.label}' is {b['model_type']}; "
            "all inputs must be fine-tunes of the same base")
    for what, keys in _ARCH_FIELDS.items():
        bv, cv = _pick(b, keys), _pick(c, keys)
        if bv is not None and cv is not None and bv != cv:
            raise IncompatibleInputError(
                f"input '{ckpt.label}' has {what} {cv} but the base '{base.label}' has {bv}; "
                "it is not a fine-tune of this base")


def base_model_claims(ckpt: Checkpoint) -> list[str]:
    """Base models an input names for itself (card ``base_model``, adapter config)."""
    claims = []
    bm = ckpt.card_metadata().get("base_model")
    if isinstance(bm, str) and bm.strip():  # peft writes `base_model: ''` when it did not know
        claims.append(bm)
    elif isinstance(bm, list) and len(bm) == 1 and bm[0]:
        claims.append(bm[0])
    adapter = ckpt.read_json("adapter_config.json") or {}
    if adapter.get("base_model_name_or_path"):
        claims.append(adapter["base_model_name_or_path"])
    return claims


def resolve_base(inputs: list[Checkpoint]) -> str:
    """The base the inputs' cards (or adapter configs) name; they must agree.

    A base named by a Hub input must be a Hub repo ID: a remote card cannot make hubsoup merge
    onto (and push the tokenizer of) a folder of this machine. Only a local input's card may
    name a local folder. See :func:`resolve_base_spec` for whether it must be opened from the Hub.
    """
    return resolve_base_spec(inputs)[0]


def resolve_base_spec(inputs: list[Checkpoint]) -> tuple[str, bool]:
    """``(base, hub_only)``: the base the inputs name, and whether a Hub input named it (then only the Hub is asked)."""
    named = {}
    remote = False
    for ckpt in inputs:
        claims = base_model_claims(ckpt)
        if not claims:
            raise BaseNotNamedError(
                f"input '{ckpt.label}' does not say which base model it was fine-tuned from "
                "(no base_model in its model card, no base_model_name_or_path in an adapter_config.json); "
                "pass --base ORG/NAME or a folder")
        claim = claims[0]
        if ckpt.ref.repo_id:
            remote = True
            repo_id = parse_spec(claim)[0] if isinstance(claim, str) else ""
            if (not isinstance(claim, str) or claim.startswith((".", "/", "~", "\\")) or os.path.isabs(claim)
                    or repo_id.count("/") > 1 or ".." in repo_id or not REPO_ID.match(repo_id)):
                raise BaseModelError(
                    f"input '{ckpt.label}' names its base as {claim!r}, which is not a Hub repo ID; a Hub repo "
                    "cannot choose a local folder as the base: pass --base ORG/NAME or a folder")
        named[ckpt.label] = claim
    if len(set(named.values())) > 1:
        detail = ", ".join(f"{k} -> {v}" for k, v in named.items())
        raise BaseModelError(f"inputs disagree on their base model ({detail}); pass --base to choose one")
    return next(iter(named.values())), remote


def check_out_is_no_input(out: str, base: Checkpoint, sources: Sequence[Any]) -> None:
    """Refuse an output folder that is, or contains, an input or the base (``--overwrite`` would delete it)."""
    target = os.path.realpath(os.path.expanduser(out))
    ckpts = [("the base", base), *(("input", getattr(s, "ckpt", None) or s) for s in sources)]
    ckpts += [(role, c.adapter) for role, c in ckpts if getattr(c, "adapter", None) is not None]  # model+adapter
    for role, ckpt in ckpts:
        folder = getattr(ckpt, "folder", None)
        ref = getattr(ckpt, "ref", None)
        if not folder or not os.path.isdir(folder):
            continue
        real = os.path.realpath(folder)
        try:
            inside = os.path.commonpath([real, target]) == target
        except ValueError:
            inside = False
        if inside:
            what = "is" if real == target else "contains"
            name = f"{role} '{ref.label}'" if role == "input" and ref is not None else f"{role} '{getattr(ref, 'label', folder)}'"
            raise ParameterError(
                f"output '{out}' {what} {name}; writing the merge there (with --overwrite) would delete it: "
                "choose another --out")


def align_names(base_keys: list[str], ckpt: Checkpoint, ignore_extra: bool) -> dict[str, str]:
    """Map base tensor names to the input's, allowing one leading prefix (``bert.``) either way."""
    keys = ckpt.keys()
    have = set(keys)
    name_map = {k: k for k in base_keys}
    if not set(base_keys) <= have:
        prefixes = {k.split(".", 1)[0] + "." for k in keys if "." in k} | {k.split(".", 1)[0] + "." for k in base_keys if "." in k}
        for p in sorted(prefixes):
            if all((p + k) in have for k in base_keys):
                name_map = {k: p + k for k in base_keys}
                break
            if all(k.startswith(p) and k[len(p):] in have for k in base_keys):
                name_map = {k: k[len(p):] for k in base_keys}
                break
    missing = [k for k, v in name_map.items() if v not in have]
    if missing:
        raise IncompatibleInputError(
            f"input '{ckpt.label}' lacks {len(missing)} tensor(s) the base has, e.g. '{missing[0]}'; "
            "is it a fine-tune of this base, and is its checkpoint complete?")
    extra = sorted(have - set(name_map.values()))
    if extra and not ignore_extra:
        raise IncompatibleInputError(
            f"input '{ckpt.label}' has {len(extra)} tensor(s) the base lacks, e.g. '{extra[0]}' (a task head?); "
            "pass --ignore-extra (ignore_extra=True) to leave them out of the merge")
    if extra:
        log.warning("input %s: ignoring %d tensor(s) the base lacks (e.g. %s)", ckpt.label, len(extra), extra[0])
    return name_map


def task_vector(ckpt: Checkpoint, base: Checkpoint, base_keys: list[str], infos: dict[str, TensorInfo], *,
                 ignore_extra: bool = False, shape_mismatch: str = "error") -> FullDelta | LoraDelta:
    """The task-vector source for one input, after checking its tensors against the base.

    A full checkpoint gives a :class:`FullDelta`; a PEFT LoRA adapter (``adapter_config.json``)
    a :class:`~hubsoup.sources.lora.LoraDelta`, which materialises each adapted tensor's ΔW
    on demand from the adapter's factors (see ``hubsoup/sources/lora.py`` for the checks).
    """
    if ckpt.ref.kind == "lora":
        return lora_source(ckpt, base, base_keys, infos, ignore_extra=ignore_extra)
    if ckpt.ref.kind != "full":
        raise IncompatibleInputError(f"input '{ckpt.label}' is a {ckpt.ref.kind} adapter; such inputs are not supported")
    name_map = align_names(base_keys, ckpt, ignore_extra)
    for k in base_keys:
        shape = tuple(ckpt.info(name_map[k]).shape)
        want = tuple(infos[k].shape)
        if shape != want and (shape_mismatch == "error" or len(shape) != len(want)):
            raise IncompatibleInputError(shape_message(ckpt.label, name_map[k], shape, want))
        check_dtype(ckpt.label, name_map[k], ckpt.info(name_map[k]).dtype, infos[k].dtype)
    return FullDelta(ckpt, name_map, shape_mismatch)


def check_dtype(label: str, name: str, dtype: torch.dtype, base_dtype: torch.dtype) -> None:
    """Refuse an integer (quantized) tensor where the base's is floating point: its values are not weights."""
    if base_dtype.is_floating_point and not dtype.is_floating_point:
        raise IncompatibleInputError(
            f"input '{label}': tensor '{name}' is {str(dtype).replace('torch.', '')} but the base's is "
            f"{str(base_dtype).replace('torch.', '')}: a quantized checkpoint? hubsoup merges floating-point "
            "weights only; merge the full-precision fine-tune (or dequantize it first)")


def open_models(specs: Sequence[str], *, base: str | Checkpoint | None, allow_pickle: bool = False, ignore_extra: bool = False,
                shape_mismatch: str = "error", token: Token = None, monitor: Monitor | None = None,
                headers_only: bool = False) -> tuple[Checkpoint, list[Any]]:
    """Open the base and the inputs, check every input against the base, and return their task vectors.

    ``specs``: specs or opened checkpoints; ``base``: a spec, an opened checkpoint, or None for the base the inputs' cards (or adapter configs) name. Only configs,
    cards and file headers are read here; no weight. ``monitor`` (:class:`hubsoup.progress.Monitor`): the
    downloads of Hub models are its "download" stage (silent, cancellable between files). ``headers_only``
    (planning): Hub models' tensors are known from their safetensors headers on the Hub, so nothing here
    downloads a weight (:func:`hubsoup.sources.resolve.open_input`).
    """
    hub = [s for s in specs if isinstance(s, str) and not is_local(s)]
    base_hub = base is None or (isinstance(base, str) and not is_local(base))
    if monitor is not None:  # metadata, then weights, per Hub model (entered at the first download)
        monitor.expect("download", 2 * (len(hub) + int(base_hub)))

    ckpts = [open_adapted(s, open_input, allow_pickle=allow_pickle, token=token, monitor=monitor,
                          headers_only=headers_only) if isinstance(s, str) else s
             for s in specs]  # or opened already (a re-mapped view)
    warn_duplicates(ckpts)
    if base is not None and not isinstance(base, str):  # opened already
        base_ckpt = base
    elif base:
        base_ckpt = open_base(base, allow_pickle=allow_pickle, token=token, monitor=monitor,
                              headers_only=headers_only)
    else:
        spec, hub_only = resolve_base_spec(ckpts)
        base_ckpt = open_base(spec, allow_pickle=allow_pickle, token=token, hub_only=hub_only, monitor=monitor,
                              headers_only=headers_only)
    for c in ckpts:
        if c.ref.kind == "full":
            check_config(base_ckpt, c)
    base_keys = base_ckpt.keys()
    infos = {k: base_ckpt.info(k) for k in base_keys}
    return base_ckpt, [task_vector(c, base_ckpt, base_keys, infos, ignore_extra=ignore_extra,
                                   shape_mismatch=shape_mismatch) for c in ckpts]


def is_local(spec: Any) -> bool:
    # a hub_only run never looks at the disk for a spec (open_input refuses any that is not a repo ID)
    return not hub_only() and isinstance(spec, str) and os.path.isdir(os.path.expanduser(spec))


def warn_duplicates(ckpts: Sequence[Checkpoint]) -> None:
    """Warn when one model is given twice (same repo and commit, or same folder): it counts twice."""
    seen: dict[tuple[str | None, ...], str] = {}
    for c in ckpts:
        key = ("hub", c.ref.repo_id.lower(), c.ref.sha) if c.ref.repo_id else ("local", os.path.realpath(c.folder))
        if key in seen:
            log.warning("input %s is the same model as %s: it is given twice, so it counts twice in the merge",
                        c.label, seen[key])
        else:
            seen[key] = c.label


def open_base(spec: str, *, allow_pickle: bool = False, token: Token = None,
              hub_only: bool = False, monitor: Monitor | None = None, headers_only: bool = False) -> Checkpoint:
    """The base model (with its tokenizer files); an adapter is refused.

    ``hub_only``: the base was named by a Hub input's card or adapter config, so it is opened
    from the Hub only (never a local folder, see :func:`resolve_base`).
    """
    # a Checkpoint, or for model+adapter an AdaptedCheckpoint (the model's attributes, passed through)
    ckpt: Checkpoint = open_adapted(spec, open_input, allow_pickle=allow_pickle, token=token, with_tokenizer=True,
                                    hub_only=hub_only, role="base", monitor=monitor, headers_only=headers_only)
    if ckpt.ref.kind != "full":
        raise BaseModelError(f"base '{ckpt.label}' is an adapter, not a full model")
    return ckpt
