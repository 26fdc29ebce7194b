"""Every request gets exactly one answer, promptly, however many come at once.

Real WebSockets on loopback, real clock; every wait is bounded.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
from trio_websocket import open_websocket_url, serve_websocket

from iop_trio.model import RunQuery
from iop_trio.protocol import pb
from iop_trio.runtime import RunSpec, RunStatus
from iop_trio.transport import (
    RemoteError,
    ReplyTimeout,
    SessionClosed,
    SessionSettings,
    open_runner,
)
from iop_trio.transport.auth import bearer_header

from .test_wire import TOKEN, echo_node, stack

pytestmark = pytest.mark.faults

WAIT = 60


async def test_a_burst_over_the_session_bounds_gets_one_answer_each():
    """3,000 requests at once used to leave 1,643 unanswered; now each gets accepted or
    UNAVAILABLE, and nothing stays pending on either side."""
    small = SessionSettings(max_in_flight=8, max_pending=100)
    node = echo_node(("a", 4), max_queued=10_000, queue_timeout=60)
    outcomes: collections.Counter[str] = collections.Counter()
    async with (
        stack(node, edge_settings=small) as s,
        open_runner(s.edge.client_url, token=TOKEN) as client,
    ):

        async def one(i: int) -> None:
            try:
                await client.submit(RunSpec("echo/a", f"run {i}", background=True))
            except RemoteError as exc:
                outcomes[pb.ErrorCode.Name(exc.code)] += 1
            else:
                outcomes["accepted"] += 1

        with trio.fail_after(WAIT):
            async with trio.open_nursery() as nursery:
                for i in range(5_000):
                    nursery.start_soon(one, i)
        assert sum(outcomes.values()) == 5_000
        assert set(outcomes) == {"accepted", "ERROR_CODE_UNAVAILABLE"}
        assert outcomes["accepted"] >= 100
        assert client.session.pending == 0
        [edge_side] = s.edge.clients.values()
        assert edge_side.unanswered == 0
        assert edge_side.refused == outcomes["ERROR_CODE_UNAVAILABLE"]


async def test_the_gate_not_the_transport_decides_and_control_requests_go_on():
    """5,000 runs behind a paused target over one edge: each is accepted and either
    waits or is REJECTED(queue_full) with its stored event; cancel, list and
    set_limits are answered meanwhile."""
    node = echo_node(("a", 0), max_queued=1_000, queue_timeout=600)
    run_ids: list[str] = []
    async with stack(node) as s, open_runner(s.edge.client_url, token=TOKEN) as client:

        async def one(i: int) -> None:
            run_ids.append(await client.submit(RunSpec("echo/a", f"run {i}", background=True)))

        with trio.fail_after(WAIT):
            async with trio.open_nursery() as nursery:
                for i in range(5_000):
                    nursery.start_soon(one, i)
            assert len(run_ids) == 5_000
            queued = await node.store.list_runs(RunQuery(statuses=[RunStatus.QUEUED], limit=10_000))
            rejected = await node.store.list_runs(
                RunQuery(statuses=[RunStatus.REJECTED], limit=10_000)
            )
            assert (len(queued), len(rejected)) == (1_000, 4_000)
            assert {r.reason for r in rejected} == {"queue_full"}
            # control requests, with 1,000 runs waiting on this session's node
            listed = await client.list_runs(RunQuery(statuses=[RunStatus.QUEUED], limit=5))
            assert len(listed) == 5
            cancelled = await client.cancel(queued[0].run_id, "no longer needed")
            assert cancelled.cancelled
            limits = await s.handle.set_limits(targets={"echo/a": 0}, max_queued=1_000)
            assert limits.targets["echo/a"] == 0
            assert await client.ping() >= 0


async def test_a_peer_that_does_not_read_is_closed_and_others_go_on():
    # a run whose events are big, so that unread answers fill the sockets quickly
    node = echo_node(("a", 1), max_queued=10)
    settings = SessionSettings(send_timeout=0.5, max_outbox=1024 * 1024)
    async with stack(node, edge_settings=settings) as s:
        async with s.edge.run(RunSpec("echo/a", ("x" * 1000 + " ") * 500)) as stream:
            await stream.collect()
        request = pb.Envelope(get_run=pb.GetRun(run_id=stream.run_id, include_events=True))
        async with open_websocket_url(
            s.edge.client_url, extra_headers=bearer_header(TOKEN)
        ) as deaf:
            with trio.fail_after(WAIT):
                await s.edge.wait_until(lambda: bool(s.edge.clients))
                [session] = s.edge.clients.values()
                for nonce in range(1, 201):  # 200 answers of ~0.5 MB each, never read
                    request.nonce = nonce
                    try:
                        await deaf.send_message(request.SerializeToString())
                    except Exception:  # the edge may have closed it already
                        break
                await session.ended.wait()
        assert "does not read" in session.close_reason
        # the edge and the node serve the next client as if nothing happened
        async with (
            open_runner(s.edge.client_url, token=TOKEN) as client,
            client.run(RunSpec("echo/a", "still here")) as other,
        ):
            assert (await other.collect())[0] == "still here"


@asynccontextmanager
async def silent_edge() -> AsyncIterator[str]:
    """A WebSocket server that takes requests and never answers; yields its URL."""

    async def handler(request: object) -> None:
        ws = await request.accept()  # type: ignore[attr-defined]
        while True:
            await ws.get_message()

    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve_websocket, handler, "127.0.0.1", 0, None)
        yield f"ws://127.0.0.1:{server.port}/client"
        nursery.cancel_scope.cancel()


async def test_the_caller_gets_a_clear_timeout_from_a_peer_that_never_answers():
    async with silent_edge() as url, open_runner(url, ack_timeout=0.2) as client:
        with trio.fail_after(WAIT), pytest.raises(ReplyTimeout, match="not answered run_request"):
            await client.submit(RunSpec("echo/a", "hello?"))
        with trio.fail_after(WAIT), pytest.raises(ReplyTimeout, match=r"cancel_run .* 0.2s"):
            await client.cancel("r1")
        assert client.session.pending == 0


async def test_a_stream_that_goes_quiet_times_out():
    node = echo_node(("a", 1), delay=30)
    async with stack(node) as s:
        url = s.edge.client_url
        async with (
            open_runner(url, token=TOKEN, idle_timeout=0.3) as client,
            client.run(RunSpec("echo/a", "slow words")) as stream,
        ):
            with trio.fail_after(WAIT), pytest.raises(ReplyTimeout, match="went on"):
                async for _ in stream:
                    pass


async def test_edge_answers_mean_what_they_say():
    node = echo_node(("a", 1))
    async with stack(node) as s, open_runner(s.edge.client_url, token=TOKEN) as client:
        with pytest.raises(RemoteError) as empty:
            await client.submit(RunSpec("", "no target"))
        assert empty.value.code == pb.ERROR_CODE_INVALID
        with pytest.raises(RemoteError) as unknown:
            await client.submit(RunSpec("echo/zz", "never served"))
        assert unknown.value.code == pb.ERROR_CODE_UNKNOWN_TARGET
        await s.client.aclose()  # the node goes away
        with trio.fail_after(WAIT):
            await s.edge.wait_until(lambda: not s.edge.nodes)
        with pytest.raises(RemoteError) as gone:
            await client.submit(RunSpec("echo/a", "its node is gone"))
        assert gone.value.code == pb.ERROR_CODE_UNAVAILABLE
        assert "retry later" in gone.value.message


async def test_each_waiter_gets_its_own_session_closed():
    async with silent_edge() as url, open_runner(url, ack_timeout=None) as client:
        caught: list[BaseException] = []

        async def wait_for_answer() -> None:
            try:
                await client.cancel("r")
            except SessionClosed as exc:
                caught.append(exc)

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(wait_for_answer)
            await trio.testing.wait_all_tasks_blocked()
            assert client.session.pending == 3
            await client.session.aclose()
        assert len(caught) == 3
        assert len({id(exc) for exc in caught}) == 3
