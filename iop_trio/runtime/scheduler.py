"""The gate's policy, sans I/O: which waiting run starts, which is turned away, and why.

Everything the gate decides is decided here, in synchronous code that imports only the
model and is given the time (``now``); every operation returns its decisions (the runs
it granted, the runs whose deadline passed) for the Trio shell (:mod:`.gate`) to carry
out. So the rules can be read in one place and driven directly by tests, with no
clock and no tasks.

**Pools.** A run takes from four pools: its tenant's, its target's, its adapter's and
the node's (and where its adapter has replicas, one replica's, picked as it is granted:
:mod:`.replicas`; a run waits while none fits it). Each pool bounds the runs it holds at
once (``limit``; ``math.inf`` for none) and the tokens they reserve at once (``budget``;
``math.inf`` for none). A run *fits* a pool if one more run stays within the limit and
its ``cost`` (its prompt tokens plus the most output tokens it may make; 0 where no
token rule applies) within the budget. A tenant may also have a token rate
(``tokens_per_minute``): a bucket of a minute's worth, which a run's cost is charged to
when it starts (the bucket may go into a debt by one run larger than what is left) and
corrected at settlement by what the run really used. A run starts only when it fits all
four pools and its tenant's bucket is not in debt by more than its cost allows (see
:meth:`Tenant.ready`).

**Admission** (:meth:`Scheduler.admit`):

- a run whose cost is over a budget it needs, on its own, is refused ``too_large`` at
  once: it could never start;
- a run that fits now starts now (nothing waiting could use that room: the scheduler
  grants until nothing that waits can start);
- else a full queue (node-wide ``max_queued``, the target's, the tenant's) refuses it
  ``queue_full``; a queue timeout of 0 refuses it ``queue_timeout``; a tenant whose
  bucket could not refill the run's cost within its queue timeout refuses it
  ``rate_limited``, with the time it would take as the hint; with early rejection, an
  estimated wait over its timeout refuses it ``queue_timeout``;
- else it waits, at most its queue timeout (the smaller of its own and its target's or
  the node's). At its deadline it is refused ``rate_limited`` if its tenant's token rate
  or tokens in flight held it back then, else ``queue_timeout``.

**Order.** Waiting runs are ordered within a target by priority (higher first), then
between the tenants of one priority by start-time fair queueing by run count, then FIFO
within a tenant: each tenant's flow at a (target, priority) carries a virtual time, a
grant adds 1/weight to it, the flow with the smallest time goes next (the older head on
a tie), a flow that becomes backlogged starts at the level's clock, which every grant
moves on by 1 / the waiting tenants' weights, so no tenant saves up credit while idle.
Across targets the highest priority goes first, the oldest on a tie. A run whose
tenant, target or adapter cannot take it never blocks one that could start (no
head-of-line blocking); FIFO within a tenant and priority always holds.

**Small runs do not starve a large one.** A run that waits because it does not fit a
pool's *token budget* may be passed by runs that do, for ``hold_after`` seconds. After
that it *holds* room: in every pool with a budget that it takes from, its cost is kept
free for it, so a run ranked after it (lower priority, or the same priority and
younger) fits that pool only in the tokens left beyond what the holders ranked before
it keep. The tokens it lacks then only come free, so it starts as soon as enough of the
runs that hold them end (its cost fits each budget on its own, or it would have been
refused ``too_large``). Holders rank as runs do: the one ranked first keeps room from
everyone after it and is kept from by no one, so holders cannot block each other for
ever. A run of higher priority may still pass a holder, as strict priority always may.

**Cost.** A grant looks at each target with waiters, in each at its priority levels
and, in a level, at most :data:`BACKFILL` tenants' heads: O(targets x priorities x
BACKFILL x log tenants), whatever the number of waiting runs.

Tickets move through the states of :data:`TICKET_MOVES`; a move not in it is a bug and
raises. The value types (pools, tickets, tenants, lanes and their fair-queueing levels)
are in :mod:`.tickets`, which imports only the model too; this module holds the
:class:`Scheduler` that moves them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from contextlib import closing

from ..model import (
    RejectReason,
    TenantLimits,
    TokenBucket,
    UnknownTarget,
    check_limit,
    check_seconds,
    check_tenant_limits,
    clamp_retry_after,
)
from .refusals import expired, queue_full
from .replicas import Replica, ReplicaSet, ReplicaSpec
from .tickets import (
    HOLD_AFTER,
    INF,
    TICKET_MOVES,
    Lane,
    Level,
    Pool,
    PoolStats,
    Rate,
    Refusal,
    Tenant,
    Ticket,
    TicketState,
    pool_stats,
)

# The value types live in .tickets; these are re-exported, as the gate and the tests have
# always imported them from here.
__all__ = [
    "HOLD_AFTER",
    "INF",
    "TICKET_MOVES",
    "Pool",
    "PoolStats",
    "Refusal",
    "Scheduler",
    "Ticket",
    "TicketState",
    "pool_stats",
]


class Scheduler:
    """The policy of the module docstring, for one node. Not thread-safe; the time is
    passed in, in seconds of any one clock.

    Every operation that can let waiting runs start returns the tickets it granted, in
    the order granted; the caller gives each its permit. Limits and budgets may change
    at any time (``set_*``): lowering one lets holders finish, raising one grants at once.
    """

    def __init__(
        self,
        *,
        concurrency: int,
        max_queued: int,
        queue_timeout: float,
        early_reject: bool = False,
        token_budget: int | None = None,
        hold_after: float = HOLD_AFTER,
    ) -> None:
        self.early_reject = early_reject
        self.hold_after = check_seconds("hold_after", hold_after)
        self.node = Pool(
            "node", check_limit("concurrency", concurrency), _budget("token_budget", token_budget)
        )
        self.max_queued = check_limit("max_queued", max_queued)
        self.queue_timeout = check_seconds("queue_timeout", queue_timeout)
        self.adapters: dict[str, Pool] = {}
        self.replica_sets: dict[str, ReplicaSet] = {}  # by adapter, where it has replicas
        self._adapter_caps: dict[str, int | None] = {}
        self.lanes: dict[str, Lane] = {}
        self._busy: dict[Lane, None] = {}  # lanes with waiters, for dispatch in O(targets)
        self._waiting: dict[object, Ticket] = {}  # waiting tickets by key
        # waiting runs' deadlines, earliest first; stale entries dropped when met
        self._deadlines: list[tuple[float, int, Ticket]] = []
        self.tenants: dict[str, Tenant] = {}
        self.queued = 0
        self._order = 0
        self.rate = Rate()  # grants, node-wide
        self.running_by_priority: dict[int, int] = {}
        # whether any token rule is set (a budget, a tenant's token rate): holds and
        # refills matter only then
        self.tokens_in_use = self.node.budget < INF

    def __repr__(self) -> str:
        return (
            f"<Scheduler {self.node!r} queued={self.queued}/{self.max_queued} "
            f"adapters={len(self.adapters)} targets={len(self.lanes)}>"
        )

    # --- configuration -------------------------------------------------------------------

    def add_adapter(
        self,
        name: str,
        limit: int | None,
        *,
        max_concurrency: int | None = None,
        token_budget: int | None = None,
    ) -> Pool:
        """Register an adapter pool. Its limit is the smaller of ``limit`` and
        ``max_concurrency`` (the adapter's capability); None for both = unbounded."""
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is already registered")
        if max_concurrency is not None:
            check_limit(f"adapter {name!r} max_concurrency", max_concurrency)
        self._adapter_caps[name] = max_concurrency
        pool = Pool(
            f"adapter:{name}",
            self._adapter_limit(name, limit),
            _budget(f"adapter {name!r} token_budget", token_budget),
        )
        self.adapters[name] = pool
        self._note_tokens()
        return pool

    def add_replicas(
        self, adapter: str, specs: Sequence[ReplicaSpec], routing: str = "least_loaded"
    ) -> ReplicaSet:
        """Spread ``adapter``'s runs over replicas (:mod:`.replicas`), each a pool below it."""
        if adapter not in self.adapters or adapter in self.replica_sets:
            raise ValueError(f"adapter {adapter!r} is unknown or has its replicas already")
        replicas = self.replica_sets[adapter] = ReplicaSet(adapter, specs, routing)
        self._note_tokens()
        return replicas

    def add_target(
        self,
        name: str,
        *,
        adapter: str,
        limit: int,
        max_queued: int | None = None,
        queue_timeout: float | None = None,
        token_budget: int | None = None,
    ) -> Lane:
        """Register a target under ``adapter``; ``max_queued`` bounds its waiting runs too,
        ``queue_timeout`` replaces the node's for it."""
        if name in self.lanes:
            raise ValueError(f"target {name!r} is already registered")
        if adapter not in self.adapters:
            raise ValueError(f"target {name!r} names unknown adapter {adapter!r}")
        lane = Lane(
            name=name,
            adapter_name=adapter,
            target=Pool(
                f"target:{name}",
                check_limit(f"target {name!r} concurrency", limit),
                _budget(f"target {name!r} token_budget", token_budget),
            ),
            adapter=self.adapters[adapter],
            node=self.node,
            max_queued=None if max_queued is None else check_limit("max_queued", max_queued),
            queue_timeout=(
                None if queue_timeout is None else check_seconds("queue_timeout", queue_timeout)
            ),
        )
        self.lanes[name] = lane
        self._note_tokens()
        return lane

    def _note_tokens(self) -> None:
        self.tokens_in_use = (
            self.node.budget < INF
            or any(p.budget < INF for p in self.adapters.values())
            or any(r.pool.budget < INF for s in self.replica_sets.values() for r in s.replicas)
            or any(lane.target.budget < INF for lane in self.lanes.values())
            or any(t.bucket is not None or t.pool.budget < INF for t in self.tenants.values())
        )

    def _adapter_limit(self, name: str, limit: int | None) -> float:
        if limit is not None:
            check_limit(f"adapter {name!r} concurrency", limit)
        given = [n for n in (limit, self._adapter_caps[name]) if n is not None]
        return min(given) if given else INF

    def lane(self, target: str) -> Lane:
        try:
            return self.lanes[target]
        except KeyError:
            raise UnknownTarget(target) from None

    def set_node_limit(self, limit: int, now: float) -> list[Ticket]:
        self.node.limit = check_limit("concurrency", limit)
        return self.dispatch(now)

    def set_adapter_limit(self, name: str, limit: int | None, now: float) -> list[Ticket]:
        """Set the configured limit (None = none); the capability still caps it."""
        self.adapters[name].limit = self._adapter_limit(name, limit)
        return self.dispatch(now)

    def set_target_limit(self, name: str, limit: float, now: float) -> list[Ticket]:
        """Set a target's limit (an int, or ``math.inf`` for none: a learned limit)."""
        pool = self.lane(name).target
        pool.limit = limit if limit == INF else check_limit(f"target {name!r} concurrency", limit)
        return self.dispatch(now)

    def set_pool_limit(self, pool: Pool, limit: float, now: float) -> list[Ticket]:
        """Set any pool's limit (a learned one, say): an int >= 0 or ``math.inf``."""
        pool.limit = limit if limit == INF else check_limit(f"{pool.name} concurrency", limit)
        return self.dispatch(now)

    def set_pool_budget(self, pool: Pool, budget: float, now: float) -> list[Ticket]:
        """Set a learned token budget on a pool: an int >= 1 or ``math.inf``; the one in
        force is the smaller of it and the configured one. Lowered under what is
        reserved, the holders keep their tokens."""
        if budget != INF:
            budget = check_limit(f"{pool.name} token_budget", budget, 1)
        pool.budget = min(budget, pool.static_budget)
        self._note_tokens()
        return self.dispatch(now)

    def counts_tokens(self, target: str, tenant: str) -> bool:
        """Whether a run of ``tenant`` on ``target`` must say what it reserves: a pool it
        takes from has a token budget (or learns one), or its tenant a token rate."""
        lane = self.lane(target)
        pools = [lane.target, lane.adapter, lane.node]
        replicas = self.replica_sets.get(lane.adapter_name)
        if replicas is not None:
            pools += [r.pool for r in replicas.replicas]
        known = self.tenants.get(tenant)
        if known is not None:
            if known.bucket is not None:
                return True
            pools.append(known.pool)
        return any(p.budget < INF or p.counts_tokens for p in pools)

    def waiting_for(self, pool: Pool) -> int:
        """Runs waiting whose target takes from ``pool`` (for the node's: all)."""
        return sum(lane.waiting for lane in self._busy if self._takes_from(lane, pool))

    def _takes_from(self, lane: Lane, pool: Pool) -> bool:
        """Whether ``lane``'s runs take from ``pool`` (a replica's: any of its adapter's)."""
        if pool in (lane.target, lane.adapter, lane.node):
            return True
        replicas = self.replica_sets.get(lane.adapter_name)
        return replicas is not None and id(pool) in replicas.by_pool

    def smallest_waiting(self, pool: Pool) -> int | None:
        """The fewest tokens that a run waiting at the head of its flow (one that could go
        next) and taking from ``pool`` reserves; None if none waits."""
        costs = [
            next(iter(flow)).cost
            for lane in self._busy
            if self._takes_from(lane, pool)
            for level in lane.levels.values()
            for flow in level.flows.values()
            if flow
        ]
        return min(costs, default=None)

    def set_tenant(self, name: str, limits: TenantLimits, now: float) -> list[Ticket]:
        """Set a tenant's weight and bounds (all of them; a tenant never set has weight 1
        and no bounds). A lower bound cancels nobody; a new weight counts from the next
        grant; a new token rate starts full. ValueError (nothing changed) for a bad
        name or value."""
        check_tenant_limits(name, limits)
        tenant = self.tenant(name)
        tenant.configured = True
        tenant.weight = float(limits.weight)
        tenant.max_queued = limits.max_queued
        tenant.pool.limit = INF if limits.concurrency is None else limits.concurrency
        tenant.pool.budget = _budget("max_tokens_in_flight", limits.max_tokens_in_flight)
        tenant.pool.static_budget = tenant.pool.budget
        rate = limits.tokens_per_minute
        if rate is None:
            tenant.bucket = None
        elif tenant.bucket is None or tenant.bucket.size != rate:
            tenant.bucket = TokenBucket(rate / 60.0, float(rate), now)
        self._note_tokens()
        return self.dispatch(now)

    def tenant_limits(self, name: str) -> TenantLimits:
        """The share of tenant ``name`` in force (the defaults for one never set)."""
        tenant = self.tenants.get(name)
        if tenant is None:
            return TenantLimits()
        pool = tenant.pool
        return TenantLimits(
            tenant.weight,
            tenant.max_queued,
            None if pool.limit == INF else int(pool.limit),
            None if pool.budget == INF else int(pool.budget),
            None if tenant.bucket is None else tenant.bucket.size,
        )

    def tenant(self, name: str) -> Tenant:
        tenant = self.tenants.get(name)
        if tenant is None:
            tenant = self.tenants[name] = Tenant(name)
        return tenant

    def set_queue(
        self, *, max_queued: int | None = None, queue_timeout: float | None = None
    ) -> None:
        """Change the node-wide queue bound or timeout (None leaves it). A lower bound
        rejects nobody already waiting; a new timeout applies to runs from now on."""
        if max_queued is not None:
            self.max_queued = check_limit("max_queued", max_queued)
        if queue_timeout is not None:
            self.queue_timeout = check_seconds("queue_timeout", queue_timeout)

    # --- admission -----------------------------------------------------------------------

    def ticket(
        self,
        key: object,
        target: str,
        *,
        priority: int = 0,
        tenant: str = "",
        cost: int = 0,
        queue_timeout: float | None = None,
        affinity: int | None = None,
    ) -> Ticket:
        """A new ticket (state NEW) and the queue timeout that applies to it; ``affinity``:
        its prompt's (:func:`~.replicas.affinity_of`), for prefix routing. UnknownTarget for
        a target that is not registered."""
        lane = self.lane(target)
        timeout = self.queue_timeout if lane.queue_timeout is None else lane.queue_timeout
        if queue_timeout is not None:
            timeout = min(timeout, check_seconds("queue_timeout", queue_timeout))
        self._order += 1
        who = self.tenant(tenant)
        return Ticket(
            key, lane, who, priority, self._order, max(0, cost), timeout, affinity=affinity
        )

    def start_now(self, ticket: Ticket, now: float) -> bool:
        """Grant a NEW ticket if it may start now (and True); else leave it NEW (and the
        scheduler as it was: a tenant only it brought is forgotten again)."""
        if self._start_if_it_fits(ticket, now):
            return True
        self._forget_if_idle(ticket.tenant)
        return False

    def _start_if_it_fits(self, ticket: Ticket, now: float) -> bool:
        if self.tokens_in_use:
            self._place_holds(now)  # a waiting run past its bound is not passed by this one
        if self._fits_now(ticket, now):
            self._grant(ticket, now, queued=False)
            return True
        return False

    def admit(self, ticket: Ticket, now: float) -> Refusal | None:
        """Admit a NEW ticket: granted now (GRANTED, None returned), refused (REFUSED, the
        Refusal returned), or waiting (WAITING, None returned) until it is granted by a
        later operation, withdrawn, or expires (see :meth:`advance`)."""
        too_large = self._too_large(ticket)
        if too_large is not None:
            return self._refuse(ticket, too_large)
        if self._start_if_it_fits(ticket, now):
            return None
        refusal = self._refusal(ticket, now)
        if refusal is not None:
            return self._refuse(ticket, refusal)
        ticket.move(TicketState.WAITING)
        self._enqueue(ticket, now)
        return None

    def _refuse(self, ticket: Ticket, refusal: Refusal) -> Refusal:
        ticket.move(TicketState.REFUSED)
        self._forget_if_idle(ticket.tenant)
        return refusal

    def _too_large(self, ticket: Ticket) -> Refusal | None:
        cost = ticket.cost
        for pool in ticket.pools:
            if cost > pool.static_budget:  # a learned budget never refuses: see _fits
                what = (
                    f"tenant {ticket.tenant.name!r}'s max_tokens_in_flight"
                    if pool is ticket.tenant.pool
                    else f"{pool.name.replace(':', ' ')}'s token_budget"
                )
                return Refusal(
                    RejectReason.TOO_LARGE,
                    f"the run reserves {cost} tokens (its prompt and the most output it may "
                    f"make), more than {what} of {pool.static_budget:g}: it could never start; ask "
                    "for fewer output tokens (max_tokens) or send a shorter prompt",
                    None,
                )
        replicas = self.replica_sets.get(ticket.lane.adapter_name)
        return None if replicas is None else replicas.too_large(cost)

    def _fits_now(self, ticket: Ticket, now: float) -> bool:
        lane = ticket.lane
        return (
            ticket.tenant.ready(ticket.cost, now)
            and lane.has_room
            and self._fits(ticket)
            and self._replica_fits(ticket)
        )

    def _replica_for(self, ticket: Ticket) -> Replica | None:
        """The replica ``ticket`` would be granted now; None where its adapter has no
        replicas or none fits it."""
        replicas = self.replica_sets.get(ticket.lane.adapter_name)
        return None if replicas is None else replicas.choose(ticket.cost, ticket.affinity)

    def _replica_fits(self, ticket: Ticket) -> bool:
        """Whether ``ticket``'s adapter has no replicas, or one fits it now."""
        replicas = self.replica_sets.get(ticket.lane.adapter_name)
        return replicas is None or replicas.choose(ticket.cost, ticket.affinity) is not None

    def _fits(self, ticket: Ticket) -> bool:
        """Whether ``ticket``'s cost fits its target's, adapter's and node's budgets, in
        what the holders ranked before it leave (a newcomer ranks after every waiter)."""
        cost = ticket.cost
        for pool in ticket.pools[1:]:
            if pool.budget == INF:
                continue
            kept = pool.kept_from(ticket) if pool.holders else 0
            if not pool.fits_tokens(cost, kept):
                return False
        return True

    def _refusal(self, ticket: Ticket, now: float) -> Refusal | None:
        """Why a run that cannot start now is refused at once, or None: it may wait."""
        full = queue_full(ticket, self.queued, self.max_queued, self.rate)
        if full is not None:
            return full
        lane, timeout = ticket.lane, ticket.timeout
        if timeout <= 0:
            return Refusal(
                RejectReason.QUEUE_TIMEOUT,
                "no capacity and queue_timeout is 0",
                lane.rate.wait_for(lane.waiting, 1.0),
            )
        bucket = ticket.tenant.bucket
        if bucket is not None:
            wait = bucket.wait_for(ticket.cost, now)
            if wait > timeout:
                return Refusal(
                    RejectReason.RATE_LIMITED,
                    f"tenant {ticket.tenant.name!r} is over its tokens_per_minute "
                    f"({bucket.size:g}): the {ticket.cost} tokens this run reserves come "
                    f"back in {wait:.1f}s, past its {timeout:g}s queue timeout",
                    clamp_retry_after(wait),
                )
        if self.early_reject:
            estimate = lane.estimated_wait(ticket.priority, ticket.tenant)
            if estimate is not None and estimate > timeout:
                return Refusal(
                    RejectReason.QUEUE_TIMEOUT,
                    f"about {estimate:.1f}s of queue ahead on {lane.name}, more than the "
                    f"{timeout:g}s it may wait (decided at once)",
                    clamp_retry_after(estimate - timeout),
                )
        return None

    # --- granting and ending -------------------------------------------------------------

    def _grant(self, ticket: Ticket, now: float, *, queued: bool) -> None:
        replica = self._replica_for(ticket)
        if replica is not None:
            ticket.replica = replica.pool
            self.replica_sets[ticket.lane.adapter_name].took(replica)
        ticket.move(TicketState.GRANTED)
        for pool in ticket.pools:
            pool.take(ticket.cost)
        ticket.at_grant = tuple((p.running, p.reserved) for p in ticket.pools)
        ticket.granted_at = now
        bucket = ticket.tenant.bucket
        if bucket is not None:
            bucket.level(now)
            bucket.charge(ticket.cost)
        ticket.tenant.charged += ticket.cost
        self._drop_holds(ticket)
        running = self.running_by_priority
        running[ticket.priority] = running.get(ticket.priority, 0) + 1
        lane = ticket.lane
        if queued:  # service while runs wait: a sample of the target's rate
            lane.rate.tick(now, since=lane.backlogged_since)
        else:
            lane.rate.last = now
        self.rate.tick(now)

    # --- replicas ------------------------------------------------------------------------

    def _replica_room(self, lane: Lane) -> bool:
        replicas = self.replica_sets.get(lane.adapter_name)
        return replicas is None or replicas.has_room

    def mark_replica(self, adapter: str, name: str, down: bool, now: float) -> list[Ticket]:
        """Mark a replica down (no run is granted it; those it holds keep their place) or
        clear it; returns the runs that lets start (a replica cleared, or the last one
        marked: then runs go as if none were). KeyError for an unknown one."""
        if self.replica_sets[adapter].mark(name, down):
            return self.dispatch(now)
        return []

    def reroute(self, ticket: Ticket, now: float) -> Replica | None:
        """Move a granted ``ticket`` whose replica failed it (before its first token) to
        another that fits it now, its place and tokens moved with it; None if none does
        (it stays where it was, to end as any failed run does)."""
        return self.replica_sets[ticket.lane.adapter_name].reroute(ticket)

    def full_level(self, ticket: Ticket, now: float) -> str:
        """:meth:`~.tickets.Ticket.full_level`, or ``replica`` where its other levels
        have room but no replica of its adapter fits it."""
        level = ticket.full_level(now)
        if level == "queue" and not self._replica_fits(ticket):
            return "replica"
        return level

    def release(self, ticket: Ticket, now: float, used: int | None = None) -> list[Ticket]:
        """A granted run ended: give back its place and its reserved tokens, and settle
        its tenant's token rate with ``used`` (the tokens it really took; None: what it
        reserved). Returns the runs this let start."""
        ticket.move(TicketState.RELEASED)
        for pool in ticket.pools:
            pool.give_back(ticket.cost)
        bucket = ticket.tenant.bucket
        if used is not None:
            ticket.tenant.charged += used - ticket.cost
            if bucket is not None:
                bucket.level(now)
                bucket.credit(ticket.cost - used)
        running = self.running_by_priority
        running[ticket.priority] -= 1
        if not running[ticket.priority]:
            del running[ticket.priority]
        self._forget_if_idle(ticket.tenant)
        return self.dispatch(now)

    def withdraw(self, key: object, now: float) -> tuple[Ticket | None, list[Ticket]]:
        """Take ``key``'s waiting run out of the queue (WITHDRAWN; None if none waits),
        and the runs that lets start (the one behind it in its tenant's flow may fit
        where it did not, and the room it kept as a holder is free)."""
        ticket = self._waiting.get(key)
        if ticket is None:
            return None, []
        self._dequeue(ticket)
        ticket.move(TicketState.WITHDRAWN)
        self._forget_if_idle(ticket.tenant)
        return ticket, self.dispatch(now) if self.tokens_in_use else []

    def waiting(self, key: object) -> Ticket | None:
        return self._waiting.get(key)

    def advance(self, now: float) -> tuple[list[Ticket], list[tuple[Ticket, Refusal]]]:
        """What the time brings: runs whose queue deadline passed (EXPIRED, with their
        Refusal), then the runs a refilled token rate lets start."""
        expired = []
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, _, ticket = heapq.heappop(deadlines)
            if ticket.state is not TicketState.WAITING:
                continue
            refusal = self.expiry(ticket, now)
            self._dequeue(ticket)
            ticket.move(TicketState.EXPIRED)
            self._forget_if_idle(ticket.tenant)
            expired.append((ticket, refusal))
        return self.dispatch(now), expired

    def expiry(self, ticket: Ticket, now: float) -> Refusal:
        """The Refusal of a run whose queue deadline passed at ``now``."""
        return expired(ticket, now)

    def wakeup(self, now: float) -> float:
        """When :meth:`advance` next has something to do: the earliest queue deadline, or
        when a tenant's token rate lets its waiting head start, or when a waiting run
        reaches its hold bound (``math.inf``: nothing). Always after ``now``: a head past
        its bound that is not yet a holder waits for room (a release), which dispatches
        and places holds; waking for it at ``now`` would only spin."""
        when = INF
        while self._deadlines and self._deadlines[0][2].state is not TicketState.WAITING:
            heapq.heappop(self._deadlines)
        if self._deadlines:
            when = self._deadlines[0][0]
        if not self.tokens_in_use:
            return when
        for lane in self._busy:
            for level in lane.levels.values():
                for tenant, flow in level.flows.items():
                    head = next(iter(flow))
                    if tenant.bucket is not None and not tenant.rate_ready(head.cost, now):
                        wait = tenant.bucket.wait_for(head.cost, now)
                        when = min(when, now + max(wait, 1e-6))  # past now, even in floats
                    bound = head.enqueued + self.hold_after
                    if not head.holding and bound > now and not self._fits(head):
                        when = min(when, bound)
        return when

    def dispatch(self, now: float) -> list[Ticket]:
        """Grant the best run that may start, until none may: of each target with room,
        its candidates in order (:meth:`Lane.candidates`), the first that fits its pools
        in what holders leave; across targets the best by rank. Runs that lack tokens
        past ``hold_after`` become holders first."""
        granted: list[Ticket] = []
        while self._busy and self.node.has_room:
            lanes = [lane for lane in self._busy if lane.has_room and self._replica_room(lane)]
            if self.tokens_in_use:  # holds first, so nothing below is granted past one
                self._place_holds(now, lanes)
            best: Ticket | None = None
            for lane in lanes:
                ticket = self._first_to_go(lane, now)
                if ticket is not None and (best is None or ticket.rank < best.rank):
                    best = ticket
            if best is None:
                break
            self._dequeue(best, served=True)
            self._grant(best, now, queued=True)
            granted.append(best)
        return granted

    def _first_to_go(self, lane: Lane, now: float) -> Ticket | None:
        """``lane``'s first candidate that fits its pools, in what holders leave."""
        with closing(lane.candidates(now)) as candidates:
            for ticket in candidates:
                if self._fits(ticket) and self._replica_fits(ticket):
                    return ticket
        return None

    def _place_holds(self, now: float, lanes: list[Lane] | None = None) -> None:
        for lane in list(self._busy) if lanes is None else lanes:
            with closing(lane.candidates(now)) as candidates:
                for ticket in candidates:
                    self._maybe_hold(ticket, now)

    def _maybe_hold(self, ticket: Ticket, now: float) -> None:
        """A run that has waited ``hold_after`` and does not fit its budgets keeps room
        for itself in each pool with a budget that it takes from."""
        if ticket.holding or now - ticket.enqueued < self.hold_after or self._fits(ticket):
            return
        ticket.holding = True
        for pool in ticket.pools[1:]:
            if pool.budget != INF:
                pool.holders.append(ticket)
                pool.holders.sort(key=lambda h: h.rank)

    def _drop_holds(self, ticket: Ticket) -> None:
        if ticket.holding:
            ticket.holding = False
            for pool in ticket.pools[1:]:
                if ticket in pool.holders:
                    pool.holders.remove(ticket)

    def _enqueue(self, ticket: Ticket, now: float) -> None:
        lane = ticket.lane
        level = lane.levels.get(ticket.priority)
        if level is None:
            level = lane.levels[ticket.priority] = Level()
        level.add(ticket)
        if not lane.waiting:
            lane.backlogged_since = now
        lane.waiting += 1
        ticket.tenant.queued += 1
        ticket.enqueued = now
        ticket.deadline = now + ticket.timeout
        self._waiting[ticket.key] = ticket
        self._busy[lane] = None
        self.queued += 1
        heapq.heappush(self._deadlines, (ticket.deadline, ticket.order, ticket))

    def _dequeue(self, ticket: Ticket, *, served: bool = False) -> None:
        """Take a waiting ``ticket`` out of the queue (``served``: it is being granted)."""
        lane = ticket.lane
        level = lane.levels[ticket.priority]
        if served:
            level.served(ticket)
        else:
            level.remove(ticket)
        if not level.flows:
            # the level goes, and with it its virtual times: they mean nothing once no
            # tenant is backlogged at it
            del lane.levels[ticket.priority]
        del self._waiting[ticket.key]
        lane.waiting -= 1
        ticket.tenant.queued -= 1
        self.queued -= 1
        if not lane.waiting:
            del self._busy[lane]
        if not served:
            self._drop_holds(ticket)

    def _forget_if_idle(self, tenant: Tenant) -> None:
        # a tenant never set is kept only while it has runs, so names cannot pile up
        if tenant.idle and self.tenants.get(tenant.name) is tenant:
            del self.tenants[tenant.name]

    # --- introspection -------------------------------------------------------------------

    @property
    def deadlines(self) -> int:
        """Queue deadlines still to be met (of waiting runs)."""
        return sum(1 for _, _, t in self._deadlines if t.state is TicketState.WAITING)

    def queued_by_priority(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for lane in self._busy:
            for priority, level in lane.levels.items():
                counts[priority] = counts.get(priority, 0) + level.size
        return counts

    def waiting_tickets(self) -> list[Ticket]:
        return list(self._waiting.values())


def _budget(what: str, budget: int | None) -> float:
    return INF if budget is None else check_limit(what, budget, 1)
