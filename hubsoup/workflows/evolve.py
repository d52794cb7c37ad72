"""Evolutionary search over merge recipes: ``hubsoup evolve CONFIG.yml --out DIR`` / :func:`evolve`.

The search space is any method parameter as a range or a choice, and per-input × per-layer-group
genes written as mergekit gradients; CMA-ES (told every finished trial, TPE for the choice genes:
:mod:`hubsoup.workflows.proposals`), Optuna's TPE or random sampler propose the points, and Optuna's
storage (an SQLite file in ``DIR`` by default, any database URL for a cluster) holds the study.

* **Generation-synchronous.** A whole population is asked, then evaluated (by an executor: this process,
  or Ray tasks, :mod:`hubsoup.workflows.executors`), each trial told as its result arrives. A trial's
  proposal depends only on the seed, its number and the results told (samplers seeded from
  ``(seed, trial number)``; CMA-ES replayed from the study), so a seed gives the same study whatever runs
  the trials and in whatever order they finish, and a resumed study proposes what an uninterrupted one would.
* **Resumable.** A killed run is run again with the same command: finished trials are read from the
  storage (those of an interrupted generation too), the unfinished ones (asked, never told) are evaluated
  again, nothing else repeats.
* **Cheap trials.** Each process keeps its inputs in memory, one model filled in place by every merge and
  its evaluator (:class:`hubsoup.workflows.trial.TrialSession`).
* **One driver per study.** A second driver on the same storage (any host) is refused at once, naming the
  first one's host and pid; a killed driver's lease is taken over (:mod:`hubsoup.workflows.study_lease`).
* **A failing trial** (a point the method refuses, NaN weights, out of memory) is recorded ``FAIL``
  with its reason; the study goes on.
* **Nothing written per trial.** A trial merges into memory and is scored there (:mod:`hubsoup.workflows.trial`);
  only the best is written, once, at the end: weights, ``hubsoup_recipe.yaml`` (``hubsoup run`` repeats
  it bit for bit), the card (space, optimizer, trials, best parameters and scores, with a link to the
  trial table ``hubsoup_search.json`` and its plot ``hubsoup_search.png``).

Layer groups: ``layer_groups: G`` gives G genes per input (or per parameter), the anchors of a
mergekit gradient over the layers (:mod:`hubsoup.methods._schedule`): group g sits at layer position
g/(G-1) and the layers between two anchors interpolate. (mergekit-evolve's ``layer_granularity``
holds each group's value constant instead; a gradient keeps neighbouring layers close.)

Example:
    >>> res = evolve("evolve.yml", out="./evolved")                          # doctest: +SKIP
    >>> res.best_params, res.best_score                                      # doctest: +SKIP
    ({'density': 0.41, 'weights': [[0.2, 0.7, 0.9], [0.8, 0.3, 0.1]]}, -3.87)
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import jinja2

import hubsoup
from hubsoup.session import parse_method
from hubsoup.card import template_path
from hubsoup.errors import EvolveError, ParameterError
from hubsoup.eval import TaskSpec
from hubsoup.hubclient import check_repo_id, pushed_line, scrub_url_credentials
from hubsoup.methods import get_method
from hubsoup.options import MergeOptions, parse_size
from hubsoup.output.folder import MARKER, OutputLock, holds_cwd, read_marker, write_marker
from hubsoup.output.folder import umask  # the mode every other output file gets
from hubsoup.progress import Monitor
from hubsoup.public import public_value
from hubsoup.untrusted import MAX_YAML_BYTES, label, load_yaml, short
from hubsoup.workflows.executors import make_executor
from hubsoup.workflows.proposals import MIN_POPULATION, propose, trial_sampler
from hubsoup.workflows.study_lease import StudyLease
from hubsoup.workflows.trial import pin_inputs

if TYPE_CHECKING:
    from optuna import Study
    from optuna.distributions import BaseDistribution
    from optuna.samplers import BaseSampler
    from optuna.storages import RDBStorage
    from optuna.trial import FrozenTrial

    from hubsoup.api import MergeResult

OPTIMIZERS = ("cmaes", "tpe", "random")
SEARCH_FILE = "hubsoup_search.json"
PLOT_FILE = "hubsoup_search.png"
STUDY_FILE = "hubsoup_study.db"
_STUDY_FILES = (STUDY_FILE, f"{STUDY_FILE}-journal", f"{STUDY_FILE}-wal", f"{STUDY_FILE}-shm", SEARCH_FILE, PLOT_FILE)
_TOP_KEYS = {"base", "models", "method", "params", "space", "optimizer", "trials", "population", "seed", "eval",
             "dtype", "device", "storage", "study_name", "resources"}
MAX_LAYER_GROUPS = 1024
"""The most layer groups of one space entry (a gradient over the layers: models have at most a few hundred)."""
MAX_GENES = 4096
"""The most genes (Optuna parameters) of a study: inputs x layer groups add up; CMA-ES keeps a genes² matrix."""
MAX_CPUS = 1024
"""The most cores (and torch threads) one trial may ask for."""
MAX_GPUS = 1024
"""The most GPUs one trial may ask Ray for (a fraction is a share of one)."""


@dataclass(frozen=True)
class Dimension:
    """One entry of ``space``: a float/int range or a choice, maybe one gene per input and layer group."""

    key: str
    kind: str  # float | int | choice
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple[Any, ...] = ()
    per_input: bool = False
    layer_groups: int = 1

    @classmethod
    def parse(cls, key: str, raw: Any) -> "Dimension":
        where = f"space.{key}"
        if isinstance(raw, (list, tuple)):
            raw = {"range": list(raw)}
        if not isinstance(raw, dict):
            raise ParameterError(f"{where}: expected [low, high], {{range: [low, high], ...}} or {{choices: [...]}}, "
                                 f"got {short(raw)}")
        unknown = sorted(set(raw) - {"range", "choices", "log", "step", "int", "per", "layer_groups"})
        if unknown:
            raise ParameterError(f"{where}: unknown key '{unknown[0]}' (range, choices, log, step, int, per, "
                                 f"layer_groups)")
        if ("range" in raw) == ("choices" in raw):
            raise ParameterError(f"{where}: give either range: [low, high] or choices: [...]")
        per = raw.get("per")
        if per not in (None, "input"):
            raise ParameterError(f"{where}: per must be 'input', got {short(per)}")
        groups = raw.get("layer_groups", 1)
        if isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= MAX_LAYER_GROUPS:
            raise ParameterError(f"{where}: layer_groups must be an integer from 1 to {MAX_LAYER_GROUPS} (a gradient "
                                 f"over the layers; models have at most a few hundred), got {short(groups)}")
        for flag in ("int", "log"):
            if flag in raw and not isinstance(raw[flag], bool):
                raise ParameterError(f"{where}: {flag} must be true or false, got {short(raw[flag])}")
        if "choices" in raw:
            choices = raw["choices"]
            if not isinstance(choices, list) or not choices:
                raise ParameterError(f"{where}: choices must be a non-empty list")
            if per or groups != 1:
                raise ParameterError(f"{where}: per-input and per-layer genes are numeric ranges, not choices")
            if any(not isinstance(c, (str, int, float, bool)) or c is None for c in choices):
                raise ParameterError(f"{where}: choices must be numbers, strings or booleans")
            return cls(key, "choice", choices=tuple(choices))
        rng = raw["range"]
        if (not isinstance(rng, list) or len(rng) != 2
                or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in rng)):
            raise ParameterError(f"{where}: range must be [low, high] numbers, got {short(rng)}")
        low, high = float(rng[0]), float(rng[1])
        if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
            raise ParameterError(f"{where}: range [{rng[0]}, {rng[1]}] must have finite low < high")
        is_int = bool(raw.get("int", False))
        log = bool(raw.get("log", False))
        if log and low <= 0:
            raise ParameterError(f"{where}: a log range needs low > 0, got {low}")
        step = raw.get("step")
        if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float))
                                 or not math.isfinite(step) or step <= 0):
            raise ParameterError(f"{where}: step must be a positive number, got {short(step)}")
        if step is not None and step > high - low:
            raise ParameterError(f"{where}: step {step} is wider than the range [{rng[0]}, {rng[1]}]")
        if step is not None and log:
            raise ParameterError(f"{where}: a log range takes no step (Optuna samples it continuously)")
        if step is not None and is_int and not float(step).is_integer():
            raise ParameterError(f"{where}: an integer range's step must be an integer, got {step}")
        if is_int and (groups != 1 or per):
            raise ParameterError(f"{where}: integer genes cannot be per input or per layer group")
        return cls(key, "int" if is_int else "float", low, high, log, float(step) if step else None,
                   per_input=per == "input", layer_groups=groups)

    def genes(self, n_inputs: int) -> list[str]:
        """The Optuna parameter names of this entry: ``key``, ``key.i0``, ``key.g1``, ``key.i0.g1``."""
        ins = [f".i{i}" for i in range(n_inputs)] if self.per_input else [""]
        grs = [f".g{g}" for g in range(self.layer_groups)] if self.layer_groups > 1 else [""]
        return [f"{self.key}{i}{g}" for i in ins for g in grs]

    def distribution(self) -> BaseDistribution:
        import optuna.distributions as d  # lazy: optional extra (optuna)

        if self.kind == "choice":
            return d.CategoricalDistribution(list(self.choices))
        assert self.low is not None and self.high is not None  # a range (parse)
        if self.kind == "int":
            return d.IntDistribution(int(self.low), int(self.high), log=self.log, step=int(self.step or 1))
        return d.FloatDistribution(self.low, self.high, log=self.log, step=self.step)

    def value(self, point: dict[str, Any], n_inputs: int) -> Any:
        """The method parameter's value at ``point``: a number/choice, a gradient list, or one per input."""
        def one(prefix: str) -> Any:
            if self.layer_groups == 1:
                return point[prefix]
            return [point[f"{prefix}.g{g}"] for g in range(self.layer_groups)]

        if self.per_input:
            return [one(f"{self.key}.i{i}") for i in range(n_inputs)]
        return one(self.key)

    def describe(self) -> dict[str, Any]:
        if self.kind == "choice":
            return {"choices": list(self.choices)}
        d: dict[str, Any] = {"range": [self.low, self.high]}
        for k, v in (("int", self.kind == "int"), ("log", self.log), ("step", self.step),
                     ("per", "input" if self.per_input else None),
                     ("layer_groups", self.layer_groups if self.layer_groups > 1 else None)):
            if v:
                d[k] = v
        return d


@dataclass
class EvolveConfig:
    """An evolve config (the YAML file's keys; see the module doc and ``examples/evolve.yml``)."""

    models: list[str]
    method: str
    space: dict[str, Dimension]
    tasks: list[str]
    base: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    optimizer: str = "cmaes"
    trials: int = 48
    population: int = 8
    seed: int = 0
    metric: str | None = None
    limit: int | None = None
    batch_size: int = 32
    dtype: str | None = None
    device: str = "cpu"
    storage: str | None = None
    study_name: str | None = None
    resources: dict[str, Any] = field(default_factory=dict)
    """Per trial: ``cpus`` (also its torch threads, wherever it runs: the same scores bit for bit; default 1),
    ``gpus`` (Ray's request; default 0), ``memory`` (bytes for Ray; default: the planner's prediction)."""

    @classmethod
    def load(cls, source: "str | dict[str, Any]") -> "EvolveConfig":
        """From a YAML file or a mapping; a bad key or value is an error naming it."""
        where = "evolve config"
        if isinstance(source, (str, os.PathLike)):
            where = f"evolve config '{source}'"
            if not os.path.isfile(source):
                raise ParameterError(f"{where} not found")

            with open(source, encoding="utf-8") as f:
                loaded = load_yaml(f.read(MAX_YAML_BYTES + 1), where)  # bounded: size, aliases
            source = config_relative(loaded, os.path.dirname(os.path.abspath(source)))
        if not isinstance(source, dict):
            raise ParameterError(f"{where}: expected a mapping (base, models, method, space, ...)")
        d = dict(source)
        unknown = sorted(set(d) - _TOP_KEYS)
        if unknown:
            raise ParameterError(f"{where}: unknown key '{unknown[0]}' (known: {', '.join(sorted(_TOP_KEYS))})")
        models = d.get("models")
        if not isinstance(models, list) or not models or not all(isinstance(m, str) and m for m in models):
            raise ParameterError(f"{where}: 'models' must be a non-empty list of Hub IDs or folders")
        if not isinstance(d.get("method"), str):
            raise ParameterError(f"{where}: 'method' must be a method name (see `hubsoup methods`)")
        space = d.get("space")
        if not isinstance(space, dict) or not space:
            raise ParameterError(f"{where}: 'space' must map method parameters to ranges or choices")
        ev = d.get("eval")
        if not isinstance(ev, dict) or not isinstance(ev.get("tasks"), list) or not ev["tasks"]:
            raise ParameterError(f"{where}: 'eval.tasks' must list at least one task spec")
        bad = sorted(set(ev) - {"tasks", "metric", "limit", "batch_size"})
        if bad:
            raise ParameterError(f"{where}: unknown key 'eval.{bad[0]}' (tasks, metric, limit, batch_size)")
        cfg = cls(models=list(models), method=d["method"], base=d.get("base"),
                  space={str(k): Dimension.parse(str(k), v) for k, v in space.items()},
                  tasks=[str(t) for t in ev["tasks"]], metric=ev.get("metric"), limit=ev.get("limit"),
                  batch_size=ev.get("batch_size", 32), params=dict(d.get("params") or {}),
                  optimizer=d.get("optimizer", "cmaes"), trials=d.get("trials", 48),
                  population=d.get("population", 8), seed=d.get("seed", 0), dtype=d.get("dtype"),
                  device=d.get("device", "cpu"), storage=d.get("storage"), study_name=d.get("study_name"),
                  resources=dict(d.get("resources") or {}))
        cfg.validate(where)
        return cfg

    def validate(self, where: str = "evolve config") -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ParameterError(f"{where}: optimizer must be one of {', '.join(OPTIMIZERS)}, got {short(self.optimizer)}")
        for k in ("trials", "population", "batch_size"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ParameterError(f"{where}: '{k}' must be a positive integer, got {short(v)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ParameterError(f"{where}: 'seed' must be a non-negative integer, got {short(self.seed)}")
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1):
            raise ParameterError(f"{where}: 'eval.limit' must be a positive integer, got {short(self.limit)}")
        clash = sorted(set(self.space) & set(self.params))
        if clash:
            raise ParameterError(f"{where}: '{clash[0]}' is both searched (space) and fixed (params)")
        bad = sorted(set(self.resources) - {"cpus", "gpus", "memory"})
        if bad:
            raise ParameterError(f"{where}: unknown key 'resources.{bad[0]}' (cpus, gpus, memory)")
        check_population(self, where)
        cpus, gpus = self.resources.get("cpus"), self.resources.get("gpus")
        if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, int) or not 1 <= cpus <= MAX_CPUS):
            raise ParameterError(f"{where}: 'resources.cpus' (each trial's cores and torch threads) must be an "
                                 f"integer from 1 to {MAX_CPUS}, got {short(cpus)}")
        if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, (int, float)) or not math.isfinite(gpus)
                                 or not 0 <= gpus <= MAX_GPUS):
            raise ParameterError(f"{where}: 'resources.gpus' (each trial's share of GPUs, for Ray) must be a number "
                                 f"from 0 to {MAX_GPUS}, got {short(gpus)}")
        if self.resources.get("memory") is not None:
            try:
                self.resources = {**self.resources, "memory": parse_size(self.resources["memory"])}
            except ParameterError:
                raise ParameterError(f"{where}: 'resources.memory' must be a size (bytes, or e.g. 8GB), got "
                                     f"{short(self.resources['memory'])}") from None
        n = len(self.models)
        genes = sum(len(d.genes(n)) for d in self.space.values())
        if genes > MAX_GENES:
            raise ParameterError(f"{where}: the space has {genes} genes ({n} inputs; per-input and layer_groups "
                                 f"multiply); at most {MAX_GENES} are searched (CMA-ES keeps a genes x genes matrix)")

    @property
    def cpus(self) -> int:
        return int(self.resources.get("cpus") or 1)

    def distributions(self) -> dict[str, Any]:
        out = {}
        for dim in self.space.values():
            for g in dim.genes(len(self.models)):
                out[g] = dim.distribution()
        return out

    def method_params(self, point: dict[str, Any], param_names: dict[str, str]) -> dict[str, Any]:
        """The merge's parameters at ``point`` (gene name -> value): the fixed ones, then each dimension's."""
        out = dict(self.params)
        for key, dim in self.space.items():
            out[param_names[key]] = dim.value(point, len(self.models))
        return out

    def identity(self) -> dict[str, Any]:
        """What fixes the study's trials (a resumed study must match it): not ``trials``, the storage or executor."""
        return {"base": self.base, "models": self.models, "method": self.method, "params": self.params,
                "space": {k: v.describe() for k, v in self.space.items()}, "optimizer": self.optimizer,
                "population": self.population, "seed": self.seed, "tasks": self.tasks, "metric": self.metric,
                "limit": self.limit, "dtype": self.dtype, "threads": self.cpus}


def config_relative(d: Any, root: str) -> Any:
    """An evolve config file's paths taken relative to the file, as a pipeline's are: ``models`` and ``base``
    folders, a task's local data and ``head=``, an lm-eval ``task_dir=``. A relative path that does not exist
    there is left as written (a Hub ID such as ``org/name``, or a path relative to the working folder)."""
    if not isinstance(d, dict):
        return d

    def local(value: Any) -> Any:
        if not isinstance(value, str) or not value or os.path.isabs(os.path.expanduser(value)):
            return value
        there = os.path.join(root, value)
        return there if os.path.exists(there) else value

    out = dict(d)
    if isinstance(out.get("models"), list):
        out["models"] = [local(m) for m in out["models"]]
    if out.get("base"):
        out["base"] = local(out["base"])
    ev = out.get("eval")
    if isinstance(ev, dict) and isinstance(ev.get("tasks"), list):
        out["eval"] = {**ev, "tasks": [_task_relative(t, local) if isinstance(t, str) else t for t in ev["tasks"]]}
    return out


def _task_relative(spec: str, local: Callable[[Any], Any]) -> str:
    """A task spec with its local paths (DATA, ``head=``, ``task_dir=``) passed through ``local``."""
    kind, sep, rest = spec.partition(":")
    if not sep:
        return spec
    parts = rest.split(",")
    for i, part in enumerate(parts):
        key, eq, value = part.partition("=")
        if eq and key.strip() in ("head", "task_dir"):
            parts[i] = f"{key}={local(value)}"
        elif i == 0 and not eq and kind.strip() != "lm-eval":  # lm-eval's first field is task names
            parts[i] = local(part)
    return f"{kind}:{','.join(parts)}"


"""The smallest CMA-ES population: below it CMA-ES keeps one parent (μ = 1) and its update divides by zero
(``cmaes`` warns "divide by zero" at every generation), at 4 it keeps two."""


def check_population(cfg: "EvolveConfig", where: str = "evolve config") -> None:
    """A population CMA-ES cannot work with is refused, saying what can (a study's population is its identity:
    raising it behind the user's back would make another study than the one written)."""
    if (cfg.optimizer == "cmaes" and cfg.population < MIN_POPULATION
            and any(d.kind != "choice" for d in cfg.space.values())):  # choice genes alone: TPE, no CMA-ES
        raise ParameterError(f"{where}: population {cfg.population} is too small for CMA-ES, which needs at least "
                             f"{MIN_POPULATION} (with fewer it keeps one parent and its update divides by zero);"
                             f" use population: {MIN_POPULATION} or more, or optimizer: tpe or random")


def param_names(cfg: EvolveConfig) -> dict[str, str]:
    """Each space key's method parameter; a per-input key may use mergekit's per-model name (``weight`` ->
    ``weights``, ``density`` -> ``densities``). An unknown name is an error naming the key and the choices."""
    m = get_method(cfg.method)
    fields = {f.name for f in dataclasses.fields(m.Params)}
    out = {}
    for key, dim in cfg.space.items():
        names = [key]
        if dim.per_input:
            names += [key + "s", key[:-1] + "ies" if key.endswith("y") else key + "es"]
        hit = next((n for n in names if n in fields), None)
        if hit is None:
            raise ParameterError(f"space.{key}: method '{m.name}' has no parameter '{key}' "
                                 f"(its parameters: {', '.join(sorted(fields))})")
        out[key] = hit
    return out


def make_sampler(cfg: EvolveConfig, number: int, study: Any = None) -> BaseSampler:
    """The sampler that proposes trial ``number``, seeded from ``(seed, number)``: what it proposes depends only
    on the seed, the number and the finished trials, never on this process' history (resumption, executors).
    ``cmaes`` proposes from the study's finished trials (:mod:`hubsoup.workflows.proposals`): pass ``study``."""
    sampler: BaseSampler = trial_sampler(cfg.optimizer, cfg.distributions(), cfg.population, cfg.seed, number, study)
    return sampler


@dataclass
class EvolveResult:
    """What :func:`evolve` produced: the best trial, the trial table, and the written best model."""

    path: str
    best_number: int
    best_params: dict[str, Any]
    best_score: float
    trials: list[dict[str, Any]]
    result: Any = None
    """The :class:`hubsoup.MergeResult` of the best model written to ``path``."""
    seconds: list[dict[str, Any]] = field(default_factory=list)
    """Per trial evaluated in this run: ``number``, ``open`` (its process' session opened: once per process),
    ``merge``, ``eval``, ``total`` (the trial, where it ran), ``wall`` (from dispatch to result on the driver) and
    ``session`` (``new``: this trial opened its process' session; ``kept``: the inputs are held in memory). Not in
    ``hubsoup_search.json``, which stays the same on every run of the same study."""
    resumed: int = 0
    """Trials that were asked by an earlier, killed run and evaluated again by this one."""
    study_seconds: float = 0.0
    """This run's time from opening the study to its last trial told (asks, trials, tells, table)."""
    write_seconds: float = 0.0
    """Writing the best model (one merge to disk, its evaluation and card) and the plot."""


def _gene_point(trial: FrozenTrial) -> dict[str, Any]:
    return dict(trial.params)


def _check_dir(out: str, cfg: "EvolveConfig") -> None:
    """``out`` is new, empty, or a study folder hubsoup made (its marker says ``evolve``); never a file, a link, the
    working folder, an input's or the base's folder or one that holds it. A file named like a study's
    (``hubsoup_search.json``) makes no folder a study. Nothing is written before."""
    for spec in [*cfg.models, *([cfg.base] if cfg.base else [])]:  # --out must never be (or hold) an input
        for part in dict.fromkeys([spec, *spec.split("+")]):
            local = os.path.expanduser(part)
            if not os.path.isdir(local):
                continue
            real, target = os.path.realpath(local), os.path.realpath(out)
            if real == target or real.startswith(target.rstrip(os.sep) + os.sep):
                raise ParameterError(f"--out '{out}' {'is' if real == target else 'holds'} the model '{spec}'; the "
                                     "study writes its best model there: choose another --out")
    if not os.path.lexists(out):
        return
    if os.path.islink(out) or not os.path.isdir(out):
        raise ParameterError(f"--out '{out}' is {'a link' if os.path.islink(out) else 'a file'}, not a study folder")
    if holds_cwd(out):
        raise ParameterError(f"--out '{out}' is the working folder or holds it; choose an empty or new folder")
    marker = read_marker(out)
    if (marker is not None and marker.get("kind") == "evolve") or not os.listdir(out):
        return  # a study hubsoup made (resumed), or an empty folder (the study starts there)
    raise ParameterError(f"--out '{out}' exists and holds no hubsoup study (no {MARKER} marker of an evolve study "
                         f"hubsoup made; a file named {SEARCH_FILE} is not one); choose an empty or new folder")


def _pin_inputs(cfg: EvolveConfig, opts: MergeOptions, point: dict[str, Any]) -> tuple[list[str], str | None, int]:
    """The inputs and base pinned once on the driver, and the memory a trial needs (:func:`trial.pin_inputs`)."""
    inputs, base, memory, _, _ = pin_inputs(cfg.models, cfg.base, cfg.method, point, opts, cfg.dtype, keep=True)
    return inputs, base, memory


def _storage(cfg: EvolveConfig, out: str) -> RDBStorage:
    import optuna  # lazy: optional extra (optuna)

    url = cfg.storage or f"sqlite:///{os.path.abspath(os.path.join(out, STUDY_FILE))}"
    try:
        return optuna.storages.RDBStorage(url)
    except Exception as e:  # noqa: BLE001 - one line naming the storage
        # the database driver's message may quote the URL (or the part with the password): scrubbed too
        raise EvolveError(f"cannot open the study storage {_public_url(url)}: "
                          f"{scrub_url_credentials(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)}"
                          ) from None


def _public_url(url: str) -> str:
    """A storage URL as messages show it: no user or password (``postgresql://u:p@db/x`` ->
    ``postgresql://***@db/x``, ``?password=p`` -> ``?password=***``); text that is no URL is not shown (it may
    be a password pasted in the wrong place)."""
    if "://" not in url:
        return "(not a database URL: DIALECT://[USER[:PASSWORD]@]HOST[:PORT]/DATABASE)"
    return scrub_url_credentials(url)


def _ask(study: Study, cfg: EvolveConfig, dists: dict[str, Any], names: dict[str, str], number: int) -> None:
    """Add trial ``number`` to the study: CMA-ES's point written at once (one transaction, with the method parameters
    it means), the other samplers' through ``study.ask`` (one write per gene)."""
    import optuna  # lazy: optional extra (optuna)

    if cfg.optimizer != "cmaes":
        study.sampler = make_sampler(cfg, number, study)
        study.ask(dists)
        return
    point = propose(dists, cfg.population, cfg.seed, number, study)
    params = json.loads(json.dumps(cfg.method_params(point, names)))
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING, params=point,
                                              distributions=dists, user_attrs={"params": params}))


def _tell(study: Study, trial: FrozenTrial, r: dict[str, Any]) -> None:
    """Record trial ``r``'s result (metrics, a failure's reason) and tell the study (its timings are this run's:
    in :attr:`EvolveResult.seconds`, not in the study)."""
    import optuna  # lazy: optional extra (optuna)

    sid = trial._trial_id
    if r.get("metrics"):
        study._storage.set_trial_user_attr(sid, "metrics", r["metrics"])
    if r["state"] == "complete":
        study.tell(trial.number, float(r["score"]))
    else:
        study._storage.set_trial_user_attr(sid, "reason", r.get("reason") or "unknown")
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL)


def _trial_row(t: FrozenTrial, n_inputs: int, names: dict[str, str], cfg: EvolveConfig) -> dict[str, Any]:
    ua = t.user_attrs
    row = {"number": t.number, "generation": t.number // cfg.population, "state": t.state.name.lower(),
           "params": ua.get("params") or cfg.method_params(_gene_point(t), names),
           "genes": _gene_point(t), "score": t.value if t.state.name == "COMPLETE" else None}
    if ua.get("metrics"):
        row["metrics"] = ua["metrics"]
    if ua.get("reason"):
        row["reason"] = ua["reason"]
    return row


def evolve(config: "str | dict[str, Any] | EvolveConfig", out: str, *, executor: Any = "local",
           push: str | None = None, private: bool | None = None, progress: Any = None, cancel: Any = None,
           quiet: bool = False, on_generation: Callable[[int, list[dict[str, Any]]], None] | None = None
           ) -> EvolveResult:
    """Run (or resume) an evolutionary merge search and write the best model into ``out``.

    Args:
        config: an evolve YAML file, a mapping of its keys, or an :class:`EvolveConfig`.
        out: the study's folder: its SQLite storage (unless ``storage:`` names a database), the trial table
            ``hubsoup_search.json`` and plot, and at the end the best model (weights, recipe, card).
            Running again with the same folder resumes the study (more ``trials`` extend it).
        executor: ``"local"`` (this process, the default), ``"ray"`` (``RAY_ADDRESS`` or a local cluster),
            ``"ray://HOST:PORT"``, or an executor object (:mod:`hubsoup.workflows.executors`).
        push: upload the best model to this Hub repo (from this process only, once).
        progress, cancel: as for :func:`hubsoup.merge` (stage ``eval`` per trial); a cancel stops between
            trials (the study stays resumable).
        on_generation: called with (generation, its trial rows) after each generation is told.

    Raises:
        hubsoup.errors.ParameterError: a bad config key or value (named), a space key the method lacks.
        EvolveError: every trial failed (the first reason given); the storage holds a different study.
        hubsoup.errors.StudyLockedError: another driver is running the same study (same storage and study
            name, any host): refused at once, naming it (:mod:`hubsoup.workflows.study_lease`); a killed
            driver's lease is taken over (its pid gone on this host, or no heartbeat for 2 minutes).
    """
    cfg = config if isinstance(config, EvolveConfig) else EvolveConfig.load(config)
    monitor = Monitor(progress, cancel)
    quiet = quiet or monitor.reporting
    if push:
        check_repo_id(push)
    names = param_names(cfg)
    tasks = [TaskSpec.parse(t) for t in cfg.tasks]
    for t in tasks:  # missing data fails now, not in every trial
        t.check()
    opts = MergeOptions(quiet=True, device=cfg.device, dtype=cfg.dtype)
    dists = cfg.distributions()
    mid = _check_space(cfg, dists, names)
    lock = _claim_folder(out, cfg)
    exe = lease = None
    try:
        inputs, base, memory = _pin_inputs(cfg, opts, cfg.method_params(mid, names))
        if "memory" not in cfg.resources:  # Ray's memory request: the planner's prediction (+25 % for the eval)
            cfg = copy.copy(cfg)
            cfg.resources = {**cfg.resources, "memory": int(memory * 1.25)}
        import optuna  # lazy: optional extra (optuna)

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage = _storage(cfg, out)
        name = cfg.study_name or "hubsoup-evolve"
        # one driver per study, also across hosts on a shared database (a killed driver's lease is taken over)
        lease = StudyLease(storage.engine, name, _public_url(storage.url))
        lease.acquire()
        study = _open_study(optuna, storage, name, cfg, out)
        exe = make_executor(executor, cfg)
        payload_base = {"inputs": inputs, "base": base, "method": cfg.method, "tasks": cfg.tasks,
                        "metric": cfg.metric, "limit": cfg.limit, "batch_size": cfg.batch_size,
                        "options": {"device": cfg.device, "dtype": cfg.dtype}, "threads": cfg.cpus,
                        "keep": True}  # each process keeps the inputs, one candidate model and the evaluator
        t_study = time.perf_counter()
        seconds, resumed = _run_generations(study, cfg, dists, names, out, len(inputs), payload_base, exe, lease,
                                            monitor, quiet, on_generation)
        table = [_trial_row(t, len(inputs), names, cfg) for t in study.get_trials(deepcopy=False)]
        best = _best(table)
        exe.close()  # what the trials kept (inputs, a model) is freed before the best model is written
        exe = None
        t_write = time.perf_counter()
        study_seconds = t_write - t_study
        summary = _write_table(out, cfg, names, table)
        _plot(out, table)
        monitor.check("before the best model was written")
        if monitor.reporting:
            monitor.child(0.97, 0.99)(0.0, "merge", f"writing the best trial ({best['number']})")
        result = _write_best(out, cfg, inputs, base, best, summary, quiet)
        if push:
            info = result.push_to_hub(push, private=private)
            if not quiet:
                print(pushed_line(push, info))
        if monitor.reporting:
            monitor.finish(f"best trial {best['number']} (score {best['score']:.6g}) -> {out}")
        return EvolveResult(os.path.abspath(out), best["number"], best["params"], best["score"], table, result,
                            seconds, resumed, study_seconds, time.perf_counter() - t_write)
    finally:
        if exe is not None:
            exe.close()
        if lease is not None:
            lease.release()
        lock.release()


def _check_space(cfg: EvolveConfig, dists: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """The space's keys and choices are the method's (a typo'd choice fails now, by name); returns its lower
    corner (a range that reaches past what the method accepts only fails those trials)."""
    mid = {g: (d.choices[0] if hasattr(d, "choices") else d.low) for g, d in dists.items()}
    parse_method(cfg.method, cfg.method_params(mid, names))
    for g, d in dists.items():
        for c in getattr(d, "choices", ())[1:]:
            try:
                parse_method(cfg.method, cfg.method_params({**mid, g: c}, names))
            except ParameterError as e:
                raise ParameterError(f"space.{g}: choice {c!r}: {e}") from None
    return mid


def _claim_folder(out: str, cfg: EvolveConfig) -> OutputLock:
    """``out`` checked (:func:`_check_dir`), made, locked for this driver and marked as a study hubsoup made."""
    _check_dir(out, cfg)
    os.makedirs(out, exist_ok=True)
    lock = OutputLock(out, "evolve study")
    lock.acquire()
    if read_marker(out) is None:  # a new (or empty) folder: the study's, made by hubsoup from now on
        try:
            write_marker(out, "evolve", best=[])
        except BaseException:
            lock.release()
            raise
    return lock


def _open_study(optuna: Any, storage: Any, name: str, cfg: EvolveConfig, out: str) -> Any:
    """The study ``name`` in ``storage`` (made, or resumed when it was started with the same config)."""
    study = optuna.create_study(storage=storage, study_name=name, direction="maximize", load_if_exists=True)
    ident = json.loads(json.dumps(cfg.identity(), default=str))
    held = study.user_attrs.get("hubsoup_config")
    if held is None:
        study.set_user_attr("hubsoup_config", ident)
    elif held != ident:
        diff = next(k for k in ident if held.get(k) != ident.get(k))
        raise EvolveError(f"the study '{name}' in {out} was started with another '{diff}' "
                          f"({held.get(diff)!r}, now {ident.get(diff)!r}); use a new --out or study_name")
    return study


def _run_generations(study: Any, cfg: EvolveConfig, dists: dict[str, Any], names: dict[str, str], out: str,
                     n_inputs: int, payload_base: dict[str, Any], exe: Any, lease: StudyLease, monitor: Monitor,
                     quiet: bool, on_generation: Callable[[int, list[dict[str, Any]]], None] | None
                     ) -> tuple[list[dict[str, Any]], int]:
    """Generation after generation until the study holds ``cfg.trials`` told trials (a killed run's generation
    finished first), the trial table written after each; returns the trials' timings and how many a killed run
    had asked."""
    seconds: list[dict[str, Any]] = []
    resumed = 0
    while True:
        monitor.check("between generations (the study is saved; run again to resume)")
        lease.check()
        gen, again = _next_generation(study, cfg)
        if gen is None:
            return seconds, resumed
        resumed += again
        batch = _ask_generation(study, cfg, dists, names, gen)
        if not quiet:
            print(f"generation {gen}: trials {batch[0].number}-{batch[-1].number} of {cfg.trials}")
        seconds += _evaluate_generation(study, cfg, batch, payload_base, names, exe, monitor, quiet)
        table = [_trial_row(t, n_inputs, names, cfg) for t in study.get_trials(deepcopy=False)
                 if t.state.is_finished()]
        _write_table(out, cfg, names, table)
        if on_generation is not None:
            on_generation(gen, [row for row in table if row["number"] in {t.number for t in batch}])


def _next_generation(study: Any, cfg: EvolveConfig) -> tuple[int | None, int]:
    """``(the generation to run, trials of it a killed run asked and this one evaluates again)``; None: done."""
    trials = study.get_trials(deepcopy=False)
    open_ = [t for t in trials if not t.state.is_finished()]
    if open_:  # a killed run's generation: finish asking it, then evaluate what was never told
        return min(t.number for t in open_) // cfg.population, len(open_)
    if len(trials) >= cfg.trials:
        return None, 0
    return len(trials) // cfg.population, 0


def _ask_generation(study: Any, cfg: EvolveConfig, dists: dict[str, Any], names: dict[str, str],
                    gen: int) -> list[Any]:
    """Every trial of generation ``gen`` asked (those a killed run asked are kept); returns those not told yet,
    each with the method parameters it means recorded."""
    end = min((gen + 1) * cfg.population, cfg.trials)
    while (n := len(study.get_trials(deepcopy=False))) < end:
        _ask(study, cfg, dists, names, n)
    batch = sorted((t for t in study.get_trials(deepcopy=False) if not t.state.is_finished()),
                   key=lambda t: t.number)
    for t in batch:
        if "params" not in t.user_attrs:
            params = cfg.method_params(_gene_point(t), names)
            study._storage.set_trial_user_attr(t._trial_id, "params", json.loads(json.dumps(params)))
    return batch


def _evaluate_generation(study: Any, cfg: EvolveConfig, batch: list[Any], payload_base: dict[str, Any],
                         names: dict[str, str], exe: Any, monitor: Monitor, quiet: bool) -> list[dict[str, Any]]:
    """The trials of ``batch`` run by the executor, each told as its result arrives; returns their timings."""
    payloads = [{**payload_base, "number": t.number, "params": cfg.method_params(_gene_point(t), names)}
                for t in batch]
    total = cfg.trials
    finished = sum(t.state.is_finished() for t in study.get_trials(deepcopy=False))
    pending = {t.number: t for t in batch}

    def on_result(r: dict[str, Any]) -> None:
        # told as it arrives: a run killed later keeps it (a resumed run evaluates only what never finished)
        t = pending.pop(r["number"], None)
        if t is None:
            return
        _tell(study, t, r)
        done = finished + len(batch) - len(pending)
        msg = (f"trial {r['number']}: " + (f"score {r['score']:.6g}" if r["state"] == "complete"
                                              else f"failed ({r.get('reason', '')[:120]})"))
        if monitor.reporting:
            monitor.child(0.0, 0.97)(min(done / total, 1.0), "eval", msg)
        if not quiet:
            print("  " + msg)

    results = exe.run(payloads, on_result=on_result, monitor=monitor)
    seconds = []
    for t, r in zip(batch, results):  # an executor that did not report a result as it arrived
        if t.number in pending:
            on_result(r)
        seconds.append({"number": t.number, **(r.get("seconds") or {}), "wall": r.get("wall"),
                        "session": r.get("session")})
    return seconds


def _best(table: list[dict[str, Any]]) -> dict[str, Any]:
    """The best complete trial (a tie: the earlier one); every trial failed: :class:`EvolveError`."""
    done = [r for r in table if r["state"] == "complete"]
    if not done:
        reasons = [r.get("reason") for r in table if r.get("reason")]
        raise EvolveError(f"every trial of the study failed; the first: {reasons[0] if reasons else 'unknown'}")
    return max(done, key=lambda r: (r["score"], -r["number"]))  # a tie: the earlier trial


def _is_name(name: str) -> bool:
    try:
        label(name, "file")
    except ParameterError:
        return False
    return True


def public_task(spec: str) -> str:
    """A task spec as it may be published: a local data file, task folder or head by name and content hash.

    >>> public_task("lm-eval:arc_easy,num_fewshot=0")
    'lm-eval:arc_easy,num_fewshot=0'
    """
    kind, sep, rest = spec.partition(":")
    if not sep:
        return spec
    return kind + ":" + ",".join(public_value(p) for p in rest.split(","))


def _selection(cfg: EvolveConfig) -> str:
    if cfg.metric:
        return f"{cfg.metric} (maximised; a lower-is-better metric negated)"
    return "the mean over tasks of each task's score (accuracy; -log(perplexity); an lm-eval task's main metric)"


def _write_table(out: str, cfg: EvolveConfig, names: dict[str, str], table: list[dict[str, Any]]) -> dict[str, Any]:
    """``hubsoup_search.json``: the config, the best trial and every finished trial (no timings: it is the same
    file for the same study whoever ran it). Written to a temporary file and renamed."""
    done = [r for r in table if r["state"] == "complete"]
    best = max(done, key=lambda r: (r["score"], -r["number"])) if done else None
    data = {"method": cfg.method, "optimizer": cfg.optimizer, "seed": cfg.seed, "population": cfg.population,
            "trials_planned": cfg.trials, "space": {k: v.describe() for k, v in cfg.space.items()},
            "parameters": names, "fixed": public_value(cfg.params), "tasks": [public_task(t) for t in cfg.tasks],
            "selection": _selection(cfg),
            "best": {k: best[k] for k in ("number", "params", "score", "metrics") if k in best} if best else None,
            "trials": [r for r in table if r["state"] in ("complete", "fail")]}
    fd, tmp = tempfile.mkstemp(prefix=f".{SEARCH_FILE}.", dir=out)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, default=str)
    os.chmod(tmp, 0o666 & ~umask())  # mkstemp's 0600 would make it the only private file of the folder
    os.replace(tmp, os.path.join(out, SEARCH_FILE))
    return data


def _plot(out: str, table: list[dict[str, Any]]) -> None:
    """``hubsoup_search.png``: each trial's score (failed trials marked on the axis) and the best so far."""
    import matplotlib  # lazy: optional extra (matplotlib)
    import matplotlib.ticker  # lazy: optional extra (matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: optional extra (matplotlib)

    rows = sorted(table, key=lambda r: r["number"])
    ok = [r for r in rows if r["state"] == "complete"]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    ax.scatter([r["number"] for r in ok], [r["score"] for r in ok], s=14, label="trial score", zorder=3)
    best, xs, ys = -math.inf, [], []
    for r in rows:
        if r["state"] == "complete":
            best = max(best, r["score"])
        if best > -math.inf:
            xs.append(r["number"])
            ys.append(best)
    ax.step(xs, ys, where="post", color="C1", label="best so far")
    failed = [r["number"] for r in rows if r["state"] == "fail"]
    if failed and ok:
        ax.scatter(failed, [min(r["score"] for r in ok)] * len(failed), marker="x", color="C3", label="failed")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("trial")
    ax.set_ylabel("score (higher is better)")
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    tmp = os.path.join(out, f".{PLOT_FILE}.tmp.png")
    fig.savefig(tmp, metadata={"Software": None})  # no version stamp: the same study, the same bytes
    plt.close(fig)
    os.replace(tmp, os.path.join(out, PLOT_FILE))


def _card_in_place(res: MergeResult, out: str) -> MergeResult:
    """The best model's card, rendered where the model now is: titled (and its model-index named) by ``out``'s
    name, its "How to use" loading ``out``; a push then retitles it by the repo and loads the repo ID. Never the
    temporary folder the merge was written to (``.hubsoup-best-XXXX/model``)."""
    res.path = os.path.abspath(out)
    res.card_text = None
    res.write_card(res.path)
    return res


def _write_best(out: str, cfg: EvolveConfig, inputs: list[str], base: str | None, best: dict[str, Any],
                summary: dict[str, Any], quiet: bool) -> MergeResult:
    """Merge the best trial once into a temporary folder inside ``out`` (with evaluation and card), then move its
    files into ``out``, replacing an earlier best model's; the study's own files stay."""
    tmp = tempfile.mkdtemp(prefix=".hubsoup-best-", dir=out)
    try:
        model_dir = os.path.join(tmp, "model")
        res = hubsoup.merge(inputs, cfg.method, base=base, out=model_dir, params=best["params"], dtype=cfg.dtype,
                            device=cfg.device, evaluate=cfg.tasks, eval_limit=cfg.limit, quiet=True)

        with open(template_path("evolve.md"), encoding="utf-8") as f:
            body = jinja2.Template(f.read()).render(s=summary, trials=len(summary["trials"]),
                                                    failed=sum(r["state"] == "fail" for r in summary["trials"]),
                                                    search_file=SEARCH_FILE, plot_file=PLOT_FILE)
        res.sections.append({"title": "Evolutionary search", "body": body.strip()})
        new = sorted(n for n in os.listdir(model_dir) if n != MARKER)
        for name in new:  # a file of the study's own, or one the user put there, is never replaced
            there = os.path.join(out, name)
            if name in _STUDY_FILES or (os.path.lexists(there) and (os.path.isdir(there) or os.path.islink(there))):
                raise EvolveError(f"the best model's file '{name}' would replace '{there}', which is not a file "
                                  "the study wrote; move it away and run again (the study is saved)")
        marker = read_marker(out) or {}
        # the previous best model's files (a study extended with more trials): only those the marker lists
        old = [f for f in marker.get("best") or [] if isinstance(f, str) and _is_name(f) and f not in _STUDY_FILES
               and f != MARKER]
        for stale in old:
            path = os.path.join(out, stale)
            if stale not in new and os.path.isfile(path) and not os.path.islink(path):
                os.remove(path)
        for name in new:
            os.replace(os.path.join(model_dir, name), os.path.join(out, name))
        write_marker(out, "evolve", best=new)
        return _card_in_place(res, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["evolve", "EvolveConfig", "EvolveResult", "Dimension", "make_sampler", "param_names"]
