"""The openai adapter against a real local HTTP server speaking OpenAI's SSE chat API.

Real clock: sockets are involved. Nothing sleeps; the tests wait on
server-side events, under ``trio.fail_after`` bounds.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from iop_trio.adapters import (
    AdapterRequest,
    Completion,
    Delta,
    default_registry,
)
from iop_trio.adapters._http import HTTPAdapter
from iop_trio.adapters.openai import OpenAIAdapter, OpenAISettings
from iop_trio.adapters.stream_formats import SSEDecoder, SSEEvent
from iop_trio.runtime import EventKind, RunSpec, RunStatus, Usage

from .engines import (
    JSON,
    OPENAI,
    SSE,
    SSE_DONE,
    EngineServer,
    Reply,
    collect,
    make_node,
    openai_chunk,
    openai_error,
    openai_reply,
    openai_stream,
    run_to_end,
    serve,
    sse,
)

PROMPT = AdapterRequest(run_id="r1", model="qwen", prompt="Say hi")
CHAT = AdapterRequest(run_id="r2", model="qwen", messages=(("system", "be brief"), ("user", "hi")))
PATH = "/v1/chat/completions"


@pytest.fixture
async def server() -> AsyncIterator[EngineServer]:
    async with serve() as s:
        yield s


def openai(server: EngineServer, **kw: Any) -> HTTPAdapter:
    return OPENAI.adapter(server.url, **kw)


def assert_names_engine(message: str, url: str) -> None:
    assert f"{url}{PATH}" in message
    assert "'qwen'" in message


# --- streaming --------------------------------------------------------------------------------


async def test_prompt_streams_deltas_finish_reason_and_usage(server):
    server.push(openai_reply(["Hi", " there"], finish_reason="length", usage=(9, 2)))
    async with openai(server, api_key="sk-test") as adapter:
        chunks = await collect(adapter, PROMPT)
    assert chunks == [
        Delta("Hi"),
        Delta(" there"),
        Completion(Usage("length", prompt_tokens=9, completion_tokens=2)),
    ]
    [exchange] = server.exchanges
    assert (exchange.method, exchange.path) == ("POST", PATH)
    assert exchange.headers["authorization"] == "Bearer sk-test"
    assert exchange.json == {
        "model": "qwen",
        "messages": [{"role": "user", "content": "Say hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def test_chat_without_usage_option_or_key(server):
    server.push(openai_reply(["ok"], usage=None))
    async with openai(server, include_usage=False) as adapter:
        chunks = await collect(adapter, CHAT)
    assert chunks == [Delta("ok"), Completion(Usage("stop"))]
    [exchange] = server.exchanges
    assert "authorization" not in exchange.headers
    assert exchange.json == {
        "model": "qwen",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
        ],
        "stream": True,
    }


async def test_base_url_may_end_in_v1(server):
    server.push(openai_reply(["ok"]))
    async with OPENAI.adapter(server.url + "/v1/") as adapter:
        await collect(adapter, PROMPT)
    assert server.exchanges[0].path == PATH


async def test_sse_edge_cases_on_the_wire(server):
    """Comments, CRLF and CR line ends, multi-line data, event/id/retry fields, a BOM,
    no space after the colon, and every event split across TCP writes."""
    first = json.dumps(openai_chunk("a\nb")).replace(', "', ',\n"')  # JSON over several lines
    body = (
        "\ufeff: this is a comment\r\n"
        "retry: 100\r\n\r\n"
        + "".join(f"data: {line}\r\n" for line in first.split("\n"))
        + "id: 1\r\n\r\n"
        + "event: message\r"
        + f"data:{json.dumps(openai_chunk('c', finish_reason='stop'))}\r\r"
        + ": keep-alive\n\n"
        + "data: [DONE]\n\n"
    ).encode()
    parts = [body[i : i + 7] for i in range(0, len(body), 7)]
    server.push(Reply(content_type=SSE, parts=parts))
    async with openai(server) as adapter:
        chunks = await collect(adapter, PROMPT)
    assert chunks == [Delta("a\nb"), Delta("c"), Completion(Usage("stop"))]


async def test_non_streamed_json_answer_is_accepted(server):
    completion = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "whole"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }
    server.push(Reply(content_type=JSON, parts=[json.dumps(completion).encode()]))
    async with openai(server) as adapter:
        chunks = await collect(adapter, PROMPT)
    # one answer, not a chunk a token: its tokens are estimated from its size
    assert chunks == [Delta("whole", tokens=2), Completion(Usage("stop", 3, 1))]


async def test_params_and_extra_body_map_to_the_body(server):
    server.push(openai_reply(["ok"]))
    params = {
        "temperature": 0.3,
        "top_p": 0.8,
        "max_tokens": 64,
        "stop": ["\n"],
        "seed": 5,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "top_k": 3,  # not an OpenAI param: ignored (use extra_body)
        "extra_body": {"top_k": 20, "repetition_penalty": 1.05, "stream": False, "seed": 6},
    }
    request = AdapterRequest(run_id="r", model="qwen", prompt="p", params=params)
    async with openai(server) as adapter:
        await collect(adapter, request)
    assert server.exchanges[0].json == {
        "model": "qwen",
        "messages": [{"role": "user", "content": "p"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.3,
        "top_p": 0.8,
        "max_tokens": 64,
        "stop": ["\n"],
        "seed": 6,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "top_k": 20,
        "repetition_penalty": 1.05,
    }


async def test_profile_params_and_run_options_reach_the_engine(server):
    server.push(openai_reply(["ok"]))
    async with openai(server) as adapter:
        node = make_node(adapter, model="qwen", params={"temperature": 0.1, "max_tokens": 8})
        async with node.running():
            spec = RunSpec("vllm/qwen", prompt="p", options={"max_tokens": 16})
            record, _ = await run_to_end(node, spec)
    assert record.status is RunStatus.SUCCEEDED
    body = server.exchanges[0].json
    assert (body["temperature"], body["max_tokens"]) == (0.1, 16)


# --- through the runtime ----------------------------------------------------------------------


async def run_failing(server: EngineServer, reply: Reply | None, **kw: Any) -> tuple[Any, Any]:
    if reply is not None:
        server.push(reply)
    async with openai(server, **kw) as adapter:
        node = make_node(adapter, model="qwen")
        async with node.running():
            return await run_to_end(node, RunSpec("vllm/qwen", prompt="hi"))


@pytest.mark.parametrize(
    ("reply", "words"),
    [
        (
            openai_error(400, "max_tokens must be at least 1, got -1."),
            "HTTP 400 Bad Request: max_tokens must be at least 1, got -1. (invalid_request_error)",
        ),
        (
            Reply(500, parts=[b'"the server is overloaded"'], content_length=True),
            "HTTP 500 Internal Server Error: the server is overloaded",
        ),
        (
            Reply(504, content_type="text/html", parts=[b"<h1>Gateway\n Timeout</h1>"]),
            "HTTP 504 Gateway Timeout: <h1>Gateway Timeout</h1>",
        ),
        (
            Reply(
                400,
                parts=[b'{"object": "error", "message": "old vLLM says no", "code": 400}'],
            ),
            "HTTP 400 Bad Request: old vLLM says no",
        ),
        (
            Reply(
                422,
                parts=[b'{"detail": [{"loc": ["body", "messages"], "msg": "field required"}]}'],
            ),
            "HTTP 422 Unprocessable Entity: body.messages: field required",
        ),
        (Reply(502, content_type=None), "HTTP 502 Bad Gateway: no details"),
    ],
)
async def test_error_status_fails_the_run_with_the_engine_message(server, reply, words):
    record, events = await run_failing(server, reply)
    assert (record.status, record.reason) == (RunStatus.FAILED, "engine_error")
    assert words in record.message
    assert_names_engine(record.message, server.url)
    assert events[-1].kind is EventKind.FAILED


async def test_401_names_the_status(server):
    record, _ = await run_failing(server, openai_error(401, "Invalid API key", type="auth"))
    assert record.reason == "engine_error"
    assert "HTTP 401 Unauthorized: Invalid API key (auth)" in record.message


@pytest.mark.parametrize(
    ("error_part", "words"),
    [
        (
            sse({"error": {"message": "CUDA out of memory", "type": "InternalServerError"}}),
            "CUDA out of memory (InternalServerError)",
        ),
        (sse({"object": "error", "message": "old style", "code": 500}), "old style"),
        (sse({"message": "in an error event"}, event="error"), '{"message": "in an error event"}'),
        (b'error: {"code": 500, "message": "llama.cpp says no"}\n\n', "llama.cpp says no"),
    ],
)
async def test_error_mid_stream_fails_the_run(server, error_part, words):
    parts = [*openai_stream(["partial"], done=False, usage=None)[:2], error_part]
    record, events = await run_failing(server, Reply(content_type=SSE, parts=parts))
    assert (record.status, record.reason) == (RunStatus.FAILED, "engine_error")
    assert "engine error mid-stream" in record.message
    assert words in record.message
    assert_names_engine(record.message, server.url)
    assert [e.text for e in events if e.kind is EventKind.DELTA] == ["partial"]


@pytest.mark.parametrize(
    "parts",
    [
        openai_stream(["a"], done=False),
        [*openai_stream(["a"])[:-1], b"data: [DONE]\n"],  # no blank line after it
    ],
)
async def test_stream_without_done_is_truncated(server, parts):
    record, events = await run_failing(server, Reply(content_type=SSE, parts=parts))
    assert (record.status, record.reason) == (RunStatus.FAILED, "bad_response")
    assert "without 'data: [DONE]': truncated" in record.message
    assert [e.text for e in events if e.kind is EventKind.DELTA] == ["a"]


@pytest.mark.parametrize(
    "parts",
    [
        [SSE_DONE],  # llama.cpp's server cutting a second stream short
        [sse(openai_chunk("", role="assistant")), sse(openai_chunk("half")), SSE_DONE],
    ],
)
async def test_done_without_a_finish_reason_is_a_half_answer_not_success(server, parts):
    record, _ = await run_failing(server, Reply(content_type=SSE, parts=parts))
    assert (record.status, record.reason) == (RunStatus.FAILED, "bad_response")
    assert "the engine ended the stream without finishing" in record.message
    assert_names_engine(record.message, server.url)


async def test_html_page_instead_of_a_stream_is_bad_response(server):
    reply = Reply(content_type="text/html", parts=[b"<html>hello</html>"])
    record, _ = await run_failing(server, reply)
    assert record.reason == "bad_response"
    assert "content-type 'text/html'" in record.message


async def test_comments_alone_do_not_keep_a_stalled_stream_alive_forever(server):
    """A keep-alive comment resets the read timeout (it is data), then silence ends the run."""
    pace = trio.Event()
    parts = [b": ping\n\n", pace, b": ping\n\n"]
    reply = server.push(Reply(content_type=SSE, parts=parts, end="hang"))
    async with trio.open_nursery() as nursery:

        async def ping_after_request() -> None:
            await reply.request()
            pace.set()

        nursery.start_soon(ping_after_request)
        record, _ = await run_failing(server, None, read_timeout=0.5)
    assert record.reason == "timeout"
    assert len(reply.written) == 2


def test_registry_builds_openai_adapters_and_repr_hides_the_key():
    settings = OpenAISettings(base_url="http://gpu:8000", api_key="sk-secret")
    adapter = default_registry().create("openai", "vllm", settings, max_concurrency=4)
    assert isinstance(adapter, OpenAIAdapter)
    assert adapter.capabilities.max_concurrency == 4
    assert repr(adapter) == "<OpenAIAdapter 'vllm' base_url='http://gpu:8000' max_concurrency=4>"
    assert "sk-secret" not in repr(adapter)
    assert "sk-secret" not in repr(settings)


# --- the SSE decoder (sans-IO) ----------------------------------------------------------------


def decode(*chunks: bytes) -> list[SSEEvent]:
    decoder = SSEDecoder()
    return [event for chunk in chunks for event in decoder.feed(chunk)]


@pytest.mark.parametrize(
    ("stream", "events"),
    [
        (b"data: a\n\n", [SSEEvent("a")]),
        (b"data:a\ndata:  b\n\n", [SSEEvent("a\n b")]),
        (b"data\n\n", [SSEEvent("")]),
        (b"data: a\r\n\r\ndata: b\r\rdata: c\n\n", [SSEEvent("a"), SSEEvent("b"), SSEEvent("c")]),
        (
            b"event: x\nid: 7\ndata: a\n\ndata: b\n\n",
            [SSEEvent("a", "x", "7"), SSEEvent("b", id="7")],
        ),
        (b": comment\nevent: x\n\ndata: a\n\n", [SSEEvent("a")]),  # no data: nothing dispatched
        (b"\xef\xbb\xbfdata: a\n\n", [SSEEvent("a")]),
        (b"dat\xc3\xa0: x\nfoo: y\ndata: \xff\n\n", [SSEEvent("\ufffd")]),
        (b"data: cut off at the end", []),
        (b"data: no blank line\n", []),
        (b'error: {"message": "m"}\n\n', [SSEEvent('{"message": "m"}', "error")]),
    ],
)
def test_sse_decoder(stream, events):
    assert decode(stream) == events


SSE_TEXT = st.lists(
    st.one_of(
        st.text(alphabet="ab: \u2028é", max_size=8).map(lambda t: f"data: {t}"),
        st.sampled_from(["", ": c", "event: e", "id: 1", "retry: 5", "data"]),
    ),
    max_size=12,
)


@given(
    lines=SSE_TEXT,
    eol=st.sampled_from(["\n", "\r\n", "\r"]),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_sse_decoder_ignores_chunking(lines, eol, cuts):
    stream = "".join(line + eol for line in lines).encode()
    whole = decode(stream)
    bounds = sorted({c for c in cuts if c <= len(stream)} | {0, len(stream)})
    pieces = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    assert decode(*pieces) == whole
    assert len(whole) <= sum(1 for line in lines if line == "")


class LineByLine(SSEDecoder):
    """The decoder without its shortcut for whole ``data:`` events: the reference."""

    def _whole_data_events(self, data: bytes) -> list[SSEEvent] | None:
        return None


DATA_LINE = st.text(alphabet="ab: \u2028é", max_size=6).map(lambda t: f"data:{t}")


@settings(max_examples=400)
@given(
    events=st.lists(
        st.lists(
            # mostly what engines write, so that the shortcut is taken often
            st.one_of(
                DATA_LINE,
                DATA_LINE,
                DATA_LINE,
                st.sampled_from([": c", "event: e", "id: 1", "data", "error: x"]),
            ),
            min_size=1,
            max_size=2,
        ),
        max_size=8,
    ),
    bom=st.booleans(),
    line_cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=3),
)
def test_the_shortcut_for_whole_data_events_decodes_as_the_line_by_line_path(
    events, bom, line_cuts, cuts
):
    """What an engine writes (whole ``data:`` events, one a write) takes a shortcut; any
    stream, cut at line ends (where whole events end, or inside an event) or anywhere,
    decodes exactly as it does line by line."""
    stream = ("\ufeff" if bom else "") + "".join("\n".join(e) + "\n\n" for e in events)
    data = stream.encode()
    line_ends = [i + 1 for i, byte in enumerate(data) if byte == ord("\n")]
    at_lines = {line_ends[c] for c in line_cuts if c < len(line_ends)}
    bounds = sorted(at_lines | {c for c in cuts if c <= len(data)} | {0, len(data)})
    pieces = [data[a:b] for a, b in itertools.pairwise(bounds)]
    fast, reference = SSEDecoder(), LineByLine()
    for piece in pieces:
        assert fast.feed(piece) == reference.feed(piece)


def test_whole_data_events_take_the_shortcut():
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\n\n") == [SSEEvent("a")]  # the first feed: a BOM may lead
    taken: list[bytes] = []
    shortcut = decoder._whole_data_events
    decoder._whole_data_events = lambda data: taken.append(data) or shortcut(data)  # type: ignore[method-assign]
    assert decoder.feed(b"data: b\n\ndata:c\n\n") == [SSEEvent("b"), SSEEvent("c")]
    assert decoder.feed(b"event: x\ndata: d\n\n") == [SSEEvent("d", "x")]  # not a shortcut
    assert taken == [b"data: b\n\ndata:c\n\n", b"event: x\ndata: d\n\n"]
    # an event begun in an earlier read is finished line by line
    assert decoder.feed(b"event: y\n") == []
    assert decoder.feed(b"data: e\n\n") == [SSEEvent("e", "y")]
    assert decoder.feed(b"data: p\n") == []
    assert decoder.feed(b"data: q\n\n") == [SSEEvent("p\nq")]
    assert decoder.feed(b"data: r") == []
    assert decoder.feed(b"data: s\n\n") == [SSEEvent("rdata: s")]
    # a BOM is dropped only at the very start, whichever path read that
    later = SSEDecoder()
    assert later.feed(b"data: a\n\n") == [SSEEvent("a")]
    assert later.feed("\ufeffdata: b\n\n".encode()) == []  # a field named "\ufeffdata"
