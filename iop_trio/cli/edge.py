"""``iop-node edge`` (the reference edge) and ``iop-node hash-token`` (for its identities).

:func:`edge_command` turns the flags into an :class:`~iop_trio.edge.Edge`, checking
each in the order the flags are documented (the first bad one is the error, exit 2),
then serves it, and its OpenAI-compatible door if asked, until SIGTERM or SIGINT;
:func:`edge_process` is the whole process, with the tracing of the ``--otel-*`` flags
(:func:`edge_tracing`) installed around it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import ssl
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, TextIO

import trio

from ..config import TracingConfig, read_secret_file, split_listen
from ..telemetry import EDGE_SERVICE, TracingSettings, installed, resolve
from .errors import CliError

if TYPE_CHECKING:
    from ..edge import Edge
    from ..edge.identities import Identities
    from ..transport.guard import ConnectionBounds

log = logging.getLogger("iop_trio.node")


def edge_tracing(ns: argparse.Namespace, environ: Mapping[str, str]) -> TracingSettings:
    """The tracing of the ``--otel-*`` flags, each one not given from its OTEL_*
    variable in ``environ``, else off; a bad flag is a CliError naming it (exit 2), a
    bad variable a ConfigError naming it."""
    try:
        given = TracingConfig(
            exporter=ns.otel_exporter,
            endpoint=ns.otel_endpoint,
            service_name=ns.otel_service_name,
            sampler=ns.otel_sampler,
            sampler_arg=ns.otel_sampler_arg,
        )
    except ValueError as exc:  # the validator's "key: problem"
        key, _, problem = str(exc).partition(": ")
        raise CliError(f"--otel-{key.replace('_', '-')}: {problem}", code=2) from None
    return resolve(given, environ, service_name=EDGE_SERVICE)


def edge_process(ns: argparse.Namespace, out: TextIO) -> int:
    """``iop-node edge`` as a process: its tracing installed (nothing when off), the
    edge served until SIGTERM or SIGINT, then the tracer provider shut down, flushing
    its spans, however the edge ended."""
    with installed(edge_tracing(ns, os.environ)):
        return trio.run(edge_command, ns, out)


async def edge_command(ns: argparse.Namespace, out: TextIO) -> int:
    """The reference edge, until SIGTERM or SIGINT: nodes dial /node, clients /client."""
    from ..edge import Edge

    host, port = _listen_address(ns)
    identities, token = _who_may_use(ns)
    context = _tls_context(ns)
    door_address = None
    if ns.openai_listen is not None:
        try:
            door_address = split_listen(ns.openai_listen)
        except ValueError:
            raise CliError(
                f"--openai-listen must be host:port, not {ns.openai_listen!r}", code=2
            ) from None
    edge = Edge(
        token=token,
        identities=identities,
        ssl_context=context,
        edge_id=ns.edge_id,
        bounds=_bounds(ns),
    )
    if identities is None:
        log.warning(
            "edge: one shared token: whoever holds it may use every target, read, follow "
            "and cancel every run and pose as any node, and nothing bounds one caller's "
            "rate; give each caller and node a token of its own with --identities "
            "(docs/security.md)"
        )
    return await _serve_edge(edge, ns, (host, port), door_address, out)


def _listen_address(ns: argparse.Namespace) -> tuple[str, int]:
    """``--listen`` as (host, port); the edge is told its host (``:8765`` is refused)."""
    try:
        if ns.listen.startswith(":"):  # the edge is told its host; no default here
            raise ValueError(ns.listen)
        return split_listen(ns.listen)
    except ValueError:
        raise CliError(f"--listen must be host:port, not {ns.listen!r}", code=2) from None


def _who_may_use(ns: argparse.Namespace) -> tuple[Identities | None, str | None]:
    """``(identities, None)`` from ``--identities``, else ``(None, token)`` from
    ``--token-file`` or ``IOP_EDGE_TOKEN``; CliError (exit 2) when none says."""
    from ..edge.identities import Identities, IdentityError

    identities = token = None
    try:
        if ns.identities is not None:
            identities = Identities.load(ns.identities)
        elif ns.token_file is not None:
            token = read_secret_file(ns.token_file, "--token-file")
        else:
            token = os.environ.get("IOP_EDGE_TOKEN") or None
    except IdentityError as exc:
        raise CliError(str(exc), code=2) from None
    if identities is None and token is None:
        raise CliError(
            "the edge needs who may use it: --identities FILE (a token per caller and "
            "node), --token-file FILE or IOP_EDGE_TOKEN (one shared token)",
            code=2,
        )
    return identities, token


def _tls_context(ns: argparse.Namespace) -> ssl.SSLContext | None:
    """The server context of ``--cert-file`` (with its key and client CA), or None for
    plain ws://; the key file must be private, as ``read_secret_file`` checks."""
    from ..transport.tls import server_context

    if ns.cert_file is None and (ns.key_file or ns.client_ca_file):
        raise CliError("--key-file and --client-ca-file go with --cert-file (TLS)", code=2)
    if ns.cert_file is None:
        return None
    read_secret_file(ns.key_file or ns.cert_file, "--key-file" if ns.key_file else "--cert-file")
    try:
        return server_context(
            cert_file=ns.cert_file, key_file=ns.key_file, client_ca_file=ns.client_ca_file
        )
    except (OSError, ssl.SSLError) as exc:
        raise CliError(f"TLS files: {exc}", code=2) from None


def _bounds(ns: argparse.Namespace) -> ConnectionBounds:
    """The guard's bounds from the flags; a bad one is a CliError (exit 2)."""
    from ..transport.guard import ConnectionBounds

    try:
        return ConnectionBounds(
            max_connections=ns.max_connections,
            max_unproven_per_peer=ns.max_unproven_per_peer,
            handshake_timeout=ns.handshake_timeout,
        )
    except ValueError as exc:
        raise CliError(f"connection bounds: {exc}", code=2) from None


async def _serve_edge(
    edge: Edge,
    ns: argparse.Namespace,
    address: tuple[str, int],
    door_address: tuple[str, int] | None,
    out: TextIO,
) -> int:
    """Serve ``edge`` on ``address`` (and the door on ``door_address``) until the first
    SIGTERM or SIGINT; a port that cannot be bound is a CliError naming it."""
    from ..edge.front_door import serve_door

    refused: tuple[str, OSError] | None = None
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            listening = ns.listen
            try:
                await nursery.start(edge.serve, *address)
                out.write(f"edge listening on {edge.url} (nodes: {edge.node_url}, ")
                out.write(f"clients: {edge.client_url})\n")
                if door_address is not None:
                    listening = ns.openai_listen
                    door_port = await nursery.start(serve_door, edge, *door_address)
                    scheme = "http" if ns.cert_file is None else "https"
                    door_host = door_address[0]
                    shown = f"[{door_host}]" if ":" in door_host else door_host
                    out.write(f"OpenAI-compatible API on {scheme}://{shown}:{door_port}/v1\n")
            except OSError as exc:  # raised outside the nursery, so it is not a group
                refused = listening, exc
            else:
                out.flush()
                async for _ in signals:
                    log.info("edge: stopping")
                    break
            nursery.cancel_scope.cancel()
    if refused is not None:
        where, error = refused
        raise CliError(f"cannot listen on {where}: {error.strerror or error}")
    return 0


def hash_token(out: TextIO) -> int:
    """Read a token on stdin and print the ``sha256:...`` an identities file keeps;
    CliError (exit 2) when stdin has none."""
    from ..edge.identities import token_digest

    token = sys.stdin.readline().strip()
    if not token:
        raise CliError("no token on stdin", code=2)
    out.write(token_digest(token) + "\n")
    return 0
