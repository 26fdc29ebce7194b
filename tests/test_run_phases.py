"""A live run's phase (runtime/live.py): every move a run makes is one of PHASE_MOVES."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from iop_trio.lifecycle import RunState
from iop_trio.model import RunSpec, RunStatus
from iop_trio.runtime.live import PHASE_MOVES, LiveRun, RunPhase
from iop_trio.store import StoreUnavailable

from .test_runtime import A, CommitsIn, make_node, submit

Move = tuple[RunPhase, RunPhase]


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> list[Move]:
    """Every phase move a live run makes while the test runs, in order."""
    made: list[Move] = []
    move = LiveRun.move

    def recorded(self: LiveRun, to: RunPhase) -> None:
        made.append((self.phase, to))
        move(self, to)

    monkeypatch.setattr(LiveRun, "move", recorded)
    return made


def table() -> set[Move]:
    return {(a, b) for a, tos in PHASE_MOVES.items() for b in tos}


def test_a_move_not_in_the_table_raises_naming_both_phases():
    state, _ = RunState.create(run_id="r", target=A, background=False, time=0.0, prompt="p")
    live = LiveRun(state, None, [])
    with pytest.raises(RuntimeError, match="r cannot go from entering to starting"):
        live.move(RunPhase.STARTING)
    live.move(RunPhase.QUEUED)
    live.move(RunPhase.ENDED)
    with pytest.raises(RuntimeError, match="from ended to running"):
        live.move(RunPhase.RUNNING)
    assert set(PHASE_MOVES) == set(RunPhase)  # every phase has its row


async def test_every_move_a_run_makes_is_in_the_table(autojump_clock, moves):
    """Runs through each way a run goes: started at once, queued then granted, cancelled
    while queued and as it is granted, its queue deadline, and a run never stored."""
    store = CommitsIn(0.0)
    node, adapter = make_node(queue_timeout=5.0, store=store)
    async with node.running():
        first = await submit(node)  # ENTERING -> RUNNING: room at once
        waits = await submit(node)  # ENTERING -> QUEUED
        cancelled = await submit(node)
        await node.manager.cancel(cancelled)  # QUEUED -> ENDED
        adapter.script(first).finish()  # RUNNING -> ENDED; waits is granted and starts
        await trio.testing.wait_all_tasks_blocked()
        assert adapter.started[-1] == waits
        expires = await submit(node)
        await trio.sleep(6)  # its queue deadline: QUEUED -> ENDED
        record = await node.manager.get(expires)
        assert record is not None and record.status is RunStatus.REJECTED
        granted = await submit(node)
        node.gate.set_target_limit(A, 2)  # granted now; its task is yet to run
        assert node.manager.cancel_nowait(granted)  # ADMITTED -> ENDED: never starts
        await trio.testing.wait_all_tasks_blocked()
        assert granted not in adapter.started
        store.seconds = math.inf
        with pytest.raises(StoreUnavailable):  # ENTERING -> ENDED: never stored
            await node.manager.submit(RunSpec(A, "p"), create_timeout=1.0)
        store.seconds = 0.0
        adapter.script(waits).finish()
        await trio.testing.wait_all_tasks_blocked()
    made = set(moves)
    assert made <= table()
    # all of them but the one only a bug makes (an end that could not be recorded)
    assert made == table() - {(RunPhase.STARTING, RunPhase.ENDED)}, table() - made
