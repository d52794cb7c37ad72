"""Push a merge output folder to the Hugging Face Hub.

One call, :func:`push_folder`, creates the repo if needed and uploads the whole folder
(weights, config, tokenizer, model card, recipe) in **one commit**. Pushing the same
folder again is idempotent: the Hub makes no new commit for identical content, so a
failed or interrupted push is simply retried with ``hubsoup push FOLDER ORG/NAME``.

The token comes from the usual ``huggingface_hub`` sources (``token=``, ``HF_TOKEN``,
``hf auth login``); hubsoup never prints, logs or writes it anywhere (:func:`scrub_secrets`
cleans every message, :func:`install_log_scrubber` every log record).

What goes up names local inputs without their paths: the recipe is uploaded in its public form
(:meth:`hubsoup.recipe.Recipe.public_yaml`; the local ``hubsoup_recipe.yaml`` keeps the paths
for ``hubsoup run``), other text files have the local paths the recipe knows replaced by those
public names, and a push that would still upload a local path (or a link leading out of the
folder) is refused before anything is sent.

Every Hub request times out (:func:`ensure_timeouts`; ``HUBSOUP_HUB_TIMEOUT`` seconds, default
60): a server that stops answering ends the push with the retry command.

Example:
    >>> from hubsoup.hub import push_folder
    >>> info = push_folder("./soup", "org/soup", private=True)     # doctest: +SKIP
    >>> info.commit_url                                              # doctest: +SKIP
    'https://huggingface.co/org/soup/commit/3f1c...'
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import threading
from contextlib import contextmanager
from typing import Any, Callable

from huggingface_hub import CommitOperationAdd, HfApi, constants
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.utils import (
    are_progress_bars_disabled, disable_progress_bars, enable_progress_bars, filter_repo_objects,
)
from huggingface_hub.utils._runtime import is_xet_available

from hubsoup.card import public_adapter_config, retarget_text
from hubsoup.errors import MergeCancelled, PushError
from hubsoup.public import _map_models, resign_state_json
# the Hub client rules live in hubsoup.hubclient (sources and the pipeline use them too); re-exported here
from hubsoup.hubclient import (  # noqa: F401
    DEFAULT_TIMEOUT, TIMEOUT_ENV, SecretFilter, Token, check_repo_id, ensure_timeouts, error_status, hub_timeout,
    install_log_scrubber, is_timeout, scrub_secrets, server_detail,
)
from hubsoup.recipe import RECIPE_FILE, Recipe, looks_local, public_file_ref, public_recipe_yaml
from hubsoup.sources.access import is_hub_id
from hubsoup.sources.resolve import parse_spec
from hubsoup.untrusted import MAX_YAML_BYTES, load_yaml

log = logging.getLogger(__name__)

# never uploaded: VCS folders, huggingface_hub's local metadata, our own temp files
IGNORE_PATTERNS = [".git/*", "*/.git/*", ".cache/*", "*.tmp", "*.partial", ".DS_Store",
                   "hubsoup_study.db*",  # an evolve study's local store (it names local paths): never uploaded
                   ".hubsoup", "*/.hubsoup"]  # hubsoup's marker of a folder it made (output.folder.MARKER): local


# text files whose local paths are replaced by public names in what is uploaded
_TEXT_SUFFIXES = (".md", ".json", ".yaml", ".yml", ".txt", ".jinja", ".csv", ".tsv")
_MAX_TEXT = 32 * 1024 * 1024


def retry_command(folder: str, repo_id: str, *, private: bool | None = None, create_pr: bool = False,
                  commit_message: str | None = None) -> str:
    """The ``hubsoup push`` command line that retries a push of ``folder`` to ``repo_id``."""
    parts = ["hubsoup", "push", folder, repo_id]
    if private:
        parts.append("--private")
    if create_pr:
        parts.append("--create-pr")
    if commit_message:
        parts += ["--commit-message", commit_message]
    return " ".join(shlex.quote(p) for p in parts)


def default_commit_message(folder: str) -> str:
    """``Upload <method> merge made with hubsoup (recipe <hash>)`` when the folder holds a recipe."""
    try:
        with open(os.path.join(folder, RECIPE_FILE), encoding="utf-8") as f:
            recipe = load_yaml(f.read(MAX_YAML_BYTES + 1), "recipe") or {}
        method = recipe.get("method")
        if method:
            return f"Upload {method} merge made with hubsoup"
    except Exception:  # noqa: BLE001 - any folder may be pushed; the message is cosmetic
        pass
    return "Upload model made with hubsoup"


def retarget_card(folder: str, repo_id: str) -> bool:
    """Point a hubsoup card's "how to use" snippet at ``repo_id`` instead of the local folder.

    A card written by ``hubsoup merge`` without ``--push`` loads the model from its local
    path; before that folder goes to the Hub, the path becomes the repo ID (in place, so
    the local folder stays identical to what is on the Hub). Returns whether it changed.
    """
    path = os.path.join(folder, "README.md")
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if "hubsoup" not in text:
        return False

    new = retarget_text(text, folder, repo_id)  # the repo's title and ID; a local base by its public name
    if new == text:
        return False
    with open(path, "w", encoding="utf-8") as f:
        f.write(new)
    return True


def _scrub(text: str, token: Token) -> str:
    """Remove any token from a message (a server may echo it back in an error body)."""
    return scrub_secrets(text, token)


_server_detail = server_detail


def _explain(e: Exception, repo_id: str, token: Token) -> str:
    """What went wrong, in words a user can act on."""
    status = error_status(e)
    detail = _server_detail(e)
    if isinstance(e, ValueError) and "metadata" in str(e).lower():
        first = str(e).strip().splitlines()
        why = "; ".join(s.lstrip("- ").strip() for s in first[1:] if s.strip()) or first[0]
        return f"the Hub refused the model card's metadata (README.md): {why}"
    if constants.HF_HUB_OFFLINE and not isinstance(e, HfHubHTTPError):
        return "offline mode is on (HF_HUB_OFFLINE=1); unset it to push"
    if is_timeout(e):
        return (f"the Hub at {constants.ENDPOINT} did not answer within {hub_timeout():g}s (timed out; "
                f"{TIMEOUT_ENV} sets the limit)")
    if isinstance(e, RevisionNotFoundError):
        return f"revision not found{detail}"
    if status == 401:
        return ("authentication failed: no valid token (log in with `hf auth login`, set HF_TOKEN, "
                "or pass token=)")
    if status == 403:
        return (f"permission denied: the token may not write to {repo_id} (use a write token of a user "
                "who owns the namespace or belongs to the organisation, or open a pull request with --create-pr)")
    if isinstance(e, RepositoryNotFoundError) or status == 404:
        return (f"repo not found on {constants.ENDPOINT}, or no access to it with this token "
                "(is it private? is the namespace yours?)")
    if status is not None and status >= 500:
        return f"Hub server error {status}{detail}; try again later"
    if isinstance(e, HfHubHTTPError):
        return f"Hub request failed with HTTP {status}{detail}"
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"network error: cannot reach {constants.ENDPOINT} ({type(e).__name__}: {first[:200]})"


# --- what goes up --------------------------------------------------------------------------------

def _local_paths(folder: str, repo_id: str) -> dict[str, str]:
    """Local paths the folder's files may hold, each mapped to what is published instead."""
    paths: dict[str, str] = {}
    recipe_path = os.path.join(folder, RECIPE_FILE)
    if os.path.isfile(recipe_path):
        try:
            with open(recipe_path, encoding="utf-8") as f:
                # every path it names, whatever else it says (verify=False: an edited recipe is still scanned)
                paths.update(Recipe.from_yaml(f.read(), verify=False).local_paths())
        except Exception:  # noqa: BLE001 - not a hubsoup recipe: the leak check still runs
            pass
    evals = os.path.join(folder, "eval_results.json")
    if os.path.isfile(evals):
        try:
            with open(evals, encoding="utf-8") as f:
                for row in json.load(f):
                    data = row.get("data") if isinstance(row, dict) else None
                    if looks_local(data):
                        public = public_file_ref(data)
                        for form in {data, os.path.abspath(os.path.expanduser(data))}:
                            paths[form] = public
        except Exception:  # noqa: BLE001
            pass
    for form in {os.path.abspath(folder), os.path.realpath(folder)}:
        paths[form] = repo_id
    return {k: v for k, v in paths.items() if len(k) > 1}


def _leak_needles(paths: dict[str, str]) -> list[str]:
    """Strings that must not be uploaded: every absolute local path known here, and the home folder."""
    needles = {p for p in paths if os.path.isabs(p)}
    home = os.path.expanduser("~")
    if home and home not in ("/", "~") and len(home) > 1:
        needles.add(home.rstrip("/\\") + "/")
    return sorted(needles, key=len, reverse=True)


def _safetensors_header(path: str) -> bytes:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return b""
        n = int.from_bytes(head, "little")
        return f.read(min(n, 100 * 1024 * 1024))


STATE_JSON = "continual_state/state.json"


def upload_plan(folder: str, repo_id: str) -> list[tuple[str, str | bytes]]:
    """What :func:`push_folder` uploads: ``(path in repo, local file or the bytes to upload)``, sorted.

    The recipe goes up in its public form (no local path), other text files with the local paths
    the recipe (and ``eval_results.json``) name replaced by their public names. Raises
    :class:`PushError` (the reason only) for a link leading out of the folder, or for a file that
    would still carry a local path (safetensors headers included) — nothing is uploaded then.
    """
    root = os.path.realpath(folder)
    rel = []
    for dirpath, dirs, names in os.walk(folder):
        dirs.sort()
        for n in sorted(names):
            p = os.path.join(dirpath, n)
            if os.path.isfile(p):
                rel.append(os.path.relpath(p, folder).replace(os.sep, "/"))
    rel = sorted(filter_repo_objects(rel, ignore_patterns=IGNORE_PATTERNS + [".git", "**/.git/**",
                                                                              ".cache/huggingface/*"]))
    paths = _local_paths(folder, repo_id)
    needles = _leak_needles(paths)
    replace = sorted(paths.items(), key=lambda kv: len(kv[0]), reverse=True)
    plan: list[tuple[str, str | bytes]] = []
    for name in rel:
        local = os.path.join(folder, *name.split("/"))
        real = os.path.realpath(local)
        if os.path.commonpath([real, root]) != root:
            raise PushError(f"{name} is a link to a file outside the folder; refusing to upload it")
        content: str | bytes = local
        scan: bytes = b""
        if name == RECIPE_FILE:
            with open(local, encoding="utf-8") as f:
                text = f.read()
            try:
                text = public_recipe_yaml(text)
            except Exception:  # noqa: BLE001 - not one of ours: uploaded as is (after the checks)
                pass
            content = scan = text.encode("utf-8")
        elif name.lower().endswith(_TEXT_SUFFIXES) and os.path.getsize(local) <= _MAX_TEXT:
            with open(local, "rb") as f:
                raw = f.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                scan = raw
            else:
                new = text
                if name == "adapter_config.json":  # peft loads the base it names: the one a card names
                    new = public_adapter_config(new, folder)
                for path, public in replace:
                    if path in new:
                        new = new.replace(path, public)
                if new != text and name.endswith(STATE_JSON):  # a checksummed state: sign the public form again
                    new = resign_state_json(new)
                scan = new.encode("utf-8")
                content = scan if new != text else local
        elif name.endswith(".safetensors"):
            scan = _safetensors_header(local)
        for needle in needles:
            if needle.encode("utf-8") in scan:
                under = os.path.dirname(needle.rstrip("/")) or needle
                if name.endswith(".safetensors"):
                    raise PushError(f"{name} holds a local path (under {under}) in its metadata, which must not "
                                    "be published (an output of an older hubsoup? merge again)")
                raise PushError(f"{name} holds a local path (under {under}), which must not be published: "
                                "remove it from the file and push again")
        plan.append((name, content))
    return plan


def restricted_inputs(folder: str, token: Token = None) -> list[dict[str, str]]:
    """The Hub repos a merge folder's recipe names (base, inputs, a mergekit config's models) that are not public,
    asked of the Hub now with ``token``: ``{"repo": ..., "why": "private" | "gated" | "not readable ..."}``."""
    path = os.path.join(folder, RECIPE_FILE)
    if not os.path.isfile(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            recipe = Recipe.from_yaml(f.read(), verify=False)  # every repo it names, even in an edited recipe
    except Exception:  # noqa: BLE001 - not a hubsoup recipe: nothing to check it by
        return []
    repos = {r.repo_id for r in (recipe.base, *recipe.inputs) if r.repo_id}
    config = recipe.mergekit.get("config") if isinstance(recipe.mergekit, dict) else None
    if isinstance(config, str):
        named: list[str] = []
        try:
            _map_models(load_yaml(config, "mergekit config"), lambda r: named.extend(str(r).split("+")) or r)
        except Exception:  # noqa: BLE001
            pass
        repos |= {parse_spec(n)[0] for n in named if is_hub_id(n)}
    out = []
    api = HfApi(token=token)
    ensure_timeouts()
    for repo in sorted(repos):
        try:
            info = api.model_info(repo, token=token, timeout=hub_timeout())
        except Exception as e:  # noqa: BLE001 - a repo this token cannot read is not public to it
            status = error_status(e)
            if status is None or status >= 500:
                raise PushError(f"cannot check whether input '{repo}' is public: {_explain(e, repo, token)}") from e
            out.append({"repo": repo, "why": "not readable with this token"})
            continue
        if getattr(info, "private", False) or getattr(info, "gated", False):
            out.append({"repo": repo, "why": "private" if info.private else "gated"})
    return out


def _goes_public(api, repo_id: str, private: bool | None) -> bool:
    """Whether a push to ``repo_id`` is readable by everyone (an existing repo keeps its own visibility)."""
    if private:
        return False
    try:
        return not api.repo_info(repo_id, timeout=hub_timeout()).private
    except Exception as e:  # noqa: BLE001 - not there (or not ours to see): created public by this push
        if error_status(e) in (401, 404) or type(e).__name__ == "RepositoryNotFoundError":
            return True
        raise


def push_folder(folder: str, repo_id: str, *, private: bool | None = None, create_pr: bool = False,
                commit_message: str | None = None, token: Token = None,
                commit_description: str | None = None, monitor: Any = None, allow_private_inputs: bool = False,
                card_writer: Callable[[str, str, list[dict[str, str]]], None] | None = None):
    """Create ``repo_id`` if needed and upload ``folder`` to it in one commit.

    Args:
        folder: a merge output (or any model folder).
        repo_id: ``namespace/name``.
        private: visibility of a repo created by this call (an existing repo keeps its own).
        create_pr: open a pull request instead of committing to ``main``.
        commit_message: default ``Upload <method> merge made with hubsoup``.
        token: default: the usual huggingface_hub sources (``HF_TOKEN``, ``hf auth login``).
        allow_private_inputs: push a merge of private or gated inputs (see :func:`restricted_inputs`) to a
            public repo anyway; without it such a push is refused before anything is sent. The card then
            says so (rendered again by ``card_writer`` when it does not).
        card_writer: ``card_writer(folder, repo_id, restricted)`` renders the card again so that it names the
            private or gated inputs (:func:`hubsoup.api.note_restricted_inputs`, which ``push_to_hub`` and
            ``hubsoup push`` pass; the push module renders no card itself).
        monitor: a :class:`hubsoup.progress.Monitor` (an app's ``progress``/``cancel``): stage ``push``,
            one report per file, nothing printed; cancelled before the repo is created, between files or
            before the commit, it raises :class:`MergeCancelled` with no commit made (and deletes the repo
            if this call created it).

    Returns:
        ``huggingface_hub.CommitInfo`` (``commit_url``, ``oid``, ``pr_url``).

    Raises:
        PushError: one line naming the repo, what went wrong (authentication, permission,
            not found, server error, network) and the ``hubsoup push`` command that retries.
            The local folder is never touched by a failed push.
    """
    check_repo_id(repo_id)
    if not os.path.isdir(folder):
        raise PushError(f"cannot push '{folder}' to {repo_id}: no such folder")
    if not any(os.path.isfile(os.path.join(folder, f)) for f in os.listdir(folder)):
        raise PushError(f"cannot push '{folder}' to {repo_id}: the folder holds no files")
    message = commit_message or default_commit_message(folder)
    retry = retry_command(folder, repo_id, private=private, create_pr=create_pr, commit_message=commit_message)
    retarget_card(folder, repo_id)  # the local card too: the folder stays what is on the Hub (but the recipe's paths)
    api = HfApi(token=token)
    _check_private_inputs(api, folder, repo_id, private, token, allow_private_inputs, retry, card_writer)
    try:
        plan = upload_plan(folder, repo_id)
    except PushError as e:
        raise PushError(f"push of '{folder}' to {repo_id} refused: {e}") from None
    created = False
    try:
        ensure_timeouts()
        if monitor is not None and monitor.active:
            monitor.stage("push", f"pushing to {repo_id}")
            monitor.check("before the push")
            created = not api.repo_exists(repo_id)
            api.create_repo(repo_id, private=private, exist_ok=True)
            info = _push_monitored(api, repo_id, plan, monitor, message, commit_description, create_pr)
        else:
            api.create_repo(repo_id, private=private, exist_ok=True)
            # one commit, whatever the folder's size; identical content makes no new commit
            operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=content) for name, content in plan]
            info = api.create_commit(repo_id=repo_id, operations=operations, commit_message=message,
                                     commit_description=commit_description, create_pr=create_pr)
    except MergeCancelled:
        if created:  # the repo this call created holds no commit of ours: leave nothing behind
            try:
                api.delete_repo(repo_id)
            except Exception:  # noqa: BLE001 - the cancellation is what the caller must see
                log.debug("could not delete %s after a cancelled push", repo_id)
        raise
    except Exception as e:  # noqa: BLE001 - mapped to one clear line
        what = _scrub(_explain(e, repo_id, token), token)
        log.debug("push of %s to %s failed: %s", folder, repo_id, type(e).__name__)
        raise PushError(f"push of '{folder}' to {repo_id} failed: {what}. The local output is intact; "
                        f"retry with: {retry}") from e
    log.info("pushed %s to %s: %s", folder, repo_id, info.commit_url)
    return info


def _check_private_inputs(api, folder: str, repo_id: str, private: bool | None, token: Token, allow: bool,
                          retry: str, card_writer: Callable[[str, str, list[dict[str, str]]], None] | None) -> None:
    """Refuse (before anything is sent) a public push of a merge whose inputs are not public, unless allowed;
    allowed, make sure the card says so."""
    if private:
        return
    try:
        ensure_timeouts()
        restricted = restricted_inputs(folder, token)
        public = bool(restricted) and _goes_public(api, repo_id, private)
    except PushError as e:
        raise PushError(f"push of '{folder}' to {repo_id} failed: {e}. The local output is intact; retry with: "
                        f"{retry}") from None
    except Exception as e:  # noqa: BLE001
        raise PushError(f"push of '{folder}' to {repo_id} failed: {_scrub(_explain(e, repo_id, token), token)}. "
                        f"The local output is intact; retry with: {retry}") from e
    if not public:
        return
    what = ", ".join(f"'{r['repo']}' ({r['why']})" for r in restricted)
    if not allow:
        raise PushError(f"push of '{folder}' to {repo_id} refused: {repo_id} is public and the merge contains "
                        f"{what}: its weights would be published. Push to a private repo (--private), or pass "
                        "--allow-private-inputs (allow_private_inputs=True) to publish it anyway")
    if card_writer is not None:
        card_writer(folder, repo_id, restricted)


def _push_monitored(api, repo_id: str, plan: list[tuple[str, str | bytes]], monitor: Any, message: str,
                    commit_description: str | None, create_pr: bool):
    """The push of an app's run: the files uploaded one at a time (a report and a cancel check between them,
    no progress bar: files are given as open file objects, which huggingface_hub uploads without one), then
    one commit. Uploaded blobs that no commit names are invisible on the Hub."""
    with contextlib.ExitStack() as files, _no_xet_bars(monitor.reporting):
        operations = []
        for name, content in plan:
            src = files.enter_context(open(content, "rb")) if isinstance(content, str) else content
            operations.append(CommitOperationAdd(path_in_repo=name, path_or_fileobj=src))
        monitor.segment(len(operations) + 1, f"uploading {len(operations)} file(s)")
        for op in operations:
            monitor.check("during the upload")
            api.preupload_lfs_files(repo_id, additions=[op], create_pr=create_pr)
            monitor.step(f"uploaded {op.path_in_repo}")
        monitor.check("before the commit")
        info = api.create_commit(repo_id=repo_id, operations=operations, commit_message=message,
                                 commit_description=commit_description, create_pr=create_pr)
        monitor.step(f"committed to {repo_id}")
        return info


_BARS_MUTEX = threading.Lock()
_BARS_USERS = 0


@contextmanager
def _no_xet_bars(quiet: bool):
    """huggingface_hub's xet uploads show progress unless progress bars are off *process-wide*: unlike
    downloads (``tqdm_class``) and plain LFS uploads (a file object has no bar), there is no per-call
    switch. So, only when xet is in use, bars are turned off while at least one silent push runs and
    turned back on after the last one (counted under a lock; never when the user had them off
    already). It hides other threads' bars for that while; it changes no result."""
    global _BARS_USERS

    if not quiet or not is_xet_available():
        yield
        return
    with _BARS_MUTEX:
        _BARS_USERS += 1
        first = _BARS_USERS == 1
        if first:
            _no_xet_bars.restore = not are_progress_bars_disabled()  # type: ignore[attr-defined]
            if _no_xet_bars.restore:  # type: ignore[attr-defined]
                disable_progress_bars()
    try:
        yield
    finally:
        with _BARS_MUTEX:
            _BARS_USERS -= 1
            if _BARS_USERS == 0 and getattr(_no_xet_bars, "restore", False):
                _no_xet_bars.restore = False  # type: ignore[attr-defined]
                enable_progress_bars()


__all__ = ["push_folder", "retarget_card", "retry_command", "check_repo_id", "upload_plan", "scrub_secrets",
           "install_log_scrubber", "ensure_timeouts", "hub_timeout"]
