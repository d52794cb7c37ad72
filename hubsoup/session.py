"""The merge session: the one owner of "open the inputs, plan, place, build the recipe", done once per merge.

Every way into a merge goes through here: :func:`hubsoup.merge`, a search's trials
(:mod:`hubsoup.workflows.trial`: search, sweep, evolve), ``hubsoup plan``, :func:`hubsoup.api.push_figures`,
continual merging's setup and the pipeline's predicted recipe hash. What differs between them is a parameter or a
step of :class:`Session`, never a copy of the prelude:

* :func:`open_inputs` opens the base and the inputs' task vectors (a layout's own inputs through ``layout``);
  a caller that keeps them open across merges (a search's trials) opens them once and plans each candidate with
  :meth:`Session.over`;
* ``state``: continual merging streams its accumulated state as the job's first input: placed with the inputs,
  not in the recipe;
* ``out``: ``--overwrite`` never deletes an input, the base or a model a layout's slices copy from (checked once
  the inputs are open, before any weight moves);
* ``recipe``: False where the recipe comes later (continual merging's holds the soup's count and λ).

The per-tensor parameters (per-layer schedules and name filters resolved at each tensor's position) are resolved
once, here (:func:`hubsoup.engine.lowrank.resolve_all`), and handed to the planner and the merge
(:attr:`hubsoup.engine.Job.resolved`).

Example:
    >>> m, p = parse_method("ties", {"density": 0.2})                                      # doctest: +SKIP
    >>> s = Session.open(["org/ft-a", "org/ft-b"], m, p, MergeOptions(), base="org/base")   # doctest: +SKIP
    >>> s.fetch(); stats = s.run(CheckpointSink(...), scratch=tmp)                          # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from hubsoup.engine import Job, run
from hubsoup.engine.lowrank import resolve_all
from hubsoup.engine.placement import Placement, place_blocks
from hubsoup.errors import BaseNotNamedError, HubsoupError, ParameterError
from hubsoup.methods import Method, get_method
from hubsoup.options import MergeOptions
from hubsoup.plan import Plan
from hubsoup.progress import Monitor
from hubsoup.recipe import RECIPE_FILE, Recipe, recipe_for
from hubsoup.sources import InputRef
from hubsoup.sources.compat import check_out_is_no_input, open_models

log = logging.getLogger(__name__)


def parse_method(method: str, given: dict[str, Any]) -> tuple[Method[Any], Any]:
    """The method and its parsed parameters; a key that looks like a misspelt option says so."""
    m = get_method(method)
    try:
        return m, m.parse(given)
    except ParameterError:
        MergeOptions.check_not_misspelt(given, _declared(m, given))
        raise


def _declared(m: Method[Any], given: dict[str, Any]) -> set[str]:
    names = {f.name for f in dataclasses.fields(m.Params)}
    chain = str(given.get("base_method", "")).split("+") if "base_method" in names else []
    for n in chain:
        try:
            names |= {f.name for f in dataclasses.fields(get_method(n.strip()).Params)}
        except HubsoupError:
            pass
    return names


def open_inputs(inputs: Sequence[str], base: Any, m: Method[Any], p: Any, opts: MergeOptions,
                **kw: Any) -> tuple[Any, list[Any]]:
    """The base and the inputs' task vectors, opened with ``opts`` as every merge opens them; a method that needs
    no base (``Method.needs_base``) and whose inputs' cards name none takes the first input as the layout reference
    (its task vector is 0). ``base``: a spec or an opened checkpoint (continual merging's)."""
    kw.update(allow_pickle=opts.allow_pickle, token=opts.token, ignore_extra=opts.ignore_extra,
              shape_mismatch=opts.shape_mismatch)
    try:
        return open_models(inputs, base=base, **kw)
    except BaseNotNamedError:  # only when no card names a base: a named one is always checked and used
        if base is not None or m.needs_base(p, len(inputs)):
            raise
        log.info("no base model named: %s needs none, the first input is the layout reference", m.name)
        return open_models(inputs, base=inputs[0], **kw)


def make_recipe(method: str, params: dict[str, Any], base: InputRef, inputs: Sequence[InputRef], *,
                dtype: str | None, options: MergeOptions | None = None, layout: Any = None,
                output: dict[str, Any] | None = None, continual: dict[str, Any] | None = None) -> Recipe:
    """The recipe of a merge (:func:`hubsoup.recipe.recipe_for`: what its hash covers): the one place a caller gets
    one, for a merge that has no session open (the pipeline's prediction from Hub metadata, continual merging's
    recipe once the soup's λ is known)."""
    return recipe_for(method, params, base, inputs, dtype=dtype, options=options, layout=layout,
                      output=output or {}, continual=continual)


@dataclass
class Session:
    """One merge, opened: the method and its parameters, the base and inputs, the plan with every block placed,
    the per-tensor parameters resolved once, and the recipe (whose hash seeds every random draw)."""

    method: Method[Any]
    params: Any
    opts: MergeOptions
    base: Any
    """The base checkpoint (:class:`hubsoup.sources.Checkpoint`)."""
    sources: list[Any]
    """The inputs' task vectors, in merge order."""
    plan: Plan
    placement: Placement
    resolved: Mapping[str, Any]
    """Every mergeable tensor's parameters (:func:`hubsoup.engine.lowrank.resolve_all`)."""
    recipe: Recipe | None
    layout: Any = None
    monitor: Monitor = field(default_factory=Monitor)

    @classmethod
    def open(cls, inputs: Sequence[str], m: Method[Any], p: Any, opts: MergeOptions, *, base: Any,
             layout: Any = None, monitor: Monitor | None = None, out: str | None = None, lora_output: bool = False,
             output: dict[str, Any] | None = None, state: Any = None, recipe: bool = True,
             name: str | None = None) -> "Session":
        """Open the inputs (from their headers: the fit check runs before any weight moves; :meth:`fetch` then
        downloads), then plan, place and build the recipe (:meth:`over`)."""
        if getattr(layout, "opens_inputs", False):  # a mergekit merged vocabulary: the inputs re-mapped to it
            base_ckpt, sources = layout.open_inputs(inputs, base, opts, monitor=monitor)
        else:
            base_ckpt, sources = open_inputs(inputs, base, m, p, opts, monitor=monitor, headers_only=True)
        return cls.over(base_ckpt, sources, m, p, opts, layout=layout, monitor=monitor, out=out,
                        lora_output=lora_output, output=output, state=state, recipe=recipe, name=name)

    @classmethod
    def over(cls, base_ckpt: Any, sources: Sequence[Any], m: Method[Any], p: Any, opts: MergeOptions, *,
             layout: Any = None, monitor: Monitor | None = None, out: str | None = None, lora_output: bool = False,
             output: dict[str, Any] | None = None, state: Any = None, recipe: bool = True,
             name: str | None = None) -> "Session":
        """The session of inputs already open (a search's trials keep theirs across candidates): checked against
        the method and ``out``, planned (``layout``'s plan, else the base's), placed (``state`` streamed first),
        the parameters resolved per tensor, the recipe built (``output``: the LoRA output's settings; ``name``: the
        method as the caller named it, which the recipe records; default ``m.name``)."""
        sources = list(sources)
        placed = [*([state] if state is not None else []), *sources]  # the job's inputs, the state first
        m.check_inputs(p, len(placed))
        if out is not None:
            check_out_is_no_input(out, base_ckpt, sources)  # --overwrite must never delete an input or the base
        # a layout (a mergekit config's slices, tokenizer_source) plans the output itself: the one engine streams it
        plan = layout.plan(base_ckpt, sources, opts) if layout is not None else Plan.of(base_ckpt, opts.device)
        if layout is not None and layout.reads and out is not None:  # the models slices copy from: inputs too
            check_out_is_no_input(out, base_ckpt, layout.reads)
        resolved = resolve_all(p, plan)
        placement = place_blocks(plan, m, p, placed, opts, lora_output=lora_output, resolved=resolved)
        if _needs_base_files(m, p) and getattr(base_ckpt, "keep_files", None) is not None:
            base_ckpt.keep_files()  # LOT runs the base model from its folder
        made = (recipe_for(name or m.name, m.describe_params(p), base_ckpt.ref, [s.ref for s in sources],
                           dtype=opts.dtype, options=opts, layout=layout, output=output or {}) if recipe else None)
        return cls(m, p, opts, base_ckpt, sources, plan, placement, resolved, made, layout,
                   monitor if monitor is not None else Monitor())

    @property
    def checkpoints(self) -> list[Any]:
        """The base and the inputs' checkpoints (a LoRA input's base-less task vector has none)."""
        return [c for c in (self.base, *(getattr(s, "ckpt", None) for s in self.sources)) if c is not None]

    def fetch(self) -> None:
        """The weights of Hub inputs opened from their headers, downloaded now (after the fit check)."""
        for ckpt in self.checkpoints:
            ckpt.fetch()

    def job(self, **kw: Any) -> Job:
        """The engine's job of this session (its plan, inputs, method, resolved parameters and recipe hash);
        ``kw``: how it runs (``quiet``, ``scratch``, ``prefetch``, ...). The device map and memory budget are the
        options'."""
        kw.setdefault("device_map", self.opts.device_map)
        kw.setdefault("max_memory", self.opts.max_memory)
        kw.setdefault("monitor", self.monitor)
        kw.setdefault("token", self.opts.token)  # the run's, for a method's data on the Hub (LOT's exemplars)
        return Job(self.plan, self.base, self.sources, self.method, self.params,
                   self.recipe.hash if self.recipe is not None else "",
                   donors=self.layout.donors if self.layout is not None else (), resolved=self.resolved, **kw)

    def finish(self, folder: str) -> None:
        """The output's last files, once the engine has written it into ``folder``: the layout's own (a mergekit
        config's output config layer count, tokenizer_source, chat_template), then the recipe
        (:data:`hubsoup.recipe.RECIPE_FILE`, with its local paths: ``hubsoup run`` reads it)."""
        assert self.recipe is not None, "finish writes the session's recipe: open it with recipe=True"
        if self.layout is not None:
            self.layout.finish(folder)
        with open(os.path.join(folder, RECIPE_FILE), "w", encoding="utf-8") as f:
            f.write(self.recipe.to_yaml())

    def run(self, sink: Any, job: Job | None = None, **kw: Any) -> dict[str, Any]:
        """Merge into ``sink`` (``job``: one :meth:`job` made, else one with ``kw``); the method's statistics are
        finished after, unless a shared-statistics block owns them. Returns the run's statistics."""
        job = job if job is not None else self.job(**kw)
        try:
            return run(job, sink)
        finally:
            if not job.shared_stats:  # else the search that shares them finishes them
                self.method.finish(self.params, job.stats)


def _needs_base_files(m: Method[Any], p: Any) -> bool:
    """Whether the method, or one a modifier wraps (LiNeS over LOT), builds the base model from its folder."""
    cur: Any = m
    while cur is not None:
        if cur.needs_base_files:
            return True
        cur, p = getattr(p, "inner", None), getattr(p, "inner_params", None)
    return False


__all__ = ["Session", "open_inputs", "parse_method", "make_recipe"]
