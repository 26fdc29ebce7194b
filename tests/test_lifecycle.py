import attrs
import pytest

from iop_trio.lifecycle import (
    TRANSITIONS,
    IllegalTransition,
    RunState,
    check_transition,
    fold,
)
from iop_trio.model import EventKind, RunStatus, Usage

ALLOWED = {
    (None, RunStatus.QUEUED),
    (RunStatus.QUEUED, RunStatus.RUNNING),
    (RunStatus.QUEUED, RunStatus.REJECTED),
    (RunStatus.QUEUED, RunStatus.CANCELLED),
    (RunStatus.QUEUED, RunStatus.INTERRUPTED),
    (RunStatus.RUNNING, RunStatus.SUCCEEDED),
    (RunStatus.RUNNING, RunStatus.FAILED),
    (RunStatus.RUNNING, RunStatus.CANCELLED),
    (RunStatus.RUNNING, RunStatus.INTERRUPTED),
}


@pytest.mark.parametrize("old", [None, *RunStatus])
@pytest.mark.parametrize("new", list(RunStatus))
def test_transition_table_is_the_design(old, new):
    assert (new in TRANSITIONS[old]) == ((old, new) in ALLOWED)
    if (old, new) in ALLOWED:
        check_transition("r", old, new)
    else:
        with pytest.raises(IllegalTransition, match="illegal transition"):
            check_transition("r", old, new)


def test_terminal_statuses_have_no_way_out():
    for status in RunStatus:
        assert status.terminal == (status not in (RunStatus.QUEUED, RunStatus.RUNNING))
        assert status.terminal == (not TRANSITIONS[status])


def make(**kw):
    return RunState.create(run_id="r1", target="echo/m", background=False, time=1.0, **kw)


def test_events_are_numbered_and_fold_into_the_record():
    state, first = make()
    assert (first.seq, first.kind) == (1, EventKind.QUEUED)
    started = state.transition(RunStatus.RUNNING, time=2.0)
    d1 = state.delta("a", time=2.5)
    done = state.transition(RunStatus.SUCCEEDED, time=3.0)
    assert [e.seq for e in (first, started, d1, done)] == [1, 2, 3, 4]
    assert [e.kind for e in (started, d1, done)] == [
        EventKind.STARTED,
        EventKind.DELTA,
        EventKind.SUCCEEDED,
    ]
    record = state.record
    assert (record.status, record.started, record.finished, record.last_seq) == (
        RunStatus.SUCCEEDED,
        2.0,
        3.0,
        4,
    )


def test_illegal_moves_raise_and_change_nothing():
    state, _ = make()
    with pytest.raises(IllegalTransition):
        state.transition(RunStatus.SUCCEEDED, time=2.0)
    with pytest.raises(ValueError, match="delta while queued"):
        state.delta("x", time=2.0)
    assert (state.status, state.record.last_seq) == (RunStatus.QUEUED, 1)
    state.transition(RunStatus.CANCELLED, time=2.0, reason="cancelled")
    for new in RunStatus:
        with pytest.raises(IllegalTransition):
            state.transition(new, time=3.0)
    assert (state.status, state.record.last_seq) == (RunStatus.CANCELLED, 2)


def test_rejected_needs_a_known_reason():
    state, _ = make()
    with pytest.raises(ValueError, match="queue_full"):
        state.transition(RunStatus.REJECTED, time=2.0, reason="because")
    event = state.transition(RunStatus.REJECTED, time=2.0, reason="queue_full")
    assert (event.kind, event.reason, state.record.reason) == (
        EventKind.REJECTED,
        "queue_full",
        "queue_full",
    )


@pytest.mark.parametrize(
    ("end", "kept"),
    [
        (RunStatus.FAILED, True),  # an engine's 429 or 503: when to ask it again
        (RunStatus.SUCCEEDED, False),
        (RunStatus.CANCELLED, False),
        (RunStatus.INTERRUPTED, False),
    ],
)
def test_a_retry_hint_is_kept_on_a_failure_and_dropped_on_other_ends(end, kept):
    state, _ = make()
    state.transition(RunStatus.RUNNING, time=2.0)
    event = state.transition(end, time=3.0, reason="engine_busy", retry_after=7.0)
    hint = 7.0 if kept else None
    assert (event.retry_after, state.record.retry_after) == (hint, hint)


def test_fold_refuses_a_gap_in_seq():
    state, _ = make()
    state.transition(RunStatus.RUNNING, time=2.0)
    other, _ = make()
    other.transition(RunStatus.RUNNING, time=2.0)
    other.delta("x", time=2.0)
    late = other.delta("y", time=2.0)
    with pytest.raises(ValueError, match="seq 4 after 2"):
        fold(state.record, late)


def test_interruption_only_for_live_runs():
    state, _ = make()
    event = state.interrupt(time=5.0, message="restart")
    assert (event.seq, event.kind, event.reason) == (2, EventKind.INTERRUPTED, "node_restart")
    assert (state.status, state.record.last_seq) == (RunStatus.INTERRUPTED, 2)
    with pytest.raises(IllegalTransition):
        state.interrupt(time=6.0, message="again")


# --- usage: only on the end of a run that started ------------------------------------------


USED = Usage("", 3, 2, prompt_estimated=True, completion_estimated=True)


@pytest.mark.parametrize(
    "end", [RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.INTERRUPTED]
)
def test_the_end_of_a_run_that_started_carries_its_usage(end):
    state, _ = make()
    state.transition(RunStatus.RUNNING, time=2.0)
    event = state.transition(end, time=3.0, reason="r", usage=USED)
    assert (event.usage, state.record.usage) == (USED, USED)


@pytest.mark.parametrize("end", [RunStatus.CANCELLED, RunStatus.REJECTED, RunStatus.INTERRUPTED])
def test_a_run_that_never_started_has_no_usage(end):
    state, _ = make()
    with pytest.raises(ValueError, match="only the end of a run that started has usage"):
        state.transition(end, time=3.0, reason="queue_full", usage=USED)
    assert (state.status, state.record.last_seq, state.record.usage) == (RunStatus.QUEUED, 1, None)
    with pytest.raises(ValueError, match="usage on a started event"):
        state.transition(RunStatus.RUNNING, time=2.0, usage=USED)
    assert state.transition(end, time=3.0, reason="queue_full").usage is None


def test_an_interruption_of_a_running_run_carries_what_it_used():
    state, _ = make()
    state.transition(RunStatus.RUNNING, time=2.0)
    event = state.interrupt(time=5.0, message="restart", usage=USED)
    assert (event.kind, event.usage, state.record.usage) == (EventKind.INTERRUPTED, USED, USED)


def test_a_delta_carries_its_engine_tokens_and_no_other_event_does():
    state, first = make()
    started = state.transition(RunStatus.RUNNING, time=2.0)
    assert (first.tokens, started.tokens) == (0, 0)
    assert state.delta("one", time=2.1).tokens == 1  # one engine chunk, by default
    assert state.delta("two three", time=2.2, tokens=2).tokens == 2
    with pytest.raises(ValueError, match="a delta of -1 tokens"):
        state.delta("x", time=2.3, tokens=-1)
    other, _ = make()
    other.transition(RunStatus.RUNNING, time=2.0)
    end = attrs.evolve(other.transition(RunStatus.SUCCEEDED, time=3.0), seq=5, tokens=4)
    with pytest.raises(ValueError, match="tokens on a succeeded event"):
        fold(state.record, end)
    assert state.record.last_seq == 4


def test_the_replica_a_run_ran_on_is_named_by_its_start_and_its_end():
    """STARTED names where it went; the end, where it ended (another after a failover);
    an end that names none leaves the record's."""
    state, _ = make()
    state.transition(RunStatus.RUNNING, time=2.0, replica="http://a:1")
    assert state.record.replica == "http://a:1"
    state.delta("x", time=2.1)
    assert state.record.replica == "http://a:1"
    state.transition(RunStatus.SUCCEEDED, time=3.0, replica="http://b:1")
    assert state.record.replica == "http://b:1"
    kept, _ = make()
    kept.transition(RunStatus.RUNNING, time=2.0, replica="http://a:1")
    kept.interrupt(time=5.0, message="restart")
    assert kept.record.replica == "http://a:1"


@pytest.mark.parametrize("end", [RunStatus.CANCELLED, RunStatus.REJECTED])
def test_a_run_that_never_started_ran_on_no_replica(end):
    state, _ = make()
    with pytest.raises(ValueError, match="only a run that started ran on one"):
        state.transition(end, time=3.0, reason="queue_full", replica="http://a:1")
    assert (state.status, state.record.last_seq, state.record.replica) == (RunStatus.QUEUED, 1, "")
    state.transition(RunStatus.RUNNING, time=2.0)
    bad = attrs.evolve(state.delta("x", time=2.1), seq=4, replica="http://a:1")
    with pytest.raises(ValueError, match="a replica on a delta"):
        fold(state.record, bad)
