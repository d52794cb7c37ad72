"""``hubsoup eval MODEL --task SPEC ...``"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse


def run(args: argparse.Namespace) -> int:
    from hubsoup.eval import TaskSpec, evaluate_model  # lazy: keeps hubsoup --help free of torch
    from hubsoup.eval.run import write_results  # lazy: keeps hubsoup --help free of torch

    tasks = [TaskSpec.parse(s) for s in args.task]
    for task in tasks:  # what `merge --eval` checks before merging: data, columns, heads, lm-eval task names
        task.check()
    results = evaluate_model(args.model, tasks, batch_size=args.batch_size, limit=args.limit, device=args.device,
                             tokenizer=args.tokenizer, quiet=args.quiet)
    for r in results:
        shown = "  ".join(f"{k}={v:.4f}" for k, v in r.metrics.items())
        print(f"{r.task.name:<24} n={r.n_examples:<6} {shown}")
    if args.json:
        write_results(results, args.json)
        print(f"results written to {args.json}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("eval", help="evaluate a model on classification / perplexity tasks",
                       description="Evaluate a model folder or Hub repo. TASK: KIND:DATA[,key=value...], e.g. "
                                   "classification:val.csv,text=sentence,label=label or perplexity:test.jsonl,text=text")
    p.add_argument("model")
    p.add_argument("--task", "-t", action="append", required=True, metavar="SPEC", help="task spec (repeatable)")
    p.add_argument("--limit", type=int, help="at most N examples per task")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokenizer", help="tokenizer folder or repo (default: the model's)")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--quiet", "-q", action="store_true")
    p.set_defaults(func=run)
