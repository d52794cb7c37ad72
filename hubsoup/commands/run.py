"""``hubsoup run RECIPE --out DIR``: repeat a merge from its ``hubsoup_recipe.yaml``."""

from __future__ import annotations

import os
from typing import Any

from hubsoup.errors import ParameterError


def recipe_merge_args(recipe) -> tuple[list[str], dict[str, Any]]:
    """The ``hubsoup.merge`` arguments that repeat ``recipe`` exactly (Hub inputs pinned to their SHAs)."""
    def spec(ref: dict) -> str:
        if ref.get("repo_id"):
            return f"{ref['repo_id']}@{ref['sha']}" if ref.get("sha") else ref["repo_id"]
        return ref.get("path") or ref["spec"]

    kwargs: dict[str, Any] = {"method": recipe.method, "base": spec(recipe.base), "params": dict(recipe.params),
                              "dtype": recipe.dtype}
    kwargs.update((recipe.extra or {}).get("options") or {})
    output = (recipe.extra or {}).get("output") or {}
    if output.get("format") == "lora":
        kwargs.update(output_format="lora", rank=output.get("rank"), energy=output.get("energy"))
    return [spec(i) for i in recipe.inputs], kwargs


def run_recipe(path: str, out: str, **overrides: Any):
    """Merge again from a recipe file (or an output folder holding one); returns the MergeResult."""
    from hubsoup.api import merge
    from hubsoup.recipe import RECIPE_FILE, Recipe

    if os.path.isdir(path):
        path = os.path.join(path, RECIPE_FILE)
    if not os.path.isfile(path):
        raise ParameterError(f"recipe '{path}' not found")
    try:
        with open(path, encoding="utf-8") as f:
            recipe = Recipe.from_yaml(f.read())
    except Exception as e:  # noqa: BLE001 - a malformed file gets one clear line
        raise ParameterError(f"recipe '{path}' cannot be read: {e}") from e
    inputs, kwargs = recipe_merge_args(recipe)
    result = merge(inputs, out=out, **{**kwargs, **overrides})
    if result.recipe.hash != recipe.hash:
        import logging

        logging.getLogger(__name__).warning("recipe hash changed (%s -> %s): an input or parameter differs",
                                            recipe.hash[:12], result.recipe.hash[:12])
    return result


def run(args) -> int:
    result = run_recipe(args.recipe, args.out, overwrite=args.overwrite, device=args.device, quiet=args.quiet)
    print(result)
    return 0


def register(sub) -> None:
    p = sub.add_parser("run", help="repeat a merge from its hubsoup_recipe.yaml",
                       description="Merge again exactly as a recipe says (Hub inputs pinned to the recorded SHAs). "
                                   "RECIPE is a hubsoup_recipe.yaml or an output folder holding one.")
    p.add_argument("recipe")
    p.add_argument("--out", "-o", required=True, help="output folder")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quiet", "-q", action="store_true")
    p.set_defaults(func=run)
