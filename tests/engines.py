"""Real HTTP/1.1 servers on 127.0.0.1 that speak the engines' wire formats, scripted per test.

::

    async with serve() as server:            # or the ``server`` fixture of a test module
        reply = server.push(Reply(content_type=NDJSON, end="hang"))
        ...                                  # a client POSTs to server.url
        exchange = await reply.request()     # what the server got: path, headers, JSON body
        await reply.send(b'{"response": "hi", "done": false}\\n')  # written when this returns
        await reply.finish()                 # or abort() (FIN mid-body), reset() (RST)
        await exchange.disconnected.wait()   # the client went away before the reply ended

Each request takes the next pushed :class:`Reply` (else ``server.handler``'s,
else a 500). A reply's ``parts`` are written in order; a ``trio.Event`` among
them makes the server wait until the test sets it, so chunk pacing is in the
test's hands and nothing sleeps. While a reply is being written the server
keeps reading its socket, so a client that closes the connection (a
cancelled run) is seen at once: ``Exchange.disconnected`` is set.

The helpers at the end build Ollama (NDJSON) and OpenAI (SSE) streams and
error bodies, and run a real :class:`~iop_trio.runtime.Node` over an adapter.
"""

from __future__ import annotations

import itertools
import json
import math
import socket
import ssl
import struct
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from typing import Any, Literal

import attrs
import h11
import httpx
import pytest
import trio

from iop_trio.adapters._http import HTTPAdapter
from iop_trio.adapters.base import Adapter, AdapterError, AdapterRequest, Chunk
from iop_trio.adapters.ollama import OllamaAdapter, OllamaSettings
from iop_trio.adapters.openai import OpenAIAdapter, OpenAISettings
from iop_trio.runtime import Node, RunEvent, RunRecord, RunSpec, TargetSpec, Usage
from iop_trio.store.memory import MemoryStore

Ending = Literal["finish", "abort", "reset", "hang"]
NDJSON = "application/x-ndjson"
SSE = "text/event-stream"
JSON = "application/json"


class ConnectionGone(Exception):
    """A reply command could not be carried out: the client left or the reply had ended."""


@attrs.define(eq=False)
class Connection:
    """One TCP connection the server accepted; ``closed`` is set when it is over."""

    id: int
    closed: trio.Event = attrs.field(factory=trio.Event)
    closed_by_client: bool = False


@attrs.define(eq=False)
class Exchange:
    """One request the server read, and whether the client left before the reply ended."""

    method: str
    path: str
    headers: dict[str, str]  # names in lower case
    body: bytes
    connection: Connection
    disconnected: trio.Event = attrs.field(factory=trio.Event)

    @property
    def json(self) -> Any:
        return json.loads(self.body)


@attrs.define(eq=False)
class _Command:
    kind: str  # data | wait | finish | abort | reset
    data: bytes = b""
    event: trio.Event | None = None
    done: trio.Event = attrs.field(factory=trio.Event)
    ok: bool = False


class Reply:
    """A scripted response.

    ``parts`` (bytes, or a ``trio.Event`` to wait for) are written as body
    chunks, then ``end`` happens: ``finish`` ends the body properly,
    ``abort`` closes the connection (FIN) mid-reply, ``reset`` closes it with
    an RST, ``hang`` waits for more commands (:meth:`send`, :meth:`finish`,
    ...). The status line and headers go out when the request arrives, or with
    the first part when ``headers_now`` is False. The body is chunked unless
    ``content_length`` (then the parts must all be bytes and ``end`` finish).
    """

    def __init__(
        self,
        status: int = 200,
        *,
        content_type: str | None = JSON,
        headers: Iterable[tuple[str, str]] = (),
        parts: Iterable[bytes | trio.Event] = (),
        end: Ending = "finish",
        content_length: bool = False,
        headers_now: bool = True,
    ) -> None:
        self.status = status
        self.headers = [("content-type", content_type)] if content_type else []
        self.headers += list(headers)
        self.headers_now = headers_now
        self.exchange: Exchange | None = None
        self.received = trio.Event()
        self.ended = trio.Event()
        self.written: list[bytes] = []
        self._send, self._receive = trio.open_memory_channel[_Command](math.inf)
        parts = list(parts)
        if content_length:
            assert end == "finish" and all(isinstance(p, bytes) for p in parts)
            size = sum(len(p) for p in parts if isinstance(p, bytes))
            self.headers.append(("content-length", str(size)))
        for part in parts:
            if isinstance(part, trio.Event):
                self._send.send_nowait(_Command("wait", event=part))
            else:
                self._send.send_nowait(_Command("data", part))
        if end != "hang":
            self._send.send_nowait(_Command(end))

    @classmethod
    def silent(cls) -> Reply:
        """Reads the request and never answers (until told to)."""
        return cls(end="hang", headers_now=False)

    def __repr__(self) -> str:
        return f"<Reply {self.status} written={len(self.written)} ended={self.ended.is_set()}>"

    async def request(self) -> Exchange:
        """Wait for the request this reply answers."""
        await self.received.wait()
        assert self.exchange is not None
        return self.exchange

    async def send(self, data: bytes) -> None:
        """Write a body chunk; returns once it is on the socket."""
        await self._do(_Command("data", data))

    async def finish(self) -> None:
        await self._do(_Command("finish"))

    async def abort(self) -> None:
        await self._do(_Command("abort"))

    async def reset(self) -> None:
        await self._do(_Command("reset"))

    async def _do(self, command: _Command) -> None:
        if self.ended.is_set():
            raise ConnectionGone(f"{self!r} has ended")
        self._send.send_nowait(command)
        await command.done.wait()
        if not command.ok:
            raise ConnectionGone(f"{self!r}: the client left before {command.kind}")

    # --- server side ---

    async def _run(self, stream: trio.SocketStream, conn: h11.Connection) -> bool:
        """Carry out the commands; True if the response ended properly."""
        started = False

        async def start() -> None:
            nonlocal started
            if not started:
                started = True
                response = h11.Response(status_code=self.status, headers=self.headers)
                await stream.send_all(conn.send(response) or b"")

        command: _Command | None = None
        try:
            if self.headers_now:
                await start()
            while True:
                command = await self._receive.receive()
                if command.kind == "wait":
                    assert command.event is not None
                    await command.event.wait()
                elif command.kind == "data":
                    await start()
                    if command.data:
                        await stream.send_all(conn.send(h11.Data(data=command.data)) or b"")
                    self.written.append(command.data)
                elif command.kind == "finish":
                    await start()
                    await stream.send_all(conn.send(h11.EndOfMessage()) or b"")
                elif command.kind == "reset":
                    stream.socket.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
                command.ok = True
                command.done.set()
                if command.kind in ("finish", "abort", "reset"):
                    return command.kind == "finish"
                command = None
        finally:
            self.ended.set()
            if command is not None:
                command.done.set()
            while True:
                try:
                    self._receive.receive_nowait().done.set()
                except trio.WouldBlock:
                    break


class EngineServer:
    """An HTTP/1.1 server whose answers the test scripts (see the module docstring)."""

    def __init__(self) -> None:
        self.port = 0
        self.exchanges: list[Exchange] = []
        self.connections: list[Connection] = []
        self.handler: Callable[[Exchange], Reply] | None = None
        self._replies: deque[Reply] = deque()
        self._ids = itertools.count(1)

    def __repr__(self) -> str:
        return f"<EngineServer {self.url} requests={len(self.exchanges)}>"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def push(self, reply: Reply) -> Reply:
        """Answer the next request that has no reply yet with ``reply``."""
        self._replies.append(reply)
        return reply

    def _reply_for(self, exchange: Exchange) -> Reply:
        if self._replies:
            return self._replies.popleft()
        if self.handler is not None:
            return self.handler(exchange)
        return Reply(500, parts=[b'{"error": "no reply scripted"}'], content_length=True)

    async def _serve(self, stream: trio.SocketStream) -> None:
        connection = Connection(next(self._ids))
        self.connections.append(connection)
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                exchange = await self._read_request(stream, conn, connection)
                if exchange is None:
                    connection.closed_by_client = True
                    return
                reply = self._reply_for(exchange)
                if not await self._respond(stream, conn, exchange, reply):
                    return
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        finally:
            connection.closed.set()
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _read_request(
        self, stream: trio.SocketStream, conn: h11.Connection, connection: Connection
    ) -> Exchange | None:
        request: h11.Request | None = None
        body = bytearray()
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                return None
            if event is h11.NEED_DATA:
                try:
                    data = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    data = b""
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert request is not None
                exchange = Exchange(
                    method=request.method.decode(),
                    path=request.target.decode(),
                    headers={k.decode().lower(): v.decode() for k, v in request.headers},
                    body=bytes(body),
                    connection=connection,
                )
                self.exchanges.append(exchange)
                return exchange
            else:  # ConnectionClosed
                return None

    async def _respond(
        self, stream: trio.SocketStream, conn: h11.Connection, exchange: Exchange, reply: Reply
    ) -> bool:
        reply.exchange = exchange
        reply.received.set()
        ok = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch, stream, conn, exchange, nursery.cancel_scope)
            try:
                ok = await reply._run(stream, conn)
            except trio.BrokenResourceError:
                exchange.disconnected.set()
                exchange.connection.closed_by_client = True
            nursery.cancel_scope.cancel()
        return ok and not exchange.disconnected.is_set()

    @staticmethod
    async def _watch(
        stream: trio.SocketStream,
        conn: h11.Connection,
        exchange: Exchange,
        scope: trio.CancelScope,
    ) -> None:
        """While a reply is written: notice the client leaving (EOF or reset)."""
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                data = b""
            if not data:
                exchange.disconnected.set()
                exchange.connection.closed_by_client = True
                scope.cancel()
                return
            conn.receive_data(data)  # the next request, kept for h11


@asynccontextmanager
async def serve(tls: ssl.SSLContext | None = None) -> AsyncIterator[EngineServer]:
    """An :class:`EngineServer` on 127.0.0.1 (a free port) for the body of the ``with``;
    over TLS with the server context ``tls``."""
    server = EngineServer()
    async with trio.open_nursery() as nursery:
        if tls is None:
            listeners: list[trio.SocketListener] = await nursery.start(
                partial(trio.serve_tcp, server._serve, 0, host="127.0.0.1")
            )
            server.port = listeners[0].socket.getsockname()[1]
        else:
            secure: list[trio.SSLListener[trio.SocketStream]] = await nursery.start(
                partial(trio.serve_ssl_over_tcp, server._serve, 0, tls, host="127.0.0.1")
            )
            server.port = secure[0].transport_listener.socket.getsockname()[1]
        try:
            yield server
        finally:
            nursery.cancel_scope.cancel()


@contextmanager
def refused_port() -> Iterator[int]:
    """A port on 127.0.0.1 where a connection is refused: bound, never listening."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]
    finally:
        sock.close()


def recording_client() -> tuple[httpx.AsyncClient, list[httpx.Response]]:
    """An httpx client to inject into an adapter, and the responses it got (to check
    ``is_closed``: an adapter must close its response before ``open_stream`` returns)."""
    responses: list[httpx.Response] = []

    async def record(response: httpx.Response) -> None:
        responses.append(response)

    return httpx.AsyncClient(event_hooks={"response": [record]}), responses


# --- Ollama (NDJSON) -------------------------------------------------------------------------


def ndjson(*objects: Any) -> bytes:
    return b"".join(json.dumps(o).encode() + b"\n" for o in objects)


def ollama_piece(text: str, *, chat: bool = True, model: str = "m") -> dict[str, Any]:
    base = {"model": model, "created_at": "2026-01-01T00:00:00Z", "done": False}
    if chat:
        return {**base, "message": {"role": "assistant", "content": text}}
    return {**base, "response": text}


def ollama_done(
    *,
    chat: bool = True,
    done_reason: str = "stop",
    prompt_eval_count: int = 5,
    eval_count: int = 3,
    model: str = "m",
) -> dict[str, Any]:
    last = ollama_piece("", chat=chat, model=model)
    last.update(
        done=True,
        done_reason=done_reason,
        total_duration=1000,
        prompt_eval_count=prompt_eval_count,
        eval_count=eval_count,
    )
    return last


def ollama_reply(
    pieces: Sequence[str], *, chat: bool = True, done: bool = True, end: Ending = "finish"
) -> Reply:
    """A 200 NDJSON stream: one line per piece, then the done line (unless ``done=False``)."""
    parts = [ndjson(ollama_piece(p, chat=chat)) for p in pieces]
    if done:
        parts.append(ndjson(ollama_done(chat=chat, eval_count=len(pieces))))
    return Reply(content_type=NDJSON, parts=parts, end=end)


def ollama_error(status: int, message: str) -> Reply:
    return Reply(status, parts=[json.dumps({"error": message}).encode()], content_length=True)


# --- OpenAI (SSE) ----------------------------------------------------------------------------


def sse(data: Any, *, event: str | None = None, eol: str = "\n") -> bytes:
    """One server-sent event; ``data`` (a string, else JSON) may hold several lines."""
    text = data if isinstance(data, str) else json.dumps(data)
    lines = [f"event: {event}"] if event else []
    lines += [f"data: {line}" for line in text.split("\n")]
    return (eol.join(lines) + eol + eol).encode()


SSE_DONE = sse("[DONE]")


def openai_chunk(
    content: str | None = None,
    *,
    finish_reason: str | None = None,
    role: str | None = None,
    model: str = "m",
) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


def openai_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def openai_stream(
    pieces: Sequence[str],
    *,
    finish_reason: str = "stop",
    usage: tuple[int, int] | None = (7, 2),
    done: bool = True,
    eol: str = "\n",
) -> list[bytes]:
    """The SSE parts of a streamed chat completion, as vLLM sends them."""
    parts = [sse(openai_chunk("", role="assistant"), eol=eol)]
    parts += [sse(openai_chunk(p), eol=eol) for p in pieces]
    parts.append(sse(openai_chunk(finish_reason=finish_reason), eol=eol))
    if usage is not None:
        parts.append(sse(openai_usage(*usage), eol=eol))
    if done:
        parts.append(sse("[DONE]", eol=eol))
    return parts


def openai_reply(pieces: Sequence[str], *, end: Ending = "finish", **kw: Any) -> Reply:
    return Reply(content_type=SSE, parts=openai_stream(pieces, **kw), end=end)


def openai_error(status: int, message: str, *, type: str = "invalid_request_error") -> Reply:
    body = {"error": {"message": message, "type": type, "param": None, "code": None}}
    return Reply(status, parts=[json.dumps(body).encode()], content_length=True)


STOP_USAGE = Usage("stop", 5, 3)

# --- one wire format, as the adapter contract sees it ----------------------------------------


@attrs.frozen
class Wire:
    """How one engine says what every HTTP adapter must understand, for the contract suite.

    Prompt-only runs of ``model`` are POSTed to ``path``; a stream is ``piece``
    per delta, then ``end`` (the engine's finish signal, with its token counts);
    ``error_body`` is the engine's JSON error; ``error_part`` an error in the
    middle of a stream, whose message contains ``error_words``.
    """

    kind: str
    namespace: str
    model: str
    path: str
    content_type: str
    settings_type: type[Any]
    adapter_type: type[HTTPAdapter]
    piece: Callable[[str], bytes]
    end: Callable[[Usage], bytes]
    error_body: Callable[[str], bytes]
    error_part: bytes
    error_words: str
    bad_parts: tuple[bytes, ...]
    empty_content_types: tuple[str, ...]
    bad_params: tuple[Mapping[str, Any], ...]
    prompt_of: Callable[[Any], str]  # the prompt of a request body
    is_probe: Callable[[Any], bool]  # a body asks for as little output as the engine allows
    whole: Callable[[str], bytes]  # the engine's answer to a request without streaming

    def __repr__(self) -> str:
        return self.kind

    @property
    def target(self) -> str:
        return f"{self.namespace}/{self.model}"

    def adapter(
        self,
        url: str,
        *,
        client: httpx.AsyncClient | None = None,
        max_concurrency: int | None = None,
        **settings: Any,
    ) -> HTTPAdapter:
        settings.setdefault("read_timeout", 10.0)
        settings.setdefault("connect_timeout", 5.0)
        return self.adapter_type(
            self.namespace,
            self.settings_type(base_url=url, **settings),
            client=client,
            max_concurrency=max_concurrency,
        )

    def reply(
        self,
        pieces: Sequence[str],
        *,
        usage: Usage = STOP_USAGE,
        done: bool = True,
        end: Ending = "finish",
    ) -> Reply:
        """A 200 stream of ``pieces``, then the finish signal (none if not ``done``)."""
        parts = [self.piece(p) for p in pieces] + ([self.end(usage)] if done else [])
        return Reply(content_type=self.content_type, parts=parts, end=end)

    def error(self, status: int, message: str) -> Reply:
        return Reply(status, parts=[self.error_body(message)], content_length=True)

    def whole_reply(self, text: str) -> Reply:
        """A 200 answer of ``text`` to a request without streaming."""
        return Reply(parts=[self.whole(text)], content_length=True)


def _openai_end(usage: Usage) -> bytes:
    counts = (usage.prompt_tokens or 0, usage.completion_tokens or 0)
    return (
        sse(openai_chunk(finish_reason=usage.done_reason)) + sse(openai_usage(*counts)) + SSE_DONE
    )


OLLAMA = Wire(
    kind="ollama",
    namespace="ollama",
    model="llama3",
    path="/api/generate",
    content_type=NDJSON,
    settings_type=OllamaSettings,
    adapter_type=OllamaAdapter,
    piece=lambda text: ndjson(ollama_piece(text, chat=False)),
    end=lambda usage: ndjson(
        ollama_done(
            chat=False,
            done_reason=usage.done_reason,
            prompt_eval_count=usage.prompt_tokens or 0,
            eval_count=usage.completion_tokens or 0,
        )
    ),
    error_body=lambda message: json.dumps({"error": message}).encode(),
    error_part=ndjson(
        {"error": "an error was encountered while running the model: unexpected EOF"}
    ),
    error_words="unexpected EOF",
    bad_parts=(b"{not json\n", b"[1, 2]\n", b'{"response": 3}\n'),
    empty_content_types=(NDJSON,),
    bad_params=({"options": [1]}, {"system": 3}),
    prompt_of=lambda body: str(body["prompt"]),
    is_probe=lambda body: body["options"]["num_predict"] == 1,
    whole=lambda text: json.dumps(
        {**ollama_done(chat=False, eval_count=1), "response": text}
    ).encode(),
)
OPENAI = Wire(
    kind="openai",
    namespace="vllm",
    model="qwen",
    path="/v1/chat/completions",
    content_type=SSE,
    settings_type=OpenAISettings,
    adapter_type=OpenAIAdapter,
    piece=lambda text: sse(openai_chunk(text)),
    end=_openai_end,
    error_body=lambda message: json.dumps(
        {"error": {"message": message, "type": "invalid_request_error"}}
    ).encode(),
    error_part=sse({"error": {"message": "CUDA out of memory", "type": "InternalServerError"}}),
    error_words="CUDA out of memory (InternalServerError)",
    bad_parts=(
        b"data: {not json\n\n",
        b"data: [1]\n\n",
        b'data: {"choices": {"0": 1}}\n\n',
        b'data: {"choices": [{"index": 0, "delta": {"content": 5}}]}\n\n',
    ),
    empty_content_types=(SSE, JSON),
    bad_params=({"extra_body": "x"}, {"temperature": {0.5}}),
    prompt_of=lambda body: str(body["messages"][-1]["content"]),
    is_probe=lambda body: body["max_tokens"] == 1 and "stream_options" not in body,
    whole=lambda text: json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "qwen",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    ).encode(),
)
WIRES = (OLLAMA, OPENAI)


# --- the runtime over an adapter -------------------------------------------------------------


def make_node(
    adapter: Adapter,
    *,
    model: str = "m",
    params: Mapping[str, Any] | None = None,
    concurrency: int = 1,
    **target: Any,
) -> Node:
    """A node with one target ``{adapter.name}/{model}`` (``target``: more TargetSpec fields)."""
    target = TargetSpec(
        adapter.name, model, concurrency=concurrency, params=dict(params or {}), **target
    )
    return Node(node_id="test", adapters=[adapter], targets=[target], store=MemoryStore())


WAIT = 10.0  # seconds a helper waits for a run before the test fails


async def run_to_end(node: Node, spec: RunSpec) -> tuple[RunRecord, list[RunEvent]]:
    """Submit ``spec``, wait for its terminal event; the stored record and events."""
    submitted = await node.manager.submit(spec)
    return await wait_end(node, submitted.record.run_id)


async def wait_end(node: Node, run_id: str) -> tuple[RunRecord, list[RunEvent]]:
    """Wait (at most :data:`WAIT`) for the terminal event of ``run_id``."""
    with trio.fail_after(WAIT):
        async for _event in node.manager.watch(run_id):
            pass
    record = await node.store.get(run_id)
    assert record is not None
    return record, await node.store.events(run_id)


async def next_event(node: Node, run_id: str, after_seq: int) -> RunEvent:
    """The first event of ``run_id`` with seq > ``after_seq`` (waits at most :data:`WAIT`)."""
    with trio.fail_after(WAIT):
        return await node.manager.watch(run_id, after_seq=after_seq).__anext__()


async def collect(adapter: Adapter, request: AdapterRequest) -> list[Chunk]:
    """Everything ``adapter`` streams for ``request`` (bounded wait)."""
    with trio.fail_after(10):
        async with adapter.open_stream(request) as chunks:
            return [chunk async for chunk in chunks]


async def failure(adapter: Adapter, request: AdapterRequest) -> AdapterError:
    """The AdapterError ``adapter`` raises for ``request`` (fails the test if none)."""
    with pytest.raises(AdapterError) as info:
        await collect(adapter, request)
    return info.value
