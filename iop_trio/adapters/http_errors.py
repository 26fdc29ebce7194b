"""How an HTTP exchange with an engine goes wrong, as an :class:`AdapterError` whose
message names the engine URL and the model (``where``):

====================================================  ==================
what happened                                         reason
====================================================  ==================
connect / pool / write timeout, no data for           ``timeout``
``read_timeout`` seconds (before the headers or
between two chunks of the body); the connect and
read timeouts are ``unresponsive``
connection refused, DNS failure, reset, the engine    ``connection``
closed the connection mid-response, bad URL scheme
non-2xx status (the engine's own message is kept)     ``engine_error``
429 Too Many Requests                                 ``engine_busy``
503 Service Unavailable                               ``engine_unavailable``
404 whose message mentions the model                  ``model_not_found``
undecodable body (content-encoding)                   ``bad_response``
any other httpx error                                 ``engine_error``
====================================================  ==================

A 429 or 503 carries a retry hint (:func:`retry_after_hint`): the engine's
``Retry-After``, else :data:`ENGINE_RETRY_AFTER`. An error body's message is the
engine's own where it sends one in a form known here (:func:`json_error`).

Pure functions of what httpx raised or the engine answered; no I/O.
"""

from __future__ import annotations

import datetime
import email.utils
import json
import math
import time
from collections.abc import Mapping
from contextlib import suppress
from http import HTTPStatus
from typing import Any

import httpx

from ..model import ENGINE_RETRY_AFTER, clamp_retry_after
from .base import AdapterError

#: How much of an engine message (or of a bad line) is quoted in an AdapterError.
MAX_QUOTE = 500
#: The reasons of the statuses by which an engine turns a run away for now.
BUSY_REASONS = {429: "engine_busy", 503: "engine_unavailable"}


def quote(text: str, limit: int = MAX_QUOTE) -> str:
    """``text`` on one line, shortened to ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def transport_error(
    exc: httpx.HTTPError, where: str, timeout: httpx.Timeout, *, streaming: bool
) -> AdapterError:
    """The AdapterError for an httpx error; ``streaming`` = the headers had arrived."""
    detail = str(exc) or type(exc).__name__
    # the engine did not answer in time (unresponsive); a write or pool timeout is not
    # that: a long prompt on a slow link, or the node's own pool
    if isinstance(exc, httpx.ConnectTimeout):
        return AdapterError(
            "timeout", f"{where}: could not connect within {timeout.connect}s", unresponsive=True
        )
    if isinstance(exc, httpx.ReadTimeout):
        if streaming:
            return AdapterError(
                "timeout",
                f"{where}: the stream stalled: no data for {timeout.read}s",
                unresponsive=True,
            )
        return AdapterError(
            "timeout", f"{where}: no response within {timeout.read}s", unresponsive=True
        )
    if isinstance(exc, httpx.WriteTimeout):
        return AdapterError(
            "timeout", f"{where}: could not send the request within {timeout.write}s"
        )
    if isinstance(exc, httpx.PoolTimeout):
        return AdapterError("timeout", f"{where}: no free connection within {timeout.pool}s")
    if isinstance(exc, httpx.TimeoutException):
        return AdapterError("timeout", f"{where}: timed out: {detail}")
    if isinstance(exc, httpx.ConnectError):
        return AdapterError("connection", f"{where}: cannot connect: {detail}")
    if isinstance(exc, httpx.NetworkError | httpx.ProxyError):
        return AdapterError("connection", f"{where}: connection lost: {detail}")
    if isinstance(exc, httpx.RemoteProtocolError):
        what = "mid-response" if streaming else "before responding"
        return AdapterError(
            "connection", f"{where}: the engine closed the connection {what}: {detail}"
        )
    if isinstance(exc, httpx.UnsupportedProtocol):
        return AdapterError("connection", f"{where}: {detail}")
    if isinstance(exc, httpx.DecodingError):
        return AdapterError("bad_response", f"{where}: cannot decode the response: {detail}")
    return AdapterError("engine_error", f"{where}: {type(exc).__name__}: {detail}")


def json_error(obj: object) -> str | None:
    """The message of an engine error object, or None if ``obj`` is not one.

    Knows Ollama's ``{"error": "..."}``, OpenAI's ``{"error": {"message": ...}}``
    and vLLM's older ``{"object": "error", "message": ...}``; any other
    ``error`` value is shown as JSON.
    """
    if not isinstance(obj, Mapping):
        return None
    error = obj.get("error")
    if error is not None:
        if isinstance(error, str):
            return error
        if isinstance(error, Mapping):
            message = error.get("message")
            if isinstance(message, str) and message:
                kind = error.get("type") or error.get("code")
                return f"{message} ({kind})" if isinstance(kind, str) and kind else message
        return json.dumps(error)
    if obj.get("object") == "error" and isinstance(obj.get("message"), str):
        return str(obj["message"])
    return None


def _detail(obj: object) -> str | None:
    """FastAPI's ``{"detail": ...}`` (llama-cpp-python's validation errors)."""
    detail = obj.get("detail") if isinstance(obj, Mapping) else None
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):
        return "; ".join(
            f"{'.'.join(map(str, d.get('loc', ())))}: {d.get('msg', '')}"
            if isinstance(d, Mapping)
            else str(d)
            for d in detail
        )
    return None


def body_message(body: bytes) -> str:
    """What an error body says: the engine's JSON error message (or JSON string), else its
    text, on one line and shortened ("" for an empty body)."""
    text = body.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return quote(text)
    message = obj if isinstance(obj, str) else json_error(obj)
    if message is None:
        message = _detail(obj)
    return quote(message if message is not None else text)


def retry_after_hint(value: str, *, now: float | None = None) -> float | None:
    """The seconds an HTTP ``Retry-After`` says to wait: a number of seconds, or an HTTP
    date less ``now`` (the wall clock, by default), bounded as the gate bounds its own
    hints (:func:`~iop_trio.model.clamp_retry_after`: 0.1 s .. 1 h, so a negative
    delay or a date gone by gives 0.1 s, a huge one 1 h). None for a value that is
    neither (empty, words, NaN)."""
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            date = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if date.tzinfo is None:  # "-0000": UTC, says RFC 5322
            date = date.replace(tzinfo=datetime.UTC)
        seconds = date.timestamp() - (time.time() if now is None else now)
    if math.isnan(seconds):
        return None
    return clamp_retry_after(seconds)


def status_error(
    status: int, phrase: str, body: bytes, where: str, *, retry_after: str | None = None
) -> AdapterError:
    """The AdapterError for a non-2xx response with ``body`` (possibly cut short).

    A 429 or 503 (:data:`BUSY_REASONS`) carries a retry hint: the response's
    ``retry_after`` header read by :func:`retry_after_hint`, or
    :data:`ENGINE_RETRY_AFTER` when it gives none that can be read.
    """
    message = body_message(body)
    if not phrase:
        with suppress(ValueError):
            phrase = HTTPStatus(status).phrase
    reason = "engine_error"
    hint: float | None = None
    tail = ""
    if status == 404 and "model" in message.lower():
        reason = "model_not_found"
    elif status in BUSY_REASONS:
        reason = BUSY_REASONS[status]
        if retry_after is not None:
            hint = retry_after_hint(retry_after)
        hint = ENGINE_RETRY_AFTER if hint is None else hint
        tail = f" (retry after {hint:g}s)"
    status_line = f"HTTP {status} {phrase}".rstrip()
    return AdapterError(
        reason, f"{where}: {status_line}: {message or 'no details'}{tail}", retry_after=hint
    )


def parse_json(raw: bytes | str, where: str) -> Any:
    """A JSON value from one line/event of a stream; ``bad_response`` if it is not JSON."""
    try:
        return json.loads(raw)
    except ValueError:
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        raise AdapterError(
            "bad_response", f"{where}: invalid JSON in the stream: {quote(text, 200)!r}"
        ) from None
