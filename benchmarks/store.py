"""Run store throughput: events appended per second, and SQLite's group commit.

    python benchmarks/store.py [--events N] [--runs N] [--rev REV]

For each store, N DELTA events are appended (each ``append`` returns once the
event is durable), either by 1 task into one run or by 64 concurrent tasks,
each into its own run. For SQLite (a file in a temporary directory, WAL) the
table also shows the commits made and the mean batch size (appends per
commit): with one writer every append pays a commit; with 64 they share them.
``synchronous=FULL`` (an fsync per commit) is measured with N/5 events.

Then ``--runs`` whole runs go through a node (an ``echo`` target, 8 words, no
delay, submitted and watched to their end by C = 1 or 16 tasks), with each
store: per run, the store's commits, the process's CPU time (every thread:
the SQLite writer's too) and wall time. The MemoryStore row is the baseline
measured in the same run: what a run costs the node without a disk.

``--rev REV`` measures a committed revision's ``iop_trio`` (``git archive`` into a
temporary folder, first on PYTHONPATH), as relay.py's ``--rev`` does, so a before/after
comparison in one sitting needs no checkout.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import trio

# after PYTHONPATH, so --rev's exported code is the one imported
sys.path.append(str(Path(__file__).resolve().parent.parent))

from relay import REV_ENV, run_at_rev

import iop_trio
from iop_trio.adapters.echo import EchoAdapter
from iop_trio.lifecycle import RunState
from iop_trio.model import RunSpec, RunStatus, TargetSpec
from iop_trio.runtime import Node, RuntimeLimits
from iop_trio.store import RunStore
from iop_trio.store.memory import MemoryStore
from iop_trio.store.sqlite import SqliteStore


async def running_run(store: RunStore, run_id: str) -> RunState:
    state, first = RunState.create(run_id=run_id, target="bench/m", background=False, time=0.0)
    await store.create(state.record, first)
    await store.append(state.transition(RunStatus.RUNNING, time=0.0))
    return state


async def measure(store: RunStore, writers: int, events: int) -> tuple[float, str, str]:
    """Append ``events`` deltas with ``writers`` tasks.

    Returns events per second and, for SQLite, the commits made and the mean batch.
    """
    states = [await running_run(store, f"w{i}") for i in range(writers)]
    each = events // writers

    async def writer(state: RunState) -> None:
        for i in range(each):
            await store.append(state.delta("tok ", time=float(i)))

    before = store.statistics() if isinstance(store, SqliteStore) else None
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for state in states:
            nursery.start_soon(writer, state)
    rate = each * writers / (time.perf_counter() - start)
    if not isinstance(store, SqliteStore) or before is None:
        return rate, "-", "-"
    after = store.statistics()
    commits = after.commits - before.commits
    return rate, str(commits), f"{(after.jobs - before.jobs) / commits:.1f}"


async def row(
    name: str, make: Callable[[], RunStore], writers: int, events: int
) -> tuple[str, int, int, float, str, str]:
    store = make()
    try:
        rate, commits, batch = await measure(store, writers, events)
    finally:
        await store.aclose()
    return name, writers, events, rate, commits, batch


RUN_PROMPT = "one two three four five six seven eight"


async def whole_runs(store: RunStore, callers: int, runs: int) -> tuple[str, float, float]:
    """Commits (SQLite), CPU and wall microseconds per run, ``runs`` by ``callers`` tasks."""
    node = Node(
        node_id="bench",
        adapters=[EchoAdapter()],
        targets=[TargetSpec("echo", "m", concurrency=callers, params={"delay": 0})],
        limits=RuntimeLimits(concurrency=callers, max_queued=10_000, queue_timeout=600.0),
        store=store,
    )
    async with node.running():

        async def caller(count: int) -> None:
            for _ in range(count):
                submitted = await node.manager.submit(RunSpec("echo/m", RUN_PROMPT))
                async for _event in node.manager.watch(submitted.record.run_id, after_seq=1):
                    pass

        await caller(50)  # warm up
        before = store.statistics() if isinstance(store, SqliteStore) else None
        cpu, wall = time.process_time(), time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(callers):
                nursery.start_soon(caller, runs // callers)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        done = runs // callers * callers
        commits = "-"
        if isinstance(store, SqliteStore) and before is not None:
            commits = f"{(store.statistics().commits - before.commits) / done:.2f}"
    return commits, cpu / done * 1e6, wall / done * 1e6


async def main(events: int, runs: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        counter = iter(range(1_000_000))

        def sqlite(synchronous: Literal["NORMAL", "FULL"]) -> Callable[[], RunStore]:
            def make() -> RunStore:
                return SqliteStore(Path(tmp) / f"{next(counter)}.db", synchronous=synchronous)

            return make

        rows = []
        for writers in (1, 64):
            rows.append(await row("MemoryStore", MemoryStore, writers, events))
            rows.append(await row("SqliteStore NORMAL", sqlite("NORMAL"), writers, events))
            rows.append(await row("SqliteStore FULL", sqlite("FULL"), writers, events // 5))
        run_rows = []
        if runs:
            for callers in (1, 16):
                for name, make in (
                    ("MemoryStore", MemoryStore),
                    ("SqliteStore NORMAL", sqlite("NORMAL")),
                ):
                    store = make()
                    try:
                        run_rows.append((name, callers, *await whole_runs(store, callers, runs)))
                    finally:
                        await store.aclose()

    print(
        f"python {sys.version.split()[0]}, trio {trio.__version__}, sqlite {sqlite3.sqlite_version}"
    )
    package = Path(iop_trio.__file__).parent
    print(f"iop_trio from {package} ({os.environ.get(REV_ENV, 'the working tree')})")
    columns = ("store", "writers", "events", "events/s", "commits", "mean batch")
    print("{:<20} {:>7} {:>7} {:>11} {:>8} {:>11}".format(*columns))
    for name, writers, n, rate, commits, batch in rows:
        print(f"{name:<20} {writers:>7} {n:>7} {rate:>11,.0f} {commits:>8} {batch:>11}")
    if run_rows:
        print(f"\n{runs} whole runs a row (echo, 8 words, no delay), per run:")
        print(
            "{:<20} {:>7} {:>8} {:>8} {:>8}".format(
                "store", "callers", "commits", "cpu us", "wall us"
            )
        )
        for name, callers, commits, cpu, wall in run_rows:
            print(f"{name:<20} {callers:>7} {commits:>8} {cpu:>8,.0f} {wall:>8,.0f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=6400, help="events per measurement")
    parser.add_argument("--runs", type=int, default=2000, help="whole runs a row (0: none)")
    parser.add_argument("--rev", help="measure this git revision's iop_trio instead")
    args = parser.parse_args()
    if args.rev:
        sys.exit(run_at_rev(args.rev, sys.argv[1:], Path(__file__)))
    trio.run(main, args.events, args.runs)
