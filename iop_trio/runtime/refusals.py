"""The refusals the gate's scheduler words, sans I/O: a queue that is full, and a run
whose queue deadline passed. Each names the bound that was met and a hint of when a run
like it would likely get in (see :class:`~.tickets.Refusal`)."""

from __future__ import annotations

from ..model import RejectReason, clamp_retry_after
from .tickets import Rate, Refusal, Ticket


def queue_full(ticket: Ticket, queued: int, max_queued: int, rate: Rate) -> Refusal | None:
    """The queue bound a new waiter would break (the node's, with ``queued`` of
    ``max_queued`` waiting and ``rate`` its grants; its target's; its tenant's), or None."""
    lane, tenant = ticket.lane, ticket.tenant
    if queued >= max_queued:
        message = f"the node's queue is full (max_queued {max_queued}, {queued} waiting)"
        hint = rate.wait_for(queued - max_queued, 1.0)
    elif lane.max_queued is not None and lane.waiting >= lane.max_queued:
        message = (
            f"the queue of {lane.name} is full "
            f"(its max_queued {lane.max_queued}, {lane.waiting} waiting)"
        )
        hint = lane.rate.wait_for(lane.waiting - lane.max_queued, 1.0)
    elif tenant.max_queued is not None and tenant.queued >= tenant.max_queued:
        message = (
            f"the queue of tenant {tenant.name!r} is full "
            f"(its max_queued {tenant.max_queued}, {tenant.queued} waiting)"
        )
        hint = rate.wait_for(tenant.queued - tenant.max_queued, 1.0)
    else:
        return None
    return Refusal(RejectReason.QUEUE_FULL, message, hint)


def expired(ticket: Ticket, now: float) -> Refusal:
    """The refusal of a run whose queue deadline passed at ``now``: ``rate_limited`` if
    its tenant's token rate or tokens in flight held it back then, else
    ``queue_timeout``."""
    lane, tenant = ticket.lane, ticket.tenant
    if not tenant.rate_ready(ticket.cost, now) or not tenant.pool.fits_tokens(ticket.cost):
        bucket = tenant.bucket
        wait = 1.0 if bucket is None else bucket.wait_for(ticket.cost, now)
        return Refusal(
            RejectReason.RATE_LIMITED,
            f"tenant {tenant.name!r} was over its token rate or tokens in flight for "
            f"the {ticket.timeout:g}s this run could wait on {lane.name}",
            clamp_retry_after(wait),
        )
    return Refusal(
        RejectReason.QUEUE_TIMEOUT,
        f"no capacity on {lane.name} within {ticket.timeout:g}s",
        lane.rate.wait_for(lane.waiting, ticket.timeout),
    )
