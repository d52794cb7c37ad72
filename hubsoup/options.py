"""Options shared by every entry point that writes a model: one declaration, typed and validated.

:class:`MergeOptions` is taken by :func:`hubsoup.merge`, the continual workflow, search,
sweeps and soups; a field made with :func:`flag` declares its command-line flag too (help, metavar, choices),
which ``hubsoup.cli.options`` generates, and the values a flag gives (strings) are parsed here. Method parameters are *not* options: they belong to the
method (``hubsoup methods NAME``).

Example:
    >>> from hubsoup.options import MergeOptions
    >>> MergeOptions(dtype="bf16", shard_size="2GB").shard_bytes
    2000000000
    >>> options, method_params = MergeOptions.split({"overwrite": True, "density": 0.2})
    >>> options.overwrite, method_params
    (True, {'density': 0.2})
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Container, Iterable

from typing import TYPE_CHECKING

from hubsoup.errors import ParameterError, PlacementError
from hubsoup.hubclient import Token
from hubsoup.progress import Cancel, Monitor, Progress

if TYPE_CHECKING:
    import torch

# dtype names -> torch's names; ``DTYPES`` (name -> torch.dtype) is made on first use: importing torch costs
# seconds, which `hubsoup --help` must not pay
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
               "bfloat16": "bfloat16", "bf16": "bfloat16"}
SHAPE_POLICIES = ("error", "base-slice")


def __getattr__(name: str) -> Any:
    if name == "DTYPES":
        import torch  # lazy: keeps hubsoup --help free of torch

        return {k: getattr(torch, v) for k, v in DTYPE_NAMES.items()}
    raise AttributeError(f"module 'hubsoup.options' has no attribute {name!r}")


STRATEGIES = ("auto", "balanced", "sequential")


def parse_max_memory(spec: str | dict[Any, Any] | None) -> dict[int | str, int] | None:
    """``"0=70GiB,1=70GiB,cpu=64GiB"`` (or a dict) → ``{0: bytes, 1: bytes, "cpu": bytes}``, accelerate's units."""
    if spec is None or spec == "":
        return None
    from accelerate.utils import convert_file_size_to_int  # lazy: keeps hubsoup --help free of accelerate (and torch)

    items = spec.items() if isinstance(spec, dict) else (p.split("=", 1) for p in str(spec).split(",") if p.strip())
    out: dict[int | str, int] = {}
    for item in items:
        if len(item) != 2:
            raise PlacementError(f"max_memory: expected DEVICE=SIZE entries (0=70GiB,cpu=64GiB), got {spec!r}")
        k, v = item
        k = str(k).strip()
        key: int | str = int(k) if k.isdigit() else k
        if isinstance(key, str) and key not in ("cpu", "mps") and not key.startswith(("cuda", "cpu:")):
            raise PlacementError(f"max_memory: unknown device {k!r} (use a GPU index, 'cpu' or 'cpu:N')")
        try:
            size = convert_file_size_to_int(v.strip() if isinstance(v, str) else v)
        except (ValueError, TypeError) as e:
            raise PlacementError(f"max_memory: cannot read the size {v!r} of device {k!r} ({e})") from None
        if size <= 0:
            raise PlacementError(f"max_memory: the size of device {k!r} must be positive, got {v!r}")
        out[key] = size
    return out


def parse_device_map(spec: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """A strategy name, or an explicit map from a dict, a JSON string or a JSON file."""
    if spec is None or spec == "":
        return None
    if isinstance(spec, dict):
        return dict(spec)
    s = str(spec).strip()
    if s in STRATEGIES:
        return s
    if s.startswith("{"):
        try:
            m = json.loads(s)
        except json.JSONDecodeError as e:
            raise PlacementError(f"device_map: not valid JSON ({e})") from None
    elif os.path.isfile(s):
        try:
            with open(s, encoding="utf-8") as f:
                m = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise PlacementError(f"device_map: cannot read {s} ({e})") from None
    else:
        raise PlacementError(f"device_map: {s!r} is not one of {', '.join(STRATEGIES)}, a JSON map or a JSON file")
    if not isinstance(m, dict) or not all(isinstance(k, str) for k in m):
        raise PlacementError("device_map: a map is a JSON object from module names to devices")
    return m


_SIZE_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
               "TB": 10**12, "B": 1, "": 1}
_SIZE = re.compile(r"^([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*([KMGT]I?B|B)?$")


def parse_size(size: str | int) -> int:
    """``"5GB"`` → 5·10⁹ bytes (``GiB`` → 2³⁰), as transformers' ``max_shard_size``; a plain number is bytes.

    Raises :class:`~hubsoup.errors.ParameterError` for anything else (``"5XB"``, ``"nan"``) and for a
    size that is not positive.
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ParameterError(f"{size!r} is not a size (give bytes or e.g. 5GB, 500MB, 2GiB)")
    if isinstance(size, int):
        n = size
    else:
        m = _SIZE.match(size.strip().upper())
        if not m:
            raise ParameterError(f"{size!r} is not a size (give bytes or e.g. 5GB, 500MB, 2GiB)")
        n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2) or ""])
    if n <= 0:
        raise ParameterError(f"{size!r} is not a positive size (give bytes or e.g. 5GB, 500MB, 2GiB)")
    return n


def flag(default: Any, help: str, *, metavar: str | None = None, also: tuple[str, ...] = (),
         choices: Iterable[str] | None = None, inputs: bool = False, compare: bool = True) -> Any:
    """A :class:`MergeOptions` field that is also a command-line flag (``--name-with-dashes``): its ``help``,
    ``metavar``, other spellings (``also``: ``-q``) and ``choices`` are what ``hubsoup.cli.options`` builds the
    flag from; a bool is a switch. ``inputs``: a rule about the inputs, which a continual state fixes (its
    commands that read one leave the flag out); ``compare``: as :func:`dataclasses.field`'s. A field made with plain
    ``field()`` has no flag."""
    meta: dict[str, Any] = {"help": help, "also": also, "inputs": inputs}
    if metavar is not None:
        meta["metavar"] = metavar
    if choices is not None:
        meta["choices"] = tuple(choices)
    return field(default=default, compare=compare, metadata=meta)


@dataclass(frozen=True)
class MergeOptions:
    """How a merge reads its inputs and writes its output (not *what* it computes, but see below).

    ``shape_mismatch`` and ``ignore_extra`` change which tensors are merged, so they enter
    the recipe's hash; the others do not change the result.
    """

    device: str = flag("cpu", "device to merge on (cpu, cuda:0, ...) without --device-map")
    """Where tensors are merged (``cpu``, ``cuda:0``, ...) when there is no ``device_map``."""
    device_map: str | dict[str, Any] | None = flag(
        None, "auto, balanced, sequential (accelerate's placement by each block's working set), a JSON map "
              "{\"model.layers.0\": 0, \"\": \"cpu\"} or a JSON file; blocks on different devices are merged "
              "concurrently", metavar="MAP")
    """``auto``, ``balanced``, ``sequential`` (accelerate's placement by each block's working set),
    or an explicit map ``{"model.layers.0": 0, "": "cpu"}`` (a dict, JSON string or JSON file)."""
    max_memory: str | dict[Any, Any] | None = flag(
        None, "memory per device for the placement: 0=70GiB,1=70GiB,cpu=64GiB", metavar="SPEC")
    """Per device memory for the placement: ``"0=70GiB,1=70GiB,cpu=64GiB"`` or a dict (accelerate's units)."""
    dtype: str | None = flag(None, "output dtype (default: the base's): float32, float16, bfloat16")
    """Output dtype (``float32``, ``float16``, ``bfloat16``; default: the base's)."""
    shard_size: str | int = flag("5GB", "maximum shard size (default 5GB)")
    """Largest safetensors shard (``"5GB"``, ``"500MB"``, ``"2GiB"`` or bytes)."""
    overwrite: bool = flag(False, "replace an existing output folder")
    """Replace an existing output (kept until the new one is complete)."""
    allow_pickle: bool = flag(False, "accept pickle .bin checkpoints (can run code!)")
    """Accept ``pytorch_model.bin`` / ``adapter_model.bin`` inputs (pickle can run code)."""
    ignore_extra: bool = flag(False, "leave out input tensors the base lacks", inputs=True)
    """Leave out input tensors the base lacks (e.g. task heads) instead of refusing the input."""
    shape_mismatch: str = flag("error", "a tensor whose shape differs from the base's: fail, or merge the base's rows",
                               choices=SHAPE_POLICIES, inputs=True)
    """``error``, or ``base-slice``: merge the rows the base has (a resized vocabulary)."""
    token: Token = field(default=None, repr=False, compare=False)
    """Hub token (default: ``HF_TOKEN`` or the stored login). Never printed, never stored."""
    quiet: bool = flag(False, "no progress bars", also=("-q",))
    """No progress bars."""
    prefetch: bool | None = field(default=None, compare=False)
    """Read the next block's bytes while the current one is merged (None: ``HUBSOUP_PREFETCH``, default on).
    Not hashed: it never changes the result."""
    progress: Progress | None = field(default=None, repr=False, compare=False)
    """``progress(done, stage, message)`` for apps (see :mod:`hubsoup.progress`); given, nothing is printed.
    Not hashed: it never changes the result."""
    cancel: Cancel | None = field(default=None, repr=False, compare=False)
    """A ``threading.Event`` or a callable returning True to stop the run (:class:`~hubsoup.errors.MergeCancelled`).
    Not hashed."""
    hub_only: bool = flag(
        False, "accept Hub repo IDs only (models, base, tokenizer source, data): refuse every local path (for "
               "servers; see SECURITY.md)", compare=False)
    """Accept Hub repo IDs only: every model, base, tokenizer source, soup, exemplar and eval dataset named by
    the caller (or a config) must be one; a local path is refused by its text, before the disk is looked at
    (for servers: SECURITY.md; :mod:`hubsoup.sources.access`)."""
    cache_dir: str | None = field(default=None, repr=False, compare=False)
    """The run's own Hub cache (default: huggingface_hub's); a server gives each run its own and removes it after."""
    max_download: str | int | None = flag(
        None, "download at most SIZE in this run (e.g. 20GB), checked from the Hub's file sizes before "
              "downloading", metavar="SIZE", compare=False)
    """At most this much downloaded by the run (``"20GB"`` or bytes), checked from the Hub's file sizes before
    each download."""
    allow_private_inputs: bool = flag(
        False, "allow pushing a merge of private or gated inputs to a public repo (the card says so)", compare=False)
    """Let a merge of private or gated Hub inputs be pushed to a public repo (its card then says so)."""
    cache_inputs: bool = flag(
        False, "download Hub inputs' weight files into the Hub cache and read them there (default: read only the "
               "tensors the merge needs, with range requests, never storing them)", compare=False)
    """Download Hub inputs' weight files into the Hub cache (``snapshot_download``) and read them there. Default
    (False): the tensors the merge needs are read from the Hub with range requests at the pinned commit, held in
    memory only (:mod:`hubsoup.sources.remote`); whatever the cache already holds at that commit is read there."""
    read_ahead: str | int = flag(
        "256MiB", "Hub inputs: bytes fetched ahead of the merge, in memory (default 256MiB)", metavar="SIZE",
        compare=False)
    """Hub inputs read in place: at most this many bytes fetched ahead of the tensor being merged, per stream
    (``"256MiB"`` or bytes). Never changes a result."""
    max_disk: str | int | None = flag(
        None, "refuse the run, before any weight is downloaded, unless its peak local disk (output, Hub cache, "
              "temporary files) stays under SIZE", metavar="SIZE", compare=False)
    """The most local disk the run may use at its peak (``"20GB"`` or bytes): the output (all of it, or the shards
    in flight when they stream to the Hub), the Hub cache it fills and its temporary files. Checked from the plan
    before any weight is downloaded (:mod:`hubsoup.footprint`)."""
    allow_task_code: bool = flag(
        False, "with --hub-only: let an lm-eval task_dir fetched from the Hub run its Python (!function, .py "
               "files; it runs code!)", compare=False)
    """In a ``hub_only`` run, an lm-eval ``task_dir`` is a Hub repo fetched into a fresh folder, and its Python
    (``!function`` tags, ``.py`` files) is refused unless the operator sets this (SECURITY.md)."""

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise ParameterError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.shape_mismatch not in SHAPE_POLICIES:
            raise ParameterError(f"shape_mismatch must be one of {', '.join(SHAPE_POLICIES)}, "
                                 f"got {self.shape_mismatch!r}")
        self.shard_bytes  # noqa: B018 - parse now: a bad size fails before any work
        self.max_download_bytes  # noqa: B018
        self.read_ahead_bytes  # noqa: B018
        self.max_disk_bytes  # noqa: B018
        if self.hub_only and isinstance(self.device_map, str) and not self.device_map.strip().startswith("{"):
            if self.device_map.strip() not in STRATEGIES:  # a JSON file: a path, never looked at in hub_only
                raise ParameterError(f"device_map: with hub_only, one of {', '.join(STRATEGIES)} or a JSON map "
                                     "(not a file)")
        if self.progress is not None or self.cancel is not None:
            self.monitor()  # refuses a progress that is not callable, a cancel that is neither Event nor callable
        parse_device_map(self.device_map)
        parse_max_memory(self.max_memory)

    @property
    def silent(self) -> bool:
        """No progress bars and no prints: ``quiet``, or a ``progress`` callback takes their place."""
        return self.quiet or self.progress is not None

    def watched(self, progress: Progress | None = None, cancel: Cancel | None = None) -> "MergeOptions":
        """These options with ``progress`` and ``cancel`` set when given (a run's own keywords), made quiet when a
        ``progress`` callback reports: it replaces every bar and print."""
        opts = self
        if progress is not None or cancel is not None:
            opts = opts.replace(**{k: v for k, v in (("progress", progress), ("cancel", cancel)) if v is not None})
        if opts.progress is not None and not opts.quiet:
            opts = opts.replace(quiet=True)
        return opts

    def monitor(self) -> Monitor:
        """A new :class:`hubsoup.progress.Monitor` for one run with these options' ``progress`` and ``cancel``."""
        return Monitor(self.progress, self.cancel)

    @property
    def out_dtype(self) -> "torch.dtype | None":
        import torch  # lazy: keeps hubsoup --help free of torch

        return getattr(torch, DTYPE_NAMES[self.dtype]) if self.dtype else None

    @property
    def shard_bytes(self) -> int:
        try:
            return parse_size(self.shard_size)
        except ParameterError as e:
            raise ParameterError(f"--shard-size (shard_size): {e}") from None

    @property
    def max_download_bytes(self) -> int | None:
        if self.max_download is None:
            return None
        try:
            return parse_size(self.max_download)
        except ParameterError as e:
            raise ParameterError(f"--max-download (max_download): {e}") from None

    @property
    def read_ahead_bytes(self) -> int:
        try:
            return parse_size(self.read_ahead)
        except ParameterError as e:
            raise ParameterError(f"--read-ahead (read_ahead): {e}") from None

    @property
    def max_disk_bytes(self) -> int | None:
        if self.max_disk is None:
            return None
        try:
            return parse_size(self.max_disk)
        except ParameterError as e:
            raise ParameterError(f"--max-disk (max_disk): {e}") from None

    @property
    def hashed(self) -> dict[str, Any]:
        """The options that change what is merged (recorded in the recipe's hash when not default)."""
        if self.shape_mismatch == "error" and not self.ignore_extra:
            return {}
        return {"shape_mismatch": self.shape_mismatch, "ignore_extra": self.ignore_extra}

    def replace(self, **changes: Any) -> "MergeOptions":
        return dataclasses.replace(self, **changes)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def split(cls, kwargs: dict[str, Any], base: "MergeOptions | None" = None
              ) -> tuple["MergeOptions", dict[str, Any]]:
        """(options, the rest): keyword arguments that name an option become options."""
        names = cls.names()
        given = {k: v for k, v in kwargs.items() if k in names}
        rest = {k: v for k, v in kwargs.items() if k not in names}
        opts = (base or cls()).replace(**given) if given else (base or cls())
        return opts, rest

    @classmethod
    def check_not_misspelt(cls, keys: Iterable[str], declared: Container[str]) -> None:
        """Refuse a key that no method declares and that looks like an option name (``overwite``)."""
        for k in keys:
            if k in declared:
                continue
            close = difflib.get_close_matches(k, cls.names() + ("output_format", "rank", "energy", "evaluate",
                                                                 "eval_limit", "params", "base", "out"), n=1)
            if close:
                raise ParameterError(f"unknown option '{k}' (did you mean '{close[0]}'?)")
