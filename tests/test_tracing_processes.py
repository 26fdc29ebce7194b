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
import re
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio

from .engines import SSE, Exchange, Reply, openai_stream, serve
from .test_cli import IOP_NODE

TOKEN = "trace-token"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
START_TIMEOUT = 60.0


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@asynccontextmanager
async def process(
    argv: list[str], env: dict[str, str], out: Path, err: Path
) -> AsyncIterator[trio.Process]:
    """``argv`` as a process with stdout and stderr in files; SIGTERM and wait at the end
    (SIGKILL if it has not stopped within 20 s)."""
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = await trio.lowlevel.open_process(argv, env=env, stdout=stdout, stderr=stderr)
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


def text_of(path: Path) -> str:
    return path.read_text(errors="replace")


async def until_in(path: Path, pattern: str, proc: trio.Process) -> None:
    """Wait (bounded) until ``path`` holds ``pattern``: an outside process's log line,
    read every 50 ms, as there is nothing else to wait on."""
    with trio.fail_after(START_TIMEOUT):
        while not re.search(pattern, text_of(path)):
            assert proc.returncode is None, text_of(path)
            await trio.sleep(0.05)


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
    async with serve() as wire:
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
        paths = {name: tmp_path / name for name in ("edge.out", "edge.err", "node.out", "node.err")}
        async with process(
            edge_argv, {**env, "IOP_EDGE_TOKEN": TOKEN}, paths["edge.out"], paths["edge.err"]
        ) as edge_proc:
            await until_in(paths["edge.out"], r"OpenAI-compatible API on", edge_proc)
            async with process(
                [*IOP_NODE, "serve", "--config", str(config)],
                {**env, "IOP_EDGE__TOKEN": TOKEN},
                paths["node.out"],
                paths["node.err"],
            ) as node_proc:
                await until_in(paths["edge.err"], r"node traced-node .* joined", edge_proc)
                async with httpx.AsyncClient(timeout=30) as client:
                    answer = await client.post(
                        f"http://127.0.0.1:{door_port}/v1/chat/completions",
                        headers={
                            "authorization": f"Bearer {TOKEN}",
                            "traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01",
                        },
                        json={"model": "wire/m", "messages": [{"role": "user", "content": "hi"}]},
                    )
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["message"]["content"] == "traced words"
            assert node_proc.returncode == 0, paths["node.err"].read_text()
        assert edge_proc.returncode == 0, paths["edge.err"].read_text()
    (headers,) = seen
    assert headers["traceparent"].split("-")[1] == TRACE_ID
    ours = f'"trace_id": "0x{TRACE_ID}"'
    edge_out, node_out = paths["edge.out"].read_text(), paths["node.out"].read_text()
    assert ours in edge_out, edge_out[-2000:]
    assert ours in node_out, node_out[-2000:]
    for attribute in (
        '"gen_ai.request.model": "m"',
        '"gen_ai.usage.input_tokens": 9',
        '"gen_ai.usage.output_tokens": 2',
        '"iop.queue.wait_s"',
    ):
        assert attribute in node_out, (attribute, node_out[-3000:])
    assert "Traceback" not in paths["node.err"].read_text() + paths["edge.err"].read_text()
