"""Shared HTTP plumbing of the engine adapters (``ollama``, ``openai``), over httpx on trio.

:class:`HTTPAdapter` owns one ``httpx.AsyncClient`` per adapter instance and
turns every way an HTTP exchange can go wrong into an :class:`AdapterError`
whose message names the engine URL and the model:

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
``Retry-After``, else :data:`ENGINE_RETRY_AFTER`.

The stream formats (NDJSON lines, server-sent events) are parsed by the
sans-IO :class:`LineSplitter` and :class:`SSEDecoder` below, which the
adapters feed with the body bytes as they come.
"""

from __future__ import annotations

import abc
import datetime
import email.utils
import json
import math
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from http import HTTPStatus
from typing import Any, NoReturn, Self

import attrs
import httpx
import trio

from ..model import Capabilities, clamp_retry_after, field_check, redact_url, seconds_problem
from .base import Adapter, AdapterError, AdapterRequest, Chunk

DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_READ_TIMEOUT = 300.0
DEFAULT_WRITE_TIMEOUT = 30.0

#: Bound on closing a response when a stream is left (shielded from cancellation).
CLOSE_TIMEOUT = 5.0
#: After the final line, how long to wait for the end of the body so the
#: connection can go back to the pool (best effort; the run is complete either way).
DRAIN_TIMEOUT = 1.0
#: How much of an error body is read to find the engine's message.
MAX_ERROR_BODY = 64 * 1024
#: The longest wait for the answer to the request repeated without streaming after an
#: empty streamed answer (see :meth:`HTTPAdapter.explain_empty`).
PROBE_TIMEOUT = 30.0
#: The longest wait for an engine's list of models (:meth:`HTTPAdapter.served_models`).
HEALTH_TIMEOUT = 5.0
#: The longest line (NDJSON line, SSE field) accepted before the stream is refused.
MAX_LINE = 16 * 1024 * 1024
#: How much of an engine message (or of a bad line) is quoted in an AdapterError.
MAX_QUOTE = 500
#: The retry hint (seconds) of an engine's 429 or 503 that gives no ``Retry-After`` (or
#: one that is no number of seconds nor a date): the status itself says to ask again
#: later, and a caller is never left without a hint (the gate's before it has seen a
#: grant is the same).
ENGINE_RETRY_AFTER = 1.0
#: The reasons of the statuses by which an engine turns a run away for now.
BUSY_REASONS = {429: "engine_busy", 503: "engine_unavailable"}


def quote(text: str, limit: int = MAX_QUOTE) -> str:
    """``text`` on one line, shortened to ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- error mapping ---------------------------------------------------------------------------


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


# --- stream formats (sans-IO) ----------------------------------------------------------------

_ANY_EOL = re.compile(rb"\r\n|\r|\n")
_LF = re.compile(rb"\n")


class LineTooLong(ValueError):
    pass


class LineSplitter:
    """Cuts a byte stream into lines, whatever the chunking.

    With ``cr=True`` (server-sent events) CRLF, LF and a lone CR each end a
    line; otherwise (NDJSON) only LF does and a CR before it is dropped. Only
    these bytes split: a JSON string holding U+2028 or U+0085 stays one line
    (``str.splitlines`` would cut it). :meth:`feed` raises
    :class:`LineTooLong` when an unfinished line exceeds ``max_line`` bytes.
    """

    def __init__(self, *, cr: bool, max_line: int = MAX_LINE) -> None:
        self._cr = cr
        self._eol = _ANY_EOL if cr else _LF
        self._buffer = bytearray()
        self._after_cr = False
        self._max_line = max_line

    def __repr__(self) -> str:
        return f"<LineSplitter cr={self._cr} buffered={len(self._buffer)}>"

    def feed(self, data: bytes) -> list[bytes]:
        """The lines completed by ``data``, without their line ends."""
        if self._after_cr:
            # a CR ended the last chunk: an LF opening this one belongs to it
            self._after_cr = False
            if data.startswith(b"\n"):
                data = data[1:]
        start = len(self._buffer)  # the buffer holds no line end
        self._buffer += data
        buf = self._buffer
        lines: list[bytes] = []
        pos = 0
        for match in self._eol.finditer(buf, start):
            line = bytes(buf[pos : match.start()])
            lines.append(line if self._cr or not line.endswith(b"\r") else line[:-1])
            pos = match.end()
        if self._cr and pos == len(buf) and buf.endswith(b"\r"):
            self._after_cr = True
        del buf[:pos]
        if len(buf) > self._max_line:
            raise LineTooLong(f"a line is longer than {self._max_line} bytes")
        return lines

    @property
    def at_line_start(self) -> bool:
        """Whether the next byte fed starts a line (nothing of an unfinished one held)."""
        return not self._buffer and not self._after_cr

    def flush(self) -> bytes | None:
        """At the end of the stream: the unterminated last line, or None."""
        if not self._buffer:
            return None
        rest = bytes(self._buffer)
        self._buffer.clear()
        return rest if self._cr or not rest.endswith(b"\r") else rest[:-1]


@attrs.frozen
class SSEEvent:
    """One dispatched server-sent event; ``data`` lines are joined with LF."""

    data: str
    event: str = "message"
    id: str = ""


class SSEDecoder:
    """Server-sent events as the HTML standard parses them ("event stream interpretation").

    Lines end with CRLF, LF or CR; a leading BOM is dropped; ``:`` starts a
    comment; ``field: value`` loses one space after the colon; a line without
    a colon is a field with an empty value; ``data`` lines accumulate and a
    blank line dispatches the event (none if it had no data). An event cut off
    by the end of the stream is discarded, as the standard says. One
    deliberate extension: a field named ``error`` (llama.cpp's server writes
    ``error: {json}`` mid-stream) is taken as ``event: error`` with that
    value as its data; any other unknown field is ignored.
    """

    def __init__(self, *, max_line: int = MAX_LINE) -> None:
        self._lines = LineSplitter(cr=True, max_line=max_line)
        self._data: list[str] = []
        self._event = ""
        self._last_id = ""
        self._first = True

    def __repr__(self) -> str:
        return f"<SSEDecoder pending_data_lines={len(self._data)}>"

    def feed(self, data: bytes) -> list[SSEEvent]:
        """The events completed by ``data``. Raises :class:`LineTooLong`."""
        if (
            not self._first
            and not self._data
            and not self._event
            and data.endswith(b"\n\n")
            and self._lines.at_line_start
            and b"\r" not in data
        ):
            whole = self._whole_data_events(data)
            if whole is not None:
                return whole
        events = []
        for raw in self._lines.feed(data):
            event = self._line(raw.decode("utf-8", "replace"))
            if event is not None:
                events.append(event)
        return events

    def _whole_data_events(self, data: bytes) -> list[SSEEvent] | None:
        """The events of ``data`` if it is whole ``data: ...`` events and nothing else (what
        an engine writes, one a token), else None: the line-by-line path decides. Between
        events (nothing held), they are parsed exactly as that path would."""
        events = []
        for block in data[:-2].split(b"\n\n"):
            if not block.startswith(b"data:") or b"\n" in block:
                return None
            value = block[6:] if block.startswith(b"data: ") else block[5:]
            events.append(SSEEvent(value.decode("utf-8", "replace"), "message", self._last_id))
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if self._first:
            self._first = False
            line = line.removeprefix("\ufeff")
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id":
            if "\0" not in value:
                self._last_id = value
        elif field == "error":
            self._event = "error"
            self._data.append(value)
        return None

    def _dispatch(self) -> SSEEvent | None:
        data, event = self._data, self._event
        self._data, self._event = [], ""
        if not data:
            return None
        return SSEEvent("\n".join(data), event or "message", self._last_id)


# --- the adapter base ------------------------------------------------------------------------


def _url_problem(value: object) -> str | None:
    try:
        url = httpx.URL(value) if isinstance(value, str) else None
    except httpx.InvalidURL:
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.host:
        shown = redact_url(value) if isinstance(value, str) else value
        return f"must be an http(s) URL, not {shown!r}"
    return None


#: The check of an engine's ``base_url``.
check_base_url = field_check(_url_problem)
_seconds = field_check(lambda value: seconds_problem(value, positive=True))


@attrs.frozen(kw_only=True)
class HTTPSettings:
    """How an HTTP adapter reaches its engine: the config keys its kinds share.

    Timeouts (seconds): ``connect_timeout`` to open a connection (and to get
    one from the pool), ``write_timeout`` to send the request, ``read_timeout``
    for each wait on the engine, both for the response headers (which some
    engines send only once the model is loaded) and between two chunks of
    the stream; None waits for ever. ``headers`` go with every request (for a
    proxy in front of the engine, say). Environment proxy settings are
    ignored unless ``trust_env``. A bad value raises ValueError naming the key.
    """

    base_url: str = attrs.field(validator=check_base_url)
    connect_timeout: float = attrs.field(default=DEFAULT_CONNECT_TIMEOUT, validator=_seconds)
    read_timeout: float | None = attrs.field(default=DEFAULT_READ_TIMEOUT, validator=_seconds)
    write_timeout: float = attrs.field(default=DEFAULT_WRITE_TIMEOUT, validator=_seconds)
    headers: dict[str, str] = attrs.field(factory=dict)
    trust_env: bool = False


class EngineResponse:
    """A streamed 2xx response being read; every httpx error becomes an AdapterError.

    ``where`` (engine, URL, model) prefixes every message.
    """

    def __init__(self, response: httpx.Response, where: str, timeout: httpx.Timeout) -> None:
        self.response = response
        self.where = where
        self._timeout = timeout
        coding = response.headers.get("content-encoding", "").strip().lower()
        # the raw bytes when there is nothing to decode: the same bytes, two generator
        # layers fewer a chunk (an engine writes one a token)
        plain = coding in ("", "identity")
        self._chunks = response.aiter_raw() if plain else response.aiter_bytes()
        self.received = 0  # body bytes so far

    def __repr__(self) -> str:
        return (
            f"<EngineResponse {self.where} HTTP {self.response.status_code} read={self.received}>"
        )

    @property
    def content_type(self) -> str:
        return str(self.response.headers.get("content-type", "")).lower()

    async def read(self) -> bytes:
        """The next piece of the body; ``b""`` at its end."""
        try:
            data = await anext(self._chunks)
        except StopAsyncIteration:
            return b""
        except httpx.HTTPError as exc:
            raise transport_error(exc, self.where, self._timeout, streaming=True) from exc
        self.received += len(data)
        return data

    async def read_all(self, limit: int) -> bytes:
        """The rest of the body; ``bad_response`` past ``limit`` bytes."""
        parts = []
        size = 0
        while data := await self.read():
            parts.append(data)
            size += len(data)
            if size > limit:
                raise AdapterError("bad_response", f"{self.where}: response over {limit} bytes")
        return b"".join(parts)

    async def drain(self) -> None:
        """Best effort, after the final line: read the end of the body so the connection
        can be reused. Never fails; gives up after :data:`DRAIN_TIMEOUT` or 64 KiB."""
        with trio.move_on_after(DRAIN_TIMEOUT):
            size = 0
            try:
                while size < 64 * 1024 and (data := await self.read()):
                    size += len(data)
            except AdapterError:
                pass

    async def aclose(self) -> None:
        """Close the response (and its connection, if unfinished), even when cancelled."""
        with trio.move_on_after(CLOSE_TIMEOUT, shield=True):
            try:
                aclose = getattr(self._chunks, "aclose", None)
                if aclose is not None:
                    with suppress(httpx.HTTPError):
                        await aclose()
            finally:
                with suppress(httpx.HTTPError):
                    await self.response.aclose()


class EngineStream:
    """The chunks of one run, as :meth:`Adapter.open_stream` yields them."""

    def __init__(self, chunks: AsyncGenerator[Chunk, None], *, run_id: str, where: str) -> None:
        self._chunks = chunks
        self.run_id = run_id
        self.where = where

    def __repr__(self) -> str:
        return f"<EngineStream run {self.run_id} from {self.where}>"

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> Chunk:
        return await anext(self._chunks)

    async def aclose(self) -> None:
        await self._chunks.aclose()


class HTTPAdapter(Adapter):
    """Base of the HTTP adapters: one shared httpx client, reaching the engine as ``settings`` say.

    The client is made on first use and closed by :meth:`aclose`; an injected
    ``client`` is used as it is (the settings' timeouts still apply to each
    request) and is left open for its owner.
    """

    settings_type = HTTPSettings

    def __init__(
        self,
        name: str,
        settings: HTTPSettings,
        *,
        max_concurrency: int | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(name, capabilities=Capabilities(max_concurrency=max_concurrency))
        self.settings = settings
        self.base_url = settings.base_url.rstrip("/")
        read = settings.read_timeout
        self.timeout = httpx.Timeout(
            connect=float(settings.connect_timeout),
            read=None if read is None else float(read),
            write=float(settings.write_timeout),
            pool=float(settings.connect_timeout),
        )
        self._client = client
        self._owns_client = client is None
        # the pool under the client this adapter made, which routes every URL to it (no
        # proxies from the environment): a run's request goes to it straight
        self._transport: httpx.AsyncHTTPTransport | None = None

    def __repr__(self) -> str:
        cap = self.capabilities.max_concurrency
        return (
            f"<{type(self).__name__} {self.name!r} base_url={redact_url(self.base_url)!r} "
            f"max_concurrency={cap}>"
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def client(self) -> httpx.AsyncClient:
        """The shared client (made on first use, again after :meth:`aclose`)."""
        if self._client is None or (self._owns_client and self._client.is_closed):
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
            if self.settings.trust_env:  # the client picks a proxy a URL
                self._client = httpx.AsyncClient(
                    timeout=self.timeout, limits=limits, trust_env=True
                )
            else:
                self._transport = httpx.AsyncHTTPTransport(limits=limits)
                self._client = httpx.AsyncClient(
                    timeout=self.timeout, transport=self._transport, trust_env=False
                )
            self._owns_client = True
        return self._client

    async def aclose(self) -> None:
        """Close the client this adapter made (an injected one is left open)."""
        if self._client is not None and self._owns_client:
            client, self._client, self._transport = self._client, None, None
            await client.aclose()  # and its transport

    async def _send_streamed(
        self, client: httpx.AsyncClient, request: httpx.Request
    ) -> httpx.Response:
        """``client.send(request, stream=True)``; for the client this adapter made, straight
        to its transport: the same request (built by the client: headers, timeouts) and
        the same pool, without the client's auth, redirect, cookie and logging layers,
        which this adapter does not use and which cost about 0.3 ms of CPU a request."""
        transport = self._transport  # set only with the client this adapter made
        if transport is None:
            return await client.send(request, stream=True)
        response = await transport.handle_async_request(request)
        response.request = request
        return response

    def where(self, url: str, model: str) -> str:
        """How messages name an engine endpoint and model."""
        return f"{self.kind} engine at {redact_url(url)} (model {model!r})"

    def request_headers(self) -> dict[str, str]:
        """Headers of every request (subclasses add e.g. Authorization)."""
        return dict(self.settings.headers)

    @abc.abstractmethod
    def url(self, request: AdapterRequest) -> str:
        """Where ``request`` is POSTed."""

    @abc.abstractmethod
    def request_body(self, request: AdapterRequest) -> dict[str, Any]:
        """The JSON body for ``request``; AdapterError("invalid_params") for bad params."""

    @abc.abstractmethod
    def probe_body(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``body`` asked without streaming and for as little output as the engine allows."""

    @abc.abstractmethod
    def models_url(self) -> str:
        """Where the engine lists the models it serves (GET)."""

    @abc.abstractmethod
    def model_names(self, body: Any) -> frozenset[str] | None:
        """The model names in the engine's (decoded JSON) list; None if it is not one."""

    probed = True

    async def served_models(self) -> frozenset[str]:
        """GET :meth:`models_url` within :data:`HEALTH_TIMEOUT` seconds: the names served.

        AdapterError as for a run (``timeout``, ``connection``, ``engine_error``), or
        ``bad_response`` for an answer that is not a list of models.
        """
        url = self.models_url()
        where = f"{self.kind} engine at {redact_url(url)}"
        timeout = httpx.Timeout(HEALTH_TIMEOUT)
        with trio.move_on_after(HEALTH_TIMEOUT * 2) as bounded:
            try:
                response = await self.client.get(
                    url, headers=self.request_headers(), timeout=timeout
                )
            except httpx.HTTPError as exc:
                raise transport_error(exc, where, timeout, streaming=False) from None
        if bounded.cancelled_caught:
            raise AdapterError("timeout", f"{where}: no list of models within {HEALTH_TIMEOUT}s")
        if not response.is_success:
            raise AdapterError(
                "engine_error", f"{where}: HTTP {response.status_code}: {quote(response.text)}"
            )
        try:
            names = self.model_names(response.json())
        except ValueError:
            names = None
        if names is None:
            raise AdapterError("bad_response", f"{where}: the answer is not a list of models")
        return names

    @abc.abstractmethod
    def chunks(
        self, response: EngineResponse, request: AdapterRequest
    ) -> AsyncGenerator[Chunk, None]:
        """The run's chunks from a 2xx ``response``; AdapterError for a bad stream.

        A stream that ends without the engine's sign that it finished raises
        ``bad_response``; one with no data at all ``empty_response``.
        """

    @asynccontextmanager
    async def open_stream(self, request: AdapterRequest) -> AsyncIterator[AsyncIterator[Chunk]]:
        """POST the request and yield its chunks; see :class:`~iop_trio.adapters.base.Adapter`.

        An empty 2xx answer is explained with :meth:`explain_empty` once the
        response is closed.
        """
        url, body = self.url(request), self.request_body(request)
        try:
            async with self.post_stream(url, body, request) as response:
                stream = EngineStream(
                    self.chunks(response, request), run_id=request.run_id, where=response.where
                )
                try:
                    yield stream
                finally:
                    await stream.aclose()
        except AdapterError as exc:
            if exc.reason != "empty_response":
                raise
            raise await self.explain_empty(url, body, request, exc) from None

    async def explain_empty(
        self, url: str, body: Mapping[str, Any], request: AdapterRequest, empty: AdapterError
    ) -> AdapterError:
        """The error to report for an empty streamed answer to ``body``.

        Some engines (llama.cpp's server, for a prompt longer than its context)
        answer a streamed request 200 with an empty body, and the same request
        without streaming with the error. So the request is asked once more
        without streaming and for as little output as the engine allows
        (:meth:`probe_body`; sent again once if the connection turns out to be
        gone), bounded by :data:`PROBE_TIMEOUT`: an error status
        becomes the run's error, with the engine's message; anything else
        leaves ``empty``, saying what the second answer was.
        """
        where = self.where(url, request.model)
        timeout = self._probe_timeout()
        status = 0
        try:
            with trio.move_on_after(PROBE_TIMEOUT) as scope:
                async with self._post_plain(url, self.probe_body(body), where) as plain:
                    status = plain.response.status_code
        except AdapterError as exc:
            return AdapterError(
                exc.reason,
                f"{exc.message} (the engine's answer to the request without "
                "streaming, after an empty streamed answer)",
                retry_after=exc.retry_after,
            )
        except httpx.HTTPError as exc:
            detail = transport_error(exc, where, timeout, streaming=False).message
            return AdapterError(empty.reason, f"{empty.message}; asked again: {detail}")
        if scope.cancelled_caught:
            return AdapterError(
                empty.reason, f"{empty.message}; asked again, no answer within {PROBE_TIMEOUT:g}s"
            )
        return AdapterError(
            empty.reason,
            f"{empty.message} (the same request without streaming was accepted, HTTP {status})",
        )

    async def probe_generation(self, request: AdapterRequest) -> None:
        """Ask the engine for the smallest answer to ``request`` it allows: the run's body
        without streaming and for as little output as the engine allows
        (:meth:`probe_body`: one token), its answer read whole, all within
        :data:`PROBE_TIMEOUT` (or the adapter's ``read_timeout``, if shorter).

        Returns once the engine has answered 2xx with a JSON value that is no error;
        raises AdapterError as a run would otherwise (``unresponsive`` when the engine
        did not answer in time).
        """
        url = self.url(request)
        body = self.probe_body(self.request_body(request))
        where = self.where(url, request.model)
        timeout = self._probe_timeout()
        answer: Any = None
        try:
            with trio.move_on_after(PROBE_TIMEOUT) as scope:
                async with self._post_plain(url, body, where) as plain:
                    answer = parse_json(await plain.read_all(MAX_LINE), where)
        except httpx.HTTPError as exc:
            raise transport_error(exc, where, timeout, streaming=False) from None
        if scope.cancelled_caught:
            raise AdapterError(
                "timeout",
                f"{where}: no answer to a request for one token within {PROBE_TIMEOUT:g}s",
                unresponsive=True,
            )
        message = json_error(answer)
        if message is not None:
            raise AdapterError("engine_error", f"{where}: engine error: {quote(message)}")

    def _probe_timeout(self) -> httpx.Timeout:
        """The timeouts of a request for one token: :data:`PROBE_TIMEOUT`, or the
        adapter's ``read_timeout`` if that is shorter."""
        return httpx.Timeout(min(PROBE_TIMEOUT, self.timeout.read or PROBE_TIMEOUT))

    @asynccontextmanager
    async def _post_plain(
        self, url: str, body: Mapping[str, Any], where: str
    ) -> AsyncIterator[EngineResponse]:
        """POST ``body`` (asked without streaming), with :meth:`_probe_timeout`, and yield
        its 2xx response, unread; sent once more, on a new connection, if the pooled one
        turns out gone (the engine may close the connection of an empty answer:
        llama.cpp's server resets it). AdapterError for another status (with the
        engine's message) or a body JSON cannot carry; httpx errors are raised as they
        are. Closed on leaving."""
        client = self.client
        timeout = self._probe_timeout()
        try:
            http_request = client.build_request(
                "POST", url, json=body, headers=self.request_headers(), timeout=timeout
            )
        except (TypeError, ValueError) as exc:
            raise AdapterError(
                "invalid_params", f"{where}: cannot send the request: {exc}"
            ) from exc
        try:
            response = await client.send(http_request, stream=True)
        except (httpx.NetworkError, httpx.RemoteProtocolError):
            response = await client.send(http_request, stream=True)
        plain = EngineResponse(response, where, timeout)
        try:
            if not response.is_success:
                await self._raise_status(plain)
            yield plain
        finally:
            await plain.aclose()

    @asynccontextmanager
    async def post_stream(
        self, url: str, body: Mapping[str, Any], request: AdapterRequest
    ) -> AsyncIterator[EngineResponse]:
        """POST ``body`` as JSON and yield the 2xx response, streamed.

        Raises AdapterError for transport faults and non-2xx statuses (after
        reading up to :data:`MAX_ERROR_BODY` of the body for the engine's
        message). The response is closed before this returns, whatever the
        way out, cancellation included.
        """
        where = self.where(url, request.model)
        client = self.client
        try:
            http_request = client.build_request(
                "POST", url, json=body, headers=self.request_headers(), timeout=self.timeout
            )
        except (TypeError, ValueError) as exc:  # a param value JSON cannot carry
            raise AdapterError(
                "invalid_params", f"{where}: cannot send the request: {exc}"
            ) from exc
        try:
            response = await self._send_streamed(client, http_request)
        except httpx.HTTPError as exc:
            raise transport_error(exc, where, self.timeout, streaming=False) from exc
        engine = EngineResponse(response, where, self.timeout)
        try:
            if not response.is_success:
                await self._raise_status(engine)
            yield engine
        finally:
            await engine.aclose()

    async def _raise_status(self, engine: EngineResponse) -> NoReturn:
        body = b""
        try:
            while len(body) < MAX_ERROR_BODY and (data := await engine.read()):
                body += data
        except AdapterError:
            pass  # the status says enough
        response = engine.response
        raise status_error(
            response.status_code,
            response.reason_phrase,
            body[:MAX_ERROR_BODY],
            engine.where,
            retry_after=response.headers.get("retry-after"),
        )
