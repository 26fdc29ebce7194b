"""Every ``iop-node`` command in one table: its name, help, arguments and how it starts.

:data:`COMMANDS` is the table (in ``--help`` order) and :func:`build_parser` the parser
made from it; :func:`run_command` runs the command a parsed namespace names. Each
``_start_*`` function (and :func:`_on_store`, for the commands that read the store) is
how a command starts: the logging it sets up, the config it loads (and where that
config's warnings go), and the function it runs under trio.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Awaitable, Callable
from typing import TextIO

import trio

from .. import __version__
from ..config import TRACE_EXPORTERS, TRACE_SAMPLERS, NodeConfig, load_config
from ..logs import setup_logging
from ..model import RunStatus
from .check import check_config
from .demo import demo_process
from .edge import edge_process, hash_token
from .runs import runs_cancel, runs_list, runs_show
from .serve import serve_process
from .spec import Command, FromEnv, Runner, arg, chosen
from .spec import build_parser as _build
from .submit import submit
from .usage import usage_command

log = logging.getLogger("iop_trio.node")

#: A command on the node's store: its config, the parsed arguments, stdout; its exit status.
StoreCommand = Callable[[NodeConfig, argparse.Namespace, TextIO], Awaitable[int]]


def _config(ns: argparse.Namespace, err: TextIO) -> NodeConfig:
    """The config ``--config`` names, its warnings written to ``err``."""
    config = load_config(ns.config)
    for warning in config.warnings:
        err.write(f"iop-node: warning: {warning}\n")
    return config


def _start_serve(ns: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    config = load_config(ns.config)
    setup_logging(config.logging.level, config.logging.format)
    for warning in config.warnings:  # in the node's log, not on stderr
        log.warning("%s", warning)
    return serve_process(config)


def _start_check_config(ns: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    return check_config(_config(ns, err), out, probe=ns.probe)


def _on_store(action: StoreCommand) -> Runner:
    """How a command that reads the node's store starts: the config (its warnings on
    stderr), warnings-only logging, then ``action`` under trio."""

    def start(ns: argparse.Namespace, out: TextIO, err: TextIO) -> int:
        config = _config(ns, err)
        setup_logging("warning")
        return trio.run(action, config, ns, out)

    start.__name__ = start.__qualname__ = f"start_{action.__name__}"
    return start


def _start_submit(ns: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    setup_logging("warning")
    return trio.run(submit, ns, out, err)


def _start_edge(ns: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    setup_logging("info")
    return edge_process(ns, out)


def _start_hash_token(ns: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    return hash_token(out)


def _start_demo(ns: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    setup_logging("info")
    return demo_process(ns, out)


CONFIG = arg(
    "--config",
    default=FromEnv("IOP_CONFIG", "node.yaml"),
    help="the node's YAML config (default: $IOP_CONFIG or node.yaml)",
)

#: ``iop-node``'s own options, before the command.
OPTIONS = (
    arg("--version", action="version", version=f"iop-node {__version__}"),
    arg("--debug", action="store_true", help="with a failure's one line, print its traceback"),
)

RUNS = (
    Command(
        "list",
        "newest runs first",
        (
            CONFIG,
            arg(
                "--status",
                action="append",
                choices=[s.value for s in RunStatus],
                help="only runs with this status (repeat for several)",
            ),
            arg("--target", help="only this target's runs (adapter/model[@profile])"),
            arg("--tenant", help='only this tenant\'s runs ("" is the default tenant)'),
            arg("--limit", type=int, default=50, help="at most this many (default %(default)s)"),
            arg(
                "--json",
                action="store_true",
                help="one JSON object per line (JSON Lines), newest first",
            ),
        ),
        _on_store(runs_list),
    ),
    Command(
        "show",
        "one run, with --events its event log",
        (
            CONFIG,
            arg("run_id", help="the run's id (as runs list shows it)"),
            arg("--events", action="store_true", help="also print its event log"),
            arg("--json", action="store_true", help="the run (and events) as JSON"),
        ),
        _on_store(runs_show),
    ),
    Command(
        "cancel",
        "cancel a live run",
        (
            CONFIG,
            arg("run_id", help="the run's id"),
            arg(
                "--reason",
                default="cancelled",
                help="recorded as the run's reason (default %(default)s)",
            ),
        ),
        _on_store(runs_cancel),
    ),
)

USAGE_ARGS = (
    CONFIG,
    arg(
        "--since",
        metavar="WHEN",
        help="runs that ended then or later: a date and time (2025-03-14, 2025-03-14T10:00, "
        "local time unless it names a zone) or a time ago (90m, 24h, 7d); default: all",
    ),
    arg("--until", metavar="WHEN", help="runs that ended before then (as --since); default: now"),
    arg(
        "--by",
        choices=["tenant", "target"],
        default="tenant",
        help="sum by the runs' tenant or target (default %(default)s)",
    ),
    arg("--json", action="store_true", help="one JSON object per line (JSON Lines), by name"),
)

SUBMIT_ARGS = (
    arg(
        "--edge",
        default=FromEnv("IOP_EDGE", "ws://127.0.0.1:8765"),
        help="the edge's ws:// or wss:// URL (default: $IOP_EDGE or %(default)s)",
    ),
    arg(
        "--token",
        default=FromEnv("IOP_TOKEN"),
        help="the edge's token (default: $IOP_TOKEN); on the command line ps shows it, so "
        "prefer IOP_TOKEN or --token-file",
    ),
    arg("--token-file", metavar="FILE", help="read the token from a private file"),
    arg("--target", required=True, help="adapter/model[@profile], e.g. echo/chat"),
    arg(
        "--background",
        action="store_true",
        help="print the run id once accepted and exit; the run goes on (see runs show)",
    ),
    arg("--run-id", help="the run's id (resubmitting an id follows the run it names)"),
    arg("--option", action="append", metavar="KEY=VALUE", help="JSON or text value"),
    arg("--priority", type=int, default=0, help="higher starts first (-1000..1000; default 0)"),
    arg(
        "--queue-timeout",
        type=float,
        metavar="SECONDS",
        help="wait at most this long for capacity (the target's bound applies if smaller)",
    ),
    arg("prompt", help="the prompt (one argument; quote it)"),
)

EDGE_ARGS = (
    arg("--listen", default="127.0.0.1:8765", help="host:port (default %(default)s)"),
    arg("--edge-id", default="edge", help="the edge's name in HelloAck"),
    arg(
        "--identities",
        metavar="FILE",
        help="a token per caller and node (see docs/security.md; iop-node hash-token)",
    ),
    arg(
        "--token-file",
        metavar="FILE",
        help="one shared token, from a private file (or IOP_EDGE_TOKEN); never on the "
        "command line, where ps shows it",
    ),
    arg("--cert-file", metavar="FILE", help="serve wss:// with this certificate"),
    arg("--key-file", metavar="FILE", help="its private key (if not in --cert-file)"),
    arg("--client-ca-file", metavar="FILE", help="require client certificates from this CA"),
    arg(
        "--openai-listen",
        metavar="HOST:PORT",
        help="also serve an OpenAI-compatible API (POST /v1/chat/completions, GET /v1/models) "
        "there; its bearer tokens are the callers' (https with --cert-file, and client "
        "certificates with --client-ca-file, as on the WebSocket port)",
    ),
    arg(
        "--handshake-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a connection not authenticated within this is closed (default %(default)s)",
    ),
    arg(
        "--max-unproven-per-peer",
        type=int,
        default=32,
        metavar="N",
        help="connections from one address that may wait to authenticate at once "
        "(default %(default)s)",
    ),
    arg(
        "--max-connections",
        type=int,
        metavar="N",
        help="connections at once, both ports together (default: the open-file limit less 64)",
    ),
    # tracing (docs/operations.md "Tracing"): each flag not given falls back to its OTEL_*
    arg(
        "--otel-exporter",
        choices=TRACE_EXPORTERS,
        help="send the edge's spans: none, console (stdout) or otlp (OTLP/HTTP, the otlp "
        "extra); default: $OTEL_TRACES_EXPORTER, else none (tracing off)",
    ),
    arg(
        "--otel-endpoint",
        metavar="URL",
        help="the OTLP/HTTP collector's base URL (/v1/traces is added); default: "
        "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, $OTEL_EXPORTER_OTLP_ENDPOINT, else "
        "http://localhost:4318",
    ),
    arg(
        "--otel-service-name",
        metavar="NAME",
        help="the spans' service.name (default: $OTEL_SERVICE_NAME, else iop-edge)",
    ),
    arg(
        "--otel-sampler",
        choices=TRACE_SAMPLERS,
        help="which traces to keep (default: $OTEL_TRACES_SAMPLER, else "
        "parentbased_always_on: the caller's choice, else all)",
    ),
    arg(
        "--otel-sampler-arg",
        type=float,
        metavar="RATIO",
        help="the share the ratio samplers keep, 0 to 1 (default: $OTEL_TRACES_SAMPLER_ARG, "
        "else 1)",
    ),
)

DEMO_ARGS = (
    arg("--port", type=int, default=8765, help="the edge's port (0: any free one)"),
    arg(
        "--api-port",
        type=int,
        default=8080,
        help="the OpenAI-compatible API's port (0: any free one)",
    ),
    arg("--metrics-port", type=int, default=9464, help="the node's metrics port (0: any free one)"),
    arg(
        "--var",
        default="var",
        metavar="DIR",
        help="where the demo writes its config, token and run store (default: ./var)",
    ),
    arg("--once", action="store_true", help="exit after the demo run"),
)

#: Every command, in ``--help`` order.
COMMANDS = (
    Command("serve", "run the node until SIGTERM/SIGINT", (CONFIG,), _start_serve),
    Command(
        "check-config",
        "validate the config and print what it sets up",
        (
            CONFIG,
            arg(
                "--probe",
                action="store_true",
                help="also ask each engine whether it serves its target's model, and open a "
                "connection to the edge with the node's token (exit 1 if any cannot be "
                "reached)",
            ),
        ),
        _start_check_config,
    ),
    Command(
        "runs",
        "inspect or cancel runs in the node's store",
        subcommands=RUNS,
        dest="runs_command",
    ),
    Command(
        "usage",
        "prompt and completion tokens of the runs that ended, by tenant or target",
        USAGE_ARGS,
        _on_store(usage_command),
    ),
    Command("submit", "submit a run through an edge and stream it", SUBMIT_ARGS, _start_submit),
    Command(
        "edge",
        "run the reference edge: nodes dial ws(s)://HOST:PORT/node, clients /client",
        EDGE_ARGS,
        _start_edge,
    ),
    Command(
        "hash-token",
        "read a token on stdin, print the sha256:... an edge's identities file keeps",
        run=_start_hash_token,
    ),
    Command("demo", "edge + node + echo targets on loopback (make run)", DEMO_ARGS, _start_demo),
)


def build_parser() -> argparse.ArgumentParser:
    """``iop-node``'s parser, made from :data:`OPTIONS` and :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(prog="iop-node", description="An IOP inference node.")
    return _build(parser, OPTIONS, COMMANDS, dest="command")


def run_command(ns: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Run the command ``ns`` names; its failures are main's to say."""
    command = chosen(COMMANDS, ns, "command")
    assert command.run is not None
    return command.run(ns, out, err)
