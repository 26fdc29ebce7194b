"""The concurrency gate: a three-level CapacityLimiter hierarchy with one FIFO queue.

A run holds one token of its target's limiter, one of its adapter's limiter and
one of the global limiter, or none at all. Tokens are taken on behalf of the
run's :class:`Permit`, always in the order target -> adapter -> global, and
only when all three are free at once, so a run never sits on a token it cannot
use yet: ``borrowed_tokens`` at every limiter equals the runs holding a permit
under it.

Waiting runs form one queue, FIFO per target. When capacity appears (a permit
is released, a limit is raised) the gate grants, over and over, the oldest
waiting run whose three limiters all have room. A run whose target is full
therefore never blocks a run of another target (no head-of-line blocking),
and within a target runs start in arrival order. Nobody waits inside a
limiter, so the fixed acquisition order cannot deadlock.

Admission (:meth:`Gate.acquire`): a run that can be granted at once is. Else,
if the queue is full (``max_queued`` node-wide, or the target's own
``max_queued``) it is rejected with ``queue_full`` at once; if its queue
timeout is 0 it is rejected with ``queue_timeout`` at once; otherwise it waits
at most ``queue_timeout`` seconds and is then rejected with ``queue_timeout``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import attrs
import trio

from ..model import RejectReason, UnknownTarget, check_limit, check_seconds


class GateWithdrawn(Exception):
    """The run was taken out of the queue (:meth:`Gate.withdraw`) before it got a permit."""


class GateRejected(Exception):
    """The gate turned a run away; ``reason`` says why."""

    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@attrs.define(eq=False, repr=False)
class _Ticket:
    borrower: object
    lane: _Lane
    order: int
    task: trio.lowlevel.Task | None = None  # set while waiting
    granted: bool = False
    withdrawn: bool = False


@attrs.define(eq=False, repr=False)
class _Lane:
    """One target's limiters and its waiting tickets, oldest first."""

    name: str
    adapter: str
    target_limiter: trio.CapacityLimiter
    adapter_limiter: trio.CapacityLimiter
    max_queued: int | None
    queue_timeout: float | None
    waiting: dict[_Ticket, None] = attrs.field(factory=dict)

    def head(self) -> _Ticket | None:
        return next(iter(self.waiting), None)


def _has_room(limiter: trio.CapacityLimiter) -> bool:
    return limiter.borrowed_tokens < limiter.total_tokens


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


class Gate:
    """Admits runs under the target / adapter / global limits; see the module docstring.

    Limits are changed at runtime with :meth:`set_global_limit`,
    :meth:`set_adapter_limit` and :meth:`set_target_limit`. Lowering a limit
    lets current holders finish and admits nobody new until the borrowed count
    is below the new limit; raising one admits waiting runs at once. A limit
    of 0 pauses that level: runs queue (or are rejected) as if it were full.
    """

    def __init__(self, *, concurrency: int, max_queued: int, queue_timeout: float) -> None:
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
        self._queued = 0
        self._order = 0

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
            queued_by_target={n: len(lane.waiting) for n, lane in self._lanes.items()},
        )

    def _lane(self, target: str) -> _Lane:
        try:
            return self._lanes[target]
        except KeyError:
            raise UnknownTarget(target) from None

    # --- admission -----------------------------------------------------------------------

    async def acquire(self, borrower: object, target: str) -> Permit:
        """Wait for a permit for ``target``, or raise :class:`GateRejected`.

        ``borrower`` names the holder in the limiters (it must not hold a
        token of them already). Raises :class:`UnknownTarget` at once for a
        target that is not registered. If cancelled while waiting the run
        leaves the queue and holds nothing; a run granted in the same instant
        its deadline passed keeps its permit. Always a checkpoint.
        """
        lane = self._lane(target)
        await trio.lowlevel.checkpoint_if_cancelled()
        self._order += 1
        ticket = _Ticket(borrower, lane, self._order)
        if not lane.waiting and self._grantable(lane):
            self._grant(ticket)
            await trio.lowlevel.cancel_shielded_checkpoint()
            return Permit(self, ticket)
        full = self._full(lane)
        if full is not None:
            # the message is made before the checkpoint, so it counts what refused the run
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise GateRejected(RejectReason.QUEUE_FULL, full)
        timeout = self.queue_timeout if lane.queue_timeout is None else lane.queue_timeout
        if timeout <= 0:
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise GateRejected(RejectReason.QUEUE_TIMEOUT, "no capacity and queue_timeout is 0")
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
                RejectReason.QUEUE_TIMEOUT, f"no capacity on {target} within {timeout:g}s"
            )
        return Permit(self, ticket)

    def _full(self, lane: _Lane) -> str | None:
        """Which queue bound a new waiter of ``lane`` would break, in words; None if none."""
        if self._queued >= self.max_queued:
            return (
                f"the node's queue is full (max_queued {self.max_queued}, {self._queued} waiting)"
            )
        if lane.max_queued is not None and len(lane.waiting) >= lane.max_queued:
            return (
                f"the queue of {lane.name} is full "
                f"(its max_queued {lane.max_queued}, {len(lane.waiting)} waiting)"
            )
        return None

    def _grantable(self, lane: _Lane) -> bool:
        return (
            _has_room(lane.target_limiter)
            and _has_room(lane.adapter_limiter)
            and _has_room(self._global)
        )

    def _grant(self, ticket: _Ticket) -> None:
        # most specific first, global last; all three have room, so none can fail
        lane = ticket.lane
        lane.target_limiter.acquire_on_behalf_of_nowait(ticket)
        lane.adapter_limiter.acquire_on_behalf_of_nowait(ticket)
        self._global.acquire_on_behalf_of_nowait(ticket)
        ticket.granted = True

    def withdraw(self, borrower: object) -> bool:
        """Take ``borrower``'s waiting run out of the queue: its :meth:`acquire` raises
        GateWithdrawn. False (and nothing done) if it is not waiting.

        Cheaper than cancelling the waiting task: no Cancelled is delivered, so a
        drain can empty a queue of 100,000 runs quickly.
        """
        ticket = self._waiting.get(borrower)
        if ticket is None or ticket.task is None:
            return False
        self._dequeue(ticket)
        ticket.withdrawn = True
        trio.lowlevel.reschedule(ticket.task)
        return True

    def _enqueue(self, ticket: _Ticket) -> None:
        lane = ticket.lane
        lane.waiting[ticket] = None
        self._waiting[ticket.borrower] = ticket
        self._busy_lanes[lane] = None
        self._queued += 1

    def _dequeue(self, ticket: _Ticket) -> None:
        lane = ticket.lane
        if ticket in lane.waiting:
            del lane.waiting[ticket]
            del self._waiting[ticket.borrower]
            self._queued -= 1
            if not lane.waiting:
                del self._busy_lanes[lane]

    def _release(self, ticket: _Ticket) -> None:
        lane = ticket.lane
        self._global.release_on_behalf_of(ticket)
        lane.adapter_limiter.release_on_behalf_of(ticket)
        lane.target_limiter.release_on_behalf_of(ticket)
        self._dispatch()

    def _dispatch(self) -> None:
        """Grant the oldest grantable waiting run until none is left."""
        while self._busy_lanes and _has_room(self._global):
            best: _Ticket | None = None
            for lane in self._busy_lanes:
                head = lane.head()
                if (
                    head is not None
                    and (best is None or head.order < best.order)
                    and _has_room(lane.target_limiter)
                    and _has_room(lane.adapter_limiter)
                ):
                    best = head
            if best is None:
                return
            self._dequeue(best)
            self._grant(best)
            assert best.task is not None
            trio.lowlevel.reschedule(best.task)
