"""The Space app's ZeroGPU path on this CPU machine, through the `spaces` package's own machinery (for
tests/test_space_zerogpu.py; never imported by the library).

    python tests/zerogpu_space.py SPACE_FOLDER RESULT.json

What is real: the `spaces` package, imported with ``SPACES_ZERO_GPU=true`` as on a ZeroGPU Space, so
``@spaces.GPU`` is its real wrapper (``spaces.zero.wrappers.generator_function_wrapper``): the call's arguments go
through its pickling queue to a worker process it forks, the generator runs there, each yield is pickled back,
and closing the generator here sets its stop event, which closes the worker's generator at its next yield. The
app (``app.py`` of a Space folder written by ``hubsoup space create --hardware zero-a10g``), hubsoup, the merge,
the test Hub and the push are real.

What is stubbed is the GPU itself, and only that:

* the ZeroGPU device API (``SPACES_ZERO_DEVICE_API_URL``), the scheduler that lends a GPU: a small HTTP server
  in this process answering ``/schedule`` (a GPU is free), ``/allow`` (records the worker's pid), ``/release``;
* torch's CUDA build, which `spaces` inspects at import: this CPU wheel gets ``torch.version.cuda``, a
  ``torch._C._cuda_init`` that raises, and a picklable ``torch.cuda._is_in_bad_fork``;
* in the worker, ``spaces.zero.torch.init`` (make the lent GPU visible, touch it) and ``.move`` (copy the
  tensors packed at startup onto it): there is no GPU to do either on. The worker then merges on the CPU
  (the app asks ``torch.cuda.is_available()`` there, as it does on a real ZeroGPU worker, where it is True).

It writes RESULT.json: what each run returned, the progress the app's main process saw, and the device API's
calls. Environment: ``HF_ENDPOINT`` (the test Hub), ``ZEROGPU_TOKEN`` (the visitor's token).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

CALLS: list[dict] = []


class DeviceAPI(BaseHTTPRequestHandler):
    """The ZeroGPU scheduler `spaces.zero.api.APIClient` talks to: one GPU, always free."""

    def do_POST(self):  # noqa: N802 - http.server's name
        url = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        CALLS.append({"path": url.path, **{k: query[k] for k in ("pid", "fail") if k in query}})
        body = b""
        if url.path == "/schedule":
            body = json.dumps({"idle": False, "nvidiaIndex": 0, "nvidiaUUID": "GPU-none-on-this-machine",
                               "allowToken": "allow-token"}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def fake_cuda_build() -> None:
    """What `spaces` reads of torch's CUDA build at import, on this CPU wheel (see the module docstring)."""
    import torch

    def no_gpu(*args, **kwargs):
        raise RuntimeError("this machine has no GPU")

    def _is_in_bad_fork() -> bool:  # spaces asks it in a forked process: it must pickle by name
        return False

    _is_in_bad_fork.__module__, _is_in_bad_fork.__qualname__ = "torch.cuda", "_is_in_bad_fork"
    torch.version.cuda = torch.version.cuda or "12.8"
    if not hasattr(torch._C, "_cuda_init"):
        torch._C._cuda_init = no_gpu
    torch.cuda._is_in_bad_fork = _is_in_bad_fork


def main(folder: str, result_path: str) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), DeviceAPI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    os.environ.update(SPACES_ZERO_GPU="true", SPACES_ZERO_DEVICE_API_URL=f"http://127.0.0.1:{server.server_port}")
    fake_cuda_build()
    import spaces  # noqa: F401 - as the app imports it: ZeroGPU's torch patching, its GPU decorator
    import spaces.zero.torch as zero_torch

    zero_torch.init = lambda nvidia_uuid: None  # the worker's GPU: none here
    zero_torch.move = lambda callback=None: None

    spec = importlib.util.spec_from_file_location("zerogpu_app", os.path.join(folder, "app.py"))
    app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app)
    from hubsoup.errors import MergeCancelled

    token = os.environ["ZEROGPU_TOKEN"]
    out: dict = {"main_pid": os.getpid(), "zerogpu": app.ZEROGPU,
                 "wrapped": app.merge_on_gpu.__code__.co_filename if app.ZEROGPU else None,
                 "wrapper": getattr(app.merge_on_gpu, "__wrapped__", None) is not None}

    def reporter(seen: list):
        def report(lo, hi):
            return lambda done, stage, message: seen.append([lo + (hi - lo) * done, stage, message])
        return report

    # 1. a merge on the "GPU" worker, pushed from here
    seen: list = []
    state = app.merge_and_push(["alice/ft-a", "alice/ft-b"], "ties", base="alice/base", params={"density": 0.5},
                               token=token, repo_id="alice/zero-soup", private=False, cancel=threading.Event(),
                               report=reporter(seen))
    out["merge"] = {"url": state.get("url"), "error": repr(state.get("error")) if state.get("error") else None,
                    "progress": seen, "runs_left": os.listdir(app.RUNS_DIR), "card": state.get("card", "")}

    # 2. cancelled while the worker merges: its generator closed there, the merge stopped, nothing pushed or left
    seen2: list = []
    cancel = threading.Event()
    ended: dict = {}
    run_merge = app.run_merge

    def watched_run_merge(job, report, cancel_event):  # when the worker gave control back: was an output made?
        try:
            return run_merge(job, report, cancel_event)
        finally:
            ended.update(seconds=time.monotonic() - cancelled_at[0] if cancelled_at else None,
                         output=os.path.exists(job["out"]),
                         temporary=[n for n in os.listdir(os.path.dirname(job["out"])) if n.startswith(".")])

    cancelled_at: list = []

    def cancel_in_the_merge(lo, hi):
        def report(done, stage, message):
            seen2.append([lo + (hi - lo) * done, stage, message])
            if stage == "merge" and not cancel.is_set():
                cancelled_at.append(time.monotonic())
                cancel.set()
        return report

    app.run_merge = watched_run_merge
    t0 = time.monotonic()
    state = app.merge_and_push(["alice/ft-a", "alice/ft-b"], "sftm", base="alice/base", params={},
                               token=token, repo_id="alice/zero-cancelled", private=False, cancel=cancel,
                               report=cancel_in_the_merge)
    app.run_merge = run_merge
    out["cancel"] = {"cancelled": isinstance(state.get("error"), MergeCancelled), "error": repr(state.get("error")),
                     "seconds": time.monotonic() - t0, "progress": seen2, "runs_left": os.listdir(app.RUNS_DIR),
                     "ended": ended}

    # 3. what the app used to send: a closure and a threading.Event do not cross spaces' queue
    try:
        list(app.merge_on_gpu({"merge_fn": lambda out: out, "cancel": threading.Event()}))
        out["closure"] = "crossed"
    except Exception as e:  # noqa: BLE001 - its class is the point
        out["closure"] = f"{type(e).__name__}: {e}"
    out["calls"] = CALLS
    app.shutdown()
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    os._exit(0)  # spaces' worker threads and the device API's server are daemons: nothing to wait for
