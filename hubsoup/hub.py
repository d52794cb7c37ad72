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
import hashlib
import json
import logging
import os
import queue
import re
import shlex
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterator, Sequence

from huggingface_hub import CommitOperationAdd, constants
from huggingface_hub.lfs import UploadInfo, post_lfs_batch_info
from huggingface_hub.utils import (  # type: ignore[attr-defined]  # huggingface_hub.utils: re-exports mypy cannot see
    are_progress_bars_disabled, disable_progress_bars, enable_progress_bars, filter_repo_objects,
)
from huggingface_hub.utils._runtime import is_xet_available

from hubsoup.card import public_adapter_config, retarget_text
from hubsoup.errors import MergeCancelled, ParameterError, PrivateInputsError, PushError
from hubsoup.output.folder import OutputFolder
from hubsoup.output.shards import ShardLayout
from hubsoup.progress import Monitor, upload_steps
from hubsoup.public import local_path_in_file, looks_local, map_models, public_file_ref, resign_state_json
from hubsoup.hubclient import (
    Token, check_repo_id, ensure_timeouts, error_status, expect_commit, hub_api, hub_timeout, is_hub_id, parse_spec,
    push_failure,
)
from hubsoup.recipe import RECIPE_FILE, Recipe, public_recipe_yaml
from hubsoup.untrusted import MAX_YAML_BYTES, load_yaml

if TYPE_CHECKING:
    from huggingface_hub import CommitInfo, HfApi

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


# --- what goes up --------------------------------------------------------------------------------

def _local_paths(folder: str, repo_id: str, recipe: Recipe | None = None) -> dict[str, str]:
    """Local paths the folder's files may hold, each mapped to what is published instead (``recipe``: the
    merge's, for a folder that holds none yet: a push streamed while the merge runs)."""
    paths: dict[str, str] = {}
    recipe = recipe or _folder_recipe(folder)
    if recipe is not None:
        try:
            paths.update(recipe.local_paths())
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


def _folder_recipe(folder: str) -> Recipe | None:
    """The recipe a merge output holds (None: none, or not one of hubsoup's), read for what it names whatever else
    it says (``verify=False``: an edited recipe is still scanned for local paths and private inputs)."""
    path = os.path.join(folder, RECIPE_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return Recipe.from_yaml(f.read(), verify=False)
    except Exception:  # noqa: BLE001 - not a hubsoup recipe
        return None


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


def upload_plan(folder: str, repo_id: str, *, recipe: Recipe | None = None,
                skip: Collection[str] = ()) -> list[tuple[str, str | bytes]]:
    """What :func:`push_folder` uploads: ``(path in repo, local file or the bytes to upload)``, sorted.

    The recipe goes up in its public form (no local path), other text files with the local paths
    the recipe (and ``eval_results.json``) name replaced by their public names. Raises
    :class:`PushError` (the reason only) for a link leading out of the folder, or for a file that
    would still carry a local path (safetensors headers included) — nothing is uploaded then.
    ``skip``: files not to list (shards a streamed push already uploaded); ``recipe``: the merge's, when the
    folder holds none yet.
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
    rules = _PublishRules(folder, repo_id, recipe)
    plan: list[tuple[str, str | bytes]] = []
    for name in rel:
        if name in skip:
            continue
        local = os.path.join(folder, *name.split("/"))
        if os.path.commonpath([os.path.realpath(local), root]) != root:
            raise PushError(f"{name} is a link to a file outside the folder; refusing to upload it")
        plan.append((name, rules.content(name, local)))
    return plan


class _PublishRules:
    """What a file of a merge output becomes on the Hub (:func:`upload_plan`'s rule for one file, which the
    streamed push applies to each shard before its upload): the local paths the recipe and the evaluation
    name replaced by their public names, and a refusal for a file that would still carry a local path."""

    def __init__(self, folder: str, repo_id: str, recipe: Recipe | None = None):
        self.folder = folder
        paths = _local_paths(folder, repo_id, recipe)
        self.needles = _leak_needles(paths)
        self.replace = sorted(paths.items(), key=lambda kv: len(kv[0]), reverse=True)

    def content(self, name: str, local: str) -> str | bytes:
        """The file's public content: ``local`` itself, or the bytes to upload instead (raises :class:`PushError`)."""
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
                    new = public_adapter_config(new, self.folder)
                for path, public in self.replace:
                    if path in new:
                        new = new.replace(path, public)
                if new != text and name.endswith(STATE_JSON):  # a checksummed state: sign the public form again
                    new = resign_state_json(new)
                scan = new.encode("utf-8")
                content = scan if new != text else local
        elif name.endswith(".safetensors"):
            scan = _safetensors_header(local)
        self.check(name, scan)
        self.scrub(name, content)
        return content

    @staticmethod
    def scrub(name: str, content: str | bytes) -> None:
        """Every file of the commit, whatever wrote it (eval results, search tables, a shard's metadata): no
        absolute local path, no home folder (``content``: its bytes or its local path)."""
        if (leak := local_path_in_file(name, content)) is not None:
            raise PushError(f"{name} holds a local path ({leak}), which must not be published: remove it from the "
                            "file and push again")

    def check(self, name: str, scan: bytes) -> None:
        for needle in self.needles:
            if needle.encode("utf-8") in scan:
                under = os.path.dirname(needle.rstrip("/")) or needle
                if name.endswith(".safetensors"):
                    raise PushError(f"{name} holds a local path (under {under}) in its metadata, which must not "
                                    "be published (an output of an older hubsoup? merge again)")
                raise PushError(f"{name} holds a local path (under {under}), which must not be published: "
                                "remove it from the file and push again")


def restricted_inputs(folder: str, token: Token = None, recipe: Recipe | None = None) -> list[dict[str, str]]:
    """The Hub repos a merge folder's recipe (or ``recipe``) names (base, inputs, a mergekit config's models) that
    are not public, asked of the Hub now with ``token``: ``{"repo": ..., "why": "private" | "gated" | "not
    readable ..."}``."""
    recipe = recipe or _folder_recipe(folder)
    if recipe is None:
        return []
    repos = {r.repo_id for r in (recipe.base, *recipe.inputs) if r.repo_id}
    config = recipe.mergekit.get("config") if isinstance(recipe.mergekit, dict) else None
    if isinstance(config, str):
        named: list[str] = []

        def note(r: str) -> str:  # each model the config names, kept as it is
            named.extend(str(r).split("+"))
            return r

        try:
            map_models(load_yaml(config, "mergekit config"), note)
        except Exception:  # noqa: BLE001
            pass
        repos |= {parse_spec(n)[0] for n in named if is_hub_id(n)}
    out = []
    api = hub_api(token)
    for repo in sorted(repos):
        try:
            info = api.model_info(repo, token=token, timeout=hub_timeout())
        except Exception as e:  # noqa: BLE001 - a repo this token cannot read is not public to it
            status = error_status(e)
            if status is None or status >= 500:
                raise PushError(f"cannot check whether input '{repo}' is public: {push_failure(e, repo, token)}") from e
            out.append({"repo": repo, "why": "not readable with this token"})
            continue
        if getattr(info, "private", False) or getattr(info, "gated", False):
            out.append({"repo": repo, "why": "private" if info.private else "gated"})
    return out


def _goes_public(api: HfApi, repo_id: str, private: bool | None) -> bool:
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
                card_writer: Callable[[str, str, list[dict[str, str]]], None] | None = None) -> CommitInfo:
    """Create ``repo_id`` if needed and upload ``folder`` to it in one commit.

    The same push as a merge streamed to the Hub (:class:`HubPush`), with every shard already complete:
    the shards are uploaded (huggingface_hub's pre-upload of LFS files; one the Hub already holds is not
    sent again), then everything goes in one commit.

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
            reports as the files go up (in bytes), nothing printed; cancelled before the repo is created, between files or
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
    retry = retry_command(folder, repo_id, private=private, create_pr=create_pr, commit_message=commit_message)
    retarget_card(folder, repo_id)  # the local card too: the folder stays what is on the Hub (but the recipe's paths)
    push = HubPush(repo_id, private=private, create_pr=create_pr, commit_message=commit_message, token=token,
                   commit_description=commit_description, monitor=monitor, allow_private_inputs=allow_private_inputs,
                   card_writer=card_writer, keep_files=True, what=f"push of '{folder}' to {repo_id}",
                   after=f"The local output is intact; retry with: {retry}")
    push.prepare(folder)  # the private inputs, then every file's public form: all checked before anything is sent
    try:
        plan = upload_plan(folder, repo_id)
    except PushError as e:
        raise PushError(f"push of '{folder}' to {repo_id} refused: {e}") from None
    shards = [name for name, content in plan if name.endswith(".safetensors") and isinstance(content, str)]
    mon = push.monitor
    mon.stage("push", f"pushing to {repo_id}")
    try:
        push.begin()
        # one segment counted in bytes (and the commit as one more unit): a big shard moves the bar as it goes up
        mon.segment(sum(os.path.getsize(c) if isinstance(c, str) else len(c) for _, c in plan) + 1,
                    f"uploading {len(plan)} file(s)")
        push.steps = True  # a finished folder: each shard's bytes are steps of the push
        for name in shards:
            mon.check("during the upload")
            push.shard_done(name, os.path.join(folder, *name.split("/")), lambda: None)
        info = push.commit(folder, segment=False)
    except BaseException as e:
        push.abort(cancelled=isinstance(e, MergeCancelled))
        raise
    log.info("pushed %s to %s: %s", folder, repo_id, info.commit_url)
    return info


PUSHED: list[str] = []
"""Commit URLs of the pushes this process committed, in order: a signal that arrives after a push's commit must not
be reported as having committed nothing (the CLI reads this)."""
COMMITTING: list[str] = []
"""The repo of every commit this process sent, in order (answered or not): one sent and not in :data:`PUSHED` when a
signal came was on its way, and the Hub applies it whole or not at all (the CLI says so)."""


def resume_dir() -> str:
    """Where pushes streamed during a merge keep their resume records: ``$HF_HOME/hubsoup/push-resume``."""
    return os.path.join(constants.HF_HOME, "hubsoup", "push-resume")


@dataclass(frozen=True)
class PushTarget:
    """Where a merge goes on the Hub (``hubsoup.merge(..., push=...)``; a plain ``"org/name"`` is enough).

    Example:
        >>> PushTarget.of("my-org/soup").repo_id
        'my-org/soup'
    """

    repo_id: str
    private: bool | None = None
    """Visibility of a repo the push creates (an existing repo keeps its own)."""
    create_pr: bool = False
    commit_message: str | None = None
    commit_description: str | None = None
    token: Token = field(default=None, repr=False, compare=False)
    """None: the merge's own token (``MergeOptions.token``). Never printed, never stored."""
    allow_private_inputs: bool | None = None
    """None: the merge's ``MergeOptions.allow_private_inputs``."""
    work_dir: str | None = None
    """Without a local copy (no ``out``): the folder under which the shards wait for their upload (in a temporary
    folder removed at the end); None: the working directory."""

    @classmethod
    def of(cls, value: "str | PushTarget") -> "PushTarget":
        if isinstance(value, PushTarget):
            check_repo_id(value.repo_id)
            return value
        if isinstance(value, str):
            return cls(check_repo_id(value))
        raise ParameterError(f"push must be a Hub repo ID (org/name) or a PushTarget, got {type(value).__name__}")

    def scratch_dir(self) -> str:
        """Where a push without a local copy works: ``.hubsoup-push-ORG--NAME`` (never created: its temporary folder
        ``..hubsoup-push-ORG--NAME.partial-*`` is, and removed at the end) in :attr:`work_dir` or the working
        directory. One run per repo and folder at a time (its lock)."""
        return os.path.join(os.path.abspath(self.work_dir or "."), ".hubsoup-push-" + self.repo_id.replace("/", "--"))

    def stream(self, *, token: Token, allow_private_inputs: bool, monitor: Monitor, keep_files: bool,
               card_writer: Callable[[str, str, list[dict[str, str]]], None] | None = None) -> "HubPush":
        """The push of a merge streamed here: this target's options, else the merge's ``token`` and
        ``allow_private_inputs`` (:meth:`HubPush.prepare` and :meth:`HubPush.begin` start it)."""
        allow = allow_private_inputs if self.allow_private_inputs is None else self.allow_private_inputs
        return HubPush(self.repo_id, private=self.private, create_pr=self.create_pr,
                       commit_message=self.commit_message, commit_description=self.commit_description,
                       token=self.token if self.token is not None else token, monitor=monitor,
                       allow_private_inputs=allow, card_writer=card_writer, keep_files=keep_files,
                       what=f"push to {self.repo_id}",
                       after="Nothing was committed; run the same merge again: it resumes (the shards already on the "
                             "Hub are neither merged nor uploaded again)")


class HubPush:
    """One push to the Hub, streamed: each shard uploaded as soon as it is complete, the rest in one commit.

    It is the :class:`~hubsoup.output.shards.ShardHandoff` of the merge's writer: a complete shard is handed
    in (:meth:`shard_done`), checked (no local path in its header), pre-uploaded in a background thread
    (``HfApi.preupload_lfs_files``: an object the Hub already holds is not sent again), recorded for a resume,
    deleted unless the files are kept (a local copy), and released to the writer, which waits while
    :data:`~hubsoup.output.shards.SHARDS_IN_FLIGHT` shards are uploading. :meth:`commit` puts the rest of the
    folder (index, config, tokenizer, card, recipe) and every shard in one commit: nothing is visible on the
    repo before it; :meth:`abort` commits nothing. A finished folder is pushed the same way
    (:func:`push_folder`).

    Order: :meth:`prepare` (the checks before anything is sent: private or gated inputs to a public repo, what
    must not be published), :meth:`begin` (the repo, created if needed, and the upload thread), optionally
    :meth:`resume`, shards, :meth:`commit` (a merge's output folder: :meth:`publish`). A merge makes its push with
    :meth:`PushTarget.stream`.
    """

    def __init__(self, repo_id: str, *, private: bool | None = None, create_pr: bool = False,
                 commit_message: str | None = None, commit_description: str | None = None, token: Token = None,
                 monitor: Any = None, allow_private_inputs: bool = False,
                 card_writer: Callable[[str, str, list[dict[str, str]]], None] | None = None,
                 keep_files: bool = True, what: str | None = None, after: str = ""):
        self.repo_id = check_repo_id(repo_id)
        self.private, self.create_pr = private, create_pr
        self.commit_message, self.commit_description = commit_message, commit_description
        self.token = token
        self.monitor = monitor if monitor is not None else Monitor()
        self.allow = allow_private_inputs
        self.card_writer = card_writer
        self.keeps_files = keep_files
        """The shard files stay where they are (a local copy); else each is deleted once uploaded."""
        self.what = what or f"push to {repo_id}"
        self.after = after
        """What a failure's message ends with (how to retry)."""
        self.api: HfApi = hub_api(token)
        self.created = False
        self.restricted: list[dict[str, str]] = []
        self.shards: dict[str, CommitOperationAdd] = {}
        """Shards on the Hub, uploaded by this push or found there by :meth:`resume`: what the commit names."""
        self.resumed: set[str] = set()
        """Shards :meth:`resume` found on the Hub (neither written nor sent again)."""
        self.steps = False
        """Report each shard uploaded as a step of the monitor's segment (a finished folder's push)."""
        self._rules: _PublishRules | None = None
        self._record: _ResumeRecord | None = None
        self._names: dict[str, tuple[str, ...]] = {}
        self._queue: queue.Queue[tuple[str, str, Callable[[], None]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._busy = 0
        self._done = threading.Condition()
        self._stopped = False

    # --- before the first upload ---------------------------------------------------------------------------------

    def prepare(self, folder: str, recipe: Recipe | None = None) -> None:
        """What must hold before anything is sent: a merge of private or gated inputs goes to a public repo only
        when allowed (asked of the Hub now, with the pushing token), and the local paths no file may carry.
        ``recipe``: the merge's, while the folder holds none yet."""
        ensure_timeouts()
        self._rules = _PublishRules(folder, self.repo_id, recipe)
        self.restricted = self._check_private_inputs(folder, recipe)

    def begin(self) -> None:
        """Create the repo if needed (nothing is committed to it before :meth:`commit`), start the upload thread."""
        try:
            self.monitor.check("before the push")
            self.created = not self.api.repo_exists(self.repo_id)
            self.api.create_repo(self.repo_id, private=self.private, exist_ok=True)
        except MergeCancelled:
            raise
        except Exception as e:  # noqa: BLE001 - mapped to one clear line
            raise self._error_for(e) from e
        self._thread = threading.Thread(target=self._run, name="hubsoup-upload", daemon=True)
        self._thread.start()

    def resume(self, layout: Sequence[ShardLayout], key: str) -> set[str]:
        """The shards of ``layout`` an interrupted push of the same merge uploaded and the Hub still holds: they are
        neither written nor sent again, only named by the commit. ``key``: what makes the shards' bytes (the recipe
        hash, the device); the record is per repo, pull request or not, key and layout (every shard's header). A
        recorded shard counts only when the Hub's LFS batch API answers that it holds its object (by sha256)."""
        digest = hashlib.sha256()
        for shard in layout:
            digest.update(shard.file.encode() + b"\0" + shard.header)
        ident = json.dumps([constants.ENDPOINT, self.repo_id, self.create_pr, key, digest.hexdigest()])
        self._record = _ResumeRecord(os.path.join(resume_dir(), hashlib.sha256(ident.encode()).hexdigest() + ".json"))
        self._names = {shard.file: shard.names for shard in layout}
        by_file = {shard.file: shard for shard in layout}
        known = {f: e for f, e in self._record.shards.items()
                 if f in by_file and e.get("size") == by_file[f].size and tuple(e.get("tensors") or ()) == by_file[f].names}
        present = self._on_hub({e["sha256"]: e["size"] for e in known.values()}) if known else set()
        for f, e in known.items():
            if e["sha256"] in present:
                self.shards[f] = _uploaded(f, e["sha256"], e["size"], by_file[f].header[:512])
                self.resumed.add(f)
        if self.resumed:
            log.info("resuming the push to %s: %d shard(s) already on the Hub", self.repo_id, len(self.resumed))
        return set(self.resumed)

    def _on_hub(self, objects: dict[str, int]) -> set[str]:
        """Which of these LFS objects (sha256 → size) the repo holds: the batch API answers them without actions."""
        infos = [UploadInfo(size=n, sample=b"", sha256=bytes.fromhex(oid)) for oid, n in objects.items()]
        try:
            # huggingface_hub annotates its token str | None; it hands it to build_hf_headers, which takes False too
            actions, _, _ = post_lfs_batch_info(upload_infos=infos, token=self.token, repo_type="model",  # type: ignore[arg-type]
                                                repo_id=self.repo_id, revision=None if self.create_pr else "main",
                                                endpoint=self.api.endpoint)
        except Exception as e:  # noqa: BLE001 - resuming saves work; without an answer the shards are made again
            log.debug("cannot ask %s which shards it holds: %s", self.repo_id, type(e).__name__)
            return set()
        return {a["oid"] for a in actions if a.get("actions") is None}

    # --- the writer's hand-off ---------------------------------------------------------------------------------

    def shard_done(self, name: str, path: str, release: Callable[[], None]) -> None:
        with self._done:
            self._busy += 1
        self._queue.put((name, path, release))

    def failure(self) -> BaseException | None:
        if self._error is None and self.monitor.cancelled():  # a writer waiting for an upload stops at once
            return MergeCancelled("cancelled while the shards were uploading; nothing was committed")
        return self._error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            name, path, release = item
            try:
                if self._error is None and not self._stopped:
                    self._upload(name, path)
            except BaseException as e:  # noqa: BLE001 - the writer raises it at its next tensor, commit() too
                if self._error is None and not self._stopped:
                    # a shard that would publish a local path is refused; anything else failed
                    self._error = PushError(f"{self.what} refused: {e}") if isinstance(e, PushError) else \
                        self._error_for(e)
            finally:
                release()
                with self._done:
                    self._busy -= 1
                    self._done.notify_all()

    def _preupload(self, op: CommitOperationAdd) -> None:
        self.api.preupload_lfs_files(self.repo_id, additions=[op], create_pr=self.create_pr)

    def _upload(self, name: str, path: str) -> None:
        assert self._rules is not None, "prepare() first"
        self._rules.check(name, _safetensors_header(path))  # nothing local in what goes up, checked per shard
        size = os.path.getsize(path)
        with contextlib.ExitStack() as files:
            # an app's push shows no progress bar: a file object has none (huggingface_hub draws one for a path)
            src = files.enter_context(open(path, "rb")) if self.monitor.reporting else path
            op = CommitOperationAdd(path_in_repo=name, path_or_fileobj=src)
            if self.steps:  # a finished folder's push: its bytes are counted as they go up
                upload_steps(self.monitor, [op], self._preupload, segment=False)
            else:
                self._preupload(op)
            sha = op.upload_info.sha256.hex()
            if op._upload_mode != "lfs":  # a Hub that keeps it in git: its bytes go in the commit itself
                with open(path, "rb") as f:
                    op.path_or_fileobj = f.read()
        self.shards[name] = op
        if self._record is not None and op._upload_mode == "lfs" and not self._stopped:
            self._record.add(name, sha, size, self._names.get(name, ()))
        if not self.keeps_files:
            os.remove(path)

    # --- the commit ----------------------------------------------------------------------------------------

    def publish(self, folder: OutputFolder, *, keep_local: bool) -> Any:
        """The end of a merge streamed here, its output complete in ``folder`` (card rendered): stage ``push``, every
        shard uploaded, then the commit. ``keep_local``: the local output is committed first (a failed push then
        leaves it whole, and the error says how to retry with ``hubsoup push``); else ``folder`` is removed once the
        output is on the Hub. Returns the commit (``huggingface_hub.CommitInfo``)."""
        self.monitor.stage("push", f"pushing to {self.repo_id}")
        self.wait()  # every shard uploaded
        if not keep_local:
            info = self.commit(folder.path)
            folder.abort()  # nothing stays: the output is on the Hub
            return info
        folder.commit()
        self.what = f"push of '{folder.target}' to {self.repo_id}"
        self.after = ("The local output is intact; retry with: "
                      + retry_command(folder.target, self.repo_id, private=self.private, create_pr=self.create_pr,
                                      commit_message=self.commit_message))
        return self.commit(folder.target)

    def wait(self) -> None:
        """Until every shard handed in is uploaded; raises the first failure (and ``cancel``, checked meanwhile)."""
        with self._done:
            while self._busy and self._error is None:
                self.monitor.check("during the upload")
                # a cancel is a flag or a callable: looked at between the uploads' reports
                self._done.wait(0.2 if self.monitor.active else None)
        if self._error is not None:
            raise self._error

    def commit(self, folder: str, *, segment: bool = True) -> CommitInfo:
        """Wait for the shards, then commit them with the rest of ``folder`` (its public form) in one commit.

        Returns ``huggingface_hub.CommitInfo``; removes the resume record. ``segment``: the push's files are a
        new segment of the monitor's current stage."""
        self.wait()
        mon = self.monitor
        if self.restricted and self.card_writer is not None:
            self.card_writer(folder, self.repo_id, self.restricted)
        message = self.commit_message or default_commit_message(folder)
        try:
            plan = upload_plan(folder, self.repo_id, skip=set(self.shards))
        except PushError as e:
            raise PushError(f"{self.what} refused: {e}") from None
        try:
            with contextlib.ExitStack() as files, _no_xet_bars(mon.reporting):
                rest = []
                for name, content in plan:
                    src = (files.enter_context(open(content, "rb")) if isinstance(content, str) and mon.reporting
                           else content)
                    rest.append(CommitOperationAdd(path_in_repo=name, path_or_fileobj=src))
                upload_steps(mon, rest, self._preupload, segment=segment)
                mon.check("before the commit")
                expect_commit()  # identical content: huggingface_hub skips the commit (hubclient.commit_was_skipped)
                # one commit, whatever the number of files; identical content makes no new commit
                operations = sorted([*self.shards.values(), *rest], key=lambda op: op.path_in_repo)
                COMMITTING.append(self.repo_id)
                info = self.api.create_commit(repo_id=self.repo_id, operations=operations, commit_message=message,
                                              commit_description=self.commit_description, create_pr=self.create_pr)
                PUSHED.append(info.commit_url)
                mon.step(f"committed to {self.repo_id}")
        except MergeCancelled:
            raise
        except Exception as e:  # noqa: BLE001 - mapped to one clear line
            log.debug("%s failed: %s", self.what, type(e).__name__)
            raise self._error_for(e) from e
        if self._record is not None:
            self._record.remove()
        self._stop()
        return info

    def abort(self, cancelled: bool = False) -> None:
        """Stop uploading; nothing is committed. Never raises. ``cancelled``: the repo this push created is deleted
        again (and the resume record); otherwise both stay, so that running the same merge again resumes."""
        try:
            self._stop()
            if cancelled:
                if self._record is not None:
                    self._record.remove()
                if self.created:  # the repo this push created holds no commit of ours: leave nothing behind
                    try:
                        self.api.delete_repo(self.repo_id)
                    except Exception:  # noqa: BLE001 - the cancellation is what the caller must see
                        log.debug("could not delete %s after a cancelled push", self.repo_id)
        except BaseException:  # noqa: BLE001 - the caller is already failing; its error is the one to show
            pass

    def _stop(self) -> None:
        """The upload thread ends after the request in flight (not waited for: a cancel is prompt)."""
        self._stopped = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread = None

    # --- errors ------------------------------------------------------------------------------------------------

    def _error_for(self, e: BaseException) -> BaseException:
        if isinstance(e, (MergeCancelled, PushError)):
            return e
        what = push_failure(e, self.repo_id, self.token)
        err = PushError(f"{self.what} failed: {what}.{' ' + self.after if self.after else ''}")
        err.__cause__ = e
        return err

    def _check_private_inputs(self, folder: str, recipe: Recipe | None) -> list[dict[str, str]]:
        """Refuse (before anything is sent) a public push of a merge whose inputs are not public, unless allowed;
        returns them when allowed (the card must then say so)."""
        if self.private:
            return []
        after = f" {self.after}" if self.after else ""
        try:
            restricted = restricted_inputs(folder, self.token, recipe)
            public = bool(restricted) and _goes_public(self.api, self.repo_id, self.private)
        except PushError as e:
            raise PushError(f"{self.what} failed: {e}.{after}") from None
        except Exception as e:  # noqa: BLE001
            raise PushError(f"{self.what} failed: {push_failure(e, self.repo_id, self.token)}."
                            f"{after}") from e
        if not public:
            return []
        what = ", ".join(f"'{r['repo']}' ({r['why']})" for r in restricted)
        if not self.allow:
            raise PrivateInputsError(f"{self.what} refused: {self.repo_id} is public and the merge contains "
                                     f"{what}: its weights would be published. Push to a private repo (--private), or "
                                     "pass --allow-private-inputs (allow_private_inputs=True) to publish it anyway",
                                     self.repo_id, [(r["repo"], r["why"]) for r in restricted])
        return restricted


def _uploaded(name: str, sha256: str, size: int, sample: bytes) -> CommitOperationAdd:
    """A commit operation for an LFS object the repo already holds (found by :meth:`HubPush.resume`): no local file."""
    op = CommitOperationAdd(path_in_repo=name, path_or_fileobj=b"")
    op.upload_info = UploadInfo(size=size, sample=sample, sha256=bytes.fromhex(sha256))
    # what huggingface_hub's preupload_lfs_files marks on an operation whose object it sent: create_commit then names
    # the object (oid, size) without sending or reading anything
    op._upload_mode, op._should_ignore, op._is_uploaded = "lfs", False, True
    return op


class _ResumeRecord:
    """The shards a streamed push uploaded, written as each is uploaded and removed after its commit: a JSON file
    ``{"version": 1, "shards": {file: {"sha256", "size", "tensors"}}}`` in :func:`resume_dir` (no token, no path)."""

    def __init__(self, path: str):
        self.path = path
        self.shards: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            shards = data.get("shards") if isinstance(data, dict) and data.get("version") == 1 else None
            if isinstance(shards, dict):
                self.shards = {k: v for k, v in shards.items() if isinstance(v, dict) and isinstance(v.get("sha256"), str)
                               and re.fullmatch(r"[0-9a-f]{64}", v["sha256"]) and isinstance(v.get("size"), int)}
        except (OSError, ValueError):
            pass

    def add(self, file: str, sha256: str, size: int, tensors: Sequence[str]) -> None:
        with self._lock:
            self.shards[file] = {"sha256": sha256, "size": size, "tensors": list(tensors)}
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                tmp = f"{self.path}.{os.getpid()}.tmp"
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump({"version": 1, "shards": self.shards}, f)
                os.replace(tmp, self.path)
            except OSError as e:  # a record that cannot be written only costs a resume
                log.debug("cannot write the push's resume record: %s", e)

    def remove(self) -> None:
        with self._lock:
            try:
                os.remove(self.path)
            except OSError:
                pass


_BARS_MUTEX = threading.Lock()
_BARS_USERS = 0


@contextmanager
def _no_xet_bars(quiet: bool) -> Iterator[None]:
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


__all__ = ["push_folder", "HubPush", "PushTarget", "resume_dir", "retarget_card", "retry_command", "upload_plan"]
