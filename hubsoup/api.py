"""``hubsoup.merge``: the Python API that the CLI calls."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, ParamSpec, Sequence, TypeVar, cast

import torch

from hubsoup.card import write_card
from hubsoup.engine import remote_bytes
from hubsoup.engine.lowrank import reads_base as lowrank_reads_base
from hubsoup.engine.placement import start_device
from hubsoup.errors import MergeCancelled, ParameterError, PushError
from hubsoup.eval import TaskSpec
from hubsoup.footprint import Footprint, on_disk
from hubsoup.eval.run import EVAL_FILE, evaluate_output, read_results
from hubsoup.hub import HubPush, PushTarget, push_folder, retarget_card
from hubsoup.hubclient import Token, check_repo_id
from hubsoup.methods import Method, TensorContext
from hubsoup.options import MergeOptions
from hubsoup.output import OutputFolder, check_output
from hubsoup.output.checkpoint import BASE_FILES, CheckpointSink
from hubsoup.output.lora import LoraOptions, LoraSink
from hubsoup.output.shards import SHARDS_IN_FLIGHT, shard_layout
from hubsoup.plan import OutputLayout, Plan
from hubsoup.progress import Cancel, Monitor, Progress
from hubsoup.recipe import RECIPE_FILE, Recipe
from hubsoup.sources import InputRef
from hubsoup.sources.access import Access, check_specs, current, scope
from hubsoup.sources.compat import is_local
from hubsoup.session import Session, parse_method
from hubsoup.untrusted import read_json

log = logging.getLogger(__name__)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def scoped(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``fn`` (a public entry point taking ``options=`` and options as keywords) inside :func:`scope` of
    its options: every spec that reaches :func:`hubsoup.sources.resolve.open_input` during it follows them.
    (Here, beside the entry points, not in :mod:`hubsoup.sources.access`: it reads :class:`MergeOptions`.)"""

    @functools.wraps(fn)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        names = MergeOptions.names()
        opts, _ = MergeOptions.split({k: v for k, v in kwargs.items() if k in names},
                                     cast("MergeOptions | None", kwargs.get("options")))
        with scope(opts):
            return fn(*args, **kwargs)

    return run


def keeps_inputs(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``fn`` (a workflow that merges the same inputs many times: search, sweeps, greedy soups, evolve) with
    ``cache_inputs``: Hub inputs' weight files are downloaded into the Hub cache once and read there by every
    merge, instead of being read in place again by each (:mod:`hubsoup.sources.remote`). Inside :func:`scoped`,
    so the run's token, ``hub_only`` and budget carry over."""

    @functools.wraps(fn)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with scope(cache_inputs=True):
            return fn(*args, **kwargs)

    return run


CARD_EXTRAS_FILE = "hubsoup_card.json"
"""Card content added after the merge (notes, sections, search), kept so a re-render keeps it."""


@dataclass
class MergeResult:
    """What a merge produced. ``path`` is a standard ``save_pretrained`` folder."""

    path: str
    recipe: Recipe
    method: str
    params: dict[str, Any]
    base: InputRef
    inputs: list[InputRef]
    plan: Plan | None = field(repr=False)
    """The merge plan (None for a result read back with :meth:`from_folder`)."""
    stats: dict[str, Any] = field(default_factory=dict, repr=False)
    seconds: float = 0.0
    output_format: str = "full"
    """``full`` (a checkpoint) or ``lora`` (a PEFT adapter of the base)."""
    lora: dict[str, Any] | None = field(default=None, repr=False)
    """LoRA output only: ranks and truncation errors (``hubsoup_lora_report.json``)."""
    evaluation: list[Any] = field(default_factory=list, repr=False)
    """:class:`hubsoup.eval.TaskResult` of each ``evaluate`` task (also in ``eval_results.json``)."""
    notes: list[str] = field(default_factory=list, repr=False)
    """Markdown paragraphs for the card's "Merge notes", after the method's own (e.g. a greedy soup's)."""
    sections: list[dict[str, str]] = field(default_factory=list, repr=False)
    """Extra card sections, ``{"title": ..., "body": markdown}`` (e.g. continual merging's)."""
    search: dict[str, Any] | None = field(default=None, repr=False)
    """The hyper-parameter search that chose this merge (grid, scores, best point), if any."""
    restricted: list[dict[str, str]] = field(default_factory=list, repr=False)
    """Hub inputs that were not public when merged: ``{"repo": ..., "why": "private" | "gated"}`` (the card says
    so; a push to a public repo is refused unless ``allow_private_inputs``)."""
    allow_private_inputs: bool = field(default=False, repr=False)
    """The run allowed its merge of private or gated inputs to be pushed to a public repo."""
    hub_only: bool = field(default=False, repr=False)
    """Made by a ``hub_only`` run: its card is never rendered from a local template file."""
    card_text: str | None = field(default=None, repr=False)
    """The model card as last rendered by :meth:`write_card` (None: not rendered in this process; see :attr:`card`)."""
    pushed: Any = field(default=None, repr=False)
    """A merge streamed to the Hub (``merge(..., push=...)``): its commit (``huggingface_hub.CommitInfo``:
    ``commit_url``, ``oid``, ``pr_url``). Without ``out`` nothing stays on disk and :attr:`path` is empty."""
    repo_id: str | None = field(default=None, repr=False)
    """The Hub repo the merge was pushed to (with :attr:`pushed`)."""
    network: dict[str, Any] = field(default_factory=dict, repr=False)
    """What the merge read from the Hub: ``fetched`` and ``needed`` bytes (:mod:`hubsoup.sources.remote`), the files
    ``verified`` against their sha256 and the ``unverified`` ones with why, and the ``predicted`` footprint."""

    def save_card_extras(self, folder: str | None = None) -> None:
        """Persist :attr:`notes`, :attr:`sections` and :attr:`search` beside the recipe (when there are any)."""
        path = os.path.join(folder or self.path, CARD_EXTRAS_FILE)
        if not (self.notes or self.sections or self.search or self.restricted):
            if os.path.exists(path):
                os.remove(path)
            return
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"notes": self.notes, "sections": self.sections, "search": self.search,
                       **({"restricted": self.restricted} if self.restricted else {})}, f, indent=2, default=str)

    @classmethod
    def from_folder(cls, path: str) -> "MergeResult":
        """The result of the merge whose output is ``path``, from its recipe and saved card extras.

        Enough to render its card again (``result.write_card(template=...)``) with everything
        the first rendering had: notes, sections (continual merging), search, LoRA report, evals.
        """
        with open(os.path.join(path, RECIPE_FILE), encoding="utf-8") as f:
            recipe = Recipe.from_yaml(f.read())
        lora = read_json(os.path.join(path, "hubsoup_lora_report.json"))
        extras = read_json(os.path.join(path, CARD_EXTRAS_FILE)) or {}
        result = cls(os.path.abspath(path), recipe, recipe.method, dict(recipe.params), recipe.base,
                     list(recipe.inputs), None, output_format=recipe.output.get("format", "full"), lora=lora,
                     notes=extras.get("notes") or [], sections=extras.get("sections") or [],
                     restricted=[r for r in extras.get("restricted") or [] if isinstance(r, dict)],
                     search=extras.get("search"))

        result.evaluation = read_results(os.path.join(path, EVAL_FILE))  # so a re-rendered card keeps its scores
        if recipe.continual:
            result.stats = {"opcm.lambda": recipe.continual.get("lambda"), "continual.count": recipe.continual.get("count")}
        return result

    def write_card(self, folder: str | None = None, **kwargs: Any) -> str:
        """Render the card (``hubsoup.card.render``) into ``folder`` (default: the output) and keep its extras."""
        if self.hub_only and kwargs.get("template"):
            raise ParameterError("card template: a local file, and this result's run was hub_only")
        folder = folder or self.path
        path = write_card(self, folder, **kwargs)
        self.save_card_extras(folder)
        return path

    @property
    def card(self) -> str:
        """The rendered model card: the text :meth:`write_card` rendered (what ``README.md`` holds), or for a
        result read back with :meth:`from_folder`, the output's ``README.md``."""
        if self.card_text is not None:
            return self.card_text
        if not self.path:
            raise ParameterError("this merge was pushed without a local copy, and its card was not rendered here")
        with open(os.path.join(self.path, "README.md"), encoding="utf-8") as f:
            return f.read()

    def push_to_hub(self, repo_id: str, *, private: bool | None = None, create_pr: bool = False,
                    commit_message: str | None = None, token: Token = None,
                    eval_results: Sequence[Any] | None = None, card_template: str | None = None,
                    license: str | None = None, progress: Progress | None = None, cancel: Cancel | None = None,
                    allow_private_inputs: bool | None = None) -> Any:
        """Upload the output folder to the Hub in one commit (the repo is created if needed).

        The folder's model card is updated first, in place, so that the folder stays identical
        to what is on the Hub and ``hubsoup push FOLDER REPO`` retries a failed push: its "how to
        use" snippet loads ``repo_id``. Given ``eval_results`` (``huggingface_hub.EvalResult``
        entries: the card's ``model-index`` and results table), ``card_template`` or ``license``,
        the card is rendered again from this result (its notes, sections and search included).

        ``progress(done, stage, message)`` and ``cancel`` (a ``threading.Event`` or a callable) as
        for :func:`merge` (:mod:`hubsoup.progress`): stage ``"push"``, reports as the files go up (counted in bytes),
        nothing printed; ``cancel`` is checked before the repo is created, between files and before
        the commit, and a cancelled push raises :class:`hubsoup.errors.MergeCancelled` with no
        commit made (a repo this call created is deleted again).

        A merge of a private or gated Hub input (asked of the Hub with ``token`` at push time) is not pushed
        to a public repo unless ``allow_private_inputs`` (default: the merge's ``MergeOptions``); the card
        then has a "Private or gated inputs" section.

        Returns:
            ``huggingface_hub.CommitInfo`` (``commit_url``, ``oid``, ``pr_url``).

        Raises:
            hubsoup.errors.PushError: what failed and how to retry; the local folder is intact.
            hubsoup.errors.MergeCancelled: ``cancel`` was set; nothing was committed.

        Example:
            >>> info = result.push_to_hub("my-org/soup", private=True)   # doctest: +SKIP
            >>> print(info.commit_url)                                     # doctest: +SKIP
            >>> stop = threading.Event()                  # e.g. set by a Cancel button  # doctest: +SKIP
            >>> result.push_to_hub("my-org/soup", token=user_token, cancel=stop,
            ...                    progress=lambda done, stage, msg: print(f"{done:.0%} {msg}"))  # doctest: +SKIP
        """
        check_repo_id(repo_id)
        if not self.path:  # streamed to the Hub without a local copy: nothing here to push again
            if self.pushed is not None and repo_id == self.repo_id:
                return self.pushed
            raise PushError(f"this merge was pushed to {self.repo_id} without a local copy: merge again with "
                            f"push='{repo_id}' (or with out= to keep one)")
        monitor = Monitor(progress, cancel)
        monitor.plan({"push": 1.0})  # the whole bar: done moves as the files go up (unplanned, it stood at 0 till 1)
        monitor.check("before the push")
        if eval_results or card_template or license:
            self.write_card(repo_id=repo_id, eval_results=eval_results, template=card_template, license=license)
        elif retarget_card(self.path, repo_id):
            self.card_text = None  # the card on disk now names repo_id: read it from there
        allow = self.allow_private_inputs if allow_private_inputs is None else allow_private_inputs
        info = push_folder(self.path, repo_id, private=private, create_pr=create_pr,
                           commit_message=commit_message, token=token, monitor=monitor, allow_private_inputs=allow,
                           card_writer=note_restricted_inputs)
        if monitor.reporting:
            monitor.finish(f"pushed to {repo_id}")
        return info

    def __str__(self) -> str:
        what = ""
        if self.lora is not None:
            what = f" as a LoRA adapter (relative truncation error {self.lora['aggregate_rel_error']:.2e})"
        where = self.path or f"pushed to {self.repo_id}"
        return (f"merged {len(self.inputs)} model(s) with {self.method} onto {self.base.label}{what} "
                f"in {self.seconds:.2f}s -> {where}")


def note_restricted_inputs(folder: str, repo_id: str, restricted: list[dict[str, str]]) -> None:
    """The push's card hook (``hubsoup.hub.push_folder(card_writer=...)``): the card of the merge in ``folder``
    says which inputs were not public, as the Hub says now (rendered again when it does not)."""
    result = MergeResult.from_folder(folder)
    if result.restricted != restricted:
        result.restricted = restricted
        result.write_card(folder, repo_id=repo_id)


@scoped  # hub_only, cache_dir, max_download hold for every spec opened during the merge
def merge(inputs: Sequence[str], method: str, *, base: str | None = None, out: str | None = None,
          params: Mapping[str, Any] | None = None, options: MergeOptions | None = None,
          output_format: str = "full", rank: int | None = None, energy: float | None = None,
          evaluate: Sequence[Any] | None = None, eval_limit: int | None = None, progress: Progress | None = None,
          cancel: Cancel | None = None, layout: OutputLayout | None = None, push: str | PushTarget | None = None,
          before_push: Callable[[MergeResult, str], None] | None = None, **kwargs: Any) -> MergeResult:
    """Merge fine-tunes of one base model and write a standard checkpoint folder, or stream it to the Hub.

    Args:
        inputs: local folders or Hub repo IDs (``org/name[@revision]``).
        method: a registered method name (``hubsoup methods`` lists them).
        base: the pre-trained model; when omitted, taken from the inputs' model cards.
        out: output folder (written atomically; must not exist unless ``overwrite``). With ``push``, optional:
            given, the output is also kept there (its whole size on disk); else nothing stays on disk.
        push: a Hub repo ID (``org/name``) or a :class:`hubsoup.hub.PushTarget` (private, pull request, commit
            message, token, ...): the output is streamed there. Each shard is uploaded as soon as it is written
            (huggingface_hub's pre-upload of LFS files, in a background thread while the merge goes on) and
            deleted, so the disk holds at most ``SHARDS_IN_FLIGHT + 1`` shards; the index, config, tokenizer,
            card and recipe go with every shard in one commit at the end. Nothing is visible on the repo before
            that commit; a failed, interrupted or cancelled run commits nothing (a cancel also deletes the repo
            it created). Run again after a failure or an interruption, the same merge resumes: the shards the
            Hub already holds are neither computed nor uploaded again. The checks of :func:`hubsoup.hub.push_folder`
            hold (private or gated inputs, no local path in anything sent, checked per shard before its upload).
            ``result.pushed`` is the commit.
        before_push: with ``push``, called as ``before_push(result, folder)`` once the output is complete in
            ``folder`` (its card rendered), before the commit that publishes it: e.g. to render the card again.
        params: method parameters (``hubsoup methods NAME`` lists them).
        options: how inputs are read and the output written (:class:`hubsoup.options.MergeOptions`:
            ``device``, ``dtype``, ``shard_size``, ``overwrite``, ``allow_pickle``, ``ignore_extra``,
            ``shape_mismatch``, ``token``, ``quiet``).
        output_format: ``full`` (a checkpoint) or ``lora`` (a PEFT adapter of the base holding
            the merged task vector, per-module truncated SVD; see :mod:`hubsoup.output.lora`).
        rank: LoRA output: the rank of every module (the cap when ``energy`` is given).
        energy: LoRA output: per module, the smallest rank keeping this fraction of ‖τ‖²_F.
        evaluate: tasks (:class:`hubsoup.eval.TaskSpec` or spec strings such as
            ``"classification:val.csv,text=sentence"``) to evaluate the output on before it is
            committed; results go to ``eval_results.json`` and the card's model-index.
        eval_limit: evaluate on at most this many examples per task.
        progress: ``progress(done, stage, message)``, for apps (:mod:`hubsoup.progress`): ``done``
            goes from 0.0 to exactly 1.0, never down; ``stage`` is ``download`` (Hub models),
            ``statistics`` (methods with whole-model passes, e.g. TIES with ``scope="model"``),
            ``merge``, ``eval`` (with ``evaluate``); called at least once per stage and per block.
            Given, nothing is printed (no progress bars, huggingface_hub's included).
        cancel: a ``threading.Event`` or a callable returning True: checked before every tensor,
            between downloaded files and before the output is committed; a cancelled merge raises
            :class:`hubsoup.errors.MergeCancelled` and leaves no output, no temporary folder, no lock.
        layout: how the output is laid out from the inputs when not as the base is: a
            :class:`hubsoup.formats.mergekit.MergekitLayout` (a mergekit config's slices, output
            config, tokenizer; see :func:`hubsoup.workflows.rerun.run_config`).
        **kwargs: an option's name (``overwrite=True``, ``dtype="bf16"``, ...) sets that option;
            anything else is a method parameter (``density=0.2``; LOT's ``exemplars={...}``).

    Inputs may be PEFT LoRA adapters (folders or repos with ``adapter_config.json``),
    mixed freely with full fine-tunes of the same base.

    Returns:
        :class:`MergeResult` describing the output; ``result.card`` is the rendered card.

    Raises:
        hubsoup.errors.HubsoupError: a one-line reason (bad input, parameter, option, output exists, ...).

    Example:
        >>> import hubsoup
        >>> res = hubsoup.merge(["org/ft-a", "org/ft-b"], method="ties", base="org/base",
        ...                     out="./soup", density=0.2)          # doctest: +SKIP
        >>> res.path                                                # doctest: +SKIP
        '/abs/path/soup'

        In an app (a Gradio Space), with a progress callback and a Cancel button's event:

        >>> import threading
        >>> stop = threading.Event()                                # stop.set() cancels
        >>> res = hubsoup.merge(["org/ft-a", "org/ft-b"], method="ties", base="org/base", out="./soup",
        ...                     token=user_token, cancel=stop,
        ...                     progress=lambda done, stage, msg: print(f"{done:.0%} {stage}: {msg}"))  # doctest: +SKIP
        >>> res.card[:3]                                            # doctest: +SKIP
        '---'
    """
    t0 = time.perf_counter()
    target = PushTarget.of(push) if push is not None else None
    if out is None and target is None:
        raise ParameterError("give the output folder (out=), a Hub repo to stream the output to (push=), or both")
    network = _NetworkShare.start()  # the run's share of the scope's counters
    opts, extra = MergeOptions.split(kwargs, options)
    opts = opts.watched(progress, cancel)  # a progress callback replaces every bar and print
    monitor = opts.monitor()
    monitor.check("before the merge")
    start_device(opts.device, opts.device_map)  # CUDA's context comes up while the inputs are opened
    m, p = parse_method(method, {**(params or {}), **extra})
    tasks = _tasks(evaluate)
    lora = _check_request(inputs, base, out, opts, m, p, tasks, layout, output_format=output_format, rank=rank,
                          energy=energy)
    keep_files = out is not None or bool(tasks)  # a streamed push's shards stay on disk: kept, or evaluated
    # the lock on `out` (a second run fails at once, naming this one) and the temporary folder, before any work;
    # a push without a local copy works in a temporary folder of its own (locked per repo), removed at the end
    folder = _output_folder(out, target, opts)
    sink: LoraSink | CheckpointSink | None = None
    hub_push: HubPush | None = None
    try:
        monitor.plan(_stage_weights(m, p, inputs, base, tasks, push=target is not None))
        # open, plan, place and the recipe, once (Hub models from their safetensors headers: the fit check below
        # runs before any weight moves)
        session = Session.open(inputs, m, p, opts, base=base, layout=layout, monitor=monitor, out=out,
                               lora_output=lora is not None, name=method,
                               output={"format": "lora", "rank": rank, "energy": energy} if lora is not None else {})
        predicted = _check_footprint(session, lora_output=lora is not None, push=target is not None,
                                     local_copy=keep_files)
        session.fetch()  # the fit check passed: download
        if target is not None:  # before the first upload: the checks, then the repo (created if needed)
            hub_push = target.stream(token=opts.token, allow_private_inputs=opts.allow_private_inputs,
                                     monitor=monitor, keep_files=keep_files, card_writer=note_restricted_inputs)
            hub_push.prepare(folder.path, session.recipe)
            hub_push.begin()
        sink = _sink(session, folder.path, lora, hub_push)
        job = session.job(quiet=opts.quiet, prefetch=opts.prefetch, scratch=folder.path,
                          read_ahead=opts.read_ahead_bytes, skip_output=_resumed(session, sink, hub_push))
        stats = session.run(sink, job)
        lora_report = sink.close()
        session.finish(folder.path)  # the layout's files and the recipe
        result = _result(session, folder.target if out is not None else "", method, output_format, stats,
                         time.perf_counter() - t0, lora_report, network.since(predicted),
                         repo_id=target.repo_id if target is not None else None)
        if tasks:
            result.evaluation = evaluate_output(folder.path, tasks, limit=eval_limit, device=opts.device,
                                                quiet=opts.quiet, monitor=monitor, token=opts.token)
        result.write_card(folder.path, **({"repo_id": target.repo_id} if target is not None else {}))
        monitor.check("before the output was committed")
        if hub_push is None:
            folder.commit()
        else:
            if before_push is not None:
                before_push(result, folder.path)
            result.pushed = hub_push.publish(folder, keep_local=out is not None)
    except BaseException as e:
        raise _failed(e, folder, sink, hub_push)
    result.seconds = time.perf_counter() - t0
    result.hub_only = opts.hub_only or current().hub_only
    if monitor.reporting:
        monitor.finish(f"pushed to {target.repo_id}" if target is not None else f"merged into {folder.target}")
    return result


class _NetworkShare:
    """A run's share of its scope's Hub counters (:func:`hubsoup.sources.access.current`: one scope may hold many
    runs, a sweep's), counted from :meth:`start`."""

    def __init__(self, acc: Access) -> None:
        self.acc = acc
        self.counted = (acc.fetched, acc.needed, len(acc.verified), len(acc.unverified))

    @classmethod
    def start(cls) -> "_NetworkShare":
        return cls(current())

    def since(self, predicted: Footprint) -> dict[str, Any]:
        """:attr:`MergeResult.network`: what was read since :meth:`start`, and the ``predicted`` footprint."""
        acc, counted = self.acc, self.counted
        return {"fetched": acc.fetched - counted[0], "needed": acc.needed - counted[1],
                "verified": acc.verified[counted[2]:], "unverified": acc.unverified[counted[3]:],
                "predicted": dataclasses.asdict(predicted)}


def _output_folder(out: str | None, target: PushTarget | None, opts: MergeOptions) -> OutputFolder:
    """``out``'s folder, or the scratch folder of a push without a local copy (locked per repo, removed at the end)."""
    if out is not None:
        return OutputFolder(out, overwrite=opts.overwrite)
    assert target is not None  # neither `out` nor a push target is refused at merge's start
    return OutputFolder(target.scratch_dir(), overwrite=True, what="push")


def _check_request(inputs: Sequence[str], base: str | None, out: str | None, opts: MergeOptions, m: Method[Any],
                   p: Any, tasks: list[Any], layout: OutputLayout | None, *, output_format: str, rank: int | None,
                   energy: float | None) -> LoraOptions | None:
    """What :func:`merge` checks before any work (no folder made yet): the inputs' specs, the output's format and
    folder, the eval tasks' data. Returns the LoRA output's options (None: a full checkpoint)."""
    if not inputs:
        raise ParameterError("no input models given")
    check_specs(inputs=inputs, base=base, tasks=tasks, exemplars=getattr(p, "exemplars", None))
    lora = _lora_options(output_format, rank, energy, opts)
    if layout is not None and lora is not None:
        raise ParameterError("a mergekit config's merge is written as a full checkpoint, not a LoRA adapter")
    m.check_inputs(p, len(inputs))
    if out is not None:
        check_output(out, opts.overwrite)
    for task in tasks:  # the eval data (file, columns, head) now: a typo must not cost a whole merge
        task.check(opts.token)
    return lora


def _failed(e: BaseException, folder: OutputFolder, sink: LoraSink | CheckpointSink | None,
            hub_push: HubPush | None) -> BaseException:
    """What a failed merge raises (``e``, or one line for a full or read-only disk), once it has left nothing: the
    push stopped first (no shard the writer still completes goes up; nothing committed; a cancel deletes the repo
    the push created), the sink's files closed, the temporary folder removed and the lock released."""
    if hub_push is not None:
        hub_push.abort(cancelled=isinstance(e, MergeCancelled))
    if sink is not None:
        sink.abort()
    return folder.fail(e)


def _check_footprint(session: Session, *, lora_output: bool, push: bool, local_copy: bool) -> Footprint:
    """The run's disk and network from its plan, before any weight moves (:func:`footprint`), checked: ``max_disk``,
    then the download budget (a streamed push without a local copy holds ``SHARDS_IN_FLIGHT + 1`` shards;
    evaluation keeps them all)."""
    predicted = footprint(session, lora_output=lora_output, push=push, local_copy=local_copy)
    predicted.check(session.opts.max_disk_bytes)
    if current().limited:
        current().check_total(predicted.network_in - predicted.already_read)
    return predicted


def _sink(session: Session, folder: str, lora: LoraOptions | None, hub_push: HubPush | None
          ) -> LoraSink | CheckpointSink:
    """What the engine writes the output into, in ``folder``: a LoRA adapter (``lora``), else a checkpoint, each
    complete shard handed to ``hub_push`` (a push streamed to the Hub). Every shard's header holds the public
    recipe."""
    assert session.recipe is not None, "a merge's sink needs its recipe (the shards' headers)"
    metadata = session.recipe.metadata()  # the public recipe: no local path in what may be pushed
    if lora is not None:
        return LoraSink.of_merge(session.base, session.sources, lora, folder, metadata)
    return CheckpointSink(folder, session.plan, session.base, dtype=session.opts.dtype,
                          shard_size=session.opts.shard_bytes, metadata=metadata, handoff=hub_push)


def _resumed(session: Session, sink: LoraSink | CheckpointSink, hub_push: HubPush | None) -> frozenset[str]:
    """The plan entries the engine need not compute: on a rerun after an interrupted push, those whose shards the
    Hub already holds (:meth:`hubsoup.hub.HubPush.resume`; they are not written either)."""
    if hub_push is None or not isinstance(sink, CheckpointSink):
        return frozenset()
    assert session.recipe is not None, "a resumed push is keyed by the merge's recipe"
    sink.writer.mark_remote(hub_push.resume(sink.writer.layout, _push_key(session.recipe.hash, session.opts)))
    return sink.unneeded()


def _result(session: Session, path: str, method: str, output_format: str, stats: dict[str, Any], seconds: float,
            lora_report: dict[str, Any] | None, network: dict[str, Any], *, repo_id: str | None) -> MergeResult:
    """The :class:`MergeResult` of a merge's session, its output at ``path`` ('': pushed without a local copy)."""
    assert session.recipe is not None, "a merge's result holds its recipe"
    m, p, base_ckpt, sources, layout = session.method, session.params, session.base, session.sources, session.layout
    result = MergeResult(path, session.recipe, method, m.describe_params(p), base_ckpt.ref, [s.ref for s in sources],
                         session.plan, _jsonable(stats), seconds, output_format, lora_report, repo_id=repo_id)
    result.restricted = _restricted([base_ckpt, *(getattr(s, "ckpt", None) for s in sources),
                                     *(layout.reads if layout is not None else ())])
    result.network = network
    result.allow_private_inputs = session.opts.allow_private_inputs
    if layout is not None:
        result.sections.append(layout.card_section())  # e.g. the mergekit config, as YAML
    return result


@scoped  # hub_only, cache_dir hold for every spec opened
def push_figures(inputs: Sequence[str], *, base: str | None = None, push: bool = True, bandwidth: float | None = None,
                 options: MergeOptions | None = None, method: str = "task_arithmetic",
                 **kwargs: Any) -> dict[str, float | int | None]:
    """What a merge of ``inputs`` would need, before it starts: ``{"disk", "download", "upload", "seconds"}``.

    The figures of the merge's own plan (:func:`footprint`, what ``merge`` checks ``max_disk`` against and
    ``hubsoup plan --push`` prints), read from the Hub's file sizes and the models' safetensors headers only
    (range requests): nothing is downloaded but configs and cards. ``disk``: peak bytes on local disk (the output's
    shards in flight with ``push``, its whole size without; the Hub cache's metadata; the inputs' weights only when
    ``cache_inputs`` keeps them); ``download``: the bytes fetched from the Hub (the tensors ``method`` reads, once
    per pass, and the headers); ``upload``: the output's bytes sent to the Hub (0 without ``push``); ``seconds``:
    the larger of ``download`` and ``upload`` over ``bandwidth`` (bytes per second each way: they overlap; None
    when no bandwidth is given). A ``push`` figure is for a push without a local copy.

    Example:
        >>> push_figures(["org/ft-a", "org/ft-b"], base="org/base", shard_size="2GB")   # doctest: +SKIP
        {'disk': 6010547328, 'download': 9000000000, 'upload': 3000000000, 'seconds': None}
    """
    opts, extra = MergeOptions.split(kwargs, options)
    if extra:
        raise ParameterError(f"push_figures: unknown option(s) {', '.join(sorted(extra))}")
    check_specs(inputs=inputs, base=base)
    m, p = parse_method(method, {})
    # planned on the CPU: the figures are bytes, whatever device the merge will run on
    session = Session.open(inputs, m, p, opts.replace(device="cpu", device_map=None, max_memory=None), base=base,
                           name=method)
    predicted = footprint(session, push=push, local_copy=not push)
    down, up = predicted.network_in, predicted.network_out
    return {"disk": predicted.peak_disk, "download": down, "upload": up,
            "seconds": max(down, up) / bandwidth if bandwidth else None}


def _small_output_bytes(base: Any, shards: Sequence[Any]) -> int:
    """The disk an output's files beside its weight shards take (whole blocks each): the base's config and tokenizer
    files (the Hub's sizes for a Hub base), the index of ``shards`` (their layout) and the card and recipe."""
    if base.ref.repo_id:
        copied = sum(on_disk(size) for f, size in (getattr(base, "metadata_files", None) or {}).items()
                     if f in BASE_FILES)
    else:
        copied = sum(on_disk(os.path.getsize(os.path.join(base.folder, f))) for f in BASE_FILES
                     if os.path.isfile(os.path.join(base.folder, f)))
    # the index: a line per tensor naming its shard
    index = 0 if len(shards) <= 1 else on_disk(64 + sum(len(n) + len(sh.file) + 12 for sh in shards for n in sh.names))
    return copied + index + _CARD_ALLOWANCE


_CARD_ALLOWANCE = 12 * 1024
"""Disk counted for the card and the recipe an output holds beside the base's files (a few kB each)."""


def _push_key(recipe_hash: str, opts: MergeOptions) -> str:
    """What makes a merge's shards' bytes, for a resumed push: the recipe, and the devices that compute them."""
    return json.dumps([recipe_hash, str(opts.device), repr(opts.device_map)])


def footprint(session: Session, *, lora_output: bool = False, push: bool = False, local_copy: bool = True,
              metadata: Mapping[str, str] | None = None) -> Footprint:
    """The run's predicted peak local disk and network (:class:`hubsoup.footprint.Footprint`), from its plan and
    the inputs' headers and Hub file sizes, without reading a weight: what ``merge`` checks ``max_disk`` and
    ``max_download`` against, what ``hubsoup plan --push`` prints and :func:`push_figures` returns.

    ``push``: the output goes to the Hub (its bytes count as network out); without ``local_copy`` its shards are
    uploaded as they are written and deleted: the disk holds the largest ``SHARDS_IN_FLIGHT + 1`` shards of its
    layout at most (:data:`hubsoup.output.shards.SHARDS_IN_FLIGHT`; a LoRA adapter is written whole, then pushed).
    ``metadata``: the shards' ``__metadata__`` (None: the session's recipe's).

    Example:
        >>> f = footprint(session, push=True, local_copy=False)                                   # doctest: +SKIP
        >>> f.peak_disk, f.network_in, f.network_out                                               # doctest: +SKIP
    """
    plan, base_ckpt, sources, m, p, opts = (session.plan, session.base, session.sources, session.method,
                                            session.params, session.opts)
    layout = session.layout
    ckpts: dict[str, Any] = {}
    for c in (base_ckpt, *(getattr(s, "ckpt", None) for s in sources), *(layout.donors if layout is not None else ())):
        if c is not None:
            ckpts.setdefault(c.ref.public if c.ref.repo_id else f"local:{id(c)}", c)
    out_dtype = opts.out_dtype
    # the output's shards as the writer lays them out (headers included): what goes up, and what a streamed
    # push holds on disk at once
    if metadata is None:  # each shard's header holds the recipe
        assert session.recipe is not None, "a footprint needs the session's recipe (its shards' headers)"
        metadata = session.recipe.metadata()
    layout_ = shard_layout([(name, tuple(e.shape), (out_dtype or e.dtype) if e.mergeable else e.dtype)
                            for name, e in plan.output_entries()], opts.shard_bytes, dict(metadata))
    shards = [on_disk(shard.size) for shard in layout_]  # on disk: whole blocks
    weights = sum(shards)
    sent = sum(shard.size for shard in layout_)
    small = _small_output_bytes(base_ckpt, layout_)  # config, tokenizer, card, recipe, index: copied or written
    streamed = push and not local_copy and not lora_output
    cache = sum(c.weight_bytes() for c in ckpts.values() if c.weight_bytes is not None)
    inputs_metadata = sum(int(getattr(c, "metadata_bytes", 0) or 0) for c in ckpts.values())  # in the Hub cache
    job = session.job()
    reads_base = (lambda work: lowrank_reads_base(work, lowrank_ok=True)) if lora_output else None
    in_place = remote_bytes(job, reads_base)
    passes = 1 + len(m.passes(p, len(sources)))
    already = current().fetched  # the headers read so far (the run's counter)
    return Footprint(output_bytes=weights + small, shard_bytes=opts.shard_bytes, output_streamed=streamed,
                     held_shards=tuple(sorted(shards, reverse=True)[:SHARDS_IN_FLIGHT + 1]) if streamed else (),
                     output_small=small, output_bound=lora_output, cache_bytes=cache, metadata_bytes=inputs_metadata,
                     network_in=in_place * passes + cache + already, passes=passes,
                     network_out=sent + small if push else 0, in_place=in_place * passes, already_read=already)


def measure_merge_seconds(plan: Plan, m: Method[Any], p: Any, n_inputs: int, *, sample: tuple[int, int] = (2048, 2048)
                          ) -> float | None:
    """The merge's compute time on this machine, predicted: the method timed on one ``sample``-shaped float32 tensor
    (its statistics passes over it included), scaled to the plan's mergeable entries. None when the method cannot
    merge without the models themselves (LOT's exemplars)."""
    numel = sample[0] * sample[1]
    g = torch.Generator().manual_seed(0)
    base = torch.randn(sample, generator=g)
    stack = torch.randn((n_inputs, *sample), generator=g).mul_(0.01)
    name = "model.layers.0.mlp.up_proj.weight"
    stats: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        for sp in m.passes(p, n_inputs):
            sp.update(TensorContext(name, None, n_inputs, stats, ""), base, stack)
            sp.finish(stats)
        work = stack.clone()  # what the engine hands: a fresh float32 stack of τᵢ
        m.merge(base, work, p, TensorContext(name, None, n_inputs, stats, ""))
        seconds = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - a method that needs more than tensors: not predicted
        log.debug("merge time not measured: %s", e)
        return None
    total = sum(e.numel for _, e in plan.entries() if e.mergeable)
    return seconds * total / numel


def _restricted(ckpts: Sequence[Any]) -> list[dict[str, str]]:
    """The Hub inputs the Hub said were private or gated when they were opened (each once)."""
    out: dict[str, str] = {}
    for c in ckpts:
        seen = getattr(c, "visibility", None) if c is not None else None
        if seen and (seen.get("private") or seen.get("gated")):
            out.setdefault(c.ref.repo_id, "private" if seen.get("private") else "gated")
    return [{"repo": k, "why": v} for k, v in sorted(out.items())]


def _stage_weights(m: Method[Any], p: Any, inputs: Sequence[str], base: str | None, tasks: list[Any],
                   push: bool = False) -> dict[str, float]:
    """The stages a merge will go through, weighted by their rough cost (for ``progress``'s ``done``)."""
    weights: dict[str, float] = {}
    if base is None or not is_local(base) or not all(is_local(s) for s in inputs):
        weights["download"] = 2.0
    n_passes = len(m.passes(p, len(inputs)))
    if n_passes or type(m).prepare is not Method.prepare:
        weights["statistics"] = float(max(n_passes, 1))
    weights["merge"] = 2.0
    if tasks:
        weights["eval"] = 1.0
    if push:  # the shards go up during the merge; what is left: the last uploads and the commit
        weights["push"] = 1.0
    return weights


def _lora_options(output_format: str, rank: int | None, energy: float | None,
                  opts: MergeOptions) -> LoraOptions | None:
    if output_format == "lora":
        lora = LoraOptions(rank, energy, opts.out_dtype)
        lora.validate()
        return lora
    if output_format != "full":
        raise ParameterError(f"output_format must be 'full' or 'lora', got {output_format!r}")
    if rank is not None or energy is not None:
        raise ParameterError("rank/energy apply to the LoRA output only (--output-format lora)")
    return None


def _tasks(evaluate: Sequence[Any] | None) -> list[Any]:
    if not evaluate:
        return []

    return [TaskSpec.parse(t) if isinstance(t, str) else t for t in evaluate]


def _jsonable(stats: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in stats.items():
        try:
            json.dumps(v)
            out[k] = v
        except TypeError:
            out[k] = repr(v)
    return out


__all__ = ["merge", "MergeResult", "push_figures"]
