"""What the SQLite store's writer thread writes: the plans, and the backend that makes them.

A write call of :class:`~iop_trio.store.sqlite.SqliteStore` becomes a *plan*, one attrs
class per kind (:data:`PLANS`), carried by a :class:`~iop_trio.store.group_commit.Job`
to the writer thread. There :class:`SqliteWriter` (the group-commit engine's
:class:`~iop_trio.store.group_commit.WriteBackend`) makes a batch of them in one
transaction. A batch of creates, appends and syncs only (the plans with ``bulk``) is
made with a few multi-row statements; should that fail for a reason that does not pass,
it is made again job by job, each in its own SAVEPOINT, to refuse the job at fault alone.

Each event is folded into its run's row with :func:`iop_trio.lifecycle.fold`, against
the state committed before it (earlier jobs of the same batch included), by one path
(:meth:`SqliteWriter.fold_events`) for both. The writer keeps the fold state of live runs
in memory so that an append costs no SELECT; it is dropped whenever a job or a
transaction fails, and reloaded from the file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from typing import ClassVar, Literal

import attrs

from ..lifecycle import RunState, fold
from ..model import RunEvent, RunRecord, RunSpec
from .base import StoreError, StoreUnavailable, unfinished_usage
from .group_commit import Job, store_error
from .sqlite_file import StoreFile, create_private, uri
from .sqlite_schema import (
    EVENT_COLUMNS,
    FOLD_COLUMNS,
    LIVE_VALUES,
    RUN_COLUMNS,
    TERMINAL_VALUES,
    check_or_create_schema,
    event_row,
    fold_record,
    insert_rows,
    marks,
    select_ids,
    select_rows,
    update_folds,
    write_event,
)

#: The store's log (logger ``iop_trio.store.sqlite``).
log = logging.getLogger("iop_trio.store.sqlite")

#: Primary SQLite result codes of failures that pass (the disk fills, an I/O error,
#: another process holds a lock too long): the batch is retried, never refused.
PASSING_CODES = frozenset(
    {
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
        sqlite3.SQLITE_NOMEM,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_PROTOCOL,
    }
)
#: The writer checkpoints the WAL between batches, off the commit path: once it holds
#: this many bytes and nothing is pending (the writer is idle) ...
IDLE_CHECKPOINT = 256 * 1024
#: ... or, however busy, once it holds this many.
BUSY_CHECKPOINT = 768 * 1024
#: SQLite's own checkpoint inside a commit, at this many pages (4 KiB each, about 1 MiB
#: with their headers), is left as the bound that only a batch larger than the room left
#: under it can reach ...
WAL_AUTOCHECKPOINT = 256
#: ... and the WAL is truncated to this many bytes when it is reset (after a checkpoint
#: that copied it all), so a small disk holds and the file's size is what it holds.
JOURNAL_SIZE_LIMIT = 0
#: The run id of a probe's row; no run has it (a run id starts with a letter or digit).
PROBE_RUN = "\x00probe"


# --- the plans ------------------------------------------------------------------------------


@attrs.frozen
class CreatePlan:
    """``create``: a new run's row, its events' rows, and what the writer keeps of it to
    fold later appends into (``kept``; None once it ended). Refused if the run exists."""

    label: ClassVar[str] = "create"
    withdrawable: ClassVar[bool] = True
    bulk: ClassVar[bool] = True
    run_id: str
    row: tuple[object, ...]
    event_rows: tuple[tuple[object, ...], ...]
    kept: RunRecord | None

    @property
    def size(self) -> int:
        """About how many bytes it writes."""
        return sum(len(v) for r in (self.row, *self.event_rows) for v in r if isinstance(v, str))


@attrs.frozen
class AppendPlan:
    """``append`` (one event) or ``append_many``: events folded into their runs, in order.

    An event the lifecycle refuses, or of an unknown run, writes nothing; the others are
    written. ``many``: the job's result is the list of refusals; else the first refusal is
    its error."""

    withdrawable: ClassVar[bool] = False
    bulk: ClassVar[bool] = True
    size: ClassVar[int] = 0
    events: tuple[RunEvent, ...]
    many: bool = False

    @property
    def label(self) -> str:
        return "append_many" if self.many else "append"


@attrs.frozen
class SyncPlan:
    """``sync``: writes nothing; done once the writes taken before it are."""

    label: ClassVar[str] = "sync"
    withdrawable: ClassVar[bool] = True
    bulk: ClassVar[bool] = True
    size: ClassVar[int] = 0


@attrs.frozen
class InterruptPlan:
    """``interrupt_unfinished``: every live run INTERRUPTED, oldest first; the result is
    the events written."""

    label: ClassVar[str] = "interrupt_unfinished"
    withdrawable: ClassVar[bool] = True
    bulk: ClassVar[bool] = False
    size: ClassVar[int] = 0
    time: float
    message: str
    chars_per_token: float


@attrs.frozen
class PrunePlan:
    """``prune``: terminal runs that finished before ``finished_before`` deleted, with
    their events; the result is how many runs."""

    label: ClassVar[str] = "prune"
    withdrawable: ClassVar[bool] = True
    bulk: ClassVar[bool] = False
    size: ClassVar[int] = 0
    finished_before: float


Plan = CreatePlan | AppendPlan | SyncPlan | InterruptPlan | PrunePlan
#: Every kind of plan; those with ``bulk`` are made with a few statements a batch.
PLANS: tuple[type[Plan], ...] = (CreatePlan, AppendPlan, SyncPlan, InterruptPlan, PrunePlan)


def job_for(plan: Plan) -> Job[Plan]:
    """A job carrying ``plan``, for the caller's task (in the Trio thread)."""
    return Job(plan, plan.label, withdrawable=plan.withdrawable, size=plan.size)


class SqliteStoreHooks:
    """Test seams of a :class:`~iop_trio.store.sqlite.SqliteStore`, called in its writer
    thread; these defaults do nothing. Pass a subclass as the store's ``hooks``."""

    def before_batch(self, labels: list[str]) -> None:
        """The writer has taken a batch (the jobs' labels); its first attempt is next. An
        exception is logged and ignored; blocking here holds the writer."""

    def before_attempt(self, conn: sqlite3.Connection) -> None:
        """Before each attempt at a batch, and each probe, on the writer's connection (a
        test fills the "disk" with ``PRAGMA max_page_count`` here). An exception fails
        the attempt as the batch's own would."""


def passing(exc: BaseException) -> str | None:
    """What went wrong, if ``exc`` (or its cause) is a passing SQLite failure (or the
    store's own StoreUnavailable); else None."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, StoreUnavailable):
            return str(seen)
        code = getattr(seen, "sqlite_errorcode", None)
        if isinstance(seen, sqlite3.Error) and code is not None and code & 0xFF in PASSING_CODES:
            return str(seen) or type(seen).__name__
        seen = seen.__cause__
    return None


@attrs.define
class _Written:
    """What a bulk pass writes: runs' rows, events' rows, the runs whose fold moved."""

    run_rows: list[tuple[object, ...]] = attrs.Factory(list)
    event_rows: list[tuple[object, ...]] = attrs.Factory(list)
    folded: dict[str, RunRecord] = attrs.Factory(dict)


class SqliteWriter:
    """The writer thread's side of the store: its connection, its folds, its plans.

    The :class:`~iop_trio.store.group_commit.WriteBackend` of the store's engine; every
    method runs in the writer thread.
    """

    def __init__(
        self,
        file: StoreFile,
        *,
        synchronous: Literal["NORMAL", "FULL"],
        busy_timeout: float,
        hooks: SqliteStoreHooks,
    ) -> None:
        self.file = file
        self.synchronous = synchronous
        self.busy_timeout = busy_timeout
        self._hooks = hooks
        self._conn: sqlite3.Connection | None = None
        # partial records (see fold_record) of the live runs it has seen, as in the
        # database, so an append needs no SELECT; cleared when in doubt
        self._folds: dict[str, RunRecord] = {}

    def __repr__(self) -> str:
        state = "connected" if self._conn is not None else "not connected"
        return f"<SqliteWriter {self.file.path!r} {state} folds={len(self._folds)}>"

    # --- the WriteBackend ------------------------------------------------------------------

    def open(self) -> None:
        self._conn = self._open_writer()

    def commit(self, jobs: Sequence[Job[Plan]], attempt: int) -> tuple[bool, int]:
        if self._conn is None:
            self._conn = self._open_writer()
            if attempt:
                # a full disk stops the checkpoint a closing connection makes, and a WAL
                # not checkpointed is appended to, not reused, so each attempt would fill
                # the room the disk got back: checkpoint first, and free the WAL's space
                # (a checkpoint that still fails is retried too)
                self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        self._hooks.before_attempt(self._conn)
        made = self._transaction(self._conn, jobs)
        self.file.note_wal()  # its first write made it
        return made

    def passing(self, exc: BaseException) -> str | None:
        return passing(exc)

    def refusal(self, plan: Plan) -> StoreError | None:
        """With the file gone, a create (which its rescue copy could miss) is refused;
        those runs were never acknowledged, and the runs the node has go on."""
        gone = self.file.gone()
        if gone is None or not isinstance(plan, CreatePlan):
            return None
        return StoreUnavailable(f"the run store cannot write: {gone}")

    def reset(self) -> None:
        """Drop the connection, for a fresh one next time; a store whose file is gone keeps
        it: it is the only way left to its runs."""
        if self._conn is not None and self.file.gone() is None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None
            self.file.forget_wal()

    def probe(self, size: int) -> None:
        """Write a row of ``size`` bytes and delete it, two commits. The row is an event of
        a run that cannot exist (:data:`PROBE_RUN`), which nothing reads."""
        if self._conn is None:
            self._conn = self._open_writer()
        conn = self._conn
        self._hooks.before_attempt(conn)
        with self._undone_on_error(conn):
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("DELETE FROM events WHERE run_id = ?", (PROBE_RUN,))
            conn.execute(
                f"INSERT INTO events ({EVENT_COLUMNS}) "
                "VALUES (?, 0, 'probe', 0, zeroblob(?), '', '', NULL, NULL, NULL, '')",
                (PROBE_RUN, size),
            )
            conn.execute("COMMIT")
        conn.execute("DELETE FROM events WHERE run_id = ?", (PROBE_RUN,))

    def tend(self, *, now: bool) -> bool:
        return self.file.tend(self._conn, now=now)

    def between_batches(self, *, idle: bool) -> None:
        """Checkpoint the WAL (PASSIVE: readers are not waited for) once it holds
        :data:`IDLE_CHECKPOINT` bytes and ``idle`` (nothing pending), or
        :data:`BUSY_CHECKPOINT` bytes, so no caller's commit waits for one. A checkpoint
        that fails (a full disk, a lock) is left to the next time: SQLite's own, at
        :data:`WAL_AUTOCHECKPOINT` pages, still bounds the WAL."""
        conn = self._conn
        if conn is None or self.file.gone() is not None:
            return
        if self.file.wal_size() < (IDLE_CHECKPOINT if idle else BUSY_CHECKPOINT):
            return
        try:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error as exc:
            log.debug("run store: a checkpoint between batches failed: %s", exc)

    def tending_due(self) -> bool:
        return self.file.tending_due()

    def time_to_check(self) -> float | None:
        return self.file.time_to_check()

    def close(self) -> None:
        if self._conn is not None:
            if self.file.gone() is not None:
                self.file.rescue(self._conn, closing=True)
            self._conn.close()

    # --- the connection --------------------------------------------------------------------

    def _open_writer(self) -> sqlite3.Connection:
        """Open the writer's connection: the first time making the file if need be and
        noting which it is; again (after a failure) only if it is still that file."""
        path = self.file.path
        if not self.file.opened:
            create_private(path)
            conn = sqlite3.connect(
                path, timeout=self.busy_timeout, isolation_level=None, check_same_thread=True
            )
        else:
            self.file.check_reopen()
            conn = sqlite3.connect(
                uri(path, "rw"),
                uri=True,
                timeout=self.busy_timeout,
                isolation_level=None,
                check_same_thread=True,
            )
        try:
            check_or_create_schema(conn)
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreError(f"cannot use WAL journal mode on {path!r} (got {mode})")
            conn.execute(f"PRAGMA synchronous = {self.synchronous}")
            conn.execute(f"PRAGMA wal_autocheckpoint = {WAL_AUTOCHECKPOINT}")
            conn.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
            self.file.note_opened()
        except BaseException:
            conn.close()
            raise
        return conn

    @contextlib.contextmanager
    def _undone_on_error(self, conn: sqlite3.Connection) -> Iterator[None]:
        """Roll the transaction back (and forget the folds, now in doubt) if the body raises."""
        try:
            yield
        except BaseException:
            self._folds.clear()
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    # --- transactions ----------------------------------------------------------------------

    def _transaction(
        self, conn: sqlite3.Connection, batch: Sequence[Job[Plan]]
    ) -> tuple[bool, int]:
        """Run the batch in one transaction; return whether it committed, and the events
        written. A batch of bulk plans only is made in bulk; should that fail for a reason
        that does not pass, it is made again job by job, to refuse the job at fault alone.
        """
        if all(job.plan.bulk for job in batch):
            try:
                conn.execute("BEGIN IMMEDIATE")
                with self._undone_on_error(conn):
                    events = self._bulk(conn, batch)
                    conn.execute("COMMIT")
                return True, events
            except Exception as exc:
                if passing(exc) is not None:
                    raise
                log.warning("run store: a batch failed in bulk (%s); making it job by job", exc)
                for job in batch:
                    job.error = None
        return self._per_job_transaction(conn, batch)

    def _per_job_transaction(
        self, conn: sqlite3.Connection, batch: Sequence[Job[Plan]]
    ) -> tuple[bool, int]:
        """Run each job of the batch in its own savepoint, so a job that fails (or is
        refused) is undone alone (a batch of one is undone by rolling back); then commit."""
        conn.execute("BEGIN IMMEDIATE")
        events = 0
        alone = len(batch) == 1
        with self._undone_on_error(conn):
            for job in batch:
                if not alone:
                    conn.execute("SAVEPOINT job")
                try:
                    written = self._make_alone(conn, job)
                except Exception as exc:  # this job only; the batch goes on
                    if passing(exc) is not None:
                        raise  # the whole batch is retried
                    self._folds.clear()  # the job may have changed one before it failed
                    if not isinstance(exc, StoreError | sqlite3.Error):
                        log.exception("run store: %s failed unexpectedly", job.label)
                    job.error = store_error(exc, f"{job.label} failed")
                    if alone:
                        conn.execute("ROLLBACK")
                        return False, 0
                    conn.execute("ROLLBACK TO job")
                else:
                    events += written
                if not alone:
                    conn.execute("RELEASE job")
            conn.execute("COMMIT")
        return True, events

    def _make_alone(self, conn: sqlite3.Connection, job: Job[Plan]) -> int:
        """Make one job (in the savepoint of :meth:`_per_job_transaction`); the events it
        wrote. Raises what refuses it."""
        plan = job.plan
        if isinstance(plan, InterruptPlan):
            made = self._interrupt(conn, plan)
            job.result = made
            return len(made)
        if isinstance(plan, PrunePlan):
            job.result = _prune(conn, plan.finished_before)
            return 0
        written = self._bulk(conn, [job])
        if job.error is not None:
            raise job.error
        return written

    def _bulk(self, conn: sqlite3.Connection, jobs: Sequence[Job[Plan]]) -> int:
        """Make create, append and sync jobs with a few statements; return the events written.

        The writer holds the GIL only between statements, so while the Trio thread
        is busy each statement costs a switch interval: a batch of any size takes a
        handful of them here, against four a job one by one. A job whose run exists
        (create) or is unknown (append), or whose event the lifecycle refuses, gets
        its StoreError and nothing of it is written; the others go on.
        """
        creates = [job.plan.run_id for job in jobs if isinstance(job.plan, CreatePlan)]
        taken = select_ids(conn, "SELECT run_id FROM runs WHERE run_id IN ({})", creates)
        self._load_folds(
            conn,
            (e.run_id for job in jobs if isinstance(job.plan, AppendPlan) for e in job.plan.events),
        )
        written = _Written()
        for job in jobs:
            plan = job.plan
            if isinstance(plan, CreatePlan):
                if plan.run_id in taken:
                    job.error = StoreError(f"run {plan.run_id} exists")
                    continue
                taken.add(plan.run_id)
                written.run_rows.append(plan.row)
                written.event_rows.extend(plan.event_rows)
                if plan.kept is not None:
                    self._folds[plan.run_id] = attrs.evolve(plan.kept)
            elif isinstance(plan, AppendPlan):
                refused = self.fold_events(plan.events, written)
                if plan.many:
                    job.result = refused
                elif refused:
                    job.error = StoreError(refused[0])
        insert_rows(conn, "runs", RUN_COLUMNS, written.run_rows)
        insert_rows(conn, "events", EVENT_COLUMNS, written.event_rows)
        update_folds(conn, list(written.folded.values()))
        return len(written.event_rows)

    def _load_folds(self, conn: sqlite3.Connection, run_ids: Iterable[str]) -> None:
        """Load the fold state of the runs among ``run_ids`` not in memory (if stored)."""
        unknown = set(run_ids) - self._folds.keys()
        for row in select_rows(
            conn, f"SELECT {FOLD_COLUMNS} FROM runs WHERE run_id IN ({{}})", sorted(unknown)
        ):
            self._folds[row[0]] = fold_record(row)

    def fold_events(self, events: Iterable[RunEvent], written: _Written) -> list[str]:
        """Fold each event into its run's state in memory (loaded before), in order, and
        add its row to ``written``; return the refusals (an unknown run, a move the
        lifecycle refuses), of events that write nothing. A run that ends is forgotten."""
        refused = []
        for event in events:
            record = self._folds.get(event.run_id)
            try:
                if record is None:
                    raise StoreError(f"event for unknown run {event.run_id}")
                fold(record, event)
            except (StoreError, ValueError, RuntimeError) as exc:  # IllegalTransition
                refused.append(str(exc))
                continue
            written.event_rows.append(event_row(event))
            written.folded[event.run_id] = record
            if record.status.terminal:
                del self._folds[event.run_id]
        return refused

    def _interrupt(self, conn: sqlite3.Connection, plan: InterruptPlan) -> list[RunEvent]:
        """Mark every live run INTERRUPTED (oldest first); the events written. Those found
        RUNNING get the usage of what they asked and were sent (see unfinished_usage)."""
        live = f"status IN ({marks(len(LIVE_VALUES))})"
        rows = conn.execute(
            f"SELECT {FOLD_COLUMNS} FROM runs WHERE {live} ORDER BY id", LIVE_VALUES
        ).fetchall()
        # what those found RUNNING asked and were sent, for their usage: the deltas'
        # tokens (a delta stored before they were kept counts one)
        asked = {
            run_id: RunSpec("", prompt, tuple((r, c) for r, c in json.loads(messages)))
            for run_id, prompt, messages in conn.execute(
                "SELECT run_id, prompt, messages FROM runs WHERE status = 'running'"
            )
        }
        sent = dict(
            conn.execute(
                "SELECT e.run_id, SUM(COALESCE(e.tokens, 1)) FROM runs r JOIN events e "
                "ON e.run_id = r.run_id WHERE r.status = 'running' AND e.kind = 'delta' "
                "GROUP BY e.run_id"
            ).fetchall()
        )
        made = []
        for row in rows:
            record = fold_record(row)
            usage = None
            if record.run_id in asked:
                usage = unfinished_usage(
                    asked[record.run_id], sent.get(record.run_id, 0), plan.chars_per_token
                )
            event = RunState(record).interrupt(time=plan.time, message=plan.message, usage=usage)
            write_event(conn, record, event)
            self._folds.pop(record.run_id, None)
            made.append(event)
        return made


def _prune(conn: sqlite3.Connection, finished_before: float) -> int:
    """Delete terminal runs with ``finished < finished_before`` and their events."""
    condition = f"status IN ({marks(len(TERMINAL_VALUES))}) AND finished < ?"
    args = (*TERMINAL_VALUES, finished_before)
    conn.execute(
        f"DELETE FROM events WHERE run_id IN (SELECT run_id FROM runs WHERE {condition})",
        args,
    )
    return int(conn.execute(f"DELETE FROM runs WHERE {condition}", args).rowcount)
