"""The in-memory output: a merge held as tensors and built into a model, never written to disk.

A search scores many candidates and keeps one; writing each to disk and loading it back is most
of a small model's trial time (mergekit-evolve's users' complaint). :class:`MemorySink` takes the
same outcomes as :class:`~hubsoup.output.checkpoint.CheckpointSink`, cast to the same dtype and
checked the same way, so the model :meth:`MemorySink.model` builds holds exactly the tensors a
checkpoint of the same merge would hold: its scores are those of the written model, bit for bit.

A search's process keeps one model and writes each candidate into it (:class:`ModelSink`, into
:func:`empty_model`).

Example:
    >>> sink = MemorySink(plan, dtype=None)               # doctest: +SKIP
    >>> engine.run(job, sink); model = sink.model(base_folder)   # doctest: +SKIP
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
import transformers

from hubsoup.engine import Copy, LowRank, Outcome, TensorWork, Unchanged, Weights
from hubsoup.errors import HubsoupError
from hubsoup.options import DTYPES
from hubsoup.output.checkpoint import check_output_tensor
from hubsoup.plan import Plan, TensorEntry


class MemorySink:
    """Every output tensor in a dict, in the output dtype (the dtype a checkpoint would be written in)."""

    def __init__(self, plan: Plan, *, dtype: str | None = None):
        self.out_dtype = DTYPES[dtype] if dtype else None
        self.dtype_name = dtype
        self.tensors: dict[str, torch.Tensor] = {}
        self.plan = plan

    def accepts_lowrank(self, entry: TensorEntry) -> bool:
        return True

    def weights_dtype(self, entry: TensorEntry) -> torch.dtype:
        return self.out_dtype or entry.dtype

    def put(self, work: TensorWork, outcome: Outcome) -> None:
        out = self.output(work, outcome)
        for name in (work.entry.name, *work.entry.aliases):
            self.tensors[name] = out

    def output(self, work: TensorWork, outcome: Outcome) -> torch.Tensor:
        """The tensor a checkpoint would hold for this outcome (the output dtype, on the CPU, checked)."""
        work.settle()  # on a device: a NaN input is named before the output's own check
        entry = work.entry
        if isinstance(outcome, Copy):
            out = work.raw_base()
            if self.copies:
                out = out.clone()  # the base's file is unmapped after the block
        elif isinstance(outcome, Weights):
            out = outcome.theta
        else:
            if isinstance(outcome, Unchanged):
                merged = work.base()
            elif isinstance(outcome, LowRank):
                merged = torch.addmm(work.base(), outcome.p, outcome.q)
            else:
                merged = outcome.tau.add_(work.base())
            out = merged.to(self.out_dtype or entry.dtype)
            check_output_tensor(entry.name, out, merged)
        out = out.detach().to("cpu")
        if isinstance(outcome, Unchanged) and self.copies:
            out = out.clone()  # the base's tensor may be a view of its file, which is unmapped after the block
        return out

    copies = True
    """Whether :meth:`output` must own what it returns (a sink that copies it elsewhere at once need not)."""

    def close(self) -> None:
        return None

    def abort(self) -> None:
        self.tensors.clear()

    def model(self, config_folder: str, kind: str = "causal") -> transformers.PreTrainedModel:
        """The merged model (``transformers``) from the base's ``config.json`` and these tensors, in eval mode.

        Built without random initialisation (every weight is assigned from the merge); a tensor the
        model expects but the merge lacks, or one it does not know, is an error naming it.
        """
        cls = _model_class(kind)
        config = transformers.AutoConfig.from_pretrained(config_folder)
        if self.dtype_name is not None:
            config.dtype = self.out_dtype
        dtype = self.out_dtype or next((t.dtype for t in self.tensors.values() if t.is_floating_point()),
                                       torch.float32)
        with _no_init_weights():
            model: transformers.PreTrainedModel = cls.from_config(config, dtype=dtype)
        state = model.state_dict()
        missing = [k for k in state if k not in self.tensors]
        tied = _tied_names(model)
        missing = [k for k in missing if k not in tied]
        unknown = [k for k in self.tensors if k not in state]
        if missing or unknown:
            what = f"lacks tensor '{missing[0]}'" if missing else f"has tensor '{unknown[0]}' the model does not know"
            raise HubsoupError(f"the merged model (in memory) {what} for {cls.__name__}")
        model.load_state_dict({k: v for k, v in self.tensors.items() if k in state}, strict=False, assign=True)
        model.tie_weights()
        return model.eval()  # type: ignore[no-untyped-call, no-any-return]  # transformers: its eval is untyped


class ModelSink(MemorySink):
    """A merge written into a model in place (:func:`empty_model`, or one :meth:`MemorySink.model` built): each tensor
    cast as a checkpoint would be and copied into the model's own tensor, so that a search keeps one model for all its
    candidates and scores each exactly as its written merge would score.

    Example:
        >>> model = empty_model(base_folder, plan)                           # doctest: +SKIP
        >>> engine.run(job, ModelSink(plan, model, dtype=None))              # doctest: +SKIP
    """

    copies = False  # each output is copied into the model at once

    def __init__(self, plan: Plan, model: torch.nn.Module, *, dtype: str | None = None):
        super().__init__(plan, dtype=dtype)
        self.targets = model.state_dict()  # the model's tensors themselves (state_dict shares their storage)

    def put(self, work: TensorWork, outcome: Outcome) -> None:
        out = self.output(work, outcome)
        done: set[int] = set()
        for name in (work.entry.name, *work.entry.aliases):
            target = self.targets.get(name)
            if target is None:
                raise HubsoupError(f"the merged model (in memory) has no tensor '{name}' to receive the merge")
            if target.dtype != out.dtype or target.shape != out.shape:
                raise HubsoupError(f"the merged model (in memory) holds '{name}' as {target.dtype} "
                                   f"{list(target.shape)}, the merge gives {out.dtype} {list(out.shape)}")
            if target.data_ptr() not in done:  # tied names share one tensor
                done.add(target.data_ptr())
                target.copy_(out)


def empty_model(config_folder: str, plan: Plan, *, dtype: str | None = None, kind: str = "causal") -> torch.nn.Module:
    """The model a merge of ``plan`` fills in place (:class:`ModelSink`): built from ``config_folder``'s config without
    initialisation, each tensor the merge writes allocated as a checkpoint of the merge holds it (``dtype``, the
    merge's output dtype, for merged tensors; the stored dtype for the others), so it is the model
    :meth:`MemorySink.model` would build from the same merge. A tensor the model expects but the plan lacks, or one it
    does not know, is an error naming it."""
    cls = _model_class(kind)
    config = transformers.AutoConfig.from_pretrained(config_folder)
    out_dtype = DTYPES[dtype] if dtype else None
    if out_dtype is not None:
        config.dtype = out_dtype
    entries = {n: e for _, e in plan.entries() for n in (e.name, *e.aliases)}
    first = out_dtype or next((e.dtype for e in entries.values() if e.dtype.is_floating_point), torch.float32)
    with _no_init_weights():
        model: transformers.PreTrainedModel = cls.from_config(config, dtype=first)
    state = model.state_dict()
    tied = _tied_names(model)
    missing = [k for k in state if k not in entries and k not in tied]
    unknown = [k for k in entries if k not in state]
    if missing or unknown:
        what = f"lacks tensor '{missing[0]}'" if missing else f"has tensor '{unknown[0]}' the model does not know"
        raise HubsoupError(f"the merged model (in memory) {what} for {cls.__name__}")
    for name, e in entries.items():
        want = (out_dtype or e.dtype) if e.mergeable else e.dtype
        if state[name].dtype != want:  # a tensor kept in another dtype than the rest (a float32 norm, an int buffer)
            module, _, leaf = name.rpartition(".")
            owner = model.get_submodule(module)
            held = getattr(owner, leaf)
            if isinstance(held, torch.nn.Parameter):
                held.data = torch.empty(held.shape, dtype=want)  # the same parameter object: ties stay
            else:
                setattr(owner, leaf, torch.empty(held.shape, dtype=want))
    return model.eval()  # type: ignore[no-untyped-call, no-any-return]  # transformers: its eval is untyped


def _model_class(kind: str) -> Any:  # a transformers auto class
    return {"causal": transformers.AutoModelForCausalLM, "encoder": transformers.AutoModel,
            "seqcls": transformers.AutoModelForSequenceClassification}[kind]


def _no_init_weights() -> AbstractContextManager[Any]:
    """transformers' context that skips random initialisation (``transformers.initialization`` from 5.0)."""
    try:
        # lazy: which module holds it depends on transformers' version (tried in turn)
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        # lazy: which module holds it depends on transformers' version (tried in turn)
        from transformers.modeling_utils import no_init_weights  # type: ignore[attr-defined, no-redef]  # transformers 4's
    return no_init_weights()


def _tied_names(model: transformers.PreTrainedModel) -> set[str]:
    """Parameter names tied to another (the output embedding of a model with tied embeddings)."""
    keys = getattr(model, "_tied_weights_keys", None) or ()
    if isinstance(keys, dict):
        return set(keys)
    return set(keys) if model.config.get_text_config().tie_word_embeddings else set()
