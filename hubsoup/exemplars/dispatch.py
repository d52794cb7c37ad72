"""Experts larger than one device: accelerate's big-model inference for exemplar capture.

With a ``device_map`` or ``max_memory`` (:class:`hubsoup.options.MergeOptions`), each expert is
built empty (on the meta device), placed by accelerate (``infer_auto_device_map`` over the
budgets, ``get_balanced_memory`` for ``balanced``/``auto`` over several GPUs), filled tensor by
tensor from the engine's stream (``set_module_tensor_to_device``, or ``offload_weight`` for
modules placed on ``disk``) and run through ``dispatch_model``'s hooks, which bring offloaded
weights to the execution device one module at a time. No expert is ever whole in memory;
the offloaded weights live in a scratch folder removed after each expert.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from hubsoup.arch import model_class
from hubsoup.errors import HubsoupError, PlacementError
from hubsoup.options import parse_device_map, parse_max_memory


def meta_model(base_folder: str) -> Any:
    """The base's architecture with empty (meta) weights, ties made, in eval mode; never remote code."""
    # lazy: accelerate and transformers' model code cost ~13 s to import here; only big experts (offload) need them
    from accelerate import init_empty_weights
    # lazy: transformers costs ~4 s to import here (torch ~6 s); only big experts (offload) need it
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(base_folder, trust_remote_code=False)
        with init_empty_weights():  # buffers (rotary frequencies, ...) are real: computed by the modules
            model = model_class(cfg)._from_config(cfg, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001
        raise HubsoupError(f"LOT needs to run the model, but transformers cannot build it from '{base_folder}' "
                           f"({type(e).__name__}: {e})") from e
    return model.eval()


def _accelerate_device(d: Any) -> int | str:
    """A hubsoup device (``cpu:N`` workers, ``cuda:N``) as accelerate's key (``cpu``, ``N``)."""
    s = str(d)
    if isinstance(d, int) or s.isdigit():
        return int(d)
    if s.startswith("cpu"):
        return "cpu"
    if s.startswith("cuda:") and s[5:].isdigit():
        return int(s[5:])
    return s


def expert_device_map(model: torch.nn.Module, device_map: Any, max_memory: Any) -> dict[str, int | str]:
    """Where each module of an expert goes (accelerate's device map), from the merge's options.

    The budgets are ``max_memory`` (``cpu:N`` entries pooled into ``cpu``: they are one host's
    memory) or, without it, accelerate's ``get_max_memory()`` over the devices the map names
    (every device for a strategy). Modules that fit nowhere go to ``disk``.
    """
    # lazy: accelerate with transformers' model code costs ~13 s here; only big experts need it
    from accelerate.utils import (
        get_balanced_memory,
        get_max_memory,
        infer_auto_device_map,
    )

    dm = parse_device_map(device_map)
    mm = parse_max_memory(max_memory)
    if mm is not None:
        budget: dict[int | str, int] = {}
        for k, v in mm.items():
            key = _accelerate_device(k)
            budget[key] = budget.get(key, 0) + v
        budget = get_max_memory(budget)
    else:
        budget = get_max_memory()
        if isinstance(dm, dict):
            named = {_accelerate_device(v) for v in dm.values()}
            budget = {k: v for k, v in budget.items() if k in named} or {"cpu": budget["cpu"]}
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    if dm in ("auto", "balanced") and sum(isinstance(k, int) for k in budget) > 1:
        budget = get_balanced_memory(model, max_memory=budget, no_split_module_classes=no_split, dtype=torch.float32)
    return infer_auto_device_map(model, max_memory=budget, no_split_module_classes=no_split, dtype=torch.float32)  # type: ignore[no-any-return]  # accelerate ships no types


def _module_device(dm: dict[str, int | str], name: str) -> int | str:
    """The device of tensor ``name`` in accelerate's map: its longest module prefix's."""
    module = name
    while module not in dm:
        if not module:
            raise PlacementError(f"LOT: the experts' device map covers no module of tensor '{name}'")
        module = module.rsplit(".", 1)[0] if "." in module else ""
    return dm[module]


class DispatchedExperts:
    """Builds each expert with accelerate's big-model inference; its offload folder lives in ``scratch``.

    Example (what :func:`hubsoup.exemplars.capture` does per expert)::

        experts = DispatchedExperts(base_folder, device_map=None, max_memory={"cpu": "2GiB"}, scratch=tmp)
        with experts.load(lambda assign: ctx.load_expert(i, assign)) as model:
            model(**batch)
    """

    def __init__(self, base_folder: str, *, device_map: Any = None, max_memory: Any = None,
                 scratch: str | None = None, quiet: bool = False):
        self.base_folder = base_folder
        self.scratch, self.quiet = scratch, quiet
        self.template = meta_model(base_folder)
        self.device_map = expert_device_map(self.template, device_map, max_memory)
        if set(self.device_map.values()) == {"disk"}:
            raise PlacementError("LOT: max_memory leaves no device room for even one module of an expert "
                                 "(every module would be offloaded to disk); give the devices more memory")
        devices = [d for d in self.device_map.values() if d not in ("cpu", "disk")]
        self.main_device = _torch(devices[0]) if devices else "cpu"
        self.offload_dir: str | None = None

    @property
    def offloads(self) -> bool:
        return "disk" in self.device_map.values()

    def load(self, stream: Callable[[Callable[[str, torch.Tensor], None]], None]) -> _Loaded:
        """The expert whose tensors ``stream(assign)`` gives, dispatched (a context manager that frees it)."""
        return _Loaded(self, stream)


def _torch(d: int | str) -> str:
    return f"cuda:{d}" if isinstance(d, int) else str(d)


class _Loaded:
    def __init__(self, experts: DispatchedExperts, stream: Callable[[Callable[[str, torch.Tensor], None]], None]):
        self.experts, self.stream, self.model = experts, stream, None

    def __enter__(self) -> Any:
        # lazy: accelerate with transformers' model code costs ~13 s here; only big experts need it
        from accelerate import dispatch_model
        # lazy: accelerate with transformers' model code costs ~13 s here; only big experts need it
        from accelerate.utils import (
            find_tied_parameters,
            offload_weight,
            set_module_tensor_to_device,
        )

        ex = self.experts
        dm = ex.device_map
        model = meta_model(ex.base_folder)
        if ex.offloads:
            if ex.scratch is not None:
                os.makedirs(ex.scratch, exist_ok=True)
            ex.offload_dir = tempfile.mkdtemp(prefix=".hubsoup-offload-", dir=ex.scratch)
        params = dict(model.named_parameters(remove_duplicate=False))
        tensors = set(params) | {n for n, _ in model.named_buffers(remove_duplicate=False)}
        partners = {n: g for g in find_tied_parameters(model) for n in g}  # a tie's every name gets the value
        index: dict[str, dict[str, Any]] = {}
        seen: set[str] = set()

        def assign(name: str, value: torch.Tensor) -> None:
            for n in partners.get(name, [name]):
                if n in seen or n not in tensors:
                    continue
                seen.add(n)
                target = params[n].dtype if n in params else value.dtype
                if not (value.is_floating_point() and target.is_floating_point):
                    target = value.dtype
                dev = _module_device(dm, n)
                if dev == "disk" and n in params:  # buffers stay in memory (offload_buffers=False)
                    offload_weight(value.detach().to("cpu", target), n, ex.offload_dir, index)
                else:
                    set_module_tensor_to_device(model, n, _torch("cpu" if dev == "disk" else dev),
                                                value=value.detach(), dtype=target)

        try:
            with torch.no_grad():
                self.stream(assign)
            missing = sorted(n for n in params if n not in seen)
            if missing:
                raise HubsoupError(f"LOT: the base checkpoint has no tensor for the model's parameter '{missing[0]}'"
                                   + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                                   + "; cannot run the experts with a device map")
            notices = logging.getLogger("accelerate.big_modeling")  # "some parameters are on the meta device"
            level = notices.level
            if ex.quiet:
                notices.setLevel(logging.ERROR)
            try:
                self.model = dispatch_model(model, dm, main_device=ex.main_device,
                                            offload_dir=ex.offload_dir, offload_index=index or None)
            finally:
                notices.setLevel(level)
        except BaseException:
            self._cleanup()
            raise
        return self.model

    def __exit__(self, *exc: Any) -> None:
        self._cleanup()

    def _cleanup(self) -> None:
        self.model = None
        ex = self.experts
        if ex.offload_dir is not None:
            shutil.rmtree(ex.offload_dir, ignore_errors=True)
            ex.offload_dir = None
