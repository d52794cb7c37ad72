"""The command-line flags of :class:`hubsoup.options.MergeOptions`, generated from its fields for every command."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from hubsoup.errors import ParameterError
from hubsoup.options import MergeOptions


def add_merge_options(p: argparse.ArgumentParser, *, inputs: bool = True) -> None:
    """The options' flags, one per :class:`MergeOptions` field made with :func:`hubsoup.options.flag` (its name,
    default, help, metavar, choices; a bool is a switch), in the fields' order. ``inputs=False`` leaves out the
    rules about the inputs, which a continual state fixes."""
    g = p.add_argument_group("merge options")
    for f in fields(MergeOptions):
        meta = f.metadata
        if "help" not in meta or (meta["inputs"] and not inputs):
            continue
        names = ("--" + f.name.replace("_", "-"), *meta["also"])
        if f.type == "bool":
            g.add_argument(*names, action="store_true", help=meta["help"])
            continue
        kw: dict[str, Any] = {k: meta[k] for k in ("metavar",) if k in meta}
        if "choices" in meta:
            kw["choices"] = list(meta["choices"])
        g.add_argument(*names, default=f.default, help=meta["help"], **kw)


def merge_options(args: argparse.Namespace) -> MergeOptions:
    """The :class:`MergeOptions` the parsed flags give (flags a command lacks keep their defaults)."""
    given = {name: getattr(args, name) for name in MergeOptions.names() if hasattr(args, name)}
    return MergeOptions(**given)


def add_output_format(p: argparse.ArgumentParser, *, energy: bool = True) -> None:
    g = p.add_argument_group("output format")
    g.add_argument("--output-format", default="full", choices=["full", "lora"],
                   help="full: a checkpoint; lora: a PEFT adapter of the base (truncated SVD of the merged task vector)")
    g.add_argument("--rank", type=int, help="LoRA output: rank of every module (the cap with --energy)")
    if energy:
        g.add_argument("--energy", type=float, help="LoRA output: per module, the smallest rank keeping this "
                                                    "fraction of the squared Frobenius norm")


def output_format(args: argparse.Namespace) -> dict[str, Any]:
    """``output_format``/``rank``/``energy`` keyword arguments, only those given."""
    out = {}
    if getattr(args, "output_format", "full") != "full":
        out["output_format"] = args.output_format
    for k in ("rank", "energy"):
        if getattr(args, k, None) is not None:
            out[k] = getattr(args, k)
    return out


def add_params(p: argparse.ArgumentParser, help: str = "method parameter (repeatable)") -> None:
    p.add_argument("--param", "-p", action="append", metavar="KEY=VALUE", help=help)


def params(pairs: list[str] | None) -> dict[str, str]:
    """``--param KEY=VALUE`` pairs as a dict."""
    out = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ParameterError(f"--param expects KEY=VALUE, got {pair!r}")
        k, v = pair.split("=", 1)
        out[k.strip()] = v.strip()
    return out
