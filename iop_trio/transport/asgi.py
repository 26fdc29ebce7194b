"""Serving ASGI apps on hypercorn's Trio worker, and the few response helpers they share.

The node's ops routes (:mod:`iop_trio.ops`) and the edge's OpenAI-compatible
front door (:mod:`iop_trio.edge.front_door`) are both small ASGI apps served by
:func:`serve_asgi`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from .server import lone_error

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Seconds a request in progress gets once the server is told to stop.
GRACEFUL_TIMEOUT = 2.0
#: Seconds an idle keep-alive connection is kept, and the most a request may take to arrive.
IDLE_TIMEOUT = 10.0
#: The largest request line plus headers accepted.
MAX_HEADER_SIZE = 16 * 1024


async def respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: str,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Send a whole response."""
    raw = [(b"content-type", content_type.encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    raw.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def respond_json(
    send: Send, data: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> None:
    await respond(send, status, json.dumps(data, default=str).encode(), "application/json", headers)


async def respond_text(send: Send, text: str, status: int = 200) -> None:
    await respond(send, status, text.encode(), "text/plain; charset=utf-8")


async def lifespan(receive: Receive, send: Send) -> None:
    """Nothing to set up or tear down: acknowledge both."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def is_http(scope: Scope, receive: Receive, send: Send) -> bool:
    """Whether ``scope`` is an HTTP request for the app to answer; a lifespan scope is
    answered here (nothing to set up), any other is not for these apps."""
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
        return False
    return bool(scope["type"] == "http")


class _PortStatus:
    """Hands the port of hypercorn's first bind (``http://host:port``) to ``task_status``."""

    def __init__(self, task_status: trio.TaskStatus[int]) -> None:
        self._task_status = task_status

    def started(self, binds: list[str]) -> None:
        self._task_status.started(int(binds[0].rpartition(":")[2]))


async def serve_asgi(
    app: ASGIApp,
    host: str,
    port: int,
    *,
    shutdown: trio.Event | None = None,
    read_timeout: float | None = IDLE_TIMEOUT,
    cert_file: str | None = None,
    key_file: str | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``host:port`` (0 = any free port) with hypercorn; ``task_status``
    gets the bound port. Raises OSError itself (not in a group) if the address cannot
    be bound.

    Returns once ``shutdown`` is set and the server has stopped: idle connections are
    closed at once, requests in progress get :data:`GRACEFUL_TIMEOUT` seconds.

    ``read_timeout``: a connection whose client sends nothing for that long is closed,
    even while its response is still being sent (hypercorn reads all the time), so an
    app that streams long responses passes None; idle keep-alive connections are
    closed after :data:`IDLE_TIMEOUT` all the same.

    ``cert_file`` (and ``key_file`` if the key is not in it): serve https.
    """
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # our handlers, not its own
    config.graceful_timeout = GRACEFUL_TIMEOUT
    config.keep_alive_timeout = IDLE_TIMEOUT
    config.read_timeout = None if read_timeout is None else int(read_timeout)
    config.h11_max_incomplete_size = MAX_HEADER_SIZE
    config.certfile = cert_file
    config.keyfile = key_file
    try:
        await serve(
            app,  # type: ignore[arg-type]
            config,
            shutdown_trigger=shutdown.wait if shutdown is not None else None,
            task_status=_PortStatus(task_status),  # type: ignore[arg-type]
            mode="asgi",
        )
    except BaseExceptionGroup as group:  # hypercorn binds inside its nurseries
        error = lone_error(group)
        if isinstance(error, OSError):
            raise error from None
        raise
