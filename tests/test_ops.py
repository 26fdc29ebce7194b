"""The operator endpoints (``iop_trio.ops``) on a real hypercorn server on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import attrs
import httpx
import pytest
import trio
import trio.testing

from iop_trio.metrics import CONTENT_TYPE, NodeMetrics
from iop_trio.ops import OpsApp, serve_ops
from iop_trio.runtime import Node, RunSpec, RunStatus, TargetSpec
from iop_trio.store import RunStore
from iop_trio.store.memory import MemoryStore
from iop_trio.store.sqlite import SqliteStore

from .support import ScriptedAdapter, logged

WAIT = 10.0
TARGET = "scripted/m"


@attrs.define
class Ops:
    node: Node
    adapter: ScriptedAdapter
    client: httpx.AsyncClient
    port: int
    shutdown: trio.Event


OPS_TOKEN = "ops-s3cret"


@asynccontextmanager
async def serving(
    *,
    token: str | None = OPS_TOKEN,
    send_token: str | None = OPS_TOKEN,
    open_metrics: bool = True,
    store: RunStore | None = None,
) -> AsyncIterator[Ops]:
    """A node (not started) with one scripted target and ``store`` (a MemoryStore by
    default), and its ops app served (with ``token``); the client sends ``send_token``."""
    adapter = ScriptedAdapter()
    node = Node(
        node_id="ops",
        adapters=[adapter],
        targets=[TargetSpec("scripted", "m", allow_options={"k"})],
        store=store or MemoryStore(),
    )
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        with trio.fail_after(WAIT):
            app = OpsApp(node, NodeMetrics(node), token=token, open_metrics=open_metrics)
            port = await nursery.start(partial(serve_ops, app, "127.0.0.1", 0, shutdown=shutdown))
        headers = {"Authorization": f"Bearer {send_token}"} if send_token else {}
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=WAIT, headers=headers
        ) as client:
            yield Ops(node, adapter, client, port, shutdown)
        nursery.cancel_scope.cancel()


async def test_run_routes_show_and_cancel_a_run():
    async with serving() as ops, ops.node.running():
        run = (await ops.node.manager.submit(RunSpec(TARGET, "p", options={"k": 1}))).record
        shown = await ops.client.get(f"/runs/{run.run_id}")
        assert shown.status_code == 200
        assert shown.headers["content-type"] == "application/json"
        data = shown.json()
        assert (data["run_id"], data["target"], data["options"]) == (run.run_id, TARGET, {"k": 1})
        assert data["status"] in ("queued", "running")

        cancel = await ops.client.post(f"/runs/{run.run_id}/cancel", params={"reason": "ops"})
        assert cancel.json() == {"run_id": run.run_id, "status": "cancelled", "cancelled": True}
        record = await ops.node.store.get(run.run_id)
        assert record is not None
        assert (record.status, record.reason) == (RunStatus.CANCELLED, "ops")
        again = await ops.client.post(f"/runs/{run.run_id}/cancel")
        assert again.json() == {"run_id": run.run_id, "status": "cancelled", "cancelled": False}


async def test_unknown_runs_paths_and_methods():
    async with serving() as ops, ops.node.running():
        missing = await ops.client.get("/runs/nope")
        assert (missing.status_code, missing.json()) == (404, {"error": "unknown run 'nope'"})
        assert (await ops.client.post("/runs/nope/cancel")).status_code == 404
        for path in ("/nope", "/runs/", "/runs/a/b/c", "/metrics/x"):
            assert (await ops.client.get(path)).status_code == 404, path
        wrong = await ops.client.get("/runs/x/cancel")
        assert (wrong.status_code, wrong.headers["allow"]) == (405, "POST")
        wrong = await ops.client.post("/healthz")
        assert (wrong.status_code, wrong.headers["allow"]) == (405, "GET, HEAD")


async def test_run_routes_while_the_node_is_not_running():
    async with serving() as ops:
        for response in (
            await ops.client.get("/runs/r"),
            await ops.client.post("/runs/r/cancel"),
        ):
            assert (response.status_code, response.json()) == (
                503,
                {"error": "the node is not running"},
            )


async def test_run_routes_whose_store_cannot_answer_say_so_in_a_503(tmp_path):
    """A run the node no longer holds is read from the store; one deleted under the node
    cannot answer: a JSON error with a 503, never a 500 with a traceback."""
    path = tmp_path / "node.db"
    store = SqliteStore(path)
    try:
        async with serving(store=store) as ops, ops.node.running():
            run = (await ops.node.manager.submit(RunSpec(TARGET, "p"))).record.run_id
            with trio.fail_after(WAIT):
                while run not in ops.adapter.scripts:
                    await trio.testing.wait_all_tasks_blocked()
                ops.adapter.script(run).finish()
                await ops.node.manager.wait_idle()
            assert (await ops.client.get(f"/runs/{run}")).status_code == 200
            path.unlink()
            path.with_name("node.db-wal").unlink()
            for response in (
                await ops.client.get(f"/runs/{run}"),
                await ops.client.post(f"/runs/{run}/cancel"),
            ):
                assert response.status_code == 503
                assert response.headers["content-type"] == "application/json"
                error = response.json()["error"]
                assert error.startswith("the run store cannot be read: its file ") and (
                    "was deleted" in error
                ), error
    finally:
        await store.aclose()


async def test_head_is_answered_like_get_without_the_body():
    async with serving() as ops, ops.node.running():
        head = await ops.client.head("/healthz")
        assert (head.status_code, head.content) == (200, b"")
        assert head.headers["content-length"] == "6"  # "alive\n", as GET sends it


async def test_metrics_content_negotiation_and_name_filter():
    async with serving() as ops:
        plain = await ops.client.get("/metrics")
        assert plain.headers["content-type"] == CONTENT_TYPE
        assert "iop_gate_queue_max" in plain.text
        assert "_created" not in plain.text
        only = await ops.client.get("/metrics", params={"name[]": "iop_gate_queue_max"})
        families = {line.split()[2] for line in only.text.splitlines() if line.startswith("# TYPE")}
        assert families == {"iop_gate_queue_max"}
        zipped = await ops.client.get("/metrics", headers={"accept-encoding": "gzip"})
        assert zipped.headers["content-encoding"] == "gzip"  # httpx has unzipped it

        def steady(text: str) -> list[str]:  # the process's CPU time moves between scrapes
            return [line for line in text.splitlines() if "process_" not in line]

        assert steady(zipped.text) == steady(plain.text)


async def test_shutdown_stops_the_server_with_a_keep_alive_connection_open():
    node = Node(node_id="o", adapters=[ScriptedAdapter()], targets=[], store=MemoryStore())
    shutdown, stopped = trio.Event(), trio.Event()

    async def serve_then_note(task_status: trio.TaskStatus[int]) -> None:
        await serve_ops(
            OpsApp(node, NodeMetrics(node)),
            "127.0.0.1",
            0,
            shutdown=shutdown,
            task_status=task_status,
        )
        stopped.set()

    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_then_note)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/readyz")).status_code == 503  # kept alive, idle
            with trio.fail_after(WAIT):
                shutdown.set()
                await stopped.wait()
        with pytest.raises(OSError, match="connect"):
            await trio.open_tcp_stream("127.0.0.1", port)


async def test_a_taken_port_is_an_os_error():
    async with serving() as ops, trio.open_nursery() as nursery:
        app = OpsApp(ops.node, NodeMetrics(ops.node))
        with pytest.raises(OSError, match="in use"):
            await nursery.start(serve_ops, app, "127.0.0.1", ops.port)


async def test_the_run_routes_need_the_ops_token():
    async with serving(send_token=None) as ops, ops.node.running():
        run = (await ops.node.manager.submit(RunSpec(TARGET, "secret prompt"))).record
        for response in (
            await ops.client.get(f"/runs/{run.run_id}"),
            # what a page in a browser could send: a form post, no Authorization header
            await ops.client.post(
                f"/runs/{run.run_id}/cancel",
                content=b"reason=x",
                headers={"Content-Type": "application/x-www-form-urlencoded"},
            ),
            await ops.client.get(f"/runs/{run.run_id}", headers={"Authorization": "Bearer wrong"}),
        ):
            assert response.status_code == 401
            assert response.headers["www-authenticate"] == "Bearer"
            assert "secret prompt" not in response.text
        assert (await ops.node.manager.get(run.run_id)).status is not RunStatus.CANCELLED  # type: ignore[union-attr]
        # /metrics and /healthz stay open
        assert (await ops.client.get("/healthz")).status_code == 200
        assert (await ops.client.get("/metrics")).status_code == 200


async def test_with_no_token_configured_the_run_routes_say_how_to_set_one():
    with logged("iop_trio.ops") as records:
        async with serving(token=None) as ops, ops.node.running():
            refused = await ops.client.get("/runs/anything")
            assert refused.status_code == 401
            assert "metrics.token" in refused.json()["error"]
            await ops.client.get("/runs/anything")
    told = [r.getMessage() for r in records if "metrics.token" in r.getMessage()]
    assert len(told) == 1  # said once, not per request


async def test_metrics_can_need_the_token_too():
    async with serving(send_token=None, open_metrics=False) as ops:
        assert (await ops.client.get("/metrics")).status_code == 401
        assert (await ops.client.get("/healthz")).status_code == 401
    async with serving(open_metrics=False) as ops:
        assert (await ops.client.get("/metrics")).status_code == 200
