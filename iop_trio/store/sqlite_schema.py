"""The run store's SQLite schema, its migrations, and the rows it is made of.

What :class:`~iop_trio.store.sqlite.SqliteStore` writes and reads, as data and pure
functions over a :class:`sqlite3.Connection`: the tables (:data:`SCHEMA`), the
migrations from older versions (:func:`check_or_create_schema`), the column lists, and
the conversions between rows and :class:`~iop_trio.model.RunRecord` /
:class:`~iop_trio.model.RunEvent`. Nothing here holds state or knows of threads.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping
from typing import Any, TypeVar

from ..model import (
    LIVE_STATUSES,
    TERMINAL_STATUSES,
    EventKind,
    RunEvent,
    RunRecord,
    RunStatus,
    Usage,
)
from .base import StoreError, UsageGroup

T = TypeVar("T")

#: The schema this code writes; PRAGMA user_version of the file. Versions 1 (without
#: tenants, priorities and retry hints), 2 (without the runs' token columns and the
#: deltas' token counts) and 3 (without replicas) are migrated in place when the store
#: opens.
SCHEMA_VERSION = 4

SCHEMA = (
    """
    CREATE TABLE runs (
        id INTEGER PRIMARY KEY,              -- creation order; newest first = id DESC
        run_id TEXT NOT NULL UNIQUE,
        target TEXT NOT NULL,
        status TEXT NOT NULL,
        background INTEGER NOT NULL,
        created REAL NOT NULL,
        prompt TEXT NOT NULL,
        messages TEXT NOT NULL,              -- JSON [[role, content], ...]
        options TEXT NOT NULL,               -- JSON object
        started REAL,
        finished REAL,
        reason TEXT NOT NULL,
        message TEXT NOT NULL,
        last_seq INTEGER NOT NULL,
        usage TEXT,                          -- JSON object or NULL
        tenant TEXT NOT NULL DEFAULT '',
        priority INTEGER NOT NULL DEFAULT 0,
        retry_after REAL,                    -- a REJECTED run's hint (seconds) or NULL
        -- the usage's counts again, as numbers, for totals (usage_totals); NULL: none
        prompt_tokens INTEGER,
        completion_tokens INTEGER,
        prompt_estimated INTEGER NOT NULL DEFAULT 0,
        completion_estimated INTEGER NOT NULL DEFAULT 0,
        replica TEXT NOT NULL DEFAULT ''     -- where it ran; '': nowhere, or no replicas
    )
    """,
    "CREATE INDEX runs_status ON runs (status, id)",
    "CREATE INDEX runs_target ON runs (target, id)",
    "CREATE INDEX runs_tenant ON runs (tenant, id)",
    "CREATE INDEX runs_finished ON runs (finished)",
    """
    CREATE TABLE events (
        run_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        kind TEXT NOT NULL,
        time REAL NOT NULL,
        text TEXT NOT NULL,
        reason TEXT NOT NULL,
        message TEXT NOT NULL,
        usage TEXT,                          -- JSON object or NULL
        retry_after REAL,
        tokens INTEGER,                      -- a delta's engine tokens; NULL: before v3
        replica TEXT NOT NULL DEFAULT '',    -- STARTED and a started run's end: where
        PRIMARY KEY (run_id, seq)
    ) WITHOUT ROWID
    """,
)

#: From schema version 1 to 2.
MIGRATE_1_TO_2 = (
    "ALTER TABLE runs ADD COLUMN tenant TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE runs ADD COLUMN priority INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE runs ADD COLUMN retry_after REAL",
    "CREATE INDEX runs_tenant ON runs (tenant, id)",
    "ALTER TABLE events ADD COLUMN retry_after REAL",
)
#: From schema version 2 to 3 (then :func:`fill_token_columns`). A delta stored before
#: reads as one engine token (it holds one chunk at least).
MIGRATE_2_TO_3 = (
    "ALTER TABLE runs ADD COLUMN prompt_tokens INTEGER",
    "ALTER TABLE runs ADD COLUMN completion_tokens INTEGER",
    "ALTER TABLE runs ADD COLUMN prompt_estimated INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE runs ADD COLUMN completion_estimated INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE events ADD COLUMN tokens INTEGER",
)
#: From schema version 3 to 4: a run stored before ran on no replica.
MIGRATE_3_TO_4 = (
    "ALTER TABLE runs ADD COLUMN replica TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE events ADD COLUMN replica TEXT NOT NULL DEFAULT ''",
)

#: The columns that hold a run's usage as numbers (:func:`usage_columns`).
USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "prompt_estimated", "completion_estimated")
RUN_COLUMNS = (
    "run_id, target, status, background, created, prompt, messages, options, "
    "started, finished, reason, message, last_seq, usage, tenant, priority, retry_after, "
    + ", ".join(USAGE_FIELDS)
    + ", replica"
)
EVENT_COLUMNS = (
    "run_id, seq, kind, time, text, reason, message, usage, retry_after, tokens, replica"
)
# Folding reads and writes only the columns lifecycle.fold() looks at or
# changes, so a delta does not reload a long prompt or chat history.
FOLD_FIELDS = (
    "status", "last_seq", "started", "finished", "reason", "message", "usage", "retry_after",
    *USAGE_FIELDS, "replica",
)  # fmt: skip
FOLD_COLUMNS = "run_id, " + ", ".join(FOLD_FIELDS)
LIVE_VALUES = tuple(sorted(s.value for s in LIVE_STATUSES))
TERMINAL_VALUES = tuple(sorted(s.value for s in TERMINAL_STATUSES))


def check_or_create_schema(conn: sqlite3.Connection) -> None:
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"the run store has schema version {version}, newer than this version of "
            f"iop-trio understands ({SCHEMA_VERSION}); upgrade iop-trio or use another file"
        )
    if version == SCHEMA_VERSION:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]  # another process?
        if version == 0:
            tables = conn.execute(
                "SELECT name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"
            ).fetchall()
            if tables:
                raise StoreError(
                    "the file is a SQLite database but not an iop-trio run store "
                    f"(it has {', '.join(sorted(t[0] for t in tables))} and no schema version)"
                )
            for statement in SCHEMA:
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        elif version in (1, 2, 3):
            migrate(conn, version)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        elif version != SCHEMA_VERSION:  # pragma: no cover - no other versions exist
            raise StoreError(f"the run store has schema version {version}; cannot migrate it")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def migrate(conn: sqlite3.Connection, version: int) -> None:
    """Bring a store of schema ``version`` (1 to 3) to :data:`SCHEMA_VERSION`, in the
    caller's transaction."""
    for statement in MIGRATE_1_TO_2 if version == 1 else ():
        conn.execute(statement)
    if version < 3:
        for statement in MIGRATE_2_TO_3:
            conn.execute(statement)
        fill_token_columns(conn)
    for statement in MIGRATE_3_TO_4:
        conn.execute(statement)


def usage_totals_sql(
    by: UsageGroup, since: float | None, until: float | None
) -> tuple[str, list[object]]:
    """The statement (and its arguments) of :meth:`SqliteStore.usage_totals`."""
    column = {"tenant": "tenant", "target": "target"}[by]  # never the caller's text
    where = ["usage IS NOT NULL", "finished IS NOT NULL"]
    args: list[object] = []
    if since is not None:
        where.append("finished >= ?")
        args.append(since)
    if until is not None:
        where.append("finished < ?")
        args.append(until)
    sums = ", ".join(
        f"COALESCE(SUM({count}), 0)"
        for count in (
            "prompt_tokens",
            "completion_tokens",
            "prompt_tokens * prompt_estimated",
            "completion_tokens * completion_estimated",
        )
    )
    # a window reads the runs that ended in it, by the index on finished: left to choose,
    # SQLite takes the index on tenant (or target) to group without sorting, and reads
    # every run (a second for 500,000, against milliseconds for a day of them)
    source = "runs" if since is None and until is None else "runs INDEXED BY runs_finished"
    sql = (
        f"SELECT {column}, COUNT(*), {sums} FROM {source} WHERE {' AND '.join(where)} "
        f"GROUP BY {column} ORDER BY {column}"
    )
    return sql, args


def fill_token_columns(conn: sqlite3.Connection) -> None:
    """Set the token columns of every run with a usage from its JSON (migrating to v3)."""
    rows = conn.execute("SELECT run_id, usage FROM runs WHERE usage IS NOT NULL").fetchall()
    assignments = ", ".join(f"{field} = ?" for field in USAGE_FIELDS)
    conn.executemany(
        f"UPDATE runs SET {assignments} WHERE run_id = ?",
        [(*usage_columns(usage_from_json(usage)), run_id) for run_id, usage in rows],
    )


#: Values in one statement: SQLite's default bound since 3.32 (this module asks no more).
MAX_VALUES = 32766


def chunks(items: list[T], width: int) -> list[list[T]]:
    """``items`` in runs short enough that ``width`` values each fit in one statement."""
    size = max(1, MAX_VALUES // width)
    return [items[i : i + size] for i in range(0, len(items), size)]


def select_rows(conn: sqlite3.Connection, sql: str, ids: list[str]) -> list[tuple[Any, ...]]:
    """``sql`` (with ``{}`` for the list of ids) over ``ids``, a statement per chunk."""
    rows: list[tuple[Any, ...]] = []
    for chunk in chunks(ids, 1):
        rows += conn.execute(sql.format(marks(len(chunk))), chunk).fetchall()
    return rows


def select_ids(conn: sqlite3.Connection, sql: str, ids: list[str]) -> set[str]:
    return {row[0] for row in select_rows(conn, sql, ids)}


def insert_rows(
    conn: sqlite3.Connection, table: str, columns: str, rows: list[tuple[object, ...]]
) -> None:
    if not rows:
        return
    for chunk in chunks(rows, len(rows[0])):
        values = ", ".join([f"({marks(len(chunk[0]))})"] * len(chunk))
        conn.execute(
            f"INSERT INTO {table} ({columns}) VALUES {values}", [v for row in chunk for v in row]
        )


def update_folds(conn: sqlite3.Connection, records: list[RunRecord]) -> None:
    """Set the fold columns of each run to its record's, a statement per chunk."""
    width = 1 + len(FOLD_FIELDS)
    assignments = ", ".join(f"{field} = u.{field}" for field in FOLD_FIELDS)
    for chunk in chunks(records, width):
        values = ", ".join([f"({marks(width)})"] * len(chunk))
        conn.execute(
            f"WITH u({FOLD_COLUMNS}) AS (VALUES {values}) "
            f"UPDATE runs SET {assignments} FROM u WHERE runs.run_id = u.run_id",
            [value for r in chunk for value in (r.run_id, *fold_values(r))],
        )


def marks(n: int) -> str:
    return ", ".join("?" * n)


def usage_json(usage: Usage | None) -> str | None:
    if usage is None:
        return None
    return json.dumps(
        {
            "done_reason": usage.done_reason,
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "prompt_estimated": usage.prompt_estimated,
            "completion_estimated": usage.completion_estimated,
        }
    )


def usage_from_json(text: str | None) -> Usage | None:
    if text is None:
        return None
    data = json.loads(text)
    return Usage(
        data["done_reason"],
        data["prompt_tokens"],
        data["completion_tokens"],
        # absent: stored before the node settled usage, a count the engine's or none
        prompt_estimated=data.get("prompt_estimated", False),
        completion_estimated=data.get("completion_estimated", False),
    )


def usage_columns(usage: Usage | None) -> tuple[object, ...]:
    """The values of :data:`USAGE_FIELDS` for a run whose record holds ``usage``."""
    if usage is None:
        return (None, None, 0, 0)
    return (
        usage.prompt_tokens,
        usage.completion_tokens,
        int(usage.prompt_estimated),
        int(usage.completion_estimated),
    )


def run_row(record: RunRecord) -> tuple[object, ...]:
    return (
        record.run_id,
        record.target,
        record.status.value,
        int(record.background),
        record.created,
        record.prompt,
        json.dumps([[role, content] for role, content in record.messages]),
        json.dumps(dict(record.options)),
        record.started,
        record.finished,
        record.reason,
        record.message,
        record.last_seq,
        usage_json(record.usage),
        record.tenant,
        record.priority,
        record.retry_after,
        *usage_columns(record.usage),
        record.replica,
    )


def run_from_row(row: tuple[Any, ...]) -> RunRecord:
    options: Mapping[str, Any] = json.loads(row[7])
    return RunRecord(
        run_id=row[0],
        target=row[1],
        status=RunStatus(row[2]),
        background=bool(row[3]),
        created=row[4],
        prompt=row[5],
        messages=tuple((role, content) for role, content in json.loads(row[6])),
        options=options,
        started=row[8],
        finished=row[9],
        reason=row[10],
        message=row[11],
        last_seq=row[12],
        usage=usage_from_json(row[13]),
        tenant=row[14],
        priority=row[15],
        retry_after=row[16],
        replica=row[21],
    )


def event_row(event: RunEvent) -> tuple[object, ...]:
    return (
        event.run_id,
        event.seq,
        event.kind.value,
        event.time,
        event.text,
        event.reason,
        event.message,
        usage_json(event.usage),
        event.retry_after,
        event.tokens,
        event.replica,
    )


def event_from_row(row: tuple[Any, ...]) -> RunEvent:
    kind = EventKind(row[2])
    tokens = row[9]
    if tokens is None:  # stored before v3: a delta holds one engine chunk at least
        tokens = 1 if kind is EventKind.DELTA else 0
    return RunEvent(
        run_id=row[0],
        seq=row[1],
        kind=kind,
        time=row[3],
        text=row[4],
        reason=row[5],
        message=row[6],
        usage=usage_from_json(row[7]),
        retry_after=row[8],
        tokens=tokens,
        replica=row[10],
    )


def fold_record(row: tuple[Any, ...]) -> RunRecord:
    """A partial record (no target, prompt, options) for :func:`iop_trio.lifecycle.fold`."""
    return RunRecord(
        run_id=row[0],
        target="",
        status=RunStatus(row[1]),
        background=False,
        created=0.0,
        last_seq=row[2],
        started=row[3],
        finished=row[4],
        reason=row[5],
        message=row[6],
        usage=usage_from_json(row[7]),
        retry_after=row[8],
        replica=row[13],
    )


def fold_values(record: RunRecord) -> tuple[object, ...]:
    """The values of :data:`FOLD_FIELDS` for ``record``."""
    return (
        record.status.value,
        record.last_seq,
        record.started,
        record.finished,
        record.reason,
        record.message,
        usage_json(record.usage),
        record.retry_after,
        *usage_columns(record.usage),
        record.replica,
    )


def write_event(conn: sqlite3.Connection, record: RunRecord, event: RunEvent) -> None:
    """Insert ``event`` and update the run's row to ``record``, which ``event`` was folded into."""
    row = event_row(event)
    conn.execute(f"INSERT INTO events ({EVENT_COLUMNS}) VALUES ({marks(len(row))})", row)
    if event.status is None:  # a delta moves only the seq
        conn.execute("UPDATE runs SET last_seq = ? WHERE run_id = ?", (event.seq, record.run_id))
        return
    assignments = ", ".join(f"{field} = ?" for field in FOLD_FIELDS)
    conn.execute(
        f"UPDATE runs SET {assignments} WHERE run_id = ?",
        (*fold_values(record), record.run_id),
    )
