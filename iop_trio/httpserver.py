"""A minimal HTTP/1.1 server on Trio and h11, for small operational endpoints.

::

    async def hello(request: HttpRequest) -> HttpResponse:
        return HttpResponse.text(f"hello {request.query.get('name', 'you')}\\n")

    port = await nursery.start(serve_http, {("GET", "/hello"): hello}, "127.0.0.1", 0)

Meant for ``/metrics``, ``/healthz`` and the like, not for serving the
public: every request body is read into memory (bounded), responses are
sent whole, and there is no TLS.

Routing is by exact path. A route whose path ends in ``/`` also matches every
path below it (the longest such prefix wins) and its handler finds the rest
in :attr:`HttpRequest.subpath`. A path that no route matches gets 404; a
matched path asked with a method it has no handler for gets 405 with an
``Allow`` header. ``HEAD`` is served by the ``GET`` handler (without the
body) unless a ``HEAD`` handler is registered.

Each connection runs in its own task and nothing that happens in one (a
handler that raises, a peer that sends garbage or disappears) reaches the
listener: a handler exception becomes a 500 with a short body and is logged.
Connections are kept alive between requests (HTTP/1.1 keep-alive and
pipelining). A whole request, from the moment the server starts waiting for
it until its body is read, must arrive within ``read_timeout``: a peer that
stalls mid-request gets 408 and is dropped; an idle keep-alive connection is
closed silently after the same time.
"""

from __future__ import annotations

import email.utils
import http
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import MappingProxyType
from typing import NoReturn
from urllib.parse import parse_qsl, unquote, urlsplit

import attrs
import h11
import trio

log = logging.getLogger(__name__)

KiB = 1024
MiB = 1024 * KiB
_RECEIVE_SIZE = 64 * KiB
# set by the server from the body; a handler's own values are dropped
_FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding"})


@attrs.frozen
class HttpSettings:
    """Bounds of one server. Every timeout is in seconds.

    ``read_timeout``: the most time for one whole request (headers and body),
    counted from when the server starts waiting for it, so it is also the
    idle keep-alive timeout. ``write_timeout``: the most time to send one
    response. ``max_body``: larger request bodies get 413 (checked against
    ``Content-Length`` before anything is read, and while a chunked body
    arrives). ``max_header_size``: a request line plus headers larger than
    this gets 431. ``max_connections``: connections accepted beyond this are
    closed at once, unanswered. ``linger``: after an error response the
    server stops sending and reads (and drops) what the peer still sends
    for at most this long before closing, so the peer can read the response
    instead of getting a reset.
    """

    read_timeout: float = 10.0
    write_timeout: float = 10.0
    max_body: int = MiB
    max_header_size: int = 16 * KiB
    max_connections: int = 256
    linger: float = 1.0

    def __attrs_post_init__(self) -> None:
        for name in ("read_timeout", "write_timeout", "linger"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value >= 0 and not math.isnan(value)):
                raise ValueError(f"{name} must be a number >= 0, not {value!r}")
        for name in ("max_body", "max_header_size", "max_connections"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, not {value!r}")


_NO_STRINGS: Mapping[str, str] = MappingProxyType({})


@attrs.frozen
class HttpRequest:
    """One request, its body read whole.

    ``path`` is the percent-decoded path without the query; ``subpath`` is
    what follows the route's prefix for a prefix route (``/runs/`` asked as
    ``/runs/a/b`` gives ``a/b``) and ``""`` for an exact route. ``query``
    maps each query parameter to its value, decoded; a parameter given twice
    keeps its last value and one without ``=`` maps to ``""``. ``headers``
    has lower-case names; a header given several times maps to its values
    joined by ``", "``. ``client`` is the peer's ``host:port`` (``""`` if
    unknown).
    """

    method: str
    path: str
    query: Mapping[str, str] = _NO_STRINGS
    headers: Mapping[str, str] = _NO_STRINGS
    body: bytes = b""
    subpath: str = ""
    client: str = ""

    def __repr__(self) -> str:
        query = f"?{len(self.query)} params" if self.query else ""
        return f"<HttpRequest {self.method} {self.path}{query} body={len(self.body)}B>"


@attrs.frozen
class HttpResponse:
    """What a handler returns; the server sets ``Content-Length`` from ``body``.

    ``headers`` are extra (name, value) pairs; ``Content-Length`` and
    ``Transfer-Encoding`` among them are ignored. A 204 or 304 must have an
    empty body. A response the server cannot send (bad status or header)
    is replaced by a 500, as if the handler had raised.
    """

    status: int = 200
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: Sequence[tuple[str, str]] = ()

    @classmethod
    def text(
        cls, text: str, status: int = 200, *, headers: Sequence[tuple[str, str]] = ()
    ) -> HttpResponse:
        """A ``text/plain`` UTF-8 response."""
        return cls(status, text.encode(), headers=headers)

    def __repr__(self) -> str:
        return f"<HttpResponse {self.status} {self.content_type} body={len(self.body)}B>"


Route = Callable[[HttpRequest], Awaitable[HttpResponse]]
Routes = Mapping[tuple[str, str], Route]


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return ""


def _error(status: int, detail: str = "", headers: Sequence[tuple[str, str]] = ()) -> HttpResponse:
    text = (_phrase(status) or "error").lower()
    return HttpResponse.text(f"{text}{': ' + detail if detail else ''}\n", status, headers=headers)


class _Router:
    """(method, path) -> handler, by exact path, then by the longest ``/``-ending prefix."""

    def __init__(self, routes: Routes) -> None:
        self._paths: dict[str, dict[str, Route]] = {}
        for (method, path), handler in routes.items():
            if not method or method != method.upper() or not method.isascii():
                raise ValueError(f"route method must be upper-case ASCII, not {method!r}")
            if not path.startswith("/"):
                raise ValueError(f"route path must start with '/', not {path!r}")
            if not callable(handler):
                raise TypeError(f"the handler for {method} {path} is not callable")
            self._paths.setdefault(path, {})[method] = handler
        self._prefixes = sorted((p for p in self._paths if p.endswith("/")), key=len, reverse=True)

    def __len__(self) -> int:
        return sum(len(methods) for methods in self._paths.values())

    def match(self, path: str) -> tuple[Mapping[str, Route], str] | None:
        """The handlers by method for ``path`` and the subpath, or None (404)."""
        methods = self._paths.get(path)
        if methods is not None:
            return methods, ""
        for prefix in self._prefixes:
            if path.startswith(prefix):
                return self._paths[prefix], path[len(prefix) :]
        return None

    @staticmethod
    def allowed(methods: Mapping[str, Route]) -> str:
        names = set(methods)
        if "GET" in names:
            names.add("HEAD")
        return ", ".join(sorted(names))


class _Drop(Exception):
    """The connection is over: the peer left, stalled or broke the protocol past answering."""


def _split_target(target: str) -> tuple[str, dict[str, str]] | None:
    """(decoded path, query) of a request target; None for one the server cannot route."""
    if target.startswith(("http://", "https://")):  # the absolute form
        parts = urlsplit(target)
        raw_path, raw_query = parts.path or "/", parts.query
    else:  # the origin form; urlsplit would take "//a/b" for a host and a path
        raw_path, _, raw_query = target.partition("?")
    if not raw_path.startswith("/"):
        return None
    path = unquote(raw_path, errors="strict")
    segments = path.split("/")
    if "." in segments or ".." in segments or "\x00" in path:
        return None
    query = dict(parse_qsl(raw_query, keep_blank_values=True, errors="strict"))
    return path, query


class HttpServer:
    """Serves ``routes`` (see the module docstring) with the bounds of ``settings``.

    One instance may serve several listeners at once. ``open_connections``,
    ``connections_total`` and ``requests_total`` count what it has done;
    :meth:`wait_idle` waits until no connection is open.
    """

    def __init__(self, routes: Routes, *, settings: HttpSettings | None = None) -> None:
        self._router = _Router(routes)
        self.settings = settings or HttpSettings()
        self.open_connections = 0
        self.connections_total = 0
        self.requests_total = 0
        self._idle = trio.Event()
        self._idle.set()

    def __repr__(self) -> str:
        return (
            f"<HttpServer routes={len(self._router)} open={self.open_connections} "
            f"connections={self.connections_total} requests={self.requests_total}>"
        )

    async def serve(
        self,
        host: str | None = "127.0.0.1",
        port: int = 0,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> NoReturn:
        """Listen on ``host``:``port`` and serve until cancelled.

        Reports the bound port through ``task_status`` (useful with port 0).
        A host that resolves to several addresses (None = all interfaces) gets
        a listener on each; with port 0 they all get the port of the first.
        OSError if the port cannot be bound.
        """
        listeners = await _open_listeners(host, port)
        bound = listeners[0].socket.getsockname()[1]
        log.info("HTTP server listening on %s port %d", host or "*", bound)
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._handle, listeners)
            task_status.started(bound)
            await trio.sleep_forever()
        raise AssertionError("unreachable")  # pragma: no cover

    async def wait_idle(self) -> None:
        """Return when no connection is open (at once if none is)."""
        while self.open_connections:
            await self._idle.wait()
        await trio.lowlevel.checkpoint()

    # --- one connection ------------------------------------------------------------------

    async def _handle(self, stream: trio.SocketStream) -> None:
        """A connection's task. Never raises (but for Cancelled, at shutdown)."""
        if self.open_connections >= self.settings.max_connections:
            log.warning("refusing a connection: %d are open already", self.settings.max_connections)
            await trio.aclose_forcefully(stream)
            return
        self.open_connections += 1
        self.connections_total += 1
        if self._idle.is_set():
            self._idle = trio.Event()
        try:
            await _Connection(self, stream).serve()
        except _Drop:
            pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the peer went away
        except Exception:
            log.exception("HTTP connection failed")
        finally:
            await trio.aclose_forcefully(stream)
            self.open_connections -= 1
            if not self.open_connections:
                self._idle.set()


async def _open_listeners(host: str | None, port: int) -> list[trio.SocketListener]:
    listeners = await trio.open_tcp_listeners(port, host=host)
    ports = {listener.socket.getsockname()[1] for listener in listeners}
    if port == 0 and len(ports) > 1:
        # each address got its own random port: take the first one's for all
        chosen = listeners[0].socket.getsockname()[1]
        for listener in listeners:
            await listener.aclose()
        listeners = await trio.open_tcp_listeners(chosen, host=host)
    return listeners


class _Connection:
    """Reads requests and writes responses on one stream until it is done."""

    def __init__(self, server: HttpServer, stream: trio.SocketStream) -> None:
        self._server = server
        self._settings = server.settings
        self._stream = stream
        self._conn = h11.Connection(
            h11.SERVER, max_incomplete_event_size=server.settings.max_header_size
        )
        try:
            host, port, *_ = stream.socket.getpeername()
            self._client = f"{host}:{port}"
        except (OSError, ValueError, TypeError):
            self._client = ""

    async def serve(self) -> None:
        conn = self._conn
        while True:
            with trio.move_on_after(self._settings.read_timeout) as timer:
                got = await self._read_request()
            if timer.cancelled_caught:
                if conn.their_state is h11.IDLE and not conn.trailing_data[0]:
                    return  # idle keep-alive connection: close quietly
                log.info("HTTP client %s: request not complete in time", self._client)
                await self._reply_and_close(_error(408))
                return
            if got is None:
                return  # the peer closed between requests
            if isinstance(got, HttpResponse):  # the request was refused
                await self._reply_and_close(got)
                return
            self._server.requests_total += 1
            response = await self._dispatch(got)
            await self._send_response(response, head=got.method == "HEAD")
            if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                conn.start_next_cycle()
            else:  # one side asked to close (Connection: close, HTTP/1.0)
                await self._linger()
                return

    async def _read_request(self) -> HttpRequest | HttpResponse | None:
        """The next request; an error response for one refused; None on a clean EOF."""
        conn = self._conn
        start: h11.Request | None = None
        body = bytearray()
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                status = exc.error_status_hint
                return _error(status, "" if status == 431 else str(exc))
            if event is h11.NEED_DATA:
                data = await self._stream.receive_some(_RECEIVE_SIZE)
                try:
                    conn.receive_data(data)
                except RuntimeError:  # data after the peer's EOF: cannot happen
                    raise _Drop from None
            elif isinstance(event, h11.Request):
                start = event
                refused = self._check_start(event)
                if refused is not None:
                    return refused
                if conn.they_are_waiting_for_100_continue:
                    await self._send(h11.InformationalResponse(status_code=100, headers=[]))
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > self._settings.max_body:
                    return _error(413, f"the body is over {self._settings.max_body} bytes")
            elif isinstance(event, h11.EndOfMessage):
                assert start is not None
                return self._request(start, bytes(body))
            elif isinstance(event, h11.ConnectionClosed):
                if start is not None or conn.trailing_data[0]:
                    log.info("HTTP client %s closed in the middle of a request", self._client)
                return None
            else:  # PAUSED cannot come before the request's end
                raise _Drop

    def _check_start(self, event: h11.Request) -> HttpResponse | None:
        # h11 bounds only a head that is still incomplete; one that came whole is checked here
        size = len(event.method) + len(event.target) + 11
        size += sum(len(name) + len(value) + 4 for name, value in event.headers)
        if size > self._settings.max_header_size:
            return _error(431)
        for name, value in event.headers:
            if name == b"content-length" and int(value) > self._settings.max_body:
                return _error(413, f"the body is over {self._settings.max_body} bytes")
        return None

    def _request(self, start: h11.Request, body: bytes) -> HttpRequest | HttpResponse:
        try:
            target = start.target.decode("ascii")
            split = _split_target(target)
        except (UnicodeDecodeError, ValueError):
            split = None
        if split is None:
            return _error(400, "bad request target")
        path, query = split
        headers: dict[str, str] = {}
        for name, value in start.headers:
            key = name.decode("ascii")
            text = value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        return HttpRequest(
            method=start.method.decode("ascii"),
            path=path,
            query=MappingProxyType(query),
            headers=MappingProxyType(headers),
            body=body,
            client=self._client,
        )

    async def _dispatch(self, request: HttpRequest) -> HttpResponse:
        match = self._server._router.match(request.path)
        if match is None:
            return _error(404)
        methods, subpath = match
        handler = methods.get(request.method)
        if handler is None and request.method == "HEAD":
            handler = methods.get("GET")
        if handler is None:
            return _error(405, headers=[("Allow", _Router.allowed(methods))])
        request = attrs.evolve(request, subpath=subpath)
        try:
            response = await handler(request)
            if not isinstance(response, HttpResponse):
                raise TypeError(f"the handler returned {type(response).__name__}")
            self._build(response, head=False)  # a response h11 refuses is the handler's fault
        except Exception:
            log.exception("HTTP handler for %s %s failed", request.method, request.path)
            return _error(500)
        return response

    def _build(self, response: HttpResponse, *, head: bool) -> list[h11.Event]:
        if not 200 <= response.status <= 599:
            raise ValueError(f"a handler cannot send status {response.status}")
        no_body = response.status in (204, 304)
        if no_body and response.body:
            raise ValueError(f"a {response.status} response cannot have a body")
        headers = [("Date", email.utils.formatdate(usegmt=True))]
        if not no_body:
            headers += [
                ("Content-Type", response.content_type),
                ("Content-Length", str(len(response.body))),
            ]
        headers += [(k, v) for k, v in response.headers if k.lower() not in _FRAMING_HEADERS]
        events: list[h11.Event] = [
            h11.Response(
                status_code=response.status,
                headers=headers,
                reason=_phrase(response.status).encode(),
            )
        ]
        if response.body and not head:
            events.append(h11.Data(data=response.body))
        events.append(h11.EndOfMessage())
        return events

    async def _send_response(self, response: HttpResponse, *, head: bool) -> None:
        try:
            events = self._build(response, head=head)
        except (h11.LocalProtocolError, ValueError):
            log.exception("HTTP response %r cannot be sent", response)
            events = self._build(_error(500), head=head)
        await self._send(*events)

    async def _send(self, *events: h11.Event) -> None:
        try:
            data = b"".join(self._conn.send(event) or b"" for event in events)
        except h11.LocalProtocolError as exc:
            # the connection cannot take a response now (e.g. it broke mid-request)
            raise _Drop from exc
        with trio.move_on_after(self._settings.write_timeout) as timer:
            await self._stream.send_all(data)
        if timer.cancelled_caught:
            log.info("HTTP client %s: response not taken in time", self._client)
            raise _Drop

    async def _reply_and_close(self, response: HttpResponse) -> None:
        """Send an error response that ends the connection, then close it gently."""
        if self._conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        closing = attrs.evolve(response, headers=[*response.headers, ("Connection", "close")])
        await self._send_response(closing, head=False)
        await self._linger()

    async def _linger(self) -> None:
        """Stop sending; drop what the peer still sends until it closes, for a bounded time."""
        with trio.move_on_after(self._settings.linger):
            try:
                await self._stream.send_eof()
                while await self._stream.receive_some(_RECEIVE_SIZE):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass


async def serve_http(
    routes: Routes,
    host: str | None = "127.0.0.1",
    port: int = 0,
    *,
    settings: HttpSettings | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Serve ``routes`` on ``host``:``port`` until cancelled; see :class:`HttpServer`.

    ``task_status.started`` gets the bound port, so ``port=0`` picks a free one::

        port = await nursery.start(serve_http, routes, "127.0.0.1", 0)
    """
    await HttpServer(routes, settings=settings).serve(host, port, task_status=task_status)


__all__ = [
    "HttpRequest",
    "HttpResponse",
    "HttpServer",
    "HttpSettings",
    "Route",
    "Routes",
    "serve_http",
]
