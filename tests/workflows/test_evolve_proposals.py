"""How evolve proposes trials: CMA-ES from the space's centre, told every finished trial (the first generation's
too), TPE for the choice genes; deterministic replays; no sampler falling back in silence.

These drive the proposals as :func:`hubsoup.workflows.evolve.evolve` does (a generation asked with
``make_sampler``, evaluated, told) on synthetic objectives with a known optimum: no model is merged.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

optuna = pytest.importorskip("optuna", reason="hubsoup[evolve] is not installed")

from hubsoup.errors import ParameterError  # noqa: E402
from hubsoup.workflows import proposals  # noqa: E402
from hubsoup.workflows.evolve import EvolveConfig, make_sampler  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)
OPTIMUM = {"weight.i0.g0": 0.2, "weight.i0.g1": 0.7, "weight.i1.g0": 0.35, "weight.i1.g1": 0.8}


def cfg(optimizer="cmaes", *, population=6, seed=0, space=None, trials=200):
    return EvolveConfig.load({"models": ["a", "b"], "method": "ties", "optimizer": optimizer,
                              "population": population, "trials": trials, "seed": seed,
                              "space": space or {"weight": {"range": [0, 1], "per": "input", "layer_groups": 2}},
                              "eval": {"tasks": ["perplexity:val.jsonl"]}})


def drive(c, objective, trials, study=None):
    """Generations as evolve runs them: asked, then evaluated and told. ``objective`` None: a failed trial."""
    study = study or optuna.create_study(direction="maximize")
    dists = c.distributions()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no sampler may fall back to another with a warning (nor silently)
        while len(study.trials) < trials:
            start = len(study.trials)
            batch = []
            for n in range(start, min(start + c.population, trials)):
                study.sampler = make_sampler(c, n, study)
                batch.append(study.ask(dists))
            for t in batch:
                v = objective(t.params, t.number)
                if v is None:
                    study.tell(t, state=optuna.trial.TrialState.FAIL)
                else:
                    study.tell(t, v)
    return study


def sphere(params, number):
    return -sum((params[k] - v) ** 2 for k, v in OPTIMUM.items())


def first_hit(study, threshold=-1e-3):
    return next((t.number for t in study.trials if t.value is not None and t.value > threshold), None)


def test_cma_es_reaches_the_optimum_in_fewer_trials_than_random_search():
    """4 genes, optimum off-centre: CMA-ES gets within 0.032 of it (f > -1e-3) in fewer than 200 trials for every
    seed; random search, which would need ~30 000 trials on average, does not get there in 200."""
    for seed in (0, 1, 2):
        cma = first_hit(drive(cfg(seed=seed), sphere, 200))
        rnd = first_hit(drive(cfg("random", seed=seed), sphere, 200))
        assert cma is not None and rnd is None, (seed, cma, rnd)


def test_every_trial_is_cma_es_and_the_first_generation_teaches_the_second():
    c = cfg(population=4, trials=8)
    a = drive(c, sphere, 8)
    b = drive(c, lambda p, n: -sphere(p, n), 8)  # the opposite scores for the same points
    ga, gb = [[t.params for t in s.trials] for s in (a, b)]
    assert ga[:4] == gb[:4]  # generation 0: the seed alone
    assert all(x != y for x, y in zip(ga[4:], gb[4:]))  # generation 1: what generation 0 scored
    # generation 0 is CMA-ES's own (mean at the centre, step 1/6 of the range), not uniform: |u - 0.5| ~ 0.13, not 0.25
    spread = np.mean([abs(p[k] - 0.5) for p in ga[:4] for k in OPTIMUM])
    assert spread < 0.2
    # and told, generation 1 moves towards the better half of generation 0
    best = max(a.trials[:4], key=lambda t: t.value).params
    worst = min(a.trials[:4], key=lambda t: t.value).params
    mean1 = {k: np.mean([p[k] for p in ga[4:]]) for k in OPTIMUM}
    assert sum((mean1[k] - best[k]) ** 2 for k in OPTIMUM) < sum((mean1[k] - worst[k]) ** 2 for k in OPTIMUM)


def test_a_replay_continued_in_this_process_is_the_replay_from_scratch_bit_for_bit():
    """The optimiser's state is replayed from the study (a resumed run starts from scratch, an uninterrupted one
    continues its replay): both give the same points to the last bit."""
    c = cfg(population=6, seed=1)
    study = drive(c, sphere, 60)
    dists = c.distributions()
    continued = proposals.cma_points(dists, 6, 1, study.trials, 10)
    proposals._CACHE.clear()
    scratch = proposals.cma_points(dists, 6, 1, study.trials, 10)
    assert all(np.array_equal(x, y) for x, y in zip(continued, scratch))
    with pytest.raises(ValueError, match="generation 10 is not finished"):
        proposals.cma_points(dists, 6, 1, study.trials, 11)


def test_failed_trials_rank_last_and_a_generation_of_failures_teaches_nothing():
    told = []

    class Spy:
        def tell(self, solutions):
            told.append([v for _, v in solutions])

    xs = [np.zeros(2)] * 3
    proposals._tell(Spy(), xs, (("COMPLETE", 1.0), ("FAIL", None), ("COMPLETE", 3.0)))
    assert told == [[-1.0, -1.0 + 1.0, -3.0]]  # cmaes minimises: the failure just above the worst (-1)
    proposals._tell(Spy(), xs, (("FAIL", None),) * 3)
    assert len(told) == 1  # nothing told
    # in a study: a trial failing in every generation does not stop CMA-ES from converging
    study = drive(cfg(seed=2), lambda p, n: None if n % 6 == 5 else sphere(p, n), 200)
    assert first_hit(study) is not None


def test_choice_genes_are_learnt_by_tpe_not_drawn_at_random():
    """A choice CMA-ES cannot sample comes from TPE, which learns it: after the first population, the better
    choice is proposed most of the time (random search: half)."""
    space = {"weight": {"range": [0, 1], "per": "input"}, "merge": {"choices": ["sum", "mean"]}}

    def objective(p, n):
        return -(p["weight.i0"] - 0.3) ** 2 - (p["weight.i1"] - 0.6) ** 2 - (0.0 if p["merge"] == "mean" else 0.5)

    for seed in (0, 1):
        study = drive(cfg(population=6, seed=seed, space=space), objective, 48)
        later = [t.params["merge"] for t in study.trials[12:]]
        assert later.count("mean") >= 0.75 * len(later), later


def test_a_point_written_at_once_is_the_point_the_sampler_gives():
    """evolve records a CMA-ES trial in one write (``propose`` + ``Study.add_trial``); ``study.ask`` with the
    sampler gives the same genes."""
    space = {"weight": {"range": [0, 1], "per": "input", "layer_groups": 2}, "merge": {"choices": ["sum", "mean"]},
             "k": {"range": [1, 9], "int": True}}
    c = cfg(population=4, seed=3, space=space)
    study = drive(c, lambda p, n: -(p["weight.i0.g0"] - 0.3) ** 2 - (p["merge"] == "sum") - p["k"] / 10, 8)
    for n in (8, 9):
        point = proposals.propose(c.distributions(), 4, 3, n, study)
        study.sampler = make_sampler(c, n, study)
        assert study.ask(c.distributions()).params == point


def test_cma_es_needs_a_population_of_four():
    with pytest.raises(ParameterError, match="population 2 is too small for CMA-ES, which needs at least 4"):
        cfg(population=2)
    cfg("tpe", population=2)  # other samplers take any population
    cfg(population=2, space={"merge": {"choices": ["sum", "mean"]}})  # no numeric gene: no CMA-ES


def test_decode_covers_each_kind_of_range():
    d = optuna.distributions
    assert [proposals.decode(d.IntDistribution(0, 4, step=2), u) for u in (0, 0.3, 0.5, 0.9, 1)] == [0, 0, 2, 4, 4]
    v = proposals.decode(d.FloatDistribution(0.1, 0.9, step=0.2), 0.55)
    assert math.isclose(v, 0.5) and d.FloatDistribution(0.1, 0.9, step=0.2)._contains(v)
    assert proposals.decode(d.FloatDistribution(1.0, 100.0, log=True), 0.5) == pytest.approx(10.0)
    assert proposals.decode(d.FloatDistribution(1.0, 100.0, log=True), 1.0) == 100.0
