"""An engine request in one send: httpcore's network streams, holding writes until a read.

httpcore writes an HTTP/1.1 request in two sends, its head and then its body, and the
engine wakes for each; on this VM a loopback send costs about 0.1 ms of CPU, and the
engine's first wake-up finds half a request. :class:`OneSendBackend` wraps the backend
of the pool this adapter makes: its streams hold what httpcore writes until httpcore
reads (for the response), and write it then, in one send.

Semantics, for the HTTP/1.1 exchanges of that pool (it has HTTP/2 off: a connection
carries one request at a time, written whole before its response is read):

- ``write`` holds the bytes (no I/O, no checkpoint); the next ``read``, ``start_tls``
  or ``aclose`` comes first. ``read`` writes what is held, in order, with one
  ``write`` of the stream it wraps, within the read's own timeout, then reads;
- so a write's failure is raised by the read that follows (a WriteError, as the
  stream it wraps raises it: httpcore's own answer to a write that failed is to read
  the response anyway, and it meets the same failure there);
- ``aclose`` drops what is held: a request closed before its response is read was
  given up on;
- ``get_extra_info`` is the wrapped stream's (``is_readable``, the socket...).

This is the one place the package reaches inside httpx: ``install`` puts the backend
into the transport's httpcore pool (``AsyncHTTPTransport`` takes no backend of its
own); ``tests/test_one_send.py`` holds it to one write a request on a real server,
and ``make smoke`` on llama.cpp's.
"""

# httpcore's stream and backend interfaces take a ``timeout`` argument
# ruff: noqa: ASYNC109
from __future__ import annotations

import ssl
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx


class OneSendStream(httpcore.AsyncNetworkStream):
    """A stream whose writes wait for its next read (see the module docstring)."""

    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream
        self._held: list[bytes] = []

    def __repr__(self) -> str:
        return f"<OneSendStream held={sum(map(len, self._held))}B of {self._stream!r}>"

    async def _write_held(self, timeout: float | None) -> None:
        if self._held:
            data = b"".join(self._held)
            self._held.clear()
            await self._stream.write(data, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if buffer:
            self._held.append(buffer)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        await self._write_held(timeout)
        return await self._stream.read(max_bytes, timeout)

    async def aclose(self) -> None:
        self._held.clear()
        await self._stream.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        await self._write_held(timeout)
        tls = await self._stream.start_tls(ssl_context, server_hostname, timeout)
        return OneSendStream(tls)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class OneSendBackend(httpcore.AsyncNetworkBackend):
    """A network backend whose streams are :class:`OneSendStream` over ``backend``'s."""

    def __init__(self, backend: httpcore.AsyncNetworkBackend) -> None:
        self._backend = backend

    def __repr__(self) -> str:
        return f"<OneSendBackend over {self._backend!r}>"

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._backend.connect_tcp(host, port, timeout, local_address, socket_options)
        return OneSendStream(stream)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._backend.connect_unix_socket(path, timeout, socket_options)
        return OneSendStream(stream)

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


def install(transport: httpx.AsyncHTTPTransport) -> httpx.AsyncHTTPTransport:
    """Make ``transport`` (one with no proxy: an httpcore connection pool, HTTP/1.1)
    write each request in one send; returns it. A transport of another shape is left
    as it is."""
    pool = getattr(transport, "_pool", None)
    if type(pool) is httpcore.AsyncConnectionPool and not getattr(pool, "_http2", True):
        backend = pool._network_backend  # noqa: SLF001
        if not isinstance(backend, OneSendBackend):
            pool._network_backend = OneSendBackend(backend)  # noqa: SLF001
    return transport
