"""Mass cancellation: draining a node with 100,000 queued runs on the SQLite store.

Three figures from the same process, each on a fresh store in a temporary folder
with N runs queued behind a paused target (concurrency 0):

- ``drain``: ``RunManager.drain`` (what SIGTERM does): the queued runs are taken out
  of the queue and their CANCELLED events written together;
- ``one by one``: the same runs cancelled with ``cancel_nowait`` each, every run
  ending itself with its own store write (the path of a single cancel);
- ``store only``: the baseline, N CANCELLED events written with one
  ``append_many`` on a store holding N queued runs, no runtime at all.

Each line checks that every run is CANCELLED in the store and counts the ERROR
lines logged (there should be none).

    .venv/bin/python benchmarks/drain.py [--runs 100000]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from iop_trio.adapters.echo import EchoAdapter
from iop_trio.lifecycle import RunState
from iop_trio.model import RunQuery, RunStatus
from iop_trio.runtime import Node, RunSpec, RuntimeLimits, TargetSpec
from iop_trio.store.sqlite import SqliteStore


class ErrorCount(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


ERRORS = ErrorCount()


async def with_queued_node(n: int, end: Callable[[Node], Awaitable[None]]) -> tuple[float, int]:
    """Seconds ``end`` takes to end ``n`` queued runs, and how many are CANCELLED after."""
    with tempfile.TemporaryDirectory() as folder:
        store = SqliteStore(Path(folder) / "runs.db")
        node = Node(
            node_id="drain",
            adapters=[EchoAdapter()],
            targets=[TargetSpec("echo", "m", concurrency=0)],
            limits=RuntimeLimits(max_queued=n, queue_timeout=3600),
            store=store,
        )
        async with node.running():
            async with trio.open_nursery() as nursery:
                for _ in range(n):
                    nursery.start_soon(node.manager.submit, RunSpec("echo/m", "p", background=True))
            assert node.gate.queued == n
            started = time.perf_counter()
            await end(node)
            elapsed = time.perf_counter() - started
        cancelled = len(
            await store.list_runs(RunQuery(statuses=[RunStatus.CANCELLED], limit=n + 1))
        )
        await store.aclose()
    return elapsed, cancelled


async def drain(node: Node) -> None:
    await node.manager.drain(0)


async def one_by_one(node: Node) -> None:
    for record in node.manager.live_records():
        node.manager.cancel_nowait(record.run_id, "node_draining")
    await node.manager.wait_idle()


async def store_only(n: int) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as folder:
        store = SqliteStore(Path(folder) / "runs.db")
        states = []
        for i in range(n):
            state, first = RunState.create(
                run_id=f"r{i}", target="echo/m", background=True, time=1.0
            )
            states.append((state, first))
        async with trio.open_nursery() as nursery:
            for state, first in states:
                nursery.start_soon(store.create, state.record, first)
        events = [s.transition(RunStatus.CANCELLED, time=2.0, reason="drain") for s, _ in states]
        started = time.perf_counter()
        await store.append_many(events)
        elapsed = time.perf_counter() - started
        cancelled = len(
            await store.list_runs(RunQuery(statuses=[RunStatus.CANCELLED], limit=n + 1))
        )
        await store.aclose()
    return elapsed, cancelled


async def main(n: int) -> None:
    print(f"python {sys.version.split()[0]}, trio {trio.__version__}; {n:,} queued runs")
    print(f"{'':<12} {'seconds':>8} {'runs/s':>9} {'x store':>8} {'cancelled':>10} {'errors':>7}")
    base, base_count = await store_only(n)
    rows = [("store only", base, base_count, 0)]
    for name, end in (("drain", drain), ("one by one", one_by_one)):
        before = ERRORS.count
        elapsed, count = await with_queued_node(n, end)
        rows.append((name, elapsed, count, ERRORS.count - before))
    for name, elapsed, count, errors in rows:
        print(
            f"{name:<12} {elapsed:>8.2f} {n / elapsed:>9,.0f} {elapsed / base:>8.1f} "
            f"{count:>10,} {errors:>7}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=100_000)
    logging.getLogger().addHandler(ERRORS)
    trio.run(main, parser.parse_args().runs)
