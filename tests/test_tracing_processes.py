"""Tracing as an operator turns it on: ``OTEL_TRACES_EXPORTER=console`` on a real
``iop-node edge`` and a real ``iop-node serve``.

The node serves an OpenAI-compatible wire engine in this process (tests/engines.py,
over loopback) that records the headers of each request. One request to the edge's
OpenAI door sends its own ``traceparent``; then both processes are stopped (SIGTERM:
each flushes its spans to stdout as it stops). Each process's stdout must hold spans
of that trace id, the node's with the model, the usage and the queue wait, and the
engine must have been sent a ``traceparent`` of the same trace.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import httpx
import trio

from .engines import SSE, Exchange, Reply, openai_stream, serve
from .support import free_port
from .test_cli import IOP_NODE
from .test_telemetry import read_lines_until

TOKEN = "trace-token"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
START_TIMEOUT = 60.0


@attrs.define
class Output:
    """What a process wrote to one of its pipes, line by line, and when a line with
    ``want`` came."""

    want: str
    lines: list[str] = attrs.Factory(list)
    seen: trio.Event = attrs.Factory(trio.Event)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@asynccontextmanager
async def process(
    nursery: trio.Nursery, argv: list[str], env: dict[str, str], out: Output, err: Output
) -> AsyncIterator[trio.Process]:
    """``argv`` as a process whose stdout and stderr are read into ``out`` and ``err``;
    SIGTERM and wait at the end (SIGKILL if it has not stopped within 20 s)."""
    proc = await trio.lowlevel.open_process(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    nursery.start_soon(read_lines_until, proc.stdout, out.lines, out.want, out.seen)
    nursery.start_soon(read_lines_until, proc.stderr, err.lines, err.want, err.seen)
    try:
        yield proc
    finally:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                with trio.move_on_after(20):
                    await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_console_tracing_on_both_processes_follows_one_door_request(tmp_path):
    seen: list[dict[str, str]] = []

    def engine(exchange: Exchange) -> Reply:
        if exchange.path.endswith("/models"):
            listed = json.dumps({"object": "list", "data": [{"id": "m"}]}).encode()
            return Reply(content_type="application/json", parts=[listed], content_length=True)
        seen.append(dict(exchange.headers))
        return Reply(content_type=SSE, parts=openai_stream(["traced ", "words"], usage=(9, 2)))

    edge_port, door_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IOP_", "OTEL_"))}
    env |= {"OTEL_TRACES_EXPORTER": "console", "PYTHONUNBUFFERED": "1"}
    edge_out, edge_err = Output("OpenAI-compatible API on"), Output("node traced-node")
    node_out, node_err = Output("\0"), Output("\0")  # read to the end, waited for by none
    with trio.fail_after(START_TIMEOUT):
        async with serve() as wire, trio.open_nursery() as nursery:
            wire.handler = engine
            config = tmp_path / "node.yaml"
            config.write_text(
                "node_id: traced-node\n"
                f"edge: {{url: 'ws://127.0.0.1:{edge_port}/node', backoff_initial: 0.05}}\n"
                f"adapters: {{wire: {{kind: openai, base_url: '{wire.url}'}}}}\n"
                "targets: [{adapter: wire, model: m}]\n"
                f"store: {{path: {tmp_path / 'node.db'}}}\n"
                "metrics: {listen: ''}\n"
            )
            edge_argv = [*IOP_NODE, "edge", "--listen", f"127.0.0.1:{edge_port}"]
            edge_argv += ["--openai-listen", f"127.0.0.1:{door_port}"]
            edge_env = {**env, "IOP_EDGE_TOKEN": TOKEN}
            async with process(nursery, edge_argv, edge_env, edge_out, edge_err) as edge_proc:
                await edge_out.seen.wait()
                node_argv = [*IOP_NODE, "serve", "--config", str(config)]
                node_env = {**env, "IOP_EDGE__TOKEN": TOKEN}
                async with process(nursery, node_argv, node_env, node_out, node_err) as node_proc:
                    await edge_err.seen.wait()  # the edge's log: node traced-node ... joined
                    async with httpx.AsyncClient(timeout=30) as client:
                        answer = await client.post(
                            f"http://127.0.0.1:{door_port}/v1/chat/completions",
                            headers={
                                "authorization": f"Bearer {TOKEN}",
                                "traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01",
                            },
                            json={
                                "model": "wire/m",
                                "messages": [{"role": "user", "content": "hi"}],
                            },
                        )
                    assert answer.status_code == 200, answer.text
                    assert answer.json()["choices"][0]["message"]["content"] == "traced words"
                assert node_proc.returncode == 0, node_err.text
            assert edge_proc.returncode == 0, edge_err.text
    (headers,) = seen
    assert headers["traceparent"].split("-")[1] == TRACE_ID
    ours = f'"trace_id": "0x{TRACE_ID}"'
    assert ours in edge_out.text, edge_out.text[-2000:]
    assert ours in node_out.text, node_out.text[-2000:]
    for attribute in (
        '"gen_ai.request.model": "m"',
        '"gen_ai.usage.input_tokens": 9',
        '"gen_ai.usage.output_tokens": 2',
        '"iop.queue.wait_s"',
    ):
        assert attribute in node_out.text, (attribute, node_out.text[-3000:])
    assert "Traceback" not in node_err.text + edge_err.text
