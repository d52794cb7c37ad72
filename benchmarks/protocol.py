"""The tuned merge-quality protocol shared by the encoder and the decoder-LM benchmarks.

Every seed paper chooses its hyper-parameters on validation data; a user who types
``hubsoup merge a b c --method m`` gets the defaults. So each method of :data:`ROWS` is run
three ways, side by side, through the CLI:

- **defaults**: ``hubsoup merge REPOS --method M`` plus only the row's structural ``params``
  (``base_method=ties``; never a number the user would have to know);
- **old defaults**: the same with :attr:`Row.old` added, the values the defaults had before
  they were chosen from these benchmarks (issue 16); skipped when identical to ``defaults``;
- **tuned**: ``hubsoup merge ... --search KEY=GRID --eval VAL_TASK ...``: one merge per grid
  point, scored on the in-domain *validation* splits with the papers' selection score (mean
  normalized accuracy; for LMs, mean log-perplexity: see :mod:`hubsoup.workflows.search`), the
  best point kept; then scored once on *test*.

Scores. The **normalized gain** of model m over the in-domain tasks is
``Σ_t (s_t(m) − s_t(base)) / Σ_t (s_t(ft_t) − s_t(base))`` where s is accuracy (encoders) or
minus the mean token NLL = −log perplexity (LMs), and ft_t the fine-tune of task t: 1 = the
fine-tunes' own gains recovered, 0 = nothing gained, < 0 = worse than the untouched base. The
papers' **normalized accuracy** ``s_t(m) / s_t(ft_t)`` is reported too (encoders). Controls
(tasks no input was trained on): ``s_t(m) − s_t(base)`` (negative = forgetting).

Confidence intervals: a paired bootstrap over test examples (each task's examples resampled,
the same resample for every model, so references and merges move together), 95 % percentile
intervals of every average and of every difference used in a claim (:func:`bootstrap`).

The guard (:func:`guard`, issues 35 and 46), per benchmark setting, for each method with
hyper-parameters at its defaults: (a) it recovers at least :data:`RELATIVE_BAR` (0.8) × the share the
same method reaches tuned on validation in that setting, or its interval reaches that value; (b) it
does not harm an in-domain task that the tuned method leaves unharmed: it fails where the defaults are
worse than the base on a task beyond the noise (the paired 95 % interval of ``s_t(m) − s_t(base)``
entirely below 0) *and* worse than the tuned method on that task (the paired interval of
``s_t(defaults) − s_t(tuned)`` entirely below 0; :func:`versus_tuned`, stored in the defaults summary as
``vs_tuned``): a harm the tuned method shares is the method's limitation in that setting, not its
defaults'; (c) on the decoder LM, where every tuned method clears it, it recovers at least
:data:`LM_BAR` (0.5) of the gain. Every harm, whether (b) passes or not, is disclosed (:func:`harms`:
``hubsoup methods``, the README's method table, the card of a merge like the harmed setting).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IN_PROCESS = True
"""Run each ``hubsoup merge`` command line through the CLI's entry point in this process (same argv, same
code path, no interpreter start and imports per run, and a search's fine-tune scores are kept between
runs); False (``--subprocess``): one ``python -m hubsoup`` process per run, as a user's shell does."""
B = 1000  # bootstrap resamples
SEED = 20261123


@dataclass(frozen=True)
class Row:
    """One method of the protocol.

    ``params`` are structural (which inner method, which variant) and go into every run;
    ``old`` the pre-evidence defaults (issue 16), added for the "old defaults" run;
    ``grid`` what the tuned run searches (``--search KEY=a,b,c``; the method's paper grid,
    thinned to stay in the time budget); ``inherit``: the label of a row whose tuned values
    this one takes as fixed (LwPTV is compared like for like: the same base method and λ with
    and without the mask).
    """

    label: str
    method: str
    params: dict = field(default_factory=dict)
    old: dict = field(default_factory=dict)
    grid: dict = field(default_factory=dict)
    inherit: str | None = None
    lora: bool = True  # also run on LoRA fine-tunes
    exemplars: bool = False  # LOT: needs --exemplars TASK=PATH per input
    continual: bool = False  # OPCM: order matters
    whole_grid: bool = False  # searched on the whole grid, never thinned (the time budget's thinning skips it)


ROWS: list[Row] = [
    Row("uniform soup", "linear"),
    # task arithmetic's λ is the default chosen by a rule over the inputs (issue 35): its validation curve
    # over the whole grid in every setting is what the rule was fitted to, so its grid is never thinned
    Row("task arithmetic", "task_arithmetic", old={"scale": 0.3},
        grid={"scale": [0.1, 0.2, 0.3, 0.5, 0.7, 1.0]}, whole_grid=True),
    Row("TIES", "ties", old={"density": 0.2, "scale": 1.0}, grid={"scale": [0.3, 0.5, 0.7, 1.0, 1.3]}),
    Row("DARE + TA", "dare", {"then": "sum"}, old={"p": 0.9, "scale": 1.0},
        grid={"scale": [0.1, 0.2, 0.3, 0.5, 0.7, 1.0]}),
    Row("consensus", "consensus", old={"k": 2, "lambdas": 0.4, "scale": 0.3},
        grid={"scale": [0.1, 0.2, 0.3, 0.5, 0.7, 1.0]}),
    Row("LiNeS + uniform soup", "lines", {"base_method": "linear"}, old={"beta": 1.0},
        grid={"beta": [0.0, 0.2, 0.5, 1.0]}),
    Row("LiNeS + TA", "lines", {"base_method": "task_arithmetic"}, old={"beta": 1.0},
        grid={"beta": [0.1, 0.2, 0.3, 0.5, 0.7, 1.0]}),
    Row("LiNeS + TIES", "lines", {"base_method": "ties"}, old={"beta": 1.0},
        grid={"beta": [0.1, 0.3, 0.5, 0.7, 1.0, 1.4]}),
    Row("LiNeS + consensus", "lines", {"base_method": "consensus"}, old={"beta": 1.0},
        grid={"beta": [0.1, 0.2, 0.3, 0.5, 0.7, 1.0]}),
    Row("LwPTV + TA", "lwptv", {"base_method": "task_arithmetic"}, old={"eta": 0.7, "scale": 0.3},
        grid={"eta": [0.1, 0.2, 0.3, 0.5, 0.7]}, inherit="task arithmetic"),
    Row("LwPTV + TIES", "lwptv", {"base_method": "ties"}, old={"eta": 0.7, "merge": "sum", "scale": 0.3},
        grid={"eta": [0.1, 0.2, 0.3, 0.5, 0.7]}, inherit="TIES"),
    Row("SFTM", "sftm", old={"eta": 0.2, "gamma": 0.6}, grid={"gamma": [0.4, 0.6, 0.8, 1.0, 1.2]}),
    Row("LOT", "lot", old={"scale": 1.0}, grid={"scale": [0.6, 0.8, 1.0, 1.2, 1.5]}, exemplars=True),
    Row("OPCM", "opcm", old={"alpha": 0.5}, grid={"alpha": [0.3, 0.5, 0.7]}, continual=True),
]
ROW = {r.label: r for r in ROWS}

# The seed papers' claims, as (claim, row, reference row, what is compared). "in" = mean in-domain
# normalized gain; "control" = mean control score change; LwPTV's claim has two parts.
CLAIMS: list[tuple[str, str, str, str]] = [
    ("LiNeS improves task arithmetic", "LiNeS + TA", "task arithmetic", "in"),
    ("LiNeS improves TIES", "LiNeS + TIES", "TIES", "in"),
    ("LiNeS improves consensus", "LiNeS + consensus", "consensus", "in"),
    ("LwPTV lifts control tasks (over TA, same λ)", "LwPTV + TA", "task arithmetic", "control"),
    ("LwPTV costs ≤ 1 point in-domain (over TA, same λ)", "LwPTV + TA", "task arithmetic", "in_loss"),
    ("LwPTV lifts control tasks (over TIES, same λ)", "LwPTV + TIES", "TIES", "control"),
    ("LwPTV costs ≤ 1 point in-domain (over TIES, same λ)", "LwPTV + TIES", "TIES", "in_loss"),
    ("SFTM ≥ TIES", "SFTM", "TIES", "in"),
    ("LOT ≥ task arithmetic", "LOT", "task arithmetic", "in"),
    ("OPCM ≥ sequential averaging", "OPCM", "uniform soup", "in"),
]


# ---- running merges through the CLI -------------------------------------------------------------


def cli_command(inputs: Sequence[str], method: str, params: dict, out: str, *, search: dict | None = None,
                evals: Sequence[str] = (), extra: Sequence[str] = ()) -> list[str]:
    """The ``hubsoup merge`` command line of one run (``python -m hubsoup`` in this interpreter)."""
    cmd = [sys.executable, "-m", "hubsoup", "merge", *inputs, "--method", method, "--out", out,
           "--overwrite", "--quiet"]
    for k, v in params.items():
        cmd += ["--param", f"{k}={_cli_value(v)}"]
    for k, values in (search or {}).items():
        cmd += ["--search", f"{k}=" + ",".join(_cli_value(v) for v in values)]
    for spec in evals:
        cmd += ["--eval", spec]
    return cmd + list(extra)


def _cli_value(v) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(_cli_value(x) for x in v)
    return str(v).lower() if isinstance(v, bool) else str(v)


def display(cmd: Sequence[str]) -> str:
    """A command as a user types it (``hubsoup merge ...``), for the results."""
    return " ".join(["hubsoup", *[c if " " not in c else repr(c) for c in cmd[3:]]])


def run_cli(cmd: Sequence[str], env: dict | None = None,
            timeout: float | None = None) -> tuple[bool, str, float]:
    """Run one CLI merge; (ok, last error line or the command, seconds). ``timeout``: seconds after which
    the merge is killed and reported as failed (a time budget; such a run, or one with its own ``env``, is
    a process of its own even when :data:`IN_PROCESS`)."""
    if IN_PROCESS and env is None and timeout is None:
        return _run_in_process(cmd)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"stopped after {timeout:.0f} s (the benchmark's time budget)", time.perf_counter() - t0
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        lines = [l for l in (proc.stderr or proc.stdout).strip().splitlines() if l.strip()]
        return False, (lines[-1] if lines else f"exit {proc.returncode}")[:400], dt
    return True, display(cmd), dt


@contextlib.contextmanager
def sharing(work: str):
    """While the runs are in-process: runs of the same inputs share equal preparations and statistics
    (:mod:`hubsoup.engine.shared`: LOT's exemplar capture, TIES' ranking, SFTM's superpositions, OPCM's
    S) across a row's defaults, old defaults and its search's points, each model bit for bit the one its
    own command gives; the files they keep live in a folder under ``work``, removed at the end."""
    if not IN_PROCESS:
        yield
        return
    import tempfile

    from hubsoup.engine.shared import shared_statistics

    os.makedirs(work, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="shared-", dir=work) as tmp, shared_statistics(scratch=tmp):
        yield


def _run_in_process(cmd: Sequence[str]) -> tuple[bool, str, float]:
    """:func:`run_cli` through ``hubsoup.cli.main(argv)`` in this process: its output captured, its
    exit status (or the exception it let out) the verdict."""
    import contextlib
    import gc
    import io

    from hubsoup.cli import main

    assert list(cmd[1:3]) == ["-m", "hubsoup"], cmd
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(list(cmd[3:]))
    except SystemExit as e:  # argparse
        rc = e.code if isinstance(e.code, int) else 2
    except Exception as e:  # noqa: BLE001 - a crash of one run is that run's failure
        rc = 1
        err.write(f"{type(e).__name__}: {e}\n")
    dt = time.perf_counter() - t0
    gc.collect()  # the run's models and buffers, before the next run is timed
    if rc != 0:
        lines = [l for l in (err.getvalue() or out.getvalue()).strip().splitlines() if l.strip()]
        return False, (lines[-1] if lines else f"exit {rc}")[:400], dt
    return True, display(cmd), dt


def _effective(method: str, params: dict) -> dict:
    """The parameters a merge with ``params`` really uses (the method's defaults filled in)."""
    from hubsoup.methods import get_method

    m = get_method(method)
    return m.describe_params(m.parse(dict(params)))


def _inherited(label: str, tuned: dict[str, dict]) -> dict:
    """Every parameter the tuned run of row ``label`` merged with (its chosen values and its method's
    defaults): a like-for-like comparison."""
    src = ROW[label]
    return {k: v for k, v in _effective(src.method, {**src.params, **tuned.get(label, {})}).items()
            if v is not None and not isinstance(v, dict)}


def search_grid(row: Row, points: int) -> dict:
    """The grid ``row``'s tuned run searches: each list thinned to ``points`` evenly spaced values, both ends
    kept (``points`` = 0, or a :attr:`Row.whole_grid` row: the whole grid; the time budget's thinning).

    >>> search_grid(ROW["TIES"], 3), search_grid(ROW["task arithmetic"], 3)["scale"][:3]
    ({'scale': [0.3, 0.7, 1.3]}, [0.1, 0.2, 0.3])
    """
    if not points or row.whole_grid:
        return dict(row.grid)
    out = {}
    for k, vals in row.grid.items():
        if len(vals) <= points:
            out[k] = list(vals)
        else:
            idx = (sorted({round(i * (len(vals) - 1) / (points - 1)) for i in range(points)}) if points > 1
                   else [len(vals) // 2])
            out[k] = [vals[i] for i in idx]
    return out


def runs_of(row: Row, tuned: dict[str, dict]) -> list[tuple[str, dict, dict | None]]:
    """The runs of ``row``: (variant, params, search grid or None); ``tuned`` maps a row label to the
    values its tuned run chose (for :attr:`Row.inherit`)."""
    fixed = dict(row.params)
    out = [("defaults", fixed, None)]
    old = {**fixed, **row.old}
    if _effective(row.method, old) != _effective(row.method, fixed):  # skipped where the defaults did not move
        out.append(("old defaults", old, None))
    if row.grid:
        base = {**fixed, **(_inherited(row.inherit, tuned) if row.inherit else {})}
        out.append(("tuned", {k: v for k, v in base.items() if k not in row.grid}, row.grid))
    return out


def _num(v):
    """A grid value as the search recorded it (a string or a number), as a number where it is one."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return v
    return int(f) if f.is_integer() and "." not in str(v) else f


def searched(out: str) -> dict:
    """A tuned run's record from its search's ``hubsoup_search.json`` in ``out``: the chosen values, the
    selection score's name and value, where the time went and every grid point's score."""
    with open(os.path.join(out, "hubsoup_search.json"), encoding="utf-8") as f:
        found = json.load(f)
    return {"chosen": {k: _num(v) for k, v in found["best"].items()}, "selection": found.get("selection"),
            "val_score": found.get("best_score"), "search_seconds": found.get("seconds"),
            "grid_scores": [{"params": {k: _num(v) for k, v in s["params"].items()}, "score": s["score"]}
                            for s in found.get("scores", [])]}


def scored_run(run: dict, out: str, grid: dict | None, tuned: dict, label: str,
               evaluate: Callable[[str], dict], summarize: Callable[[dict], dict]) -> dict:
    """Complete the record ``run`` of a merge written to ``out``: a tuned run's search (:func:`searched`;
    its chosen values go into ``tuned[label]``), the test evaluation ``evaluate(out)`` and its time, and
    ``summarize(evaluations)``."""
    if grid:
        run.update(searched(out))
        tuned[label] = run["chosen"]
    t0 = time.perf_counter()
    evals = evaluate(out)
    run["eval_seconds"] = round(time.perf_counter() - t0, 2)
    run["tests"] = evals
    run["summary"] = summarize(evals)
    return run


VARIANT_ORDER = ("defaults", "tuned", "old defaults")


def run_order(rows: Sequence[Row], budgeted: bool) -> list[tuple[Row, str]]:
    """The order of the runs, as (row, variant). Under a time budget every row's defaults first (what
    the guard reads), then the tuned runs (the claims), then the old defaults, so the budget cuts off the
    least needed. Without one, each row's runs one after another (defaults, tuned, old defaults): the
    shared block (:func:`sharing`) keeps only the last merge's statistics, so a row's search reuses its
    defaults' preparations (SFTM's superpositions, LOT's capture, OPCM's S) only when it comes next.
    Rows stay in their order either way, so a row's :attr:`Row.inherit` source is tuned before it."""
    if budgeted:
        return [(row, v) for v in VARIANT_ORDER for row in rows]
    return [(row, v) for row in rows for v in VARIANT_ORDER]


# ---- scores and confidence intervals -----------------------------------------------------------


@dataclass
class Scores:
    """Per-example scores of one model on one task's test split.

    Classification: ``values`` = 1/0 per example, ``weights`` = 1 each (accuracy = mean); or weights 1 / the
    size of the example's class and values the outcomes times them (balanced accuracy: the mean of the
    classes' accuracies).
    Perplexity: ``values`` = minus each sequence's summed token NLL, ``weights`` = its token count
    (score = −Σ nll / Σ tokens = −log perplexity).
    """

    values: list[float]
    weights: list[float]
    strata: tuple | None = None
    """Each example's class where the score is a balanced accuracy: the bootstrap resamples within classes."""

    def score(self, idx=None):
        """The score on all examples (``idx`` None: a float), or on each bootstrap resample (``idx``: a
        [B, n] index tensor; a [B] tensor)."""
        v, w = self._tensors()
        if idx is None:
            return float(v.sum() / w.sum()) if float(w.sum()) else float("nan")
        memo = self.__dict__.setdefault("_memo", {})
        if id(idx) not in memo:  # the resample tensors live in _RESAMPLES, so their ids stay theirs
            memo[id(idx)] = v[idx].sum(-1) / w[idx].sum(-1)
        return memo[id(idx)]

    def _tensors(self):
        if getattr(self, "_t", None) is None:  # converted once: every statistic reads them B times
            import torch

            self._t = (torch.as_tensor(self.values, dtype=torch.float64),
                       torch.as_tensor(self.weights, dtype=torch.float64))
        return self._t

    @classmethod
    def classification(cls, correct: Sequence[int], classes: Sequence[str] | None = None) -> "Scores":
        """0/1 outcomes: accuracy; with each example's class, balanced accuracy (the mean of the classes'
        accuracies: each outcome weighted 1 / its class's size; the score is Σ values / Σ weights)."""
        if classes is None:
            return cls([float(c) for c in correct], [1.0] * len(correct))
        if len(classes) != len(correct):
            raise ValueError(f"{len(correct)} outcomes but {len(classes)} classes")
        counts = Counter(classes)
        weights = [1.0 / counts[c] for c in classes]
        return cls([float(c) * w for c, w in zip(correct, weights)], weights, tuple(classes))

    @classmethod
    def perplexity(cls, nll: Sequence[float], tokens: Sequence[int]) -> "Scores":
        return cls([-float(x) for x in nll], [float(t) for t in tokens])  # higher is better: −NLL

    def to_dict(self) -> dict:
        return {"values": self.values, "weights": self.weights}


ModelScores = dict  # task -> Scores


def _resamples(n_by_task: dict[str, int | tuple], b: int = B, seed: int = SEED) -> dict:
    """Each task's bootstrap resamples, a [b, n] index tensor, seeded by the task's name (so the same
    task gets the same resamples in every statistic: the intervals are paired). A task given by its
    examples' classes (:func:`sizes`) is resampled within each class: every resample keeps the class counts."""
    import torch

    out = {}
    for t, n in n_by_task.items():
        key = (t, n, b, seed)
        if key not in _RESAMPLES:
            g = torch.Generator().manual_seed(seed + sum(ord(c) * 31 ** i for i, c in enumerate(t)) % 2 ** 31)
            if isinstance(n, int):
                _RESAMPLES[key] = torch.randint(0, n, (b, n), generator=g)
            else:
                idx = torch.empty(b, len(n), dtype=torch.long)
                for c in sorted(set(n)):
                    pos = torch.tensor([i for i, x in enumerate(n) if x == c])
                    idx[:, pos] = pos[torch.randint(0, len(pos), (b, len(pos)), generator=g)]
                _RESAMPLES[key] = idx
        out[t] = _RESAMPLES[key]
    return out


def sizes(scores: "ModelScores", tasks: Sequence[str]) -> dict[str, int | tuple]:
    """What :func:`interval` resamples per task: its number of examples, or their classes (balanced accuracy)."""
    return {t: scores[t].strata or len(scores[t].values) for t in tasks}


_RESAMPLES: dict = {}  # one index tensor per task: every statistic reuses it (and Scores caches by it)


def interval(stat: Callable[[dict], float], n_by_task: dict[str, int], b: int = B, level: float = 0.95) -> dict:
    """``stat`` on the full test sets, with its paired-bootstrap percentile interval (95 % unless ``level``
    says otherwise). ``stat`` takes ``{task: None}`` (a float) or ``{task: [b, n] indices}`` (a [b] tensor)."""
    import torch

    point = float(stat({t: None for t in n_by_task}))
    samples = torch.sort(torch.as_tensor(stat(_resamples(n_by_task, b)), dtype=torch.float64)).values
    tail = round((1 - level) / 2, 12)  # 0.025 exactly at 95 %: the same indices as always
    lo, hi = float(samples[int(tail * b)]), float(samples[min(b - 1, int(math.ceil((1 - tail) * b)) - 1)])
    return {"value": point, "lo": lo, "hi": hi}


def gain(m: ModelScores, base: ModelScores, fts: dict[str, ModelScores], tasks: Sequence[str]):
    """The statistic "share of the fine-tunes' gain recovered" over ``tasks`` (for :func:`interval`):
    Σ_t (s_t(m) − s_t(base)) / Σ_t (s_t(ft_t) − s_t(base)), the tasks' gains pooled. A per-task ratio
    averaged over tasks is undefined where a fine-tune gained nothing on its own task (one encoder
    task's fine-tune ends below the base), and one such task then decides the whole average."""
    def stat(idx):
        num = sum(m[t].score(idx[t]) - base[t].score(idx[t]) for t in tasks)
        den = sum(fts[t][t].score(idx[t]) - base[t].score(idx[t]) for t in tasks)
        return num / (den if not isinstance(den, float) or den else float("nan"))
    return stat


def normalized(m: ModelScores, fts: dict[str, ModelScores], tasks: Sequence[str]):
    """Mean normalized accuracy ``s(m) / s(ft)`` (encoders, the papers' table metric)."""
    return lambda idx: sum(m[t].score(idx[t]) / fts[t][t].score(idx[t]) for t in tasks) / len(tasks)


def change(m: ModelScores, base: ModelScores, tasks: Sequence[str]):
    """Mean ``s(m) − s(base)`` over ``tasks`` (controls: negative = forgetting)."""
    return lambda idx: sum(m[t].score(idx[t]) - base[t].score(idx[t]) for t in tasks) / len(tasks)


def difference(f: Callable, g: Callable):
    return lambda idx: f(idx) - g(idx)


def summarize(m: ModelScores, base: ModelScores, fts: dict[str, ModelScores], in_domain: Sequence[str],
              controls: Sequence[str], b: int = B) -> dict:
    """Everything a table row shows, each with its interval."""
    n = sizes(base, [*in_domain, *controls])
    n_in = {t: n[t] for t in in_domain}
    out = {"scores": {t: m[t].score() for t in n},
           "gain": interval(gain(m, base, fts, in_domain), n_in, b),
           "in_domain": interval(lambda idx: sum(m[t].score(idx[t]) for t in in_domain) / len(in_domain), n_in, b),
           "worst_task_vs_base": {t: interval(change(m, base, [t]), {t: n[t]}, b) for t in in_domain}}
    if all(fts[t][t].score() > 0 for t in in_domain):  # accuracies: the papers' normalized accuracy
        out["normalized"] = interval(normalized(m, fts, in_domain), n_in, b)
    if controls:
        out["control_change"] = interval(change(m, base, controls), {t: n[t] for t in controls}, b)
    return out


# ---- claims and the guard ----------------------------------------------------------------------


def claim(kind: str, m: ModelScores, ref: ModelScores, base: ModelScores, fts: dict[str, ModelScores],
          in_domain: Sequence[str], controls: Sequence[str], b: int = B) -> dict:
    """One seed claim, m against ref: the difference with its interval and a verdict.

    "holds" when the interval is above 0 (for "in_loss": the loss of in-domain score is ≤ 1 point,
    i.e. the interval's lower end of m − ref is above −0.01 on the mean in-domain score),
    "does not hold" when it is below 0 (above −0.01 fails), "inside the noise" otherwise.
    """
    n_in = sizes(base, in_domain)
    if kind == "in":
        d = interval(difference(gain(m, base, fts, in_domain), gain(ref, base, fts, in_domain)), n_in, b)
        lo_ok = 0.0
    elif kind == "control":
        d = interval(difference(change(m, base, controls), change(ref, base, controls)),
                     sizes(base, controls), b)
        lo_ok = 0.0
    else:  # in_loss: mean in-domain score of m − ref ≥ −1 point
        d = interval(difference(change(m, base, in_domain), change(ref, base, in_domain)), n_in, b)
        lo_ok = -0.01
    if d["lo"] > lo_ok:
        verdict = "holds"
    elif d["hi"] < lo_ok:
        verdict = "does not hold"
    else:
        verdict = "inside the noise"
    return {**d, "verdict": verdict, "threshold": lo_ok}


RELATIVE_BAR = 0.8
"""(a): a default must recover this share of what the same method reaches tuned, in each setting."""
LM_BAR = 0.5
"""(c): on the decoder LM, a default must recover at least this share of the fine-tunes' gain."""
MAX_HALF_WIDTH = 0.15
"""Issue 35: a benchmark that can tell: the main rows' 95 % intervals at most ±0.15 wide."""


GUARD_READING = ("(a) at its defaults a method recovers ≥ 0.8 × the share of the fine-tunes' gain it reaches "
                 "tuned on validation in that setting, or its 95 % interval reaches that value; (b) it does not harm "
                 "an in-domain task that the tuned method leaves unharmed: it fails where the defaults are worse than "
                 "the base on a task (95 % interval's upper end below 0) and worse than the tuned method on the same "
                 "task (paired interval of defaults − tuned below 0); (c) on the decoder LM it recovers ≥ 0.5 of the "
                 "gain")
"""The guard's reading, as the reports state it (issue 46)."""


def versus_tuned(m: ModelScores, tuned: ModelScores, base: ModelScores, tasks: Sequence[str],
                 b: int = B) -> dict[str, dict]:
    """Per in-domain task, the paired interval of ``s_t(defaults) − s_t(tuned)`` (as a difference of both runs'
    changes against the base, the statistic ``benchmarks/guard_options.py`` reads): below 0, tuning avoids
    (part of) what the defaults lose on that task. The guard's (b) reads it from the defaults summary."""
    n = sizes(base, tasks)
    return {t: interval(difference(change(m, base, [t]), change(tuned, base, [t])), {t: n[t]}, b) for t in tasks}


def add_versus_tuned(setting: dict, scores: Callable[[dict], ModelScores], base: ModelScores) -> None:
    """Store :func:`versus_tuned` in the summary of every defaults run of ``setting`` whose row has a tuned run
    with per-example outcomes (``scores``: a run's ``tests`` -> :data:`ModelScores`, the benchmark's own
    scoring); a defaults run without one loses a stale ``vs_tuned``."""
    for variants in setting["rows"].values():
        d, t = variants.get("defaults") or {}, variants.get("tuned") or {}
        if "summary" not in d:
            continue
        if "tests" in d and "tests" in t:
            d["summary"]["vs_tuned"] = versus_tuned(scores(d["tests"]), scores(t["tests"]), base,
                                                    setting["in_domain"])
        else:
            d["summary"].pop("vs_tuned", None)


def guard(results: dict) -> list[str]:
    """Failures of the defaults guard in one benchmark's results (see the module docstring).

    ``results``: ``{"benchmark": name, "settings": {setting: {"rows": {label: {"defaults":
    summary, "tuned": summary}}}}}`` as the benchmarks write them (a setting = fine-tune kind ×
    number of tasks); (b) reads each defaults summary's ``vs_tuned`` (:func:`add_versus_tuned`).
    """
    bad = []
    for setting, s in results["settings"].items():
        for label, variants in s["rows"].items():
            summ = variants.get("defaults", {}).get("summary")
            if not summ or (label in ROW and not ROW[label].grid):
                continue  # a method without hyper-parameters (uniform soup) has no default to guard
            where = f"{results['benchmark']} / {setting} / {label} at its defaults"
            g = summ["gain"]
            tuned = (variants.get("tuned") or {}).get("summary")
            if tuned is not None:
                bar = RELATIVE_BAR * tuned["gain"]["value"]
                if g["value"] < bar and g["hi"] < bar:
                    bad.append(f"{where}: recovers {g['value']:.2f} [{g['lo']:.2f}, {g['hi']:.2f}] of the "
                               f"fine-tunes' gain, below {RELATIVE_BAR} x {tuned['gain']['value']:.2f} tuned "
                               f"(= {bar:.2f})")
            if results.get("benchmark") == "decoder-lm" and g["value"] < LM_BAR:
                bad.append(f"{where}: recovers {g['value']:.2f} of the fine-tunes' gain (< {LM_BAR} on the LM)")
            for t, d in summ["worst_task_vs_base"].items():
                if d["hi"] >= 0:
                    continue
                harm = f"worse than the base on {t} ({d['value']:+.4f}, 95% CI [{d['lo']:+.4f}, {d['hi']:+.4f}])"
                vt = (summ.get("vs_tuned") or {}).get(t)
                if tuned is None:
                    bad.append(f"{where}: {harm}, and no tuned run to tell the defaults' harm from the method's")
                elif vt is None:
                    bad.append(f"{where}: {harm}; the defaults − tuned interval is not stored (re-summarize: "
                               "python -m benchmarks.vs_tuned)")
                elif vt["hi"] < 0:
                    bad.append(f"{where}: {harm} and worse than tuned there ({vt['value']:+.4f}, 95% CI "
                               f"[{vt['lo']:+.4f}, {vt['hi']:+.4f}])")
    return bad


def harms(results: dict) -> list[dict]:
    """Every (setting, method at its defaults, in-domain task) worse than the base beyond the noise (the 95 %
    interval of the change below 0), whatever the guard's (b) decides: what hubsoup discloses (issue 46).

    Each: ``{"setting", "kind", "n_inputs", "row", "task", "change": {value, lo, hi}, "vs_tuned": {...} | None}``;
    ``change`` in the benchmark's unit (accuracy for the encoder, −log perplexity for the LM)."""
    out = []
    for setting, s in results["settings"].items():
        for label, variants in s["rows"].items():
            summ = (variants.get("defaults") or {}).get("summary")
            if not summ:
                continue
            for t, d in summ["worst_task_vs_base"].items():
                if d["hi"] < 0:
                    out.append({"setting": setting, "kind": s.get("kind"),
                                "n_inputs": s.get("n_tasks") or len(s.get("in_domain", [])), "row": label,
                                "task": t, "change": d, "vs_tuned": (summ.get("vs_tuned") or {}).get(t)})
    return out


def _scale_by_n(method: str, params: dict, ns: Sequence[int] = (4, 8), kinds: Sequence[str] = ("LoRA", "full")) -> dict:
    """Defaults that a rule resolves (task arithmetic's λ by the number of inputs, through any modifier; LiNeS'
    β; SFTM's γ by the inputs' kind) at each number of inputs in ``ns`` and kind in ``kinds``: a rule is
    invisible in the parameters (``None``), and a new rule must make old results stale."""
    from hubsoup.methods import TensorContext, get_method
    from hubsoup.methods._compose import Modifier

    top = get_method(method)
    leaf, p = top, top.parse(dict(params))
    out = {}
    if hasattr(top, "base_scale"):  # LiNeS: the base method's λ sets its β, by a rule recorded at α = 0.125
        at = top.parse({**params, "alpha": 0.125})
        out = {**{f"base λ at N={n}": top.base_scale(p, n) for n in ns},
               **{f"β at α=0.125, N={n}": top.alpha_beta(at, TensorContext("", None, n))[1] for n in ns}}
    while isinstance(leaf, Modifier):
        leaf, p = p.inner, p.inner_params
    rule = getattr(leaf, "resolved_scale", None)
    if rule:
        out.update({f"λ at N={n}": rule(p, n) for n in ns})
    gamma = getattr(leaf, "resolved_gamma", None)  # SFTM: by the inputs' kind
    if gamma:
        out.update({f"γ for {kind}, N={n}": gamma(p, TensorContext("", None, n, adapters=kind == "LoRA"))
                    for kind in kinds for n in ns})
    return out


_KIND = {"lora": "LoRA", "full": "full"}  # a setting's kind -> how a rule's record names it


def effective_defaults(label: str, n: int | None = None, kind: str | None = None) -> dict:
    """Row ``label``'s "defaults" run as a merge really performs it today (the method's current defaults
    filled in, a rule by its values at ``n`` inputs of ``kind`` ("lora" or "full"), or at 4 and 8 of both);
    each defaults run records it, at its setting's number and kind of inputs, as ``"effective"``."""
    r = ROW[label]
    kinds = [_KIND[kind]] if kind else list(_KIND.values())
    return json.loads(json.dumps({**_effective(r.method, r.params),
                                  **_scale_by_n(r.method, r.params, (n,) if n else (4, 8), kinds)}, default=str))


def defaults_in_use() -> dict[str, dict]:
    """:func:`effective_defaults` of every row. A benchmark stores it as ``results["defaults"]`` for the rows its
    file has no record of yet, and keeps the record it has: it dates the runs made before each run recorded its
    own ``"effective"``, so a partial re-run does not vouch for rows it did not run."""
    return {r.label: effective_defaults(r.label) for r in ROWS}


def _applying(record: dict, n: int | None, kind: str | None) -> dict:
    """A record of defaults as it applies to ``n`` inputs of ``kind``: a rule's values at other numbers or for
    the other kind left out."""
    def keep(k: str) -> bool:
        at, of = re.search(r"N=(\d+)", k), re.search(r"for (LoRA|full)\b", k)
        return (not n or not at or int(at[1]) == n) and (not kind or not of or of[1] == _KIND[kind])
    return {k: v for k, v in record.items() if keep(k)}


def stale_defaults(results: dict) -> list[str]:
    """Rows whose defaults changed since ``results`` were measured: the guard's verdict on them is void
    until the benchmark's defaults runs are repeated (``--variants defaults``). Each setting is judged at its
    own number and kind of inputs: a rule changed only at 8 inputs, or for LoRA adapters, leaves the other
    settings' runs valid."""
    then = results.get("defaults") or {}
    out = []
    for label in ROW:
        runs = {setting: ((s.get("n_tasks"), s.get("kind")), run.get("effective", then.get(label)))
                for setting, s in results.get("settings", {}).items()
                for run in [(s["rows"].get(label) or {}).get("defaults")] if run}
        if not runs and label in then:  # no run of it in the file: its record alone
            runs = {"": ((None, None), then[label])}
        eff = {at: effective_defaults(label, *at) for at in {at for at, _ in runs.values()}}
        stale = {setting: (eff[at], _applying(was, *at)) for setting, (at, was) in runs.items()
                 if was is not None and _applying(was, *at) != eff[at]}
        if stale:
            diff = sorted({k for now, was in stale.values() for k in set(now) | set(was) if now.get(k) != was.get(k)})
            where = "" if len(stale) == len(runs) else f" in {', '.join(stale)}"
            out.append(f"{results['benchmark']} / {label}: defaults changed since the benchmark ran{where} "
                       f"({', '.join(diff)}); re-run its defaults")
        elif label not in then and not any(was for _, was in runs.values()):
            out.append(f"{results['benchmark']} / {label}: not in the results; re-run the benchmark")
    return out


def ci(d: dict, pct: bool = True) -> str:
    """``value [lo, hi]`` for a table."""
    k = 100 if pct else 1
    return f"{k * d['value']:.1f} [{k * d['lo']:.1f}, {k * d['hi']:.1f}]" if pct else \
        f"{d['value']:.2f} [{d['lo']:.2f}, {d['hi']:.2f}]"


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (the merges run as children)."""
    import resource

    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, default=str)


def write_results(out: str, results: dict, render) -> None:
    """``out``.json (the results) and ``out``.md (``render(results)``)."""
    write_json(out + ".json", results)
    with open(out + ".md", "w", encoding="utf-8") as f:
        f.write(render(results))


if __name__ == "__main__":  # the guard over committed results: python -m benchmarks.protocol FILE.json ...
    failures = []
    for p in sys.argv[1:]:
        with open(p, encoding="utf-8") as f:
            res = json.load(f)
        failures += guard(res) + stale_defaults(res)
    print("\n".join(failures) or "guard: every method at its defaults passes")
    sys.exit(1 if failures else 0)
