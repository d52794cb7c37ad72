"""Exemplar statistics: hooks on every parametrised op of each expert, reduced as they are produced.

See :mod:`hubsoup.exemplars` for what is kept per op. The experts' weights come through
the engine (:class:`hubsoup.methods.PrepareContext.load_expert`), one block at a time.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, cast

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from hubsoup.arch import model_class
from hubsoup.errors import HubsoupError
from hubsoup.exemplars.data import load_exemplar_rows, make_batches
from hubsoup.exemplars.dispatch import DispatchedExperts

if TYPE_CHECKING:  # the method kit's types only: methods (LOT) import exemplars, not the reverse
    from hubsoup.methods import PrepareContext
    from hubsoup.methods.lot import LotParams

log = logging.getLogger(__name__)

_Hook = tuple[str, torch.nn.Module, str, Any, int]
"""A hook to install: (module name, module, kind, extra, Gram bytes)."""


# --- statistics --------------------------------------------------------------------------------

@dataclass
class OpStat:
    """How one mergeable tensor is merged, and under which key its statistics are stored."""

    kind: str  # linear | scale | lookup | add
    key: str
    layout: str = "out_in"  # linear: out_in (nn.Linear), in_out (Conv1D), conv (Conv2d kernel)


@dataclass
class FeatureStore:
    """Per-task statistics of every op, on disk in a scratch folder removed with the store."""

    ops: dict[str, OpStat]
    """Mergeable tensor name → how to merge it. Names absent here were not reached."""
    n_tasks: int
    rows: list[dict[str, float]] = field(default_factory=list)
    """Per task: key → number of rows (tokens / patches / exemplars) seen by that op."""
    files: list[dict[str, str]] = field(default_factory=list)
    """Per task: tensor key → spill file."""
    alias: list[dict[str, str]] = field(default_factory=list)
    """Per task: linear module → the module whose identical input (and Gram) it shares."""
    _tmp: Any = field(default=None, repr=False)

    def tensor(self, task: int, key: str) -> torch.Tensor:
        # read and unmap at once: a mapping kept open would keep every Gram read so far resident,
        # and the merge reads them all, one tensor at a time
        with safe_open(self.files[task][key], framework="pt", device="cpu") as h:
            return h.get_tensor(key).clone()  # type: ignore[no-any-return]  # safetensors: safe_open is untyped

    def has(self, task: int, key: str) -> bool:
        return key in self.files[task]

    def n_rows(self, task: int, key: str) -> float:
        return self.rows[task].get(key, 0.0)

    def gram_key(self, task: int, module: str) -> str | None:
        """Key of the Gram of ``module``'s input for ``task`` (None: no exemplar reached it)."""
        owner = self.alias[task].get(module)
        return None if owner is None else f"gram::{owner}"

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __repr__(self) -> str:  # what lands in MergeResult.stats
        return f"FeatureStore({len(self.ops)} ops, {self.n_tasks} tasks)"


def _norm_kind(module: torch.nn.Module) -> str | None:
    if isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm)):
        return "layernorm" if isinstance(module, torch.nn.LayerNorm) else None
    name = type(module).__name__.lower()
    if "rmsnorm" in name or hasattr(module, "variance_epsilon") or name == "t5layernorm":
        return "rmsnorm"
    if "layernorm" in name and hasattr(module, "eps"):
        return "layernorm"
    return None


def _normalised(module: torch.nn.Module, h: torch.Tensor, kind: str) -> torch.Tensor:
    h = h.to(torch.float32)
    if kind == "layernorm":
        shape = getattr(module, "normalized_shape", (h.shape[-1],))
        return F.layer_norm(h, tuple(shape), eps=float(getattr(module, "eps", 1e-5)))
    eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class _Capture:
    """Hooks that turn one chunk of ops' inputs into statistics for the current task."""

    def __init__(self, model: torch.nn.Module, specs: list[tuple[str, torch.nn.Module, str, Any]]):
        self.specs = specs
        self.sums: dict[str, torch.Tensor] = {}
        self.rows: dict[str, float] = {}
        self.mask: torch.Tensor | None = None
        self.alias: dict[str, str] = {}  # module -> module whose identical input it shares
        self._last: tuple[Any, str] | None = None
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        for name, module, kind, extra in specs:
            self.handles.append(module.register_forward_hook(self._hook(name, module, kind, extra)))

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self._last = None

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """Token-position rows of ``x`` (…, d) without padding, as (n, d)."""
        m = self.mask
        if m is not None and x.dim() >= 3 and tuple(x.shape[:2]) == tuple(m.shape):
            return x[m.to(x.device)]
        return x.reshape(-1, x.shape[-1])

    def _add(self, key: str, value: torch.Tensor) -> None:
        if key in self.sums:
            self.sums[key].add_(value)
        else:
            self.sums[key] = value.clone()

    def _count(self, name: str, n: float) -> None:
        self.rows[f"rows::{name}"] = self.rows.get(f"rows::{name}", 0.0) + n

    def _n_rows(self, x: torch.Tensor) -> float:
        """Rows an op sees: token positions (padding excluded) for ids or (…, d) activations."""
        m = self.mask
        if not x.is_floating_point():
            return float(m.sum()) if m is not None and tuple(x.shape) == tuple(m.shape) else float(x.numel())
        if m is not None and x.dim() >= 3 and tuple(x.shape[:2]) == tuple(m.shape):
            return float(m.sum())
        return float(x.numel() // max(x.shape[-1], 1)) if x.dim() else 1.0

    def _hook(self, name: str, module: torch.nn.Module, kind: str, extra: Any
              ) -> Callable[[Any, tuple[Any, ...], Any], None]:
        def hook(mod: Any, inputs: tuple[Any, ...], output: Any) -> None:
            if not inputs or not torch.is_tensor(inputs[0]):
                return
            x = inputs[0]
            if kind == "linear":
                self._count(name, self._n_rows(x))
                last = self._last
                owner = last[1] if last is not None and last[0] is x else name
                if owner == name:
                    self._last = (x, name)
                if self.alias.setdefault(name, owner) != owner:
                    raise HubsoupError(f"LOT feature capture: module '{name}' shares its input inconsistently "
                                       "across batches; cannot attribute its Gram matrix")
                if owner == name:  # q/k/v (gate/up) see the same tensor: one Gram, kept by the first
                    r = self._rows(x).to(torch.float64)
                    self._add(f"gram::{name}", r.mT @ r)
            elif kind == "conv":  # im2col: one row per patch position, d_in = C·kh·kw
                r = F.unfold(x.to(torch.float32), mod.kernel_size, dilation=mod.dilation, padding=mod.padding,
                             stride=mod.stride).transpose(1, 2).reshape(-1, extra).to(torch.float64)
                self.alias.setdefault(name, name)
                self._count(name, float(r.shape[0]))
                self._add(f"gram::{name}", r.mT @ r)
            elif kind == "scale":
                xh = self._rows(_normalised(mod, x, extra)).to(torch.float64)
                self._count(name, float(xh.shape[0]))
                self._add(f"sq::{name}", xh.pow(2).sum(0))
            elif kind == "lookup":
                ids = x
                m = self.mask
                if m is not None and tuple(ids.shape) == tuple(m.shape):
                    ids = ids[m.to(ids.device)]
                ids = ids.reshape(-1).to(torch.long)
                self._count(name, float(ids.numel()))
                self._add(f"count::{name}", torch.bincount(ids, minlength=extra).to(torch.float64))
            elif kind == "rows":  # an additive input (position embeddings): n = positions seen
                self._count(name, self._n_rows(x))
            elif kind == "examples":  # params of a composite module (CLIP class_embedding): n = exemplars
                self._count(name, float(x.shape[0]) if x.dim() else 1.0)
        return hook


def load_skeleton(base_folder: str, device: str | torch.device) -> Any:
    """The base model as a float32 ``transformers`` model in eval mode (never remote code)."""
    # lazy: transformers costs ~4 s to import here (torch ~6 s); only LOT's exemplar capture needs it
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(base_folder, trust_remote_code=False)
        model = model_class(cfg).from_pretrained(base_folder, dtype=torch.float32, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001
        raise HubsoupError(f"LOT needs to run the model, but transformers cannot build it from '{base_folder}' "
                           f"({type(e).__name__}: {e})") from e
    return model.to(device).eval()


def plan_ops(model: torch.nn.Module, base_names: set[str]) -> tuple[dict[str, OpStat], list[_Hook]]:
    """Which op owns each mergeable tensor, and the hooks to install (name, module, kind, extra, gram bytes)."""
    # lazy: transformers' model classes cost ~13 s to import here (torch ~6 s); only LOT's exemplar capture needs them
    from transformers.pytorch_utils import Conv1D

    names_of: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(pname)

    def ckpt_name(p: torch.Tensor) -> str | None:
        for n in names_of.get(id(p), []):
            if n in base_names:
                return n
        return None

    ops: dict[str, OpStat] = {}
    hooks: list[_Hook] = []
    priority: dict[str, int] = {}

    def claim(p: torch.Tensor | None, stat: OpStat, prio: int) -> None:
        n = ckpt_name(p) if p is not None else None
        if n is None or p is None or not p.dtype.is_floating_point:
            return
        if priority.get(n, -1) < prio:  # a tied weight: the output head's solution wins over the lookup's
            ops[n], priority[n] = stat, prio

    for mname, mod in model.named_modules():
        own = dict(mod.named_parameters(recurse=False))
        if not own:
            continue
        w, b = own.get("weight"), own.get("bias")
        if isinstance(mod, torch.nn.Linear) or isinstance(mod, Conv1D):
            d_in = mod.in_features if isinstance(mod, torch.nn.Linear) else cast(torch.Tensor, w).shape[0]
            hooks.append((mname, mod, "linear", None, d_in * d_in * 8))
            claim(w, OpStat("linear", mname, "out_in" if isinstance(mod, torch.nn.Linear) else "in_out"), 2)
            claim(b, OpStat("add", f"rows::{mname}"), 2)
        elif isinstance(mod, torch.nn.Conv2d) and mod.groups == 1 and isinstance(mod.padding, tuple):
            d_in = cast(torch.Tensor, w).shape[1] * cast(torch.Tensor, w).shape[2] * cast(torch.Tensor, w).shape[3]
            hooks.append((mname, mod, "conv", d_in, d_in * d_in * 8))
            claim(w, OpStat("linear", mname, "conv"), 2)
            claim(b, OpStat("add", f"rows::{mname}"), 2)
        elif isinstance(mod, torch.nn.Embedding):
            short = mname.rsplit(".", 1)[-1].lower()
            if "position" in short or short in ("wpe",):
                hooks.append((mname, mod, "rows", None, 0))  # additive input: rule (c)
                claim(w, OpStat("add", f"rows::{mname}"), 1)
            else:
                hooks.append((mname, mod, "lookup", mod.num_embeddings, 0))
                claim(w, OpStat("lookup", f"count::{mname}"), 1)
        elif (nk := _norm_kind(mod)) is not None and w is not None and w.dim() == 1:
            hooks.append((mname, mod, "scale", nk, 0))
            claim(w, OpStat("scale", f"sq::{mname}"), 2)
            claim(b, OpStat("add", f"rows::{mname}"), 2)
            for pn, p in own.items():
                if pn not in ("weight", "bias"):
                    claim(p, OpStat("add", f"rows::{mname}"), 2)
        else:  # params owned by a composite module (CLIP class_embedding, ...): additive, n = exemplars
            hooks.append((mname, mod, "examples", None, 0))
            for p in own.values():
                claim(p, OpStat("add", f"rows::{mname}"), 1)
    return ops, hooks


def _chunks(hooks: list[_Hook], budget: int) -> list[list[_Hook]]:
    cur: list[_Hook]
    out, cur, size = [], [], 0
    for h in hooks:
        if cur and size + h[4] > budget:
            out.append(cur)
            cur, size = [], 0
        cur.append(h)
        size += h[4]
    if cur:
        out.append(cur)
    return out


def capture(ctx: PrepareContext, params: LotParams, tasks: list[tuple[int, str, str]]) -> FeatureStore:
    """Run each expert on its own exemplars and keep per-op statistics (see the module docstring).

    ``tasks``: (input index, task name, exemplar spec) for every input; the experts' weights
    come from ``ctx.load_expert`` (the engine's stream), never from the checkpoints directly.
    """
    with _quiet_libraries(ctx.quiet):
        return _capture(ctx, params, tasks)


class _quiet_libraries:
    """Silence transformers' and datasets' own progress bars and info logs while capturing (``quiet``)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet

    def __enter__(self) -> _quiet_libraries:
        if not self.quiet:
            return self
        import datasets  # lazy: datasets costs ~7 s to import here (torch ~6 s); only LOT's exemplar capture needs it
        # lazy: transformers costs ~4 s to import here (torch ~6 s); only LOT's exemplar capture needs it
        import transformers

        self.ds = datasets.is_progress_bar_enabled()
        self.tf_bar = transformers.utils.logging.is_progress_bar_enabled()
        self.tf_level = transformers.utils.logging.get_verbosity()
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers: unannotated
        transformers.utils.logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # as above
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.quiet:
            return
        import datasets  # lazy: datasets costs ~7 s to import here (torch ~6 s); only LOT's exemplar capture needs it
        # lazy: transformers costs ~4 s to import here (torch ~6 s); only LOT's exemplar capture needs it
        import transformers

        if self.ds:
            datasets.enable_progress_bars()
        if self.tf_bar:
            transformers.utils.logging.enable_progress_bar()  # type: ignore[no-untyped-call]  # as above
        transformers.utils.logging.set_verbosity(self.tf_level)


def _capture(ctx: PrepareContext, params: LotParams, tasks: list[tuple[int, str, str]]) -> FeatureStore:
    device = ctx.device
    experts = None
    if ctx.device_map is not None or ctx.max_memory is not None:
        # big experts: each is built and run with accelerate's big-model inference (CPU/disk offload)

        experts = DispatchedExperts(ctx.base_folder, device_map=ctx.device_map, max_memory=ctx.max_memory,
                                    scratch=ctx.scratch, quiet=ctx.quiet)
        model, device = experts.template, experts.main_device  # the template: empty weights, for the op plan
    else:
        model = load_skeleton(ctx.base_folder, device)
    ops, hooks = plan_ops(model, set(ctx.names))
    ops = {ctx.names.get(n, n): s for n, s in ops.items()}  # tied names: the tensor the merge sees
    if not any(s.kind == "linear" for s in ops.values()):
        raise HubsoupError(f"LOT: no linear layer of '{ctx.base_label}' could be matched to its checkpoint tensors")
    tokenizer = _tokenizer(ctx.base_folder)
    vocab = getattr(model.config, "vocab_size", None)
    max_len = min(params.max_length, _max_positions(model.config))
    batches = {}
    for i, task, spec in tasks:  # load and tokenize every task first: bad exemplars fail before any forward
        ds = load_exemplar_rows(spec, task, params.n_exemplars, params.seed, token=ctx.token)
        batches[i] = make_batches(ds, task, spec, tokenizer=tokenizer, vocab_size=vocab, max_length=max_len,
                                  batch_size=params.batch_size, text_column=params.text_column)
    n = len(ctx.inputs)
    tmp = tempfile.TemporaryDirectory(prefix="hubsoup-lot-")
    store = FeatureStore(ops, n, rows=[{} for _ in range(n)], files=[{} for _ in range(n)],
                         alias=[{} for _ in range(n)], _tmp=tmp)
    chunks = _chunks(hooks, int(params.gram_budget_gb * 1e9))
    params_by_name = dict(model.named_parameters(remove_duplicate=False))

    def assign(name: str, value: torch.Tensor) -> None:
        p = params_by_name.get(name)
        if p is not None and p.dtype.is_floating_point:
            p.copy_(value.reshape(p.shape))

    def run_task(model: Any, chunks: list[list[_Hook]], i: int, task: str) -> None:
        for c, chunk in enumerate(chunks):
            cap = _Capture(model, [(n_, m, k, x) for n_, m, k, x, _ in chunk])
            try:
                with torch.no_grad():
                    for batch in tqdm(batches[i], desc=f"LOT features: task '{task}'"
                                      + (f" part {c + 1}/{len(chunks)}" if len(chunks) > 1 else ""),
                                      unit="batch", disable=ctx.quiet, leave=False):
                        cap.mask = batch.mask
                        cap._last = None
                        _forward(model, {k: v.to(device) for k, v in batch.inputs.items()})
            finally:
                cap.close()
            path = os.path.join(tmp.name, f"task{i}-part{c}.safetensors")
            save_file({k: v.cpu().contiguous() for k, v in cap.sums.items()}, path)
            store.files[i].update({k: path for k in cap.sums})
            store.rows[i].update(cap.rows)
            store.alias[i].update(cap.alias)
            del cap

    try:
        for i, task, spec in tasks:
            if experts is None:
                with torch.no_grad():
                    ctx.load_expert(i, assign)  # θ_0 + τ_i, streamed block by block through the engine
                run_task(model, chunks, i, task)
                continue
            # θ_0 + τ_i streamed the same way, into a model dispatched by accelerate (offloaded modules on disk)
            with experts.load(functools.partial(ctx.load_expert, i)) as expert:
                run_task(expert, _chunks(plan_ops(expert, set(ctx.names))[1], int(params.gram_budget_gb * 1e9)),
                         i, task)
    except BaseException:
        store.close()
        raise
    finally:
        del model
    return store


def _forward(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> None:
    """One forward pass. Encoder-decoder models get the exemplar itself, shifted right, as
    decoder input (teacher forcing on the exemplar text) [ours: the papers do not say]."""
    kw: dict[str, Any] = dict(inputs)
    if getattr(model.config, "is_encoder_decoder", False) and "input_ids" in kw:
        shift = getattr(model, "_shift_right", None)
        kw["decoder_input_ids"] = shift(kw["input_ids"]) if shift is not None else kw["input_ids"]
        if "attention_mask" in kw:
            kw["decoder_attention_mask"] = kw["attention_mask"]
    if "use_cache" in inspect.signature(model.forward).parameters:
        kw["use_cache"] = False
    model(**kw)


def _tokenizer(folder: str) -> Any:
    try:
        # lazy: transformers costs ~4 s to import here (torch ~6 s); only LOT's exemplar capture needs it
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # noqa: BLE001 - no tokenizer: only pre-tokenised exemplars will do
        log.debug("no tokenizer in %s: %s", folder, e)
        return None


def _max_positions(cfg: Any) -> int:
    for k in ("max_position_embeddings", "n_positions", "max_seq_len"):
        v = getattr(cfg, k, None)
        if isinstance(v, int) and v > 0:
            return v
    return 1 << 30
