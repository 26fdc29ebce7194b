"""A run's spans from the door to the engine, with the SDK's in-memory exporter.

Real parts: the door served by hypercorn, the edge and a node over the proto-socket on
loopback, and an HTTP engine speaking OpenAI's wire that records the headers it got.
The edge and the node each get a TracerProvider of their own (two processes, one
exporter), never the global one.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import attrs
import httpx
import pytest
import trio
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, format_span_id, format_trace_id

from iop_trio import tracing
from iop_trio.adapters.echo import EchoAdapter
from iop_trio.cli.serve import log_run_end
from iop_trio.edge import Edge
from iop_trio.edge.front_door import serve_door
from iop_trio.logs import JsonFormatter
from iop_trio.model import EventKind, RunSpec, RunStatus, TargetSpec
from iop_trio.protocol import pb
from iop_trio.protocol.convert import request_from_spec, spec_from_request
from iop_trio.runtime import Node, RuntimeLimits
from iop_trio.store.memory import MemoryStore
from iop_trio.transport import NodeLink, open_runner

from .engines import OPENAI, EngineServer, openai_reply, serve
from .test_wire import FAST, TOKEN

WAIT = 30
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{CALLER}-01"


class Spans(InMemorySpanExporter):
    """The spans ended so far, and a wait for the one named so (no sleeping)."""

    def __init__(self) -> None:
        super().__init__()
        self._changed = trio.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> object:
        result = super().export(spans)
        self._changed.set()
        self._changed = trio.Event()
        return result

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.get_finished_spans() if s.name == name]

    async def wait_for(self, name: str, count: int = 1) -> list[ReadableSpan]:
        with trio.fail_after(WAIT):
            while len(self.named(name)) < count:
                await self._changed.wait()
        return self.named(name)


def provider(spans: Spans, service: str) -> TracerProvider:
    from opentelemetry.sdk.resources import Resource

    made = TracerProvider(resource=Resource.create({"service.name": service}))
    made.add_span_processor(SimpleSpanProcessor(spans))
    return made


@pytest.fixture
def spans() -> Spans:
    return Spans()


@pytest.fixture
async def engine() -> AsyncIterator[EngineServer]:
    async with serve() as server:
        yield server


@attrs.frozen
class Traced:
    edge: Edge
    node: Node
    door: str  # the door's base URL


@asynccontextmanager
async def traced(node: Node, edge: Edge) -> AsyncIterator[Traced]:
    """``node`` linked to ``edge`` on loopback, and the door in front."""
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(edge.serve)
            async with node.running():
                link = NodeLink(node, edge.node_url, token=TOKEN, backoff=FAST)
                nursery.start_soon(link.run)
                await edge.wait_for_node(node.node_id)
                await link.wait_connected()
                port = await nursery.start(serve_door, edge, "127.0.0.1", 0)
                yield Traced(edge, node, f"http://127.0.0.1:{port}")
                await link.aclose()
            nursery.cancel_scope.cancel()


def engine_node(url: str, spans: Spans | None, **limits: object) -> Node:
    return Node(
        node_id="n1",
        adapters=[OPENAI.adapter(url)],
        targets=[TargetSpec("vllm", "qwen")],
        store=MemoryStore(),
        limits=RuntimeLimits(**limits),  # type: ignore[arg-type]
        tracer_provider=None if spans is None else provider(spans, "node"),
    )


def echo_node(spans: Spans | None, *, concurrency: int = 2, **limits: object) -> Node:
    return Node(
        node_id="n1",
        adapters=[EchoAdapter()],
        targets=[TargetSpec("echo", "a", concurrency=concurrency)],
        store=MemoryStore(),
        limits=RuntimeLimits(**limits),  # type: ignore[arg-type]
        tracer_provider=None if spans is None else provider(spans, "node"),
    )


def edge_for(spans: Spans | None) -> Edge:
    return Edge(token=TOKEN, tracer_provider=None if spans is None else provider(spans, "edge"))


async def chat(
    door: str, model: str, *, traceparent: str | None = None, **extra: object
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    if traceparent is not None:
        headers["traceparent"] = traceparent
    body = {"model": model, "messages": [{"role": "user", "content": "hi there"}], **extra}
    async with httpx.AsyncClient(base_url=door, timeout=WAIT) as http:
        return await http.post("/v1/chat/completions", json=body, headers=headers)


def hex_ids(span: ReadableSpan) -> tuple[str, str]:
    assert span.context is not None
    return format_trace_id(span.context.trace_id), format_span_id(span.context.span_id)


def parent_id(span: ReadableSpan) -> str | None:
    return None if span.parent is None else format_span_id(span.parent.span_id)


async def test_one_trace_from_the_door_through_the_node_to_the_engine(spans, engine):
    engine.push(openai_reply(["Hel", "lo"], usage=(7, 2)))
    async with traced(engine_node(engine.url, spans), edge_for(spans)) as t:
        answer = await chat(t.door, "vllm/qwen", traceparent=TRACEPARENT, max_tokens=16)
        assert answer.status_code == 200, answer.text
        (door,) = await spans.wait_for("chat vllm/qwen")
    (relay,) = spans.named(tracing.SPAN_RELAY)
    (run,) = spans.named(tracing.SPAN_RUN)
    (call,) = spans.named(tracing.SPAN_ENGINE)
    (write,) = spans.named(tracing.SPAN_STORE_FINAL_WRITE)
    assert not spans.named(tracing.SPAN_GATE_WAIT)  # it did not wait
    # one trace, and each span the child of the one before it
    everyone = [door, relay, run, call, write]
    assert {hex_ids(s)[0] for s in everyone} == {TRACE}
    assert parent_id(door) == CALLER and door.parent is not None and door.parent.is_remote
    assert parent_id(relay) == hex_ids(door)[1]
    assert parent_id(run) == hex_ids(relay)[1]
    assert parent_id(call) == parent_id(write) == hex_ids(run)[1]
    assert (door.kind, relay.kind, run.kind, call.kind) == (
        SpanKind.SERVER,
        SpanKind.CLIENT,
        SpanKind.SERVER,
        SpanKind.CLIENT,
    )
    # the engine got the engine span's context, so its own spans join the trace
    (exchange,) = engine.exchanges
    assert exchange.headers["traceparent"] == f"00-{TRACE}-{hex_ids(call)[1]}-01"
    # what each says
    run_id = answer.headers["x-iop-run-id"]
    assert run.attributes is not None
    assert run.attributes[tracing.GEN_AI_OPERATION_NAME] == "chat"
    assert run.attributes[tracing.GEN_AI_PROVIDER_NAME] == "openai"
    assert run.attributes[tracing.GEN_AI_REQUEST_MODEL] == "qwen"
    assert run.attributes[tracing.GEN_AI_REQUEST_MAX_TOKENS] == 16
    assert run.attributes[tracing.GEN_AI_USAGE_INPUT_TOKENS] == 7
    assert run.attributes[tracing.GEN_AI_USAGE_OUTPUT_TOKENS] == 2
    assert run.attributes[tracing.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert run.attributes[tracing.IOP_RUN_ID] == run_id
    assert run.attributes[tracing.IOP_NODE_ID] == "n1"
    assert run.attributes[tracing.IOP_TARGET] == "vllm/qwen"
    assert run.attributes[tracing.IOP_STATUS] == "succeeded"
    wait = run.attributes[tracing.IOP_QUEUE_WAIT_S]
    assert isinstance(wait, float) and 0 <= wait < WAIT
    assert run.status.status_code is StatusCode.UNSET
    assert door.attributes is not None
    assert door.attributes[tracing.GEN_AI_REQUEST_MODEL] == "vllm/qwen"
    assert door.attributes[tracing.GEN_AI_REQUEST_MAX_TOKENS] == 16
    assert door.attributes[tracing.GEN_AI_USAGE_OUTPUT_TOKENS] == 2
    assert door.attributes[tracing.IOP_RUN_ID] == run_id
    assert relay.attributes is not None and relay.attributes[tracing.IOP_NODE_ID] == "n1"
    assert [e.name for e in call.events] == [tracing.EVENT_FIRST_TOKEN, tracing.EVENT_END]
    # the two processes' spans, as their providers name them
    assert {s.resource.attributes["service.name"] for s in (door, relay)} == {"edge"}
    assert {s.resource.attributes["service.name"] for s in (run, call, write)} == {"node"}


async def test_a_rejected_run_has_an_error_status_and_its_reason(spans):
    # a budget of 5 tokens: a run reserving its prompt and 1024 output tokens is too large
    async with traced(echo_node(spans, token_budget=5), edge_for(spans)) as t:
        answer = await chat(t.door, "echo/a", traceparent=TRACEPARENT)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == "too_large"
        (door,) = await spans.wait_for("chat echo/a")
    (run,) = spans.named(tracing.SPAN_RUN)
    for span in (door, run):
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description is not None
        assert span.status.description.startswith("too_large")
        assert span.attributes is not None
        assert span.attributes[tracing.IOP_REJECT_REASON] == "too_large"
        assert span.attributes[tracing.ERROR_TYPE] == "too_large"
    assert run.attributes is not None and run.attributes[tracing.IOP_STATUS] == "rejected"
    assert not spans.named(tracing.SPAN_ENGINE)  # it never started


async def test_with_no_traceparent_a_new_trace_starts_at_the_door(spans, engine):
    engine.push(openai_reply(["ok"]))
    async with traced(engine_node(engine.url, spans), edge_for(spans)) as t:
        answer = await chat(t.door, "vllm/qwen")
        assert answer.status_code == 200, answer.text
        (door,) = await spans.wait_for("chat vllm/qwen")
    (run,) = spans.named(tracing.SPAN_RUN)
    assert door.parent is None
    trace_id = hex_ids(door)[0]
    assert trace_id != TRACE and hex_ids(run)[0] == trace_id
    assert engine.exchanges[0].headers["traceparent"].split("-")[1] == trace_id


async def test_a_proto_socket_run_request_with_a_traceparent_parents_the_nodes_spans(spans):
    async with traced(echo_node(spans), edge_for(spans)) as t:
        async with open_runner(t.edge.client_url, token=TOKEN) as client:
            async with client.run(RunSpec("echo/a", "a b c", traceparent=TRACEPARENT)) as s:
                _, last = await s.collect()
            assert last.kind is EventKind.SUCCEEDED
        (asked,) = await spans.wait_for("chat echo/a")
    (relay,) = spans.named(tracing.SPAN_RELAY)
    (run,) = spans.named(tracing.SPAN_RUN)
    assert {hex_ids(s)[0] for s in (asked, relay, run)} == {TRACE}
    assert parent_id(asked) == CALLER
    assert parent_id(relay) == hex_ids(asked)[1]
    assert parent_id(run) == hex_ids(relay)[1]
    assert asked.kind is SpanKind.SERVER


async def test_an_edge_that_sends_no_context_still_works_and_the_node_starts_a_trace(spans):
    """An older edge (or one not tracing) sends no traceparent: the run is as before."""
    async with traced(echo_node(spans), edge_for(None)) as t:
        answer = await chat(t.door, "echo/a", traceparent=TRACEPARENT)
        assert answer.status_code == 200, answer.text
        (run,) = await spans.wait_for(tracing.SPAN_RUN)
    # the edge's no-op tracer passes the caller's context on as it came
    assert hex_ids(run)[0] == TRACE and parent_id(run) == CALLER
    assert not spans.named(tracing.SPAN_RELAY)


async def test_a_node_given_no_context_starts_a_trace_of_its_own(spans):
    node = echo_node(spans)
    async with node.running():
        submitted = await node.manager.submit(RunSpec("echo/a", "hi"))
        (run,) = await spans.wait_for(tracing.SPAN_RUN)
    assert run.parent is None
    assert run.attributes is not None
    assert run.attributes[tracing.IOP_RUN_ID] == submitted.record.run_id


async def test_the_wire_carries_the_context_and_an_old_request_has_none():
    spec = RunSpec("echo/a", "hi", traceparent=TRACEPARENT, tracestate="k=v")
    request = request_from_spec(spec)
    assert (request.traceparent, request.tracestate) == (TRACEPARENT, "k=v")
    back = spec_from_request(pb.RunRequest.FromString(request.SerializeToString()))
    assert (back.traceparent, back.tracestate) == (TRACEPARENT, "k=v")
    old = spec_from_request(pb.RunRequest(target="echo/a", prompt="hi"))
    assert (old.traceparent, old.tracestate) == ("", "")
    # a value longer than any W3C one is dropped (a new trace), not kept
    long = spec_from_request(pb.RunRequest(target="echo/a", prompt="hi", traceparent="0" * 500))
    assert long.traceparent == ""
    await trio.lowlevel.checkpoint()


async def test_a_run_that_waits_has_a_gate_span_naming_the_full_level(spans):
    node = echo_node(spans, concurrency=1)
    words = " ".join(f"w{i}" for i in range(500))
    async with node.running():
        first = await node.manager.submit(RunSpec("echo/a", words, options={"delay": 0.05}))
        second = await node.manager.submit(RunSpec("echo/a", "short"))
        assert node.gate.is_waiting(node.manager.runs.get(second.record.run_id))
        await node.manager.cancel(first.record.run_id)
        runs = await spans.wait_for(tracing.SPAN_RUN, 2)
        (gate,) = await spans.wait_for(tracing.SPAN_GATE_WAIT)
    by_id = {r.attributes[tracing.IOP_RUN_ID]: r for r in runs if r.attributes is not None}
    waited = by_id[second.record.run_id]
    assert parent_id(gate) == hex_ids(waited)[1]
    assert gate.attributes is not None and gate.attributes[tracing.IOP_QUEUE_LEVEL] == "target"
    assert gate.status.status_code is StatusCode.UNSET  # it was granted
    cancelled = by_id[first.record.run_id]
    assert cancelled.status.status_code is StatusCode.ERROR
    assert cancelled.status.description == "cancelled"
    assert cancelled.attributes is not None
    assert cancelled.attributes[tracing.IOP_STATUS] == RunStatus.CANCELLED.value


async def test_a_json_log_line_about_a_run_names_its_trace(spans):
    node = echo_node(spans)
    node.event_listeners.append(log_run_end)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("iop_trio.node")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        async with node.running():
            await node.manager.submit(RunSpec("echo/a", "hi", traceparent=TRACEPARENT))
            (run,) = await spans.wait_for(tracing.SPAN_RUN)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    (line,) = [json.loads(x) for x in out.getvalue().splitlines()]
    assert (line["trace_id"], line["span_id"]) == hex_ids(run)
    assert line["trace_id"] == TRACE


async def test_with_tracing_off_a_run_has_no_spans_and_the_engine_no_context(engine):
    engine.push(openai_reply(["ok"]))
    node = engine_node(engine.url, None)
    async with node.running():
        submitted = await node.manager.submit(RunSpec("vllm/qwen", "hi"))
        live = node.manager.runs.get(submitted.record.run_id)
        assert live is None or live.spans is None
        with trio.fail_after(WAIT):
            async for event in node.manager.watch(submitted.record.run_id):
                if event.kind.terminal:
                    break
    assert "traceparent" not in engine.exchanges[0].headers
