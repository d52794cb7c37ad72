"""``merge --search`` and ``hubsoup pipeline`` on a real local Ray cluster: the local run's result, computed on the nodes.

One cluster for the module (``ray_cluster``: a head that runs no task and a worker node of 1 CPU, each its own
raylet and worker processes); each point or merge is a Ray task (merged in memory and scored on the node), the
driver writes and pushes. ``tests/workflows/test_executors.py`` checks the same comparisons in-process.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("ray", reason="hubsoup[ray] is not installed")

from hubsoup.cli import main  # noqa: E402
from tests.workflows.test_executors import (GRID, assert_same_pipeline, assert_same_search,  # noqa: E402,F401
                                            pipeline_round, search_both, tiny)
from tests.workflows.pipeline.test_pipeline import publish, zoo  # noqa: E402,F401

pytestmark = pytest.mark.slow


def test_search_on_ray_gives_the_local_search(ray_cluster, tiny, tmp_path):
    a, b = search_both(tiny, tmp_path, "ray")
    assert a.best == b.best and a.best_score == b.best_score
    assert_same_search(str(tmp_path / "local"), str(tmp_path / "exec"))
    # the CLI: merge --search --executor ray (this process is connected to the cluster: RAY_ADDRESS's role)
    base, fts, data = tiny
    out = str(tmp_path / "cli")
    assert main(["merge", *fts, "--base", base, "--method", "ties", "--out", out, "--eval", f"perplexity:{data}",
                 "--search", "density=0.2:0.8:0.3", "--search", "merge=mean,sum", "--executor", "ray"]) == 0
    assert_same_search(str(tmp_path / "local"), out)


def test_pipeline_on_ray_gives_the_local_leaderboard_and_pushes(ray_cluster, hub, zoo, tmp_path):
    from hubsoup.workflows.executors import RayExecutor

    publish(hub, zoo, "base", "ft-a", "ft-b", "ft-c")
    hub.login("alice")
    marks = tmp_path / "tasks"
    marks.mkdir()

    def trial(payload):  # what each task runs (the default), noting the process it ran in
        import os

        from hubsoup.workflows.executors import _ray_trial

        open(os.path.join(str(marks), f"{payload['number']}-{os.getpid()}"), "w").close()
        return _ray_trial(payload)

    local = pipeline_round(hub, tmp_path, "local", None)
    far = pipeline_round(hub, tmp_path, "exec", RayExecutor(trial=trial))
    assert_same_pipeline(local, far)
    assert len(local[3]) == 4 and len(far[3]) == 3  # the merge not selected was never written
    tasks = sorted(os.listdir(marks))
    assert [t.split("-")[0] for t in tasks] == ["0", "1", "2", "3"]  # each merge one task, on the worker node
    assert str(os.getpid()) not in {t.split("-")[1] for t in tasks}
    assert far[4].count("scored ") == 4  # scored on the node; the driver wrote and pushed the 3 selected
