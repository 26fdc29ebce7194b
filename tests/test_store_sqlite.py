"""What only the SQLite store has: a file, a writer thread, group commit, a schema version.

These tests wait on a real thread, so they use no mock clock; they hold the
writer at a known point with the store's ``hooks`` test seam instead
of sleeping, and every wait is bounded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import stat
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iop_trio.lifecycle import RunState
from iop_trio.model import EventKind, RunEvent, RunQuery, RunRecord, RunStatus
from iop_trio.runtime import Usage
from iop_trio.store import RunStore, StoreError, StoreUnavailable
from iop_trio.store.memory import MemoryStore
from iop_trio.store.sqlite import (
    BUSY_CHECKPOINT,
    SCHEMA_VERSION,
    WAL_AUTOCHECKPOINT,
    SqliteStore,
    SqliteStoreHooks,
    usage_totals_sql,
)
from iop_trio.store.sqlite_schema import MIGRATE_1_TO_2, MIGRATE_2_TO_3

from .support import HealthLog, logged, read_only
from .test_store_contract import created, finished, new_run, running, seqs

LIMIT = 20  # seconds; a generous bound for anything that waits on the writer thread


@pytest.fixture
def gate() -> WriterGate:
    """The hooks of the ``store`` fixture: a gate that holds nothing until told to."""
    return WriterGate()


@pytest.fixture
async def store(tmp_path: Path, gate: WriterGate) -> AsyncIterator[SqliteStore]:
    made = SqliteStore(tmp_path / "runs.db", hooks=gate)
    try:
        yield made
    finally:
        await made.aclose()


class WriterGate(SqliteStoreHooks):
    """A store's hooks: once :meth:`hold` is called, holds the writer thread before each
    batch (after taking it) until released, and notes each batch's labels."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self._entered = threading.Event()
        self._go = threading.Event()
        self._armed = False
        self._holding = False

    def hold(self) -> WriterGate:
        """Hold every batch from now on, until :meth:`release`."""
        self._armed = self._holding = True
        return self

    def before_batch(self, labels: list[str]) -> None:
        if not self._armed:
            return
        self.batches.append(labels)
        if self._holding:
            self._entered.set()
            self._go.wait(LIMIT)

    async def wait_held(self) -> None:
        """Until the writer has taken a batch and is held before committing it."""
        assert await trio.to_thread.run_sync(self._entered.wait, LIMIT)

    def release(self) -> None:
        """Let the writer go, now and for every later batch."""
        self._holding = False
        self._go.set()

    def __enter__(self) -> WriterGate:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()  # a failing test must not leave the writer held


async def in_order(nursery: trio.Nursery, *calls: object) -> None:
    """Start each call in its own task, each after the previous one is parked."""
    for call in calls:
        nursery.start_soon(call)  # type: ignore[arg-type]
        await trio.testing.wait_all_tasks_blocked()


# --- durability and the file ----------------------------------------------------------------


async def test_data_survives_close_and_reopen(tmp_path):
    path = tmp_path / "runs.db"
    first = SqliteStore(path)
    long_chat = tuple(("user" if i % 2 else "assistant", f"message {i} " * 50) for i in range(40))
    a = await created(first, "a", messages=long_chat, options={"delay": 0.5, "x": [1, "two"]})
    b = await running(first, "b", background=True, prompt="p" * 10_000)
    await first.append(b.delta("partial ", time=102.0))
    c = await finished(first, "c")
    usage = Usage("length", prompt_tokens=7, completion_tokens=9)
    d = await running(first, "d")
    await first.append(d.transition(RunStatus.SUCCEEDED, time=103.0, usage=usage))
    events = {run_id: await first.events(run_id) for run_id in "abcd"}
    await first.aclose()

    second = SqliteStore(path)
    try:
        assert await second.list_runs() == [d.record, c.record, b.record, a.record]
        for run_id, stored in events.items():
            assert await second.events(run_id) == stored
        assert (await second.get("d")).usage == usage  # type: ignore[union-attr]
        # the log goes on where it stopped
        await second.append(b.delta("more", time=104.0))
        assert await seqs(second, "b") == [1, 2, 3, 4]
        assert second.statistics().commits == 1
    finally:
        await second.aclose()


async def test_wal_schema_and_primary_key(store, tmp_path):
    await store.ready()
    raw = sqlite3.connect(tmp_path / "runs.db")
    try:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        tables = {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert {"runs", "events"} <= tables
        pk = sorted((r[5], r[1]) for r in raw.execute("PRAGMA table_info(events)") if r[5])
        assert [name for _, name in pk] == ["run_id", "seq"]
    finally:
        raw.close()
    await created(store, "r1")
    assert (tmp_path / "runs.db-wal").exists()


async def test_synchronous_full_works(tmp_path):
    full = SqliteStore(tmp_path / "full.db", synchronous="FULL")
    try:
        state = await running(full, "r1")
        assert await full.get("r1") == state.record
        assert "synchronous=FULL" in repr(full)
    finally:
        await full.aclose()


async def test_database_work_runs_off_the_trio_thread(tmp_path, monkeypatch):
    threads: list[int] = []
    real_connect = sqlite3.connect

    def connect(*args: object, **kwargs: object) -> sqlite3.Connection:
        threads.append(threading.get_ident())
        return real_connect(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sqlite3, "connect", connect)
    gate = WriterGate()
    store = SqliteStore(tmp_path / "runs.db", hooks=gate)
    gate.hold().release()
    try:
        state = await running(store, "r1")
        assert await store.get("r1") == state.record
        assert await store.list_runs() == [state.record]
    finally:
        await store.aclose()
    assert threads  # the writer's connection and at least one reader's
    assert gate.batches
    assert threading.get_ident() not in threads


@pytest.mark.parametrize("path", ["", ":memory:", "file:x.db?mode=memory"])
def test_needs_a_file_path(path):
    with pytest.raises(ValueError, match="path"):
        SqliteStore(path)


# --- the schema version and unusable files ------------------------------------------------


V1_SCHEMA = (
    "CREATE TABLE runs (id INTEGER PRIMARY KEY, run_id TEXT NOT NULL UNIQUE, target TEXT NOT "
    "NULL, status TEXT NOT NULL, background INTEGER NOT NULL, created REAL NOT NULL, prompt "
    "TEXT NOT NULL, messages TEXT NOT NULL, options TEXT NOT NULL, started REAL, finished REAL, "
    "reason TEXT NOT NULL, message TEXT NOT NULL, last_seq INTEGER NOT NULL, usage TEXT)",
    "CREATE INDEX runs_status ON runs (status, id)",
    "CREATE INDEX runs_target ON runs (target, id)",
    "CREATE INDEX runs_finished ON runs (finished)",
    "CREATE TABLE events (run_id TEXT NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL, "
    "time REAL NOT NULL, text TEXT NOT NULL, reason TEXT NOT NULL, message TEXT NOT NULL, "
    "usage TEXT, PRIMARY KEY (run_id, seq)) WITHOUT ROWID",
)


def old_store(
    path: Path, version: int, schema: tuple[str, ...], rows: list[tuple[str, tuple[object, ...]]]
) -> None:
    """A store file as an older iop-trio left it: ``schema``'s statements, then each
    ``(sql, args)`` of ``rows``, at ``PRAGMA user_version`` ``version``."""
    raw = sqlite3.connect(path)
    try:
        for statement in schema:
            raw.execute(statement)
        for sql, args in rows:
            raw.execute(sql, args)
        raw.execute(f"PRAGMA user_version = {version}")
        raw.commit()
    finally:
        raw.close()


async def test_a_version_1_store_is_migrated_in_place(tmp_path):
    path = tmp_path / "runs.db"
    run = (
        "INSERT INTO runs VALUES (1, 'old', 'echo/m', 'queued', 0, 1.0, 'p', '[]', '{}', "
        "NULL, NULL, '', '', 1, NULL)"
    )
    event = "INSERT INTO events VALUES ('old', 1, 'queued', 1.0, '', '', '', NULL)"
    old_store(path, 1, V1_SCHEMA, [(run, ()), (event, ())])
    store = SqliteStore(path)
    try:
        record = await store.get("old")
        assert record is not None
        assert (record.tenant, record.priority, record.retry_after) == ("", 0, None)
        [interrupted] = await store.interrupt_unfinished(time=2.0, message="restart")
        assert interrupted.run_id == "old"
        state = await created(store, "new", tenant="acme", priority=3)
        assert await store.get("new") == state.record
        assert [r.run_id for r in await store.list_runs(RunQuery(tenant="acme"))] == ["new"]
    finally:
        await store.aclose()
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    raw.close()


async def test_a_version_2_store_is_migrated_with_its_usage_in_numbers(tmp_path):
    """v3 keeps each run's token counts as numbers (for totals) and each delta's engine
    tokens; a run stored before has its counts copied from its usage, a delta stored
    before holds one token, and a run it left RUNNING is interrupted with those."""
    path = tmp_path / "runs.db"
    run = "INSERT INTO runs VALUES (?, ?, 'echo/m', ?, 0, 1.0, 'abcdefgh', '[]', '{}', 2.0, ?, "
    run += "'', '', ?, ?, 't', 0, NULL)"
    used = '{"done_reason": "stop", "prompt_tokens": 7, "completion_tokens": 9}'
    rows: list[tuple[str, tuple[object, ...]]] = [
        (run, (1, "done", "succeeded", 3.0, 4, used)),
        (run, (2, "live", "running", None, 4, None)),
    ]
    event = "INSERT INTO events VALUES (?, ?, ?, 2.0, ?, '', '', ?, NULL)"
    for run_id in ("done", "live"):
        rows.append((event, (run_id, 1, "queued", "", None)))
        rows.append((event, (run_id, 2, "started", "", None)))
        rows.append((event, (run_id, 3, "delta", "a b c", None)))
    rows.append((event, ("done", 4, "succeeded", "", used)))
    rows.append((event, ("live", 4, "delta", "d", None)))
    old_store(path, 2, (*V1_SCHEMA, *MIGRATE_1_TO_2), rows)
    store = SqliteStore(path)
    try:
        done = await store.get("done")
        assert done is not None
        assert done.usage == Usage("stop", 7, 9)  # the engine's, as it was
        assert [e.tokens for e in await store.events("live")] == [0, 0, 1, 1]
        [interrupted] = await store.interrupt_unfinished(time=5.0, message="restart")
        assert interrupted.usage == Usage(
            "", 2, 2, prompt_estimated=True, completion_estimated=True
        )
    finally:
        await store.aclose()
    raw = sqlite3.connect(path)
    try:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
        columns = "run_id, prompt_tokens, completion_tokens, prompt_estimated, completion_estimated"
        assert raw.execute(f"SELECT {columns} FROM runs ORDER BY id").fetchall() == [
            ("done", 7, 9, 0, 0),
            ("live", 2, 2, 1, 1),
        ]
    finally:
        raw.close()


async def test_a_version_3_store_is_migrated_with_no_replica_named(tmp_path):
    """v4 names the replica a run ran on; a run stored before names none, and one it
    left RUNNING is interrupted and can be read back as before."""
    path = tmp_path / "runs.db"
    run = (
        "INSERT INTO runs VALUES (1, 'live', 'echo/m', 'running', 0, 1.0, 'p', '[]', '{}', "
        "2.0, NULL, '', '', 2, NULL, '', 0, NULL, NULL, NULL, 0, 0)"
    )
    event = "INSERT INTO events VALUES ('live', ?, ?, 2.0, '', '', '', NULL, NULL, 0)"
    old_store(
        path,
        3,
        (*V1_SCHEMA, *MIGRATE_1_TO_2, *MIGRATE_2_TO_3),
        [(run, ()), (event, (1, "queued")), (event, (2, "started"))],
    )
    store = SqliteStore(path)
    try:
        live = await store.get("live")
        assert live is not None and live.replica == ""
        assert [e.replica for e in await store.events("live")] == ["", ""]
        [interrupted] = await store.interrupt_unfinished(time=5.0, message="restart")
        assert (interrupted.status, interrupted.replica) == (RunStatus.INTERRUPTED, "")
        state, first = RunState.create(run_id="new", target="echo/m", background=False, time=6.0)
        await store.create(state.record, first)
        await store.append(state.transition(RunStatus.RUNNING, time=7.0, replica="http://b:8000"))
        await store.append(state.transition(RunStatus.SUCCEEDED, time=8.0, replica="http://c:8000"))
        got = await store.get("new")
        assert got is not None and got.replica == "http://c:8000" == state.record.replica
        assert [e.replica for e in await store.events("new")] == [
            "",
            "http://b:8000",
            "http://c:8000",
        ]
    finally:
        await store.aclose()


@pytest.mark.parametrize("by", ["tenant", "target"])
@pytest.mark.parametrize(("since", "until"), [(100.0, 200.0), (100.0, None), (None, 200.0)])
async def test_usage_totals_of_a_window_read_only_the_runs_that_ended_in_it(
    store, tmp_path, by, since, until
):
    """One GROUP BY whose window is found through the index on the runs' finish time, so
    a day's totals do not read a month of runs (left to itself, SQLite groups by the
    index on tenant, which reads them all, for --since alone)."""
    await created(store, "r1")
    raw = sqlite3.connect(tmp_path / "runs.db")
    try:
        sql, args = usage_totals_sql(by, since, until)
        plan = " ".join(row[-1] for row in raw.execute(f"EXPLAIN QUERY PLAN {sql}", args))
        assert "USING INDEX runs_finished" in plan, plan
    finally:
        raw.close()


async def test_a_newer_schema_version_is_refused(tmp_path):
    path = tmp_path / "runs.db"
    old = SqliteStore(path)
    await created(old, "r1")
    await old.aclose()
    raw = sqlite3.connect(path)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 98}")
    raw.commit()
    raw.close()

    newer = SqliteStore(path)
    try:
        newer_version = rf"schema version {SCHEMA_VERSION + 98}, newer .* understands"
        with pytest.raises(StoreError, match=rf"{newer_version} \({SCHEMA_VERSION}\)"):
            await newer.ready()
        assert "broken" in repr(newer)
        # every call says the same, and nothing is written
        with pytest.raises(StoreError, match=newer_version):
            await newer.get("r1")
        state, first = new_run("r2")
        with pytest.raises(StoreError, match=newer_version):
            await newer.create(state.record, first)
        with pytest.raises(StoreError, match=newer_version):
            await newer.interrupt_unfinished(time=1.0, message="m")
    finally:
        await newer.aclose()
    raw = sqlite3.connect(path)
    assert raw.execute("SELECT run_id FROM runs").fetchall() == [("r1",)]
    raw.close()


async def test_a_foreign_database_is_refused(tmp_path):
    path = tmp_path / "other.db"
    raw = sqlite3.connect(path)
    raw.execute("CREATE TABLE customers (id INTEGER)")
    raw.commit()
    raw.close()
    foreign = SqliteStore(path)
    try:
        with pytest.raises(StoreError, match=r"not an iop-trio run store.*customers"):
            await foreign.ready()
    finally:
        await foreign.aclose()


async def test_a_file_that_is_not_a_database_is_refused(tmp_path):
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not sqlite" * 100)
    junk = SqliteStore(path)
    try:
        with pytest.raises(StoreError, match="cannot open run store"):
            await junk.ready()
    finally:
        await junk.aclose()


async def test_a_missing_directory_is_a_store_error(tmp_path):
    missing = SqliteStore(tmp_path / "no" / "such" / "dir" / "runs.db")
    try:
        with pytest.raises(StoreError, match=r"runs\.db"):
            await missing.ready()
    finally:
        await missing.aclose()


# --- cancellation -----------------------------------------------------------------------------


async def test_append_cancelled_while_waiting_is_written(store, gate):
    state = await running(store, "r1")
    gate.hold()
    outcome: dict[str, bool] = {}

    async def cancellable_append(event: RunEvent) -> None:
        with trio.CancelScope() as scope:
            cancel_scopes.append(scope)
            await store.append(event)
            outcome["returned"] = True
        outcome["cancelled"] = scope.cancelled_caught

    cancel_scopes: list[trio.CancelScope] = []
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            with gate:
                nursery.start_soon(store.append, state.delta("a ", time=1.0))
                await gate.wait_held()  # the writer holds "a" and commits nothing
                await in_order(nursery, lambda: cancellable_append(state.delta("b ", time=2.0)))
                cancel_scopes[0].cancel()
                await trio.testing.wait_all_tasks_blocked()
                assert outcome == {"cancelled": True}
                assert await seqs(store, "r1") == [1, 2]  # nothing committed yet
                assert store.statistics().pending == 1  # "b" is queued, not withdrawn
        await store.append(state.delta("c", time=3.0))
    assert "".join(e.text for e in await store.events("r1", after_seq=2)) == "a b c"
    assert await store.get("r1") == state.record


async def test_create_cancelled_before_the_writer_took_it_stores_nothing(store, gate):
    gate.hold()
    state, first = new_run("r1")
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            with gate:
                nursery.start_soon(created, store, "blocker")
                await gate.wait_held()
                with trio.CancelScope() as scope:
                    scope.cancel()
                    await store.create(state.record, first)
                assert scope.cancelled_caught
                assert store.statistics().pending == 0  # withdrawn
        assert await store.get("r1") is None
        assert [r.run_id for r in await store.list_runs()] == ["blocker"]
        assert gate.batches == [["create"]]


async def test_create_cancelled_after_the_writer_took_it_completes(store, gate):
    gate.hold()
    state, first = new_run("r1")
    done: dict[str, bool] = {}

    async def create_then_checkpoint() -> None:
        with trio.CancelScope() as scope:
            scopes.append(scope)
            await store.create(state.record, first)
            done["returned"] = True
            await trio.lowlevel.checkpoint()  # the cancellation lands here
        done["cancelled"] = scope.cancelled_caught

    scopes: list[trio.CancelScope] = []
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            with gate:
                nursery.start_soon(create_then_checkpoint)
                await gate.wait_held()  # the writer has taken the create
                await trio.testing.wait_all_tasks_blocked()
                scopes[0].cancel()
                await trio.testing.wait_all_tasks_blocked()
                assert done == {}  # still waiting for its commit
    assert done == {"returned": True, "cancelled": True}
    assert await store.get("r1") == state.record


# --- group commit -----------------------------------------------------------------------------


async def test_many_concurrent_appenders_get_contiguous_seqs_and_share_commits(store):
    runs = 8
    states = [await running(store, f"r{i}") for i in range(runs)]
    before = store.statistics()
    per_task = 20

    async def appender(state: RunState) -> None:
        for i in range(per_task):
            # taking the seq and calling append with no checkpoint between, as the gate does
            await store.append(state.delta(f"{i} ", time=float(i)))

    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            for i in range(64):
                nursery.start_soon(appender, states[i % runs])
    after = store.statistics()
    appended = 64 * per_task
    assert after.events - before.events == appended
    assert after.jobs - before.jobs == appended
    commits = after.commits - before.commits
    assert commits < appended
    assert after.mean_batch > 1
    for state in states:
        run_id = state.record.run_id
        assert await seqs(store, run_id) == list(range(1, 2 + 1 + 8 * per_task))
        assert await store.get(run_id) == state.record


async def test_a_bad_event_does_not_poison_its_batch(store, gate):
    good = await running(store, "good")
    queued = await created(store, "queued")
    gate.hold()
    results: dict[str, str] = {}

    def call(name: str, make_call: object) -> object:
        async def run() -> None:
            try:
                await make_call()  # type: ignore[operator]
            except StoreError as exc:
                results[name] = f"error: {exc}"
            else:
                results[name] = "ok"

        return run

    new_state, new_first = new_run("new")
    dup_state, dup_first = new_run("good")
    d1 = good.delta("1", time=1.0)
    d2 = good.delta("2", time=2.0)
    end = good.transition(RunStatus.SUCCEEDED, time=3.0)
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            with gate:
                nursery.start_soon(call("blocker", lambda: created(store, "blocker")))
                await gate.wait_held()
                await in_order(
                    nursery,
                    call("d1", lambda: store.append(d1)),
                    call("gap", lambda: store.append(RunEvent("good", 9, EventKind.DELTA, 1.0))),
                    call("d2", lambda: store.append(d2)),
                    call(
                        "illegal",
                        lambda: store.append(RunEvent("queued", 2, EventKind.SUCCEEDED, 1.0)),
                    ),
                    call("create", lambda: store.create(new_state.record, new_first)),
                    call(
                        "unknown", lambda: store.append(RunEvent("ghost", 2, EventKind.DELTA, 1.0))
                    ),
                    call("duplicate", lambda: store.create(dup_state.record, dup_first)),
                    call("end", lambda: store.append(end)),
                )
                before = store.statistics()
    assert gate.batches[1] == ["append"] * 4 + ["create", "append", "create", "append"]
    assert store.statistics().commits - before.commits == 2  # the held batch, then this one
    assert results.pop("blocker") == "ok"
    assert {k: v.split(":")[0] for k, v in results.items()} == {
        "d1": "ok",
        "gap": "error",
        "d2": "ok",
        "illegal": "error",
        "create": "ok",
        "unknown": "error",
        "duplicate": "error",
        "end": "ok",
    }
    assert "seq 9 after 3" in results["gap"]
    assert "illegal transition queued -> succeeded" in results["illegal"]
    assert "ghost" in results["unknown"]
    assert "exists" in results["duplicate"]
    assert await store.get("good") == good.record
    assert await seqs(store, "good") == [1, 2, 3, 4, 5]
    assert await store.get("queued") == queued.record
    assert await store.get("new") == new_state.record


async def test_creates_with_the_events_that_follow_go_in_bulk_with_the_rest(store, gate):
    """A batch of creates that carry STARTED, and appends to those runs, is one commit."""
    gate.hold()
    states = [new_run(f"r{i}") for i in range(3)]
    calls = []
    for state, first in states:
        queued = attrs.evolve(state.record)
        started = state.transition(RunStatus.RUNNING, time=101.0)
        calls.append(partial(store.create, queued, first, then=[started]))
    appends = [partial(store.append, state.delta("x", time=102.0)) for state, _ in states]
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            with gate:
                nursery.start_soon(created, store, "blocker")
                await gate.wait_held()
                await in_order(nursery, *calls, *appends)
                before = store.statistics()
    assert gate.batches[1] == ["create"] * 3 + ["append"] * 3
    after = store.statistics()
    assert after.commits - before.commits == 2  # the held batch, then this one
    assert after.events - before.events == 1 + 9
    for state, _ in states:
        assert await store.get(state.record.run_id) == state.record
        assert await seqs(store, state.record.run_id) == [1, 2, 3]


class FileSizes(SqliteStoreHooks):
    """Hooks that note the database file's and the WAL's sizes as each batch begins."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sizes: list[tuple[int, int]] = []

    def before_batch(self, labels: list[str]) -> None:
        wal = Path(f"{self.path}-wal")
        self.sizes.append((self.path.stat().st_size, wal.stat().st_size if wal.exists() else 0))


async def test_the_writer_checkpoints_between_batches_not_inside_a_commit(tmp_path):
    # a WAL past BUSY_CHECKPOINT (and under SQLite's own checkpoint, at WAL_AUTOCHECKPOINT
    # pages) is copied into the file after its batch's callers are woken, before the next
    # batch: no caller's commit waits for it
    path = tmp_path / "runs.db"
    hooks = FileSizes(path)
    store = SqliteStore(path, hooks=hooks)
    try:
        state = await running(store, "a")
        big = "x" * (BUSY_CHECKPOINT + 16 * 1024)
        assert len(big) < WAL_AUTOCHECKPOINT * 4096 * 0.9
        await store.append(state.delta(big, time=102.0))
        await store.append(state.delta("y", time=103.0))
        (file_before, wal_before), (file_after, _wal_after) = hooks.sizes[-2:]
        assert file_before < 64 * 1024  # the big write's batch found nothing copied yet
        assert file_after > BUSY_CHECKPOINT  # the next found it copied, with no wait of its own
        assert wal_before < BUSY_CHECKPOINT
        assert (await store.events("a"))[-2].text == big
    finally:
        await store.aclose()


# --- closing ----------------------------------------------------------------------------------


async def test_aclose_twice_and_calls_after_close(tmp_path):
    store = SqliteStore(tmp_path / "runs.db")
    state = await created(store, "r1")
    await store.aclose()
    await store.aclose()
    assert "closed" in repr(store)
    with pytest.raises(StoreError, match="closed"):
        await store.get("r1")
    with pytest.raises(StoreError, match="closed"):
        await store.append(state.transition(RunStatus.RUNNING, time=1.0))
    with pytest.raises(StoreError, match="closed"):
        await store.list_runs()


async def test_aclose_of_a_store_never_used(tmp_path):
    store = SqliteStore(tmp_path / "runs.db")
    assert "unopened" in repr(store)
    await store.aclose()
    await store.aclose()
    assert not (tmp_path / "runs.db").exists()


async def test_aclose_commits_what_was_taken_and_concurrent_closes_wait(tmp_path):
    path = tmp_path / "runs.db"
    gate = WriterGate()
    store = SqliteStore(path, hooks=gate)
    state = await running(store, "r1")
    gate.hold()
    closed: list[int] = []

    async def close(n: int) -> None:
        await store.aclose()
        closed.append(n)

    events = [state.delta(f"{i} ", time=float(i)) for i in range(5)]
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            with gate:
                await in_order(nursery, *[lambda e=e: store.append(e) for e in events])
                await gate.wait_held()
                nursery.start_soon(close, 1)
                nursery.start_soon(close, 2)
                await trio.testing.wait_all_tasks_blocked()
                assert closed == []
    assert sorted(closed) == [1, 2]
    reopened = SqliteStore(path)
    try:
        assert await reopened.get("r1") == state.record
        assert await seqs(reopened, "r1") == [1, 2, 3, 4, 5, 6, 7]
    finally:
        await reopened.aclose()


async def test_repr_says_what_it_is(store, tmp_path):
    assert repr(store).startswith(f"<SqliteStore {str(tmp_path / 'runs.db')!r} unopened")
    await created(store, "r1")
    text = repr(store)
    assert " open " in text and "commits=1" in text and "pending=0" in text


# --- the same answers as the reference store --------------------------------------------------

# what a run may do next, by status; an "any" event picks from every kind
_NEXT_KINDS = {
    RunStatus.QUEUED: [EventKind.STARTED, EventKind.REJECTED, EventKind.CANCELLED],
    RunStatus.RUNNING: [EventKind.DELTA] * 4 + [EventKind.SUCCEEDED, EventKind.FAILED],
}
_CREATE = st.tuples(st.just("create"), st.integers(0, 3))
_NEXT_EVENT = st.tuples(st.just("next"), st.integers(0, 3), st.integers(0, 99))
_ANY_EVENT = st.tuples(
    st.just("any"), st.integers(0, 4), st.sampled_from(list(EventKind)), st.integers(-1, 1)
)
# mostly the next event of a run, some refused ones (by the table, or a seq that is
# not the next), and now and then a restart or a prune
_OPS = st.one_of(
    _NEXT_EVENT,
    _CREATE,
    _NEXT_EVENT,
    _ANY_EVENT,
    _NEXT_EVENT,
    _NEXT_EVENT,
    st.tuples(st.just("interrupt")),
    _NEXT_EVENT,
    st.tuples(st.just("prune"), st.integers(0, 60)),
)


Call = Callable[[RunStore], Awaitable[object]]


async def _on_memory(ops: list[tuple[object, ...]]) -> tuple[MemoryStore, list[Call], list[object]]:
    """Turn ``ops`` into concrete calls (the seq from what is stored so far) and run
    them one after the other on a MemoryStore; return it, the calls and their results."""
    memory = MemoryStore()
    calls: list[Call] = []
    results: list[object] = []
    for i, op in enumerate(ops):
        call: Call
        if op[0] == "create":
            state, first = new_run(f"r{op[1]}", time=float(i), options={"i": i})
            call = partial(_create, state.record, first)
        elif op[0] in ("next", "any"):
            run_id = f"r{op[1]}"
            known = await memory.get(run_id)
            if op[0] == "next":
                assert isinstance(op[2], int)
                choices = _NEXT_KINDS.get(known.status, [EventKind.DELTA]) if known else []
                kind, offset = (choices[op[2] % len(choices)] if choices else EventKind.DELTA), 0
            else:
                kind, offset = op[2], op[3]  # type: ignore[assignment]
                assert isinstance(kind, EventKind) and isinstance(offset, int)
            seq = (known.last_seq if known else 1) + 1 + offset
            reason = "queue_full" if kind is EventKind.REJECTED else ""
            call = partial(_append, RunEvent(run_id, seq, kind, float(i), "t", reason))
        elif op[0] == "interrupt":
            call = partial(_interrupt, float(i))
        else:
            assert isinstance(op[1], int)
            call = partial(_prune, float(op[1]))
        calls.append(call)
        results.append(await _outcome(call, memory))
    return memory, calls, results


async def _create(record: RunRecord, first: RunEvent, store: RunStore) -> object:
    return await store.create(attrs.evolve(record), first)


async def _append(event: RunEvent, store: RunStore) -> object:
    return await store.append(event)


async def _interrupt(time: float, store: RunStore) -> object:
    return await store.interrupt_unfinished(time=time, message="m")


async def _prune(before: float, store: RunStore) -> object:
    return await store.prune(finished_before=before)


async def _outcome(call: Call, store: RunStore) -> object:
    try:
        return await call(store)
    except StoreError:
        return "StoreError"


async def _dump(store: RunStore) -> tuple[object, ...]:
    records = await store.list_runs(RunQuery(limit=1000))
    return tuple([(r, await store.events(r.run_id)) for r in records])


@settings(
    max_examples=40,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(_OPS, max_size=25))
async def test_same_answers_as_the_memory_store(ops):
    memory, calls, expected = await _on_memory(ops)
    got: list[object] = [None] * len(calls)

    async def run(i: int, store: RunStore) -> None:
        got[i] = await _outcome(calls[i], store)

    with tempfile.TemporaryDirectory() as tmp:
        sqlite_store = SqliteStore(Path(tmp) / "runs.db")
        try:
            with trio.fail_after(LIMIT):
                # all at once, in order: the writer takes them in batches of any size
                async with trio.open_nursery() as nursery:
                    for i in range(len(calls)):
                        nursery.start_soon(run, i, sqlite_store)
                        await trio.testing.wait_all_tasks_blocked()
                assert got == expected
                assert await _dump(sqlite_store) == await _dump(memory)
        finally:
            await sqlite_store.aclose()


# --- bulk writes ------------------------------------------------------------------------------


async def test_a_batch_that_fails_in_bulk_is_made_job_by_job(store, gate):
    """A batch is written with a few multi-row statements; when that fails (here a fold
    made stale by another writer makes an event clash with a stored one), it is made
    again job by job, and only the job at fault is refused."""
    stale = await running(store, "stale")
    fine = await running(store, "fine")
    # another writer adds an event to "stale": the writer's fold of it is stale now
    late = stale.delta("late", time=4.0)
    with contextlib.closing(sqlite3.connect(store.path, isolation_level=None)) as other:
        other.execute(
            "INSERT INTO events (run_id, seq, kind, time, text, reason, message) "
            "VALUES (?, ?, 'delta', ?, ?, '', '')",
            (late.run_id, late.seq, late.time, late.text),
        )
        other.execute("UPDATE runs SET last_seq = ? WHERE run_id = 'stale'", (late.seq,))
    clash = RunEvent("stale", 3, EventKind.DELTA, 5.0, text="clash")
    new, first = new_run("new")
    queued = attrs.evolve(new.record)
    started = new.transition(RunStatus.RUNNING, time=5.0)
    gate.hold()
    errors: list[StoreError] = []

    async def append_clash() -> None:
        try:
            await store.append(clash)
        except StoreError as exc:
            errors.append(exc)

    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            with gate:
                nursery.start_soon(store.sync)
                await gate.wait_held()
                await in_order(
                    nursery,
                    append_clash,
                    partial(store.append, fine.delta("ok", time=5.0)),
                    partial(store.create, queued, first, then=[started]),
                )
        assert gate.batches[-1] == ["append", "append", "create"]  # one batch, every job
    assert len(errors) == 1
    assert "seq 3 after 3" in str(errors[0])
    assert await seqs(store, "stale") == [1, 2, 3]
    assert [e.text for e in await store.events("fine", after_seq=2)] == ["ok"]
    assert await store.events("new") == [first, started]
    await store.append(new.delta("on", time=6.0))  # folds on from what the create stored
    assert await store.get("new") == new.record


async def test_append_many_folds_runs_the_writer_has_forgotten(store):
    """A failed job makes the writer forget the runs it folds in memory; append_many reloads
    them from the file, as append does (it once refused them as unknown runs)."""
    state = await running(store, "r1")
    late = state.delta("late", time=4.0)  # another writer's: the writer's fold is stale
    with contextlib.closing(sqlite3.connect(store.path, isolation_level=None)) as other:
        other.execute(
            "INSERT INTO events (run_id, seq, kind, time, text, reason, message) "
            "VALUES ('r1', ?, 'delta', 4.0, 'late', '', '')",
            (late.seq,),
        )
        other.execute("UPDATE runs SET last_seq = ? WHERE run_id = 'r1'", (late.seq,))
    with pytest.raises(StoreError, match="seq 3 after 3"):
        await store.append(RunEvent("r1", 3, EventKind.DELTA, 5.0, text="clash"))
    await store.append_many([state.delta("on", time=6.0), state.delta("and on", time=7.0)])
    assert await seqs(store, "r1") == [1, 2, 3, 4, 5]


async def test_many_events_in_one_job_are_one_commit(store):
    states = [await running(store, f"r{i}") for i in range(50)]
    before = store.statistics().commits
    await store.append_many([s.transition(RunStatus.CANCELLED, time=9.0) for s in states])
    assert store.statistics().commits == before + 1
    assert {r.status for r in await store.list_runs(RunQuery(limit=100))} == {RunStatus.CANCELLED}


async def test_the_store_is_private_to_its_owner(tmp_path):
    path = tmp_path / "node.db"
    store = SqliteStore(path)
    try:
        await created(store, "r1")
    finally:
        await store.aclose()
    made = [p for p in path.parent.iterdir() if p.name.startswith("node.db")]
    assert path in made
    for file in made:  # the database and any WAL / shared-memory file SQLite made
        assert oct(file.stat().st_mode & 0o777) == oct(0o600), file


async def test_a_store_others_may_read_is_used_with_a_warning(tmp_path):
    path = tmp_path / "node.db"
    path.touch(mode=0o644)
    path.chmod(0o644)
    with logged("iop_trio.store.sqlite") as records:
        store = SqliteStore(path)
        try:
            await created(store, "r1")
        finally:
            await store.aclose()
    assert any("may be read by others (mode 0644)" in r.getMessage() for r in records)


async def test_writes_nobody_waits_for_gather_until_one_somebody_waits_for(tmp_path):
    """Deltas (append_nowait) alone are not committed until LINGER passes or a write
    somebody waits for comes; then all go in one commit, in order."""
    store = SqliteStore(tmp_path / "runs.db", linger=3600)  # only a waited write ends it
    try:
        state = await running(store, "r1")
        commits = store.statistics().commits
        for word in ("a ", "b ", "c "):
            store.append_nowait(state.delta(word, time=2.0))
        # the old writer committed each at once; give it ample time to do so
        await trio.to_thread.run_sync(threading.Event().wait, 0.3)
        assert store.statistics().commits == commits
        assert store.statistics().pending == 3
        with trio.fail_after(LIMIT):
            await store.append(state.delta("d", time=3.0))  # waited: ends the linger at once
        assert store.statistics().commits == commits + 1
        assert "".join(e.text for e in await store.events("r1", after_seq=2)) == "a b c d"
        store.append_nowait(state.delta(" e", time=4.0))
    finally:
        with trio.fail_after(LIMIT):
            await store.aclose()  # closing ends a linger too, and commits what was taken
    reopened = SqliteStore(tmp_path / "runs.db")
    try:
        assert "".join(e.text for e in await reopened.events("r1", after_seq=2)) == "a b c d e"
    finally:
        await reopened.aclose()


# --- the file under the store ---------------------------------------------------------------


def remove_store_files(path: Path) -> None:
    """``rm`` the database and its WAL, as an operator might under a running node."""
    path.unlink()
    path.with_name(path.name + "-wal").unlink()


async def test_a_read_never_makes_a_file_where_the_store_was(tmp_path):
    """Readers open the file read-only: with the database and its WAL removed, a read
    fails instead of making an empty database at the path (which the next start, or
    ``runs list``, would then take for the store)."""
    path = tmp_path / "node.db"
    store = SqliteStore(path)
    try:
        await created(store, "r1")
        remove_store_files(path)
        with pytest.raises(StoreError):
            await store.get("r1")
        assert not path.exists()
    finally:
        await store.aclose()


def wal_of(path: Path) -> Path:
    return path.with_name(path.name + "-wal")


def stored_ids(path: str | Path) -> set[str]:
    """The run ids in a database file, read without changing it."""
    uri = f"{Path(path).absolute().as_uri()}?mode=ro"
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
        return {row[0] for row in conn.execute("SELECT run_id FROM runs")}


@pytest.mark.parametrize("how", ["deleted", "its WAL deleted", "replaced"])
async def test_a_store_whose_file_goes_refuses_new_runs_says_so_once_and_rescues_them(
    tmp_path, how
):
    """The file (or its WAL) deleted or replaced under a store: it is unwritable for good
    (no flapping, though writes into the file it holds still go through), new runs and
    reads are refused, one ERROR line names a rescue copy that has every run, and the
    copy is made anew at close with what was written since."""
    path = tmp_path / "node.db"
    store = SqliteStore(path, check_interval=0.05)
    health = HealthLog(store, limit=LIMIT)
    with logged("iop_trio.store.sqlite") as records:
        try:
            states = [await running(store, f"r{i}") for i in range(20)]
            await finished(store, "done")
            if how == "its WAL deleted":
                wal_of(path).unlink()
            elif how == "deleted":
                remove_store_files(path)
            else:  # another database put in its place, in one step
                other = SqliteStore(tmp_path / "other.db")
                await created(other, "stranger")
                await other.aclose()
                os.replace(tmp_path / "other.db", path)
            failing = await health.wait_for(writable=False)
            said = "replaced by another file" if how == "replaced" else "deleted"
            assert said in failing.problem
            with pytest.raises(StoreUnavailable, match=f"cannot write: its .*{said}"):
                await created(store, "late")
            with pytest.raises(StoreUnavailable, match="cannot be read"):
                await store.get("r1")
            # the runs it has still go on (into the file it holds) and its health holds
            with trio.fail_after(LIMIT):
                await store.append(states[0].transition(RunStatus.SUCCEEDED, time=105.0))
            assert not store.health().writable
            [error] = [r for r in records if r.levelno >= logging.ERROR]
            rescue = Path(error.rescue)
            assert rescue.name.startswith("node.db.rescued-")
            assert str(rescue) in error.getMessage() and said in error.getMessage()
            assert stored_ids(rescue) == {f"r{i}" for i in range(20)} | {"done"}
        finally:
            with trio.fail_after(LIMIT):
                await store.aclose()
    assert health.seen == [failing]
    assert [r for r in records if r.levelno >= logging.ERROR] == [error]
    assert f"its runs are copied to {rescue}" in store.health().problem
    assert stat.S_IMODE(os.stat(rescue).st_mode) == 0o600
    # what an operator does: the node stopped, the copy goes where the store was
    for leftover in (path, wal_of(path), path.with_name("node.db-shm")):
        leftover.unlink(missing_ok=True)
    os.replace(rescue, path)
    again = SqliteStore(path)
    try:
        records_now = {r.run_id: r for r in await again.list_runs(RunQuery(limit=100))}
        assert set(records_now) == {f"r{i}" for i in range(20)} | {"done"}
        assert records_now["r0"].status is RunStatus.SUCCEEDED  # written after the rescue
        assert records_now["r1"].status is RunStatus.RUNNING
        assert await seqs(again, "r0") == [1, 2, 3]
    finally:
        await again.aclose()


@pytest.mark.parametrize("what", ["file", "folder"])
async def test_a_store_it_may_not_write_is_reported_until_it_may_again(tmp_path, what):
    """A read-only file or folder (its WAL and shared memory are made there) is found by
    the check: the store is unwritable, new runs are refused, reads go on; once it may
    be written again, so may the store. Logged once each way."""
    folder = tmp_path / "var"
    folder.mkdir()
    path = folder / "node.db"
    store = SqliteStore(path, check_interval=0.05)
    health = HealthLog(store, limit=LIMIT)
    with logged("iop_trio.store.sqlite") as records:
        try:
            await created(store, "r1")
            with read_only(path if what == "file" else folder):
                failing = await health.wait_for(writable=False)
                assert f"its {what} {path if what == 'file' else folder} may not be written" in (
                    failing.problem
                )
                with pytest.raises(StoreUnavailable, match="may not be written"):
                    await created(store, "r2")
                assert await store.get("r1") is not None  # reads go on
            await health.wait_for(writable=True)
            await created(store, "r3")
        finally:
            await store.aclose()
    assert [h.writable for h in health.seen] == [False, True]
    said = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert said == [
        f"run store {path} cannot be written: {failing.problem}; new runs are refused until it can",
        f"run store {path} may be written again",
    ]
    again = SqliteStore(path)
    try:
        assert [r.run_id for r in await again.list_runs()] == ["r3", "r1"]
    finally:
        await again.aclose()


class Said(logging.Handler):
    """Set once a record of ``level`` or above whose message has ``words`` is logged (in
    any thread); :meth:`wait` for it from Trio."""

    def __init__(self, logger: str, words: str, level: int = logging.DEBUG) -> None:
        super().__init__(level)
        self.words = words
        self.records: list[logging.LogRecord] = []
        self._said = threading.Event()
        logging.getLogger(logger).addHandler(self)
        self._logger = logger

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.records.append(record)
            self._said.set()

    async def wait(self) -> logging.LogRecord:
        assert await trio.to_thread.run_sync(self._said.wait, LIMIT), f"never said {self.words}"
        return self.records[0]

    def close(self) -> None:
        logging.getLogger(self._logger).removeHandler(self)
        super().close()


async def test_a_store_gone_whose_copy_cannot_be_made_yet_says_why_and_tries_again(tmp_path):
    """Its folder may not be written when the file goes: the ERROR line says no copy could
    be made, and why; the writer tries at each check, and says where the copy is once
    the folder may be written again (a WARNING: the ERROR stays the one line)."""
    folder = tmp_path / "var"
    folder.mkdir()
    path = folder / "node.db"
    store = SqliteStore(path, check_interval=0.05)
    failed = Said("iop_trio.store.sqlite", "no copy of its runs could be made")
    copied = Said("iop_trio.store.sqlite", "copied to", logging.WARNING)
    with logged("iop_trio.store.sqlite") as records:
        try:
            await created(store, "r1")
            remove_store_files(path)
            with read_only(folder):
                error = await failed.wait()
                assert error.levelno == logging.ERROR
            later = await copied.wait()
        finally:
            failed.close()
            copied.close()
            await store.aclose()
    assert [r for r in records if r.levelno >= logging.ERROR] == [error]
    assert "it tries again every 0.05s" in error.getMessage()
    assert "at last" in later.getMessage()
    rescue = Path(later.rescue)
    assert f"its runs are copied to {rescue}" in store.health().problem
    assert stored_ids(rescue) == {"r1"}
    assert [p.name for p in folder.iterdir() if ".part-" in p.name] == []
