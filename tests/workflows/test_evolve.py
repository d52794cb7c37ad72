"""hubsoup evolve: Optuna studies over merge recipes, generation-synchronous, resumable, scored in memory."""

from __future__ import annotations

import json
import os
import threading

import pytest
from method_helpers import tiny_lm_zoo  # tests/ is on sys.path
import yaml

optuna = pytest.importorskip("optuna", reason="hubsoup[evolve] is not installed")  # noqa: F841

from hubsoup.errors import EvolveError, ParameterError  # noqa: E402
from hubsoup.workflows.evolve import SEARCH_FILE, EvolveConfig, evolve, make_sampler, param_names  # noqa: E402
from hubsoup.workflows.executors import LocalExecutor  # noqa: E402
import paths  # tests/paths.py: the repository's root, wherever a test module sits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama base with a tokenizer, two fine-tunes and a perplexity validation file."""
    base, fts, data = tiny_lm_zoo(tmp_path_factory.mktemp("evolve"))
    return base, fts, str(data)


def config(tiny, **over):
    base, fts, data = tiny
    cfg = {"base": base, "models": fts, "method": "ties",
           "space": {"density": [0.1, 0.9], "merge": {"choices": ["mean", "sum"]},
                     "weight": {"range": [0.0, 1.0], "per": "input", "layer_groups": 2}},
           "optimizer": "cmaes", "trials": 4, "population": 4, "seed": 0,
           "eval": {"tasks": [f"perplexity:{data}"]}}
    cfg.update(over)
    return cfg


def table(folder):
    with open(os.path.join(folder, SEARCH_FILE), encoding="utf-8") as f:
        return json.load(f)


# --- the config -----------------------------------------------------------------------------------

def test_config_space_genes_and_gradients(tiny):
    cfg = EvolveConfig.load(config(tiny))
    assert sorted(cfg.distributions()) == ["density", "merge", "weight.i0.g0", "weight.i0.g1", "weight.i1.g0",
                                           "weight.i1.g1"]
    names = param_names(cfg)
    assert names == {"density": "density", "merge": "merge", "weight": "weights"}  # mergekit's name -> hubsoup's
    point = {"density": 0.3, "merge": "sum", "weight.i0.g0": 0.1, "weight.i0.g1": 0.2, "weight.i1.g0": 0.3,
             "weight.i1.g1": 0.4}
    # per input a mergekit gradient over the layers: [group 0, group 1]
    assert cfg.method_params(point, names) == {"density": 0.3, "merge": "sum", "weights": [[0.1, 0.2], [0.3, 0.4]]}


@pytest.mark.parametrize("change, message", [
    ({"optimizer": "adam"}, "optimizer must be one of cmaes, tpe, random"),
    ({"space": {"density": [0.9, 0.1]}}, r"space.density: range \[0.9, 0.1\] must have finite low < high"),
    ({"space": {"density": {"range": [0, 1], "per": "layer"}}}, "space.density: per must be 'input'"),
    ({"space": {"dnsity": [0.1, 0.9]}}, "space.dnsity: method 'ties' has no parameter 'dnsity'"),
    ({"space": {"merge": {"choices": ["mean", "median"]}}}, "merge"),
    ({"trials": 0}, "'trials' must be a positive integer"),
    ({"evaluate": {}}, "unknown key 'evaluate'"),
    ({"eval": {"tasks": []}}, "'eval.tasks' must list at least one task spec"),
    # issue 48, item 6: below 4, CMA-ES keeps one parent and cmaes warns "divide by zero" every generation
    ({"optimizer": "cmaes", "population": 3}, "population 3 is too small for CMA-ES, which needs at least 4"),
    # issue 44: each a traceback, a hang or silently accepted before
    ({"space": {"density": {"range": [0.1, 0.9], "step": float("nan")}}}, "space.density: step must be a positive"),
    ({"space": {"density": {"range": [0.1, 0.9], "step": float("inf")}}}, "space.density: step must be a positive"),
    ({"space": {"density": {"range": [0.1, 0.9], "step": 2}}}, "step 2 is wider than the range"),
    ({"space": {"density": {"range": [0.1, 0.9], "step": 0.1, "log": True}}}, "a log range takes no step"),
    ({"space": {"density": {"range": [0.1, 0.9], "log": "no"}}}, "log must be true or false"),
    ({"space": {"weight": {"range": [0, 1], "per": "input", "layer_groups": 1000000}}},
     "layer_groups must be an integer from 1 to 1024"),
    ({"space": {k: {"range": [0, 1], "per": "input", "layer_groups": 1024} for k in ("weight", "density", "lambda")}},
     "the space has 6144 genes"),
    ({"resources": {"cpus": "many"}}, r"'resources.cpus' .* from 1 to 1024, got 'many'"),
    ({"resources": {"cpus": 1e9}}, r"'resources.cpus' .* got 1000000000.0"),
    ({"resources": {"cpus": 0}}, r"'resources.cpus'"),
    ({"resources": {"gpus": "x"}}, r"'resources.gpus' .* got 'x'"),
    ({"resources": {"gpus": float("nan")}}, r"'resources.gpus'"),
    ({"resources": {"memory": "lots"}}, r"'resources.memory' must be a size"),
])
def test_bad_config_is_named(tiny, tmp_path, change, message):
    with pytest.raises(ParameterError, match=message):
        evolve(config(tiny, **change), str(tmp_path / "out"), quiet=True)
    assert not os.path.exists(tmp_path / "out")  # refused before anything was written


def test_out_must_be_new_or_a_study(tiny, tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ParameterError, match="holds no hubsoup study"):
        evolve(config(tiny), str(tmp_path / "busy"), quiet=True)


# --- studies --------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["cmaes", "tpe", "random"])
def test_study_writes_best_model_table_plot_and_card(tiny, tmp_path, optimizer):
    out = str(tmp_path / "out")
    res = evolve(config(tiny, optimizer=optimizer, trials=6, population=4), out, quiet=True)
    t = table(out)
    assert [r["number"] for r in t["trials"]] == [0, 1, 2, 3, 4, 5]
    assert all(r["state"] == "complete" and isinstance(r["score"], float) for r in t["trials"])
    assert [r["generation"] for r in t["trials"]] == [0, 0, 0, 0, 1, 1]
    for r in t["trials"]:  # the point's genes, and the gradients they became
        assert r["params"]["weights"] == [[r["genes"]["weight.i0.g0"], r["genes"]["weight.i0.g1"]],
                                          [r["genes"]["weight.i1.g0"], r["genes"]["weight.i1.g1"]]]
    best = max(t["trials"], key=lambda r: r["score"])
    assert res.best_number == best["number"] == t["best"]["number"] and res.best_score == best["score"]
    for f in ("model.safetensors", "config.json", "hubsoup_recipe.yaml", "README.md", "hubsoup_search.png",
              "hubsoup_study.db", "eval_results.json"):
        assert os.path.isfile(os.path.join(out, f)), f
    with open(os.path.join(out, "hubsoup_search.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    card = open(os.path.join(out, "README.md"), encoding="utf-8").read()
    assert "## Evolutionary search" in card and f"**{optimizer}** sampler" in card
    assert f"Best trial: **{best['number']}**" in card and "(hubsoup_search.json)" in card
    assert "hubsoup_search.png" in card and "`weights`" in card
    assert tiny[2] not in card and tiny[2] not in json.dumps(t)  # the local data path is never published
    # issue 48, item 3: titled and named by the output, loading the output, never its temporary folder
    assert "\n# out\n" in card and ".hubsoup-best" not in card
    assert f'from_pretrained("{os.path.abspath(out)}")' in card
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["model-index"][0]["name"] == "out"
    # the written model is the best trial's: its score from disk is the in-memory score, bit for bit
    from hubsoup.eval import read_results

    [ev] = read_results(os.path.join(out, "eval_results.json"))
    assert ev.metrics["perplexity"] == best["metrics"]["val"]["perplexity"]
    assert sorted(n for n in os.listdir(tmp_path)) == ["out"]  # nothing left beside it
    # no temporary folder or lock left; the marker says hubsoup made the study (issue 44)
    assert [n for n in os.listdir(out) if n.startswith(".")] == [".hubsoup"]
    mode = os.stat(os.path.join(out, "model.safetensors")).st_mode & 0o777
    for f in os.listdir(out):  # the trial table too (it was the only file readable by its owner alone)
        if os.path.isfile(os.path.join(out, f)):
            assert os.stat(os.path.join(out, f)).st_mode & 0o777 == mode, f


@pytest.mark.slow
def test_same_seed_same_study_whatever_the_order(tiny, tmp_path):
    """Results told in trial order: an executor finishing trials in reverse gives the same table."""
    class Reversed(LocalExecutor):
        def run(self, payloads, *, on_result=None, monitor=None):
            out = super().run(list(reversed(payloads)), on_result=on_result, monitor=monitor)
            return list(reversed(out))

    a, b, c = (str(tmp_path / n) for n in "abc")
    evolve(config(tiny, trials=6, population=4), a, quiet=True)
    evolve(config(tiny, trials=6, population=4), b, quiet=True, executor=Reversed())
    evolve(config(tiny, trials=6, population=4, seed=1), c, quiet=True)
    with open(os.path.join(a, SEARCH_FILE), "rb") as fa, open(os.path.join(b, SEARCH_FILE), "rb") as fb:
        assert fa.read() == fb.read()
    assert table(a)["trials"][0]["genes"] != table(c)["trials"][0]["genes"]  # the seed matters


class _Killed(BaseException):
    pass


@pytest.mark.slow
def test_killed_driver_resumes_without_repeating_finished_trials(tiny, tmp_path):
    """A driver killed inside a generation keeps the trials it finished: the resumed run evaluates only the others,
    and the study ends as an uninterrupted one does."""
    ref = str(tmp_path / "ref")
    evolve(config(tiny, trials=10, population=4), ref, quiet=True)

    class DiesInGeneration1(LocalExecutor):  # the driver dies after two trials of generation 1 were evaluated
        def run(self, payloads, *, on_result=None, monitor=None):
            if payloads[0]["number"] >= 4:
                super().run(payloads[:2], on_result=on_result, monitor=monitor)
                raise _Killed()
            return super().run(payloads, on_result=on_result, monitor=monitor)

    out = str(tmp_path / "out")
    with pytest.raises(_Killed):
        evolve(config(tiny, trials=10, population=4), out, quiet=True, executor=DiesInGeneration1())
    st = optuna.load_study(study_name="hubsoup-evolve", storage=f"sqlite:///{out}/hubsoup_study.db")
    assert [t.state.name for t in st.trials] == ["COMPLETE"] * 6 + ["RUNNING"] * 2
    assert not os.path.exists(os.path.join(out, "model.safetensors"))

    res = evolve(config(tiny, trials=10, population=4), out, quiet=True)
    assert res.resumed == 2
    assert [s["number"] for s in res.seconds] == [6, 7, 8, 9]  # 4 and 5 were finished: not run again
    assert [s["session"]["new"] for s in res.seconds] == [True, False, False, False]  # one session per process
    with open(os.path.join(ref, SEARCH_FILE), "rb") as fa, open(os.path.join(out, SEARCH_FILE), "rb") as fb:
        assert fa.read() == fb.read()  # the study an uninterrupted run gives


@pytest.mark.slow
def test_killed_while_asking_a_generation_resumes_the_same(tiny, tmp_path):
    """A run killed after asking part of a generation: the rest is asked as the uninterrupted run would."""
    ref, out = str(tmp_path / "ref"), str(tmp_path / "out")
    cfg = config(tiny, trials=4, population=2, optimizer="tpe")
    evolve(cfg, ref, quiet=True)
    os.makedirs(out)
    from hubsoup.output.folder import write_marker

    write_marker(out, "evolve", best=[])  # what a run writes first, before its study
    parsed = EvolveConfig.load(cfg)
    st = optuna.create_study(storage=f"sqlite:///{out}/hubsoup_study.db", study_name="hubsoup-evolve",
                             direction="maximize")
    st.sampler = make_sampler(parsed, 0, st)
    st.ask(parsed.distributions())  # trial 0 of generation 0 only, then the "kill"
    res = evolve(cfg, out, quiet=True)
    assert res.resumed == 1
    with open(os.path.join(ref, SEARCH_FILE), "rb") as fa, open(os.path.join(out, SEARCH_FILE), "rb") as fb:
        assert fa.read() == fb.read()


@pytest.mark.slow
def test_more_trials_extend_the_study_and_other_settings_are_refused(tiny, tmp_path):
    out = str(tmp_path / "out")
    evolve(config(tiny, trials=2), out, quiet=True)
    res = evolve(config(tiny, trials=5), out, quiet=True)
    assert [s["number"] for s in res.seconds] == [2, 3, 4] and len(table(out)["trials"]) == 5
    with pytest.raises(EvolveError, match="started with another 'seed'"):
        evolve(config(tiny, trials=5, seed=3), out, quiet=True)


@pytest.mark.slow
def test_failing_trials_are_recorded_and_the_study_goes_on(tiny, tmp_path):
    # densities above 1 are refused by TIES: those points fail with the method's reason
    out = str(tmp_path / "out")
    res = evolve(config(tiny, optimizer="random", trials=6, population=3,
                        space={"density": [0.5, 1.6]}), out, quiet=True)
    rows = table(out)["trials"]
    failed = [r for r in rows if r["state"] == "fail"]
    assert failed and len(failed) < len(rows)
    for r in failed:
        assert r["params"]["density"] > 1 and r["score"] is None and "density" in r["reason"]
    assert all(r["params"]["density"] <= 1 for r in rows if r["state"] == "complete")
    assert res.best_params["density"] <= 1


@pytest.mark.slow
def test_every_trial_failing_is_an_error(tiny, tmp_path):
    # weights of 1e7 overflow a float16 output: every trial fails, naming the tensor
    with pytest.raises(EvolveError, match="every trial of the study failed; the first: NonFiniteTensorError.*float16"):
        evolve(config(tiny, optimizer="random", trials=2, population=2, dtype="float16",
                      space={"weight": {"range": [1e7, 1e8], "per": "input"}}), str(tmp_path / "out"), quiet=True)
    with pytest.raises(ParameterError, match="density"):  # a range the method refuses everywhere: refused at once
        evolve(config(tiny, space={"density": [1.1, 1.9]}), str(tmp_path / "out2"), quiet=True)


@pytest.mark.slow
def test_best_recipe_reruns_bit_for_bit(tiny, tmp_path):
    from hubsoup.cli import main
    from hubsoup.eval import TaskSpec, evaluate_model

    cfg_file = tmp_path / "evolve.yml"
    cfg_file.write_text(yaml.safe_dump(config(tiny, optimizer="tpe")))
    out, again = str(tmp_path / "out"), str(tmp_path / "again")
    assert main(["evolve", str(cfg_file), "--out", out, "--quiet"]) == 0
    assert main(["run", out, "--out", again, "--quiet"]) == 0
    with open(os.path.join(out, "model.safetensors"), "rb") as f1, \
            open(os.path.join(again, "model.safetensors"), "rb") as f2:
        assert f1.read() == f2.read()
    best = table(out)["best"]
    [r] = evaluate_model(again, [TaskSpec.parse(f"perplexity:{tiny[2]}")], quiet=True)
    assert r.metrics["perplexity"] == best["metrics"]["val"]["perplexity"]


@pytest.mark.slow
def test_progress_per_trial_and_cancel(tiny, tmp_path):
    from hubsoup.errors import MergeCancelled

    seen = []
    stop = threading.Event()

    def progress(done, stage, msg):
        seen.append((done, stage, msg))
        if "trial 1:" in msg:
            stop.set()  # cancel once trial 1 is in: the rest of the study never runs

    out = str(tmp_path / "out")
    with pytest.raises(MergeCancelled):
        evolve(config(tiny, trials=8, population=4), out, progress=progress, cancel=stop)
    trials = [(d, m) for d, _, m in seen if m.startswith("trial ")]
    assert [m.split(":")[0] for _, m in trials] == ["trial 0", "trial 1"]
    assert trials[0][0] < trials[1][0]  # each trial its own step (not the generation's)
    dones = [d for d, _, _ in seen]
    assert dones == sorted(dones) and any("trial 0: score" in m for _, _, m in seen)
    st = optuna.load_study(study_name="hubsoup-evolve", storage=f"sqlite:///{out}/hubsoup_study.db")
    assert [t.state.name for t in st.trials] == ["COMPLETE"] * 2 + ["RUNNING"] * 2  # what finished is kept
    seen.clear()
    res = evolve(config(tiny, trials=8, population=4), out, progress=lambda *a: seen.append(a))
    assert seen[-1][0] == 1.0 and res.resumed == 2 and [s["number"] for s in res.seconds] == [2, 3, 4, 5, 6, 7]
    steps = [d for d, _, m in seen if m.startswith("trial ")]
    assert len(steps) == 6 and steps == sorted(set(steps))  # a distinct fraction per trial


@pytest.mark.slow
def test_ctrl_c_keeps_the_study_and_says_how_to_resume(tiny, tmp_path):
    import signal
    import subprocess
    import sys

    cfg = tmp_path / "evolve.yml"
    cfg.write_text(yaml.safe_dump(config(tiny, trials=8)))
    out = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "hubsoup", "evolve", str(cfg), "--out", out]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([paths.ROOT,
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stdout:  # once a trial is told
            if line.strip().startswith("trial 0:"):
                proc.send_signal(signal.SIGINT)
                break
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"interrupted; the study in {out} is kept") and "no output was left behind" not in err
    assert f"run the same command again to resume: hubsoup evolve {cfg} --out {out}" in last
    done = [t for t in optuna.load_study(study_name="hubsoup-evolve", storage=f"sqlite:///{out}/hubsoup_study.db")
            .trials if t.state.name == "COMPLETE"]
    assert done  # trial 0 at least: kept
    res = evolve(str(cfg), out, quiet=True)  # resumed: what finished is not run again
    assert len(table(out)["trials"]) == 8 and len(res.seconds) == 8 - len(done)


def test_example_config_parses():
    """examples/evolve.yml (run as printed by tests/test_examples.py::test_the_evolve_example_runs_as_printed)."""
    here = os.path.join(paths.ROOT, "examples", "evolve.yml")
    cfg = EvolveConfig.load(here)
    assert (cfg.optimizer, cfg.trials, cfg.population, cfg.space["weight"].layer_groups) == ("cmaes", 8, 4, 2)
    assert len(cfg.distributions()) == 2 + 2 * 2 and param_names(cfg)["weight"] == "weights"


def test_paths_in_a_config_file_are_relative_to_the_file(tiny, tmp_path, monkeypatch):
    """Issue 48, item 4: as a pipeline's, an evolve file's models, base and task data are found beside the file,
    wherever it is run from; a name that is no path there (a Hub ID) is left as written."""
    import shutil

    base, fts, data = tiny
    where = tmp_path / "study"
    (where / "models").mkdir(parents=True)
    for src, name in ((base, "base"), (fts[0], "ft-a"), (fts[1], "ft-b")):
        shutil.copytree(src, where / "models" / name)
    shutil.copy(data, where / "val.jsonl")
    cfg = config(tiny, base="models/base", models=["models/ft-a", "models/ft-b", "org/on-the-hub"],
                 eval={"tasks": ["perplexity:val.jsonl,text=text", "lm-eval:x,task_dir=models"]})
    (where / "evolve.yml").write_text(yaml.safe_dump(cfg))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = EvolveConfig.load(str(where / "evolve.yml"))
    assert loaded.base == str(where / "models" / "base")
    assert loaded.models == [str(where / "models" / "ft-a"), str(where / "models" / "ft-b"), "org/on-the-hub"]
    assert loaded.tasks == [f"perplexity:{where / 'val.jsonl'},text=text", f"lm-eval:x,task_dir={where / 'models'}"]
    # and it runs so, from elsewhere
    runnable = dict(cfg, models=cfg["models"][:2], eval={"tasks": [cfg["eval"]["tasks"][0]]})
    (where / "run.yml").write_text(yaml.safe_dump(runnable))
    res = evolve(str(where / "run.yml"), str(tmp_path / "out"), quiet=True)
    assert res.best_score is not None and os.listdir(elsewhere) == []


@pytest.mark.slow
def test_push_once_from_the_driver_without_the_study_store(hub, tiny, tmp_path):
    hub.login("alice")
    out = str(tmp_path / "out")
    res = evolve(config(tiny, trials=2), out, push="alice/evolved", quiet=True)
    assert len(hub.history("alice/evolved")) == 2  # the repo's creation, then the one commit of the best model
    files = set(hub.api("alice").list_repo_files("alice/evolved"))
    assert {"model.safetensors", "hubsoup_recipe.yaml", "README.md", SEARCH_FILE, "hubsoup_search.png"} <= files
    assert not [f for f in files if f.startswith("hubsoup_study")]  # the local study store stays local
    assert res.result.path == os.path.abspath(out)
    # issue 48, item 3: the pushed card is titled and named by the repo and loads it, never a temporary folder
    card = hub.files("alice/evolved")["README.md"].decode()
    assert "\n# evolved\n" in card and ".hubsoup-best" not in card and str(tmp_path) not in card
    assert 'from_pretrained("alice/evolved")' in card
    assert yaml.safe_load(card.split("---\n")[1])["model-index"][0]["name"] == "evolved"
    from hubsoup.public import local_path_in_file

    for name, data in hub.files("alice/evolved").items():  # nothing local in any pushed file (issue 48, item 2)
        assert local_path_in_file(name, data) is None, name
