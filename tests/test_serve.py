"""`iop-node serve` as a real process: edge link, metrics, ops cancel, SIGTERM drain."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import trio

from iop_trio.cli import StoreLock
from iop_trio.edge import Edge
from iop_trio.runtime import EventKind, RunSpec, RunStatus
from iop_trio.store.sqlite import SqliteStore

TOKEN = "serve-token"
OPS_TOKEN = "ops-token"


def config_text(db: Path, edge_url: str) -> str:
    return f"""
node_id: served-node
edge: {{url: "{edge_url}", token: {TOKEN}, backoff_initial: 0.05, backoff_max: 0.2}}
store: {{path: "{db}"}}
runtime: {{concurrency: 4, drain_timeout: 1.0}}
adapters:
  echo: {{kind: echo}}
targets:
  - {{adapter: echo, model: quick, concurrency: 2}}
  - {{adapter: echo, model: slow, concurrency: 2, params: {{delay: 60}}}}
metrics: {{listen: "127.0.0.1:0", token: {OPS_TOKEN}}}
logging: {{level: info, format: json}}
"""


async def test_serve_links_exposes_metrics_cancels_and_drains_on_sigterm(tmp_path):
    db = tmp_path / "node.db"
    edge = Edge(token=TOKEN)
    logs: list[dict[str, object]] = []
    metrics_url: list[str] = []
    got_url = trio.Event()

    async def read_logs(stream: trio.abc.ReceiveStream) -> None:
        buffer = b""
        async for chunk in stream:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                entry = json.loads(line)
                logs.append(entry)
                message = str(entry["msg"])
                if message.startswith("metrics on "):
                    metrics_url.append(message.removeprefix("metrics on ").rsplit("/", 1)[0])
                    got_url.set()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(edge.serve)
            config = tmp_path / "node.yaml"
            config.write_text(config_text(db, edge.node_url))
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "iop_trio.cli", "serve", "--config", str(config)],
                stderr=subprocess.PIPE,
            )
            assert process.stderr is not None
            nursery.start_soon(read_logs, process.stderr)
            handle = await edge.wait_for_node("served-node")
            await got_url.wait()
            base = metrics_url[0]

            async with edge.run(RunSpec("echo/quick", "quick one")) as stream:
                text, last = await stream.collect()
            assert (text, last.kind) == ("quick one", EventKind.SUCCEEDED)

            async with edge.run(RunSpec("echo/slow", "slow one", background=True)) as slow:
                while (await slow.__anext__()).kind is not EventKind.STARTED:
                    pass
            async with edge.run(RunSpec("echo/slow", "to cancel", background=True)) as victim:
                while (await victim.__anext__()).kind is not EventKind.STARTED:
                    pass

            ops_auth = {"Authorization": f"Bearer {OPS_TOKEN}"}
            async with httpx.AsyncClient(base_url=base, timeout=10, headers=ops_auth) as http:
                health = await http.get("/healthz")
                assert (health.status_code, health.text.strip()) == (200, "alive")
                ready = await http.get("/readyz")
                assert ready.status_code == 200
                assert ready.json()["components"]["edge"] == {"ok": True, "state": "up"}
                scraped = (await http.get("/metrics")).text
                assert 'iop_gate_running_runs{target="echo/slow"} 2.0' in scraped
                assert "iop_edge_link_up 1.0" in scraped
                assert "iop_edge_link_sessions_total 1.0" in scraped
                shown = (await http.get(f"/runs/{slow.run_id}")).json()
                assert (shown["status"], shown["background"], shown["options"]) == (
                    "running",
                    True,
                    {},
                )
                assert (await http.get("/runs/nope")).status_code == 404
                assert 'iop_runs_finished_total{status="succeeded",target="echo/quick"} 1.0' in (
                    scraped
                )

            # `runs cancel` finds the store locked by the live node and goes through its ops port
            cancel = await trio.run_process(
                [
                    sys.executable,
                    "-m",
                    "iop_trio.cli",
                    "runs",
                    "cancel",
                    victim.run_id,
                    "--config",
                    str(config),
                ],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            assert cancel.returncode == 0, cancel.stderr
            assert cancel.stdout.decode().strip() == f"{victim.run_id}: cancelled"
            info = await handle.get_run(victim.run_id)
            assert info.run.reason == "cancelled"

            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
            nursery.cancel_scope.cancel()

    messages = [str(e["msg"]) for e in logs]
    assert any(m.startswith("SIGTERM: draining") for m in messages)
    assert any(m == "drained; 1 runs were cancelled" for m in messages)
    ended = {e["run_id"]: e for e in logs if e.get("status") and e.get("run_id")}
    assert ended[slow.run_id]["reason"] == "node_draining"

    store = SqliteStore(db)
    try:
        record = await store.get(slow.run_id)
        assert record is not None
        assert (record.status, record.reason) == (RunStatus.CANCELLED, "node_draining")
        events = await store.events(slow.run_id)
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert events[-1].kind is EventKind.CANCELLED
    finally:
        await store.aclose()
    assert not StoreLock(str(db)).held_elsewhere()  # the node let go of its store
