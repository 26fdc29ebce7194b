"""One replica of two SIGKILLed under load, then started again (issue 32), with real
processes: two ``benchmarks/sim_engine.py`` engines on loopback, a real node over them
(``replicas:``, ``round_robin``, probes every 0.2 s).

While eight runs stream, one engine gets SIGKILL: the runs streaming from it end
FAILED (their streams cut, as a lone engine's do), every other run succeeds, and eight
runs submitted right after all succeed (those granted the dead replica before its mark
go on to the live one; nothing is stored twice: each has one STARTED and its whole
text). The engine is started again on its port: the probe clears it and it serves runs,
the node not restarted.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from iop_trio.adapters.openai import OpenAIAdapter, OpenAISettings
from iop_trio.model import EventKind, RunSpec, RunStatus
from iop_trio.runtime import AdapterSlot, Node, ReplicaSlot, RuntimeLimits, TargetSpec
from iop_trio.store.memory import MemoryStore

from .engines import wait_end

pytestmark = pytest.mark.faults

SIM = Path(__file__).resolve().parent.parent / "benchmarks" / "sim_engine.py"
FAST = ("--base-ms", "25", "--per-seq-ms", "0", "--prefill-us", "0")
WAIT = 20.0  # seconds any step may take, at most
TOKENS = 40  # a run's tokens: a second of streaming at 25 ms a step


@asynccontextmanager
async def engine(port: int = 0) -> AsyncIterator[tuple[trio.Process, int]]:
    """A sim engine (its port: ``port``, or a free one), killed at the end if it runs."""
    argv = [sys.executable, str(SIM), "--port", str(port), "--model", "m", *FAST]
    proc = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        seen = b""
        with trio.fail_after(WAIT):
            while b"\n" not in seen:
                chunk = await proc.stdout.receive_some(4096)
                assert chunk, "the engine exited before it listened"
                seen += chunk
        found = re.search(rb"listening on [\d.]+:(\d+)", seen)
        assert found is not None, seen
        yield proc, int(found.group(1))
    finally:
        if proc.returncode is None:
            proc.kill()
        with trio.CancelScope(shield=True):
            await proc.wait()


def node_over(urls: list[str]) -> Node:
    replicas = tuple(
        ReplicaSlot(OpenAIAdapter("r", OpenAISettings(base_url=url)), url) for url in urls
    )
    return Node(
        node_id="faults",
        adapters=[AdapterSlot(replicas[0].adapter, replicas=replicas, routing="round_robin")],
        targets=[TargetSpec("r", "m", concurrency=32, params={"max_tokens": TOKENS})],
        store=MemoryStore(),
        limits=RuntimeLimits(probe_interval=0.2),
    )


async def submit(node: Node, count: int) -> list[str]:
    return [
        (await node.manager.submit(RunSpec(target="r/m", prompt=f"run {i}"))).record.run_id
        for i in range(count)
    ]


async def streaming(node: Node, run_id: str) -> bool:
    return any(e.kind is EventKind.DELTA for e in await node.store.events(run_id))


async def test_a_replica_killed_under_load_and_started_again():
    async with engine() as (dead, dead_port), engine() as (_live, live_port):
        urls = [f"http://127.0.0.1:{dead_port}", f"http://127.0.0.1:{live_port}"]
        node = node_over(urls)
        async with node.running():
            first = await submit(node, 8)
            with trio.fail_after(WAIT):
                for _ in range(int(WAIT / 0.01)):
                    if all([await streaming(node, r) for r in first]):
                        break
                    await trio.sleep(0.01)
            os.kill(dead.pid, signal.SIGKILL)
            await dead.wait()
            after = await submit(node, 8)
            ends = {r: await wait_end(node, r) for r in first + after}
            failed = [r for r in first if ends[r][0].status is RunStatus.FAILED]
            assert 1 <= len(failed) <= 4, {r: ends[r][0] for r in first}
            for run_id, (record, events) in ends.items():
                if run_id in failed:
                    assert record.reason in ("connection", "bad_response"), record
                    continue
                assert record.status is RunStatus.SUCCEEDED, record
                assert [e.kind for e in events].count(EventKind.STARTED) == 1
                text = "".join(e.text for e in events if e.kind is EventKind.DELTA)
                assert text.count("tok") == TOKENS, (record, text)
            assert ("r", urls[0]) in node.replica_health.down
            # back on its port: the probe clears it, and round robin sends it runs
            async with engine(dead_port):
                with trio.fail_after(WAIT):
                    for _ in range(int(WAIT / 0.05)):
                        if not node.replica_health.down:
                            break
                        await trio.sleep(0.05)
                for run_id in await submit(node, 4):
                    record, _ = await wait_end(node, run_id)
                    assert record.status is RunStatus.SUCCEEDED, record
                async with httpx.AsyncClient() as http:
                    stats = (await http.get(urls[0] + "/bench/stats")).json()
                assert stats["finished"] >= 2, stats
