"""Usage accounting through a real ``iop-node serve`` that is killed and restarted.

A real node process serves an OpenAI-compatible wire server (tests/engines.py, in this
process, over loopback) that streams a chunk a token and reports usage at the end. Runs
of three tenants on two targets end three ways:

- **succeeded**: the engine reported its counts; the run's usage is exactly those
  (nothing estimated), whatever the node counted itself;
- **cancelled** mid-stream, once the caller has every chunk the engine sent (the engine
  then sends nothing more): no report, so the node's own count, marked estimated: the
  completion is the engine tokens of the deltas the run received and stored, which is
  exactly the chunks the engine sent; the prompt is the estimate of its size
  (``estimate_prompt_tokens``, 4 bytes a token);
- **killed**: RUNNING, streaming, when the node gets SIGKILL; the restarted node
  interrupts them with a usage counted from their *stored* deltas, marked estimated:
  their completion is the tokens of the deltas in the store, which is at most what the
  caller received (a delta is sent once the store has taken it, and written within 64
  deltas or 200 ms: the ones not yet written when the node died are not counted) and
  never more; their prompt the same estimate.

Every run that started has a usage; the totals ``iop-node usage`` prints, by tenant and
by target, are the sums of what the runs' records hold; the restarted node's
``iop_tenant_tokens_total`` holds exactly what it settled at the restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from iop_trio.cli import StoreLock
from iop_trio.edge import Edge
from iop_trio.model import EventKind, RunQuery, RunSpec, RunStatus, estimate_prompt_tokens
from iop_trio.store.sqlite import SqliteStore

from .engines import SSE, Exchange, Reply, openai_chunk, openai_stream, serve, sse

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 90  # seconds for the whole test; it needs a few
TOKEN = "usage-token"
NODE_ID = "usage-node"
PIECES = 6  # the chunks (tokens) each run's engine streams


@attrs.frozen
class Plan:
    """One run: who it is for, where it goes, how it ends."""

    end: str  # succeed | cancel | kill
    tenant: str
    target: str
    number: int

    @property
    def prompt(self) -> str:
        # the prompt names the run (the engine's script reads it) and differs in length
        return f"{self.end} {self.number} " + "word " * (3 * self.number)

    @property
    def pieces(self) -> list[str]:
        return [f"t{self.number}.{i} " for i in range(PIECES)]

    @property
    def reported(self) -> tuple[int, int]:
        """What the engine reports for a run that finishes: not what the node would
        count (its chunks, its prompt's size), so the test can tell whose counts it sees."""
        return 1000 + self.number, 500 + self.number


PLANS = [
    Plan(end, tenant, target, number)
    for number, (end, tenant, target) in enumerate(
        [
            ("succeed", "acme", "vllm/a"),
            ("succeed", "acme", "vllm/b"),
            ("succeed", "beta", "vllm/a"),
            ("succeed", "", "vllm/b"),
            ("succeed", "beta", "vllm/b"),
            ("succeed", "", "vllm/a"),
            ("cancel", "acme", "vllm/a"),
            ("cancel", "beta", "vllm/b"),
            ("cancel", "", "vllm/a"),
            ("kill", "acme", "vllm/b"),
            ("kill", "beta", "vllm/a"),
            ("kill", "", "vllm/b"),
        ]
    )
]
BY_PROMPT = {plan.prompt: plan for plan in PLANS}


def engine_reply(exchange: Exchange) -> Reply:
    """The engine's answer to a run: its chunks, one a token, then (if it is to succeed)
    its finish and usage; a run to be cancelled or killed hangs after its chunks."""
    plan = BY_PROMPT[exchange.json["messages"][-1]["content"]]
    if plan.end == "succeed":
        return Reply(content_type=SSE, parts=openai_stream(plan.pieces, usage=plan.reported))
    parts = [sse(openai_chunk("", role="assistant"))] + [
        sse(openai_chunk(piece)) for piece in plan.pieces
    ]
    return Reply(content_type=SSE, parts=parts, end="hang")


def write_config(tmp_path: Path, engine_url: str, edge: Edge) -> Path:
    config = tmp_path / "node.yaml"
    config.write_text(
        f"node_id: {NODE_ID}\n"
        f"adapters: {{vllm: {{kind: openai, base_url: '{engine_url}', read_timeout: 60}}}}\n"
        "targets:\n"
        "  - {adapter: vllm, model: a, concurrency: 8}\n"
        "  - {adapter: vllm, model: b, concurrency: 8}\n"
        "runtime: {concurrency: 16, probe_interval: null}\n"
        "tenants: {acme: {weight: 1}}\n"  # beta is not set: its metric series is other
        f"store: {{path: {tmp_path / 'node.db'}}}\n"
        "metrics: {listen: '127.0.0.1:0'}\n"
        f"edge: {{url: '{edge.node_url}', token: {TOKEN}}}\n"
    )
    return config


@asynccontextmanager
async def node_process(config: Path, stderr: Path) -> AsyncIterator[trio.Process]:
    """``iop-node serve`` on ``config``; killed (SIGKILL) if it is still running at the end."""
    with stderr.open("ab") as err:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "iop_trio.cli", "serve", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()


async def run_to_its_end(edge: Edge, plan: Plan, received: dict[Plan, str]) -> None:
    """Stream ``plan``'s run; cancel it once every chunk the engine sends has come."""
    spec = RunSpec(plan.target, plan.prompt, tenant=plan.tenant)
    async with edge.run(spec) as stream:
        text = []
        async for event in stream:
            text.append(event.text)
            if plan.end == "cancel" and "".join(text) == "".join(plan.pieces):
                await edge.cancel(stream.run_id, reason="cancelled")
        received[plan] = "".join(text)
        assert stream.last is not None
        expected = {"succeed": EventKind.SUCCEEDED, "cancel": EventKind.CANCELLED}
        assert stream.last.kind is expected[plan.end], (plan, stream.last)


async def stream_until_all_came(
    edge: Edge, plan: Plan, received: dict[Plan, str], ids: dict[Plan, str]
) -> None:
    """Start ``plan``'s run (background: it outlives this stream) and read it until every
    chunk the engine sends has come; the run goes on, hanging on its engine."""
    spec = RunSpec(plan.target, plan.prompt, tenant=plan.tenant, background=True)
    async with edge.run(spec) as stream:
        ids[plan] = stream.run_id
        text = []
        async for event in stream:
            text.append(event.text)
            if "".join(text) == "".join(plan.pieces):
                break
        received[plan] = "".join(text)


async def scrape_tenant_tokens(db: Path) -> dict[tuple[str, str], float]:
    """iop_tenant_tokens_total of the node running on ``db`` (its ops URL is in its lock)."""
    url = next(line for line in StoreLock(str(db)).read() if line.startswith("http"))
    async with httpx.AsyncClient() as client:
        response = await client.get(f"{url}/metrics")
    response.raise_for_status()
    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == "iop_tenant_tokens_total":
                found[sample.labels["tenant"], sample.labels["kind"]] = sample.value
    return found


async def usage_lines(config: Path, by: str) -> list[dict[str, object]]:
    done = await trio.run_process(
        [sys.executable, "-m", "iop_trio.cli", "usage", "--config", str(config), "--by", by,
         "--json"],
        capture_stdout=True,
        capture_stderr=True,
        cwd=ROOT,
    )  # fmt: skip
    return [json.loads(line) for line in done.stdout.decode().splitlines()]


async def test_usage_survives_cancels_and_a_kill_9_and_adds_up(tmp_path):
    db = tmp_path / "node.db"
    stderr = tmp_path / "node.stderr"
    received: dict[Plan, str] = {}
    killed_ids: dict[Plan, str] = {}
    edge = Edge(token=TOKEN)
    with trio.fail_after(TIMEOUT):
        async with serve() as engine, trio.open_nursery() as nursery:
            engine.handler = engine_reply
            await nursery.start(edge.serve)
            config = write_config(tmp_path, engine.url, edge)
            async with node_process(config, stderr) as first:
                old = await edge.wait_for_node(NODE_ID)
                async with trio.open_nursery() as runs:
                    for plan in PLANS:
                        if plan.end == "kill":
                            runs.start_soon(stream_until_all_came, edge, plan, received, killed_ids)
                        else:
                            runs.start_soon(run_to_its_end, edge, plan, received)
                first.kill()  # SIGKILL, with three runs streaming
                assert await first.wait() == -signal.SIGKILL
            async with node_process(config, stderr) as second:
                # it interrupted what the first left RUNNING before it dialled the edge
                await edge.wait_for_node(NODE_ID, other_than=old)
                tokens = await scrape_tenant_tokens(db)
                second.send_signal(signal.SIGTERM)
                assert await second.wait() == 0, stderr.read_text()
            nursery.cancel_scope.cancel()
        by_tenant = await usage_lines(config, "tenant")
        by_target = await usage_lines(config, "target")
        store = SqliteStore(db)
        try:
            records = {r.run_id: r for r in await store.list_runs(RunQuery(limit=1000))}
            events = {run_id: await store.events(run_id) for run_id in records}
        finally:
            await store.aclose()

    plans = {run_id: BY_PROMPT[r.prompt] for run_id, r in records.items()}
    assert sorted(plans.values(), key=lambda p: p.number) == PLANS  # each once, none lost
    assert set(killed_ids.values()) <= set(records)
    interrupted: dict[str, tuple[int, int]] = defaultdict(lambda: (0, 0))
    for run_id, record in records.items():
        plan = plans[run_id]
        usage = record.usage
        assert record.started is not None and usage is not None, record  # all started
        assert events[run_id][-1].usage == usage  # the end carries what the record holds
        stored = sum(e.tokens for e in events[run_id] if e.kind is EventKind.DELTA)
        prompt = estimate_prompt_tokens(plan.prompt)
        if plan.end == "succeed":  # the engine's report, exactly
            assert record.status is RunStatus.SUCCEEDED
            assert (usage.prompt_tokens, usage.completion_tokens) == plan.reported
            assert not usage.estimated
            assert received[plan] == "".join(plan.pieces)
            continue
        # the node's count: the prompt's estimate, the engine tokens of the stored deltas
        assert (usage.prompt_tokens, usage.completion_tokens) == (prompt, stored)
        assert usage.prompt_estimated and usage.completion_estimated
        if plan.end == "cancel":  # every chunk the engine sent was received and stored
            assert (record.status, stored) == (RunStatus.CANCELLED, PIECES)
        else:  # what the store had when the node died: at most what was received
            assert (record.status, record.reason) == (RunStatus.INTERRUPTED, "node_restart")
            assert received[plan] == "".join(plan.pieces)
            text = "".join(e.text for e in events[run_id] if e.kind is EventKind.DELTA)
            assert received[plan].startswith(text)
            assert stored == len(text.split())  # a chunk a word, a token a chunk
            label = plan.tenant if plan.tenant in ("", "acme") else "other"
            was = interrupted[label]
            interrupted[label] = (was[0] + prompt, was[1] + stored)

    # the totals iop-node usage prints are the sums of the records
    for by, lines in (("tenant", by_tenant), ("target", by_target)):
        sums: dict[str, dict[str, int]] = {}
        for record in records.values():
            usage = record.usage
            assert usage is not None
            prompt, completion = usage.prompt_tokens or 0, usage.completion_tokens or 0
            total = sums.setdefault(record.tenant if by == "tenant" else record.target, {})
            for key, value in (
                ("runs", 1),
                ("prompt_tokens", prompt),
                ("completion_tokens", completion),
                ("estimated_prompt_tokens", prompt if usage.prompt_estimated else 0),
                ("estimated_completion_tokens", completion if usage.completion_estimated else 0),
            ):
                total[key] = total.get(key, 0) + value
        assert lines == [{by: name, **sums[name]} for name in sorted(sums)]
    assert sum(int(line["runs"]) for line in by_tenant) == len(PLANS)  # type: ignore[call-overload]

    # the restarted node settled only the runs it interrupted, and counted them so
    assert tokens == {
        (label, kind): float(counts[i])
        for label, counts in interrupted.items()
        for i, kind in enumerate(("input", "output"))
        if counts[i]
    }
