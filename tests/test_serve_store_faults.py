"""`iop-node serve` as a real process when its store fails under it (issue 19).

The store file deleted under a running node: it stops admitting, says so once, its
reads say so, and a copy it made has every run it acknowledged. A run created while the
disk is full (a real tmpfs where one can be mounted): refused within about store_grace,
and never stored. Every wait is on a line the node logs or an answer it gives, bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from iop_trio.edge import Edge
from iop_trio.protocol import pb
from iop_trio.runtime import EventKind, RunSpec
from iop_trio.transport import RemoteError

from .test_store_faults import fill_disk, small_disk

pytestmark = pytest.mark.faults

TOKEN = "store-token"
OPS_TOKEN = "store-ops-token"
LIMIT = 30  # seconds: a bound on anything that waits on the node
IOP_NODE = [sys.executable, "-m", "iop_trio.cli"]
Entry = dict[str, Any]


def config_text(db: Path, edge_url: str) -> str:
    return f"""
node_id: store-node
edge: {{url: "{edge_url}", token: {TOKEN}, backoff_initial: 0.05, backoff_max: 0.2}}
store: {{path: "{db}"}}
runtime: {{concurrency: 8, store_grace: 1.0, drain_timeout: 1.0}}
adapters:
  echo: {{kind: echo}}
targets:
  - {{adapter: echo, model: quick, concurrency: 6}}
  - {{adapter: echo, model: slow, concurrency: 2, params: {{delay: 60}}}}
metrics: {{listen: "127.0.0.1:0", token: {OPS_TOKEN}}}
logging: {{level: info, format: json}}
"""


@attrs.define(eq=False)
class NodeProcess:
    """A running ``iop-node serve``: its JSON log as it comes, and its ops client."""

    process: trio.Process
    log: list[Entry] = attrs.field(factory=list)
    ops: httpx.AsyncClient | None = None
    _changed: trio.Event = attrs.field(factory=trio.Event)

    def __repr__(self) -> str:
        return f"<NodeProcess pid={self.process.pid} log={len(self.log)} lines>"

    async def read_log(self, stream: trio.abc.ReceiveStream) -> None:
        buffer = b""
        async for chunk in stream:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                self.log.append(json.loads(line))
            self._changed.set()
            self._changed = trio.Event()

    async def said(self, test: Callable[[Entry], bool]) -> Entry:
        """The first line of its log that passes ``test``, once there is one."""
        with trio.fail_after(LIMIT):
            while True:
                found = next((e for e in self.log if test(e)), None)
                if found is not None:
                    return found
                if self.process.poll() is not None:
                    raise AssertionError(f"the node ended ({self.process.returncode}): {self.log}")
                await self._changed.wait()

    def lines(self, level: str) -> list[str]:
        return [str(e["msg"]) for e in self.log if e["level"] == level]


def says(prefix: str) -> Callable[[Entry], bool]:
    return lambda entry: str(entry["msg"]).startswith(prefix)


@asynccontextmanager
async def serving(config: Path, nursery: trio.Nursery) -> AsyncIterator[NodeProcess]:
    """``iop-node serve`` of ``config``, once it serves, with a client of its ops port;
    SIGTERM at the end (it must exit 0)."""
    process = await trio.lowlevel.open_process(
        [*IOP_NODE, "serve", "--config", str(config)], stderr=subprocess.PIPE
    )
    node = NodeProcess(process)
    try:
        assert process.stderr is not None
        nursery.start_soon(node.read_log, process.stderr)
        url = str((await node.said(says("metrics on ")))["msg"]).removeprefix("metrics on ")
        await node.said(says("node store-node serving"))
        headers = {"Authorization": f"Bearer {OPS_TOKEN}"}
        async with httpx.AsyncClient(
            base_url=url.removesuffix("/metrics"), timeout=LIMIT, headers=headers
        ) as node.ops:
            yield node
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(LIMIT):
                assert await process.wait() == 0, node.log
    finally:
        if process.returncode is None:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()


async def cli(*argv: str) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [*IOP_NODE, *argv], capture_stdout=True, capture_stderr=True, check=False
    )


async def listed(config: Path) -> dict[str, Entry]:
    """``runs list --json`` of the store ``config`` names: run id -> its record."""
    result = await cli("runs", "list", "--json", "--limit", "10000", "--config", str(config))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.decode().splitlines()]  # JSON Lines
    return {record["run_id"]: record for record in records}


async def submit(edge: Edge, spec: RunSpec) -> str:
    """Submit a background run through the edge; its id once the node acknowledged it."""
    async with edge.run(spec) as stream:
        return stream.run_id


async def test_a_store_deleted_under_a_serving_node_is_reported_and_its_copy_has_every_run(
    tmp_path,
):
    edge = Edge(token=TOKEN)
    db = tmp_path / "node.db"
    config = tmp_path / "node.yaml"
    acknowledged: list[str] = []
    with trio.fail_after(LIMIT * 4):
        async with trio.open_nursery() as nursery:
            await nursery.start(edge.serve)
            config.write_text(config_text(db, edge.node_url))
            async with serving(config, nursery) as node:
                assert node.ops is not None
                await edge.wait_for_node("store-node")

                async def some(first: int) -> None:
                    for i in range(first, 200, 10):
                        spec = RunSpec("echo/quick", f"run {i}", background=True)
                        acknowledged.append(await submit(edge, spec))

                async with trio.open_nursery() as submitting:
                    for first in range(10):
                        submitting.start_soon(some, first)
                async with edge.run(RunSpec("echo/slow", "slow one", background=True)) as slow:
                    while (await slow.__anext__()).kind is not EventKind.STARTED:
                        pass
                for run_id in acknowledged:  # the quick runs have ended (each is a line)
                    await node.said(lambda e, r=run_id: e.get("run_id") == r and "status" in e)
                acknowledged.append(slow.run_id)
                assert (await node.ops.get("/readyz")).status_code == 200

                db.unlink()
                db.with_name("node.db-wal").unlink()
                error = await node.said(lambda e: e["level"] == "error")
                rescue = Path(error["rescue"])
                assert "was deleted while the node had it open" in error["msg"]
                assert f"copied to {rescue}" in error["msg"]

                ready = await node.ops.get("/readyz")
                assert ready.status_code == 503
                store = ready.json()["components"]["store"]
                assert store["ok"] is False and "deleted" in store["state"], store
                assert "iop_store_writable 0.0" in (await node.ops.get("/metrics")).text
                with pytest.raises(RemoteError) as refused:
                    await submit(edge, RunSpec("echo/quick", "too late", background=True))
                assert refused.value.code == pb.ERROR_CODE_STORE_UNAVAILABLE
                assert "deleted" in refused.value.message
                result = await cli("runs", "list", "--config", str(config))
                assert (result.returncode, result.stdout) == (1, b"")
                [line] = result.stderr.decode().splitlines()
                assert line.startswith(f"iop-node: the run store {db} was deleted under the node")
                shown = await node.ops.get(f"/runs/{acknowledged[0]}")
                assert shown.status_code == 503
                assert shown.json()["error"].startswith("the run store cannot be read: its file")
                # the running run is stopped after store_grace, as for a full disk; its
                # end goes into the deleted file, which the copy is made of again at the stop
                await node.said(lambda e: "stopped 1 running runs" in str(e["msg"]))
            nursery.cancel_scope.cancel()

    assert len(node.lines("error")) == 1, node.lines("error")
    assert any("has every run as the node left it" in m for m in node.lines("warning"))
    # what an operator does, the node stopped: the copy goes where the store was
    for leftover in (db.with_name("node.db-wal"), db.with_name("node.db-shm")):
        leftover.unlink(missing_ok=True)
    os.replace(rescue, db)
    with trio.fail_after(LIMIT * 2):
        async with trio.open_nursery() as nursery:
            await nursery.start(edge.serve)
            config.write_text(config_text(db, edge.node_url))
            async with serving(config, nursery):
                runs = await listed(config)
            nursery.cancel_scope.cancel()
    assert set(acknowledged) <= set(runs), "acknowledged runs lost"
    assert len(acknowledged) == 201
    assert (runs[slow.run_id]["status"], runs[slow.run_id]["reason"]) == (
        "failed",
        "store_unavailable",
    )
    assert {runs[r]["status"] for r in acknowledged[:-1]} == {"succeeded"}


async def test_a_run_created_while_the_disk_is_full_is_refused_in_store_grace_never_stored(
    tmp_path,
):
    """issue 19: such a run waited until space returned; its caller timed out through the
    edge (30 s) without its id, and the run was stored later. Now it is refused
    STORE_UNAVAILABLE after store_grace (1 s), and nothing of it is ever stored."""
    with small_disk(tmp_path / "disk") as disk:
        edge = Edge(token=TOKEN)
        db = disk / "node.db"
        config = tmp_path / "node.yaml"
        filler = disk / "filler"
        try:
            with trio.fail_after(LIMIT * 3):
                async with trio.open_nursery() as nursery:
                    await nursery.start(edge.serve)
                    config.write_text(config_text(db, edge.node_url))
                    async with serving(config, nursery) as node:
                        assert node.ops is not None
                        await edge.wait_for_node("store-node")
                        before = await submit(edge, RunSpec("echo/quick", "fits", background=True))
                        # it has ended: the create is the first write to meet the full disk
                        await node.said(lambda e: e.get("run_id") == before and "status" in e)
                        fill_disk(filler)
                        big = RunSpec("echo/quick", "x" * 300_000, run_id="orphan", background=True)
                        # well within the edge's 30 s for an answer: store_grace is 1 s
                        with trio.fail_after(10), pytest.raises(RemoteError) as refused:
                            await submit(edge, big)
                        assert refused.value.code == pb.ERROR_CODE_STORE_UNAVAILABLE
                        assert "did not store the run within 1s" in refused.value.message
                        filler.unlink()
                        await node.said(says(f"run store {db} writes again"))
                        assert (await node.ops.get("/readyz")).status_code == 200
                        assert (await node.ops.get("/runs/orphan")).status_code == 404
                        runs = await listed(config)
                        assert before in runs and "orphan" not in runs
                        # its caller may submit it again, with the same id
                        assert await submit(edge, big) == "orphan"
                    nursery.cancel_scope.cancel()
        finally:
            filler.unlink(missing_ok=True)
    assert node.lines("error") == []
