"""Several envelopes in one frame, several frames in one send (issue 23).

The rule of what goes together (``take_sendable``) and the batch's wire form
(``pack_batch``) are sans-IO and tested as such, with a property over any frames
and bounds; ``send_messages`` and the negotiation are tested on real WebSockets on
loopback, with a real edge and node, and with raw peers that speak the protocol as
an older release does (no ``batches`` in Hello or HelloAck, no subprotocol).
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from trio_websocket import ConnectionClosed, open_websocket_url, serve_websocket

from iop_trio.adapters.base import Adapter, AdapterRequest, Chunk, Completion, Delta, Usage
from iop_trio.edge import Edge
from iop_trio.model import EventKind, RunSpec, TargetSpec
from iop_trio.protocol import (
    BATCH_SUBPROTOCOL,
    ProtocolError,
    ProtoConnection,
    Reply,
    Request,
    Role,
    decode,
    pack_batch,
    pb,
    take_sendable,
)
from iop_trio.runtime import Node
from iop_trio.store.sqlite import SqliteStore
from iop_trio.transport import NodeLink, open_runner
from iop_trio.transport.auth import bearer_header
from iop_trio.transport.ws_send import send_messages

from .test_wire import FAST, TOKEN, echo_node, stack

# --- the wire form and the rule, sans I/O ------------------------------------------------


def _requests(n: int) -> tuple[ProtoConnection[None], list[bytes]]:
    edge: ProtoConnection[None] = ProtoConnection(Role.EDGE)
    frames = [edge.request("run_request", pb.RunRequest(target=f"t/{i}"))[1] for i in range(n)]
    return edge, frames


def test_a_batch_is_its_frames_bytes_and_reads_as_they_would_one_by_one():
    _, frames = _requests(3)
    batch = pack_batch(frames)
    envelope = decode(batch)
    assert envelope.WhichOneof("body") == "batch"
    assert [e.SerializeToString() for e in envelope.batch.envelopes] == frames
    # the same bytes the protobuf library makes for it: nothing re-encoded, nothing lost
    made = pb.Envelope(batch=pb.Batch(envelopes=[decode(f) for f in frames]))
    assert made.SerializeToString() == batch
    node: ProtoConnection[None] = ProtoConnection(Role.RUNNER)
    one_by_one = [ProtoConnection(Role.RUNNER).receive(f) for f in frames]
    together = node.receive_all(batch)
    assert together == one_by_one
    assert [r.nonce for r in together if isinstance(r, Request)] == [1, 2, 3]
    assert all(
        isinstance(r, Request) and r.size == len(f) for r, f in zip(together, frames, strict=True)
    )


def test_a_bad_envelope_in_a_batch_is_an_error_in_its_place_and_the_others_are_served():
    _, frames = _requests(2)
    nested = pack_batch(frames[:1])
    no_body = pb.Envelope(nonce=9).SerializeToString()
    node: ProtoConnection[None] = ProtoConnection(Role.RUNNER)
    incoming = node.receive_all(pack_batch([frames[0], nested, no_body, frames[1]]))
    assert isinstance(incoming[0], Request) and isinstance(incoming[3], Request)
    assert isinstance(incoming[1], ProtocolError)
    assert incoming[1].code == pb.ERROR_CODE_MALFORMED and "nest" in incoming[1].message
    assert isinstance(incoming[2], ProtocolError) and incoming[2].reply_to == 9
    # an undecodable frame is one error; receive() reads one envelope a frame only
    assert [type(i) for i in node.receive_all(b"\xff\xff")] == [ProtocolError]
    with pytest.raises(ProtocolError, match="nest"):
        node.receive(pack_batch(frames))


def test_replies_in_a_batch_reach_their_requests_and_end_their_streams():
    edge, frames = _requests(2)
    node: ProtoConnection[None] = ProtoConnection(Role.RUNNER)
    first, second = node.receive_all(pack_batch(frames))
    assert isinstance(first, Request) and isinstance(second, Request)
    replies = pack_batch(
        [
            node.reply(first.nonce, "run_accepted", pb.RunAccepted(run_id="r1")),
            node.reply(second.nonce, "error", pb.Error(code=pb.ERROR_CODE_UNKNOWN_TARGET)),
            node.reply(first.nonce, "run_event", pb.RunEvent(seq=1, kind=pb.EVENT_KIND_QUEUED)),
            node.reply(first.nonce, "run_event", pb.RunEvent(seq=2, kind=pb.EVENT_KIND_REJECTED)),
        ]
    )
    got = edge.receive_all(replies)
    assert [(r.reply_to, r.kind, r.final) for r in got if isinstance(r, Reply)] == [
        (1, "run_accepted", False),
        (2, "error", True),
        (1, "run_event", False),
        (1, "run_event", True),
    ]
    assert edge.pending == 0


def _unpacked(messages: list[bytes]) -> list[bytes]:
    frames: list[bytes] = []
    for message in messages:
        envelope = decode(message)
        if envelope.WhichOneof("body") == "batch":
            frames.extend(e.SerializeToString() for e in envelope.batch.envelopes)
        else:
            frames.append(message)
    return frames


def test_what_goes_together_one_frame_goes_alone_at_once():
    _, frames = _requests(3)
    outbox = collections.deque(frames[:1])
    assert take_sendable(outbox, batches=True) == ([frames[0]], len(frames[0]))
    outbox = collections.deque(frames)
    messages, taken = take_sendable(outbox, batches=False)
    assert messages == frames and taken == sum(map(len, frames)) and not outbox
    outbox = collections.deque(frames)
    messages, _ = take_sendable(outbox, batches=True)
    assert len(messages) == 1 and _unpacked(messages) == frames


@given(
    sizes=st.lists(st.integers(min_value=0, max_value=3000), min_size=1, max_size=40),
    batches=st.booleans(),
    batch_bytes=st.integers(min_value=1, max_value=8000),
    send_bytes=st.integers(min_value=1, max_value=20000),
)
def test_what_goes_together_keeps_order_and_its_bounds(sizes, batches, batch_bytes, send_bytes):
    frames = [
        pb.Envelope(reply_to=i + 1, run_event=pb.RunEvent(text="x" * size)).SerializeToString()
        for i, size in enumerate(sizes)
    ]
    outbox = collections.deque(frames)
    messages, taken = take_sendable(
        outbox, batches=batches, batch_bytes=batch_bytes, send_bytes=send_bytes
    )
    sent = _unpacked(messages)
    # in order, none lost, none twice: what was taken, then what is left
    assert sent + list(outbox) == frames
    assert taken == sum(map(len, sent))
    # at least one; more only within the send's bound
    assert len(sent) == 1 or taken <= send_bytes
    # the next frame was left only because it would have passed the bound
    if outbox:
        assert taken + len(outbox[0]) > send_bytes
    for message in messages:
        if decode(message).WhichOneof("body") == "batch":
            assert batches
            assert len(message) <= batch_bytes + 8  # the batch's own tag and length
    if not batches:
        assert messages == sent


# --- several messages in one send, on a real WebSocket ------------------------------------


@asynccontextmanager
async def _echo_server(expected: int) -> AsyncIterator[tuple[int, list[bytes | str], trio.Event]]:
    """A WebSocket server that keeps what it gets; its event is set at ``expected``."""
    got: list[bytes | str] = []
    enough = trio.Event()

    async def handler(request) -> None:  # type: ignore[no-untyped-def]
        ws = await request.accept()
        while True:
            try:
                got.append(await ws.get_message())
            except ConnectionClosed:
                return
            if len(got) >= expected:
                enough.set()

    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            lambda task_status: serve_websocket(
                handler, "127.0.0.1", 0, ssl_context=None, task_status=task_status
            )
        )
        yield server.port, got, enough
        nursery.cancel_scope.cancel()


async def test_several_messages_go_in_one_send_and_arrive_as_they_were():
    with trio.fail_after(10):
        async with _echo_server(5) as (port, got, enough):
            async with open_websocket_url(f"ws://127.0.0.1:{port}/") as ws:
                writes: list[int] = []
                stream = ws._stream  # count the writes the layer makes
                send_all = stream.send_all

                async def counted(data: bytes) -> None:
                    writes.append(len(data))
                    await send_all(data)

                stream.send_all = counted  # type: ignore[method-assign]
                await send_messages(ws, [b"one", b"", b"three" * 1000])
                await send_messages(ws, [])
                await send_messages(ws, [b"four"])
                await ws.send_message("text still works")
                await enough.wait()
                assert got == [b"one", b"", b"three" * 1000, b"four", "text still works"]
                assert len(writes) == 3  # three messages, one write; then one; then one
            with pytest.raises(ConnectionClosed):
                await send_messages(ws, [b"after", b"close"])


# --- negotiation, and the older peers ------------------------------------------------------


async def _frames_of_runs(url: str, *, offer: bool, runs: int) -> tuple[str | None, list[bytes]]:
    """Ask for ``runs`` echo runs at once on a raw /client WebSocket (offering the batch
    subprotocol or not) and return the subprotocol agreed and every frame until all end."""
    conn: ProtoConnection[None] = ProtoConnection(Role.CLIENT)
    frames: list[bytes] = []
    async with open_websocket_url(
        url,
        extra_headers=bearer_header(TOKEN),
        subprotocols=[BATCH_SUBPROTOCOL] if offer else None,
    ) as ws:
        requests = [
            conn.request("run_request", pb.RunRequest(target="echo/a", prompt=f"run {i}"))[1]
            for i in range(runs)
        ]
        await send_messages(ws, requests)
        ended = 0
        while ended < runs:
            frame = await ws.get_message()
            assert isinstance(frame, bytes)
            frames.append(frame)
            for incoming in conn.receive_all(frame):
                assert isinstance(incoming, Reply), incoming
                ended += incoming.final
        return ws.subprotocol, frames


def _has_batches(frames: list[bytes]) -> bool:
    return any(decode(f).WhichOneof("body") == "batch" for f in frames)


async def test_a_client_that_reads_batches_gets_them_and_an_older_one_one_envelope_a_frame():
    async with stack(echo_node(("a", 4))) as s:
        url = s.edge.client_url
        agreed, frames = await _frames_of_runs(url, offer=True, runs=4)
        assert agreed == BATCH_SUBPROTOCOL
        assert _has_batches(frames)  # the ack goes with QUEUED and STARTED, at least
        # an older client offers no subprotocol: every frame it gets is one envelope,
        # and its runs end as well
        agreed, frames = await _frames_of_runs(url, offer=False, runs=4)
        assert agreed is None
        assert frames and not _has_batches(frames)
        # the session with the node, both new, reads batches both ways
        assert s.handle.session.peer_reads_batches
        assert s.client.session is not None and s.client.session.peer_reads_batches
        # the node wrote each ack with its QUEUED and STARTED: fewer sends than frames
        node_side = s.client.session
        assert node_side.sends < node_side.frames_sent, repr(node_side)
        # and the CLI's own client offers it
        async with open_runner(url, token=TOKEN) as runner:
            assert runner.session.peer_reads_batches


async def test_an_older_edge_gets_one_envelope_a_frame_from_a_new_node():
    """An edge of an older release: its HelloAck says nothing of batches. The node
    answers a burst of run requests sent in one batch, one envelope a frame."""
    node = echo_node(("a", 4))
    seen: dict[str, object] = {}
    done = trio.Event()

    async def old_edge(ws) -> None:  # type: ignore[no-untyped-def]
        conn: ProtoConnection[None] = ProtoConnection(Role.EDGE)
        hello = conn.receive(await ws.get_message())
        assert isinstance(hello, Request) and isinstance(hello.message, pb.Hello)
        seen["hello_batches"] = hello.message.batches
        await ws.send_message(conn.reply(hello.nonce, "hello_ack", pb.HelloAck(edge_id="old")))
        frames = [
            conn.request("run_request", pb.RunRequest(target="echo/a", prompt=f"p{i}"))[1]
            for i in range(6)
        ]
        await send_messages(ws, frames)
        got: list[bytes] = []
        ended = 0
        while ended < 6:
            frame = await ws.get_message()
            got.append(frame)
            incoming = conn.receive(frame)  # an older edge reads one envelope a frame
            assert isinstance(incoming, Reply), incoming
            ended += incoming.final
        seen["frames"] = got
        done.set()
        await trio.sleep_forever()

    async def accept_then(request) -> None:  # type: ignore[no-untyped-def]
        await old_edge(await request.accept())

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                lambda task_status: serve_websocket(
                    accept_then, "127.0.0.1", 0, ssl_context=None, task_status=task_status
                )
            )
            async with node.running():
                link = NodeLink(node, f"ws://127.0.0.1:{server.port}/node", backoff=FAST)
                nursery.start_soon(link.run)
                await done.wait()
                assert seen["hello_batches"] is True  # the node said it reads them
                assert link.session is not None and not link.session.peer_reads_batches
                assert not _has_batches(seen["frames"])  # type: ignore[arg-type]
                nursery.cancel_scope.cancel()


async def test_an_older_node_gets_one_envelope_a_frame_from_a_new_edge():
    """A node of an older release: its Hello says nothing of batches. The edge relays a
    client's burst to it one envelope a frame, and the runs end as ever."""
    edge = Edge(token=TOKEN)
    got: list[bytes] = []

    async def old_node(ws) -> None:  # type: ignore[no-untyped-def]
        conn: ProtoConnection[None] = ProtoConnection(Role.RUNNER)
        hello = pb.Hello(node_id="old", version="0.0", targets=[pb.TargetInfo(name="echo/a")])
        _, frame = conn.request("hello", hello)
        await ws.send_message(frame)
        while True:
            try:
                frame = await ws.get_message()
            except ConnectionClosed:
                return
            got.append(frame)
            incoming = conn.receive(frame)  # an older node reads one envelope a frame
            if isinstance(incoming, Request) and isinstance(incoming.message, pb.RunRequest):
                accepted = pb.RunAccepted(run_id=f"r{incoming.nonce}")
                end = pb.RunEvent(run_id=f"r{incoming.nonce}", seq=1, kind=pb.EVENT_KIND_REJECTED)
                await ws.send_message(conn.reply(incoming.nonce, "run_accepted", accepted))
                await ws.send_message(conn.reply(incoming.nonce, "run_event", end))

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(edge.serve)
            async with open_websocket_url(edge.node_url, extra_headers=bearer_header(TOKEN)) as ws:
                nursery.start_soon(old_node, ws)
                handle = await edge.wait_for_node("old")
                assert not handle.session.peer_reads_batches
                agreed, frames = await _frames_of_runs(edge.client_url, offer=True, runs=6)
                assert agreed == BATCH_SUBPROTOCOL
                assert len(_unpacked(frames)) == 12  # each run: its ack and its end
                requests = [f for f in got if decode(f).WhichOneof("body") == "run_request"]
                assert len(requests) == 6 and not _has_batches(got)
            nursery.cancel_scope.cancel()


# --- what is ready together: a run's last text and its end ---------------------------------


class _EndsWithText(Adapter):
    """Streams "first", then, when told, "last" and its end back to back, as an engine's
    last read brings its last tokens and ``[DONE]`` together."""

    kind = "ends-with-text"

    def __init__(self) -> None:
        super().__init__("scripted")
        self.go = trio.Event()

    @asynccontextmanager
    async def open_stream(self, request: AdapterRequest) -> AsyncIterator[AsyncIterator[Chunk]]:
        async def chunks() -> AsyncIterator[Chunk]:
            yield Delta("first ")
            await self.go.wait()
            yield Delta("last")
            yield Completion(Usage("stop"))

        yield chunks()


async def test_a_runs_last_text_goes_with_its_end_and_its_first_text_alone(tmp_path):
    adapter = _EndsWithText()
    node = Node(
        node_id="n1",
        adapters=[adapter],
        targets=[TargetSpec("scripted", "a", concurrency=1)],
        store=SqliteStore(str(tmp_path / "runs.db")),
    )
    with trio.fail_after(10):
        async with node.running():
            submitted = await node.manager.submit(RunSpec("scripted/a", "p"))
            watcher = node.manager.watch(submitted.record.run_id)
            # text that its engine's end did not come with is published at once, alone
            # (its engine was asked as the run's write committed: it may be here already)
            events = watcher.ready() or [await watcher.__anext__()]
            while events[-1].kind is not EventKind.DELTA:
                events.append(await watcher.__anext__())
            assert [e.kind for e in events] == [
                EventKind.QUEUED,
                EventKind.STARTED,
                EventKind.DELTA,
            ]
            assert events[-1].text == "first " and watcher.ready() == []
            adapter.go.set()
            # the last text waits for the run's end (a commit on a real SQLite file) and
            # both are published in one step: a watcher takes them together
            last = await watcher.__anext__()
            assert last.text == "last"
            (end,) = watcher.ready()
            assert end.kind is EventKind.SUCCEEDED
            stored = await node.store.events(submitted.record.run_id)
            assert [e.text for e in stored if e.kind is EventKind.DELTA] == ["first ", "last"]
