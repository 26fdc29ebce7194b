"""A flood with exact accounting: 10,000 runs through the edge to an `iop-node serve` process.

Every run is followed to its end by the client; afterwards the client's tally of end
statuses, the node's `/metrics` and the node's store (read after it drained on SIGTERM)
must agree exactly, run for run. The targets make every kind of end: success, engine
failure, queue_full, and cancels from the client.
"""

from __future__ import annotations

import collections
import contextlib
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from iop_trio.cli import StoreLock
from iop_trio.edge import Edge
from iop_trio.model import RunQuery, RunStatus
from iop_trio.protocol import pb
from iop_trio.runtime import EventKind, RunSpec
from iop_trio.store.sqlite import SqliteStore
from iop_trio.transport import RemoteError, ReplyTimeout, open_runner

from .support import free_port

pytestmark = pytest.mark.faults

TOKEN = "flood-token"
IOP_NODE = [sys.executable, "-m", "iop_trio.cli"]
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
        records = await store.list_runs(RunQuery(limit=RUNS + 1))
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


# --- the holes of issue 19: a handshake flood, and the default client's burst ---------------


def log_file(path: Path) -> int:
    """A file descriptor for a child's stderr (the child keeps its own copy)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)


def low_file_limit(soft: int) -> Callable[[], None]:
    def lower() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return lower


async def start_edge(
    tmp_path: Path, *, files: int | None = None
) -> tuple[trio.Process, str, str, Path]:
    """An `iop-node edge` process with a shared token and the OpenAI door (its open-file
    limit lowered to ``files``); its ws:// URL, door URL and token file."""
    token_file = tmp_path / "edge-token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    port, door = free_port(), free_port()
    stderr = log_file(tmp_path / "edge.log")
    process = await trio.lowlevel.open_process(
        [
            *IOP_NODE,
            "edge",
            "--listen",
            f"127.0.0.1:{port}",
            "--token-file",
            str(token_file),
            "--openai-listen",
            f"127.0.0.1:{door}",
        ],
        stdout=subprocess.PIPE,
        stderr=stderr,
        preexec_fn=None if files is None else low_file_limit(files),
    )
    os.close(stderr)  # the child has its own
    assert process.stdout is not None
    said = b""
    with trio.fail_after(30):
        while b"OpenAI-compatible API" not in said:
            chunk = await process.stdout.receive_some()
            assert chunk, said
            said += chunk
    return process, f"ws://127.0.0.1:{port}", f"http://127.0.0.1:{door}", token_file


async def start_node(tmp_path: Path, edge_url: str, token_file: Path) -> trio.Process:
    """An `iop-node serve` process with an echo target, dialling ``edge_url``; returns
    once its /readyz says it is linked."""
    config = tmp_path / "node.yaml"
    ops = free_port()
    config.write_text(
        f"""
node_id: n1
edge: {{url: "{edge_url}/node", token_file: {token_file}, backoff_initial: 0.1, backoff_max: 0.5}}
store: {{path: "{tmp_path / "node.db"}"}}
adapters: {{echo: {{kind: echo}}}}
targets: [{{adapter: echo, model: m, concurrency: 8}}]
metrics: {{listen: "127.0.0.1:{ops}"}}
logging: {{level: warning}}
"""
    )
    stderr = log_file(tmp_path / "node.log")
    process = await trio.lowlevel.open_process(
        [*IOP_NODE, "serve", "--config", str(config)], stderr=stderr
    )
    os.close(stderr)  # the child has its own
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ops}", timeout=5) as http:
        with trio.fail_after(30):
            while True:  # a real process: asked every 0.1 s, bounded
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get("/readyz")).status_code == 200:
                        return process
                await trio.sleep(0.1)


async def stop(*processes: trio.Process) -> None:
    for process in processes:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
    with trio.move_on_after(20):
        for process in processes:
            await process.wait()
    for process in processes:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_handshake_flood_under_a_low_file_limit_locks_out_no_caller_and_no_node(
    tmp_path,
):
    # the test holds ~900 sockets itself
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    edge, url, door, token_file = await start_edge(tmp_path, files=256)
    node: trio.Process | None = None
    flood: list[trio.SocketStream] = []
    try:
        with trio.fail_after(120):
            port, door_port = int(url.rpartition(":")[2]), int(door.rpartition(":")[2])
            for i in range(900):  # more than the edge may open; none ever finishes
                to, head = (
                    (port, b"GET /client HTTP/1.1\r\nHost: x\r\n")
                    if i % 3
                    else (door_port, b"POST /v1/chat/completions HTTP/1.1\r\n")
                )
                stream = await trio.open_tcp_stream("127.0.0.1", to)
                with contextlib.suppress(trio.BrokenResourceError):
                    await stream.send_all(head)
                flood.append(stream)
            await trio.sleep(1.2)  # the held handshakes are now old enough to give way
            # a node dials in during the flood, and a caller submits through it
            node = await start_node(tmp_path, url, token_file)
            submitted = await trio.run_process(
                [
                    *IOP_NODE,
                    "submit",
                    "--edge",
                    url,
                    "--token-file",
                    str(token_file),
                    "--target",
                    "echo/m",
                    "through the flood",
                ],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            assert submitted.returncode == 0, submitted.stderr.decode()
            assert submitted.stdout.decode().strip() == "through the flood"
            async with httpx.AsyncClient(base_url=door, timeout=10) as http:
                answer = await http.post(
                    "/v1/chat/completions",
                    headers={"Authorization": f"Bearer {TOKEN}"},
                    json={"model": "echo/m", "messages": [{"role": "user", "content": "hi"}]},
                )
            assert answer.status_code == 200, answer.text
            # every flood connection is refused at once or dropped at the 10 s deadline
            start = trio.current_time()
            for stream in flood:
                with trio.move_on_after(15 - (trio.current_time() - start)) as waiting:
                    with contextlib.suppress(trio.BrokenResourceError):
                        while await stream.receive_some():
                            pass
                assert not waiting.cancelled_caught, "a flood connection outlived the deadline"
    finally:
        for stream in flood:
            await trio.aclose_forcefully(stream)
        await stop(*(p for p in (node, edge) if p is not None))
    said = (tmp_path / "edge.log").read_text()
    assert "Traceback" not in said and "EMFILE" not in said and "Too many open files" not in said
    assert "refused" in said  # the flood was seen, and said in a line now and then
    assert said.count("refused") < 20


async def test_the_default_clients_burst_of_ten_thousand_gets_an_answer_each_and_no_orphan(
    tmp_path,
):
    edge, url, _, token_file = await start_edge(tmp_path)
    node = await start_node(tmp_path, url, token_file)
    accepted: set[str] = set()
    refused: collections.Counter[str] = collections.Counter()
    try:
        with trio.fail_after(180):
            async with open_runner(f"{url}/client", token=TOKEN) as client:  # its defaults

                async def one(i: int) -> None:
                    spec = RunSpec("echo/m", "burst", background=True, run_id=f"b{i}")
                    try:
                        accepted.add(await client.submit(spec))
                    except RemoteError as exc:
                        refused[pb.ErrorCode.Name(exc.code)] += 1
                    except ReplyTimeout:
                        refused["timeout"] += 1

                began = trio.current_time()
                async with trio.open_nursery() as burst:
                    for i in range(RUNS):
                        burst.start_soon(one, i)
                took = trio.current_time() - began
    finally:
        await stop(node, edge)
    assert refused["timeout"] == 0, refused
    assert len(accepted) + sum(refused.values()) == RUNS
    assert set(refused) <= {"ERROR_CODE_UNAVAILABLE"}, refused
    store = SqliteStore(tmp_path / "node.db")
    try:
        stored = {r.run_id for r in await store.list_runs(RunQuery(limit=RUNS + 1))}
    finally:
        await store.aclose()
    orphans, lost = sorted(stored - accepted), sorted(accepted - stored)
    assert (orphans, lost) == ([], [])  # a run for every acceptance, and for nothing else
    print(f"burst: {len(accepted)} accepted, refused {dict(refused)}, in {took:.1f}s")
