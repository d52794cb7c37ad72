"""Run a pipeline and SIGKILL this process inside the second merge, for tests/test_pipeline.py.

    python tests/pipeline_kill_helper.py PIPELINE.yml MARKER

After the first merge is pushed, the first tensor the next merge writes kills the process
(after creating the file MARKER): its temporary output and lock are left behind, as a crash
would leave them. Never imported by the library.
"""

from __future__ import annotations

import os
import signal
import sys

if __name__ == "__main__":
    from hubsoup.output import shards
    from hubsoup.workflows.pipeline import run_pipeline

    path, marker = sys.argv[1], sys.argv[2]
    state = {"pushed": 0}
    original = shards.ShardedWriter.write

    def write(self, name, tensor):
        if state["pushed"] >= 1:
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, name, tensor)

    def on_event(kind, merge):
        if kind == "pushed":
            state["pushed"] += 1

    shards.ShardedWriter.write = write
    report = run_pipeline(path, on_event=on_event)
    sys.exit(report.exit_code)
