"""The gate's value types, sans I/O: the pools runs take from, the tickets that stand for
runs, the tenants they are for, and each target's lane of waiting runs with its
fair-queueing levels (start-time fair queueing by run count).

The rules that move tickets between these are in :mod:`.scheduler` (its module docstring
says them in full); this module holds the state they act on and the small local rules
of one object each (whether a pool has room, the order of one level's flows). Like the
scheduler it imports only the model: no I/O, no clock (``now`` is passed in).

Tickets move through the states of :data:`TICKET_MOVES`; a move not in it is a bug and
raises.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Generator, Mapping

import attrs

from ..model import RejectReason, TokenBucket, clamp_retry_after

INF = math.inf
#: Gaps between grants a target must have seen before its wait is estimated for early
#: rejection.
EARLY_MIN_SAMPLES = 8
#: Seconds a run that lacks a pool's tokens may be passed by smaller runs before it holds
#: that pool (see the module docstring).
HOLD_AFTER = 1.0
#: The most tenants' heads looked at in one priority level of one target per grant.
BACKFILL = 16


class TicketState(enum.Enum):
    """Where a run is in the gate."""

    NEW = "new"  # made, not yet granted, queued or refused
    WAITING = "waiting"  # in the queue
    GRANTED = "granted"  # holds its place in every pool
    REFUSED = "refused"  # turned away without waiting
    WITHDRAWN = "withdrawn"  # taken out of the queue by its owner (a cancel, a drain)
    EXPIRED = "expired"  # its queue deadline passed
    RELEASED = "released"  # it ended and gave its place back


#: The moves a ticket may make; the states not listed as keys are final.
TICKET_MOVES: Mapping[TicketState, frozenset[TicketState]] = {
    TicketState.NEW: frozenset({TicketState.GRANTED, TicketState.WAITING, TicketState.REFUSED}),
    TicketState.WAITING: frozenset(
        {TicketState.GRANTED, TicketState.WITHDRAWN, TicketState.EXPIRED}
    ),
    TicketState.GRANTED: frozenset({TicketState.RELEASED}),
}


@attrs.frozen
class Refusal:
    """Why a run is turned away, in words, and seconds until one like it would likely get
    in (None: never, as it is)."""

    reason: RejectReason
    message: str
    retry_after: float | None


@attrs.define(eq=False)
class Pool:
    """One level runs take from: runs at once (``limit``) and tokens reserved at once
    (``budget``); ``math.inf`` bounds nothing. A limit lowered under what is held lets
    the holders finish. ``holders``: the waiting runs that keep room here (module
    docstring), by rank."""

    name: str
    limit: float = INF
    budget: float = INF
    running: int = 0
    reserved: int = 0
    holders: list[Ticket] = attrs.field(factory=list)
    #: its runs' tokens are counted even with no budget (one is being learned)
    counts_tokens: bool = False
    #: the budget configured (``budget`` is the one in force: a learned one may be lower)
    static_budget: float = INF

    def __attrs_post_init__(self) -> None:
        self.static_budget = self.budget

    def __repr__(self) -> str:
        return (
            f"<Pool {self.name} runs={self.running}/{self.limit:g} "
            f"tokens={self.reserved}/{self.budget:g}>"
        )

    @property
    def has_room(self) -> bool:
        return self.running < self.limit

    def fits_tokens(self, cost: int, kept: int = 0) -> bool:
        """Whether ``cost`` more tokens fit, beside ``kept`` that holders keep free. Over
        a *learned* budget (lower than the configured one) a run fits a pool that holds
        nothing: a learned budget bounds what runs share, it never shuts one out."""
        taken = self.reserved + kept
        return taken + cost <= self.budget or (taken == 0 and cost <= self.static_budget)

    def take(self, cost: int) -> None:
        """A run reserving ``cost`` tokens holds a place here now."""
        self.running += 1
        self.reserved += cost

    def give_back(self, cost: int) -> None:
        """A run reserving ``cost`` tokens holds its place here no more."""
        self.running -= 1
        self.reserved -= cost

    def kept_from(self, ticket: Ticket) -> int:
        """The tokens the holders ranked before ``ticket`` keep free for themselves."""
        return sum(h.cost for h in self.holders if h is not ticket and h.rank < ticket.rank)


@attrs.define(eq=False)
class Rate:
    """Grants a second, as a moving average of the time between grants."""

    interval: float | None = None
    last: float | None = None
    samples: int = 0

    def tick(self, now: float, *, since: float | None = None) -> None:
        """A grant at ``now``. The gap since the last grant is a sample; ``since``, when
        given, is when the gap may start at the earliest (a target's gaps count only
        while runs wait there, so an idle spell does not look like slow service)."""
        begin = self.last if since is None or self.last is None else max(self.last, since)
        if begin is not None:
            gap = now - begin
            self.interval = gap if self.interval is None else 0.8 * self.interval + 0.2 * gap
            self.samples += 1
        self.last = now

    def wait_for(self, ahead: int, fallback: float) -> float:
        """Seconds until ``ahead`` more grants, at the recent rate (``fallback`` if none)."""
        guess = fallback if self.interval is None else (ahead + 1) * self.interval
        return clamp_retry_after(guess)


@attrs.define(eq=False)
class Tenant:
    """Who runs are for: a fair-queueing weight, a queue bound, a pool (its concurrency
    and ``max_tokens_in_flight``) and an optional token rate."""

    name: str
    weight: float = 1.0
    max_queued: int | None = None
    pool: Pool = attrs.Factory(lambda self: Pool(f"tenant:{self.name}"), takes_self=True)
    bucket: TokenBucket | None = None
    queued: int = 0  # waiting runs of this tenant, node-wide
    configured: bool = False  # set by set_tenant; others are forgotten when idle
    #: tokens charged to its rate so far: what its runs reserved, corrected as they settle
    charged: int = 0

    def __repr__(self) -> str:
        return f"<Tenant {self.name!r} weight={self.weight:g} queued={self.queued} {self.pool!r}>"

    @property
    def idle(self) -> bool:
        return not self.configured and not self.queued and not self.pool.running

    def rate_ready(self, cost: int, now: float) -> bool:
        """Whether its token rate lets a run of ``cost`` start now: the bucket holds the
        cost (or, for a run larger than a minute's worth, is full)."""
        return self.bucket is None or self.bucket.level(now) >= min(cost, self.bucket.size)

    def ready(self, cost: int, now: float) -> bool:
        """Whether a run of ``cost`` of this tenant may start as far as the tenant goes."""
        return self.pool.has_room and self.pool.fits_tokens(cost) and self.rate_ready(cost, now)


@attrs.define(eq=False)
class Ticket:
    """One run in the gate: who it is (``key``, the caller's), where it goes, what it
    costs, and its state (:data:`TICKET_MOVES`)."""

    key: object
    lane: Lane
    tenant: Tenant
    priority: int
    order: int
    cost: int = 0
    timeout: float = INF
    enqueued: float = 0.0  # when it began to wait
    deadline: float = INF
    state: TicketState = TicketState.NEW
    #: it keeps room in its pools (module docstring: small runs do not starve a large one)
    holding: bool = False
    #: each pool's (runs, reserved tokens) once it was granted, itself included, and when
    at_grant: tuple[tuple[int, int], ...] = ()
    granted_at: float | None = None
    #: the hash of its prompt's leading characters (prefix routing), if any
    affinity: int | None = None
    #: the pool of the replica it was granted, where its adapter has replicas
    replica: Pool | None = None

    def __repr__(self) -> str:
        return (
            f"<Ticket {self.key!r} {self.lane.name} {self.state.value} p={self.priority} "
            f"cost={self.cost}>"
        )

    @property
    def granted(self) -> bool:
        """Whether it holds its place in every pool now."""
        return self.state is TicketState.GRANTED

    @property
    def rank(self) -> tuple[int, int]:
        """The order runs go in across targets, and holds rank by: priority, then age."""
        return (-self.priority, self.order)

    def move(self, to: TicketState) -> None:
        if to not in TICKET_MOVES.get(self.state, frozenset()):
            raise RuntimeError(f"ticket {self!r} cannot go from {self.state.value} to {to.value}")
        self.state = to

    @property
    def pools(self) -> tuple[Pool, ...]:
        """Its four pools, most specific first, and once granted its replica's pool, if
        its adapter has replicas (which one is decided at the grant)."""
        lane = self.lane
        pools = (self.tenant.pool, lane.target, lane.adapter, lane.node)
        return pools if self.replica is None else (*pools, self.replica)

    def full_level(self, now: float) -> str:
        """Which level keeps it from starting now: the first of its pools, most specific
        first (``tenant``, ``target``, ``adapter``, ``global``), with no room for one
        more run or for its tokens; ``tenant`` too for a tenant over its token rate;
        ``queue`` when every level has room (runs ranked before it go first, or holders
        keep the tokens it would take). Looks at four pools: cheap. (A replica with no
        room is the scheduler's to say: :meth:`~.scheduler.Scheduler.full_level`.)"""
        for level, pool in zip(LEVELS, self.pools[:4], strict=True):
            if not pool.has_room or not pool.fits_tokens(self.cost):
                return level
        return "queue" if self.tenant.rate_ready(self.cost, now) else "tenant"


#: The names of a ticket's pools' levels, in :attr:`Ticket.pools`' order.
LEVELS = ("tenant", "target", "adapter", "global")


@attrs.define(eq=False)
class Level:
    """The waiting runs of one priority at one target: a FIFO flow per tenant, the
    virtual times of start-time fair queueing, and a heap of the flows' heads by
    (virtual time, arrival), so a grant costs O(log tenants).

    Heap entries are not updated in place: a flow whose head or time changes gets a new
    entry, and an entry that no longer matches its flow is dropped when met.
    """

    flows: dict[Tenant, dict[Ticket, None]] = attrs.field(factory=dict)
    vtime: dict[Tenant, float] = attrs.field(factory=dict)
    # the level's virtual time: a grant moves it by 1 / the waiting tenants' weights
    clock: float = 0.0
    weights: float = 0.0  # of the waiting tenants, as they were when each began to wait
    entered: dict[Tenant, float] = attrs.field(factory=dict)  # each one's weight then
    heap: list[tuple[float, int, int, Tenant]] = attrs.field(factory=list)
    pushes: int = 0
    size: int = 0  # waiting runs

    def add(self, ticket: Ticket) -> None:
        self.size += 1
        tenant = ticket.tenant
        flow = self.flows.get(tenant)
        if flow is None:  # the tenant becomes backlogged: it saved up nothing meanwhile
            self.vtime[tenant] = max(self.vtime.get(tenant, 0.0), self.clock)
            flow = self.flows[tenant] = {}
            flow[ticket] = None
            self.entered[tenant] = tenant.weight
            self.weights += tenant.weight
            self._push(tenant)
        else:
            flow[ticket] = None

    def remove(self, ticket: Ticket) -> None:
        self.size -= 1
        tenant = ticket.tenant
        flow = self.flows[tenant]
        was_head = next(iter(flow)) is ticket
        del flow[ticket]
        if not flow:
            self._idle(tenant)
        elif was_head:
            self._push(tenant)

    def _idle(self, tenant: Tenant) -> None:
        """``tenant`` has no more runs waiting here."""
        del self.flows[tenant]
        self.weights -= self.entered.pop(tenant)
        if len(self.vtime) > 2 * len(self.flows) + 16:
            # times of tenants gone idle that the clock has passed mean nothing now
            self.vtime = {t: v for t, v in self.vtime.items() if t in self.flows or v > self.clock}

    def _push(self, tenant: Tenant) -> None:
        head = next(iter(self.flows[tenant]))
        self.pushes += 1
        heapq.heappush(self.heap, (self.vtime[tenant], head.order, self.pushes, tenant))
        if len(self.heap) > 2 * len(self.flows) + 16:  # mostly stale: rebuild
            self.heap = [e for e in self.heap if self._current(e)]
            heapq.heapify(self.heap)

    def _current(self, entry: tuple[float, int, int, Tenant]) -> bool:
        vtime, order, _, tenant = entry
        flow = self.flows.get(tenant)
        return flow is not None and self.vtime[tenant] == vtime and next(iter(flow)).order == order

    def heads(self, now: float, most: int) -> Generator[Ticket, None, None]:
        """Up to ``most`` flows' heads whose tenant is ready for them, in fair order (the
        smallest virtual time first, the older head on a tie), found as they are asked
        for: a caller that stops at the first costs one heap look."""
        heap = self.heap
        taken = []
        found = 0
        try:
            while heap and found < most:
                entry = heap[0]
                if not self._current(entry):
                    heapq.heappop(heap)
                    continue
                taken.append(heapq.heappop(heap))
                head = next(iter(self.flows[entry[3]]))
                if entry[3].ready(head.cost, now):
                    found += 1
                    yield head
        finally:  # the caller may stop early: the heap is put back either way
            for entry in taken:
                heapq.heappush(heap, entry)

    def ahead_of(self, tenant: Tenant) -> int:
        """How many of the runs waiting here would start before a new run of ``tenant``
        (by their start tags; blocked tenants are counted as if they were not)."""
        flow = self.flows.get(tenant)
        if flow is None:
            start = max(self.vtime.get(tenant, 0.0), self.clock)
            ahead = 0
        else:
            start = self.vtime[tenant] + len(flow) / tenant.weight
            ahead = len(flow)
        for other, other_flow in self.flows.items():
            if other is not tenant and self.vtime[other] <= start:
                # start tags vtime + j / weight <= start go first (older on a tie)
                later = math.floor((start - self.vtime[other]) * other.weight + 1e-9) + 1
                ahead += min(len(other_flow), later)
        return ahead

    def served(self, ticket: Ticket) -> None:
        """``ticket`` (its flow's head) is granted. The clock moves on by 1 / the waiting
        tenants' weights, and at least to the start of the run served: so it keeps pace
        with the tenants' own times, and a stream of newcomers (each starting at the
        clock) cannot keep a backlogged tenant waiting."""
        tenant = ticket.tenant
        self.clock = max(self.clock + 1.0 / self.weights, self.vtime[tenant])
        self.vtime[tenant] += 1.0 / tenant.weight
        self.size -= 1
        flow = self.flows[tenant]
        del flow[ticket]
        if flow:
            self._push(tenant)
        else:
            self._idle(tenant)


@attrs.define(eq=False)
class Lane:
    """One target: its pool, its adapter's and the node's, and its waiting runs."""

    name: str
    adapter_name: str
    target: Pool
    adapter: Pool
    node: Pool
    max_queued: int | None
    queue_timeout: float | None
    levels: dict[int, Level] = attrs.field(factory=dict)
    waiting: int = 0
    rate: Rate = attrs.field(factory=Rate)
    backlogged_since: float = 0.0  # when the lane last went from no waiters to some

    def __repr__(self) -> str:
        return f"<Lane {self.name} waiting={self.waiting} {self.target!r}>"

    @property
    def has_room(self) -> bool:
        """Whether its target, adapter and node pools can take one more run."""
        return self.target.has_room and self.adapter.has_room and self.node.has_room

    def estimated_wait(self, priority: int, tenant: Tenant) -> float | None:
        """Seconds a new run of ``priority`` and ``tenant`` would likely wait: the runs
        that would start before it, plus one, times the recent time between grants here
        (None until :data:`EARLY_MIN_SAMPLES` gaps have been seen)."""
        if self.rate.interval is None or self.rate.samples < EARLY_MIN_SAMPLES:
            return None
        ahead = sum(level.size for p, level in self.levels.items() if p > priority)
        level = self.levels.get(priority)
        if level is not None:
            ahead += level.ahead_of(tenant)
        return (ahead + 1) * self.rate.interval

    def candidates(self, now: float) -> Generator[Ticket, None, None]:
        """Its waiting runs whose tenant is ready for them, in the order they should go:
        priority, then fair, then oldest (at most :data:`BACKFILL` a level)."""
        for priority in sorted(self.levels, reverse=True):
            yield from self.levels[priority].heads(now, BACKFILL)


@attrs.frozen
class PoolStats:
    limit: float  # math.inf = unbounded
    running: int
    budget: float = INF
    reserved: int = 0


def pool_stats(pool: Pool) -> PoolStats:
    return PoolStats(pool.limit, pool.running, pool.budget, pool.reserved)
