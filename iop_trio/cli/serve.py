"""``iop-node serve``: the node's composition root, and its drain on a signal.

:func:`serve` wires a config into running pieces in the shape of hypercorn's
``worker_serve``: the store (locked) outermost, then the node and the ops endpoints (so
``/healthz`` says "draining" through a drain), then the edge link and the pruner; it
reports what it bound with ``task_status.started`` and waits for a signal to drain.
:func:`serve_process` is the whole process: tracing installed around :func:`serve`.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING

import attrs
import trio

from .. import __version__
from ..config import NodeConfig
from ..metrics import NodeMetrics
from ..model import RunEvent, RunRecord
from ..ops import OpsApp, serve_ops
from ..runtime import Node
from ..store import RunStore
from ..telemetry import NODE_SERVICE, installed, resolve
from .errors import CliError
from .store_lock import StoreLock, check_store_writable, open_store, store_note

if TYPE_CHECKING:
    from ..transport import NodeLink

log = logging.getLogger("iop_trio.node")


@attrs.frozen
class Serving:
    """What :func:`serve` reports once it serves: its node, and the ops endpoint's
    ``(host, port)`` as bound (the port is the real one when the config asked for 0),
    or None when ``metrics.listen`` is empty."""

    node: Node
    ops_address: tuple[str, int] | None

    def __repr__(self) -> str:
        ops = "no ops" if self.ops_address is None else "ops {}:{}".format(*self.ops_address)
        return f"<Serving node {self.node.node_id!r}, {ops}>"


def log_run_end(event: RunEvent, record: RunRecord) -> None:
    """Log one line when ``event`` ends the run of ``record``; nothing for any other."""
    if not event.kind.terminal:
        return
    started = record.started if record.started is not None else record.created
    log.info(
        "run %s %s",
        record.run_id,
        event.kind.value,
        extra={
            "run_id": record.run_id,
            "target": record.target,
            "status": event.kind.value,
            "reason": event.reason,
            "background": record.background,
            "queued_s": round(started - record.created, 3),
            "run_s": round(event.time - started, 3) if record.started is not None else 0.0,
        },
    )


async def prune_loop(store: RunStore, config: NodeConfig) -> None:
    """Every ``store.prune_interval``, drop runs that finished ``store.retention_days``
    ago; returns at once when retention is 0 (keep them all)."""
    days = config.store.retention_days
    if days <= 0:
        return
    while True:
        removed = await store.prune(finished_before=time.time() - days * 86400)
        if removed:
            log.info("pruned %d runs older than %g days", removed, days, extra={"pruned": removed})
        await trio.sleep(config.store.prune_interval)


def serve_process(config: NodeConfig, environ: Mapping[str, str] | None = None) -> int:
    """``iop-node serve`` as a process: tracing installed from ``tracing:`` and the
    OTEL_* variables of ``environ`` (``os.environ``; nothing when off), :func:`serve`
    until a signal has drained the node, then the tracer provider shut down, flushing
    its spans, however serve ended. A bad OTEL_* value is a ConfigError, before
    anything starts."""
    settings = resolve(
        config.tracing, os.environ if environ is None else environ, service_name=NODE_SERVICE
    )
    with installed(settings, node_id=config.node_id):
        return trio.run(serve, config)


async def serve(
    config: NodeConfig,
    *,
    stop: trio.Event | None = None,
    task_status: trio.TaskStatus[Serving] = trio.TASK_STATUS_IGNORED,
) -> int:
    """Run the node of ``config`` until SIGTERM/SIGINT (or ``stop``), then drain; returns
    the exit code.

    The first signal stops admission, cancels queued runs, gives running ones
    ``runtime.drain_timeout`` seconds and cancels the rest (status recorded);
    a second signal cancels everything at once.
    """
    check_store_writable(config)
    lock = StoreLock(config.store.path) if config.store.kind == "sqlite" else None
    if lock is not None:
        lock.acquire()
    store = open_store(config)
    try:
        node = Node(
            node_id=config.node_id,
            adapters=config.build_adapters(),
            targets=config.target_specs(),
            limits=config.limits(),
            store=store,
        )
        node.event_listeners.append(log_run_end)
        metrics = NodeMetrics(node)
        metrics.attach()
        await _run_node(config, node, metrics, lock, stop, task_status)
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()
        if lock is not None:
            lock.release()
    log.info("node %s stopped", config.node_id)
    return 0


async def _run_node(
    config: NodeConfig,
    node: Node,
    metrics: NodeMetrics,
    lock: StoreLock | None,
    stop: trio.Event | None,
    task_status: trio.TaskStatus[Serving],
) -> None:
    """The node running, its ops endpoints in the outer nursery (they outlive the rest),
    the edge link and the pruner in the inner one, until a signal has drained it."""
    ops_stop = trio.Event()
    async with node.running(), trio.open_nursery() as ops:
        ops_address = await _start_ops(ops, config, node, metrics, ops_stop)
        if lock is not None:  # the store is open: which file it is, for the runs commands
            notes = [] if ops_address is None else ["http://{}:{}".format(*ops_address)]
            lock.note(*notes, store_note(config.store.path))
        async with trio.open_nursery() as nursery:
            link = _start_link(nursery, config, node, metrics)
            nursery.start_soon(prune_loop, node.store, config)

            def serving() -> None:  # once a signal drains: "serving" means SIGTERM is safe
                log.info(
                    "node %s serving %s",
                    config.node_id,
                    ", ".join(node.targets),
                    extra={"node_id": config.node_id, "version": __version__},
                )
                task_status.started(Serving(node, ops_address))

            await wait_and_drain(node, config.runtime.drain_timeout, stop, ready=serving)
            if link is not None:
                await link.aclose("node stopping")
            nursery.cancel_scope.cancel()
        ops_stop.set()


async def _start_ops(
    nursery: trio.Nursery,
    config: NodeConfig,
    node: Node,
    metrics: NodeMetrics,
    shutdown: trio.Event,
) -> tuple[str, int] | None:
    """Serve ``/metrics``, ``/healthz``, ``/readyz`` and ``/runs`` in ``nursery`` until
    ``shutdown``; the address bound, or None when ``metrics.listen`` is empty. A port
    that cannot be bound is a CliError naming it."""
    if config.metrics.address is None:
        return None
    host, port = config.metrics.address
    app = OpsApp(node, metrics, token=config.ops_token(), open_metrics=config.metrics.open_metrics)
    try:
        bound = await nursery.start(partial(serve_ops, app, host, port, shutdown=shutdown))
    except OSError as exc:
        raise CliError(
            f"cannot listen on {host}:{port} (metrics.listen): {exc.strerror or exc}"
        ) from None
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return host, bound


def _start_link(
    nursery: trio.Nursery, config: NodeConfig, node: Node, metrics: NodeMetrics
) -> NodeLink | None:
    """Dial the edge (and redial it, backing off) in ``nursery``; None without
    ``edge.url``."""
    from ..transport import Backoff, NodeLink, SessionSettings

    if not config.edge.url:
        return None
    link = NodeLink(
        node,
        config.edge.url,
        token=config.edge_token(),
        settings=SessionSettings(
            ping_interval=config.edge.ping_interval,
            ping_timeout=config.edge.ping_timeout,
            max_message_size=config.edge.max_message_size,
        ),
        backoff=Backoff(initial=config.edge.backoff_initial, maximum=config.edge.backoff_max),
        ssl_context=config.edge_ssl_context(),
    )
    metrics.watch_link(link)
    nursery.start_soon(link.run)
    return link


async def wait_and_drain(
    node: Node,
    grace: float,
    stop: trio.Event | None = None,
    *,
    ready: Callable[[], None] | None = None,
) -> None:
    """Wait for SIGTERM or SIGINT (or ``stop``), then drain ``node``; a second signal
    cancels every run at once. ``ready`` is called once the signals are caught, so a
    signal sent after it drains rather than kills the process."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        if ready is not None:
            ready()
        why = "stop"
        async with trio.open_nursery() as waiting:

            async def on_signal() -> None:
                nonlocal why
                why = signal.Signals(await signals.__anext__()).name
                waiting.cancel_scope.cancel()

            waiting.start_soon(on_signal)
            if stop is not None:
                await stop.wait()
                waiting.cancel_scope.cancel()
        log.warning(
            "%s: draining (running runs get %gs; a second signal cancels them now)",
            why,
            grace,
        )
        async with trio.open_nursery() as nursery:

            async def second_signal() -> None:
                await signals.__anext__()
                log.warning("second signal: cancelling every run now")
                node.manager.cancel_all("node_shutdown")

            nursery.start_soon(second_signal)
            cancelled = await node.manager.drain(grace)
            nursery.cancel_scope.cancel()
    log.info("drained; %d runs were cancelled", cancelled, extra={"cancelled": cancelled})
