"""hubsoup in a Gradio Space: merge fine-tunes from the Hub and push the soup to your namespace.

The visitor signs in with the Hub; every read and the push use *their* OAuth token (never a
token of the Space). They give the models by repo ID, pick a method, set its parameters
(widgets generated from ``hubsoup.list_methods()``) — or paste a mergekit YAML config (second tab,
validated as they type) — watch the status and progress at the top, may cancel, read the
generated model card and find the merge under ``{their username}/{repo name}``.

``hubsoup space create USER/NAME`` deploys it (see ``hubsoup.space``): ``hubsoup_space.json`` beside
this file then says which tab opens first and whether the merge runs in ``spaces.GPU`` (ZeroGPU).

On ZeroGPU, ``spaces.GPU`` runs the decorated function in a worker process that holds the GPU, and sends
its arguments there through a pickling queue. So what crosses is plain data: the *job* (inputs, method,
parameters or the mergekit config's text, options, the output folder; :func:`merge_job`). The merge runs
in the worker as a generator (:func:`merge_events`): each ``yield`` (a progress report, a heartbeat) comes
back to this process, and closing it here (Cancel) makes ``spaces`` close it there at its next yield, which
cancels the merge; ``close()`` returns once the worker has cleaned up. The push runs here, not on the GPU.

On CPU hardware the merge is streamed to the visitor's repo (``hubsoup.merge(..., push=...)``): each output shard
is uploaded as soon as it is written and then deleted, so the output takes at most ``SHARDS_IN_FLIGHT + 1`` shards
of the Space's disk, whatever its size; everything is committed at once at the end (a cancel commits nothing). On
ZeroGPU the worker writes the output whole and this process pushes it (the lent GPU's time is not spent
uploading), so the output must fit on the disk. Before the visitor starts, the form shows what the merge would
download, upload and hold on disk (``hubsoup.push_figures``; the time too when ``HUBSOUP_SPACE_BANDWIDTH``, in
bytes per second, is set).

Run locally, against the Hub or any Hub-compatible endpoint::

    HF_ENDPOINT=https://huggingface.co HF_TOKEN=hf_... python app.py

Outside a Space, Gradio's sign-in is a mock: it signs you in as the owner of the machine's
token (``HF_TOKEN`` or ``hf auth login``), whose ``whoami`` gives the profile.

A visitor's text never names a file of the Space (SECURITY.md, "Hosting hubsoup"): every run is
``hub_only`` (Hub repo IDs only, refused by their text before the disk is looked at), downloads into
a Hub cache of its own (another visitor's token never opens it) limited to ``HUBSOUP_SPACE_MAX_DOWNLOAD``
(default 100GB, checked from the Hub's file sizes before anything moves), and its folder (output and
cache) is removed when it ends, whether it succeeded, failed or was cancelled. The inputs' tensors are read
from the Hub in place (range requests, in memory: that cache holds their configs and tokenizers only), and a
run whose predicted peak disk exceeds ``HUBSOUP_SPACE_MAX_DISK`` (default 40GB of a free CPU Space's 50 GB) is
refused before any weight moves. Stopping the app
(Ctrl-C, SIGTERM) cancels the running jobs and removes the app's temporary folder.
"""

from __future__ import annotations

import atexit
import contextvars
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from typing import Any, Callable, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import hubsoup
except ImportError:  # a private Space made by `hubsoup space create`: its build cannot fetch the wheel beside us
    import glob
    import subprocess

    wheels = sorted(glob.glob(os.path.join(HERE, "hubsoup-*.whl")))
    if not wheels:
        raise
    subprocess.check_call([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", wheels[-1]])
    import hubsoup

import gradio as gr
from huggingface_hub import get_token

from hubsoup.errors import HubsoupError, InputError, MergeCancelled, MethodError, PrivateInputsError, PushError
from hubsoup.footprint import fmt

# what `hubsoup space create` chose (template, ZeroGPU); absent when run from a checkout
try:
    with open(os.path.join(HERE, "hubsoup_space.json"), encoding="utf-8") as f:
        SETTINGS: dict[str, Any] = json.load(f)
except (OSError, ValueError):
    SETTINGS = {}
ZEROGPU = bool(SETTINGS.get("zerogpu"))
if ZEROGPU:  # imported before anything touches CUDA, as ZeroGPU asks
    import spaces
METHODS: dict[str, dict[str, Any]] = {m["name"]: m for m in hubsoup.list_methods()}
DEFAULT_METHOD = "ties" if "ties" in METHODS else next(iter(METHODS))
ON_SPACE = os.environ.get("SYSTEM") == "spaces"  # how Gradio itself tells a Space from a local run
FIRST_TAB = "mergekit" if SETTINGS.get("template") == "mergekit-gui" else "form"
EXAMPLE_CONFIG = """merge_method: ties
base_model: org/base
models:
  - model: org/fine-tune-a
    parameters: {weight: 1.0, density: 0.5}
  - model: org/fine-tune-b
    parameters: {weight: 1.0, density: 0.5}
dtype: float32
"""

MAX_DOWNLOAD = os.environ.get("HUBSOUP_SPACE_MAX_DOWNLOAD", "100GB")
"""What one run may fetch from the Hub (predicted from the Hub's file sizes and the merge's plan before any weight
moves, and counted as the bytes arrive). The inputs no longer take the Space's disk (they are read in place), so
this bounds the network, not the disk: 100 GB holds two 13B bfloat16 fine-tunes and their base (78 GB)."""
MAX_DISK = os.environ.get("HUBSOUP_SPACE_MAX_DISK", "40GB")
"""The most local disk one run may use at its peak (``max_disk``: checked from the merge's plan before any weight
moves). A free CPU Space has 50 GB of disk; 40 GB leaves room for the app, its Python packages and the system."""

# session hash -> the cancel event of that session's running job (one job per browser tab)
RUNNING: dict[str, threading.Event] = {}
WORKERS: set[threading.Thread] = set()  # jobs still running (joined when the app stops)
RUNS_DIR = tempfile.mkdtemp(prefix="soup-space-runs-")
"""Every run's folder (its output and its own Hub cache) lies here while it runs; removed when the app stops."""


HEARTBEAT = 0.25
"""Seconds between two events of a merge that reports nothing new: where a cancel is noticed at the latest."""
GPU_SECONDS = int(os.environ.get("HUBSOUP_SPACE_GPU_SECONDS", "300"))
"""ZeroGPU: the duration asked of ``spaces.GPU`` for one merge."""
SHARD_SIZE = os.environ.get("HUBSOUP_SPACE_SHARD_SIZE", "5GB")
"""The output's shard size: a run holds at most ``SHARDS_IN_FLIGHT + 1`` shards on the Space's disk at once."""
BANDWIDTH = float(os.environ.get("HUBSOUP_SPACE_BANDWIDTH") or 0) or None
"""Bytes per second the Space moves to and from the Hub, measured by its owner: the form's time estimate (None: none)."""


def merge_job(job: dict[str, Any], progress: Callable[[float, str, str], None], cancel: threading.Event,
              before_push: Callable[[Any, str], None] | None = None) -> str:
    """Run the merge that ``job`` describes into ``job["out"]`` and return that folder; with ``job["push"]``
    (``repo_id``, ``private``, ``work_dir``: CPU hardware) stream it to the visitor's repo instead and return the
    commit's URL (``before_push(result, folder)`` runs before the commit).

    ``job`` is plain data, so that it crosses to a ZeroGPU worker through ``spaces``' pickling queue:
    ``inputs``, ``method``, ``base``, ``params`` (the form) or ``config`` (a mergekit config's YAML text), ``out``,
    ``options`` (:func:`merge_options`: the visitor's token, ``hub_only``, the run's own Hub cache, the download
    limit) and ``device``. ``progress`` and ``cancel`` are this process's own (see :func:`merge_events`)."""
    options = {**job["options"], "progress": progress, "cancel": cancel}
    if job.get("device"):
        options["device"] = job["device"]
    if job.get("push"):  # streamed to the visitor's repo: ``out`` is None, the card shown before the commit
        push = job["push"]
        options["push"] = hubsoup.PushTarget(push["repo_id"], private=push.get("private"), token=options.get("token"),
                                             work_dir=push["work_dir"])
        if before_push is not None:
            options["before_push"] = before_push
    if job.get("config") is not None:
        from hubsoup.workflows.rerun import run_config as run_mergekit

        result = run_mergekit(job["config"], job.get("out"), **options)
    else:
        result = hubsoup.merge(job["inputs"], job["method"], base=job.get("base"), out=job.get("out"),
                               params=job.get("params") or {}, **options)
    pushed = getattr(result, "pushed", None)
    return pushed.commit_url if job.get("push") and pushed is not None else job["out"]


def error_info(error: BaseException) -> dict[str, Any]:
    """An error as plain data (it crosses the ZeroGPU boundary; a traceback's objects may not pickle): its class,
    message, and what :func:`visitor_message` reads of it (a refused public push's target and inputs)."""
    info: dict[str, Any] = {"type": type(error).__name__, "message": str(error),
                            "hubsoup": "yes" if isinstance(error, HubsoupError) else ""}
    if isinstance(error, PrivateInputsError):
        info.update(repo_id=error.repo_id, inputs=[list(x) for x in error.inputs])
    return info


def error_from(info: dict[str, Any]) -> BaseException:
    """The error :func:`error_info` described: hubsoup's own class again, anything else as a HubsoupError."""
    import hubsoup.errors

    cls = getattr(hubsoup.errors, info["type"], None) if info.get("hubsoup") else None
    if isinstance(cls, type) and issubclass(cls, PrivateInputsError):
        return cls(info["message"], info.get("repo_id", ""), [tuple(x) for x in info.get("inputs") or []])
    if isinstance(cls, type) and issubclass(cls, HubsoupError):
        return cls(info["message"])
    return HubsoupError(f"{info['type']}: {info['message']}")


def merge_events(job: dict[str, Any], before_push: Callable[[Any, str], None] | None = None, *,
                 local: bool = False) -> Iterator[tuple[Any, ...]]:
    """The merge of ``job`` as a stream of plain tuples: ``("progress", done, stage, message)`` as it advances,
    ``("alive",)`` every :data:`HEARTBEAT` seconds when nothing changed, then ``("done", folder)`` or
    ``("error", error_info)``. Closing the generator cancels the merge and returns once it has unwound (its
    temporary output removed). On ZeroGPU this is what runs in the GPU worker (:func:`merge_on_gpu`)."""
    cancel, changed = threading.Event(), threading.Condition()
    latest: list[Any] = [None]
    outcome: list[tuple[Any, ...]] = []

    def progress(done: float, stage: str, message: str) -> None:
        with changed:
            latest[0] = (float(done), str(stage), str(message))
            changed.notify()

    def work() -> None:
        try:
            end: tuple[Any, ...] = ("done", merge_job(job, progress, cancel, before_push))
        except BaseException as e:  # noqa: BLE001 - reported as data; a cancel is a MergeCancelled
            # in this process (``local``) the error itself too: its causes say what the Hub answered
            end = ("error", error_info(e), e) if local else ("error", error_info(e))
        with changed:
            outcome.append(end)
            changed.notify()

    worker = threading.Thread(target=work, name="hubsoup-merge", daemon=True)
    worker.start()
    sent = None
    try:
        while True:
            with changed:
                changed.wait_for(lambda: outcome or latest[0] != sent, timeout=HEARTBEAT)
                now, end = latest[0], (outcome[0] if outcome else None)
            if now is not None and now != sent:
                sent = now
                yield ("progress", *now)
            elif end is None:
                yield ("alive",)  # a yield is where a closed generator (Cancel) stops
            if end is not None:
                yield end
                return
    finally:
        cancel.set()  # closed early (Cancel, the tab gone): stop the merge; it removes what it wrote
        worker.join()


if ZEROGPU:
    @spaces.GPU(duration=GPU_SECONDS)
    def merge_on_gpu(job: dict[str, Any]) -> Iterator[tuple[Any, ...]]:
        """:func:`merge_events` in ZeroGPU's worker process, on the GPU it was lent (its arguments and yields
        pickled by ``spaces``; closing it here closes it there at its next yield)."""
        import torch

        yield from merge_events({**job, "device": "cuda" if torch.cuda.is_available() else "cpu"})


def run_merge(job: dict[str, Any], report: Callable[[float, str, str], None], cancel: threading.Event,
              before_push: Callable[[Any, str], None] | None = None) -> str:
    """Run ``job`` (on ZeroGPU in the GPU worker, else in this process), forwarding its progress to ``report`` and
    ``cancel`` to it; returns the output folder (a streamed push: the commit's URL). Raises the merge's error, or
    MergeCancelled."""
    events = merge_on_gpu(job) if ZEROGPU else merge_events(job, before_push, local=True)
    try:
        for event in events:
            if cancel.is_set():
                break
            if event[0] == "progress":
                report(*event[1:])
            elif event[0] == "done":
                return str(event[1])
            elif event[0] == "error":
                raise event[2] if len(event) > 2 else error_from(event[1])
    finally:
        events.close()  # on a cancel: the merge stops at its next check; this returns once it has cleaned up
    if cancel.is_set():
        raise MergeCancelled("cancelled during the merge; nothing was written")
    raise HubsoupError("the merge ended without a result")


def merge_share(n_models: int) -> float:
    """The share of the progress bar for the merge; the push gets the rest. A merge downloads its models and the
    base, a push uploads one model: counted in models moved, (n + 1) of (n + 2)."""
    return (max(n_models, 1) + 1) / (max(n_models, 1) + 2)


def merge_then_push(job: dict[str, Any], *, token: str, repo_id: str, private: bool, cancel: threading.Event,
                    report: Callable[[float, float], Callable[[float, str, str], None]] | None = None,
                    state: dict[str, Any] | None = None, workdir: str | None = None) -> dict[str, Any]:
    """One visitor's run: the merge ``job`` describes (Hub repos only, its own Hub cache, a download limit:
    :func:`merge_options`), then the push: on CPU hardware streamed as the merge goes (:func:`merge_job`), on
    ZeroGPU from the finished output. Whatever happens (done, error, cancel), the run's folder (output, shards not
    yet uploaded and downloads) is removed before it returns. ``state`` gets ``card`` (the card as it will be on the
    Hub, before the commit), then ``url``, or ``error``."""
    from hubsoup.api import MergeResult
    from hubsoup.card import retarget_text

    state = {} if state is None else state
    state.setdefault("lock", threading.Lock())  # run_job reads "pushing" under it when Cancel is pressed
    report = report or (lambda lo, hi: lambda done, stage, message: None)
    workdir = workdir or tempfile.mkdtemp(prefix="run-", dir=RUNS_DIR)
    share = merge_share(len(job.get("inputs") or job.get("models") or []))
    try:
        if not ZEROGPU:  # streamed: the shards go up as they are written, the commit is the push's last step
            def before_commit(result: Any, folder: str) -> None:
                from hubsoup.card import render

                card = render(result, repo_id=repo_id)  # as it goes to the Hub: titled by the repo, loading it
                with state["lock"]:
                    state["card"] = f"```yaml\n{card.data.to_yaml()}\n```\n\n{card.text}"
                    if cancel.is_set():
                        raise MergeCancelled("cancelled before the commit; nothing was pushed")
                    state["pushing"] = True

            job = {**job, "out": None, "options": merge_options(token, workdir),
                   "push": {"repo_id": repo_id, "private": private, "work_dir": workdir}}
            state["url"] = run_merge(job, report(0, 1.0), cancel, before_commit)
            return state
        job = {**job, "out": os.path.join(workdir, "merge"), "options": merge_options(token, workdir)}
        out = run_merge(job, report(0, share), cancel)
        result = MergeResult.from_folder(out)
        result.hub_only = True
        # the card as it will be on the Hub: titled by the repo, loading the repo (never this server's path)
        card = retarget_text(result.card, out, repo_id)
        head, _, body = card[4:].partition("\n---\n") if card.startswith("---\n") else ("", "", card)
        state["card"] = f"```yaml\n{head}\n```\n\n{body}" if head else body
        with state["lock"]:
            if cancel.is_set():
                raise MergeCancelled("cancelled before the push; nothing was pushed")
            state["pushing"] = True
        info = result.push_to_hub(repo_id, private=private, token=token, progress=report(share, 1.0), cancel=cancel)
        state["url"] = info.commit_url
    except BaseException as e:  # reported in the status line
        state["error"] = e
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # nothing of a visitor's run stays on the Space's disk
    return state


def merge_and_push(inputs: list[str], method: str, *, base: str | None, params: dict[str, Any], token: str,
                   repo_id: str, private: bool, cancel: threading.Event,
                   report: Callable[[float, float], Callable[[float, str, str], None]] | None = None,
                   state: dict[str, Any] | None = None) -> dict[str, Any]:
    """The form's run (:func:`merge_then_push` of a ``hubsoup.merge`` job), callable without a browser."""
    job = {"inputs": list(inputs), "method": method, "base": base, "params": dict(params)}
    return merge_then_push(job, token=token, repo_id=repo_id, private=private, cancel=cancel, report=report,
                           state=state)


def shutdown() -> None:
    """Cancel every running job, wait for them to clean up, remove the app's temporary folder."""
    for event in list(RUNNING.values()):
        event.set()
    for worker in list(WORKERS):
        worker.join(30)
    shutil.rmtree(RUNS_DIR, ignore_errors=True)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM (a Space being stopped) as Ctrl-C: launch() returns, shutdown() cleans up


atexit.register(shutdown)
if __name__ == "__main__":  # from now on: even a SIGTERM while the page is built unwinds through shutdown()
    signal.signal(signal.SIGTERM, _interrupt)


def user_token(oauth: gr.OAuthToken) -> str:
    """The signed-in user's token: the OAuth token on a Space.

    Locally Gradio injects a placeholder instead, having signed you in as the owner of the
    machine's token: that token is then the user's own.
    """
    return oauth.token if ON_SPACE else (get_token() or oauth.token)


def param_widget(method: str, p: dict[str, Any]) -> gr.components.Component:
    """One input widget for one method parameter, from its ``list_methods()`` description."""
    kind, default = p["type"], p["default"]
    info = (p.get("help") or "") + (" [not from the paper]" if p.get("source") == "ours" else "")
    kw: dict[str, Any] = {"label": p["name"], "info": info, "elem_id": f"param-{method}-{p['name']}"}
    if kind == "bool":
        return gr.Checkbox(value=bool(default), **kw)
    if kind == "choice":
        return gr.Dropdown(choices=list(p["choices"]), value=default, **kw)
    if kind in ("int", "float") and default is not None:
        lo, hi = p.get("range") or (None, None)
        return gr.Number(value=default, minimum=lo, maximum=hi, precision=0 if kind == "int" else None, **kw)
    # optional numbers (empty = none), lists ("floats", "strs", comma-separated) and text: a textbox
    text = ", ".join(map(str, default)) if isinstance(default, (list, tuple)) else ("" if default is None else str(default))
    return gr.Textbox(value=text, **kw)


def parse_param(p: dict[str, Any], raw: Any) -> Any:
    """A widget's value as the method parameter's Python value (``None``: left empty)."""
    if isinstance(raw, str) and p["type"] not in ("choice", "bool"):
        raw = raw.strip()
        if not raw:
            return None
        if p["type"] in ("int", "float"):
            return int(raw) if p["type"] == "int" else float(raw)
        if p["type"] == "floats":
            return [float(x) for x in raw.replace(",", " ").split()]
        if p["type"] == "strs":
            return [x.strip() for x in raw.split(",") if x.strip()]
    return int(raw) if p["type"] == "int" and raw is not None else raw


def status_line(done: float, text: str) -> str:
    return f"**{100 * done:.0f}%** · {text}"


# advice meant for a command line (log in, set HF_TOKEN, `hubsoup push ...`): a Space visitor can do none of it
_CLI_ADVICE = [re.compile(r"\s*\([^()]*(hf auth login|HF_TOKEN|token=)[^()]*\)"),
               re.compile(r";?\s*(accept its terms on the Hub and )?log in \(hf auth login or HF_TOKEN\)"),
               re.compile(r"\.?\s*The local output is intact; retry with: .*$", re.S)]


def visitor_message(error: BaseException, repo_id: str) -> str:
    """What went wrong, said as what a visitor of the Space can do about it (sign in, request access, check a
    repo name) — never a command to run."""
    from hubsoup.hubclient import error_status

    text = str(error)
    for pattern in _CLI_ADVICE:
        text = pattern.sub("", text)
    # the server's folders are nobody's business: "push of '<run folder>' to x" is "push to x"
    text = re.sub(r"push of '[^']*' to ", "push to ", text)
    text = re.sub(re.escape(RUNS_DIR) + r"[^\s'\"]*", "(this run's folder)", text)
    status = error_status(error)
    if isinstance(error, PrivateInputsError):
        names = ", ".join(f"`{repo}`" for repo, _ in error.inputs) or "private or gated models"
        return (f"{repo_id} is public, and the merge contains private or gated models ({names}): pushing it would "
                "publish their weights. Tick \"Private repo\" and merge again.")
    if isinstance(error, PushError):
        if status == 401:
            return f"The Hub refused your sign-in while pushing to {repo_id}: sign out, sign in again, and merge again."
        if status == 403:
            return (f"You may not write to {repo_id}: check the repo name (it goes to your own namespace), or sign "
                    "in with an account that can write there.")
        return f"{text}. Nothing of yours was lost: merge again to retry the push."
    if isinstance(error, InputError):
        if "gated" in text:
            return (f"{text}: open the model's page on the Hub and request access (accept its terms), then merge "
                    "again, signed in with that account.")
        if "not found" in text:
            return (f"{text}. Check the repo name (org/name); if the model is private, sign in with an account "
                    "that can read it.")
        return text
    if isinstance(error, MethodError):
        return f"{text}. Check the method's parameters (or the config)."
    if isinstance(error, HubsoupError):
        return text
    return f"{type(error).__name__}: {text}"


def _inputs_from_form(values: dict) -> tuple[list[str], str | None]:
    inputs = [s.strip() for s in values[models_box].replace(",", "\n").splitlines() if s.strip()]
    if not inputs:
        raise gr.Error("Give the models to merge: their repo names (org/name), one per line.")
    return inputs, values[base_box].strip() or None


def check_config(text: str) -> tuple[Any, str]:
    """A pasted mergekit config, read without touching the Hub: (the merge, what the page shows)."""
    from hubsoup.formats.mergekit import read_config
    from hubsoup.public import looks_local

    if not (text or "").strip():
        return None, "Paste a mergekit YAML config (merge_method, base_model, models or slices, parameters)."
    try:
        m = read_config(text, resolve=False)
    except HubsoupError as e:
        return None, f"**Not valid:** {e}"
    local = [r for r in [m.base, *m.inputs] if r and looks_local(r)]
    if local:  # the Space's own disk is nobody's input
        return None, f"**Not valid:** `{local[0]}` is not a Hub repo name (org/name): a Space merges Hub models only."
    rows = "\n".join(f"- `{i}`" for i in m.inputs)
    params = ", ".join(f"`{k}={v}`" for k, v in m.params.items()) or "its defaults"
    ignored = ("\n\nIgnored, as mergekit ignores them (a typo?): " + ", ".join(f"`{k}`" for k in m.ignored)
               if m.ignored else "")
    return m, (f"**Valid**: mergekit `{m.merge_method}` → hubsoup `{m.method}` with {params}, "
               f"base `{m.base or '(none)'}`, {len(m.inputs)} model(s):\n{rows}{ignored}")


def validate_config(text: str) -> str:
    return check_config(text)[1]


def run_form(values: dict, profile: gr.OAuthProfile | None, oauth: gr.OAuthToken | None, request: gr.Request,
             progress: gr.Progress = gr.Progress()) -> Iterator[tuple[str, Any]]:
    """The form tab: merge the listed models with the chosen method, push to ``{user}/{name}``."""
    signed_in(profile, oauth)
    inputs, base = _inputs_from_form(values)
    method = values[method_radio]
    try:  # only what differs from the defaults, so the recipe (and its hash) stays minimal
        params = {p["name"]: v for p, w in PARAM_WIDGETS[method]
                  if (v := parse_param(p, values[w])) is not None and v != p["default"]}
    except ValueError as e:
        raise gr.Error(f"{method}: {e}") from None

    job = {"inputs": inputs, "method": method, "base": base, "params": params}
    yield from run_job(job, values[repo_box], values[private_box], profile, oauth, request, progress)


def run_config(text: str, name: str, private: bool, profile: gr.OAuthProfile | None, oauth: gr.OAuthToken | None,
               request: gr.Request, progress: gr.Progress = gr.Progress()) -> Iterator[tuple[str, Any]]:
    """The mergekit tab: merge the pasted config as mergekit would, push to ``{user}/{name}``."""
    signed_in(profile, oauth)
    merge, shown = check_config(text)
    if merge is None:
        raise gr.Error(shown.replace("**", ""))
    job = {"config": text, "models": list(merge.inputs)}
    yield from run_job(job, name, private, profile, oauth, request, progress)


def signed_in(profile, oauth) -> None:
    if profile is None or oauth is None:
        raise gr.Error("Sign in with Hugging Face first (the button at the top): the merge is pushed to your "
                       "namespace, with your access to the models.")


def figures(inputs: list[str], base: str | None, token: str | bool) -> dict[str, Any]:
    """What a merge of ``inputs`` would need (``hubsoup.push_figures``: disk, download, upload, seconds), read from
    the Hub's file sizes and safetensors headers with the visitor's token (``False``: anonymous), as a run reads:
    Hub repos only, a Hub cache of its own (removed)."""
    workdir = tempfile.mkdtemp(prefix="figures-", dir=RUNS_DIR)
    try:
        kw = dict(base=base, bandwidth=BANDWIDTH, token=token, hub_only=True,
                  cache_dir=os.path.join(workdir, "hub-cache"), shard_size=SHARD_SIZE, quiet=True)
        f = hubsoup.push_figures(inputs, push=True, **kw)
        if ZEROGPU:  # the worker writes the output whole, then this process pushes it: all of it on the disk
            f["disk"] = hubsoup.push_figures(inputs, push=False, **kw)["disk"]
        return f
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def figures_line(f: dict[str, Any]) -> str:
    when = f" · about {f['seconds'] / 60:.0f} min at this Space's bandwidth" if f.get("seconds") else ""
    return (f"**Before you start** · downloads {fmt(f['download'])}, uploads {fmt(f['upload'])}, "
            f"holds at most {fmt(f['disk'])} on the Space's disk{when}")


def show_figures(models: str, base: str, oauth: gr.OAuthToken | None) -> str:
    """The form's figures, as the visitor types the models (signed in: with their access)."""
    inputs = [x.strip() for x in (models or "").replace(",", "\n").splitlines() if x.strip()]
    if not inputs:
        return ""
    try:
        f = figures(inputs, (base or "").strip() or None, user_token(oauth) if oauth is not None else False)
    except Exception as e:  # noqa: BLE001 - a figure that cannot be known is said so, never a crash of the form
        return f"Sizes not known yet: {visitor_message(e, '')}"
    return figures_line(f)


def merge_options(token: str, workdir: str) -> dict[str, Any]:
    """What every merge of this app is given, whichever tab started it: the visitor's token, Hub repos only
    (``hub_only``: no path of this server is ever opened), a Hub cache of the run's own (removed with it) and a
    download limit checked from the Hub's file sizes before anything is downloaded, and a disk limit checked from
    the merge's plan (its inputs are read in place, never downloaded whole: the cache holds their configs and
    tokenizers). Plain data (a ZeroGPU job)."""
    return {"token": token, "hub_only": True, "cache_dir": os.path.join(workdir, "hub-cache"),
            "max_download": MAX_DOWNLOAD, "max_disk": MAX_DISK, "shard_size": SHARD_SIZE}


def run_job(job: dict[str, Any], name: str, private: bool, profile: gr.OAuthProfile,
            oauth: gr.OAuthToken, request: gr.Request, progress: gr.Progress) -> Iterator[tuple[str, Any]]:
    """Merge (the ``job``: :func:`merge_job`), then push to ``{user}/{name}``; yields (status, card) as the job
    advances. Everything shown comes from this call's own ``state``: one visitor never sees another's run.

    Cancel answers at once while the run is still merging: the push, which is the only thing that could leave
    something behind, will not start (checked under ``state["lock"]``), so the page says so and the tab may
    merge again while the run unwinds (a download in flight ends, the run's folder is removed) in the
    background. A cancel during the push waits for it to stop: only then is it known that nothing was committed."""
    name = (name or "").strip()
    if not name or "/" in name:
        raise gr.Error(f"Give a repo name (no '/'): the merge goes to {profile.username}/NAME.")
    session = request.session_hash or ""
    if session in RUNNING:
        raise gr.Error("A merge is already running in this tab: cancel it or wait.")

    token, repo_id = user_token(oauth), f"{profile.username}/{name}"
    cancel = RUNNING[session] = threading.Event()
    state: dict[str, Any] = {"done": 0.0, "text": "starting", "lock": threading.Lock()}

    workdir = tempfile.mkdtemp(prefix="run-", dir=RUNS_DIR)

    def report(lo: float, hi: float):  # hubsoup's progress(done, stage, message), mapped onto [lo, hi]
        def callback(done: float, stage: str, message: str) -> None:
            message = message.replace(os.path.join(workdir, "merge"), "the work folder")  # not this server's path
            state["done"], state["text"] = lo + (hi - lo) * done, f"{stage}: {message}"
        return callback

    def run() -> None:  # in its own thread; the cancel event stops hubsoup itself
        try:
            merge_then_push(job, token=token, repo_id=repo_id, private=private, cancel=cancel, report=report,
                            state=state, workdir=workdir)
        finally:
            WORKERS.discard(threading.current_thread())

    # in this handler's context: ZeroGPU's spaces.GPU reads the visitor's request (their GPU quota) from it
    worker = threading.Thread(target=contextvars.copy_context().run, args=(run,), daemon=True)
    WORKERS.add(worker)
    worker.start()
    shown_card = False
    yield status_line(0.0, "starting"), ""  # and clear the previous run's card
    try:
        while worker.is_alive():
            worker.join(0.2)
            if cancel.is_set():
                with state["lock"]:
                    if not state.get("pushing"):  # the push will never start: the run is cancelled, whatever it
                        break                      # is still waiting for (it unwinds in the background)
            text = "cancelling…" if cancel.is_set() else state["text"]
            progress(state["done"])  # the bar only: the status line right under it says the text
            card = state.get("card")
            yield status_line(state["done"], text), (card if card and not shown_card else gr.skip())
            shown_card = shown_card or bool(card)
    finally:
        cancel.set()  # the tab went away (generator closed): stop the job too
        RUNNING.pop(session, None)

    error = state.get("error")
    if worker.is_alive() or isinstance(error, MergeCancelled):
        yield "**Cancelled** · nothing was pushed; the run's files are removed.", ""
    elif error is not None:
        yield f"**Failed** · {visitor_message(error, repo_id)}", state.get("card", "")
    else:
        yield status_line(1.0, f"done: pushed to [{repo_id}]({state['url']})"), state["card"]


def cancel_job(request: gr.Request) -> None:
    """Set the session's cancel event: hubsoup stops at its next check and removes what it wrote."""
    event = RUNNING.get(request.session_hash or "")
    if event is not None:
        event.set()


def describe(method: str) -> tuple[Any, ...]:
    m = METHODS[method]
    paper = f" — [{m['paper']}]({m['paper_url']})" if m.get("paper_url") else (f" — {m['paper']}" if m.get("paper") else "")
    return (f"**{m['name']}**: {m['summary']}{paper}",
            *(gr.update(visible=name == method) for name in METHODS))


with gr.Blocks(title="hubsoup: model soups from the Hub") as demo:
    gr.Markdown("# hubsoup: model soups from the Hub\nMerge fine-tunes of one base model, "
                "streamed tensor by tensor; the merge and its model card are pushed to your namespace.")
    gr.LoginButton()
    # the run's status and progress bar, at the top: visible whichever tab or field the visitor is at
    # Cancel first: its place never moves as the status text changes length under the cursor
    with gr.Row(equal_height=False):
        cancel_btn = gr.Button("Cancel", variant="stop", elem_id="cancel", scale=0, min_width=100)
        status = gr.Markdown("Sign in, then merge.", elem_id="status", min_height=48)
    with gr.Row():
        repo_box = gr.Textbox(label="Repo name", value="soup", info="pushed to YOUR-USERNAME/NAME", elem_id="repo")
        private_box = gr.Checkbox(label="Private repo", value=False, elem_id="private")
    with gr.Tabs(selected=FIRST_TAB, elem_id="tabs"):
        with gr.Tab("Form", id="form", elem_id="tab-form"):
            merge_btn = gr.Button("Merge and push", variant="primary", elem_id="merge")
            with gr.Row():
                models_box = gr.Textbox(label="Models to merge", info="repo IDs (org/name[@revision]), one per line",
                                        lines=3, elem_id="models")
                base_box = gr.Textbox(label="Base model (optional)",
                                      info="default: the base_model the inputs' cards name", elem_id="base")
            figures_view = gr.Markdown(elem_id="figures")  # disk and network, before the visitor starts
            method_radio = gr.Radio(list(METHODS), value=DEFAULT_METHOD, label="Method", elem_id="method")
            method_info = gr.Markdown(elem_id="method-info")
            PARAM_WIDGETS: dict[str, list[tuple[dict[str, Any], gr.components.Component]]] = {}
            groups = []
            with gr.Accordion("Parameters", open=True):
                for name, m in METHODS.items():
                    with gr.Group(visible=name == DEFAULT_METHOD) as group:
                        PARAM_WIDGETS[name] = [(p, param_widget(name, p)) for p in m["params"]]
                    groups.append(group)
        with gr.Tab("mergekit YAML", id="mergekit", elem_id="tab-mergekit"):
            gr.Markdown("Paste a [mergekit](https://github.com/arcee-ai/mergekit) config, as model cards carry it: "
                        "hubsoup merges it with mergekit's semantics. Models are Hub repo names.")
            with gr.Row():
                validate_btn = gr.Button("Validate", elem_id="validate")
                merge_yaml_btn = gr.Button("Merge config and push", variant="primary", elem_id="merge-yaml")
            yaml_box = gr.Code(value=EXAMPLE_CONFIG, language="yaml", label="mergekit config", lines=14,
                               elem_id="mergekit-yaml", interactive=True)
            yaml_check = gr.Markdown(elem_id="mergekit-check")
    card_view = gr.Markdown(elem_id="card")

    demo.load(describe, method_radio, [method_info, *groups])
    for box in (models_box, base_box):  # the figures follow the models as they are given
        box.blur(show_figures, [models_box, base_box], figures_view, show_progress="hidden")
    method_radio.change(describe, method_radio, [method_info, *groups])
    widgets = {w for pairs in PARAM_WIDGETS.values() for _, w in pairs}
    merge_btn.click(run_form, {models_box, base_box, method_radio, repo_box, private_box, *widgets},
                    [status, card_view], show_progress_on=[status], concurrency_limit=2)
    merge_yaml_btn.click(run_config, [yaml_box, repo_box, private_box], [status, card_view],
                         show_progress_on=[status], concurrency_limit=2)
    validate_btn.click(validate_config, yaml_box, yaml_check, show_progress="hidden")
    yaml_box.change(validate_config, yaml_box, yaml_check, show_progress="hidden")
    demo.load(validate_config, yaml_box, yaml_check)
    # at once, never queued behind the running merges (the queue holds them until one ends)
    cancel_btn.click(cancel_job, None, None, show_progress="hidden", queue=False)
    demo.unload(cancel_job)  # closing the tab cancels its job

if __name__ == "__main__":
    try:
        demo.queue().launch()  # host and port: GRADIO_SERVER_NAME / GRADIO_SERVER_PORT (a Space sets them)
    finally:
        shutdown()
