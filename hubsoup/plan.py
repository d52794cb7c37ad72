"""The merge plan: a model's tensors grouped into transformer blocks in forward order.

Each block knows its stack (``model.layers``, ``decoder.block``, ...), its depth in
that stack and the stack's number of layers (from the config), and the device it
is computed on. Tied weights appear once (their aliases are written with the same
result); non-float tensors are marked to be copied from the base.

Example:
    >>> from hubsoup.plan import block_of
    >>> block_of("decoder.block.3.layer.0.SelfAttention.q.weight")
    ('decoder.block', 3)
    >>> block_of("lm_head.weight") is None
    True
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Protocol, Sequence, cast

import torch

from hubsoup.arch import before_blocks, tied_groups
from hubsoup.errors import IncompatibleInputError

if TYPE_CHECKING:
    from hubsoup.arch import TensorHeader

log = logging.getLogger(__name__)

# The leftmost `<container>.<int>.` names the block: `decoder.block.3.layer.0.x` is block 3
# of `decoder.block` (a substring test for ".0." would wrongly say 0).
_BLOCK_RE = re.compile(r"^(?P<stack>(?:.*?\.)?(?:layers|layer|h|block|blocks|resblocks))\.(?P<idx>\d+)\.")


def block_of(name: str) -> tuple[str, int] | None:
    """``(stack, index)`` of the transformer block holding tensor ``name``, or None."""
    m = _BLOCK_RE.match(name)
    return (m.group("stack"), int(m.group("idx"))) if m else None


def num_layers_for(stack: str, config: Mapping[str, Any]) -> int | None:
    """Number of blocks of ``stack`` according to the model config."""
    def first(cfg: Mapping[str, Any], *keys: str) -> int | None:
        for k in keys:
            if isinstance(cfg.get(k), int):
                return cast(int, cfg[k])
        return None

    sub = config
    for tower in ("vision", "text"):
        if f"{tower}_model" in stack and isinstance(config.get(f"{tower}_config"), dict):
            sub = config[f"{tower}_config"]
    if "decoder" in stack:
        return first(sub, "num_decoder_layers", "decoder_layers", "num_layers", "num_hidden_layers", "n_layer")
    return first(sub, "num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "n_layers")


@dataclass(frozen=True)
class BlockInfo:
    """Where a tensor sits in the network: block ``index`` of ``stack`` (of ``num_layers``)."""

    stack: str
    index: int
    num_layers: int

    @property
    def depth(self) -> float:
        """Relative depth in [0, 1]: 0 for the first block, 1 for the last."""
        return self.index / (self.num_layers - 1) if self.num_layers > 1 else 0.0


@dataclass(frozen=True)
class TensorSource:
    """Where an output tensor is read from when the output's layout is not the base's.

    A layout (mergekit's ``slices``: a frankenmerge, per-slice merges) renumbers layers, so
    output tensor ``model.layers.5.mlp.up_proj.weight`` may be layer 3 of the base and of each
    input. The engine reads θ₀ as ``base`` (from the base checkpoint, or from
    ``Job.donors[origin]`` when ``origin`` ≥ 0: a passthrough slice copies another model's
    layer) and input i's task vector from its tensor ``inputs[i]`` (None: τᵢ = 0 here).
    ``position`` is the tensor's gradient position t for schedules (its slice's, as mergekit
    computes it); None: from its block (:func:`hubsoup.methods._schedule.layer_position`).
    """

    base: str
    inputs: tuple[str | None, ...]
    position: float | None = None
    origin: int = -1


@dataclass
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    aliases: tuple[str, ...] = ()
    """Tied copies present in the checkpoint: written with the same result."""
    source: TensorSource | None = None
    """Where the tensor is read from, when not from ``name`` itself (a layout: :func:`layout_plan`)."""

    @property
    def mergeable(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class Block:
    name: str
    info: BlockInfo | None
    tensors: list[TensorEntry] = field(default_factory=list)
    device: str = "cpu"
    worker: str = ""
    """The engine's worker that merges it (one per device of a device map; blocks of one worker run in order)."""


class PlannedCheckpoint(Protocol):
    """What :meth:`Plan.of` reads of a checkpoint (``hubsoup.sources.checkpoint.Checkpoint``)."""

    folder: str

    @property
    def config(self) -> dict[str, Any]: ...

    def keys(self) -> list[str]: ...

    def info(self, name: str) -> TensorHeader: ...


@dataclass
class Plan:
    blocks: list[Block]

    def entries(self) -> Iterator[tuple[Block, TensorEntry]]:
        """(block, entry) pairs in forward order."""
        for block in self.blocks:
            for entry in block.tensors:
                yield block, entry

    def output_entries(self) -> list[tuple[str, TensorEntry]]:
        """Every name written to the output (aliases included) with its entry."""
        out = []
        for _, e in self.entries():
            out.append((e.name, e))
            out.extend((a, e) for a in e.aliases)
        return out

    @classmethod
    def of(cls, ckpt: PlannedCheckpoint, device: str = "cpu") -> "Plan":
        """The plan of a checkpoint (its keys, header infos, config and architecture's ties)."""
        keys = ckpt.keys()
        infos = {k: ckpt.info(k) for k in keys}
        return build_plan(keys, infos, ckpt.config, ties=tied_groups(ckpt.folder, keys, infos, ckpt.config),
                          device=device)

    def summary(self) -> str:
        lines = []
        for b in self.blocks:
            size = sum(e.numel for e in b.tensors)
            where = f"block {b.info.index}/{b.info.num_layers} of {b.info.stack}" if b.info else "outside blocks"
            lines.append(f"{b.name:<40} {len(b.tensors):>4} tensors {size:>12,} params  {where}  [{b.device}]")
        return "\n".join(lines)


def build_plan(keys: list[str], infos: Mapping[str, TensorHeader], config: Mapping[str, Any], *,
               ties: Sequence[Sequence[str]] = (), device: str = "cpu") -> Plan:
    """Group the base's tensors into blocks in forward order.

    ``infos`` maps each key to an object with ``shape`` and ``dtype``.
    """
    alias_of: dict[str, str] = {}
    for group in ties:
        for other in group[1:]:
            alias_of[other] = group[0]
    aliases: dict[str, list[str]] = {}
    for other, kept in alias_of.items():
        aliases.setdefault(kept, []).append(other)

    stacks: dict[str, dict[int, Block]] = {}
    head: list[TensorEntry] = []
    tail: list[TensorEntry] = []
    counts: dict[str, int] = {}
    for name in keys:
        if name in alias_of:
            continue
        info = infos[name]
        entry = TensorEntry(name, tuple(info.shape), info.dtype, tuple(aliases.get(name, ())))
        hit = block_of(name)
        if hit is None:
            (head if before_blocks(name) else tail).append(entry)
            continue
        stack, idx = hit
        if stack not in counts:
            n = num_layers_for(stack, config)
            counts[stack] = n if n is not None else -1
        stacks.setdefault(stack, {}).setdefault(idx, Block(f"{stack}.{idx}", None, [], device)).tensors.append(entry)

    for stack, by_idx in stacks.items():
        present = max(by_idx) + 1
        n = counts[stack]
        if n == -1:
            log.warning("config gives no layer count for %s; using %d from the checkpoint", stack, present)
            n = present
        elif present > n:
            raise IncompatibleInputError(
                f"base checkpoint has block {present - 1} in '{stack}' but its config says {n} layers"
            )
        for idx, block in by_idx.items():
            block.info = BlockInfo(stack, idx, n)

    def stack_rank(stack: str) -> tuple[int, int]:
        order = 2 if "decoder" in stack else (0 if "encoder" in stack or "vision" in stack else 1)
        return (order, list(stacks).index(stack))

    blocks: list[Block] = []
    if head:
        blocks.append(Block("embeddings", None, head, device))
    for stack in sorted(stacks, key=stack_rank):
        blocks.extend(stacks[stack][i] for i in sorted(stacks[stack]))
    if tail:
        blocks.append(Block("head", None, tail, device))
    return Plan(blocks)


def layout_plan(sources: dict[str, TensorSource], infos: Mapping[str, TensorHeader], config: Mapping[str, Any], *,
                ties: Sequence[Sequence[str]] = (), device: str = "cpu") -> Plan:
    """The plan of an output whose tensors come from elsewhere (``sources``: output name → :class:`TensorSource`).

    ``infos`` maps each output name to its shape and dtype; ``config`` is the output's config
    (its layer count gives the blocks' depth). The one engine streams it like any plan.
    """
    plan = build_plan(list(sources), infos, config, ties=ties, device=device)
    for _, entry in plan.entries():
        entry.source = sources[entry.name]
    return plan


class OutputLayout(Protocol):
    """How an output is laid out from its inputs when not as the base is: what :func:`hubsoup.merge` (its
    ``layout``), the footprint and the recipe read of it. A mergekit config's layout
    (:class:`hubsoup.formats.mergekit.MergekitLayout`: slices, merged vocabulary, tokenizer) is one."""

    donors: list[Any]
    """Checkpoints beyond the inputs and the base that tensors are copied from (a ``slices:`` config's models)."""

    @property
    def reads(self) -> list[Any]:
        """Every checkpoint the output is made from beyond the inputs and the base (never overwritten)."""

    @property
    def opens_inputs(self) -> bool:
        """Whether the merge opens the inputs through :meth:`open_inputs` (read where present: False when absent)."""

    @property
    def hashed(self) -> dict[str, Any]:
        """The layout's options that change the output: in the recipe's hash."""

    def open_inputs(self, inputs: Sequence[str], base: str | None, opts: Any, monitor: Any = None) -> Any:
        """The base checkpoint and the inputs' task vectors, as the layout sees them."""

    def plan(self, base: Any, sources: Sequence[Any], opts: Any) -> Plan:
        """The output's plan, the one engine streams."""

    def finish(self, folder: str) -> None:
        """Fix the written output folder (its config's layer count, tokenizer, chat template)."""

    def card_section(self) -> dict[str, str]:
        """A section for the model card (e.g. the config as YAML)."""

    def recipe_extra(self) -> dict[str, Any]:
        """What the recipe records of the layout outside the hash."""
