"""lm-evaluation-harness as a task kind: parsing, lm-eval's own numbers, merge --eval, evolve, offline custom tasks."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from hubsoup.errors import ParameterError
from hubsoup.eval import TaskSpec


def test_parse_lm_eval_spec():
    t = TaskSpec.parse("lm-eval:arc_easy,hellaswag,num_fewshot=0,limit=200,batch_size=8,metric=acc_norm,"
                       "apply_chat_template=true,model_args=max_length=2048;add_bos_token=true,gen_kwargs=temperature=0")
    assert (t.kind, t.data, t.name, t.limit) == ("lm-eval", "arc_easy,hellaswag", "arc_easy,hellaswag", 200)
    assert t.extra == {"num_fewshot": 0, "batch_size": 8, "metric": "acc_norm", "apply_chat_template": True,
                       "model_args": {"max_length": 2048, "add_bos_token": True}, "gen_kwargs": {"temperature": 0}}
    assert not t.is_local


@pytest.mark.parametrize("spec, message", [
    ("lm-eval:num_fewshot=0", "name at least one lm-eval task"),
    ("lm-eval:arc_easy,shots=5", "unknown key 'shots'"),
    ("lm-eval:arc_easy,num_fewshot=-1", "num_fewshot must be >= 0"),
    ("lm-eval:arc_easy,limit=x", "limit must be an integer"),
    ("lm-eval:arc_easy,apply_chat_template=maybe", "apply_chat_template must be true or false"),
    ("lm-eval:arc_easy,model_args=trust_remote_code=true", "model_args 'trust_remote_code' cannot be set"),
    ("lm-eval:arc_easy,model_args=max_length", "model_args expects K=V pairs"),
    ("lm-eval:arc_easy,limit=3,hellaswag", "task names come first"),
    # issue 44: a TypeError in lm-eval before (hubsoup passes these to HFLM itself)
    ("lm-eval:arc_easy,model_args=batch_size=2", "model_args 'batch_size' cannot be set there: .*batch_size=N"),
    ("lm-eval:arc_easy,model_args=device=cuda", "model_args 'device' cannot be set there"),
    ("lm-eval:arc_easy,model_args=tokenizer=gpt2", "model_args 'tokenizer' cannot be set there"),
])
def test_bad_lm_eval_spec_is_named(spec, message):
    with pytest.raises(ParameterError, match=message):
        TaskSpec.parse(spec)


lm_eval = pytest.importorskip("lm_eval", reason="hubsoup[lmeval] is not installed")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A tiny Llama base with a tokenizer, two fine-tunes, and an offline lm-eval multiple-choice task."""
    from hubsoup.testing import choice_rows, choice_task_yaml, make_base, make_finetune, save_tiny_tokenizer

    root = tmp_path_factory.mktemp("lmeval")
    base = make_base("llama", str(root / "base"))
    save_tiny_tokenizer(base)
    fts = [make_finetune(base, str(root / f"ft{i}"), seed=i, scale=0.05) for i in (1, 2)]
    for ft in fts:
        save_tiny_tokenizer(ft)
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "toy.jsonl").write_text(choice_rows(6))
    (tasks / "toy.yaml").write_text(choice_task_yaml("toy_choice", str(tasks / "toy.jsonl"), metrics=("acc", "acc_norm")))
    return base, fts, f"lm-eval:toy_choice,task_dir={tasks},batch_size=4"


def test_unknown_lm_eval_task_is_named_without_indexing_lm_evals_own(toy):
    """A name written in no file of lm-eval's task folder is reported at once: lm-eval's index of its ~15k
    built-in tasks (most of a minute) is not built for it."""
    from hubsoup.eval import lmeval

    lmeval._MANAGERS.clear()
    spec = TaskSpec.parse(toy[2].replace("toy_choice", "toy_choice,toy_choise"))
    with pytest.raises(ParameterError, match="lm-eval has no task 'toy_choise' or in "):
        spec.check()
    with pytest.raises(ParameterError, match="lm-eval has no task 'hellaswg' \\("):
        TaskSpec.parse("lm-eval:arc_easy,hellaswg").check()
    assert not [k for k in lmeval._MANAGERS if k[1]]  # no index with the built-in tasks was made


def test_hubsoup_eval_checks_task_names_as_merge_eval_does(toy, tmp_path, capsys):
    """``hubsoup eval`` with a misspelt lm-eval task: one line naming it, before the model is loaded (issue 44:
    a KeyError traceback from lm-eval, after loading the model)."""
    from hubsoup.cli import main

    base, _, spec = toy
    assert main(["eval", base, "--task", spec.replace("toy_choice", "toy_choise")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "lm-eval has no task 'toy_choise'" in err[0], err


def test_a_task_dirs_name_from_an_included_file_outside_it_is_known(tmp_path):
    """lm-eval takes a task's name from a file its YAML includes, wherever that lies: task_dir's own index
    (not a text search) decides its names."""
    from hubsoup.eval import lmeval

    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "shared_yaml").write_text("task: far_away_task\ndataset_path: json\n"
                                                      "output_type: multiple_choice\n")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "t.yaml").write_text("include: ../common/shared_yaml\n")
    lmeval._MANAGERS.clear()
    TaskSpec.parse(f"lm-eval:far_away_task,task_dir={tmp_path / 'tasks'}").check()
    assert not [k for k in lmeval._MANAGERS if k[1]]
    with pytest.raises(ParameterError, match="task_dir .* is not a folder"):
        TaskSpec.parse(f"lm-eval:far_away_task,task_dir={tmp_path / 'nothing'}").check()


@pytest.mark.slow  # lm-eval's index of half its task folders: ~15 s
def test_every_name_lm_evals_index_knows_passes_the_quick_check():
    """The quick check (a text search of lm-eval's task folder) never rejects a name lm-eval's own index has
    (tasks, groups, tags). The index is lm-eval's own ``TaskIndex``, built on every folder that holds an
    include file not ending in .yaml (lm-eval's ``_xxx_yaml`` templates: the names written only there) and on
    every eighth folder besides, about half of the ~220: the whole index takes most of a minute."""
    import pathlib

    from lm_eval.tasks._index import TaskIndex

    from hubsoup.eval import lmeval

    folders = sorted(p for p in pathlib.Path(lm_eval.tasks.__file__).parent.iterdir()
                     if p.is_dir() and p.name != "__pycache__")
    templated = {p for p in folders if any(f.endswith("yaml") and not f.endswith(".yaml")
                                           for _, _, files in os.walk(p) for f in files)}
    known = sorted(TaskIndex.build(sorted(templated | set(folders[::8]))))
    assert len(templated) > 20 and len(known) > 5000 and "arc_multilingual" in known  # a tag written in _arc_yaml
    assert lmeval._unwritten_builtins(known) == []
    assert lmeval._unwritten_builtins(["hellaswag", "hellaswg"]) == ["hellaswg"]
    assert lmeval._unwritten_builtins(known[:100] + ["hellaswg"]) == ["hellaswg"]  # the many-names path too


@pytest.mark.slow
def test_scores_are_lm_evals_own(toy):
    """hubsoup's lm-eval task on a model in memory gives what lm-eval's own `hf` model gives for the folder."""
    from lm_eval.tasks import TaskManager

    import transformers

    from hubsoup.eval import evaluate_model

    base, fts, spec = toy
    model = transformers.AutoModelForCausalLM.from_pretrained(fts[0])
    [ours] = evaluate_model(model, [TaskSpec.parse(spec)], tokenizer=fts[0], quiet=True)
    theirs = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={fts[0]}", tasks=["toy_choice"],
                                     device="cpu", batch_size=4, bootstrap_iters=0,
                                     task_manager=TaskManager(include_path=spec.split("task_dir=")[1].split(",")[0],
                                                              include_defaults=False))
    row = theirs["results"]["toy_choice"]
    assert ours.metrics == {"acc": row["acc,none"], "acc_norm": row["acc_norm,none"]}
    assert ours.task.name == "toy_choice" and ours.main_metric == "acc" and ours.score == row["acc,none"]
    assert ours.n_examples == 6


@pytest.mark.slow
def test_tasks_built_once_give_simple_evaluates_numbers_for_every_model(toy):
    """An Evaluator builds lm-eval's tasks once and scores model after model (a search's candidates) with them:
    each gets exactly what a fresh ``simple_evaluate`` gives it, few-shot examples (seeded) included."""
    import torch
    import transformers
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from hubsoup.eval import Evaluator, lmeval

    base, fts, spec = toy
    spec = spec + ",num_fewshot=2"
    task_dir = spec.split("task_dir=")[1].split(",")[0]
    models = [transformers.AutoModelForCausalLM.from_pretrained(p).eval() for p in (fts[0], fts[1], base)]
    tok = transformers.AutoTokenizer.from_pretrained(fts[0])
    tok.pad_token = tok.pad_token or tok.eos_token
    theirs = [lm_eval.simple_evaluate(model=HFLM(pretrained=m, tokenizer=tok, batch_size=4, device="cpu"),
                                      tasks=["toy_choice"], num_fewshot=2, bootstrap_iters=0, log_samples=False,
                                      task_manager=TaskManager(include_path=task_dir, include_defaults=False))
              for m in models]
    ev = Evaluator([TaskSpec.parse(spec)], tokenizer=fts[0])
    ours = [ev.evaluate(m)[0] for m in models]
    # one model instance whose weights change in place, as a search's session does
    with torch.no_grad():
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            p.copy_(q)
    again = ev.evaluate(models[0])[0]
    for out, r in zip(theirs, ours):
        row = out["results"]["toy_choice"]
        assert r.metrics == {"acc": row["acc,none"], "acc_norm": row["acc_norm,none"]}
        assert r.details["lm_eval"]["results"] == row and r.details["lm_eval"]["n-shot"] == 2
        # lm-eval's config as hubsoup keeps it: its local files by name and content hash (nothing local published)
        assert r.details["lm_eval"]["config"] == lmeval.public_config(out["configs"]["toy_choice"])
    assert again.metrics == ours[1].metrics
    assert len({tuple(r.metrics.values()) for r in ours}) > 1  # the models score differently


@pytest.mark.slow
def test_merge_eval_writes_lm_eval_output_and_model_index(toy, tmp_path):
    import hubsoup
    from huggingface_hub import ModelCard

    base, fts, spec = toy
    out = tmp_path / "soup"
    res = hubsoup.merge(fts, "task_arithmetic", base=base, out=str(out), evaluate=[spec + ",metric=acc_norm"],
                        quiet=True)
    [r] = res.evaluation
    rows = json.loads((out / "eval_results.json").read_text())
    assert rows[0]["kind"] == "lm-eval" and rows[0]["task"] == "toy_choice" and rows[0]["main_metric"] == "acc_norm"
    assert rows[0]["lm_eval"]["results"]["acc_norm,none"] == r.metrics["acc_norm"]  # lm-eval's own output
    assert rows[0]["lm_eval"]["config"]["output_type"] == "multiple_choice"
    index = ModelCard.load(str(out / "README.md")).data.eval_results
    got = {(e.dataset_name, e.metric_type): e.metric_value for e in index}
    assert got[("toy_choice", "acc")] == round(r.metrics["acc"], 6)
    assert got[("toy_choice", "acc_norm")] == round(r.metrics["acc_norm"], 6)


@pytest.mark.slow
def test_evolve_on_an_lm_eval_task(toy, hub, tmp_path):
    pytest.importorskip("optuna")
    from hubsoup.public import local_path_in_file
    from hubsoup.workflows.evolve import SEARCH_FILE, evolve

    base, fts, spec = toy
    out = str(tmp_path / "out")
    hub.login("alice")
    res = evolve({"base": base, "models": fts, "method": "task_arithmetic", "space": {"scale": [0.1, 1.5]},
                  "optimizer": "random", "trials": 2, "population": 2, "seed": 0,
                  "eval": {"tasks": [spec], "metric": "toy_choice/acc_norm"}}, out, quiet=True,
                 push="alice/lm-evolved")
    for name, data in hub.files("alice/lm-evolved").items():  # issue 48, item 2: `evolve --push` too
        assert local_path_in_file(name, data) is None, name
    table = json.loads(open(os.path.join(out, SEARCH_FILE)).read())
    for row in table["trials"]:
        assert row["state"] == "complete" and row["score"] == row["metrics"]["toy_choice"]["acc_norm"]
    rows = json.loads(open(os.path.join(out, "eval_results.json")).read())
    assert rows[0]["metrics"]["acc_norm"] == res.best_score  # the written model scores what its trial scored


@pytest.mark.slow
def test_a_custom_tasks_local_files_are_never_kept_or_pushed_and_git_says_nothing(toy, hub, tmp_path, capfd,
                                                                                  monkeypatch):
    """Issue 48, items 2 and 6: lm-eval's config of a custom task names its files by path (``data_files``,
    ``config_source``); ``eval_results.json`` keeps them by name and content hash, at the source, so the push has
    nothing to replace (and its scrubber, run over every file, finds nothing). Run outside a git repository, the
    CLI prints nothing of lm-eval's (its ``git describe`` said "fatal: not a git repository" once per evaluation)."""
    from hubsoup.cli import main
    from hubsoup.public import local_path_in_file

    base, fts, spec = toy
    elsewhere = tmp_path / "not-a-repo"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # git looks no higher than here
    monkeypatch.setenv("HF_TOKEN", hub.token("alice"))
    out = tmp_path / "soup"
    assert main(["merge", *fts, "--base", base, "--method", "task_arithmetic", "--eval", spec, "--out", str(out),
                 "--push", "alice/lm-soup"]) == 0
    printed = capfd.readouterr()
    assert "fatal" not in printed.err and "git" not in printed.err, printed.err
    assert "Running loglikelihood" not in printed.err and "Generating" not in printed.err, printed.err
    row = json.loads((out / "eval_results.json").read_text())[0]
    cfg = row["lm_eval"]["config"]
    assert cfg["dataset_kwargs"]["data_files"]["validation"].startswith("toy.jsonl@sha256:")
    assert cfg["metadata"]["config_source"].startswith("toy.yaml@sha256:")
    tasks_dir = spec.split("task_dir=")[1].split(",")[0]
    assert tasks_dir not in (out / "eval_results.json").read_text()
    pushed = hub.files("alice/lm-soup")
    assert pushed["eval_results.json"] == (out / "eval_results.json").read_bytes()  # nothing left to replace
    for name, data in pushed.items():
        assert local_path_in_file(name, data) is None, name
    meta = yaml.safe_load(pushed["README.md"].decode().split("---\n")[1])
    rows = meta["model-index"][0]["results"]  # lm-eval's `json`: no file, the task's name
    assert [r["dataset"]["type"] for r in rows] == [r["dataset"]["name"] for r in rows]
