"""The command line: success output, one-line errors, exit codes."""

import os
import subprocess
import sys

from hubsoup.cli import main


def test_merge_cli(llama, tmp_path, capsys):
    base, fts = llama
    out = tmp_path / "soup"
    rc = main(["merge", *fts, "--base", base, "--method", "ties", "--param", "density=0.4", "-p", "scope=tensor",
               "--out", str(out), "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "merged 3 model(s) with ties" in printed and str(out) in printed
    assert (out / "model.safetensors").exists()


def test_cli_error_is_one_line_with_nonzero_exit(llama, tmp_path, capsys):
    base, fts = llama
    rc = main(["merge", *fts, "--base", base, "--method", "ties", "--param", "density=7", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().count("\n") == 0 and err.startswith("error: parameter 'density' = 7.0 is out of range")
    assert "Traceback" not in err
    rc = main(["--verbose", "merge", *fts, "--base", base, "--method", "nope", "--out", str(tmp_path / "o")])
    assert rc == 2 and "Traceback" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_bad_param_syntax(llama, tmp_path, capsys):
    base, fts = llama
    assert main(["merge", *fts, "--base", base, "--method", "ties", "--param", "density", "--out", str(tmp_path / "o")]) == 2
    assert "--param expects KEY=VALUE" in capsys.readouterr().err


def test_methods_lists_every_method_with_defaults(capsys):
    from hubsoup.methods import available

    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for name in available():
        assert f"{name}:" in out
    assert "--param density=0.2" in out and "arxiv.org/abs/2306.01708" in out


def test_console_script_entry_point(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "hubsoup", "merge", "./missing", "--method", "linear", "--base",
                           "./missing", "--out", str(tmp_path / "o")], capture_output=True, text=True, env=env)
    assert proc.returncode == 2
    assert "error: input './missing': no such local folder" in proc.stderr
