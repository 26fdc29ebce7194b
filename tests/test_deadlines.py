"""A request that says when its sender gives up gets its answer before then, and no run is
made for a sender who is gone (issue 19, "a burst never does work for nobody").

Two sessions over an in-memory WebSocket for the session's rule, then the edge and a
node over real loopback WebSockets: the bound travels on each hop (the client's, the
edge's relay to the node) and each hop answers in time. A MockClock throughout. (The
default client's 10,000-request burst through real processes is in test_flood.py.)
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from iop_trio.adapters.echo import EchoAdapter
from iop_trio.edge.edge import HOP_MARGIN
from iop_trio.model import RunSpec, RunStatus, TargetSpec
from iop_trio.protocol import Request, Role, pb
from iop_trio.runtime import Node
from iop_trio.transport import (
    ProtoSession,
    RemoteError,
    RunService,
    SessionSettings,
    open_runner,
)
from iop_trio.transport.caller import ACK_TIMEOUT, RunnerClient, answer_within_for

from .test_runtime import CommitsIn
from .test_wire import TOKEN, echo_node, stack, websocket_pair


def test_a_caller_gives_its_peer_less_time_than_it_waits_itself():
    assert answer_within_for(ACK_TIMEOUT) == 20.0
    assert answer_within_for(4.0) == 2.0  # at least half, at most the timeout less 2 s
    assert answer_within_for(100.0) == pytest.approx(66.67, abs=0.01)
    assert answer_within_for(None) == 0.0


@asynccontextmanager
async def pair(
    handler, settings: SessionSettings
) -> AsyncIterator[tuple[RunnerClient, ProtoSession]]:  # type: ignore[no-untyped-def]
    """A client session and a serving one, over an in-memory WebSocket."""
    near, far = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        ws, peer = await websocket_pair(near, far, nursery)
        served = ProtoSession(peer, Role.RUNNER, handler=handler, settings=settings)
        client = ProtoSession(ws, Role.CLIENT, settings=SessionSettings(ping_interval=0))
        nursery.start_soon(served.run)
        nursery.start_soon(client.run)
        await trio.testing.wait_all_tasks_blocked()
        yield RunnerClient(client, ack_timeout=10.0), served
        nursery.cancel_scope.cancel()


async def test_a_waiting_request_whose_sender_gave_up_is_answered_and_never_handled(
    autojump_clock,
):
    handled: list[int] = []
    release = trio.Event()
    left: dict[int, float] = {}

    async def handler(session: ProtoSession, request: Request) -> None:
        handled.append(request.nonce)
        left[request.nonce] = session.time_left(request.nonce)
        await release.wait()
        await session.reply(request.nonce, "limits", pb.Limits())

    settings = SessionSettings(ping_interval=0, max_in_flight=1)
    async with pair(handler, settings) as (client, served):
        answers: dict[str, object] = {}

        async def ask(name: str) -> None:
            try:
                answers[name] = await client.call("set_limits", pb.SetLimits())
            except RemoteError as exc:
                answers[name] = exc

        async with trio.open_nursery() as nursery:
            for name in ("first", "second", "third"):
                nursery.start_soon(ask, name)
                await trio.testing.wait_all_tasks_blocked()
            start = trio.current_time()
            await trio.sleep(answer_within_for(10.0) + 0.1)  # the bound the client gave
            assert set(answers) == {"second", "third"}  # both answered, in time (< 10 s)
            release.set()
        assert trio.current_time() - start < 10
        assert handled == [1]  # the waiting two were never handled
        assert left[1] == pytest.approx(answer_within_for(10.0))
        for name in ("second", "third"):
            refused = answers[name]
            assert isinstance(refused, RemoteError)
            assert refused.code == pb.ERROR_CODE_UNAVAILABLE
            assert "its sender has given up" in refused.message
            assert refused.retry_after
        assert served.expired == 2


async def test_a_request_without_a_bound_waits_its_turn(autojump_clock):
    release = trio.Event()

    async def handler(session: ProtoSession, request: Request) -> None:
        await release.wait()
        await session.reply(request.nonce, "limits", pb.Limits())

    settings = SessionSettings(ping_interval=0, max_in_flight=1)
    async with pair(handler, settings) as (client, served), trio.open_nursery() as nursery:
        for _ in range(3):  # an older peer's requests: no bound, no timeout
            nursery.start_soon(client.session.request, "set_limits", pb.SetLimits())
        await trio.sleep(100)
        assert served.expired == 0
        release.set()


async def test_the_edge_passes_the_time_left_on_and_the_node_refuses_what_comes_too_late(
    autojump_clock, monkeypatch
):
    node = echo_node(("a", 1))
    seen: list[float] = []
    original = RunService._on_run_request

    async def spying(self, session, nonce, message):  # type: ignore[no-untyped-def]
        seen.append(session.time_left(nonce))  # what the node's session is told
        await original(self, session, nonce, message)

    monkeypatch.setattr(RunService, "_on_run_request", spying)
    async with stack(node) as s:
        async with (
            open_runner(s.edge.client_url, token=TOKEN) as client,
            client.run(RunSpec("echo/a", "in time")) as stream,
        ):
            assert (await stream.collect())[0] == "in time"
        assert len(seen) == 1
        assert seen[0] == pytest.approx(answer_within_for(ACK_TIMEOUT) - HOP_MARGIN, abs=0.01)

        # a sender that gives the edge too little time: refused there, nothing reaches the node
        async with open_runner(s.edge.client_url, token=TOKEN) as client:
            with pytest.raises(RemoteError) as refused:
                async with client.stream(
                    "run_request",
                    pb.RunRequest(target="echo/a", prompt="too late"),
                    answer_within=HOP_MARGIN,
                ) as replies:
                    await replies.first()
        assert refused.value.code == pb.ERROR_CODE_UNAVAILABLE
        assert "too soon" in refused.value.message
        assert len(seen) == 1
        assert [r.status for r in await node.manager.list_runs()] == [RunStatus.SUCCEEDED]


async def test_a_node_does_not_make_a_run_its_sender_will_not_hear_of(autojump_clock):
    node = echo_node(("a", 1))
    async with stack(node) as s:
        with pytest.raises(RemoteError) as refused:
            async with s.handle.stream(
                "run_request", pb.RunRequest(target="echo/a", prompt="x"), answer_within=0.1
            ) as replies:
                await replies.first()
        assert refused.value.code == pb.ERROR_CODE_UNAVAILABLE
        assert "not begun" in refused.value.message
        assert await node.manager.list_runs() == []


async def test_a_run_the_node_cannot_store_before_its_sender_gives_up_is_not_made(
    autojump_clock,
):
    store = CommitsIn(math.inf)  # a busy store: this create would end, but not in time
    node = Node(
        node_id="n1",
        adapters=[EchoAdapter()],
        targets=[TargetSpec("echo", "a")],
        store=store,
    )
    async with stack(node) as s:
        start = trio.current_time()
        with pytest.raises(RemoteError) as refused:
            async with s.handle.stream(
                "run_request",
                pb.RunRequest(target="echo/a", prompt="x", run_id="late"),
                answer_within=5.0,
            ) as replies:
                await replies.first()
        assert trio.current_time() - start < 5.0  # answered before the sender gave up
        assert refused.value.code == pb.ERROR_CODE_UNAVAILABLE  # the store is well: busy
        assert "could not be stored within" in refused.value.message
        assert await store.get("late") is None
