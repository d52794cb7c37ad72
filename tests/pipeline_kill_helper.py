"""Run a pipeline and kill this process part-way, for tests/workflows/pipeline/test_pipeline*.py.

    python tests/pipeline_kill_helper.py PIPELINE.yml MARKER [merge|push]

``merge`` (default): SIGKILL inside a merge: with select.top_k none, after the first merge is
pushed; with select.top_k, in the second merge (nothing is pushed before every merge is scored).
Its temporary output and lock are left behind, as a crash would leave them.

``push``: ``hubsoup pipeline`` (the CLI, with its SIGTERM handling) gets SIGTERM while it pushes
its second merge, as a CI job cancelled or timed out does; the exit status is the CLI's.

MARKER is created just before the signal. Never imported by the library.
"""

from __future__ import annotations

import os
import signal
import sys

if __name__ == "__main__":
    from hubsoup.api import MergeResult
    from hubsoup.output import shards
    from hubsoup.workflows.pipeline import load_pipeline, run_pipeline

    path, marker = sys.argv[1], sys.argv[2]
    mode = sys.argv[3] if len(sys.argv) > 3 else "merge"
    state = {"pushed": 0, "merges": 0, "pushes": 0}
    if mode == "push":
        from hubsoup.cli import main

        original_push = MergeResult.push_to_hub

        def push_to_hub(self, *args, **kwargs):
            state["pushes"] += 1
            if state["pushes"] == 2:
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGTERM)  # handled in this (the main) thread, inside the push
            return original_push(self, *args, **kwargs)

        MergeResult.push_to_hub = push_to_hub
        sys.exit(main(["pipeline", path]))

    top_k = (load_pipeline(path).select or None) and load_pipeline(path).select.top_k
    original = shards.ShardedWriter.write
    opened = set()

    def write(self, name, tensor):
        if id(self) not in opened:
            opened.add(id(self))
            state["merges"] += 1
        if (state["pushed"] >= 1) if top_k is None else (state["merges"] >= 2):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, name, tensor)

    def on_event(kind, merge):
        if kind == "pushed":
            state["pushed"] += 1

    shards.ShardedWriter.write = write
    report = run_pipeline(path, on_event=on_event)
    sys.exit(report.exit_code)
