"""``hubsoup export-config RECIPE_OR_OUTPUT [-o FILE]``: the mergekit config equivalent of a hubsoup merge."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from hubsoup.errors import ParameterError

if TYPE_CHECKING:
    import argparse


def export(args: argparse.Namespace) -> int:
    from hubsoup.formats.mergekit import export_config  # lazy: keeps hubsoup --help free of torch
    from hubsoup.recipe import RECIPE_FILE, Recipe  # lazy: keeps hubsoup --help free of torch

    path = args.recipe
    if os.path.isdir(path):
        path = os.path.join(path, RECIPE_FILE)
    if not os.path.isfile(path):
        raise ParameterError(f"recipe '{path}' not found")
    with open(path, encoding="utf-8") as f:
        try:
            recipe = Recipe.from_yaml(f.read())
        except ParameterError as e:
            raise ParameterError(f"recipe '{path}': {e}") from None
    stored = None
    if os.path.isdir(args.recipe):  # the output's stored dtype, for a recipe that kept the base's
        cfg_path = os.path.join(args.recipe, "config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
            stored = cfg.get("torch_dtype") or cfg.get("dtype")
            stored = stored if isinstance(stored, str) else None
    text = export_config(recipe, out_dtype=stored)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.output}")
    else:
        print(text, end="" if text.endswith("\n") else "\n")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("export-config", help="write the mergekit config equivalent of a hubsoup recipe",
                       description="Print (or write with -o) the mergekit YAML config that reproduces a hubsoup "
                                   "merge: RECIPE is a hubsoup_recipe.yaml or an output folder holding one. A merge "
                                   "run from a mergekit config gives that config back; a method or option mergekit "
                                   "lacks (sftm, lines, TIES with convention=paper, ...) is an error naming it.")
    p.add_argument("recipe", help="hubsoup_recipe.yaml or an output folder")
    p.add_argument("--output", "-o", metavar="FILE", help="write the config to FILE instead of printing it")
    p.set_defaults(func=export)
