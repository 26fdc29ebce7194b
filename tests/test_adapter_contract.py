"""The contract of every HTTP adapter, run against each engine's wire format.

Each test takes ``wire`` (:data:`tests.engines.WIRES`: Ollama's NDJSON, OpenAI's
server-sent events) and a real local HTTP server speaking it, the way
``test_store_contract.py`` serves both stores. What only one engine does
(its request body, its stream format's corners) is in its own file.

Real clock: sockets are involved. Nothing sleeps; the tests wait on
server-side events, under ``trio.fail_after`` bounds.
"""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator, Callable
from email.utils import formatdate
from typing import Any

import httpx
import pytest
import trio

from iop_trio.adapters import AdapterError, AdapterRequest, Completion, Delta
from iop_trio.adapters.http_errors import ENGINE_RETRY_AFTER, retry_after_hint, transport_error
from iop_trio.model import MAX_RETRY_AFTER, MIN_RETRY_AFTER
from iop_trio.runtime import EventKind, RunSpec, RunStatus, Usage

from .engines import (
    OPENAI,
    STOP_USAGE,
    WIRES,
    EngineServer,
    Reply,
    Wire,
    collect,
    failure,
    make_node,
    next_event,
    recording_client,
    refused_port,
    run_to_end,
    serve,
    wait_end,
)


@pytest.fixture(params=WIRES, ids=repr)
def wire(request: pytest.FixtureRequest) -> Wire:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
async def server() -> AsyncIterator[EngineServer]:
    async with serve() as s:
        yield s


def prompt(wire: Wire) -> AdapterRequest:
    return AdapterRequest(run_id="r1", model=wire.model, prompt="hi")


def spec(wire: Wire, text: str = "hi") -> RunSpec:
    return RunSpec(wire.target, prompt=text)


def assert_names_engine(wire: Wire, message: str, url: str) -> None:
    assert f"{url}{wire.path}" in message
    assert f"'{wire.model}'" in message


async def run_reply(
    wire: Wire, server: EngineServer, reply: Reply | None, **settings: Any
) -> tuple[Any, Any]:
    """One run to its end against ``reply`` (pushed first, if given): (record, events)."""
    if reply is not None:
        server.push(reply)
    async with wire.adapter(server.url, **settings) as adapter:
        node = make_node(adapter, model=wire.model)
        async with node.running():
            return await run_to_end(node, spec(wire))


def deltas(events: Any) -> list[str]:
    return [e.text for e in events if e.kind is EventKind.DELTA]


# --- streaming --------------------------------------------------------------------------------


async def test_deltas_arrive_as_the_engine_sends_them(wire, server):
    """Chunk pacing is the server's: each delta is a run event before the next is sent."""
    reply = server.push(Reply(content_type=wire.content_type, end="hang"))
    async with wire.adapter(server.url) as adapter:
        node = make_node(adapter, model=wire.model)
        async with node.running():
            run = (await node.manager.submit(spec(wire))).record.run_id
            await reply.request()
            assert (await next_event(node, run, 1)).kind is EventKind.STARTED
            for seq, word in enumerate(["one", " two", " three"], start=3):
                await reply.send(wire.piece(word))
                event = await next_event(node, run, seq - 1)
                assert (event.seq, event.kind, event.text) == (seq, EventKind.DELTA, word)
            await reply.send(wire.end(Usage("stop", 5, 3)))
            await reply.finish()
            record, events = await wait_end(node, run)
    assert record.status is RunStatus.SUCCEEDED
    assert record.usage == Usage("stop", prompt_tokens=5, completion_tokens=3)
    assert [e.kind for e in events][-1] is EventKind.SUCCEEDED


async def test_run_end_to_end_stores_deltas_and_usage(wire, server):
    server.push(wire.reply(["Hel", "lo"], usage=Usage("stop", 4, 2)))
    async with wire.adapter(server.url) as adapter:
        node = make_node(adapter, model=wire.model)
        async with node.running():
            record, events = await run_to_end(node, spec(wire))
    kinds = [e.kind for e in events]
    # one delta a piece, or one for both if they came while the run was busy
    assert kinds[:2] == [EventKind.QUEUED, EventKind.STARTED]
    assert kinds[-1] is EventKind.SUCCEEDED
    assert set(kinds[2:-1]) == {EventKind.DELTA} and len(kinds) in (4, 5)
    assert "".join(e.text for e in events) == "Hello"
    assert record.status is RunStatus.SUCCEEDED
    assert record.usage == Usage("stop", prompt_tokens=4, completion_tokens=2)


async def test_runs_reuse_one_connection(wire, server):
    server.push(wire.reply(["a"]))
    server.push(wire.reply(["b"]))
    async with wire.adapter(server.url) as adapter:
        await collect(adapter, prompt(wire))
        await collect(adapter, prompt(wire))
    assert [e.connection.id for e in server.exchanges] == [1, 1]


async def test_two_runs_stream_at_once(wire, server):
    replies = [server.push(Reply(content_type=wire.content_type, end="hang")) for _ in range(2)]
    async with wire.adapter(server.url) as adapter:
        node = make_node(adapter, model=wire.model, concurrency=2)
        async with node.running():
            runs = {}
            for text in ("A", "B"):
                runs[text] = (await node.manager.submit(spec(wire, text))).record.run_id
            # both requests are open at the engine before either has an answer
            exchanges = [await reply.request() for reply in replies]
            by_prompt = {wire.prompt_of(e.json): r for e, r in zip(exchanges, replies, strict=True)}
            await by_prompt["B"].send(wire.piece("b1"))
            await by_prompt["A"].send(wire.piece("a1"))
            for text, reply in by_prompt.items():
                await reply.send(wire.piece(text.lower() + "2") + wire.end(Usage("stop")))
                await reply.finish()
            results = {p: await wait_end(node, run) for p, run in runs.items()}
    for text, (record, events) in results.items():
        assert record.status is RunStatus.SUCCEEDED
        assert "".join(deltas(events)) == f"{text.lower()}1{text.lower()}2"
    assert exchanges[0].connection is not exchanges[1].connection


# --- params -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wire", "params"),
    [(wire, params) for wire in WIRES for params in wire.bad_params],
    ids=repr,
)
async def test_bad_params_fail_before_any_request(wire, server, params):
    request = AdapterRequest(run_id="r", model=wire.model, prompt="p", params=params)
    async with wire.adapter(server.url) as adapter:
        error = await failure(adapter, request)
    assert error.reason == "invalid_params"
    assert server.exchanges == []


# --- failures ---------------------------------------------------------------------------------


async def test_error_status_fails_the_run_with_the_engine_message(wire, server):
    reply = wire.error(500, "llama runner process has terminated: signal: killed")
    record, events = await run_reply(wire, server, reply)
    assert (record.status, record.reason) == (RunStatus.FAILED, "engine_error")
    assert "HTTP 500" in record.message
    assert "llama runner process has terminated: signal: killed" in record.message
    assert_names_engine(wire, record.message, server.url)
    assert events[-1].kind is EventKind.FAILED


async def test_404_for_a_missing_model_is_model_not_found(wire, server):
    record, _ = await run_reply(wire, server, wire.error(404, f"model '{wire.model}' not found"))
    assert (record.status, record.reason) == (RunStatus.FAILED, "model_not_found")
    assert f"model '{wire.model}' not found" in record.message


async def test_404_of_another_server_is_an_engine_error(wire, server):
    reply = Reply(404, content_type="text/plain", parts=[b"404 page not found"])
    record, _ = await run_reply(wire, server, reply)
    assert (record.reason, record.status) == ("engine_error", RunStatus.FAILED)
    assert "HTTP 404 Not Found: 404 page not found" in record.message


@pytest.mark.parametrize(
    ("status", "reason", "phrase"),
    [(429, "engine_busy", "Too Many Requests"), (503, "engine_unavailable", "Service Unavailable")],
)
async def test_an_engine_that_turns_a_run_away_says_when_to_ask_again(
    wire, server, status, reason, phrase
):
    """The engine's Retry-After goes with the run's end: its record and its FAILED event."""
    reply = Reply(
        status,
        headers=[("retry-after", "7")],
        parts=[wire.error_body("the server is overloaded")],
        content_length=True,
    )
    record, events = await run_reply(wire, server, reply)
    assert (record.status, record.reason, record.retry_after) == (RunStatus.FAILED, reason, 7.0)
    assert (events[-1].kind, events[-1].retry_after) == (EventKind.FAILED, 7.0)
    assert f"HTTP {status} {phrase}: the server is overloaded" in record.message
    assert "retry after 7s" in record.message
    assert_names_engine(wire, record.message, server.url)


@pytest.mark.parametrize(
    ("header", "hint"),
    [
        ("2.5", 2.5),
        ("0", MIN_RETRY_AFTER),
        ("-5", MIN_RETRY_AFTER),  # a silly hint is bounded as the gate bounds its own
        ("99999999", MAX_RETRY_AFTER),
        ("inf", MAX_RETRY_AFTER),
        ("Fri, 01 Jan 2100 00:00:00 GMT", MAX_RETRY_AFTER),  # an HTTP date
        ("Fri, 01 Jan 1999 00:00:00 GMT", MIN_RETRY_AFTER),  # passed already
        ("nan", ENGINE_RETRY_AFTER),  # no number: as if the engine gave none
        ("soon", ENGINE_RETRY_AFTER),
        (None, ENGINE_RETRY_AFTER),
    ],
)
async def test_a_429s_hint_is_bounded_and_one_is_given_when_the_engine_gives_none(
    server, header, hint
):
    wire = OPENAI
    headers = [] if header is None else [("retry-after", header)]
    server.push(Reply(429, headers=headers, parts=[wire.error_body("busy")], content_length=True))
    async with wire.adapter(server.url) as adapter:
        error = await failure(adapter, prompt(wire))
    assert (error.reason, error.retry_after) == ("engine_busy", hint)


def test_retry_after_reads_seconds_and_http_dates():
    now = 1_700_000_000.0
    assert retry_after_hint(" 12 ", now=now) == 12.0
    assert retry_after_hint(formatdate(now + 90, usegmt=True), now=now) == 90.0
    assert retry_after_hint(formatdate(now + 90), now=now) == 90.0  # a zone, not GMT
    assert retry_after_hint("Sun, 06 Nov 1994 08:49:37 -0000", now=784111777.0 - 30) == 30.0
    for unreadable in ("", "soon", "nan", "-nan", "12 seconds", "Fri, 99 Foo 2100"):
        assert retry_after_hint(unreadable, now=now) is None, unreadable


async def test_error_mid_stream_fails_the_run(wire, server):
    parts = [wire.piece("partial"), wire.error_part]
    record, events = await run_reply(
        wire, server, Reply(content_type=wire.content_type, parts=parts)
    )
    assert (record.status, record.reason) == (RunStatus.FAILED, "engine_error")
    assert wire.error_words in record.message
    assert_names_engine(wire, record.message, server.url)
    assert deltas(events) == ["partial"]


@pytest.mark.parametrize(
    ("wire", "part"), [(wire, part) for wire in WIRES for part in wire.bad_parts], ids=repr
)
async def test_bad_data_is_bad_response(wire, server, part):
    reply = Reply(content_type=wire.content_type, parts=[wire.piece("a"), part, wire.end(Usage())])
    record, _ = await run_reply(wire, server, reply)
    assert (record.status, record.reason) == (RunStatus.FAILED, "bad_response")
    assert_names_engine(wire, record.message, server.url)


@pytest.mark.parametrize("content_length", [True, False])
@pytest.mark.parametrize(
    ("wire", "content_type"),
    [(wire, kind) for wire in WIRES for kind in wire.empty_content_types],
    ids=repr,
)
async def test_empty_200_is_empty_response(wire, server, content_type, content_length):
    server.push(Reply(content_type=content_type, parts=[], content_length=content_length))
    server.push(Reply(200, parts=[b"{}"], content_length=True))  # the repeated request: fine
    record, _ = await run_reply(wire, server, None)
    assert (record.status, record.reason) == (RunStatus.FAILED, "empty_response")
    assert_names_engine(wire, record.message, server.url)
    assert "the same request without streaming was accepted, HTTP 200" in record.message
    streamed, probe = server.exchanges
    assert streamed.json["stream"] is True
    assert probe.json["stream"] is False
    assert wire.is_probe(probe.json)
    assert wire.prompt_of(probe.json) == wire.prompt_of(streamed.json)


async def test_an_empty_streamed_answer_gets_the_engine_error_the_plain_request_gets(wire, server):
    """llama.cpp's server answers a streamed prompt longer than its context 200 and
    empty; asked without streaming, it says why."""
    server.push(Reply(content_type=wire.content_type, parts=[]))
    too_long = "the request exceeds the available context size, try increasing it"
    server.push(wire.error(400, too_long))
    record, _ = await run_reply(wire, server, None)
    assert (record.status, record.reason) == (RunStatus.FAILED, "engine_error")
    assert "HTTP 400 Bad Request" in record.message
    assert too_long in record.message
    assert "without streaming, after an empty streamed answer" in record.message
    assert len(server.exchanges) == 2  # asked once more, no further


async def test_the_repeated_request_goes_again_if_its_connection_was_dropped(wire, server):
    """llama.cpp's server resets the connection its empty answer came on; the repeated
    request, taken from the pool, meets the reset and is sent once more."""
    server.push(Reply(content_type=wire.content_type, parts=[]))
    server.push(Reply(end="reset", headers_now=False))
    server.push(wire.error(400, "the request exceeds the available context size"))
    record, _ = await run_reply(wire, server, None)
    assert (record.status, record.reason) == (RunStatus.FAILED, "engine_error")
    assert "exceeds the available context size" in record.message
    assert len(server.exchanges) == 3


async def test_an_empty_streamed_answer_whose_repeat_never_comes_is_empty_response(wire, server):
    server.push(Reply(content_type=wire.content_type, parts=[]))
    server.push(Reply.silent())
    record, _ = await run_reply(wire, server, None, read_timeout=0.5)
    assert (record.status, record.reason) == (RunStatus.FAILED, "empty_response")
    assert "asked again: " in record.message
    assert "no response within 0.5s" in record.message


async def test_stream_without_its_end_is_truncated(wire, server):
    record, events = await run_reply(wire, server, wire.reply(["a", "b"], done=False))
    assert (record.status, record.reason) == (RunStatus.FAILED, "bad_response")
    assert "truncated" in record.message
    assert "".join(deltas(events)) == "ab"  # one delta or two: what came at once is joined


@pytest.mark.faults
@pytest.mark.parametrize("end", ["abort", "reset"])
async def test_connection_dropped_mid_stream_is_connection(wire, server, end):
    record, events = await run_reply(wire, server, wire.reply(["a"], done=False, end=end))
    assert (record.status, record.reason) == (RunStatus.FAILED, "connection")
    assert_names_engine(wire, record.message, server.url)
    assert deltas(events) == ["a"]


@pytest.mark.faults
async def test_closed_without_a_response_is_connection(wire, server):
    record, _ = await run_reply(wire, server, Reply(end="abort", headers_now=False))
    assert (record.status, record.reason) == (RunStatus.FAILED, "connection")
    assert "before responding" in record.message


@pytest.mark.faults
async def test_engine_that_never_answers_times_out(wire, server):
    reply = server.push(Reply.silent())
    record, _ = await run_reply(wire, server, None, read_timeout=0.5)
    assert (record.status, record.reason) == (RunStatus.FAILED, "timeout")
    assert "no response within 0.5s" in record.message
    assert_names_engine(wire, record.message, server.url)
    exchange = await reply.request()
    with trio.fail_after(5):
        await exchange.disconnected.wait()


@pytest.mark.faults
async def test_stream_that_stalls_times_out(wire, server):
    reply = server.push(wire.reply(["a"], done=False, end="hang"))
    record, events = await run_reply(wire, server, None, read_timeout=0.5)
    assert (record.status, record.reason) == (RunStatus.FAILED, "timeout")
    assert "stalled: no data for 0.5s" in record.message
    assert deltas(events) == ["a"]
    with trio.fail_after(5):
        await (await reply.request()).disconnected.wait()


@pytest.mark.faults
async def test_connection_refused_fails_the_run(wire):
    with refused_port() as port:
        url = f"http://127.0.0.1:{port}"
        adapter = wire.adapter(url)
        node = make_node(adapter, model=wire.model)
        async with node.running():
            record, _ = await run_to_end(node, spec(wire))
    assert (record.status, record.reason) == (RunStatus.FAILED, "connection")
    assert f"{wire.kind} engine at {url}{wire.path} (model '{wire.model}')" in record.message
    assert "cannot connect" in record.message


async def test_trust_env_sends_runs_through_the_environments_proxy(wire, server, monkeypatch):
    """With ``trust_env`` a run's request goes where the client's proxy settings say (here:
    the fake engine, as an HTTP proxy); without it they are ignored."""
    monkeypatch.setenv("HTTP_PROXY", server.url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    behind = "http://engine.invalid:9"  # reachable only through the proxy
    reply = server.push(wire.reply(["via ", "proxy"]))
    async with wire.adapter(behind, trust_env=True) as adapter:
        node = make_node(adapter, model=wire.model)
        async with node.running():
            record, events = await run_to_end(node, spec(wire))
    assert record.status is RunStatus.SUCCEEDED
    assert "".join(deltas(events)) == "via proxy"
    exchange = await reply.request()
    assert exchange.path == behind + wire.path  # a proxy's request names the whole URL
    async with wire.adapter(behind) as adapter:
        node = make_node(adapter, model=wire.model)
        async with node.running():
            record, _ = await run_to_end(node, spec(wire))
    assert (record.status, record.reason) == (RunStatus.FAILED, "connection")


# --- cancellation -----------------------------------------------------------------------------


async def test_cancel_mid_stream_closes_the_http_stream(wire, server):
    reply = server.push(wire.reply(["first"], done=False, end="hang"))
    client, responses = recording_client()
    async with client, wire.adapter(server.url, client=client) as adapter:
        node = make_node(adapter, model=wire.model)
        async with node.running():
            run = (await node.manager.submit(spec(wire))).record.run_id
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


async def test_cancel_while_waiting_for_headers_closes_the_connection(wire, server):
    reply = server.push(Reply.silent())
    async with wire.adapter(server.url) as adapter:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:

                async def cancel_when_asked() -> None:
                    await reply.request()
                    scope.cancel()

                nursery.start_soon(cancel_when_asked)
                await collect(adapter, prompt(wire))
        assert scope.cancelled_caught
        with trio.fail_after(5):
            await (await reply.request()).disconnected.wait()


async def test_cancelled_open_stream_closes_the_response_before_it_returns(wire, server):
    reply = server.push(wire.reply(["a", "b"], done=False, end="hang"))
    client, responses = recording_client()
    async with client, wire.adapter(server.url, client=client) as adapter:
        with trio.CancelScope() as scope:
            async with adapter.open_stream(prompt(wire)) as chunks:
                async for chunk in chunks:
                    assert chunk == Delta("a")
                    scope.cancel()
                    await trio.lowlevel.checkpoint()
        assert scope.cancelled_caught
        assert responses[0].is_closed
        with trio.fail_after(5):
            await (await reply.request()).disconnected.wait()


async def test_leaving_open_stream_early_closes_the_response_before_it_returns(wire, server):
    reply = server.push(wire.reply(["a", "b"], done=False, end="hang"))
    client, responses = recording_client()
    async with client, wire.adapter(server.url, client=client) as adapter:
        async with adapter.open_stream(prompt(wire)) as chunks:
            async for chunk in chunks:
                assert chunk == Delta("a")
                break
        assert responses[0].is_closed
        with trio.fail_after(5):
            await (await reply.request()).disconnected.wait()


async def test_node_shutdown_closes_open_streams(wire, server):
    reply = server.push(wire.reply(["first"], done=False, end="hang"))
    async with wire.adapter(server.url) as adapter:
        node = make_node(adapter, model=wire.model)
        async with node.running():
            run = (await node.manager.submit(spec(wire))).record.run_id
            await next_event(node, run, 2)
        record = await node.store.get(run)
        assert record is not None
        assert (record.status, record.reason) == (RunStatus.CANCELLED, "node_shutdown")
        with trio.fail_after(5):
            await (await reply.request()).disconnected.wait()


# --- the adapter itself -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"base_url": "ftp://x"},
        {"base_url": "localhost:11434"},
        {"base_url": "http://[::1"},
        {"connect_timeout": 0},
        {"read_timeout": -1},
        {"write_timeout": "1"},
    ],
)
def test_bad_settings_are_a_value_error_naming_the_key(wire, bad):
    settings = {"base_url": "http://127.0.0.1:11434", **bad}
    with pytest.raises(
        ValueError, match=r"base_url: must be|_timeout: must be a number of seconds > 0"
    ):
        wire.settings_type(**settings)


def test_max_concurrency_is_a_capability(wire):
    assert wire.adapter("http://e:1", max_concurrency=2).capabilities.max_concurrency == 2


async def test_aclose_closes_its_own_client_not_an_injected_one(wire):
    own = wire.adapter("http://e:1")
    client = own.client
    await own.aclose()
    assert client.is_closed
    assert own.client is not client  # made again on use
    await own.aclose()

    injected = httpx.AsyncClient()
    adapter = wire.adapter("http://e:1", client=injected)
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
async def test_transport_errors_map_to_reasons(wire, exc, reason, words):
    adapter = wire.adapter("http://engine:11434", connect_timeout=5, client=failing_client(exc))
    error = await failure(adapter, prompt(wire))
    assert error.reason == reason
    assert words in error.message
    assert error.message.startswith(
        f"{wire.kind} engine at http://engine:11434{wire.path} (model '{wire.model}')"
    )
    await adapter.client.aclose()


@pytest.mark.parametrize(
    ("exc", "unresponsive"),
    [
        (httpx.ConnectTimeout("t"), True),  # the engine did not answer in time
        (httpx.ReadTimeout("t"), True),
        (httpx.WriteTimeout("t"), False),  # a long prompt on a slow link, as much as a hang
        (httpx.PoolTimeout("t"), False),  # the node's own pool
        (httpx.ConnectError("refused"), False),  # down, not hung: the list probe sees it
        (httpx.RemoteProtocolError("closed"), False),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Exception) else str(value),
)
def test_only_connect_and_read_timeouts_say_the_engine_did_not_answer(exc, unresponsive):
    for streaming in (False, True):
        error = transport_error(exc, "here", httpx.Timeout(1.0), streaming=streaming)
        assert error.unresponsive is unresponsive, (error, streaming)


async def test_a_run_probe_asks_for_one_token_without_streaming(wire, server):
    """What the node asks of a target whose engine did not answer a run in time: the run's
    own request (the target's params), for as little output as the engine allows."""
    reply = server.push(wire.whole_reply("Hi"))
    request = AdapterRequest(run_id="p", model=wire.model, prompt="hi", params={"seed": 3})
    async with wire.adapter(server.url) as adapter:
        with trio.fail_after(10):
            await adapter.probe_generation(request)
    body = (await reply.request()).json
    assert ((await reply.request()).path, body["stream"]) == (wire.path, False)
    assert wire.is_probe(body)
    assert wire.prompt_of(body) == "hi"
    assert 3 in (body.get("seed"), body.get("options", {}).get("seed"))


async def test_a_run_probe_the_engine_does_not_answer_in_time_is_unresponsive(
    wire, server, autojump_clock
):
    server.push(Reply.silent())
    server.push(wire.error(500, "the model runner crashed"))
    async with wire.adapter(server.url, read_timeout=60.0) as adapter:
        with pytest.raises(AdapterError) as silent:
            await adapter.probe_generation(prompt(wire))
        assert (silent.value.reason, silent.value.unresponsive) == ("timeout", True)
        assert "within 30" in silent.value.message  # PROBE_TIMEOUT, not the read_timeout
        with pytest.raises(AdapterError) as crashed:
            await adapter.probe_generation(prompt(wire))
        assert (crashed.value.reason, crashed.value.unresponsive) == ("engine_error", False)
        assert "the model runner crashed" in crashed.value.message


def test_transport_error_for_a_stalled_stream_says_so():
    timeout = httpx.Timeout(1.0, read=2.5)
    error = transport_error(httpx.ReadTimeout("x"), "here", timeout, streaming=True)
    assert (error.reason, error.message) == (
        "timeout",
        "here: the stream stalled: no data for 2.5s",
    )


async def test_a_compressed_stream_is_decoded(wire, server):
    """A body with a content-encoding is decoded (one without is read raw, as it is)."""
    body = b"".join(wire.piece(word) for word in ("un", "zipped")) + wire.end(Usage("stop", 2, 2))
    compressed = gzip.compress(body)
    parts = [compressed[:10], compressed[10:]]
    gzipped = [("content-encoding", "gzip")]
    reply = Reply(content_type=wire.content_type, headers=gzipped, parts=parts)
    record, events = await run_reply(wire, server, reply)
    assert record.status is RunStatus.SUCCEEDED
    assert "".join(deltas(events)) == "unzipped"


async def test_what_arrives_in_one_read_is_one_delta(wire, server):
    """A node that is behind its engine finds several tokens in one read: they go on as one
    delta (same text, same order); what came before a fault in that read is kept."""
    together = b"".join(wire.piece(word) for word in ("one", " two", " three"))
    reply = Reply(content_type=wire.content_type, parts=[together + wire.end(Usage("stop", 2, 3))])
    record, events = await run_reply(wire, server, reply)
    assert record.status is RunStatus.SUCCEEDED
    assert deltas(events) == ["one two three"]
    parts = [wire.piece("kept") + wire.piece(" too") + wire.error_part]
    record, events = await run_reply(
        wire, server, Reply(content_type=wire.content_type, parts=parts)
    )
    assert (record.status, record.reason) == (RunStatus.FAILED, "engine_error")
    assert deltas(events) == ["kept too"]


async def test_a_delta_holds_one_token_an_engine_chunk(wire, server):
    """The engine writes a chunk a token: a delta joined of one read's chunks holds as many
    tokens (a chunk with no text holds none), so a run can count what its engine sent."""
    server.push(wire.reply(["one", " two"]))  # a part a write: h11 reads them one by one
    together = b"".join(wire.piece(word) for word in ("a", "", " b", " c"))
    server.push(Reply(content_type=wire.content_type, parts=[together + wire.end(STOP_USAGE)]))
    faulty = wire.piece("kept") + wire.piece(" too") + wire.error_part
    server.push(Reply(content_type=wire.content_type, parts=[faulty]))
    async with wire.adapter(server.url) as adapter:
        chunks = await collect(adapter, prompt(wire))
        assert [c for c in chunks if isinstance(c, Delta)] == [Delta("one", 1), Delta(" two", 1)]
        assert await collect(adapter, prompt(wire)) == [
            Delta("a b c", tokens=3),
            Completion(STOP_USAGE),
        ]
        got: list[object] = []
        with pytest.raises(AdapterError):
            async with adapter.open_stream(prompt(wire)) as stream:
                async for chunk in stream:
                    got.append(chunk)
    assert got == [Delta("kept too", tokens=2)]  # what came before the fault
