"""``hubsoup sweep``: one merge per grid point (e.g. a rewarded-soups Pareto front)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hubsoup.cli.options import add_merge_options, add_output_format, add_params, merge_options, output_format, params

if TYPE_CHECKING:
    import argparse


def cmd_sweep(args: argparse.Namespace) -> int:
    from hubsoup.workflows.sweep import sweep  # lazy: keeps hubsoup --help free of torch

    res = sweep(args.inputs, args.method, args.out, args.grid, param=args.sweep_param, base=args.base,
                params=params(args.param), options=merge_options(args), **output_format(args))
    for pt in res.points:
        print(f"{pt.value}\t{pt.result.path}")
    print(f"{len(res.points)} model(s) in {res.path} (index: sweep.json)")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sweep", help="merge once per grid point (preference vectors for a Pareto front, or one parameter)",
        description="Write one merged model per grid point into OUT/<param>-<value>/ plus OUT/sweep.json. "
                    "Default: sweep the `lambdas` preference vector on the simplex, e.g. "
                    "`hubsoup sweep pol-a pol-b --base sft --method rewarded_soups --grid 0:1:0.1 --out front` "
                    "gives lambdas (0,1), (0.1,0.9), ..., (1,0).")
    p.add_argument("inputs", nargs="+", help="fine-tuned models or adapters: folders or org/name[@revision]")
    p.add_argument("--method", required=True, help="merge method (see `hubsoup methods`)")
    p.add_argument("--grid", "--sweep", required=True, metavar="START:STOP:STEP",
                   help="grid values, both ends included (or comma-separated values)")
    p.add_argument("--sweep-param", default="lambdas",
                   help="parameter to sweep (default lambdas: preference vectors over the inputs; "
                        "any scalar parameter such as beta otherwise)")
    p.add_argument("--base", help="pre-trained / SFT base model (default: from the inputs' model cards)")
    add_params(p, "fixed method parameter (repeatable)")
    p.add_argument("--out", "-o", required=True, help="output folder for all the models")
    add_merge_options(p)
    add_output_format(p)
    p.set_defaults(func=cmd_sweep)
