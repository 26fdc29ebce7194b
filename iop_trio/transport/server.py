"""A WebSocket server for proto-sockets: bearer-token check, routing by path, isolation.

Each connection runs in its own handler; whatever a handler raises is logged
and ends that connection only, never the server (trio-websocket would
otherwise let it crash the listener's nursery).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from urllib.parse import urlsplit

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, serve_websocket

from .auth import bearer_ok
from .session import DEFAULT_MAX_MESSAGE_SIZE

log = logging.getLogger(__name__)

ConnectionHandler = Callable[[WebSocketConnection], Awaitable[None]]


async def serve_proto(
    routes: Mapping[str, ConnectionHandler],
    host: str,
    port: int,
    *,
    token: str | None,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``routes`` (path -> handler) until cancelled; ``task_status`` gets the port.

    A wrong or missing bearer token is refused with HTTP 401 before the
    WebSocket opens; an unknown path with 404.
    """

    async def on_request(request: WebSocketRequest) -> None:
        path = urlsplit(request.path).path or "/"
        try:
            handler = routes.get(path)
            if handler is None:
                await request.reject(404, body=f"no proto-socket at {path}\n".encode())
                return
            if not bearer_ok(request.headers, token):
                log.warning("refused a connection to %s: bad or missing bearer token", path)
                await request.reject(
                    401,
                    extra_headers=[(b"WWW-Authenticate", b"Bearer")],
                    body=b"bad or missing bearer token\n",
                )
                return
            ws = await request.accept()
            await handler(ws)
        except ConnectionClosed:
            pass
        except Exception:
            log.exception("connection handler for %s failed", path)

    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            lambda task_status: serve_websocket(
                on_request,
                host,
                port,
                ssl_context=None,
                max_message_size=max_message_size,
                task_status=task_status,
            )
        )
        task_status.started(server.port)
