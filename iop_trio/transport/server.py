"""A WebSocket server for proto-sockets: bearer-token check, routing by path, isolation.

Each connection runs in its own handler; whatever a handler raises is logged
and ends that connection only, never the server (trio-websocket would
otherwise let it crash the listener's nursery).
"""

from __future__ import annotations

import hmac
import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, serve_websocket

from .auth import bearer_token
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


def shared_token(token: str | None) -> Authorize:
    """Everyone with ``token`` (everyone at all for None) is let in, as ``True``."""

    def authorize(path: str, given: str | None) -> bool | None:
        ok = token is None or (
            given is not None and hmac.compare_digest(given.encode(), token.encode())
        )
        return True if ok else None

    return authorize


async def serve_proto(
    routes: Mapping[str, ConnectionHandler],
    host: str,
    port: int,
    *,
    authorize: Authorize,
    ssl_context: ssl.SSLContext | None = None,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``routes`` (path -> handler) until cancelled; ``task_status`` gets the port.

    A connection whose bearer token ``authorize`` refuses is answered HTTP 401
    before the WebSocket opens; an unknown path 404. The handler gets who
    ``authorize`` said the connection is. OSError (not in a group) if the port
    cannot be bound.
    """

    async def on_request(request: WebSocketRequest) -> None:
        path = urlsplit(request.path).path or "/"
        try:
            handler = routes.get(path)
            if handler is None:
                await request.reject(404, body=f"no proto-socket at {path}\n".encode())
                return
            who = authorize(path, bearer_token(request.headers))
            if who is None:
                log.warning("refused a connection to %s: bad or missing bearer token", path)
                await request.reject(
                    401,
                    extra_headers=[(b"WWW-Authenticate", b"Bearer")],
                    body=b"bad or missing bearer token\n",
                )
                return
            ws = await request.accept()
            await handler(ws, who)
        except ConnectionClosed:
            pass
        except Exception:
            log.exception("connection handler for %s failed", path)

    try:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                lambda task_status: serve_websocket(
                    on_request,
                    host,
                    port,
                    ssl_context=ssl_context,
                    max_message_size=max_message_size,
                    task_status=task_status,
                )
            )
            task_status.started(server.port)
    except BaseExceptionGroup as group:
        # a port that cannot be bound is the caller's to report, as itself
        error = lone_error(group)
        if isinstance(error, OSError):
            raise error from None
        raise
