"""``hubsoup space create USER/NAME``: a Gradio Space running hubsoup's app (see :mod:`hubsoup.space`)."""

from __future__ import annotations

import argparse

from hubsoup import space
from hubsoup.errors import ParameterError
from hubsoup.space import HARDWARE, TEMPLATES


def hardware_arg(value: str) -> str:
    """``--hardware``: a misspelt name gets "did you mean" (argparse would list every choice); the choices stay on
    the option for completion."""
    try:
        space.check_hardware(value)
    except ParameterError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def cmd_space_create(args: argparse.Namespace) -> int:
    if args.dry_run:
        folder = space.write_space(args.dry_run, args.repo_id, hardware=args.hardware, template=args.template,
                                   private=args.private)
        print(f"wrote the Space's files to {folder} (nothing pushed); upload them with: "
              f"hubsoup space create {args.repo_id}" + (f" --hardware {args.hardware}" if args.hardware != "cpu-basic" else ""))
        return 0
    from huggingface_hub import constants  # lazy: keeps hubsoup --help free of huggingface_hub

    args.interrupted_note = (f"the Space {args.repo_id} gets its files in one commit, there only if it landed before "
                             "the interruption: run the command again with --update")
    info = space.create_space(args.repo_id, hardware=args.hardware, template=args.template, private=args.private,
                              exist_ok=args.update)
    print(f"Space {args.repo_id}: {constants.ENDPOINT}/spaces/{args.repo_id} (commit {info.commit_url})")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("space", help="create a Hugging Face Space running hubsoup's merge app",
                       description="Hugging Face Spaces that run hubsoup's Gradio app.")
    ssub = p.add_subparsers(dest="space_command", required=True)
    c = ssub.add_parser(
        "create", help="create a Gradio Space with hubsoup's app, uploaded in one commit",
        description="Create the Space USER/NAME (Gradio SDK) and upload in one commit: the app, a README with the "
                    "Space's configuration (sign-in with Hugging Face), a requirements.txt and the wheel of this "
                    "hubsoup, built from the running install. CPU hardware pins torch's CPU build; ZeroGPU "
                    "hardware runs each merge in spaces.GPU. The token comes from HF_TOKEN or `hf auth login`.")
    c.add_argument("repo_id", metavar="USER/NAME", help="the Space to create")
    c.add_argument("--hardware", default="cpu-basic", choices=HARDWARE, metavar="HARDWARE", type=hardware_arg,
                   help=f"the Space's hardware (default cpu-basic): {', '.join(HARDWARE)}")
    c.add_argument("--private", action="store_true", help="create the Space private")
    c.add_argument("--template", default="gradio", choices=list(TEMPLATES),
                   help="; ".join(f"{k}: {v}" for k, v in TEMPLATES.items()))
    c.add_argument("--update", action="store_true", help="upload the app again to a Space that exists")
    c.add_argument("--dry-run", metavar="DIR", help="write the Space's files to DIR instead (nothing pushed)")
    c.set_defaults(func=cmd_space_create)
