"""A flood with exact accounting: 10,000 runs through the edge to an `iop-node serve` process.

Every run is followed to its end by the client; afterwards the client's tally of end
statuses, the node's `/metrics` and the node's store (read after it drained on SIGTERM)
must agree exactly, run for run. The targets make every kind of end: success, engine
failure, queue_full, and cancels from the client.
"""

from __future__ import annotations

import collections
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from iop_trio.cli import StoreLock
from iop_trio.edge import Edge
from iop_trio.model import RunStatus
from iop_trio.runtime import EventKind, RunSpec
from iop_trio.store.sqlite import SqliteStore
from iop_trio.transport import RemoteError, open_runner

pytestmark = pytest.mark.faults

TOKEN = "flood-token"
RUNS = 10_000
TARGETS = ("echo/ok", "echo/bad", "echo/tight", "echo/slow")


def config_text(db: Path, edge_url: str) -> str:
    return f"""
node_id: flooded
edge: {{url: "{edge_url}", token: {TOKEN}, backoff_initial: 0.05, backoff_max: 0.2}}
store: {{path: "{db}"}}
runtime: {{concurrency: 16, max_queued: 20000, queue_timeout: 600, drain_timeout: 5}}
adapters:
  echo: {{kind: echo}}
targets:
  - {{adapter: echo, model: ok, concurrency: 8}}
  - {{adapter: echo, model: bad, concurrency: 4, params: {{fail_after: 1}}}}
  - {{adapter: echo, model: tight, concurrency: 1, max_queued: 2, params: {{delay: 0.01}}}}
  - {{adapter: echo, model: slow, concurrency: 4, params: {{delay: 0.02}}}}
metrics: {{listen: "127.0.0.1:0"}}
logging: {{level: warning, format: json}}
"""


def finished_by_status(metrics_text: str) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "iop_runs_finished_total":
                counts[sample.labels["status"]] += int(sample.value)
    return +counts


async def test_ten_thousand_runs_are_accounted_for_by_client_metrics_and_store(tmp_path):
    db = tmp_path / "node.db"
    config = tmp_path / "node.yaml"
    edge = Edge(token=TOKEN)
    client_ends: collections.Counter[str] = collections.Counter()
    refused: list[str] = []
    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            await nursery.start(edge.serve)
            config.write_text(config_text(db, edge.node_url))
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "iop_trio.cli", "serve", "--config", str(config)],
                stderr=subprocess.DEVNULL,
            )
            await edge.wait_for_node("flooded")
            base = StoreLock(str(db)).read()[1]  # the ops URL the node wrote there

            # All 10,000 requests go at once on one session, so the last is accepted only
            # after nearly all the others ran: on two shared cores that can take longer
            # than the default 30 s first-answer bound, which this test does not measure.
            async with open_runner(edge.client_url, token=TOKEN, ack_timeout=180) as client:

                async def one(i: int) -> None:
                    target = TARGETS[i % len(TARGETS)]
                    try:
                        async with client.run(RunSpec(target, f"run {i} words")) as stream:
                            if target == "echo/slow" and i % 8 == 3:
                                await client.cancel(stream.run_id, "client changed its mind")
                            async for event in stream:
                                if event.kind.terminal:
                                    client_ends[event.kind.value] += 1
                    except RemoteError as exc:  # refused before a run existed
                        refused.append(exc.message)

                async with trio.open_nursery() as flood:
                    for i in range(RUNS):
                        flood.start_soon(one, i)

            async with httpx.AsyncClient(base_url=base, timeout=30) as http:
                scraped = (await http.get("/metrics")).text
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
            nursery.cancel_scope.cancel()

    assert refused == []
    assert sum(client_ends.values()) == RUNS
    # every kind of end happened
    assert set(client_ends) == {"succeeded", "failed", "rejected", "cancelled"}
    assert finished_by_status(scraped) == client_ends
    submitted = sum(
        int(s.value)
        for family in text_string_to_metric_families(scraped)
        for s in family.samples
        if s.name == "iop_runs_submitted_total"
    )
    assert submitted == RUNS
    store = SqliteStore(db)
    try:
        records = await store.list_runs(limit=RUNS + 1)
        stored = collections.Counter(r.status.value for r in records)
        assert stored == client_ends
        assert all(r.status is not RunStatus.INTERRUPTED for r in records)
        for record in records[:50]:  # whole logs: seq 1..n, one terminal event, last
            kinds = [e.kind for e in await store.events(record.run_id)]
            assert len(kinds) == record.last_seq
            assert [k.terminal for k in kinds].count(True) == 1
            assert kinds[-1].terminal
            assert kinds[0] is EventKind.QUEUED
    finally:
        await store.aclose()
