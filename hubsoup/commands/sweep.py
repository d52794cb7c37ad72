"""``hubsoup sweep``: one merge per grid point (e.g. a rewarded-soups Pareto front)."""

from __future__ import annotations


def cmd_sweep(args) -> int:
    from hubsoup.cli import _params
    from hubsoup.sweep import sweep

    extra = {"output_format": args.output_format} if args.output_format != "full" else {}
    if args.rank is not None:
        extra["rank"] = args.rank
    res = sweep(args.inputs, args.method, args.out, args.grid, param=args.sweep_param, base=args.base,
                params=_params(args.param), overwrite=args.overwrite, quiet=args.quiet, device=args.device,
                dtype=args.dtype, allow_pickle=args.allow_pickle, ignore_extra=args.ignore_extra, **extra)
    for pt in res.points:
        print(f"{pt.value}\t{pt.result.path}")
    print(f"{len(res.points)} model(s) in {res.path} (index: sweep.json)")
    return 0


def register(sub) -> None:
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
    p.add_argument("--param", "-p", action="append", metavar="KEY=VALUE", help="fixed method parameter (repeatable)")
    p.add_argument("--out", "-o", required=True, help="output folder for all the models")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", help="output dtype (default: the base's)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--allow-pickle", action="store_true", help="accept pickle .bin checkpoints (can run code!)")
    p.add_argument("--ignore-extra", action="store_true", help="leave out input tensors the base lacks")
    p.add_argument("--output-format", default="full", choices=["full", "lora"],
                   help="full: checkpoints; lora: PEFT adapters of the base (as `hubsoup merge`)")
    p.add_argument("--rank", type=int, help="LoRA output: rank of every module")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_sweep)
