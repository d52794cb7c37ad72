"""A local, standard-library-only server that speaks the Hugging Face Hub HTTP API.

The real clients (``huggingface_hub``'s ``HfApi`` / ``hf_hub_download`` / ``snapshot_download`` /
``ModelCard``, ``transformers``' ``from_pretrained`` and ``peft``'s ``PeftModel.from_pretrained``)
are pointed at it through ``HF_ENDPOINT`` (set by ``conftest.py``).  Everything lives in memory.

What it implements (models, datasets and spaces alike):

* ``POST /api/repos/create`` (409 + ``url`` when it exists), ``DELETE /api/repos/delete``,
  ``PUT /api/{type}s/{repo}/settings`` (visibility);
* ``POST .../preupload/{rev}`` (``lfs`` for ``*.safetensors`` and what else the repo's ``.gitattributes``
  names, for files of 10 MB or more and binary ones; ``regular`` otherwise; no Xet) and the NDJSON
  ``POST .../commit/{rev}`` (``file`` / ``lfsFile`` / ``deletedFile`` / ``deletedFolder``; ``?create_pr=1``
  opens ``refs/pr/N``);
* LFS (its own section below, :class:`_LfsStore`): the batch API ``POST /{repo}.git/info/lfs/objects/batch``
  (basic and multipart transfers, verify), objects stored by sha256 and kept across commits, counters of
  what was uploaded;
* ``GET .../{repo}`` and ``.../revision/{rev}`` (``sha``, ``siblings``, ``private``, ``cardData``),
  ``.../tree/{rev}[/path]``, ``POST .../paths-info/{rev}``, ``.../refs``, ``.../commits/{rev}``,
  ``POST/DELETE .../branch/{name}``, ``POST .../tag/{rev}`` / ``DELETE .../tag/{tag}``;
* ``HEAD`` / ``GET /[datasets/|spaces/]{repo}/resolve/{rev}/{path}`` by branch, tag, ``refs/pr/N``
  or (full or abbreviated) commit sha, with ``ETag`` (git blob sha1), ``X-Repo-Commit``,
  ``Content-Length`` and ``Range`` support;
* ``GET /api/whoami-v2``, ``POST /api/validate-yaml``, ``GET /api/agent-harnesses``;
* ``GET /api/models`` (and ``/api/datasets``, ``/api/spaces``): the listing of ``HfApi.list_models``,
  with ``author``, ``search`` (substring of the ID), ``filter`` (every value must be one of the
  repo's tags: the card's ``tags``, ``base_model:<id>``, ``base_model:<relation>:<id>``,
  ``license:<id>``, the library name), ``sort`` (``createdAt``, ``lastModified``; others keep
  creation order), ``limit`` and pagination; private repos only for their owners.

Errors carry ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``) and
``X-Error-Message`` the way the Hub sends them, so the client raises ``RepositoryNotFoundError``,
``RevisionNotFoundError`` and ``RemoteEntryNotFoundError``.  Private repos answer 401
(anonymous) or 404 (another user) with ``RepoNotFound``; writes need a write token whose user
owns the namespace (403 otherwise, 401 when anonymous).  Opening a PR (``create_pr=True``) only
needs a write token and read access, as on the Hub.

Every commit has a random 40-hex sha (``content_shas=True``: the sha of its repo, parents, tree and
title, so the same uploads give the same shas on every run: the benchmarks' seeded merges, whose
seeds come from the recipe and so from the inputs' shas, then repeat across runs); each branch keeps its history, so an old sha still serves
the old files.  A new repo starts with the Hub's "initial commit" by ``system`` holding a
``.gitattributes`` (pass ``gitattributes=False`` to get an empty tree instead).

``file_hashes=False`` (or ``server.file_hashes = False`` in a test; ``reset()`` restores the
constructor's value) is a Hub that reports no file hashes: pre-upload answers carry no ``oid`` and
repo info no ``blobId``, so ``huggingface_hub`` cannot skip an unchanged file and commits it again.

Failure injection: ``server.fail_next(n, status=500, method="POST", path=r"/commit/")`` answers
the next ``n`` matching requests with an error (``when="after"`` runs the request first and then
loses its answer; ``drop=True`` closes the connection without an answer; ``hang=SECONDS`` stops
answering: the request is held that long, at most ``MAX_HANG`` seconds and never past a
``reset()`` / ``stop()``, and the connection is then closed without an answer).
``server.fail_commits(n)`` is the shorthand for the commit endpoint.

Pytest fixtures (register with ``pytest_plugins = [..., "hub_server"]`` in ``conftest.py``):

* ``hub_server`` (session): the running :class:`HubServer` on the port of ``HF_ENDPOINT``;
* ``hub`` (function): the same server, emptied, with offline mode switched off for the test.
"""

from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import json
import os
import re
import sys
import threading
import traceback
import uuid
import warnings
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

import pytest

# --------------------------------------------------------------------------------------------
# Users and tokens
# --------------------------------------------------------------------------------------------

ALICE_WRITE_TOKEN = "hf_write_alice"
ALICE_READ_TOKEN = "hf_read_alice"
BOB_WRITE_TOKEN = "hf_write_bob"
BOB_READ_TOKEN = "hf_read_bob"

#: token -> (user, may write)
DEFAULT_TOKENS: dict[str, tuple[str, bool]] = {
    ALICE_WRITE_TOKEN: ("alice", True),
    ALICE_READ_TOKEN: ("alice", False),
    BOB_WRITE_TOKEN: ("bob", True),
    BOB_READ_TOKEN: ("bob", False),
}
#: organisation -> members (members may write to the organisation's namespace)
DEFAULT_ORGS: dict[str, set[str]] = {"soup-org": {"alice"}}

REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}

GITATTRIBUTES = b"""*.7z filter=lfs diff=lfs merge=lfs -text
*.bin filter=lfs diff=lfs merge=lfs -text
*.ckpt filter=lfs diff=lfs merge=lfs -text
*.gguf filter=lfs diff=lfs merge=lfs -text
*.h5 filter=lfs diff=lfs merge=lfs -text
*.msgpack filter=lfs diff=lfs merge=lfs -text
*.onnx filter=lfs diff=lfs merge=lfs -text
*.pt filter=lfs diff=lfs merge=lfs -text
*.pth filter=lfs diff=lfs merge=lfs -text
*.safetensors filter=lfs diff=lfs merge=lfs -text
*.zip filter=lfs diff=lfs merge=lfs -text
"""

MAX_HANG = 30.0
"""The longest a ``hang`` failure holds a request (seconds)."""

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")
_SHORT_SHA_RE = re.compile(r"^[0-9a-f]{7,39}$")
_PR_RE = re.compile(r"^refs/pr/(\d+)$")


def git_blob_oid(data: bytes) -> str:
    """Git blob sha1, the oid the Hub reports (and ``huggingface_hub.utils.sha.git_hash`` computes)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _iso(ts: float) -> str:
    d = _dt.datetime.fromtimestamp(ts, _dt.timezone.utc)
    return d.strftime("%Y-%m-%dT%H:%M:%S.") + f"{d.microsecond // 1000:03d}Z"


def _now() -> float:
    return _dt.datetime.now(_dt.timezone.utc).timestamp()


def _truthy(values: list[str] | None) -> bool:
    return bool(values) and values[-1].lower() in ("1", "true", "yes", "on")


# --------------------------------------------------------------------------------------------
# Storage
# --------------------------------------------------------------------------------------------


@dataclass
class Commit:
    oid: str
    parents: list[str]
    tree: dict[str, str]  # path -> blob oid
    title: str
    message: str
    author: str
    date: float


@dataclass
class Repo:
    type: str
    id: str
    private: bool
    created_at: float
    uid: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    prs: dict[int, str] = field(default_factory=dict)
    pr_info: dict[int, dict] = field(default_factory=dict)
    next_discussion: int = 1
    gated: Any = False

    @property
    def namespace(self) -> str:
        return self.id.split("/")[0]


class HubError(Exception):
    """An error answer: status, message, optional ``X-Error-Code`` and extra headers."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None,
                 body: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = dict(headers or {})
        self.body = body

    def response(self) -> tuple[int, dict, bytes]:
        headers = {"X-Error-Message": self.message, **self.headers}
        if self.code:
            headers["X-Error-Code"] = self.code
        body = {"error": self.message, **(self.body or {})}
        return _json_response(body, self.status, headers)


def _json_response(obj: Any, status: int = 200, headers: dict | None = None) -> tuple[int, dict, bytes]:
    data = json.dumps(obj).encode()
    return status, {"Content-Type": "application/json; charset=utf-8", **(headers or {})}, data


@dataclass
class _Failure:
    remaining: int
    status: int
    method: str | None
    path: re.Pattern | None
    message: str
    code: str | None
    when: str
    drop: bool
    headers: dict
    hang: float | None = None

    def matches(self, method: str, path: str, when: str) -> bool:
        return (
            self.remaining > 0
            and self.when == when
            and (self.method is None or self.method == method)
            and (self.path is None or self.path.search(path) is not None)
        )


@dataclass
class _Req:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: Any
    body: bytes
    user: str | None
    can_write: bool

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"{}")
        except ValueError:
            raise HubError(400, "Invalid JSON body") from None


# --------------------------------------------------------------------------------------------
# LFS: large files as the Hub stores them (pre-upload modes, the batch API, uploads, objects)
# --------------------------------------------------------------------------------------------

LFS_SIZE_THRESHOLD = 10 * 1024 * 1024
"""A file this large is always LFS (the Hub's rule for files over 10 MB), whatever ``.gitattributes`` says."""

_LFS_OID_RE = re.compile(r"^[0-9a-f]{64}$")


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The git-lfs pointer file of an object: what the repo's git tree holds in the object's place."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _lfs_patterns(gitattributes: bytes | None) -> list[str]:
    """The patterns a ``.gitattributes`` puts under ``filter=lfs``."""
    out = []
    for line in (gitattributes or b"").decode("utf-8", "replace").splitlines():
        parts = line.split()
        if len(parts) >= 2 and not parts[0].startswith("#") and "filter=lfs" in parts[1:]:
            out.append(parts[0])
    return out


def _matches(pattern: str, path: str) -> bool:
    import fnmatch

    if "/" in pattern.strip("/"):  # git: a pattern with a slash matches the whole path
        return fnmatch.fnmatchcase(path, pattern.lstrip("/"))
    return fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pattern)


@dataclass
class _LfsTicket:
    """An upload the batch API handed out: its URLs carry the ticket (as the Hub's pre-signed URLs do)."""

    repo: tuple[str, str]
    oid: str
    size: int
    parts: dict[int, bytes] = field(default_factory=dict)


class _LfsStore:
    """The Hub's LFS side, as :class:`HubServer` uses it (this section is the whole of it):

    * ``POST .../preupload/{rev}`` answers ``"uploadMode": "lfs"`` for a path the repo's ``.gitattributes``
      (at that revision) puts under ``filter=lfs`` (``*.safetensors`` in a new repo), a file of
      :data:`LFS_SIZE_THRESHOLD` bytes or more, or a binary one (a NUL byte in its 512-byte sample): as the
      Hub decides. Its ``oid`` for an existing LFS file is the object's sha256 (what huggingface_hub compares).
    * ``POST /{repo}.git/info/lfs/objects/batch`` (the LFS batch API, basic transfer): an object this repo
      already holds is answered without ``actions`` (huggingface_hub then uploads nothing); another gets an
      ``upload`` action (a ``PUT`` to this server, the ticket in its URL: no token needed, as S3's pre-signed
      URLs) and a ``verify`` action. With :attr:`lfs_multipart_chunk` set, objects larger than it get the
      Hub's multipart transfer (``chunk_size`` and one URL per part in the action's header, completed by a
      ``POST`` of the parts' ETags). Uploaded bytes are checked against the oid and size (400 otherwise).
    * Objects are stored by sha256 and kept across commits (and across a failed or cancelled run), per repo:
      a rerun's batch request finds them. A commit's ``lfsFile`` entry (oid, size) must name an object of
      the repo, or the commit is refused (422, as the Hub refuses a pointer to an object it lacks); the
      tree then holds the object's pointer file.
    * ``resolve`` serves an LFS file's content with ``X-Linked-Etag`` (its sha256) and ``X-Linked-Size``
      as the Hub does; repo info with ``blobs=True`` lists ``lfs: {sha256, size, pointerSize}`` and
      ``paths-info`` / ``tree`` entries ``lfs: {oid, size, pointerSize}`` (``blobId`` / ``oid``: the
      pointer's git sha1).
    * Counters for tests: :attr:`lfs_uploads` (one ``{repo, oid, size}`` per object stored by an upload),
      :attr:`lfs_uploaded_bytes`, :attr:`lfs_uploaded_objects`.
    """

    lfs_multipart_chunk: int | None = None
    """Objects larger than this many bytes are uploaded with the multipart transfer (None: never)."""

    def _lfs_reset(self) -> None:
        self.lfs_objects: dict[str, bytes] = {}  # sha256 -> content
        self.lfs_pointers: dict[str, str] = {}  # git oid of a pointer file -> sha256 of its object
        self.lfs_uploads: list[dict] = []
        self._lfs_tickets: dict[str, _LfsTicket] = {}
        self._lfs_repos: dict[tuple[str, str], set[str]] = {}  # (type, id) -> the objects it holds
        self._lfs_misreported: dict[str, str] = {}  # sha256 of an object -> the sha256 the Hub says it has
        self.lfs_multipart_chunk = None

    @property
    def lfs_uploaded_bytes(self) -> int:
        with self._lock:
            return sum(u["size"] for u in self.lfs_uploads)

    @property
    def lfs_uploaded_objects(self) -> int:
        with self._lock:
            return len(self.lfs_uploads)

    def misreport_sha256(self, repo_id: str, path: str, sha256: str = "0" * 64) -> None:
        """From now on the Hub reports ``sha256`` for ``path``'s LFS object (repo info, paths-info, tree,
        ``X-Linked-Etag``) while it serves the same bytes: a client that checks what it read must notice."""
        with self._lock:
            repo = self.repos[("model", repo_id)]
            oid = repo.commits[repo.branches["main"]].tree[path]
            self._lfs_misreported[self.lfs_pointers[oid]] = sha256

    def lfs_held(self, repo_id: str, repo_type: str = "model") -> set[str]:
        """The sha256 of every object ``repo_id`` holds (uploaded or committed), committed or not."""
        with self._lock:
            return set(self._lfs_repos.get((repo_type, repo_id), set()))

    # ---- storage --------------------------------------------------------------------------

    def _content(self, oid: str) -> bytes:
        """A tree entry's content: an LFS pointer's object, or the git blob itself."""
        sha = self.lfs_pointers.get(oid)
        return self.lfs_objects[sha] if sha is not None else self.blobs[oid]

    def _lfs_info(self, oid: str) -> dict | None:
        """``{oid, size, pointerSize}`` of a tree entry that is an LFS pointer, else None."""
        sha = self.lfs_pointers.get(oid)
        if sha is None:
            return None
        return {"oid": self._lfs_misreported.get(sha, sha), "size": len(self.lfs_objects[sha]),
                "pointerSize": len(self.blobs[oid])}

    def _lfs_headers(self, oid: str) -> dict[str, str]:
        """``resolve``'s headers for an LFS file (none for a regular one)."""
        info = self._lfs_info(oid)
        if info is None:
            return {}
        return {"ETag": f'"{info["oid"]}"', "X-Linked-Etag": f'"{info["oid"]}"', "X-Linked-Size": str(info["size"])}

    def _lfs_tree_entry(self, repo_key: tuple[str, str], sha: str) -> str:
        """Put object ``sha`` (stored) in a tree: its pointer file's git oid."""
        data = self.lfs_objects[sha]
        pointer = lfs_pointer(sha, len(data))
        oid = git_blob_oid(pointer)
        self.blobs[oid] = pointer
        self.lfs_pointers[oid] = sha
        self._lfs_repos.setdefault(repo_key, set()).add(sha)
        return oid

    def _lfs_store(self, repo_key: tuple[str, str], data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        self.lfs_objects[sha] = data
        self._lfs_repos.setdefault(repo_key, set()).add(sha)
        return sha

    def _is_lfs(self, tree: dict[str, str], path: str, size: int, sample: bytes) -> bool:
        """The Hub's choice for a file: LFS by ``.gitattributes``, by size, or because it is binary."""
        if size == 0:
            return False
        if size >= LFS_SIZE_THRESHOLD or b"\0" in sample[:512]:
            return True
        attrs = tree.get(".gitattributes")
        return any(_matches(p, path) for p in _lfs_patterns(self._content(attrs) if attrs else None))

    def _stored_oid(self, repo: "Repo", tree: dict[str, str], path: str, data: bytes) -> str:
        """Store ``data`` for ``path`` in ``repo`` (an LFS object if the Hub would make it one): its tree oid."""
        if self._is_lfs(tree, path, len(data), data[:512]):
            return self._lfs_tree_entry((repo.type, repo.id), self._lfs_store((repo.type, repo.id), data))
        oid = git_blob_oid(data)
        self.blobs[oid] = data
        return oid

    def _remote_oid(self, tree: dict[str, str], path: str) -> str | None:
        """Pre-upload's ``oid`` of an existing file: an LFS object's sha256, a regular file's git oid."""
        oid = tree.get(path)
        if oid is None:
            return None
        return self.lfs_pointers.get(oid, oid)

    def _commit_lfs_file(self, repo: "Repo", value: dict) -> str:
        """A commit's ``lfsFile`` line: the tree oid of the object it names, which the repo must hold."""
        sha, size = str(value.get("oid") or "").lower(), value.get("size")
        if value.get("algo", "sha256") != "sha256" or not _LFS_OID_RE.match(sha):
            raise HubError(400, f"Invalid LFS oid: {short_text(sha)}")
        held = self._lfs_repos.get((repo.type, repo.id), set())
        if sha not in held or sha not in self.lfs_objects:
            raise HubError(422, f"Your push was rejected because an LFS pointer pointed to a file that does not "
                                f"exist: {sha}")
        if size is not None and size != len(self.lfs_objects[sha]):
            raise HubError(422, f"LFS object {sha} has size {len(self.lfs_objects[sha])}, not {size}")
        return self._lfs_tree_entry((repo.type, repo.id), sha)

    # ---- the batch API and the transfers ----------------------------------------------------

    def _lfs_route(self, req: _Req, segs: list[str]):
        """``POST /[type/]{ns}/{name}.git/info/lfs/objects/batch``; None when ``segs`` is something else."""
        rtype = "model"
        if segs and segs[0] in REPO_TYPES and segs[0] != "models" and len(segs) > 1:
            rtype, segs = REPO_TYPES[segs[0]], segs[1:]
        if len(segs) == 6 and segs[1].endswith(".git") and segs[2:] == ["info", "lfs", "objects", "batch"]:
            if req.method != "POST":
                return self._no_route(req)
            return self._lfs_batch(req, rtype, f"{segs[0]}/{segs[1][:-4]}")
        return None

    def _lfs_batch(self, req: _Req, rtype: str, repo_id: str):
        repo = self._readable(req, rtype, repo_id)
        body = req.json()
        if body.get("operation") != "upload":
            raise HubError(400, "The test hub's LFS batch API only uploads")
        # huggingface_hub names the branch (`ref`) except for a pull request: then a write token that can
        # read the repo is enough, as for a commit that opens one
        self._check_commit_access(req, repo, create_pr=not body.get("ref"))
        transfers = body.get("transfers") or ["basic"]
        multipart = self.lfs_multipart_chunk is not None and "multipart" in transfers
        objects, chosen = [], "basic"
        for obj in body.get("objects") or []:
            oid, size = str(obj.get("oid") or "").lower(), obj.get("size")
            if not _LFS_OID_RE.match(oid) or not isinstance(size, int) or size < 0:
                objects.append({"oid": str(oid), "size": size if isinstance(size, int) else 0,
                                "error": {"code": 422, "message": "Invalid oid or size"}})
                continue
            have = self.lfs_objects.get(oid)
            if have is not None and oid in self._lfs_repos.get((repo.type, repo.id), set()) and len(have) == size:
                objects.append({"oid": oid, "size": size})  # already there: no actions, nothing to upload
                continue
            ticket = uuid.uuid4().hex
            self._lfs_tickets[ticket] = _LfsTicket((repo.type, repo.id), oid, size)
            base = f"{self.endpoint}/_test-lfs"
            if multipart and size > self.lfs_multipart_chunk:
                chunk = self.lfs_multipart_chunk
                n = -(-size // chunk)
                header = {"chunk_size": str(chunk), **{f"{i + 1:05d}": f"{base}/part/{ticket}/{i + 1}" for i in range(n)}}
                upload = {"href": f"{base}/complete/{ticket}", "header": header}
                chosen = "multipart"
            else:
                upload = {"href": f"{base}/upload/{ticket}"}
            objects.append({"oid": oid, "size": size, "authenticated": True,
                            "actions": {"upload": upload, "verify": {"href": f"{base}/verify/{ticket}"}}})
        return _json_response({"transfer": chosen, "objects": objects, "hash_algo": "sha256"},
                              headers={"Content-Type": "application/vnd.git-lfs+json"})

    def _lfs_transfer(self, req: _Req, segs: list[str]):
        """``PUT /_test-lfs/upload/{ticket}``, ``PUT .../part/{ticket}/{n}``, ``POST .../complete/{ticket}``,
        ``POST .../verify/{ticket}``: the URLs the batch API handed out."""
        if len(segs) < 2 or segs[1] not in self._lfs_tickets:
            raise HubError(403, "Unknown or expired upload URL")
        kind, ticket = segs[0], self._lfs_tickets[segs[1]]
        if kind == "upload" and req.method == "PUT" and len(segs) == 2:
            return self._lfs_receive(ticket, req.body)
        if kind == "part" and req.method == "PUT" and len(segs) == 3 and segs[2].isdigit():
            ticket.parts[int(segs[2])] = req.body
            return 200, {"ETag": f'"{hashlib.md5(req.body).hexdigest()}"'}, b""
        if kind == "complete" and req.method == "POST" and len(segs) == 2:
            body = req.json()
            parts = body.get("parts") or []
            if body.get("oid") != ticket.oid or [p.get("partNumber") for p in parts] != sorted(ticket.parts):
                raise HubError(400, "Multipart completion does not match the uploaded parts")
            for p in parts:
                want = f'"{hashlib.md5(ticket.parts[p["partNumber"]]).hexdigest()}"'
                if p.get("etag") != want:
                    raise HubError(400, f"Part {p['partNumber']}: wrong ETag")
            return self._lfs_receive(ticket, b"".join(ticket.parts[n] for n in sorted(ticket.parts)))
        if kind == "verify" and req.method == "POST" and len(segs) == 2:
            if req.user is None:
                raise HubError(401, "Invalid username or password.")
            if ticket.oid not in self._lfs_repos.get(ticket.repo, set()):
                raise HubError(404, f"LFS object {ticket.oid} not found")
            return _json_response({"success": True})
        return self._no_route(req)

    def _lfs_receive(self, ticket: _LfsTicket, data: bytes):
        if len(data) != ticket.size or hashlib.sha256(data).hexdigest() != ticket.oid:
            raise HubError(400, f"The uploaded content does not match the LFS object {ticket.oid} "
                                f"({len(data)} bytes, {ticket.size} announced)")
        self._lfs_store(ticket.repo, data)
        self.lfs_uploads.append({"repo": ticket.repo[1], "oid": ticket.oid, "size": ticket.size})
        return 200, {}, b""


def short_text(value: str) -> str:
    return value if len(value) <= 80 else value[:77] + "..."

# Ranged GETs (issue 45, the input side): a bandwidth limit, faults mid-body, bytes served, LFS sha256
# --------------------------------------------------------------------------------------------


@dataclass
class _BodyFault:
    remaining: int
    path: re.Pattern | None
    after: int
    drop: bool
    hang: float | None
    ranged: bool


class _RangedGets:
    """What :class:`HubServer` does for the bodies of file downloads (``GET .../resolve/...``), for the tests and
    the benchmark of Hub inputs read in place:

    * ``limit_bandwidth(rate)``: bodies are sent at most ``rate`` bytes/s, all connections together (a link;
      ``per_connection=True``: each connection on its own), in chunks of :attr:`BODY_CHUNK`; ``None`` lifts it.
      The LFS upload endpoints (``PUT /_test-lfs/upload/...`` and ``.../part/...``, the URLs the batch API hands
      out) receive their bodies at the same rate, on the link's other direction (a link is full duplex: an upload
      and a download go on at once, each at ``rate``); ``received`` counts the upload bytes taken in;
    * ``fail_body(n, path=..., after=N, drop=True | hang=SECONDS, ranged=True)``: the next ``n`` matching bodies
      stop after ``N`` bytes, the connection closed (``drop``) or held then closed (``hang``; ``reset()``/``stop()``
      end it early); ``ranged``: only requests with a ``Range`` that does not start at byte 0 (a tensor's bytes,
      not a header read);
    * ``served``: ``(path, first byte, bytes sent)`` of every file body, ``served_bytes(path)`` their sum,
      ``wait_served(n)`` waits (on a condition, not a sleep) until that many bytes were sent;
    * LFS fields (the sha256 a file read whole is verified against) come from the LFS section above: every
      ``*.safetensors`` file is an LFS object there, reported as the Hub reports one.
    """

    BODY_CHUNK = 16 << 10

    def _reset_ranged(self) -> None:
        self.bandwidth: float | None = None
        self._per_connection = False
        self._link_free = 0.0  # when the shared link is next free (time.monotonic)
        self._up_free = 0.0  # when its upload direction is next free
        self.received = 0
        self._body_faults: list[_BodyFault] = []
        self.served: list[tuple[str, int, int]] = []
        self._served_total = 0
        self._served_cond = threading.Condition()
        self._ranged_failures: list[_Failure] = []

    def limit_bandwidth(self, rate: float | None, *, per_connection: bool = False) -> None:
        """Send file bodies at most ``rate`` bytes/s (``None``: as fast as possible)."""
        if rate is not None and rate <= 0:
            raise ValueError("rate must be positive (or None)")
        self.bandwidth, self._per_connection, self._link_free, self._up_free = rate, per_connection, 0.0, 0.0

    def fail_body(self, n: int = 1, *, path: str | None = None, after: int = 0, drop: bool = True,
                  hang: float | None = None, ranged: bool = True) -> None:
        """Stop the next ``n`` file bodies matching ``path`` (a regex searched in the request path) after ``after``
        bytes: the connection closed (``drop``) or held ``hang`` seconds first (at most ``MAX_HANG``)."""
        if hang is not None and not (0 < hang <= MAX_HANG):
            raise ValueError(f"hang must be in (0, {MAX_HANG}] seconds")
        with self._lock:
            self._body_faults.append(_BodyFault(n, re.compile(path) if path else None, after, drop, hang, ranged))

    def fail_ranged(self, n: int = 1, status: int = 503, *, path: str | None = None, drop: bool = False,
                    hang: float | None = None) -> None:
        """Answer the next ``n`` GETs of a file with a ``Range`` that does not start at byte 0 (a tensor's bytes,
        never a header read) and whose path matches ``path`` with ``status`` (or drop / hang, as ``fail_next``)."""
        with self._lock:
            self._ranged_failures.append(_Failure(n, status, "GET", re.compile(path) if path else None,
                                                  f"Injected failure ({status})", None, "before", drop, {}, hang))

    def redirect_ranged(self, to: str, *, n: int = 1000, path: str | None = None) -> None:
        """Answer the next ``n`` ranged GETs of a tensor's bytes (as :meth:`fail_ranged` picks them) with a
        ``302`` to the same path on ``to`` (another server: a CDN, a Xet bridge), as the Hub redirects downloads."""
        with self._lock:
            self._ranged_failures.append(_Failure(n, 302, "GET", re.compile(path) if path else None, "Found", None,
                                                  "before", False, {"X-Redirect-To": to}, None))

    def _take_ranged_failure(self, req: "_Req") -> "_Failure | None":
        rng = req.headers.get("Range") or ""
        if req.method != "GET" or "/resolve/" not in req.path or not rng or re.match(r"\s*bytes=0-", rng):
            return None
        with self._lock:
            for f in self._ranged_failures:
                if f.matches("GET", req.path, "before"):
                    f.remaining -= 1
                    to = f.headers.get("X-Redirect-To")
                    if to:  # this request's own Location
                        return _Failure(1, f.status, "GET", None, f.message, None, "before", False,
                                        {"Location": to + req.path})
                    return f
        return None

    def served_bytes(self, path: str | None = None) -> int:
        """Bytes of file bodies sent so far whose request path matches ``path`` (a regex; all when None)."""
        rx = re.compile(path) if path else None
        with self._served_cond:
            return sum(n for p, _, n in self.served if rx is None or rx.search(p))

    def wait_served(self, n: int, timeout: float = 60.0) -> bool:
        """Wait until at least ``n`` bytes of file bodies were sent (True) or ``timeout`` passed (False)."""
        with self._served_cond:
            return self._served_cond.wait_for(lambda: self._served_total >= n, timeout)

    def _take_body_fault(self, req: "_Req") -> _BodyFault | None:
        rng = req.headers.get("Range") or ""
        with self._lock:
            for f in self._body_faults:
                if f.remaining <= 0 or (f.path is not None and not f.path.search(req.path)):
                    continue
                if f.ranged and (not rng or re.match(r"\s*bytes=0-", rng)):
                    continue
                f.remaining -= 1
                return f
        return None

    def _pace(self, n: int, conn: dict) -> None:
        """Wait until ``n`` more bytes may go out (a slot on the shared link, or on this connection)."""
        rate = self.bandwidth
        if not rate:
            return
        import time

        now = time.monotonic()
        with self._lock if not self._per_connection else threading.Lock():
            if self._per_connection:
                start = max(now, conn.get("free", 0.0))
                conn["free"] = start + n / rate
                until = conn["free"]
            else:
                start = max(now, self._link_free)
                self._link_free = start + n / rate
                until = self._link_free
        if until > now:
            self._wake.wait(until - now)

    def _pace_up(self, n: int, conn: dict) -> None:
        """Wait until ``n`` more upload bytes may come in (the upload direction of the link, or this connection)."""
        rate = self.bandwidth
        if rate:
            import time

            now = time.monotonic()
            with self._lock:
                if self._per_connection:
                    conn["free"] = until = max(now, conn.get("free", 0.0)) + n / rate
                else:
                    self._up_free = until = max(now, self._up_free) + n / rate
                self.received += n
            if until > now:
                self._wake.wait(until - now)
        else:
            with self._lock:
                self.received += n

    def _paced_upload(self, method: str, path: str) -> bool:
        """Whether a request's body is an LFS upload, received at the link's rate."""
        return method == "PUT" and path.startswith("/_test-lfs/")

    def _write_body(self, handler: "BaseHTTPRequestHandler", req: "_Req", status: int, data: bytes) -> None:
        """Send a response body: file bodies paced, counted and maybe cut (see the class doc); others at once."""
        if "/resolve/" not in req.path or status >= 400:
            handler.wfile.write(data)
            return
        fault = self._take_body_fault(req)
        m = re.match(r"\s*bytes=(\d+)-", req.headers.get("Range") or "")
        first = int(m.group(1)) if m and status == 206 else 0
        limit = len(data) if fault is None else min(fault.after, len(data))
        conn: dict = {}
        sent = 0
        try:
            while sent < limit:
                chunk = data[sent:min(limit, sent + self.BODY_CHUNK)]
                self._pace(len(chunk), conn)
                handler.wfile.write(chunk)
                sent += len(chunk)
        except OSError:  # the client went away (a cancelled run)
            fault = fault or _BodyFault(0, None, 0, True, None, False)
        finally:
            with self._served_cond:
                self.served.append((req.path, first, sent))
                self._served_total += sent
                self._served_cond.notify_all()
        if fault is not None:
            handler.wfile.flush()
            if fault.hang:
                self._wake.wait(min(fault.hang, MAX_HANG))
            handler.close_connection = True
            try:
                import socket

                handler.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------


class HubServer(_LfsStore, _RangedGets):
    """In-memory Hub.  ``HubServer(port).start()``; ``stop()``; ``reset()`` empties it."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1",
                 tokens: dict[str, str | tuple[str, bool]] | None = None,
                 orgs: dict[str, Iterable[str]] | None = None, gitattributes: bool = True,
                 page_size: int = 1000, content_shas: bool = False, file_hashes: bool = True):
        self.content_shas = content_shas
        self._file_hashes = file_hashes
        self.host = host
        self.port = port
        self.tokens: dict[str, tuple[str, bool]] = {}
        for tok, who in (DEFAULT_TOKENS if tokens is None else tokens).items():
            self.tokens[tok] = (who, True) if isinstance(who, str) else (who[0], bool(who[1]))
        self.orgs = {k: set(v) for k, v in (DEFAULT_ORGS if orgs is None else orgs).items()}
        self.gitattributes = gitattributes
        self.page_size = page_size
        self._lock = threading.RLock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._monkeypatch = None  # set by the ``hub`` fixture (for ``login``)
        self._wake = threading.Event()  # set to end every hanging request at once
        self.reset()

    # ---- life cycle ----------------------------------------------------------------------

    def start(self) -> "HubServer":
        httpd = _HTTPServer((self.host, self.port), _Handler)
        httpd.hub = self
        self.port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"hub-server-{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._release_hangs()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> "HubServer":
        return self.start() if self._httpd is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    url = endpoint

    def reset(self) -> None:
        """Forget every repo, blob, injected failure and logged request (and end hanging requests)."""
        self._release_hangs()
        with self._lock:
            self.repos: dict[tuple[str, str], Repo] = {}
            self.blobs: dict[str, bytes] = {}
            self._lfs_reset()
            self._failures: list[_Failure] = []
            self._delays: list[list] = []  # [remaining, method, path regex, seconds]: see delay_next
            #: every request: dicts with method, path, query, status, user
            self.requests: list[dict] = []
            #: requests that matched no route (answered 404 without X-Error-Code)
            self.unhandled: list[str] = []
            #: False: a Hub that reports no file hashes (no ``oid`` in pre-upload answers, no ``blobId``
            #: in repo info), so a client cannot tell an unchanged file from a changed one by hash
            self.file_hashes = self._file_hashes
            self._reset_ranged()  # bandwidth, body faults, bytes served (the section below)

    def _release_hangs(self) -> None:
        wake = getattr(self, "_wake", None)
        if wake is not None:
            wake.set()
        self._wake = threading.Event()

    # ---- tokens --------------------------------------------------------------------------

    def token(self, user: str, write: bool = True) -> str:
        """A token of ``user`` (a write token unless ``write=False``)."""
        for tok, (who, can_write) in self.tokens.items():
            if who == user and can_write == write:
                return tok
        raise KeyError(f"no {'write' if write else 'read'} token for {user!r}")

    def api(self, user: str | None = None, write: bool = True):
        """An ``HfApi`` on this server, authenticated as ``user`` (anonymous if ``None``)."""
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.endpoint, token=self.token(user, write) if user else False)

    def login(self, user: str | None, write: bool = True) -> str | None:
        """Set ``HF_TOKEN`` (implicit token of every client) to ``user``'s token; ``None`` logs out.

        Inside the ``hub`` fixture the change is undone after the test.
        """
        tok = self.token(user, write) if user else None
        mp = self._monkeypatch
        if tok is None:
            if mp is not None:
                mp.delenv("HF_TOKEN", raising=False)
            else:
                os.environ.pop("HF_TOKEN", None)
        elif mp is not None:
            mp.setenv("HF_TOKEN", tok)
        else:
            os.environ["HF_TOKEN"] = tok
        return tok

    # ---- failure injection ---------------------------------------------------------------

    def fail_next(self, n: int = 1, status: int = 500, *, method: str | None = None,
                  path: str | None = None, message: str | None = None, code: str | None = None,
                  when: str = "before", drop: bool = False, headers: dict | None = None,
                  hang: float | None = None) -> None:
        """Answer the next ``n`` requests matching ``method`` / ``path`` with an error.

        ``path`` is a regex searched in the raw request path (no query string), e.g. ``r"/commit/"``,
        ``r"/preupload/"``, ``r"/resolve/"``.  ``when="after"`` runs the request (the commit lands)
        and then replaces its answer by the error, as if the answer had been lost.  ``drop=True``
        closes the connection without any answer (the client sees a ``RemoteProtocolError``).
        ``hang=SECONDS``: a server that stops answering — the request is held (at most ``MAX_HANG``
        seconds, ended early by ``reset()``/``stop()``), then the connection is closed unanswered.
        Rules are consumed in the order they were added.
        """
        if when not in ("before", "after"):
            raise ValueError("when must be 'before' or 'after'")
        if hang is not None and not (0 < hang <= MAX_HANG):
            raise ValueError(f"hang must be in (0, {MAX_HANG}] seconds")
        with self._lock:
            self._failures.append(_Failure(
                remaining=n, status=status, method=method.upper() if method else None,
                path=re.compile(path) if path else None,
                message=message or f"Injected failure ({status})", code=code, when=when, drop=drop,
                headers=dict(headers or {}), hang=hang,
            ))

    def delay_next(self, n: int, seconds: float, *, method: str | None = None, path: str | None = None) -> None:
        """Hold the next ``n`` requests matching ``method`` / ``path`` (a regex searched in the path) for
        ``seconds`` (at most ``MAX_HANG``; ``reset()``/``stop()`` end it early), then answer them normally: a slow
        Hub, for tests that must act while a client waits on it (e.g. cancel a run in its download)."""
        if not (0 < seconds <= MAX_HANG):
            raise ValueError(f"seconds must be in (0, {MAX_HANG}]")
        with self._lock:
            self._delays.append([n, method.upper() if method else None, re.compile(path) if path else None, seconds])

    def release_delays(self) -> None:
        """Answer now the requests that :meth:`delay_next` holds (a test that has seen what it waited for)."""
        self._release_hangs()

    def _take_delay(self, method: str, path: str) -> float:
        with self._lock:
            for d in self._delays:
                if d[0] > 0 and (d[1] is None or d[1] == method) and (d[2] is None or d[2].search(path)):
                    d[0] -= 1
                    return d[3]
        return 0.0

    def fail_commits(self, n: int = 1, status: int = 500, **kw) -> None:
        """Shorthand: fail the next ``n`` ``POST .../commit/...`` requests."""
        self.fail_next(n, status, method="POST", path=r"^/api/[a-z]+/[^/]+/[^/]+/commit/", **kw)

    def clear_failures(self) -> None:
        """Drop every injected failure not yet taken: ``fail_next``'s, ``fail_ranged``'s and ``fail_body``'s."""
        with self._lock:
            self._failures.clear()
            self._ranged_failures.clear()
            self._body_faults.clear()

    @property
    def pending_failures(self) -> int:
        with self._lock:
            return sum(f.remaining for f in self._failures)

    def _take_failure(self, method: str, path: str, when: str) -> _Failure | None:
        with self._lock:
            for f in self._failures:
                if f.matches(method, path, when):
                    f.remaining -= 1
                    return f
        return None

    def calls(self, method: str | None = None, path: str | None = None) -> list[dict]:
        """Logged requests filtered by method and by a regex searched in their path."""
        rx = re.compile(path) if path else None
        with self._lock:
            return [r for r in self.requests
                    if (method is None or r["method"] == method.upper())
                    and (rx is None or rx.search(r["path"]))]

    # ---- direct (no HTTP) access for tests -----------------------------------------------

    def _repo(self, repo_id: str, repo_type: str = "model") -> Repo:
        try:
            return self.repos[(repo_type, repo_id)]
        except KeyError:
            raise KeyError(f"no {repo_type} repo {repo_id!r}") from None

    def files(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> dict[str, bytes]:
        """``{path: content}`` of ``repo_id`` at ``revision``."""
        with self._lock:
            repo = self._repo(repo_id, repo_type)
            commit = repo.commits[self._resolve(repo, revision)]
            return {p: self._content(o) for p, o in sorted(commit.tree.items())}

    def head(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> str:
        """Commit sha that ``revision`` points to."""
        with self._lock:
            return self._resolve(self._repo(repo_id, repo_type), revision)

    def history(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> list[Commit]:
        """Commits reachable from ``revision`` through first parents, newest first."""
        with self._lock:
            repo = self._repo(repo_id, repo_type)
            return self._history(repo, self._resolve(repo, revision))

    def exists(self, repo_id: str, repo_type: str = "model") -> bool:
        with self._lock:
            return (repo_type, repo_id) in self.repos

    def seed(self, repo_id: str, files: dict[str, bytes | str] | str | os.PathLike, *,
             repo_type: str = "model", private: bool = False, message: str = "seed",
             author: str | None = None, branch: str = "main") -> str:
        """Create (if needed) ``repo_id`` and commit ``files`` (a dict, or a local folder) to it
        without going through HTTP.  Returns the commit sha."""
        if not isinstance(files, dict):
            root = Path(files)
            files = {p.relative_to(root).as_posix(): p.read_bytes()
                     for p in sorted(root.rglob("*")) if p.is_file() and ".cache" not in p.parts}
        with self._lock:
            repo = self.repos.get((repo_type, repo_id))
            if repo is None:
                repo = self._create(repo_type, repo_id, private)
            if branch not in repo.branches:
                repo.branches[branch] = repo.branches["main"]
            parent = repo.commits[repo.branches[branch]]
            tree = dict(parent.tree)
            for p, content in files.items():
                data = content.encode() if isinstance(content, str) else bytes(content)
                tree[p.strip("/")] = self._stored_oid(repo, tree, p.strip("/"), data)  # LFS where the Hub would
            sha = self._new_commit(repo, [parent.oid], tree, message, "", author or repo.namespace)
            repo.branches[branch] = sha
            return sha

    # ---- internals: repo model -----------------------------------------------------------

    def _create(self, repo_type: str, repo_id: str, private: bool) -> Repo:
        repo = Repo(type=repo_type, id=repo_id, private=private, created_at=_now())
        tree = {}
        if self.gitattributes:
            oid = git_blob_oid(GITATTRIBUTES)
            self.blobs[oid] = GITATTRIBUTES
            tree[".gitattributes"] = oid
        repo.branches["main"] = self._new_commit(repo, [], tree, "initial commit", "", "system")
        self.repos[(repo_type, repo_id)] = repo
        return repo

    def _new_commit(self, repo: Repo, parents: list[str], tree: dict[str, str], title: str,
                    message: str, author: str) -> str:
        nonce = "" if self.content_shas else uuid.uuid4().hex
        seed = json.dumps([nonce, repo.id, parents, sorted(tree.items()), title]).encode()
        oid = hashlib.sha1(seed).hexdigest()
        repo.commits[oid] = Commit(oid, parents, dict(tree), title, message, author, _now())
        return oid

    def _history(self, repo: Repo, sha: str) -> list[Commit]:
        out = []
        cur: str | None = sha
        while cur is not None:
            c = repo.commits[cur]
            out.append(c)
            cur = c.parents[0] if c.parents else None
        return out

    def _resolve_ref(self, repo: Repo, rev: str) -> tuple[str, str, Any]:
        """``(sha, kind, name)`` with kind in branch / tag / pr / commit."""
        if rev in repo.branches:
            return repo.branches[rev], "branch", rev
        if rev.startswith("refs/heads/") and rev[11:] in repo.branches:
            return repo.branches[rev[11:]], "branch", rev[11:]
        if rev in repo.tags:
            return repo.tags[rev], "tag", rev
        if rev.startswith("refs/tags/") and rev[10:] in repo.tags:
            return repo.tags[rev[10:]], "tag", rev[10:]
        m = _PR_RE.match(rev)
        if m and int(m.group(1)) in repo.prs:
            return repo.prs[int(m.group(1))], "pr", int(m.group(1))
        low = rev.lower()
        if _SHA_RE.match(low) and low in repo.commits:
            return low, "commit", low
        if _SHORT_SHA_RE.match(low):
            hits = [c for c in repo.commits if c.startswith(low)]
            if len(hits) == 1:
                return hits[0], "commit", hits[0]
        raise HubError(404, f"Invalid rev id: {rev}", code="RevisionNotFound")

    def _resolve(self, repo: Repo, rev: str) -> str:
        return self._resolve_ref(repo, rev)[0]

    def _owns(self, user: str | None, namespace: str) -> bool:
        return user is not None and (user == namespace or user in self.orgs.get(namespace, ()))

    def _readable(self, req: _Req, repo_type: str, repo_id: str) -> Repo:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None or (repo.private and not self._owns(req.user, repo.namespace)):
            # Like the Hub: anonymous callers get a 401, authenticated ones a 404; both RepoNotFound.
            raise HubError(401 if req.user is None else 404, "Repository not found", code="RepoNotFound")
        return repo

    def _require_write(self, req: _Req, namespace: str, action: str = "write to") -> None:
        if req.user is None:
            raise HubError(401, "Invalid username or password.")
        if not req.can_write:
            raise HubError(403, f"You don't have the rights to {action} {namespace}: this token has a read role")
        if not self._owns(req.user, namespace):
            raise HubError(403, f"You don't have the rights to {action} {namespace}")

    def _repo_url(self, repo: Repo) -> str:
        return f"{self.endpoint}/{URL_PREFIX[repo.type]}{repo.id}"

    # ---- HTTP dispatch -------------------------------------------------------------------

    def handle(self, req: _Req) -> tuple[int, dict, bytes]:
        segs = [unquote(s) for s in req.path.split("/")[1:]]
        with self._lock:
            if segs and segs[0] == "_test-lfs":  # the upload URLs the LFS batch API hands out
                return self._lfs_transfer(req, segs[1:])
            lfs = self._lfs_route(req, segs)
            if lfs is not None:
                return lfs
            if segs and segs[0] == "api":
                return self._handle_api(req, segs[1:])
            rtype = "model"
            if segs and segs[0] in REPO_TYPES and segs[0] != "models" and len(segs) > 1:
                rtype, segs = REPO_TYPES[segs[0]], segs[1:]
            if len(segs) >= 4 and segs[2] == "resolve" and req.method in ("GET", "HEAD"):
                rev, rest = _split_rev(segs[3:])
                return self._resolve_file(req, rtype, f"{segs[0]}/{segs[1]}", rev, "/".join(rest))
            if len(segs) >= 3 and segs[1] == "resolve":  # a repo id without a namespace
                raise HubError(404, "Repository not found", code="RepoNotFound")
            return self._no_route(req)

    def _no_route(self, req: _Req):
        self.unhandled.append(f"{req.method} {req.path}")
        raise HubError(404, f"Not handled by the test hub: {req.method} {req.path}")

    def _handle_api(self, req: _Req, segs: list[str]):
        m = req.method
        if segs == ["repos", "create"] and m == "POST":
            return self._create_repo(req)
        if segs == ["repos", "delete"] and m == "DELETE":
            return self._delete_repo(req)
        if segs == ["whoami-v2"] and m == "GET":
            return self._whoami(req)
        if segs == ["validate-yaml"] and m == "POST":
            return self._validate_yaml(req)
        if segs == ["agent-harnesses"] and m == "GET":
            return _json_response({"standardEnvVars": [], "harnesses": {}})
        if len(segs) == 1 and segs[0] in REPO_TYPES and m == "GET":
            return self._list_repos(req, REPO_TYPES[segs[0]])
        if segs and segs[0] in REPO_TYPES:
            rtype = REPO_TYPES[segs[0]]
            if len(segs) == 2:  # a repo id without a namespace
                raise HubError(404, "Repository not found", code="RepoNotFound")
            if len(segs) >= 3:
                return self._handle_repo_api(req, rtype, f"{segs[1]}/{segs[2]}", segs[3:])
        return self._no_route(req)

    def _handle_repo_api(self, req: _Req, rtype: str, repo_id: str, rest: list[str]):
        m = req.method
        op = rest[0] if rest else ""
        if op == "" and m == "GET":
            return self._info(req, rtype, repo_id, None)
        if op == "revision" and m == "GET" and len(rest) >= 2:
            return self._info(req, rtype, repo_id, "/".join(rest[1:]))
        if op == "tree" and m == "GET" and len(rest) >= 2:
            rev, path = _split_rev(rest[1:])
            return self._tree(req, rtype, repo_id, rev, "/".join(path))
        if op == "paths-info" and m == "POST" and len(rest) >= 2:
            return self._paths_info(req, rtype, repo_id, "/".join(rest[1:]))
        if op == "refs" and m == "GET":
            return self._refs(req, rtype, repo_id)
        if op == "commits" and m == "GET" and len(rest) >= 2:
            return self._commits(req, rtype, repo_id, "/".join(rest[1:]))
        if op == "preupload" and m == "POST" and len(rest) >= 2:
            return self._preupload(req, rtype, repo_id, "/".join(rest[1:]))
        if op == "commit" and m == "POST" and len(rest) >= 2:
            return self._commit(req, rtype, repo_id, "/".join(rest[1:]))
        if op == "branch" and m in ("POST", "DELETE") and len(rest) >= 2:
            return self._branch(req, rtype, repo_id, "/".join(rest[1:]))
        if op == "tag" and m in ("POST", "DELETE") and len(rest) >= 2:
            return self._tag(req, rtype, repo_id, "/".join(rest[1:]))
        if op == "settings" and m == "PUT":
            return self._settings(req, rtype, repo_id)
        return self._no_route(req)

    # ---- endpoints -----------------------------------------------------------------------

    def _validate_yaml(self, req: _Req):
        content = str(req.json().get("content") or "")
        try:
            _card_data(content.encode(), strict=True)
        except ValueError as e:
            raise HubError(400, "Invalid metadata in README.md", body={"errors": [{"message": str(e)}]}) from None
        return _json_response({"errors": [], "warnings": []})

    def _whoami(self, req: _Req):
        if req.user is None:
            raise HubError(401, "Invalid username or password.")
        return _json_response({
            "type": "user", "id": hashlib.md5(req.user.encode()).hexdigest()[:24], "name": req.user,
            "fullname": req.user.title(), "email": f"{req.user}@example.com", "emailVerified": True,
            "isPro": False, "canPay": False, "avatarUrl": "",
            "orgs": [{"type": "org", "name": o, "fullname": o, "roleInOrg": "write"}
                     for o, members in sorted(self.orgs.items()) if req.user in members],
            "auth": {"type": "access_token",
                     "accessToken": {"displayName": "test", "role": "write" if req.can_write else "read"}},
        })

    def _create_repo(self, req: _Req):
        body = req.json()
        rtype = body.get("type") or "model"
        if rtype not in URL_PREFIX:
            raise HubError(400, f"Invalid repo type: {rtype}")
        name = body.get("name") or ""
        if req.user is None:
            raise HubError(401, "Invalid username or password.")
        namespace = body.get("organization") or req.user
        if not _NAME_RE.match(name) or "--" in name or not _NAME_RE.match(namespace):
            raise HubError(400, f"Invalid repo name: {namespace}/{name}")
        self._require_write(req, namespace, "create a repo under")
        repo_id = f"{namespace}/{name}"
        existing = self.repos.get((rtype, repo_id))
        if existing is not None:
            raise HubError(409, f"You already created this {rtype} repo", body={"url": self._repo_url(existing)})
        if "visibility" in body:
            private = body["visibility"] == "private"
        else:
            private = bool(body.get("private", False))
        repo = self._create(rtype, repo_id, private)
        return _json_response({"url": self._repo_url(repo), "name": repo_id, "id": repo.uid})

    def _delete_repo(self, req: _Req):
        body = req.json()
        rtype = body.get("type") or "model"
        namespace = body.get("organization") or req.user
        repo_id = f"{namespace}/{body.get('name')}"
        self._readable(req, rtype, repo_id)
        self._require_write(req, namespace, "delete a repo of")
        del self.repos[(rtype, repo_id)]
        self._lfs_repos.pop((rtype, repo_id), None)  # its LFS objects go with it
        return _json_response({})

    def _settings(self, req: _Req, rtype: str, repo_id: str):
        repo = self._readable(req, rtype, repo_id)
        self._require_write(req, repo.namespace, "change the settings of")
        body = req.json()
        if "visibility" in body:
            repo.private = body["visibility"] == "private"
        if "private" in body:
            repo.private = bool(body["private"])
        if "gated" in body:
            repo.gated = body["gated"]
        return _json_response({})

    def _info(self, req: _Req, rtype: str, repo_id: str, rev: str | None):
        repo = self._readable(req, rtype, repo_id)
        sha = self._resolve(repo, rev or "main")
        commit = repo.commits[sha]
        with_blobs = _truthy(req.query.get("blobs"))
        siblings = []
        for p, oid in sorted(commit.tree.items()):
            s: dict[str, Any] = {"rfilename": p}
            if with_blobs:
                s.update(size=len(self._content(oid)), **({"blobId": oid} if self.file_hashes else {}))
                lfs = self._lfs_info(oid) if self.file_hashes else None
                if lfs is not None:
                    s["lfs"] = {"sha256": lfs["oid"], "size": lfs["size"], "pointerSize": lfs["pointerSize"]}
            siblings.append(s)
        info: dict[str, Any] = {
            "_id": repo.uid, "id": repo.id, "author": repo.namespace, "sha": sha,
            "lastModified": _iso(commit.date), "createdAt": _iso(repo.created_at),
            "private": repo.private, "gated": repo.gated, "disabled": False, "downloads": 0,
            "likes": 0, "tags": [], "siblings": siblings,
            "usedStorage": sum(len(self._content(o)) for o in set(commit.tree.values())),
        }
        card = _card_data(self._content(commit.tree["README.md"])) if "README.md" in commit.tree else None
        if card is not None:
            info["cardData"] = card
            tags = card.get("tags")
            info["tags"] = list(tags) if isinstance(tags, list) else ([tags] if isinstance(tags, str) else [])
            if rtype == "model":
                for key in ("library_name", "pipeline_tag"):
                    if isinstance(card.get(key), str):
                        info[key] = card[key]
        if rtype == "model":
            info["modelId"] = repo.id
            if "config.json" in commit.tree:
                try:
                    cfg = json.loads(self._content(commit.tree["config.json"]))
                    info["config"] = {k: cfg[k] for k in ("architectures", "model_type") if k in cfg}
                except (ValueError, TypeError):
                    pass
        return _json_response(info)

    def _list_repos(self, req: _Req, rtype: str):
        """``GET /api/models``: what ``HfApi.list_models`` reads (filters, sort, limit, pagination)."""
        q = req.query
        author = (q.get("author") or [None])[-1]
        search = ((q.get("search") or [""])[-1]).lower()
        wanted = [f for f in q.get("filter", []) if f]
        sort = (q.get("sort") or [None])[-1]
        items = []
        for (t, repo_id), repo in self.repos.items():
            if t != rtype or (repo.private and not self._owns(req.user, repo.namespace)):
                continue
            if author and repo.namespace != author:
                continue
            if search and search not in repo_id.lower():
                continue
            status, _, body = self._info(req, rtype, repo_id, None)
            info = json.loads(body)
            tags = list(info.get("tags") or [])
            card = info.get("cardData") or {}
            bases = card.get("base_model") or []
            relation = card.get("base_model_relation") or ("adapter" if "adapter_config.json" in
                                                           {s["rfilename"] for s in info["siblings"]} else "finetune")
            for b in [bases] if isinstance(bases, str) else bases:
                if isinstance(b, str):
                    tags += [f"base_model:{b}", f"base_model:{relation}:{b}"]
            lic = card.get("license")
            for name in [lic] if isinstance(lic, str) else (lic or []):
                tags.append(f"license:{name}")
            if info.get("library_name"):
                tags.append(info["library_name"])
            if not all(f in tags for f in wanted):
                continue
            info["tags"] = list(dict.fromkeys(tags))
            if not (_truthy(q.get("cardData")) or _truthy(q.get("full"))):
                info.pop("cardData", None)
            items.append((repo, info))
        if sort in ("createdAt", "lastModified"):
            key = (lambda r: r[0].created_at) if sort == "createdAt" else (lambda r: r[1]["lastModified"])
            items.sort(key=key, reverse=True)
        return self._paginate(req, [i for _, i in items], self.page_size)

    def _entry(self, repo: Repo, commit: Commit, path: str, is_dir: bool, expand: bool) -> dict:
        if is_dir:
            prefix = path + "/"
            items = sorted((p, o) for p, o in commit.tree.items() if p.startswith(prefix))
            oid = hashlib.sha1("\n".join(f"{p} {o}" for p, o in items).encode()).hexdigest()
            entry: dict[str, Any] = {"type": "directory", "oid": oid, "size": 0, "path": path}
        else:
            oid = commit.tree[path]
            entry = {"type": "file", "oid": oid, "size": len(self._content(oid)), "path": path}
            lfs = self._lfs_info(oid) if self.file_hashes else None
            if lfs is not None:
                entry["lfs"] = lfs
        if expand:
            last = self._last_commit_touching(repo, commit, path, is_dir)
            entry["lastCommit"] = {"id": last.oid, "title": last.title, "date": _iso(last.date)}
            if not is_dir:
                entry["securityFileStatus"] = {"status": "safe", "avScan": {"virusFound": False},
                                              "pickleImportScan": None}
        return entry

    def _last_commit_touching(self, repo: Repo, commit: Commit, path: str, is_dir: bool) -> Commit:
        def view(c: Commit):
            if is_dir:
                return sorted((p, o) for p, o in c.tree.items() if p.startswith(path + "/"))
            return c.tree.get(path)

        hist = self._history(repo, commit.oid)
        for newer, older in zip(hist, hist[1:]):
            if view(newer) != view(older):
                return newer
        return hist[-1]

    @staticmethod
    def _dirs(tree: dict[str, str]) -> set[str]:
        out = set()
        for p in tree:
            parts = p.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                out.add("/".join(parts[:i]))
        return out

    def _paginate(self, req: _Req, items: list, page_size: int):
        try:
            start = int((req.query.get("cursor") or ["0"])[-1])
        except ValueError:
            raise HubError(400, "Invalid cursor") from None
        limit = page_size
        if req.query.get("limit"):
            try:
                limit = max(1, min(limit, int(req.query["limit"][-1])))
            except ValueError:
                pass
        page = items[start:start + limit]
        headers = {}
        if start + limit < len(items):
            q = {k: v for k, v in req.query.items() if k != "cursor"}
            q["cursor"] = [str(start + limit)]
            headers["Link"] = f'<{self.endpoint}{req.path}?{urlencode(q, doseq=True)}>; rel="next"'
        return _json_response(page, headers=headers)

    def _tree(self, req: _Req, rtype: str, repo_id: str, rev: str, path: str):
        repo = self._readable(req, rtype, repo_id)
        commit = repo.commits[self._resolve(repo, rev)]
        path = path.strip("/")
        recursive = _truthy(req.query.get("recursive"))
        expand = _truthy(req.query.get("expand"))
        dirs = self._dirs(commit.tree)
        if path and path not in dirs:
            raise HubError(404, f"{path} does not exist on \"{rev}\"", code="EntryNotFound",
                           headers={"X-Repo-Commit": commit.oid})
        prefix = path + "/" if path else ""
        entries = []
        for d in sorted(dirs):
            if d.startswith(prefix) and (recursive or "/" not in d[len(prefix):]):
                entries.append((d, True))
        for p in sorted(commit.tree):
            if p.startswith(prefix) and (recursive or "/" not in p[len(prefix):]):
                entries.append((p, False))
        entries.sort(key=lambda e: e[0])
        items = [self._entry(repo, commit, p, d, expand) for p, d in entries]
        return self._paginate(req, items, 50 if expand else self.page_size)

    def _paths_info(self, req: _Req, rtype: str, repo_id: str, rev: str):
        repo = self._readable(req, rtype, repo_id)
        commit = repo.commits[self._resolve(repo, rev)]
        ctype = req.headers.get("Content-Type", "")
        if "json" in ctype:
            body = req.json()
            paths, expand = body.get("paths", []), bool(body.get("expand"))
        else:
            form = parse_qs(req.body.decode(), keep_blank_values=True)
            paths, expand = form.get("paths", []), _truthy(form.get("expand"))
        dirs = self._dirs(commit.tree)
        out = []
        for p in paths:
            p = p.strip("/")
            if p in commit.tree:
                out.append(self._entry(repo, commit, p, False, expand))
            elif p in dirs:
                out.append(self._entry(repo, commit, p, True, expand))
        return _json_response(out)

    def _refs(self, req: _Req, rtype: str, repo_id: str):
        repo = self._readable(req, rtype, repo_id)
        data: dict[str, Any] = {
            "branches": [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": s}
                         for b, s in sorted(repo.branches.items())],
            "converts": [],
            "tags": [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": s} for t, s in sorted(repo.tags.items())],
        }
        if _truthy(req.query.get("include_prs")):
            data["pullRequests"] = [{"name": f"refs/pr/{n}", "ref": f"refs/pr/{n}", "targetCommit": s}
                                    for n, s in sorted(repo.prs.items())]
        return _json_response(data)

    def _commits(self, req: _Req, rtype: str, repo_id: str, rev: str):
        repo = self._readable(req, rtype, repo_id)
        items = [{
            "id": c.oid, "title": c.title, "message": c.message, "date": _iso(c.date),
            "authors": [{"user": c.author, "avatar": ""}],
            "formatted": {"title": c.title, "message": c.message},
        } for c in self._history(repo, self._resolve(repo, rev))]
        return self._paginate(req, items, 50)

    def _check_commit_access(self, req: _Req, repo: Repo, create_pr: bool) -> None:
        if create_pr:
            # Like the Hub: anyone who can read the repo may open a PR (with a write-capable token).
            if req.user is None:
                raise HubError(401, "Invalid username or password.")
            if not req.can_write:
                raise HubError(403, "You don't have the rights to open a pull request: this token has a read role")
        else:
            self._require_write(req, repo.namespace, "commit to")

    def _preupload(self, req: _Req, rtype: str, repo_id: str, rev: str):
        repo = self._readable(req, rtype, repo_id)
        create_pr = _truthy(req.query.get("create_pr"))
        self._check_commit_access(req, repo, create_pr)
        commit = repo.commits[self._resolve(repo, rev)]
        files = []
        for f in req.json().get("files", []):
            p = f.get("path", "")
            try:
                sample = base64.b64decode(f.get("sample") or "")
            except ValueError:
                raise HubError(400, f"Invalid sample for {p}") from None
            mode = "lfs" if self._is_lfs(commit.tree, p.strip("/"), int(f.get("size") or 0), sample) else "regular"
            files.append({"path": p, "uploadMode": mode, "shouldIgnore": False,
                          **({"oid": self._remote_oid(commit.tree, p.strip("/"))} if self.file_hashes else {})})
        return _json_response({"files": files, "commitOid": commit.oid})

    def _commit(self, req: _Req, rtype: str, repo_id: str, rev: str):
        repo = self._readable(req, rtype, repo_id)
        create_pr = _truthy(req.query.get("create_pr"))
        self._check_commit_access(req, repo, create_pr)
        try:
            lines = [json.loads(line) for line in req.body.decode().splitlines() if line.strip()]
        except ValueError:
            raise HubError(400, "Invalid NDJSON commit payload") from None
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "The first line of a commit must be its header")
        header = lines[0].get("value") or {}
        title = header.get("summary") or ""
        if not title:
            raise HubError(400, "A commit needs a summary")
        sha, kind, name = self._resolve_ref(repo, rev)
        parent_commit = header.get("parentCommit")
        if parent_commit is not None:
            parent_commit = parent_commit.lower()
            if parent_commit not in repo.commits:
                raise HubError(404, f"Invalid rev id: {parent_commit}", code="RevisionNotFound")
        if create_pr:
            if kind != "branch":
                raise HubError(400, "A pull request must target a branch")
            base = parent_commit or sha
        else:
            if kind not in ("branch", "pr"):
                raise HubError(400, f"Invalid rev id: {rev} is not a branch")
            if parent_commit is not None and parent_commit != sha:
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            base = sha
        tree = dict(repo.commits[base].tree)
        new_blobs = {}
        for line in lines[1:]:
            key, value = line.get("key"), line.get("value") or {}
            path = (value.get("path") or "").strip("/")
            if key == "file":
                if not path:
                    raise HubError(400, "A file needs a path")
                content = value.get("content", "")
                if value.get("encoding", "base64") == "base64":
                    data = base64.b64decode(content)
                else:
                    data = content.encode()
                oid = git_blob_oid(data)
                new_blobs[oid] = data
                tree[path] = oid
            elif key == "deletedFile":
                if path not in tree:
                    raise HubError(404, f"A file with this name doesn't exist: {path}", code="EntryNotFound")
                del tree[path]
            elif key == "deletedFolder":
                gone = [p for p in tree if p.startswith(path + "/")] if path else list(tree)
                if not gone:
                    raise HubError(404, f"A folder with this name doesn't exist: {path}", code="EntryNotFound")
                for p in gone:
                    del tree[p]
            elif key == "lfsFile":
                if not path:
                    raise HubError(400, "A file needs a path")
                tree[path] = self._commit_lfs_file(repo, value)
            else:
                raise HubError(400, f"Unknown commit operation: {key}")
        self.blobs.update(new_blobs)
        oid = self._new_commit(repo, [base], tree, title, header.get("description") or "", req.user or "")
        out: dict[str, Any] = {"success": True, "commitOid": oid,
                               "commitUrl": f"{self._repo_url(repo)}/commit/{oid}", "hookOutput": ""}
        if create_pr:
            num = repo.next_discussion
            repo.next_discussion += 1
            repo.prs[num] = oid
            repo.pr_info[num] = {"title": title, "author": req.user, "status": "open", "target": name}
            out["pullRequestUrl"] = f"{self._repo_url(repo)}/discussions/{num}"
        elif kind == "pr":
            repo.prs[name] = oid
        else:
            repo.branches[name] = oid
        return _json_response(out)

    def _branch(self, req: _Req, rtype: str, repo_id: str, branch: str):
        repo = self._readable(req, rtype, repo_id)
        self._require_write(req, repo.namespace, "manage branches of")
        if req.method == "DELETE":
            if branch not in repo.branches:
                raise HubError(404, f"Invalid rev id: {branch}", code="RevisionNotFound")
            if branch == "main":
                raise HubError(403, "Cannot delete the main branch")
            del repo.branches[branch]
            return _json_response({})
        if branch.startswith("refs/") or not re.match(r"^[A-Za-z0-9._/-]+$", branch):
            raise HubError(400, f"Invalid reference for a branch: {branch}")
        if branch in repo.branches:
            raise HubError(409, f"Reference already exists: refs/heads/{branch}")
        start = req.json().get("startingPoint")
        repo.branches[branch] = self._resolve(repo, start) if start else repo.branches["main"]
        return _json_response({})

    def _tag(self, req: _Req, rtype: str, repo_id: str, rev_or_tag: str):
        repo = self._readable(req, rtype, repo_id)
        self._require_write(req, repo.namespace, "manage tags of")
        if req.method == "DELETE":
            if rev_or_tag not in repo.tags:
                raise HubError(404, f"Invalid rev id: {rev_or_tag}", code="RevisionNotFound")
            del repo.tags[rev_or_tag]
            return _json_response({})
        tag = req.json().get("tag") or ""
        if not tag or tag.startswith("refs/"):
            raise HubError(400, f"Invalid tag name: {tag!r}")
        if tag in repo.tags:
            raise HubError(409, f"Tag already exists: {tag}")
        repo.tags[tag] = self._resolve(repo, rev_or_tag)
        return _json_response({})

    def _resolve_file(self, req: _Req, rtype: str, repo_id: str, rev: str, path: str):
        repo = self._readable(req, rtype, repo_id)
        sha = self._resolve(repo, rev)
        commit = repo.commits[sha]
        if path not in commit.tree:
            raise HubError(404, "Entry not found", code="EntryNotFound", headers={"X-Repo-Commit": sha})
        oid = commit.tree[path]
        data = self._content(oid)
        headers = {
            "Content-Type": _content_type(path), "ETag": f'"{oid}"', "X-Repo-Commit": sha,
            "Accept-Ranges": "bytes", "Cache-Control": "private, max-age=0, must-revalidate",
            **self._lfs_headers(oid),
        }
        rng = req.headers.get("Range")
        if rng:
            m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", rng)
            if m and (m.group(1) or m.group(2)):
                size = len(data)
                if m.group(1):
                    start = int(m.group(1))
                    end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
                else:
                    start, end = max(size - int(m.group(2)), 0), size - 1
                if start >= size or start > end:
                    raise HubError(416, "Requested range not satisfiable",
                                   headers={"Content-Range": f"bytes */{size}", "X-Repo-Commit": sha})
                headers["Content-Range"] = f"bytes {start}-{end}/{size}"
                return 206, headers, data[start:end + 1]
        return 200, headers, data


def _split_rev(segs: list[str]) -> tuple[str, list[str]]:
    """First segment is the (URL-quoted) revision; accept an unquoted ``refs/pr/N`` too."""
    if len(segs) >= 3 and segs[0] == "refs" and segs[1] in ("pr", "heads", "tags", "convert"):
        return "/".join(segs[:3]), segs[3:]
    return segs[0], segs[1:]


def _content_type(path: str) -> str:
    if path.endswith((".json", ".jinja", ".md", ".txt", ".yaml", ".yml", ".py", ".gitattributes")):
        return "text/plain; charset=utf-8"
    return "application/octet-stream"


def _card_data(readme: bytes, strict: bool = False) -> dict | None:
    """The YAML front matter of a README as a dict (``None`` if absent or, unless ``strict``, invalid)."""
    text = readme.decode("utf-8", "replace")
    m = re.match(r"^\s*---\s*\n(.*?)\n---\s*(\n|$)", text, re.S)
    if not m:
        return None
    try:
        import yaml  # huggingface_hub itself depends on PyYAML
    except ImportError:  # pragma: no cover
        return None
    try:
        data = yaml.safe_load(m.group(1))
    except yaml.YAMLError as e:
        if strict:
            raise ValueError(f"Invalid YAML in the metadata: {e}") from None
        return None
    if data is not None and not isinstance(data, dict):
        if strict:
            raise ValueError("The metadata must be a YAML mapping")
        return None
    return data


# --------------------------------------------------------------------------------------------
# HTTP plumbing
# --------------------------------------------------------------------------------------------


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    hub: HubServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "hubsoup-test-hub/1.0"
    server: _HTTPServer

    def log_message(self, format, *args):  # noqa: A002 - silence the default stderr log
        pass

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def do_PATCH(self):
        self._dispatch("PATCH")

    def _read_body(self, method: str = "") -> bytes:
        hub = self.server.hub
        paced = hub._paced_upload(method, urlsplit(self.path).path)  # an LFS upload: at the link's rate
        conn: dict = {}

        def read(n: int) -> bytes:
            if not paced:
                return self.rfile.read(n)
            parts = []
            while n > 0:
                step = min(n, hub.BODY_CHUNK)
                hub._pace_up(step, conn)
                got = self.rfile.read(step)
                if not got:
                    break
                parts.append(got)
                n -= len(got)
            return b"".join(parts)

        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return read(length) if length else b""

    def _dispatch(self, method: str) -> None:
        hub = self.server.hub
        body = self._read_body(method)
        split = urlsplit(self.path)
        path = split.path
        query = parse_qs(split.query, keep_blank_values=True)
        auth = self.headers.get("Authorization") or ""
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        user, can_write, bad_token = None, False, False
        if token:
            if token in hub.tokens:
                user, can_write = hub.tokens[token]
            else:
                bad_token = True
        req = _Req(method, path, query, self.headers, body, user, can_write)

        delay = hub._take_delay(method, path)
        if delay:
            hub._wake.wait(delay)  # outside the lock: the rest of the Hub answers meanwhile
        failure = hub._take_failure(method, path, "before") or hub._take_ranged_failure(req)
        if failure is not None:
            resp = None
        elif bad_token:
            resp = HubError(401, "Invalid credentials in Authorization header").response()
        else:
            try:
                resp = hub.handle(req)
            except HubError as e:
                resp = e.response()
            except Exception as e:  # a bug in the test hub: make it loud
                traceback.print_exc()
                resp = HubError(500, f"Test hub crashed: {type(e).__name__}: {e}").response()
            failure = hub._take_failure(method, path, "after")
        if failure is not None:
            if failure.hang:
                hub._wake.wait(min(failure.hang, MAX_HANG))  # outside the lock: the rest of the Hub answers
            if failure.drop or failure.hang:
                self._log(hub, req, 0)
                self.close_connection = True
                return
            err = HubError(failure.status, failure.message, failure.code, failure.headers)
            resp = err.response()
        status, headers, data = resp
        self._log(hub, req, status)
        self.send_response(status)
        for k, v in headers.items():
            # header values must be one latin-1 line (messages may quote paths)
            v = re.sub(r"[\r\n]+", " ", str(v)).encode("latin-1", "replace").decode("latin-1")
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Request-Id", f"test-{uuid.uuid4().hex[:12]}")
        self.end_headers()
        if method != "HEAD":
            hub._write_body(self, req, status, data)

    @staticmethod
    def _log(hub: HubServer, req: _Req, status: int) -> None:
        with hub._lock:
            hub.requests.append({"method": req.method, "path": req.path, "query": req.query,
                                 "status": status, "user": req.user, "range": req.headers.get("Range")})


# --------------------------------------------------------------------------------------------
# Pytest fixtures
# --------------------------------------------------------------------------------------------


def _endpoint_port() -> int:
    endpoint = os.environ.get("HF_ENDPOINT")
    if not endpoint:
        raise RuntimeError("HF_ENDPOINT is not set: conftest.py must set it before huggingface_hub is imported")
    port = urlsplit(endpoint).port
    if port is None:
        raise RuntimeError(f"HF_ENDPOINT={endpoint!r} has no port")
    return port


@pytest.fixture(scope="session")
def hub_server():
    """The test Hub, started on the port of ``HF_ENDPOINT`` the first time a test asks for it."""
    from huggingface_hub import constants

    port = _endpoint_port()
    if urlsplit(constants.ENDPOINT).port != port:
        raise RuntimeError("huggingface_hub was imported before conftest.py set HF_ENDPOINT")
    server = HubServer(port=port).start()
    yield server
    server.stop()


@pytest.fixture
def hub(hub_server, monkeypatch):
    """The test Hub, emptied, with offline mode off for the duration of the test.

    Offline mode is read from ``huggingface_hub.constants.HF_HUB_OFFLINE`` (``is_offline_mode()``,
    used by huggingface_hub and transformers) and from the ``HF_HUB_OFFLINE`` environment variable
    (peft's ``check_file_exists_on_hf_hub``); ``datasets.config`` keeps its own copy.
    """
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    ds_config = sys.modules.get("datasets.config")
    if ds_config is not None:
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            if hasattr(ds_config, name):
                monkeypatch.setattr(ds_config, name, False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    hub_server.reset()
    hub_server._monkeypatch = monkeypatch
    try:
        yield hub_server
    finally:
        hub_server._monkeypatch = None
        if hub_server.unhandled:
            warnings.warn(f"test hub got requests it does not handle: {hub_server.unhandled}", stacklevel=1)
