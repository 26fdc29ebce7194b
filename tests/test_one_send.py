"""An engine request in one send (adapters/one_send.py), on a real HTTP server."""

# httpcore's stream and backend interfaces take a ``timeout`` argument
# ruff: noqa: ASYNC109
from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

import httpcore
import httpx
import pytest

from iop_trio.adapters import one_send
from iop_trio.adapters.base import AdapterRequest
from iop_trio.adapters.openai import OpenAIAdapter, OpenAISettings

from .engines import EngineServer, collect, openai_reply, serve


@pytest.fixture
async def server() -> AsyncIterator[EngineServer]:
    async with serve() as engine:
        yield engine


class _Counted(httpcore.AsyncNetworkStream):
    def __init__(self, stream: httpcore.AsyncNetworkStream, writes: list[int]) -> None:
        self._stream, self._writes = stream, writes

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if buffer:  # httpcore's own streams skip an empty write (a body's end)
            self._writes.append(len(buffer))
        await self._stream.write(buffer, timeout)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._stream.read(max_bytes, timeout)

    async def aclose(self) -> None:
        await self._stream.aclose()

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _CountingBackend(httpcore.AsyncNetworkBackend):
    """Counts the writes of its streams: the sends a request costs."""

    def __init__(self, backend: httpcore.AsyncNetworkBackend) -> None:
        self._backend = backend
        self.writes: list[int] = []

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._backend.connect_tcp(host, port, timeout, local_address, socket_options)
        return _Counted(stream, self.writes)

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


def _counting(adapter: OpenAIAdapter) -> _CountingBackend:
    """Count the sends of ``adapter``'s own pool, under what it installed."""
    adapter.client  # noqa: B018  (made on first use)
    pool = adapter._transport._pool  # type: ignore[union-attr]
    backend = pool._network_backend
    if isinstance(backend, one_send.OneSendBackend):
        counting = _CountingBackend(backend._backend)
        backend._backend = counting
    else:
        counting = pool._network_backend = _CountingBackend(backend)
    return counting


async def _two_runs(server: EngineServer, adapter: OpenAIAdapter) -> list[int]:
    counting = _counting(adapter)
    before = len(server.connections)
    request = AdapterRequest(run_id="r", model="m", prompt="hello " * 50, params={})
    for _ in range(2):  # the second on the kept-alive connection
        server.push(openai_reply(["a", "b"]))
        chunks = await collect(adapter, request)
        assert [getattr(c, "text", None) for c in chunks][:2] == ["a", "b"]
    assert len(server.connections) == before + 1
    await adapter.aclose()
    return counting.writes


async def test_an_engine_request_goes_in_one_send_head_and_body_together(server):
    adapter = OpenAIAdapter("o", OpenAISettings(base_url=server.url))
    writes = await _two_runs(server, adapter)
    assert len(writes) == 2  # one a request
    # httpcore's own streams write the head and the body apart: what this saves
    plain = OpenAIAdapter("o", OpenAISettings(base_url=server.url))
    plain.client  # noqa: B018
    pool = plain._transport._pool  # type: ignore[union-attr]
    pool._network_backend = pool._network_backend._backend  # undo the install
    assert len(await _two_runs(server, plain)) == 4


def test_install_leaves_a_transport_of_another_shape_as_it_is():
    proxied = httpx.AsyncHTTPTransport(proxy="http://127.0.0.1:9")
    assert not isinstance(proxied._pool._network_backend, one_send.OneSendBackend)
    one_send.install(proxied)
    assert not isinstance(proxied._pool._network_backend, one_send.OneSendBackend)
    plain = one_send.install(one_send.install(httpx.AsyncHTTPTransport()))
    backend = plain._pool._network_backend
    assert isinstance(backend, one_send.OneSendBackend)
    assert not isinstance(backend._backend, one_send.OneSendBackend)  # once only
