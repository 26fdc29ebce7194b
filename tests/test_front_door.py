"""The edge's OpenAI-compatible front door, with the official ``openai`` package as the client.

A real stack on loopback: a node with echo targets linked to an edge over the
proto-socket, the front door served by hypercorn, and ``openai.OpenAI`` (sync,
in a worker thread) talking HTTP to it. Every wait is bounded.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import attrs
import httpx
import openai
import pytest
import trio

from iop_trio.edge import Edge
from iop_trio.edge.front_door import parse_chat_request, serve_door
from iop_trio.edge.identities import Identities, token_digest
from iop_trio.model import EventKind, RunSpec, RunStatus, TargetSpec
from iop_trio.protocol import pb
from iop_trio.runtime import Node
from iop_trio.store.memory import MemoryStore
from iop_trio.transport import RemoteError, SessionSettings, open_runner

from .engines import OPENAI, EngineServer, Reply, serve
from .support import logged
from .test_edge_identities import IDENTITIES, run_node
from .test_wire import TOKEN, echo_node, stack

T = TypeVar("T")
WAIT = 30


@attrs.frozen
class Door:
    edge: Edge
    node: Node
    url: str

    def client(self, token: str = TOKEN) -> openai.OpenAI:
        # no retries: a 429 or 503 must reach the test, not be retried away
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=token, max_retries=0)


async def in_thread(call: Callable[[], T]) -> T:
    return await trio.to_thread.run_sync(call)


@asynccontextmanager
async def door(node: Node) -> AsyncIterator[Door]:
    """``node`` behind an edge with the shared TOKEN, and the front door in front."""
    async with stack(node) as s, trio.open_nursery() as nursery:
        port = await nursery.start(serve_door, s.edge, "127.0.0.1", 0)
        yield Door(s.edge, node, f"http://127.0.0.1:{port}")
        nursery.cancel_scope.cancel()


async def test_a_chat_completion_is_a_run_and_its_answer():
    async with door(echo_node(("a", 2))) as d:
        completion = await in_thread(
            lambda: d.client().chat.completions.create(
                model="echo/a",
                messages=[
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hello big world"},
                ],
            )
        )
        assert completion.choices[0].message.content == "hello big world"
        assert completion.choices[0].finish_reason == "stop"
        assert completion.usage is not None
        assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (3, 3)
        assert completion.model == "echo/a"
        run_id = completion.id.removeprefix("chatcmpl-")
        record = await d.node.manager.get(run_id)
        assert record is not None
        assert record.status is RunStatus.SUCCEEDED
        assert record.messages == (("system", "be brief"), ("user", "hello big world"))


async def test_a_streamed_completion_comes_as_chunks_with_usage_last():
    async with door(echo_node(("a", 2))) as d:

        def stream() -> list[Any]:
            return list(
                d.client().chat.completions.create(
                    model="echo/a",
                    messages=[{"role": "user", "content": "one two three four"}],
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )

        chunks = await in_thread(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "one two three four"
        assert chunks[0].choices[0].delta.role == "assistant"
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.total_tokens == 8
        assert len({c.id for c in chunks}) == 1


async def test_models_lists_the_targets_of_the_connected_nodes():
    async with door(echo_node(("a", 2), ("b", 1))) as d:
        client = d.client()
        models = await in_thread(lambda: [m.id for m in client.models.list()])
        assert models == ["echo/a", "echo/b"]
        assert (await in_thread(lambda: client.models.retrieve("echo/b"))).id == "echo/b"
        with pytest.raises(openai.NotFoundError):
            await in_thread(lambda: client.models.retrieve("echo/zzz"))


async def test_unknown_model_wrong_key_and_forbidden_options_are_clear_errors():
    async with door(echo_node(("a", 2))) as d:
        hello = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.NotFoundError) as unknown:
            await in_thread(
                lambda: d.client().chat.completions.create(model="echo/zzz", messages=hello)  # type: ignore[arg-type]
            )
        assert unknown.value.code == "model_not_found"
        with pytest.raises(openai.AuthenticationError) as wrong:
            await in_thread(
                lambda: d.client("nope").chat.completions.create(model="echo/a", messages=hello)  # type: ignore[arg-type]
            )
        assert wrong.value.code == "invalid_api_key"
        # echo lets a caller set its delay, not a temperature: the node's allow-list says 400
        with pytest.raises(openai.BadRequestError) as refused:
            await in_thread(
                lambda: d.client().chat.completions.create(
                    model="echo/a",
                    messages=hello,  # type: ignore[arg-type]
                    temperature=0.5,
                )
            )
        assert "temperature" in refused.value.message
        # and the door went on serving
        ok = await in_thread(
            lambda: d.client().chat.completions.create(
                model="echo/a",
                messages=hello,  # type: ignore[arg-type]
                extra_body={"delay": 0},
            )
        )
        assert ok.choices[0].message.content == "hi"


async def test_a_rejection_is_429_with_retry_after_streaming_or_not():
    # one run at a time and no queue: a second run is REJECTED(queue_full) at once
    async with door(echo_node(("a", 1), max_queued=0, queue_timeout=5)) as d:
        hello = [{"role": "user", "content": "a run that finds the target full"}]
        holder = RunSpec("echo/a", "hold the slot", options={"delay": 30})
        async with d.edge.run(holder) as held:
            async for event in held:
                if event.kind is EventKind.STARTED:
                    break
            for stream in (False, True):
                with pytest.raises(openai.RateLimitError) as rejected:
                    await in_thread(
                        lambda stream=stream: d.client().chat.completions.create(  # type: ignore[misc]
                            model="echo/a", messages=hello, stream=stream
                        )
                    )
                assert rejected.value.code == "queue_full"
                assert int(rejected.value.response.headers["retry-after"]) >= 1
            await d.edge.cancel(held.run_id)


@pytest.fixture
async def engine() -> AsyncIterator[EngineServer]:
    async with serve() as server:
        yield server


def engine_node(url: str) -> Node:
    """One target, vllm/qwen, on the OpenAI-compatible engine at ``url``."""
    return Node(
        node_id="n1",
        adapters=[OPENAI.adapter(url)],
        targets=[TargetSpec("vllm", "qwen")],
        store=MemoryStore(),
    )


def turned_away(status: int, retry_after: str) -> Reply:
    return Reply(
        status,
        headers=[("retry-after", retry_after)],
        parts=[OPENAI.error_body("too many requests at once")],
        content_length=True,
    )


async def test_an_engines_429_or_503_is_the_doors_with_its_retry_after(engine):
    """Not a bare 502: the caller is told the engine is busy, and when to ask again."""
    hello = [{"role": "user", "content": "hi"}]
    async with door(engine_node(engine.url)) as d:
        engine.push(turned_away(429, "7"))
        with pytest.raises(openai.RateLimitError) as busy:
            await in_thread(
                lambda: d.client().chat.completions.create(model="vllm/qwen", messages=hello)  # type: ignore[arg-type]
            )
        assert busy.value.code == "engine_busy"
        assert busy.value.response.headers["retry-after"] == "7"
        assert "too many requests at once" in busy.value.message
        engine.push(turned_away(503, "2.5"))
        with pytest.raises(openai.InternalServerError) as down:
            await in_thread(
                lambda: d.client().chat.completions.create(model="vllm/qwen", messages=hello)  # type: ignore[arg-type]
            )
        assert (down.value.status_code, down.value.code) == (503, "engine_unavailable")
        assert down.value.response.headers["retry-after"] == "3"  # whole seconds, rounded up
        # a stream's headers wait for the engine's first words: its 429 is still a status
        engine.push(turned_away(429, "7"))
        with pytest.raises(openai.RateLimitError) as streamed:
            await in_thread(
                lambda: list(
                    d.client().chat.completions.create(
                        model="vllm/qwen",
                        messages=hello,  # type: ignore[arg-type]
                        stream=True,
                    )
                )
            )
        assert streamed.value.code == "engine_busy"
        assert streamed.value.response.headers["retry-after"] == "7"


async def test_a_proto_socket_caller_gets_the_engines_retry_hint(engine):
    async with door(engine_node(engine.url)) as d:
        engine.push(turned_away(429, "7"))
        async with open_runner(d.edge.client_url, token=TOKEN) as client:
            async with client.run(RunSpec("vllm/qwen", "hi")) as stream:
                _, last = await stream.collect()
            assert (last.kind, last.reason, last.retry_after) == (
                EventKind.FAILED,
                "engine_busy",
                7.0,
            )
            info = await client.get_run(stream.run_id)
            assert info.run.retry_after_s == 7.0


async def test_a_client_that_goes_away_cancels_its_run():
    async with door(echo_node(("a", 1))) as d:
        words = " ".join(f"w{i}" for i in range(200))

        def read_two_chunks_and_leave() -> str:
            response = d.client().chat.completions.create(
                model="echo/a",
                messages=[{"role": "user", "content": words}],
                stream=True,
                extra_body={"delay": 0.05},
            )
            first = next(iter(response))
            next(iter(response))
            response.close()  # the connection goes; 200 words would take 10 s
            return first.id.removeprefix("chatcmpl-")

        run_id = await in_thread(read_two_chunks_and_leave)
        with trio.fail_after(WAIT):
            while True:
                record = await d.node.manager.get(run_id)
                assert record is not None
                if record.status.terminal:
                    break
                await trio.sleep(0.01)
        assert record.status is RunStatus.CANCELLED
        assert record.reason == "client_lost"


async def test_with_identities_a_callers_token_names_its_tenant_and_targets():
    edge = Edge(token=None, identities=Identities.from_data(IDENTITIES))
    node = echo_node(("a", 2), ("b", 2))
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(edge.serve)
            await nursery.start(run_node, node, edge.node_url, "n1-token")
            await edge.wait_for_node("n1")
            port = await nursery.start(serve_door, edge, "127.0.0.1", 0)
            d = Door(edge, node, f"http://127.0.0.1:{port}")
            bob = d.client("bob-token")
            assert [m.id for m in await in_thread(bob.models.list)] == ["echo/a"]
            completion = await in_thread(
                lambda: bob.chat.completions.create(
                    model="echo/a", messages=[{"role": "user", "content": "hi"}]
                )
            )
            run_id = completion.id.removeprefix("chatcmpl-")
            assert run_id.startswith("bob:")
            record = await node.manager.get(run_id)
            assert record is not None and record.tenant == "team-b"
            with pytest.raises(openai.PermissionDeniedError):
                await in_thread(
                    lambda: bob.chat.completions.create(
                        model="echo/b", messages=[{"role": "user", "content": "hi"}]
                    )
                )
            # alice may ask for priority 5 at most
            alice = d.client("alice-token")
            with pytest.raises(openai.PermissionDeniedError):
                await in_thread(
                    lambda: alice.chat.completions.create(
                        model="echo/b",
                        messages=[{"role": "user", "content": "hi"}],
                        extra_body={"priority": 6},
                    )
                )
            nursery.cancel_scope.cancel()


async def test_bad_bodies_get_400_and_oversize_413_as_openai_errors():
    async with door(echo_node(("a", 2))) as d:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=d.url, headers=headers) as http:
            cases: list[tuple[Any, int, str | None]] = [
                (b"{not json", 400, None),
                ({"model": "echo/a"}, 400, "messages"),
                ({"model": "echo/a", "messages": [{"role": "user", "content": 3}]}, 400, None),
                (
                    {
                        "model": "echo/a",
                        "messages": [
                            {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}
                        ],
                    },
                    400,
                    "messages[0].content[0].type",
                ),
                (
                    {"model": "echo/a", "messages": [{"role": "u", "content": "x"}], "n": 2},
                    400,
                    "n",
                ),
                (b"x" * (d.edge.settings.max_message_size + 1), 413, None),
            ]
            for body, status, param in cases:
                if isinstance(body, bytes):
                    response = await http.post("/v1/chat/completions", content=body)
                else:
                    response = await http.post("/v1/chat/completions", json=body)
                assert response.status_code == status, (body, response.text)
                error = response.json()["error"]
                assert error["message"] and error["type"]
                if param is not None:
                    assert error["param"] == param
            assert (await http.get("/v1/chat/completions")).status_code == 405
            assert (await http.get("/nowhere")).status_code == 404


def test_request_fields_become_options_renamed_for_the_adapter_kind():
    body = {
        "model": "ollama/llama3",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 5,
        "temperature": 0.2,
        "user": "someone",
        "stream": True,
        "seed": None,
    }
    request = parse_chat_request(dict(body), "ollama")
    assert request.options == {"num_predict": 5, "temperature": 0.2}
    assert request.messages == (("user", "hi"),)
    assert request.stream and not request.include_usage
    assert parse_chat_request(dict(body), "openai").options == {"max_tokens": 5, "temperature": 0.2}


async def test_a_door_stream_nobody_reads_is_cancelled_and_frees_its_slot(autojump_clock):
    # one slot, a run that would write 6.5 GB over 1,000 s, and a client that reads nothing
    node = echo_node(("a", 1), max_output_bytes=None)
    async with (
        stack(node, edge_settings=SessionSettings(send_timeout=3)) as s,
        trio.open_nursery() as nursery,
    ):
        port = await nursery.start(serve_door, s.edge, "127.0.0.1", 0)
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await sock.connect(("127.0.0.1", port))
        deaf = trio.SocketStream(sock)
        body = json.dumps(
            {
                "model": "echo/a",
                "messages": [{"role": "user", "content": "x" * 65536}],
                "stream": True,
                "delay": 0.01,
                "repeat": 100_000,
            }
        ).encode()
        await deaf.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        ended = trio.Event()
        node.event_listeners.append(lambda event, record: event.kind.terminal and ended.set())
        await ended.wait()
        runs = await node.manager.list_runs()
        assert (runs[0].status, runs[0].reason) == (RunStatus.CANCELLED, "client_lost")
        assert runs[0].finished is not None and runs[0].started is not None
        assert runs[0].finished - runs[0].started < 10  # the send timeout, not the run's end
        async with s.edge.run(RunSpec("echo/a", "the slot is free")) as stream:
            assert (await stream.collect())[0] == "the slot is free"
        await deaf.aclose()
        nursery.cancel_scope.cancel()


async def test_out_of_range_and_unrepresentable_input_is_400_naming_the_field():
    async with door(echo_node(("a", 2))) as d:
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        hi = '"messages": [{"role": "user", "content": "hi"}]'
        deep = "[" * 500 + "]" * 500
        cases: list[tuple[str, str | None, str]] = [
            (f'{{"model": "echo/a", {hi}, "priority": 99999999999}}', "priority", "-1000 to 1000"),
            (f'{{"model": "echo/a", {hi}, "stop": {deep}}}', None, "deeper than 32"),
            (
                '{"model": "echo/a", "messages": [{"role": "user", "content": "\\ud800"}]}',
                "messages[0].content",
                "lone surrogate",
            ),
            (f'{{"model": "echo/a", {hi}, "delay": NaN}}', None, "not a JSON number"),
            (f'{{"model": "echo/a", {hi}, "delay": 1e400}}', "delay", "too large"),
            (f'{{"model": "echo/a", {hi}, "stream": "yes"}}', "stream", "true or false"),
            ('{"model": "", "messages": []}', "model", "must not be empty"),
        ]
        with logged("") as records:
            async with httpx.AsyncClient(base_url=d.url, headers=headers) as http:
                for body, param, words in cases:
                    response = await http.post("/v1/chat/completions", content=body)
                    assert response.status_code == 400, (body[:80], response.text)
                    error = response.json()["error"]
                    assert words in error["message"], (body[:80], error)
                    if param is not None:
                        assert error["param"] == param, (body[:80], error)
        assert not [r for r in records if r.exc_info]  # no traceback for any of them
        # and the node refuses a number that is no number, whoever sends it
        with pytest.raises(RemoteError) as refused:
            await d.edge.run(RunSpec("echo/a", "x", options={"delay": float("nan")})).__aenter__()
        assert refused.value.code == pb.ERROR_CODE_INVALID
        assert "numbers must be finite" in refused.value.message


async def test_a_caller_over_its_rate_gets_429_with_retry_after():
    identities = {
        "callers": {
            "eager": {"token_sha256": token_digest("eager"), "requests_per_second": 1, "burst": 2},
        },
        "nodes": {"n1": {"token_sha256": token_digest("n1-token")}},
    }
    edge = Edge(token=None, identities=Identities.from_data(identities))
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(edge.serve)
            await nursery.start(run_node, echo_node(("a", 2)), edge.node_url, "n1-token")
            await edge.wait_for_node("n1")
            port = await nursery.start(serve_door, edge, "127.0.0.1", 0)
            headers = {"Authorization": "Bearer eager"}
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                statuses = [(await http.get("/v1/models", headers=headers)) for _ in range(3)]
            assert [r.status_code for r in statuses] == [200, 200, 429]
            limited = statuses[2]
            assert limited.json()["error"]["code"] == "rate_limited"
            assert int(limited.headers["retry-after"]) >= 1
            nursery.cancel_scope.cancel()
