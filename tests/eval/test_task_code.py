"""Issue 44, item 3: no code from a task folder on a server.

In a ``hub_only`` run an lm-eval ``task_dir`` is a Hub dataset or Space repo, fetched with the run's token into a
fresh folder (never a folder of the working directory, even one named like the repo), and its Python (``!function``
tags, ``.py`` files) is refused unless the operator passes ``allow_task_code``. A local form is refused by its
text alone, with the same message whether it exists or not, before anything is stat'ed. The working directory here
holds a planted folder named like the repo, whose task's ``!function utils.proc`` would create a sentinel file:
it never does. On the test Hub (``tests/hub_server.py``).
"""

from __future__ import annotations

import os
import shutil

import pytest
import yaml

import hubsoup
from hubsoup.cli import main
from hubsoup.errors import HubsoupError, InputError
from hubsoup.eval import TaskSpec
from hubsoup.eval.lmeval import check_task_folder
from hubsoup.testing import choice_rows, choice_task_yaml, tiny_lm_family

pytest.importorskip("lm_eval", reason="hubsoup[lmeval] is not installed")

MARK = "PLANTEDMARK"  # every planted path holds it: a probe of one is seen
TASK = choice_task_yaml("toy_hub", "org/data", hub_dataset=True, extra="process_docs: !function utils.proc\n")
UTILS = """import os


def proc(dataset):
    open(os.environ["HUBSOUP_SENTINEL"] + ".{who}", "w").close()  # the proof that this file's Python ran
    return dataset
"""


@pytest.fixture(scope="module")
def lm_zoo(tmp_path_factory):
    """A tiny Llama base with a tokenizer and two fine-tunes, and a multiple-choice dataset for it."""
    root = tmp_path_factory.mktemp(f"{MARK}-zoo")
    base, fts = tiny_lm_family(str(root), base_model="alice/base")
    rows = choice_rows(6)
    return {"base": base, "ft-a": fts[0], "ft-b": fts[1], "rows": rows}


@pytest.fixture
def server(hub, lm_zoo, tmp_path, monkeypatch):
    """The test Hub with the models and the data; a server's working folder holding a planted ``org/tasks`` whose
    Python would create ``SENTINEL.cwd``."""
    for name in ("base", "ft-a", "ft-b"):
        hub.seed(f"alice/{name}", lm_zoo[name])
    hub.seed("org/data", {"data.jsonl": lm_zoo["rows"]}, repo_type="dataset")
    work = tmp_path / f"{MARK}-cwd"
    planted = work / "org" / "tasks"
    planted.mkdir(parents=True)
    (planted / "toy.yaml").write_text(TASK)
    (planted / "utils.py").write_text(UTILS.format(who="cwd"))
    (work / "org" / "data").mkdir()  # and a folder named like the data: two rows, where the Hub's dataset has six
    (work / "org" / "data" / "data.jsonl").write_text("".join(lm_zoo["rows"].splitlines(True)[:2]))
    monkeypatch.chdir(work)
    sentinel = tmp_path / "sentinel"
    monkeypatch.setenv("HUBSOUP_SENTINEL", str(sentinel))
    return {"hub": hub, "work": work, "sentinel": sentinel, "out": str(tmp_path / "soup"),
            "cache": str(tmp_path / "cache")}



def planted_probes(probes, server) -> list[str]:
    planted = str(server["work"] / "org")
    return [p for p in probes if os.path.abspath(p).startswith(planted) or p.startswith("org/tasks")]


def merge(server, task_dir: str, **kw):
    return hubsoup.merge(["alice/ft-a", "alice/ft-b"], "task_arithmetic", base="alice/base", out=server["out"],
                         hub_only=True, cache_dir=server["cache"],
                         evaluate=[f"lm-eval:toy_hub,task_dir={task_dir},batch_size=2"], **kw)


def test_a_repo_named_task_dir_is_never_the_working_folders_and_its_python_never_runs(server, probes):
    """The probe: ``task_dir=org/tasks`` used the server's ``./org/tasks`` and ran its Python. The Hub has no such
    repo: the run is refused naming the repo only, and nothing of the planted folder is looked at."""
    probes.clear()
    with pytest.raises(InputError) as e:
        merge(server, "org/tasks")
    assert "org/tasks" in str(e.value) and "not found" in str(e.value) and MARK not in str(e.value)
    assert planted_probes(probes, server) == []
    assert not os.path.exists(server["sentinel"].with_suffix(".cwd")) and not os.path.exists(server["out"])


@pytest.mark.parametrize("task_dir", ["org/tasks", "hf://datasets/org/tasks", "hf://spaces/org/tasks"])
def test_a_task_repos_python_is_refused_unless_the_operator_allows_it(server, task_dir, probes):
    repo_type = "space" if "spaces" in task_dir else "dataset"
    server["hub"].seed("org/tasks", {"toy.yaml": TASK, "utils.py": UTILS.format(who="hub")},
                       repo_type=repo_type)
    probes.clear()
    with pytest.raises(InputError) as e:
        merge(server, task_dir)
    assert ("toy.yaml uses the YAML tag '!function' (Python)" in str(e.value) or "utils.py is Python" in str(e.value)) \
        and "allow_task_code" in str(e.value) and str(e.value).startswith("task 'toy_hub' task_dir "), e.value
    assert MARK not in str(e.value) and server["cache"] not in str(e.value)
    assert planted_probes(probes, server) == []
    assert not os.path.exists(server["out"])
    assert not [p for p in os.listdir(server["cache"]) if p.startswith("hubsoup-tasks-")]  # its folder is gone
    # the !function tag alone, and a .py file alone, are each refused
    folder = server["work"].parent / "repo-copy"
    folder.mkdir()
    (folder / "toy.yaml").write_text(TASK)
    with pytest.raises(InputError, match="uses the YAML tag '!function'"):
        check_task_folder(str(folder), "task_dir 'org/tasks'", allow_code=False)
    (folder / "toy.yaml").write_text("task: toy\n")
    (folder / "utils.py").write_text(UTILS.format(who="hub"))
    with pytest.raises(InputError, match="utils.py is Python"):
        check_task_folder(str(folder), "task_dir 'org/tasks'", allow_code=False)
    for p in (server["sentinel"].with_suffix(".cwd"), server["sentinel"].with_suffix(".hub")):
        assert not os.path.exists(p)


@pytest.mark.slow  # a merge evaluated with lm-eval
def test_with_allow_task_code_the_repos_own_python_runs_never_the_working_folders(server):
    server["hub"].seed("org/tasks", {"toy.yaml": TASK, "utils.py": UTILS.format(who="hub")},
                       repo_type="dataset")
    res = merge(server, "org/tasks", allow_task_code=True, quiet=True)
    [r] = res.evaluation
    assert r.task.name == "toy_hub" and r.n_examples == 6  # the Hub's dataset, not the working folder's org/data
    assert os.path.exists(server["sentinel"].with_suffix(".hub"))
    assert not os.path.exists(server["sentinel"].with_suffix(".cwd"))
    assert not [p for p in os.listdir(server["cache"]) if p.startswith("hubsoup-tasks-")]
    text = open(os.path.join(server["out"], "eval_results.json")).read()
    assert MARK not in text and server["cache"] not in text  # no server path in what may be published


@pytest.mark.parametrize("task_dir", ["./org/tasks", "org/tasks/..", "../x", "/srv/tasks", "~/tasks",
                                      "org/tasks/sub", "hf://models/org/tasks", "C:/tasks"])
def test_a_local_task_dir_is_refused_by_its_text_alone(server, probes, task_dir):
    """The same message whether such a folder exists or not, and nothing stat'ed before refusing."""
    probes.clear()
    with pytest.raises(InputError) as e:
        merge(server, task_dir)
    assert str(e.value) == (f"task 'toy_hub' task_dir '{task_dir}': only Hub dataset or Space repos (org/name, "
                            "hf://datasets/org/name, hf://spaces/org/name) are accepted here, not local paths")
    assert planted_probes(probes, server) == [] and not [p for p in probes if "/srv/" in p]
    assert not os.path.exists(server["out"])


@pytest.mark.parametrize("content, why", [
    ({"t.yaml": "task: t\ninclude: /etc/hubsoup-secret.yaml\n"}, "includes '/etc/hubsoup-secret.yaml'"),
    ({"t.yaml": "task: t\ninclude: ../outside.yaml\n"}, "includes '../outside.yaml'"),
    ({"t.yaml": "task: t\ndataset_path: json\ndataset_kwargs: {data_files: /etc/passwd}\n"}, "data_files"),
    ({"t.yaml": "task: t\ndataset_path: ./data\n"}, "dataset_path './data'"),
    ({"t.yaml": "task: t\ndataset_path: csv\n"}, "dataset_path 'csv'"),
    ({"t.yaml": "task: t\ndataset_path: org/d\ndataset_kwargs: {trust_remote_code: true}\n"}, "remote code"),
    ({"t.yaml": "task: t\nprocess_docs: !!python/name:os.system\n"}, "tag '!!python/name:os.system'"),
    ({"sub/helper.py": "x = 1\n", "t.yaml": "task: t\n"}, "sub/helper.py is Python"),
])
def test_a_fetched_task_repo_that_would_read_the_host_or_run_code_is_refused(tmp_path, content, why):
    for name, text in content.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    with pytest.raises(InputError, match="task_dir 'org/tasks'") as e:
        check_task_folder(str(tmp_path), "task_dir 'org/tasks'", allow_code=False)
    assert why in str(e.value) and str(tmp_path) not in str(e.value)


def test_a_fetched_task_repo_of_data_and_prompts_passes(tmp_path):
    (tmp_path / "t.yaml").write_text("task: t\ndataset_path: org/d\ninclude: common.yaml\n")
    (tmp_path / "common.yaml").write_text("output_type: multiple_choice\ndoc_to_text: '{{q}}'\n")
    (tmp_path / "README.md").write_text("# tasks\n")
    check_task_folder(str(tmp_path), "task_dir 'org/tasks'", allow_code=False)
    (tmp_path / "u.yaml").write_text("task: u\nprocess_docs: !function utils.proc\n")
    (tmp_path / "utils.py").write_text("def proc(d):\n    return d\n")
    check_task_folder(str(tmp_path), "task_dir 'org/tasks'", allow_code=True)


def test_a_hub_only_evaluation_renders_prompts_in_the_sandbox_and_reads_data_from_the_hub_only(monkeypatch):
    """lm-eval renders a task's Jinja prompts with a plain environment (a template reaches Python's classes); once a
    hub_only evaluation ran, the process renders them in jinja2's sandbox, and a hub_only task's dataset is asked
    of the Hub (hf://datasets/...) with the token its Runner lends: never a packaged builder over local files, never
    the host's login (a load no Runner lent a token to is refused)."""
    import jinja2.exceptions
    import lm_eval.api.task
    import lm_eval.utils

    from hubsoup.eval import lmeval
    from hubsoup.sources.access import scope

    lmeval._guard_lm_eval()
    assert lm_eval.utils.apply_template("{{q}} {{ q|upper }}", {"q": "w1"}) == "w1 W1"
    with pytest.raises(jinja2.exceptions.SecurityError):
        lm_eval.utils.apply_template("{{ q.__class__.__mro__[1].__subclasses__() }}", {"q": "w1"})
    asked = []
    monkeypatch.setattr(lm_eval.api.task.datasets._module, "load_dataset",
                        lambda path, name=None, **kw: asked.append((path, kw.get("token"))) or "ds")
    with scope(hub_only=True):
        with lm_eval.api.task.datasets.lend("hf_runs_own"):
            assert lm_eval.api.task.datasets.load_dataset(path="org/data", name=None) == "ds"
            for bad in ({"path": "json", "data_files": "/etc/passwd"}, {"path": "./data"}, {"path": "csv"}):
                with pytest.raises(InputError):
                    lm_eval.api.task.datasets.load_dataset(**bad)
        with pytest.raises(InputError, match="host's login"):  # no token lent: refused, not the ambient login
            lm_eval.api.task.datasets.load_dataset(path="org/data", name=None)
    assert asked == [("hf://datasets/org/data", "hf_runs_own")]
    lm_eval.api.task.datasets.load_dataset(path="json", data_files="x.json")  # other runs: lm-eval's own
    assert asked[-1] == ("json", None)


def test_lm_eval_task_names_are_labels_never_files():
    """lm-eval loads a task "name" that is a file as a task YAML (its ``!function`` included): never a path here."""
    for spec in ("lm-eval:/srv/x/task.yaml", "lm-eval:../task", "lm-eval:mytask.yaml", "lm-eval:a/b"):
        with pytest.raises(HubsoupError):
            TaskSpec.parse(spec)
    assert TaskSpec.parse("lm-eval:tmmluplus_education_(profession_level)").data == \
        "tmmluplus_education_(profession_level)"


def test_pipeline_hub_only_never_uses_a_repo_shaped_local_task_dir(server, tmp_path, probes, capsys):
    """``pipeline --hub-only`` with ``task_dir=org/tasks`` (a folder of that name beside the pipeline file and in
    the working folder): the Hub's repo or nothing; refused before anything is merged, the Python never run."""
    pipeline = {"base": "alice/base", "candidates": {"models": ["alice/ft-a", "alice/ft-b"]},
                "merges": [{"method": "linear"}], "push": {"namespace": "soup-org"},
                "eval": {"tasks": ["lm-eval:toy_hub,task_dir=org/tasks"]}, "work_dir": str(tmp_path / "work")}
    path = server["work"] / "pipeline.yml"
    path.write_text(yaml.safe_dump(pipeline))
    probes.clear()
    assert main(["pipeline", str(path), "--hub-only"]) == 2
    err = capsys.readouterr().err
    assert "org/tasks" in err and "not found" in err and MARK not in err.replace(str(path), "")
    assert planted_probes(probes, server) == []
    assert not os.path.exists(server["sentinel"].with_suffix(".cwd"))
    assert not os.path.exists(tmp_path / "work") and not server["hub"].exists("soup-org/leaderboard", "dataset")
    shutil.rmtree(server["work"] / "org")
