"""Push a merge output folder to the Hugging Face Hub.

One call, :func:`push_folder`, creates the repo if needed and uploads the whole folder
(weights, config, tokenizer, model card, recipe) in **one commit**. Pushing the same
folder again is idempotent: the Hub makes no new commit for identical content, so a
failed or interrupted push is simply retried with ``hubsoup push FOLDER ORG/NAME``.

The token comes from the usual ``huggingface_hub`` sources (``token=``, ``HF_TOKEN``,
``hf auth login``); hubsoup never prints, logs or writes it anywhere.

Example:
    >>> from hubsoup.hub import push_folder
    >>> info = push_folder("./soup", "org/soup", private=True)     # doctest: +SKIP
    >>> info.commit_url                                              # doctest: +SKIP
    'https://huggingface.co/org/soup/commit/3f1c...'
"""

from __future__ import annotations

import logging
import os
import re
import shlex
from typing import Any

from hubsoup.errors import PushError

log = logging.getLogger(__name__)

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*$")
# never uploaded: VCS folders, huggingface_hub's local metadata, our own temp files
IGNORE_PATTERNS = [".git/*", "*/.git/*", ".cache/*", "*.tmp", "*.partial", ".DS_Store"]


def check_repo_id(repo_id: str) -> str:
    """Refuse a target that is not ``namespace/name`` (before any merge or upload starts)."""
    if not isinstance(repo_id, str) or not _REPO_ID.match(repo_id) or ".." in repo_id or repo_id.endswith((".", "-")):
        raise PushError(f"push target '{repo_id}' is not a Hub repo ID; use NAMESPACE/NAME, e.g. my-org/my-soup")
    return repo_id


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
        from hubsoup.recipe import RECIPE_FILE

        import yaml

        with open(os.path.join(folder, RECIPE_FILE), encoding="utf-8") as f:
            recipe = yaml.safe_load(f) or {}
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
    new = text
    for local in {os.path.abspath(folder), os.path.realpath(folder), folder}:
        new = new.replace(f'from_pretrained("{local}")', f'from_pretrained("{repo_id}")')
        new = new.replace(f'from_pretrained(base, "{local}")', f'from_pretrained(base, "{repo_id}")')
    if new == text:
        return False
    with open(path, "w", encoding="utf-8") as f:
        f.write(new)
    return True


def _scrub(text: str, token: Any) -> str:
    """Remove any token from a message (belt and braces: the Hub's messages do not carry it)."""
    from huggingface_hub import get_token

    for tok in {token if isinstance(token, str) else None, get_token()}:
        if tok:
            text = text.replace(tok, "***")
    return re.sub(r"\bhf_[A-Za-z0-9]{30,}\b", "hf_***", text)  # the shape of a real token


def _server_detail(e: Exception) -> str:
    resp = getattr(e, "response", None)
    msg = getattr(e, "server_message", None)
    if not msg and resp is not None:
        try:
            msg = resp.headers.get("X-Error-Message")
        except Exception:  # noqa: BLE001
            msg = None
    return f" ({msg.strip().splitlines()[0]})" if msg and msg.strip() else ""


def _explain(e: Exception, repo_id: str, token: Any) -> str:
    """What went wrong, in words a user can act on."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    status = None
    resp = getattr(e, "response", None)
    if resp is not None:
        status = getattr(resp, "status_code", None)
    detail = _server_detail(e)
    if isinstance(e, ValueError) and "metadata" in str(e).lower():
        first = str(e).strip().splitlines()
        why = "; ".join(s.lstrip("- ").strip() for s in first[1:] if s.strip()) or first[0]
        return f"the Hub refused the model card's metadata (README.md): {why}"
    if constants.HF_HUB_OFFLINE and not isinstance(e, HfHubHTTPError):
        return "offline mode is on (HF_HUB_OFFLINE=1); unset it to push"
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
    return f"network error: cannot reach {constants.ENDPOINT} ({type(e).__name__}: {e})"


def push_folder(folder: str, repo_id: str, *, private: bool | None = None, create_pr: bool = False,
                commit_message: str | None = None, token: str | bool | None = None,
                commit_description: str | None = None):
    """Create ``repo_id`` if needed and upload ``folder`` to it in one commit.

    Args:
        folder: a merge output (or any model folder).
        repo_id: ``namespace/name``.
        private: visibility of a repo created by this call (an existing repo keeps its own).
        create_pr: open a pull request instead of committing to ``main``.
        commit_message: default ``Upload <method> merge made with hubsoup``.
        token: default: the usual huggingface_hub sources (``HF_TOKEN``, ``hf auth login``).

    Returns:
        ``huggingface_hub.CommitInfo`` (``commit_url``, ``oid``, ``pr_url``).

    Raises:
        PushError: one line naming the repo, what went wrong (authentication, permission,
            not found, server error, network) and the ``hubsoup push`` command that retries.
            The local folder is never touched by a failed push.
    """
    from huggingface_hub import HfApi

    check_repo_id(repo_id)
    if not os.path.isdir(folder):
        raise PushError(f"cannot push '{folder}' to {repo_id}: no such folder")
    if not any(os.path.isfile(os.path.join(folder, f)) for f in os.listdir(folder)):
        raise PushError(f"cannot push '{folder}' to {repo_id}: the folder holds no files")
    message = commit_message or default_commit_message(folder)
    retry = retry_command(folder, repo_id, private=private, create_pr=create_pr, commit_message=commit_message)
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=message,
                                 commit_description=commit_description, create_pr=create_pr,
                                 ignore_patterns=IGNORE_PATTERNS)
    except Exception as e:  # noqa: BLE001 - mapped to one clear line
        what = _scrub(_explain(e, repo_id, token), token)
        log.debug("push of %s to %s failed: %s", folder, repo_id, type(e).__name__)
        raise PushError(f"push of '{folder}' to {repo_id} failed: {what}. The local output is intact; "
                        f"retry with: {retry}") from e
    log.info("pushed %s to %s: %s", folder, repo_id, info.commit_url)
    return info


__all__ = ["push_folder", "retarget_card", "retry_command", "check_repo_id"]
