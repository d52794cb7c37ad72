"""hubsoup in a Gradio Space: merge fine-tunes from the Hub and push the soup to your namespace.

The visitor signs in with the Hub; every read and the push use *their* OAuth token (never a
token of the Space). They give the models by repo ID, pick a method, set its parameters
(widgets generated from ``hubsoup.list_methods()``), watch the progress, may cancel, read the
generated model card and find the merge under ``{their username}/{repo name}``.

Run locally, against the Hub or any Hub-compatible endpoint::

    HF_ENDPOINT=https://huggingface.co HF_TOKEN=hf_... python app.py

Outside a Space, Gradio's sign-in is a mock: it signs you in as the owner of the machine's
token (``HF_TOKEN`` or ``hf auth login``), whose ``whoami`` gives the profile.

A visitor's text never names a file of the Space (SECURITY.md, "Hosting hubsoup"): every run is
``hub_only`` (Hub repo IDs only, refused by their text before the disk is looked at), downloads into
a Hub cache of its own (another visitor's token never opens it) limited to ``HUBSOUP_SPACE_MAX_DOWNLOAD``
(default 20GB, checked from the Hub's file sizes before downloading), and its folder (output and
cache) is removed when it ends, whether it succeeded, failed or was cancelled. Stopping the app
(Ctrl-C, SIGTERM) cancels the running jobs and removes the app's temporary folder.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
import threading
from typing import Any, Callable, Iterator

import gradio as gr
from huggingface_hub import ModelCard, get_token

import hubsoup
from hubsoup.errors import HubsoupError, MergeCancelled

METHODS: dict[str, dict[str, Any]] = {m["name"]: m for m in hubsoup.list_methods()}
DEFAULT_METHOD = "ties" if "ties" in METHODS else next(iter(METHODS))
ON_SPACE = os.environ.get("SYSTEM") == "spaces"  # how Gradio itself tells a Space from a local run
MERGE_SHARE = 0.9  # share of the progress bar for the merge; the push gets the rest

MAX_DOWNLOAD = os.environ.get("HUBSOUP_SPACE_MAX_DOWNLOAD", "20GB")
"""What one run may download (the Hub's file sizes are checked before any download)."""

# session hash -> the cancel event of that session's running job (one job per browser tab)
RUNNING: dict[str, threading.Event] = {}
WORKERS: set[threading.Thread] = set()  # jobs still running (joined when the app stops)
RUNS_DIR = tempfile.mkdtemp(prefix="soup-space-runs-")
"""Every run's folder (its output and its own Hub cache) lies here while it runs; removed when the app stops."""


def merge_and_push(inputs: list[str], method: str, *, base: str | None, params: dict[str, Any], token: str,
                   repo_id: str, private: bool, cancel: threading.Event,
                   report: Callable[[float, float], Callable[[float, str, str], None]] | None = None,
                   state: dict[str, Any] | None = None) -> dict[str, Any]:
    """One visitor's run: merge Hub models (``hub_only``, its own cache, a download limit) and push the result.

    Whatever happens (done, error, cancel), the run's folder (output and downloads) is removed before it
    returns. ``state`` gets ``card`` (as soon as the merge is done), then ``url``, or ``error``.
    """
    state = {} if state is None else state
    report = report or (lambda lo, hi: None)
    workdir = tempfile.mkdtemp(prefix="run-", dir=RUNS_DIR)
    try:
        result = hubsoup.merge(inputs, method, base=base, out=os.path.join(workdir, "merge"),
                               progress=report(0, MERGE_SHARE), cancel=cancel, token=token, hub_only=True,
                               cache_dir=os.path.join(workdir, "hub-cache"), max_download=MAX_DOWNLOAD, **params)
        card = ModelCard(result.card)  # shown as its metadata (YAML) and its text, rendered
        state["card"] = f"```yaml\n{card.data.to_yaml()}\n```\n\n{card.text}"
        info = result.push_to_hub(repo_id, private=private, token=token,
                                  progress=report(MERGE_SHARE, 1.0), cancel=cancel)
        state["url"] = info.commit_url
    except BaseException as e:  # reported in the status line
        state["error"] = e
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # nothing of a visitor's run stays on the Space's disk
    return state


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


def run(values: dict, profile: gr.OAuthProfile | None, oauth: gr.OAuthToken | None, request: gr.Request,
        progress: gr.Progress = gr.Progress()) -> Iterator[tuple[str, Any]]:
    """Merge, then push to ``{user}/{name}``; yields (status, card) as the job advances."""
    if profile is None or oauth is None:
        raise gr.Error("Sign in with Hugging Face first: the merge is pushed to your namespace.")
    inputs = [s.strip() for s in values[models_box].replace(",", "\n").splitlines() if s.strip()]
    name = values[repo_box].strip()
    if not name or "/" in name:
        raise gr.Error(f"Give a repo name (no '/'): the merge goes to {profile.username}/NAME.")
    method = values[method_radio]
    try:  # only what differs from the defaults, so the recipe (and its hash) stays minimal
        params = {p["name"]: v for p, w in PARAM_WIDGETS[method]
                  if (v := parse_param(p, values[w])) is not None and v != p["default"]}
    except ValueError as e:
        raise gr.Error(f"{method}: {e}") from None
    session = request.session_hash or ""
    if session in RUNNING:
        raise gr.Error("A merge is already running in this tab: cancel it or wait.")

    token, repo_id = user_token(oauth), f"{profile.username}/{name}"
    cancel = RUNNING[session] = threading.Event()
    state: dict[str, Any] = {"done": 0.0, "text": "starting"}

    def report(lo: float, hi: float):  # hubsoup's progress(done, stage, message), mapped onto [lo, hi]
        def callback(done: float, stage: str, message: str) -> None:
            state["done"], state["text"] = lo + (hi - lo) * done, f"{stage}: {message}"
        return callback

    def job() -> None:  # runs in its own thread; the cancel event stops hubsoup itself
        try:
            merge_and_push(inputs, method, base=values[base_box].strip() or None, params=params, token=token,
                           repo_id=repo_id, private=values[private_box], cancel=cancel, report=report, state=state)
        finally:
            WORKERS.discard(threading.current_thread())

    worker = threading.Thread(target=job, daemon=True)
    WORKERS.add(worker)
    worker.start()
    shown_card = False
    yield status_line(0.0, "starting"), ""  # and clear the previous run's card
    try:
        while worker.is_alive():
            worker.join(0.2)
            text = "cancelling…" if cancel.is_set() else state["text"]
            progress(state["done"], desc=text)
            card = state.get("card")
            yield status_line(state["done"], text), (card if card and not shown_card else gr.skip())
            shown_card = shown_card or bool(card)
    finally:
        cancel.set()  # the tab went away (generator closed): stop the job too
        RUNNING.pop(session, None)

    error = state.get("error")
    if isinstance(error, MergeCancelled):
        yield "**Cancelled** · nothing was written or pushed.", ""
    elif error is not None:
        kind = "" if isinstance(error, HubsoupError) else f"{type(error).__name__}: "
        yield f"**Failed** · {kind}{error}", state.get("card", "")
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
    with gr.Row():
        models_box = gr.Textbox(label="Models to merge", info="repo IDs (org/name[@revision]), one per line",
                                lines=3, elem_id="models")
        base_box = gr.Textbox(label="Base model (optional)", info="default: the base_model the inputs' cards name",
                              elem_id="base")
    method_radio = gr.Radio(list(METHODS), value=DEFAULT_METHOD, label="Method", elem_id="method")
    method_info = gr.Markdown(elem_id="method-info")
    PARAM_WIDGETS: dict[str, list[tuple[dict[str, Any], gr.components.Component]]] = {}
    groups = []
    for name, m in METHODS.items():
        with gr.Group(visible=name == DEFAULT_METHOD) as group:
            PARAM_WIDGETS[name] = [(p, param_widget(name, p)) for p in m["params"]]
        groups.append(group)
    with gr.Row():
        repo_box = gr.Textbox(label="Repo name", value="soup", info="pushed to YOUR-USERNAME/NAME", elem_id="repo")
        private_box = gr.Checkbox(label="Private repo", value=False, elem_id="private")
    with gr.Row():
        merge_btn = gr.Button("Merge and push", variant="primary", elem_id="merge")
        cancel_btn = gr.Button("Cancel", variant="stop", elem_id="cancel")
    status = gr.Markdown("Sign in, then merge.", elem_id="status")
    card_view = gr.Markdown(elem_id="card")

    demo.load(describe, method_radio, [method_info, *groups])
    method_radio.change(describe, method_radio, [method_info, *groups])
    widgets = {w for pairs in PARAM_WIDGETS.values() for _, w in pairs}
    merge_btn.click(run, {models_box, base_box, method_radio, repo_box, private_box, *widgets}, [status, card_view],
                    show_progress_on=[card_view], concurrency_limit=2)
    cancel_btn.click(cancel_job, None, None, show_progress="hidden")
    demo.unload(cancel_job)  # closing the tab cancels its job

if __name__ == "__main__":
    try:
        demo.queue().launch()  # host and port: GRADIO_SERVER_NAME / GRADIO_SERVER_PORT (a Space sets them)
    finally:
        shutdown()
