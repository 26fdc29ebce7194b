"""Deterministic ordering tests of the gate and run manager (no sleeps, MockClock)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from iop_trio.adapters import Adapter, AdapterError
from iop_trio.adapters.echo import EchoAdapter, EchoSettings
from iop_trio.model import RunEvent
from iop_trio.runtime import (
    AdapterSlot,
    EventKind,
    InvalidRequest,
    Node,
    NodeUnavailable,
    RunSpec,
    RunState,
    RunStatus,
    RuntimeLimits,
    TargetSpec,
    TenantLimits,
    UnknownRun,
    UnknownTarget,
    Usage,
)
from iop_trio.runtime.live import EVENT_WINDOW
from iop_trio.store import StoreUnavailable
from iop_trio.store.memory import MemoryStore

from .support import ScriptedAdapter

A = "scripted/a"
B = "scripted/b"


def make_node(
    *,
    concurrency: int = 8,
    max_queued: int = 100,
    queue_timeout: float = 60.0,
    a_limit: int = 1,
    b_limit: int = 1,
    adapter_limit: int | None = None,
    max_concurrency: int | None = None,
    store: MemoryStore | None = None,
    final_write_timeout: float = 10.0,
) -> tuple[Node, ScriptedAdapter]:
    adapter = ScriptedAdapter(max_concurrency=max_concurrency)
    node = Node(
        node_id="test",
        adapters=[AdapterSlot(adapter, adapter_limit)],
        targets=[
            TargetSpec("scripted", "a", concurrency=a_limit),
            TargetSpec("scripted", "b", concurrency=b_limit),
        ],
        limits=RuntimeLimits(
            concurrency=concurrency,
            max_queued=max_queued,
            queue_timeout=queue_timeout,
            final_write_timeout=final_write_timeout,
        ),
        store=store or MemoryStore(),
    )
    return node, adapter


@pytest.fixture
async def node_and_adapter() -> AsyncIterator[tuple[Node, ScriptedAdapter]]:
    node, adapter = make_node()
    async with node.running():
        yield node, adapter


async def submit(node: Node, target: str = A, **kw: object) -> str:
    submitted = await node.manager.submit(RunSpec(target, "p", **kw))  # type: ignore[arg-type]
    await trio.testing.wait_all_tasks_blocked()
    return submitted.record.run_id


async def status(node: Node, run_id: str) -> RunStatus:
    record = await node.store.get(run_id)
    assert record is not None
    return record.status


async def kinds(node: Node, run_id: str) -> list[EventKind]:
    return [e.kind for e in await node.store.events(run_id)]


def borrowed(node: Node) -> tuple[int, int, int, int]:
    s = node.gate.statistics()
    return (
        s.targets[A].borrowed,
        s.targets[B].borrowed,
        s.adapters["scripted"].borrowed,
        s.global_.borrowed,
    )


async def test_queued_is_stored_before_the_ack(node_and_adapter):
    node, _ = node_and_adapter
    submitted = await node.manager.submit(RunSpec(A, "p"))
    # no wait: the record must already be in the store when submit returns
    stored = await node.store.get(submitted.record.run_id)
    assert stored is not None
    assert submitted.record.status is RunStatus.QUEUED
    assert (await node.store.events(submitted.record.run_id))[0].kind is EventKind.QUEUED


async def test_limit_1_second_run_queues_then_times_out(autojump_clock):
    node, adapter = make_node(queue_timeout=5.0)
    async with node.running():
        first = await submit(node)
        second = await submit(node)
        assert await status(node, first) is RunStatus.RUNNING
        assert await status(node, second) is RunStatus.QUEUED
        assert node.gate.queued == 1
        start = trio.current_time()
        await node.manager.watch(second).__anext__()  # the queued event
        async for event in node.manager.watch(second, after_seq=1):
            last = event
        assert trio.current_time() - start == pytest.approx(5.0)
        assert (last.kind, last.reason) == (EventKind.REJECTED, "queue_timeout")
        assert await status(node, second) is RunStatus.REJECTED
        assert await kinds(node, second) == [EventKind.QUEUED, EventKind.REJECTED]
        assert adapter.started == [first]
        assert node.gate.queued == 0
        assert borrowed(node) == (1, 0, 1, 1)


async def test_limit_1_second_run_starts_when_first_ends():
    node, adapter = make_node()
    async with node.running():
        runs = [await submit(node) for _ in range(3)]
        assert [await status(node, r) for r in runs] == [
            RunStatus.RUNNING,
            RunStatus.QUEUED,
            RunStatus.QUEUED,
        ]
        adapter.script(runs[0]).finish()
        await trio.testing.wait_all_tasks_blocked()
        assert [await status(node, r) for r in runs] == [
            RunStatus.SUCCEEDED,
            RunStatus.RUNNING,
            RunStatus.QUEUED,
        ]
        adapter.script(runs[1]).fail("boom")
        await trio.testing.wait_all_tasks_blocked()
        assert await status(node, runs[1]) is RunStatus.FAILED
        assert await status(node, runs[2]) is RunStatus.RUNNING
        assert adapter.started == runs  # FIFO
        record = await node.store.get(runs[1])
        assert record is not None
        assert (record.reason, record.message) == ("engine_error", "boom")


async def test_background_runs_take_the_same_gate(node_and_adapter):
    node, adapter = node_and_adapter
    fg = await submit(node)
    bg = await submit(node, background=True)
    assert await status(node, bg) is RunStatus.QUEUED
    adapter.script(fg).finish()
    await trio.testing.wait_all_tasks_blocked()
    assert await status(node, bg) is RunStatus.RUNNING
    fg2 = await submit(node)
    assert await status(node, fg2) is RunStatus.QUEUED
    assert borrowed(node) == (1, 0, 1, 1)


async def test_cancel_while_queued_never_starts(node_and_adapter):
    node, adapter = node_and_adapter
    first = await submit(node)
    second = await submit(node)
    outcome = await node.manager.cancel(second)
    assert (outcome.status, outcome.cancelled) == (RunStatus.CANCELLED, True)
    assert await kinds(node, second) == [EventKind.QUEUED, EventKind.CANCELLED]
    assert node.gate.queued == 0
    adapter.script(first).finish()
    await trio.testing.wait_all_tasks_blocked()
    assert adapter.started == [first]
    assert borrowed(node) == (0, 0, 0, 0)


async def test_cancel_while_running_closes_the_adapter_stream(node_and_adapter):
    node, adapter = node_and_adapter
    first = await submit(node)
    second = await submit(node)
    adapter.script(first).delta("partial")
    await trio.testing.wait_all_tasks_blocked()
    assert adapter.open_streams == [first]
    outcome = await node.manager.cancel(first, reason="user asked")
    assert (outcome.status, outcome.cancelled) == (RunStatus.CANCELLED, True)
    assert adapter.scripts[first].closed
    assert await kinds(node, first) == [
        EventKind.QUEUED,
        EventKind.STARTED,
        EventKind.DELTA,
        EventKind.CANCELLED,
    ]
    record = await node.store.get(first)
    assert record is not None and record.reason == "user asked"
    await trio.testing.wait_all_tasks_blocked()
    assert await status(node, second) is RunStatus.RUNNING  # the token went on
    assert borrowed(node) == (1, 0, 1, 1)


async def test_cancel_of_an_ended_or_unknown_run(node_and_adapter):
    node, adapter = node_and_adapter
    run = await submit(node)
    adapter.script(run).finish()
    await trio.testing.wait_all_tasks_blocked()
    outcome = await node.manager.cancel(run)
    assert (outcome.status, outcome.cancelled) == (RunStatus.SUCCEEDED, False)
    with pytest.raises(UnknownRun):
        await node.manager.cancel("nope")


async def test_queue_full_rejects_at_once():
    node, _adapter = make_node(max_queued=1)
    async with node.running():
        await submit(node)
        queued = await submit(node)
        full = await submit(node)
        assert await status(node, queued) is RunStatus.QUEUED
        record = await node.store.get(full)
        assert record is not None
        assert (record.status, record.reason) == (RunStatus.REJECTED, "queue_full")
        assert await kinds(node, full) == [EventKind.QUEUED, EventKind.REJECTED]
        # the queue bound is node-wide: a run of another target that must wait is refused too
        await submit(node, B)
        other = await submit(node, B)
        assert await status(node, other) is RunStatus.REJECTED


async def test_queue_full_says_which_bound_and_counts_what_refused_the_run():
    node, adapter = make_node(max_queued=2)
    async with node.running():
        running = await submit(node)
        waiting = [await submit(node), await submit(node)]
        full = await submit(node)
        record = await node.store.get(full)
        assert record is not None
        assert record.message == "the node's queue is full (max_queued 2, 2 waiting)"
        # a waiter leaves in the same instant the next run is refused: the count is the one
        # that refused it, not the one after
        async with trio.open_nursery() as nursery:
            nursery.start_soon(node.manager.cancel, waiting[0])
            nursery.start_soon(submit, node)
        refused = [r for r in await node.store.list_runs() if r.status is RunStatus.REJECTED]
        assert {r.message for r in refused} <= {
            "the node's queue is full (max_queued 2, 2 waiting)"
        }
        adapter.script(running).finish()

    target = TargetSpec("scripted", "t", concurrency=0, max_queued=1)
    own = Node(node_id="t", adapters=[ScriptedAdapter()], targets=[target], store=MemoryStore())
    async with own.running():
        await submit(own, "scripted/t")
        record = await own.store.get(await submit(own, "scripted/t"))
        assert record is not None
        assert record.message == "the queue of scripted/t is full (its max_queued 1, 1 waiting)"


async def test_queue_timeout_zero_rejects_at_once():
    node, _ = make_node(queue_timeout=0)
    async with node.running():
        await submit(node)
        second = await submit(node)
        record = await node.store.get(second)
        assert record is not None
        assert (record.status, record.reason) == (RunStatus.REJECTED, "queue_timeout")


async def test_a_full_target_does_not_block_another():
    node, _adapter = make_node(concurrency=2)
    async with node.running():
        a1 = await submit(node, A)
        a2 = await submit(node, A)
        b1 = await submit(node, B)
        assert [await status(node, r) for r in (a1, a2, b1)] == [
            RunStatus.RUNNING,
            RunStatus.QUEUED,
            RunStatus.RUNNING,
        ]
        assert borrowed(node) == (1, 1, 2, 2)


async def test_global_token_goes_to_the_oldest_eligible_run():
    node, adapter = make_node(concurrency=1, a_limit=2, b_limit=2)
    async with node.running():
        a1 = await submit(node, A)
        b1 = await submit(node, B)
        a2 = await submit(node, A)
        adapter.script(a1).finish()
        await trio.testing.wait_all_tasks_blocked()
        assert await status(node, b1) is RunStatus.RUNNING
        assert await status(node, a2) is RunStatus.QUEUED
        adapter.script(b1).finish()
        await trio.testing.wait_all_tasks_blocked()
        assert await status(node, a2) is RunStatus.RUNNING
        assert adapter.started == [a1, b1, a2]


async def test_adapter_limit_is_the_min_of_config_and_capability():
    node, _adapter = make_node(adapter_limit=3, max_concurrency=1, a_limit=5, b_limit=5)
    async with node.running():
        assert node.gate.adapter_limit("scripted") == 1
        first = await submit(node, A)
        second = await submit(node, B)
        assert await status(node, first) is RunStatus.RUNNING
        assert await status(node, second) is RunStatus.QUEUED
        # raising the configured limit cannot go past the capability
        assert node.set_limits(adapters={"scripted": 10}).adapters["scripted"] == 1
        await trio.testing.wait_all_tasks_blocked()
        assert await status(node, second) is RunStatus.QUEUED


async def test_raising_a_limit_admits_waiting_runs_at_once(node_and_adapter):
    node, _ = node_and_adapter
    runs = [await submit(node) for _ in range(3)]
    limits = node.set_limits(targets={A: 3})
    assert limits.targets[A] == 3
    await trio.testing.wait_all_tasks_blocked()
    assert [await status(node, r) for r in runs] == [RunStatus.RUNNING] * 3


async def test_lowering_a_limit_lets_holders_finish():
    node, adapter = make_node(a_limit=3)
    async with node.running():
        runs = [await submit(node) for _ in range(4)]
        node.set_limits(targets={A: 1})
        await trio.testing.wait_all_tasks_blocked()
        assert [await status(node, r) for r in runs[:3]] == [RunStatus.RUNNING] * 3
        adapter.script(runs[0]).finish()
        adapter.script(runs[1]).finish()
        await trio.testing.wait_all_tasks_blocked()
        assert await status(node, runs[3]) is RunStatus.QUEUED  # 1 still holds, limit 1
        adapter.script(runs[2]).finish()
        await trio.testing.wait_all_tasks_blocked()
        assert await status(node, runs[3]) is RunStatus.RUNNING


async def test_limit_zero_pauses_a_target(node_and_adapter):
    node, _ = node_and_adapter
    node.set_limits(targets={A: 0})
    run = await submit(node)
    assert await status(node, run) is RunStatus.QUEUED
    node.set_limits(targets={A: 1})
    await trio.testing.wait_all_tasks_blocked()
    assert await status(node, run) is RunStatus.RUNNING


async def test_set_limits_checks_everything_first(node_and_adapter):
    node, _ = node_and_adapter
    before = node.limits()
    with pytest.raises(InvalidRequest, match="target 'nope/x'"):
        node.set_limits(concurrency=1, targets={"nope/x": 1})
    with pytest.raises(InvalidRequest, match="must be an integer"):
        node.set_limits(concurrency=2, targets={A: -1})
    with pytest.raises(InvalidRequest, match="not True"):  # a bool is not a limit
        node.set_limits(concurrency=True)
    with pytest.raises(InvalidRequest, match="tenant 'x' max_queued"):
        node.set_limits(concurrency=2, tenants={"x": TenantLimits(max_queued=-1)})
    with pytest.raises(InvalidRequest, match="must be up to 128 characters"):
        node.set_limits(concurrency=2, tenants={"a b": TenantLimits()})
    assert node.limits() == before


async def test_unknown_target_and_bad_run_id_create_nothing(node_and_adapter):
    node, _ = node_and_adapter
    with pytest.raises(UnknownTarget, match="nope/x"):
        await node.manager.submit(RunSpec("nope/x", "p"))
    with pytest.raises(InvalidRequest, match="run_id"):
        await node.manager.submit(RunSpec(A, "p", run_id="bad id!"))
    for bad, match in [
        ({"tenant": "two words"}, "must be up to 128 characters"),
        ({"tenant": "x" * 129}, "must be up to 128 characters"),
        ({"priority": 1001}, "priority must be an integer from -1000 to 1000"),
        ({"priority": True}, "priority must be an integer"),
        ({"queue_timeout": -1.0}, "queue_timeout must be a number >= 0"),
        ({"queue_timeout": float("nan")}, "queue_timeout must be a number >= 0"),
        ({"queue_timeout": float("inf")}, "queue_timeout must be finite"),
    ]:
        with pytest.raises(InvalidRequest, match=match):
            await node.manager.submit(RunSpec(A, "p", **bad))  # type: ignore[arg-type]
    assert await node.store.list_runs() == []


async def test_a_known_run_id_returns_that_run(node_and_adapter):
    node, _adapter = node_and_adapter
    first = await node.manager.submit(RunSpec(A, "p", run_id="job-1"))
    again = await node.manager.submit(RunSpec(A, "other", run_id="job-1"))
    assert (first.existing, again.existing) == (False, True)
    assert again.record.run_id == "job-1"
    assert len(await node.store.list_runs()) == 1


async def test_abandon_cancels_foreground_runs_only(node_and_adapter):
    node, _adapter = node_and_adapter
    fg = (await node.manager.submit(RunSpec(A, "p"), owner="s1")).record.run_id
    bg = (await node.manager.submit(RunSpec(B, "p", background=True), owner="s1")).record.run_id
    other = (await node.manager.submit(RunSpec(B, "p"), owner="s2")).record.run_id
    await trio.testing.wait_all_tasks_blocked()
    assert node.manager.abandon("s1") == [fg]
    await trio.testing.wait_all_tasks_blocked()
    record = await node.store.get(fg)
    assert record is not None
    assert (record.status, record.reason) == (RunStatus.CANCELLED, "session_lost")
    assert await status(node, bg) is RunStatus.RUNNING
    assert await status(node, other) is RunStatus.QUEUED


async def test_node_exit_cancels_live_runs_and_records_it():
    store = MemoryStore()
    node, adapter = make_node(store=store)
    async with node.running():
        running = await submit(node)
        queued = await submit(node)
    for run_id in (running, queued):
        record = await store.get(run_id)
        assert record is not None
        assert (record.status, record.reason) == (RunStatus.CANCELLED, "node_shutdown")
    assert adapter.open_streams == []
    assert borrowed(node) == (0, 0, 0, 0)


async def test_an_exception_in_the_body_propagates_as_itself():
    node, _ = make_node()
    with pytest.raises(ZeroDivisionError):
        async with node.running():
            await submit(node)
            1 / 0  # noqa: B018


async def test_start_marks_unfinished_runs_interrupted():
    store = MemoryStore()
    left: dict[str, RunStatus] = {}
    for run_id, started in (("was-queued", False), ("was-running", True)):
        state, first = RunState.create(run_id=run_id, target=A, background=True, time=1.0)
        await store.create(state.record, first)
        if started:
            await store.append(state.transition(RunStatus.RUNNING, time=2.0))
        left[run_id] = state.status
    node, _ = make_node(store=store)
    async with node.running():
        for run_id in left:
            record = await store.get(run_id)
            assert record is not None
            assert (record.status, record.reason) == (RunStatus.INTERRUPTED, "node_restart")
            assert (await kinds(node, run_id))[-1] is EventKind.INTERRUPTED
    assert left == {"was-queued": RunStatus.QUEUED, "was-running": RunStatus.RUNNING}


class SlowFinalStore(MemoryStore):
    """A store whose terminal writes take ``delay`` seconds (or forever)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    async def append(self, event):  # type: ignore[no-untyped-def]
        self.append_nowait(event)
        if event.kind.terminal:
            await trio.sleep(self.delay)


async def test_final_status_is_written_shielded(autojump_clock):
    store = SlowFinalStore(delay=3.0)
    node, _adapter = make_node(store=store)
    async with node.running():
        run = await submit(node)
        with trio.move_on_after(1.0):
            # the canceller gives up waiting; the write must go on regardless
            await node.manager.cancel(run)
        await node.manager.wait_idle()
        assert await status(node, run) is RunStatus.CANCELLED


async def test_final_write_is_bounded(autojump_clock):
    store = SlowFinalStore(delay=float("inf"))
    node, _adapter = make_node(store=store, final_write_timeout=2.0)
    async with node.running():
        run = await submit(node)
        start = trio.current_time()
        await node.manager.cancel(run)
        assert trio.current_time() - start == pytest.approx(2.0)
        # the run is known until the store says its writes are done (at once here)
        await trio.testing.wait_all_tasks_blocked()
        assert node.manager.live_count() == 0
        assert borrowed(node) == (0, 0, 0, 0)


class FailingCreateStore(MemoryStore):
    async def create(self, record, event, *, then=()):  # type: ignore[no-untyped-def]
        await trio.lowlevel.checkpoint()
        raise OSError("disk full")


async def test_a_run_the_store_refuses_is_not_acknowledged():
    node, adapter = make_node(store=FailingCreateStore())
    async with node.running():
        with pytest.raises(OSError, match="disk full"):
            await node.manager.submit(RunSpec(A, "p"))
        assert node.manager.live_count() == 0
        await trio.testing.wait_all_tasks_blocked()
        # its engine was asked as its write went to the store (issue 23), and its stream
        # was closed as the write failed: nothing of it is published or stored
        assert len(adapter.started) == 1 and adapter.open_streams == []
        assert await node.store.get(adapter.started[0]) is None
        # the permit it took to start at once is given back
        assert borrowed(node) == (0, 0, 0, 0)


class HeldCreates(MemoryStore):
    """A create of a run named in ``held`` waits until its event is set."""

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, trio.Event] = {}

    async def create(self, record, event, *, then=()):  # type: ignore[no-untyped-def]
        if record.run_id in self.held:
            await self.held[record.run_id].wait()
        await super().create(record, event, then=then)


async def test_runs_enter_the_gate_in_the_order_they_came_whatever_order_their_writes_end():
    """Two runs are being stored QUEUED while the target is full. Room frees up; a third
    run comes, which could start at once, and the later write of the two ends first. The
    third and the later wait for the earlier one, which gets the room; then in order."""
    store = HeldCreates()
    node, adapter = make_node(store=store)
    async with node.running(), trio.open_nursery() as nursery:
        await submit(node, A, run_id="busy")
        store.held = {"early": trio.Event(), "late": trio.Event()}
        for name in store.held:
            nursery.start_soon(partial(submit, node, A, run_id=name))
            await trio.testing.wait_all_tasks_blocked()
        adapter.script("busy").finish()
        await trio.testing.wait_all_tasks_blocked()
        assert borrowed(node) == (0, 0, 0, 0)  # the room is free
        nursery.start_soon(partial(submit, node, A, run_id="third"))
        store.held["late"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert adapter.started == ["busy"]  # both stored, and waiting for "early"
        store.held["early"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert adapter.started == ["busy", "early"]
        assert node.gate.statistics().queued == 2
        for run in ("early", "late", "third"):
            assert adapter.started[-1] == run
            adapter.script(run).finish()
            await trio.testing.wait_all_tasks_blocked()
    assert adapter.started == ["busy", "early", "late", "third"]
    assert {await status(node, r) for r in ("early", "late", "third")} == {RunStatus.SUCCEEDED}


@pytest.mark.parametrize("room", [False, True])
async def test_a_run_cancelled_while_it_is_stored_never_starts(room):
    """Cancelled while its first write is made: without room it never waits in the gate,
    with room (it took a permit and writes STARTED too, and its engine is asked while
    that write commits) its engine stream is closed, and the permit goes back. Either
    way it ends CANCELLED with the reason given."""
    store = HeldCreates()
    node, adapter = make_node(store=store)
    async with node.running(), trio.open_nursery() as nursery:
        if not room:
            await submit(node, A, run_id="busy")
        store.held = {"x": trio.Event()}
        nursery.start_soon(partial(submit, node, A, run_id="x"))
        await trio.testing.wait_all_tasks_blocked()
        assert node.manager.cancel_nowait("x", "changed my mind")
        store.held["x"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert node.gate.statistics().queued == 0
        expected = [EventKind.QUEUED, EventKind.CANCELLED]
        if room:
            expected.insert(1, EventKind.STARTED)
            assert borrowed(node) == (0, 0, 0, 0)
        assert await kinds(node, "x") == expected
        record = await node.store.get("x")
        assert record is not None and record.reason == "changed my mind"
        if room:
            # its engine was asked as its write went to the store (issue 23); the cancel
            # closed its stream, and nothing it streamed was published or stored
            assert adapter.started == ["x"] and adapter.open_streams == []
        else:
            assert "x" not in adapter.started
        if not room:
            adapter.script("busy").finish()
            await trio.testing.wait_all_tasks_blocked()


async def test_draining_lets_running_runs_finish_and_cancels_the_rest(autojump_clock):
    node, adapter = make_node()
    async with node.running():
        quick = await submit(node, A)
        slow = await submit(node, B)
        queued = await submit(node, A)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(node.manager.drain, 5.0)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(NodeUnavailable):
                await node.manager.submit(RunSpec(A, "p"))
            # the queued run is cancelled at once; the running ones may finish
            assert await status(node, queued) is RunStatus.CANCELLED
            await trio.sleep(1.0)
            adapter.script(quick).finish()
        assert trio.current_time() == pytest.approx(5.0)
        assert await status(node, quick) is RunStatus.SUCCEEDED
        record = await node.store.get(slow)
        assert record is not None
        assert (record.status, record.reason) == (RunStatus.CANCELLED, "node_draining")
        assert adapter.open_streams == []


async def test_watch_follows_a_live_run_and_replays_an_ended_one(node_and_adapter):
    node, adapter = node_and_adapter
    run = await submit(node)
    seen: list[str] = []

    async def follow() -> None:
        async for event in node.manager.watch(run):
            seen.append(event.text or event.kind.value)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(follow)
        await trio.testing.wait_all_tasks_blocked()
        # one at a time: what comes while a run is busy becomes one delta
        adapter.script(run).delta("x")
        await trio.testing.wait_all_tasks_blocked()
        adapter.script(run).delta("y")
        await trio.testing.wait_all_tasks_blocked()
        adapter.script(run).finish()
    assert seen == ["queued", "started", "x", "y", "succeeded"]
    replay = [e.seq async for e in node.manager.watch(run, after_seq=3)]
    assert replay == [4, 5]


class BrokenAdapter(ScriptedAdapter):
    def open_stream(self, request):  # type: ignore[no-untyped-def]
        raise RuntimeError("bug in adapter")


async def test_a_buggy_adapter_fails_its_run_and_the_node_goes_on():
    adapter = BrokenAdapter(name="broken")
    echo = EchoAdapter()
    node = Node(
        node_id="t",
        adapters=[adapter, echo],
        targets=[TargetSpec("broken", "m"), TargetSpec("echo", "m")],
        store=MemoryStore(),
    )
    async with node.running():
        bad = (await node.manager.submit(RunSpec("broken/m", "p"))).record.run_id
        good = (await node.manager.submit(RunSpec("echo/m", "hello world"))).record.run_id
        await node.manager.wait_idle()
        bad_record = await node.store.get(bad)
        assert bad_record is not None
        assert (bad_record.status, bad_record.reason) == (RunStatus.FAILED, "internal")
        assert "bug in adapter" in bad_record.message
        assert await status(node, good) is RunStatus.SUCCEEDED


async def test_echo_streams_words_and_can_fail(autojump_clock):
    echo = EchoAdapter(settings=EchoSettings(delay=0.5))
    node = Node(
        node_id="t",
        adapters=[echo],
        targets=[TargetSpec("echo", "m", concurrency=4)],
        store=MemoryStore(),
    )
    async with node.running():
        ok = (await node.manager.submit(RunSpec("echo/m", "one two  three"))).record.run_id
        bad = (
            await node.manager.submit(
                RunSpec("echo/m", "a b c", options={"fail_after": 2, "fail_message": "nope"})
            )
        ).record.run_id
        start = trio.current_time()
        await node.manager.wait_idle()
        assert trio.current_time() - start == pytest.approx(1.5)
        texts = [e.text for e in await node.store.events(ok) if e.kind is EventKind.DELTA]
        assert texts == ["one ", "two  ", "three"]
        events = await node.store.events(bad)
        assert [e.text for e in events if e.kind is EventKind.DELTA] == ["a ", "b "]
        assert (events[-1].kind, events[-1].reason, events[-1].message) == (
            EventKind.FAILED,
            "engine_error",
            "nope",
        )
        assert echo.active == 0
        assert echo.opened == 2


def test_bad_node_config_is_refused():
    with pytest.raises(ValueError, match="adapter 'nope'"):
        Node(
            node_id="t",
            adapters=[EchoAdapter()],
            targets=[TargetSpec("nope", "m")],
            store=MemoryStore(),
        )
    with pytest.raises(ValueError, match="configured twice"):
        Node(
            node_id="t",
            adapters=[EchoAdapter()],
            targets=[TargetSpec("echo", "m"), TargetSpec("echo", "m")],
            store=MemoryStore(),
        )
    with pytest.raises(ValueError, match="concurrency"):
        Node(
            node_id="t",
            adapters=[EchoAdapter()],
            targets=[TargetSpec("echo", "m", concurrency=-1)],
            store=MemoryStore(),
        )


def test_adapter_error_repr():
    assert repr(AdapterError("timeout", "slow")) == "AdapterError('timeout', 'slow')"


async def test_run_options_merge_into_profile_params_one_level_deep():
    from iop_trio.model import overlay

    profile = {"options": {"num_ctx": 8192, "temperature": 0.7}, "keep_alive": "5m"}
    run = {"options": {"temperature": 0.0}, "seed": 1}
    assert overlay(profile, run) == {
        "options": {"num_ctx": 8192, "temperature": 0.0},
        "keep_alive": "5m",
        "seed": 1,
    }
    assert profile["options"] == {"num_ctx": 8192, "temperature": 0.7}  # not mutated


class ChattyAdapter(ScriptedAdapter):
    """Sends a delta after its Completion: the runtime must ignore it."""

    def open_stream(self, request):  # type: ignore[no-untyped-def]
        from contextlib import asynccontextmanager

        from iop_trio.adapters import Completion, Delta, Usage

        @asynccontextmanager
        async def stream():  # type: ignore[no-untyped-def]
            async def chunks():  # type: ignore[no-untyped-def]
                yield Delta("a")
                yield Completion(Usage("stop", 1, 1))
                yield Delta("late")
                yield Completion(Usage("length", 9, 9))

            yield chunks()

        return stream()


async def test_the_first_completion_ends_the_run():
    node = Node(
        node_id="t",
        adapters=[ChattyAdapter(name="c")],
        targets=[TargetSpec("c", "m")],
        store=MemoryStore(),
    )
    async with node.running():
        run_id = (await node.manager.submit(RunSpec("c/m", "p"))).record.run_id
        await node.manager.wait_idle()
        events = await node.store.events(run_id)
        assert [e.text for e in events if e.kind is EventKind.DELTA] == ["a"]
        assert events[-1].usage is not None and events[-1].usage.done_reason == "stop"


async def test_a_node_can_run_again_after_it_stopped():
    node, _adapter = make_node()
    async with node.running():
        first = await submit(node)
    async with node.running():
        second = await submit(node)
        assert await status(node, second) is RunStatus.RUNNING
    assert await status(node, first) is RunStatus.CANCELLED


# --- a run's bounds: time, output, prompt, memory ---------------------------------------------


def bounded_node(adapter: Adapter, **bounds: Any) -> Node:
    """One target ``<adapter>/m`` at concurrency 1 with the given run bounds."""
    target = TargetSpec(adapter.name, "m", **bounds)
    limits = RuntimeLimits(queue_timeout=600)
    return Node(
        node_id="b", adapters=[adapter], targets=[target], limits=limits, store=MemoryStore()
    )


async def test_max_run_time_counts_from_the_start_and_closes_the_engine_stream(autojump_clock):
    adapter = ScriptedAdapter()
    node = bounded_node(adapter, max_run_time=5)
    target = "scripted/m"
    async with node.running():
        first = await submit(node, target)
        queued = await submit(node, target)
        await trio.sleep(3)
        adapter.script(first).finish()
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(4)  # queued 3 s and running 4 s: inside the bound
        adapter.script(queued).finish()
        late = await submit(node, target)
        await trio.sleep(5.5)
        assert adapter.open_streams == []  # the deadline closed the engine stream
    records = {r: await node.store.get(r) for r in (first, queued, late)}
    assert [(r.status, r.reason) for r in records.values() if r] == [
        (RunStatus.SUCCEEDED, ""),
        (RunStatus.SUCCEEDED, ""),
        (RunStatus.FAILED, "run_timeout"),
    ]
    assert records[late].message == "the run did not finish within 5s (max_run_time of scripted/m)"  # type: ignore[union-attr]


async def test_output_over_max_output_bytes_fails_the_run_and_stops_the_engine():
    echo = EchoAdapter()
    node = bounded_node(echo, max_output_bytes=10)
    async with node.running():
        run = await submit_text(node, "echo/m", "aaaa bbbb cccc dddd")
        await node.manager.wait_idle()
    record = await node.store.get(run)
    assert record is not None
    assert (record.status, record.reason) == (RunStatus.FAILED, "output_limit")
    assert "passed 10 bytes (max_output_bytes of echo/m)" in record.message
    texts = [e.text for e in await node.store.events(run) if e.kind is EventKind.DELTA]
    # 10 bytes (in one delta or two: what came at once is joined); the third would pass
    assert "".join(texts) == "aaaa bbbb "
    assert echo.active == 0


async def test_a_prompt_over_max_prompt_bytes_is_refused_before_any_run_exists():
    node = bounded_node(EchoAdapter(), max_prompt_bytes=8)
    async with node.running():
        with pytest.raises(InvalidRequest, match="10 bytes, over the 8"):
            await node.manager.submit(RunSpec("echo/m", "ééééé"))  # 5 characters, 10 bytes
        with pytest.raises(InvalidRequest, match="9 bytes"):
            await node.manager.submit(RunSpec("echo/m", messages=(("user", "hello"),)))
        assert await node.store.list_runs() == []
        ok = await submit_text(node, "echo/m", "éééé")  # 8 bytes: at the bound
        await node.manager.wait_idle()
        assert (await status(node, ok)) is RunStatus.SUCCEEDED


async def test_node_bounds_apply_to_targets_that_set_none():
    node = Node(
        node_id="d",
        adapters=[EchoAdapter()],
        targets=[TargetSpec("echo", "own", max_run_time=7), TargetSpec("echo", "default")],
        limits=RuntimeLimits(max_run_time=60, max_output_bytes=None),
        store=MemoryStore(),
    )
    own, default = node.targets["echo/own"], node.targets["echo/default"]
    assert (own.max_run_time, default.max_run_time) == (7, 60)
    assert default.max_output_bytes is None
    assert default.max_prompt_bytes == RuntimeLimits().max_prompt_bytes


async def test_a_long_run_keeps_a_window_and_a_late_watcher_reads_the_store():
    adapter = ScriptedAdapter()
    node = bounded_node(adapter)
    count = EVENT_WINDOW * 3
    async with node.running():
        run = await submit(node, "scripted/m")
        script = adapter.script(run)
        for i in range(count):
            script.delta(f"{i} ")
            await trio.testing.wait_all_tasks_blocked()  # one delta each: none joined
        live = node.manager.runs.get(run)
        assert live is not None
        assert len(live.events) == EVENT_WINDOW  # memory does not grow with the output
        assert live.events[-1].seq == count + 2
        # a watcher from the start: the store has what left the window, in order, no gap
        seen = []
        watcher = node.manager.watch(run)
        for _ in range(count + 2):
            seen.append(await watcher.__anext__())
        assert [e.seq for e in seen] == list(range(1, count + 3))
        assert "".join(e.text for e in seen) == "".join(f"{i} " for i in range(count))
        page = await node.manager.events(run, after_seq=0, limit=3)
        assert [e.seq for e in page] == [1, 2, 3]
        tail = await node.manager.events(run, after_seq=count, limit=9)
        assert [e.seq for e in tail] == [count + 1, count + 2]
        script.finish()
        assert (await watcher.__anext__()).kind is EventKind.SUCCEEDED
        with pytest.raises(StopAsyncIteration):
            await watcher.__anext__()


async def submit_text(node: Node, target: str, text: str) -> str:
    return (await node.manager.submit(RunSpec(target, text))).record.run_id


async def test_a_waiting_run_is_data_its_task_starts_when_it_is_admitted(autojump_clock):
    """Queued runs hold no task of their own (issue 12: memory per queued run); they are
    admitted in order as room comes, and their deadlines and cancels still hold."""
    node, adapter = make_node(a_limit=1, queue_timeout=30)
    async with node.running():
        nursery = node.manager._nursery
        first = await submit(node)  # runs, holding the one permit of A
        tasks = len(nursery.child_tasks)
        queued = [await submit(node) for _ in range(50)]
        assert len(nursery.child_tasks) == tasks  # fifty waiting runs, no task more
        assert node.gate.statistics().queued == 50
        # a cancel while it waits: it never starts, and its end is recorded
        outcome = await node.manager.cancel(queued[0])
        assert (outcome.status, outcome.cancelled) == (RunStatus.CANCELLED, True)
        assert await kinds(node, queued[0]) == [EventKind.QUEUED, EventKind.CANCELLED]
        # room comes: the oldest waiting run gets its task and starts
        adapter.script(first).finish()
        await trio.testing.wait_all_tasks_blocked()
        assert adapter.started == [first, queued[1]]
        assert await status(node, queued[1]) is RunStatus.RUNNING
        # the deadline ends the others, each REJECTED(queue_timeout) with a hint
        await trio.sleep(31)
        await trio.testing.wait_all_tasks_blocked()
        for run_id in queued[2:]:
            record = await node.store.get(run_id)
            assert record is not None
            assert (record.status, record.reason) == (RunStatus.REJECTED, "queue_timeout")
            assert record.retry_after is not None
        assert node.gate.statistics().queued == 0
        assert adapter.started == [first, queued[1]]


class HeldDurable(MemoryStore):
    """Takes each event at once, but tells ``on_durable`` only when released: a STARTED
    whose commit is on its way."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[Callable[[], None]] = []

    def append_nowait(
        self, event: RunEvent, *, on_durable: Callable[[], None] | None = None
    ) -> None:
        super().append_nowait(event)
        if on_durable is not None:
            self.held.append(on_durable)

    def release(self) -> None:
        held, self.held = self.held, []
        for on_durable in held:
            on_durable()


async def test_a_run_cancelled_while_its_started_is_being_stored_keeps_a_whole_log():
    """A run let in from the queue hands STARTED to the store and streams meanwhile; its
    first delta waits for STARTED to be durable. Cancelled then, the delta (its seq is
    taken) is stored all the same, so the CANCELLED after it is not refused for a gap
    (a flood of cancels left runs RUNNING in the store that their callers saw end)."""
    store = HeldDurable()
    node, adapter = make_node(store=store, a_limit=1)
    async with node.running():
        first = await submit(node)
        second = await submit(node)  # waits for the one permit of A
        adapter.script(first).finish()
        await trio.testing.wait_all_tasks_blocked()
        assert adapter.started == [first, second]
        assert len(store.held) == 1  # the second's STARTED, not yet durable
        adapter.script(second).delta("tok")
        await trio.testing.wait_all_tasks_blocked()  # its delta waits for STARTED
        node.manager.cancel_nowait(second, "client_lost")
        await trio.testing.wait_all_tasks_blocked()
        store.release()
        await node.manager.wait_idle()
        assert await kinds(node, second) == [
            EventKind.QUEUED,
            EventKind.STARTED,
            EventKind.DELTA,
            EventKind.CANCELLED,
        ]
        record = await node.store.get(second)
        assert record is not None
        assert (record.status, record.reason) == (RunStatus.CANCELLED, "client_lost")
        assert [e.seq for e in await node.manager.events(second)] == [1, 2, 3, 4]


class CommitsIn(MemoryStore):
    """A create takes ``seconds`` (the writer's attempt at it: a cancel waits for it), or
    never ends (its caller may give up on it: nothing is stored)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    async def create(self, record, event, *, then=()):  # type: ignore[no-untyped-def]
        if self.seconds == math.inf:
            await trio.sleep_forever()
        with trio.CancelScope(shield=True):
            await trio.sleep(self.seconds)
            await super().create(record, event, then=then)


@pytest.mark.parametrize("room", [True, False])
async def test_a_run_not_stored_within_its_create_timeout_is_refused_and_forgotten(
    autojump_clock, room
):
    store = CommitsIn(0.0)
    node, adapter = make_node(store=store)
    async with node.running():
        if not room:
            busy = await submit(node)  # A's one permit
        store.seconds = math.inf
        start = trio.current_time()
        with pytest.raises(StoreUnavailable, match=r"did not store the run within 3s"):
            await node.manager.submit(RunSpec(A, "p", run_id="r1"), create_timeout=3.0)
        assert trio.current_time() - start == pytest.approx(3.0)
        assert await node.store.get("r1") is None
        assert node.manager.live_count() == (0 if room else 1)
        # with room its engine was asked meanwhile: that task gives the permit back as
        # its stream closes
        await trio.testing.wait_all_tasks_blocked()
        assert borrowed(node) == ((0, 0, 0, 0) if room else (1, 0, 1, 1))
        store.seconds = 0.0
        if not room:
            adapter.script(busy).finish()
        again = await submit(node, run_id="r1")  # the line of runs being stored moved on
        assert adapter.started[-1] == again


async def test_a_run_committed_as_its_create_timeout_passes_is_created(autojump_clock):
    """The bound passes while the store is committing the run (a short attempt): the
    caller waits for it, and the run exists."""
    node, adapter = make_node(store=CommitsIn(5.0))
    async with node.running():
        submitted = await node.manager.submit(RunSpec(A, "p"), create_timeout=1.0)
        assert trio.current_time() == pytest.approx(5.0)
        assert await node.store.get(submitted.record.run_id) is not None
        await trio.testing.wait_all_tasks_blocked()
        assert adapter.started == [submitted.record.run_id]


# --- usage: every end of a run that started carries it ----------------------------------------


def counted(prompt: int, completion: int) -> Usage:
    """A usage the node counted (its engine reported none)."""
    return Usage("", prompt, completion, prompt_estimated=True, completion_estimated=True)


async def test_every_end_of_a_run_that_started_carries_its_usage_and_no_other_does():
    """A run that started ends with its tokens whatever ends it: the engine's where it
    reported them, else its deltas' engine tokens and its prompt estimated (marked so);
    a run that never started (cancelled or rejected in the queue) carries none."""
    node, adapter = make_node(a_limit=3)
    async with node.running():
        done = await submit(node)
        cancelled = await submit(node)
        failed = await submit(node)
        rejected = await submit(node, queue_timeout=0)  # no room, no wait: rejected at once
        waited = await submit(node)  # waits for room, and is cancelled while it waits
        for run_id in (done, cancelled, failed):
            adapter.script(run_id).delta("one ")
            adapter.script(run_id).delta("two ")
        await trio.testing.wait_all_tasks_blocked()
        await node.manager.cancel(waited)
        adapter.script(done).finish()  # the script reports no counts: Usage("stop")
        await node.manager.cancel(cancelled)
        adapter.script(failed).fail()
        await node.manager.wait_idle()
    runs = (done, cancelled, failed, rejected, waited)
    ends = {r: (await node.store.events(r))[-1] for r in runs}
    assert {r: (e.kind, e.usage) for r, e in ends.items()} == {
        done: (EventKind.SUCCEEDED, attrs.evolve(counted(1, 2), done_reason="stop")),
        cancelled: (EventKind.CANCELLED, counted(1, 2)),
        failed: (EventKind.FAILED, counted(1, 2)),
        rejected: (EventKind.REJECTED, None),
        waited: (EventKind.CANCELLED, None),
    }
    for run_id, end in ends.items():  # the record holds what its end holds
        record = await node.store.get(run_id)
        assert record is not None and record.usage == end.usage


async def test_a_count_the_engine_reports_is_kept_exactly():
    echo = EchoAdapter()  # reports its words, in and out
    node = bounded_node(echo)
    async with node.running():
        run = await submit_text(node, "echo/m", "one two three")
        await node.manager.wait_idle()
    record = await node.store.get(run)
    assert record is not None and record.usage == Usage("stop", 3, 3)
    assert not record.usage.estimated


async def test_a_delta_holds_the_tokens_of_the_chunks_it_joins():
    """However the run joins the chunks that came while it was busy, its deltas' tokens
    add up to the engine's chunks, and so does its counted completion."""
    node, adapter = make_node()
    async with node.running():
        run = await submit(node)
        script = adapter.script(run)
        for word in ("a", "b", "c", "d", "e"):
            script.delta(word)  # all there before the run wakes: joined as it can
        await trio.testing.wait_all_tasks_blocked()
        await node.manager.cancel(run)
    events = await node.store.events(run)
    deltas = [e for e in events if e.kind is EventKind.DELTA]
    assert "".join(e.text for e in deltas) == "abcde"
    assert [len(e.text) for e in deltas] == [e.tokens for e in deltas]
    assert events[-1].usage == counted(1, 5)


async def test_output_past_max_output_bytes_is_not_counted():
    echo = EchoAdapter()
    node = bounded_node(echo, max_output_bytes=10)
    async with node.running():
        run = await submit_text(node, "echo/m", "aaaa bbbb cccc dddd")
        await node.manager.wait_idle()
    record = await node.store.get(run)
    assert record is not None and record.reason == "output_limit"
    # the two words stored and sent; the third, which passed the bound, was neither
    assert record.usage == counted(5, 2)  # ceil(19 / 4)


async def test_a_prompt_is_estimated_with_the_nodes_chars_per_token():
    adapter = ScriptedAdapter()
    node = Node(
        node_id="t",
        adapters=[adapter],
        targets=[TargetSpec("scripted", "m")],
        limits=RuntimeLimits(chars_per_token=2),
        store=MemoryStore(),
    )
    async with node.running():
        run = (
            await node.manager.submit(RunSpec("scripted/m", messages=(("user", "héllo"),)))
        ).record.run_id
        await trio.testing.wait_all_tasks_blocked()
        await node.manager.cancel(run)
    record = await node.store.get(run)
    assert record is not None and record.usage == counted(5, 0)  # ceil((4 + 6) / 2)
    with pytest.raises(ValueError, match="chars_per_token: must be a number > 0"):
        RuntimeLimits(chars_per_token=0)


async def test_a_run_found_running_at_start_is_settled_with_the_nodes_chars_per_token():
    store = MemoryStore()
    state, first = RunState.create(run_id="r", target=A, background=True, time=1.0, prompt="abcd")
    await store.create(state.record, first)
    await store.append(state.transition(RunStatus.RUNNING, time=2.0))
    await store.append(state.delta("x y", time=3.0, tokens=2))
    node = Node(
        node_id="t",
        adapters=[ScriptedAdapter()],
        targets=[TargetSpec("scripted", "a")],
        limits=RuntimeLimits(chars_per_token=1),
        store=store,
    )
    async with node.running():
        pass
    record = await store.get("r")
    assert record is not None
    assert (record.status, record.usage) == (RunStatus.INTERRUPTED, counted(4, 2))
