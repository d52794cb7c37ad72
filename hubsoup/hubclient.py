"""The Hub client rules every Hub request of hubsoup follows: timeouts, token scrubbing, HTTP-error reading.

A leaf (it imports only :mod:`hubsoup.errors` and, inside the calls that need it, ``huggingface_hub``):
sources (downloads), :mod:`hubsoup.hub` (the push) and the pipeline all use it, so none of them imports
another for these rules.

Example:
    >>> from hubsoup.hubclient import scrub_secrets
    >>> scrub_secrets("401 for hf_" + "a" * 24)
    '401 for hf_***'
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any, Union

from hubsoup.errors import PushError

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


def _timeout_hook(request) -> None:
    """Give a request that would wait forever (no timeout set, by the client or the call) hubsoup's timeout."""
    current = request.extensions.get("timeout") or {}
    if all(v is None for v in current.values()):
        t = hub_timeout()
        request.extensions["timeout"] = {"connect": t, "read": t, "write": t, "pool": t}


def _add_timeout_hook(client) -> None:
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
    from huggingface_hub.utils import _http, get_session  # lazy: keeps hubsoup --help free of huggingface_hub

    factory = getattr(_http, "_GLOBAL_CLIENT_FACTORY", None)
    if factory is not None and not getattr(factory, "_hubsoup", False):
        def with_timeouts(inner=factory):
            client = inner()
            _add_timeout_hook(client)
            return client

        with_timeouts._hubsoup = True  # type: ignore[attr-defined]
        _http._GLOBAL_CLIENT_FACTORY = with_timeouts  # the current client stays open (no request is cut)
    _add_timeout_hook(get_session())


def is_timeout(e: BaseException | None) -> bool:
    """Whether ``e`` (or an exception it was raised from) is a timeout."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, TimeoutError) or any(c.__name__ in ("TimeoutException", "Timeout", "ReadTimeout",
                                                             "WriteTimeout", "ConnectTimeout", "PoolTimeout")
                                              for c in type(e).__mro__):
            return True
        e = e.__cause__ or e.__context__
    return False


def error_status(e: BaseException | None) -> int | None:
    """The HTTP status of ``e``'s response (or of an exception it was raised from), if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        resp = getattr(e, "response", None)
        status = getattr(resp, "status_code", None) if resp is not None else None
        if isinstance(status, int):
            return status
        e = e.__cause__ or e.__context__
    return None


RETRY_STATUS = (408, 429, 500, 502, 503, 504)
"""The answers huggingface_hub's own downloads retry (``http_backoff``); hubsoup's range reads retry them too."""


def transient(e: BaseException) -> bool:
    """Whether a Hub request that raised ``e`` may be tried again: a 5xx, 408 or 429 answer, or a connection that
    dropped (refused, reset, closed before the answer or the body ended). A timeout is not: the request already
    waited ``HUBSOUP_HUB_TIMEOUT``."""
    if is_timeout(e):
        return False
    status = error_status(e)
    if status is not None:
        return status in RETRY_STATUS
    seen = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if any(c.__name__ in ("ConnectError", "RemoteProtocolError", "ReadError", "ConnectionError",
                              "IncompleteRead") for c in type(cur).__mro__):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


# --- secrets -------------------------------------------------------------------------------------

_TOKEN_SHAPE = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")
_AUTH_HEADER = re.compile(r"(?i)(authorization[\"']?\s*[:=]\s*[\"']?)(?:(bearer|basic|token)\s+)?[^\s\"',}]+")


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
    anything shaped like one (``hf_`` + 20 or more characters) and ``Authorization`` header values."""
    text = str(text)
    for tok in sorted(_tokens_in_use(token), key=len, reverse=True):
        text = text.replace(tok, "***")
    text = _TOKEN_SHAPE.sub("hf_***", text)
    return _AUTH_HEADER.sub(lambda m: m.group(1) + (m.group(2) + " " if m.group(2) else "") + "***", text)


class SecretFilter:
    """A logging filter that removes tokens from every record (message, arguments, exception text)."""

    def filter(self, record) -> bool:
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

    def scrubbed_record(*args, **kwargs):
        record = factory(*args, **kwargs)
        scrub.filter(record)
        return record

    scrubbed_record._hubsoup = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(scrubbed_record)


def check_repo_id(repo_id: str) -> str:
    """Refuse a target that is not ``namespace/name`` (before any merge or upload starts)."""
    if not isinstance(repo_id, str) or not _REPO_ID.match(repo_id) or ".." in repo_id or repo_id.endswith((".", "-")):
        raise PushError(f"push target '{repo_id}' is not a Hub repo ID; use NAMESPACE/NAME, e.g. my-org/my-soup")
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
