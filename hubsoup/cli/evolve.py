"""``hubsoup evolve CONFIG.yml --out DIR``: an evolutionary search over merge recipes (Optuna; local or Ray)."""

from __future__ import annotations

import os
import shlex
from typing import TYPE_CHECKING

from hubsoup.errors import ParameterError

if TYPE_CHECKING:
    import argparse


def cmd_evolve(args: argparse.Namespace) -> int:
    from hubsoup.workflows.evolve import evolve  # lazy: keeps hubsoup --help free of torch

    if not args.push and args.private:
        raise ParameterError("--private needs --push ORG/NAME")

    def kept() -> str | None:  # what an interrupted run says (hubsoup.cli.main): the study stays, resumable
        from hubsoup.workflows.evolve import SEARCH_FILE, STUDY_FILE  # lazy: keeps hubsoup --help free of torch

        if not (os.path.isfile(os.path.join(args.out, STUDY_FILE)) or os.path.isfile(os.path.join(args.out, SEARCH_FILE))
                or (os.path.isdir(args.out) and os.listdir(args.out))):
            return None  # refused before the study was opened: nothing kept
        again = " ".join(shlex.quote(a) for a in ("hubsoup", "evolve", args.config, "--out", args.out))
        return (f"the study in {args.out} is kept (trials that finished stay done); run the same command "
                f"again to resume: {again}")

    args.interrupted_note = kept
    res = evolve(args.config, args.out, executor=args.executor, push=args.push, private=args.private or None,
                 quiet=args.quiet)
    done = sum(r["state"] == "complete" for r in res.trials)
    print(f"best trial {res.best_number} of {len(res.trials)} ({done} complete): score {res.best_score:.6g}")
    print(f"  params: {res.best_params}")
    print(f"best model, card and trial table -> {res.path}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("evolve", help="evolutionary search over merge recipes (CMA-ES/TPE/random; local or Ray)",
                       description="Search a merge's parameters (ranges, choices, per-input x per-layer-group "
                                   "gradients) with Optuna, scoring each candidate in memory on the config's eval "
                                   "tasks (hubsoup's or lm-eval's). The study lives in DIR (SQLite) unless the "
                                   "config names a database: run the same command again to resume a killed run. "
                                   "One driver per study: a second driver on the same storage (any host) is "
                                   "refused with the first one's host and pid; a killed driver's lease is taken "
                                   "over (its pid gone on this host, or no heartbeat for 2 minutes). "
                                   "DIR gets the best model (weights, hubsoup_recipe.yaml, card), "
                                   "hubsoup_search.json and hubsoup_search.png. See examples/evolve.yml.")
    p.add_argument("config", help="the evolve config (YAML): base, models, method, space, optimizer, trials, "
                                  "population, seed, eval")
    p.add_argument("--out", "-o", required=True, help="the study's folder (resumed when it holds one)")
    p.add_argument("--executor", default="local",
                   help="local (default), ray (RAY_ADDRESS or a local cluster) or ray://HOST:PORT")
    p.add_argument("--push", metavar="ORG/NAME", help="upload the best model to this Hub repo (once, at the end)")
    p.add_argument("--private", action="store_true", help="with --push: create the repo private")
    p.add_argument("--quiet", "-q", action="store_true", help="print only the result")
    p.set_defaults(func=cmd_evolve)
