"""CLI manners (issue 32, item 5): --help/--version without torch, examples in every --help, -v/-q before or after
the command, "did you mean" for a misspelt --param, bash completion, py.typed shipped in the wheel."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hubsoup.cli import build_parser, main
import paths  # tests/paths.py: the repository's root, wherever a test module sits

ROOT = Path(paths.ROOT)
HEAVY = ("torch", "transformers", "numpy", "safetensors", "huggingface_hub", "yaml", "jinja2")


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_import_no_torch(flag):
    code = (f"import sys\nfrom hubsoup.cli import main\ntry:\n    main([{flag!r}])\nexcept SystemExit:\n    pass\n"
            f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout, proc.stdout[-500:]
    assert ("hubsoup 0." in proc.stdout) if flag == "--version" else ("usage: hubsoup" in proc.stdout)


def test_import_hubsoup_is_lazy_but_complete():
    code = ("import sys, hubsoup\nassert 'torch' not in sys.modules, 'import hubsoup imported torch'\n"
            "from hubsoup import merge, MergeResult, MergeOptions, HubsoupError\n"
            "assert callable(merge) and MergeOptions().shard_bytes > 0\nprint('ok')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def _commands(parser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _commands(sub, (*path, name))


def test_every_command_has_examples_in_its_help():
    commands = dict(_commands(build_parser()))
    assert {("merge",), ("space", "create"), ("completion",), ("continual", "add")} <= set(commands)
    for path, sub in commands.items():
        if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions) and path != ("continual",):
            continue  # a group of commands (space): its commands carry the examples
        text = sub.format_help()
        assert "\nexamples:\n" in text and "hubsoup " + " ".join(path) in text.split("\nexamples:\n")[1], path


def test_verbose_and_quiet_before_or_after_the_command(monkeypatch, capsys, tmp_path):
    import hubsoup.api

    seen = []

    class Result:
        evaluation = []

    def fake_merge(inputs, method, **kwargs):
        seen.append(kwargs["options"].quiet)
        return Result()

    real_merge = hubsoup.api.merge
    monkeypatch.setattr(hubsoup.api, "merge", fake_merge)
    out = str(tmp_path / "o")
    for argv in (["-q", "merge", "a", "b", "--method", "linear", "-o", out],
                 ["merge", "a", "b", "--method", "linear", "-o", out, "-q"],
                 ["merge", "a", "b", "--method", "linear", "-o", out]):
        assert main(argv) == 0
    assert seen == [True, True, False]
    monkeypatch.setattr(hubsoup.api, "merge", real_merge)
    # -v after the command shows the traceback of an error, as before it
    bad = ["merge", "a", "b", "--method", "ties", "-p", "densty=0.5", "-o", out]
    for argv in (["-v", *bad], [*bad, "-v"], ["methods", "ties", "-v"]):
        rc = main(argv)
        err = capsys.readouterr().err
        if argv[0] == "methods":
            assert rc == 0
        else:
            assert rc == 2 and "Traceback" in err
    assert main(bad) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    # a misspelt parameter: the method's closest one
    assert "has no parameter 'densty' (did you mean 'density'?" in err


def _complete(script: str, words: list[str]) -> list[str]:
    """COMPREPLY of the completion function for the command line ``words`` (the last one being completed)."""
    arr = " ".join(f"'{w}'" for w in words)
    bash = f'{script}\nCOMP_WORDS=({arr}); COMP_CWORD={len(words) - 1}; _hubsoup; printf "%s\\n" "${{COMPREPLY[@]}}"'
    proc = subprocess.run(["bash", "-c", bash], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return [w for w in proc.stdout.splitlines() if w]


def test_bash_completion(capsys, tmp_path):
    assert main(["completion", "bash"]) == 0
    script = capsys.readouterr().out
    assert "complete -o default -F _hubsoup hubsoup" in script
    assert _complete(script, ["hubsoup", "me"]) == ["merge", "methods"]
    assert _complete(script, ["hubsoup", "-v", "sp"]) == ["space"]
    assert set(_complete(script, ["hubsoup", "merge", "a", "--method", "ti"])) == {"ties"}
    assert _complete(script, ["hubsoup", "merge", "--output-format", "l"]) == ["lora"]
    assert "--push" in _complete(script, ["hubsoup", "merge", "--pu"])
    assert _complete(script, ["hubsoup", "continual", "a"]) == ["add"]
    assert "--base" in _complete(script, ["hubsoup", "continual", "add", "--ba"])
    assert _complete(script, ["hubsoup", "space", "create", "x", "--hardware", "zero"]) == ["zero-a10g"]
    (tmp_path / "soup-folder").mkdir()
    os.chdir(tmp_path)
    assert _complete(script, ["hubsoup", "push", "soup"]) == ["soup-folder"]  # paths after a command


@pytest.mark.slow
def test_wheel_ships_py_typed_cards_and_space_app(tmp_path):
    """The wheel pip builds from this tree (hatchling, from PyPI in pip's build isolation)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheel = next(tmp_path.glob("hubsoup-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"hubsoup/py.typed", "hubsoup/cards/merge.md", "hubsoup/cards/space.md", "hubsoup/space_app/app.py",
            "hubsoup/methods/measured.json"} <= names  # list_methods() reads it in an installed package


def test_an_interrupt_after_the_output_is_committed_says_it_is_complete(monkeypatch, capsys):
    """A Ctrl-C that lands after the output's commit (while the command prints or pushes) must not claim that
    nothing was left: the output is complete, and the line says where; before any commit it says nothing was."""
    import argparse
    import types

    import hubsoup.cli as cli
    from hubsoup.output import folder

    def run(commit: bool):
        def func(args):
            if commit:
                folder.COMMITTED.append("/somewhere/out")
            raise KeyboardInterrupt
        ns = argparse.Namespace(func=func, top_verbose=False, top_quiet=False, verbose=False, quiet=False)
        monkeypatch.setattr(cli, "build_parser", lambda: types.SimpleNamespace(parse_args=lambda argv: ns))
        return cli.main([]), capsys.readouterr().err

    rc, err = run(commit=False)
    assert rc == 130 and err.strip() == "interrupted; no output was left behind"
    rc, err = run(commit=True)
    assert rc == 130 and err.strip() == "interrupted; the output written before it is complete: /somewhere/out"


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_signal_whose_handler_runs_during_the_commit_is_raised_after_it(tmp_path, signum):
    """A signal caught just before the commit's block (its Python handler not yet run) runs that handler at the
    next bytecode, which can be right after the rename: the kill loop once saw "no output was left behind"
    beside a committed output. Within the block the handler only records it; it is raised after the record."""
    import signal

    from hubsoup.output import folder

    sig = getattr(signal, signum)

    def raising(n, frame):  # as the CLI's handlers
        raise KeyboardInterrupt

    old = signal.signal(sig, raising)
    try:
        out = folder.OutputFolder(str(tmp_path / "out"))
        real = out._commit

        def renamed_then_handler_runs(source=None):
            target = real(source)
            signal.getsignal(sig)(sig, None)  # where Python runs a pending signal's handler: after the rename
            return target

        out._commit = renamed_then_handler_runs
        before = len(folder.COMMITTED)
        with pytest.raises(KeyboardInterrupt):
            out.commit()
        assert folder.COMMITTED[before:] == [str(tmp_path / "out")] and os.path.isdir(tmp_path / "out")
        assert signal.getsignal(sig) is raising  # the real handler is back
    finally:
        signal.signal(sig, old)


@pytest.mark.parametrize("fate", ["replaced", "swallowed", "unraisable"])
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_whose_exception_is_lost_still_ends_the_command_as_signalled(monkeypatch, capsys, sig, fate):
    """A handler's exception raised while C code runs a Python callback can come back as that code's own error
    (torch building a tensor during safetensors' get_tensor said "could not determine the shape of object type
    'torch.storage.UntypedStorage'"), or not come back at all, or land in a callback the garbage collector runs
    (a weakref's, a ``__del__``), where Python prints "Exception ignored in ..." instead of raising it: the command
    still exits as signalled, in one line, and prints nothing of the lost exception."""
    import argparse
    import signal
    import time
    import types

    import hubsoup.cli as cli

    signum = getattr(signal, sig)

    class Dropped:
        def __del__(self):
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the handler raises here, inside __del__: Python cannot raise it

    def func(args):
        if fate == "unraisable":
            Dropped()
            return 0
        try:
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the handler raises here
        except KeyboardInterrupt:
            if fate == "replaced":
                raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'")
        return 0

    printed = []  # what would print "Exception ignored in ..." (pytest's own hook would only warn)
    monkeypatch.setattr(sys, "unraisablehook", printed.append)

    ns = argparse.Namespace(func=func, top_verbose=False, top_quiet=False, verbose=False, quiet=False)
    monkeypatch.setattr(cli, "build_parser", lambda: types.SimpleNamespace(parse_args=lambda argv: ns))
    before = signal.getsignal(signum)
    rc = cli.main([])
    err = capsys.readouterr().err
    want = {"SIGTERM": (143, "terminated (SIGTERM); no output was left behind"),
            "SIGINT": (130, "interrupted; no output was left behind")}[sig]
    assert (rc, err.strip()) == want and printed == []
    assert signal.getsignal(signum) is before  # the command's handlers are gone with it
    assert sys.unraisablehook == printed.append  # and its hook
