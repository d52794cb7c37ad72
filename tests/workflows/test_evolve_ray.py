"""hubsoup evolve on a real local Ray cluster: the same study as a local run, also when a worker node dies.

The node is killed while a trial runs on it, whatever the load: the first attempt at trial 2 (generation 1)
marks that it is inside the trial and then waits there (until its node is killed; bounded, so that a broken
test ends), and the test kills the node once it sees the mark. No sleep window to land in (issue 48, item 5).
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from method_helpers import tiny_lm_zoo  # tests/ is on sys.path

pytest.importorskip("optuna", reason="hubsoup[evolve] is not installed")
ray = pytest.importorskip("ray", reason="hubsoup[ray] is not installed")

from hubsoup.workflows.evolve import SEARCH_FILE, evolve  # noqa: E402
from hubsoup.workflows.executors import RayExecutor  # noqa: E402
from ray_cluster import start_worker_node  # noqa: E402

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base, fts, data = tiny_lm_zoo(tmp_path_factory.mktemp("evolve_ray"))
    return {"base": base, "models": fts, "method": "ties",
            "space": {"density": [0.1, 0.9], "weight": {"range": [0.0, 1.0], "per": "input", "layer_groups": 2}},
            "optimizer": "cmaes", "trials": 6, "population": 4, "seed": 0,  # generation 1: trials 4 and 5
            "eval": {"tasks": [f"perplexity:{data}"]}}


def test_ray_gives_the_local_study_even_when_a_worker_node_dies(ray_cluster, tiny, tmp_path):
    cluster = ray_cluster
    local, far = str(tmp_path / "local"), str(tmp_path / "ray")
    evolve(tiny, local, quiet=True)
    marks = tmp_path / "attempts"
    marks.mkdir()

    def trial(payload):  # on the worker nodes: notes each attempt; trial 4's first one waits to be killed
        import os
        import time

        from hubsoup.workflows.executors import _ray_trial

        number = payload["number"]
        open(os.path.join(str(marks), f"{number}-{os.getpid()}"), "w").close()  # "inside trial N", for the test
        first = len([m for m in os.listdir(str(marks)) if m.startswith(f"{number}-")]) == 1
        if number == 4 and first:  # the one the test kills its node under
            deadline = time.monotonic() + 240  # the node dies meanwhile; this bound only ends a broken test
            while time.monotonic() < deadline:
                time.sleep(0.05)
        return _ray_trial(payload)  # what a task runs by default

    done: dict = {}

    def drive():  # the driver in a thread: this one kills the node (Cluster's node processes are this thread's)
        try:
            done["res"] = evolve(tiny, far, quiet=True, executor=RayExecutor(trial=trial))
        except BaseException as e:  # noqa: BLE001 - reported below
            done["error"] = e

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    deadline = time.time() + 300  # once a trial of generation 1 is inside its trial: kill its node, start another
    while time.time() < deadline and not any(n.startswith("4-") for n in os.listdir(marks)):
        time.sleep(0.05)
    [node] = list(cluster.worker_nodes)
    cluster.remove_node(node, allow_graceful=False)
    start_worker_node(cluster)
    driver.join(timeout=300)
    assert "error" not in done, done.get("error")
    res = done["res"]
    attempts = sorted(os.listdir(marks))
    tries_of_4 = [a for a in attempts if a.startswith("4-")]
    assert len(tries_of_4) == 2 and len({a.split("-")[1] for a in tries_of_4}) == 2  # retried, in another process
    assert [s["number"] for s in res.seconds] == [0, 1, 2, 3, 4, 5]  # each trial told once
    # the worker process keeps its session (inputs in memory, one model, the evaluator) from trial to trial
    assert [s["session"] for s in res.seconds[:4]] == [{"new": True, "kept": True}] + [{"new": False, "kept": True}] * 3
    # generation 1 ran (again) on the new node: a new process, whose first trial opened a session for both
    assert sorted(s["session"]["new"] for s in res.seconds[4:]) == [False, True]
    with open(os.path.join(local, SEARCH_FILE), "rb") as a, open(os.path.join(far, SEARCH_FILE), "rb") as b:
        assert a.read() == b.read()  # the same study, bit for bit, as the local executor's
    with open(os.path.join(local, "model.safetensors"), "rb") as a, \
            open(os.path.join(far, "model.safetensors"), "rb") as b:
        assert a.read() == b.read()
