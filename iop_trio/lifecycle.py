"""The run lifecycle: the one transition table, and :class:`RunState`, which makes every event.

Everything that changes a run's status goes through :class:`RunState`, which
checks the move against :data:`TRANSITIONS` and makes the matching event with
the next ``seq``; :func:`fold` applies an event to a record under the same
rules (the stores fold what they are given with it). This module does no I/O
and imports only :mod:`iop_trio.model`.

::

    QUEUED -> RUNNING -> SUCCEEDED | FAILED | CANCELLED
    QUEUED -> REJECTED(queue_full | queue_timeout) | CANCELLED
    QUEUED | RUNNING -> INTERRUPTED   (found unfinished after a restart)
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import attrs

from .model import (
    REJECT_REASONS,
    TERMINAL_STATUSES,
    EventKind,
    RunEvent,
    RunRecord,
    RunStatus,
    Usage,
)

_NO_OPTIONS: Mapping[str, Any] = types.MappingProxyType({})

# The one transition table. ``None`` is "not yet created".
TRANSITIONS: Mapping[RunStatus | None, frozenset[RunStatus]] = {
    None: frozenset({RunStatus.QUEUED}),
    RunStatus.QUEUED: frozenset(
        {RunStatus.RUNNING, RunStatus.REJECTED, RunStatus.CANCELLED, RunStatus.INTERRUPTED}
    ),
    RunStatus.RUNNING: frozenset(
        {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.INTERRUPTED}
    ),
    **{s: frozenset() for s in TERMINAL_STATUSES},
}

#: The ends that carry a retry hint: the gate's (REJECTED), an engine's (FAILED).
_HINTED = frozenset({RunStatus.REJECTED, RunStatus.FAILED})

#: The reason of the INTERRUPTED event of a run found unfinished when a node starts.
NODE_RESTART = "node_restart"


class IllegalTransition(RuntimeError):
    """A status change that :data:`TRANSITIONS` does not allow."""

    def __init__(self, run_id: str, old: RunStatus | None, new: RunStatus) -> None:
        self.run_id = run_id
        self.old = old
        self.new = new
        shown = old.value if old is not None else "<new>"
        super().__init__(f"run {run_id}: illegal transition {shown} -> {new.value}")


def check_transition(run_id: str, old: RunStatus | None, new: RunStatus) -> None:
    """Raise :class:`IllegalTransition` unless ``old -> new`` is in the table."""
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(run_id, old, new)


def fold(record: RunRecord, event: RunEvent) -> None:
    """Fold ``event`` into ``record``: seq, status, times, reason and usage.

    Raises :class:`IllegalTransition` for a status event the table does not
    allow, and ValueError for a seq that is not the next one, a DELTA on a
    run that is not RUNNING, a token count on an event that is not a DELTA (or
    a negative one), or a usage or a replica on an event that is neither STARTED
    (a replica only) nor the end of a run that started (a RUNNING run's terminal
    event): a run that never started used no tokens and ran nowhere. A replica
    named sets the record's; an event that names none leaves it. The record is
    unchanged when it raises.
    """
    if event.seq != record.last_seq + 1:
        raise ValueError(f"run {record.run_id}: event seq {event.seq} after {record.last_seq}")
    new = event.status
    if new is None:
        if record.status is not RunStatus.RUNNING:
            raise ValueError(f"run {record.run_id}: delta while {record.status.value}")
        if event.tokens < 0:
            raise ValueError(f"run {record.run_id}: a delta of {event.tokens} tokens")
        if event.replica:
            raise ValueError(f"run {record.run_id}: a replica on a delta")
    else:
        check_transition(record.run_id, record.status, new)
        if event.tokens:
            raise ValueError(f"run {record.run_id}: tokens on a {event.kind.value} event")
        ends_started = new.terminal and record.status is RunStatus.RUNNING
        if event.usage is not None and not ends_started:
            raise ValueError(
                f"run {record.run_id}: usage on a {event.kind.value} event "
                f"from {record.status.value}: only the end of a run that started has usage"
            )
        if event.replica and not (new is RunStatus.RUNNING or ends_started):
            raise ValueError(
                f"run {record.run_id}: a replica on a {event.kind.value} event "
                f"from {record.status.value}: only a run that started ran on one"
            )
        record.status = new
        if event.replica:
            record.replica = event.replica
        if new is RunStatus.RUNNING:
            record.started = event.time
        elif new.terminal:
            record.finished = event.time
            record.reason = event.reason
            record.message = event.message
            record.usage = event.usage
            record.retry_after = event.retry_after
    record.last_seq = event.seq


@attrs.define(repr=False)
class RunState:
    """The sans-IO state of one run: makes its events, in order, checked.

    ``record`` is updated in place by each method before it returns the event,
    so the in-memory status never lags the event log. Wrap a stored record
    (``RunState(record)``) to make the events that end it outside a run's
    task: the interruption at start-up, a cancel with no node running.
    """

    record: RunRecord

    @classmethod
    def create(
        cls,
        *,
        run_id: str,
        target: str,
        background: bool,
        time: float,
        prompt: str = "",
        messages: tuple[tuple[str, str], ...] = (),
        options: Mapping[str, Any] | None = None,
        tenant: str = "",
        priority: int = 0,
    ) -> tuple[RunState, RunEvent]:
        """A new run in QUEUED, and its ``queued`` event (seq 1)."""
        check_transition(run_id, None, RunStatus.QUEUED)
        record = RunRecord(
            run_id=run_id,
            target=target,
            status=RunStatus.QUEUED,
            background=background,
            created=time,
            prompt=prompt,
            messages=messages,
            options=dict(options) if options else _NO_OPTIONS,
            tenant=tenant,
            priority=priority,
        )
        event = RunEvent(run_id, 1, EventKind.QUEUED, time)
        record.last_seq = 1
        return cls(record), event

    def __repr__(self) -> str:
        return f"<RunState {self.record!r}>"

    @property
    def status(self) -> RunStatus:
        return self.record.status

    def transition(
        self,
        new: RunStatus,
        *,
        time: float,
        reason: str = "",
        message: str = "",
        usage: Usage | None = None,
        retry_after: float | None = None,
        replica: str = "",
    ) -> RunEvent:
        """Move to ``new`` and return its event; raises IllegalTransition.

        A REJECTED event needs a reason of :data:`~iop_trio.model.REJECT_REASONS`
        (ValueError otherwise). Only REJECTED and FAILED carry ``retry_after`` (the
        gate's hint; an engine's, when it turned the run away with a 429 or 503); any
        other end drops it. Only the end of a run that started carries ``usage``, and
        only STARTED and that end a ``replica`` (ValueError otherwise, see :func:`fold`).
        """
        check_transition(self.record.run_id, self.record.status, new)
        if new is RunStatus.REJECTED and reason not in REJECT_REASONS:
            raise ValueError(f"REJECTED needs one of {sorted(REJECT_REASONS)}, not {reason!r}")
        event = RunEvent(
            self.record.run_id,
            self.record.last_seq + 1,
            new.event_kind,
            time,
            reason=reason,
            message=message,
            usage=usage,
            retry_after=retry_after if new in _HINTED else None,
            replica=replica,
        )
        fold(self.record, event)
        return event

    def interrupt(self, *, time: float, message: str, usage: Usage | None = None) -> RunEvent:
        """The INTERRUPTED event (reason ``node_restart``) of a run found unfinished at
        start; ``usage`` for one found RUNNING (what its stored deltas say it used)."""
        return self.transition(
            RunStatus.INTERRUPTED, time=time, reason=NODE_RESTART, message=message, usage=usage
        )

    def delta(self, text: str, *, time: float, tokens: int = 1) -> RunEvent:
        """A DELTA event of ``text``, which holds ``tokens`` engine tokens; only while
        RUNNING (ValueError otherwise, and for a negative count)."""
        event = RunEvent(
            self.record.run_id,
            self.record.last_seq + 1,
            EventKind.DELTA,
            time,
            text,
            tokens=tokens,
        )
        fold(self.record, event)
        return event
