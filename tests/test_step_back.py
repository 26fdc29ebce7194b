"""A run's engine request taken back (``LiveRun.step_back``, what ``concurrency: auto``
does to a run that waits inside an engine found full): its request is closed, it waits
in the node holding its permit, and goes again when told, with nothing sent or stored
twice; never once the engine has sent it anything, and at most ``MOST_STEPS_BACK``
times. A run taken back can still be cancelled, and one never told goes again after
``HOLD_AT_MOST``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from iop_trio.model import EventKind, RunSpec, RunStatus
from iop_trio.runtime import Node, RuntimeLimits, TargetSpec
from iop_trio.runtime.live import MOST_STEPS_BACK
from iop_trio.runtime.pipeline import HOLD_AT_MOST
from iop_trio.store.memory import MemoryStore

from .engines import wait_end
from .support import ScriptedAdapter


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    adapter = ScriptedAdapter()
    made = Node(
        node_id="test",
        adapters=[adapter],
        targets=[TargetSpec("scripted", "a", concurrency=4)],
        limits=RuntimeLimits(concurrency=4),
        store=MemoryStore(),
    )
    async with made.running():
        yield made


def _adapter(node: Node) -> ScriptedAdapter:
    adapter = node.adapters["scripted"]
    assert isinstance(adapter, ScriptedAdapter)
    return adapter


async def _started(node: Node) -> str:
    submitted = await node.manager.submit(RunSpec(target="scripted/a", prompt="p"))
    await trio.testing.wait_all_tasks_blocked()
    return submitted.record.run_id


def _permit(node: Node, run_id: str) -> object:
    live = node.manager.runs.get(run_id)
    assert live is not None and live.permit is not None
    return live.permit


async def test_a_run_taken_back_waits_holding_its_place_and_goes_again_once_told(node):
    adapter = _adapter(node)
    run_id = await _started(node)
    permit = _permit(node, run_id)
    assert node.manager.runs.step_back(permit)  # type: ignore[arg-type]
    await trio.testing.wait_all_tasks_blocked()
    assert adapter.script(run_id).closed  # its request was closed
    assert list(node.manager.runs.held_back()) == [permit]
    assert node.gate.statistics().targets["scripted/a"].borrowed == 1  # it keeps its place
    record = await node.manager.get(run_id)
    assert record is not None and record.status is RunStatus.RUNNING
    node.manager.runs.go_again(permit)  # type: ignore[arg-type]
    await trio.testing.wait_all_tasks_blocked()
    assert adapter.started == [run_id, run_id] and list(node.manager.runs.held_back()) == []
    adapter.script(run_id).delta("hi")
    adapter.script(run_id).finish()
    record, events = await wait_end(node, run_id)
    assert record.status is RunStatus.SUCCEEDED
    kinds = [e.kind for e in events]
    assert kinds == [EventKind.QUEUED, EventKind.STARTED, EventKind.DELTA, EventKind.SUCCEEDED]


async def test_a_run_the_engine_has_answered_is_never_taken_back(node):
    adapter = _adapter(node)
    run_id = await _started(node)
    adapter.script(run_id).delta("a")
    await trio.testing.wait_all_tasks_blocked()
    assert not node.manager.runs.step_back(_permit(node, run_id))  # type: ignore[arg-type]
    adapter.script(run_id).finish()
    record, _ = await wait_end(node, run_id)
    assert record.status is RunStatus.SUCCEEDED and adapter.started == [run_id]


async def test_a_run_is_taken_back_at_most_a_few_times(node):
    adapter = _adapter(node)
    run_id = await _started(node)
    permit = _permit(node, run_id)
    for _ in range(MOST_STEPS_BACK):
        assert node.manager.runs.step_back(permit)  # type: ignore[arg-type]
        await trio.testing.wait_all_tasks_blocked()
        node.manager.runs.go_again(permit)  # type: ignore[arg-type]
        await trio.testing.wait_all_tasks_blocked()
    assert not node.manager.runs.step_back(permit)  # type: ignore[arg-type]
    assert len(adapter.started) == MOST_STEPS_BACK + 1
    adapter.script(run_id).finish()
    record, _ = await wait_end(node, run_id)
    assert record.status is RunStatus.SUCCEEDED


async def test_a_run_taken_back_can_be_cancelled_and_never_goes_again(node):
    adapter = _adapter(node)
    run_id = await _started(node)
    assert node.manager.runs.step_back(_permit(node, run_id))  # type: ignore[arg-type]
    await trio.testing.wait_all_tasks_blocked()
    assert (await node.manager.cancel(run_id)).cancelled
    record, events = await wait_end(node, run_id)
    assert record.status is RunStatus.CANCELLED and adapter.started == [run_id]
    assert [e.kind for e in events].count(EventKind.STARTED) == 1
    assert node.gate.statistics().targets["scripted/a"].borrowed == 0  # its place is given back


async def test_a_run_taken_back_and_never_told_goes_again_after_a_bound(node, autojump_clock):
    adapter = _adapter(node)
    run_id = await _started(node)
    assert node.manager.runs.step_back(_permit(node, run_id))  # type: ignore[arg-type]
    await trio.sleep(HOLD_AT_MOST - 1)
    assert adapter.started == [run_id]
    await trio.sleep(2)
    assert adapter.started == [run_id, run_id]
    adapter.script(run_id).finish()
    record, _ = await wait_end(node, run_id)
    assert record.status is RunStatus.SUCCEEDED
