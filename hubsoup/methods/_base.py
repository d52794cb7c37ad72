"""The method interface the engine calls, and the registry it finds methods in.

A method is tensor math only: it never opens a file. The engine streams the model
and, for every mergeable tensor, calls :meth:`Method.merge` with the base tensor and
the inputs' task vectors stacked into one float32 tensor of shape ``(N, *shape)`` on
the block's device; the method returns the merged task vector. The method owns the
stack and may overwrite it in place: that is what keeps peak memory near
(N + 2) tensors. Methods that need whole-model statistics first (global
thresholds, norms) return :class:`StatsPass` objects from :meth:`Method.passes`;
the engine streams the model once per pass before merging, so no method ever holds
a whole model.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import logging
import math
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Generic, Hashable, Mapping, MutableMapping, Sequence, TypeVar

import torch

from hubsoup.errors import MethodError
from hubsoup.hubclient import Token
from hubsoup.methods._kept import KeptTensors
from hubsoup.methods._params import parse_params, to_dict
from hubsoup.plan import BlockInfo

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11 on; hubsoup supports 3.10

log = logging.getLogger(__name__)

P = TypeVar("P")
"""A method's parameter dataclass (its ``Params``): ``class Ties(Method[TiesParams])`` types every hook's ``params``."""


@dataclass
class TensorContext:
    """What a method may know about the tensor it is merging."""

    name: str
    block: BlockInfo | None
    """The transformer block holding the tensor (None: embeddings, final norm, head)."""
    n_inputs: int
    stats: MutableMapping[str, Any] = field(default_factory=dict)
    """Results of the method's statistics passes."""
    recipe_hash: str = ""
    offset: int = 0
    """Where the entries seen start in the flattened tensor: 0 for the whole tensor, a piece's start when
    merged in pieces (:meth:`Method.tensor_passes`)."""
    dtype: torch.dtype | None = None
    """The base tensor's stored dtype (None where unknown)."""
    adapters: bool = False
    """Every input is a LoRA adapter (low-rank task vectors): a default measured apart for them may differ."""

    def generator(self, salt: str = "", device: str | torch.device = "cpu") -> torch.Generator:
        """A random generator seeded from the recipe and the tensor name: reruns repeat exactly."""
        g = torch.Generator(device=device)
        g.manual_seed(self.seed(salt))
        return g

    def seed(self, salt: str = "") -> int:
        """A 63-bit seed from the recipe, the tensor name and ``salt`` (what :meth:`generator` is seeded with;
        the key of :func:`hubsoup.methods._sparsify.counter_uniform`'s device-independent draws)."""
        digest = hashlib.sha256(f"{self.recipe_hash}|{self.name}|{salt}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class StatsPass:
    """One streaming pass over every mergeable tensor before the merge.

    ``update`` sees each tensor once (its base and task vectors); ``finish`` stores
    what it learned in ``stats``, which later passes and the merge read.
    """

    piecewise: bool = False
    """``update`` may see a tensor as several pieces of its flattened entries (the ``(N, k)`` stack over
    each) and learns the same (e.g. histograms): the engine then streams full fine-tunes in pieces."""

    def update(self, ctx: TensorContext, base: torch.Tensor, deltas: torch.Tensor) -> None:
        """See one tensor: ``deltas`` is the (N, *shape) stack; read it, never modify it."""
        raise NotImplementedError

    def finish(self, stats: MutableMapping[str, Any]) -> None:
        raise NotImplementedError

    def fork(self) -> "Self | None":
        """An empty pass of the same kind that another thread feeds other pieces of the same tensors
        (the engine sweeps pieces in lanes, :mod:`hubsoup.engine.lanes`), put back by :meth:`join`
        before :meth:`finish` (or, learned during the merge, before :meth:`finish` too: begun on the
        lane's own ``stats``). None (the default): one thread feeds this pass every piece."""
        return None

    def join(self, other: "Self") -> None:
        """Add what ``other``, a fork of this pass (:meth:`fork`), has learned."""
        raise NotImplementedError

    # A per-tensor pass (Method.tensor_passes) may instead be learned by the merge sweep itself, when its
    # statistic changes the merge of a few entries only (TIES' majority sign: entries whose trimmed task
    # vectors sum to 0): one sweep over the pieces instead of two.
    during_merge: bool = False
    """True: no sweep of its own. The engine calls :meth:`begin` (a provisional value into ``stats``),
    merges every piece (the method reports to the pass through ``stats``), asks :meth:`piece_done`
    after each piece, calls :meth:`finish`, and merges again the pieces that used the provisional value
    when :meth:`confirmed` is False."""

    def begin(self, stats: MutableMapping[str, Any]) -> None:
        raise NotImplementedError

    def piece_done(self) -> bool:
        """Whether the piece just merged depends on the provisional value."""
        raise NotImplementedError

    def confirmed(self, stats: MutableMapping[str, Any]) -> bool:
        """After :meth:`finish`: whether the provisional value was the final one."""
        raise NotImplementedError


@dataclass
class InputInfo:
    """What a method may know about an input model: how it is named."""

    label: str
    spec: str = ""
    """The input as the user gave it."""
    repo_id: str | None = None
    path: str | None = None
    """A local folder (None for a Hub input)."""


@dataclass
class PrepareContext:
    """What :meth:`Method.prepare` gets: the base's files, the inputs' names, and the experts' weights.

    Methods stay free of I/O on the checkpoints: ``load_expert(i, assign)`` streams input
    ``i``'s weights θ₀ + τᵢ through the engine, calling ``assign(name, tensor)`` for every
    floating-point tensor of the base (tied names included), one block in memory at a time.
    """

    base_folder: str
    """The base model's local folder (config, tokenizer): for methods that must run the model."""
    base_label: str
    inputs: Sequence[InputInfo]
    device: str
    names: dict[str, str]
    """Every floating-point tensor name of the base (tied names included) → the name the merge uses."""
    load_expert: Callable[[int, Callable[[str, torch.Tensor], None]], None]
    quiet: bool = False
    device_map: Any = None
    """The merge's ``device_map`` and ``max_memory`` as given: a method that runs the model (LOT) runs each
    expert with accelerate's big-model inference when either is set (:mod:`hubsoup.exemplars.dispatch`)."""
    max_memory: Any = None
    scratch: str | None = None
    """A folder for large temporary files (offloaded weights) inside the output's temporary folder; None: the system's."""
    token: Token = field(default=None, repr=False)
    """The run's Hub token (``MergeOptions.token``), for data a method reads from the Hub (LOT's exemplars). Never
    shown."""

    shared: bool = False
    """True inside a search (:mod:`hubsoup.engine.shared`): later merges that differ only in parameters the
    method's :meth:`Method.stats_key` leaves out get what this preparation returns, so per-tensor work those
    parameters do not change is worth keeping (:meth:`keep_tensors`)."""

    def keep_tensors(self, label: str) -> KeptTensors:
        """A store for per-tensor intermediates the statistics pass computes and the merge needs again
        (``put(name, tensor)``, ``get(name, device)``, ``close()``; on disk in :attr:`scratch`): return it
        from :meth:`Method.prepare` in the statistics; :meth:`Method.finish` closes it."""
        return KeptTensors(self.scratch, label)


class Method(Generic[P]):
    """Base class of merge methods. Subclasses set the class attributes and ``merge``; every hook has a default.

    Generic over the parameter dataclass: ``class Median(Method[MedianParams])`` gives every hook its own typed
    ``params`` (a bare ``Method`` subclass is ``Method[Any]``). A method that needs only ``merge`` may be one
    decorated function instead (:func:`hubsoup.methods.method`).

    Hooks (all optional but ``merge``): :meth:`parse`/:meth:`describe_params`/:meth:`check_inputs`
    (parameters and inputs), :meth:`prepare` and :meth:`passes` (whole-model work before
    merging), :meth:`linear_coefficients` and :meth:`merge_factors` (low-rank fast paths),
    :meth:`card_notes` (text for the model card); class attributes :attr:`search_grid`
    (the paper's hyper-parameter grids) and :attr:`scale_param` (the global scale, which
    modifiers such as LiNeS replace).
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    paper: ClassVar[str] = ""
    """Title of the paper it comes from."""
    paper_url: ClassVar[str] = ""
    Params: ClassVar[type]
    min_inputs: ClassVar[int] = 1
    max_inputs: ClassVar[int | None] = None
    zero_preserving: ClassVar[bool] = True
    """All-zero task vectors merge to zero, so a tensor no input changes is the base's (the engine then
    skips it, e.g. the tensors a LoRA does not adapt). Set False if the method can move such a tensor."""
    search_grid: ClassVar[dict[str, list[Any]]] = {}
    """The paper's grid per parameter, used by ``--search KEY`` when no values are given."""
    scale_param: ClassVar[str | None] = None
    """The parameter that scales the whole merged task vector (λ), if any: a modifier that applies
    its own scale (LiNeS) sets it to 1 unless the user gives it."""
    elementwise: ClassVar[bool] = False
    """True: :meth:`merge` works entry by entry and needs no per-tensor statistics, so the engine may merge
    full fine-tunes in cache-sized pieces (:meth:`tensor_passes` is then ``[]``). A linear method is
    element-wise already (:meth:`linear_coefficients`); one with per-tensor statistics declares them in
    :meth:`tensor_passes` instead."""
    needs_base_files: ClassVar[bool] = False
    """:meth:`prepare` builds the base model from its folder (``from_pretrained``: LOT's exemplar capture), so a Hub
    base's weight files are downloaded into the Hub cache rather than read in place (:mod:`hubsoup.sources.remote`)."""
    workspace_copies: ClassVar[float | None] = None
    """Float32 copies of one tensor that :meth:`merge` allocates beyond the stack of task vectors: the
    default :meth:`workspace_bytes` the planner (``hubsoup plan``, the fit check) counts. None (undeclared):
    0 for this package's methods (in-place math, or their own :meth:`workspace_bytes`), one copy of the
    whole stack (as many as there are inputs) for a method defined elsewhere: a guess that errs high."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A subclass that overrides merge() but not linear_coefficients() inherits a claim of linearity
        # about a merge it replaced: drop the claim, so the low-rank path never disagrees with merge().
        if "merge" in vars(cls) and "linear_coefficients" not in vars(cls):
            cls.linear_coefficients = Method.linear_coefficients  # type: ignore[method-assign]
        if "merge" in vars(cls) and "elementwise" not in vars(cls):  # the same for element-wise
            cls.elementwise = False

    def parse(self, given: dict[str, Any]) -> P:
        """Build this method's parameters from user values (CLI strings or Python objects).

        Modifiers that wrap another method override this to split off the inner
        method's parameters.
        """
        return parse_params(self.Params, given, method=self.name)  # type: ignore[no-any-return]

    def describe_params(self, params: P) -> dict[str, Any]:
        """Parameters as plain values, for the recipe and the card."""
        return to_dict(params)

    def check_inputs(self, params: P, n_inputs: int) -> None:
        if n_inputs < self.min_inputs or (self.max_inputs is not None and n_inputs > self.max_inputs):
            want = (f"exactly {self.min_inputs}" if self.min_inputs == self.max_inputs
                    else f"at least {self.min_inputs}" if self.max_inputs is None
                    else f"{self.min_inputs} to {self.max_inputs}")
            raise MethodError(f"method '{self.name}' takes {want} input model(s), got {n_inputs}")
        weights = getattr(params, "weights", None)
        if weights is not None and len(weights) != n_inputs:
            raise MethodError(
                f"method '{self.name}': {len(weights)} weights given for {n_inputs} inputs"
            )
        if dataclasses.is_dataclass(params):  # every per-input tuple (densities, gammas, ...) too
            for f in dataclasses.fields(params):
                v = getattr(params, f.name)
                if f.metadata.get("per_input") and v is not None and len(v) != n_inputs:
                    raise MethodError(f"method '{self.name}': {len(v)} {f.name} given for {n_inputs} inputs")

    def needs_base(self, params: P, n_inputs: int) -> bool:
        """Whether the result depends on a base model beyond the inputs themselves.

        False for methods that combine the models' own weights (a weighted average, SLERP
        between two inputs, Karcher mean): ``hubsoup.merge`` without a base (and no base in the
        inputs' cards) then takes the first input as the layout reference, whose task vector
        is 0, and the method works on the experts θᵢ = θ₀ + τᵢ.
        """
        return True

    def preserves_zero(self, params: P) -> bool:
        """Whether all-zero task vectors merge to zero with these parameters (see :attr:`zero_preserving`).

        The engine leaves a tensor no input changes at the base's value only when this holds;
        override it where a parameter breaks it (``linear`` with ``combine=models`` and no
        normalisation gives Σwᵢ·θ₀, a scaled ``passthrough`` scales the base).
        """
        return self.zero_preserving

    def linear_coefficients(self, params: P, n_inputs: int) -> list[float] | None:
        """The cᵢ when the merged task vector is always Σ cᵢ τᵢ (None: the method is not linear).

        Linear methods let low-rank (LoRA) inputs be merged from their factors without the
        dense stack (see ``hubsoup.engine.lowrank``).
        """
        return None

    def passes(self, params: P, n_inputs: int) -> list[StatsPass]:
        """Statistics passes to run before merging (none by default)."""
        return []

    def tensor_passes(self, params: P, n_inputs: int) -> list[StatsPass] | None:
        """Passes over one tensor that make its merge element-wise, or None (the default for non-linear
        methods): :meth:`merge` then needs the whole tensor.

        With a list, the engine may merge a tensor in pieces of its flattened entries: each pass
        sees every piece (``update(ctx, base_piece, deltas_piece)``, one sweep per pass, so it may
        overwrite ``deltas_piece``) and ``finish`` writes the tensor's statistics into
        ``ctx.stats``; then :meth:`merge` of any piece must equal that piece of the merge of the
        whole tensor. A linear method needs no pass (``[]``); TIES counts its per-tensor threshold
        this way, and learns its majority sign during the merge sweep (``StatsPass.during_merge``).

        Pieces are swept by several threads at once (:mod:`hubsoup.engine.lanes`): :meth:`merge`
        may run on two pieces concurrently, so it must not change shared state (``ctx.stats``
        included); a pass is fed from several threads only through its :meth:`StatsPass.fork`.

        Default: ``[]`` for an :attr:`elementwise` or linear method, else None.
        """
        if self.elementwise:
            return []
        return [] if self.linear_coefficients(params, n_inputs) is not None else None

    def piece_multiple(self, params: P) -> int:
        """Merged in pieces (:meth:`tensor_passes`), a tensor's pieces start at multiples of this many
        entries: SLERP sums its dot products over fixed blocks, DARE draws its masks by blocks."""
        return 1

    def stats_key(self, params: P) -> Hashable:
        """What :meth:`prepare` and :meth:`passes` read of ``params``: merges of the same inputs with equal
        keys share one preparation and one set of statistics passes inside a search
        (:mod:`hubsoup.engine.shared`). Default: every parameter (no sharing between different points)."""
        return repr(params)

    def prepare(self, params: P, ctx: PrepareContext) -> dict[str, Any]:
        """Optional work before any statistics pass; returns entries for ``ctx.stats`` of the merge.

        Methods that must *run* the models (LOT Merging's exemplar features) do it here,
        through :class:`PrepareContext`; everything else leaves it alone. Nothing by default.
        """
        return {}

    def finish(self, params: P, stats: dict[str, Any]) -> None:
        """Release what :meth:`prepare` holds (scratch files), after the merge or on failure. By default the
        stores of :meth:`PrepareContext.keep_tensors` are closed and left out of the statistics; a method
        that overrides this and keeps tensors calls it too."""
        for k in [k for k, v in stats.items() if isinstance(v, KeptTensors)]:
            stats.pop(k).close()

    def merge_factors(self, shape: tuple[int, ...], factors: list[tuple[torch.Tensor, torch.Tensor] | None],
                      params: P, ctx: TensorContext) -> torch.Tensor | None:
        """The merged τ of a 2-D tensor from the inputs' low-rank factors, or None for the dense path.

        ``factors[i]`` is ``(P, Q)`` with τᵢ = P Q (None: τᵢ = 0). Methods with a low-rank
        formulation (SFTM: SVDs of the task matrices) avoid the dense stack with it.
        """
        return None

    def workspace_bytes(self, shape: tuple[int, ...], n_inputs: int, params: P, name: str = "") -> int:
        """Memory the method needs for one tensor beyond the stack of task vectors (SVDs, Grams), for the planner.

        ``name``: the tensor's (a method treating roles differently, e.g. SFTM's matrices, can tell);
        "" when unknown (answer for the worst case). Default: :attr:`workspace_copies` float32 copies of the tensor."""
        copies = self.workspace_copies
        if copies is None:
            copies = 0 if type(self).__module__.startswith("hubsoup.") else n_inputs
        return int(copies * math.prod(shape) * 4)

    def card_notes(self, described: dict[str, Any], stats: dict[str, Any], n_inputs: int) -> list[str]:
        """Markdown paragraphs for the model card (``described``: :meth:`describe_params`'s output)."""
        return []

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: P,
              ctx: TensorContext) -> torch.Tensor:
        """Merged task vector of one tensor (float32, shape of ``base``)."""
        raise NotImplementedError


_REGISTRY: dict[str, type[Method[Any]]] = {}


def register(cls: type[Method[Any]]) -> type[Method[Any]]:
    """Class decorator adding a method to the registry under ``cls.name``."""
    if not dataclasses.is_dataclass(cls.Params):
        raise MethodError(f"{cls.__name__}.Params must be a dataclass")
    have = _REGISTRY.get(cls.name)
    if have is not None and have is not cls and (have.__module__, have.__qualname__) != (cls.__module__, cls.__qualname__):
        raise MethodError(f"method name '{cls.name}' is taken by {have.__module__}.{have.__qualname__}; "
                          f"{cls.__module__}.{cls.__qualname__} needs another name")
    _REGISTRY[cls.name] = cls
    return cls


ENTRY_POINT_GROUP = "hubsoup.methods"
"""Installed packages declare their methods under this entry-point group (``name = "module:Class"``,
``name = "module:function"`` for a function decorated with :func:`hubsoup.methods.method`, or ``name = "module"``): loading the entry point registers them (``@register``, or the class it names)."""

_plugins_loaded = False

_DISTRIBUTIONS: dict[str, dict[str, str]] = {}
"""Method name -> ``{"distribution", "version"}`` of the installed package whose entry point registered it."""


def load_plugins() -> None:
    """Register the methods of installed packages (entry-point group ``hubsoup.methods``), once per process.

    A plug-in that fails to load, or takes a name already registered, is left out with a warning naming its
    entry point: the built-in methods always stay usable. Each method a package registers is recorded with the
    package's name and version (:func:`method_distribution`): recipes name it.
    """
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            before = dict(_REGISTRY)
            obj = ep.load()
            obj = getattr(obj, "__hubsoup_method__", obj)  # a function decorated with methods.method: its class
            if isinstance(obj, type) and issubclass(obj, Method):
                register(obj)
        except Exception as e:  # noqa: BLE001 - someone else's package: say which and go on
            log.warning("method plug-in %r (%s, entry point group %s) not loaded: %s: %s", ep.name, ep.value,
                        ENTRY_POINT_GROUP, type(e).__name__, e)
            continue
        dist = getattr(ep, "dist", None)
        if dist is None or not getattr(dist, "name", None):
            continue
        mine = [n for n, c in _REGISTRY.items() if before.get(n) is not c]  # what loading it registered
        if isinstance(obj, type) and issubclass(obj, Method):
            mine.append(obj.name)  # the class it names, even if imported (and registered) before
        for n in mine:
            _DISTRIBUTIONS[n] = {"distribution": dist.name, "version": dist.version}


def method_distribution(name: str) -> dict[str, str] | None:
    """The installed package a method comes from, ``{"distribution", "version"}``, when an entry point of the group
    ``hubsoup.methods`` registered it; None for a built-in method (or one registered by importing its module).

    Example:
        >>> method_distribution("ties") is None
        True
    """
    load_plugins()
    return dict(_DISTRIBUTIONS[name]) if name in _DISTRIBUTIONS else None


def plugin_distributions(method: str, params: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """The installed packages a merge's methods come from, by method name: ``method`` and, for a modifier (LiNeS,
    LwPTV), each method of its ``base_method`` chain; built-in methods are not listed (what a recipe records).

    Example:
        >>> plugin_distributions("lines", {"base_method": "ties"})
        {}
    """
    names = [method, *(n.strip() for n in str(params.get("base_method") or "").split("+") if n.strip())]
    found = {n: method_distribution(n) for n in dict.fromkeys(names)}
    return {n: d for n, d in found.items() if d is not None}


def check_plugins(plugins: Mapping[str, Any]) -> None:
    """Before a merge is made again from its recipe: every method it records as coming from an installed package
    (:func:`plugin_distributions`) is registered here, else a :class:`MethodError` names the package and version to
    install; one installed at another version is merged with a warning."""
    for name, rec in plugins.items():
        rec = rec if isinstance(rec, Mapping) else {}
        dist, version = str(rec.get("distribution") or "?"), str(rec.get("version") or "")
        pinned = f"{dist}=={version}" if version else dist
        if name not in available():
            raise MethodError(f"method '{name}' comes from the package {dist}" + (f" {version}" if version else "")
                              + f", which is not installed here: pip install '{pinned}', then run it again")
        have = method_distribution(name)
        if have is not None and version and have.get("version") != version:
            log.warning("method '%s': the recipe was made with %s %s, this is %s %s: the merge may differ",
                        name, dist, version, have.get("distribution"), have.get("version"))


def get_method(name: str) -> Method[Any]:
    """The registered method called ``name`` (built in, or from an installed package: :func:`load_plugins`)."""
    load_plugins()
    try:
        return _REGISTRY[name]()
    except KeyError:
        close = difflib.get_close_matches(name, _REGISTRY, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise MethodError(
            f"unknown method '{name}'{hint}; `hubsoup methods` lists them: {', '.join(sorted(_REGISTRY))}"
        ) from None


def available() -> dict[str, type[Method[Any]]]:
    """Every registered method by name, the installed packages' included."""
    load_plugins()
    return dict(sorted(_REGISTRY.items()))
