"""A run's engine stream on h11 (adapters/engine_http.py): every way an engine can split or
end its answer, the pool's reuse rules, and one send a request, on a real server where the
case allows and on in-memory connections where it needs exact bytes."""

from __future__ import annotations

import itertools
import json
import ssl
from collections.abc import AsyncIterator, Callable

import attrs
import pytest
import trio
import trio.testing
import trustme
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iop_trio.adapters.base import AdapterRequest
from iop_trio.adapters.engine_http import EnginePool
from iop_trio.adapters.openai import OpenAIAdapter, OpenAISettings
from iop_trio.runtime import RunSpec, RunStatus

from .engines import (
    SSE,
    EngineServer,
    Reply,
    collect,
    failure,
    make_node,
    openai_chunk,
    openai_reply,
    openai_usage,
    run_to_end,
    serve,
)
from .support import count_sends
from .test_relay import text_of

REQUEST = AdapterRequest(run_id="r", model="m", prompt="hello " * 50, params={})


@pytest.fixture
async def server() -> AsyncIterator[EngineServer]:
    async with serve() as engine:
        yield engine


# --- on a real server ----------------------------------------------------------------------


async def test_a_request_goes_in_one_send_and_the_next_run_reuses_the_connection(server):
    adapter = OpenAIAdapter("o", OpenAISettings(base_url=server.url))
    sends = count_sends(adapter)
    for _ in range(2):
        server.push(openai_reply(["a", "b"]))
        chunks = await collect(adapter, REQUEST)
        assert "".join(getattr(c, "text", "") for c in chunks) == "ab"
    await adapter.aclose()
    assert (len(sends.writes), sends.connections, len(server.connections)) == (2, 1, 1)
    headers = server.exchanges[0].headers
    assert headers["accept-encoding"] == "identity"
    assert headers["content-type"] == "application/json"
    assert json.loads(server.exchanges[0].body)["stream"] is True


async def test_an_engine_that_says_close_gets_a_new_connection_next_time(server):
    adapter = OpenAIAdapter("o", OpenAISettings(base_url=server.url))
    for _ in range(2):
        reply = openai_reply(["a"])
        reply.headers.append(("connection", "close"))
        server.push(reply)
        await collect(adapter, REQUEST)
    await adapter.aclose()
    assert len(server.connections) == 2


async def test_a_run_cancelled_mid_stream_closes_its_connection_and_the_next_opens_one(server):
    adapter = OpenAIAdapter("o", OpenAISettings(base_url=server.url))
    reply = server.push(Reply(content_type=SSE, end="hang"))
    with trio.move_on_after(5) as bounded:
        async with adapter.open_stream(REQUEST) as chunks:
            await reply.send(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
            await anext(aiter(chunks))
            bounded.cancel()
            await trio.sleep_forever()
    exchange = await reply.request()
    with trio.fail_after(5):
        await exchange.disconnected.wait()
    assert adapter.engine_pool is not None and "idle=0" in repr(adapter.engine_pool)
    server.push(openai_reply(["b"]))
    await collect(adapter, REQUEST)
    await adapter.aclose()
    assert len(server.connections) == 2


async def test_an_https_engine_is_reached_over_tls_and_its_connection_kept():
    ca = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_tls)
    client_tls = ssl.create_default_context()
    ca.configure_trust(client_tls)
    async with serve(server_tls) as server:
        adapter = OpenAIAdapter("o", OpenAISettings(base_url=f"https://127.0.0.1:{server.port}"))
        adapter.engine_pool = EnginePool(ssl_context=lambda: client_tls)
        for _ in range(2):
            server.push(openai_reply(["a", "b"]))
            chunks = await collect(adapter, REQUEST)
            assert "".join(getattr(c, "text", "") for c in chunks) == "ab"
        await adapter.aclose()
        assert len(server.connections) == 1


async def test_an_https_engine_with_a_certificate_not_trusted_is_a_connection_error():
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    trustme.CA().issue_cert("127.0.0.1").configure_cert(server_tls)
    async with serve(server_tls) as server:
        adapter = OpenAIAdapter("o", OpenAISettings(base_url=f"https://127.0.0.1:{server.port}"))
        error = await failure(adapter, REQUEST)
        await adapter.aclose()
    assert error.reason == "connection"
    assert "CERTIFICATE_VERIFY_FAILED" in error.message, error.message


@attrs.define
class ClosingEngine:
    """A raw HTTP/1.1 server on loopback whose every connection answers ``answers``
    requests in full (keep-alive) and then closes: after the last answer (``linger``
    False), or on reading the next request without a word (``linger`` True)."""

    answers: int
    linger: bool
    requests: list[int] = attrs.field(factory=list)  # the connection of each request
    closed: trio.Event = attrs.field(factory=trio.Event)
    port: int = 0

    async def serve(self, stream: trio.SocketStream) -> None:
        conn_id = len(set(self.requests)) + 1
        body = (
            b"".join(
                ("data: " + json.dumps(c) + "\n\n").encode()
                for c in (openai_chunk("hi"), openai_chunk(finish_reason="stop"))
            )
            + b"data: [DONE]\n\n"
        )
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: "
        answer = head + str(len(body)).encode() + b"\r\n\r\n" + body
        buffer = b""
        with trio.fail_after(10):
            for n in range(self.answers + 1):
                while b"\r\n\r\n" not in buffer or not _whole(buffer):
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buffer += data
                self.requests.append(conn_id)
                buffer = buffer[_whole(buffer) :]
                if n == self.answers:
                    break
                await stream.send_all(answer)
                if n == self.answers - 1 and not self.linger:
                    break
        await stream.aclose()
        self.closed.set()


def _whole(buffer: bytes) -> int:
    """The length of the first whole request in ``buffer`` (0: not yet whole)."""
    head, sep, rest = buffer.partition(b"\r\n\r\n")
    if not sep:
        return 0
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return len(head) + 4 + length if len(rest) >= length else 0


async def _closing_engine(nursery: trio.Nursery, engine: ClosingEngine) -> str:
    listeners = await nursery.start(trio.serve_tcp, engine.serve, 0)
    engine.port = listeners[0].socket.getsockname()[1]
    return f"http://127.0.0.1:{engine.port}"


async def test_an_idle_connection_the_engine_closed_is_dropped_before_reuse(nursery):
    engine = ClosingEngine(answers=1, linger=False)
    adapter = OpenAIAdapter("o", OpenAISettings(base_url=await _closing_engine(nursery, engine)))
    await collect(adapter, REQUEST)
    with trio.fail_after(5):
        await engine.closed.wait()
    await trio.testing.wait_all_tasks_blocked()
    chunks = await collect(adapter, REQUEST)
    assert getattr(chunks[0], "text", None) == "hi"
    assert engine.requests == [1, 2]  # none sent on the closed connection
    await adapter.aclose()


async def test_a_reused_connection_closed_as_the_request_went_is_retried_once(nursery):
    engine = ClosingEngine(answers=1, linger=True)
    adapter = OpenAIAdapter("o", OpenAISettings(base_url=await _closing_engine(nursery, engine)))
    await collect(adapter, REQUEST)
    chunks = await collect(adapter, REQUEST)  # read by the first connection, unanswered
    assert getattr(chunks[0], "text", None) == "hi"
    assert engine.requests == [1, 1, 2]
    await adapter.aclose()


# --- every way an answer can be split or end (in memory) -----------------------------------

TEXT = st.text(alphabet=st.sampled_from("ab é日🙂\n"), min_size=1, max_size=6)


class ScriptedEngine(trio.abc.Stream):
    """An engine's side of one connection, in memory: takes the request, then gives
    ``reads`` one a ``receive_some``, then an EOF (the engine closed the connection)."""

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads
        self.sent: list[bytes] = []

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()
        self.sent.append(bytes(data))

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        return self.reads.pop(0) if self.reads else b""

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


@attrs.frozen
class Wire:
    """An answer's bytes; ``done_at``: the offset just past its ``[DONE]`` event;
    ``segments``: (offset in the wire, offset in the body, length) of each run of body
    bytes."""

    data: bytes
    head: int
    done_at: int
    segments: tuple[tuple[int, int, int], ...]
    chunk_starts: tuple[int, ...] = ()

    def body_before(self, at: int) -> int:
        """How many body bytes come before wire offset ``at``."""
        return sum(max(0, min(at - wire, size)) for wire, _body, size in self.segments)


def _events(pieces: list[str]) -> tuple[bytes, list[int]]:
    """The SSE body of ``pieces``, and the body offset just past each piece's event."""
    objects = [openai_chunk("", role="assistant")]
    objects += [openai_chunk(p) for p in pieces]
    objects += [openai_chunk(finish_reason="stop"), openai_usage(3, len(pieces))]
    events = [f"data: {json.dumps(o, ensure_ascii=False)}\n\n".encode() for o in objects]
    ends = [sum(map(len, events[: i + 2])) for i in range(len(pieces))]
    return b"".join(events) + b"data: [DONE]\n\n", ends


def _wire(body: bytes, framing: str, cuts: list[int]) -> Wire:
    """``body`` framed: ``chunked`` (cut at ``cuts``), ``length`` or ``http10``."""
    status = b"HTTP/1.0 200 OK" if framing == "http10" else b"HTTP/1.1 200 OK"
    head = status + b"\r\ncontent-type: text/event-stream\r\n"
    if framing == "length":
        head += b"content-length: " + str(len(body)).encode() + b"\r\n"
    if framing != "chunked":
        head += b"\r\n"
        whole = ((len(head), 0, len(body)),)
        return Wire(head + body, len(head), len(head) + len(body), whole)
    head += b"transfer-encoding: chunked\r\n\r\n"
    out, starts, segments = bytearray(head), [], []
    bounds = [0, *sorted({c % len(body) for c in cuts} - {0}), len(body)]
    for start, end in itertools.pairwise(bounds):
        starts.append(len(out))
        out += f"{end - start:x}\r\n".encode()
        segments.append((len(out), start, end - start))
        out += body[start:end] + b"\r\n"
    out += b"0\r\n\r\n"
    done_at = segments[-1][0] + segments[-1][2]
    return Wire(bytes(out), len(head), done_at, tuple(segments), tuple(starts))


def _split(data: bytes, points: list[int], byte_by_byte: bool) -> list[bytes]:
    if byte_by_byte:
        return [data[i : i + 1] for i in range(len(data))]
    bounds = [0, *sorted({p % max(len(data), 1) for p in points}), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


@attrs.frozen
class Ending:
    """How the answer ends: ``whole``, ``cut`` (the engine closes at ``at``) or
    ``bad_size`` (a chunk's size line is not hex, from ``at``)."""

    kind: str
    at: int = 0


def _apply(wire: Wire, ending: Ending) -> tuple[bytes, int]:
    """The bytes sent, and the wire offset of the fault (the end for none)."""
    if ending.kind == "cut":
        at = wire.head + 1 + ending.at % (len(wire.data) - wire.head - 1)
        return wire.data[:at], at
    if ending.kind == "bad_size" and wire.chunk_starts:
        at = wire.chunk_starts[ending.at % len(wire.chunk_starts)]
        return wire.data[:at] + b"zz\r\n" + wire.data[at:], at
    return wire.data, len(wire.data)


def _node_over(reads: list[bytes]) -> tuple[Callable[..., object], ScriptedEngine]:
    engine = ScriptedEngine(reads)
    adapter = OpenAIAdapter("o", OpenAISettings(base_url="http://engine.test:8000"))

    async def connect(host: str, port: int) -> trio.abc.Stream:
        assert (host, port) == ("engine.test", 8000)
        return engine

    assert adapter.engine_pool is not None
    adapter.engine_pool.connector = connect
    return make_node(adapter).running, engine


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pieces=st.lists(TEXT, min_size=1, max_size=6),
    framing=st.sampled_from(["chunked", "length", "http10"]),
    cuts=st.lists(st.integers(0, 10_000), max_size=8),
    points=st.lists(st.integers(0, 10_000), max_size=12),
    byte_by_byte=st.booleans(),
    ending=st.builds(Ending, st.sampled_from(["whole", "cut", "bad_size"]), st.integers(0, 10_000)),
)
async def test_every_split_and_ending_gives_the_stream_or_a_clear_failure(
    pieces, framing, cuts, points, byte_by_byte, ending
):
    body, ends = _events(pieces)
    wire = _wire(body, framing, cuts)
    data, fault = _apply(wire, ending)
    running, engine = _node_over(_split(data, points, byte_by_byte))
    async with running() as node:
        record, events = await run_to_end(node, RunSpec("o/m", prompt="hi"))
    full = "".join(pieces)
    stored = text_of(events)
    assert len(engine.sent) == 1  # the request in one send
    if fault >= wire.done_at:
        assert (record.status, stored) == (RunStatus.SUCCEEDED, full), record.message
        assert record.usage is not None and record.usage.completion_tokens == len(pieces)
        return
    assert record.status is RunStatus.FAILED
    # an HTTP/1.0 body ends at the close: a stream without its end; else the engine left
    expected = "bad_response" if framing == "http10" else "connection"
    assert record.reason == expected, record.message
    # every event whole before the fault is stored, none after it
    before = wire.body_before(fault)
    assert stored == "".join(p for p, end in zip(pieces, ends, strict=True) if end <= before)


async def test_a_header_that_is_not_ascii_is_invalid_params_before_any_connection():
    adapter = OpenAIAdapter(
        "o", OpenAISettings(base_url="http://engine.test:8000", headers={"x-who": "é"})
    )
    assert adapter.engine_pool is not None
    sends = count_sends(adapter)
    error = await failure(adapter, REQUEST)
    assert (error.reason, sends.connections) == ("invalid_params", 0)
    assert "cannot send the request" in error.message
