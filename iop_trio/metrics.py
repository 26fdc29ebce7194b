"""Prometheus metrics of a node, and the HTTP routes that expose them.

::

    metrics = NodeMetrics(node)
    metrics.attach()                       # before the node runs, so no run is missed
    async with node.running(), trio.open_nursery() as nursery:
        await nursery.start(serve_ops, OpsApp(node, metrics), "127.0.0.1", 9464)

(:mod:`iop_trio.ops` serves ``/metrics`` with prometheus_client's ASGI app.)

Two kinds of metric (the table of names is :data:`METRICS`):

- Gauges read from the gate at scrape time (``iop_gate_*``, ``iop_node_*``):
  queued and running runs per target, limit and borrowed tokens per level,
  the queue's length and bound. Nothing is kept between scrapes.
- Counters and histograms fed by the run manager's events (``iop_runs_*``,
  ``iop_run_*``). Durations are differences of event times
  (:attr:`RunEvent.time`, wall clock), clamped at 0 should the clock step
  back.

Queue wait (``iop_run_queue_wait_seconds``) is observed for every run that
leaves the queue, with ``outcome`` saying how: ``started`` (QUEUED ->
STARTED), ``rejected`` (QUEUED -> REJECTED: about 0 for ``queue_full``, about
the queue timeout for ``queue_timeout``) or ``cancelled`` (QUEUED ->
CANCELLED: the caller or the node gave up waiting). Counting only started
runs would hide the waits that were too long to end well.

Per-tenant series carry the tenant's name for the tenants whose share is set
and for the default tenant (""); every other tenant counts as ``other``, so a
caller cannot grow the number of series. ``priority`` is a class: ``high``
(> 0), ``normal`` (0), ``low`` (< 0).

A run's tokens are counted once, from its settled usage, when its terminal event
comes (it is stored by then, or given up on): ``iop_tenant_tokens_total`` all of
them, the engine's counts and the node's estimates alike, so its sum over a window
is what ``iop-node usage`` totals from the store; ``iop_run_tokens_total`` only
what the engine reported. A run found running when the node starts is counted as
it is interrupted (the node tells its listeners).

Per-run state is kept only for live runs (QUEUED or RUNNING) and dropped at
the terminal event; :attr:`NodeMetrics.tracked_runs` counts it. Should a
terminal event never come (a bug elsewhere), ``max_tracked_runs`` bounds the
state: the oldest entry is dropped, with a warning. A listener attached
while runs are live has no state for them: their counters still count from
then on, but their durations are not observed.

Everything here runs in the Trio thread: :meth:`NodeMetrics.render` reads the
gate without locks, so do not call it from another thread.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import RestrictedRegistry

from .model import EventKind, RejectReason, RunEvent, RunRecord, RunStatus, Usage
from .runtime import Node
from .runtime.gate import LimiterStats

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The content type of :meth:`NodeMetrics.render`: the Prometheus text format 0.0.4.

Spelled out rather than prometheus_client's ``CONTENT_TYPE_LATEST``, which
names format 1.0.0 in recent versions (0.0.4 in older ones): every metric
name here is a classic one, so the output is valid 0.0.4, and every
Prometheus version reads that.
"""

# Bucket upper bounds, in seconds (+Inf is added by the client library).
QUEUE_WAIT_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300,
)  # fmt: skip
"""Queue wait: ~0 when there is room; up to the queue timeout (30 s by default) and past it."""

RUN_DURATION_BUCKETS: tuple[float, ...] = (
    0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800,
)  # fmt: skip
"""Run duration: short completions (sub-second) to long generations (tens of minutes)."""

FIRST_DELTA_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 30, 60,
)  # fmt: skip
"""Time to first delta: prompt processing, fine-grained around 0.1-2 s, and model loads."""

Listener = Callable[[RunEvent, RunRecord], None]

_OUTCOME_OF_STATUS: Mapping[RunStatus, str] = {
    RunStatus.RUNNING: "started",
    RunStatus.REJECTED: "rejected",
    RunStatus.CANCELLED: "cancelled",
}
_FINISHED_STATUSES = (
    RunStatus.SUCCEEDED,
    RunStatus.FAILED,
    RunStatus.CANCELLED,
    RunStatus.REJECTED,
)


@attrs.frozen
class MetricInfo:
    """One row of the metric table: name as exposed, type, labels, meaning."""

    name: str
    type: str
    labels: tuple[str, ...]
    help: str


METRICS: tuple[MetricInfo, ...] = (
    MetricInfo("iop_runs_submitted_total", "counter", ("target",), "Runs created (QUEUED)."),
    MetricInfo(
        "iop_runs_finished_total",
        "counter",
        ("target", "status"),
        "Runs ended, by terminal status (succeeded, failed, cancelled, rejected).",
    ),
    MetricInfo(
        "iop_runs_rejected_total",
        "counter",
        ("target", "reason"),
        "Runs rejected by the gate, by reason (queue_full, queue_timeout).",
    ),
    MetricInfo(
        "iop_runs_failed_total",
        "counter",
        ("target", "reason"),
        "Runs ended FAILED, by reason (connection, timeout, engine_error, engine_busy, "
        "engine_unavailable, model_not_found, bad_response, empty_response, run_timeout, "
        "output_limit, store_unavailable, ...).",
    ),
    MetricInfo(
        "iop_run_deltas_total",
        "counter",
        ("target",),
        "Output delta events stored and sent (one joins what the engine sent while the run "
        "was busy: not a token count).",
    ),
    MetricInfo(
        "iop_run_tokens_total",
        "counter",
        ("target", "kind"),
        "Tokens the engine reported at a run's end (kind prompt or completion); the "
        "node's own estimates, where it reported none, are not counted here.",
    ),
    MetricInfo(
        "iop_run_queue_wait_seconds",
        "histogram",
        ("target", "outcome"),
        "Time from QUEUED until the run left the queue; outcome started, rejected or cancelled.",
    ),
    MetricInfo(
        "iop_run_duration_seconds",
        "histogram",
        ("target", "status"),
        "Time from STARTED to the terminal event (runs that started only).",
    ),
    MetricInfo(
        "iop_run_time_to_first_delta_seconds",
        "histogram",
        ("target",),
        "Time from STARTED to the first delta.",
    ),
    MetricInfo(
        "iop_tenant_runs_finished_total",
        "counter",
        ("tenant", "priority", "status"),
        "Runs ended, by tenant, priority class (high > 0, normal 0, low < 0) and status.",
    ),
    MetricInfo(
        "iop_tenant_queue_wait_seconds",
        "histogram",
        ("tenant", "priority", "outcome"),
        "Time from QUEUED until the run left the queue, by tenant and priority class.",
    ),
    MetricInfo(
        "iop_tenant_tokens_total",
        "counter",
        ("tenant", "kind"),
        "Tokens settled at the end of each run that started, by tenant (kind input: the "
        "prompt, output: the completion); the engine's counts, else the node's estimates.",
    ),
    MetricInfo(
        "iop_gate_queued_runs", "gauge", ("target",), "Runs waiting in the gate's queue now."
    ),
    MetricInfo("iop_gate_tenant_queued_runs", "gauge", ("tenant",), "Runs waiting now, by tenant."),
    MetricInfo(
        "iop_gate_tenant_running_runs", "gauge", ("tenant",), "Runs holding a permit, by tenant."
    ),
    MetricInfo(
        "iop_gate_priority_queued_runs",
        "gauge",
        ("priority",),
        "Runs waiting now, by priority class (high > 0, normal 0, low < 0).",
    ),
    MetricInfo(
        "iop_gate_priority_running_runs",
        "gauge",
        ("priority",),
        "Runs holding a permit now, by priority class.",
    ),
    MetricInfo(
        "iop_gate_tenant_weight",
        "gauge",
        ("tenant",),
        "The fair-queueing weight of each tenant whose share is set.",
    ),
    MetricInfo(
        "iop_gate_running_runs",
        "gauge",
        ("target",),
        "Runs holding a permit now (the target's borrowed tokens).",
    ),
    MetricInfo(
        "iop_gate_permits_limit",
        "gauge",
        ("level", "name"),
        "Concurrency permits per level (global/adapter/target/tenant); +Inf = unbounded.",
    ),
    MetricInfo(
        "iop_gate_permits_in_use",
        "gauge",
        ("level", "name"),
        "Permits held now per level (global/adapter/target/tenant): runs holding one.",
    ),
    MetricInfo(
        "iop_gate_token_budget",
        "gauge",
        ("level", "name"),
        "Tokens the runs may reserve at once per level (configured or learned); levels "
        "with no budget are left out.",
    ),
    MetricInfo(
        "iop_gate_tokens_reserved",
        "gauge",
        ("level", "name"),
        "Tokens reserved now per level (prompt + most output of the runs holding a permit).",
    ),
    MetricInfo(
        "iop_gate_limit_adjustments_total",
        "counter",
        ("pool", "reason"),
        "Moves of a learned concurrency (concurrency: auto), by pool and why.",
    ),
    MetricInfo(
        "iop_gate_learned_signal",
        "gauge",
        ("pool", "signal"),
        "1 for the signal a learned concurrency uses: engine (its metrics) or latency.",
    ),
    MetricInfo("iop_gate_queue_length", "gauge", (), "Runs waiting in the gate, all targets."),
    MetricInfo(
        "iop_gate_queue_max",
        "gauge",
        (),
        "Node-wide bound on waiting runs (max_queued); more are rejected queue_full.",
    ),
    MetricInfo(
        "iop_gate_queue_timeout_seconds",
        "gauge",
        (),
        "Node-wide queue timeout for runs that arrive now.",
    ),
    MetricInfo(
        "iop_node_admitting",
        "gauge",
        (),
        "1 while the node runs and admits runs; 0 while draining or stopped.",
    ),
    MetricInfo(
        "iop_node_live_runs", "gauge", (), "Runs the run manager holds (QUEUED or RUNNING)."
    ),
    MetricInfo(
        "iop_node_info", "gauge", ("node_id", "version"), "Always 1; the labels describe the node."
    ),
    MetricInfo(
        "iop_edge_link_up",
        "gauge",
        (),
        "1 while the node's link to its edge is up (HelloAck received); 0 while it is down.",
    ),
    MetricInfo(
        "iop_edge_link_sessions_total",
        "counter",
        (),
        "Sessions with the edge that came up (each reconnect adds one).",
    ),
    MetricInfo(
        "iop_edge_link_attempts_total",
        "counter",
        (),
        "Attempts to connect to the edge, successful or not.",
    ),
    MetricInfo(
        "iop_target_available",
        "gauge",
        ("target",),
        "1 while the target's engine answered the last probe, serves its model and answers "
        "its runs in time; 0 while it does not (runtime.probe_interval; always 1 without "
        "probes).",
    ),
    MetricInfo(
        "iop_store_writable",
        "gauge",
        (),
        "1 while the run store's writes go through; 0 while they fail (disk full, I/O error) "
        "or it may not be written (its file or folder read-only, its file deleted or "
        "replaced: for good, see the log).",
    ),
)
#: What prometheus_client's ProcessCollector adds (Linux), so a node's CPU, memory and
#: open files can be watched without another exporter.
PROCESS_METRICS: tuple[MetricInfo, ...] = (
    MetricInfo("process_cpu_seconds_total", "counter", (), "CPU time of the node's process."),
    MetricInfo("process_resident_memory_bytes", "gauge", (), "Its resident memory."),
    MetricInfo("process_virtual_memory_bytes", "gauge", (), "Its virtual memory."),
    MetricInfo("process_start_time_seconds", "gauge", (), "When it started (unix time)."),
    MetricInfo("process_open_fds", "gauge", (), "File descriptors it has open."),
    MetricInfo("process_max_fds", "gauge", (), "The most it may have open."),
)
_HELP = {m.name: m.help for m in METRICS}


def _help(name: str) -> str:
    return _HELP[name]


#: The label of the tenants whose share is not set (see the module docstring).
OTHER_TENANT = "other"


def priority_class(priority: int) -> str:
    return "high" if priority > 0 else "low" if priority < 0 else "normal"


def _tenant_label(node: Node, tenant: str) -> str:
    return tenant if tenant == "" or node.gate.is_set(tenant) else OTHER_TENANT


@attrs.define(eq=False, repr=False)
class _RunTimes:
    """What the metrics keep about one live run."""

    target: str
    queued: float
    deltas: Counter  # the target's child of iop_run_deltas_total, looked up once
    tenant: str  # its label
    priority: str  # its class
    started: float | None = None
    first_delta: bool = False


class _GateCollector:
    """Reads the gate (and the manager, if running) at each scrape."""

    def __init__(self, node: Node) -> None:
        self._node = node
        self.link: Any = None  # a NodeLink, once the node has one (NodeMetrics.watch_link)

    def describe(self) -> Iterable[Metric]:
        return [*self._families().values(), *self._link_families(), self._adjustments()]

    def _adjustments(self) -> CounterMetricFamily:
        """The moves of each learned concurrency, by why (counted by its learner)."""
        family = CounterMetricFamily(
            "iop_gate_limit_adjustments",
            _help("iop_gate_limit_adjustments_total"),
            labels=["pool", "reason"],
        )
        for pool, learner in self._node.learners.items():
            if learner.learned is not None:
                for reason, count in learner.learned.moves.items():
                    family.add_metric([pool, reason], count)
        return family

    def _link_families(self) -> list[Metric]:
        if self.link is None:
            return []
        link = self.link
        up = GaugeMetricFamily("iop_edge_link_up", _help("iop_edge_link_up"))
        up.add_metric([], int(link.session is not None))
        sessions = CounterMetricFamily(
            "iop_edge_link_sessions", _help("iop_edge_link_sessions_total")
        )
        sessions.add_metric([], link.sessions)
        attempts = CounterMetricFamily(
            "iop_edge_link_attempts", _help("iop_edge_link_attempts_total")
        )
        attempts.add_metric([], link.attempts)
        return [up, sessions, attempts]

    def collect(self) -> Iterable[Metric]:
        node = self._node
        stats = node.gate.statistics()
        g = self._families()
        for target, count in stats.queued_by_target.items():
            g["iop_gate_queued_runs"].add_metric([target], count)
        for target, tokens in stats.targets.items():
            g["iop_gate_running_runs"].add_metric([target], tokens.borrowed)
        configured = node.gate.tenants()
        queued: dict[str, int] = {"": 0, OTHER_TENANT: 0, **dict.fromkeys(configured, 0)}
        running = dict(queued)
        for tenant, count in stats.queued_by_tenant.items():
            label = _tenant_label(node, tenant)
            queued[label] = queued.get(label, 0) + count
        for tenant, tokens in stats.tenants.items():
            label = _tenant_label(node, tenant)
            running[label] = running.get(label, 0) + tokens.borrowed
        for label, count in queued.items():
            g["iop_gate_tenant_queued_runs"].add_metric([label], count)
        for label, count in running.items():
            g["iop_gate_tenant_running_runs"].add_metric([label], count)
        for tenant, share in configured.items():
            g["iop_gate_tenant_weight"].add_metric([tenant], share.weight)
        for name, by_priority in (
            ("iop_gate_priority_queued_runs", stats.queued_by_priority),
            ("iop_gate_priority_running_runs", stats.running_by_priority),
        ):
            classes = dict.fromkeys(("high", "normal", "low"), 0)
            for priority, count in by_priority.items():
                classes[priority_class(priority)] += count
            for label, count in classes.items():
                g[name].add_metric([label], count)
        levels: list[tuple[str, Mapping[str, LimiterStats]]] = [
            ("global", {"global": stats.global_}),
            ("adapter", stats.adapters),
            ("target", stats.targets),
            ("tenant", {n: t for n, t in stats.tenants.items() if n in configured}),
        ]
        for level, by_name in levels:
            for name, tokens in by_name.items():
                g["iop_gate_permits_limit"].add_metric([level, name], float(tokens.limit))
                g["iop_gate_permits_in_use"].add_metric([level, name], tokens.borrowed)
                if tokens.budget != math.inf or tokens.reserved:
                    g["iop_gate_token_budget"].add_metric([level, name], float(tokens.budget))
                    g["iop_gate_tokens_reserved"].add_metric([level, name], tokens.reserved)
        for pool, learner in node.learners.items():
            learned = learner.learned
            if learned is None:
                continue
            g["iop_gate_learned_signal"].add_metric([pool, learned.signal], 1)

        g["iop_gate_queue_length"].add_metric([], stats.queued)
        g["iop_gate_queue_max"].add_metric([], stats.max_queued)
        g["iop_gate_queue_timeout_seconds"].add_metric([], stats.queue_timeout)
        try:
            manager = node.manager
        except RuntimeError:  # not running
            admitting, live = 0, 0
        else:
            admitting, live = int(manager.admitting), manager.live_count()
        g["iop_node_admitting"].add_metric([], admitting)
        g["iop_node_live_runs"].add_metric([], live)
        g["iop_node_info"].add_metric([node.node_id, node.version], 1)
        g["iop_store_writable"].add_metric([], int(node.store.health().writable))
        for target in node.targets:
            g["iop_target_available"].add_metric([target], int(target not in node.unavailable))
        return [*g.values(), *self._link_families(), self._adjustments()]

    @staticmethod
    def _families() -> dict[str, GaugeMetricFamily]:
        return {
            m.name: GaugeMetricFamily(m.name, m.help, labels=list(m.labels))
            for m in METRICS
            if m.type == "gauge" and not m.name.startswith("iop_edge_link")
        }


class _WithoutCreated:
    """A view of a registry without the ``<name>_created`` samples."""

    def __init__(self, registry: CollectorRegistry | RestrictedRegistry) -> None:
        self._registry = registry

    def restricted_registry(self, names: Iterable[str]) -> _WithoutCreated:
        """The same view of only the metrics ``names`` (``/metrics?name[]=...``)."""
        assert isinstance(self._registry, CollectorRegistry)
        return _WithoutCreated(self._registry.restricted_registry(names))

    def collect(self) -> Iterable[Metric]:
        for metric in self._registry.collect():
            created = f"{metric.name}_created"
            metric.samples = [s for s in metric.samples if s.name != created]
            yield metric


class NodeMetrics:
    """The Prometheus metrics of ``node``, in ``registry`` (a new, private one by default).

    Call :meth:`attach` so that the run events reach it; the gauges work
    without. Two NodeMetrics cannot share a registry (their names clash:
    ValueError from prometheus_client).
    """

    def __init__(
        self,
        node: Node,
        *,
        registry: CollectorRegistry | None = None,
        max_tracked_runs: int = 100_000,
    ) -> None:
        self.node = node
        self.registry = registry if registry is not None else CollectorRegistry()
        self.max_tracked_runs = max_tracked_runs
        self._runs: dict[str, _RunTimes] = {}
        self._listener: Listener = self.on_event
        self._attached_to: list[list[Listener]] = []
        r = self.registry
        self.submitted = Counter(
            "iop_runs_submitted", _help("iop_runs_submitted_total"), ["target"], registry=r
        )
        self.finished = Counter(
            "iop_runs_finished",
            _help("iop_runs_finished_total"),
            ["target", "status"],
            registry=r,
        )
        self.rejected = Counter(
            "iop_runs_rejected",
            _help("iop_runs_rejected_total"),
            ["target", "reason"],
            registry=r,
        )
        self.failed = Counter(
            "iop_runs_failed",
            _help("iop_runs_failed_total"),
            ["target", "reason"],
            registry=r,
        )
        self.deltas = Counter(
            "iop_run_deltas", _help("iop_run_deltas_total"), ["target"], registry=r
        )
        self.tokens = Counter(
            "iop_run_tokens", _help("iop_run_tokens_total"), ["target", "kind"], registry=r
        )
        self.queue_wait = Histogram(
            "iop_run_queue_wait_seconds",
            _help("iop_run_queue_wait_seconds"),
            ["target", "outcome"],
            buckets=QUEUE_WAIT_BUCKETS,
            registry=r,
        )
        self.run_duration = Histogram(
            "iop_run_duration_seconds",
            _help("iop_run_duration_seconds"),
            ["target", "status"],
            buckets=RUN_DURATION_BUCKETS,
            registry=r,
        )
        self.tenant_finished = Counter(
            "iop_tenant_runs_finished",
            _help("iop_tenant_runs_finished_total"),
            ["tenant", "priority", "status"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "iop_tenant_tokens",
            _help("iop_tenant_tokens_total"),
            ["tenant", "kind"],
            registry=r,
        )
        self.tenant_queue_wait = Histogram(
            "iop_tenant_queue_wait_seconds",
            _help("iop_tenant_queue_wait_seconds"),
            ["tenant", "priority", "outcome"],
            buckets=QUEUE_WAIT_BUCKETS,
            registry=r,
        )
        self.first_delta = Histogram(
            "iop_run_time_to_first_delta_seconds",
            _help("iop_run_time_to_first_delta_seconds"),
            ["target"],
            buckets=FIRST_DELTA_BUCKETS,
            registry=r,
        )
        self._collector = _GateCollector(node)
        r.register(self._collector)
        ProcessCollector(registry=r)
        # the configured targets show 0 from the first scrape, so rate() works at once
        for target in node.targets:
            self.submitted.labels(target)
            self.deltas.labels(target)
            for status in _FINISHED_STATUSES:
                self.finished.labels(target, status.value)
            for reason in RejectReason:
                self.rejected.labels(target, reason.value)

    def __repr__(self) -> str:
        state = "attached" if self.attached else "detached"
        return f"<NodeMetrics node={self.node.node_id!r} {state} tracked_runs={self.tracked_runs}>"

    # --- wiring --------------------------------------------------------------------------

    @property
    def tracked_runs(self) -> int:
        """How many live runs the metrics keep state for."""
        return len(self._runs)

    @property
    def attached(self) -> bool:
        return bool(self._attached_to)

    def attach(self) -> None:
        """Start receiving the node's run events. Calling it again does nothing more.

        The listener goes into ``node.event_listeners``, which the node hands
        to each run manager it starts; if the node is running now, also into
        the current manager's listeners (unless it shares that list). A node
        without ``event_listeners`` must be running: the listener then goes
        to the current manager only, and a restarted node needs another
        :meth:`attach`. RuntimeError if there is nowhere to attach.
        """
        lists: list[list[Listener]] = []
        node_list: list[Listener] | None = getattr(self.node, "event_listeners", None)
        if node_list is not None:
            lists.append(node_list)
        try:
            lists.append(self.node.manager.listeners)
        except RuntimeError:
            if node_list is None:
                raise RuntimeError(
                    "this node has no event_listeners and is not running: "
                    "attach the metrics inside `async with node.running()`"
                ) from None
        for listeners in lists:
            if not any(listener is self._listener for listener in listeners):
                listeners.append(self._listener)
            if not any(seen is listeners for seen in self._attached_to):
                self._attached_to.append(listeners)

    def watch_link(self, link: Any) -> None:
        """Show the state of ``link`` (the node's NodeLink) as the ``iop_edge_link_*``
        metrics; read at each scrape."""
        self._collector.link = link

    def detach(self) -> None:
        """Stop receiving events; forget the per-run state (those runs' durations are lost)."""
        for listeners in self._attached_to:
            while any(listener is self._listener for listener in listeners):
                listeners.remove(self._listener)
        self._attached_to.clear()
        self._runs.clear()

    # --- events --------------------------------------------------------------------------

    def on_event(self, event: RunEvent, record: RunRecord) -> None:
        """Account for one event of ``record``'s run (the run manager's listener).

        Never raises for an event out of order or of a run it has not seen
        start; it counts what it can.
        """
        kind = event.kind
        run_id = event.run_id
        target = record.target
        if kind is EventKind.DELTA:  # the hot path: one per streamed chunk
            times = self._runs.get(run_id)
            if times is None:
                self.deltas.labels(target).inc()
                return
            times.deltas.inc()
            if not times.first_delta and times.started is not None:
                times.first_delta = True
                self.first_delta.labels(target).observe(max(0.0, event.time - times.started))
        elif kind is EventKind.QUEUED:
            self.submitted.labels(target).inc()
            times = _RunTimes(
                target,
                event.time,
                self.deltas.labels(target),
                _tenant_label(self.node, record.tenant),
                priority_class(record.priority),
            )
            self._track(run_id, times)
        elif kind is EventKind.STARTED:
            times = self._runs.get(run_id)
            if times is not None:
                times.started = event.time
                wait = max(0.0, event.time - times.queued)
                self.queue_wait.labels(target, "started").observe(wait)
                self.tenant_queue_wait.labels(times.tenant, times.priority, "started").observe(wait)
        elif kind.terminal:
            self._ended(event, record, self._runs.pop(run_id, None))

    def _ended(self, event: RunEvent, record: RunRecord, times: _RunTimes | None) -> None:
        status = event.kind.status
        assert status is not None
        target = record.target
        self.finished.labels(target, status.value).inc()
        if times is not None:
            tenant, priority = times.tenant, times.priority
        else:
            tenant = _tenant_label(self.node, record.tenant)
            priority = priority_class(record.priority)
        self.tenant_finished.labels(tenant, priority, status.value).inc()
        if status is RunStatus.REJECTED:
            self.rejected.labels(target, event.reason or "unknown").inc()
        elif status is RunStatus.FAILED:
            self.failed.labels(target, event.reason or "unknown").inc()
        usage = event.usage
        if usage is not None:
            self._settled(target, tenant, usage)
        if times is None:
            return
        if times.started is not None:
            duration = max(0.0, event.time - times.started)
            self.run_duration.labels(target, status.value).observe(duration)
        else:
            outcome = _OUTCOME_OF_STATUS.get(status)
            if outcome is not None:  # INTERRUPTED is not a way out of the queue
                wait = max(0.0, event.time - times.queued)
                self.queue_wait.labels(target, outcome).observe(wait)
                self.tenant_queue_wait.labels(tenant, priority, outcome).observe(wait)

    def _settled(self, target: str, tenant: str, usage: Usage) -> None:
        """Count a run's settled usage: by tenant all of it (``input``, ``output``: the
        names of OpenTelemetry's gen_ai.usage.input_tokens and output_tokens), by target
        only what the engine reported."""
        prompt, completion = usage.prompt_tokens or 0, usage.completion_tokens or 0
        if prompt:
            self.tenant_tokens.labels(tenant, "input").inc(prompt)
            if not usage.prompt_estimated:
                self.tokens.labels(target, "prompt").inc(prompt)
        if completion:
            self.tenant_tokens.labels(tenant, "output").inc(completion)
            if not usage.completion_estimated:
                self.tokens.labels(target, "completion").inc(completion)

    def _track(self, run_id: str, times: _RunTimes) -> None:
        runs = self._runs
        runs[run_id] = times
        if len(runs) > self.max_tracked_runs:
            oldest = next(iter(runs))
            del runs[oldest]
            log.warning(
                "metrics: more than %d live runs tracked; dropped the state of run %s "
                "(did it end without a terminal event?)",
                self.max_tracked_runs,
                oldest,
            )

    # --- exposition ----------------------------------------------------------------------

    def render(self) -> bytes:
        """The metrics in the Prometheus text format (:data:`CONTENT_TYPE`).

        The ``*_created`` series that prometheus_client adds to counters and
        histograms (their creation times, shown as extra gauges in this
        format) are left out: they double the output and say nothing here.
        """
        return generate_latest(self.exposition())

    def exposition(self) -> _WithoutCreated:
        """The registry as it is exposed (without the ``*_created`` series), for
        :func:`prometheus_client.make_asgi_app`."""
        return _WithoutCreated(self.registry)

    def health(self) -> tuple[bool, str]:
        """(ready, why): ready while the node runs, admits runs, its store writes and its
        edge link (if it has one) is up."""
        ready, components = self.readiness()
        if ready:
            return True, "ok"
        name, state = next((n, c) for n, c in components.items() if not c["ok"])
        return False, f"{name}: {state['state']}"

    def readiness(self) -> tuple[bool, dict[str, dict[str, Any]]]:
        """Whether the node is ready for runs, and the state of each component that
        decides it: ``node`` (running and admitting), ``store`` (writable),
        ``target:<name>`` (its engine answered the last probe and serves its model;
        available until probed), ``edge`` (the link is up; only when the node has one).
        """
        components: dict[str, dict[str, Any]] = {}
        try:
            manager = self.node.manager
        except RuntimeError:
            components["node"] = {"ok": False, "state": "stopped: the node is not running"}
        else:
            admitting = manager.admitting
            components["node"] = {
                "ok": admitting,
                "state": "running" if admitting else "draining: the node admits no new runs",
            }
        store = self.node.store.health()
        components["store"] = {
            "ok": store.writable,
            "state": "writable" if store.writable else f"the run store {store}",
        }
        for target in self.node.targets:
            why = self.node.unavailable.get(target)
            components[f"target:{target}"] = {
                "ok": why is None,
                "state": "available" if why is None else f"unavailable: {why}",
            }
        for pool, learner in self.node.learners.items():
            learned = learner.learned
            said = "asking the engine" if learned is None else f"learned from {learned.signal}"
            if learned is not None:
                budget = "-" if learned.budget == math.inf else f"{learned.budget:.0f}"
                said += f": {learned.limit} runs, {budget} tokens"
                if learned.last is not None:
                    said += f" (last: {learned.last.reason})"
            components[f"capacity:{pool}"] = {"ok": True, "state": said}
        link = self._collector.link
        if link is not None:
            up = link.session is not None
            components["edge"] = {
                "ok": up,
                "state": "up" if up else f"down: {link.last_error or 'connecting'}",
            }
        return all(c["ok"] for c in components.values()), components


__all__ = [
    "CONTENT_TYPE",
    "FIRST_DELTA_BUCKETS",
    "METRICS",
    "PROCESS_METRICS",
    "QUEUE_WAIT_BUCKETS",
    "RUN_DURATION_BUCKETS",
    "MetricInfo",
    "NodeMetrics",
]
