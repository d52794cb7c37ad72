"""``hubsoup push DIR ORG/NAME``: upload a merge output folder to the Hub in one commit."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from hubsoup.hubclient import check_repo_id, pushed_line

if TYPE_CHECKING:
    import argparse


def cmd_push(args: argparse.Namespace) -> int:
    from hubsoup.api import note_restricted_inputs  # lazy: keeps hubsoup --help free of torch
    from hubsoup.hub import push_folder, retarget_card  # lazy: keeps hubsoup --help free of torch

    check_repo_id(args.repo_id)
    # what a Ctrl-C says: a push removes nothing, and its one commit is on the Hub whole or not at all
    args.interrupted_note = (f"'{args.folder}' is intact; the push to {args.repo_id} is one commit, on the Hub only "
                             "if it landed before the interruption: run the same command again (a push that landed "
                             "makes no new commit)")
    if os.path.isdir(args.folder):
        retarget_card(args.folder, args.repo_id)  # the card's "how to use" loads the repo, not the folder
    info = push_folder(args.folder, args.repo_id, private=args.private or None, create_pr=args.create_pr,
                       commit_message=args.commit_message, allow_private_inputs=args.allow_private_inputs, card_writer=note_restricted_inputs)
    print(pushed_line(args.repo_id, info))
    if info.pr_url:
        print(f"pull request: {info.pr_url}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "push", help="upload an output folder to a Hub repo (created if needed) in one commit",
        description="Upload FOLDER (weights, config, tokenizer, model card, recipe) to the Hub repo ORG/NAME in one "
                    "commit, creating the repo if needed, and print the commit URL. Pushing the same folder again "
                    "makes no new commit, so a failed push is simply retried. The token comes from HF_TOKEN or "
                    "`hf auth login`.")
    p.add_argument("folder", help="the output folder of a merge")
    p.add_argument("repo_id", metavar="ORG/NAME", help="target repo")
    p.add_argument("--private", action="store_true", help="create the repo private (an existing repo keeps its visibility)")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing to main")
    p.add_argument("--commit-message", help="the commit message (default: Upload <method> merge made with hubsoup)")
    p.add_argument("--allow-private-inputs", action="store_true",
                   help="push a merge of private or gated inputs to a public repo anyway (the card says so)")
    p.set_defaults(func=cmd_push)
