"""Hypothesis state machine over the node runtime: the gate's invariants after every step.

Trio runs in a helper thread (``trio.run`` with a MockClock that only moves
when a rule jumps it); each rule calls into it with ``trio.from_thread.run``
and returns only when every task in the node is blocked, so every check sees
a quiescent node. hypothesis-trio does not work with current Hypothesis.
"""

from __future__ import annotations

import math
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

from iop_trio.model import TenantLimits
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
from iop_trio.runtime.live import RunPhase
from iop_trio.store.memory import MemoryStore

from .support import ScriptedAdapter

T = TypeVar("T")

#: The record statuses a live run may have in each phase (a run whose end is being
#: written has its terminal status already, in the phase it ends from).
PHASE_STATUSES: dict[RunPhase, frozenset[RunStatus]] = {
    RunPhase.ENTERING: frozenset({RunStatus.QUEUED, RunStatus.RUNNING}),
    RunPhase.QUEUED: frozenset({RunStatus.QUEUED}),
    RunPhase.ADMITTED: frozenset({RunStatus.QUEUED}),
    RunPhase.STARTING: frozenset({RunStatus.RUNNING}),
    RunPhase.RUNNING: frozenset({RunStatus.RUNNING}),
    RunPhase.ENDED: frozenset(),
}

GLOBAL_LIMIT = 3
MAX_QUEUED = 8
QUEUE_TIMEOUT = 5.0
TARGETS = [
    # (adapter, model, limit, max_queued, queue_timeout)
    ("x", "a", 1, None, None),
    ("x", "b", 2, 2, None),
    ("y", "c", 2, None, 2.0),
]
ADAPTERS = [("x", None, None), ("y", 3, 1)]  # (name, configured limit, capability)
TARGET_NAMES = [f"{a}/{m}" for a, m, *_ in TARGETS]
# tenants set at start (others, like "", have weight 1 and no bounds until a rule sets them)
TENANTS = {"t1": TenantLimits(weight=1, max_queued=2, concurrency=1), "t2": TenantLimits(weight=2)}
TENANT_NAMES = ["", "t1", "t2"]


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
    queued_by_tenant: dict[str, int]
    now: float

    def has_room(self, key: str) -> bool:
        # a tenant the gate has forgotten (never set, no runs) holds nothing, has no bound
        return self.borrowed.get(key, 0) < self.limits.get(key, math.inf)


def limiter_keys(target: str, tenant: str) -> list[str]:
    """The run's four levels, most specific first."""
    return [f"tenant:{tenant}", f"target:{target}", f"adapter:{target.split('/')[0]}", "global"]


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
                concurrency=GLOBAL_LIMIT,
                max_queued=MAX_QUEUED,
                queue_timeout=QUEUE_TIMEOUT,
                tenants=TENANTS,
            ),
            store=self.store,
        )
        self.runs: list[str] = []
        self.target_of: dict[str, str] = {}
        self.spec_of: dict[str, RunSpec] = {}
        self.submitted_at: dict[str, float] = {}
        self.cancelled_while_queued: set[str] = set()
        # runs that held a token at a level when its limit was lowered: they may exceed it
        self.grandfathered: dict[str, set[str]] = {}
        # fair shares: runs started at (target, priority) by two tenants (a < b), counted
        # since both became backlogged there, with the weights they had then
        self.shares: dict[tuple[str, int, str, str], tuple[float, float, int, int]] = {}
        # a tenant held back by its own concurrency bound falls behind and may catch up
        # later, which fair queueing allows: it is left out of the share check until it
        # has no bound and no waiting run (its flows then start afresh)
        self.lagging = {n for n, t in TENANTS.items() if t.concurrency is not None}
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
            for name, s in stats.tenants.items():
                borrowed[f"tenant:{name}"], limits[f"tenant:{name}"] = s.borrowed, s.limit
            live = {r.run_id: r.status for r in self.node.manager.live_records()}
            return Snapshot(
                records={k: v for k, v in records.items() if v is not None},
                events=events,
                live=live,
                borrowed=borrowed,
                limits=limits,
                queued=stats.queued,
                queued_by_tenant=dict(stats.queued_by_tenant),
                now=trio.current_time(),
            )

        return self.host.call(take)

    def _status(self, run_id: str) -> RunStatus:
        return self.snap.records[run_id].status

    def _running(self) -> list[str]:
        return [r for r in self.runs if self._status(r) is RunStatus.RUNNING]

    def _keys(self, run_id: str) -> list[str]:
        return limiter_keys(self.target_of[run_id], self.spec_of[run_id].tenant)

    def _under(self, key: str, status: RunStatus) -> list[str]:
        return [r for r in self.runs if self._status(r) is status and key in self._keys(r)]

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
        self._check_order(before)
        return result

    def _check_order(self, before: Snapshot) -> None:
        """No run started in this step ahead of one that waited through it and should
        have gone first: on its target, of higher priority (unless its tenant is full),
        or of its own tenant and priority and older (FIFO)."""
        started = [
            r
            for r in self.runs
            if r in before.records
            and before.records[r].status is RunStatus.QUEUED
            and RunStatus.RUNNING
            in {e.status for e in self.snap.events[r][len(before.events[r]) :]}
        ]
        still_waiting = [
            r
            for r in self.runs
            if r in before.records
            and before.records[r].status is RunStatus.QUEUED
            and self._status(r) is RunStatus.QUEUED
        ]
        self._check_shares(before, started)
        for late in started:
            spec = self.spec_of[late]
            for waiter in still_waiting:
                other = self.spec_of[waiter]
                if other.target != spec.target:
                    continue  # another target's limits may be full: no head-of-line blocking
                if other.priority > spec.priority:
                    assert not self.snap.has_room(f"tenant:{other.tenant}"), (waiter, late)
                if (other.tenant, other.priority) == (spec.tenant, spec.priority):
                    assert self.runs.index(waiter) > self.runs.index(late), (waiter, late)

    def _check_shares(self, before: Snapshot, started: list[str]) -> None:
        """Between two tenants continuously backlogged at one (target, priority), the
        runs each started, over its weight, differ by at most 1/w_a + 1/w_b."""

        def backlogged(snap: Snapshot) -> set[tuple[str, int, str]]:
            return {
                (spec.target, spec.priority, spec.tenant)
                for r, spec in self.spec_of.items()
                if r in snap.records and snap.records[r].status is RunStatus.QUEUED
            }

        now = backlogged(self.snap)
        both = backlogged(before) & now
        for tenant in TENANT_NAMES:
            key = f"tenant:{tenant}"
            if min(before.limits.get(key, math.inf), self.snap.limits.get(key, math.inf)) < (
                math.inf
            ):
                self.lagging.add(tenant)
            elif not any(t == tenant for _, _, t in now):
                self.lagging.discard(tenant)
        weight = {t: self.node.gate.tenant_limits(t).weight for t in TENANT_NAMES}
        shares = {}
        for target, priority, a in both:
            for other_target, other_priority, b in both:
                if (other_target, other_priority) != (target, priority) or not a < b:
                    continue
                if {a, b} & self.lagging:
                    continue
                key = (target, priority, a, b)
                wa, wb, na, nb = self.shares.get(key, (weight[a], weight[b], 0, 0))
                if (wa, wb) != (weight[a], weight[b]):  # a new weight: a new window
                    wa, wb, na, nb = weight[a], weight[b], 0, 0
                for r in started:
                    spec = self.spec_of[r]
                    if (spec.target, spec.priority) == (target, priority):
                        na += spec.tenant == a
                        nb += spec.tenant == b
                assert abs(na / wa - nb / wb) <= 1 / wa + 1 / wb + 1e-9, (key, na, nb)
                shares[key] = (wa, wb, na, nb)
        self.shares = shares

    def _timeout(self, run_id: str) -> float:
        target_timeout = TARGETS[TARGET_NAMES.index(self.target_of[run_id])][4]
        timeout = QUEUE_TIMEOUT if target_timeout is None else target_timeout
        own = self.spec_of[run_id].queue_timeout
        return timeout if own is None else min(timeout, own)

    # --- rules -------------------------------------------------------------------------

    @rule(
        target_name=st.sampled_from(TARGET_NAMES),
        background=st.booleans(),
        tenant=st.sampled_from(TENANT_NAMES),
        priority=st.sampled_from([-1, 0, 0, 2]),
        queue_timeout=st.sampled_from([None, None, 0.0, 1.0, 30.0]),
    )
    def submit(
        self,
        target_name: str,
        background: bool,
        tenant: str,
        priority: int,
        queue_timeout: float | None,
    ) -> None:
        target = target_name
        before = self.snap
        keys = limiter_keys(target, tenant)
        room = all(before.has_room(k) for k in keys)
        lane_waiting = [
            r
            for r, s in before.live.items()
            if s is RunStatus.QUEUED and self.target_of[r] == target
        ]
        _, _, _, target_max_queued, target_timeout = TARGETS[TARGET_NAMES.index(target)]
        timeout = QUEUE_TIMEOUT if target_timeout is None else target_timeout
        if queue_timeout is not None:
            timeout = min(timeout, queue_timeout)
        tenant_max_queued = self.node.gate.tenant_limits(tenant).max_queued
        spec = RunSpec(
            target,
            "p",
            background=background,
            tenant=tenant,
            priority=priority,
            queue_timeout=queue_timeout,
        )

        async def go() -> str:
            run_id = (await self.node.manager.submit(spec, owner="s1")).record.run_id
            self.runs.append(run_id)
            self.target_of[run_id] = target
            self.spec_of[run_id] = spec
            self.submitted_at[run_id] = before.now
            return run_id

        run_id = self._step(go)
        record = self.snap.records[run_id]
        if room:  # all four levels have room: whoever waits there is held by its tenant
            expected: tuple[RunStatus, str] = (RunStatus.RUNNING, "")
        elif (
            before.queued >= MAX_QUEUED
            or (target_max_queued is not None and len(lane_waiting) >= target_max_queued)
            or (
                tenant_max_queued is not None
                and before.queued_by_tenant.get(tenant, 0) >= tenant_max_queued
            )
        ):
            expected = (RunStatus.REJECTED, "queue_full")
        elif timeout == 0:
            expected = (RunStatus.REJECTED, "queue_timeout")
        else:
            expected = (RunStatus.QUEUED, "")
        assert (record.status, record.reason) == expected, (spec, before)
        assert (record.tenant, record.priority) == (tenant, priority)
        if record.status is RunStatus.REJECTED:
            assert record.retry_after is not None and record.retry_after > 0

    @rule(
        target_name=st.sampled_from(TARGET_NAMES),
        tenant=st.sampled_from(TENANT_NAMES),
        count=st.integers(2, 5),
    )
    def burst(self, target_name: str, tenant: str, count: int) -> None:
        """Several runs of one tenant at once: what makes fair queueing matter."""
        for _ in range(count):
            self.submit(target_name, True, tenant, 0, None)

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

    @rule(
        tenant=st.sampled_from(TENANT_NAMES),
        weight=st.sampled_from([1, 2, 3]),
        max_queued=st.sampled_from([None, 0, 1, 3]),
        concurrency=st.sampled_from([None, None, None, 0, 1, 2]),
    )
    def change_tenant(
        self, tenant: str, weight: int, max_queued: int | None, concurrency: int | None
    ) -> None:
        key = f"tenant:{tenant}"
        if (concurrency if concurrency is not None else math.inf) < self.snap.limits.get(
            key, math.inf
        ):
            holders = set(self._under(key, RunStatus.RUNNING))
            self.grandfathered.setdefault(key, set()).update(holders)
        share = TenantLimits(weight=weight, max_queued=max_queued, concurrency=concurrency)

        async def go() -> None:
            self.node.set_limits(tenants={tenant: share})

        self._step(go)
        assert self.node.limits().tenants[tenant] == share

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
        keys = set(self.snap.borrowed) | {k for r in self.runs for k in self._keys(r)}
        for key in keys:
            borrowed = self.snap.borrowed.get(key, 0)
            running = self._under(key, RunStatus.RUNNING)
            assert borrowed == len(running), (key, borrowed, running)
            kept = self.grandfathered.get(key, set()) & set(running)
            limit = self.snap.limits.get(key, math.inf)
            assert len(running) <= max(limit, len(kept)), (key, running)

    @invariant()
    def the_limiters_lend_what_the_policy_counts(self) -> None:
        """The shell's CapacityLimiters (the permits) and the scheduler's pools agree."""
        assert self.host.call(self._mirrors)

    async def _mirrors(self) -> bool:
        return self.node.gate.mirrors_agree()

    @invariant()
    def no_waiting_run_could_start(self) -> None:
        queued = [r for r in self.runs if self._status(r) is RunStatus.QUEUED]
        assert self.snap.queued == len(queued) <= MAX_QUEUED
        for run_id in queued:
            assert not all(self.snap.has_room(k) for k in self._keys(run_id)), run_id
        for tenant in TENANT_NAMES:
            waiting = [r for r in queued if self.spec_of[r].tenant == tenant]
            assert self.snap.queued_by_tenant.get(tenant, 0) == len(waiting), tenant

    @invariant()
    def queue_waits_respect_the_deadline(self) -> None:
        for run_id in self.runs:
            if self._status(run_id) is RunStatus.QUEUED:
                waited = self.snap.now - self.submitted_at[run_id]
                assert waited < self._timeout(run_id), (run_id, waited)

    @invariant()
    def every_live_run_is_in_a_phase_its_state_agrees_with(self) -> None:
        """A quiescent node's live runs are QUEUED (waiting in the gate, unless asked to
        end) or RUNNING (holding a permit, its STARTED published)."""
        assert self.host.call(self._phases_agree)

    async def _phases_agree(self) -> bool:
        for live in self.node.manager.runs:
            run_id, status = live.state.record.run_id, live.state.status
            assert status in PHASE_STATUSES[live.phase] or status.terminal, (run_id, live)
            assert live.phase in (RunPhase.QUEUED, RunPhase.RUNNING), (run_id, live)
            waiting = self.node.gate.is_waiting(live)
            assert waiting == (live.phase is RunPhase.QUEUED and live.asked is None), live
            assert (live.starting is not None) == (live.phase is RunPhase.STARTING), live
            if live.phase is RunPhase.RUNNING:
                assert live.permit is not None and not live.permit.released, live
            if live.phase is RunPhase.QUEUED:
                assert live.permit is None, live
        return True

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
        assert all(s.borrowed == 0 for s in stats.tenants.values())
        assert stats.running_by_priority == {} and stats.queued_by_priority == {}
        assert set(stats.tenants) <= set(TENANT_NAMES)  # tenants never set are forgotten
        assert all(not a.open_streams for a in self.adapters.values())


GateMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    suppress_health_check=[HealthCheck.too_slow],
)
TestGateMachine = GateMachine.TestCase


def test_host_reports_a_crash_in_trio() -> None:
    """The harness itself: an exception inside trio reaches the test thread."""

    async def boom(stop: trio.Event, ready: Callable[[], None]) -> None:
        raise ValueError("inside trio")

    with pytest.raises(ValueError, match="inside trio"):
        TrioHost(boom)
