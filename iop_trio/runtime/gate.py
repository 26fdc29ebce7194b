"""The concurrency gate: a four-level CapacityLimiter hierarchy with one queue.

A run holds one token of its tenant's limiter, one of its target's, one of its
adapter's and one of the global limiter, or none at all. Tokens are taken on
behalf of the run's :class:`Permit`, always in the order tenant -> target ->
adapter -> global (most specific first), and only when all four are free at
once, so a run never sits on a token it cannot use yet: ``borrowed_tokens`` at
every limiter equals the runs holding a permit under it. A tenant without a
concurrency bound has an unbounded limiter.

Waiting runs are ordered, within a target, by priority (higher first), then
between tenants of one priority by weighted fair queueing, then FIFO within a
tenant. When capacity appears (a permit is released, a limit is raised) the
gate grants, over and over, the best waiting run whose four limiters all have
room: the one of highest priority among the targets, the oldest of those on a
tie. Fair queueing is start-time fair queueing by run count: each tenant's
flow at a (target, priority) carries a virtual time, a grant adds 1/weight to
it, the flow with the smallest time goes next (the older head on a tie), and a
flow that becomes backlogged starts at the level's virtual time, which every
grant moves on by 1 / the waiting tenants' weights (as in weighted fair
queueing), so no tenant saves up credit while idle and a stream of newcomers
cannot starve a backlogged tenant. Two backlogged tenants of equal weight
therefore alternate, whatever their arrival rates. A run whose target (or
tenant) is full never blocks one that could run (no head-of-line blocking).
Strict priority may starve a lower priority; such runs end REJECTED
(queue_timeout) at their deadline.

:meth:`Gate._dispatch` is one synchronous function: per grant it looks at each
target with waiters, and in each at its priority levels and their tenants,
so a grant costs O(targets x priorities + log tenants), whatever the number
of waiting runs (tenants held at their own concurrency bound are stepped
over, each at O(log tenants)).

Admission (:meth:`Gate.acquire`): a run whose four limiters have room is
granted at once (nothing waiting could use that room: the gate always grants
until nothing can start). Else, if a queue bound is reached (``max_queued``
node-wide, the target's, the tenant's) it is rejected with ``queue_full`` at
once; if its queue timeout (the smaller of the run's own and the target's or
node's) is 0 it is rejected with ``queue_timeout`` at once; otherwise it waits
at most that long and is then rejected with ``queue_timeout``. With
``early_reject`` on, a run whose estimated wait (the runs that would start
before it, plus one, times the recent time between grants at its target while
runs waited there) already exceeds its timeout is rejected with
``queue_timeout`` at once instead. A rejection carries ``retry_after``:
seconds until such a run would likely get in, from the recent rate of grants
and the runs ahead.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator, Mapping
from typing import NoReturn

import attrs
import trio

from ..model import (
    RejectReason,
    TenantLimits,
    UnknownTarget,
    check_limit,
    check_seconds,
    check_tenant_limits,
    clamp_retry_after,
)


class GateWithdrawn(Exception):
    """The run was taken out of the queue (:meth:`Gate.withdraw`) before it got a permit."""


class GateRejected(Exception):
    """The gate turned a run away; ``reason`` says why, ``retry_after`` (seconds) when a
    run like it would likely get in."""

    def __init__(self, reason: RejectReason, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


def _has_room(limiter: trio.CapacityLimiter) -> bool:
    return limiter.borrowed_tokens < limiter.total_tokens


#: Gaps between grants a target must have seen before its wait is estimated for early
#: rejection (see :attr:`Gate.early_reject`).
EARLY_MIN_SAMPLES = 8


@attrs.define(eq=False, repr=False)
class _Rate:
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


@attrs.define(eq=False, repr=False)
class _Tenant:
    """Who runs are for: a fair-queueing weight, a queue bound, a concurrency limiter."""

    name: str
    weight: float = 1.0
    max_queued: int | None = None
    limiter: trio.CapacityLimiter = attrs.field(factory=lambda: trio.CapacityLimiter(math.inf))
    queued: int = 0  # waiting runs of this tenant, node-wide
    configured: bool = False  # set by set_tenant; others are forgotten when idle

    @property
    def idle(self) -> bool:
        return not self.configured and not self.queued and not self.limiter.borrowed_tokens


@attrs.define(eq=False, repr=False)
class _Ticket:
    borrower: object
    lane: _Lane
    tenant: _Tenant
    priority: int
    order: int
    task: trio.lowlevel.Task | None = None  # set while a task waits in acquire()
    granted: bool = False
    withdrawn: bool = False
    # a run waiting as data (enter()): called when it is granted / its deadline passes
    on_grant: Callable[[Permit], None] | None = None
    on_expire: Callable[[GateRejected], None] | None = None
    timeout: float = math.inf


@attrs.define(eq=False, repr=False)
class _Level:
    """The waiting runs of one priority at one target: a FIFO flow per tenant, the
    virtual times of start-time fair queueing (see the module docstring), and a heap of
    the flows' heads by (virtual time, arrival), so a grant costs O(log tenants).

    Heap entries are not updated in place: a flow whose head or time changes gets a
    new entry, and an entry that no longer matches its flow is dropped when met.
    """

    flows: dict[_Tenant, dict[_Ticket, None]] = attrs.field(factory=dict)
    vtime: dict[_Tenant, float] = attrs.field(factory=dict)
    # the level's virtual time: a grant moves it by 1 / the waiting tenants' weights
    clock: float = 0.0
    weights: float = 0.0  # of the waiting tenants, as they were when each began to wait
    entered: dict[_Tenant, float] = attrs.field(factory=dict)  # each one's weight then
    heap: list[tuple[float, int, int, _Tenant]] = attrs.field(factory=list)
    pushes: int = 0
    size: int = 0  # waiting runs

    def add(self, ticket: _Ticket) -> None:
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

    def remove(self, ticket: _Ticket) -> None:
        self.size -= 1
        tenant = ticket.tenant
        flow = self.flows[tenant]
        was_head = next(iter(flow)) is ticket
        del flow[ticket]
        if not flow:
            self._idle(tenant)
        elif was_head:
            self._push(tenant)

    def _idle(self, tenant: _Tenant) -> None:
        """``tenant`` has no more runs waiting here."""
        del self.flows[tenant]
        self.weights -= self.entered.pop(tenant)
        if len(self.vtime) > 2 * len(self.flows) + 16:
            # times of tenants gone idle that the clock has passed mean nothing now
            self.vtime = {t: v for t, v in self.vtime.items() if t in self.flows or v > self.clock}

    def _push(self, tenant: _Tenant) -> None:
        head = next(iter(self.flows[tenant]))
        self.pushes += 1
        heapq.heappush(self.heap, (self.vtime[tenant], head.order, self.pushes, tenant))
        if len(self.heap) > 2 * len(self.flows) + 16:  # mostly stale: rebuild
            self.heap = [e for e in self.heap if self._current(e)]
            heapq.heapify(self.heap)

    def _current(self, entry: tuple[float, int, int, _Tenant]) -> bool:
        vtime, order, _, tenant = entry
        flow = self.flows.get(tenant)
        return flow is not None and self.vtime[tenant] == vtime and next(iter(flow)).order == order

    def pick(self) -> _Ticket | None:
        """The head of the flow with the smallest virtual time (the older head on a tie)
        among the tenants with room; None if none has."""
        heap = self.heap
        blocked = []
        found = None
        while heap:
            entry = heap[0]
            if not self._current(entry):
                heapq.heappop(heap)
            elif not _has_room(entry[3].limiter):
                blocked.append(heapq.heappop(heap))
            else:
                found = next(iter(self.flows[entry[3]]))
                break
        for entry in blocked:
            heapq.heappush(heap, entry)
        return found

    def ahead_of(self, tenant: _Tenant) -> int:
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

    def served(self, ticket: _Ticket) -> None:
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


@attrs.define(eq=False, repr=False)
class _Lane:
    """One target's limiters and its waiting runs, by priority."""

    name: str
    adapter: str
    target_limiter: trio.CapacityLimiter
    adapter_limiter: trio.CapacityLimiter
    max_queued: int | None
    queue_timeout: float | None
    levels: dict[int, _Level] = attrs.field(factory=dict)
    waiting: int = 0
    rate: _Rate = attrs.field(factory=_Rate)
    backlogged_since: float = 0.0  # when the lane last went from no waiters to some

    def estimated_wait(self, priority: int, tenant: _Tenant) -> float | None:
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

    def pick(self) -> _Ticket | None:
        """The best waiting run whose tenant has room (the lane's own room is the
        caller's to check): highest priority, then fair, then oldest."""
        for priority in sorted(self.levels, reverse=True):
            ticket = self.levels[priority].pick()
            if ticket is not None:
                return ticket
        return None


@attrs.define(eq=False, repr=False)
class Permit:
    """One token of each level, held for one run. Release it exactly once (extra calls are no-ops).

    Use as a context manager to release on exit.
    """

    _gate: Gate
    _ticket: _Ticket
    released: bool = False

    @property
    def target(self) -> str:
        return self._ticket.lane.name

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._gate._release(self._ticket)

    def __enter__(self) -> Permit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Permit {self._ticket.borrower!r} {self._ticket.lane.name} {state}>"


@attrs.frozen
class LimiterStats:
    limit: int | float  # math.inf = unbounded
    borrowed: int


@attrs.frozen
class GateStatistics:
    """A snapshot: queued counts and, per level, the limit and the tokens borrowed."""

    queued: int
    max_queued: int
    queue_timeout: float
    global_: LimiterStats
    adapters: Mapping[str, LimiterStats]
    targets: Mapping[str, LimiterStats]
    queued_by_target: Mapping[str, int]
    tenants: Mapping[str, LimiterStats] = attrs.field(factory=dict)
    queued_by_tenant: Mapping[str, int] = attrs.field(factory=dict)
    queued_by_priority: Mapping[int, int] = attrs.field(factory=dict)
    running_by_priority: Mapping[int, int] = attrs.field(factory=dict)


class Gate:
    """Admits runs under the tenant / target / adapter / global limits; see the module
    docstring.

    Limits are changed at runtime with :meth:`set_global_limit`,
    :meth:`set_adapter_limit`, :meth:`set_target_limit` and :meth:`set_tenant`
    (tenants not set have weight 1 and no bounds). Lowering a limit
    lets current holders finish and admits nobody new until the borrowed count
    is below the new limit; raising one admits waiting runs at once. A limit
    of 0 pauses that level: runs queue (or are rejected) as if it were full.
    ``early_reject`` (settable) turns on early rejection (module docstring); it
    acts only once a target has seen :data:`EARLY_MIN_SAMPLES` grants while runs
    waited there.
    """

    def __init__(
        self,
        *,
        concurrency: int,
        max_queued: int,
        queue_timeout: float,
        early_reject: bool = False,
    ) -> None:
        self.early_reject = early_reject
        self._global = trio.CapacityLimiter(check_limit("concurrency", concurrency))
        self.max_queued = check_limit("max_queued", max_queued)
        self.queue_timeout = check_seconds("queue_timeout", queue_timeout)
        self._adapters: dict[str, trio.CapacityLimiter] = {}
        self._adapter_caps: dict[str, int | None] = {}
        self._lanes: dict[str, _Lane] = {}
        # lanes that have waiters, for dispatch in O(targets)
        self._busy_lanes: dict[_Lane, None] = {}
        # the waiting tickets by borrower, so a waiting run can be withdrawn
        self._waiting: dict[object, _Ticket] = {}
        # the queue deadlines of runs waiting as data (enter), earliest first; entries of
        # runs granted or withdrawn meanwhile are dropped when met
        self._deadlines: list[tuple[float, int, _Ticket]] = []
        self._deadline_moved = trio.Event()
        self._tenants: dict[str, _Tenant] = {}
        self._queued = 0
        self._order = 0
        self._rate = _Rate()  # grants, node-wide
        self._running_by_priority: dict[int, int] = {}

    def __repr__(self) -> str:
        g = self._global
        return (
            f"<Gate global={g.borrowed_tokens}/{g.total_tokens} queued={self._queued}"
            f"/{self.max_queued} adapters={len(self._adapters)} targets={len(self._lanes)}>"
        )

    # --- configuration -------------------------------------------------------------------

    def add_adapter(
        self, name: str, limit: int | None, *, max_concurrency: int | None = None
    ) -> None:
        """Register an adapter level. Its limit is the smaller of ``limit`` and
        ``max_concurrency`` (the adapter's capability); None for both = unbounded.
        """
        if name in self._adapters:
            raise ValueError(f"adapter {name!r} is already registered")
        if max_concurrency is not None:
            check_limit(f"adapter {name!r} max_concurrency", max_concurrency)
        self._adapter_caps[name] = max_concurrency
        self._adapters[name] = trio.CapacityLimiter(self._effective_adapter_limit(name, limit))

    def add_target(
        self,
        name: str,
        *,
        adapter: str,
        limit: int,
        max_queued: int | None = None,
        queue_timeout: float | None = None,
    ) -> None:
        """Register a target under ``adapter``.

        ``max_queued`` bounds this target's waiting runs in addition to the
        node-wide bound; ``queue_timeout`` replaces the node-wide one for it.
        """
        if name in self._lanes:
            raise ValueError(f"target {name!r} is already registered")
        if adapter not in self._adapters:
            raise ValueError(f"target {name!r} names unknown adapter {adapter!r}")
        self._lanes[name] = _Lane(
            name=name,
            adapter=adapter,
            target_limiter=trio.CapacityLimiter(check_limit(f"target {name!r} concurrency", limit)),
            adapter_limiter=self._adapters[adapter],
            max_queued=None if max_queued is None else check_limit("max_queued", max_queued),
            queue_timeout=(
                None if queue_timeout is None else check_seconds("queue_timeout", queue_timeout)
            ),
        )

    def _effective_adapter_limit(self, name: str, limit: int | None) -> int | float:
        if limit is not None:
            check_limit(f"adapter {name!r} concurrency", limit)
        given = [n for n in (limit, self._adapter_caps[name]) if n is not None]
        return min(given) if given else math.inf

    def set_global_limit(self, limit: int) -> None:
        self._global.total_tokens = check_limit("concurrency", limit)
        self._dispatch()

    def set_adapter_limit(self, name: str, limit: int | None) -> int | None:
        """Set the configured limit (None = none); returns the limit in force
        (capped by the capability; None = unbounded).
        """
        limiter = self._adapters[name]
        limiter.total_tokens = self._effective_adapter_limit(name, limit)
        self._dispatch()
        return self.adapter_limit(name)

    def adapter_limit(self, name: str) -> int | None:
        """The adapter limit in force, None if unbounded."""
        total = self._adapters[name].total_tokens
        return None if total == math.inf else int(total)

    def set_target_limit(self, name: str, limit: int) -> None:
        lane = self._lane(name)
        lane.target_limiter.total_tokens = check_limit(f"target {name!r} concurrency", limit)
        self._dispatch()

    def set_tenant(self, name: str, limits: TenantLimits) -> None:
        """Set a tenant's weight and bounds (all of them; a tenant never set has weight 1
        and no bounds).

        A lower bound cancels nobody: runs above it finish (or wait); a new
        weight counts from the next grant. ValueError (nothing changed) for a
        bad name, a weight that is not a number > 0 or a bound that is not a limit.
        """
        check_tenant_limits(name, limits)
        tenant = self._tenant(name)
        tenant.configured = True
        tenant.weight = float(limits.weight)
        tenant.max_queued = limits.max_queued
        tenant.limiter.total_tokens = math.inf if limits.concurrency is None else limits.concurrency
        self._dispatch()

    def tenant_limits(self, name: str) -> TenantLimits:
        """The share of tenant ``name`` in force (the defaults for one never set)."""
        tenant = self._tenants.get(name)
        if tenant is None:
            return TenantLimits()
        total = tenant.limiter.total_tokens
        return TenantLimits(
            tenant.weight, tenant.max_queued, None if total == math.inf else int(total)
        )

    def is_set(self, tenant: str) -> bool:
        """Whether ``tenant``'s share was set (:meth:`set_tenant`)."""
        found = self._tenants.get(tenant)
        return found is not None and found.configured

    def tenants(self) -> dict[str, TenantLimits]:
        """The tenants whose share was set, and their shares."""
        return {n: self.tenant_limits(n) for n, t in self._tenants.items() if t.configured}

    def _tenant(self, name: str) -> _Tenant:
        tenant = self._tenants.get(name)
        if tenant is None:
            tenant = self._tenants[name] = _Tenant(name)
        return tenant

    def set_queue(
        self, *, max_queued: int | None = None, queue_timeout: float | None = None
    ) -> None:
        """Change the node-wide queue bound or timeout (None leaves it).

        A lower bound rejects nobody already waiting; a new timeout applies to
        runs that arrive from now on.
        """
        if max_queued is not None:
            self.max_queued = check_limit("max_queued", max_queued)
        if queue_timeout is not None:
            self.queue_timeout = check_seconds("queue_timeout", queue_timeout)

    # --- introspection -------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return self._queued

    def targets(self) -> Iterator[str]:
        return iter(self._lanes)

    def global_limiter(self) -> trio.CapacityLimiter:
        return self._global

    def adapter_limiter(self, name: str) -> trio.CapacityLimiter:
        return self._adapters[name]

    def target_limiter(self, name: str) -> trio.CapacityLimiter:
        return self._lane(name).target_limiter

    def adapter_of(self, target: str) -> str:
        return self._lane(target).adapter

    def statistics(self) -> GateStatistics:
        def stats(limiter: trio.CapacityLimiter) -> LimiterStats:
            return LimiterStats(limiter.total_tokens, limiter.borrowed_tokens)

        return GateStatistics(
            queued=self._queued,
            max_queued=self.max_queued,
            queue_timeout=self.queue_timeout,
            global_=stats(self._global),
            adapters={n: stats(lim) for n, lim in self._adapters.items()},
            targets={n: stats(lane.target_limiter) for n, lane in self._lanes.items()},
            queued_by_target={n: lane.waiting for n, lane in self._lanes.items()},
            tenants={n: stats(t.limiter) for n, t in self._tenants.items()},
            queued_by_tenant={n: t.queued for n, t in self._tenants.items()},
            queued_by_priority=self._queued_by_priority(),
            running_by_priority=dict(self._running_by_priority),  # _release drops zeros
        )

    def _queued_by_priority(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for lane in self._busy_lanes:
            for priority, level in lane.levels.items():
                counts[priority] = counts.get(priority, 0) + level.size
        return counts

    def _lane(self, target: str) -> _Lane:
        try:
            return self._lanes[target]
        except KeyError:
            raise UnknownTarget(target) from None

    # --- admission -----------------------------------------------------------------------

    async def acquire(
        self,
        borrower: object,
        target: str,
        *,
        priority: int = 0,
        tenant: str = "",
        queue_timeout: float | None = None,
    ) -> Permit:
        """Wait for a permit for ``target``, or raise :class:`GateRejected`.

        ``borrower`` names the holder in the limiters (it must not hold a
        token of them already). ``queue_timeout`` is the run's own bound on
        waiting; the smaller of it and the target's (or node's) applies. Raises
        :class:`UnknownTarget` at once for a target that is not registered. If
        cancelled while waiting the run leaves the queue and holds nothing; a
        run granted in the same instant its deadline passed keeps its permit.
        Raises GateWithdrawn if :meth:`withdraw` takes it out of the queue.
        Always a checkpoint.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        lane, ticket, timeout = self._ticket(borrower, target, priority, tenant, queue_timeout)
        if self._grantable(lane, ticket.tenant):
            # nothing waiting could use this room: the gate grants until none can start
            self._grant(ticket)
            await trio.lowlevel.cancel_shielded_checkpoint()
            return Permit(self, ticket)
        # made before the checkpoint, so the message counts what refused the run
        refusal = self._refusal(lane, ticket, timeout)
        if refusal is not None:
            await self._turn_away(ticket, *refusal)
        ticket.task = trio.lowlevel.current_task()
        self._enqueue(ticket)

        def abort(_: object) -> trio.lowlevel.Abort:
            # a deadline or an outside cancel: a granted ticket's task has been
            # rescheduled already and is never aborted, so this one still waits
            self._dequeue(ticket)
            return trio.lowlevel.Abort.SUCCEEDED

        with trio.move_on_after(timeout):
            await trio.lowlevel.wait_task_rescheduled(abort)
        ticket.task = None
        if ticket.withdrawn:
            raise GateWithdrawn()
        if not ticket.granted:
            raise GateRejected(
                RejectReason.QUEUE_TIMEOUT,
                f"no capacity on {target} within {timeout:g}s",
                lane.rate.wait_for(lane.waiting, timeout),
            )
        return Permit(self, ticket)

    def enter(
        self,
        borrower: object,
        target: str,
        *,
        on_grant: Callable[[Permit], None],
        on_expire: Callable[[GateRejected], None],
        priority: int = 0,
        tenant: str = "",
        queue_timeout: float | None = None,
    ) -> Permit | None:
        """:meth:`acquire` for a run that waits as data, not as a task: never waits.

        Returns a Permit if the run may start now; raises GateRejected if it is
        refused at once (as ``acquire`` would be before waiting); else it waits
        in the queue and None is returned. Then exactly one of these happens:
        ``on_grant(permit)`` is called when it is granted (synchronously, by
        whoever made room: it must not raise nor wait), ``on_expire(rejected)``
        when its queue deadline passes first (by :meth:`expire_waiting`), or
        :meth:`withdraw` takes it out (and calls neither). The order between
        runs is the same as for runs waiting in ``acquire``.
        """
        lane, ticket, timeout = self._ticket(borrower, target, priority, tenant, queue_timeout)
        if self._grantable(lane, ticket.tenant):
            self._grant(ticket)
            return Permit(self, ticket)
        refusal = self._refusal(lane, ticket, timeout)
        if refusal is not None:
            self._forget_if_idle(ticket.tenant)
            raise GateRejected(*refusal)
        ticket.on_grant = on_grant
        ticket.on_expire = on_expire
        ticket.timeout = timeout
        self._enqueue(ticket)
        deadline = trio.current_time() + timeout
        if not self._deadlines or deadline < self._deadlines[0][0]:
            self._deadline_moved.set()
        heapq.heappush(self._deadlines, (deadline, ticket.order, ticket))
        return None

    def enter_now(
        self, borrower: object, target: str, *, priority: int = 0, tenant: str = ""
    ) -> Permit | None:
        """The Permit :meth:`enter` would grant at once, or None and the gate is as it was.

        Never queues nor refuses: a run that gets None goes on to :meth:`enter`
        (which may queue or refuse it) as if this had not been called. A tenant
        that only this call brought is forgotten again.
        """
        lane, ticket, _ = self._ticket(borrower, target, priority, tenant, None)
        if self._grantable(lane, ticket.tenant):
            self._grant(ticket)
            return Permit(self, ticket)
        self._forget_if_idle(ticket.tenant)
        return None

    async def expire_waiting(self) -> None:
        """Until cancelled: reject each run waiting as data (:meth:`enter`) whose queue
        deadline has passed, with ``on_expire``. One task per gate runs this."""
        deadlines = self._deadlines
        while True:
            now = trio.current_time()
            while deadlines and deadlines[0][0] <= now:
                _, _, ticket = heapq.heappop(deadlines)
                if self._waiting.get(ticket.borrower) is not ticket:
                    continue  # granted or withdrawn meanwhile
                self._dequeue(ticket)
                lane = ticket.lane
                assert ticket.on_expire is not None
                ticket.on_expire(
                    GateRejected(
                        RejectReason.QUEUE_TIMEOUT,
                        f"no capacity on {lane.name} within {ticket.timeout:g}s",
                        lane.rate.wait_for(lane.waiting, ticket.timeout),
                    )
                )
            self._deadline_moved = trio.Event()
            with trio.move_on_at(deadlines[0][0] if deadlines else math.inf):
                await self._deadline_moved.wait()

    def _ticket(
        self,
        borrower: object,
        target: str,
        priority: int,
        tenant: str,
        queue_timeout: float | None,
    ) -> tuple[_Lane, _Ticket, float]:
        """A new ticket, and the queue timeout that applies to it."""
        lane = self._lane(target)
        timeout = self.queue_timeout if lane.queue_timeout is None else lane.queue_timeout
        if queue_timeout is not None:
            timeout = min(timeout, check_seconds("queue_timeout", queue_timeout))
        self._order += 1
        return lane, _Ticket(borrower, lane, self._tenant(tenant), priority, self._order), timeout

    def _refusal(
        self, lane: _Lane, ticket: _Ticket, timeout: float
    ) -> tuple[RejectReason, str, float] | None:
        """Why a run that cannot start now is refused at once, or None: it may wait."""
        full = self._full(lane, ticket.tenant)
        if full is not None:
            return RejectReason.QUEUE_FULL, *full
        if timeout <= 0:
            return (
                RejectReason.QUEUE_TIMEOUT,
                "no capacity and queue_timeout is 0",
                lane.rate.wait_for(lane.waiting, 1.0),
            )
        if self.early_reject:
            estimate = lane.estimated_wait(ticket.priority, ticket.tenant)
            if estimate is not None and estimate > timeout:
                return (
                    RejectReason.QUEUE_TIMEOUT,
                    f"about {estimate:.1f}s of queue ahead on {lane.name}, more than the "
                    f"{timeout:g}s it may wait (decided at once)",
                    clamp_retry_after(estimate - timeout),
                )
        return None

    async def _turn_away(
        self, ticket: _Ticket, reason: RejectReason, message: str, retry_after: float
    ) -> NoReturn:
        """Reject a run that never waited (a tenant it alone brought is forgotten)."""
        self._forget_if_idle(ticket.tenant)
        await trio.lowlevel.cancel_shielded_checkpoint()
        raise GateRejected(reason, message, retry_after)

    def _full(self, lane: _Lane, tenant: _Tenant) -> tuple[str, float] | None:
        """Which queue bound a new waiter would break, in words, and when a run would likely
        find room (seconds); None if none."""
        if self._queued >= self.max_queued:
            return (
                f"the node's queue is full (max_queued {self.max_queued}, {self._queued} waiting)",
                self._rate.wait_for(self._queued - self.max_queued, 1.0),
            )
        if lane.max_queued is not None and lane.waiting >= lane.max_queued:
            return (
                f"the queue of {lane.name} is full "
                f"(its max_queued {lane.max_queued}, {lane.waiting} waiting)",
                lane.rate.wait_for(lane.waiting - lane.max_queued, 1.0),
            )
        if tenant.max_queued is not None and tenant.queued >= tenant.max_queued:
            return (
                f"the queue of tenant {tenant.name!r} is full "
                f"(its max_queued {tenant.max_queued}, {tenant.queued} waiting)",
                self._rate.wait_for(tenant.queued - tenant.max_queued, 1.0),
            )
        return None

    def _lane_has_room(self, lane: _Lane) -> bool:
        return (
            _has_room(lane.target_limiter)
            and _has_room(lane.adapter_limiter)
            and _has_room(self._global)
        )

    def _grantable(self, lane: _Lane, tenant: _Tenant) -> bool:
        return _has_room(tenant.limiter) and self._lane_has_room(lane)

    def _grant(self, ticket: _Ticket, *, queued: bool = False) -> None:
        # most specific first, global last; all four have room, so none can fail
        lane = ticket.lane
        ticket.tenant.limiter.acquire_on_behalf_of_nowait(ticket)
        lane.target_limiter.acquire_on_behalf_of_nowait(ticket)
        lane.adapter_limiter.acquire_on_behalf_of_nowait(ticket)
        self._global.acquire_on_behalf_of_nowait(ticket)
        ticket.granted = True
        running = self._running_by_priority
        running[ticket.priority] = running.get(ticket.priority, 0) + 1
        now = trio.current_time()
        if queued:  # service while runs wait: a sample of the target's rate
            lane.rate.tick(now, since=lane.backlogged_since)
        else:
            lane.rate.last = now
        self._rate.tick(now)

    def is_waiting(self, borrower: object) -> bool:
        """Whether ``borrower``'s run waits in the queue."""
        return borrower in self._waiting

    def withdraw(self, borrower: object) -> bool:
        """Take ``borrower``'s waiting run out of the queue: its :meth:`acquire` raises
        GateWithdrawn. False (and nothing done) if it is not waiting.

        Cheaper than cancelling the waiting task: no Cancelled is delivered, so a
        drain can empty a queue of 100,000 runs quickly.
        """
        ticket = self._waiting.get(borrower)
        if ticket is None or (ticket.task is None and ticket.on_grant is None):
            return False
        self._dequeue(ticket)
        ticket.withdrawn = True
        if ticket.task is not None:
            trio.lowlevel.reschedule(ticket.task)
        return True

    def _enqueue(self, ticket: _Ticket) -> None:
        lane = ticket.lane
        level = lane.levels.get(ticket.priority)
        if level is None:
            level = lane.levels[ticket.priority] = _Level()
        level.add(ticket)
        if not lane.waiting:
            lane.backlogged_since = trio.current_time()
        lane.waiting += 1
        ticket.tenant.queued += 1
        self._waiting[ticket.borrower] = ticket
        self._busy_lanes[lane] = None
        self._queued += 1

    def _dequeue(self, ticket: _Ticket, *, served: bool = False) -> None:
        """Take a waiting ``ticket`` out of the queue (``served``: it is being granted)."""
        if self._waiting.get(ticket.borrower) is not ticket:
            return
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
        del self._waiting[ticket.borrower]
        lane.waiting -= 1
        ticket.tenant.queued -= 1
        self._queued -= 1
        if not lane.waiting:
            del self._busy_lanes[lane]
        if not served:
            self._forget_if_idle(ticket.tenant)

    def _forget_if_idle(self, tenant: _Tenant) -> None:
        # a tenant never set is kept only while it has runs, so names cannot pile up
        if tenant.idle and self._tenants.get(tenant.name) is tenant:
            del self._tenants[tenant.name]

    def _release(self, ticket: _Ticket) -> None:
        lane = ticket.lane
        self._global.release_on_behalf_of(ticket)
        lane.adapter_limiter.release_on_behalf_of(ticket)
        lane.target_limiter.release_on_behalf_of(ticket)
        ticket.tenant.limiter.release_on_behalf_of(ticket)
        running = self._running_by_priority
        running[ticket.priority] -= 1
        if not running[ticket.priority]:
            del running[ticket.priority]
        self._forget_if_idle(ticket.tenant)
        self._dispatch()

    def _dispatch(self) -> None:
        """Grant the best grantable waiting run until none is left: of the targets with
        room, the candidate of highest priority, the oldest on a tie (see ``_Lane.pick``
        for the order within a target)."""
        while self._busy_lanes and _has_room(self._global):
            best: _Ticket | None = None
            for lane in self._busy_lanes:
                if not (_has_room(lane.target_limiter) and _has_room(lane.adapter_limiter)):
                    continue
                candidate = lane.pick()
                if candidate is not None and (
                    best is None
                    or (candidate.priority, -candidate.order) > (best.priority, -best.order)
                ):
                    best = candidate
            if best is None:
                return
            self._dequeue(best, served=True)
            self._grant(best, queued=True)
            if best.on_grant is not None:
                best.on_grant(Permit(self, best))
            else:
                assert best.task is not None
                trio.lowlevel.reschedule(best.task)
