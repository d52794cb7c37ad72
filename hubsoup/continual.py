"""Continual merging (OPCM) with a saved state: add models one at a time, later.

``init`` merges an ordered list of fine-tunes; ``add`` adds more to an existing soup
reading **only** the saved state, the base and the new models, never the earlier
inputs; ``export`` writes the merged model from a state. The result of ``init(a, b)``
then ``add(c)`` equals a one-shot ``hubsoup merge --method opcm a b c`` bit for bit:
both call :func:`hubsoup.methods.opcm.opcm_update` and ``opcm_lambda`` on the same
float32 task vectors in the same order.

The state lives beside the merged weights, in ``<soup>/continual_state/``, so that
uploading the soup folder uploads it too::

    continual_state/
      state.json          count, task-vector norms, ‖S‖, λ, params, base (ref + per-tensor
                          SHA-256 of its bytes), the models in merge order, file checksums
      S.safetensors       the unscaled accumulated update S, float32, one tensor per
                          mergeable base tensor (S-0000i-of-0000n.safetensors when sharded)

The merged weights are θ_0 + S / λ. Everything is streamed tensor by tensor: ``add``
makes one pass reading (base, S, new models) and writing the new S, then one pass
reading (base, new S) and writing the merged weights, because λ is only known once the
whole model was seen. Memory is a few tensors, whatever the number of models; disk is
the output plus S. The new soup (weights, card, state) is written into a temporary
folder and renamed into place at the end, so a failure leaves the old soup untouched
and never a half-written state.

Example:
    >>> from hubsoup import continual
    >>> continual.init(["org/ft-a", "org/ft-b"], base="org/base", out="./soup")   # doctest: +SKIP
    >>> continual.add("./soup", ["org/ft-c"])                                     # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from hubsoup import __version__
from hubsoup.errors import BaseModelError, InputError, NonFiniteTensorError, ParameterError
from hubsoup.methods import get_method
from hubsoup.methods.opcm import opcm_lambda, opcm_update, sq_norm
from hubsoup.plan import Plan, build_plan, tied_groups
from hubsoup.recipe import RECIPE_FILE, Recipe
from hubsoup.sources import Checkpoint, InputRef, open_input
from hubsoup.sources.deltas import SHAPE_POLICIES, all_finite
from hubsoup.writer import OutputFolder, ShardedWriter, check_output, parse_size

log = logging.getLogger(__name__)

STATE_DIR = "continual_state"
STATE_FILE = "state.json"
FORMAT = "hubsoup.continual"
FORMAT_VERSION = 1
METHOD = "opcm"


class ContinualStateError(InputError):
    """A continual-merging state is missing, corrupt, or belongs to another base."""


@dataclass
class ContinualState:
    """What ``state.json`` holds (S itself is in the safetensors files beside it)."""

    params: dict[str, Any]
    base: dict[str, Any]
    base_sha256: dict[str, str]
    """SHA-256 of each mergeable base tensor's stored bytes: a different base is refused."""
    models: list[dict[str, Any]]
    """Input refs in merge order."""
    task_norms: list[float]
    s_norm: float
    lam: float
    tensors: dict[str, dict[str, Any]]
    """name -> {file, shape}: where each S tensor is stored."""
    files: dict[str, str]
    """S file -> SHA-256 of its bytes."""
    dtype: str | None = None
    shape_mismatch: str = "error"
    ignore_extra: bool = False
    hubsoup_version: str = ""
    format: str = FORMAT
    version: int = FORMAT_VERSION

    @property
    def count(self) -> int:
        return len(self.models)

    def to_json(self) -> str:
        d = asdict(self)
        d["count"] = self.count
        d["lambda"] = d.pop("lam")
        d["checksum"] = _json_digest(d)
        return json.dumps(d, indent=2)

    @classmethod
    def from_json(cls, text: str, where: str) -> "ContinualState":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ContinualStateError(f"continual state {where}: {STATE_FILE} is not valid JSON ({e}); "
                                      "the state is corrupt") from e
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ContinualStateError(f"continual state {where}: {STATE_FILE} is not a hubsoup continual state")
        if d.pop("checksum", None) != _json_digest(d):
            raise ContinualStateError(f"continual state {where}: {STATE_FILE} does not match its own checksum "
                                      "(edited or corrupt); the state cannot be trusted")
        if d.get("version") != FORMAT_VERSION:
            raise ContinualStateError(f"continual state {where}: format version {d.get('version')} is not "
                                      f"supported (this hubsoup reads version {FORMAT_VERSION})")
        try:
            d["lam"] = d.pop("lambda")
            count = d.pop("count")
            state = cls(**d)
        except (KeyError, TypeError) as e:
            raise ContinualStateError(f"continual state {where}: {STATE_FILE} lacks or has unexpected fields "
                                      f"({e}); the state is corrupt") from e
        if count != state.count or len(state.task_norms) != state.count or state.count < 1:
            raise ContinualStateError(f"continual state {where}: count {count}, {len(state.models)} models and "
                                      f"{len(state.task_norms)} norms disagree; the state is corrupt")
        return state


def _json_digest(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


# --- reading a state --------------------------------------------------------------------------

def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


class StateReader:
    """A verified state folder: ``state.json`` checked, S files checksummed, S read lazily."""

    def __init__(self, folder: str, label: str | None = None, *, verify: bool = True):
        self.folder = folder
        where = f"'{label or folder}'"
        path = os.path.join(folder, STATE_FILE)
        if not os.path.isfile(path):
            raise ContinualStateError(
                f"{where} has no continual state ({STATE_DIR}/{STATE_FILE}); create one with "
                "`hubsoup continual init`")
        with open(path, encoding="utf-8") as f:
            self.state = ContinualState.from_json(f.read(), where)
        self._handles = {}
        try:
            self._open(folder, where, verify)
        except (AttributeError, TypeError, KeyError, ValueError) as e:  # fields of the wrong type
            raise ContinualStateError(f"continual state {where}: {STATE_FILE} is malformed ({type(e).__name__}: "
                                      f"{e}); the state is corrupt") from e

    def _open(self, folder: str, where: str, verify: bool) -> None:
        for fname, digest in self.state.files.items():
            fpath = os.path.join(folder, fname)
            if os.path.basename(fname) != fname or not os.path.isfile(fpath):
                raise ContinualStateError(f"continual state {where}: file {fname} is missing; the state is incomplete")
            if verify and _sha256_file(fpath) != digest:
                raise ContinualStateError(
                    f"continual state {where}: {fname} does not match the checksum in {STATE_FILE} "
                    "(corrupt or modified); the state cannot be trusted: restore it, or start again with "
                    "`hubsoup continual init`")
            try:
                self._handles[fname] = safe_open(fpath, framework="pt", device="cpu")
            except SafetensorError as e:
                raise ContinualStateError(f"continual state {where}: {fname} is not a valid safetensors file: {e}") from e
        for name, info in self.state.tensors.items():
            h = self._handles.get(info.get("file"))
            if h is None or name not in h.keys():
                raise ContinualStateError(f"continual state {where}: tensor '{name}' is not in its file; "
                                          "the state is corrupt")

    def tensor(self, name: str) -> torch.Tensor:
        info = self.state.tensors[name]
        return self._handles[info["file"]].get_tensor(name).to(torch.float32)


def state_folder(soup: str, token: str | bool | None = None) -> tuple[str, str]:
    """(local folder of the soup's state, a label) for a soup given as a folder or Hub repo ID."""
    expanded = os.path.expanduser(soup)
    if os.path.isdir(expanded):
        return os.path.join(expanded, STATE_DIR), soup
    if os.path.exists(expanded):
        raise InputError(f"soup '{soup}': is a file; give the merged model's folder or its Hub repo ID")
    from huggingface_hub import snapshot_download

    from hubsoup.sources.resolve import parse_spec

    repo_id, revision = parse_spec(soup)
    try:
        folder = snapshot_download(repo_id, revision=revision, token=token, allow_patterns=[f"{STATE_DIR}/*"])
    except Exception as e:  # noqa: BLE001 - one clear line
        raise InputError(f"soup '{soup}': cannot fetch its continual state from the Hub ({type(e).__name__}: {e})") from e
    return os.path.join(folder, STATE_DIR), soup


def load_state(soup: str, token: str | bool | None = None) -> ContinualState:
    """The verified state of a soup (folder or Hub repo ID)."""
    folder, label = state_folder(soup, token)
    return StateReader(folder, label).state


# --- the streaming passes ------------------------------------------------------------------------

@dataclass
class _Setup:
    base: Checkpoint
    plan: Plan
    sources: list
    refs: list[InputRef]
    out_dtype: torch.dtype | None
    dtype: str | None


def _open_models(models: Sequence[str], base_ckpt: Checkpoint, *, allow_pickle, ignore_extra, shape_mismatch,
                 token, device) -> tuple[list, list[InputRef], Plan]:
    from hubsoup import api

    ckpts = [open_input(s, allow_pickle=allow_pickle, token=token) for s in models]
    for c in ckpts:
        if c.ref.kind == "full":
            api.check_config(base_ckpt, c)
    base_keys = base_ckpt.keys()
    infos = {k: base_ckpt.info(k) for k in base_keys}
    sources = [api.delta_source(c, base_ckpt, base_keys, infos, ignore_extra=ignore_extra,
                                shape_mismatch=shape_mismatch) for c in ckpts]
    plan = build_plan(base_keys, infos, base_ckpt.config, ties=tied_groups(base_ckpt.folder, base_keys), device=device)
    return sources, [c.ref for c in ckpts], plan


def _advance(setup: _Setup, prev: StateReader | None, params, folder: str, shard_size: int,
             quiet: bool) -> tuple[list[float], float, dict[str, str], dict[str, dict]]:
    """Pass 1: S ← S + P_S(τ) for every new model, tensor by tensor; S written to ``folder``."""
    mergeable = [(b, e) for b, e in setup.plan.entries() if e.mergeable]
    if prev is not None:
        have, want = set(prev.state.tensors), {e.name for _, e in mergeable}
        if have != want:
            odd = sorted(have ^ want)[0]
            raise ContinualStateError(
                f"the continual state does not fit the base '{setup.base.label}' (tensor '{odd}' is in one but not "
                "the other); it was made with a different base")
    writer = ShardedWriter(folder, [(e.name, e.shape, torch.float32) for _, e in mergeable], shard_size,
                           metadata={"hubsoup_continual": "S, the unscaled accumulated OPCM update"})
    sq_tau = [0.0] * len(setup.sources)
    sq_S = 0.0
    digests: dict[str, str] = {}
    try:
        for block, entry in tqdm(mergeable, desc="continual: updating the state", unit="tensor", disable=quiet):
            raw = setup.base.tensor(entry.name)
            digest = _tensor_sha256(raw)
            if prev is not None and prev.state.base_sha256.get(entry.name) != digest:
                raise ContinualStateError(
                    f"base '{setup.base.label}': tensor '{entry.name}' differs from the base the continual state "
                    "was made with; adding to it needs that same base")
            digests[entry.name] = digest
            base = raw.to(block.device, torch.float32)
            if not all_finite(base):
                raise NonFiniteTensorError(f"base '{setup.base.label}': tensor '{entry.name}' has NaN/inf values")
            S = prev.tensor(entry.name).to(block.device) if prev is not None else None
            tau = torch.empty_like(base)
            for i, src in enumerate(setup.sources):
                src.delta_into(tau, entry.name, base)
                sq_tau[i] += sq_norm(tau)
                S = opcm_update(S, tau, entry.name, params)
            sq_S += sq_norm(S)
            writer.write(entry.name, S)
            del S, tau, base, raw
        writer.close()
    except BaseException:
        writer.abort()
        raise
    tensors = {}
    for fname in writer.files:  # model*.safetensors -> S*.safetensors
        os.rename(os.path.join(folder, fname), os.path.join(folder, "S" + fname[len("model"):]))
    for name, slot in writer.slots.items():
        tensors[name] = {"file": "S" + writer.files[slot.shard][len("model"):], "shape": list(slot.shape)}
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        os.remove(index)
    return [math.sqrt(v) for v in sq_tau], math.sqrt(sq_S), digests, tensors


def _materialize(setup: _Setup, S: StateReader, lam: float, folder: str, shard_size: int, recipe: Recipe,
                 quiet: bool) -> None:
    """Pass 2: θ = θ_0 + S / λ, tensor by tensor, exactly as the engine computes it for ``opcm``."""
    from hubsoup.api import _copy_base_files, _set_config_dtype

    plan, out_dtype = setup.plan, setup.out_dtype
    entries = [(name, e.shape, out_dtype if (out_dtype and e.mergeable) else e.dtype) for name, e in plan.output_entries()]
    writer = ShardedWriter(folder, entries, shard_size,
                           metadata={"hubsoup_recipe": json.dumps(recipe.to_dict(), default=str)})
    try:
        copied = _copy_base_files(setup.base, folder)
        if out_dtype is not None and "config.json" in copied:
            _set_config_dtype(os.path.join(folder, "config.json"), setup.dtype)
        for block in tqdm(plan.blocks, desc="continual: writing the merged model", unit="block", disable=quiet):
            for entry in block.tensors:
                if not entry.mergeable:
                    out = setup.base.tensor(entry.name)
                else:
                    base = setup.base.tensor(entry.name).to(block.device, torch.float32)
                    # S.tensor() may share the state file's mmap: divide out of place (same kernel as opcm's div_)
                    out = torch.div(S.tensor(entry.name).to(block.device), lam).add_(base).to(out_dtype or entry.dtype)
                for name in (entry.name, *entry.aliases):
                    writer.write(name, out)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    with open(os.path.join(folder, RECIPE_FILE), "w", encoding="utf-8") as f:
        f.write(recipe.to_yaml())


def _write_state(folder: str, state: ContinualState) -> None:
    state.files = {f: _sha256_file(os.path.join(folder, f)) for f in sorted({t["file"] for t in state.tensors.values()})}
    tmp = os.path.join(folder, STATE_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(state.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, STATE_FILE))


def _result(setup: _Setup, folder: OutputFolder, state: ContinualState, recipe: Recipe, t0: float):
    from hubsoup.api import MergeResult
    from hubsoup.card import write_card

    refs = [_ref(d) for d in state.models]
    result = MergeResult(folder.target, recipe, METHOD, dict(state.params), setup.base.ref, refs, setup.plan,
                         {"opcm.lambda": state.lam, "opcm.task_norms": state.task_norms, "opcm.s_norm": state.s_norm,
                          "continual.count": state.count}, time.perf_counter() - t0)
    path = write_card(result, folder.path)
    lines = ["", "## Continual merging", "",
             f"This soup was built by continual merging (OPCM); {state.count} model(s) were added **in this order** "
             f"(the result depends on it). λ = {state.lam:.6g}.", ""]
    lines += [f"{i}. {_ref_label(d)}" for i, d in enumerate(state.models, 1)]
    lines += ["", f"The merge state is in `{STATE_DIR}/`: add one more model, without the earlier ones, with",
              "", "```bash", "hubsoup continual add <this repo or folder> <new-model>", "```", ""]
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return result


def _ref(d: dict) -> InputRef:
    return InputRef(spec=d.get("spec", ""), repo_id=d.get("repo_id"), revision=d.get("revision"), sha=d.get("sha"),
                    path=d.get("path"), kind=d.get("kind", "full"))


def _ref_label(d: dict) -> str:
    if d.get("repo_id"):
        return f"{d['repo_id']}" + (f" @ `{d['sha']}`" if d.get("sha") else "")
    return f"`{d.get('spec') or d.get('path')}` (local folder)"


def _run(setup: _Setup, prev: StateReader | None, params, state_base: dict, *, out: str, overwrite: bool,
         shard_size: str | int, quiet: bool, prev_state: ContinualState | None, shape_mismatch: str,
         ignore_extra: bool, t0: float):
    m = get_method(METHOD)
    size = parse_size(shard_size)
    folder = OutputFolder(out, overwrite=overwrite)
    try:
        sdir = os.path.join(folder.path, STATE_DIR)
        os.makedirs(sdir)
        norms, s_norm, digests, tensors = _advance(setup, prev, params, sdir, size, quiet)
        prev_models = prev_state.models if prev_state else []
        task_norms = (prev_state.task_norms if prev_state else []) + norms
        lam = opcm_lambda(params.scaling, s_norm, task_norms)
        state = ContinualState(params=m.describe_params(params), base=state_base, base_sha256=digests,
                               models=prev_models + [r.to_dict() for r in setup.refs], task_norms=task_norms,
                               s_norm=s_norm, lam=lam, tensors=tensors, files={}, dtype=setup.dtype,
                               shape_mismatch=shape_mismatch, ignore_extra=ignore_extra, hubsoup_version=__version__)
        _write_state(sdir, state)
        recipe = Recipe(method=METHOD, params=state.params, base=state_base, inputs=state.models, dtype=setup.dtype,
                        hubsoup_version=__version__, extra={"continual": {"count": state.count, "lambda": lam}})
        _materialize(setup, StateReader(sdir, verify=False), lam, folder.path, size, recipe, quiet)
        result = _result(setup, folder, state, recipe, t0)
        folder.commit()
    except BaseException:
        folder.abort()
        raise
    result.seconds = time.perf_counter() - t0
    return result


def _dtype(dtype: str | None):
    from hubsoup.api import _DTYPES

    if dtype is not None and dtype not in _DTYPES:
        raise ParameterError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype] if dtype else None


# --- the public API ------------------------------------------------------------------------------

def init(models: Sequence[str], *, base: str | None = None, out: str, params: dict[str, Any] | None = None,
         device: str = "cpu", dtype: str | None = None, shard_size: str | int = "5GB", overwrite: bool = False,
         allow_pickle: bool = False, ignore_extra: bool = False, shape_mismatch: str = "error",
         token: str | bool | None = None, quiet: bool = False, **kwargs: Any):
    """Start a continual soup: merge ``models`` in order with OPCM and save the state beside the output.

    Parameters as :func:`hubsoup.merge`; OPCM's (``alpha``, ``scaling``, ``zero_diagonal``,
    ``rank_tol``) in ``params`` or as keywords. They are stored in the state and used by
    every later ``add``. Returns a :class:`hubsoup.MergeResult`.
    """
    from hubsoup.api import resolve_base

    t0 = time.perf_counter()
    p = get_method(METHOD).parse({**(params or {}), **kwargs})
    if not models:
        raise ParameterError("no input models given")
    if shape_mismatch not in SHAPE_POLICIES:
        raise ParameterError(f"shape_mismatch must be one of {', '.join(SHAPE_POLICIES)}, got {shape_mismatch!r}")
    out_dtype = _dtype(dtype)
    check_output(out, overwrite)
    if base is None:
        base = resolve_base([open_input(s, allow_pickle=allow_pickle, token=token) for s in models])
    base_ckpt = _open_base(base, allow_pickle, token)
    sources, refs, plan = _open_models(models, base_ckpt, allow_pickle=allow_pickle, ignore_extra=ignore_extra,
                                       shape_mismatch=shape_mismatch, token=token, device=device)
    setup = _Setup(base_ckpt, plan, sources, refs, out_dtype, dtype)
    return _run(setup, None, p, base_ckpt.ref.to_dict(), out=out, overwrite=overwrite, shard_size=shard_size,
                quiet=quiet, prev_state=None, shape_mismatch=shape_mismatch, ignore_extra=ignore_extra, t0=t0)


def add(soup: str, models: Sequence[str] | str, *, out: str | None = None, base: str | None = None,
        device: str = "cpu", dtype: str | None = None, shard_size: str | int = "5GB", overwrite: bool = False,
        allow_pickle: bool = False, token: str | bool | None = None, quiet: bool = False):
    """Add ``models`` (in order) to a continual soup, reading only its state, the base and the new models.

    Args:
        soup: the soup's folder or Hub repo ID (its ``continual_state/`` is used).
        models: the new fine-tune(s).
        out: where the new soup goes; default: replace ``soup`` in place (atomically), which
            needs ``soup`` to be a local folder.
        base: the base model, when it is not where the state says (it must be the same
            model, byte for byte: checked per tensor against the state's SHA-256s).
        dtype: output dtype (default: the one the soup was made with).
    """
    t0 = time.perf_counter()
    if isinstance(models, str):
        models = [models]
    if not models:
        raise ParameterError("no models to add")
    sdir, label = state_folder(soup, token)
    prev = StateReader(sdir, label)
    st = prev.state
    p = get_method(METHOD).parse(st.params)
    dtype = dtype if dtype is not None else st.dtype
    out_dtype = _dtype(dtype)
    if out is None:
        if not os.path.isdir(os.path.expanduser(soup)):
            raise ParameterError(f"soup '{soup}' is not a local folder; pass --out (out=...) for the new soup")
        out, overwrite = os.path.expanduser(soup), True
    else:
        check_output(out, overwrite)
    base_spec = base or _ref_spec(st.base)
    try:
        base_ckpt = _open_base(base_spec, allow_pickle, token)
    except InputError as e:
        raise ContinualStateError(f"the base the continual state was made with ({base_spec}) cannot be opened: {e}; "
                                  "pass --base (base=...) with that same model") from e
    have = {r.get("sha") or r.get("path") for r in st.models}
    sources, refs, plan = _open_models(models, base_ckpt, allow_pickle=allow_pickle, ignore_extra=st.ignore_extra,
                                       shape_mismatch=st.shape_mismatch, token=token, device=device)
    for r in refs:
        if (r.sha or (os.path.abspath(r.path) if r.path else None)) in have:
            log.warning("%s is already in this soup; adding it again counts it twice", r.label)
    setup = _Setup(base_ckpt, plan, sources, refs, out_dtype, dtype)
    return _run(setup, prev, p, st.base, out=out, overwrite=overwrite, shard_size=shard_size, quiet=quiet,
                prev_state=st, shape_mismatch=st.shape_mismatch, ignore_extra=st.ignore_extra, t0=t0)


def export(soup: str, *, out: str, base: str | None = None, device: str = "cpu", dtype: str | None = None,
           shard_size: str | int = "5GB", overwrite: bool = False, allow_pickle: bool = False,
           token: str | bool | None = None, quiet: bool = False):
    """Write the merged model θ_0 + S/λ of a soup's state to ``out`` (without the state).

    Reads the state and the base only; ``dtype``/``shard_size`` may differ from the soup's.
    """
    t0 = time.perf_counter()
    sdir, label = state_folder(soup, token)
    reader = StateReader(sdir, label)
    st = reader.state
    dtype = dtype if dtype is not None else st.dtype
    out_dtype = _dtype(dtype)
    base_ckpt = _open_base(base or _ref_spec(st.base), allow_pickle, token)
    keys = base_ckpt.keys()
    infos = {k: base_ckpt.info(k) for k in keys}
    plan = build_plan(keys, infos, base_ckpt.config, ties=tied_groups(base_ckpt.folder, keys), device=device)
    for _, e in plan.entries():
        if e.mergeable and (st.base_sha256.get(e.name) != _tensor_sha256(base_ckpt.tensor(e.name))):
            raise ContinualStateError(f"base '{base_ckpt.label}': tensor '{e.name}' differs from the base the "
                                      "continual state was made with")
    setup = _Setup(base_ckpt, plan, [], [_ref(d) for d in st.models], out_dtype, dtype)
    recipe = Recipe(method=METHOD, params=st.params, base=st.base, inputs=st.models, dtype=dtype,
                    hubsoup_version=__version__, extra={"continual": {"count": st.count, "lambda": st.lam}})
    folder = OutputFolder(out, overwrite=overwrite)
    try:
        _materialize(setup, reader, st.lam, folder.path, parse_size(shard_size), recipe, quiet)
        result = _result(setup, folder, st, recipe, t0)
        folder.commit()
    except BaseException:
        folder.abort()
        raise
    return result


def _ref_spec(ref: dict) -> str:
    if ref.get("repo_id"):
        return f"{ref['repo_id']}@{ref['sha']}" if ref.get("sha") else ref["repo_id"]
    return ref.get("path") or ref["spec"]


def _open_base(spec: str, allow_pickle: bool, token) -> Checkpoint:
    ckpt = open_input(spec, allow_pickle=allow_pickle, token=token, with_tokenizer=True)
    if ckpt.ref.kind != "full":
        raise BaseModelError(f"base '{ckpt.label}' is an adapter, not a full model")
    return ckpt


__all__ = ["init", "add", "export", "load_state", "ContinualState", "ContinualStateError", "STATE_DIR"]
