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
and never a half-written state. Every command locks what it writes and the local soup it
reads (``.soup.lock`` beside it, :mod:`hubsoup.output.folder`) before reading the state,
for the whole run: a second ``add`` on the same soup fails at once, naming the first,
instead of both succeeding and one added model being lost.

Example:
    >>> from hubsoup import continual
    >>> continual.init(["org/ft-a", "org/ft-b"], base="org/base", out="./soup")   # doctest: +SKIP
    >>> continual.add("./soup", ["org/ft-c"])                                     # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

from hubsoup import __version__
from hubsoup.api import MergeResult, footprint, scoped
from hubsoup.engine import Copy, Dense, Job, stream
from hubsoup.errors import ContinualStateError, InputError, ParameterError
from hubsoup.methods import get_method
from hubsoup.methods.opcm import opcm_lambda, opcm_update, sq_norm
from hubsoup.options import MergeOptions
from hubsoup.output import OutputFolder, ShardedWriter, check_output
from hubsoup.output.folder import OutputLock, lock_output
from hubsoup.output.checkpoint import CheckpointSink
from hubsoup.plan import Plan
from hubsoup.progress import Monitor
from hubsoup.recipe import RECIPE_FILE, Recipe
from hubsoup.session import Session, make_recipe, parse_method
from hubsoup.sources import Checkpoint, InputRef
from hubsoup.sources.access import check_specs, hub_only
from hubsoup.sources.compat import is_local, open_base
from hubsoup.workflows.continual.state import (
    STATE_DIR,
    STATE_FILE,
    ContinualState,
    StateReader,
    load_state,
    sha256_file,
    state_folder,
    tensor_sha256,
)

if TYPE_CHECKING:
    from hubsoup.methods.opcm import OpcmParams
    from hubsoup.sources.taskvector import TaskVector

log = logging.getLogger(__name__)

METHOD = "opcm"

# --- the streaming passes (both through the engine's one cursor) --------------------------------

@dataclass
class _Setup:
    base: Checkpoint
    plan: Plan
    sources: list[TaskVector]
    """The new models' task vectors, in merge order."""
    options: MergeOptions
    dtype: str | None
    """The output dtype (None: the base's)."""
    monitor: Monitor = field(default_factory=Monitor)
    """The run's progress and cancellation (:mod:`hubsoup.progress`)."""
    session: Session | None = None
    """The merge's session (None for an export: the state alone, no new model)."""


def _setup(models: Sequence[str], base: str | Checkpoint | None, options: MergeOptions, params: Any,
           prev: StateReader | None = None, monitor: Monitor | None = None) -> _Setup:
    # the merge's session: the state, when there is one, is the job's first input (placed with the new models, as
    # _advance streams them); headers only: with --cache-inputs nothing is downloaded before --max-disk is checked
    # (_run fetches then)
    monitor = monitor or Monitor()
    session = Session.open(models, get_method(METHOD), params, options, base=base, monitor=monitor, state=prev)
    return _Setup(session.base, session.plan, session.sources, options, options.dtype, monitor, session)


def _monitor(opts: MergeOptions, models: Sequence[str], soup: str | None = None) -> tuple[MergeOptions, Monitor]:
    """The run's options (quiet when a progress callback replaces the bars) and monitor: a download stage when
    a model (or the soup) is not a local folder, then the two passes (stage ``merge``)."""
    if opts.progress is not None and not opts.quiet:
        opts = opts.replace(quiet=True)
    monitor = opts.monitor()
    monitor.check("before the merge")
    local = all(is_local(m) for m in [*models, *([soup] if soup else [])])
    monitor.plan({**({} if local else {"download": 1.0}), "merge": 2.0})
    return opts, monitor


def _plan(base_ckpt: Checkpoint, state: StateReader, params: Any, options: MergeOptions) -> Plan:
    """The plan of a soup's state over ``base_ckpt``, every block on its device (the session's placement, as
    ``hubsoup plan`` and merge): ``options``' device, device map and max_memory; OPCM's workspace counted."""
    return Session.over(base_ckpt, [], get_method(METHOD), params, options, state=state, recipe=False).plan


def _advance(setup: _Setup, prev: StateReader | None, params: OpcmParams, folder: str
             ) -> tuple[list[float], float, dict[str, str], dict[str, dict[str, Any]]]:
    """Pass 1: S ← S + P_S(τ) for every new model, tensor by tensor; S written to ``folder``."""
    mergeable = [e for _, e in setup.plan.entries() if e.mergeable]
    if prev is not None:
        have, want = set(prev.state.tensors), {e.name for e in mergeable}
        if have != want:
            odd = sorted(have ^ want)[0]
            raise ContinualStateError(
                f"the continual state does not fit the base '{setup.base.label}' (tensor '{odd}' is in one but not "
                "the other); it was made with a different base")
    writer = ShardedWriter(folder, [(e.name, e.shape, torch.float32) for e in mergeable], setup.options.shard_bytes,
                           metadata={"hubsoup_continual": "S, the unscaled accumulated OPCM update"},
                           prefix="S", index=False)
    # the state, when there is one, is the job's first input: the engine streams S like a task vector
    inputs = ([prev] if prev is not None else []) + list(setup.sources)
    first_new = len(inputs) - len(setup.sources)
    job = Job(setup.plan, setup.base, inputs, quiet=setup.options.quiet, monitor=setup.monitor,
              prefetch=setup.options.prefetch)
    sq_tau = [0.0] * len(setup.sources)
    sq_S = 0.0
    digests: dict[str, str] = {}
    try:
        for work in stream(job, mergeable_only=True, unit="tensor", desc="continual: updating the state"):
            digest = tensor_sha256(work.raw_base())
            if prev is not None and prev.state.base_sha256.get(work.name) != digest:
                raise ContinualStateError(
                    f"base '{setup.base.label}': tensor '{work.name}' differs from the base the continual state "
                    "was made with; adding to it needs that same base")
            digests[work.name] = digest
            S = work.delta_into(0, torch.empty_like(work.base())) if prev is not None else None
            tau = torch.empty_like(work.base())
            for i in range(first_new, len(inputs)):
                work.delta_into(i, tau)
                sq_tau[i - first_new] += sq_norm(tau)
                S = opcm_update(S, tau, work.name, params)
            assert S is not None  # every run adds at least one model (init and add check)
            sq_S += sq_norm(S)
            writer.write(work.name, S)
            del S, tau
        writer.close()
    except BaseException:
        writer.abort()
        raise
    tensors = {name: {"file": writer.files[slot.shard], "shape": list(slot.shape)} for name, slot in writer.slots.items()}
    return [math.sqrt(v) for v in sq_tau], math.sqrt(sq_S), digests, tensors


def _materialize(setup: _Setup, S: StateReader, lam: float, folder: str, recipe: Recipe) -> None:
    """Pass 2: θ = θ_0 + S / λ, tensor by tensor, exactly as the engine computes it for ``opcm``."""
    sink = CheckpointSink(folder, setup.plan, setup.base, dtype=setup.dtype, shard_size=setup.options.shard_bytes,
                          metadata=recipe.metadata())
    job = Job(setup.plan, setup.base, [S], quiet=setup.options.quiet, monitor=setup.monitor,
              prefetch=setup.options.prefetch)
    try:
        for work in stream(job, desc="continual: writing the merged model"):
            if work.entry.mergeable:  # S / λ: the same kernel as opcm's div_
                sink.put(work, Dense(work.delta_into(0, torch.empty_like(work.base())).div_(lam)))
            else:
                sink.put(work, Copy())
        sink.close()
    except BaseException:
        sink.abort()
        raise
    with open(os.path.join(folder, RECIPE_FILE), "w", encoding="utf-8") as f:
        f.write(recipe.to_yaml())


def _write_state(folder: str, state: ContinualState) -> None:
    state.files = {f: sha256_file(os.path.join(folder, f)) for f in sorted({t["file"] for t in state.tensors.values()})}
    tmp = os.path.join(folder, STATE_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(state.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, STATE_FILE))


def _result(setup: _Setup, folder: OutputFolder, state: ContinualState, recipe: Recipe, t0: float) -> MergeResult:
    refs = [InputRef.from_dict(d) for d in state.models]
    result = MergeResult(folder.target, recipe, METHOD, dict(state.params), setup.base.ref, refs, setup.plan,
                         {"opcm.lambda": state.lam, "opcm.task_norms": state.task_norms, "opcm.s_norm": state.s_norm,
                          "continual.count": state.count}, time.perf_counter() - t0)
    lines = [f"This soup was built by continual merging (OPCM); {state.count} model(s) were added **in this order** "
             f"(the result depends on it). λ = {state.lam:.6g}.", ""]
    lines += [f"{i}. {_ref_label(d)}" for i, d in enumerate(state.models, 1)]
    lines += ["", f"The merge state is in `{STATE_DIR}/`: add one more model, without the earlier ones, with",
              "", "```bash", "hubsoup continual add <this repo or folder> <new-model>", "```"]
    result.sections.append({"title": "Continual merging", "body": "\n".join(lines)})
    result.write_card(folder.path)
    return result


def _ref_label(d: dict[str, Any]) -> str:
    if d.get("repo_id"):
        return f"{d['repo_id']}" + (f" @ `{d['sha']}`" if d.get("sha") else "")
    ref = InputRef.from_dict(d)  # a card is published: a local folder by its name and digest, never its path
    return f"`{ref.public_name}`" + (f" `sha256:{ref.digest}`" if ref.digest else "") + " (local folder)"


def _run(setup: _Setup, prev: StateReader | None, params: OpcmParams, state_base: dict[str, Any], *,
         folder: OutputFolder, t0: float) -> MergeResult:
    """Both passes into ``folder`` (locked and created by the caller, who aborts it on failure), then commit."""
    m = get_method(METHOD)
    prev_state = prev.state if prev is not None else None
    opts = setup.options
    # --max-disk before any tensor is read: the merged model, the new state S (float32) and what the Hub cache gets
    assert setup.session is not None
    predicted = footprint(setup.session)
    predicted.scratch_bytes = sum(e.numel * 4 for _, e in setup.plan.entries() if e.mergeable)
    predicted.check(opts.max_disk_bytes)
    for ckpt in (setup.base, *(getattr(s, "ckpt", None) for s in setup.sources)):  # the check passed: download
        if ckpt is not None:
            ckpt.fetch()
    sdir = os.path.join(folder.path, STATE_DIR)
    os.makedirs(sdir)
    setup.monitor.stage("merge", "continual merging (OPCM)", parts=2)  # the state's pass, then the weights'
    norms, s_norm, digests, tensors = _advance(setup, prev, params, sdir)
    prev_models = prev_state.models if prev_state else []
    task_norms = (prev_state.task_norms if prev_state else []) + norms
    lam = opcm_lambda(params.scaling, s_norm, task_norms)
    state = ContinualState(params=m.describe_params(params), base=state_base, base_sha256=digests,
                           models=prev_models + [s.ref.to_dict() for s in setup.sources], task_norms=task_norms,
                           s_norm=s_norm, lam=lam, tensors=tensors, files={}, dtype=setup.dtype,
                           shape_mismatch=opts.shape_mismatch, ignore_extra=opts.ignore_extra,
                           hubsoup_version=__version__)
    _write_state(sdir, state)
    recipe = make_recipe(METHOD, state.params, InputRef.from_dict(state_base),
                         [InputRef.from_dict(d) for d in state.models], dtype=setup.dtype,
                        continual={"count": state.count, "lambda": lam})
    _materialize(setup, StateReader(sdir, verify=False), lam, folder.path, recipe)
    result = _result(setup, folder, state, recipe, t0)
    setup.monitor.check("before the output was committed")
    folder.commit()
    result.seconds = time.perf_counter() - t0
    if setup.monitor.reporting:
        setup.monitor.finish(f"merged into {folder.target}")
    return result


def _lock_soup(soup: str) -> OutputLock | None:
    """The lock on a local soup (None for a Hub soup), taken before its state is read; recovers an interrupted add."""
    if hub_only():  # the soup is a Hub repo ID (check_specs): no folder of this machine is looked at
        return None
    path = os.path.abspath(os.path.expanduser(soup))
    parent, name = os.path.split(path)
    try:
        interrupted = not os.path.exists(path) and any(e.startswith(f".{name}.old-") for e in os.listdir(parent))
    except OSError:
        interrupted = False
    return lock_output(path, what="continual soup") if os.path.isdir(path) or interrupted else None


# --- the public API ------------------------------------------------------------------------------

@scoped
def init(models: Sequence[str], *, base: str | None = None, out: str, params: dict[str, Any] | None = None,
         options: MergeOptions | None = None, **kwargs: Any) -> MergeResult:
    """Start a continual soup: merge ``models`` in order with OPCM and save the state beside the output.

    Options as :func:`hubsoup.merge` (``options=`` or their names as keywords); OPCM's parameters
    (``alpha``, ``scaling``, ``zero_diagonal``, ``rank_tol``) in ``params`` or as keywords. They are
    stored in the state and used by every later ``add``. Returns a :class:`hubsoup.MergeResult`.

    ``progress=`` and ``cancel=`` as for :func:`hubsoup.merge` (stages ``download``, ``merge``; a
    cancel leaves no output). Example::

        continual.init(["org/ft-a"], base="org/base", out="./soup", cancel=stop,
                       progress=lambda done, stage, msg: print(f"{done:.0%} {msg}"))
    """
    t0 = time.perf_counter()
    opts, extra = MergeOptions.split(kwargs, options)
    _, p = parse_method(METHOD, {**(params or {}), **extra})
    if not models:
        raise ParameterError("no input models given")
    check_specs(inputs=models, base=base)
    check_output(out, opts.overwrite)
    opts, monitor = _monitor(opts, models)
    folder = OutputFolder(out, overwrite=opts.overwrite)  # locked for the whole run
    try:
        setup = _setup(models, base, opts, p, monitor=monitor)
        return _run(setup, None, p, setup.base.ref.to_dict(), folder=folder, t0=t0)
    except BaseException as e:
        raise folder.fail(e)


@scoped
def add(soup: str, models: Sequence[str] | str, *, out: str | None = None, base: str | None = None,
        options: MergeOptions | None = None, **kwargs: Any) -> MergeResult:
    """Add ``models`` (in order) to a continual soup, reading only its state, the base and the new models.

    Args:
        soup: the soup's folder or Hub repo ID (its ``continual_state/`` is used).
        models: the new fine-tune(s).
        out: where the new soup goes; default: replace ``soup`` in place (atomically), which
            needs ``soup`` to be a local folder.
        base: the base model, when it is not where the state says (it must be the same
            model, byte for byte: checked per tensor against the state's SHA-256s).
        options: as :func:`hubsoup.merge` (or their names as keywords); ``dtype`` defaults to
            the one the soup was made with; ``ignore_extra``/``shape_mismatch`` are the state's.
            ``progress=`` and ``cancel=`` as for :func:`hubsoup.merge`: a cancelled add leaves the
            soup as it was, e.g. ``continual.add("./soup", "org/ft-c", cancel=stop, progress=report)``.
    """
    t0 = time.perf_counter()
    opts, extra = MergeOptions.split(kwargs, options)
    if extra:
        raise ParameterError(f"continual add: unknown option '{sorted(extra)[0]}' (OPCM's parameters are fixed by "
                             "the state)")
    if isinstance(models, str):
        models = [models]
    if not models:
        raise ParameterError("no models to add")
    check_specs(inputs=models, base=base, soup=soup)
    opts, monitor = _monitor(opts, models, soup)
    # an add in place replaces the soup: lock it before its state is read, for the whole run (an add to
    # another --out only reads it, and the in-place replacement is an atomic rename)
    local = is_local(soup)
    same = local and out is not None and (os.path.abspath(os.path.expanduser(out))
                                          == os.path.abspath(os.path.expanduser(soup)))
    soup_lock = _lock_soup(soup) if out is None or same else None
    try:
        if out is None:
            if soup_lock is None:
                raise ParameterError(f"soup '{soup}' is not a local folder; pass --out (out=...) for the new soup")
            out, opts = soup_lock.target, opts.replace(overwrite=True)
        else:
            check_output(out, opts.overwrite)
        in_place = soup_lock is not None and os.path.abspath(os.path.expanduser(out)) == soup_lock.target
        folder = OutputFolder(out, overwrite=opts.overwrite, what="continual soup" if in_place else "output")
        try:
            return _add(soup, models, folder, base, opts, t0, monitor)
        except BaseException as e:
            raise folder.fail(e)
    finally:
        if soup_lock is not None:
            soup_lock.release()


def _add(soup: str, models: Sequence[str], folder: OutputFolder, base: str | None, opts: MergeOptions, t0: float,
         monitor: Monitor | None = None) -> MergeResult:
    sdir, label = state_folder(soup, opts.token)
    prev = StateReader(sdir, label)
    st = prev.state
    p = get_method(METHOD).parse(st.params)
    opts = opts.replace(dtype=opts.dtype if opts.dtype is not None else st.dtype,
                        ignore_extra=st.ignore_extra, shape_mismatch=st.shape_mismatch)
    base_ref = InputRef.from_dict(st.base)
    from_hub = not is_local(soup)
    if base is None and from_hub and not base_ref.repo_id:
        # a state downloaded from the Hub must not choose a folder on this machine as the base
        raise ContinualStateError(f"soup '{soup}': its continual state names a local base, not a Hub repo; pass "
                                  "--base (base=...) with that same model")
    base_spec = base or base_ref.pinned_spec
    try:
        base_ckpt = open_base(base_spec, allow_pickle=opts.allow_pickle, token=opts.token,
                              hub_only=base is None and from_hub, monitor=monitor, headers_only=True)
    except InputError as e:
        raise ContinualStateError(f"the base the continual state was made with ({base_spec}) cannot be opened: {e}; "
                                  "pass --base (base=...) with that same model") from e
    setup = _setup(models, base_ckpt, opts, p, prev, monitor)
    have = {r.get("sha") or r.get("path") for r in st.models}
    for s in setup.sources:
        r = s.ref
        if (r.sha or (os.path.abspath(r.path) if r.path else None)) in have:
            log.warning("%s is already in this soup; adding it again counts it twice", r.label)
    return _run(setup, prev, p, st.base, folder=folder, t0=t0)


@scoped
def export(soup: str, *, out: str, base: str | None = None, options: MergeOptions | None = None,
           **kwargs: Any) -> MergeResult:
    """Write the merged model θ_0 + S/λ of a soup's state to ``out`` (without the state).

    Reads the state and the base only; ``dtype``/``shard_size`` may differ from the soup's.
    """
    t0 = time.perf_counter()
    opts, extra = MergeOptions.split(kwargs, options)
    if extra:
        raise ParameterError(f"continual export: unknown option '{sorted(extra)[0]}'")
    check_specs(base=base, soup=soup)
    check_output(out, opts.overwrite)
    soup_lock = _lock_soup(soup)  # an `add` must not replace the soup while it is read
    try:
        folder = OutputFolder(out, overwrite=opts.overwrite)
        try:
            return _export(soup, folder, base, opts, t0)
        except BaseException as e:
            raise folder.fail(e)
    finally:
        if soup_lock is not None:
            soup_lock.release()


def _export(soup: str, folder: OutputFolder, base: str | None, opts: MergeOptions, t0: float) -> MergeResult:
    sdir, label = state_folder(soup, opts.token)
    reader = StateReader(sdir, label)
    st = reader.state
    opts = opts.replace(dtype=opts.dtype if opts.dtype is not None else st.dtype)
    base_ckpt = open_base(base or InputRef.from_dict(st.base).pinned_spec, allow_pickle=opts.allow_pickle, token=opts.token)
    setup = _Setup(base_ckpt, _plan(base_ckpt, reader, get_method(METHOD).parse(st.params), opts), [], opts,
                   opts.dtype)
    for _, e in setup.plan.entries():
        if e.mergeable and (st.base_sha256.get(e.name) != tensor_sha256(base_ckpt.tensor(e.name))):
            raise ContinualStateError(f"base '{base_ckpt.label}': tensor '{e.name}' differs from the base the "
                                      "continual state was made with")
    base_ckpt.release()
    recipe = make_recipe(METHOD, st.params, InputRef.from_dict(st.base), [InputRef.from_dict(d) for d in st.models],
                         dtype=opts.dtype,
                        continual={"count": st.count, "lambda": st.lam})
    _materialize(setup, reader, st.lam, folder.path, recipe)
    result = _result(setup, folder, st, recipe, t0)
    folder.commit()
    return result


__all__ = ["init", "add", "export", "load_state", "ContinualState", "STATE_DIR"]
