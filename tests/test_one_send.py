"""An engine request in one send (adapters/one_send.py), on a real HTTP server."""

# httpcore's stream and backend interfaces take a ``timeout`` argument
from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from iop_trio.adapters import one_send
from iop_trio.adapters.base import AdapterRequest
from iop_trio.adapters.openai import OpenAIAdapter, OpenAISettings

from .engines import EngineServer, collect, openai_reply, serve
from .support import count_sends


@pytest.fixture
async def server() -> AsyncIterator[EngineServer]:
    async with serve() as engine:
        yield engine


async def _two_runs(server: EngineServer, adapter: OpenAIAdapter) -> list[int]:
    counting = count_sends(adapter)
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
