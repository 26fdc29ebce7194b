"""The counters and histograms fed by the run manager's events (``iop_runs_*``,
``iop_run_*``, ``iop_tenant_*``, and ``gen_ai_*`` after OpenTelemetry's GenAI
conventions), and :class:`NodeMetrics`, which owns them, the
scrape-time gauges (:mod:`.gauges`) and the exposition. The package docstring says what
each metric counts and when.
"""

from __future__ import annotations

import logging
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
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import RestrictedRegistry

from ..model import EventKind, RejectReason, RunEvent, RunRecord, RunStatus, Usage
from ..runtime import Node
from .gauges import GateCollector, priority_class, tenant_label
from .readiness import node_readiness
from .table import (
    FIRST_DELTA_BUCKETS,
    GENAI_DURATION_BUCKETS,
    GENAI_TOKEN_BUCKETS,
    GENAI_TPOT_BUCKETS,
    GENAI_TTFT_BUCKETS,
    QUEUE_WAIT_BUCKETS,
    RUN_DURATION_BUCKETS,
    metric_info,
)

log = logging.getLogger(__name__)

Listener = Callable[[RunEvent, RunRecord], None]

_OUTCOME_OF_STATUS: Mapping[RunStatus, str] = {
    RunStatus.RUNNING: "started",
    RunStatus.REJECTED: "rejected",
    RunStatus.CANCELLED: "cancelled",
}
#: gen_ai.operation.name of every run: the door and the adapters speak chat completions.
GENAI_OPERATION = "chat"
#: gen_ai.provider.name of a run whose target (and so its adapter) the node does not have.
UNKNOWN_PROVIDER = "unknown"
_FINISHED_STATUSES = (
    RunStatus.SUCCEEDED,
    RunStatus.FAILED,
    RunStatus.CANCELLED,
    RunStatus.REJECTED,
)


@attrs.define(eq=False, repr=False)
class _RunTimes:
    """What the metrics keep about one live run."""

    target: str
    queued: float
    deltas: Counter  # the target's child of iop_run_deltas_total, looked up once
    tenant: str  # its label
    priority: str  # its class
    genai: tuple[str, ...]  # its gen_ai_* histograms' labels (table.GENAI_LABELS)
    started: float | None = None
    first_delta: float | None = None  # its time


def _counter(name: str, registry: CollectorRegistry) -> Counter:
    """The counter ``name`` of :data:`.table.METRICS` (``<family>_total``) in ``registry``."""
    info = metric_info(name, "counter")
    return Counter(name.removesuffix("_total"), info.help, list(info.labels), registry=registry)


def _histogram(name: str, buckets: tuple[float, ...], registry: CollectorRegistry) -> Histogram:
    """The histogram ``name`` of :data:`.table.METRICS` in ``registry``, with ``buckets``."""
    info = metric_info(name, "histogram")
    return Histogram(name, info.help, list(info.labels), buckets=buckets, registry=registry)


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
        # names, labels and help come from the table (METRICS)
        self.submitted = _counter("iop_runs_submitted_total", r)
        self.finished = _counter("iop_runs_finished_total", r)
        self.rejected = _counter("iop_runs_rejected_total", r)
        self.failed = _counter("iop_runs_failed_total", r)
        self.deltas = _counter("iop_run_deltas_total", r)
        self.tokens = _counter("iop_run_tokens_total", r)
        self.queue_wait = _histogram("iop_run_queue_wait_seconds", QUEUE_WAIT_BUCKETS, r)
        self.run_duration = _histogram("iop_run_duration_seconds", RUN_DURATION_BUCKETS, r)
        self.tenant_finished = _counter("iop_tenant_runs_finished_total", r)
        self.tenant_tokens = _counter("iop_tenant_tokens_total", r)
        self.tenant_queue_wait = _histogram("iop_tenant_queue_wait_seconds", QUEUE_WAIT_BUCKETS, r)
        self.first_delta = _histogram("iop_run_time_to_first_delta_seconds", FIRST_DELTA_BUCKETS, r)
        self.genai_ttft = _histogram(
            "gen_ai_server_time_to_first_token_seconds", GENAI_TTFT_BUCKETS, r
        )
        self.genai_tpot = _histogram(
            "gen_ai_server_time_per_output_token_seconds", GENAI_TPOT_BUCKETS, r
        )
        self.genai_duration = _histogram(
            "gen_ai_server_request_duration_seconds", GENAI_DURATION_BUCKETS, r
        )
        self.genai_tokens = _histogram("gen_ai_client_token_usage", GENAI_TOKEN_BUCKETS, r)
        self._collector = GateCollector(node)
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
            if times.first_delta is None and times.started is not None:
                times.first_delta = event.time
                self.first_delta.labels(target).observe(max(0.0, event.time - times.started))
                self.genai_ttft.labels(*times.genai).observe(max(0.0, event.time - times.queued))
        elif kind is EventKind.QUEUED:
            self.submitted.labels(target).inc()
            tenant = tenant_label(self.node, record.tenant)
            times = _RunTimes(
                target,
                event.time,
                self.deltas.labels(target),
                tenant,
                priority_class(record.priority),
                self.genai_labels(target, tenant),
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
            tenant = tenant_label(self.node, record.tenant)
            priority = priority_class(record.priority)
        self.tenant_finished.labels(tenant, priority, status.value).inc()
        if status is RunStatus.REJECTED:
            self.rejected.labels(target, event.reason or "unknown").inc()
        elif status is RunStatus.FAILED:
            self.failed.labels(target, event.reason or "unknown").inc()
        usage = event.usage
        if usage is not None:
            self._settled(target, tenant, usage)
            genai = times.genai if times is not None else self.genai_labels(target, tenant)
            self._genai_tokens(genai, usage)
        if times is None:
            return
        if times.started is not None:
            duration = max(0.0, event.time - times.started)
            self.run_duration.labels(target, status.value).observe(duration)
            self._genai_ended(event, times)
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

    def genai_labels(self, target: str, tenant: str) -> tuple[str, ...]:
        """The ``gen_ai_*`` histograms' labels of a run of ``target`` by ``tenant`` (its
        label): operation ``chat``, provider the kind of the target's adapter (``openai``,
        ``ollama``, ``echo``), the model the engine is asked for. A target the node does
        not have (a run in the store from an older config) has provider ``unknown`` and
        its name's model part."""
        spec = self.node.targets.get(target)
        if spec is None:
            model = target.partition("/")[2].partition("@")[0]
            return (GENAI_OPERATION, UNKNOWN_PROVIDER, model, target, tenant)
        adapter = self.node.adapters.get(spec.adapter)
        provider = adapter.kind if adapter is not None else UNKNOWN_PROVIDER
        return (GENAI_OPERATION, provider, spec.model, target, tenant)

    def _genai_ended(self, end: RunEvent, times: _RunTimes) -> None:
        """The request duration (QUEUED to ``end``) of a run that started, and its time
        per output token if it SUCCEEDED with a first delta and 2 output tokens or more:
        the time after the first delta over the tokens after the first."""
        status = end.kind.status
        if status is RunStatus.SUCCEEDED:
            error = ""
        elif status is RunStatus.FAILED:
            error = end.reason or "unknown"
        else:
            error = status.value if status is not None else "unknown"
        self.genai_duration.labels(*times.genai, error).observe(max(0.0, end.time - times.queued))
        output = (end.usage.completion_tokens if end.usage is not None else None) or 0
        first = times.first_delta
        if status is RunStatus.SUCCEEDED and first is not None and output >= 2:
            decode = max(0.0, end.time - first)
            self.genai_tpot.labels(*times.genai).observe(decode / (output - 1))

    def _genai_tokens(self, genai: tuple[str, ...], usage: Usage) -> None:
        """One observation a token type of a run's settled ``usage``; a count that is None
        (a record stored before the node settled usage) is not observed."""
        if usage.prompt_tokens is not None:
            self.genai_tokens.labels(*genai, "input").observe(usage.prompt_tokens)
        if usage.completion_tokens is not None:
            self.genai_tokens.labels(*genai, "output").observe(usage.completion_tokens)

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
        return node_readiness(self.node, self._collector.link)
