"""``iop-node demo`` (``make run``): an edge, its OpenAI-compatible API and a node with
echo targets, on loopback, until Ctrl-C.

The node is an ordinary :func:`~iop_trio.cli.serve.serve` of a config the demo writes
(:data:`DEMO_CONFIG`, with a token file and a fresh ops token) in ``--var``. Its
tracing is off unless the OTEL_* variables say otherwise (:func:`demo_process`).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import attrs
import trio

from .. import __version__
from ..config import TracingConfig, load_config
from ..model import RunSpec
from ..telemetry import DEMO_SERVICE, installed, resolve
from .errors import CliError
from .serve import serve

if TYPE_CHECKING:
    from ..edge import Edge, NodeHandle


#: The demo edge's one shared token (it listens on loopback only).
DEMO_TOKEN = "demo-token"


DEMO_CONFIG = """\
# written by `iop-node demo`: the demo's node, for `iop-node runs list --config` this file
node_id: demo-node
adapters:
  echo: {{kind: echo, delay: 0.05, concurrency: 8}}
targets:
  - {{adapter: echo, model: chat, concurrency: 2, params: {{delay: 0.08}}}}
  - {{adapter: echo, model: fast, concurrency: 4, params: {{delay: 0}}}}
runtime: {{concurrency: 4, max_queued: 100, queue_timeout: 30, drain_timeout: 5}}
store: {{path: demo.db}}
metrics: {{listen: "127.0.0.1:{metrics_port}", token_file: demo.ops-token}}
edge: {{url: "ws://127.0.0.1:{edge_port}/node", token_file: demo.token}}
"""


def free_port() -> int:
    """A port on 127.0.0.1 free just now (for the demo's metrics, asked for port 0)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_demo_files(folder: Path, edge_port: int, metrics_port: int) -> tuple[Path, Path]:
    """The demo node's config, the edge's token and the ops port's (a new random one,
    so that ``runs cancel`` and ``GET /runs/<id>`` work on the demo), private, in
    ``folder``."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    token_file = folder / "demo.token"
    token_file.write_text(DEMO_TOKEN + "\n")
    token_file.chmod(0o600)
    ops_token = folder / "demo.ops-token"
    ops_token.touch(mode=0o600)
    ops_token.chmod(0o600)
    ops_token.write_text(secrets.token_urlsafe(24) + "\n")
    config_path = folder / "demo.yaml"
    config_path.write_text(DEMO_CONFIG.format(metrics_port=metrics_port, edge_port=edge_port))
    return config_path, token_file


def demo_process(ns: argparse.Namespace, out: TextIO) -> int:
    """``iop-node demo`` as a process: tracing from the OTEL_* variables alone (off
    when they say nothing; one provider for the edge and the node, which share the
    process), the demo until Ctrl-C, then the provider shut down, flushing its spans."""
    settings = resolve(TracingConfig(), os.environ, service_name=DEMO_SERVICE)
    with installed(settings):
        return trio.run(demo, ns, out)


async def demo(ns: argparse.Namespace, out: TextIO) -> int:
    """An edge (with its OpenAI-compatible API) and a node with echo targets, on loopback,
    until Ctrl-C. The node is an ordinary ``serve`` of a config written to ``ns.var``: its
    runs are kept in a SQLite file there and its metrics are served."""
    from ..edge import Edge
    from ..edge.front_door import serve_door

    folder = Path(ns.var)
    edge = Edge(token=DEMO_TOKEN, edge_id="demo-edge")
    stop = trio.Event()
    async with trio.open_nursery() as edge_nursery:
        listening = f"127.0.0.1:{ns.port}"
        try:
            port = await edge_nursery.start(edge.serve, "127.0.0.1", ns.port)
            listening = f"127.0.0.1:{ns.api_port}"
            api_port = await edge_nursery.start(serve_door, edge, "127.0.0.1", ns.api_port)
        except OSError as exc:
            raise CliError(f"cannot listen on {listening}: {exc.strerror or exc}") from None
        metrics_port = ns.metrics_port or free_port()
        config_path, token_file = write_demo_files(folder, port, metrics_port)
        config = load_config(config_path)
        async with trio.open_nursery() as node_nursery:
            await node_nursery.start(partial(serve, config, stop=stop))
            handle = await edge.wait_for_node("demo-node")
            ports = DemoPorts(edge=port, api=api_port, metrics=metrics_port)
            _write_banner(out, handle, ports, folder)
            await _demo_run(edge, out)
            _write_tries(out, ports, config_path, token_file)
            out.flush()
            if ns.once:
                stop.set()
        edge_nursery.cancel_scope.cancel()
    return 0


@attrs.frozen
class DemoPorts:
    """The loopback ports the demo's edge, OpenAI-compatible API and metrics got."""

    edge: int
    api: int
    metrics: int

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api}/v1"


def _write_banner(out: TextIO, handle: NodeHandle, ports: DemoPorts, folder: Path) -> None:
    """What the demo serves, and where."""
    out.write(
        f"\niop-trio {__version__} demo: node {handle.node_id!r} serves "
        f"{', '.join(sorted(handle.targets))}\n"
        f"  edge (proto-socket)  ws://127.0.0.1:{ports.edge}  (token: {DEMO_TOKEN})\n"
        f"  OpenAI-compatible    {ports.api_url}\n"
        f"  metrics              http://127.0.0.1:{ports.metrics}/metrics  "
        f"(and /readyz)\n"
        f"  runs are kept in     {folder / 'demo.db'}\n\n"
    )


async def _demo_run(edge: Edge, out: TextIO) -> None:
    """One run through the edge, then its text and how it ended, on one line written
    whole (the node logs the run's end as its last text and its end go out together,
    so a line written as the text streamed would have that log line in its middle)."""
    async with edge.run(RunSpec("echo/chat", "hello from the iop-trio demo")) as stream:
        text, last = await stream.collect()
    out.write(f"demo run: {text}  [{last.kind.value}]\n\n")
    out.flush()


def _write_tries(out: TextIO, ports: DemoPorts, config_path: Path, token_file: Path) -> None:
    """The commands to try on the demo from another terminal."""
    exe = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "iop-node"
    chat = json.dumps(
        {"model": "echo/chat", "messages": [{"role": "user", "content": "stream me"}]}
    )
    out.write(
        "try, from another terminal:\n"
        f"  .venv/bin/{exe} submit --edge ws://127.0.0.1:{ports.edge} --token-file "
        f'{token_file} --target echo/chat "stream me back"\n'
        f"  .venv/bin/{exe} runs list --config {config_path}\n"
        f"  .venv/bin/{exe} runs cancel RUN_ID --config {config_path}\n"
        f"  curl -s {ports.api_url}/chat/completions -H 'Authorization: Bearer {DEMO_TOKEN}' "
        f"-H 'Content-Type: application/json' -d '{chat}'\n\n"
        "each run is logged here as it ends; Ctrl-C stops (running runs are drained "
        "first).\n"
    )
