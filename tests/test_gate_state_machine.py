"""Hypothesis state machine over the node runtime: the gate's invariants after every step.

Trio runs in a helper thread (``trio.run`` with a MockClock that only moves
when a rule jumps it); each rule calls into it with ``trio.from_thread.run``
and returns only when every task in the node is blocked, so every check sees
a quiescent node. hypothesis-trio does not work with current Hypothesis.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from iop_trio.runtime import (
    AdapterSlot,
    EventKind,
    Node,
    RunEvent,
    RunRecord,
    RunSpec,
    RunStatus,
    RuntimeLimits,
    TargetSpec,
)
from iop_trio.store.memory import MemoryStore

from .support import ScriptedAdapter

T = TypeVar("T")

GLOBAL_LIMIT = 3
MAX_QUEUED = 4
QUEUE_TIMEOUT = 5.0
TARGETS = [
    # (adapter, model, limit, max_queued, queue_timeout)
    ("x", "a", 1, None, None),
    ("x", "b", 2, 2, None),
    ("y", "c", 2, None, 2.0),
]
ADAPTERS = [("x", None, None), ("y", 3, 1)]  # (name, configured limit, capability)
TARGET_NAMES = [f"{a}/{m}" for a, m, *_ in TARGETS]


class TrioHost:
    """A trio.run in a thread, with a MockClock, that runs coroutines for the test thread."""

    def __init__(self, main: Callable[[trio.Event, Callable[[], None]], Awaitable[None]]) -> None:
        self.clock = trio.testing.MockClock()
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._host, args=(main,), daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("trio host did not start")
        if self._error is not None:
            raise self._error

    def _host(self, main: Callable[[trio.Event, Callable[[], None]], Awaitable[None]]) -> None:
        async def root() -> None:
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            await main(self._stop, self._ready.set)

        try:
            trio.run(root, clock=self.clock)
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn`` in trio, then wait until every task is blocked."""

        async def wrapped() -> T:
            result = await fn()
            await trio.testing.wait_all_tasks_blocked()
            return result

        return trio.from_thread.run(wrapped, trio_token=self._token)

    def stop(self) -> None:
        assert self._stop is not None
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(10)
        assert not self._thread.is_alive(), "trio host did not stop"
        if self._error is not None:
            raise self._error


@attrs.frozen
class Snapshot:
    records: dict[str, RunRecord]
    events: dict[str, list[RunEvent]]
    live: dict[str, RunStatus]
    borrowed: dict[str, int]  # limiter key -> borrowed tokens
    limits: dict[str, float]
    queued: int
    now: float


def limiter_keys(target: str) -> list[str]:
    return [f"target:{target}", f"adapter:{target.split('/')[0]}", "global"]


class GateMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = MemoryStore()
        self.adapters = {
            name: ScriptedAdapter(name, max_concurrency=cap) for name, _, cap in ADAPTERS
        }
        self.node = Node(
            node_id="sm",
            adapters=[AdapterSlot(self.adapters[name], limit) for name, limit, _ in ADAPTERS],
            targets=[
                TargetSpec(a, m, concurrency=lim, max_queued=mq, queue_timeout=qt)
                for a, m, lim, mq, qt in TARGETS
            ],
            limits=RuntimeLimits(
                concurrency=GLOBAL_LIMIT, max_queued=MAX_QUEUED, queue_timeout=QUEUE_TIMEOUT
            ),
            store=self.store,
        )
        self.runs: list[str] = []
        self.target_of: dict[str, str] = {}
        self.submitted_at: dict[str, float] = {}
        self.cancelled_while_queued: set[str] = set()
        # runs that held a token at a level when its limit was lowered: they may exceed it
        self.grandfathered: dict[str, set[str]] = {}
        self.host = TrioHost(self._main)
        self.snap = self._snapshot()

    async def _main(self, stop: trio.Event, ready: Callable[[], None]) -> None:
        async with self.node.running():
            ready()
            await stop.wait()
        # the node has stopped: keep what the store says, for teardown
        self.final_records = {r: await self.store.get(r) for r in self.runs}
        self.final_events = {r: await self.store.events(r) for r in self.runs}

    def _snapshot(self) -> Snapshot:
        async def take() -> Snapshot:
            records = {r: await self.node.store.get(r) for r in self.runs}
            events = {r: await self.node.store.events(r) for r in self.runs}
            stats = self.node.gate.statistics()
            borrowed = {"global": stats.global_.borrowed}
            limits = {"global": stats.global_.limit}
            for name, s in stats.adapters.items():
                borrowed[f"adapter:{name}"], limits[f"adapter:{name}"] = s.borrowed, s.limit
            for name, s in stats.targets.items():
                borrowed[f"target:{name}"], limits[f"target:{name}"] = s.borrowed, s.limit
            live = {r.run_id: r.status for r in self.node.manager.live_records()}
            return Snapshot(
                records={k: v for k, v in records.items() if v is not None},
                events=events,
                live=live,
                borrowed=borrowed,
                limits=limits,
                queued=stats.queued,
                now=trio.current_time(),
            )

        return self.host.call(take)

    def _status(self, run_id: str) -> RunStatus:
        return self.snap.records[run_id].status

    def _running(self) -> list[str]:
        return [r for r in self.runs if self._status(r) is RunStatus.RUNNING]

    def _under(self, key: str, status: RunStatus) -> list[str]:
        return [
            r
            for r in self.runs
            if self._status(r) is status and key in limiter_keys(self.target_of[r])
        ]

    def _step(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        before = self.snap
        result = self.host.call(fn)
        self.snap = self._snapshot()
        for run_id, record in self.snap.records.items():
            was = before.records.get(run_id)
            if (
                was is not None
                and was.status is RunStatus.QUEUED
                and (record.status, record.reason) == (RunStatus.REJECTED, "queue_timeout")
            ):
                waited = self.snap.now - self.submitted_at[run_id]
                assert waited >= self._timeout(run_id), (run_id, waited)
        return result

    def _timeout(self, run_id: str) -> float:
        target_timeout = TARGETS[TARGET_NAMES.index(self.target_of[run_id])][4]
        return QUEUE_TIMEOUT if target_timeout is None else target_timeout

    # --- rules -------------------------------------------------------------------------

    @rule(target_name=st.sampled_from(TARGET_NAMES), background=st.booleans())
    def submit(self, target_name: str, background: bool) -> None:
        target = target_name
        before = self.snap
        keys = limiter_keys(target)
        room = all(before.borrowed[k] < before.limits[k] for k in keys)
        lane_waiting = [
            r
            for r, s in before.live.items()
            if s is RunStatus.QUEUED and self.target_of[r] == target
        ]
        _, _, _, target_max_queued, target_timeout = TARGETS[TARGET_NAMES.index(target)]
        timeout = QUEUE_TIMEOUT if target_timeout is None else target_timeout

        async def go() -> str:
            spec = RunSpec(target, "p", background=background)
            run_id = (await self.node.manager.submit(spec, owner="s1")).record.run_id
            self.runs.append(run_id)
            self.target_of[run_id] = target
            self.submitted_at[run_id] = before.now
            return run_id

        run_id = self._step(go)
        record = self.snap.records[run_id]
        if room and not lane_waiting:
            expected: tuple[RunStatus, str] = (RunStatus.RUNNING, "")
        elif before.queued >= MAX_QUEUED or (
            target_max_queued is not None and len(lane_waiting) >= target_max_queued
        ):
            expected = (RunStatus.REJECTED, "queue_full")
        elif timeout == 0:
            expected = (RunStatus.REJECTED, "queue_timeout")
        else:
            expected = (RunStatus.QUEUED, "")
        assert (record.status, record.reason) == expected, (target, before)

    @precondition(lambda self: bool(self.runs))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(self.runs))
        was = self._status(run_id)
        outcome = self._step(lambda: self.node.manager.cancel(run_id))
        if was is RunStatus.QUEUED:
            self.cancelled_while_queued.add(run_id)
        if was.terminal:
            assert (outcome.status, outcome.cancelled) == (was, False)
        else:
            assert (outcome.status, outcome.cancelled) == (RunStatus.CANCELLED, True)
            assert self._status(run_id) is RunStatus.CANCELLED

    def _script(self, run_id: str) -> Any:
        return self.adapters[self.target_of[run_id].split("/")[0]].script(run_id)

    @precondition(lambda self: bool(self._running()))
    @rule(data=st.data(), how=st.sampled_from(["finish", "fail", "delta"]))
    def drive(self, data: st.DataObject, how: str) -> None:
        run_id = data.draw(st.sampled_from(self._running()))
        script = self._script(run_id)

        async def go() -> None:
            if how == "finish":
                script.finish()
            elif how == "fail":
                script.fail("scripted")
            else:
                script.delta("tok")

        self._step(go)
        expected = {
            "finish": RunStatus.SUCCEEDED,
            "fail": RunStatus.FAILED,
            "delta": RunStatus.RUNNING,
        }[how]
        assert self._status(run_id) is expected

    @rule(seconds=st.sampled_from([0.5, 1.0, 2.0, 3.0, 6.0]))
    def advance_clock(self, seconds: float) -> None:
        async def go() -> None:
            self.host.clock.jump(seconds)

        self._step(go)

    @rule(
        key=st.sampled_from(
            ["global"]
            + [f"adapter:{a}" for a, _, _ in ADAPTERS]
            + [f"target:{t}" for t in TARGET_NAMES]
        ),
        limit=st.integers(0, 4),
    )
    def change_limit(self, key: str, limit: int) -> None:
        level, _, name = key.partition(":")
        if limit < self.snap.limits[key]:
            holders = set(self._under(key, RunStatus.RUNNING))
            self.grandfathered.setdefault(key, set()).update(holders)

        async def go() -> None:
            if level == "global":
                self.node.set_limits(concurrency=limit)
            elif level == "adapter":
                self.node.set_limits(adapters={name: limit})
            else:
                self.node.set_limits(targets={name: limit})

        self._step(go)

    @rule()
    def lose_session(self) -> None:
        foreground = [r for r in self.snap.live if not self.snap.records[r].background]
        queued = {r for r in foreground if self._status(r) is RunStatus.QUEUED}

        async def go() -> list[str]:
            return self.node.manager.abandon("s1")

        abandoned = self._step(go)
        assert sorted(abandoned) == sorted(foreground)
        self.cancelled_while_queued |= queued
        for r in foreground:
            assert (self._status(r), self.snap.records[r].reason) == (
                RunStatus.CANCELLED,
                "session_lost",
            )

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def tokens_match_running_runs_within_limits(self) -> None:
        for key, borrowed in self.snap.borrowed.items():
            running = self._under(key, RunStatus.RUNNING)
            assert borrowed == len(running), (key, borrowed, running)
            kept = self.grandfathered.get(key, set()) & set(running)
            assert len(running) <= max(self.snap.limits[key], len(kept)), (key, running)

    @invariant()
    def no_waiting_run_could_start(self) -> None:
        queued = [r for r in self.runs if self._status(r) is RunStatus.QUEUED]
        assert self.snap.queued == len(queued) <= MAX_QUEUED
        for run_id in queued:
            keys = limiter_keys(self.target_of[run_id])
            assert any(self.snap.borrowed[k] >= self.snap.limits[k] for k in keys), run_id

    @invariant()
    def queue_waits_respect_the_deadline(self) -> None:
        for run_id in self.runs:
            if self._status(run_id) is RunStatus.QUEUED:
                waited = self.snap.now - self.submitted_at[run_id]
                assert waited < self._timeout(run_id), (run_id, waited)

    @invariant()
    def no_run_overtakes_a_waiting_run_of_its_target(self) -> None:
        # (runs granted in the same instant wake in any order, so the order in
        # which adapters see them proves nothing; overtaking a waiter does)
        for i, waiting in enumerate(self.runs):
            if self._status(waiting) is not RunStatus.QUEUED:
                continue
            for later in self.runs[i + 1 :]:
                if self.target_of[later] == self.target_of[waiting]:
                    kinds = [e.kind for e in self.snap.events[later]]
                    assert EventKind.STARTED not in kinds, (waiting, later)

    @invariant()
    def event_logs_are_whole(self) -> None:
        for run_id in self.runs:
            self._check_log(run_id, require_end=False)
        for run_id in self.cancelled_while_queued:
            kinds = [e.kind for e in self.snap.events[run_id]]
            assert EventKind.STARTED not in kinds, run_id
        for run_id, status in self.snap.live.items():
            assert self._status(run_id) is status

    def _check_log(self, run_id: str, *, require_end: bool) -> None:
        record = self.snap.records[run_id]
        events = self.snap.events[run_id]
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert record.last_seq == len(events)
        statuses = [e.status for e in events if e.status is not None]
        assert statuses[-1] is record.status, run_id
        terminal = [e for e in events if e.kind.terminal]
        if record.status.terminal or require_end:
            assert len(terminal) == 1 and terminal[0] is events[-1], run_id
            assert run_id not in self.snap.live
        else:
            assert not terminal
        if record.status is RunStatus.REJECTED:
            assert record.reason in {"queue_full", "queue_timeout"}
            if record.reason == "queue_timeout" and events[-1].kind is EventKind.REJECTED:
                assert EventKind.STARTED not in [e.kind for e in events]

    def teardown(self) -> None:
        self.host.stop()
        # the node has stopped: every run has ended, once, and no token is left
        self.snap = attrs.evolve(
            self.snap, records=self.final_records, events=self.final_events, live={}
        )
        for run_id in self.runs:
            self._check_log(run_id, require_end=True)
        stats = self.node.gate.statistics()
        assert stats.queued == 0
        assert stats.global_.borrowed == 0
        assert all(s.borrowed == 0 for s in stats.adapters.values())
        assert all(s.borrowed == 0 for s in stats.targets.values())
        assert all(not a.open_streams for a in self.adapters.values())


GateMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestGateMachine = GateMachine.TestCase


def test_host_reports_a_crash_in_trio() -> None:
    """The harness itself: an exception inside trio reaches the test thread."""

    async def boom(stop: trio.Event, ready: Callable[[], None]) -> None:
        raise ValueError("inside trio")

    with pytest.raises(ValueError, match="inside trio"):
        TrioHost(boom)
