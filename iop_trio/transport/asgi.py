"""Serving ASGI apps on hypercorn's Trio worker, and the few response helpers they share.

The node's ops routes (:mod:`iop_trio.ops`) and the edge's OpenAI-compatible
front door (:mod:`iop_trio.edge.front_door`) are both small ASGI apps served by
:func:`serve_asgi`.
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from functools import partial
from typing import Any

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState

from .guard import REFUSAL, ConnectionGuard, open_guarded_listeners

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


async def serve_asgi(
    app: ASGIApp,
    host: str,
    port: int,
    *,
    shutdown: trio.Event | None = None,
    read_timeout: float | None = IDLE_TIMEOUT,
    ssl_context: ssl.SSLContext | None = None,
    guard: ConnectionGuard | None = None,
    send_timeout: float | None = None,
    prove_on_request: bool = True,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``host:port`` (0 = any free port) with hypercorn's HTTP/1.1
    protocol; ``task_status`` gets the bound port. Raises OSError itself (not in a
    group) if the address cannot be bound.

    Returns once ``shutdown`` is set and the server has stopped: it stops accepting,
    idle connections are closed at once, requests in progress get
    :data:`GRACEFUL_TIMEOUT` seconds.

    ``read_timeout``: a connection whose client sends nothing for that long is closed,
    even while its response is still being sent (hypercorn reads all the time), so an
    app that streams long responses passes None. A connection that has not sent a
    whole request head within :data:`IDLE_TIMEOUT` (or the guard's handshake deadline,
    whichever comes first) is closed, and so is an idle keep-alive connection.

    ``ssl_context``: serve https with it (it may require client certificates).

    ``guard`` (a fresh :class:`~.guard.ConnectionGuard` if None) bounds the
    connections: a connection is proven once a whole request head has come
    (``prove_on_request``), or, if false, once the app says so
    (``guard.prove_address(scope["client"])``, say when its token is good); until then
    the guard's bounds on unproven connections and its handshake deadline apply.
    ``send_timeout`` (None: no bound) breaks a connection whose client has not read a
    response's bytes for that long, which the app sees as ``http.disconnect``.

    hypercorn's own serving loop opens its sockets itself, so this one opens them,
    guarded (:mod:`.guard`), and hands each connection to hypercorn's ``TCPServer``.
    """
    config = _hypercorn_config(read_timeout)
    guard = guard or ConnectionGuard()
    guarded = await open_guarded_listeners(
        port,
        host,
        guard,
        refusal=REFUSAL if ssl_context is None else None,
        send_timeout=send_timeout,
    )
    listeners: list[trio.abc.Listener[Any]] = list(guarded)
    if ssl_context is not None:
        listeners = [trio.SSLListener(g, ssl_context, https_compatible=True) for g in guarded]
    context = WorkerContext(None)
    served = _proving(app, guard) if prove_on_request else app
    handler = partial(TCPServer, ASGIWrapper(served), config, context, ConnectionState({}))  # type: ignore[arg-type]
    bound = guarded[0].socket.getsockname()[1]
    await _serve_until(shutdown, handler, listeners, context, bound, task_status)


async def _serve_until(
    shutdown: trio.Event | None,
    handler: Callable[[trio.abc.Stream], Awaitable[object]],
    listeners: list[trio.abc.Listener[Any]],
    context: WorkerContext,
    bound: int,
    task_status: trio.TaskStatus[int],
) -> None:
    """Accept on ``listeners`` (``task_status`` gets the ``bound`` port) until
    ``shutdown`` is set (never, if None); then close the idle connections at once and
    give the others :data:`GRACEFUL_TIMEOUT` seconds."""
    async with trio.open_nursery() as connections:
        async with trio.open_nursery() as accepting:
            await accepting.start(
                partial(trio.serve_listeners, handler, listeners, handler_nursery=connections)
            )
            task_status.started(bound)
            if shutdown is None:
                await trio.sleep_forever()
            await shutdown.wait()
            accepting.cancel_scope.cancel()
        await context.terminated.set()  # idle keep-alive connections close at once
        connections.cancel_scope.deadline = trio.current_time() + GRACEFUL_TIMEOUT


def _hypercorn_config(read_timeout: float | None) -> Config:
    """hypercorn's settings for :func:`serve_asgi`: no access log, its errors to our
    handlers, our timeouts and bound on a request head."""
    config = Config()
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # our handlers, not its own
    config.graceful_timeout = GRACEFUL_TIMEOUT
    config.keep_alive_timeout = IDLE_TIMEOUT
    config.read_timeout = None if read_timeout is None else int(read_timeout)
    config.h11_max_incomplete_size = MAX_HEADER_SIZE
    return config


def _proving(app: ASGIApp, guard: ConnectionGuard) -> ASGIApp:
    """``app``, proving each connection to ``guard`` as a whole request head comes
    (the ``prove_on_request`` of :func:`serve_asgi`)."""

    async def served(scope: Scope, receive: Receive, send: Send) -> None:
        client = scope.get("client")
        if client:
            guard.prove_address(tuple(client))
        await app(scope, receive, send)

    return served
