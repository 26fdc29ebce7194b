"""The run lifecycle: statuses, events and the one transition table.

Everything that changes a run's status goes through :class:`RunState`, which
checks the move against :data:`TRANSITIONS` and makes the matching event with
the next ``seq``. This module does no I/O.

::

    QUEUED -> RUNNING -> SUCCEEDED | FAILED | CANCELLED
    QUEUED -> REJECTED(queue_full | queue_timeout) | CANCELLED
    QUEUED | RUNNING -> INTERRUPTED   (found unfinished after a restart)
"""

from __future__ import annotations

import enum
import types
from collections.abc import Mapping
from typing import Any

import attrs

from ..adapters.base import Usage as Usage  # re-exported: events carry it


class RunStatus(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    INTERRUPTED = "interrupted"

    @property
    def terminal(self) -> bool:
        """True for the statuses a run never leaves."""
        return self not in _LIVE


_LIVE = frozenset({RunStatus.QUEUED, RunStatus.RUNNING})
TERMINAL_STATUSES = frozenset(s for s in RunStatus if s.terminal)


class EventKind(enum.Enum):
    QUEUED = "queued"
    STARTED = "started"
    DELTA = "delta"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    INTERRUPTED = "interrupted"

    @property
    def status(self) -> RunStatus | None:
        """The status this event moves the run to; None for DELTA."""
        return _STATUS_OF_KIND.get(self)

    @property
    def terminal(self) -> bool:
        status = self.status
        return status is not None and status.terminal


_KIND_OF_STATUS: Mapping[RunStatus, EventKind] = {
    RunStatus.QUEUED: EventKind.QUEUED,
    RunStatus.RUNNING: EventKind.STARTED,
    RunStatus.SUCCEEDED: EventKind.SUCCEEDED,
    RunStatus.FAILED: EventKind.FAILED,
    RunStatus.CANCELLED: EventKind.CANCELLED,
    RunStatus.REJECTED: EventKind.REJECTED,
    RunStatus.INTERRUPTED: EventKind.INTERRUPTED,
}
_STATUS_OF_KIND: Mapping[EventKind, RunStatus] = {k: s for s, k in _KIND_OF_STATUS.items()}


class RejectReason(enum.Enum):
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"


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

# Reasons a REJECTED event may carry; other terminal events take free-form reasons.
REJECT_REASONS = frozenset(r.value for r in RejectReason)


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


@attrs.frozen
class RunEvent:
    """One entry of a run's event log. ``seq`` starts at 1 and has no gaps."""

    run_id: str
    seq: int
    kind: EventKind
    time: float
    text: str = ""
    reason: str = ""
    message: str = ""
    usage: Usage | None = None

    @property
    def status(self) -> RunStatus | None:
        return self.kind.status

    def __repr__(self) -> str:
        extra = ""
        if self.text:
            extra += f" text={self.text!r}"
        if self.reason:
            extra += f" reason={self.reason}"
        return f"<RunEvent {self.run_id}#{self.seq} {self.kind.value}{extra}>"


@attrs.define
class RunRecord:
    """A run as the store keeps it. ``status`` always equals the last status event."""

    run_id: str
    target: str
    status: RunStatus
    background: bool
    created: float
    prompt: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    options: Mapping[str, Any] = attrs.field(factory=dict)
    started: float | None = None
    finished: float | None = None
    reason: str = ""
    message: str = ""
    last_seq: int = 0
    usage: Usage | None = None

    def __repr__(self) -> str:
        reason = f"({self.reason})" if self.reason else ""
        mode = "bg" if self.background else "fg"
        return (
            f"<RunRecord {self.run_id} {self.target} {self.status.value}{reason} "
            f"{mode} seq={self.last_seq}>"
        )

    def apply(self, event: RunEvent) -> None:
        """Fold ``event`` into the record: seq, status, times and reason.

        Raises :class:`IllegalTransition` for a status event the table does not
        allow, and ValueError for a seq that is not the next one or a DELTA on
        a run that is not RUNNING. The record is unchanged when it raises.
        """
        if event.seq != self.last_seq + 1:
            raise ValueError(f"run {self.run_id}: event seq {event.seq} after {self.last_seq}")
        new = event.status
        if new is None:
            if self.status is not RunStatus.RUNNING:
                raise ValueError(f"run {self.run_id}: delta while {self.status.value}")
        else:
            check_transition(self.run_id, self.status, new)
            self.status = new
            if new is RunStatus.RUNNING:
                self.started = event.time
            elif new.terminal:
                self.finished = event.time
                self.reason = event.reason
                self.message = event.message
                self.usage = event.usage
        self.last_seq = event.seq


@attrs.define(repr=False)
class RunState:
    """The sans-IO state of one run: makes its events, in order, checked.

    ``record`` is updated in place by each method before it returns the event,
    so the in-memory status never lags the event log.
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
    ) -> RunEvent:
        """Move to ``new`` and return its event; raises IllegalTransition."""
        check_transition(self.record.run_id, self.record.status, new)
        if new is RunStatus.REJECTED and reason not in REJECT_REASONS:
            raise ValueError(f"REJECTED needs one of {sorted(REJECT_REASONS)}, not {reason!r}")
        event = RunEvent(
            self.record.run_id,
            self.record.last_seq + 1,
            _KIND_OF_STATUS[new],
            time,
            reason=reason,
            message=message,
            usage=usage,
        )
        self.record.apply(event)
        return event

    def delta(self, text: str, *, time: float) -> RunEvent:
        """A DELTA event; only while RUNNING (ValueError otherwise)."""
        event = RunEvent(self.record.run_id, self.record.last_seq + 1, EventKind.DELTA, time, text)
        self.record.apply(event)
        return event


def interruption(record: RunRecord, *, time: float, message: str) -> RunEvent:
    """The INTERRUPTED event (reason ``node_restart``) for a run found unfinished at start."""
    check_transition(record.run_id, record.status, RunStatus.INTERRUPTED)
    return RunEvent(
        record.run_id,
        record.last_seq + 1,
        EventKind.INTERRUPTED,
        time,
        reason="node_restart",
        message=message,
    )
