"""The ollama adapter against a real local HTTP server speaking Ollama's NDJSON API.

Real clock: sockets are involved. Nothing sleeps; the tests wait on
server-side events, under ``trio.fail_after`` bounds.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import trio

from iop_trio.adapters import (
    AdapterRequest,
    Completion,
    Delta,
    default_registry,
)
from iop_trio.adapters._http import LineSplitter, transport_error
from iop_trio.adapters.ollama import OllamaAdapter
from iop_trio.runtime import EventKind, RunSpec, RunStatus, Usage

from .engines import (
    NDJSON,
    EngineServer,
    Reply,
    collect,
    failure,
    make_node,
    ndjson,
    next_event,
    ollama_done,
    ollama_error,
    ollama_piece,
    ollama_reply,
    recording_client,
    refused_port,
    run_to_end,
    serve,
    wait_end,
)

GENERATE = AdapterRequest(run_id="r1", model="llama3", prompt="Why is the sky blue?")
CHAT = AdapterRequest(run_id="r2", model="llama3", messages=(("user", "hi"),))


@pytest.fixture
async def server() -> AsyncIterator[EngineServer]:
    async with serve() as s:
        yield s


def ollama(server: EngineServer, **kw: Any) -> OllamaAdapter:
    kw.setdefault("read_timeout", 10.0)
    kw.setdefault("connect_timeout", 5.0)
    return OllamaAdapter("ollama", base_url=server.url, **kw)


# --- streaming --------------------------------------------------------------------------------


async def test_generate_streams_deltas_then_usage(server):
    server.push(ollama_reply(["The sky", "", " is blue."], chat=False))
    async with ollama(server) as adapter:
        chunks = await collect(adapter, GENERATE)
    assert chunks == [
        Delta("The sky"),
        Delta(" is blue."),
        Completion(Usage("stop", prompt_tokens=5, completion_tokens=3)),
    ]
    [exchange] = server.exchanges
    assert (exchange.method, exchange.path) == ("POST", "/api/generate")
    assert exchange.headers["content-type"] == "application/json"
    assert exchange.json == {"model": "llama3", "prompt": "Why is the sky blue?", "stream": True}


async def test_chat_posts_messages_to_api_chat(server):
    server.push(ollama_reply(["Hello", "!"]))
    request = AdapterRequest(
        run_id="r", model="llama3", messages=(("system", "be nice"), ("user", "hi"))
    )
    async with ollama(server, headers={"X-Proxy-Key": "k"}) as adapter:
        chunks = await collect(adapter, request)
    assert chunks[:2] == [Delta("Hello"), Delta("!")]
    assert isinstance(chunks[2], Completion)
    [exchange] = server.exchanges
    assert exchange.path == "/api/chat"
    assert exchange.headers["x-proxy-key"] == "k"
    assert exchange.json == {
        "model": "llama3",
        "stream": True,
        "messages": [
            {"role": "system", "content": "be nice"},
            {"role": "user", "content": "hi"},
        ],
    }


async def test_deltas_arrive_as_the_engine_sends_them(server):
    """Chunk pacing is the server's: each delta is a run event before the next is sent."""
    reply = server.push(Reply(content_type=NDJSON, end="hang"))
    async with ollama(server) as adapter:
        node = make_node(adapter, model="llama3")
        async with node.running():
            run = (await node.manager.submit(RunSpec("ollama/llama3", prompt="hi"))).record.run_id
            await reply.request()
            assert (await next_event(node, run, 1)).kind is EventKind.STARTED
            for seq, word in enumerate(["one", " two", " three"], start=3):
                await reply.send(ndjson(ollama_piece(word, chat=False)))
                event = await next_event(node, run, seq - 1)
                assert (event.seq, event.kind, event.text) == (seq, EventKind.DELTA, word)
            await reply.send(ndjson(ollama_done(chat=False, eval_count=3)))
            await reply.finish()
            record, events = await wait_end(node, run)
    assert record.status is RunStatus.SUCCEEDED
    assert record.usage == Usage("stop", prompt_tokens=5, completion_tokens=3)
    assert [e.kind for e in events][-1] is EventKind.SUCCEEDED


async def test_lines_split_anywhere_and_unicode_line_separators_kept(server):
    body = ndjson(
        ollama_piece("caf\u00e9 \u2028 \x85 ok", chat=False),
        ollama_done(chat=False),
    ).replace(b"\n", b"\r\n", 1)
    raw = body.replace(b"\\u2028", "\u2028".encode()).replace(b"\\u0085", "\x85".encode())
    raw = raw.replace(b"\\u00e9", "\u00e9".encode())
    cut = raw.index("\u00e9".encode()) + 1  # inside the two bytes of the e-acute
    parts = [raw[:cut], raw[cut : cut + 3], raw[cut + 3 :]]
    server.push(Reply(content_type=NDJSON, parts=parts))
    async with ollama(server) as adapter:
        chunks = await collect(adapter, GENERATE)
    assert chunks[0] == Delta("caf\u00e9 \u2028 \x85 ok")
    assert isinstance(chunks[1], Completion)


async def test_final_line_without_newline_and_missing_counts(server):
    done = {"model": "m", "response": "", "done": True}  # old Ollama: no done_reason, no counts
    body = ndjson(ollama_piece("x", chat=False)) + json.dumps(done).encode()
    server.push(Reply(content_type=NDJSON, parts=[body]))
    async with ollama(server) as adapter:
        chunks = await collect(adapter, GENERATE)
    assert chunks == [Delta("x"), Completion(Usage(""))]


async def test_runs_reuse_one_connection(server):
    server.push(ollama_reply(["a"], chat=False))
    server.push(ollama_reply(["b"], chat=False))
    async with ollama(server) as adapter:
        await collect(adapter, GENERATE)
        await collect(adapter, GENERATE)
    assert [e.connection.id for e in server.exchanges] == [1, 1]


# --- params -----------------------------------------------------------------------------------


async def test_params_map_to_options_and_top_level(server):
    server.push(ollama_reply(["ok"], chat=False))
    params = {
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 40,
        "num_predict": 16,
        "num_ctx": 2048,
        "seed": 7,
        "stop": "\n\n",
        "repeat_penalty": 1.1,
        "keep_alive": "5m",
        "format": "json",
        "system": "be brief",
        "options": {"mirostat": 1, "temperature": 0.9},
        "min_p": None,  # not set
        "delay": 3,  # another adapter's param: ignored
    }
    request = AdapterRequest(run_id="r", model="llama3", prompt="p", params=params)
    async with ollama(server) as adapter:
        await collect(adapter, request)
    assert server.exchanges[0].json == {
        "model": "llama3",
        "prompt": "p",
        "stream": True,
        "system": "be brief",
        "keep_alive": "5m",
        "format": "json",
        "options": {
            "mirostat": 1,
            "temperature": 0.2,
            "top_p": 0.9,
            "top_k": 40,
            "num_predict": 16,
            "num_ctx": 2048,
            "seed": 7,
            "stop": ["\n\n"],
            "repeat_penalty": 1.1,
        },
    }


@pytest.mark.parametrize(
    ("messages", "sent"),
    [
        ((("user", "hi"),), [("system", "sys"), ("user", "hi")]),
        ((("system", "own"), ("user", "hi")), [("system", "own"), ("user", "hi")]),
    ],
)
async def test_system_param_in_a_chat(server, messages, sent):
    server.push(ollama_reply(["ok"]))
    request = AdapterRequest(run_id="r", model="m", messages=messages, params={"system": "sys"})
    async with ollama(server) as adapter:
        await collect(adapter, request)
    body = server.exchanges[0].json
    assert [(m["role"], m["content"]) for m in body["messages"]] == sent
    assert "system" not in body


@pytest.mark.parametrize("params", [{"options": [1]}, {"system": 3}])
async def test_bad_params_fail_before_any_request(server, params):
    request = AdapterRequest(run_id="r", model="m", prompt="p", params=params)
    async with ollama(server) as adapter:
        error = await failure(adapter, request)
    assert error.reason == "invalid_params"
    assert server.exchanges == []


async def test_profile_params_and_run_options_reach_the_engine(server):
    server.push(ollama_reply(["ok"], chat=False))
    async with ollama(server) as adapter:
        node = make_node(adapter, model="llama3", params={"temperature": 0.1, "num_ctx": 4096})
        async with node.running():
            spec = RunSpec("ollama/llama3", prompt="p", options={"temperature": 0.7, "seed": 1})
            record, _ = await run_to_end(node, spec)
    assert record.status is RunStatus.SUCCEEDED
    assert server.exchanges[0].json["options"] == {"temperature": 0.7, "num_ctx": 4096, "seed": 1}


# --- through the runtime ----------------------------------------------------------------------


async def test_run_end_to_end_stores_deltas_and_usage(server):
    server.push(ollama_reply(["Hel", "lo"]))
    async with ollama(server) as adapter:
        node = make_node(adapter, model="llama3")
        async with node.running():
            spec = RunSpec("ollama/llama3", messages=(("user", "hi"),))
            record, events = await run_to_end(node, spec)
    assert [e.kind for e in events] == [
        EventKind.QUEUED,
        EventKind.STARTED,
        EventKind.DELTA,
        EventKind.DELTA,
        EventKind.SUCCEEDED,
    ]
    assert "".join(e.text for e in events) == "Hello"
    assert record.status is RunStatus.SUCCEEDED
    assert record.usage == Usage("stop", prompt_tokens=5, completion_tokens=2)


async def run_failing(server: EngineServer, reply: Reply | None, **kw: Any) -> tuple[Any, Any]:
    if reply is not None:
        server.push(reply)
    async with ollama(server, **kw) as adapter:
        node = make_node(adapter, model="llama3")
        async with node.running():
            return await run_to_end(node, RunSpec("ollama/llama3", prompt="hi"))


def assert_names_engine(message: str, url: str) -> None:
    assert f"{url}/api/generate" in message
    assert "'llama3'" in message


async def test_error_status_fails_the_run_with_the_engine_message(server):
    reply = ollama_error(500, "llama runner process has terminated: signal: killed")
    record, events = await run_failing(server, reply)
    assert (record.status, record.reason) == (RunStatus.FAILED, "engine_error")
    assert "HTTP 500" in record.message
    assert "llama runner process has terminated: signal: killed" in record.message
    assert_names_engine(record.message, server.url)
    assert events[-1].kind is EventKind.FAILED


async def test_404_for_a_missing_model_is_model_not_found(server):
    record, _ = await run_failing(server, ollama_error(404, "model 'llama3' not found"))
    assert (record.status, record.reason) == (RunStatus.FAILED, "model_not_found")
    assert "model 'llama3' not found" in record.message


async def test_404_of_another_server_is_an_engine_error(server):
    reply = Reply(404, content_type="text/plain", parts=[b"404 page not found"])
    record, _ = await run_failing(server, reply)
    assert (record.reason, record.status) == ("engine_error", RunStatus.FAILED)
    assert "HTTP 404 Not Found: 404 page not found" in record.message


async def test_error_line_mid_stream_fails_the_run(server):
    parts = [
        ndjson(ollama_piece("partial", chat=False)),
        ndjson({"error": "an error was encountered while running the model: unexpected EOF"}),
    ]
    record, events = await run_failing(server, Reply(content_type=NDJSON, parts=parts))
    assert (record.status, record.reason) == (RunStatus.FAILED, "engine_error")
    assert "unexpected EOF" in record.message
    assert_names_engine(record.message, server.url)
    assert [e.text for e in events if e.kind is EventKind.DELTA] == ["partial"]


@pytest.mark.parametrize("line", [b"{not json\n", b"[1, 2]\n", b'{"response": 3}\n'])
async def test_bad_lines_are_bad_response(server, line):
    reply = Reply(content_type=NDJSON, parts=[ndjson(ollama_piece("a", chat=False)), line])
    record, _ = await run_failing(server, reply)
    assert (record.status, record.reason) == (RunStatus.FAILED, "bad_response")
    assert_names_engine(record.message, server.url)


@pytest.mark.parametrize("content_length", [True, False])
async def test_empty_200_is_empty_response(server, content_length):
    reply = Reply(content_type=NDJSON, parts=[], content_length=content_length)
    record, _ = await run_failing(server, reply)
    assert (record.status, record.reason) == (RunStatus.FAILED, "empty_response")
    assert_names_engine(record.message, server.url)


async def test_stream_without_done_line_is_truncated(server):
    record, events = await run_failing(server, ollama_reply(["a", "b"], chat=False, done=False))
    assert (record.status, record.reason) == (RunStatus.FAILED, "bad_response")
    assert "truncated" in record.message
    assert [e.text for e in events if e.kind is EventKind.DELTA] == ["a", "b"]


@pytest.mark.parametrize("end", ["abort", "reset"])
async def test_connection_dropped_mid_stream_is_connection(server, end):
    record, events = await run_failing(server, ollama_reply(["a"], chat=False, done=False, end=end))
    assert (record.status, record.reason) == (RunStatus.FAILED, "connection")
    assert_names_engine(record.message, server.url)
    assert [e.text for e in events if e.kind is EventKind.DELTA] == ["a"]


async def test_closed_without_a_response_is_connection(server):
    record, _ = await run_failing(server, Reply(end="abort", headers_now=False))
    assert (record.status, record.reason) == (RunStatus.FAILED, "connection")
    assert "before responding" in record.message


async def test_engine_that_never_answers_times_out(server):
    reply = server.push(Reply.silent())
    record, _ = await run_failing(server, None, read_timeout=0.5)
    assert (record.status, record.reason) == (RunStatus.FAILED, "timeout")
    assert "no response within 0.5s" in record.message
    assert_names_engine(record.message, server.url)
    exchange = await reply.request()
    with trio.fail_after(5):
        await exchange.disconnected.wait()


async def test_stream_that_stalls_times_out(server):
    reply = server.push(ollama_reply(["a"], chat=False, done=False, end="hang"))
    record, events = await run_failing(server, None, read_timeout=0.5)
    assert (record.status, record.reason) == (RunStatus.FAILED, "timeout")
    assert "stalled: no data for 0.5s" in record.message
    assert [e.text for e in events if e.kind is EventKind.DELTA] == ["a"]
    with trio.fail_after(5):
        await (await reply.request()).disconnected.wait()


async def test_connection_refused_fails_the_run():
    with refused_port() as port:
        adapter = OllamaAdapter(base_url=f"http://127.0.0.1:{port}", connect_timeout=5)
        node = make_node(adapter, model="llama3")
        async with node.running():
            record, _ = await run_to_end(node, RunSpec("ollama/llama3", prompt="hi"))
    assert (record.status, record.reason) == (RunStatus.FAILED, "connection")
    assert f"http://127.0.0.1:{port}/api/generate" in record.message
    assert "'llama3'" in record.message
    assert "cannot connect" in record.message


# --- cancellation -----------------------------------------------------------------------------


async def test_cancel_mid_stream_closes_the_http_stream(server):
    reply = server.push(ollama_reply(["first"], chat=False, done=False, end="hang"))
    client, responses = recording_client()
    async with client, ollama(server, client=client) as adapter:
        node = make_node(adapter, model="llama3")
        async with node.running():
            run = (await node.manager.submit(RunSpec("ollama/llama3", prompt="hi"))).record.run_id
            assert (await next_event(node, run, 2)).text == "first"
            exchange = await reply.request()
            assert not exchange.disconnected.is_set()
            outcome = await node.manager.cancel(run, reason="user asked")
            # closed before the run's end was recorded, not later by the garbage collector
            assert responses[0].is_closed
            with trio.fail_after(5):
                await exchange.disconnected.wait()
            record, events = await wait_end(node, run)
    assert outcome.cancelled
    assert (record.status, record.reason) == (RunStatus.CANCELLED, "user asked")
    assert [e.kind for e in events] == [
        EventKind.QUEUED,
        EventKind.STARTED,
        EventKind.DELTA,
        EventKind.CANCELLED,
    ]
    assert exchange.connection.closed_by_client


async def test_cancel_while_waiting_for_headers_closes_the_connection(server):
    reply = server.push(Reply.silent())
    async with ollama(server) as adapter:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:

                async def cancel_when_asked() -> None:
                    await reply.request()
                    scope.cancel()

                nursery.start_soon(cancel_when_asked)
                await collect(adapter, GENERATE)
        assert scope.cancelled_caught
        with trio.fail_after(5):
            await (await reply.request()).disconnected.wait()


async def test_cancelled_open_stream_closes_the_response_before_it_returns(server):
    reply = server.push(ollama_reply(["a", "b"], chat=False, done=False, end="hang"))
    client, responses = recording_client()
    async with client, ollama(server, client=client) as adapter:
        with trio.CancelScope() as scope:
            async with adapter.open_stream(GENERATE) as chunks:
                async for chunk in chunks:
                    assert chunk == Delta("a")
                    scope.cancel()
                    await trio.lowlevel.checkpoint()
        assert scope.cancelled_caught
        assert responses[0].is_closed
        with trio.fail_after(5):
            await (await reply.request()).disconnected.wait()


# --- the adapter itself -----------------------------------------------------------------------


def test_registry_builds_ollama_adapters():
    adapter = default_registry().create("ollama", "local", base_url="http://127.0.0.1:11434/")
    assert isinstance(adapter, OllamaAdapter)
    assert adapter.base_url == "http://127.0.0.1:11434"
    assert repr(adapter) == (
        "<OllamaAdapter 'local' base_url='http://127.0.0.1:11434' max_concurrency=None>"
    )


@pytest.mark.parametrize(
    "kw",
    [
        {"base_url": "ftp://x"},
        {"base_url": "localhost:11434"},
        {"base_url": "http://[::1"},
        {"connect_timeout": 0},
        {"read_timeout": -1},
        {"write_timeout": "1"},
    ],
)
def test_bad_config_is_a_value_error(kw):
    kw.setdefault("base_url", "http://127.0.0.1:11434")
    with pytest.raises(ValueError, match=r"base_url must be|seconds > 0"):
        OllamaAdapter(**kw)


def test_max_concurrency_is_a_capability():
    assert OllamaAdapter(max_concurrency=2).capabilities.max_concurrency == 2


async def test_aclose_closes_its_own_client_not_an_injected_one():
    own = OllamaAdapter()
    client = own.client
    await own.aclose()
    assert client.is_closed
    assert own.client is not client  # made again on use
    await own.aclose()

    injected = httpx.AsyncClient()
    adapter = OllamaAdapter(client=injected)
    assert adapter.client is injected
    await adapter.aclose()
    assert not injected.is_closed
    await injected.aclose()


def failing_client(exc: Callable[[httpx.Request], Exception]) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc(request)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


@pytest.mark.parametrize(
    ("exc", "reason", "words"),
    [
        (
            lambda r: httpx.ConnectTimeout("t", request=r),
            "timeout",
            "could not connect within 5.0s",
        ),
        (lambda r: httpx.PoolTimeout("t", request=r), "timeout", "no free connection"),
        (lambda r: httpx.WriteTimeout("t", request=r), "timeout", "could not send the request"),
        (
            lambda r: httpx.ConnectError("[Errno -2] Name or service not known", request=r),
            "connection",
            "cannot connect: [Errno -2] Name or service not known",
        ),
        (lambda r: httpx.ReadError("reset by peer", request=r), "connection", "connection lost"),
        (lambda r: httpx.ProxyError("no proxy", request=r), "connection", "connection lost"),
        (lambda r: httpx.UnsupportedProtocol("h9", request=r), "connection", "h9"),
        (lambda r: httpx.DecodingError("bad gzip", request=r), "bad_response", "bad gzip"),
        (lambda r: httpx.LocalProtocolError("odd", request=r), "engine_error", "odd"),
    ],
)
async def test_transport_errors_map_to_reasons(exc, reason, words):
    adapter = OllamaAdapter(
        base_url="http://engine:11434", connect_timeout=5, client=failing_client(exc)
    )
    error = await failure(adapter, GENERATE)
    assert error.reason == reason
    assert words in error.message
    assert error.message.startswith(
        "ollama engine at http://engine:11434/api/generate (model 'llama3')"
    )
    await adapter.client.aclose()


def test_transport_error_for_a_stalled_stream_says_so():
    timeout = httpx.Timeout(1.0, read=2.5)
    error = transport_error(httpx.ReadTimeout("x"), "here", timeout, streaming=True)
    assert (error.reason, error.message) == (
        "timeout",
        "here: the stream stalled: no data for 2.5s",
    )


@pytest.mark.parametrize(
    ("chunks", "lines", "rest"),
    [
        ([b"a\nb", b"\n"], [b"a", b"b"], None),
        ([b"a\r", b"\nb\r\n"], [b"a", b"b"], None),
        ([b"a\rb\n"], [b"a\rb"], None),  # a lone CR is not a line end in NDJSON
        ([b"x\xe2\x80", b"\xa8y\n", b"tail\r"], ["x\u2028y".encode()], b"tail"),
    ],
)
def test_ndjson_line_splitter(chunks, lines, rest):
    splitter = LineSplitter(cr=False)
    got = [line for chunk in chunks for line in splitter.feed(chunk)]
    assert got == lines
    assert splitter.flush() == rest


def test_line_splitter_refuses_an_endless_line():
    splitter = LineSplitter(cr=False, max_line=10)
    splitter.feed(b"12345")
    with pytest.raises(ValueError, match="longer than 10 bytes"):
        splitter.feed(b"678901")
