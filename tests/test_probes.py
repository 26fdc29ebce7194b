"""Engine probes: each adapter asks its engine which models it serves; the node keeps
which targets are unavailable, says so in /readyz, its metrics and a new Hello, and the
edge routes only to nodes whose engine for the target is available.

Real HTTP servers on loopback speak each engine's list of models; every wait is bounded.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
import trio

from iop_trio.adapters.base import AdapterError
from iop_trio.edge.edge import NodeGone
from iop_trio.metrics import NodeMetrics
from iop_trio.model import RunSpec, TargetSpec
from iop_trio.protocol import pb
from iop_trio.runtime import Node, RuntimeLimits
from iop_trio.store.memory import MemoryStore
from iop_trio.transport import RemoteError, open_runner

from .engines import JSON, OLLAMA, OPENAI, EngineServer, Exchange, Reply, refused_port, serve
from .test_wire import TOKEN, stack


@pytest.fixture
async def server() -> AsyncIterator[EngineServer]:
    async with serve() as s:
        yield s


def models_reply(body: object) -> Reply:
    return Reply(content_type=JSON, parts=[json.dumps(body).encode()], content_length=True)


async def test_openai_lists_models_at_v1_models(server: EngineServer) -> None:
    reply = server.push(models_reply({"object": "list", "data": [{"id": "qwen"}, {"id": "x"}]}))
    adapter = OPENAI.adapter(server.url, api_key="k")
    assert await adapter.served_models() == frozenset({"qwen", "x"})
    exchange = await reply.request()
    assert (exchange.method, exchange.path) == ("GET", "/v1/models")
    assert exchange.headers["authorization"] == "Bearer k"
    await adapter.aclose()


async def test_ollama_lists_models_at_api_tags_and_serves_latest(server: EngineServer) -> None:
    reply = server.push(
        models_reply({"models": [{"name": "llama3:latest", "model": "llama3:latest"}]})
    )
    adapter = OLLAMA.adapter(server.url)
    served = await adapter.served_models()
    assert (await reply.request()).path == "/api/tags"
    assert adapter.serves("llama3", served) and adapter.serves("llama3:latest", served)
    assert not adapter.serves("llama3:8b", served)
    await adapter.aclose()


async def test_a_bad_or_missing_answer_is_an_adapter_error(server: EngineServer) -> None:
    adapter = OPENAI.adapter(server.url)
    server.push(models_reply({"models": "nope"}))
    with pytest.raises(AdapterError) as bad:
        await adapter.served_models()
    assert bad.value.reason == "bad_response"
    server.push(Reply(503, parts=[b"loading"], content_length=True))
    with pytest.raises(AdapterError) as down:
        await adapter.served_models()
    assert down.value.reason == "engine_error" and "503" in down.value.message
    await adapter.aclose()
    with refused_port() as port:
        gone = OPENAI.adapter(f"http://127.0.0.1:{port}")
        with pytest.raises(AdapterError) as refused:
            await gone.served_models()
        assert refused.value.reason == "connection"
        await gone.aclose()


def two_target_node(url: str) -> Node:
    """vllm/qwen and vllm/other on one OpenAI engine, probed every hour (tests call
    probe_engines themselves)."""
    return Node(
        node_id="n1",
        adapters=[OPENAI.adapter(url)],
        targets=[TargetSpec("vllm", "qwen", concurrency=1), TargetSpec("vllm", "other")],
        store=MemoryStore(),
        limits=RuntimeLimits(probe_interval=3600),
    )


async def test_the_node_keeps_which_targets_are_unavailable_and_why(server: EngineServer) -> None:
    served = {"data": [{"id": "qwen"}]}
    server.handler = lambda exchange: models_reply(served)
    node = two_target_node(server.url)
    metrics = NodeMetrics(node)
    async with node.running():
        unavailable = await node.probe_engines()
        assert set(unavailable) == {"vllm/other"}
        assert "does not serve model 'other'" in unavailable["vllm/other"]
        ready, components = metrics.readiness()
        assert not ready
        assert components["target:vllm/qwen"]["ok"]
        assert not components["target:vllm/other"]["ok"]
        text = metrics.render().decode()
        assert 'iop_target_available{target="vllm/qwen"} 1.0' in text
        assert 'iop_target_available{target="vllm/other"} 0.0' in text
        served["data"].append({"id": "other"})
        seen = node.description
        assert await node.probe_engines() == {}
        assert node.description == seen + 1
        assert metrics.readiness()[0]


async def test_the_edge_routes_only_to_targets_whose_engine_is_available(
    server: EngineServer,
) -> None:
    up = True

    def answer(exchange: Exchange) -> Reply:
        if not up:
            return Reply(502, parts=[b"bad gateway"], content_length=True)
        return models_reply({"data": [{"id": "qwen"}, {"id": "other"}]})

    server.handler = answer
    node = two_target_node(server.url)
    async with stack(node) as s:
        await node.probe_engines()
        assert s.edge.route("vllm/qwen") is s.handle
        up = False
        await node.probe_engines()
        with trio.fail_after(10):  # the node says so in a new Hello on the same session
            await s.edge.wait_until(lambda: "vllm/qwen" in s.handle.unavailable)
        assert s.edge.nodes["n1"] is s.handle and s.client.sessions == 1
        with pytest.raises(NodeGone, match="unavailable on every node"):
            s.edge.route("vllm/qwen")
        async with open_runner(s.edge.client_url, token=TOKEN) as client:
            with pytest.raises(RemoteError) as refused:
                await client.submit(RunSpec("vllm/qwen", "hi"))
            assert refused.value.code == pb.ERROR_CODE_UNAVAILABLE
            assert refused.value.retry_after is not None
            assert "502" in refused.value.message
        up = True
        await node.probe_engines()
        with trio.fail_after(10):
            await s.edge.wait_until(lambda: not s.handle.unavailable)
        assert s.edge.route("vllm/qwen") is s.handle
