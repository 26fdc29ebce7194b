"""The run store interface.

A store keeps every run's record and its event log. Records change only by
events: the store folds each appended event into its own copy of the record
(:func:`iop_trio.lifecycle.fold`), so the stored status always equals the last status
event, and an event that breaks the lifecycle table or skips a seq is refused
with an exception instead of being stored.

A store whose writes fail for a passing reason (a full disk, an I/O error)
says so in :meth:`RunStore.health`: new runs are refused with
:class:`StoreUnavailable`, writes already taken wait and are made, in order,
once it writes again.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Literal

import attrs
import trio

# the store's failures live below the protocol's error table that names them (re-exported)
from ..failures import StoreError as StoreError
from ..failures import StoreUnavailable as StoreUnavailable
from ..lifecycle import fold
from ..model import (
    CHARS_PER_TOKEN,
    LATEST_RUNS,
    Prompted,
    RunEvent,
    RunQuery,
    RunRecord,
    RunStatus,
    Usage,
    estimate_prompt_tokens,
    settle_usage,
)


@attrs.frozen
class StoreHealth:
    """Whether the store writes; if not, since when (wall clock) and why."""

    writable: bool = True
    since: float | None = None
    problem: str = ""

    def __str__(self) -> str:
        if self.writable:
            return "writable"
        return f"cannot write: {self.problem}"


HealthListener = Callable[[StoreHealth], None]


def check_first_event(record: RunRecord, event: RunEvent) -> None:
    """StoreError unless ``event`` is the QUEUED event (seq 1) of a QUEUED ``record``."""
    if (
        event.run_id != record.run_id
        or event.seq != 1
        or event.status is not RunStatus.QUEUED
        or record.status is not RunStatus.QUEUED
        or record.last_seq != 1
    ):
        raise StoreError(f"run {record.run_id} must start with a QUEUED event, seq 1")


def created_record(record: RunRecord, event: RunEvent, then: Sequence[RunEvent]) -> RunRecord:
    """The record a :meth:`RunStore.create` of ``record``, ``event`` and ``then`` stores
    (a copy: ``record`` is unchanged). StoreError if ``event`` is not the run's QUEUED
    event, seq 1 (:func:`check_first_event`) or the lifecycle refuses one of ``then``."""
    check_first_event(record, event)
    created = attrs.evolve(record)
    for later in then:
        if later.run_id != record.run_id:
            raise StoreError(f"run {record.run_id}: an event of run {later.run_id} in its create")
        try:
            fold(created, later)
        except (ValueError, RuntimeError) as exc:  # IllegalTransition is a RuntimeError
            raise StoreError(str(exc)) from exc
    return created


def unfinished_usage(asked: Prompted, delta_tokens: int, chars_per_token: float) -> Usage:
    """The usage of a run left RUNNING by a node that is gone, from what the store holds
    (the end at a restart, :meth:`RunStore.interrupt_unfinished`, or a cancel with no
    node running): the prompt it ``asked`` estimated, and the ``delta_tokens`` of its
    stored deltas, both marked estimated."""
    return settle_usage(
        None, prompt=estimate_prompt_tokens(asked, chars_per_token), completion=delta_tokens
    )


#: What usage totals are grouped by: a run's tenant or its target.
UsageGroup = Literal["tenant", "target"]


@attrs.frozen
class UsageTotal:
    """The tokens of the runs of one tenant or target (``name``) that ended in a window
    and carry a usage (those that started): how many, their prompt and completion tokens,
    and how many of those are the node's estimates rather than the engine's counts."""

    name: str
    runs: int
    prompt_tokens: int
    completion_tokens: int
    estimated_prompt_tokens: int
    estimated_completion_tokens: int

    @property
    def estimated_tokens(self) -> int:
        return self.estimated_prompt_tokens + self.estimated_completion_tokens


def refused_error(refused: Sequence[str]) -> StoreError:
    """The error of an ``append_many`` whose events in ``refused`` (messages) were not stored."""
    shown = "; ".join(refused[:3]) + ("; ..." if len(refused) > 3 else "")
    return StoreError(f"{len(refused)} events refused: {shown}")


class RunStore(abc.ABC):
    """Where runs and their events live. All methods are safe to call from many tasks."""

    @abc.abstractmethod
    async def create(
        self, record: RunRecord, event: RunEvent, *, then: Sequence[RunEvent] = ()
    ) -> None:
        """Store a new run, its first (QUEUED) event and the events ``then`` that follow it
        (seq 2, 3, ...), all in one write. Durable when it returns.

        Raises StoreError if a run with that id exists, if ``event`` is not
        the QUEUED event of ``record`` (same run_id, seq 1, record QUEUED with
        ``last_seq`` 1), or if the lifecycle refuses one of ``then`` (see
        :func:`created_record`); then nothing is stored. ``then`` lets a run that
        may start at once store STARTED with its QUEUED event: one write, not two.
        A store should end creates in the order they are called, or close
        together: the run manager lets runs into the gate in that order, so a
        run whose create ends first is let in only once those called before it
        have ended.

        Cancelled, a create is stored whole or not at all, and a store that retries a
        failing write (a full disk) lets a cancelled create go between its attempts,
        storing nothing: the run manager bounds a create so (``store_grace``), and a run
        whose caller was told it was refused must never be stored later.
        """

    @abc.abstractmethod
    async def append(self, event: RunEvent) -> None:
        """Append one event to its run and fold it into the record.

        The event is taken, in order after every earlier append, before the
        first checkpoint: if the caller is cancelled while waiting, the event
        is still written. Returns once it is durable.
        """

    @abc.abstractmethod
    def append_nowait(
        self, event: RunEvent, *, on_durable: Callable[[], None] | None = None
    ) -> None:
        """Take ``event`` to be appended, in order after every earlier append, and return
        without waiting for it to be durable (a later :meth:`append` or :meth:`sync` that
        returns says it is). A store that can refuse it only later logs the refusal.

        ``on_durable``, if given, is called in the Trio thread once the event is durable
        (or its write has failed, which is logged), and the store writes it as soon as it
        can rather than let it gather with others: for a status event that is made
        known only once it is durable."""

    @abc.abstractmethod
    async def append_many(self, events: Sequence[RunEvent]) -> None:
        """Append several events (of one run or many), as :meth:`append` does each, in order.

        All are taken before the first checkpoint. Raises StoreError naming the
        refused ones (see :func:`refused_error`) once the others are durable.
        """

    @abc.abstractmethod
    async def get(self, run_id: str) -> RunRecord | None:
        """A copy of the run's record, or None."""

    @abc.abstractmethod
    async def list_runs(self, query: RunQuery = LATEST_RUNS) -> list[RunRecord]:
        """Copies of the records of the runs ``query`` asks for, newest (last created)
        first (see :class:`~iop_trio.model.RunQuery`)."""

    @abc.abstractmethod
    async def events(
        self, run_id: str, *, after_seq: int = 0, limit: int | None = None
    ) -> list[RunEvent]:
        """The run's events with ``seq > after_seq``, in order ([] for an unknown run);
        at most ``limit`` of them (None: all)."""

    @abc.abstractmethod
    async def interrupt_unfinished(
        self, *, time: float, message: str, chars_per_token: float = CHARS_PER_TOKEN
    ) -> list[RunEvent]:
        """Mark every QUEUED or RUNNING run INTERRUPTED, each with an event; return them.

        Called once when a node starts, before it accepts runs. The INTERRUPTED event of
        a run found RUNNING carries its usage (:func:`unfinished_usage`), in the same
        write, so the usage of a run whose node died is settled once, here, and nowhere
        else (its end was never stored, or it would not be RUNNING): its completion
        tokens are those of its stored deltas, counted as the run counted them (one an
        engine chunk), and its prompt tokens an estimate (``chars_per_token``), both
        marked estimated. What the engine sent after the last stored delta (at most the
        run's unsynced deltas: 64, or 200 ms of them), and what it generated and never
        sent, is not counted. A run found QUEUED never started: no usage.
        """

    @abc.abstractmethod
    async def usage_totals(
        self, *, by: UsageGroup, since: float | None = None, until: float | None = None
    ) -> list[UsageTotal]:
        """The usage of the runs that ended at ``since`` or after and before ``until``
        (unix times; None: no bound), summed by their tenant or target, by name.

        Computed from the runs' records alone, each of which holds its run's usage once
        (settled with its terminal event, in the same write): so nothing is counted
        twice, nor lost. Runs without a usage (they never started) are not counted; runs
        pruned (``store.retention_days``) are gone with their usage.
        """

    @abc.abstractmethod
    async def prune(self, *, finished_before: float) -> int:
        """Delete terminal runs that finished before the given unix time; return how many.

        Their events go with them. ``finished == finished_before`` is kept.
        """

    async def sync(self) -> None:
        """Return once every write taken before the call is durable (at once if none is
        pending). Raises StoreUnavailable if the store gives up on one (when closed)."""
        await trio.lowlevel.checkpoint()

    def health(self) -> StoreHealth:
        """Whether the store writes now."""
        return StoreHealth()

    def watch_health(self, listener: HealthListener) -> None:  # noqa: B027 - optional
        """Call ``listener`` with the new health, in the calling Trio run's thread,
        whenever it changes. A store that cannot fail never calls it."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Flush and release resources; the store is unusable afterwards."""
