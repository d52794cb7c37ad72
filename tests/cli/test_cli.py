"""The command line: success output, one-line errors, exit codes."""

import os
import subprocess
import sys

import pytest

from hubsoup.cli import main
import paths  # tests/paths.py: the repository's root, wherever a test module sits


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
    # issue 46: every task the benchmarks saw a method at its defaults make worse than the base is a caveat naming
    # the setting (kind and number of inputs), the task and the size
    from hubsoup.methods import measured

    kinds = {"lora": "LoRA adapters", "full": "full fine-tunes"}
    harms = [(row, e, h) for rows in measured().values() for row, entries in rows.items() for e in entries
             for h in e.get("harms", [])]
    for row, e, h in harms:
        assert (f"caveat, {row} at {e['n_inputs']} {kinds[e['kind']]} ({e['setting']}): {h['task']} {h['size']} "
                f"worse than the base model (95 % interval {h['range']})") in out
    assert out.count("worse than the base model (95 % interval") == len(harms)
    # issue 48, item 8: an open range is no range; a help text says nothing a given value would contradict
    assert "None]" not in out and "[None" not in out
    assert "(float ≥ 0.0)" in out  # consensus' lambdas: bounded below only
    assert "k=20%" not in out and "task arithmetic's 0.3" not in out  # TA's default is 1/N, not 0.3


def test_console_script_entry_point(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "hubsoup", "merge", "./missing", "--method", "linear", "--base",
                           "./missing", "--out", str(tmp_path / "o")], capture_output=True, text=True, env=env)
    assert proc.returncode == 2
    assert "error: input './missing': no such local folder" in proc.stderr


def test_run_recipe_repeats_the_merge_bit_exactly(llama, tmp_path, capsys):
    base, fts = llama
    first = tmp_path / "first"
    assert main(["merge", *fts, "--base", base, "--method", "dare", "-p", "p=0.5", "-p", "then=ties",
                 "--out", str(first), "-q"]) == 0
    again = tmp_path / "again"
    assert main(["run", str(first / "hubsoup_recipe.yaml"), "--out", str(again), "-q"]) == 0
    assert (first / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    assert main(["run", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "x")]) == 2
    assert "recipe" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_run_recipe_of_a_modifier_chain(llama, tmp_path):
    import hubsoup
    from hubsoup.workflows.rerun import run_recipe

    base, fts = llama
    res = hubsoup.merge(fts, method="lwptv", base=base, out=str(tmp_path / "a"), quiet=True,
                        params={"base_method": "lines+ties", "eta": 0.5, "density": 0.3})
    again = run_recipe(res.path, str(tmp_path / "b"), quiet=True)
    assert again.recipe.hash == res.recipe.hash
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_run_recipe_keeps_merge_options(model_dir, tmp_path):
    import hubsoup
    from hubsoup.workflows.rerun import run_recipe

    base = model_dir("bert")
    from safetensors.torch import load_file, save_file

    ft = tmp_path / "cls"
    ft.mkdir()
    sd = {f"bert.{k}": v + 0.01 for k, v in load_file(os.path.join(model_dir("bert", "ft1"), "model.safetensors")).items()}
    sd["classifier.weight"] = sd["bert.pooler.dense.weight"][:2].clone()
    save_file(sd, str(ft / "model.safetensors"), metadata={"format": "pt"})
    (ft / "config.json").write_text(open(os.path.join(base, "config.json")).read())
    res = hubsoup.merge([str(ft)], method="linear", base=base, out=str(tmp_path / "a"), quiet=True, ignore_extra=True)
    assert res.recipe.options["ignore_extra"] is True
    again = run_recipe(res.path, str(tmp_path / "b"), quiet=True)  # would fail without the recorded option
    assert again.recipe.hash == res.recipe.hash


def test_help_states_no_time_the_readme_states_otherwise(capsys):
    """Issue 48, item 5: `hubsoup --help` said the demo takes ~1.5 min while the README measured 2.2; a time is
    stated once (the README, measured) and pointed at from elsewhere."""
    import re

    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    readme = open(os.path.join(paths.ROOT, "README.md"),
                  encoding="utf-8").read()
    for figure in re.findall(r"~?\d+(?:\.\d+)?\s?(?:min|minutes|s|seconds)\b", text):
        assert figure in readme, f"`hubsoup --help` states {figure!r}, which the README does not"
    assert "demo" in text and "README" in text  # the demo's time: where it is measured
