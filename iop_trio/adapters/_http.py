"""Shared HTTP plumbing of the engine adapters (``ollama``, ``openai``) on trio.

:class:`HTTPAdapter` sends a run's request on its own kept-alive h11 connections
(:mod:`.engine_http`), and everything else (the probes, the models list, the metrics
scrape) through one ``httpx.AsyncClient`` per adapter instance; it turns every way
an HTTP exchange can go wrong into an :class:`AdapterError` whose message names the
engine URL and the model; the table of those ways is in :mod:`.http_errors`, which
holds the mapping (the h11 path raises httpx's exceptions, so one table serves both).

The stream formats (NDJSON lines, server-sent events) are parsed by the
sans-IO :class:`~.stream_formats.LineSplitter` and
:class:`~.stream_formats.SSEDecoder`, which the adapters feed with the body bytes as
they come.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from typing import Any, NoReturn, Self
from urllib.parse import urlsplit

import attrs
import httpx
import trio

from ..model import Capabilities, field_check, redact_url, seconds_problem
from .base import Adapter, AdapterError, AdapterRequest, Chunk
from .engine_http import (
    EnginePool,
    Exchange,
    encode_headers,
    encode_json,
    open_exchange,
    parse_url,
)
from .http_errors import json_error, parse_json, quote, status_error, transport_error
from .stream_formats import MAX_LINE

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


class EngineResponse(abc.ABC):
    """A response being read, its body streamed; every fault is an AdapterError whose
    message starts with ``where`` (engine, URL, model).

    Two ways in: :class:`H11Response` (a run's stream on the adapter's own
    :class:`~.engine_http.EnginePool`) and :class:`HttpxResponse` (httpx: the probes, and
    a run's stream on an injected client or one that follows the environment's proxies).
    Header names are looked up in lower case.
    """

    def __init__(
        self,
        where: str,
        timeout: httpx.Timeout,
        *,
        status_code: int,
        reason_phrase: str,
        headers: Mapping[str, str],
    ) -> None:
        self.where = where
        self.timeout = timeout
        self.status_code = status_code
        self.reason_phrase = reason_phrase
        self.headers = headers
        self.received = 0  # body bytes so far, decoded

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.where} HTTP {self.status_code} read={self.received}>"

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def content_type(self) -> str:
        return str(self.headers.get("content-type", "")).lower()

    @abc.abstractmethod
    async def receive(self) -> bytes:
        """The next piece of the body as it came (decoded); ``b""`` at its end; httpx's
        exception for a fault."""

    async def read(self) -> bytes:
        """The next piece of the body; ``b""`` at its end."""
        try:
            data = await self.receive()
        except httpx.HTTPError as exc:
            raise transport_error(exc, self.where, self.timeout, streaming=True) from exc
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

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close the response (and its connection, if unfinished), even when cancelled;
        never raises."""


class H11Response(EngineResponse):
    """A response on the adapter's own pool (:mod:`.engine_http`): each read is one
    network read's body bytes; closing puts a connection whose exchange ended back."""

    def __init__(self, exchange: Exchange, where: str, timeout: httpx.Timeout) -> None:
        super().__init__(
            where,
            timeout,
            status_code=exchange.status,
            reason_phrase=exchange.reason,
            headers=exchange.headers,
        )
        self.exchange = exchange

    async def receive(self) -> bytes:
        return await self.exchange.read()

    async def aclose(self) -> None:
        await self.exchange.aclose()


class HttpxResponse(EngineResponse):
    """A response read through httpx (raw bytes when there is nothing to decode)."""

    def __init__(self, response: httpx.Response, where: str, timeout: httpx.Timeout) -> None:
        super().__init__(
            where,
            timeout,
            status_code=response.status_code,
            reason_phrase=response.reason_phrase,
            headers=response.headers,
        )
        self.response = response
        coding = response.headers.get("content-encoding", "").strip().lower()
        plain = coding in ("", "identity")
        self._chunks = response.aiter_raw() if plain else response.aiter_bytes()

    async def receive(self) -> bytes:
        try:
            return await anext(self._chunks)
        except StopAsyncIteration:
            return b""

    async def aclose(self) -> None:
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
        #: where a run's stream goes (:mod:`.engine_http`): the adapter's own kept-alive
        #: h11 connections; None with an injected client or ``trust_env`` (a proxy the
        #: environment names), whose runs go through httpx
        self.engine_pool = EnginePool() if client is None and not settings.trust_env else None

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
    def server(self) -> tuple[str, int] | None:
        parts = urlsplit(self.base_url)
        if parts.hostname is None:
            return None
        return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)

    @property
    def client(self) -> httpx.AsyncClient:
        """The shared client (made on first use, again after :meth:`aclose`)."""
        if self._client is None or (self._owns_client and self._client.is_closed):
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
            self._client = httpx.AsyncClient(
                timeout=self.timeout, limits=limits, trust_env=self.settings.trust_env
            )
            self._owns_client = True
        return self._client

    async def aclose(self) -> None:
        """Close the client this adapter made (an injected one is left open) and the idle
        connections of its pool (a new pool, with the same connector, takes the next run)."""
        if self.engine_pool is not None:
            pool = self.engine_pool
            self.engine_pool = EnginePool(connector=pool.connector)
            await pool.aclose()
        if self._client is not None and self._owns_client:
            client, self._client = self._client, None
            await client.aclose()

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

    async def health_get(self, url: str, what: str) -> httpx.Response:
        """GET ``url`` (not a run: a list, the metrics) within :data:`HEALTH_TIMEOUT`
        seconds, whatever it answers; AdapterError ``timeout`` ("no ``what`` within"),
        or as for a run's transport (``connection``...) if there is no answer."""
        where = f"{self.kind} engine at {redact_url(url)}"
        timeout = httpx.Timeout(HEALTH_TIMEOUT)
        with trio.move_on_after(HEALTH_TIMEOUT * 2) as bounded:
            try:
                return await self.client.get(url, headers=self.request_headers(), timeout=timeout)
            except httpx.HTTPError as exc:
                raise transport_error(exc, where, timeout, streaming=False) from None
        assert bounded.cancelled_caught
        raise AdapterError("timeout", f"{where}: no {what} within {HEALTH_TIMEOUT}s")

    async def served_models(self) -> frozenset[str]:
        """GET :meth:`models_url` within :data:`HEALTH_TIMEOUT` seconds: the names served.

        AdapterError as for a run (``timeout``, ``connection``, ``engine_error``), or
        ``bad_response`` for an answer that is not a list of models.
        """
        url = self.models_url()
        where = f"{self.kind} engine at {redact_url(url)}"
        response = await self.health_get(url, "list of models")
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
                    status = plain.status_code
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
        plain = HttpxResponse(response, where, timeout)
        try:
            if not plain.is_success:
                await self._raise_status(plain)
            yield plain
        finally:
            await plain.aclose()

    @asynccontextmanager
    async def post_stream(
        self, url: str, body: Mapping[str, Any], request: AdapterRequest
    ) -> AsyncIterator[EngineResponse]:
        """POST ``body`` as JSON and yield the 2xx response, streamed: on the adapter's
        own pool (:attr:`engine_pool`), else through httpx.

        Raises AdapterError for transport faults and non-2xx statuses (after
        reading up to :data:`MAX_ERROR_BODY` of the body for the engine's
        message); ``invalid_params`` for a value JSON or a header cannot carry. The
        response is closed before this returns, whatever the way out, cancellation
        included.
        """
        where = self.where(url, request.model)
        headers = self.request_headers()
        headers.update(request.headers)  # the run's trace context
        if self.engine_pool is None:
            engine = await self._send_httpx(url, body, headers, where)
        else:
            engine = await self._send_h11(self.engine_pool, url, body, headers, where)
        try:
            if not engine.is_success:
                await self._raise_status(engine)
            yield engine
        finally:
            await engine.aclose()

    async def _send_h11(
        self,
        pool: EnginePool,
        url: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        where: str,
    ) -> EngineResponse:
        try:
            payload = encode_json(body)
            head = encode_headers(headers)
        except (TypeError, ValueError) as exc:  # a value JSON or a header cannot carry
            raise AdapterError(
                "invalid_params", f"{where}: cannot send the request: {exc}"
            ) from exc
        try:
            exchange = await open_exchange(pool, parse_url(url), head, payload, self.timeout)
        except httpx.HTTPError as exc:
            raise transport_error(exc, where, self.timeout, streaming=False) from exc
        return H11Response(exchange, where, self.timeout)

    async def _send_httpx(
        self, url: str, body: Mapping[str, Any], headers: Mapping[str, str], where: str
    ) -> EngineResponse:
        client = self.client
        try:
            http_request = client.build_request(
                "POST", url, json=body, headers=headers, timeout=self.timeout
            )
        except (TypeError, ValueError) as exc:  # a param value JSON cannot carry
            raise AdapterError(
                "invalid_params", f"{where}: cannot send the request: {exc}"
            ) from exc
        try:
            response = await client.send(http_request, stream=True)
        except httpx.HTTPError as exc:
            raise transport_error(exc, where, self.timeout, streaming=False) from exc
        return HttpxResponse(response, where, self.timeout)

    async def _raise_status(self, engine: EngineResponse) -> NoReturn:
        body = b""
        try:
            while len(body) < MAX_ERROR_BODY and (data := await engine.read()):
                body += data
        except AdapterError:
            pass  # the status says enough
        raise status_error(
            engine.status_code,
            engine.reason_phrase,
            body[:MAX_ERROR_BODY],
            engine.where,
            retry_after=engine.headers.get("retry-after"),
        )
