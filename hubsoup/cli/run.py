"""``hubsoup run RECIPE --out DIR``: repeat a merge from its ``hubsoup_recipe.yaml``, or run a mergekit config."""

from __future__ import annotations

from hubsoup.recipe import run_recipe


def run(args) -> int:
    source = args.recipe
    if args.hub_only:  # the operator's file, read here; the models it names must be Hub repo IDs
        from hubsoup.errors import ParameterError
        from hubsoup.untrusted import MAX_YAML_BYTES

        try:
            with open(source, encoding="utf-8") as f:
                source = f.read(MAX_YAML_BYTES + 1)
        except OSError as e:
            raise ParameterError(f"recipe '{args.recipe}' cannot be read ({e.strerror})") from None
    result = run_recipe(source, args.out, overwrite=args.overwrite, device=args.device, quiet=args.quiet,
                        hub_only=args.hub_only)
    print(result)
    return 0


def register(sub) -> None:
    p = sub.add_parser("run", help="repeat a merge from its hubsoup_recipe.yaml, or run a mergekit config",
                       description="Merge again exactly as a recipe says (Hub inputs pinned to the recorded SHAs). "
                                   "RECIPE is a hubsoup_recipe.yaml or an output folder holding one, or a mergekit "
                                   "YAML config (merge_method, models or slices, ...) as model cards carry it: it "
                                   "is merged with mergekit's semantics (model folders relative to the working "
                                   "folder, as mergekit resolves them).")
    p.add_argument("recipe")
    p.add_argument("--out", "-o", required=True, help="output folder")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quiet", "-q", action="store_true")
    p.add_argument("--hub-only", action="store_true",
                   help="RECIPE's models must be Hub repo IDs; no local path is looked at (for servers)")
    p.set_defaults(func=run)
