"""The command-line flags of :class:`hubsoup.options.MergeOptions`, declared once for every command."""

from __future__ import annotations

import argparse

from hubsoup.errors import ParameterError
from hubsoup.options import SHAPE_POLICIES, MergeOptions


def add_merge_options(p: argparse.ArgumentParser, *, inputs: bool = True) -> None:
    """The options' flags. ``inputs=False`` leaves out the ones fixed elsewhere (a continual state's)."""
    g = p.add_argument_group("merge options")
    g.add_argument("--device", default="cpu", help="device to merge on (cpu, cuda:0, ...) without --device-map")
    g.add_argument("--device-map", metavar="MAP",
                   help="auto, balanced, sequential (accelerate's placement by each block's working set), a JSON "
                        "map {\"model.layers.0\": 0, \"\": \"cpu\"} or a JSON file; blocks on different devices "
                        "are merged concurrently")
    g.add_argument("--max-memory", metavar="SPEC", help="memory per device for the placement: 0=70GiB,1=70GiB,cpu=64GiB")
    g.add_argument("--dtype", help="output dtype (default: the base's): float32, float16, bfloat16")
    g.add_argument("--shard-size", default="5GB", help="maximum shard size (default 5GB)")
    g.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    g.add_argument("--allow-pickle", action="store_true", help="accept pickle .bin checkpoints (can run code!)")
    if inputs:
        g.add_argument("--ignore-extra", action="store_true", help="leave out input tensors the base lacks")
        g.add_argument("--shape-mismatch", default="error", choices=list(SHAPE_POLICIES),
                       help="a tensor whose shape differs from the base's: fail, or merge the base's rows")
    g.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    g.add_argument("--hub-only", action="store_true",
                   help="accept Hub repo IDs only (models, base, tokenizer source, data): refuse every local path "
                        "(for servers; see SECURITY.md)")
    g.add_argument("--max-download", metavar="SIZE", help="download at most SIZE in this run (e.g. 20GB), checked "
                                                          "from the Hub's file sizes before downloading")
    g.add_argument("--allow-private-inputs", action="store_true",
                   help="allow pushing a merge of private or gated inputs to a public repo (the card says so)")


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


def output_format(args: argparse.Namespace) -> dict:
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
