"""How an evolve study proposes its trials: CMA-ES told every finished trial, TPE for the choice genes.

``optimizer: cmaes`` drives :class:`cmaes.CMA` directly (Optuna's ``CmaEsSampler`` sees no completed trial
while a generation is asked at once: its first generation is uniform random and CMA then starts from
scratch without it). The numeric genes are CMA-ES's, in the space normalised to ``[0, 1]`` per gene (a
``log`` range in log space; an integer gene over its values widened by half a step): the mean starts at
the space's centre, the step size at :data:`SIGMA0` of each range. Generation ``g`` is CMA-ES's
population ``g``: trial ``g·P + k`` is its ``k``-th point, and every finished trial of every earlier
generation is told (a failed trial ranks below every completed one of its generation; a generation with
no completed trial teaches nothing and is not told). Choice genes (which CMA-ES cannot sample) come from
Optuna's TPE, sampling each choice on its own from the finished trials (random for the first population).

The optimiser's state is never stored: it is replayed from the study's trials (each generation's points
drawn with a seed from ``(seed, generation)``), so a proposal depends only on the seed and the results
told, whatever ran the trials, in whatever order they finished, and after any number of resumptions.
(Replayed on another machine type, rounding in the covariance's eigendecomposition may differ in the
last bits.)

CMA-ES needs a population of at least :data:`MIN_POPULATION` (``cmaes`` divides by zero in its weights
below that): a smaller one is refused when the config is read.

Example:
    >>> import optuna                                                            # doctest: +SKIP
    >>> sampler = trial_sampler(cfg, dists, study, number=5)                      # doctest: +SKIP
    >>> study.sampler = sampler; study.ask(dists)                                 # doctest: +SKIP
"""

from __future__ import annotations

import collections
import datetime
import functools
import math
from typing import Any, Sequence

import numpy as np

MIN_POPULATION = 4
"""The smallest CMA-ES population: ``cmaes`` 0.10-0.13 divide by zero computing their weights below 4."""
SIGMA0 = 1 / 6
"""CMA-ES's initial step size, as a fraction of each gene's range (three steps from the centre to an edge)."""


def _seed(*keys: int) -> int:
    return int(np.random.SeedSequence(list(keys)).generate_state(1)[0] % (2**31 - 1))


def _numeric(dists: dict[str, Any]) -> list[str]:
    """The genes CMA-ES samples: every float and int range (in the distributions' order)."""
    import optuna.distributions as d  # lazy: optional extra (optuna)

    return [g for g, dist in dists.items() if isinstance(dist, (d.FloatDistribution, d.IntDistribution))]


def decode(dist: Any, u: float) -> float | int:
    """A gene's value at ``u`` in ``[0, 1]`` of its normalised range (see the module doc).

    >>> import optuna.distributions as d
    >>> decode(d.FloatDistribution(0.0, 2.0), 0.25), round(decode(d.FloatDistribution(1e-3, 1e-1, log=True), 0.5), 12)
    (0.5, 0.01)
    >>> [decode(d.IntDistribution(1, 3), u) for u in (0.0, 0.33, 0.34, 1.0)]
    [1, 1, 2, 3]
    """
    import optuna.distributions as d  # lazy: optional extra (optuna)

    u = min(max(float(u), 0.0), 1.0)
    if isinstance(dist, d.IntDistribution):
        half = 0.5 * dist.step
        lo, hi = dist.low - half, dist.high + half
        v = math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo))) if dist.log else lo + u * (hi - lo)
        k = min(max(round((v - dist.low) / dist.step), 0), (dist.high - dist.low) // dist.step)
        return int(dist.low + k * dist.step)
    if dist.log:
        v = math.exp(math.log(dist.low) + u * (math.log(dist.high) - math.log(dist.low)))
        return float(min(max(v, dist.low), dist.high))
    v = dist.low + u * (dist.high - dist.low)
    if dist.step is not None:
        k = min(max(round((v - dist.low) / dist.step), 0), round((dist.high - dist.low) / dist.step))
        v = dist.low + k * dist.step
    return float(min(max(v, dist.low), dist.high))


_CACHE: "collections.OrderedDict[tuple[Any, ...], tuple[Any, list[np.ndarray]]]" = collections.OrderedDict()
"""Replays done in this process: (space, seed, results told so far) -> (CMA-ES after telling them, the next
generation's points). The key holds every input, and a continued replay performs the same operations as one from
scratch, so it never changes a proposal (``tests/workflows/test_evolve_proposals.py`` compares them bit for bit)."""


def _told(by_number: dict[int, Any], g: int, population: int) -> tuple[tuple[str, float | None], ...]:
    out = []
    for k in range(population):
        t = by_number.get(g * population + k)
        if t is None or not t.state.is_finished():
            raise ValueError(f"generation {g} is not finished: CMA-ES cannot propose the next one")
        out.append((t.state.name, float(t.value) if t.state.name == "COMPLETE" else None))
    return tuple(out)


def _tell(cma: Any, xs: list[np.ndarray], told: tuple[tuple[str, float | None], ...]) -> None:
    done = [-v for state, v in told if state == "COMPLETE" and v is not None]  # cmaes minimises (COMPLETE: a value)
    if not done:
        return  # every trial failed: nothing learnt
    worst = max(done) + 1.0  # a failed trial ranks below every completed one
    cma.tell([(x, -v if state == "COMPLETE" and v is not None else worst) for x, (state, v) in zip(xs, told)])


def cma_points(dists: dict[str, Any], population: int, seed: int, trials: Sequence[Any], generation: int
               ) -> list[np.ndarray]:
    """CMA-ES's population for ``generation`` (``population`` points in the normalised space), after telling it
    every earlier generation's trials (``trials``: the study's, any order; each earlier generation finished)."""
    import cmaes  # lazy: optional extra (cmaes, with optuna)

    genes = _numeric(dists)
    dim = len(genes)
    by_number = {t.number: t for t in trials}
    space = (seed, population, tuple((g, repr(dists[g])) for g in genes))
    told = [_told(by_number, g, population) for g in range(generation)]
    hit = _CACHE.get((space, tuple(told)))
    if hit is not None:
        _CACHE.move_to_end((space, tuple(told)))
        return list(hit[1])
    # the state after the previous generation's points, taken (not copied: a copy of its arrays may change their
    # memory layout, and with it the last bits of the products): this continues exactly the replay from scratch
    prev = _CACHE.pop((space, tuple(told[:-1])), None) if generation else None
    if prev is not None:
        cma, start = prev[0], generation
        _tell(cma, prev[1], told[-1])
    else:
        cma = cmaes.CMA(mean=np.full(dim, 0.5), sigma=SIGMA0, bounds=np.tile([0.0, 1.0], (dim, 1)),
                        seed=_seed(seed, 0), population_size=population)
        start = 0
    for g in range(start, generation + 1):
        cma._rng = np.random.RandomState(_seed(seed, 1, g))  # the points of generation g: from (seed, g) alone
        xs = [cma.ask() for _ in range(population)]
        if g == generation:
            break
        _tell(cma, xs, told[g])
    _CACHE[(space, tuple(told))] = (cma, xs)
    while len(_CACHE) > 64:
        _CACHE.popitem(last=False)
    return list(xs)


@functools.lru_cache(maxsize=None)
def _sampler_class() -> Any:
    """An Optuna sampler for one trial: the numeric genes' values given, a base sampler for the others
    (defined on first use: Optuna is an optional extra)."""
    import optuna  # lazy: optional extra (optuna)

    class CmaEsProposal(optuna.samplers.BaseSampler):
        def __init__(self, fixed: dict[str, Any], others: Any):
            self.fixed, self.others = fixed, others

        def infer_relative_search_space(self, study: Any, trial: Any) -> dict[str, Any]:
            return {}

        def sample_relative(self, study: Any, trial: Any, search_space: dict[str, Any]) -> dict[str, Any]:
            return {}

        def sample_independent(self, study: Any, trial: Any, name: str, dist: Any) -> Any:
            if name in self.fixed:
                return self.fixed[name]
            return self.others.sample_independent(study, trial, name, dist)

        def before_trial(self, study: Any, trial: Any) -> None:
            self.others.before_trial(study, trial)

        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            self.others.after_trial(study, trial, state, values)

        def reseed_rng(self) -> None:
            self.others.reseed_rng()

    return CmaEsProposal


def trial_sampler(optimizer: str, dists: dict[str, Any], population: int, seed: int, number: int,
                  study: Any = None) -> Any:
    """The sampler that proposes trial ``number``, seeded from ``(seed, number)``: what it proposes depends only on
    the seed, the number and the finished trials, never on this process' history (resumption, executors).

    ``optimizer``: ``random`` (Optuna's ``RandomSampler``), ``tpe`` (Optuna's multivariate TPE, random for the
    first population) or ``cmaes`` (see the module doc; needs ``study`` for the trials to tell)."""
    import optuna  # lazy: optional extra (optuna)

    s = _seed(seed, number)
    if optimizer == "random":
        return optuna.samplers.RandomSampler(seed=s)
    if optimizer == "tpe":
        return optuna.samplers.TPESampler(seed=s, n_startup_trials=population, multivariate=True)
    if optimizer != "cmaes":
        raise ValueError(f"unknown optimizer {optimizer!r}")
    if study is None:
        raise ValueError("CMA-ES proposes from the study's finished trials: pass the study")
    return _sampler_class()(_cma_genes(dists, population, seed, number, study), _choice_sampler(population, s))


def _choice_sampler(population: int, seed: int) -> Any:
    import optuna  # lazy: optional extra (optuna)

    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=population)  # each choice on its own


def _cma_genes(dists: dict[str, Any], population: int, seed: int, number: int, study: Any) -> dict[str, Any]:
    genes = _numeric(dists)
    if not genes:
        return {}
    gen, k = divmod(number, population)
    x = cma_points(dists, population, seed, study.get_trials(deepcopy=False), gen)[k]
    return {g: decode(dists[g], u) for g, u in zip(genes, x)}


def propose(dists: dict[str, Any], population: int, seed: int, number: int, study: Any) -> dict[str, Any]:
    """Trial ``number``'s genes under CMA-ES (what :func:`trial_sampler` makes ``study.ask`` give), computed without
    asking: the caller records the trial at once (``Study.add_trial``: one write instead of one per gene).

    >>> params = propose(dists, 8, 0, 12, study)                                     # doctest: +SKIP
    >>> study.add_trial(optuna.trial.create_trial(state=TrialState.RUNNING, params=params,
    ...                                           distributions=dists))               # doctest: +SKIP
    """
    import optuna  # lazy: optional extra (optuna)

    fixed = _cma_genes(dists, population, seed, number, study)
    others = [g for g in dists if g not in fixed]
    if not others:
        return fixed
    choices = _choice_sampler(population, _seed(seed, number))
    stand_in = optuna.trial.FrozenTrial(  # the trial to be: TPE reads its number (finished trials are the data)
        number=number, state=optuna.trial.TrialState.RUNNING, value=None, values=None,
        datetime_start=datetime.datetime.now(), datetime_complete=None, params={}, distributions={},
        user_attrs={}, system_attrs={}, intermediate_values={}, trial_id=-1)
    out = dict(fixed)
    for g in dists:  # in the order study.ask samples them
        if g not in fixed:
            out[g] = choices.sample_independent(study, stand_in, g, dists[g])
    return {g: out[g] for g in dists}


__all__ = ["trial_sampler", "propose", "cma_points", "decode", "MIN_POPULATION", "SIGMA0"]
