"""The ``hubsoup`` command line. Every command calls the Python API.

Signals first: when this process is the ``hubsoup`` command (its console script or ``python -m hubsoup``), a
Ctrl-C or SIGTERM is recorded from the package's first line on (``hubsoup/__init__.py``), before the other
imports, and :func:`main` installs the raising handlers before anything else: a signal at any moment ends the
command with one line (exit 130 / 143); see :mod:`hubsoup.cli.signals`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import traceback
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from hubsoup import __version__
from hubsoup.cli import evolve, export_config, manners, signals, space
from hubsoup.cli.manners import HelpFormatter
from hubsoup.cli.options import add_merge_options, add_output_format, add_params, merge_options, output_format, params
from hubsoup.errors import HubsoupError, OutputExistsError, ParameterError
from hubsoup.hubclient import check_repo_id, install_log_scrubber, pushed_line, quiet_retries, scrub_secrets

if TYPE_CHECKING:
    from hubsoup.api import MergeResult
    from hubsoup.hub import PushTarget
    from hubsoup.options import MergeOptions
    from hubsoup.sources.checkpoint import Checkpoint


def _push_prepare(args: argparse.Namespace) -> str | None:
    """Check --push / --card-template before any merging; the output folder: --out, or with --push none (the output
    is streamed to the Hub, nothing stays on disk), but ``./NAME`` for a --search (its points are merged locally)."""
    if not args.push and (args.private or args.create_pr or args.commit_message):
        raise ParameterError("--private, --create-pr and --commit-message need --push ORG/NAME")
    if args.push:
        check_repo_id(args.push)
    if args.card_template and getattr(args, "hub_only", False):
        raise ParameterError("--card-template names a local file, and --hub-only accepts no local path")
    if args.card_template and not os.path.isfile(args.card_template):
        raise ParameterError(f"card template '{args.card_template}' not found")
    out = args.out or (os.path.join(".", args.push.split("/")[-1]) if args.push and getattr(args, "search", None)
                       else None)
    if not out and not args.push:
        raise ParameterError("give the output folder with --out, or a Hub repo to stream the output to with "
                             "--push ORG/NAME (both: a local copy too)")
    if args.push and out and os.path.exists(out) and not args.overwrite:
        from hubsoup.hub import retry_command  # lazy: keeps hubsoup --help free of torch

        raise OutputExistsError(f"output '{out}' already exists; pass --overwrite to merge again, or push it as it "
                                f"is with: {retry_command(out, args.push, private=args.private, create_pr=args.create_pr)}")
    return out


def _push_target(args: argparse.Namespace) -> PushTarget | None:
    """--push and its options as the merge's streamed push (None without --push)."""
    if not args.push:
        return None
    from hubsoup.hub import PushTarget  # lazy: keeps hubsoup --help free of torch

    return PushTarget(args.push, private=args.private or None, create_pr=args.create_pr,
                      commit_message=args.commit_message)


def _card_hook(args: argparse.Namespace) -> Callable[[MergeResult, str], None] | None:
    """--card-template for a streamed push: the card rendered from it before the commit that publishes it."""
    if not args.card_template:
        return None
    from hubsoup.card import write_card  # lazy: keeps hubsoup --help free of torch

    def hook(result: MergeResult, folder: str) -> None:
        write_card(result, folder, template=args.card_template, repo_id=args.push)

    return hook


def range_text(bounds: Sequence[Any] | None) -> str:
    """A parameter's range as ``hubsoup methods`` shows it: an open end is not shown (it is no bound at all).

    >>> range_text([0.0, 1.0]), range_text([0.0, None]), range_text([None, 2]), range_text([None, None])
    (' range [0.0, 1.0]', ' ≥ 0.0', ' ≤ 2', '')
    """
    lo, hi = (list(bounds) + [None, None])[:2] if bounds else (None, None)
    if lo is not None and hi is not None:
        return f" range [{lo}, {hi}]"
    return f" ≥ {lo}" if lo is not None else (f" ≤ {hi}" if hi is not None else "")


def _push_finish(args: argparse.Namespace, result: MergeResult) -> None:
    """--card-template, then --push: upload the output in one commit (a merge streamed to the Hub is committed
    already) and print the commit URL."""
    if args.card_template and result.pushed is None:
        from hubsoup.card import write_card  # lazy: keeps hubsoup --help free of torch

        write_card(result, result.path, template=args.card_template)
    if not args.push:
        return
    info = result.pushed
    if info is None:
        info = result.push_to_hub(args.push, private=args.private or None, create_pr=args.create_pr,
                                  commit_message=args.commit_message)
    print(pushed_line(args.push, info))
    if info.pr_url:
        print(f"pull request: {info.pr_url}")


def cmd_merge(args: argparse.Namespace) -> int:
    from hubsoup.api import merge  # lazy: keeps hubsoup --help free of torch

    args.out = _push_prepare(args)
    method_params = params(args.param)
    if args.exemplars:  # LOT's `exemplars` parameter, as its own flag
        method_params["exemplars"] = args.exemplars
    options = dict(base=args.base, params=method_params, options=merge_options(args), **output_format(args))
    if args.search:
        from hubsoup.eval import TaskSpec  # lazy: keeps hubsoup --help free of torch
        from hubsoup.workflows.search import parse_grid, search  # lazy: keeps hubsoup --help free of torch

        if not args.eval:
            raise ParameterError("--search needs validation tasks to score each point: give --eval SPEC")
        grid = parse_grid(*args.search, method=args.method)
        print(f"searching {' x '.join(f'{k} ({len(v)})' for k, v in grid.items())} on validation data ...")
        found = search(args.inputs, args.method, out=args.out, grid=grid, executor=args.executor,
                       tasks=[TaskSpec.parse(t) for t in args.eval], limit=args.eval_limit, **options)
        print(f"best {found.best} ({found.selection}: {found.best_score:.4f})")
        result = found.result
    else:
        if args.executor != "local":
            raise ParameterError("--executor runs a --search's points: give --search KEY=GRID")
        # with --push the output is streamed to the Hub as it is written (a local copy only with --out)
        result = merge(args.inputs, args.method, out=args.out, evaluate=args.eval, eval_limit=args.eval_limit,
                       push=_push_target(args), before_push=_card_hook(args), **options)
    print(result)
    for r in result.evaluation:
        print(f"  eval {r.task.name}: " + "  ".join(f"{k}={v:.4f}" for k, v in r.metrics.items()))
    _push_finish(args, result)
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    from hubsoup.methods import list_methods  # lazy: keeps hubsoup --help free of torch

    for m in list_methods():  # the same description apps get
        if args.name and m["name"] != args.name:
            continue
        print(f"{m['name']}: {m['summary']}")
        if m["paper"]:
            print(f"  paper: {m['paper']} {m['paper_url']}")
        lo, hi = m["min_inputs"], m["max_inputs"]
        print(f"  inputs: {lo}" + ("+" if hi is None else ("" if hi == lo else f"-{hi}")))
        for row in m["params"]:
            rng = range_text(row.get("range"))
            what = f"one of {', '.join(map(str, row['choices']))}" if row["type"] == "choice" else row["type"]
            src = f" [{row['evidence'] if row.get('evidence') else row.get('source', 'paper')}]"
            print(f"  --param {row['name']}={row['default']!s:<8} ({what}{rng}) {row.get('help', '')}{src}")
        for line in measured_lines(m["measured"]):
            print(f"  {line}")
        print()
    from hubsoup.methods._schedule import CLI_HELP  # lazy: keeps hubsoup --help free of torch

    print(CLI_HELP)  # per-layer schedules and name filters: every method's numeric parameters
    return 0


def measured_lines(found: Mapping[str, list[dict[str, Any]]]) -> list[str]:
    """``hubsoup methods``' lines on what the quality benchmarks measured of a method at its defaults: the share
    of the fine-tunes' gain per setting, and a caveat for every task the defaults made worse than the base
    (``harms``, issue 46) and every failure of the defaults guard (``guard``).

    Example:
        >>> print("\\n".join(measured_lines({"TIES": [
        ...     {"setting": "encoder lora-8", "kind": "lora", "n_inputs": 8, "defaults": 0.05,
        ...      "interval": [-0.16, 0.22], "tuned": 0.13, "tuned_values": "scale=0.7",
        ...      "harms": [{"task": "pydoc_sys", "size": "3.5 points", "range": "0.8 to 6.1 points",
        ...                 "tuned_too": True}]}]})))
        measured, share of the fine-tunes' gain at the defaults (tuned on validation), benchmarks/results/defaults.md:
          TIES: encoder lora-8 0.05 (0.13 at scale=0.7)
          caveat, TIES at 8 LoRA adapters (encoder lora-8): pydoc_sys 3.5 points worse than the base model (95 % interval 0.8 to 6.1 points), so does the method tuned: check per-task scores
    """
    if not found:
        return []
    out = ["measured, share of the fine-tunes' gain at the defaults (tuned on validation), "
           "benchmarks/results/defaults.md:"]
    caveats = []
    for row, entries in found.items():
        cells = []
        for e in entries:
            tuned = f" ({e['tuned']:.2f} at {e['tuned_values']})" if e.get("tuned") is not None else ""
            cells.append(f"{e['setting']} {e['defaults']:.2f}{tuned}")
            inputs = f"{e.get('n_inputs')} {_KINDS.get(e.get('kind', ''), 'inputs')}"
            for h in e.get("harms", []):
                how = "so does the method tuned" if h.get("tuned_too") else "tuning avoids it"
                caveats.append(f"caveat, {row} at {inputs} ({e['setting']}): {h['task']} {h['size']} worse than the "
                               f"base model (95 % interval {h['range']}), {how}: check per-task scores")
            caveats += [f"caveat, {e['setting']}: {g}: check per-task scores, tune with --search"
                        for g in e.get("guard", [])]
        out.append(f"  {row}: " + "; ".join(cells))
    return out + [f"  {c}" for c in caveats]


_KINDS = {"lora": "LoRA adapters", "full": "full fine-tunes"}


def cmd_plan(args: argparse.Namespace) -> int:
    from hubsoup.sources.access import check_specs, scope  # lazy: keeps hubsoup --help free of torch

    opts = merge_options(args)
    with scope(opts):  # --hub-only: the models' text alone decides, before the disk is looked at
        check_specs(inputs=args.models, base=args.base)
        return _cmd_plan(args, opts)


def _cmd_plan(args: argparse.Namespace, opts: MergeOptions) -> int:
    from hubsoup.plan import Plan  # lazy: keeps hubsoup --help free of torch
    from hubsoup.sources import open_input  # lazy: keeps hubsoup --help free of torch

    from hubsoup.sources.resolve import download_size  # lazy: keeps hubsoup --help free of torch

    def downloads(ckpts: Sequence[Checkpoint | None]) -> None:  # Hub models were read from their headers: what a merge would fetch
        for c in filter(None, ckpts):
            size = download_size(c, opts.token)
            if size is not None:
                todo, total = size
                print(f"download {c.label}: {todo:,} bytes of weights"
                      + (f" ({total - todo:,} of {total:,} already in the Hub cache)" if todo != total else ""))

    if not args.method:  # one model: how its tensors are grouped
        if len(args.models) != 1:
            raise ParameterError("give --method to plan a merge of several models")
        ckpt = open_input(args.models[0], allow_pickle=opts.allow_pickle, token=opts.token, headers_only=True)
        print(Plan.of(ckpt, opts.device).summary())
        downloads([ckpt])
        return 0
    from hubsoup.session import Session, parse_method  # lazy: keeps hubsoup --help free of torch

    m, p = parse_method(args.method, params(args.param))
    m.check_inputs(p, len(args.models))
    lora = args.output_format == "lora"
    # the merge's own session: the inputs from their headers, the plan, the placement and the recipe
    session = Session.open(args.models, m, p, opts, base=args.base, lora_output=lora)
    base, sources, plan, placement = session.base, session.sources, session.plan, session.placement
    print(plan.summary())
    print()
    print(f"merge of {len(sources)} model(s) with {args.method} onto {base.label}: "
          f"{len(plan.blocks)} blocks on {len(placement.devices)} device(s)")
    print(placement.summary())
    downloads([base, *(getattr(t, "ckpt", None) for t in sources)])
    # the run's disk and network (and with --push, its time from a measured bandwidth): before any weight moves
    from hubsoup.api import footprint, measure_merge_seconds  # lazy: keeps hubsoup --help free of torch
    from hubsoup.sources.access import current  # lazy: as above
    from hubsoup.sources.remote import measure_bandwidth  # lazy: as above

    predicted = footprint(session, lora_output=lora, push=bool(args.push), local_copy=False)
    bandwidth = merge_seconds = None
    if args.push:
        got, seconds = measure_bandwidth(list(current().remote_files.values()))
        bandwidth = got / seconds if seconds > 0 else None
        merge_seconds = measure_merge_seconds(plan, m, p, len(sources))
    print()
    for line in predicted.lines(bandwidth=bandwidth, merge_seconds=merge_seconds, max_disk=opts.max_disk_bytes):
        print(line)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from hubsoup.demo import run_demo  # lazy: keeps hubsoup --help free of torch

    run_demo(args.out, quiet=args.quiet)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hubsoup", description="Model soups from the Hugging Face Hub.",
                                formatter_class=HelpFormatter,
                                epilog="examples:\n  hubsoup demo\n  hubsoup merge org/ft-a org/ft-b --method ties "
                                       "--push my-org/soup\n  hubsoup COMMAND --help")
    p.add_argument("--version", action="version", version=f"hubsoup {__version__}")
    # also accepted after the command (hubsoup.cli.manners); these dests are merged in main()
    p.add_argument("--verbose", "-v", action="store_true", dest="top_verbose", help="show tracebacks and debug logs")
    p.add_argument("--quiet", "-q", action="store_true", dest="top_quiet",
                   help="only errors: no progress bars, no warnings")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("merge", help="merge fine-tunes of one base model",
                       description="Merge fine-tunes (local folders or Hub repo IDs, org/name[@revision]).")
    m.add_argument("inputs", nargs="+", help="fine-tuned models: folders or org/name[@revision]")
    m.add_argument("--method", required=True, help="merge method (see `hubsoup methods`)")
    m.add_argument("--base", help="pre-trained base model (default: from the inputs' model cards)")
    add_params(m)
    m.add_argument("--out", "-o", help="output folder (required unless --push ORG/NAME; with --push, a local copy)")
    add_merge_options(m)
    add_output_format(m)
    m.add_argument("--exemplars", action="append", metavar="TASK=PATH_OR_DATASET",
                   help="unlabelled exemplars of one input's task, for data-aware methods (lot); repeat per input. "
                        "TASK: the input as given, its folder/repo name or position; a datasets-loadable file or "
                        "folder, or a Hub dataset ID (org/name[:split])")
    m.add_argument("--eval", action="append", metavar="SPEC",
                   help="evaluate the output on a task (KIND:DATA[,key=value...], see `hubsoup eval -h`); "
                        "results go into the card and eval_results.json (repeatable)")
    m.add_argument("--eval-limit", type=int, metavar="N", help="evaluate on at most N examples per task")
    m.add_argument("--search", action="append", metavar="KEY[=GRID]",
                   help="search a parameter on the --eval tasks (validation data): KEY=lo:hi:step, KEY=a,b,c, or "
                        "KEY alone for the paper's grid; one merge per grid point, the best is kept (repeatable)")
    m.add_argument("--executor", default="local",
                   help="where --search scores its points: local (default), ray (RAY_ADDRESS or a local cluster) "
                        "or ray://HOST:PORT (each point a Ray task, merged in memory; the best written here)")
    m.add_argument("--push", metavar="ORG/NAME",
                   help="stream the output to this Hub repo (created if needed): each shard uploaded as soon as it is "
                        "written, everything committed at once at the end; run again after a failure, it resumes")
    m.add_argument("--private", action="store_true", help="with --push: create the repo private")
    m.add_argument("--create-pr", action="store_true", help="with --push: open a pull request instead of committing to main")
    m.add_argument("--commit-message", help="with --push: the commit message")
    m.add_argument("--card-template", metavar="PATH", help="Jinja template of the model card (default cards/merge.md)")
    m.set_defaults(func=cmd_merge)

    ms = sub.add_parser("methods", help="list merge methods with their parameters")
    ms.add_argument("name", nargs="?", help="show only this method")
    ms.set_defaults(func=cmd_methods)

    pl = sub.add_parser("plan", help="show how a model's tensors are grouped into blocks, or plan a merge",
                        description="With one model: its blocks. With --method: the merge's placement on the "
                                    "devices (--device-map, --max-memory) and each device's predicted peak, from "
                                    "file headers only; a block that fits nowhere is refused (exit 2).")
    pl.add_argument("models", nargs="+", help="a model, or the merge's inputs")
    pl.add_argument("--method", help="plan a merge with this method")
    pl.add_argument("--base", help="pre-trained base model (default: from the inputs' model cards)")
    add_params(pl)
    add_merge_options(pl)
    add_output_format(pl)
    pl.add_argument("--push", metavar="ORG/NAME",
                    help="plan a merge pushed to this repo as it is written: its disk (the shards in flight), network "
                         "in and out, and wall time from a bandwidth measured now (reads up to 8 MB of the inputs)")
    pl.set_defaults(func=cmd_plan)

    d = sub.add_parser("demo", help="fine-tune MiniLM on 3 small real-text tasks, merge, evaluate (no network; its time: the README's first command)")
    d.add_argument("--out", default="hubsoup-demo", help="folder for the demo's models and merge")
    d.add_argument("--quiet", "-q", action="store_true")
    d.set_defaults(func=cmd_demo)
    # further commands live beside this file, one module each with register(subparsers)
    # lazy: binds eval, which at module level would shadow the builtin
    from hubsoup.cli import continual, eval, pipeline, push, run, sweep

    for mod in (eval, push, run, sweep, continual, pipeline, export_config, evolve, space):
        mod.register(sub)
    manners.register(sub, p)  # completion: the script of this whole parser
    manners.polish(p)  # examples in every --help, -v/-q after the command too
    return p


def main(argv: list[str] | None = None) -> int:
    # first of all: a signal from now on unwinds through the cleanup and ends as one line (see cli.signals)
    restore_signals = signals.catch()
    mark = signals.start_mark()  # a signal recorded while the command imported its modules counts too
    verbose, args = False, None
    # outputs committed before this command (main() may run several times in one process); read without importing
    # the output module (it imports torch, which a command such as `hubsoup methods` need not)
    folder_mod = sys.modules.get("hubsoup.output.folder")
    committed = len(folder_mod.COMMITTED) if folder_mod is not None else 0
    hub_mod = sys.modules.get("hubsoup.hub")
    pushed = len(hub_mod.PUSHED) if hub_mod is not None else 0
    sent = len(hub_mod.COMMITTING) if hub_mod is not None else 0

    def left_behind() -> str:  # what an interrupted command says of its output
        folder = sys.modules.get("hubsoup.output.folder")  # not imported: nothing was committed
        hub = sys.modules.get("hubsoup.hub")  # not imported: nothing was pushed
        done = folder.COMMITTED[committed:] if folder is not None else []
        pushes = hub.PUSHED[pushed:] if hub is not None else []
        # a command that makes no output (push) or keeps state on purpose (an evolve study) says its own: a line,
        # or a function giving it (None: nothing to add)
        note: str | Callable[[], str | None] | None = getattr(args, "interrupted_note", None)
        note = note() if callable(note) else note
        if note and not pushes:
            return note
        said = f"the output written before it is complete: {done[-1]}" if done else "no output was left behind"
        repo = getattr(args, "push", None)
        if pushes:
            said += f"; pushed: {pushes[-1]}"
        elif hub is not None and hub.COMMITTING[sent:]:  # a commit went out unanswered: the Hub applies it whole or not
            said += f"; the one commit to {hub.COMMITTING[-1]} was on its way: the repo holds all of it or none"
        elif repo and getattr(args, "command", None) in ("merge", "run"):
            said += f"; nothing was committed to {repo} (run the same command again: it resumes)"
        return said

    def interrupted(sig: int) -> int:
        head = "terminated (SIGTERM)" if sig == signal.SIGTERM else "interrupted"
        print(f"{head}; {left_behind()}", file=sys.stderr)
        return signals.EXIT_CODES[sig]

    try:
        if signals.received(mark) is not None:  # it came while the command was starting
            raise KeyboardInterrupt
        parser = build_parser()
        args = parser.parse_args(argv)
        args.verbose = verbose = args.top_verbose or getattr(args, "verbose", False)
        args.quiet = args.top_quiet or getattr(args, "quiet", False)
        level = logging.DEBUG if args.verbose else (logging.ERROR if args.quiet else logging.WARNING)
        logging.basicConfig(level=level, format="%(levelname)s: %(message)s")
        if signals.the_command():
            # torch, before the command's code imports it: a signal during its import (Python called back from C++)
            # is recorded, then raised here; raised inside, it would abort the process (see signals.recorded)
            with signals.recorded():
                # lazy: keeps hubsoup --help free of torch (every command imports it)
                import torch  # noqa: F401
            if signals.received(mark) is not None:
                raise KeyboardInterrupt
        install_log_scrubber()  # no Hub token in any log line or message
        quiet_retries(show=args.verbose)  # a dropped connection: one error line, not a warning per retried request (-v shows them)
        rc: int = args.func(args)
    except BaseException as e:
        # a signal first: it may arrive as another error (see hubsoup.cli.signals)
        sig = signals.received(mark, e)
        if sig is not None:
            return interrupted(sig)
        if not isinstance(e, HubsoupError):
            raise
        if verbose:
            print(scrub_secrets(traceback.format_exc()), file=sys.stderr, end="")
        print(f"error: {scrub_secrets(e)}", file=sys.stderr)
        return 2
    finally:
        restore_signals()
        if signals.the_command():  # its end is decided: a signal while the interpreter exits is not a second ending
            signals.ignore()
    sig = signals.received(mark)  # a signal whose exception something swallowed: the command still ran to its end
    if sig is not None and rc != signals.EXIT_CODES[sig]:  # (a command that said it itself returns its code)
        return interrupted(sig)
    return rc

if __name__ == "__main__":
    sys.exit(main())
