"""``hubsoup run RECIPE --out DIR``: repeat a merge from its ``hubsoup_recipe.yaml``, or run a mergekit config."""

from __future__ import annotations


def run(args) -> int:
    from hubsoup.recipe import run_recipe

    result = run_recipe(args.recipe, args.out, overwrite=args.overwrite, device=args.device, quiet=args.quiet)
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
    p.set_defaults(func=run)
