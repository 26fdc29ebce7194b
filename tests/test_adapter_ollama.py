"""The ollama adapter against a real local HTTP server speaking Ollama's NDJSON API.

Real clock: sockets are involved. Nothing sleeps; the tests wait on
server-side events, under ``trio.fail_after`` bounds.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from iop_trio.adapters import (
    AdapterRequest,
    Completion,
    Delta,
    default_registry,
)
from iop_trio.adapters._http import HTTPAdapter
from iop_trio.adapters.ollama import OllamaAdapter, OllamaSettings
from iop_trio.adapters.stream_formats import LineSplitter
from iop_trio.runtime import RunSpec, RunStatus, Usage

from .engines import (
    NDJSON,
    OLLAMA,
    EngineServer,
    Reply,
    collect,
    make_node,
    ndjson,
    ollama_done,
    ollama_piece,
    ollama_reply,
    run_to_end,
    serve,
)

GENERATE = AdapterRequest(run_id="r1", model="llama3", prompt="Why is the sky blue?")
CHAT = AdapterRequest(run_id="r2", model="llama3", messages=(("user", "hi"),))


@pytest.fixture
async def server() -> AsyncIterator[EngineServer]:
    async with serve() as s:
        yield s


def ollama(server: EngineServer, **kw: Any) -> HTTPAdapter:
    return OLLAMA.adapter(server.url, **kw)


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


def test_registry_builds_ollama_adapters():
    settings = OllamaSettings(base_url="http://127.0.0.1:11434/")
    adapter = default_registry().create("ollama", "local", settings)
    assert isinstance(adapter, OllamaAdapter)
    assert adapter.base_url == "http://127.0.0.1:11434"
    assert repr(adapter) == (
        "<OllamaAdapter 'local' base_url='http://127.0.0.1:11434' max_concurrency=None>"
    )
    assert default_registry().create("ollama", "default").base_url == "http://127.0.0.1:11434"


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
