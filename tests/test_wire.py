"""Edge <-> node over real WebSockets on loopback (real clock; every wait is bounded)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    WebSocketConnection,
    open_websocket_url,
    serve_websocket,
    wrap_client_stream,
    wrap_server_stream,
)

from iop_trio.adapters.echo import EchoAdapter, EchoSettings
from iop_trio.edge import Edge, NodeHandle
from iop_trio.model import RunQuery
from iop_trio.protocol import ProtoConnection, Reply, Request, Role, pb
from iop_trio.protocol.convert import tenant_limits_from_pb
from iop_trio.runtime import (
    EventKind,
    Node,
    RunSpec,
    RunStatus,
    RuntimeLimits,
    TargetSpec,
    TenantLimits,
)
from iop_trio.store.memory import MemoryStore
from iop_trio.transport import (
    Backoff,
    NodeLink,
    ProtoSession,
    RemoteError,
    SessionSettings,
    open_runner,
)
from iop_trio.transport.auth import bearer_header

from .support import CountingEcho

TOKEN = "s3cret"
FAST = Backoff(initial=0.01, maximum=0.05, stable_after=0.5)


@attrs.frozen
class Stack:
    edge: Edge
    node: Node
    client: NodeLink
    handle: NodeHandle
    nursery: trio.Nursery


@asynccontextmanager
async def stack(
    node: Node, *, edge_settings: SessionSettings | None = None, client_tenant: str = ""
) -> AsyncIterator[Stack]:
    edge = Edge(token=TOKEN, settings=edge_settings, client_tenant=client_tenant)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(edge.serve)
            async with node.running(), trio.open_nursery() as client_nursery:
                client = NodeLink(node, edge.node_url, token=TOKEN, backoff=FAST)
                client_nursery.start_soon(client.run)
                handle = await edge.wait_for_node(node.node_id)
                await client.wait_connected()
                yield Stack(edge, node, client, handle, nursery)
                await client.aclose()  # the node hangs up first, cleanly
            nursery.cancel_scope.cancel()


def echo_node(*targets: tuple[str, int], delay: float = 0.0, **limits: object) -> Node:
    return Node(
        node_id="n1",
        adapters=[CountingEcho(settings=EchoSettings(delay=delay))],
        targets=[TargetSpec("echo", model, concurrency=limit) for model, limit in targets],
        limits=RuntimeLimits(**limits),  # type: ignore[arg-type],
        store=MemoryStore(),
    )


async def websocket_pair(
    near: trio.abc.Stream,
    far: trio.abc.Stream,
    nursery: trio.Nursery,
    client_nursery: trio.Nursery | None = None,
) -> tuple[WebSocketConnection, WebSocketConnection]:
    """Both ends of a WebSocket over a stream pair, (the client's, the server's); their
    reader tasks in ``nursery`` (the client's in ``client_nursery`` if given)."""
    accepted: list[WebSocketConnection] = []

    async def accept() -> None:
        request = await wrap_server_stream(nursery, far)
        accepted.append(await request.accept())

    nursery.start_soon(accept)
    ws = await wrap_client_stream(client_nursery or nursery, near, "peer", "/")
    await trio.testing.wait_all_tasks_blocked()
    return ws, accepted[0]


async def test_hello_tells_the_edge_about_targets_and_limits():
    node = echo_node(("a", 2), ("b", 3), concurrency=4)
    async with stack(node) as s:
        hello = s.handle.hello
        assert hello.node_id == "n1"
        assert {t.name: t.concurrency for t in hello.targets} == {"echo/a": 2, "echo/b": 3}
        assert hello.limits.concurrency == 4
        assert [a.kind for a in hello.adapters] == ["echo"]
        assert s.client.sessions == 1


async def test_100_concurrent_runs_across_3_targets_respect_the_limits():
    limits = {"a": 1, "b": 2, "c": 4}
    node = echo_node(*limits.items(), delay=0.002, concurrency=5, max_queued=200)
    adapter = node.adapters["echo"]
    assert isinstance(adapter, CountingEcho)
    results: dict[int, tuple[str, RunStatus]] = {}

    async def one(i: int) -> None:
        target = f"echo/{'abc'[i % 3]}"
        async with s.edge.run(RunSpec(target, f"run {i} says hi")) as stream:
            text, last = await stream.collect()
        results[i] = (text, last.kind.status)  # type: ignore[assignment]

    async with stack(node) as s:
        async with trio.open_nursery() as nursery:
            for i in range(100):
                nursery.start_soon(one, i)
        assert results == {i: (f"run {i} says hi", RunStatus.SUCCEEDED) for i in range(100)}
        for model, limit in limits.items():
            assert 1 <= adapter.peak_by_model[model] <= limit
        assert adapter.peak <= 5
        stats = node.gate.statistics()
        assert (stats.global_.borrowed, stats.queued) == (0, 0)


async def test_cancel_over_the_wire_queued_and_running():
    node = echo_node(("a", 1), delay=30)
    adapter = node.adapters["echo"]
    async with stack(node) as s:
        async with s.edge.run(RunSpec("echo/a", "slow words here")) as running:
            assert (await running.__anext__()).kind is EventKind.QUEUED
            assert (await running.__anext__()).kind is EventKind.STARTED
            async with s.edge.run(RunSpec("echo/a", "waits")) as queued:
                assert (await queued.__anext__()).kind is EventKind.QUEUED
                result = await s.edge.cancel(queued.run_id, "changed my mind")
                assert (result.status, result.cancelled) == (pb.RUN_STATUS_CANCELLED, True)
                last = await queued.__anext__()
                assert (last.kind, last.reason) == (EventKind.CANCELLED, "changed my mind")
            result = await s.edge.cancel(running.run_id)
            assert (result.status, result.cancelled) == (pb.RUN_STATUS_CANCELLED, True)
            assert (await running.__anext__()).kind is EventKind.CANCELLED
        assert adapter.active == 0  # the running run's stream was closed
        kinds = [e.kind for e in await node.store.events(queued.run_id)]
        assert kinds == [EventKind.QUEUED, EventKind.CANCELLED]
        again = await s.edge.cancel(running.run_id)
        assert (again.status, again.cancelled) == (pb.RUN_STATUS_CANCELLED, False)


async def test_edge_disconnect_cancels_foreground_and_spares_background():
    node = echo_node(("a", 2), delay=0.05)
    async with stack(node) as s:
        fg_spec = RunSpec("echo/a", " ".join(["word"] * 2000))
        bg_spec = RunSpec("echo/a", "background work goes on", background=True)
        async with s.edge.run(fg_spec) as fg, s.edge.run(bg_spec) as bg:
            for stream in (fg, bg):
                while (await stream.__anext__()).kind is not EventKind.STARTED:
                    pass
            # the edge drops the node's session in the middle of both runs
            await s.handle.session.aclose(1001, "edge going away")
        handle = await s.edge.wait_for_node("n1", other_than=s.handle)  # the node dialed back
        await s.client.wait_connected()
        assert s.client.sessions == 2
        info = await handle.get_run(fg.run_id)
        assert (info.run.status, info.run.reason) == (pb.RUN_STATUS_CANCELLED, "session_lost")
        async with handle.follow(bg.run_id) as followed:
            events = [e async for e in followed]
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert events[-1].kind is EventKind.SUCCEEDED
        assert "".join(e.text for e in events) == "background work goes on"
        for run_id in (fg.run_id, bg.run_id):
            stored = await node.store.events(run_id)
            record = await node.store.get(run_id)
            assert record is not None
            assert stored[-1].status is record.status
            assert sum(e.kind.terminal for e in stored) == 1


async def test_unknown_target_and_run_are_clear_errors_and_the_session_goes_on():
    node = echo_node(("a", 1))
    async with stack(node) as s:
        with pytest.raises(RemoteError, match="unknown target 'echo/zzz'") as caught:
            async with s.handle.run(RunSpec("echo/zzz", "p")):
                pass
        assert caught.value.code == pb.ERROR_CODE_UNKNOWN_TARGET
        with pytest.raises(RemoteError, match="unknown run") as caught:
            await s.handle.cancel("nope")
        assert caught.value.code == pb.ERROR_CODE_UNKNOWN_RUN
        async with s.handle.run(RunSpec("echo/a", "still fine")) as stream:
            assert (await stream.collect())[0] == "still fine"


async def test_set_limits_and_list_runs_over_the_wire():
    node = echo_node(("a", 1), ("b", 1))
    async with stack(node) as s:
        limits = await s.handle.set_limits(concurrency=3, targets={"echo/a": 2})
        assert (limits.concurrency, limits.targets["echo/a"]) == (3, 2)
        assert node.limits().targets["echo/a"] == 2
        with pytest.raises(RemoteError, match="unknown target 'echo/zzz'"):
            await s.handle.set_limits(targets={"echo/zzz": 1})
        share = TenantLimits(weight=2.5, max_queued=7)
        limits = await s.handle.set_limits(tenants={"acme": share})
        assert tenant_limits_from_pb(limits.tenants["acme"]) == share
        assert node.limits().tenants == {"acme": share}
        with pytest.raises(RemoteError, match="tenant 'acme' weight must be a number > 0"):
            await s.handle.set_limits(tenants={"acme": TenantLimits(weight=-1)})
        assert node.limits().tenants == {"acme": share}  # nothing changed
        ids = [await s.handle.submit(RunSpec("echo/a", f"r{i}")) for i in range(3)]
        await node.manager.wait_idle()
        listed = await s.handle.list_runs(RunQuery(statuses=[RunStatus.SUCCEEDED], target="echo/a"))
        assert [r.run_id for r in listed] == ids[::-1]


async def test_cli_client_through_the_edge_and_client_loss_cancels_its_run():
    node = echo_node(("a", 1), delay=30)
    async with stack(node) as s:
        async with open_runner(s.edge.client_url, token=TOKEN) as client:
            assert await client.ping() >= 0
            async with client.run(RunSpec("echo/a", "never finishes")) as stream:
                while (await stream.__anext__()).kind is not EventKind.STARTED:
                    pass
                run_id = stream.run_id
        # the client left mid-run: the edge cancels its foreground run
        with trio.fail_after(10):
            while (record := await node.store.get(run_id)) is None or not record.status.terminal:
                await node.manager.wait_idle()
        assert (record.status, record.reason) == (RunStatus.CANCELLED, "client_lost")


async def test_wrong_token_is_refused_with_401_and_the_node_keeps_trying():
    edge = Edge(token=TOKEN)
    node = echo_node(("a", 1))
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(edge.serve)
            with pytest.raises(ConnectionRejected) as caught:
                async with open_runner(edge.client_url, token="wrong"):
                    pass
            assert caught.value.status_code == 401
            async with node.running():
                client = NodeLink(node, edge.node_url, token="wrong", backoff=FAST)
                nursery.start_soon(client.run)
                await client.wait_attempts(3)
                assert "401" in client.last_error and "token" in client.last_error
                assert edge.nodes == {}
                nursery.cancel_scope.cancel()


async def test_oversized_message_closes_that_connection_with_1009_only():
    node = echo_node(("a", 1))
    settings = SessionSettings(max_message_size=64 * 1024)
    async with stack(node, edge_settings=settings) as s:
        async with open_websocket_url(s.edge.client_url, extra_headers=bearer_header(TOKEN)) as ws:
            await ws.send_message(b"\x00" * (100 * 1024))
            with pytest.raises(ConnectionClosed) as caught:
                await ws.get_message()
            assert caught.value.reason is not None
            assert caught.value.reason.code == 1009
        async with (
            open_runner(s.edge.client_url, token=TOKEN) as client,
            client.run(RunSpec("echo/a", "others are served")) as stream,
        ):
            assert (await stream.collect())[0] == "others are served"
        assert not s.handle.session.closed


@settings(
    max_examples=40,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(frames=st.lists(st.binary(max_size=300), min_size=1, max_size=15))
async def test_fuzzed_frames_get_errors_and_other_sessions_go_on(frames):
    node = echo_node(("a", 2))
    async with stack(node) as s:
        async with open_websocket_url(s.edge.client_url, extra_headers=bearer_header(TOKEN)) as ws:
            for frame in frames:
                await ws.send_message(frame)
            # whatever it sent, the fuzzing connection itself still works
            conn = ProtoConnection(Role.CLIENT)
            nonce, ping = conn.request("ping", pb.Ping(time=1.0))
            await ws.send_message(ping)
            with trio.fail_after(10):
                while True:
                    incoming = conn.receive(await ws.get_message())
                    if isinstance(incoming, Reply) and incoming.reply_to == nonce:
                        break
            assert incoming.kind == "pong"
        async with s.edge.run(RunSpec("echo/a", "still serving")) as stream:
            assert (await stream.collect())[0] == "still serving"


async def hello_then(ws, conn: ProtoConnection) -> None:  # type: ignore[no-untyped-def]
    incoming = conn.receive(await ws.get_message())
    assert isinstance(incoming, Request) and incoming.kind == "hello"
    await ws.send_message(conn.reply(incoming.nonce, "hello_ack", pb.HelloAck(edge_id="fake")))


@settings(
    max_examples=25,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(frames=st.lists(st.binary(max_size=300), min_size=1, max_size=10))
async def test_fuzzed_frames_to_the_node_get_errors_and_it_keeps_serving(frames):
    node = echo_node(("a", 1))
    done = trio.Event()
    seen: dict[str, object] = {}

    async def fake_edge(ws) -> None:  # type: ignore[no-untyped-def]
        conn = ProtoConnection(Role.EDGE)
        await hello_then(ws, conn)
        for frame in frames:
            await ws.send_message(frame)
        nonce, request = conn.request("run_request", pb.RunRequest(target="echo/a", prompt="ok"))
        await ws.send_message(request)
        texts = []
        while True:
            incoming = conn.receive(await ws.get_message())
            if isinstance(incoming, Reply) and incoming.reply_to == nonce:
                if incoming.kind == "run_event":
                    texts.append(incoming.message.text)  # type: ignore[attr-defined]
                if incoming.final:
                    seen["last"] = incoming.message
                    break
            elif isinstance(incoming, Reply) and incoming.kind == "error":
                seen.setdefault("errors", 0)
                seen["errors"] = seen["errors"] + 1  # type: ignore[operator]
        seen["text"] = "".join(texts)
        done.set()
        await trio.sleep_forever()

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(
                lambda task_status: serve_websocket(
                    lambda request: _accept_then(request, fake_edge),
                    "127.0.0.1",
                    0,
                    ssl_context=None,
                    task_status=task_status,
                )
            )
            async with node.running():
                client = NodeLink(node, f"ws://127.0.0.1:{port.port}/node", backoff=FAST)
                nursery.start_soon(client.run)
                await done.wait()
                assert seen["text"] == "ok"
                assert seen["last"].kind == pb.EVENT_KIND_SUCCEEDED  # type: ignore[attr-defined]
                assert client.sessions == 1  # bad frames never cost the node its session
                nursery.cancel_scope.cancel()


async def _accept_then(request, handler) -> None:  # type: ignore[no-untyped-def]
    ws = await request.accept()
    await handler(ws)


@asynccontextmanager
async def node_dialling(edge_handler, settings: SessionSettings) -> AsyncIterator[NodeLink]:  # type: ignore[no-untyped-def]
    """A node (echo/a) dialling a WebSocket server that gives each connection to
    ``edge_handler`` and queues none of its messages (unread, they block its reader)."""
    node = echo_node(("a", 1))
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                lambda task_status: serve_websocket(
                    lambda request: _accept_then(request, edge_handler),
                    "127.0.0.1",
                    0,
                    ssl_context=None,
                    message_queue_size=0,
                    task_status=task_status,
                )
            )
            async with node.running():
                client = NodeLink(
                    node,
                    f"ws://127.0.0.1:{server.port}/node",
                    settings=settings,
                    backoff=FAST,
                    hello_timeout=60,
                )
                nursery.start_soon(client.run)
                yield client
                nursery.cancel_scope.cancel()


async def test_heartbeat_ends_a_session_whose_peer_stopped_answering():
    async def deaf_edge(ws) -> None:  # type: ignore[no-untyped-def]
        await trio.sleep_forever()  # never reads: with no queue, pings go unanswered

    settings = SessionSettings(ping_interval=0.1, ping_timeout=0.2)
    async with node_dialling(deaf_edge, settings) as client:
        await client.wait_attempts(1)
        assert "no pong" in client.last_error


class _Steps(trio.abc.Instrument):
    """Counts the steps of the tasks whose name contains ``word``."""

    def __init__(self, word: str) -> None:
        self.word = word
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.word in task.name:
            self.steps += 1


async def test_senders_waiting_for_room_go_in_order_one_wake_up_each():
    """A slow reader makes senders wait for the outbox; they go first come, first sent,
    and each frame written wakes one of them, not all (a thousand waiters must not
    cost a thousand wake-ups per frame, nor starve one of them)."""
    senders = 40
    near, far = trio.testing.lockstep_stream_pair()  # a write waits for the peer's read
    async with trio.open_nursery() as nursery:
        ws, peer = await websocket_pair(near, far, nursery)
        session = ProtoSession(
            ws, Role.RUNNER, settings=SessionSettings(ping_interval=0, send_buffer=1)
        )
        nursery.start_soon(session.run)
        await session.started.wait()

        async def sender(i: int) -> None:
            await session.reply(10_000 + i, "pong", pb.Pong(time=i))

        steps = _Steps("sender")
        trio.lowlevel.add_instrument(steps)
        try:
            for i in range(senders):  # one at a time, so their order of arrival is known
                nursery.start_soon(sender, i, name=f"sender-{i}")
                await trio.testing.wait_all_tasks_blocked()
            times = []
            for _ in range(senders):
                envelope = pb.Envelope.FromString(await peer.get_message())
                times.append(envelope.pong.time)
            await trio.testing.wait_all_tasks_blocked()
        finally:
            trio.lowlevel.remove_instrument(steps)
        assert times == list(range(senders))
        # a few steps each (start, wake-up, checkpoints); waking all waiters for every
        # frame would take about senders**2 / 2
        assert steps.steps <= 6 * senders
        nursery.cancel_scope.cancel()


async def test_a_peer_whose_pongs_are_late_but_whose_frames_arrive_is_kept():
    """Under load a pong can wait behind the peer's data; frames that keep coming
    prove the peer alive, and the session ends only once it goes silent."""
    talking = trio.Event()
    stop_talking = trio.Event()

    async def busy_edge(ws) -> None:  # type: ignore[no-untyped-def]
        # never reads (so never pongs), but keeps sending frames until told to stop
        conn: ProtoConnection[None] = ProtoConnection(Role.EDGE)
        talking.set()
        while not stop_talking.is_set():
            _, frame = conn.request("ping", pb.Ping(time=1))
            await ws.send_message(frame)
            await trio.sleep(0.02)
        await trio.sleep_forever()

    settings = SessionSettings(ping_interval=0.05, ping_timeout=0.5)
    async with node_dialling(busy_edge, settings) as client:
        await talking.wait()
        await trio.sleep(2.0)  # forty unanswered pings, four ping timeouts
        assert client.last_error == ""
        stop_talking.set()
        await client.wait_attempts(1)
        assert "no pong" in client.last_error


async def test_the_node_reconnects_when_the_edge_comes_back():
    node = echo_node(("a", 1))
    edge = Edge(token=TOKEN)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery, node.running():
            async with trio.open_nursery() as edge_nursery:
                port = await edge_nursery.start(edge.serve)
                client = NodeLink(node, edge.node_url, token=TOKEN, backoff=FAST)
                nursery.start_soon(client.run)
                await edge.wait_for_node("n1")
                edge_nursery.cancel_scope.cancel()  # the edge goes down
            edge2 = Edge(token=TOKEN)
            async with trio.open_nursery() as edge_nursery:
                await edge_nursery.start(edge2.serve, "127.0.0.1", port)
                handle = await edge2.wait_for_node("n1")
                async with handle.run(RunSpec("echo/a", "back again")) as stream:
                    assert (await stream.collect())[0] == "back again"
                assert client.sessions == 2
                edge_nursery.cancel_scope.cancel()
            nursery.cancel_scope.cancel()


def test_backoff_is_jittered_exponential_and_capped():
    backoff = Backoff(initial=0.5, maximum=8.0)
    rng = random.Random(1)
    for attempt in range(20):
        ceiling = min(8.0, 0.5 * 2**attempt)
        delays = [backoff.delay(attempt, rng) for _ in range(200)]
        assert all(0 <= d <= ceiling for d in delays)
        assert max(delays) > ceiling * 0.8  # spread over the range, not stuck low
    assert len({backoff.delay(3, rng) for _ in range(10)}) == 10


async def test_echo_is_available_without_the_counting_wrapper():
    # the plain echo adapter behind the edge (what `make run` serves)
    node = Node(
        node_id="n1",
        adapters=[EchoAdapter()],
        targets=[TargetSpec("echo", "m")],
        store=MemoryStore(),
    )
    async with stack(node) as s:
        async with s.edge.run(RunSpec("echo/m", "plain")) as stream:
            text, last = await stream.collect()
        assert (text, last.kind) == ("plain", EventKind.SUCCEEDED)


async def test_the_edge_says_who_a_run_is_for_whatever_the_caller_sent():
    node = echo_node(("a", 1))
    async with (
        stack(node, client_tenant="team-a") as s,
        open_runner(s.edge.client_url, token=TOKEN) as client,
    ):
        spec = RunSpec("echo/a", "mine", tenant="team-b", priority=2, queue_timeout=5)
        async with client.run(spec) as stream:
            await stream.collect()
        record = await node.store.get(stream.run_id)
        assert record is not None
        assert (record.tenant, record.priority) == ("team-a", 2)
        [listed] = await client.list_runs(RunQuery(tenant="team-a"))
        assert await client.list_runs(RunQuery(tenant="team-b")) == []
        assert (listed.tenant, listed.priority) == ("team-a", 2)
    with pytest.raises(ValueError, match="must be up to 128 characters"):
        Edge(token=TOKEN, client_tenant="no spaces")


async def test_a_ping_that_meets_a_closing_socket_is_an_end_not_a_failure():
    """trio-websocket answers a ping that comes while it closes with a pong wsproto may
    not send then (its issue #184): the node link and the server take that for the end
    it is, not a failure with a traceback."""
    from iop_trio.transport.server import closing_race

    near, far = trio.testing.memory_stream_pair()
    raised: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        try:
            async with trio.open_nursery() as inner:
                ws, peer = await websocket_pair(near, far, nursery, inner)
                inner.start_soon(peer.ping)  # the peer pings as we close (heartbeat)
                inner.start_soon(ws.aclose, 1011, "heartbeat timeout")
        except BaseException as exc:
            raised.append(exc)
        nursery.cancel_scope.cancel()
    assert len(raised) == 1 and closing_race(raised[0])
    assert not closing_race(ValueError("CLOSING"))
