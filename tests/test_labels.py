"""Issue 44, items 1 and 2: a name in a config is a label, never a path; hubsoup replaces only folders it made.

The probe's cases are here: a mergekit-multi stage named ``..``, an absolute path, ``../x``, a deep ``../``,
``a/b`` or ``\\x00`` is refused with one line (exit 2) through ``hubsoup run stages.yml --out out``, through
``run_recipe(text, hub_only=True)`` on a server and through a ``hubsoup pipeline`` whose merge ``config:`` is
such a stream (with and without ``--hub-only``), before anything is written: every folder of the test is as it
was, byte for byte. A stage named like an unrelated folder (``proj/notes``), an evolve ``--out`` holding a file
named ``hubsoup_search.json`` or an input's weights, a ``--out`` that hubsoup did not make: refused, with or
without ``--overwrite``. A static check walks the package for every place a config's text reaches a path.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import sys

import pytest
import yaml

import hubsoup
from hubsoup.cli import main
from hubsoup.errors import ParameterError
from hubsoup.output.folder import MARKER, read_marker
from hubsoup.untrusted import label, owned_path

from paths import ROOT as REPO

# the probe's stage names (the absolute one is made per test: a folder the test owns)
PROBES = {"dotdot": "..", "absolute": None, "parent": "../x", "deep": "../../../..", "nested": "a/b", "nul": "\x00"}


def snapshot(root) -> dict[str, str]:
    """Every file and folder under ``root``: its kind and, for a file, its content's sha256."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in sorted(files):
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def stream(name: str, a: str, b: str) -> str:
    """A mergekit-multi stream whose first stage is named ``name`` and whose final stage merges it."""
    quoted = json.dumps(name)  # a YAML double-quoted scalar (the NUL byte as its escape)
    return (f"name: {quoted}\nmerge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: 0.5}}\n"
            f"  - model: {b}\n    parameters: {{weight: 0.5}}\ndtype: float32\n---\n"
            f"merge_method: linear\nmodels:\n  - model: {quoted}\n    parameters: {{weight: 1.0}}\ndtype: float32\n")


@pytest.fixture()
def project(tmp_path, llama, monkeypatch):
    """A user's project folder, the working folder: models, a config, and a folder of notes with a file in it."""
    base, fts = llama
    proj = tmp_path / "home" / "proj"
    (proj / "notes").mkdir(parents=True)
    (proj / "notes" / "keep.txt").write_text("mine")
    (tmp_path / "home" / "diary.txt").write_text("also mine")
    for name, src in (("base", base), ("ft-a", fts[0]), ("ft-b", fts[1])):
        shutil.copytree(src, proj / "models" / name)
    monkeypatch.chdir(proj)
    return tmp_path


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def probe_name(key: str, tmp_path) -> str:
    return str(tmp_path / "home") if PROBES[key] is None else PROBES[key]


# ---- the label ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, why", [
    ("..", "'.' or '..'"), (".", "'.' or '..'"), ("/etc", "absolute path"), ("\\\\srv\\share", "absolute path"),
    ("~", "absolute path"), ("../x", "separator"), ("../../../..", "separator"), ("a/b", "separator"),
    ("a\\b", "separator"), ("\x00", "control character"), ("a\nb", "control character"), ("C:x", "drive"),
    ("", "empty"), ("x" * 101, "longer than 100"), (".hidden", "may hold only"), ("a b", "may hold only"),
    ("trailing.", "may hold only"), (7, "must be text"),
])
def test_a_label_refuses_every_path_form(text, why):
    with pytest.raises(ParameterError, match="a name in a config is a label, never a path") as e:
        label(text, "stage name")
    assert why in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ParameterError):
        owned_path("/srv/run", text, what="stage name")


def test_labels_that_are_names_pass_and_stay_inside_their_folder(tmp_path):
    for name in ("first", "stage-1", "ZeroXClem-Llama-3.1-8B-Athena-Apollo-exp", "knowledge_core",
                 "tmmluplus_education_(profession_level)", "x" * 100):
        assert label(name, "stage name") == name
        assert os.path.dirname(owned_path(str(tmp_path), name)) == str(tmp_path)
    assert owned_path(str(tmp_path), "vision", prefix=".module-") == str(tmp_path / ".module-vision")


# ---- stage names, through every way in (the probe's cases) ----------------------------------------------

@pytest.mark.parametrize("key", sorted(PROBES))
def test_hubsoup_run_refuses_a_stage_named_as_a_path_before_anything(project, key, capsys):
    name = probe_name(key, project)
    (project / "home" / "proj" / "stages.yml").write_text(stream(name, "models/ft-a", "models/ft-b"))
    before = snapshot(project)
    for extra in ([], ["--overwrite"], ["--intermediate-dir", "notes"]):
        assert main(["run", "stages.yml", "--out", "out", *extra]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert "stage 'name'" in line and "a name in a config is a label, never a path" in line
        assert snapshot(project) == before


@pytest.mark.parametrize("key", sorted(PROBES))
def test_a_servers_run_recipe_refuses_a_stage_named_as_a_path_before_anything(project, key):
    name = probe_name(key, project)
    server = project / "home" / "proj"
    before = snapshot(project)
    with pytest.raises(ParameterError, match="a name in a config is a label, never a path"):
        hubsoup.run_recipe(stream(name, "alice/ft-a", "alice/ft-b"), str(server / "runs" / "out"), hub_only=True)
    assert snapshot(project) == before


@pytest.mark.parametrize("hub_only", [False, True])
@pytest.mark.parametrize("key", sorted(PROBES))
def test_a_pipeline_whose_config_is_such_a_stream_is_refused_before_anything(project, key, hub_only, capsys):
    name = probe_name(key, project)
    proj = project / "home" / "proj"
    pipeline = {"base": "alice/base", "merges": [{"config": stream(name, "bob/ft-a", "bob/ft-b")}],
                "push": {"namespace": "soup-org", "name": "soup-{hash8}"}, "work_dir": "work"}
    (proj / "pipeline.yml").write_text(yaml.safe_dump(pipeline))
    before = snapshot(project)
    assert main(["pipeline", "pipeline.yml", *(["--hub-only"] if hub_only else [])]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "stage 'name'" in line and "never a path" in line
    assert snapshot(project) == before


def test_a_pipelines_leaderboard_folder_is_a_label(project):
    from hubsoup.workflows.pipeline import load_pipeline

    base = {"base": "alice/base", "candidates": {"models": ["bob/a", "bob/b"]}, "merges": [{"method": "linear"}],
            "push": {"namespace": "soup-org"}}
    for bad in ("../../x", "/tmp/x", ".."):
        with pytest.raises(ParameterError, match="leaderboard.folder.*never a path"):
            load_pipeline({**base, "leaderboard": {"folder": bad}})
    assert load_pipeline({**base, "leaderboard": {"folder": "board"}}).leaderboard.folder == "board"


def test_a_hub_only_stream_whose_stage_reads_another_is_refused_before_anything(project):
    """On a server a stage's output is a local folder, which a later stage may not read: refused at once (the
    probe saw the first stage written and the second refused)."""
    before = snapshot(project)
    with pytest.raises(ParameterError, match="a local folder, which a hub_only run does not read"):
        hubsoup.run_recipe(stream("first", "alice/ft-a", "alice/ft-b"), str(project / "out"), hub_only=True)
    assert snapshot(project) == before


# ---- intermediate stages: replaced only when an earlier run made them -----------------------------------

def test_a_stage_named_like_an_unrelated_folder_never_replaces_it(project, capsys):
    proj = project / "home" / "proj"
    (proj / "stages.yml").write_text(stream("notes", "models/ft-a", "models/ft-b"))
    before = snapshot(project)
    for extra in ([], ["--overwrite"]):
        assert main(["run", "stages.yml", "--out", "out", "--intermediate-dir", ".", *extra]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert "stage 'notes'" in line and "hubsoup did not make it" in line and MARKER in line
        assert snapshot(project) == before
    # a stage folder an earlier run made is replaced without --overwrite; the output is the user's call
    assert main(["run", "stages.yml", "--out", "out", "--intermediate-dir", "inter", "-q"]) == 0
    assert read_marker(str(proj / "inter" / "notes"))["kind"] == "stage"
    assert read_marker(str(proj / "out"))["kind"] == "merge"
    capsys.readouterr()
    assert main(["run", "stages.yml", "--out", "out2", "--intermediate-dir", "inter", "-q"]) == 0
    # a merge output of the user's (hubsoup made it, not as this stream's stage): only with --overwrite
    assert main(["merge", "models/ft-a", "models/ft-b", "--base", "models/base", "--method", "linear",
                 "--out", "inter2/notes", "-q"]) == 0
    capsys.readouterr()
    assert main(["run", "stages.yml", "--out", "out3", "--intermediate-dir", "inter2", "-q"]) == 2
    assert "no .hubsoup marker of a stage" in one_error_line(capsys.readouterr().err)
    assert main(["run", "stages.yml", "--out", "out3", "--intermediate-dir", "inter2", "-q", "--overwrite"]) == 0
    assert (proj / "notes" / "keep.txt").read_text() == "mine"


def test_the_intermediate_folder_may_not_be_inside_the_output(project, capsys):
    (project / "home" / "proj" / "stages.yml").write_text(stream("blend", "models/ft-a", "models/ft-b"))
    before = snapshot(project)
    assert main(["run", "stages.yml", "--out", "out", "--intermediate-dir", "out/stages"]) == 2
    assert "inside the output" in one_error_line(capsys.readouterr().err)
    assert snapshot(project) == before


# ---- outputs: replaced only when hubsoup made them -------------------------------------------------------

def merge_args(out: str, *extra: str) -> list[str]:
    return ["merge", "models/ft-a", "models/ft-b", "--base", "models/base", "--method", "linear", "--out", out,
            "-q", *extra]


def test_out_that_hubsoup_did_not_make_is_refused_with_or_without_overwrite(project, capsys):
    proj = project / "home" / "proj"
    (proj / "look-alike").mkdir()
    (proj / "look-alike" / "hubsoup_recipe.yaml").write_text("a file named like hubsoup's output")
    (proj / "look-alike" / "thesis.tex").write_text("mine")
    (proj / "a-file").write_text("mine")
    os.symlink(proj / "notes", proj / "link")
    before = snapshot(project)
    for out, why in (("notes", "hubsoup did not make it"), ("look-alike", "hubsoup did not make it"),
                     ("a-file", "is a file"), ("link", "is a link"), (".", "working folder"),
                     ("..", "working folder")):
        for extra in ([], ["--overwrite"]):
            assert main(merge_args(out, *extra)) == 2
            assert why in one_error_line(capsys.readouterr().err), (out, extra)
            assert snapshot(project) == before


def test_what_hubsoup_made_is_replaced_with_overwrite_and_an_older_output_too(project, capsys):
    proj = project / "home" / "proj"
    assert main(merge_args("soup")) == 0
    assert read_marker(str(proj / "soup")) == {"made_by": "hubsoup", "kind": "merge"}
    assert main(merge_args("soup")) == 2
    assert "already exists; pass --overwrite" in one_error_line(capsys.readouterr().err)
    assert main(merge_args("soup", "--overwrite")) == 0
    # an output of a hubsoup older than the marker: its recipe and its weights, no marker
    os.remove(proj / "soup" / MARKER)
    before = snapshot(project)
    assert main(merge_args("soup")) == 2
    capsys.readouterr()
    assert snapshot(project) == before
    assert main(merge_args("soup", "--overwrite")) == 0
    assert read_marker(str(proj / "soup"))["kind"] == "merge"
    # recipe without weights: not an output
    os.remove(proj / "soup" / MARKER)
    os.remove(proj / "soup" / "model.safetensors")
    assert main(merge_args("soup", "--overwrite")) == 2
    assert "hubsoup did not make it" in one_error_line(capsys.readouterr().err)


def test_the_marker_is_never_pushed(project):
    from hubsoup.hub import upload_plan

    proj = project / "home" / "proj"
    assert main(merge_args("soup")) == 0
    names = [n for n, _ in upload_plan(str(proj / "soup"), "me/soup")]
    assert MARKER not in names and "model.safetensors" in names


# ---- evolve studies ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from method_helpers import tiny_lm_zoo

    return tiny_lm_zoo(tmp_path_factory.mktemp("labels-lm"))


def evolve_config(lm, **over):
    base, fts, data = lm
    cfg = {"base": base, "models": fts, "method": "task_arithmetic", "space": {"scale": [0.2, 1.0]},
           "optimizer": "random", "trials": 1, "population": 1, "seed": 0, "eval": {"tasks": [f"perplexity:{data}"]}}
    cfg.update(over)
    return cfg


def test_evolve_out_holding_a_file_named_like_a_study_is_refused_and_nothing_deleted(lm, tmp_path, capsys):
    pytest.importorskip("optuna")
    from hubsoup.workflows.evolve import SEARCH_FILE, evolve

    out = tmp_path / "mine"
    out.mkdir()
    (out / SEARCH_FILE).write_text("{}")
    (out / "thesis.tex").write_text("mine")
    (out / "data").mkdir()
    (out / "data" / "x.csv").write_text("1,2")
    before = snapshot(tmp_path)
    with pytest.raises(ParameterError, match=f"holds no hubsoup study.*{SEARCH_FILE} is not one"):
        evolve(evolve_config(lm), str(out), quiet=True)
    assert snapshot(tmp_path) == before
    cfg = tmp_path / "evolve.yml"
    cfg.write_text(yaml.safe_dump(evolve_config(lm)))
    before = snapshot(tmp_path)
    assert main(["evolve", str(cfg), "--out", str(out)]) == 2
    assert "holds no hubsoup study" in one_error_line(capsys.readouterr().err)
    assert snapshot(tmp_path) == before


def test_evolve_out_set_to_an_input_or_its_parent_is_refused(lm, tmp_path):
    pytest.importorskip("optuna")
    from hubsoup.workflows.evolve import evolve

    base, fts, data = lm
    before = snapshot(os.path.dirname(fts[0]))
    for out in (fts[0], base, os.path.dirname(fts[0])):
        with pytest.raises(ParameterError, match="the study writes its best model there"):
            evolve(evolve_config(lm), out, quiet=True)
    assert snapshot(os.path.dirname(fts[0])) == before


@pytest.mark.slow  # two small studies
def test_an_extended_study_replaces_only_the_best_models_files(lm, tmp_path):
    pytest.importorskip("optuna")
    from hubsoup.workflows.evolve import evolve

    out = tmp_path / "study"
    evolve(evolve_config(lm), str(out), quiet=True)
    marker = read_marker(str(out))
    assert marker["kind"] == "evolve" and "model.safetensors" in marker["best"] and MARKER not in marker["best"]
    (out / "my-notes.txt").write_text("mine")  # the user's file in the study folder
    evolve(evolve_config(lm, trials=2), str(out), quiet=True)
    assert (out / "my-notes.txt").read_text() == "mine"
    assert read_marker(str(out))["best"] == marker["best"]


# ---- the static check: every place a config's text reaches a path goes through label / owned_path ----------

_SINKS = {("os", "path", "join"), ("os", "replace"), ("os", "rename"), ("os", "remove"), ("os", "unlink"),
          ("os", "makedirs"), ("os", "mkdir"), ("shutil", "rmtree"), ("shutil", "move"), ("shutil", "copy"),
          ("shutil", "copy2"), ("shutil", "copyfile"), ("shutil", "copytree"), ("open",), ("rmtree",), ("_remove",),
          ("workfolder", "remove")}
# what reads text someone else wrote (a config, recipe, card, Hub file), and the names that hold such text
_SOURCES = {"load_yaml", "load_yaml_all", "read_stages", "load", "loads", "from_yaml", "from_dict", "safe_load",
            "load_pipeline", "read_config", "parse", "read_marker"}
_ROOTS = {"cfg", "spec", "stage", "st", "recipe", "data", "d"}
_CLEAN = {"label", "owned_path", "short", "len", "int", "bool", "float", "hexdigest", "public_value",
          "public_file_ref", "isinstance"}

# Reviewed: each place where text from a config reaches a path on purpose, and why it is not a name made a path.
ALLOWED = {
    ("hubsoup/arch.py", "_auto_mappings", "open(path, encoding='utf-8')"):
        "transformers' own source file, found by importlib (parse() is ast.parse, not a config)",
    ("hubsoup/options.py", "parse_device_map", "open(s, encoding='utf-8')"):
        "the caller's --device-map FILE (refused in hub_only by options), not a name from a config",
    ("hubsoup/workflows/evolve.py", "load", "open(source, encoding='utf-8')"):
        "the evolve config file the caller names",
    ("hubsoup/workflows/pipeline/run.py", "_run_pipeline", "os.path.join(p.root, work_dir or p.work_dir)"):
        "the operator's work_dir (a path by design, relative to the pipeline file; hub_only tests use absolute "
        "ones); hubsoup replaces nothing in it it did not make",
    ("hubsoup/workflows/pipeline/context.py", "_tasks", "os.path.join(self.p.root, os.path.expanduser(spec.data))"):
        "evaluation data relative to the pipeline file; refused in hub_only before this line",
    ("hubsoup/workflows/pipeline/context.py", "_tasks", "os.path.join(self.p.root, spec.head)"):
        "a classifier head file relative to the pipeline file; refused in hub_only before this line",
    ("hubsoup/workflows/pipeline/run.py", "_run_pipeline", "os.makedirs(os.path.dirname(work), exist_ok=True)"):
        "the same work_dir",
    ("hubsoup/workflows/pipeline/execute.py", "_merge_streamed", "os.makedirs(target.work_dir, exist_ok=True)"):
        "'merges' under the same work_dir: where a streamed push keeps the shards on their way (a fixed name)",
    ("hubsoup/eval/lmeval.py", "check_task_folder", "os.path.join(dirpath, inc)"):
        "an include of a fetched task repo, refused unless relative without '..' and then checked (realpath) to lie "
        "inside the repo's folder",
    ("hubsoup/workflows/pipeline/leaderboard.py", "leaderboard", "os.path.join(run.work, p.leaderboard.folder)"):
        "leaderboard.folder is a label (load_pipeline checks it with untrusted.label)",
    ("hubsoup/workflows/pipeline/leaderboard.py", "leaderboard", "os.makedirs(folder, exist_ok=True)"): "the same folder",
    ("hubsoup/workflows/pipeline/leaderboard.py", "leaderboard", "os.path.join(folder, f'.{name}.tmp')"): "the same folder",
    ("hubsoup/workflows/pipeline/leaderboard.py", "leaderboard", "open(tmp, 'w', encoding='utf-8')"): "the same folder",
    ("hubsoup/workflows/pipeline/leaderboard.py", "leaderboard", "os.path.join(folder, name)"): "the same folder",
    ("hubsoup/workflows/pipeline/leaderboard.py", "leaderboard", "os.replace(tmp, os.path.join(folder, name))"):
        "the same folder",
    ("hubsoup/workflows/search.py", "_search_remote", "os.path.join(folder.path, f'point-{best_i:03d}')"):
        "an index (the best point's number)",
    ("hubsoup/workflows/search.py", "_search_remote", "open(os.path.join(best_dir, EVAL_FILE), 'w', encoding='utf-8')"):
        "the same folder (an index)",
    ("hubsoup/workflows/evolve.py", "_write_best", "os.path.join(out, stale)"):
        "names from the marker hubsoup wrote, each checked with untrusted.label before (_is_name)",
    ("hubsoup/workflows/evolve.py", "_write_best", "os.remove(path)"): "the same names",
}


def _dotted(node) -> tuple[str, ...]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return tuple(reversed(parts))


def _call_name(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def config_text_reaching_paths() -> set[tuple[str, str, str]]:
    """Every call of a path function (``os.path.join``'s parts after the first, ``open``, ``os.replace``,
    ``shutil.rmtree``, ...) in the package whose argument holds text read from a config, recipe, card or Hub file:
    a taint walk inside each function, from the readers (``load_yaml``, ``read_stages``, ``from_yaml``, ...) and the
    names that hold their data (``cfg``, ``spec``, ``stage``, ``recipe``, ``data``, a pipeline run's ``p``), through assignments,
    loops and comprehensions, stopped by ``label`` / ``owned_path`` (and by what turns text into a number or digest)."""
    hits = set()
    for dirpath, _, files in os.walk(os.path.join(REPO, "hubsoup")):
        for fn in files:
            if not fn.endswith(".py"):
                continue
            path = os.path.join(dirpath, fn)
            rel = os.path.relpath(path, REPO).replace(os.sep, "/")
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for func in ast.walk(tree):
                if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                tainted: set[str] = set()

                def is_tainted(e) -> bool:
                    if e is None or isinstance(e, ast.Constant):
                        return False
                    if isinstance(e, ast.Call):
                        name = _call_name(e)
                        if name in _CLEAN:
                            return False
                        if name in _SOURCES:
                            return True
                        return (any(is_tainted(a) for a in e.args) or any(is_tainted(k.value) for k in e.keywords)
                                or (isinstance(e.func, ast.Attribute) and is_tainted(e.func.value)))
                    if isinstance(e, ast.Name):
                        return e.id in tainted or e.id in _ROOTS
                    if isinstance(e, ast.Attribute):
                        return _dotted(e)[:2] in (("self", "p"), ("run", "p")) or is_tainted(e.value)
                    if isinstance(e, ast.Subscript):
                        return is_tainted(e.value)
                    return any(is_tainted(c) for c in ast.iter_child_nodes(e) if isinstance(c, ast.expr))

                def bind(target) -> None:
                    if isinstance(target, ast.Name):
                        tainted.add(target.id)
                    elif isinstance(target, (ast.Tuple, ast.List)):
                        for t in target.elts:
                            bind(t)

                for _ in range(3):  # a few rounds: a name tainted late taints what was assigned from it
                    for node in ast.walk(func):
                        if isinstance(node, ast.Assign) and is_tainted(node.value):
                            for t in node.targets:
                                bind(t)
                        elif isinstance(node, (ast.For, ast.comprehension)) and is_tainted(node.iter):
                            bind(node.target)
                        elif isinstance(node, ast.NamedExpr) and is_tainted(node.value):
                            bind(node.target)
                for node in ast.walk(func):
                    if isinstance(node, ast.Call) and _dotted(node.func) in _SINKS:
                        args = node.args[1:] if _dotted(node.func) == ("os", "path", "join") else node.args
                        if any(is_tainted(a) for a in args):
                            hits.add((rel, func.name, ast.unparse(node)))
    return hits


def test_every_place_a_configs_text_reaches_a_path_is_a_reviewed_one():
    """The issue's hole was ``os.path.join(inter, s.name)`` with a stage's name: that line (and any new one like
    it) is found by this walk; a stage's folder is now ``owned_path(inter, s.name)``, which the walk accepts."""
    found = config_text_reaching_paths()
    new = sorted(found - set(ALLOWED))
    assert not new, "config text reaches a path here; make it a label (hubsoup.untrusted.owned_path) or review it:\n" \
        + "\n".join(map(str, new))
    gone = sorted(set(ALLOWED) - found)
    assert not gone, f"reviewed places no longer found (remove them from ALLOWED): {gone}"


def test_the_static_check_finds_the_hole_it_was_written_for(tmp_path, monkeypatch):
    """The walk is not vacuous: the code before the fix (a stage's name joined to the folder) is found."""
    src = os.path.join(REPO, "hubsoup", "workflows", "rerun.py")
    with open(src, encoding="utf-8") as f:
        text = f.read()
    before = 'owned_path(inter, s.name, what="stage name")'
    assert before in text
    fake = tmp_path / "hubsoup" / "workflows"
    fake.mkdir(parents=True)
    (fake / "rerun.py").write_text(text.replace(before, "os.path.join(inter, s.name)"))
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    assert ("hubsoup/workflows/rerun.py", "run_stages", "os.path.join(inter, s.name)") in config_text_reaching_paths()
