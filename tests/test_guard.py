"""The connection guard: what a stranger who never authenticates can hold, and for how long.

The rules on their own first (a MockClock, no sockets), then the edge's two ports
over real loopback sockets: slow handshakes on the proto-socket port and on the OpenAI
door are closed at the deadline, a flood of them is bounded per peer and in all, and
callers with a good token get in and are served all the while. (The same flood
against a real ``iop-node edge`` under a lowered open-file limit is in
``test_flood.py``.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import httpx
import pytest
import trio
import trio.testing

from iop_trio.edge import Edge
from iop_trio.edge.front_door import serve_door
from iop_trio.model import RunSpec, RunStatus
from iop_trio.runtime import Node
from iop_trio.transport import NodeLink, open_runner
from iop_trio.transport.guard import ConnectionBounds, ConnectionGuard

from .support import logged
from .test_wire import FAST, TOKEN, echo_node

BOUNDS = ConnectionBounds(
    max_connections=40, max_unproven=8, max_unproven_per_peer=4, evict_after=1.0
)


def test_bounds_are_checked():
    with pytest.raises(ValueError, match="max_unproven_per_peer"):
        ConnectionBounds(max_unproven_per_peer=0)
    with pytest.raises(ValueError, match="handshake_timeout"):
        ConnectionBounds(handshake_timeout=0)
    # the unproven may never take more than half of all connections
    assert ConnectionGuard(ConnectionBounds(max_connections=10, max_unproven=256)).max_unproven == 5
    # by default, all connections are bounded by the open-file limit
    assert ConnectionGuard().max_connections >= 16


async def test_a_peer_at_its_bound_is_refused_until_its_oldest_is_old_enough_to_drop(
    autojump_clock,
):
    guard = ConnectionGuard(BOUNDS)
    first = [guard.admit("10.0.0.1") for _ in range(4)]
    assert all(first)
    assert guard.admit("10.0.0.1") is None  # a burst: refused at once, nothing dropped
    assert guard.refused == 1
    assert guard.admit("10.0.0.2") is not None  # another peer is not this one's bound
    await trio.sleep(1.0)
    newcomer = guard.admit("10.0.0.1")
    assert newcomer is not None
    assert first[0] is not None and first[0].dropped.startswith("dropped for a newer")
    assert guard.unproven_from("10.0.0.1") == 4
    assert guard.open == 5  # a dropped one no longer counts
    assert "unproven=5/8" in repr(guard)


async def test_all_the_unproven_are_bounded_and_a_proven_one_leaves_their_count(
    autojump_clock,
):
    guard = ConnectionGuard(BOUNDS)
    tickets = [guard.admit(f"10.0.0.{i}") for i in range(8)]
    assert guard.admit("10.0.1.1") is None
    assert tickets[3] is not None
    guard.prove(tickets[3])
    assert guard.unproven == 7
    assert guard.admit("10.0.1.1") is not None  # the room the proven one left
    await trio.sleep(1.0)
    assert guard.admit("10.0.1.2") is not None  # and now the oldest unproven gives way
    assert tickets[0] is not None and tickets[0].dropped
    assert not tickets[3].dropped  # never a proven one


async def test_past_max_connections_everyone_is_refused_and_a_release_makes_room():
    guard = ConnectionGuard(attrs.evolve(BOUNDS, max_connections=4))
    tickets = []
    for i in range(4):  # each proves itself before the next comes
        ticket = guard.admit(f"10.0.0.{i}")
        assert ticket is not None
        guard.prove(ticket)
        tickets.append(ticket)
    assert guard.admit("10.0.0.9") is None  # proven or not: four is all
    assert tickets[0] is not None
    guard.release(tickets[0])
    guard.release(tickets[0])  # once only
    assert guard.open == 3
    assert guard.admit("10.0.0.9") is not None


async def test_refusals_are_logged_once_in_a_while_with_a_count(autojump_clock):
    guard = ConnectionGuard(attrs.evolve(BOUNDS, max_connections=2))
    for peer in ("a", "b"):
        ticket = guard.admit(peer)
        assert ticket is not None
        guard.prove(ticket)
    with logged("iop_trio.transport.guard") as records:
        for _ in range(100):
            guard.admit("c")
        await trio.sleep(10)
        guard.admit("c")
    said = [r.getMessage() for r in records if r.levelname == "WARNING"]
    assert len(said) == 2
    assert said[0].startswith("refused 1 connection(s)")
    assert said[1].startswith("refused 100 connection(s)")


async def test_a_stream_wait_ends_at_the_handshake_deadline_unless_the_connection_is_proven(
    autojump_clock,
):
    guard = ConnectionGuard(attrs.evolve(BOUNDS, handshake_timeout=10))
    late = guard.admit("a")
    proven = guard.admit("b")
    assert late is not None and proven is not None
    ended: dict[str, float] = {}

    async def wait(name: str, ticket: object) -> None:
        assert hasattr(ticket, "bounded")
        with ticket.bounded():
            await trio.sleep(100)
        ended[name] = trio.current_time()

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait, "late", late)
        nursery.start_soon(wait, "proven", proven)
        await trio.testing.wait_all_tasks_blocked()
        guard.prove(proven)  # while it waits: its deadline is lifted
    assert ended == {"late": start + 10, "proven": start + 100}
    assert late.dropped == ""  # a scope ended; whoever used the stream decides


async def test_a_dropped_connection_has_its_waits_cancelled_now_and_later(autojump_clock):
    guard = ConnectionGuard(BOUNDS)
    ticket = guard.admit("a")
    assert ticket is not None
    with ticket.bounded() as scope:
        guard.drop(ticket, "testing")
        await trio.sleep(1)
    assert scope.cancelled_caught
    with ticket.bounded() as later:
        await trio.sleep(1)
    assert later.cancelled_caught
    assert guard.open == 0 and guard.dropped == 1


# --- over real sockets ------------------------------------------------------------------


@attrs.frozen
class Served:
    edge: Edge
    node: Node
    door_url: str


@asynccontextmanager
async def served(bounds: ConnectionBounds) -> AsyncIterator[Served]:
    """An edge (proto-socket and door, one guard) with a node connected."""
    node = echo_node(("a", 4))
    edge = Edge(token=TOKEN, bounds=bounds)
    async with trio.open_nursery() as nursery:
        await nursery.start(edge.serve)
        door_port = await nursery.start(serve_door, edge, "127.0.0.1", 0)
        async with node.running():
            link = NodeLink(node, edge.node_url, token=TOKEN, backoff=FAST)
            nursery.start_soon(link.run)
            await edge.wait_for_node("n1")
            yield Served(edge, node, f"http://127.0.0.1:{door_port}")
            await link.aclose()
        nursery.cancel_scope.cancel()


async def slow_handshake(
    port: int, head: bytes = b"GET /client HTTP/1.1\r\nHost: x\r\n"
) -> trio.SocketStream:
    """A connection that starts a request and never finishes it."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(head)
    return stream


async def read_to_end(stream: trio.SocketStream) -> bytes:
    data = b""
    try:
        while chunk := await stream.receive_some():
            data += chunk
    except trio.BrokenResourceError:
        pass
    return data


async def echo_run(edge: Edge) -> RunStatus:
    async with (
        open_runner(edge.client_url, token=TOKEN) as client,
        client.run(RunSpec("echo/a", "still served")) as stream,
    ):
        text, last = await stream.collect()
    assert text == "still served"
    status = last.kind.status
    assert status is not None
    return status


async def test_a_handshake_not_finished_in_time_is_closed_and_others_are_served(autojump_clock):
    bounds = attrs.evolve(BOUNDS, handshake_timeout=10)
    async with served(bounds) as s:
        assert s.edge.port is not None
        start = trio.current_time()
        slow = await slow_handshake(s.edge.port)
        assert await echo_run(s.edge) is RunStatus.SUCCEEDED
        assert await read_to_end(slow) == b""  # closed, without a word
        assert trio.current_time() - start == pytest.approx(10, abs=0.5)
        assert s.edge.guard.unproven == 0


async def test_a_flood_of_handshakes_is_bounded_and_a_good_caller_still_gets_in(autojump_clock):
    async with served(BOUNDS) as s:
        port = s.edge.port
        assert port is not None
        flood = [await slow_handshake(port) for _ in range(30)]
        await trio.testing.wait_all_tasks_blocked()
        assert s.edge.guard.unproven_from("127.0.0.1") == 4
        refused = 0
        with trio.move_on_after(0.5):  # those refused are told so and closed at once
            for stream in flood[4:]:
                answer = await read_to_end(stream)
                assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1")
                refused += 1
        assert refused == 26
        await trio.sleep(1.0)  # the flood's oldest handshakes are now old enough to give way
        assert await echo_run(s.edge) is RunStatus.SUCCEEDED
        async with httpx.AsyncClient(base_url=s.door_url) as http:
            models = await http.get("/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})
        assert models.status_code == 200
        assert s.edge.guard.unproven_from("127.0.0.1") <= 4
        for stream in flood:
            await stream.aclose()


async def test_the_door_closes_a_slow_request_head_and_a_wrong_token_stays_unproven(
    autojump_clock,
):
    bounds = attrs.evolve(BOUNDS, handshake_timeout=5)
    async with served(bounds) as s:
        port = int(s.door_url.rpartition(":")[2])
        start = trio.current_time()
        slow = await slow_handshake(port, b"POST /v1/chat/completions HTTP/1.1\r\n")
        assert await read_to_end(slow) == b""
        assert trio.current_time() - start <= 5.5
        # a connection that keeps asking with a wrong token is dropped at the deadline
        async with httpx.AsyncClient(base_url=s.door_url) as http:
            wrong = await http.get("/v1/models", headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            assert s.edge.guard.unproven == 1
            right = await http.get("/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})
            assert right.status_code == 200
            assert s.edge.guard.unproven == 0
            await trio.sleep(8)  # past the deadline (not the keep-alive): a proven one stays
            again = await http.get("/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})
            assert again.status_code == 200
