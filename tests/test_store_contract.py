"""The RunStore contract (iop_trio/store/base.py), run against every store.

The SQLite store runs on a real file in tmp_path; nothing here uses a mock
clock, since the SQLite store waits on a real thread.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import attrs
import pytest
import trio
import trio.testing

from iop_trio.lifecycle import RunState
from iop_trio.model import EventKind, RunEvent, RunQuery, RunStatus
from iop_trio.runtime import Usage
from iop_trio.store import RunStore, StoreError, UsageTotal
from iop_trio.store.memory import MemoryStore
from iop_trio.store.sqlite import SqliteStore

STORES = ["memory", "sqlite"]


@pytest.fixture(params=STORES)
async def store(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[RunStore]:
    made: RunStore = MemoryStore() if request.param == "memory" else SqliteStore(tmp_path / "r.db")
    try:
        yield made
    finally:
        await made.aclose()


def new_run(
    run_id: str,
    *,
    target: str = "echo/a",
    time: float = 100.0,
    background: bool = False,
    prompt: str = "hello",
    messages: tuple[tuple[str, str], ...] = (),
    options: dict[str, object] | None = None,
    tenant: str = "",
    priority: int = 0,
) -> tuple[RunState, RunEvent]:
    return RunState.create(
        run_id=run_id,
        target=target,
        background=background,
        time=time,
        prompt=prompt,
        messages=messages,
        options=options,
        tenant=tenant,
        priority=priority,
    )


async def created(store: RunStore, run_id: str, **kw: object) -> RunState:
    state, first = new_run(run_id, **kw)  # type: ignore[arg-type]
    await store.create(attrs.evolve(state.record), first)
    return state


async def running(store: RunStore, run_id: str, **kw: object) -> RunState:
    state = await created(store, run_id, **kw)
    await store.append(state.transition(RunStatus.RUNNING, time=101.0))
    return state


async def finished(
    store: RunStore, run_id: str, status: RunStatus = RunStatus.SUCCEEDED, *, at: float = 200.0
) -> RunState:
    state = await running(store, run_id)
    await store.append(state.transition(status, time=at, reason="r"))
    return state


async def seqs(store: RunStore, run_id: str) -> list[int]:
    return [e.seq for e in await store.events(run_id)]


# --- create / get / events --------------------------------------------------------------------


async def test_create_then_get_and_events(store):
    state, first = new_run(
        "r1",
        background=True,
        prompt="héllo wörld ✓",
        messages=(("system", "be brief"), ("user", "hi\nthere")),
        options={"temperature": 0.25, "stop": ["\n", "END"], "nested": {"a": None, "b": True}},
    )
    await store.create(state.record, first)
    assert await store.get("r1") == state.record
    assert await store.events("r1") == [first]
    assert await store.list_runs() == [state.record]


async def test_unknown_run_reads_as_nothing(store):
    assert await store.get("nope") is None
    assert await store.events("nope") == []
    assert await store.events("nope", after_seq=3) == []


async def test_records_are_copies(store):
    state, first = new_run("r1", options={"k": 1})
    given = attrs.evolve(state.record, options=dict(state.record.options))
    await store.create(given, first)
    given.status = RunStatus.FAILED
    given.options["k"] = 2  # type: ignore[index]
    got = await store.get("r1")
    assert got is not None
    got.status = RunStatus.CANCELLED
    got.options["k"] = 3  # type: ignore[index]
    assert await store.get("r1") == state.record
    assert (await store.list_runs())[0] == state.record


async def test_duplicate_create_is_refused_and_changes_nothing(store):
    state = await created(store, "r1", prompt="first")
    again, first = new_run("r1", prompt="second")
    with pytest.raises(StoreError, match="r1"):
        await store.create(again.record, first)
    assert await store.get("r1") == state.record
    assert await seqs(store, "r1") == [1]


@pytest.mark.parametrize("what", ["seq 2", "not queued", "other run", "record not queued"])
async def test_create_needs_the_queued_event_of_the_record(store, what):
    state, first = new_run("r1")
    record = state.record
    if what == "seq 2":
        first = attrs.evolve(first, seq=2)
    elif what == "not queued":
        first = attrs.evolve(first, kind=EventKind.STARTED)
    elif what == "other run":
        first = attrs.evolve(first, run_id="r2")
    else:
        record = attrs.evolve(record, status=RunStatus.RUNNING)
    with pytest.raises(StoreError):
        await store.create(record, first)
    assert await store.get("r1") is None
    assert await store.get("r2") is None
    assert await store.events("r1") == []
    assert await store.list_runs() == []


async def test_create_stores_the_events_that_follow_in_the_same_write(store):
    state, first = new_run("r1")
    queued = attrs.evolve(state.record)
    started = state.transition(RunStatus.RUNNING, time=101.0)
    await store.create(queued, first, then=[started])
    assert queued.status is RunStatus.QUEUED  # the given record is not changed
    assert await store.get("r1") == state.record
    assert await store.events("r1") == [first, started]
    # later appends fold on from there, for a run created and for one that ended in its create
    await store.append(state.delta("hi", time=102.0))
    await store.append(state.transition(RunStatus.SUCCEEDED, time=103.0))
    assert await store.get("r1") == state.record
    assert await seqs(store, "r1") == [1, 2, 3, 4]
    other, first = new_run("r2")
    queued = attrs.evolve(other.record)
    rejected = other.transition(RunStatus.REJECTED, time=101.0, reason="queue_full")
    await store.create(queued, first, then=[rejected])
    assert await store.get("r2") == other.record
    with pytest.raises(StoreError):
        await store.append(RunEvent("r2", 3, EventKind.DELTA, 104.0, text="late"))
    assert await seqs(store, "r2") == [1, 2]


@pytest.mark.parametrize("what", ["gap", "delta while queued", "other run", "after the end"])
async def test_create_refuses_events_that_cannot_follow_and_stores_nothing(store, what):
    state, first = new_run("r1")
    queued = attrs.evolve(state.record)
    then = [state.transition(RunStatus.RUNNING, time=101.0)]
    if what == "gap":
        then = [attrs.evolve(then[0], seq=3)]
    elif what == "delta while queued":
        then = [RunEvent("r1", 2, EventKind.DELTA, 101.0, text="x")]
    elif what == "other run":
        then = [attrs.evolve(then[0], run_id="r2")]
    else:
        then.append(state.transition(RunStatus.CANCELLED, time=102.0))
        then.append(RunEvent("r1", 4, EventKind.DELTA, 103.0, text="x"))
    with pytest.raises(StoreError, match="r1"):
        await store.create(queued, first, then=then)
    assert await store.get("r1") is None
    assert await store.events("r1") == []
    assert await store.list_runs() == []


async def test_events_after_seq(store):
    state = await running(store, "r1")
    deltas = [state.delta(w, time=102.0 + i) for i, w in enumerate(["a", "b", "c"])]
    for event in deltas:
        await store.append(event)
    everything = await store.events("r1")
    assert [e.seq for e in everything] == [1, 2, 3, 4, 5]
    assert await store.events("r1", after_seq=2) == deltas
    assert await store.events("r1", after_seq=4) == deltas[-1:]
    assert await store.events("r1", after_seq=5) == []
    assert await store.events("r1", after_seq=1, limit=2) == everything[1:3]
    assert await store.events("r1", limit=0) == []
    assert await store.events("r1", after_seq=4, limit=9) == deltas[-1:]
    assert await store.events("r1", after_seq=50) == []
    assert await store.events("r1", after_seq=-3) == everything


# --- appending ------------------------------------------------------------------------------


async def test_status_events_update_the_record(store):
    state = await created(store, "r1")
    await store.append(state.transition(RunStatus.RUNNING, time=110.5))
    got = await store.get("r1")
    assert got is not None
    assert (got.status, got.started, got.last_seq) == (RunStatus.RUNNING, 110.5, 2)
    await store.append(state.delta("hel", time=111.0))
    await store.append(state.delta("lo", time=111.5))
    usage = Usage("stop", prompt_tokens=3, completion_tokens=None)
    end = state.transition(RunStatus.SUCCEEDED, time=112.25, message="done", usage=usage)
    await store.append(end)
    got = await store.get("r1")
    assert got == state.record
    assert got is not None
    assert (got.status, got.finished, got.message, got.usage) == (
        RunStatus.SUCCEEDED,
        112.25,
        "done",
        usage,
    )
    events = await store.events("r1")
    assert [e.kind for e in events] == [
        EventKind.QUEUED,
        EventKind.STARTED,
        EventKind.DELTA,
        EventKind.DELTA,
        EventKind.SUCCEEDED,
    ]
    assert events[-1] == end
    assert "".join(e.text for e in events) == "hello"


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (RunStatus.FAILED, "engine_error"),
        (RunStatus.CANCELLED, "session_lost"),
    ],
)
async def test_terminal_reason_is_stored(store, status, reason):
    state = await running(store, "r1")
    await store.append(state.transition(status, time=150.0, reason=reason, message="m"))
    got = await store.get("r1")
    assert got is not None
    assert (got.status, got.reason, got.message, got.finished) == (status, reason, "m", 150.0)


async def test_rejected_from_queued(store):
    state = await created(store, "r1")
    await store.append(state.transition(RunStatus.REJECTED, time=105.0, reason="queue_full"))
    assert await store.get("r1") == state.record
    assert (await store.events("r1"))[-1].kind is EventKind.REJECTED


def _bad_events(state: RunState) -> dict[str, RunEvent]:
    run_id, last = state.record.run_id, state.record.last_seq
    return {
        "seq gap": RunEvent(run_id, last + 2, EventKind.DELTA, 120.0, "x"),
        "seq repeated": RunEvent(run_id, last, EventKind.DELTA, 120.0, "x"),
        "seq zero": RunEvent(run_id, 0, EventKind.DELTA, 120.0, "x"),
        "queued again": RunEvent(run_id, last + 1, EventKind.QUEUED, 120.0),
        "started again": RunEvent(run_id, last + 1, EventKind.STARTED, 120.0),
    }


@pytest.mark.parametrize("bad", list(_bad_events(new_run("x")[0])))
async def test_refused_events_store_nothing(store, bad):
    state = await running(store, "r1")
    before = await store.get("r1")
    event = _bad_events(state)[bad]
    with pytest.raises(StoreError):
        await store.append(event)
    assert await store.get("r1") == before
    assert await seqs(store, "r1") == [1, 2]
    # and the run goes on with the right next event
    await store.append(state.delta("ok", time=121.0))
    assert await seqs(store, "r1") == [1, 2, 3]
    assert await store.get("r1") == state.record


@pytest.mark.parametrize(
    ("start", "kind"),
    [
        ("queued", EventKind.SUCCEEDED),  # QUEUED -> SUCCEEDED is not in the table
        ("queued", EventKind.FAILED),
        ("queued", EventKind.DELTA),  # a delta while QUEUED
        ("succeeded", EventKind.DELTA),  # anything after the terminal event
        ("succeeded", EventKind.CANCELLED),
        ("succeeded", EventKind.INTERRUPTED),
    ],
)
async def test_illegal_transitions_store_nothing(store, start, kind):
    if start == "queued":
        state = await created(store, "r1")
    else:
        state = await finished(store, "r1")
    before = await store.get("r1")
    event = RunEvent("r1", state.record.last_seq + 1, kind, 130.0, reason="x")
    with pytest.raises(StoreError):
        await store.append(event)
    assert await store.get("r1") == before
    assert await seqs(store, "r1") == list(range(1, state.record.last_seq + 1))


async def test_event_for_an_unknown_run(store):
    with pytest.raises(StoreError, match="ghost"):
        await store.append(RunEvent("ghost", 1, EventKind.QUEUED, 1.0))
    assert await store.get("ghost") is None
    assert await store.events("ghost") == []


async def test_append_cancelled_while_waiting_is_still_written(store):
    state = await running(store, "r1")
    taken = state.delta("taken", time=140.0)
    with trio.CancelScope() as scope:
        scope.cancel()
        await store.append(taken)
    # the event was taken before the first checkpoint; a later append that
    # returns proves everything before it is written, in order
    await store.append(state.delta("after", time=141.0))
    assert [e.text for e in await store.events("r1", after_seq=2)] == ["taken", "after"]
    assert await store.get("r1") == state.record


async def test_append_many_writes_every_event_in_order_and_names_the_refused(store):
    a, b = await running(store, "a"), await running(store, "b")
    events = [a.delta("a1", time=150.0), b.delta("b1", time=150.0), a.delta("a2", time=151.0)]
    events += [b.transition(RunStatus.CANCELLED, time=152.0, reason="drain")]
    events += [a.transition(RunStatus.SUCCEEDED, time=153.0)]
    await store.append_many(events)
    assert await store.get("a") == a.record
    assert await store.get("b") == b.record
    assert [e.text for e in await store.events("a", after_seq=2)] == ["a1", "a2", ""]
    # one bad event is refused alone; the others are written
    c = await running(store, "c")
    good = c.delta("c1", time=160.0)
    ghost = RunEvent("ghost", 1, EventKind.QUEUED, 160.0)
    late = RunEvent("a", 9, EventKind.DELTA, 160.0, text="after the end")
    with pytest.raises(StoreError, match=r"2 events refused: .*ghost"):
        await store.append_many([ghost, good, late])
    assert [e.text for e in await store.events("c", after_seq=2)] == ["c1"]
    assert await seqs(store, "a") == [1, 2, 3, 4, 5]
    await store.append_many([])


async def test_concurrent_appends_to_many_runs(store):
    states = [await running(store, f"r{i}") for i in range(10)]

    async def stream(state: RunState) -> None:
        for i in range(15):
            await store.append(state.delta(f"w{i} ", time=150.0 + i))
        await store.append(state.transition(RunStatus.SUCCEEDED, time=170.0))

    async with trio.open_nursery() as nursery:
        for state in states:
            nursery.start_soon(stream, state)
    for state in states:
        run_id = state.record.run_id
        assert await store.get(run_id) == state.record
        assert await seqs(store, run_id) == list(range(1, 19))


# --- listing --------------------------------------------------------------------------------


async def test_list_runs_newest_first_filters_and_limit(store):
    # created in this order; the clock goes backwards on purpose: order is by creation
    a = await created(store, "a", target="echo/x", time=5.0)
    b = await running(store, "b", target="echo/y", time=4.0)
    c = await created(store, "c", target="echo/x", time=3.0)
    d = await finished(store, "d")  # target echo/a
    e = await running(store, "e", target="echo/x", time=1.0)
    everything = [e, d, c, b, a]
    assert await store.list_runs() == [s.record for s in everything]
    assert await store.list_runs(RunQuery(limit=2)) == [e.record, d.record]
    assert await store.list_runs(RunQuery(limit=0)) == []
    assert await store.list_runs(RunQuery(limit=-1)) == []
    assert await store.list_runs(RunQuery(limit=100)) == [s.record for s in everything]
    assert [r.run_id for r in await store.list_runs(RunQuery(target="echo/x"))] == ["e", "c", "a"]
    assert [r.run_id for r in await store.list_runs(RunQuery(statuses=[RunStatus.RUNNING]))] == [
        "e",
        "b",
    ]
    assert [
        r.run_id
        for r in await store.list_runs(RunQuery(statuses={RunStatus.QUEUED, RunStatus.SUCCEEDED}))
    ] == ["d", "c", "a"]
    assert [
        r.run_id
        for r in await store.list_runs(
            RunQuery(statuses=(RunStatus.QUEUED,), target="echo/x", limit=1)
        )
    ] == ["c"]
    assert await store.list_runs(RunQuery(target="echo/none")) == []
    assert await store.list_runs(RunQuery(statuses=[RunStatus.INTERRUPTED])) == []


async def test_list_runs_by_tenant_and_the_default_tenant(store):
    await created(store, "a", tenant="acme", priority=5)
    await created(store, "b")  # the default tenant, ""
    await created(store, "c", tenant="acme", priority=-1)
    assert [r.run_id for r in await store.list_runs(RunQuery(tenant="acme"))] == ["c", "a"]
    assert [r.run_id for r in await store.list_runs(RunQuery(tenant=""))] == ["b"]
    assert [r.run_id for r in await store.list_runs()] == ["c", "b", "a"]
    assert await store.list_runs(RunQuery(tenant="nobody")) == []
    a = await store.get("a")
    assert a is not None and (a.tenant, a.priority) == ("acme", 5)


async def test_list_runs_by_run_id_prefix(store):
    for run_id in ("alice:1", "alice:2", "alicia:1", "bob:1", "a%b:1"):
        await created(store, run_id)
    assert [r.run_id for r in await store.list_runs(RunQuery(run_id_prefix="alice:"))] == [
        "alice:2",
        "alice:1",
    ]
    assert [r.run_id for r in await store.list_runs(RunQuery(run_id_prefix="a%"))] == ["a%b:1"]
    assert len(await store.list_runs(RunQuery(run_id_prefix=""))) == 5
    assert await store.list_runs(RunQuery(run_id_prefix="carol:")) == []


async def test_a_rejection_keeps_its_retry_hint(store):
    state = await created(store, "r1", tenant="t")
    event = state.transition(RunStatus.REJECTED, time=105.0, reason="queue_full", retry_after=2.5)
    await store.append(event)
    record = await store.get("r1")
    assert record is not None and record.retry_after == 2.5
    assert (await store.events("r1"))[-1].retry_after == 2.5
    assert record == state.record


async def test_a_failure_keeps_its_engines_retry_hint(store):
    """A run the engine turned away (its 429 or 503) keeps when to ask it again."""
    state = await running(store, "r1")
    event = state.transition(
        RunStatus.FAILED, time=105.0, reason="engine_busy", message="busy", retry_after=7.0
    )
    await store.append(event)
    record = await store.get("r1")
    assert record is not None and record.retry_after == 7.0
    assert (await store.events("r1"))[-1].retry_after == 7.0
    assert record == state.record


async def test_list_runs_sees_status_changes(store):
    state = await created(store, "r1")
    assert [r.run_id for r in await store.list_runs(RunQuery(statuses=[RunStatus.QUEUED]))] == [
        "r1"
    ]
    await store.append(state.transition(RunStatus.RUNNING, time=101.0))
    assert await store.list_runs(RunQuery(statuses=[RunStatus.QUEUED])) == []
    assert await store.list_runs(RunQuery(statuses=[RunStatus.RUNNING])) == [state.record]


# --- restart and pruning --------------------------------------------------------------------


async def test_interrupt_unfinished(store):
    queued = await created(store, "queued")
    run = await running(store, "running")
    await store.append(run.delta("partial", time=102.0))
    done = await finished(store, "done")
    rejected = await created(store, "rejected")
    await store.append(rejected.transition(RunStatus.REJECTED, time=103.0, reason="queue_full"))

    made = await store.interrupt_unfinished(time=500.0, message="node restarted")
    assert [(e.run_id, e.seq, e.kind) for e in made] == [
        ("queued", 2, EventKind.INTERRUPTED),
        ("running", 4, EventKind.INTERRUPTED),
    ]
    for event in made:
        assert (event.reason, event.message, event.time) == (
            "node_restart",
            "node restarted",
            500.0,
        )
        record = await store.get(event.run_id)
        assert record is not None
        assert (record.status, record.reason, record.finished, record.last_seq) == (
            RunStatus.INTERRUPTED,
            "node_restart",
            500.0,
            event.seq,
        )
        assert (await store.events(event.run_id))[-1] == event
    assert await store.get("done") == done.record
    assert await store.get("rejected") == rejected.record
    assert (await store.get("queued")).started is None  # type: ignore[union-attr]
    assert (await store.get("running")).started == 101.0  # type: ignore[union-attr]
    # nothing left to interrupt; a second call changes nothing
    assert await store.interrupt_unfinished(time=600.0, message="again") == []
    assert await seqs(store, "queued") == [1, 2]
    del queued


async def test_a_deltas_tokens_and_a_settled_usage_are_kept(store):
    state = await running(store, "r1")
    await store.append(state.delta("one two ", time=102.0, tokens=2))
    usage = Usage("", 4, 2, prompt_estimated=True, completion_estimated=True)
    end = state.transition(RunStatus.CANCELLED, time=103.0, reason="cancelled", usage=usage)
    await store.append_many([end])
    assert [e.tokens for e in await store.events("r1")] == [0, 0, 2, 0]
    assert (await store.events("r1"))[-1] == end
    assert await store.get("r1") == state.record
    assert state.record.usage == usage


async def test_a_run_found_running_is_interrupted_with_the_usage_of_its_stored_deltas(store):
    """Its completion is what its stored deltas hold (as the run counted them), its
    prompt estimated from its size; both marked estimated. A run found QUEUED never
    started, and has none."""
    run = await running(store, "running", prompt="x" * 21, messages=(("user", "hi"),))
    await store.append(run.delta("a b c ", time=102.0, tokens=3))
    await store.append(run.delta("d", time=102.5))  # one chunk
    idle = await running(store, "idle")  # started, its engine sent nothing yet
    await created(store, "queued")
    made = await store.interrupt_unfinished(time=500.0, message="m", chars_per_token=2)
    usages = {e.run_id: e.usage for e in made}
    expected = Usage("", 14, 4, prompt_estimated=True, completion_estimated=True)
    assert usages == {  # ceil((21 + 4 + 2) / 2); "hello": ceil(5 / 2)
        "running": expected,
        "idle": Usage("", 3, 0, prompt_estimated=True, completion_estimated=True),
        "queued": None,
    }
    for event in made:
        record = await store.get(event.run_id)
        assert record is not None
        assert record.usage == event.usage  # in the same write as the event
        assert (await store.events(event.run_id))[-1] == event
    del idle


async def test_interrupt_unfinished_on_an_empty_store(store):
    assert await store.interrupt_unfinished(time=1.0, message="m") == []


# --- usage totals ----------------------------------------------------------------------------


async def ended_with(
    store: RunStore, run_id: str, usage: Usage, *, at: float, **kw: object
) -> RunState:
    state = await running(store, run_id, **kw)
    await store.append(state.transition(RunStatus.CANCELLED, time=at, usage=usage))
    return state


def guessed(prompt: int, completion: int) -> Usage:
    return Usage("", prompt, completion, prompt_estimated=True, completion_estimated=True)


async def test_usage_totals_sum_the_records_of_runs_that_ended_in_the_window(store):
    await ended_with(store, "a1", Usage("stop", 10, 5), at=100.0, tenant="a", target="t/x")
    await ended_with(store, "a2", guessed(3, 2), at=200.0, tenant="a", target="t/y")
    await ended_with(store, "b1", Usage("stop", 7, 1, prompt_estimated=True), at=300.0)
    await ended_with(store, "a3", Usage("stop", 1, 1), at=400.0, tenant="a", target="t/x")
    await finished(store, "old", at=250.0)  # ended without a usage, as before v3: none
    await running(store, "live")  # not ended: not yet settled
    rejected = await created(store, "rejected")  # never started: no usage
    await store.append(rejected.transition(RunStatus.REJECTED, time=150.0, reason="queue_full"))

    assert await store.usage_totals(by="tenant") == [
        UsageTotal("", 1, 7, 1, 7, 0),
        UsageTotal("a", 3, 14, 8, 3, 2),
    ]
    assert await store.usage_totals(by="target") == [
        UsageTotal("echo/a", 1, 7, 1, 7, 0),
        UsageTotal("t/x", 2, 11, 6, 0, 0),
        UsageTotal("t/y", 1, 3, 2, 3, 2),
    ]
    # since is in the window, until is not
    assert await store.usage_totals(by="tenant", since=200.0, until=400.0) == [
        UsageTotal("", 1, 7, 1, 7, 0),
        UsageTotal("a", 1, 3, 2, 3, 2),
    ]
    assert await store.usage_totals(by="target", since=400.0) == [UsageTotal("t/x", 1, 1, 1, 0, 0)]
    assert await store.usage_totals(by="target", until=100.0) == []
    assert (await store.usage_totals(by="tenant"))[1].estimated_tokens == 5


async def test_prune(store):
    old = await finished(store, "old", at=100.0)
    edge = await finished(store, "edge", at=150.0)
    new = await finished(store, "new", RunStatus.FAILED, at=200.0)
    live_queued = await created(store, "live-q", time=1.0)
    live_running = await running(store, "live-r", time=1.0)
    rejected = await created(store, "rejected", time=1.0)
    await store.append(rejected.transition(RunStatus.REJECTED, time=50.0, reason="queue_full"))

    assert await store.prune(finished_before=150.0) == 2  # old and rejected; edge is kept
    assert await store.get("old") is None
    assert await store.events("old") == []
    assert await store.get("rejected") is None
    assert await store.events("rejected") == []
    for state in (edge, new, live_queued, live_running):
        assert await store.get(state.record.run_id) == state.record
        assert await store.events(state.record.run_id) != []
    assert {r.run_id for r in await store.list_runs()} == {"edge", "new", "live-q", "live-r"}
    assert await store.prune(finished_before=150.0) == 0
    assert await store.prune(finished_before=1e12) == 2  # live runs are never pruned
    assert {r.run_id for r in await store.list_runs()} == {"live-q", "live-r"}
    del old


async def test_a_pruned_run_id_can_be_created_again(store):
    await finished(store, "r1", at=10.0)
    assert await store.prune(finished_before=20.0) == 1
    state = await created(store, "r1", prompt="again")
    assert await store.get("r1") == state.record
    assert await seqs(store, "r1") == [1]


async def test_reads_see_every_returned_write(store):
    # no waiting at all between a write and a read
    state = await created(store, "r1")
    assert (await store.get("r1")) == state.record
    await store.append(state.transition(RunStatus.RUNNING, time=1.0))
    assert (await store.get("r1")) == state.record
    await store.append(state.delta("x", time=2.0))
    assert await seqs(store, "r1") == [1, 2, 3]
    assert await store.list_runs(RunQuery(statuses=[RunStatus.RUNNING])) == [state.record]
    await trio.testing.wait_all_tasks_blocked()
