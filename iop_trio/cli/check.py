"""``iop-node check-config``: build what a config describes, say it, and probe it.

:func:`check_config` builds the node (starting nothing) and summarises it with
:func:`config_warnings`; with ``--probe``, :func:`probe_reach` asks each engine whether
it serves its model and the edge whether it takes the node's token, and
:func:`probe_signals` says which signal each ``concurrency: auto`` pool will learn from.
"""

from __future__ import annotations

import math
import os
from typing import TextIO
from urllib.parse import urlsplit

import trio

from ..adapters import AdapterError
from ..config import NodeConfig, is_loopback
from ..model import Limits, redact_url
from ..runtime import Node
from ..telemetry import NODE_SERVICE, resolve
from .submit import submit_failure

#: Seconds ``check-config --probe`` waits for the edge's WebSocket to open.
PROBE_CONNECT_TIMEOUT = 5.0


def check_config(config: NodeConfig, out: TextIO, *, probe: bool = False) -> int:
    """Build everything the config describes (nothing is started) and summarise it,
    tracing as ``serve`` would resolve it (with the OTEL_* variables).

    With ``probe``, also ask each engine (each replica) which models it serves and open
    a WebSocket to the edge with the node's token; 1 if any target, replica or the edge
    cannot be reached.
    """
    from ..store.memory import MemoryStore

    node = Node(
        node_id=config.node_id,
        adapters=config.build_adapters(),
        targets=config.target_specs(),
        limits=config.limits(),
        store=MemoryStore(),  # the configured store is not opened
    )
    config.edge_token()
    config.edge_ssl_context()  # its key file's mode, as serve checks it
    config.ops_token()
    tracing = resolve(config.tracing, os.environ, service_name=NODE_SERVICE)
    limits = node.limits()
    out.write(f"{config.source}: ok\n")
    out.write(f"  node {config.node_id}, edge {redact_url(config.edge.url) or '(none)'}\n")
    where = config.store.path if config.store.kind == "sqlite" else "(in memory)"
    out.write(f"  store {config.store.kind} {where}\n")
    out.write(f"  tracing {tracing.describe()}\n")
    out.write(
        f"  runtime concurrency={limits.concurrency} max_queued={limits.max_queued} "
        f"queue_timeout={limits.queue_timeout:g}s\n"
    )
    for name, adapter in node.adapters.items():
        bound = limits.adapters[name]
        limit = learned_pool(node, f"adapter:{name}") or ("-" if bound is None else str(bound))
        replicas = node.gate.scheduler.replica_sets.get(name)
        routing = "" if replicas is None else f" routing={replicas.routing}"
        out.write(f"  adapter {name} ({adapter.kind}) limit={limit}{routing}\n")
        for replica in () if replicas is None else replicas.replicas:
            own = replica.pool.limit
            shown = learned_pool(node, replica.pool.name) or (
                "-" if own == math.inf else f"{own:g}"
            )
            out.write(f"    replica {replica.name} weight={replica.weight:g} limit={shown}\n")
    for name in node.targets:
        limit = learned_pool(node, f"target:{name}") or str(limits.targets[name])
        out.write(f"  target {name} limit={limit}\n")
    for warning in config_warnings(config, limits):
        out.write(f"  warning: {warning}\n")
    if probe:
        return 0 if trio.run(probe_reach, config, node, out) else 1
    return 0


async def probe_reach(config: NodeConfig, node: Node, out: TextIO) -> bool:
    """Whether every target's engine serves its model and the edge takes the node's
    token; one line each on ``out``."""
    from ..transport.tls import open_websocket

    reached = True
    try:
        unavailable = await node.probe_engines()
        await probe_signals(node, out)
    finally:
        for adapter in node.adapters.values():
            await adapter.aclose()
    for owner, engines in node.replicas.items():
        for replica in engines:
            down = node.replica_health.down.get((owner, replica))
            reached &= down is None
            said = "reachable" if down is None else f"DOWN: {down}"
            out.write(f"  probe adapter {owner} replica {replica}: {said}\n")
    for name, target in node.targets.items():
        why = unavailable.get(name)
        reached &= why is None
        said = f"serves {target.model!r}" if why is None else f"UNAVAILABLE: {why}"
        out.write(f"  probe target {name}: {said}\n")
    if config.edge.url:
        url = redact_url(config.edge.url)
        try:
            async with open_websocket(
                config.edge.url,
                token=config.edge_token(),
                ssl_context=config.edge_ssl_context(),
                max_message_size=config.edge.max_message_size,
                connect_timeout=PROBE_CONNECT_TIMEOUT,
            ) as ws:
                await ws.aclose()
            out.write(f"  probe edge {url}: reachable, the token is accepted\n")
        except Exception as exc:
            failure = submit_failure(exc, url)
            if failure is exc:
                raise
            reached = False
            out.write(f"  probe edge: UNREACHABLE: {failure}\n")
    return reached


def learned_pool(node: Node, pool: str) -> str | None:
    """``auto MIN..MAX`` and the signal the pool will learn from; None if it is static."""
    if pool not in node.auto:
        return None
    auto, _ = node.auto[pool]
    url = node.adapter_of_pool(pool).signals_url
    signal = "latency" if url is None else f"engine metrics at {url}, else latency"
    return f"auto {auto.minimum}..{auto.maximum} (signal: {signal})"


async def probe_signals(node: Node, out: TextIO) -> None:
    """For each ``concurrency: auto`` pool, read its engine's metrics once, as the
    learner does when the node starts, and say which signal it will learn from."""
    for pool in node.auto:
        adapter = node.adapter_of_pool(pool)
        try:
            signals = await adapter.engine_signals(trio.current_time())
        except AdapterError as exc:
            said = (
                f"engine (its metrics cannot be read now: {exc.message}; "
                "counted as saturated until they can)"
            )
        else:
            if signals is None:
                said = "latency (the engine exposes no signals of its load)"
            else:
                said = f"engine ({signals.waiting:g} waiting"
                if signals.kv_usage is not None:
                    said += f", KV cache {signals.kv_usage:.0%} used"
                said += ")"
        out.write(f"  probe {pool.replace(':', ' ', 1)} learns from {said}\n")


def config_warnings(config: NodeConfig, limits: Limits) -> list[str]:
    """Settings that are legal but probably not what the operator meant."""
    warnings = [
        f"target {name} has concurrency 0: it takes no runs until its limit is raised"
        for name, limit in limits.targets.items()
        if limit == 0
    ]
    if limits.queue_timeout == 0:
        warnings.append("runtime.queue_timeout is 0: a run that finds no room is rejected at once")
    edge_host = urlsplit(config.edge.url).hostname or ""
    if config.edge.url.startswith("ws://") and not is_loopback(edge_host):
        warnings.append(
            f"edge.url {redact_url(config.edge.url)} is not TLS and not on loopback: the token "
            "and every prompt cross the network in the clear (use wss://)"
        )
    for name, target in zip(limits.targets, config.targets, strict=True):
        if isinstance(target.concurrency, int) and target.concurrency > limits.concurrency:
            warnings.append(
                f"target {name} allows {target.concurrency} runs at once, more than the node's "
                f"runtime.concurrency {limits.concurrency}"
            )
    return warnings
