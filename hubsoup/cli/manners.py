"""What every command has: usage examples under ``--help``, ``-v``/``-q`` before or after the command, and
shell completion (``hubsoup completion bash``). Applied once to the whole parser by :func:`polish`.

Example:
    >>> from hubsoup.cli import build_parser
    >>> parser = build_parser()
    >>> "examples:" in parser._subparsers._group_actions[0].choices["merge"].format_help()
    True
"""

from __future__ import annotations

import argparse
import functools
import shlex

EXAMPLES: dict[str, str] = {
    "merge": """
  hubsoup merge org/ft-a org/ft-b --method ties --base org/base -p density=0.5 --out ./soup
  hubsoup merge ./ft-a ./ft-b --method task_arithmetic -p scale=0.4 --push my-org/soup --private
  hubsoup merge org/lora-a org/lora-b --method ties --output-format lora --rank 16 -o ./adapter
  hubsoup merge org/ft-a org/ft-b --method ties --eval classification:val.csv --search density -o ./best""",
    "methods": """
  hubsoup methods            # every method, its paper and parameters
  hubsoup methods dare       # one method""",
    "plan": """
  hubsoup plan org/model                                  # how its tensors are grouped
  hubsoup plan org/ft-a org/ft-b --method ties --device-map auto --max-memory 0=20GiB,cpu=64GiB""",
    "demo": """
  hubsoup demo                       # fine-tune MiniLM on 3 tasks, merge them, evaluate (offline)
  hubsoup demo --out /tmp/demo -q""",
    "eval": """
  hubsoup eval ./soup --task classification:val.csv,name=sentiment
  hubsoup eval org/model --task lm:texts.jsonl --limit 200 --json scores.json""",
    "push": """
  hubsoup push ./soup my-org/soup
  hubsoup push ./soup my-org/soup --create-pr --commit-message "TIES, density 0.5\"""",
    "run": """
  hubsoup run ./soup/hubsoup_recipe.yaml --out ./soup-again      # the same merge, inputs pinned
  hubsoup run mergekit.yml ./merged                              # a mergekit config, as mergekit-yaml
  hubsoup run stages.yml ./final --intermediate-dir ./stages      # mergekit-multi's staged configs""",
    "evolve": """
  hubsoup evolve examples/evolve.yml --out ./evolved              # CMA-ES over the config's space
  hubsoup evolve search.yml --out ./evolved --executor ray        # trials spread over a Ray cluster""",
    "sweep": """
  hubsoup sweep ./ft-a ./ft-b --method task_arithmetic --grid 0:1:0.25 --sweep-param scale --out ./sweep""",
    "continual": """
  hubsoup continual init org/ft-a org/ft-b --base org/base --out ./soup
  hubsoup continual add ./soup org/ft-c --out ./soup-2
  hubsoup continual show ./soup
  hubsoup continual export ./soup --out ./soup-checkpoint""",
    "pipeline": """
  hubsoup pipeline examples/pipelines/pipeline.yml --dry-run
  hubsoup pipeline pipeline.yml --token-env HF_TOKEN --work-dir ./work""",
    "export-config": """
  hubsoup export-config ./soup                  # the mergekit YAML of a hubsoup merge
  hubsoup export-config ./soup -o mergekit.yml""",
    "space": """
  hubsoup space create my-name/soup-space                          # a CPU Space running hubsoup's app
  hubsoup space create my-org/merger --hardware zero-a10g --private
  hubsoup space create my-name/soup-space --dry-run ./space        # write the folder, push nothing""",
    "completion": """
  eval "$(hubsoup completion bash)"                                # this shell
  hubsoup completion bash > ~/.local/share/bash-completion/completions/hubsoup   # every new shell""",
}


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, but an ``examples:`` epilog keeps its lines (descriptions are still wrapped)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:\n"):
            return "\n".join(indent + line for line in text.splitlines())
        return super()._fill_text(text, width, indent)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _has(parser: argparse.ArgumentParser, flag: str) -> bool:
    return flag in parser._option_string_actions


def _add_flags(parser: argparse.ArgumentParser) -> None:
    """``-v``/``-q`` on a subcommand (its own ``--quiet`` stays as it is); defaults suppressed, so an
    absent flag never overwrites the one given before the command."""
    if not _has(parser, "-v") and not _has(parser, "--verbose"):
        parser.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS,
                            help="show tracebacks and debug logs")
    if not _has(parser, "-q") and not _has(parser, "--quiet"):
        parser.add_argument("--quiet", "-q", action="store_true", default=argparse.SUPPRESS,
                            help="only errors: no progress bars, no warnings")


def polish(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> None:
    """Examples, ``-v``/``-q`` and the help formatter on every (sub)command of ``parser``, recursively."""
    for name, sub in _subparsers(parser).items():
        key = name if not path else path[0]
        sub.formatter_class = HelpFormatter
        if not path and key in EXAMPLES and not sub.epilog:
            sub.epilog = "examples:" + EXAMPLES[key]
        elif path and key in EXAMPLES and not sub.epilog:  # a sub-subcommand: its own lines of the examples
            mine = [line for line in EXAMPLES[key].splitlines() if f" {key} {name} " in line + " "]
            if mine:
                sub.epilog = "examples:\n" + "\n".join(mine)
        _add_flags(sub)
        polish(sub, (*path, name))


# --- shell completion --------------------------------------------------------------------------------------

def _options(parser: argparse.ArgumentParser) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """(every option string, option -> its choices, options that take a file or folder)."""
    flags: list[str] = []
    choices: dict[str, list[str]] = {}
    paths: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        flags.extend(action.option_strings)
        if action.option_strings and action.choices:
            for o in action.option_strings:
                choices[o] = [str(c) for c in action.choices]
        if action.option_strings and action.nargs != 0 and (action.metavar in ("PATH", "FILE", "DIR")
                                                             or action.dest in ("out", "output", "card_template",
                                                                                "work_dir", "dry_run", "json")):
            paths.extend(action.option_strings)
    return flags, choices, paths


def bash_script(parser: argparse.ArgumentParser, methods: list[str]) -> str:
    """A bash completion function for ``hubsoup``: commands, their options, choices, method names, paths."""
    q = shlex.quote
    top_flags, _, _ = _options(parser)
    subs = _subparsers(parser)
    cases, value_cases = [], {}
    for name, sub in subs.items():
        flags, choices, paths = _options(sub)
        nested = _subparsers(sub)
        words = [*nested, *flags] if nested else flags
        cases.append(f"    {q(name)}) words={q(' '.join(words))};;")
        for sname, ssub in nested.items():
            sflags, schoices, spaths = _options(ssub)
            cases.append(f"    {q(name + ' ' + sname)}) words={q(' '.join(sflags))};;")
            choices.update(schoices)
            paths.extend(spaths)
        for o, cs in choices.items():
            value_cases[o] = f"compgen -W {q(' '.join(cs))} -- \"$cur\""
        for o in paths:
            value_cases.setdefault(o, "compgen -f -- \"$cur\"")
    value_cases["--method"] = f"compgen -W {q(' '.join(methods))} -- \"$cur\""
    values = "\n".join(f"    {q(o)}) COMPREPLY=($({v})); return;;" for o, v in sorted(value_cases.items()))
    return f"""# bash completion for hubsoup (generated by `hubsoup completion bash`)
_hubsoup() {{
  local cur prev cmd words i w
  cur="${{COMP_WORDS[COMP_CWORD]}}"
  prev="${{COMP_WORDS[COMP_CWORD-1]}}"
  case "$prev" in
{values}
  esac
  cmd=""
  nested={q(' '.join(n for n, s in subs.items() if _subparsers(s)))}
  for ((i=1; i<COMP_CWORD; i++)); do
    w="${{COMP_WORDS[i]}}"
    case "$w" in -*) continue;; esac
    if [[ -z "$cmd" ]]; then cmd="$w"
    elif [[ " $nested " == *" $cmd "* ]]; then cmd="$cmd $w"; break
    else break; fi
  done
  case "$cmd" in
    "") words={q(' '.join([*subs, *top_flags]))};;
{chr(10).join(cases)}
    *) words="";;
  esac
  if [[ -z "$cmd" || "$cur" == -* || " $nested " == *" $cmd "* ]]; then
    COMPREPLY=($(compgen -W "$words" -- "$cur"))
  else
    COMPREPLY=($(compgen -f -- "$cur"))
  fi
}}
complete -o default -F _hubsoup hubsoup
"""


def cmd_completion(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Print the completion script of ``parser`` (the whole ``hubsoup`` parser)."""
    from hubsoup.methods import list_methods  # lazy: keeps hubsoup --help free of torch

    print(bash_script(parser, [m["name"] for m in list_methods()]), end="")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parser: argparse.ArgumentParser) -> None:
    """The ``completion`` command, which describes ``parser`` (the root parser, complete once it is built)."""
    p = sub.add_parser("completion", help="print the shell completion script (bash)",
                       description="Print a bash completion script for hubsoup: commands, options, their choices, "
                                   "the merge methods after --method, and paths. Load it with eval, or save it "
                                   "where bash-completion looks.")
    p.add_argument("shell", choices=["bash"], help="the shell (bash)")
    p.set_defaults(func=functools.partial(cmd_completion, parser=parser))
