"""Task vectors of a PEFT LoRA adapter, one base tensor at a time, with peft's exact semantics.

An adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) is read
lazily like any checkpoint: only headers when the merge is planned, and, when the
engine asks for tensor ``name``, just that module's ``lora_A``/``lora_B`` (a few
rank-r rows). Nothing ever builds a ``PeftModel`` or a dense merged copy of the model.

What ``PeftModel.from_pretrained(base, adapter).merge_and_unload()`` does, and so what
:meth:`LoraDelta.delta_into` reproduces for one base tensor ``W`` (τ = result − W):

* ``lora_A``/``lora_B`` of a Linear: ``ΔW = (B @ A) · s``, ``s = lora_alpha / r``, or
  ``lora_alpha / sqrt(r)`` with ``use_rslora``; ``r`` and ``lora_alpha`` per module from
  ``rank_pattern`` / ``alpha_pattern`` (peft's first-match regex ``(.*\\.)?(key)$`` on the
  module name). GPT-2's ``Conv1D`` stores ``W`` as (in, out): ``ΔW = (B @ A)ᵀ · s``
  (``fan_in_fan_out``; as peft, decided by the layer's type, not by the config flag).
* ``lora_embedding_A``/``lora_embedding_B`` of an Embedding: ``ΔW = (B @ A)ᵀ · s``.
* ``lora_B.bias`` (``lora_bias=True``): ``Δb = bias · s`` on the module's bias.
* DoRA (``lora_magnitude_vector`` m): ``W' = m / ‖W + ΔW‖_row · (W + ΔW)`` with the norm
  taken per output feature (rows of a Linear, columns of a Conv1D or Embedding); it
  needs the base tensor, which the engine passes in.
* Full tensors (``modules_to_save``, ``bias="all"/"lora_only"``, embeddings saved
  with ``save_embedding_layers``; keys without a ``lora_`` part): they replace the base
  tensor, so τ = saved − W (plus ΔW when the module also carries a LoRA, as peft loads
  the saved weight first and merges the LoRA on top).
* ``trainable_token_indices``: the saved rows replace those rows of the embedding.

Tensors the adapter does not touch have τ = 0; :meth:`LoraDelta.touches` says which
do, and :meth:`LoraDelta.factors` hands plain-LoRA updates over as factors so that
linear methods and the LoRA output never form the dense matrix (see ``hubsoup.engine.lowrank``).
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, cast

import torch

from hubsoup.errors import (
    BaseModelError,
    IncompatibleInputError,
    InputError,
    NonFiniteTensorError,
    UnsupportedAdapterError,
)
from hubsoup.arch import model_layout, module_kind, tie_heads
from hubsoup.sources.checkpoint import ADAPTER_CONFIG, Checkpoint
from hubsoup.sources.taskvector import all_finite

if TYPE_CHECKING:
    from hubsoup.sources.checkpoint import InputRef, TensorInfo

log = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."

# Key suffixes of the LoRA parameters a module carries (after the module path).
_LORA_SUFFIXES = {
    ".lora_A.weight": "A", ".lora_B.weight": "B", ".lora_B.bias": "B_bias",
    ".lora_embedding_A": "A", ".lora_embedding_B": "B", ".lora_magnitude_vector": "magnitude",
}
_TOKENS_SUFFIX = ".token_adapter.trainable_tokens_delta"
# Config options that change what the saved weights mean; a non-empty value is refused.
_UNSUPPORTED_OPTIONS = {
    "layer_replication": "it duplicates layers, so the merged model would not have the base's architecture",
    "target_parameters": "it adapts raw parameters (e.g. MoE experts) through ParamWrapper",
    "alora_invocation_tokens": "an activated LoRA only applies after its invocation tokens; merging it changes it",
    "use_qalora": "QA-LoRA pools its input and targets a quantized base",
    "use_bdlora": "block-diagonal LoRA", "arrow_config": "Arrow routes between several LoRAs",
    "kasa_config": "KaSA adds a learned diagonal", "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA samples its update",
}
# init_lora_weights values after which the adapter is relative to a *modified* base
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


# --------------------------------------------------------------------------------------------
# The adapter
# --------------------------------------------------------------------------------------------
def _pattern_value(patterns: Any, module: str, default: Any) -> Any:  # patterns: the config's JSON (or None)
    """peft's ``get_pattern_key``: the first key ``k`` with ``re.match(rf"(.*\\.)?({k})$", module)``."""
    for key in patterns or {}:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default


@dataclass
class LoraModule:
    """One LoRA-adapted module of one adapter, mapped onto a base tensor."""

    path: str
    """Module path in the adapter's naming (what rank/alpha patterns match)."""
    target: str
    """Base tensor it updates (the plan's name: tied aliases resolved)."""
    a_key: str
    b_key: str
    rank: int
    alpha: float
    scale: float
    transpose: bool
    """Stored as (in, out): Conv1D (fan_in_fan_out) and embeddings."""
    bias_key: str | None = None
    magnitude_key: str | None = None

    @property
    def dora(self) -> bool:
        return self.magnitude_key is not None


class LoraDelta:
    """τ of a PEFT LoRA adapter, materialised for one base tensor at a time.

    Build it with :func:`lora_source`, which checks the adapter against the base first
    (from file headers only).
    """

    kind = "lora"

    def __init__(self, ckpt: Checkpoint, config: dict[str, Any], modules: dict[str, list[LoraModule]],
                 bias: dict[str, LoraModule], replace: dict[str, str], rows: dict[str, tuple[str, list[int]]]):
        self.ckpt, self.config = ckpt, config
        self.modules = modules  # base tensor -> LoRA modules updating it (two when tied names are both adapted)
        self.bias = bias  # base bias tensor -> module whose lora_B.bias updates it
        self.replace = replace  # base tensor -> adapter key holding its full replacement
        self.rows = rows  # base embedding -> (adapter key, token indices) of trainable tokens

    @property
    def label(self) -> str:
        return self.ckpt.label

    @property
    def ref(self) -> InputRef:
        return self.ckpt.ref

    def release(self) -> None:
        self.ckpt.release()

    def touches(self, name: str) -> bool:
        """Whether this adapter changes base tensor ``name`` at all (τ ≠ 0 possible)."""
        return name in self.modules or name in self.bias or name in self.replace or name in self.rows

    def _t(self, key: str) -> torch.Tensor:
        return self.ckpt.tensor(key).to(torch.float32)

    def byte_ranges(self, name: str) -> list[tuple[str, int, int]]:
        """Where the adapter tensors τ for base tensor ``name`` is built from lie on disk (read-ahead hint)."""
        keys = [k for m in self.modules.get(name, []) for k in (m.a_key, m.b_key, m.magnitude_key) if k]
        if name in self.bias:
            keys.append(cast(str, self.bias[name].bias_key))  # a bias module's: set (_lora_modules)
        if name in self.replace:
            keys.append(self.replace[name])
        if name in self.rows:
            keys.append(self.rows[name][0])
        return self.ckpt.byte_ranges(keys)

    def factors(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(P, Q)`` with τ = P @ Q exactly (float32, base orientation), when τ is a plain LoRA update.

        None when τ is not low-rank (DoRA, a replaced tensor, a bias). An untouched
        tensor gives factors of rank 0.
        """
        if name in self.replace or name in self.rows or name in self.bias:
            return None
        mods = self.modules.get(name, [])
        if any(m.dora for m in mods):
            return None
        ps, qs = [], []
        for m in mods:
            a, b = self._t(m.a_key), self._t(m.b_key)
            if m.transpose:  # τ = (B A)ᵀ s = (Aᵀ s) Bᵀ
                ps.append(a.T * m.scale)
                qs.append(b.T)
            else:  # τ = (B A) s = (B s) A
                ps.append(b * m.scale)
                qs.append(a)
        if not ps:
            return None
        return torch.cat(ps, 1), torch.cat(qs, 0)

    def weights(self, name: str, shape: tuple[int, ...]) -> None:
        return None  # an adapter holds updates, not weights

    def delta_into(self, out: torch.Tensor, name: str, base: torch.Tensor) -> None:
        """Write τ for base tensor ``name`` into ``out`` (float32, the base's shape and device)."""
        if not self.touches(name):
            out.zero_()
            return
        dev = out.device
        weight = base
        replaced = name in self.replace or name in self.rows
        if name in self.replace:
            key = self.replace[name]
            weight = self._t(key).to(dev)
            if tuple(weight.shape) != tuple(base.shape):
                raise IncompatibleInputError(
                    f"adapter '{self.label}': saved tensor '{key}' has shape {list(weight.shape)} but the base's "
                    f"'{name}' is {list(base.shape)}")
        if name in self.rows:
            key, idx = self.rows[name]
            weight = weight.clone() if weight is base else weight
            weight[torch.tensor(idx, device=dev)] = self._t(key).to(dev)
        mods = self.modules.get(name, [])
        if any(m.dora for m in mods):
            (m,) = mods  # checked when the adapter was opened
            assert m.magnitude_key is not None  # a DoRA module's
            new = _dora_weight(weight, self._delta(m, dev), self._t(m.magnitude_key).to(dev), m.transpose)
            torch.sub(new, base, out=out)
        else:
            if replaced:
                torch.sub(weight, base, out=out)
            else:
                out.zero_()
            for i, m in enumerate(mods):
                if i == 0 and not replaced and not m.transpose:
                    # B @ A straight into ``out``, then scaled in place: peft's product and rounding
                    # without the two full-size temporaries of ``(B @ A) * s``
                    a, b = self._t(m.a_key).to(dev), self._t(m.b_key).to(dev)
                    torch.matmul(b, a, out=out).mul_(m.scale)
                    continue
                d = self._delta(m, dev)
                if i == 0 and not replaced:
                    out.copy_(d)
                else:
                    out.add_(d)
        if name in self.bias:
            m = self.bias[name]
            assert m.bias_key is not None  # a bias module's (_lora_modules)
            out.add_(self._t(m.bias_key).to(dev) * m.scale)
        if not all_finite(out):
            raise NonFiniteTensorError(
                f"adapter '{self.label}': the update of '{name}' has NaN/inf values; the adapter is broken "
                "(diverged training?) and cannot be merged")

    def _delta(self, m: LoraModule, dev: torch.device) -> torch.Tensor:
        """peft's ``get_delta_weight``: ``transpose(B @ A, fan_in_fan_out) * scaling``."""
        a, b = self._t(m.a_key).to(dev), self._t(m.b_key).to(dev)
        d = b @ a
        if m.transpose:
            d = d.T
        return d * m.scale


def _dora_weight(weight: torch.Tensor, delta: torch.Tensor, magnitude: torch.Tensor, transpose: bool) -> torch.Tensor:
    """peft's DoRA merge: ``m / ‖W + ΔW‖ · (W + ΔW)``, the norm per output feature."""
    lin_w = weight.T if transpose else weight
    lin_d = delta.T if transpose else delta
    norm: torch.Tensor = torch.linalg.norm(lin_w + 1 * lin_d, dim=1).to(weight.dtype)
    factor = (magnitude / norm).view(-1, 1)
    if transpose:
        factor = factor.T
    return factor * (weight + delta)


# --------------------------------------------------------------------------------------------
# Checks and construction
# --------------------------------------------------------------------------------------------
def adapter_config(ckpt: Checkpoint) -> dict[str, Any]:
    cfg = ckpt.read_json(ADAPTER_CONFIG)
    if cfg is None:
        raise InputError(f"input '{ckpt.label}': no {ADAPTER_CONFIG}; is it a PEFT adapter?")
    return cfg


def check_supported(ckpt: Checkpoint, cfg: dict[str, Any]) -> None:
    """Refuse adapter types and options whose weights are not plain (Do)LoRA updates."""
    ptype = str(cfg.get("peft_type", "")).upper()
    if ptype != "LORA":
        what = {"IA3": "an IA3 adapter (learned rescaling vectors)", "ADALORA": "an AdaLoRA adapter",
                "PROMPT_TUNING": "a prompt-tuning adapter (virtual tokens, no weight update)",
                "PREFIX_TUNING": "a prefix-tuning adapter (virtual tokens, no weight update)",
                "P_TUNING": "a p-tuning adapter (virtual tokens, no weight update)"}.get(ptype, f"a {ptype or 'unknown'} adapter")
        raise UnsupportedAdapterError(
            f"input '{ckpt.label}' is {what}; hubsoup merges LoRA adapters (peft_type LORA, incl. rsLoRA and DoRA) "
            "and full fine-tunes only")
    for opt, why in _UNSUPPORTED_OPTIONS.items():
        if cfg.get(opt):
            raise UnsupportedAdapterError(f"input '{ckpt.label}': LoRA option {opt}={cfg[opt]!r} is not supported ({why})")
    init = str(cfg.get("init_lora_weights", "")).lower()
    if init.startswith(_BASE_CHANGING_INITS):
        raise UnsupportedAdapterError(
            f"input '{ckpt.label}': init_lora_weights={cfg['init_lora_weights']!r} trains the adapter against a "
            "modified base, so it is not a task vector of this base; save it with peft's "
            "path_initial_model_for_weight_conversion to get a plain LoRA, and merge that")


def _positive_int(v: Any) -> bool:
    return not isinstance(v, bool) and (isinstance(v, int) or (isinstance(v, float) and v.is_integer())) and v > 0


def _finite_number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def check_config_values(ckpt: Checkpoint, cfg: dict[str, Any]) -> None:
    """Refuse a config whose ``r``/``lora_alpha`` (or their per-module patterns) are not usable numbers.

    The scale ``lora_alpha / r`` multiplies every update: a string, a rank ≤ 0 or a NaN alpha
    would crash the merge or silently write NaN weights, so it is refused when the adapter is opened.
    """
    where = f"adapter '{ckpt.label}': {ADAPTER_CONFIG}"
    if "r" in cfg and not _positive_int(cfg["r"]):
        raise InputError(f"{where} has r={cfg['r']!r}; the LoRA rank must be a positive integer")
    if "lora_alpha" in cfg and not _finite_number(cfg["lora_alpha"]):
        raise InputError(f"{where} has lora_alpha={cfg['lora_alpha']!r}; it must be a finite number")
    for key, ok, what in (("rank_pattern", _positive_int, "a positive integer"),
                          ("alpha_pattern", _finite_number, "a finite number")):
        pattern = cfg.get(key)
        if pattern is None:
            continue
        if not isinstance(pattern, dict):
            raise InputError(f"{where} has {key}={pattern!r}; it must be a mapping module → value")
        for k, v in pattern.items():
            if not ok(v):
                raise InputError(f"{where} has {key}[{k!r}]={v!r}; it must be {what}")
            try:
                re.compile(rf"(.*\.)?({k})$")
            except re.error as e:
                raise InputError(f"{where} has {key} key {k!r}, not a valid module pattern ({e})") from None


def check_base_claim(ckpt: Checkpoint, cfg: dict[str, Any], base: Checkpoint, strict: bool = True) -> None:
    """Compare the adapter's ``base_model_name_or_path`` with the merge's base.

    The rule: both Hub IDs (the base opened from the Hub, or a local folder inside the
    Hub cache, ``models--org--name``) that differ → :class:`BaseModelError` (case is
    ignored, and a legacy un-namespaced ID such as ``gpt2`` matches ``*/gpt2``); a local
    path claim that is the base folder, or equal IDs → fine; anything that cannot be
    compared (a local base and a Hub claim, two different local paths, a path of the
    machine that trained the adapter) → a warning. The tensor shapes are always checked,
    whatever the names say.
    """
    claim = cfg.get("base_model_name_or_path")
    if not claim:
        return
    claim_path = os.path.expanduser(claim)
    # a Hub adapter's claim is remote data: never a reason to look at this machine's files
    if not ckpt.ref.repo_id and os.path.isdir(claim_path):
        if os.path.realpath(claim_path) == os.path.realpath(base.folder):
            return
        log.warning("adapter %s was trained on %s; merging it onto %s (the tensor shapes match)",
                    ckpt.label, claim, base.label)
        return
    claim_id = claim.split("@", 1)[0].strip().lower()
    if not _HUB_ID.match(claim_id):  # a path on the machine that trained it: nothing to compare
        log.warning("adapter %s was trained on %s (not here); merging it onto %s (the tensor shapes match)",
                    ckpt.label, claim, base.label)
        return
    base_id = _hub_id(base)
    if base_id is None:
        if os.path.basename(os.path.normpath(base.folder)).lower() == claim_id.split("/")[-1]:
            return
        log.warning("adapter %s names base %s; cannot check that the local base %s is that model "
                    "(the tensor shapes match)", ckpt.label, claim, base.label)
        return
    legacy = "/" not in claim_id and base_id.lower().split("/")[-1] == claim_id  # `gpt2` = openai-community/gpt2
    if base_id.lower() != claim_id and not legacy and not strict:  # applied where the config says (mergekit)
        log.warning("adapter %s was trained on %s; applying it to %s as the config says (the tensor shapes match)",
                    ckpt.label, claim, base_id)
    elif base_id.lower() != claim_id and not legacy:
        raise BaseModelError(
            f"adapter '{ckpt.label}' was trained on '{claim}' but the merge's base is '{base_id}'; "
            "a LoRA's update is only meaningful on its own base model. Pass the right --base, "
            "or merge adapters of the same base")


_HUB_ID = re.compile(r"^[a-z0-9][\w.\-]*/[\w.\-]+$|^[a-z0-9][\w.\-]*$")


def _hub_id(base: Checkpoint) -> str | None:
    if base.ref.repo_id:
        return base.ref.repo_id
    m = re.search(r"models--([^/\\]+?)--([^/\\]+)", os.path.abspath(base.folder))
    return f"{m.group(1)}/{m.group(2)}" if m else None


def _split_key(key: str) -> tuple[str, str | None]:
    """``(module_path, role)`` of an adapter key; role None for a full tensor."""
    if key.endswith(_TOKENS_SUFFIX):
        return key[: -len(_TOKENS_SUFFIX)], "tokens"
    for suffix, role in _LORA_SUFFIXES.items():
        if key.endswith(suffix):
            return key[: -len(suffix)], role
    return key, None


def _prefix_maps(names: list[str], base_keys: set[str]) -> Iterator[Callable[[str], str]]:
    """Candidate renamings adapter name → base name: as is, or one leading component dropped/added."""
    yield lambda n: n
    firsts = sorted({n.split(".", 1)[0] for n in names if "." in n})
    for p in firsts:
        def dropped(n: str, p: str = p) -> str:
            return n[len(p) + 1:] if n.startswith(p + ".") else n
        yield dropped
    for p in sorted({k.split(".", 1)[0] for k in base_keys if "." in k}):
        def added(n: str, p: str = p) -> str:
            return f"{p}.{n}"
        yield added


def lora_source(ckpt: Checkpoint, base: Checkpoint, base_keys: list[str], infos: dict[str, TensorInfo], *,
                ignore_extra: bool = False, base_claim: str = "check") -> LoraDelta:
    """Open a LoRA adapter as a task-vector source, after checking it against the base.

    Everything is checked from the adapter's config and file headers: adapter type and
    options, base model name, that every adapted module exists in the base, and that
    ``lora_A``/``lora_B`` ranks agree with each other, with the config and with the base
    tensor's shape. Raises a :class:`~hubsoup.errors.HubsoupError` naming the adapter and tensor.
    """
    cfg = adapter_config(ckpt)
    check_supported(ckpt, cfg)
    check_config_values(ckpt, cfg)
    check_base_claim(ckpt, cfg, base, strict=base_claim == "check")  # "warn": a model+adapter reference
    layout = model_layout(os.path.abspath(base.folder))
    on = _OnBase(ckpt, cfg, base, infos, layout, tie_heads(layout, base_keys), set(base_keys), ignore_extra)
    lora, full, tokens = _group_keys(ckpt)
    # one consistent renaming onto the base's tensor names
    on.choose_renaming([f"{m}.weight" for m in lora] + list(full) + [f"{m}.weight" for m in tokens])
    modules, bias = _lora_modules(on, lora)
    replace = _saved_tensors(on, full)
    rows = _trainable_rows(on, tokens, modules)
    if not modules and not replace and not rows:
        raise IncompatibleInputError(
            f"adapter '{ckpt.label}': none of its modules exist in the base '{base.label}'; "
            "is it an adapter of this base?")
    return LoraDelta(ckpt, cfg, modules, bias, replace, rows)


def _group_keys(ckpt: Checkpoint) -> tuple[dict[str, dict[str, str]], dict[str, str], dict[str, str]]:
    """The adapter's keys by module: ``(LoRA factors: module -> role -> key, saved tensors: path -> key,
    trainable tokens: module -> key)``; a LoRA variant hubsoup does not know is refused."""
    lora: dict[str, dict[str, str]] = {}
    full: dict[str, str] = {}  # adapter param path -> key
    tokens: dict[str, str] = {}
    for key in ckpt.keys():
        path = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        mod, role = _split_key(path)
        if role == "tokens":
            tokens[mod] = key
        elif role is not None:
            lora.setdefault(mod, {})[role] = key
        elif ".original_module." in f".{path}" or ".modules_to_save." in f".{path}":
            continue  # peft loads neither into the merged model (the original copy, a stray duplicate)
        elif "lora_" in path:
            raise UnsupportedAdapterError(
                f"adapter '{ckpt.label}': tensor '{key}' is a LoRA variant hubsoup does not know; "
                "supported are lora_A/lora_B, lora_embedding_A/B, lora_B.bias and lora_magnitude_vector (DoRA)")
        else:
            full[path.replace(".base_layer.", ".")] = key
    if not lora and not full and not tokens:
        raise IncompatibleInputError(f"adapter '{ckpt.label}': its weights file holds no tensors")
    return lora, full, tokens


@dataclass
class _OnBase:
    """An adapter read against its base: what each step of :func:`lora_source` checks with."""

    ckpt: Checkpoint
    cfg: dict[str, Any]
    base: Checkpoint
    infos: dict[str, TensorInfo]
    layout: Any
    ties: dict[str, str]
    have: set[str]
    ignore_extra: bool
    rename: Callable[[str], str] = field(default=lambda n: n)
    """Adapter name → base name (:meth:`choose_renaming`)."""

    @property
    def label(self) -> str:
        return self.ckpt.label

    def resolve(self, name: str, f: Callable[[str], str] | None = None) -> str | None:
        """The base tensor an adapter name lands on (through a tie), or None."""
        t = (f or self.rename)(name)
        t = self.ties.get(t, t)
        return t if t in self.have else None

    def choose_renaming(self, targets: list[str]) -> None:
        """The renaming under which most of ``targets`` exist in the base (the first that finds them all)."""
        best: Callable[[str], str] | None
        best, best_hits = None, -1
        for f in _prefix_maps(targets, self.have):
            hits = sum(self.resolve(n, f) is not None for n in targets)
            if hits > best_hits:
                best, best_hits = f, hits
            if hits == len(targets):
                break
        assert best is not None  # the first candidate (names as they are) is always taken
        self.rename = best

    def missing(self, what: str, name: str) -> None:
        """The adapter names something the base lacks: refused, or with ``ignore_extra`` left out with a warning."""
        msg = (f"adapter '{self.label}' {what} '{name}', which the base '{self.base.label}' does not have; "
               "is it an adapter of this base?")
        if self.ignore_extra:
            log.warning("%s (ignored)", msg)
        else:
            raise IncompatibleInputError(msg + " (pass --ignore-extra to leave such tensors out)")


def _lora_modules(on: _OnBase, lora: dict[str, dict[str, str]]) -> tuple[dict[str, list[LoraModule]],
                                                                          dict[str, LoraModule]]:
    """The LoRA modules by the base tensor each updates, and the ``lora_B.bias`` ones by the base bias."""
    modules: dict[str, list[LoraModule]] = {}
    bias: dict[str, LoraModule] = {}
    for mod, roles in lora.items():
        m = _lora_module(on, mod, roles)
        if m is None:
            continue
        if "B_bias" in roles:
            btarget = on.resolve(f"{mod}.bias")
            if btarget is None:
                raise IncompatibleInputError(
                    f"adapter '{on.label}': module '{mod}' has lora_B.bias (lora_bias=True) but the base tensor "
                    f"'{m.target}' has no bias, so it cannot be merged (peft refuses it as well)")
            m.bias_key = roles["B_bias"]
            bias[btarget] = m
        modules.setdefault(m.target, []).append(m)
    for target, mods in modules.items():
        if len(mods) > 1 and any(m.dora for m in mods):
            raise UnsupportedAdapterError(
                f"adapter '{on.label}': DoRA on several tied modules sharing '{target}' "
                f"({', '.join(m.path for m in mods)}) is not supported")
    return modules, bias


def _lora_module(on: _OnBase, mod: str, roles: dict[str, str]) -> LoraModule | None:
    """One adapted module, its factors' ranks and shapes checked against the config and the base tensor (None: the
    base lacks it and ``ignore_extra`` leaves it out)."""
    label, cfg = on.label, on.cfg
    if "A" not in roles or "B" not in roles:
        raise IncompatibleInputError(
            f"adapter '{label}': module '{mod}' has {'lora_B' if 'A' not in roles else 'lora_A'} but no "
            f"{'lora_A' if 'A' not in roles else 'lora_B'}; the adapter file is incomplete")
    target = on.resolve(f"{mod}.weight")
    if target is None:
        on.missing("adapts module", mod)
        return None
    a_info, b_info = on.ckpt.info(roles["A"]), on.ckpt.info(roles["B"])
    w_shape = tuple(on.infos[target].shape)
    if len(a_info.shape) != 2 or len(b_info.shape) != 2:
        raise UnsupportedAdapterError(
            f"adapter '{label}': module '{mod}' has {len(a_info.shape)}-D LoRA factors (a convolution?); "
            "only Linear, Conv1D and Embedding LoRAs are supported")
    embedding = roles["A"].endswith("lora_embedding_A")
    r_a, r_b = (a_info.shape[0], b_info.shape[1])
    if r_a != r_b:
        raise IncompatibleInputError(
            f"adapter '{label}': module '{mod}' has lora_A of rank {r_a} ({list(a_info.shape)}) but lora_B of "
            f"rank {r_b} ({list(b_info.shape)}); the adapter is corrupt")
    r = int(_pattern_value(cfg.get("rank_pattern"), mod, cfg.get("r", 8)))
    alpha = float(_pattern_value(cfg.get("alpha_pattern"), mod, cfg.get("lora_alpha", 8)))
    if r_a != r:
        raise IncompatibleInputError(
            f"adapter '{label}': module '{mod}' has LoRA rank {r_a} but adapter_config.json says r={r}; "
            "the scale lora_alpha/r would be wrong, so the adapter is refused")
    out_f, in_f = b_info.shape[0], a_info.shape[1]
    # the adapted module's own type (for a tied name, e.g. lm_head, not the type of the tensor's owner)
    kind = "embedding" if embedding else module_kind(on.layout, on.rename(f"{mod}.weight")[: -len(".weight")], w_shape)
    if embedding:
        transpose = True
    elif kind == "conv1d":
        transpose = True
    elif kind == "linear":
        transpose = False
    else:  # unknown layer type: the shapes decide, the config flag breaks a square tie
        transpose = (w_shape == (in_f, out_f) and (w_shape != (out_f, in_f) or bool(cfg.get("fan_in_fan_out"))))
    want = (in_f, out_f) if transpose else (out_f, in_f)
    if w_shape != want:
        raise IncompatibleInputError(
            f"adapter '{label}': module '{mod}' gives a {list(want)} update but the base tensor '{target}' is "
            f"{list(w_shape)}; the adapter belongs to a different base model (or its lora_A/lora_B are swapped)")
    scale = alpha / math.sqrt(r) if bool(cfg.get("use_rslora", False)) else alpha / r
    m = LoraModule(mod, target, roles["A"], roles["B"], r, alpha, scale, transpose)
    if "magnitude" in roles:
        mag = tuple(on.ckpt.info(roles["magnitude"]).shape)
        if mag != (out_f,):
            raise IncompatibleInputError(
                f"adapter '{label}': DoRA magnitude of '{mod}' has shape {list(mag)}, expected [{out_f}]")
        m.magnitude_key = roles["magnitude"]
    return m


def _saved_tensors(on: _OnBase, full: dict[str, str]) -> dict[str, str]:
    """Tensors the adapter saves whole (``modules_to_save``): base tensor -> adapter key, floating point only."""
    replace: dict[str, str] = {}
    for path, key in full.items():
        target = on.resolve(path)
        if target is None:
            on.missing("saves tensor", key)
            continue
        shape, want = tuple(on.ckpt.info(key).shape), tuple(on.infos[target].shape)
        if shape != want:
            raise IncompatibleInputError(
                f"adapter '{on.label}': saved tensor '{key}' has shape {list(shape)} but the base's '{target}' is "
                f"{list(want)}; the adapter belongs to a different base (or a resized vocabulary)")
        if on.infos[target].dtype.is_floating_point:
            replace[target] = key
    return replace


def _trainable_rows(on: _OnBase, tokens: dict[str, str],
                    modules: dict[str, list[LoraModule]]) -> dict[str, tuple[str, list[int]]]:
    """Trainable tokens (peft's ``trainable_token_indices``): base tensor -> (adapter key, the rows it replaces)."""
    cfg = on.cfg
    rows: dict[str, tuple[str, list[int]]] = {}
    for mod, key in tokens.items():
        target = on.resolve(f"{mod}.weight")
        if target is None:
            on.missing("trains tokens of", mod)
            continue
        idx = cfg.get("trainable_token_indices")
        if isinstance(idx, dict):
            idx = _pattern_value(idx, mod, None) or next((v for k, v in idx.items() if mod.endswith(k)), None)
        shape = tuple(on.ckpt.info(key).shape)
        if not isinstance(idx, list) or shape != (len(idx), on.infos[target].shape[-1]):
            raise IncompatibleInputError(
                f"adapter '{on.label}': trainable tokens of '{mod}' ({list(shape)}) do not match "
                f"trainable_token_indices={cfg.get('trainable_token_indices')!r}")
        if target in modules:
            raise UnsupportedAdapterError(
                f"adapter '{on.label}': '{mod}' has both a LoRA and trainable tokens; not supported")
        rows[target] = (key, [int(i) for i in idx])
    return rows
