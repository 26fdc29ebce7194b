"""The table of a node's metrics (:data:`METRICS`): each one's name as exposed, its
type, labels and meaning; the histograms' buckets and the exposition's content type.

The gauges (:mod:`.gauges`) and the event-fed counters (:mod:`.node_metrics`) take their
names, labels and help from here, so the table is the one list of what a node exposes.
This module imports only attrs.
"""

from __future__ import annotations

import attrs

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


# The OpenTelemetry GenAI semantic conventions' advised boundaries (gen-ai-metrics.md:
# "This metric SHOULD be specified with ExplicitBucketBoundaries of [...]").
GENAI_TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
"""``gen_ai.server.time_to_first_token``: 1 ms to 10 s."""

GENAI_TPOT_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
"""``gen_ai.server.time_per_output_token``: 10 ms to 2.5 s a token."""

GENAI_DURATION_BUCKETS: tuple[float, ...] = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
"""``gen_ai.server.request.duration``: 10 ms doubling to 81.92 s."""

GENAI_TOKEN_BUCKETS: tuple[float, ...] = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip
"""``gen_ai.client.token.usage``: tokens, 1 to 4**13."""

#: The labels every GenAI histogram has, in this order: the conventions' attributes
#: (dots as underscores) and the node's own target and bounded tenant.
GENAI_LABELS: tuple[str, ...] = (
    "gen_ai_operation_name",
    "gen_ai_provider_name",
    "gen_ai_request_model",
    "iop_target",
    "iop_tenant",
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
        "gen_ai_server_time_to_first_token_seconds",
        "histogram",
        GENAI_LABELS,
        "OpenTelemetry's gen_ai.server.time_to_first_token: from QUEUED (the node received "
        "the run) to its first delta, queue wait included; every run that got one.",
    ),
    MetricInfo(
        "gen_ai_server_time_per_output_token_seconds",
        "histogram",
        GENAI_LABELS,
        "OpenTelemetry's gen_ai.server.time_per_output_token: (end - first delta) / "
        "(output tokens - 1), for runs that SUCCEEDED with 2 output tokens or more.",
    ),
    MetricInfo(
        "gen_ai_server_request_duration_seconds",
        "histogram",
        (*GENAI_LABELS, "error_type"),
        "OpenTelemetry's gen_ai.server.request.duration: from QUEUED to the terminal event, "
        "for runs that started; error_type empty if it succeeded, else the failure reason "
        "or cancelled / interrupted.",
    ),
    MetricInfo(
        "gen_ai_client_token_usage",
        "histogram",
        (*GENAI_LABELS, "gen_ai_token_type"),
        "OpenTelemetry's gen_ai.client.token.usage: each run that started, its settled "
        "tokens (gen_ai_token_type input: the prompt, output: the completion; the engine's "
        "counts, else the node's estimates).",
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
        "Concurrency permits per level (global/adapter/target/tenant/replica; a replica's "
        "name is adapter@url); +Inf = unbounded.",
    ),
    MetricInfo(
        "iop_gate_permits_in_use",
        "gauge",
        ("level", "name"),
        "Permits held now per level (global/adapter/target/tenant/replica): runs holding one.",
    ),
    MetricInfo(
        "iop_replica_up",
        "gauge",
        ("adapter", "replica"),
        "1 while a replica of an adapter takes runs, 0 while it is marked down (it failed "
        "a run before its first token; a probe or a run that streams clears it).",
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
        "iop_gate_runs_taken_back_total",
        "counter",
        ("pool",),
        "Runs a learned concurrency took back from its engine (let in past what it holds, "
        "waiting there for a first token) to wait in the node.",
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
_BY_NAME = {m.name: m for m in METRICS}


def help_of(name: str) -> str:
    """The help text of the metric ``name`` (as the table names it); KeyError if none."""
    return _BY_NAME[name].help


def metric_info(name: str, kind: str) -> MetricInfo:
    """The row of the metric ``name``, which must be of type ``kind`` (else ValueError: a
    table and its use that disagree are a bug); KeyError if there is none."""
    info = _BY_NAME[name]
    if info.type != kind:
        raise ValueError(f"{name} is a {info.type} in the table, not a {kind}")
    return info
