"""One merge per grid point: preference vectors for a Pareto front, or a scalar parameter.

``sweep(inputs, "rewarded_soups", out, "0:1:0.1")`` writes eleven models for two
inputs, ``out/lambda-0.00-1.00`` … ``out/lambda-1.00-0.00`` (λ = (v, 1 − v)), and
``out/sweep.json`` listing them. With more inputs the grid spans the simplex: every
vector whose first N − 1 entries are grid values and whose last entry 1 − Σ is ≥ 0.
With ``param="beta"`` (any scalar parameter) it writes ``out/beta-0.30`` and so on.
The output folder is locked for the whole sweep and the models are written into its
temporary folder, which becomes ``out`` at the end: a sweep that fails (or is killed)
leaves an existing output as it was and nothing half-made behind.

Example:
    >>> from hubsoup.workflows.sweep import sweep
    >>> res = sweep(["org/policy-r1", "org/policy-r2"], "rewarded_soups", "./front", "0:1:0.25",
    ...             base="org/sft", lines=True)                   # doctest: +SKIP
    >>> [p.value for p in res.points]                            # doctest: +SKIP
    [(0.0, 1.0), (0.25, 0.75), (0.5, 0.5), (0.75, 0.25), (1.0, 0.0)]
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from hubsoup.api import MergeResult, keeps_inputs, merge, scoped
from hubsoup.engine.shared import shared_statistics
from hubsoup.errors import ParameterError
from hubsoup.options import MergeOptions
from hubsoup.output import OutputFolder, check_output
from hubsoup.sources.access import check_specs
from hubsoup.workflows.search import frange

INDEX_FILE = "sweep.json"
_OUTPUT_KEYS = ("output_format", "rank", "energy", "evaluate", "eval_limit")


def parse_grid(spec: str | Sequence[float]) -> list[float]:
    """``"start:stop:step"`` (both ends included) or ``"a,b,c"`` or a list of numbers."""
    if not isinstance(spec, str):
        values = [float(v) for v in spec]
        if not all(math.isfinite(v) for v in values):
            raise ParameterError(f"grid {list(spec)!r}: values must be finite numbers")
    elif ":" in spec:
        parts = spec.split(":")
        try:
            start, stop, step = (float(x) for x in parts) if len(parts) == 3 else (None, None, None)
        except ValueError:
            start = None
        if start is None:
            raise ParameterError(f"grid {spec!r}: expected START:STOP:STEP, e.g. 0:1:0.1")
        assert stop is not None and step is not None  # set with start
        if step <= 0 or stop < start:
            raise ParameterError(f"grid {spec!r}: need STEP > 0 and STOP ≥ START")
        values = frange(start, stop, step)
        if abs(values[-1] - stop) > 1e-9 * max(1.0, abs(stop)):
            raise ParameterError(f"grid {spec!r}: STOP - START is not a multiple of STEP")
    else:
        try:
            values = [float(v) for v in spec.split(",") if v.strip()]
        except ValueError:
            raise ParameterError(f"grid {spec!r}: expected START:STOP:STEP or comma-separated numbers") from None
    if not values:
        raise ParameterError(f"grid {spec!r} is empty")
    if not all(math.isfinite(v) for v in values):
        raise ParameterError(f"grid {spec!r}: values must be finite numbers")
    return values


def simplex_grid(n: int, values: Sequence[float]) -> list[tuple[float, ...]]:
    """Preference vectors of length ``n`` on the simplex: the first n − 1 entries from ``values``."""
    if n < 2:
        raise ParameterError("a preference sweep needs at least 2 inputs")
    bad = [v for v in values if not 0.0 <= v <= 1.0]
    if bad:
        raise ParameterError(f"preference grid values must lie in [0, 1], got {bad[0]}")
    out = []
    for head in itertools.product(values, repeat=n - 1):
        last = round(1.0 - sum(head), 10)
        if last >= 0.0:
            out.append((*head, last))
    return out


def _decimals(numbers: Sequence[float]) -> int:
    for d in range(2, 7):
        if all(abs(round(x, d) - x) < 1e-9 for x in numbers):
            return d
    return 6


@dataclass
class SweepPoint:
    value: Any
    """The preference vector (tuple) or the scalar parameter value of this model."""
    result: MergeResult


@dataclass
class SweepResult:
    path: str
    param: str
    points: list[SweepPoint] = field(default_factory=list)


@scoped  # hub_only: the inputs' text alone decides, before anything local is looked at
@keeps_inputs  # every point merges the same inputs: downloaded once into the Hub cache
def sweep(inputs: Sequence[str], method: str, out_dir: str, grid: str | Sequence[float], *, param: str = "lambdas",
          base: str | None = None, params: dict[str, Any] | None = None, options: MergeOptions | None = None,
          **kwargs: Any) -> SweepResult:
    """Merge ``inputs`` once per grid point into ``out_dir/<param>-<value>/``.

    Args:
        inputs, method, base: as for :func:`hubsoup.merge`.
        out_dir: folder holding one model per grid point and ``sweep.json``.
        grid: ``"start:stop:step"``, ``"a,b,c"`` or a list of numbers.
        param: the swept parameter; ``lambdas`` (default) sweeps preference vectors on the simplex.
        params: the method's other parameters (``param`` must not be among them).
        options: as :func:`hubsoup.merge` (or their names as keywords: ``dtype=``, ``device=``, ...).
        kwargs: ``output_format``/``rank``/``energy`` as :func:`hubsoup.merge`; anything else is a
            method parameter.
    """
    check_specs(inputs=inputs, base=base)
    opts, rest = MergeOptions.split(kwargs, options)
    merge_kwargs = {k: rest.pop(k) for k in _OUTPUT_KEYS if k in rest}
    fixed = {**(params or {}), **rest}
    if param in fixed:
        raise ParameterError(f"parameter '{param}' is swept; do not also give it a fixed value")
    values = parse_grid(grid)
    points: list[Any] = simplex_grid(len(inputs), values) if param == "lambdas" else values
    d = _decimals([x for p in points for x in (p if isinstance(p, tuple) else (p,))])
    prefix = "lambda" if param == "lambdas" else param

    def folder_name(p: float | tuple[float, ...]) -> str:
        return prefix + "-" + "-".join(f"{x:.{d}f}" for x in (p if isinstance(p, tuple) else (p,)))

    check_output(out_dir, opts.overwrite)
    # the lock on `out_dir` for the whole sweep; the models go into its temporary folder, renamed at the end
    folder = OutputFolder(out_dir, overwrite=opts.overwrite)
    result = SweepResult(folder.target, param)
    monitor = opts.monitor()  # progress: each point's merge gets its share of [0, 1]; cancel: checked by each
    try:
        # points differing only in what the merge reads (λ) share the statistics
        with shared_statistics(scratch=folder.path):
            for i, p in enumerate(points):
                value = ",".join(repr(x) for x in p) if isinstance(p, tuple) else p
                point_opts = opts.replace(overwrite=False, quiet=opts.silent,
                                          progress=monitor.child(i / len(points), (i + 1) / len(points))
                                          if monitor.reporting else None)
                res = merge(inputs, method, base=base, out=os.path.join(folder.path, folder_name(p)),
                            params={**fixed, param: value}, options=point_opts, **merge_kwargs)
                # the card's "how to use" names the model's final place, not the temporary folder
                res.path = os.path.join(folder.target, folder_name(p))
                res.write_card(os.path.join(folder.path, folder_name(p)))
                result.points.append(SweepPoint(p, res))
        index = {"method": method, "param": param, "grid": grid if isinstance(grid, str) else list(values),
                 "points": [{"value": list(pt.value) if isinstance(pt.value, tuple) else pt.value,
                             "path": os.path.basename(pt.result.path), "recipe_hash": pt.result.recipe.hash}
                            for pt in result.points]}
        with open(os.path.join(folder.path, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
        monitor.check("before the output was committed")
        folder.commit()
    except BaseException as e:
        raise folder.fail(e)  # a failed sweep leaves the old output (if any) as it was, and no temporary folder
    if monitor.reporting:
        monitor.finish(f"{len(points)} models in {folder.target}")
    return result

