"""An adapter's replicas in the sans-IO scheduler: each a pool below its adapter, one
picked per run at its grant by the adapter's routing.

Hypothesis drives a scheduler with one adapter over three replicas (unequal limits,
budgets and weights) and one without, and checks after every step that

- no replica holds more runs than its limit nor more tokens than its budget (but for
  runs it held when a limit or budget was lowered), and what each counts is what the
  runs granted it hold;
- the adapter's pool, which bounds the sum, counts every run of its replicas;
- no run is granted a replica marked down (while one is up: with every replica down,
  runs go as if none were), and a run moved off a failed replica goes to another up
  that fits it, never back;
- no waiting head could start: some pool, or every replica, keeps it out.

The pickers are checked on their own: least loaded by weight and by the engine's own
queue, prefix affinity that is stable and bounded in load, round robin in turn.
"""

from __future__ import annotations

import collections
import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from iop_trio.model import RejectReason
from iop_trio.runtime.replicas import (
    BOUNDED_LOAD,
    ReplicaSet,
    ReplicaSpec,
    affinity_of,
)
from iop_trio.runtime.scheduler import Scheduler, Ticket, TicketState

REPLICAS = (  # name, limit, token budget, weight
    ReplicaSpec("http://a:8000", 2, 100, 1.0),
    ReplicaSpec("http://b:8000", 3, None, 2.0),
    ReplicaSpec("http://c:8000", None, 60, 1.0),
)


def scheduler(routing: str = "least_loaded", limit: int | None = 6) -> Scheduler:
    s = Scheduler(concurrency=8, max_queued=16, queue_timeout=5.0)
    s.add_adapter("r", limit)
    s.add_replicas("r", REPLICAS, routing)
    s.add_adapter("solo", 2)
    s.add_target("r/m", adapter="r", limit=8)
    s.add_target("solo/m", adapter="solo", limit=2)
    return s


def grant(s: Scheduler, key: int, *, cost: int = 0, affinity: int | None = None) -> Ticket:
    ticket = s.ticket(key, "r/m", cost=cost, affinity=affinity)
    assert s.admit(ticket, 0.0) is None
    return ticket


def replica_of(s: Scheduler, ticket: Ticket) -> str:
    assert ticket.replica is not None
    return s.replica_sets["r"].of_pool(ticket.replica).name


def test_least_loaded_takes_the_least_runs_per_weight_then_the_engines_queue():
    s = scheduler()
    names = [replica_of(s, grant(s, k)) for k in range(4)]
    # b has weight 2: it takes two for each one of a and c
    assert collections.Counter(names) == {
        "http://a:8000": 1,
        "http://b:8000": 2,
        "http://c:8000": 1,
    }
    s2 = scheduler()
    s2.replica_sets["r"].set_signals("http://a:8000", waiting=3, kv_use=0.5)
    s2.replica_sets["r"].set_signals("http://c:8000", waiting=0, kv_use=0.9)
    # a's engine has a queue: it is passed; between b and c, equal, b's cache is unknown
    first = [replica_of(s2, grant(s2, k)) for k in range(3)]
    assert "http://a:8000" not in first


def test_a_replica_down_gets_no_run_and_one_cleared_takes_the_waiting():
    s = scheduler(limit=None)
    s.mark_replica("r", "http://c:8000", True, 0.0)
    held = [grant(s, k) for k in range(5)]  # a (2) and b (3) fill up
    assert collections.Counter(replica_of(s, t) for t in held) == {
        "http://a:8000": 2,
        "http://b:8000": 3,
    }
    waiting = s.ticket(9, "r/m")
    assert s.admit(waiting, 0.0) is None
    assert waiting.state is TicketState.WAITING
    assert s.full_level(waiting, 0.0) == "replica"
    granted = s.mark_replica("r", "http://c:8000", False, 0.0)
    assert granted == [waiting]
    assert replica_of(s, waiting) == "http://c:8000"


def test_while_every_replica_is_down_runs_go_as_if_none_were():
    s = scheduler(limit=None)
    for spec in REPLICAS:
        s.mark_replica("r", spec.name, True, 0.0)
    ticket = grant(s, 1, cost=10)  # it tries an engine, and fails as a lone one would
    assert ticket.granted
    # but a run moved off a failed replica goes only to one that is up
    assert s.reroute(ticket, 0.0) is None
    s.mark_replica("r", "http://b:8000", False, 0.0)
    other = s.reroute(ticket, 0.0)
    assert other is not None and other.name == "http://b:8000"


def test_a_run_too_large_for_every_replica_is_refused_at_once():
    s = scheduler()
    s2 = Scheduler(concurrency=8, max_queued=16, queue_timeout=5.0)
    s2.add_adapter("r", None)
    s2.add_replicas(
        "r", [ReplicaSpec("http://a", token_budget=50), ReplicaSpec("http://b", token_budget=80)]
    )
    s2.add_target("r/m", adapter="r", limit=8)
    refusal = s2.admit(s2.ticket(1, "r/m", cost=90), 0.0)
    assert refusal is not None and refusal.reason is RejectReason.TOO_LARGE
    # b has no budget of its own in `s`: nothing is too large there
    assert s.admit(s.ticket(1, "r/m", cost=10_000), 0.0) is None


def test_reroute_moves_a_run_and_its_tokens_to_another_replica():
    s = scheduler()
    ticket = grant(s, 1, cost=40)
    first = s.replica_sets["r"].of_pool(ticket.replica)  # type: ignore[arg-type]
    s.mark_replica("r", first.name, True, 0.0)
    other = s.reroute(ticket, 0.0)
    assert other is not None and other is not first
    assert (first.pool.running, first.pool.reserved) == (0, 0)
    assert (other.pool.running, other.pool.reserved) == (1, 40)
    assert ticket.replica is other.pool
    s.release(ticket, 0.0)
    assert (other.pool.running, other.pool.reserved) == (0, 0)
    assert s.adapters["r"].running == 0


def test_prefix_affinity_is_stable_and_bounded_in_load():
    prompt = "You are a careful assistant. " * 100
    same = [affinity_of(None, [("system", prompt), ("user", f"question {i}")]) for i in range(5)]
    assert len(set(same)) == 1  # the tail past the prefix does not move it
    assert affinity_of("") is None
    assert affinity_of("a") != affinity_of("b")
    s = scheduler("prefix", limit=None)
    key = same[0]
    names = [replica_of(s, grant(s, k, affinity=key)) for k in range(6)]
    home = names[0]
    # the first runs of one prefix go home, then the bound hands them on
    assert names[:1] == [home]
    counts = collections.Counter(names)
    replicas = s.replica_sets["r"].replicas
    for r in replicas:
        assert counts[r.name] <= max(1, math.ceil(BOUNDED_LOAD * 6 / 4 * r.weight)) + 1
    assert len(counts) > 1
    # the same key on a fresh scheduler picks the same home (a stable hash)
    s2 = scheduler("prefix", limit=None)
    assert replica_of(s2, grant(s2, 1, affinity=key)) == home


def test_prefix_spreads_distinct_prefixes_over_the_replicas():
    s = scheduler("prefix", limit=None)
    homes = collections.Counter()
    for k in range(60):
        ticket = grant(s, k, affinity=affinity_of(f"family {k}"))
        homes[replica_of(s, ticket)] += 1
        s.release(ticket, 0.0)  # one at a time: no bound is met, each goes home
    assert len(homes) == 3
    assert min(homes.values()) >= 6


def test_round_robin_takes_each_replica_in_turn():
    s = scheduler("round_robin", limit=None)
    names = [replica_of(s, grant(s, k)) for k in range(6)]
    assert names == ["http://a:8000", "http://b:8000", "http://c:8000"] * 2


def test_replica_sets_refuse_bad_configuration():
    with pytest.raises(ValueError, match="routing"):
        ReplicaSet("r", REPLICAS, "fastest")
    with pytest.raises(ValueError, match="twice"):
        ReplicaSet("r", [ReplicaSpec("http://a"), ReplicaSpec("http://a")], "prefix")
    with pytest.raises(ValueError, match="weight"):
        ReplicaSet("r", [ReplicaSpec("http://a", weight=0)], "prefix")


class ReplicaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.routing = "least_loaded"
        self.s = scheduler()
        self.now = 0.0
        self.granted: list[Ticket] = []
        self.waiting: list[Ticket] = []
        self.kept: dict[int, list[Ticket]] = {}  # runs a replica held when lowered
        self.keys = 0

    def _took(self, granted: list[Ticket]) -> None:
        for ticket in granted:
            assert ticket.state is TicketState.GRANTED
            if ticket.lane.name == "r/m":
                replicas = self.s.replica_sets["r"]
                replica = replicas.of_pool(ticket.replica)  # type: ignore[arg-type]
                assert not replica.down or replicas.all_down, ticket
            self.waiting = [w for w in self.waiting if w is not ticket]
            self.granted.append(ticket)

    @rule(routing=st.sampled_from(["least_loaded", "prefix", "round_robin"]))
    def route(self, routing: str) -> None:
        self.s.replica_sets["r"].routing = routing

    @rule(
        where=st.sampled_from(["r/m", "r/m", "solo/m"]),
        cost=st.sampled_from([0, 10, 30, 50, 90]),
        family=st.integers(0, 3),
    )
    def submit(self, where: str, cost: int, family: int) -> None:
        self.keys += 1
        ticket = self.s.ticket(self.keys, where, cost=cost, affinity=affinity_of(f"f{family}"))
        refusal = self.s.admit(ticket, self.now)
        if refusal is not None:
            assert refusal.reason is not RejectReason.TOO_LARGE
            return
        if ticket.granted:
            self._took([ticket])
        else:
            self.waiting.append(ticket)

    @precondition(lambda self: bool(self.granted))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        ticket = data.draw(st.sampled_from(self.granted))
        self.granted.remove(ticket)
        self._took(self.s.release(ticket, self.now))

    @rule(which=st.integers(0, 2), down=st.booleans())
    def mark(self, which: int, down: bool) -> None:
        self._took(self.s.mark_replica("r", REPLICAS[which].name, down, self.now))

    @precondition(lambda self: any(t.replica is not None for t in self.granted))
    @rule(data=st.data())
    def fail_before_first_token(self, data: st.DataObject) -> None:
        ticket = data.draw(st.sampled_from([t for t in self.granted if t.replica is not None]))
        replicas = self.s.replica_sets["r"]
        failed = replicas.of_pool(ticket.replica)  # type: ignore[arg-type]
        self._took(self.s.mark_replica("r", failed.name, True, self.now))
        other = self.s.reroute(ticket, self.now)
        if other is None:
            assert ticket.replica is failed.pool
        else:
            assert other is not failed and not other.down
            assert ticket.replica is other.pool

    @rule(which=st.integers(0, 2), limit=st.sampled_from([0, 1, 2, 4, math.inf]))
    def learn_limit(self, which: int, limit: float) -> None:
        pool = self.s.replica_sets["r"].replicas[which].pool
        self.kept[id(pool)] = [t for t in self.granted if t.replica is pool]
        self._took(self.s.set_pool_limit(pool, limit, self.now))

    @rule(seconds=st.sampled_from([0.5, 2.0, 6.0]))
    def wait(self, seconds: float) -> None:
        self.now += seconds
        granted, expired = self.s.advance(self.now)
        for ticket, _ in expired:
            self.waiting.remove(ticket)
        self._took(granted)

    @invariant()
    def replicas_count_their_runs_within_bounds(self) -> None:
        adapter = self.s.adapters["r"]
        on_r = [t for t in self.granted if t.lane.name == "r/m"]
        assert adapter.running == len(on_r)
        assert adapter.running <= adapter.limit
        for replica in self.s.replica_sets["r"].replicas:
            pool = replica.pool
            held = [t for t in on_r if t.replica is pool]
            assert pool.running == len(held), pool
            assert pool.reserved == sum(t.cost for t in held), pool
            kept = sum(1 for t in self.kept.get(id(pool), ()) if t.granted)
            assert pool.running <= max(pool.limit, kept), pool
            assert pool.reserved <= pool.budget or len(held) <= 1, pool
        assert sum(r.pool.running for r in self.s.replica_sets["r"].replicas) == len(on_r)
        assert all(t.replica is None for t in self.granted if t.lane.name == "solo/m")

    @invariant()
    def no_waiting_head_could_start(self) -> None:
        for ticket in self.waiting:
            assert ticket.state is TicketState.WAITING
            flows = ticket.lane.levels[ticket.priority].flows[ticket.tenant]
            if next(iter(flows)) is not ticket:
                continue
            room = ticket.lane.has_room
            if ticket.lane.name == "r/m":
                replicas = self.s.replica_sets["r"]
                down_too = replicas.all_down
                room = room and any(
                    r.fits(ticket.cost, down_too=down_too) for r in replicas.replicas
                )
            assert not room, ticket


TestReplicas = ReplicaMachine.TestCase
TestReplicas.settings = settings(max_examples=300, stateful_step_count=40)
