"""A WebSocket server for proto-sockets: bearer-token check, routing by path, isolation.

Each connection runs in its own handler; whatever a handler raises is logged
and ends that connection only, never the server (trio-websocket would
otherwise let it crash the listener's nursery). A :class:`~.guard.ConnectionGuard`
bounds the connections and how long they may take to authenticate.
"""

from __future__ import annotations

import hmac
import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import trio
from trio_websocket import (
    ConnectionClosed,
    WebSocketConnection,
    WebSocketRequest,
    wrap_server_stream,
)
from wsproto.utilities import LocalProtocolError

from ..protocol import BATCH_SUBPROTOCOL
from .auth import bearer_token
from .guard import (
    REFUSAL,
    ConnectionGuard,
    GuardedListener,
    GuardedStream,
    Ticket,
    open_guarded_listeners,
)
from .session import DEFAULT_MAX_MESSAGE_SIZE

log = logging.getLogger(__name__)

#: A connection's handler: the WebSocket and who the server let in (what ``authorize``
#: answered).
ConnectionHandler = Callable[[WebSocketConnection, Any], Awaitable[None]]
#: Who the bearer token (None: none sent) of a connection to a path is; None refuses it.
Authorize = Callable[[str, str | None], object | None]


def lone_error(exc: BaseException) -> BaseException:
    """The one error inside ``exc``'s nested exception groups of one error each; ``exc``
    itself if it is no group or a group of several."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def closing_race(exc: BaseException) -> bool:
    """Whether ``exc`` is trio-websocket answering a ping on a connection it is closing
    (wsproto's "Pong cannot be sent in state LOCAL_CLOSING", trio-websocket issue #184):
    the connection is ending anyway, so it is an end, not a failure."""
    error = lone_error(exc)
    return isinstance(error, LocalProtocolError) and "CLOSING" in str(error).upper()


def shared_token(token: str | None) -> Authorize:
    """Everyone with ``token`` (everyone at all for None) is let in, as ``True``."""

    def authorize(path: str, given: str | None) -> bool | None:
        ok = token is None or (
            given is not None and hmac.compare_digest(given.encode(), token.encode())
        )
        return True if ok else None

    return authorize


#: Seconds a connection gets to finish its closing handshake once its handler is done.
DISCONNECT_TIMEOUT = 5.0


async def serve_proto(
    routes: Mapping[str, ConnectionHandler],
    host: str,
    port: int,
    *,
    authorize: Authorize,
    ssl_context: ssl.SSLContext | None = None,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    guard: ConnectionGuard | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``routes`` (path -> handler) until cancelled; ``task_status`` gets the port.

    A connection whose bearer token ``authorize`` refuses is answered HTTP 401
    before the WebSocket opens; an unknown path 404. The handler gets who
    ``authorize`` said the connection is. OSError (not in a group) if the port
    cannot be bound.

    ``guard`` (a default one if None) bounds the connections (:mod:`.guard`): a
    connection is proven once its WebSocket is open with a token ``authorize`` took,
    so the TLS handshake, the upgrade request and the token check all fall within its
    handshake deadline and its bounds on connections that wait to authenticate.
    """
    guard = guard or ConnectionGuard()
    listeners = await open_guarded_listeners(
        port, host, guard, refusal=REFUSAL if ssl_context is None else None
    )

    async def on_stream(stream: GuardedStream) -> None:
        ticket = stream.ticket
        transport: trio.abc.Stream = stream
        try:
            if ssl_context is not None:
                transport = tls = trio.SSLStream(stream, ssl_context, server_side=True)
                if not await _handshake(tls, ticket):
                    return
            async with trio.open_nursery() as nursery:
                request = await wrap_server_stream(
                    nursery, transport, max_message_size=max_message_size
                )
                accepted = await _open(request, routes, authorize)
                if accepted is not None:
                    guard.prove(ticket)
                    await _handle(*accepted)
                nursery.cancel_scope.cancel()
        except Exception as raised:
            _log_ended(raised, ticket)
        finally:
            guard.release(ticket)
            await trio.aclose_forcefully(transport)

    await _serve(on_stream, listeners, task_status)


async def _serve(
    on_stream: Callable[[GuardedStream], Awaitable[None]],
    listeners: list[GuardedListener],
    task_status: trio.TaskStatus[int],
) -> None:
    """Serve ``listeners`` with ``on_stream`` until cancelled; an OSError comes out as
    itself, not in a group."""
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, on_stream, listeners)
            task_status.started(listeners[0].socket.getsockname()[1])
    except BaseExceptionGroup as group:
        # a port that cannot be bound is the caller's to report, as itself
        error = lone_error(group)
        if isinstance(error, OSError):
            raise error from None
        raise


async def _open(
    request: WebSocketRequest, routes: Mapping[str, ConnectionHandler], authorize: Authorize
) -> tuple[WebSocketConnection, ConnectionHandler, object] | None:
    """The WebSocket ``request`` opens, its handler and who it is; None if it was refused
    (404 for an unknown path, 401 for a token ``authorize`` refuses)."""
    path = urlsplit(request.path).path or "/"
    handler = routes.get(path)
    if handler is None:
        await request.reject(404, body=f"no proto-socket at {path}\n".encode())
        return None
    who = authorize(path, bearer_token(request.headers))
    if who is None:
        log.warning("refused a connection to %s: bad or missing bearer token", path)
        await request.reject(
            401,
            extra_headers=[(b"WWW-Authenticate", b"Bearer")],
            body=b"bad or missing bearer token\n",
        )
        return None
    # a peer that offers the batch subprotocol reads batches, and so does this side
    offered = BATCH_SUBPROTOCOL in request.proposed_subprotocols
    return await request.accept(subprotocol=BATCH_SUBPROTOCOL if offered else None), handler, who


async def _handle(ws: WebSocketConnection, handler: ConnectionHandler, who: Any) -> None:
    """Run ``handler`` on the open WebSocket ``ws``, then close it (within
    :data:`DISCONNECT_TIMEOUT`), however the handler ended."""
    try:
        await handler(ws, who)
    finally:
        with trio.move_on_after(DISCONNECT_TIMEOUT):
            await ws.aclose()


async def _handshake(tls: trio.SSLStream[GuardedStream], ticket: Ticket) -> bool:
    """Whether the TLS handshake on ``tls`` went through; if not, it is logged (at debug
    level when the guard dropped the connection, else info) and the caller closes it."""
    try:
        await tls.do_handshake()
    except trio.BrokenResourceError as failed:
        cause = failed.__cause__
        why = cause if isinstance(cause, ssl.SSLError) else ticket.dropped or failed
        level = logging.DEBUG if ticket.dropped else logging.INFO
        log.log(level, "refused a TLS connection from %s: %s", ticket.peer, why)
        return False
    return True


def _log_ended(raised: Exception, ticket: Ticket) -> None:
    """Log how a connection ended in ``raised`` (called in its except block): a closed
    or broken connection (or the race of two closes) at debug level, anything else as
    the failure it is."""
    error = lone_error(raised)
    if not closing_race(error) and not isinstance(
        error, ConnectionClosed | trio.BrokenResourceError | trio.ClosedResourceError
    ):
        log.exception("connection from %s failed", ticket.peer)
    elif ticket.dropped:
        log.debug("connection from %s: %s", ticket.peer, ticket.dropped)
    else:
        log.debug("connection from %s ended: %s", ticket.peer, error)
