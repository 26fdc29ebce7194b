"""Engine probes: each adapter asks its engine which models it serves; the node keeps
which targets are unavailable, says so in /readyz, its metrics and a new Hello, and the
edge routes only to nodes whose engine for the target is available.

Real HTTP servers on loopback speak each engine's list of models; every wait is bounded.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import AsyncIterator

import pytest
import trio

from iop_trio.adapters.base import AdapterError
from iop_trio.edge.edge import NodeGone
from iop_trio.metrics import NodeMetrics
from iop_trio.model import RunSpec, RunStatus, TargetSpec
from iop_trio.protocol import pb
from iop_trio.runtime import Node, RuntimeLimits
from iop_trio.store.memory import MemoryStore
from iop_trio.transport import RemoteError, open_runner

from .engines import (
    JSON,
    OLLAMA,
    OPENAI,
    SSE,
    SSE_DONE,
    EngineServer,
    Exchange,
    Reply,
    openai_stream,
    refused_port,
    run_to_end,
    serve,
    wait_end,
)
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


# --- engines that answer their list of models but not their runs ----------------------------

HUNG = "did not answer a run in time"


class Engine:
    """An OpenAI engine that lists vllm's models at once and answers each POST (a run, or
    a run probe) with the next reply a test gave it (:meth:`answer`), in order."""

    def __init__(self, server: EngineServer) -> None:
        self.posts: list[Exchange] = []
        self._answers: deque[Reply] = deque()
        server.handler = self._handle

    def __repr__(self) -> str:
        return f"<Engine posts={len(self.posts)} answers={len(self._answers)}>"

    def _handle(self, exchange: Exchange) -> Reply:
        if exchange.method == "GET":
            return models_reply({"data": [{"id": "qwen"}, {"id": "other"}]})
        self.posts.append(exchange)
        if self._answers:
            return self._answers.popleft()
        return Reply(500, parts=[b'{"error": "no reply scripted"}'], content_length=True)

    def answer(self, reply: Reply) -> Reply:
        """Answer the next POST with ``reply``."""
        self._answers.append(reply)
        return reply


def hung_node(url: str, *, probe_interval: float | None = 3600, concurrency: int = 2) -> Node:
    """vllm/qwen and vllm/other on one OpenAI engine; a run gets no answer after 5 s."""
    return Node(
        node_id="n1",
        adapters=[OPENAI.adapter(url, read_timeout=5.0)],
        targets=[TargetSpec("vllm", "qwen", concurrency=concurrency), TargetSpec("vllm", "other")],
        store=MemoryStore(),
        limits=RuntimeLimits(probe_interval=probe_interval),
    )


def changes(caplog: pytest.LogCaptureFixture, target: str = "vllm/qwen") -> list[str]:
    """The node's log lines that say ``target`` went or came back."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "iop_trio.runtime.node" and r.getMessage().startswith(f"target {target} ")
    ]


def a_run(text: str = "hi") -> RunSpec:
    return RunSpec("vllm/qwen", text)


async def test_a_run_the_engine_does_not_answer_marks_its_target_until_a_probe_run_succeeds(
    server, autojump_clock, caplog
):
    """The list of models answers, the runs do not: the target is unavailable (its
    component of /readyz, its gauge, a new Hello) from the first run that timed out until
    a probe asks it for one token and gets it; logged once each way."""
    caplog.set_level(logging.INFO, logger="iop_trio.runtime.node")
    engine = Engine(server)
    node = hung_node(server.url)
    metrics = NodeMetrics(node)
    async with node.running():
        assert await node.probe_engines() == {}
        seen = node.description
        engine.answer(Reply.silent())
        record, _ = await run_to_end(node, a_run())
        assert (record.status, record.reason) == (RunStatus.FAILED, "timeout")
        assert HUNG in node.unavailable["vllm/qwen"]
        assert "no response within 5.0s" in node.unavailable["vllm/qwen"]
        assert set(node.unavailable) == {"vllm/qwen"}  # its engine's other model: no run failed
        assert node.description == seen + 1
        components = metrics.readiness()[1]
        assert not components["target:vllm/qwen"]["ok"]
        assert components["target:vllm/other"]["ok"]
        assert 'iop_target_available{target="vllm/qwen"} 0.0' in metrics.render().decode()
        # another run that gets no answer, and a probe run that gets none: no change
        engine.answer(Reply.silent())
        await run_to_end(node, a_run())
        engine.answer(Reply.silent())
        posts = len(engine.posts)
        assert set(await node.probe_engines()) == {"vllm/qwen"}
        probe = engine.posts[posts:]
        assert [(e.path, e.json["stream"], e.json["max_tokens"]) for e in probe] == [
            ("/v1/chat/completions", False, 1)  # one token, for the marked target only
        ]
        assert node.description == seen + 1
        # the engine answers one token: available again
        engine.answer(OPENAI.whole_reply("Hi"))
        assert await node.probe_engines() == {}
        assert node.description == seen + 2
        assert metrics.readiness()[0]
        # a healthy target costs its engine nothing but the list
        posts = len(engine.posts)
        assert await node.probe_engines() == {}
        assert len(engine.posts) == posts
    assert changes(caplog) == [
        f"target vllm/qwen is unavailable: {node_why(record.message)}",
        "target vllm/qwen is available again",
    ]


def node_why(message: str) -> str:
    """What the node says of a target whose run failed with ``message``."""
    return f"its engine {HUNG}: {message}"


async def test_a_run_that_succeeds_clears_the_mark(server, autojump_clock):
    engine = Engine(server)
    node = hung_node(server.url)
    async with node.running():
        engine.answer(Reply.silent())
        await run_to_end(node, a_run())
        assert set(node.unavailable) == {"vllm/qwen"}
        engine.answer(OPENAI.reply(["fine"]))
        record, _ = await run_to_end(node, a_run())
        assert record.status is RunStatus.SUCCEEDED
        assert node.unavailable == {}


async def test_without_probes_a_run_that_gets_no_answer_marks_nothing(server, autojump_clock):
    """Nothing would try the target again (the edge routes no run to it): it stays
    available, as every target does with ``probe_interval: null``."""
    engine = Engine(server)
    node = hung_node(server.url, probe_interval=None)
    async with node.running():
        engine.answer(Reply.silent())
        record, _ = await run_to_end(node, a_run())
        assert record.reason == "timeout"
        assert node.unavailable == {}


async def test_a_run_in_flight_across_a_change_does_not_undo_it(server, autojump_clock, caplog):
    """No flapping: a run counts only if its request went out after the target last
    changed, so one that was on its way already (a long stream that ends well after
    another run got no answer; a run the hung engine took before it recovered, that
    times out after a probe found it well) says nothing about the engine now."""
    caplog.set_level(logging.INFO, logger="iop_trio.runtime.node")
    engine = Engine(server)
    node = hung_node(server.url)
    async with node.running():
        streaming = engine.answer(Reply(content_type=SSE, end="hang"))
        silent = engine.answer(Reply.silent())
        long_run = (await node.manager.submit(a_run("a long answer"))).record.run_id
        await streaming.request()
        hung_run = (await node.manager.submit(a_run())).record.run_id
        await silent.request()
        await trio.sleep(3)
        await streaming.send(b"".join(openai_stream(["one"], done=False)))
        record, _ = await wait_end(node, hung_run)  # at 5 s; the stream's next byte is due at 8
        assert record.reason == "timeout" and set(node.unavailable) == {"vllm/qwen"}
        await streaming.send(SSE_DONE)
        await streaming.finish()
        record, _ = await wait_end(node, long_run)
        assert record.status is RunStatus.SUCCEEDED
        assert set(node.unavailable) == {"vllm/qwen"}  # it went out before the mark
        # a run the engine takes while marked; a probe finds the engine well meanwhile
        silent = engine.answer(Reply.silent())
        late_run = (await node.manager.submit(a_run())).record.run_id
        await silent.request()
        await trio.sleep(1)
        engine.answer(OPENAI.whole_reply("Hi"))
        assert await node.probe_engines() == {}
        record, _ = await wait_end(node, late_run)
        assert record.reason == "timeout"
        assert node.unavailable == {}  # it went out before the probe
        # but a run sent now that gets no answer is news
        engine.answer(Reply.silent())
        await run_to_end(node, a_run())
        assert set(node.unavailable) == {"vllm/qwen"}
    assert [line.split(":")[0] for line in changes(caplog)] == [
        "target vllm/qwen is unavailable",
        "target vllm/qwen is available again",
        "target vllm/qwen is unavailable",
    ]


async def test_the_edge_stops_routing_to_a_target_whose_runs_get_no_answer(server):
    """Real clock, the whole way: a run times out, the node's new Hello takes the target
    off the edge's routes, and a probe run that succeeds puts it back."""
    engine = Engine(server)
    node = Node(
        node_id="n1",
        adapters=[OPENAI.adapter(server.url, read_timeout=2.0)],
        targets=[TargetSpec("vllm", "qwen")],
        store=MemoryStore(),
        limits=RuntimeLimits(probe_interval=3600),
    )
    async with stack(node) as s:
        engine.answer(Reply.silent())
        record, _ = await run_to_end(node, a_run())
        assert record.reason == "timeout"
        with trio.fail_after(10):
            await s.edge.wait_until(lambda: "vllm/qwen" in s.handle.unavailable)
        async with open_runner(s.edge.client_url, token=TOKEN) as client:
            with pytest.raises(RemoteError) as refused:
                await client.submit(a_run())
            assert refused.value.code == pb.ERROR_CODE_UNAVAILABLE
            assert HUNG in refused.value.message
        engine.answer(OPENAI.whole_reply("Hi"))
        assert await node.probe_engines() == {}
        with trio.fail_after(10):
            await s.edge.wait_until(lambda: not s.handle.unavailable)
        assert s.edge.route("vllm/qwen") is s.handle
