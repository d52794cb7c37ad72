"""LoRA output: the merged task vector written as a PEFT adapter (``--output-format lora``).

Per tensor of the plan, the merged task vector τ is turned into:

* **LoRA factors** for the 2-D weight of a ``Linear``, GPT-2 ``Conv1D`` or ``Embedding``
  module: the truncated SVD τ ≈ U_r S_r V_rᵀ, split evenly (``B = U_r √S_r``,
  ``A = √S_r V_rᵀ``), with ``lora_alpha = r`` so that peft's scale is 1. The rank of a
  module is ``rank`` (capped by what the module can hold), or with ``energy`` the
  smallest rank keeping that fraction of ‖τ‖²_F (``rank`` then caps it); modules with
  another rank than ``r`` are listed in ``rank_pattern``/``alpha_pattern``. When every
  input of the tensor is a plain LoRA and the method is linear, the SVD is taken of
  the stacked factors through thin QRs (``hubsoup.engine.lowrank``): the dense matrix is
  never formed. Otherwise the method merges the dense task vectors and the SVD is
  taken of the result.
* **Full tensors** for everything else that changed (norms, biases, other parameters):
  a module none of whose weights gets a LoRA goes to ``modules_to_save`` (all its
  tensors saved, as peft expects); the bias of a LoRA-adapted module is saved as
  ``<module>.base_layer.bias`` (the layout of peft's ``bias="lora_only"``); a parameter
  that belongs to no leaf module is saved under its own name. These are exact.
* Tensors whose τ is exactly zero are left out.

The truncation's relative Frobenius error ‖τ − τ_r‖_F / ‖τ‖_F is reported per module
(``hubsoup_lora_report.json``) and in aggregate (√(Σ discarded energy / Σ energy))
in the model card. Factors are saved in float32 (``dtype`` overrides), full tensors in
the base's dtype. ``PeftModel.from_pretrained(base, out).merge_and_unload()`` gives the
merged model up to that truncation.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from hubsoup.arch import Layout, model_layout, module_kind, peft_task_type
from hubsoup.engine import Copy, Dense, LowRank, Outcome, TensorWork, Unchanged
from hubsoup.errors import ParameterError
from hubsoup.output.shards import ShardedWriter
from hubsoup.output.checkpoint import check_output_tensor, copy_base_files
from hubsoup.linalg import gram_chunked, mm_chunked, mm_t_chunked, single_thread, sq_norm_chunked, svd_of_product
from hubsoup.plan import TensorEntry
from hubsoup.sources.checkpoint import Checkpoint
from hubsoup.sources.lora import PEFT_PREFIX

log = logging.getLogger(__name__)

REPORT_FILE = "hubsoup_lora_report.json"
_LORA_KINDS = ("linear", "conv1d", "embedding")


@dataclass
class LoraOptions:
    rank: int | None = None
    """Rank of every module (the cap when ``energy`` is given)."""
    energy: float | None = None
    """Keep the smallest rank whose singular values hold this fraction of ‖τ‖²_F."""
    dtype: torch.dtype | None = None

    def validate(self) -> None:
        if self.rank is None and self.energy is None:
            raise ParameterError("LoRA output needs --rank R (and/or --energy E, a fraction of ‖τ‖² to keep)")
        if self.rank is not None and (not isinstance(self.rank, int) or self.rank < 1):
            raise ParameterError(f"rank must be a positive integer, got {self.rank!r}")
        if self.energy is not None:
            try:
                e = math.nan if isinstance(self.energy, bool) else float(self.energy)
            except (TypeError, ValueError):
                e = math.nan
            if not (0.0 < e <= 1.0):  # NaN fails the comparison
                raise ParameterError(f"energy must be a number in (0, 1], got {self.energy!r}")


@dataclass
class _ModuleRow:
    module: str
    kind: str
    rank: int
    rel_error: float
    energy: float
    kept_energy: float
    params: int
    path: str  # "factors" (stacked LoRA factors, QR) or "dense" (SVD of the merged τ)

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "kind": self.kind, "rank": self.rank, "rel_error": self.rel_error,
                "path": self.path}


# peft's task types whose PeftModel wraps the task head as a module to save (peft's classifier_module_names)
_TASK_HEADS = {"SEQ_CLS": ("classifier", "score"), "TOKEN_CLS": ("classifier", "score"), "QUESTION_ANS": ("qa_outputs",)}


@dataclass
class LoraSink:
    """The engine's LoRA-adapter output: collects the adapter's tensors as the merge streams by.

    Everything it keeps is small (factors) except the full tensors of changed non-LoRA
    modules (norms, biases, ``modules_to_save``); :meth:`close` writes the folder.
    """

    base: Checkpoint
    base_keys: list[str]
    options: LoraOptions
    folder: str
    metadata: dict[str, str] = field(default_factory=dict)
    task_type: str | None = None
    layout: Layout | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: list[_ModuleRow] = field(default_factory=list)
    changed_full: dict[str, torch.Tensor] = field(default_factory=dict)  # base name -> merged full tensor
    targets: dict[str, str] = field(default_factory=dict)  # module -> kind
    ranks: dict[str, int] = field(default_factory=dict)

    reads_base = False
    """The engine's hint (:func:`hubsoup.engine.run`): this sink reads a base tensor only for a dense outcome, so the
    base's bytes of a tensor merged from LoRA factors are never fetched from the Hub."""

    def __post_init__(self) -> None:
        if self.layout is None:
            self.layout = model_layout(os.path.abspath(self.base.folder))

    @classmethod
    def of_merge(cls, base: Checkpoint, inputs: Sequence[Any], options: LoraOptions, folder: str,
                 metadata: dict[str, str]) -> "LoraSink":
        """The adapter of a merge of ``inputs`` (task vectors) onto ``base``, written into ``folder`` with the base's
        tokenizer files. Its ``task_type`` (which ``AutoPeftModelFor*`` loads it) is the base architecture's, else the
        LoRA inputs' own when they agree on one."""
        task_types = {s.config.get("task_type") for s in inputs if s.kind == "lora"}
        sink = cls(base, base.keys(), options, folder, metadata,
                   peft_task_type(base.config) or (task_types.pop() if len(task_types) == 1 else None))
        copy_base_files(base, folder, tokenizer_only=True)
        return sink

    # --- the engine's side ------------------------------------------------------------------
    def accepts_lowrank(self, entry: TensorEntry) -> bool:
        return self.lora_kind(entry) is not None  # a module it cannot adapt needs its dense τ

    def weights_dtype(self, entry: TensorEntry) -> None:
        return None  # an adapter holds τ, never θ

    def put(self, work: TensorWork, outcome: Outcome) -> None:
        work.settle()  # on a device: a NaN input is named before the output's own checks
        if isinstance(outcome, (Copy, Unchanged)):
            return  # integer buffers stay the base's; untouched tensors have τ = 0
        if isinstance(outcome, LowRank):
            self.add_factors(work.entry, outcome.p, outcome.q)
        elif isinstance(outcome, Dense):
            self.add_dense(work.entry, outcome.tau, work.base)

    def close(self) -> dict[str, Any]:
        """Write the adapter folder; returns the truncation report."""
        # plan order, whatever order concurrent workers delivered the tensors in: the same files every time
        order = {k: i for i, k in enumerate(self.base_keys)}
        self.rows.sort(key=lambda row: order.get(row.module + ".weight", len(order)))
        self.ranks = {m: self.ranks[m] for m in sorted(self.ranks, key=lambda m: order.get(m + ".weight", len(order)))}
        self.changed_full = {k: self.changed_full[k] for k in sorted(self.changed_full, key=lambda k: order.get(k, len(order)))}
        base_name = self.base.ref.repo_id or os.path.abspath(self.base.folder)
        return self.finish(self.folder, base_name=base_name, base_revision=self.base.ref.sha,
                           task_type=self.task_type, metadata=self.metadata)

    def abort(self) -> None:
        self.tensors.clear()
        self.changed_full.clear()

    # --- what gets a LoRA ----------------------------------------------------------------
    def lora_kind(self, entry: TensorEntry) -> str | None:
        """``linear``/``conv1d``/``embedding`` when ``entry`` is the weight of such a module."""
        if len(entry.shape) != 2 or not entry.name.endswith(".weight") or self.head_module(entry.name):
            return None
        kind = module_kind(self.layout, entry.name[: -len(".weight")], entry.shape)
        return kind if kind in _LORA_KINDS else None

    def head_module(self, name: str) -> str | None:
        """The task head ``name`` belongs to, which peft's ``PeftModelFor<task_type>`` always wraps as a module to
        save (``classifier``/``score``, ``qa_outputs``): the adapter holds it whole, so it gets no LoRA."""
        heads = _TASK_HEADS.get(self.task_type or "", ())
        parts = name.split(".")
        for i, part in enumerate(parts[:-1]):
            if part in heads:
                return ".".join(parts[: i + 1])
        return None

    def add_factors(self, entry: TensorEntry, p: torch.Tensor, q: torch.Tensor) -> None:
        """τ = p @ q (base orientation); SVD through QR, never the dense matrix."""
        kind = self.lora_kind(entry)
        assert kind is not None  # the engine hands factors only where accepts_lowrank
        check_output_tensor(entry.name, p, p)  # before the SVD, which NaN would derail (one reduction each)
        check_output_tensor(entry.name, q, q)
        if kind != "linear":  # stored (in, out): the LoRA factorises τᵀ
            p, q = q.T, p.T
        with single_thread():  # all of it is (out + in) × Σr small: threads only cost here
            u, s, vh = svd_of_product(p, q)
            self._add_svd(entry, kind, u, s, vh, "factors")

    def add_dense(self, entry: TensorEntry, tau: torch.Tensor, base: Callable[[], torch.Tensor]) -> None:
        """A merged task vector computed densely: SVD if LoRA-able, else kept as a full tensor (``base()`` + τ)."""
        if not bool(tau.any()):
            return
        check_output_tensor(entry.name, tau, tau)  # NaN/inf would derail the SVD (one reduction)
        kind = self.lora_kind(entry)
        if kind is None:
            self.changed_full[entry.name] = (base() + tau).cpu()
            return
        lin = tau if kind == "linear" else tau.T
        total = sq_norm_chunked(lin)
        left = lin.shape[0] <= lin.shape[1]
        # SVD through the Gram matrix of the smaller side (float64, built in chunks): the same
        # subspaces as a full SVD, several times faster on CPU, and never a float64 copy of τ
        gram = gram_chunked(lin if left else lin.T)
        evals, evecs = torch.linalg.eigh(gram)
        s2 = evals.flip(0).clamp_min(0.0)
        basis = evecs.flip(1)
        r = self._rank(s2, total, _numerical_rank(s2))
        if r == 0:
            return
        s = s2[:r].sqrt()
        root = s.sqrt()
        if left:  # lin = U S Vᵀ: B = U √S, A = √S Vᵀ = Uᵀ lin / √S
            b = basis[:, :r] * root
            a = mm_t_chunked(basis[:, :r], lin) / root[:, None]
        else:
            b = mm_chunked(lin, basis[:, :r]) / root
            a = root[:, None] * basis[:, :r].T
        self._store(entry, kind, b, a, r, total, float(s2[:r].sum()), "dense")

    def _add_svd(self, entry: TensorEntry, kind: str, u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor,
                 path: str) -> None:
        s2 = s.double() ** 2
        total = float(s2.sum())
        r = self._rank(s2, total, _numerical_rank(s2))
        if r == 0:
            return
        root = s[:r].sqrt()
        self._store(entry, kind, u[:, :r] * root, root[:, None] * vh[:r], r, total, float(s2[:r].sum()), path)

    def _rank(self, s2: torch.Tensor, total: float, available: int) -> int:
        """The rank to keep for singular values² ``s2`` (descending) of a matrix with ‖τ‖² = total."""
        if total <= 0.0 or available == 0:
            return 0
        r = available
        if self.options.energy is not None:
            frac = torch.cumsum(s2, 0) / total
            r = int(torch.searchsorted(frac, torch.tensor(float(self.options.energy), dtype=frac.dtype) - 1e-12)) + 1
        if self.options.rank is not None:
            r = min(r, self.options.rank)
        return max(1, min(r, available))

    def _store(self, entry: TensorEntry, kind: str, b: torch.Tensor, a: torch.Tensor, r: int, total: float, kept: float,
               path: str) -> None:
        module = entry.name[: -len(".weight")]
        rel = math.sqrt(max(total - kept, 0.0) / total)
        b = b.to(torch.float32).cpu()
        a = a.to(torch.float32).cpu()
        dt = self.options.dtype or torch.float32
        key = f"{PEFT_PREFIX}{module}"
        if kind == "embedding":
            self._put(f"{key}.lora_embedding_A", a, dt)
            self._put(f"{key}.lora_embedding_B", b, dt)
        else:
            self._put(f"{key}.lora_A.weight", a, dt)
            self._put(f"{key}.lora_B.weight", b, dt)
        self.targets[module] = kind
        self.ranks[module] = r
        self.rows.append(_ModuleRow(module, kind, r, rel, total, kept, r * (a.shape[1] + b.shape[0]), path))

    def _put(self, key: str, t: torch.Tensor, dtype: torch.dtype) -> None:
        """Store adapter tensor ``key`` cast to ``dtype``, refusing NaN/inf (an overflowing cast included)."""
        out = t.to(dtype).contiguous()
        check_output_tensor(key, out, t)
        self.tensors[key] = out

    # --- full tensors ----------------------------------------------------------------------
    def _full_dtype(self, name: str) -> torch.dtype:
        return self.options.dtype or self.base.info(name).dtype

    def _place_full(self) -> tuple[list[str], list[str]]:
        """Put the changed non-LoRA tensors in: modules_to_save, base_layer biases, or plain keys."""
        modules_to_save: list[str] = []
        plain: list[str] = []
        by_module: dict[str, dict[str, torch.Tensor]] = {}
        heads = {h for k in self.base_keys if (h := self.head_module(k))}
        for head in sorted(heads):  # whole, changed or not: peft loads every tensor of the head it wraps
            for name in (k for k in self.base_keys if k.startswith(head + ".")):
                t = self.changed_full[name] if name in self.changed_full else self.base.tensor(name)
                self._put(f"{PEFT_PREFIX}{name}", t, self._full_dtype(name))
            modules_to_save.append(head)
        for name, t in self.changed_full.items():
            if self.head_module(name):
                continue
            module, _, param = name.rpartition(".")
            by_module.setdefault(module, {})[param] = t
        have = set(self.base_keys)
        for module, params in by_module.items():
            info = self.layout.modules.get(module) if self.layout is not None else None
            if module in self.targets:
                for param, t in params.items():
                    self._put(f"{PEFT_PREFIX}{module}.base_layer.{param}", t, self._full_dtype(f"{module}.{param}"))
                plain.extend(f"{module}.{p}" for p in params)
                continue
            if module and info is not None and all(f"{module}.{p}" in have or p in params for p in info.params):
                for p in info.params:  # peft's ModulesToSaveWrapper loads every tensor of the module
                    name = f"{module}.{p}"
                    t = params[p] if p in params else self.base.tensor(name)
                    self._put(f"{PEFT_PREFIX}{name}", t, self._full_dtype(name))
                modules_to_save.append(module)
                continue
            for param, t in params.items():  # a parameter outside any leaf module: loaded into the base as is
                name = f"{module}.{param}" if module else param
                self._put(f"{PEFT_PREFIX}{name}", t, self._full_dtype(name))
                plain.append(name)
        return modules_to_save, plain

    # --- the folder --------------------------------------------------------------------------
    def finish(self, folder: str, *, base_name: str, base_revision: str | None, task_type: str | None,
               metadata: dict[str, str]) -> dict[str, Any]:
        modules_to_save, plain = self._place_full()
        if not self.tensors:
            log.warning("the merged task vector is zero everywhere; writing an empty adapter")
        ranks = list(self.ranks.values())
        r = self.options.rank or (max(ranks) if ranks else 1)
        pattern = {re.escape(m): k for m, k in self.ranks.items() if k != r}
        has_base_layer_bias = any(".base_layer." in k for k in self.tensors)
        config: dict[str, Any] = {
            "peft_type": "LORA",
            "task_type": task_type,
            "base_model_name_or_path": base_name,
            "revision": base_revision,
            "r": r,
            "lora_alpha": r,
            "rank_pattern": pattern,
            "alpha_pattern": dict(pattern),
            "target_modules": sorted(self.targets) or None,
            "modules_to_save": sorted(modules_to_save) or None,
            "fan_in_fan_out": any(k == "conv1d" for k in self.targets.values()),
            "bias": "lora_only" if has_base_layer_bias else "none",
            "use_rslora": False,
            "use_dora": False,
            "lora_dropout": 0.0,
            "init_lora_weights": True,
            "inference_mode": True,
            "layers_to_transform": None,
            "layers_pattern": None,
        }
        arch = (self.base.config.get("architectures") or [None])[0] if task_type is None else None
        if isinstance(arch, str) and arch.isidentifier():  # no peft task: AutoPeftModel loads the base's own class
            config["auto_mapping"] = {"base_model_class": arch, "parent_library": "transformers"}
        # our writer, not save_file: its header order is fixed, so the same merge gives the same bytes
        names = sorted(self.tensors)
        writer = ShardedWriter(folder, [(k, tuple(self.tensors[k].shape), self.tensors[k].dtype) for k in names],
                               max_shard_size=1 << 62, metadata=metadata, prefix="adapter_model", index=False)
        for k in names:
            writer.write(k, self.tensors[k])
        writer.close()
        with open(os.path.join(folder, "adapter_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        report = self.report(modules_to_save, plain)
        with open(os.path.join(folder, REPORT_FILE), "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        return report

    def report(self, modules_to_save: list[str], plain: list[str]) -> dict[str, Any]:
        total = sum(row.energy for row in self.rows)
        kept = sum(row.kept_energy for row in self.rows)
        agg = math.sqrt(max(total - kept, 0.0) / total) if total > 0 else 0.0
        worst = sorted(self.rows, key=lambda row: -row.rel_error)
        return {
            "rank": self.options.rank,
            "energy": self.options.energy,
            "lora_modules": len(self.rows),
            "lora_params": sum(row.params for row in self.rows),
            "aggregate_rel_error": agg,
            "max_rel_error": worst[0].rel_error if worst else 0.0,
            "factor_path_modules": sum(row.path == "factors" for row in self.rows),
            "modules": [row.to_dict() for row in self.rows],
            "modules_to_save": sorted(modules_to_save),
            "full_tensors": sorted(plain),
        }


_RANK_TOL = 1e-14  # singular values² below this fraction of the largest are rounding noise (σ/σ₁ < 1e-7)


def _numerical_rank(s2: torch.Tensor) -> int:
    return int((s2 > s2[0] * _RANK_TOL).sum()) if len(s2) and float(s2[0]) > 0 else 0
