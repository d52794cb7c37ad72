"""``hubsoup run RECIPE [OUT]``: repeat a merge from its ``hubsoup_recipe.yaml``, or run a mergekit config.

Takes ``mergekit-yaml CONFIG OUT_PATH``'s arguments too, so one command swaps for the other:
flags with a meaning here are honoured, the others are accepted with one warning each.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Sequence

from hubsoup.errors import ParameterError
from hubsoup.hubclient import pushed_line
log = logging.getLogger(__name__)

# mergekit-yaml's flags with no meaning for hubsoup: name -> why (each accepted with a warning)
_IGNORED = {
    "--allow-crimes": "hubsoup still refuses inputs of another architecture, naming the field that differs",
    "--trust-remote-code": "hubsoup reads safetensors and configs only; it never runs a model's code to merge",
    "--lazy-unpickle": "hubsoup streams tensors from safetensors; pickle checkpoints need --allow-pickle",
    "--low-cpu-memory": "hubsoup streams tensor by tensor whatever the device",
    "--read-to-gpu": "inputs are read on the host and copied to --device",
    "--multi-gpu": "use --device-map with hubsoup merge to spread blocks over GPUs",
    "--gpu-rich": "use --cuda (or --device) for the device",
    "--async-write": "hubsoup's writer already overlaps with the merge",
    "--clone-tensors": "repeated layers are written as separate tensors anyway",
    "--safe-serialization": "the output is always safetensors",
    "--write-model-card": "hubsoup always writes its model card",
    "--transformers-cache": "hubsoup uses huggingface_hub's cache (HF_HOME / HF_HUB_CACHE)",
    "--lora-merge-cache": "LoRA adapters are applied tensor by tensor, never saved as a merged copy",
    "--lora-merge-dtype": "LoRA adapters are applied in float32, tensor by tensor",
    "--write-threads": "the writer's threads are hubsoup's own",
}


def _parse_params(text: str) -> int:
    """mergekit's SIZE for --out-shard-size: a number of parameters, with K/M/B suffixes (5B)."""
    t = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult != 1 else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 5B, 500M)") from None


def run(args: argparse.Namespace) -> int:
    out = args.out or args.out_path
    if not out and not args.push:
        raise ParameterError("give the output folder: hubsoup run RECIPE OUT (or --out OUT), or a Hub repo to "
                             "stream the output to: --push ORG/NAME")
    if args.out and args.out_path and args.out != args.out_path:
        raise ParameterError(f"two output folders given ('{args.out_path}' and --out '{args.out}')")
    if not args.push and (args.private or args.create_pr or args.commit_message or args.allow_private_inputs):
        raise ParameterError("--private, --create-pr, --commit-message and --allow-private-inputs need --push ORG/NAME")
    push = None
    if args.push:
        from hubsoup.hub import PushTarget  # lazy: keeps hubsoup --help free of torch

        push = PushTarget(args.push, private=args.private or None, create_pr=args.create_pr,
                          commit_message=args.commit_message, allow_private_inputs=args.allow_private_inputs or None)
    for flag in args.mergekit_ignored or []:
        log.warning("%s: accepted for mergekit-yaml compatibility, no effect here (%s)", flag, _IGNORED[flag])
    if args.unsafe_truncate_embeddings:
        raise ParameterError("--unsafe-truncate-embeddings is not supported: give the config a tokenizer section "
                             "(tokenizer_source: union, or a model) so the embeddings are mapped by token")
    if args.num_threads:
        import torch  # lazy: keeps hubsoup --help free of torch

        torch.set_num_threads(args.num_threads)  # hubsoup's lanes follow torch's thread count
    from hubsoup.workflows.rerun import run_recipe  # lazy: keeps hubsoup --help free of torch

    device = args.device or ("cuda" if args.cuda else "cpu")
    source = args.recipe
    if args.hub_only:  # the operator's file, read here; the models it names must be Hub repo IDs
        from hubsoup.untrusted import MAX_YAML_BYTES  # lazy: keeps hubsoup --help free of yaml

        try:
            with open(source, encoding="utf-8") as f:
                source = f.read(MAX_YAML_BYTES + 1)
        except OSError as e:
            raise ParameterError(f"recipe '{args.recipe}' cannot be read ({e.strerror})") from None
    extra = {"push": push} if push is not None else {}
    result = run_recipe(source, out, overwrite=args.overwrite, device=device, quiet=args.quiet,
                        hub_only=args.hub_only, copy_tokenizer=args.copy_tokenizer, random_seed=args.random_seed,
                        out_shard_params=args.out_shard_size, intermediate_dir=args.intermediate_dir, **extra)
    print(result)
    if result.pushed is not None:
        print(pushed_line(args.push, result.pushed))
        if result.pushed.pr_url:
            print(f"pull request: {result.pushed.pr_url}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("run", help="repeat a merge from its hubsoup_recipe.yaml, or run a mergekit config",
                       description="Merge again exactly as a recipe says (Hub inputs pinned to the recorded SHAs). "
                                   "RECIPE is a hubsoup_recipe.yaml or an output folder holding one, or a mergekit "
                                   "YAML config (merge_method, models or slices, ...) as model cards carry it, or a "
                                   "stream of them (mergekit-multi's stages, named with 'name:'): it is merged with "
                                   "mergekit's semantics (model folders relative to the working folder, as mergekit "
                                   "resolves them). mergekit-yaml's arguments work too: "
                                   "'hubsoup run CONFIG OUT_PATH --cuda --out-shard-size 1B'.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # examples: cli/manners.py
    p.add_argument("recipe", help="hubsoup_recipe.yaml, an output folder, or a mergekit config")
    p.add_argument("out_path", nargs="?", help="output folder (as mergekit-yaml's OUT_PATH)")
    p.add_argument("--out", "-o", help="output folder")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--device", default=None, help="device for the arithmetic (default cpu)")
    p.add_argument("--cuda", action=argparse.BooleanOptionalAction, default=False,
                   help="mergekit-yaml's --cuda: the same as --device cuda")
    p.add_argument("--quiet", "-q", action="store_true")
    g = p.add_argument_group("mergekit-yaml options")
    g.add_argument("--out-shard-size", type=_parse_params, default=None, metavar="SIZE",
                   help="parameters per output shard (5B), as mergekit counts them")
    g.add_argument("--copy-tokenizer", action=argparse.BooleanOptionalAction, default=True,
                   help="write the tokenizer into the output (default: yes)")
    g.add_argument("--random-seed", type=int, default=None, help="seed of the random methods (DARE, DELLA)")
    g.add_argument("--num-threads", "-j", type=int, default=None, help="CPU threads (torch's, which hubsoup's lanes follow)")
    g.add_argument("--intermediate-dir", default=None,
                   help="multi-stage configs: where named stages are written (default: .OUT.stages beside OUT)")
    g.add_argument("--unsafe-truncate-embeddings", action=argparse.BooleanOptionalAction, default=False,
                   help=argparse.SUPPRESS)
    for flag in _IGNORED:
        takes_value = flag in ("--transformers-cache", "--lora-merge-cache", "--lora-merge-dtype", "--write-threads")
        if takes_value:
            g.add_argument(flag, action=_Ignored, nargs=1, help=argparse.SUPPRESS)
        else:
            g.add_argument(flag, "--no-" + flag[2:], action=_Ignored, nargs=0, help=argparse.SUPPRESS)
    p.add_argument("--push", metavar="ORG/NAME",
                   help="stream the output to this Hub repo (created if needed) as it is written, one commit at the "
                        "end; OUT optional (then no local copy); a multi-stage config's intermediate stages stay local")
    p.add_argument("--private", action="store_true", help="with --push: create the repo private")
    p.add_argument("--create-pr", action="store_true", help="with --push: open a pull request instead of committing")
    p.add_argument("--commit-message", help="with --push: the commit message")
    p.add_argument("--allow-private-inputs", action="store_true",
                   help="with --push: publish a merge of private or gated models to a public repo anyway")
    p.add_argument("--hub-only", action="store_true",
                   help="RECIPE's models must be Hub repo IDs; no local path is looked at (for servers)")
    p.set_defaults(func=run, mergekit_ignored=None)


class _Ignored(argparse.Action):
    """A mergekit-yaml flag hubsoup accepts and ignores (warned about when the command runs)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        assert option_string is not None  # only flags take this action: argparse passes the flag
        ignored = getattr(namespace, "mergekit_ignored", None) or []
        name = option_string if option_string in _IGNORED else "--" + option_string[len("--no-"):]
        namespace.mergekit_ignored = [*ignored, name]
