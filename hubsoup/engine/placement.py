"""Where each block is merged: device maps and a memory planner, with accelerate's own conventions.

A merge never holds a model: a block's *working set* is what merging its largest tensor
needs — the base tensor, the N task vectors (the ``(N, *shape)`` float32 stack) and the
merged result, (N + 2) × the tensor's float32 bytes — plus what the method and the output
sink declare for their own workspaces (SVDs, Grams). The planner places blocks by those
sizes with accelerate's utilities (``infer_auto_device_map``, ``get_balanced_memory``,
``get_max_memory``), over a stand-in module (one meta parameter per block, nothing
allocated), so ``auto``/``balanced``/``sequential`` and ``max_memory`` mean what they mean
for ``from_pretrained``. An explicit map (``{"model.layers.0": 0, "": "cpu"}`` or a JSON
file) assigns blocks by the longest module prefix of their tensors' names.

Example:
    >>> parse_max_memory("0=70GiB,cpu=64GiB")
    {0: 75161927680, 'cpu': 68719476736}
    >>> torch_device(0), torch_device("cpu"), torch_device("cuda:1")
    ('cuda:0', 'cpu', 'cuda:1')
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from hubsoup.engine import lanes
from hubsoup.engine.lowrank import params_of, piece_size
from hubsoup.errors import PlacementError
from hubsoup.options import DTYPES, MergeOptions, parse_device_map, parse_max_memory
from hubsoup.plan import Block, Plan, TensorEntry

if TYPE_CHECKING:
    from hubsoup.methods import Method


def torch_device(d: int | str) -> str:
    """accelerate's device keys as torch devices: ``0`` → ``cuda:0``; ``cpu:N`` (a separate CPU worker) → ``cpu``."""
    if isinstance(d, int) or (isinstance(d, str) and d.isdigit()):
        return f"cuda:{int(d)}"
    if d == "disk":
        raise PlacementError("device_map: 'disk' is not a compute device (a merge already streams from disk)")
    return "cpu" if str(d).startswith("cpu") else str(d)


def start_device(device: str | None, device_map: Any = None) -> None:
    """Create CUDA's context in a background thread when the merge will use a GPU, while the inputs are opened
    and planned: a fresh process otherwise waits for it (~0.3-1 s) at its first device call. Changes nothing
    else (torch's lazy initialisation is locked: a caller that needs CUDA earlier simply waits for it)."""
    wants = (device or "").startswith("cuda") or (device_map is not None and device_map != "cpu")
    if not wants or not torch.cuda.is_available() or torch.cuda.is_initialized():
        return

    def init() -> None:
        try:
            torch.cuda.init()
        except Exception:  # noqa: BLE001 - the merge's own first device call reports a broken driver
            pass

    threading.Thread(target=init, name="hubsoup-cuda-init", daemon=True).start()


def worker_key(d: int | str) -> str:
    """The worker a device belongs to: one per GPU, one per ``cpu``/``cpu:N`` entry."""
    return f"cuda:{int(d)}" if isinstance(d, int) or str(d).isdigit() else str(d)


@dataclass
class Placement:
    """Blocks per device and the predicted peak working memory of each device."""

    devices: dict[str, list[Block]] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)
    budgets: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        lines = []
        for dev, blocks in self.devices.items():
            budget = f" of {self.budgets[dev] / 2**30:.2f} GiB" if dev in self.budgets else ""
            names = ", ".join(b.name for b in blocks[:4]) + (f", … ({len(blocks)} blocks)" if len(blocks) > 4 else "")
            lines.append(f"{dev:<10} predicted peak {self.peak[dev] / 2**20:10.1f} MiB{budget}  {names}")
        return "\n".join(lines)


def working_set(block: Block, n_inputs: int, extra: int = 0, *, pieces: int | None = None) -> int:
    """Bytes merging ``block`` needs at once, plus ``extra``: (N + 2) float32 copies of its largest tensor;
    merged in pieces (``pieces``: the output's bytes per entry, see :mod:`hubsoup.engine.lowrank`), two
    of its largest output tensors (one merged, one being written) and the pieces' N + 1 float32 buffers
    in every lane (:mod:`hubsoup.engine.lanes`)."""
    largest = max((e.numel for e in block.tensors if e.mergeable), default=0)
    if pieces is not None:
        # the output being merged and the one the writer thread still holds
        buffers = lanes.count() * (n_inputs + 1) * piece_size(n_inputs) * 4
        return 2 * largest * pieces + buffers + extra
    return (n_inputs + 2) * largest * 4 + extra


def mapped_bytes(block: Block, n_inputs: int, *, pieces: bool = False) -> int:
    """What merging ``block`` on the CPU adds to the process's resident memory beyond :func:`working_set`.

    The engine reads tensors through the weight files' memory maps and unmaps them only when
    the block ends, so every page of the block it touched, in the base and in each of the N
    inputs, is resident meanwhile: (N + 1) × the block's stored bytes (an upper bound for LoRA
    inputs, which map their factors instead). A float32 base tensor on the CPU is used in place
    (its float32 "copy" is those pages), so the largest one is not counted twice. On a GPU these
    pages are host memory, not the device's. Measured (tests/test_memory_plan.py): without this
    term the planner predicted 64 MiB for a task-arithmetic block whose merge grew RSS by 100 MiB.
    """
    merge = [e for e in block.tensors if e.mergeable]
    stored = sum(e.numel * e.dtype.itemsize for e in block.tensors)
    largest = max(merge, key=lambda e: e.numel, default=None)
    dense = largest is not None and largest.dtype == torch.float32 and not pieces  # pieces make no copy
    in_place = largest.numel * 4 if largest is not None and dense else 0
    return (n_inputs + 1) * stored - in_place


def place(plan: Plan, n_inputs: int, *, device: str = "cpu", device_map: str | dict[str, Any] | None = None,
          max_memory: str | dict[Any, Any] | None = None, workspace: Callable[[Block], int] | None = None,
          pieces: Callable[[Block], tuple[int, int] | None] | None = None) -> Placement:
    """Set every block's device (and worker) and predict each device's peak; refuse a block that fits nowhere.

    ``workspace(block) -> bytes`` is what the method and the sink need beyond the stack;
    ``pieces(block) -> (bytes per output entry, workspace of a piece) | None``: when the block's
    tensors are merged in pieces on the CPU (the engine's Weights path), else None.
    """
    dm = parse_device_map(device_map)
    mm = parse_max_memory(max_memory)
    sizes = {b.name: working_set(b, n_inputs, workspace(b) if workspace else 0) for b in plan.blocks}
    assign: dict[str, int | str]
    if dm is None:
        assign = {b.name: device for b in plan.blocks}
    elif isinstance(dm, dict):
        assign = {b.name: _explicit(dm, b) for b in plan.blocks}
    else:
        assign = _infer(plan, sizes, dm, mm)
    out = Placement(budgets={worker_key(k): v for k, v in (mm or {}).items()})
    for b in plan.blocks:
        key = worker_key(assign[b.name])
        b.device, b.worker = torch_device(assign[b.name]), key
        out.devices.setdefault(key, []).append(b)
        per = pieces(b) if b.device == "cpu" and pieces is not None else None
        if per is not None:  # on the CPU the engine merges these in pieces: a smaller working set
            sizes[b.name] = working_set(b, n_inputs, per[1], pieces=per[0])
        host = mapped_bytes(b, n_inputs, pieces=per is not None) if b.device == "cpu" else 0
        out.peak[key] = max(out.peak.get(key, 0), sizes[b.name] + host)
    for key, peak in out.peak.items():
        budget = out.budgets.get(key)
        if budget is not None and peak > budget:
            worst = max(out.devices[key], key=lambda b: sizes[b.name])
            raise PlacementError(f"block '{worst.name}' needs {sizes[worst.name] / 2**20:.1f} MiB to merge but device "
                                 f"{key} has {budget / 2**20:.1f} MiB (max_memory); give it more, or map the block "
                                 "to another device")
    return out


def place_blocks(plan: Plan, method: Method[Any], params: Any, sources: Sequence[Any], opts: MergeOptions, *,
                 lora_output: bool = False, resolved: Mapping[str, Any] | None = None) -> Placement:
    """Every block's device from ``opts`` (device, device_map, max_memory); refuses a block that fits nowhere.

    The one entry to placement: ``hubsoup plan``, :func:`hubsoup.merge` and continual merging all call it,
    so each predicts the same working sets (the method's :meth:`~hubsoup.methods.Method.workspace_bytes`
    included). ``sources``: the job's inputs (their number, and whether all are full checkpoints: a method
    with :meth:`~hubsoup.methods.Method.tensor_passes` then merges in pieces on the CPU). ``resolved``: the
    per-tensor parameters the session resolved once (:func:`hubsoup.engine.lowrank.resolve_all`); None: resolved here.
    """
    n_inputs, full_inputs = len(sources), all(s.kind == "full" for s in sources)

    def pieces(block: Block) -> tuple[int, int] | None:
        """If the engine merges this block's tensors in pieces (its Weights path): the output's bytes per
        entry and the method's workspace for one piece."""
        if lora_output or not full_inputs:
            return None
        merged = [e for e in block.tensors if e.mergeable]
        if not merged or any(e.source is not None for e in merged):  # a layout's renumbering: dense path
            return None
        ps = [params_of(resolved, params, block, e) for e in merged]
        if any(method.tensor_passes(p, n_inputs) is None for p in ps):
            return None
        piece = (piece_size(n_inputs),)
        return (max((DTYPES[opts.dtype] if opts.dtype else e.dtype).itemsize for e in merged),
                max(method.workspace_bytes(piece, n_inputs, p, name=e.name) for e, p in zip(merged, ps)))

    def workspace(block: Block) -> int:
        # the most any one tensor needs (not the largest's: a method's workspace depends on the tensor's role)
        return max((_workspace(block, e) for e in block.tensors if e.mergeable), default=0)

    def _workspace(block: Block, e: TensorEntry) -> int:
        # the parameters this tensor is merged with (schedules resolved as the merge resolves them)
        extra = method.workspace_bytes(e.shape, n_inputs, params_of(resolved, params, block, e), name=e.name)
        if lora_output and len(e.shape) == 2:  # the SVD through the Gram of the smaller side, float64
            extra += 2 * min(e.shape) ** 2 * 8
        return extra

    return place(plan, n_inputs, device=opts.device, device_map=opts.device_map, max_memory=opts.max_memory,
                 workspace=workspace, pieces=pieces)


def _explicit(dm: dict[str, Any], block: Block) -> int | str:
    best: int | str | None = None
    best_len = -1
    for name in (e.name for e in block.tensors):
        for prefix, dev in dm.items():
            if (prefix == "" or name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = dev, len(prefix)
    if best is None:
        raise PlacementError(f"device_map: no entry covers block '{block.name}' (e.g. tensor "
                             f"'{block.tensors[0].name}'); add its module name, or \"\" for the rest")
    return best


def _infer(plan: Plan, sizes: dict[str, int], strategy: str, mm: dict[int | str, int] | None) -> dict[str, int | str]:
    """accelerate's placement over a stand-in module: one child per block, its size the block's working set."""
    # lazy: accelerate.utils costs ~1 s to import here; only an automatic device map needs it
    from accelerate.utils import get_balanced_memory, get_max_memory, infer_auto_device_map

    stand_in = torch.nn.Module()
    names = {}
    for i, b in enumerate(plan.blocks):
        child = torch.nn.Module()
        child.register_parameter("w", torch.nn.Parameter(torch.empty(max(1, -(-sizes[b.name] // 4)),
                                                                    device="meta")))
        stand_in.add_module(f"b{i}", child)
        names[f"b{i}"] = b.name
    budget = get_max_memory(mm)
    if strategy in ("auto", "balanced") and sum(isinstance(k, int) for k in budget) > 1:
        budget = get_balanced_memory(stand_in, max_memory=budget, dtype=torch.float32)
    dm = infer_auto_device_map(stand_in, max_memory=budget, dtype=torch.float32, clean_result=False)
    out: dict[str, int | str] = {}
    for key, block in names.items():
        dev = dm.get(key, dm.get("", None))
        if dev is None or dev == "disk":
            where = ", ".join(f"{k}={v / 2**20:.0f}MiB" for k, v in budget.items())
            raise PlacementError(f"block '{block}' needs {sizes[block] / 2**20:.1f} MiB to merge and fits on no "
                                 f"device ({where}); raise max_memory or merge on a device with more memory")
        out[block] = dev
    return out
