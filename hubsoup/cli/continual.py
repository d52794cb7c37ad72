"""``hubsoup continual init|add|export|show``: continual merging (OPCM) with a saved state."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from hubsoup.cli.options import add_merge_options, add_params, merge_options, params
from hubsoup.hubclient import check_repo_id, pushed_line

if TYPE_CHECKING:
    from hubsoup.api import MergeResult


def _check_push(args: argparse.Namespace) -> None:
    if getattr(args, "push", None):
        check_repo_id(args.push)  # before any merging


def _push(args: argparse.Namespace, res: MergeResult) -> None:
    if getattr(args, "push", None):
        info = res.push_to_hub(args.push)  # the whole folder: weights, card and continual_state/
        print(pushed_line(args.push, info))


def cmd_init(args: argparse.Namespace) -> int:
    from hubsoup import continual  # lazy: keeps hubsoup --help free of torch

    _check_push(args)
    res = continual.init(args.models, base=args.base, out=args.out, params=params(args.param),
                         options=merge_options(args))
    _report(args, res)
    return 0


def _report(args: argparse.Namespace, res: MergeResult) -> None:
    """Print the soup and its state, then push if asked."""
    from hubsoup import continual  # lazy: keeps hubsoup --help free of torch

    print(res)
    print(f"continual state: {res.path}/{continual.STATE_DIR} ({len(res.inputs)} model(s), "
          f"λ = {res.stats['opcm.lambda']:.6g})")
    _push(args, res)


def cmd_add(args: argparse.Namespace) -> int:
    from hubsoup import continual  # lazy: keeps hubsoup --help free of torch

    _check_push(args)
    res = continual.add(args.soup, args.models, out=args.out, base=args.base, options=merge_options(args))
    _report(args, res)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from hubsoup import continual  # lazy: keeps hubsoup --help free of torch

    res = continual.export(args.soup, out=args.out, base=args.base, options=merge_options(args))
    print(res)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from hubsoup import continual  # lazy: keeps hubsoup --help free of torch

    st = continual.load_state(args.soup)
    print(f"continual soup {args.soup}: {st.count} model(s), λ = {st.lam:.6g}, ‖S‖ = {st.s_norm:.6g}")
    print(f"  params: {st.params}")
    print(f"  base: {st.base.get('repo_id') or st.base.get('path')} {st.base.get('sha') or ''}".rstrip())
    for i, (m, n) in enumerate(zip(st.models, st.task_norms), 1):
        print(f"  {i}. {m.get('repo_id') or m.get('path') or m.get('spec')} {m.get('sha') or ''}  ‖τ‖ = {n:.6g}")
    return 0


def _common(p: argparse.ArgumentParser, *, out_required: bool, inputs: bool = False) -> None:
    p.add_argument("--out", "-o", required=out_required, help="output folder")
    add_merge_options(p, inputs=inputs)


def _push_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--push", metavar="ORG/NAME",
                   help="upload the new soup, its continual_state/ included, to this Hub repo in one commit")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser("continual", help="continual merging (OPCM): add models to a soup one at a time",
                       description="Continual merging (OPCM). The soup keeps its merge state in continual_state/, "
                                   "so that a model can be added later without the earlier ones.")
    csub = c.add_subparsers(dest="continual_command", required=True)

    i = csub.add_parser("init", help="merge fine-tunes in order and save the state beside the output")
    i.add_argument("models", nargs="+", help="fine-tunes in merge order: folders or org/name[@revision]")
    i.add_argument("--base", help="pre-trained base model (default: from the inputs' model cards)")
    add_params(i, "OPCM parameter: alpha, scaling, zero_diagonal, rank_tol (kept for every later add)")
    _common(i, out_required=True, inputs=True)
    _push_arg(i)
    i.set_defaults(func=cmd_init)

    a = csub.add_parser("add", help="add model(s) to a soup, reading only its state, the base and the new model")
    a.add_argument("soup", help="the soup: a folder or org/name[@revision] holding continual_state/")
    a.add_argument("models", nargs="+", help="the new fine-tune(s), in order")
    a.add_argument("--base", help="the base, when not where the state says (must be the same model)")
    _common(a, out_required=False)
    _push_arg(a)
    a.set_defaults(func=cmd_add)

    e = csub.add_parser("export", help="write the merged model of a soup's state (without the state)")
    e.add_argument("soup")
    e.add_argument("--base", help="the base, when not where the state says (must be the same model)")
    _common(e, out_required=True)
    e.set_defaults(func=cmd_export)

    s = csub.add_parser("show", help="print a soup's continual state: models in order, norms, λ")
    s.add_argument("soup")
    s.set_defaults(func=cmd_show)
