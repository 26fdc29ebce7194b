"""The concurrency gate: the Trio shell around the policy of :mod:`.scheduler`.

A run holds one token of its tenant's ``trio.CapacityLimiter``, one of its target's, one
of its adapter's and one of the node's (and, where its adapter has replicas, one of the
replica the scheduler picked at its grant: :mod:`.replicas`), or none at all. The
scheduler decides who may start (its pools count what the limiters hold, and the tokens
runs reserve); the shell carries each decision out: a grant borrows the four tokens on
behalf of the run's :class:`Permit`, always in the order tenant -> target -> adapter ->
node (most specific first), and only once all four have room, so a run never sits on a
token it cannot use yet, the fixed order cannot deadlock, and ``borrowed_tokens`` at
every limiter equals the runs holding a permit under it. The rules (order, fair
queueing, token budgets, refusals, holds) are the scheduler's; see its module docstring.

Runs wait in one of two ways. :meth:`Gate.acquire` is for a task that waits (it parks
with ``wait_task_rescheduled``; its abort takes the ticket out of the queue, so a
deadline or a cancel can never race a grant). :meth:`Gate.enter` never waits: a permit
now, a :class:`GateRejected` now, or the run waits as data, and later exactly one
decision ends its wait: :class:`Admitted` (by whoever made room, synchronously),
:class:`Expired` (by the one :meth:`Gate.expire_waiting` task at its queue deadline), or
:meth:`Gate.withdraw` (its owner's, which decides nothing). The gate hands each decision
to the one :attr:`Gate.decide` its owner set (the run manager, while it runs), so no
per-run callback goes into the gate. The same task wakes the scheduler when the time brings
room (a tenant's token rate refilled, a hold to place).

A run settles its tokens when it releases its permit: :meth:`Permit.settle` says what it
really used, which corrects its tenant's token rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import NoReturn

import attrs
import trio

from ..model import EngineSignals, RejectReason, RunSpec, TenantLimits
from .replicas import ReplicaSet, ReplicaSpec, affinity_of
from .scheduler import (
    INF,
    Pool,
    PoolStats,
    Refusal,
    Scheduler,
    Ticket,
    pool_stats,
)


class GateWithdrawn(Exception):
    """The run was taken out of the queue (:meth:`Gate.withdraw`) before it got a permit."""


class GateRejected(Exception):
    """The gate turned a run away; ``reason`` says why, ``retry_after`` (seconds) when a
    run like it would likely get in (None: it never would, as it is: ``too_large``)."""

    def __init__(self, reason: RejectReason, message: str, retry_after: float | None) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after

    @classmethod
    def of(cls, refusal: Refusal) -> GateRejected:
        return cls(refusal.reason, refusal.message, refusal.retry_after)


def _now() -> float:
    """Trio's time, or 0 outside a Trio run (a gate is configured before the node runs;
    nothing waits then, and a token rate set then starts full either way)."""
    try:
        return trio.current_time()
    except RuntimeError:
        return 0.0


def _limit(value: float) -> int | float:
    """A pool's limit as a CapacityLimiter takes it (an int, or ``math.inf``)."""
    return value if value == INF else int(value)


@attrs.define(eq=False, repr=False)
class _Waiter:
    """How a waiting ticket is told its wait is over: a task parked in acquire(), or (no
    task) a decision for :attr:`Gate.decide`, for a run that waits as data."""

    task: trio.lowlevel.Task | None = None
    refusal: Refusal | None = None  # a task's, when its deadline passed
    withdrawn: bool = False  # a task's, when withdraw() took it out


@attrs.define(eq=False, repr=False)
class Permit:
    """One token of each level, held for one run. Release it exactly once (extra calls are
    no-ops); :meth:`settle` first to say what the run really used. A context manager
    releases on exit."""

    _gate: Gate
    _ticket: Ticket
    released: bool = False
    used: int | None = None

    @property
    def target(self) -> str:
        return self._ticket.lane.name

    @property
    def cost(self) -> int:
        """The tokens the run reserved."""
        return self._ticket.cost

    def at_grant(self, pool: Pool) -> tuple[int, int] | None:
        """``pool``'s runs and reserved tokens once this permit was granted (itself
        included); None if the run does not take from it."""
        ticket = self._ticket
        for mine, seen in zip(ticket.pools, ticket.at_grant, strict=True):
            if mine is pool:
                return seen
        return None

    @property
    def granted_at(self) -> float | None:
        """When it was granted (trio time), None before."""
        return self._ticket.granted_at

    @property
    def replica(self) -> str | None:
        """The name of the replica it holds a place at (None: its adapter has none)."""
        return self._gate.replica_of(self._ticket)

    def reroute(self) -> str | None:
        """Move it to another replica that has room now (its own failed the run before
        a first token); that replica's name, or None if none has (it stays)."""
        return self._gate.reroute(self._ticket)

    def settle(self, used: int | None) -> None:
        """The tokens the run really used (None: unknown, its reservation stands)."""
        self.used = used

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._gate.give_back(self._ticket, self.used)

    def __enter__(self) -> Permit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Permit {self._ticket.key!r} {self._ticket.lane.name} {state}>"


@attrs.frozen
class LimiterStats:
    limit: int | float  # math.inf = unbounded
    borrowed: int
    budget: float = math.inf  # tokens; math.inf = no budget
    reserved: int = 0


@attrs.frozen
class GateStatistics:
    """A snapshot: queued counts and, per level, the limit, the tokens borrowed and the
    token budget and what is reserved of it."""

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
    #: each replica's, by ``ADAPTER@NAME``
    replicas: Mapping[str, LimiterStats] = attrs.field(factory=dict)


def _stats(stats: PoolStats, limiter: trio.CapacityLimiter | None) -> LimiterStats:
    """A pool's figures, with the tokens its limiter lends (the permits themselves)."""
    borrowed = 0 if limiter is None else int(limiter.borrowed_tokens)
    return LimiterStats(_limit(stats.limit), borrowed, stats.budget, stats.reserved)


@attrs.frozen
class Admitted:
    """The gate granted a run that waited as data: ``permit`` is its own to release."""

    borrower: object
    permit: Permit


@attrs.frozen
class Expired:
    """A run that waited as data reached its queue deadline first: ``rejected`` says why
    (it holds nothing)."""

    borrower: object
    rejected: GateRejected


#: What the gate decides about a run that waits as data (:meth:`Gate.enter`).
GateDecision = Admitted | Expired


class Gate:
    """Admits runs under the tenant / target / adapter / node limits and token budgets;
    see the module docstring and :class:`~.scheduler.Scheduler` (whose arguments these
    are). Limits change at runtime with ``set_*``: lowering one lets holders finish,
    raising one admits waiting runs at once, 0 pauses a level. ``early_reject`` is
    settable."""

    def __init__(
        self,
        *,
        concurrency: int,
        max_queued: int,
        queue_timeout: float,
        early_reject: bool = False,
        token_budget: int | None = None,
        hold_after: float | None = None,
    ) -> None:
        extra = {} if hold_after is None else {"hold_after": hold_after}
        self.scheduler = Scheduler(
            concurrency=concurrency,
            max_queued=max_queued,
            queue_timeout=queue_timeout,
            early_reject=early_reject,
            token_budget=token_budget,
            **extra,
        )
        # the CapacityLimiter that mirrors each pool, made as the pool is first used
        self._limiters: dict[Pool, trio.CapacityLimiter] = {}
        self._waiters: dict[Ticket, _Waiter] = {}
        self._changed = trio.lowlevel.ParkingLot()  # wakes expire_waiting
        self._limiter(self.scheduler.node)
        #: who carries out each :data:`GateDecision` about a run that waits as data, at
        #: once and in the order made (it must not raise nor wait): the run manager sets
        #: it while it runs; :meth:`enter` refuses to queue a run while it is None
        self.decide: Callable[[GateDecision], None] | None = None

    def __repr__(self) -> str:
        g = self.global_limiter()
        return (
            f"<Gate global={g.borrowed_tokens}/{g.total_tokens} queued={self.queued}"
            f"/{self.max_queued} targets={len(self.scheduler.lanes)}>"
        )

    @property
    def early_reject(self) -> bool:
        return self.scheduler.early_reject

    @early_reject.setter
    def early_reject(self, value: bool) -> None:
        self.scheduler.early_reject = value

    @property
    def max_queued(self) -> int:
        return self.scheduler.max_queued

    @property
    def queue_timeout(self) -> float:
        return self.scheduler.queue_timeout

    def _limiter(self, pool: Pool) -> trio.CapacityLimiter:
        limiter = self._limiters.get(pool)
        if limiter is None:
            limiter = self._limiters[pool] = trio.CapacityLimiter(_limit(pool.limit))
        elif limiter.total_tokens != _limit(pool.limit):
            limiter.total_tokens = _limit(pool.limit)
        return limiter

    def _mirror(self, pools: Iterable[Pool]) -> None:
        for pool in pools:
            self._limiter(pool)

    # --- configuration -------------------------------------------------------------------

    def add_adapter(
        self,
        name: str,
        limit: int | None,
        *,
        max_concurrency: int | None = None,
        token_budget: int | None = None,
    ) -> None:
        pool = self.scheduler.add_adapter(
            name, limit, max_concurrency=max_concurrency, token_budget=token_budget
        )
        self._limiter(pool)

    def add_target(
        self,
        name: str,
        *,
        adapter: str,
        limit: int,
        max_queued: int | None = None,
        queue_timeout: float | None = None,
        token_budget: int | None = None,
    ) -> None:
        lane = self.scheduler.add_target(
            name,
            adapter=adapter,
            limit=limit,
            max_queued=max_queued,
            queue_timeout=queue_timeout,
            token_budget=token_budget,
        )
        self._limiter(lane.target)

    def add_replicas(
        self, adapter: str, specs: list[ReplicaSpec], routing: str = "least_loaded"
    ) -> ReplicaSet:
        """Spread ``adapter``'s runs over replicas (see :mod:`.replicas`)."""
        replicas = self.scheduler.add_replicas(adapter, specs, routing)
        self._mirror(r.pool for r in replicas.replicas)
        return replicas

    def replica_of(self, ticket: Ticket) -> str | None:
        if ticket.replica is None:
            return None
        return self.scheduler.replica_sets[ticket.lane.adapter_name].of_pool(ticket.replica).name

    def mark_replica(self, adapter: str, name: str, down: bool) -> None:
        """Mark a replica down (it gets no run) or clear it (waiting runs may go there)."""
        replicas = self.scheduler.replica_sets[adapter]
        granted = self.scheduler.mark_replica(adapter, name, down, _now())
        self._changed_limits(granted, replicas.by_name[name].pool)

    def set_replica_signals(self, adapter: str, name: str, signals: EngineSignals | None) -> None:
        """A replica's engine's figures, as scraped; None: the scrape failed, and it is
        taken for saturated (picked last) until one answers."""
        replicas = self.scheduler.replica_sets[adapter]
        if signals is None:
            replicas.set_signals(name, math.inf, 1.0)
        else:
            replicas.set_signals(name, signals.waiting, signals.kv_usage)

    def reroute(self, ticket: Ticket) -> str | None:
        """See :meth:`Permit.reroute`."""
        was = ticket.replica  # the scheduler's reroute raises if it holds none
        other = self.scheduler.reroute(ticket, _now())
        if other is None or was is None:
            return None
        self._limiter(was).release_on_behalf_of(ticket)
        self._limiter(other.pool).acquire_on_behalf_of_nowait(ticket)
        granted = self.scheduler.dispatch(_now())  # the room it left may take a waiter
        self._carry_out(granted)
        return other.name

    def _changed_limits(self, granted: list[Ticket], *pools: Pool) -> None:
        self._mirror(pools)
        self._carry_out(granted)

    def set_global_limit(self, limit: int) -> None:
        node = self.scheduler.node
        self._changed_limits(self.scheduler.set_node_limit(limit, _now()), node)

    def set_adapter_limit(self, name: str, limit: int | None) -> int | None:
        """Set the configured limit (None = none); returns the limit in force (capped by
        the capability; None = unbounded)."""
        granted = self.scheduler.set_adapter_limit(name, limit, _now())
        self._changed_limits(granted, self.scheduler.adapters[name])
        return self.adapter_limit(name)

    def adapter_limit(self, name: str) -> int | None:
        """The adapter limit in force, None if unbounded."""
        limit = self.scheduler.adapters[name].limit
        return None if limit == INF else int(limit)

    def set_target_limit(self, name: str, limit: int | float) -> None:
        granted = self.scheduler.set_target_limit(name, limit, _now())
        self._changed_limits(granted, self.scheduler.lane(name).target)

    def set_pool_limit(self, pool: Pool, limit: float) -> None:
        """Set a pool's limit (what a learned concurrency does)."""
        self._changed_limits(self.scheduler.set_pool_limit(pool, limit, _now()), pool)

    def set_pool_budget(self, pool: Pool, budget: float) -> None:
        """Set a pool's token budget (what a learned capacity does)."""
        self._changed_limits(self.scheduler.set_pool_budget(pool, budget, _now()), pool)
        self._changed.unpark_all()

    def set_tenant(self, name: str, limits: TenantLimits) -> None:
        """See :meth:`Scheduler.set_tenant`."""
        granted = self.scheduler.set_tenant(name, limits, _now())
        self._changed_limits(granted, self.scheduler.tenant(name).pool)
        self._changed.unpark_all()  # a token rate may bring room with time

    def tenant_limits(self, name: str) -> TenantLimits:
        return self.scheduler.tenant_limits(name)

    def is_set(self, tenant: str) -> bool:
        """Whether ``tenant``'s share was set (:meth:`set_tenant`)."""
        found = self.scheduler.tenants.get(tenant)
        return found is not None and found.configured

    def tenants(self) -> dict[str, TenantLimits]:
        """The tenants whose share was set, and their shares."""
        return {n: self.tenant_limits(n) for n, t in self.scheduler.tenants.items() if t.configured}

    def set_queue(
        self, *, max_queued: int | None = None, queue_timeout: float | None = None
    ) -> None:
        self.scheduler.set_queue(max_queued=max_queued, queue_timeout=queue_timeout)

    # --- introspection -------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return self.scheduler.queued

    def targets(self) -> Iterator[str]:
        return iter(self.scheduler.lanes)

    def global_limiter(self) -> trio.CapacityLimiter:
        return self._limiter(self.scheduler.node)

    def adapter_limiter(self, name: str) -> trio.CapacityLimiter:
        return self._limiter(self.scheduler.adapters[name])

    def target_limiter(self, name: str) -> trio.CapacityLimiter:
        return self._limiter(self.scheduler.lane(name).target)

    def target_pool(self, name: str) -> Pool:
        return self.scheduler.lane(name).target

    def adapter_pool(self, name: str) -> Pool:
        return self.scheduler.adapters[name]

    def mirrors_agree(self) -> bool:
        """Whether every limiter lends exactly as many tokens as its pool counts runs (an
        invariant: the tests ask)."""
        return all(
            limiter.borrowed_tokens == pool.running for pool, limiter in self._limiters.items()
        )

    def counts_tokens(self, target: str, tenant: str) -> bool:
        """See :meth:`Scheduler.counts_tokens`."""
        return self.scheduler.counts_tokens(target, tenant)

    def adapter_of(self, target: str) -> str:
        return self.scheduler.lane(target).adapter_name

    def statistics(self) -> GateStatistics:
        s = self.scheduler

        def stats(pool: Pool) -> LimiterStats:
            return _stats(pool_stats(pool), self._limiters.get(pool))

        tenants = {n: stats(t.pool) for n, t in s.tenants.items()}
        return GateStatistics(
            queued=s.queued,
            max_queued=s.max_queued,
            queue_timeout=s.queue_timeout,
            global_=stats(s.node),
            adapters={n: stats(p) for n, p in s.adapters.items()},
            targets={n: stats(lane.target) for n, lane in s.lanes.items()},
            queued_by_target={n: lane.waiting for n, lane in s.lanes.items()},
            tenants=tenants,
            queued_by_tenant={n: t.queued for n, t in s.tenants.items()},
            queued_by_priority=s.queued_by_priority(),
            running_by_priority=dict(s.running_by_priority),
            replicas={
                f"{adapter}@{r.name}": stats(r.pool)
                for adapter, replicas in s.replica_sets.items()
                for r in replicas.replicas
            },
        )

    # --- admission -----------------------------------------------------------------------

    async def acquire(
        self,
        borrower: object,
        target: str,
        *,
        priority: int = 0,
        tenant: str = "",
        queue_timeout: float | None = None,
        cost: int = 0,
    ) -> Permit:
        """Wait for a permit for ``target``, or raise :class:`GateRejected`.

        ``borrower`` names the holder in the limiters (it must not hold a token of them
        already). ``queue_timeout`` is the run's own bound on waiting; the smaller of it
        and the target's (or node's) applies. ``cost``: the tokens it reserves. Raises
        :class:`UnknownTarget` at once for a target that is not registered. If
        cancelled while waiting the run leaves the queue and holds nothing; a run
        granted in the same instant its deadline passed keeps its permit. Raises
        GateWithdrawn if :meth:`withdraw` takes it out of the queue. Always a checkpoint.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        ticket, refusal = self._admit(borrower, target, priority, tenant, cost, queue_timeout)
        if refusal is not None:
            await self._turn_away(refusal)
        if ticket.granted:
            self._borrow(ticket)
            await trio.lowlevel.cancel_shielded_checkpoint()
            return Permit(self, ticket)
        waiter = self._waiters[ticket] = _Waiter(task=trio.lowlevel.current_task())
        self._changed.unpark_all()

        def abort(_: object) -> trio.lowlevel.Abort:
            # its deadline or an outside cancel: a granted ticket's task has been
            # rescheduled already and is never aborted, so this one still waits
            self._waiters.pop(ticket, None)
            _, granted = self.scheduler.withdraw(borrower, trio.current_time())
            self._forget_limiter(ticket)
            self._carry_out(granted)
            return trio.lowlevel.Abort.SUCCEEDED

        # its deadline is its own (expire_waiting may meet it first, with the same answer)
        with trio.move_on_at(ticket.deadline):
            await trio.lowlevel.wait_task_rescheduled(abort)
        if ticket.granted:
            return Permit(self, ticket)
        if waiter.withdrawn:
            raise GateWithdrawn()
        raise GateRejected.of(waiter.refusal or self.scheduler.expiry(ticket, trio.current_time()))

    def enter(
        self,
        borrower: object,
        target: str,
        *,
        priority: int = 0,
        tenant: str = "",
        queue_timeout: float | None = None,
        cost: int = 0,
        spec: RunSpec | None = None,
    ) -> Permit | None:
        """:meth:`acquire` for a run that waits as data, not as a task: never waits.
        ``spec``: the run's, whose prompt says where prefix routing sends it.

        Returns a Permit if the run may start now; raises GateRejected if it is refused
        at once (as ``acquire`` would be before waiting); else it waits in the queue and
        None is returned. Then exactly one of these happens: :attr:`decide` gets
        ``Admitted(borrower, permit)`` when it is granted (synchronously, by whoever
        made room), ``Expired(borrower, rejected)`` when its queue deadline passes first
        (by :meth:`expire_waiting`), or :meth:`withdraw` takes it out (no decision). The
        order between runs is the same as for runs waiting in ``acquire``. RuntimeError,
        and the gate as it was, if the run would wait and :attr:`decide` is None.
        """
        ticket, refusal = self._admit(
            borrower, target, priority, tenant, cost, queue_timeout, self._affinity(target, spec)
        )
        if refusal is not None:
            raise GateRejected.of(refusal)
        if ticket.granted:
            self._borrow(ticket)
            return Permit(self, ticket)
        if self.decide is None:
            _, granted = self.scheduler.withdraw(borrower, trio.current_time())
            self._forget_limiter(ticket)
            self._carry_out(granted)
            raise RuntimeError("a run waits as data only while Gate.decide is set")
        self._waiters[ticket] = _Waiter()
        self._changed.unpark_all()
        return None

    def enter_now(
        self,
        borrower: object,
        target: str,
        *,
        priority: int = 0,
        tenant: str = "",
        cost: int = 0,
        spec: RunSpec | None = None,
    ) -> Permit | None:
        """The Permit :meth:`enter` would grant at once, or None and the gate is as it was.

        Never queues nor refuses: a run that gets None goes on to :meth:`enter` (which
        may queue or refuse it) as if this had not been called. A tenant that only this
        call brought is forgotten again.
        """
        ticket = self.scheduler.ticket(
            borrower,
            target,
            priority=priority,
            tenant=tenant,
            cost=cost,
            affinity=self._affinity(target, spec),
        )
        if not self.scheduler.start_now(ticket, trio.current_time()):
            return None
        self._borrow(ticket)
        return Permit(self, ticket)

    async def expire_waiting(self) -> None:
        """Until cancelled: reject each run waiting as data (:meth:`enter`) whose queue
        deadline has passed (an :class:`Expired` decision), and let in what the time lets in (a
        token rate that refilled). One task per gate runs this."""
        while True:
            now = trio.current_time()
            granted, expired = self.scheduler.advance(now)
            for ticket, refusal in expired:
                waiter = self._waiters.pop(ticket)
                self._forget_limiter(ticket)
                if waiter.task is not None:
                    waiter.refusal = refusal
                    trio.lowlevel.reschedule(waiter.task)
                else:
                    self._tell(Expired(ticket.key, GateRejected.of(refusal)))
            self._carry_out(granted)
            with trio.move_on_at(self.scheduler.wakeup(trio.current_time())):
                await self._changed.park()

    def _admit(
        self,
        borrower: object,
        target: str,
        priority: int,
        tenant: str,
        cost: int,
        queue_timeout: float | None,
        affinity: int | None = None,
    ) -> tuple[Ticket, Refusal | None]:
        """A new ticket for ``borrower``'s run, admitted now: granted, waiting, or refused
        (the Refusal); UnknownTarget for a target not registered."""
        ticket = self.scheduler.ticket(
            borrower,
            target,
            priority=priority,
            tenant=tenant,
            cost=cost,
            queue_timeout=queue_timeout,
            affinity=affinity,
        )
        return ticket, self.scheduler.admit(ticket, trio.current_time())

    def _affinity(self, target: str, spec: RunSpec | None) -> int | None:
        """``spec``'s affinity (:func:`~.replicas.affinity_of`) where ``target``'s adapter
        routes by prefix, else None (nothing to hash)."""
        lane = self.scheduler.lanes.get(target)
        replicas = None if lane is None else self.scheduler.replica_sets.get(lane.adapter_name)
        if spec is None or replicas is None or replicas.routing != "prefix":
            return None
        return affinity_of(spec.prompt, spec.messages)

    async def _turn_away(self, refusal: Refusal) -> NoReturn:
        await trio.lowlevel.cancel_shielded_checkpoint()
        raise GateRejected.of(refusal)

    def _borrow(self, ticket: Ticket) -> None:
        """Take ``ticket``'s four tokens: most specific first, the node's last. The
        scheduler counted room in each pool, so none can fail."""
        for pool in ticket.pools:
            self._limiter(pool).acquire_on_behalf_of_nowait(ticket)

    def full_level(self, borrower: object) -> str | None:
        """The level that was full as ``borrower``'s waiting run is now (see
        :meth:`~.tickets.Ticket.full_level`); None if it does not wait."""
        ticket = self.scheduler.waiting(borrower)
        if ticket is None:
            return None
        return self.scheduler.full_level(ticket, trio.current_time())

    def is_waiting(self, borrower: object) -> bool:
        """Whether ``borrower``'s run waits in the queue."""
        return self.scheduler.waiting(borrower) is not None

    def withdraw(self, borrower: object) -> bool:
        """Take ``borrower``'s waiting run out of the queue: its :meth:`acquire` raises
        GateWithdrawn. False (and nothing done) if it is not waiting.

        Cheaper than cancelling the waiting task: no Cancelled is delivered, so a drain
        can empty a queue of 100,000 runs quickly.
        """
        ticket, granted = self.scheduler.withdraw(borrower, trio.current_time())
        if ticket is None:
            return False
        waiter = self._waiters.pop(ticket)
        self._forget_limiter(ticket)
        if waiter.task is not None:
            waiter.withdrawn = True
            trio.lowlevel.reschedule(waiter.task)  # it raises GateWithdrawn
        self._carry_out(granted)
        return True

    def _forget_limiter(self, ticket: Ticket) -> None:
        """A tenant the scheduler forgot (never set, no runs left) takes its limiter along."""
        pool = ticket.tenant.pool
        if ticket.tenant.name not in self.scheduler.tenants and not pool.running:
            self._limiters.pop(pool, None)

    def give_back(self, ticket: Ticket, used: int | None) -> None:
        """Give back the tokens of ``ticket``'s permit, which used ``used`` of them (None:
        its reservation stands), and grant what that makes room for. Once per permit:
        :meth:`Permit.release` calls it (call that)."""
        for pool in reversed(ticket.pools):
            self._limiter(pool).release_on_behalf_of(ticket)
        granted = self.scheduler.release(ticket, trio.current_time(), used)
        self._forget_limiter(ticket)
        self._carry_out(granted)
        if ticket.tenant.bucket is not None:
            self._changed.unpark_all()  # its settlement may bring room with time

    def _carry_out(self, granted: list[Ticket]) -> None:
        """Give each granted ticket its tokens and tell its waiter, in the order granted."""
        for ticket in granted:
            self._borrow(ticket)
            waiter = self._waiters.pop(ticket)
            if waiter.task is None:
                self._tell(Admitted(ticket.key, Permit(self, ticket)))
            else:
                trio.lowlevel.reschedule(waiter.task)

    def _tell(self, decision: GateDecision) -> None:
        # enter() queued the run only with decide set; it stays set while runs wait
        assert self.decide is not None, decision
        self.decide(decision)
