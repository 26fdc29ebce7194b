"""A run's engine stream on h11 over Trio streams: the read path of every run (issue 31).

httpx stays for everything that is not a run's stream (health, the metrics scrape,
/tokenize, the probes); a run's POST and its streamed answer go through
:class:`EnginePool`: one h11 connection per request in flight, kept alive and reused.

Semantics:

- **A pool per adapter**, of idle connections by origin (scheme, host, port), at most
  :data:`MAX_IDLE` of them an origin; a connection is taken out for a request and put
  back only when its exchange ended cleanly (the whole body read, nothing after it, an
  HTTP/1.1 answer without ``Connection: close``); any error, a cancel, a response left
  half read, a body that ends at the close or an HTTP/1.0 answer closes it instead.
- **An idle connection the engine closed** (its keep-alive timeout) is seen before
  reuse (its socket is readable: an EOF or bytes nobody asked for) and dropped. A
  request on a reused connection that fails before a byte of its response (the engine
  closed it as the request went) goes once more on a new connection.
- **One send a request**: head and JSON body together (``Accept-Encoding: identity``).
- **Whole reads**: h11 writes the request and reads the response's head; the body's
  framing (chunked, content-length, or until the close) is undone by
  :mod:`.http_body`, a whole network read (up to :data:`READ_SIZE`) at a time, so
  :meth:`Exchange.read` returns every chunk of a read joined and the stream formats
  parse per read, not per event. A body the engine encoded anyway (``gzip``,
  ``deflate``) is decoded; another encoding is ``bad_response``.
- **Errors are httpx's**: every fault is raised as the httpx exception httpx would
  raise for it (``ConnectError``, ``ReadTimeout``, ``RemoteProtocolError``...), so
  :func:`~.http_errors.transport_error` maps both paths to the same AdapterError.
  Timeouts are the adapter's: ``connect`` (TCP and TLS), ``write`` (the send),
  ``read`` (each wait for bytes).
"""

# the timeouts are httpx's Timeout, passed on as they are
# ruff: noqa: ASYNC109
from __future__ import annotations

import json
import select
import zlib
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Mapping
from contextlib import suppress
from functools import lru_cache
from typing import Any

import attrs
import h11
import httpx
import trio

from .. import __version__
from .http_body import Body, BodyError, UntilClose, body_for

#: The most idle connections kept an origin.
MAX_IDLE = 32
#: The most bytes one read takes from the socket.
READ_SIZE = 64 * 1024
#: The bound on closing a connection (shielded).
CLOSE_TIMEOUT = 5.0
USER_AGENT = f"iop-trio/{__version__}".encode()

#: Opens a stream to (host, port), TLS or not: ``open_tcp_stream`` (and TLS) by default;
#: tests put in-memory streams here.
Connector = Callable[[str, int], Awaitable[trio.abc.Stream]]


@attrs.frozen
class Origin:
    """Where a connection goes: scheme, host and port (the pool's key)."""

    scheme: str
    host: str
    port: int

    @classmethod
    def of(cls, url: httpx.URL) -> Origin:
        port = url.port or (443 if url.scheme == "https" else 80)
        return cls(url.scheme, url.host, port)


@lru_cache(maxsize=64)
def parse_url(url: str) -> httpx.URL:
    """``url`` parsed (an adapter POSTs to a few URLs, each parsed once)."""
    return httpx.URL(url)


def encode_json(body: Mapping[str, Any]) -> bytes:
    """``body`` as httpx's ``json=`` sends it (compact, UTF-8); TypeError or ValueError
    for a value JSON cannot carry."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _socket_of(stream: trio.abc.Stream) -> Any:
    """The trio socket under ``stream`` (a TLS stream's transport's), or None."""
    while isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    return getattr(stream, "socket", None)


class EngineConnection:
    """One HTTP/1.1 connection to an engine: an h11 state machine over a Trio stream."""

    def __init__(self, stream: trio.abc.Stream, origin: Origin) -> None:
        self.stream = stream
        self.origin = origin
        self.h11 = h11.Connection(h11.CLIENT)
        self.requests = 0  # sent on this connection so far

    def __repr__(self) -> str:
        where = f"{self.origin.scheme}://{self.origin.host}:{self.origin.port}"
        return f"<EngineConnection {where} requests={self.requests}>"

    def idle_and_open(self) -> bool:
        """Whether this idle connection can take a request: the engine has not closed it
        (nothing to read while idle: neither an EOF nor stray bytes)."""
        sock = _socket_of(self.stream)
        if sock is None:
            return True  # a stream without a socket (a test's): trust it
        try:
            readable, _, _ = select.select([sock.fileno()], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def next_cycle(self) -> None:
        """After an exchange that leaves the connection reusable: a fresh h11 state for
        the next request (h11 read only the last one's head; :mod:`.http_body` its body)."""
        self.h11 = h11.Connection(h11.CLIENT)

    async def aclose(self) -> None:
        """Close the stream, within :data:`CLOSE_TIMEOUT`, even when cancelled."""
        with trio.move_on_after(CLOSE_TIMEOUT, shield=True):
            with suppress(OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                await self.stream.aclose()


class EnginePool:
    """The kept-alive connections of one adapter to its engines (module docstring)."""

    def __init__(
        self,
        *,
        ssl_context: Callable[[], Any] | None = None,
        connector: Connector | None = None,
        max_idle: int = MAX_IDLE,
    ) -> None:
        self._ssl_context = ssl_context or _default_ssl_context
        self._context: Any = None  # made on the first https connection
        #: opens the stream of a new connection (None: TCP, and TLS for https); a test
        #: may put its own here (to count sends, or to split reads)
        self.connector = connector
        self._max_idle = max_idle
        self._idle: defaultdict[Origin, deque[EngineConnection]] = defaultdict(deque)
        self.opened = 0  # connections opened, ever
        self.closed = False

    def __repr__(self) -> str:
        idle = sum(len(q) for q in self._idle.values())
        return f"<EnginePool idle={idle} opened={self.opened} closed={self.closed}>"

    def take_idle(self, origin: Origin) -> EngineConnection | None:
        """The most recently used idle connection to ``origin`` the engine has not closed
        (those it closed are dropped on the way), or None."""
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if conn.idle_and_open():
                return conn
            _close_now(conn)
        return None

    def put_back(self, conn: EngineConnection) -> bool:
        """Keep ``conn``, whose exchange ended cleanly and kept it alive, for the next
        request (True); False if the pool is closed (the caller closes it)."""
        if self.closed:
            return False
        conn.next_cycle()
        idle = self._idle[conn.origin]
        idle.append(conn)
        while len(idle) > self._max_idle:
            _close_now(idle.popleft())
        return True

    async def connect(self, origin: Origin, timeout: httpx.Timeout) -> EngineConnection:
        """A new connection to ``origin`` within the connect timeout (TCP, then TLS for
        https); httpx.ConnectError or ConnectTimeout."""
        with trio.move_on_after(_seconds(timeout.connect)) as bounded:
            try:
                stream = await self._open(origin)
            except (OSError, trio.BrokenResourceError) as exc:
                raise httpx.ConnectError(_detail(exc)) from exc
            self.opened += 1
            return EngineConnection(stream, origin)
        assert bounded.cancelled_caught
        raise httpx.ConnectTimeout(f"no connection within {timeout.connect}s")

    async def _open(self, origin: Origin) -> trio.abc.Stream:
        if self.connector is not None:
            return await self.connector(origin.host, origin.port)
        stream: trio.abc.Stream = await trio.open_tcp_stream(origin.host, origin.port)
        if origin.scheme == "https":
            if self._context is None:
                self._context = self._ssl_context()
            tls = trio.SSLStream(stream, self._context, server_hostname=origin.host)
            try:
                await tls.do_handshake()
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
            stream = tls
        return stream

    async def aclose(self) -> None:
        """Close every idle connection; those in use close when their exchange ends."""
        self.closed = True
        idle = [conn for queue in self._idle.values() for conn in queue]
        self._idle.clear()
        for conn in idle:
            await conn.aclose()


def _detail(exc: BaseException) -> str:
    """What went wrong, for a message: trio's stream errors carry the OS or TLS error that
    broke the stream as their cause (``[SSL: CERTIFICATE_VERIFY_FAILED] ...``)."""
    cause = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) else None
    shown = cause if cause is not None else exc
    return str(shown) or type(shown).__name__


def _default_ssl_context() -> Any:
    """The TLS context httpx's client makes for this adapter (certifi's CAs, verified;
    the environment's ``SSL_CERT_FILE`` ignored, as the client ignores it)."""
    return httpx.create_ssl_context(trust_env=False)


def _close_now(conn: EngineConnection) -> None:
    """Close an idle connection without waiting (a socket stream closes at once)."""
    sock = _socket_of(conn.stream)
    if sock is not None:
        sock.close()


def _seconds(value: float | None) -> float:
    return float("inf") if value is None else value


#: What :func:`encode_headers` makes: a request's header names and values, as sent.
Headers = list[tuple[bytes, bytes]]


def encode_headers(headers: Mapping[str, str]) -> Headers:
    """``headers`` as sent, in ASCII as httpx sends a header; UnicodeEncodeError (a
    ValueError) for one that is not."""
    return [(name.encode("ascii"), value.encode("ascii")) for name, value in headers.items()]


def request_bytes(conn: EngineConnection, url: httpx.URL, headers: Headers, body: bytes) -> bytes:
    """The whole request, head and body, as h11 frames it on ``conn``: ``headers`` after
    the defaults they do not name."""
    head = [
        (b"host", url.netloc),
        (b"user-agent", USER_AGENT),
        (b"accept", b"*/*"),
        (b"accept-encoding", b"identity"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    given = {name.lower() for name, _value in headers}
    head = [(name, value) for name, value in head if name not in given] + headers
    event = h11.Request(method=b"POST", target=url.raw_path, headers=head)
    parts = (event, h11.Data(data=body), h11.EndOfMessage())
    return b"".join(conn.h11.send(part) or b"" for part in parts)


class BodyDecoder:
    """The body as sent: identity, gzip or deflate (zlib or raw); else DecodingError."""

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self._zlib: Any = None
        self._first = True  # deflate: the first bytes tell zlib from raw
        if coding == "gzip":
            self._zlib = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif coding == "deflate":
            self._zlib = zlib.decompressobj()
        elif coding not in ("", "identity"):
            raise httpx.DecodingError(f"content-encoding {coding!r} is not supported")

    def __repr__(self) -> str:
        return f"<BodyDecoder {self.coding or 'identity'}>"

    def decode(self, data: bytes) -> bytes:
        if self._zlib is None or not data:
            return data
        try:
            return bytes(self._zlib.decompress(data))
        except zlib.error as exc:
            if self.coding == "deflate" and self._first:  # raw deflate, no zlib header
                self._first = False
                self._zlib = zlib.decompressobj(-zlib.MAX_WBITS)
                return self.decode(data)
            raise httpx.DecodingError(str(exc)) from exc
        finally:
            self._first = False

    def flush(self) -> bytes:
        if self._zlib is None:
            return b""
        try:
            return bytes(self._zlib.flush())
        except zlib.error as exc:
            raise httpx.DecodingError(str(exc)) from exc


class Exchange:
    """One request and its response on a connection of ``pool``; :func:`open_exchange`
    makes it, with the response's head read. Raises httpx's errors."""

    def __init__(self, pool: EnginePool, conn: EngineConnection, timeout: httpx.Timeout) -> None:
        self.pool = pool
        self.conn = conn
        self.timeout = timeout
        self.status = 0
        self.reason = ""
        self.http_version = ""
        self.headers: dict[str, str] = {}  # names in lower case
        self.received = 0  # bytes read from the socket, head included
        self.keep_alive = False  # the engine lets another request follow on this connection
        self._decoder: BodyDecoder | None = None
        self._body: Body | None = None  # the body's framing
        self._pending = b""  # body bytes that came with the head
        self._eof = False  # the engine closed the connection
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"<Exchange HTTP {self.status} received={self.received} ended={self.ended} "
            f"on {self.conn!r}>"
        )

    async def send(self, data: bytes) -> None:
        """Write the request in one send, within the write timeout."""
        with trio.move_on_after(_seconds(self.timeout.write)) as bounded:
            try:
                await self.conn.stream.send_all(data)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise httpx.WriteError(_detail(exc)) from exc
            self.conn.requests += 1
            return
        assert bounded.cancelled_caught
        raise httpx.WriteTimeout(f"could not send within {self.timeout.write}s")

    async def _receive(self) -> bytes:
        """One read from the socket, within the read timeout (b"" at EOF)."""
        with trio.move_on_after(_seconds(self.timeout.read)) as bounded:
            try:
                data = await self.conn.stream.receive_some(READ_SIZE)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise httpx.ReadError(_detail(exc)) from exc
        if bounded.cancelled_caught:
            raise httpx.ReadTimeout(f"no data within {self.timeout.read}s")
        self.received += len(data)
        return bytes(data)

    def _next_event(self) -> Any:
        try:
            return self.conn.h11.next_event()
        except h11.RemoteProtocolError as exc:
            raise httpx.RemoteProtocolError(str(exc)) from exc

    async def receive_head(self) -> None:
        """Read up to the response's head (1xx answers are skipped); the bytes after it
        go to the body's framing (:func:`~.http_body.body_for`)."""
        while True:
            event = self._next_event()
            if event is h11.NEED_DATA:
                self.conn.h11.receive_data(await self._receive())
            elif isinstance(event, h11.Response):
                self._took_head(event)
                return
            elif isinstance(event, h11.ConnectionClosed):
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
            # an InformationalResponse (100 Continue): the real one follows

    def _took_head(self, event: h11.Response) -> None:
        self.status = event.status_code
        self.reason = event.reason.decode("latin-1")
        self.http_version = event.http_version.decode("latin-1")
        self.headers = {
            name.decode("latin-1"): value.decode("latin-1") for name, value in event.headers
        }
        coding = self.headers.get("content-encoding", "").strip().lower()
        self._decoder = BodyDecoder(coding)
        self._body = body = body_for(self.status, self.headers)
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        self.keep_alive = (
            self.http_version == "1.1"
            and "close" not in tokens
            and not isinstance(body, UntilClose)
        )
        rest, closed = self.conn.h11.trailing_data
        self._pending = self._feed(bytes(rest)) if rest else b""
        self._eof = closed

    def _feed(self, data: bytes) -> bytes:
        """The body bytes in ``data`` (``b""``: the engine closed the connection)."""
        assert self._body is not None
        try:
            if data:
                return self._body.feed(data)
            self._body.eof()
        except BodyError as exc:
            raise httpx.RemoteProtocolError(str(exc)) from exc
        return b""

    async def read(self) -> bytes:
        """The body bytes of the next network read, decoded; ``b""`` at the body's end.

        A fault in the framing (a bad chunk size, the engine closing mid-body) is
        raised by the read after the one that returns the body bytes before it, so
        nothing the engine sent whole is lost to a fault behind it.
        """
        assert self._decoder is not None, "read before the head"
        assert self._body is not None
        while self._pending or not self._body.done:
            if self._pending:
                data, self._pending = self._pending, b""
            elif self._body.fault is not None or self._eof:
                data = self._feed(b"")  # raises, unless a close ends the body
            else:
                raw = await self._receive()
                self._eof = not raw
                data = self._feed(raw) if raw else b""
            data = self._decoder.decode(data)
            if self._body.done and not self._pending:
                data += self._decoder.flush()
            if data:
                return data
        return b""

    @property
    def ended(self) -> bool:
        """The whole body was read."""
        return self._body is not None and self._body.done

    async def aclose(self) -> None:
        """Give the connection back to the pool if the exchange ended cleanly, else close
        it (a response left half read cannot carry another). Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        extra = self._pending or (self._body is not None and self._body.extra)
        reusable = self.ended and self.keep_alive and not extra
        if not (reusable and self.pool.put_back(self.conn)):
            await self.conn.aclose()


#: The faults of a reused connection that may mean the engine closed it as the request
#: went: the request goes once more, on a new connection, if no byte came back.
_STALE = (httpx.WriteError, httpx.ReadError, httpx.RemoteProtocolError)


async def open_exchange(
    pool: EnginePool,
    url: httpx.URL,
    headers: Headers,
    body: bytes,
    timeout: httpx.Timeout,
) -> Exchange:
    """POST ``body`` (JSON) to ``url`` with ``headers`` (:func:`encode_headers`) and
    return the exchange, its head read. On an idle connection if one is open, else a new
    one; once more on a new one if a reused connection fails before any byte of the
    response. Raises httpx's errors; the connection is closed on every way out but a
    return."""
    origin = Origin.of(url)
    conn = pool.take_idle(origin)
    while True:
        reused = conn is not None
        if conn is None:
            conn = await pool.connect(origin, timeout)
        exchange = Exchange(pool, conn, timeout)
        try:
            try:
                data = request_bytes(conn, url, headers, body)
            except h11.LocalProtocolError as exc:  # a header value HTTP cannot carry
                raise httpx.LocalProtocolError(str(exc)) from exc
            await exchange.send(data)
            await exchange.receive_head()
        except _STALE:
            await conn.aclose()
            if not reused or exchange.received:
                raise
            conn = None
            continue
        except BaseException:
            await conn.aclose()
            raise
        return exchange
