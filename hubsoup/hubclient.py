"""The Hub client rules every Hub request of hubsoup follows: timeouts, token scrubbing, HTTP-error reading.

Scrubbing covers every secret a message or log line may carry: Hub tokens, and the credentials of a URL
(a study's database) too.

A leaf (it imports only :mod:`hubsoup.errors` and, inside the calls that need it, ``huggingface_hub``):
sources (downloads), :mod:`hubsoup.hub` (the push) and the pipeline all use it, so none of them imports
another for these rules.

Example:
    >>> from hubsoup.hubclient import scrub_secrets
    >>> scrub_secrets("401 for hf_" + "a" * 24)
    '401 for hf_***'
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import time
import warnings
from typing import Any, Callable, Iterator, TYPE_CHECKING, TypeGuard, TypeVar, Union

from hubsoup.errors import InputError, PushError

if TYPE_CHECKING:
    import httpx

Token = Union[str, bool, None]
"""A Hub token, as huggingface_hub takes it: the token itself, False (send none), or None (the usual sources:
``HF_TOKEN``, ``hf auth login``). The one type of every ``token=`` in hubsoup; never printed, logged or stored."""

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*$")


# --- timeouts ------------------------------------------------------------------------------------

TIMEOUT_ENV = "HUBSOUP_HUB_TIMEOUT"
DEFAULT_TIMEOUT = 60.0
"""Seconds any one Hub request may wait (connect, each read or write) before it fails."""


def hub_timeout() -> float:
    """The per-request timeout in seconds (``HUBSOUP_HUB_TIMEOUT``, default 60)."""
    try:
        value = float(os.environ.get(TIMEOUT_ENV, "") or DEFAULT_TIMEOUT)
    except ValueError:
        return DEFAULT_TIMEOUT
    return value if value > 0 else DEFAULT_TIMEOUT


def _timeout_hook(request: httpx.Request) -> None:
    """Give a request that would wait forever (no timeout set, by the client or the call) hubsoup's timeout."""
    current = request.extensions.get("timeout") or {}
    if all(v is None for v in current.values()):
        t = hub_timeout()
        request.extensions["timeout"] = {"connect": t, "read": t, "write": t, "pool": t}


def _add_timeout_hook(client: Any) -> None:  # an httpx.Client, marked with an attribute of ours
    if getattr(client, "_hubsoup_timeouts", False):
        return
    hooks = dict(client.event_hooks)
    hooks["request"] = [*hooks.get("request", []), _timeout_hook]
    client.event_hooks = hooks
    client._hubsoup_timeouts = True


def ensure_timeouts() -> None:
    """Make every request huggingface_hub sends time out.

    huggingface_hub's shared HTTP client waits forever by default (its downloads pass their own
    timeouts; uploads, commits and most API calls do not). A request hook gives every request
    that has no timeout ``HUBSOUP_HUB_TIMEOUT`` seconds for each connect, read and write; timeouts
    the caller or the user's own client set are kept. Installed on the current shared client and,
    through the client factory, on any client created later in the process.
    """
    # lazy: keeps hubsoup --help free of huggingface_hub
    from huggingface_hub.utils import _http, get_session  # type: ignore[attr-defined]  # huggingface_hub.utils: re-exports mypy cannot see

    factory = getattr(_http, "_GLOBAL_CLIENT_FACTORY", None)
    if factory is not None and not getattr(factory, "_hubsoup", False):
        def with_timeouts(inner: Callable[[], Any] = factory) -> Any:
            client = inner()
            _add_timeout_hook(client)
            return client

        with_timeouts._hubsoup = True  # type: ignore[attr-defined]
        _http._GLOBAL_CLIENT_FACTORY = with_timeouts  # the current client stays open (no request is cut)
    _add_timeout_hook(get_session())


def causes(e: BaseException | None, *, context: bool = True) -> Iterator[BaseException]:
    """``e``, then each exception it was raised from (``__cause__``, else ``__context__`` unless not ``context``),
    each once: the one walk over a chain that every reading of a Hub failure uses (huggingface_hub wraps the
    HTTP library's errors, and an upload's error in its own).

    Example:
        >>> try:
        ...     try:
        ...         raise TimeoutError("read")
        ...     except TimeoutError as inner:
        ...         raise RuntimeError("upload failed") from inner
        ... except RuntimeError as outer:
        ...     [type(c).__name__ for c in causes(outer)]
        ['RuntimeError', 'TimeoutError']
    """
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or (e.__context__ if context else None)


_E = TypeVar("_E", bound=BaseException)


def caused_by(e: BaseException | None, kind: type[_E]) -> _E | None:
    """The first exception of ``kind`` in ``e``'s chain (:func:`causes`), or None."""
    return next((c for c in causes(e) if isinstance(c, kind)), None)


def _named(e: BaseException | None, names: tuple[str, ...]) -> bool:
    """Whether an exception of ``e``'s chain is of a class named in ``names`` (the HTTP libraries' classes, matched by
    name: httpx, requests and urllib3 are not imported to be told apart)."""
    return any(c.__name__ in names for cur in causes(e) for c in type(cur).__mro__)


_TIMEOUTS = ("TimeoutError", "TimeoutException", "Timeout", "ReadTimeout", "WriteTimeout", "ConnectTimeout",
             "PoolTimeout")


# --- the client ----------------------------------------------------------------------------------

def hub_api(token: Token = None) -> Any:
    """The :class:`huggingface_hub.HfApi` of ``token`` on the current endpoint (``HF_ENDPOINT``): one per token and
    endpoint in a process, built on first use; every Hub call of hubsoup that is not a plain file download goes
    through one. (huggingface_hub's own HTTP session is shared by all of them; :func:`ensure_timeouts` is in place.)

    Example:
        >>> hub_api("hf_" + "x" * 30) is hub_api("hf_" + "x" * 30)      # doctest: +SKIP
        True
    """
    from huggingface_hub import constants  # lazy: keeps hubsoup --help free of huggingface_hub

    ensure_timeouts()
    return _client(token, constants.ENDPOINT)


@functools.lru_cache(maxsize=32)
def _client(token: Token, endpoint: str) -> Any:
    from huggingface_hub import HfApi  # lazy: keeps hubsoup --help free of huggingface_hub

    return HfApi(endpoint=endpoint, token=token)


def is_timeout(e: BaseException | None) -> bool:
    """Whether ``e`` (or an exception it was raised from) is a timeout."""
    return _named(e, _TIMEOUTS)


def error_response(e: BaseException | None) -> Any:
    """The HTTP response of ``e`` (or of an exception it was raised from) that carries a status, if any."""
    for c in causes(e):
        resp = getattr(c, "response", None)
        if resp is not None and isinstance(getattr(resp, "status_code", None), int):
            return resp
    return None


def error_status(e: BaseException | None) -> int | None:
    """The HTTP status of ``e``'s response (or of an exception it was raised from), if any."""
    resp = error_response(e)
    return resp.status_code if resp is not None else None


RETRY_STATUS = (408, 429, 500, 502, 503, 504)
"""The answers huggingface_hub's own downloads retry (``http_backoff``); hubsoup's range reads retry them too."""

DROPPED = ("ConnectError", "RemoteProtocolError", "ReadError", "WriteError", "NetworkError", "ConnectionError",
           "IncompleteRead")
"""The HTTP libraries' errors of a connection that dropped (refused, reset, closed before the answer or body ended)."""


def transient(e: BaseException) -> bool:
    """Whether a Hub request that raised ``e`` may be tried again: a 5xx, 408 or 429 answer, or a connection that
    dropped (refused, reset, closed before the answer or the body ended). A timeout is not: the request already
    waited ``HUBSOUP_HUB_TIMEOUT``."""
    if is_timeout(e):
        return False
    status = error_status(e)
    if status is not None:
        return status in RETRY_STATUS
    return _named(e, DROPPED)


# --- secrets -------------------------------------------------------------------------------------

_TOKEN_SHAPE = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")
_AUTH_HEADER = re.compile(r"(?i)(authorization[\"']?\s*[:=]\s*[\"']?)(?:(bearer|basic|token)\s+)?[^\s\"',}]+")


# a URL's user and password (``postgresql://u:p@db/x``; a password with an unescaped ``@`` too) and the
# credentials a URL's query or a libpq connection string may carry (``?password=...``, ``password=... host=...``)
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)[^\s/?#'\"<>]*@")
_KEY_SECRET = re.compile(r"(?i)\b(password|passwd|pwd|secret|api[_-]?key|access[_-]?token|auth[_-]?token|sslpassword)"
                         r"(\s*=\s*)(?:'[^']*'|\"[^\"]*\"|[^\s&;'\",}]+)")


def scrub_url_credentials(text: Any) -> str:
    """``text`` without the credentials of any URL or connection string in it: ``scheme://user:password@host``
    becomes ``scheme://***@host``, ``password=...`` (a URL's query, a libpq string) ``password=***``.

    >>> scrub_url_credentials("cannot open postgresql://alice:s3cr@t@db:5432/studies?sslmode=require&password=x")
    'cannot open postgresql://***@db:5432/studies?sslmode=require&password=***'
    """
    text = _URL_USERINFO.sub(lambda m: m.group(1) + "***@", str(text))
    return _KEY_SECRET.sub(lambda m: m.group(1) + m.group(2) + "***", text)


_stored_token: tuple[float, str | None] = (0.0, None)


def _stored() -> str | None:
    """huggingface_hub's token (env or ``hf auth login``), read at most once a second (log records ask often)."""
    global _stored_token

    now = time.monotonic()
    if now - _stored_token[0] > 1.0:
        _stored_token = (now, _stored_token[1])  # a log record made while reading it must not read it again
        try:
            from huggingface_hub import get_token  # lazy: keeps hubsoup --help free of huggingface_hub

            _stored_token = (now, get_token())
        except Exception:  # noqa: BLE001 - no token store: nothing to hide
            _stored_token = (now, None)
    return _stored_token[1]


def _tokens_in_use(token: Token = None) -> set[str]:
    toks = {token} if isinstance(token, str) and token else set()
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        if os.environ.get(name):
            toks.add(os.environ[name])
    tok = _stored()
    if tok:
        toks.add(tok)
    return {t for t in toks if len(t) >= 4}


def scrub_secrets(text: Any, token: Token = None) -> str:
    """``text`` without any Hub token: the tokens in use (``token``, ``HF_TOKEN``, the stored login),
    anything shaped like one (``hf_`` + 20 or more characters) and ``Authorization`` header values; nor
    the credentials of a URL (a database's: :func:`scrub_url_credentials`)."""
    text = str(text)
    for tok in sorted(_tokens_in_use(token), key=len, reverse=True):
        text = text.replace(tok, "***")
    text = _TOKEN_SHAPE.sub("hf_***", text)
    text = _AUTH_HEADER.sub(lambda m: m.group(1) + (m.group(2) + " " if m.group(2) else "") + "***", text)
    return scrub_url_credentials(text) if ("@" in text or "=" in text) else text


class SecretFilter:
    """A logging filter that removes tokens from every record (message, arguments, exception text)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken record is logging's problem, not ours
            return True
        clean = scrub_secrets(msg)
        if clean != msg:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[1] is not None:
            text = logging.Formatter().formatException(record.exc_info)
            if scrub_secrets(text) != text:
                record.exc_text, record.exc_info = scrub_secrets(text), None
        return True


def install_log_scrubber() -> None:
    """No Hub token in any log record: :class:`SecretFilter` on every handler of the root logger and of
    the HTTP libraries' loggers, and a log record factory that scrubs each record as it is made (so
    loggers and handlers configured later are covered too). Installed once per process."""
    for name in (None, "huggingface_hub", "httpx", "httpx2", "httpcore", "transformers", "urllib3"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, SecretFilter) for f in handler.filters):
                handler.addFilter(SecretFilter())
    factory = logging.getLogRecordFactory()
    if getattr(factory, "_hubsoup", False):
        return
    scrub = SecretFilter()

    def scrubbed_record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        scrub.filter(record)
        return record

    scrubbed_record._hubsoup = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(scrubbed_record)
    shown = warnings.formatwarning  # Python's warnings are printed, not logged: scrubbed as they are formatted
    if not getattr(shown, "_hubsoup", False):
        def scrubbed_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                             line: str | None = None) -> str:
            return scrub_secrets(shown(message, category, filename, lineno, line))

        scrubbed_warning._hubsoup = True  # type: ignore[attr-defined]
        warnings.formatwarning = scrubbed_warning


# --- retries ------------------------------------------------------------------------------------

_RETRY_MESSAGE = re.compile(r"thrown while requesting |^Retrying in \d|^Rate limited\. Waiting |^Retrying \(Retry\(")


class RetryFilter(logging.Filter):
    """Drops the warning huggingface_hub (and urllib3) log at each retry of a request, unless ``show``: a
    dropped connection ends in one error line (the reason, the command to retry), not a warning per attempt
    (72 of them before, for one download). The command line's ``-v`` shows them."""

    show = False

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.WARNING or RetryFilter.show:
            return True
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken record is logging's problem, not ours
            return True
        if _RETRY_MESSAGE.search(msg):
            self.dropped += 1
            return False
        return True


RETRY_LOGGERS = ("huggingface_hub.utils._http", "urllib3.connectionpool", "urllib3.util.retry")


def quiet_retries(show: bool = False) -> None:
    """No warning line per retried request (:class:`RetryFilter` on the loggers in :data:`RETRY_LOGGERS`)
    unless ``show``; installed once per process, by the command line (``show``: its ``-v``)."""
    RetryFilter.show = show
    for name in RETRY_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RetryFilter) for f in logger.filters):
            logger.addFilter(RetryFilter())


MAX_REPO_NAME = 96
"""The longest namespace or name the Hub takes (huggingface_hub's rule: 96 characters each)."""


# --- a commit huggingface_hub skipped ---------------------------------------------------------------

_EMPTY_COMMIT = "No files have been modified since last commit"
_skipped = threading.local()


class _SkippedCommitFilter(logging.Filter):
    """huggingface_hub's WARNING for a commit it skipped (the repo already holds every file as it is): noted for
    the thread that pushed (:func:`commit_was_skipped`, so the push can say "nothing changed" instead of
    "pushed to ... <the old commit>") and shown only when debugging (``-v``): a WARNING reads as a failure."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _EMPTY_COMMIT not in str(record.msg):
            return True
        if record.thread == threading.get_ident():
            _skipped.seen = True
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def expect_commit() -> None:
    """Before a commit: forget this thread's earlier skipped one; huggingface_hub's note of a skip is now seen."""
    logger = logging.getLogger("huggingface_hub.hf_api")
    if not any(isinstance(f, _SkippedCommitFilter) for f in logger.filters):
        logger.addFilter(_SkippedCommitFilter())
    _skipped.seen = False


def commit_was_skipped() -> bool:
    """Whether this thread's last commit (after :func:`expect_commit`) was skipped: nothing had changed."""
    return bool(getattr(_skipped, "seen", False))


def pushed_line(repo_id: str, info: Any) -> str:
    """What the command line says after a push: the commit, or that the repo already had this content.

    Example:
        >>> class Info: oid, commit_url = "3f1c2d" + "0" * 34, "https://hub/alice/soup/commit/3f1c2d"
        >>> expect_commit()  # before the commit (this thread's earlier skipped one forgotten)
        >>> pushed_line("alice/soup", Info())
        'pushed to alice/soup: https://hub/alice/soup/commit/3f1c2d'
    """
    if commit_was_skipped():
        return f"nothing changed: {repo_id} already has this content at {str(info.oid)[:12]} ({info.commit_url})"
    return f"pushed to {repo_id}: {info.commit_url}"


_NAME = r"[A-Za-z0-9][\w.\-]*"
_HUB_ID = re.compile(rf"^{_NAME}(/{_NAME})?$")
_REVISION = re.compile(r"^[\w.\-]+(/[\w.\-]+)*$")  # a branch, tag, sha or refs/pr/N


def is_hub_id(spec: Any) -> TypeGuard[str]:
    """Whether ``spec`` is a Hub repo ID (``name``, ``org/name``, optionally ``@revision``), by its text alone.

    >>> is_hub_id("org/model@v1.0"), is_hub_id("./org/model"), is_hub_id("org/../x")
    (True, False, False)
    """
    if not isinstance(spec, str) or not spec or len(spec) > 200 or spec != spec.strip():
        return False
    repo_id, _, revision = spec.partition("@")
    if "@" in spec and not revision:
        return False
    if ".." in spec or "\\" in spec or "\x00" in spec or spec.startswith(("~", ".", "/")):
        return False
    if not _HUB_ID.match(repo_id) or repo_id.endswith((".", "-")):
        return False
    return not revision or bool(_REVISION.match(revision))


def parse_spec(spec: str) -> tuple[str, str | None]:
    """Split ``org/name@revision`` into ``(repo_id, revision)``.

    >>> parse_spec("org/model@v1.0")
    ('org/model', 'v1.0')
    >>> parse_spec("org/model")
    ('org/model', None)
    """
    if "@" in spec:
        repo_id, rev = spec.rsplit("@", 1)
        return repo_id, rev or None
    return spec, None


def check_repo_id(repo_id: str) -> str:
    r"""Refuse a target the Hub would refuse, before any merge or upload starts: not ``namespace/name``;
    huggingface_hub's own rule (:func:`huggingface_hub.utils.validate_repo_id`: letters, digits, ``-``,
    ``_``, ``.``, no ``--`` or ``..``, not ending in ``.git``, at most 96 characters a part); and what that
    rule lets through but the Hub refuses: a trailing newline or space, letters beyond ASCII, a part
    starting or ending with ``-`` or ``.``.

    >>> check_repo_id("my-org/my-soup")
    'my-org/my-soup'
    >>> check_repo_id("my-org/soup\n")
    Traceback (most recent call last):
    ...
    hubsoup.errors.PushError: push target 'my-org/soup\n' is not a Hub repo ID (letters, digits, '-', '_' and '.' only); use NAMESPACE/NAME, e.g. my-org/my-soup
    """
    # lazy: keeps --help free of huggingface_hub
    from huggingface_hub.utils import HFValidationError, validate_repo_id  # type: ignore[attr-defined]  # as in ensure_timeouts

    def refuse(why: str) -> PushError:
        shown = repr(repo_id) if isinstance(repo_id, str) and len(repo_id) <= 120 else \
            (repr(repo_id[:100]) + f"... ({len(repo_id)} characters)" if isinstance(repo_id, str) else type(repo_id).__name__)
        return PushError(f"push target {shown} is not a Hub repo ID ({why}); use NAMESPACE/NAME, e.g. my-org/my-soup")

    if not isinstance(repo_id, str) or repo_id.count("/") != 1:
        raise refuse("one '/' between the namespace and the name")
    if not repo_id.isascii() or not _REPO_ID.fullmatch(repo_id):  # fullmatch: "$" would let a trailing newline by
        raise refuse("letters, digits, '-', '_' and '.' only")
    if any(len(part) > MAX_REPO_NAME for part in repo_id.split("/")):
        raise refuse(f"at most {MAX_REPO_NAME} characters before and after the '/'")
    if "--" in repo_id or ".." in repo_id or any(p.endswith((".", "-")) for p in repo_id.split("/")):
        raise refuse("no '--' or '..', no part ending in '-' or '.'")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise refuse(str(e).split(":")[0].rstrip(".")) from None
    return repo_id


def server_detail(e: BaseException) -> str:
    """`` (the server's message)`` of an HTTP error, first line only and at most 200 characters."""
    resp = getattr(e, "response", None)
    msg = getattr(e, "server_message", None)
    if not msg and resp is not None:
        try:
            msg = resp.headers.get("X-Error-Message")
        except Exception:  # noqa: BLE001
            msg = None
    if not msg or not str(msg).strip():
        return ""
    line = str(msg).strip().splitlines()[0]
    return f" ({line[:200]}{'...' if len(line) > 200 else ''})"


# --- what a failed Hub request means -------------------------------------------------------------
# The one mapping of Hub and HTTP errors to hubsoup's words: reading (an input, a base, a soup, a task repo) and
# writing (a push). Callers catch, then raise what these return; each message is scrubbed (a server may echo the
# token back).

def hub_failure(e: BaseException, who: str, repo_id: str, revision: str | None = None,
                token: Token = None) -> InputError:
    """One line saying why reading ``repo_id`` from the Hub failed (``who``: ``input 'spec'``, ``base 'spec'``)."""
    # lazy: keeps hubsoup --help free of huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import (  # lazy: as above
        GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
    )

    if caused_by(e, GatedRepoError):
        msg = f"{who}: the repo is gated; accept its terms on the Hub and log in (hf auth login or HF_TOKEN)"
    elif caused_by(e, RevisionNotFoundError):
        msg = f"{who}: revision '{revision}' not found in {repo_id}"
    elif caused_by(e, RepositoryNotFoundError):
        msg = (f"{who}: repo {repo_id} not found on {constants.ENDPOINT} "
               "(or it is private and no valid token was given: log in with `hf auth login` or set HF_TOKEN)")
    elif constants.HF_HUB_OFFLINE:
        msg = (f"{who}: not a local folder, and {repo_id}{'@' + revision if revision else ''} is not in the "
               "local Hub cache while offline (HF_HUB_OFFLINE=1)")
    elif is_timeout(e):
        msg = (f"{who}: the Hub at {constants.ENDPOINT} did not answer within {hub_timeout():g}s (timed out); "
               "try again later (HUBSOUP_HUB_TIMEOUT sets the limit)")
    elif (status := error_status(e)) is not None and status >= 500:
        msg = (f"{who}: Hub server error {status}{server_detail(caused_by(e, HfHubHTTPError) or e)} while fetching "
               f"{repo_id}; try again later")
    elif status is not None:
        msg = f"{who}: Hub request for {repo_id} failed with HTTP {status}{server_detail(caused_by(e, HfHubHTTPError) or e)}"
    elif caused_by(e, LocalEntryNotFoundError):
        msg = f"{who}: cannot reach the Hub at {constants.ENDPOINT} to fetch {repo_id}, and it is not in the local cache"
    else:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        msg = f"{who}: cannot reach the Hub at {constants.ENDPOINT} ({type(e).__name__}: {first})"
    return InputError(scrub_secrets(msg, token))


def push_failure(e: BaseException, repo_id: str, token: Token = None) -> str:
    """What went wrong with a push to ``repo_id`` (or a check before it), in words a user can act on."""
    return scrub_secrets(_push_words(e, repo_id), token)


def _push_words(e: BaseException, repo_id: str) -> str:
    # lazy: keeps hubsoup --help free of huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError  # lazy: as above

    status = error_status(e)
    detail = server_detail(e)
    if isinstance(e, ValueError) and "metadata" in str(e).lower():
        lines = str(e).strip().splitlines()
        why = "; ".join(s.lstrip("- ").strip() for s in lines[1:] if s.strip()) or lines[0]
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
    root = list(causes(e, context=False))[-1]  # huggingface_hub wraps an upload's error
    first = str(root).strip().splitlines()[0] if str(root).strip() else ""
    return f"network error: cannot reach {constants.ENDPOINT} ({type(root).__name__}: {first[:200]})"
