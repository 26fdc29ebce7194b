"""Memory of a long run: node RSS while one run streams 2,000,000 deltas, beside 1,000.

Each size runs in a fresh process (a node with a SqliteStore in a temporary folder
and the echo adapter, one run whose prompt is echoed ``repeat`` times); the process
samples its own RSS every 0.2 s and reports the peak. The baseline is the same
process streaming 1,000 deltas: a run's memory should not grow with its output,
so the peaks should be close (the store's page cache and the interpreter make the
floor). A second pair does the same with a watcher that reads every event as it
comes (what the edge does), to show the window of recent events keeps it flat too.

Then the memory a queued run takes (``--queued N``, default 100,000): a fresh process
with a node whose one target has concurrency 0 (paused) submits N runs that all wait
in the queue; the RSS it gains, divided by N, beside the same process's RSS before (the
baseline is the node with 200 queued runs, so the interpreter, the store and the first
allocations are not counted).

    .venv/bin/python benchmarks/memory.py [--deltas 2000000] [--queued 100000]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = 1000  # words in the prompt; each is one delta


def rss_kib() -> int:
    """This process's resident set now, in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def child(deltas: int, watch: bool) -> None:
    import trio

    from iop_trio.adapters.echo import EchoAdapter
    from iop_trio.runtime import Node, RunSpec, RuntimeLimits, TargetSpec
    from iop_trio.store.sqlite import SqliteStore

    async def main() -> dict[str, float]:
        peak = rss_kib()
        with tempfile.TemporaryDirectory() as folder:
            store = SqliteStore(Path(folder) / "runs.db")
            node = Node(
                node_id="mem",
                adapters=[EchoAdapter()],
                targets=[TargetSpec("echo", "m")],
                limits=RuntimeLimits(max_output_bytes=None, max_run_time=None),
                store=store,
            )
            async with node.running(), trio.open_nursery() as nursery:
                start_rss = rss_kib()

                async def sample() -> None:
                    nonlocal peak
                    while True:
                        peak = max(peak, rss_kib())
                        await trio.sleep(0.2)

                nursery.start_soon(sample)
                spec = RunSpec(
                    "echo/m", "w " * WORDS, options={"repeat": deltas // WORDS}, background=True
                )
                started = time.perf_counter()
                run = (await node.manager.submit(spec)).record.run_id
                seen = 0
                async for _event in node.manager.watch(run):
                    seen += 1
                    if not watch:
                        break  # the run goes on alone; wait for it below
                await node.manager.wait_idle()
                elapsed = time.perf_counter() - started
                peak = max(peak, rss_kib())
                nursery.cancel_scope.cancel()
            record = await store.get(run)
            stored = record.last_seq if record else 0
            await store.aclose()
        assert record is not None
        assert record.status.value == "succeeded", record
        return {
            "start_kib": start_rss,
            "peak_kib": max(peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss),
            "seconds": elapsed,
            "stored_events": stored,
            "watched": seen,
        }

    print(json.dumps(trio.run(main)))


def queued_child(runs: int) -> None:
    import gc

    import trio

    from iop_trio.adapters.echo import EchoAdapter
    from iop_trio.runtime import Node, RunSpec, RuntimeLimits, TargetSpec
    from iop_trio.store.sqlite import SqliteStore

    async def main() -> dict[str, float]:
        with tempfile.TemporaryDirectory() as folder:
            store = SqliteStore(Path(folder) / "runs.db")
            node = Node(
                node_id="mem",
                adapters=[EchoAdapter()],
                targets=[TargetSpec("echo", "m", concurrency=0)],  # paused: every run waits
                limits=RuntimeLimits(max_queued=runs + 1000, queue_timeout=3600),
                store=store,
            )
            async with node.running():
                for _ in range(200):
                    await node.manager.submit(RunSpec("echo/m", "hi"))
                gc.collect()
                before = rss_kib()
                started = time.perf_counter()

                async def submit_some(count: int) -> None:
                    for _ in range(count):
                        await node.manager.submit(RunSpec("echo/m", "hi"))

                async with trio.open_nursery() as submitters:  # 500 at once: group commit
                    for share in range(500):
                        submitters.start_soon(submit_some, runs // 500 + (share < runs % 500))
                elapsed = time.perf_counter() - started
                gc.collect()
                after = rss_kib()
                node.manager.cancel_all("done")
                await node.manager.wait_idle()
            await store.aclose()
        return {"before_kib": before, "after_kib": after, "seconds": elapsed}

    print(json.dumps(trio.run(main)))


def measure(deltas: int, watch: bool) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(deltas)] + (["--watch"] if watch else []),
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    return json.loads(out.splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--deltas", type=int, default=2_000_000)
    parser.add_argument("--child", type=int)
    parser.add_argument("--watch", action="store_true")
    parser.add_argument("--queued", type=int, default=100_000)
    parser.add_argument("--queued-child", type=int)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.watch)
        return
    if args.queued_child is not None:
        queued_child(args.queued_child)
        return
    print(f"python {sys.version.split()[0]}; one echo run per process, SqliteStore in a tmp dir")
    print(
        f"{'deltas':>10} {'watcher':>8} {'start MiB':>10} {'peak MiB':>9} {'s':>7} {'deltas/s':>9}"
    )
    for watch in (False, True):
        rows = [(n, measure(n, watch)) for n in (1_000, args.deltas)]
        for n, r in rows:
            print(
                f"{n:>10,} {'yes' if watch else 'no':>8} {r['start_kib'] / 1024:>10.1f} "
                f"{r['peak_kib'] / 1024:>9.1f} {r['seconds']:>7.1f} {n / r['seconds']:>9,.0f}"
            )
        (_, small), (_, big) = rows
        growth = (big["peak_kib"] - small["peak_kib"]) / 1024
        ratio = big["peak_kib"] / small["peak_kib"]
        print(f"{'':>10} peak of {args.deltas:,} deltas vs 1,000: x{ratio:.2f} ({growth:+.1f} MiB)")

    if args.queued:
        out = subprocess.run(
            [sys.executable, __file__, "--queued-child", str(args.queued)],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        ).stdout
        q = json.loads(out.splitlines()[-1])
        grown = (q["after_kib"] - q["before_kib"]) * 1024
        print(
            f"{args.queued:,} queued runs: RSS {q['before_kib'] / 1024:.1f} -> "
            f"{q['after_kib'] / 1024:.1f} MiB, {grown / args.queued:,.0f} bytes a queued run "
            f"(submitted at {args.queued / q['seconds']:,.0f} runs/s)"
        )


if __name__ == "__main__":
    main()
