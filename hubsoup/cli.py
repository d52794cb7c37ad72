"""The ``hubsoup`` command line. Every command calls the Python API."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

from hubsoup import __version__
from hubsoup.errors import HubsoupError, ParameterError


def _params(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ParameterError(f"--param expects KEY=VALUE, got {pair!r}")
        k, v = pair.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def cmd_merge(args) -> int:
    from hubsoup.api import merge

    result = merge(args.inputs, args.method, base=args.base, out=args.out, params=_params(args.param),
                   device=args.device, dtype=args.dtype, shard_size=args.shard_size, overwrite=args.overwrite,
                   allow_pickle=args.allow_pickle, ignore_extra=args.ignore_extra,
                   shape_mismatch=args.shape_mismatch, quiet=args.quiet)
    print(result)
    return 0


def cmd_methods(args) -> int:
    from hubsoup.methods import available
    from hubsoup.params import describe

    for name, cls in available().items():
        if args.name and name != args.name:
            continue
        print(f"{name}: {cls.summary}")
        if cls.paper:
            print(f"  paper: {cls.paper} {cls.paper_url}")
        n = f"{cls.min_inputs}" + ("+" if cls.max_inputs is None else ("" if cls.max_inputs == cls.min_inputs else f"-{cls.max_inputs}"))
        print(f"  inputs: {n}")
        for row in describe(cls.Params):
            rng = f" range {list(row['range'])}" if row.get("range") else ""
            src = " [ours]" if row.get("source") == "ours" else ""
            print(f"  --param {row['name']}={row['default']!s:<8} ({row['type']}{rng}) {row.get('help', '')}{src}")
        print()
    return 0


def cmd_plan(args) -> int:
    from hubsoup.plan import build_plan, tied_groups
    from hubsoup.sources import open_input

    ckpt = open_input(args.model, allow_pickle=args.allow_pickle)
    keys = ckpt.keys()
    plan = build_plan(keys, {k: ckpt.info(k) for k in keys}, ckpt.config, ties=tied_groups(ckpt.folder, keys),
                      device=args.device)
    print(plan.summary())
    return 0


def cmd_demo(args) -> int:
    from hubsoup.demo import run_demo

    run_demo(args.out, quiet=args.quiet)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hubsoup", description="Model soups from the Hugging Face Hub.")
    p.add_argument("--version", action="version", version=f"hubsoup {__version__}")
    p.add_argument("--verbose", "-v", action="store_true", help="show tracebacks and debug logs")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("merge", help="merge fine-tunes of one base model",
                       description="Merge fine-tunes (local folders or Hub repo IDs, org/name[@revision]).")
    m.add_argument("inputs", nargs="+", help="fine-tuned models: folders or org/name[@revision]")
    m.add_argument("--method", required=True, help="merge method (see `hubsoup methods`)")
    m.add_argument("--base", help="pre-trained base model (default: from the inputs' model cards)")
    m.add_argument("--param", "-p", action="append", metavar="KEY=VALUE", help="method parameter (repeatable)")
    m.add_argument("--out", "-o", required=True, help="output folder")
    m.add_argument("--device", default="cpu", help="device to merge on (cpu, cuda:0, ...)")
    m.add_argument("--dtype", help="output dtype (default: the base's): float32, float16, bfloat16")
    m.add_argument("--shard-size", default="5GB", help="maximum shard size (default 5GB)")
    m.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    m.add_argument("--allow-pickle", action="store_true", help="accept pickle .bin checkpoints (can run code!)")
    m.add_argument("--ignore-extra", action="store_true", help="leave out input tensors the base lacks")
    m.add_argument("--shape-mismatch", default="error", choices=["error", "base-slice"],
                   help="a tensor whose shape differs from the base's: fail, or merge the base's rows")
    m.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    m.set_defaults(func=cmd_merge)

    ms = sub.add_parser("methods", help="list merge methods with their parameters")
    ms.add_argument("name", nargs="?", help="show only this method")
    ms.set_defaults(func=cmd_methods)

    pl = sub.add_parser("plan", help="show how a model's tensors are grouped into blocks")
    pl.add_argument("model")
    pl.add_argument("--device", default="cpu")
    pl.add_argument("--allow-pickle", action="store_true")
    pl.set_defaults(func=cmd_plan)

    d = sub.add_parser("demo", help="build a small base and fine-tunes locally and merge them (no network)")
    d.add_argument("--out", default="hubsoup-demo", help="folder for the demo's models and merge")
    d.add_argument("--quiet", "-q", action="store_true")
    d.set_defaults(func=cmd_demo)
    # further commands live in hubsoup/commands/, one module each with register(subparsers)
    import importlib
    import pkgutil

    import hubsoup.commands as commands

    for mod in pkgutil.iter_modules(commands.__path__):
        importlib.import_module(f"hubsoup.commands.{mod.name}").register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        return args.func(args)
    except HubsoupError as e:
        if args.verbose:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; no output was left behind", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
