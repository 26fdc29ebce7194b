"""Gate throughput and queue memory, printed as figures.

    python benchmarks/gate.py [--runs N] [--queued N]

1. Runs per second through the in-process runtime (Node + MemoryStore + echo
   adapter, one delta a run) at limits 1, 8 and 64, beside a bare baseline
   measured in the same process: spawn a task that acquires and releases one
   CapacityLimiter of the same limit. The ratio is runtime / baseline.
2. Memory per queued run with 100k runs queued behind a paused target
   (tracemalloc: Python allocations made while the runs were queued, divided
   by their number), and the process RSS growth.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
import tracemalloc
from pathlib import Path

import trio

from iop_trio.adapters.echo import EchoAdapter
from iop_trio.runtime import Node, RunSpec, RuntimeLimits, TargetSpec
from iop_trio.store.memory import MemoryStore


def make_node(limit: int, max_queued: int) -> Node:
    return Node(
        node_id="bench",
        adapters=[EchoAdapter()],
        targets=[TargetSpec("echo", "m", concurrency=limit)],
        limits=RuntimeLimits(concurrency=limit, max_queued=max_queued, queue_timeout=3600),
        store=MemoryStore(),
    )


async def runtime_rate(limit: int, runs: int) -> float:
    node = make_node(limit, max_queued=runs)
    async with node.running():
        manager = node.manager
        spec = RunSpec("echo/m", "hi")
        start = time.perf_counter()
        for _ in range(runs):
            await manager.submit(spec)
        await manager.wait_idle()
        elapsed = time.perf_counter() - start
    return runs / elapsed


async def baseline_rate(limit: int, runs: int) -> float:
    limiter = trio.CapacityLimiter(limit)

    async def worker() -> None:
        async with limiter:
            await trio.lowlevel.checkpoint()

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(runs):
            nursery.start_soon(worker)
            await trio.lowlevel.checkpoint()
    return runs / (time.perf_counter() - start)


def rss_kib() -> int:
    # current RSS from /proc (Linux); ru_maxrss is only the peak
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


async def queued_memory(count: int) -> tuple[float, float, int]:
    node = make_node(limit=1, max_queued=count)
    node.set_limits(targets={"echo/m": 0})  # paused: every run waits
    async with node.running():
        gc.collect()
        rss_before = rss_kib()
        tracemalloc.start()
        base, _ = tracemalloc.get_traced_memory()
        for i in range(count):
            await node.manager.submit(RunSpec("echo/m", f"prompt {i}"))
        gc.collect()
        now, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss_after = rss_kib()
        queued = node.gate.queued
        node.manager.cancel_all("bench over")
    per_run = (now - base) / count
    return per_run, (rss_after - rss_before) * 1024 / count, queued


async def main(runs: int, queued: int) -> None:
    print(f"python {sys.version.split()[0]}, trio {trio.__version__}, {runs} runs per figure")
    print(f"{'limit':>6} {'runtime runs/s':>15} {'baseline ops/s':>15} {'ratio':>7}")
    for limit in (1, 8, 64):
        await runtime_rate(limit, min(runs, 500))  # warm up
        rt = await runtime_rate(limit, runs)
        base = await baseline_rate(limit, runs)
        print(f"{limit:>6} {rt:>15,.0f} {base:>15,.0f} {rt / base:>7.3f}")
    per_run, rss_per_run, n = await queued_memory(queued)
    print(
        f"queued runs: {n:,}; python heap per queued run: {per_run:,.0f} B "
        f"(tracemalloc); RSS growth per queued run: {rss_per_run:,.0f} B"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20_000)
    parser.add_argument("--queued", type=int, default=100_000)
    ns = parser.parse_args()
    trio.run(main, ns.runs, ns.queued)
