"""The gate's order and bounds, run for run: priority, tenants' fair shares, tenant bounds,
per-run deadlines and retry hints. Deterministic: every waiter is queued one at a time
(so arrival order is known) and the clock is Trio's MockClock where time matters.
"""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from iop_trio.model import MIN_RETRY_AFTER, RejectReason, TenantLimits
from iop_trio.runtime.gate import Admitted, Expired, Gate, GateDecision, GateRejected


def gate_with(targets: dict[str, int], *, concurrency: int = 100, **kw: float) -> Gate:
    gate = Gate(
        concurrency=concurrency,
        max_queued=int(kw.pop("max_queued", 1000)),
        queue_timeout=kw.pop("queue_timeout", 600.0),
    )
    gate.add_adapter("echo", None)
    for name, limit in targets.items():
        gate.add_target(name, adapter="echo", limit=limit)
    return gate


class Line:
    """Queues runs one at a time and records the order in which they get a permit;
    each gives its permit back at once, so the next grant follows."""

    def __init__(self, gate: Gate, nursery: trio.Nursery) -> None:
        self.gate = gate
        self.nursery = nursery
        self.granted: list[str] = []
        self.rejected: dict[str, GateRejected] = {}
        self._hold = trio.Event()

    async def hold(self, name: str, target: str, **kw: object) -> None:
        """A run that takes a permit and keeps it until :meth:`let_go`."""

        async def holder() -> None:
            with await self.gate.acquire(name, target, **kw):  # type: ignore[arg-type]
                await self._hold.wait()

        self.nursery.start_soon(holder)
        await trio.testing.wait_all_tasks_blocked()

    def let_go(self) -> None:
        self._hold.set()

    async def queue(self, name: str, target: str, **kw: object) -> None:
        async def waiter() -> None:
            try:
                with await self.gate.acquire(name, target, **kw):  # type: ignore[arg-type]
                    self.granted.append(name)
            except GateRejected as exc:
                self.rejected[name] = exc

        self.nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()


async def test_the_highest_priority_goes_first_then_the_oldest():
    gate = gate_with({"echo/a": 1})
    async with trio.open_nursery() as nursery:
        line = Line(gate, nursery)
        await line.hold("busy", "echo/a")
        for name, priority in [("low", -1), ("n1", 0), ("high", 5), ("n2", 0), ("mid", 1)]:
            await line.queue(name, "echo/a", priority=priority)
        line.let_go()
    assert line.granted == ["high", "mid", "n1", "n2", "low"]


async def test_priority_counts_across_targets_that_share_a_limit():
    gate = gate_with({"echo/a": 5, "echo/b": 5}, concurrency=1)
    async with trio.open_nursery() as nursery:
        line = Line(gate, nursery)
        await line.hold("busy", "echo/a")
        await line.queue("a-old", "echo/a")
        await line.queue("b-urgent", "echo/b", priority=3)
        await line.queue("a-new", "echo/a")
        line.let_go()
    assert line.granted == ["b-urgent", "a-old", "a-new"]


async def test_two_backlogged_tenants_of_equal_weight_alternate_whatever_their_arrivals():
    gate = gate_with({"echo/a": 1})
    async with trio.open_nursery() as nursery:
        line = Line(gate, nursery)
        await line.hold("busy", "echo/a")
        for i in range(1, 7):  # the heavy tenant came first, with six
            await line.queue(f"heavy{i}", "echo/a", tenant="heavy")
        for i in range(1, 3):
            await line.queue(f"light{i}", "echo/a", tenant="light")
        line.let_go()
    assert line.granted == [
        "heavy1", "light1", "heavy2", "light2", "heavy3", "heavy4", "heavy5", "heavy6",
    ]  # fmt: skip


async def test_weights_share_by_run_count():
    gate = gate_with({"echo/a": 1})
    gate.set_tenant("gold", TenantLimits(weight=2))
    async with trio.open_nursery() as nursery:
        line = Line(gate, nursery)
        await line.hold("busy", "echo/a")
        for i in range(8):
            await line.queue(f"gold{i}", "echo/a", tenant="gold")
        for i in range(8):
            await line.queue(f"std{i}", "echo/a", tenant="")
        line.let_go()
    first = line.granted[:9]
    assert sum(n.startswith("gold") for n in first) == 6  # 2:1
    # FIFO within each tenant
    assert [n for n in line.granted if n.startswith("gold")] == [f"gold{i}" for i in range(8)]
    assert [n for n in line.granted if n.startswith("std")] == [f"std{i}" for i in range(8)]


async def test_an_idle_tenant_saves_up_no_credit():
    gate = gate_with({"echo/a": 1})
    async with trio.open_nursery() as nursery:
        line = Line(gate, nursery)
        await line.hold("busy", "echo/a")
        for i in range(4):
            await line.queue(f"a{i}", "echo/a", tenant="a")
        line.let_go()
    # a was served alone; b arriving now must not get four turns in a row
    async with trio.open_nursery() as nursery:
        line = Line(gate, nursery)
        await line.hold("busy2", "echo/a")
        for i in range(3):
            await line.queue(f"a{i}", "echo/a", tenant="a")
        for i in range(3):
            await line.queue(f"b{i}", "echo/a", tenant="b")
        line.let_go()
    assert line.granted == ["a0", "b0", "a1", "b1", "a2", "b2"]


async def test_a_tenant_over_its_max_queued_is_refused_and_others_still_queue():
    gate = gate_with({"echo/a": 1})
    gate.set_tenant("flood", TenantLimits(max_queued=2))
    async with trio.open_nursery() as nursery:
        line = Line(gate, nursery)
        await line.hold("busy", "echo/a")
        for i in range(4):
            await line.queue(f"flood{i}", "echo/a", tenant="flood")
        await line.queue("other", "echo/a", tenant="other")
        assert set(line.rejected) == {"flood2", "flood3"}
        refused = line.rejected["flood2"]
        assert refused.reason is RejectReason.QUEUE_FULL
        assert "tenant 'flood'" in str(refused) and "max_queued 2" in str(refused)
        assert refused.retry_after >= MIN_RETRY_AFTER
        queued = {n: q for n, q in gate.statistics().queued_by_tenant.items() if q}
        assert queued == {"flood": 2, "other": 1}
        line.let_go()
    assert line.granted == ["flood0", "other", "flood1"]


async def test_a_tenant_at_its_concurrency_waits_while_others_use_the_room():
    gate = gate_with({"echo/a": 3})
    gate.set_tenant("t", TenantLimits(concurrency=1))
    async with trio.open_nursery() as nursery:
        line = Line(gate, nursery)
        await line.hold("t-running", "echo/a", tenant="t")
        await line.queue("t-next", "echo/a", tenant="t")  # the target has room; t has not
        assert line.granted == []
        await line.queue("u", "echo/a", tenant="u")  # no head-of-line blocking
        assert line.granted == ["u"]
        stats = gate.statistics()
        assert (stats.tenants["t"].limit, stats.tenants["t"].borrowed) == (1, 1)
        gate.set_tenant("t", TenantLimits(concurrency=2))  # raised at runtime: admitted now
        await trio.testing.wait_all_tasks_blocked()
        assert line.granted == ["u", "t-next"]
        line.let_go()


async def test_tokens_are_taken_at_every_level_and_given_back(autojump_clock):
    gate = gate_with({"echo/a": 2})
    gate.set_tenant("t", TenantLimits(concurrency=5))
    async with trio.open_nursery() as nursery:
        line = Line(gate, nursery)
        await line.hold("one", "echo/a", tenant="t")
        stats = gate.statistics()
        assert stats.tenants["t"].borrowed == stats.targets["echo/a"].borrowed == 1
        assert stats.global_.borrowed == stats.adapters["echo"].borrowed == 1
        line.let_go()
    stats = gate.statistics()
    assert stats.tenants["t"].borrowed == stats.global_.borrowed == 0


async def test_enter_now_grants_what_enter_would_grant_at_once_and_else_changes_nothing():
    gate = gate_with({"echo/a": 1, "echo/b": 1})
    gate.set_tenant("t", TenantLimits(concurrency=1))
    first = gate.enter_now("one", "echo/a", tenant="t", priority=2)
    assert first is not None
    stats = gate.statistics()
    assert stats.tenants["t"].borrowed == stats.targets["echo/a"].borrowed == 1
    assert stats.global_.borrowed == stats.adapters["echo"].borrowed == 1
    assert stats.running_by_priority == {2: 1}
    before = gate.statistics()
    # the target is full, then the tenant is: nothing is queued, refused or remembered
    assert gate.enter_now("two", "echo/a", tenant="passing") is None
    assert gate.enter_now("three", "echo/b", tenant="t") is None
    assert gate.statistics() == before
    assert not gate.is_waiting("two")
    # enter then queues as if enter_now had not been asked, and the release grants it
    decided: list[GateDecision] = []
    gate.decide = decided.append
    queued = gate.enter("two", "echo/a", tenant="passing")
    assert queued is None and gate.statistics().queued == 1
    first.release()
    (decision,) = decided
    assert isinstance(decision, Admitted) and decision.borrower == "two"
    permit = decision.permit
    assert gate.statistics().queued == 0
    permit.release()  # type: ignore[attr-defined]
    assert set(gate.statistics().tenants) == {"t"}
    assert gate.statistics().global_.borrowed == 0


async def test_the_smaller_of_the_runs_and_the_targets_queue_timeout_applies(autojump_clock):
    gate = gate_with({"echo/a": 1}, queue_timeout=30)
    async with trio.open_nursery() as nursery:
        line = Line(gate, nursery)
        await line.hold("busy", "echo/a")
        start = trio.current_time()
        await line.queue("patient", "echo/a", queue_timeout=300)
        await line.queue("hasty", "echo/a", queue_timeout=2)
        await trio.sleep(2.5)
        assert set(line.rejected) == {"hasty"}
        assert line.rejected["hasty"].reason is RejectReason.QUEUE_TIMEOUT
        assert "within 2s" in str(line.rejected["hasty"])
        await trio.sleep(30)
        assert set(line.rejected) == {"hasty", "patient"}  # the target's 30 s, not 300
        assert trio.current_time() - start == pytest.approx(32.5)
        line.let_go()


async def test_retry_hints_follow_the_recent_rate_of_grants(autojump_clock):
    gate = gate_with({"echo/a": 1})

    async def one_run() -> None:
        with await gate.acquire(object(), "echo/a"):
            await trio.sleep(2)  # a run takes 2 s

    async with trio.open_nursery() as nursery:
        for _ in range(4):  # granted at 0, 2, 4 and 6 s
            nursery.start_soon(one_run)
            await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(4.5)  # one runs, one waits; grants came 2 s apart
        with pytest.raises(GateRejected) as now:
            await gate.acquire("now-or-never", "echo/a", queue_timeout=0)
        assert now.value.reason is RejectReason.QUEUE_TIMEOUT
        assert now.value.retry_after == pytest.approx(4.0)  # two grants away
        gate.set_queue(max_queued=1)
        with pytest.raises(GateRejected) as full:
            await gate.acquire("late", "echo/a")
        assert full.value.reason is RejectReason.QUEUE_FULL
        assert full.value.retry_after == pytest.approx(2.0)  # one grant frees a place
        nursery.cancel_scope.cancel()


async def test_queue_timeout_zero_has_a_hint_too():
    gate = gate_with({"echo/a": 1})
    async with trio.open_nursery() as nursery:
        line = Line(gate, nursery)
        await line.hold("busy", "echo/a")
        await line.queue("now", "echo/a", queue_timeout=0)
        refused = line.rejected["now"]
        assert refused.reason is RejectReason.QUEUE_TIMEOUT
        assert refused.retry_after >= MIN_RETRY_AFTER
        line.let_go()


async def test_tenants_never_set_are_forgotten_when_idle():
    gate = gate_with({"echo/a": 1})
    gate.set_tenant("kept", TenantLimits(weight=3))
    async with trio.open_nursery() as nursery:
        line = Line(gate, nursery)
        await line.hold("busy", "echo/a", tenant="passing")
        await line.queue("w", "echo/a", tenant="waiting")
        assert set(gate.statistics().tenants) == {"kept", "passing", "waiting"}
        line.let_go()
    assert set(gate.statistics().tenants) == {"kept"}
    async with trio.open_nursery() as nursery:  # runs turned away at once leave none either
        line = Line(gate, nursery)
        await line.hold("busy", "echo/a")
        for i in range(5):
            await line.queue(f"r{i}", "echo/a", tenant=f"once{i}", queue_timeout=0)
        with pytest.raises(ValueError, match="queue_timeout"):
            await gate.acquire("bad", "echo/a", tenant="bad", queue_timeout=-1)
        assert len(line.rejected) == 5
        assert set(gate.statistics().tenants) == {"kept", ""}
        line.let_go()
    assert gate.tenants() == {"kept": TenantLimits(weight=3.0)}
    assert gate.tenant_limits("never") == TenantLimits()


@pytest.mark.parametrize(
    ("limits", "match"),
    [
        (TenantLimits(weight=0), "weight must be a number > 0"),
        (TenantLimits(weight=math.inf), "weight must be a number > 0"),
        (TenantLimits(weight=True), "weight must be a number > 0"),
        (TenantLimits(max_queued=-1), "max_queued"),
        (TenantLimits(concurrency=1.5), "concurrency"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_tenant_share_is_refused_and_nothing_changes(limits, match):
    gate = gate_with({"echo/a": 1})
    gate.set_tenant("t", TenantLimits(weight=2))
    with pytest.raises(ValueError, match=match):
        gate.set_tenant("t", limits)
    assert gate.tenant_limits("t") == TenantLimits(weight=2)
    with pytest.raises(ValueError, match="must be up to 128 characters"):
        gate.set_tenant("bad name", TenantLimits())


@settings(max_examples=200)
@given(
    weights=st.tuples(st.sampled_from([1, 2, 3, 0.5]), st.sampled_from([1, 2, 3, 0.5])),
    arrivals=st.lists(st.sampled_from("ab"), min_size=2, max_size=40),
)
def test_backlogged_tenants_get_their_weighted_share_within_one_run(weights, arrivals):
    """Start-time fair queueing's bound: while both tenants wait, the runs each got,
    divided by its weight, differ by at most 1/w_a + 1/w_b, in every prefix."""
    granted: list[str] = []

    async def main() -> None:
        gate = gate_with({"echo/a": 1})
        gate.set_tenant("a", TenantLimits(weight=weights[0]))
        gate.set_tenant("b", TenantLimits(weight=weights[1]))
        async with trio.open_nursery() as nursery:
            line = Line(gate, nursery)
            await line.hold("busy", "echo/a")
            for i, tenant in enumerate(arrivals):
                await line.queue(f"{tenant}{i}", "echo/a", tenant=tenant)
            line.let_go()
        granted.extend(name[0] for name in line.granted)

    trio.run(main)
    assert sorted(granted) == sorted(arrivals)
    total = {t: arrivals.count(t) for t in "ab"}
    w = dict(zip("ab", weights, strict=True))
    got = {"a": 0, "b": 0}
    for tenant in granted:
        if got["a"] == total["a"] or got["b"] == total["b"]:
            break  # one of them is no longer backlogged
        got[tenant] += 1
        gap = abs(got["a"] / w["a"] - got["b"] / w["b"])
        assert gap <= 1 / w["a"] + 1 / w["b"] + 1e-9, (granted, got)


async def test_early_rejection_decides_at_once_from_the_queue_ahead(autojump_clock):
    gate = gate_with({"echo/a": 1}, queue_timeout=600)
    outcomes: dict[str, str] = {}

    async def run(name: str, seconds: float, kw: dict[str, object]) -> None:
        try:
            with await gate.acquire(name, "echo/a", **kw):  # type: ignore[arg-type]
                outcomes[name] = "started"
                await trio.sleep(seconds)
        except GateRejected as exc:
            outcomes[name] = f"{exc.reason.value} after {trio.current_time() - t0:g}s"
            rejections[name] = exc

    rejections: dict[str, GateRejected] = {}
    async with trio.open_nursery() as nursery:
        t0 = trio.current_time()
        for i in range(20):  # a busy target: a grant every second while runs wait
            nursery.start_soon(run, f"warm{i}", 1.0, {})
            await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(12.5)  # 12 grants seen, 7 runs still wait
        gate.early_reject = True
        t0 = trio.current_time()
        for name, kw in [
            ("hopeless", {"queue_timeout": 3}),  # 7 ahead at 1 s each: about 8 s
            ("patient", {"queue_timeout": 30}),
            ("urgent", {"queue_timeout": 3, "priority": 1}),  # nobody ahead: about 1 s
        ]:
            nursery.start_soon(run, name, 1.0, kw)
            await trio.testing.wait_all_tasks_blocked()
        assert outcomes.get("hopeless") == "queue_timeout after 0s"  # decided at once
        assert "decided at once" in str(rejections["hopeless"])
        assert rejections["hopeless"].retry_after == pytest.approx(5.0, abs=1.0)
        assert "patient" not in outcomes and "urgent" not in outcomes  # they wait
        gate.early_reject = False
        nursery.start_soon(run, "off", 1.0, {"queue_timeout": 3})
        await trio.testing.wait_all_tasks_blocked()
        assert "off" not in outcomes  # without the switch it waits its 3 s
        await trio.sleep(60)
    assert outcomes["urgent"] == "started"
    assert outcomes["patient"] == "started"
    assert outcomes["off"] == "queue_timeout after 3s"


async def test_early_rejection_waits_for_enough_of_a_rate(autojump_clock):
    gate = Gate(concurrency=1, max_queued=100, queue_timeout=600, early_reject=True)
    gate.add_adapter("echo", None)
    gate.add_target("echo/a", adapter="echo", limit=1)
    async with trio.open_nursery() as nursery:
        line = Line(gate, nursery)
        await line.hold("busy", "echo/a")
        for i in range(10):  # no grant has been seen: nobody is refused on a guess
            await line.queue(f"w{i}", "echo/a", queue_timeout=0.5)
        assert line.rejected == {}
        line.let_go()


async def test_a_stream_of_newcomers_does_not_starve_a_backlogged_tenant():
    """Newcomers start at the level's virtual time, which every grant moves on. Here a
    new one-run tenant arrives for every run granted, more than the target serves, so
    newcomers pile up and the backlogged tenant gets its fair share, one turn among the
    tenants waiting: 6 of 30 grants. With a clock that only followed the starts served,
    every newcomer started at the same time, ahead of it, and it got 1."""
    gate = gate_with({"echo/a": 1})
    granted: list[str] = []
    holding: list[trio.Event] = []

    async def run(name: str, tenant: str) -> None:
        with await gate.acquire(name, "echo/a", tenant=tenant):
            granted.append(name)
            done = trio.Event()
            holding.append(done)
            await done.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "busy", "")
        await trio.testing.wait_all_tasks_blocked()
        for i in range(10):
            nursery.start_soon(run, f"heavy{i}", "heavy")
            await trio.testing.wait_all_tasks_blocked()
        for i in range(30):
            nursery.start_soon(run, f"new{i}", f"new{i}")
            await trio.testing.wait_all_tasks_blocked()
            holding.pop(0).set()  # one run ends: one grant
            await trio.testing.wait_all_tasks_blocked()
        level = gate.scheduler.lane("echo/a").levels[0]
        assert len(level.vtime) <= 2 * len(level.flows) + 17  # newcomers gone leave no trace
        nursery.cancel_scope.cancel()
    heavy = sum(name.startswith("heavy") for name in granted)
    assert heavy >= 5, granted


async def test_a_run_waiting_as_data_ends_in_one_decision_for_whoever_decides(autojump_clock):
    """Gate.enter hands its waiting runs' ends to Gate.decide: a grant when room comes,
    an expiry at the queue deadline; a gate nobody decides for queues nothing."""
    gate = gate_with({"echo/a": 1})
    busy = gate.enter_now("busy", "echo/a")
    assert busy is not None
    with pytest.raises(RuntimeError, match=r"Gate\.decide"):
        gate.enter("nobody-decides", "echo/a")
    assert gate.statistics().queued == 0 and not gate.is_waiting("nobody-decides")
    decided: list[GateDecision] = []
    gate.decide = decided.append
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gate.expire_waiting)
        assert gate.enter("hasty", "echo/a", queue_timeout=1) is None
        assert gate.enter("patient", "echo/a", queue_timeout=60) is None
        await trio.sleep(2)
        (expired,) = decided
        assert isinstance(expired, Expired) and expired.borrower == "hasty"
        assert expired.rejected.reason is RejectReason.QUEUE_TIMEOUT
        busy.release()
        (_, admitted) = decided
        assert isinstance(admitted, Admitted) and admitted.borrower == "patient"
        admitted.permit.release()
        nursery.cancel_scope.cancel()
    assert gate.statistics().global_.borrowed == 0
