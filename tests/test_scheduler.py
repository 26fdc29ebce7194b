"""The gate's policy on its own: Hypothesis drives the sans-IO scheduler directly, with
the time passed in and no Trio at all, and checks after every step that

- no pool holds more runs than its limit, nor more reserved tokens than its budget,
  and what each pool counts is what its granted runs hold;
- a run's usage is what its tenant's token rate is charged, once settled;
- no waiting run could start (the head of its tenant's flow, that fits everything);
- no run waits past its queue deadline;
- no run is starved by smaller ones: one that has waited ``hold_after`` and lacks a
  pool's tokens holds it (or one ranked before it does), and no run ranked after a
  holder takes tokens from the pool it holds;
- a refusal is ``too_large`` exactly when the run's cost is over a budget on its own.

The learned capacity is driven the same way: whatever the signals, its limit stays in
its bounds and its budget is a whole number of tokens or none.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from iop_trio.model import AutoConcurrency, EngineSignals, RejectReason, TenantLimits
from iop_trio.runtime.capacity import LearnedCapacity, RunSample
from iop_trio.runtime.scheduler import (
    TICKET_MOVES,
    Refusal,
    Scheduler,
    Ticket,
    TicketState,
)

TARGETS = {  # name: (adapter, limit, token budget)
    "x/a": ("x", 2, 60),
    "x/b": ("x", 3, None),
    "y/c": ("y", 2, 100),
}
ADAPTERS = {"x": (4, 90), "y": (None, None)}  # name: (limit, token budget)
TENANTS = {
    "t1": TenantLimits(concurrency=2, max_tokens_in_flight=70, tokens_per_minute=240),
    "t2": TenantLimits(weight=2),
    "t3": TenantLimits(tokens_per_minute=120),
}
HOLD_AFTER = 1.0


class CheckedScheduler(Scheduler):
    """Checks, at the moment of each grant, that the run takes no token a holder ranked
    before it keeps (the rule that keeps small runs from starving a large one)."""

    def _grant(self, ticket: Ticket, now: float, *, queued: bool) -> None:
        for pool in ticket.pools[1:]:
            kept = sum(
                h.cost
                for h in pool.holders
                if h is not ticket and h.rank < ticket.rank and h.state is TicketState.WAITING
            )
            alone = pool.reserved == 0 and kept == 0 and ticket.cost <= pool.static_budget
            assert pool.reserved + kept + ticket.cost <= pool.budget or alone, (ticket, pool)
        super()._grant(ticket, now, queued=queued)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.s = CheckedScheduler(
            concurrency=4,
            max_queued=8,
            queue_timeout=5.0,
            token_budget=150,
            hold_after=HOLD_AFTER,
        )
        for name, (limit, budget) in ADAPTERS.items():
            self.s.add_adapter(name, limit, token_budget=budget)
        for name, (adapter, limit, budget) in TARGETS.items():
            self.s.add_target(name, adapter=adapter, limit=limit, token_budget=budget)
        for name, share in TENANTS.items():
            self.s.set_tenant(name, share, self.now)
        self.granted: list[Ticket] = []
        self.waiting: list[Ticket] = []
        self.used: dict[str, int] = {t: 0 for t in TENANTS}  # settled usage, by tenant
        self.over: dict[str, list[Ticket]] = {}
        self.lowered: dict[int, list[Ticket]] = {}
        self.keys = 0

    def _took(self, granted: list[Ticket]) -> None:
        for ticket in granted:
            self.waiting = [w for w in self.waiting if w is not ticket]
            self.granted.append(ticket)

    @rule(
        where=st.sampled_from(sorted(TARGETS)),
        tenant=st.sampled_from(["", "t1", "t2", "t3"]),
        priority=st.sampled_from([0, 0, 1]),
        cost=st.sampled_from([0, 5, 20, 40, 55, 80, 120, 200]),
        queue_timeout=st.sampled_from([None, None, 0.0, 2.0]),
    )
    def submit(
        self, where: str, tenant: str, priority: int, cost: int, queue_timeout: float | None
    ) -> None:
        self.keys += 1
        ticket = self.s.ticket(
            self.keys,
            where,
            priority=priority,
            tenant=tenant,
            cost=cost,
            queue_timeout=queue_timeout,
        )
        over = [p for p in ticket.pools if cost > p.static_budget]
        before = list(self.granted)
        refusal = self.s.admit(ticket, self.now)
        if over:
            assert refusal is not None and refusal.reason is RejectReason.TOO_LARGE
            assert refusal.retry_after is None
            return
        if refusal is not None:
            assert refusal.reason is not RejectReason.TOO_LARGE, refusal
            assert ticket.state is TicketState.REFUSED
            return
        if ticket.state is TicketState.GRANTED:
            self._took([ticket])
        else:
            self.waiting.append(ticket)
        assert self.granted[: len(before)] == before

    @precondition(lambda self: bool(self.granted))
    @rule(data=st.data(), spent=st.floats(0, 1.5))
    def finish(self, data: st.DataObject, spent: float) -> None:
        ticket = data.draw(st.sampled_from(self.granted))
        used = round(ticket.cost * spent)
        self.granted.remove(ticket)
        if ticket.tenant.name in self.used:
            self.used[ticket.tenant.name] += used
        self._took(self.s.release(ticket, self.now, used))

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data())
    def withdraw(self, data: st.DataObject) -> None:
        ticket = data.draw(st.sampled_from(self.waiting))
        withdrawn, granted = self.s.withdraw(ticket.key, self.now)
        assert withdrawn is ticket
        self.waiting.remove(ticket)
        assert ticket.state is TicketState.WITHDRAWN
        self._took(granted)

    @rule(seconds=st.sampled_from([0.1, 0.5, 1.0, 2.5]))
    def wait(self, seconds: float) -> None:
        self.now += seconds
        granted, expired = self.s.advance(self.now)
        for ticket, refusal in expired:
            assert isinstance(refusal, Refusal)
            assert refusal.reason in (RejectReason.QUEUE_TIMEOUT, RejectReason.RATE_LIMITED)
            assert ticket.deadline <= self.now
            self.waiting.remove(ticket)
        self._took(granted)

    @rule(where=st.sampled_from(sorted(TARGETS)), limit=st.integers(0, 3))
    def set_limit(self, where: str, limit: int) -> None:
        # runs holding a place when a limit is lowered may stay over it until they end
        self.over[where] = [t for t in self.granted if t.lane.name == where]
        self._took(self.s.set_target_limit(where, limit, self.now))

    @rule(
        which=st.sampled_from(["adapter x", "target y/c", "node"]),
        budget=st.sampled_from([10, 30, 60, 1000, math.inf]),
    )
    def learn_budget(self, which: str, budget: float) -> None:
        kind, _, name = which.partition(" ")
        pool = (
            self.s.node
            if kind == "node"
            else self.s.adapters[name]
            if kind == "adapter"
            else self.s.lanes[name].target
        )
        # runs holding tokens when a budget is lowered may stay over it until they end
        self.lowered[id(pool)] = [t for t in self.granted if pool in t.pools]
        self._took(self.s.set_pool_budget(pool, budget, self.now))
        assert pool.budget == min(budget, pool.static_budget)

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def pools_count_what_their_runs_hold_within_bounds(self) -> None:
        pools: dict[int, tuple[object, list[Ticket]]] = {}
        for ticket in self.granted:
            assert ticket.state is TicketState.GRANTED
            for pool in ticket.pools:
                pools.setdefault(id(pool), (pool, []))[1].append(ticket)
        every = [self.s.node, *self.s.adapters.values()]
        every += [lane.target for lane in self.s.lanes.values()]
        every += [t.pool for t in self.s.tenants.values()]
        for pool in every:
            held = pools.get(id(pool), (pool, []))[1]
            assert pool.running == len(held), pool
            assert pool.reserved == sum(t.cost for t in held), pool
            assert pool.reserved <= pool.static_budget, pool
            # a learned budget bounds what runs share: one run alone may be over it
            kept = [t for t in self.lowered.get(id(pool), ()) if t.granted]
            alone = sum(1 for t in held if t.cost) <= 1
            assert pool.reserved <= pool.budget or alone or kept, pool
        for lane in self.s.lanes.values():
            kept = sum(1 for t in self.over.get(lane.name, ()) if t.granted)
            assert lane.target.running <= max(lane.target.limit, kept), lane

    @invariant()
    def a_tenants_rate_is_charged_what_its_runs_used(self) -> None:
        for name in TENANTS:
            in_flight = sum(t.cost for t in self.granted if t.tenant.name == name)
            assert self.s.tenants[name].charged == self.used[name] + in_flight

    @invariant()
    def no_waiting_head_could_start(self) -> None:
        for ticket in self.waiting:
            assert ticket.state is TicketState.WAITING
            assert ticket.deadline > self.now
            flows = ticket.lane.levels[ticket.priority].flows[ticket.tenant]
            if next(iter(flows)) is not ticket:
                continue  # FIFO within a tenant and priority
            fits = (
                ticket.tenant.ready(ticket.cost, self.now)
                and ticket.lane.has_room
                and all(p.fits_tokens(ticket.cost) for p in ticket.pools)
            )
            kept = any(
                not p.fits_tokens(ticket.cost, p.kept_from(ticket)) for p in ticket.pools[1:]
            )
            assert not fits or kept, ticket

    @invariant()
    def the_next_wakeup_is_after_now(self) -> None:
        """The gate's expiry task sleeps until :meth:`wakeup`: a time at or before now
        would make it spin (it did, when a head past its hold bound had no room)."""
        assert self.s.wakeup(self.now) > self.now

    @invariant()
    def a_starving_run_keeps_room(self) -> None:
        """A waiting head, ready but for tokens it lacks, that has waited hold_after keeps
        room in its pools; holders are only such runs."""
        for ticket in self.waiting:
            flows = ticket.lane.levels[ticket.priority].flows[ticket.tenant]
            ready = (
                next(iter(flows)) is ticket
                and ticket.tenant.ready(ticket.cost, self.now)
                and ticket.lane.has_room
            )
            lacks = any(not p.fits_tokens(ticket.cost) for p in ticket.pools[1:])
            if ready and lacks and self.now - ticket.enqueued >= HOLD_AFTER:
                assert ticket.holding, ticket
        pools = [self.s.node, *self.s.adapters.values()]
        pools += [lane.target for lane in self.s.lanes.values()]
        for pool in pools:
            for holder in pool.holders:
                assert holder.state is TicketState.WAITING and holder.holding, (pool, holder)
            assert pool.holders == sorted(pool.holders, key=lambda h: h.rank)


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=400, stateful_step_count=50)


def test_every_move_a_ticket_makes_is_in_the_table():
    assert TICKET_MOVES[TicketState.NEW] == {
        TicketState.GRANTED,
        TicketState.WAITING,
        TicketState.REFUSED,
    }
    s = Scheduler(concurrency=1, max_queued=1, queue_timeout=1)
    s.add_adapter("x", None)
    s.add_target("x/a", adapter="x", limit=1)
    ticket = s.ticket("k", "x/a")
    assert s.admit(ticket, 0.0) is None and ticket.state is TicketState.GRANTED
    with pytest.raises(RuntimeError, match="cannot go from granted to waiting"):
        ticket.move(TicketState.WAITING)


def test_a_large_run_past_its_bound_is_not_passed_by_small_ones():
    """The rule, played out: a budget of 100, a run of 90 behind runs of 30."""
    s = Scheduler(concurrency=10, max_queued=100, queue_timeout=100, hold_after=1.0)
    s.add_adapter("x", None)
    s.add_target("x/a", adapter="x", limit=10, token_budget=100)
    small = [s.ticket(f"s{i}", "x/a", tenant="small", cost=30) for i in range(3)]
    for ticket in small:
        assert s.admit(ticket, 0.0) is None and ticket.granted
    large = s.ticket("large", "x/a", tenant="large", cost=90)
    assert s.admit(large, 0.0) is None and large.state is TicketState.WAITING
    more = [s.ticket(f"m{i}", "x/a", tenant="small", cost=30) for i in range(4)]
    for ticket in more:
        s.admit(ticket, 0.0)
    # before the bound, a small one may pass it when one small one ends
    assert s.release(small[0], 0.5, 30) == [more[0]]
    # past it, nothing smaller takes the tokens it lacks: they only come free
    assert s.release(small[1], 1.5, 30) == []
    assert s.release(small[2], 1.6, 30) == []
    assert s.release(more[0], 1.7, 30) == [large]
    assert s.release(large, 2.0, 90) == more[1:]  # the small ones go on after it


def test_a_run_over_a_budget_on_its_own_is_too_large_at_once():
    s = Scheduler(concurrency=10, max_queued=100, queue_timeout=100, token_budget=500)
    s.add_adapter("x", None, token_budget=300)
    s.add_adapter("y", None)
    s.add_target("x/a", adapter="x", limit=10, token_budget=200)
    s.add_target("x/b", adapter="x", limit=10)
    s.add_target("y/c", adapter="y", limit=10)
    s.set_tenant("t", TenantLimits(max_tokens_in_flight=100), 0.0)
    # the most specific budget it is over is named
    for cost, target, where in [
        (600, "y/c", "node's"),
        (400, "x/b", "adapter x's"),
        (250, "x/a", "target x/a's"),
    ]:
        refusal = s.admit(s.ticket(cost, target, cost=cost), 0.0)
        assert refusal is not None and refusal.reason is RejectReason.TOO_LARGE
        assert where in refusal.message and "could never start" in refusal.message
    refusal = s.admit(s.ticket("t", "x/a", tenant="t", cost=150), 0.0)
    assert refusal is not None and "tenant 't''s max_tokens_in_flight of 100" in refusal.message


def test_a_tenant_over_its_token_rate_waits_for_its_refill_or_is_rate_limited():
    s = Scheduler(concurrency=10, max_queued=100, queue_timeout=10)
    s.add_adapter("x", None)
    s.add_target("x/a", adapter="x", limit=10)
    s.set_tenant("t", TenantLimits(tokens_per_minute=60), 0.0)  # a token a second
    first = s.ticket(1, "x/a", tenant="t", cost=60)
    assert s.admit(first, 0.0) is None and first.granted  # the bucket was full
    second = s.ticket(2, "x/a", tenant="t", cost=5)
    assert s.admit(second, 0.0) is None and second.state is TicketState.WAITING
    assert s.wakeup(0.0) == pytest.approx(5.0)  # when its five tokens are back
    s.release(first, 1.0, 20)  # it used 20 of its 60: 40 come back
    assert second.granted
    far = s.ticket(3, "x/a", tenant="t", cost=60)  # 60 more: 60 s away, past its 10 s
    refusal = s.admit(far, 1.0)
    assert refusal is not None and refusal.reason is RejectReason.RATE_LIMITED
    assert refusal.retry_after is not None and refusal.retry_after > 10


@pytest.mark.parametrize("signal", ["engine", "latency"])
def test_a_learned_capacity_stays_in_its_bounds_whatever_it_is_told(signal):
    rng = random.Random(7)
    auto = AutoConcurrency(minimum=2, maximum=40)
    learned = LearnedCapacity(auto, signal=signal, now=0.0, rng=random.Random(1))
    now = 0.0
    for _ in range(2000):
        now += rng.choice([0.05, 0.5, 1.0, 5.0])
        running = rng.randint(0, 60)
        reserved = rng.randint(0, 8000)
        if signal == "engine":
            signals = rng.choice(
                [
                    None,
                    EngineSignals(rng.choice([0, 0, 3]), None, rng.random(), now),
                    EngineSignals(0, running, None, now - 10),
                ]
            )
            learned.on_engine(
                signals, now, running=running, reserved=reserved, queued=rng.randint(0, 5)
            )
        else:
            cost = rng.randint(0, max(0, reserved))
            granted = now - rng.uniform(0, 10)
            sample = RunSample(rng.uniform(0.01, 5), running, reserved, cost, granted)
            what = rng.choice(["first", "end", "waiting", "tick"])
            if what == "first":
                learned.on_first_token(sample, now)
            elif what == "end":
                learned.on_run_end(rng.choice([None, rng.uniform(0.005, 0.1)]))
            elif what == "waiting":
                learned.on_waiting(rng.uniform(0, 30), sample, now)
            else:
                learned.on_tick(
                    now,
                    running=running,
                    reserved=reserved,
                    queued=rng.randint(0, 5),
                    smallest=rng.choice([None, rng.randint(0, 2000)]),
                )
        assert auto.minimum <= learned.limit <= auto.maximum
        assert learned.budget == math.inf or (learned.budget >= 1 and learned.budget % 1 == 0)
    assert sum(learned.moves.values()) > 0
