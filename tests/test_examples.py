"""Every script in examples/ runs, as a user would run it, and does what it says.

Each ``examples/*.py`` (found by glob, so a new example is picked up without editing this
file; ``_*.py`` helpers excepted) runs in a subprocess with the repository on
``PYTHONPATH``, offline, with a throwaway ``HF_HOME`` and ``TMPDIR`` and an empty working
folder. It must exit 0, leave the working folder empty (run from the repository root, it
must not litter the tree) and pass the checks of its output below; a new script runs,
then fails until a ``check_NAME`` is added here. One script runs without ``--out``, to
check that the default output goes to a new temporary folder.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from safetensors.torch import load_file

from paths import ROOT
EXAMPLES = sorted(p for p in glob.glob(os.path.join(ROOT, "examples", "*.py"))
                  if not os.path.basename(p).startswith("_"))
SLOW = {"lines_ties_search", "rewarded_soups_sweep"}  # they fine-tune small models first


def _name(script: str) -> str:
    return os.path.splitext(os.path.basename(script))[0]


DEFAULT_OUT = "custom_method"
"""Run without --out: its output goes to a new temporary folder (TMPDIR), never the working folder, removed at exit."""


def run_example(script: str, tmp_path) -> tuple[str, str]:
    """Run ``script`` as ``python examples/X.py --out OUT`` from an empty folder; returns (OUT, its stdout)."""
    name = _name(script)
    cwd, tmp, out = tmp_path / "cwd", tmp_path / "tmp", tmp_path / "out"
    cwd.mkdir()
    tmp.mkdir()
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf-home"), "TMPDIR": str(tmp),
           # many tiny tensor ops: on a few shared cores, more threads per process only contend
           "OMP_NUM_THREADS": "1"}
    env.pop("HF_TOKEN", None)
    args = [] if name == DEFAULT_OUT else ["--out", str(out)]
    proc = subprocess.run([sys.executable, script, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (f"{name}.py exited {proc.returncode}\n--- stdout\n{proc.stdout}"
                                  f"\n--- stderr (end)\n{proc.stderr[-4000:]}")
    assert os.listdir(cwd) == [], f"{name}.py wrote into its working folder: {os.listdir(cwd)}"
    assert proc.stdout.strip(), f"{name}.py printed nothing"
    # nothing left in TMPDIR: not the temporary output (removed at exit without --out), not torch's compile cache
    # (torch._dynamo makes ``torchinductor_<user>`` there when first imported; the examples put it under their root)
    assert os.listdir(tmp) == [], f"{name}.py left {os.listdir(tmp)} in TMPDIR (issue 48, item 8)"
    if name == DEFAULT_OUT:
        out = re.search(r"(\S*hubsoup-example-median-\w+)", proc.stdout)
        assert out and out.group(1).startswith(str(tmp)), f"{name}.py without --out: not in a temporary folder"
        return "", proc.stdout
    return str(out), proc.stdout


@pytest.fixture(scope="module")
def example_runs(request, tmp_path_factory):
    """Every selected example, started at once and run two at a time (each is one single-threaded process,
    so two cores halve the wall time): script name -> Future of :func:`run_example`'s result."""
    selected = [item.callspec.params["script"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_example_runs_and_does_what_it_says"]
    selected.sort(key=lambda s: _name(s) not in SLOW)  # the longest first
    pool = ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1)))
    futures = {_name(s): pool.submit(run_example, s, tmp_path_factory.mktemp(_name(s))) for s in selected}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


# --- what each example must have produced -----------------------------------------------------

def check_custom_method(out: str, stdout: str) -> None:
    assert "with median" in stdout  # run without --out: its folder is gone, what it printed is checked
    m = re.search(r"median ([\d.]+), average ([\d.]+), fine-tunes ([\d.]+), ([\d.]+), ([\d.]+)", stdout)
    median, average, *fts = (float(x) for x in m.groups())
    assert median < min(average, fts[2])  # robust to the outlier; the average is pulled towards it


def check_lora_to_lora(out: str, stdout: str) -> None:
    folder = os.path.join(out, "merged-lora")
    cfg = json.load(open(os.path.join(folder, "adapter_config.json"), encoding="utf-8"))
    assert cfg["peft_type"] == "LORA" and cfg["r"] <= 16
    assert os.path.isfile(os.path.join(folder, "adapter_model.safetensors"))
    assert not os.path.exists(os.path.join(folder, "model.safetensors"))
    assert "library_name: peft" in open(os.path.join(folder, "README.md"), encoding="utf-8").read()
    m = re.search(r"merged LoRA vs base ([\d.]+), vs the full TIES merge ([\d.]+)", stdout)
    vs_base, vs_full = float(m.group(1)), float(m.group(2))
    assert vs_full < 0.1 * vs_base  # peft loads it, and it is the merge up to the dropped 1% energy


def check_lines_ties_search(out: str, stdout: str) -> None:
    soup = os.path.join(out, "soup")
    chosen = re.search(r"chosen beta=([\d.]+)", stdout).group(1)
    found = json.load(open(os.path.join(soup, "hubsoup_search.json"), encoding="utf-8"))
    assert [p["params"]["beta"] for p in found["scores"]] == [0.0, 0.5, 1.0, 1.5]
    assert float(chosen) == found["best"]["beta"]
    assert found["best_score"] == max(p["score"] for p in found["scores"])
    assert found["seconds"]["references"] > 0 and len(found["seconds"]["points"]) == 4  # normalized: timed
    assert len(re.findall(r"^  beta=", stdout, re.M)) == 4
    card = open(os.path.join(soup, "README.md"), encoding="utf-8").read()
    assert "## Hyper-parameter search" in card and f"`beta={found['best']['beta']}`" in card
    recipe = open(os.path.join(soup, "hubsoup_recipe.yaml"), encoding="utf-8").read()
    assert "method: lines" in recipe and "base_method: ties" in recipe and f"beta: {found['best']['beta']}" in recipe
    for task in ("warm", "size"):  # the two fine-tunes the script trained
        assert os.path.isfile(os.path.join(out, f"ft-{task}", "model.safetensors"))
    assert not [p for p in os.listdir(out) if ".partial-" in p or p.startswith("point-")]  # no scratch left


def check_rewarded_soups_sweep(out: str, stdout: str) -> None:
    front = os.path.join(out, "front")
    index = json.load(open(os.path.join(front, "sweep.json"), encoding="utf-8"))
    assert index["method"] == "rewarded_soups"
    assert [p["value"] for p in index["points"]] == [[0.0, 1.0], [0.25, 0.75], [0.5, 0.5], [0.75, 0.25], [1.0, 0.0]]
    ppl = {}
    for p in index["points"]:
        assert os.path.isfile(os.path.join(front, p["path"], "model.safetensors"))
        results = json.load(open(os.path.join(front, p["path"], "eval_results.json"), encoding="utf-8"))
        ppl[tuple(p["value"])] = {r["task"]: r["metrics"]["perplexity"] for r in results}
    # each end of the front is its own policy: best on its own style, worse on the other
    assert ppl[(1.0, 0.0)]["up"] < ppl[(0.0, 1.0)]["up"]
    assert ppl[(0.0, 1.0)]["down"] < ppl[(1.0, 0.0)]["down"]
    assert len(re.findall(r"lambda-\d\.\d\d-\d\.\d\d$", stdout, re.M)) == 5


def check_sftm(out: str, stdout: str) -> None:
    assert os.path.isfile(os.path.join(out, "sftm-soup", "model.safetensors"))
    assert "method: sftm" in open(os.path.join(out, "sftm-soup", "hubsoup_recipe.yaml"), encoding="utf-8").read()
    rows = re.findall(r"SFTM ([\d.]+)\s+task arithmetic ([\d.]+)", stdout)
    assert len(rows) == 3
    for sftm, ta in rows:
        assert float(sftm) == pytest.approx(0.6, abs=1e-4)
    assert any(abs(float(ta) - 0.6) > 1e-3 for _, ta in rows)  # task arithmetic does not keep them


def check_continual(out: str, stdout: str) -> None:
    soup = os.path.join(out, "soup")
    state = json.load(open(os.path.join(soup, "continual_state", "state.json"), encoding="utf-8"))
    assert state["count"] == 3 and [os.path.basename(m["spec"]) for m in state["models"]] == ["ft-a", "ft-b", "ft-c"]
    assert "state: 2 models (ft-a, ft-b)" in stdout and "state: 3 models (ft-a, ft-b, ft-c)" in stdout
    assert "equals the one-shot OPCM merge of all three: True" in stdout
    assert not os.path.exists(os.path.join(out, "ft-a"))  # added without the earlier inputs
    merged, one_shot = (load_file(os.path.join(out, d, "model.safetensors")) for d in ("soup", "one-shot"))
    assert merged.keys() == one_shot.keys()


def check_lot_exemplars(out: str, stdout: str) -> None:
    recipe = open(os.path.join(out, "lot-soup", "hubsoup_recipe.yaml"), encoding="utf-8").read()
    assert "method: lot" in recipe and "math.jsonl" in recipe and "poetry.jsonl" in recipe
    rows = re.findall(r"(\w+): LOT ([\d.]+)\s+weight average ([\d.]+)", stdout)
    assert [r[0] for r in rows] == ["math", "poetry"]
    assert all(float(lot) < float(avg) for _, lot, avg in rows)


CHECKS = {name[len("check_"):]: f for name, f in globals().items() if name.startswith("check_")}


@pytest.mark.parametrize("script", [pytest.param(s, id=_name(s), marks=[pytest.mark.slow] if _name(s) in SLOW else [])
                                    for s in EXAMPLES])
def test_example_runs_and_does_what_it_says(script, example_runs):
    name = _name(script)
    out, stdout = example_runs[name].result()
    assert name in CHECKS, f"examples/{name}.py ran, but tests/test_examples.py has no check_{name} for its output"
    CHECKS[name](out, stdout)


def test_the_examples_are_all_here_and_documented():
    names = {_name(s) for s in EXAMPLES}
    assert {"lora_to_lora", "lines_ties_search", "rewarded_soups_sweep", "sftm", "continual",
            "lot_exemplars", "custom_method", DEFAULT_OUT} <= names
    readme = open(os.path.join(ROOT, "examples", "README.md"), encoding="utf-8").read()
    # installed as the README installs (issue 48, item 8), not `pip install -e .`
    assert "pip install -e ." not in readme and "pip install -c constraints.txt ." in readme
    for script in EXAMPLES:
        name = _name(script)
        source = open(script, encoding="utf-8").read()
        assert f"python examples/{name}.py" in source, f"{name}.py: its docstring does not say how to run it"
        assert '"--out"' in source and "tempfile.mkdtemp(" in source, f"{name}.py: no --out, or no temporary default"
        assert "atexit.register(shutil.rmtree, root" in source, f"{name}.py: its temporary folder is left behind"
        assert f"python examples/{name}.py" in readme, f"examples/README.md does not list {name}.py"


@pytest.mark.slow
def test_the_evolve_example_runs_as_printed(tmp_path):
    """Issue 48, item 4: the README's evolve commands, as printed, on a fresh copy of the example, offline: its
    tiny models and lm-eval task made by its script, then ``hubsoup evolve examples/evolve.yml --out ./evolved``."""
    import shutil

    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    commands = ["python examples/evolve/make_models.py", "hubsoup evolve examples/evolve.yml --out ./evolved"]
    for command in commands:
        assert command in readme, f"the README no longer prints {command!r}"
    clone = tmp_path / "clone"
    (clone / "examples" / "evolve").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "examples", "evolve.yml"), clone / "examples")
    for name in ("make_models.py", "choices.jsonl"):
        shutil.copy(os.path.join(ROOT, "examples", "evolve", name), clone / "examples" / "evolve")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf-home"), "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
    env.pop("HF_TOKEN", None)
    hubsoup_cli = [sys.executable, "-m", "hubsoup"]  # `hubsoup`, of this tree
    for command in commands:
        argv = command.split()
        argv = [sys.executable, *argv[1:]] if argv[0] == "python" else [*hubsoup_cli, *argv[1:]]
        proc = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "fatal" not in proc.stderr and "divide by zero" not in proc.stderr, proc.stderr[-2000:]  # quiet (item 6)
    out = clone / "evolved"
    table = json.load(open(out / "hubsoup_search.json", encoding="utf-8"))
    assert len(table["trials"]) == 8 and all(r["state"] == "complete" for r in table["trials"])
    card = (out / "README.md").read_text()
    assert "\n# evolved\n" in card and f'from_pretrained("{out}")' in card and ".hubsoup-best" not in card
    assert (out / "model.safetensors").is_file()
