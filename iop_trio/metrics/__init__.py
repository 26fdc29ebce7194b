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

The ``gen_ai_*`` histograms carry OpenTelemetry's GenAI metric names (the
Prometheus form: dots as underscores, the unit as a suffix) and the conventions'
advised buckets, labelled by ``gen_ai_operation_name`` (``chat``),
``gen_ai_provider_name`` (the kind of the target's adapter), ``gen_ai_request_model``
(the model the engine is asked for), ``iop_target`` and ``iop_tenant`` (bounded as
above). Their times count from QUEUED, when the node received the run, so the queue
wait is in them (the ``iop_run_*`` ones count from STARTED): time to first token at the
first delta of any run; request duration at the end of every run that started, with
``error_type`` empty if it succeeded, else its failure reason, ``cancelled`` or
``interrupted``; time per output token, ``(end - first delta) / (output tokens - 1)``,
only for runs that SUCCEEDED with two output tokens or more (a cancelled run's end is
not its last token); token usage, ``gen_ai_token_type`` ``input`` and ``output``, the
settled usage of each run that started (a count that is None is left out).

Per-run state is kept only for live runs (QUEUED or RUNNING) and dropped at
the terminal event; :attr:`NodeMetrics.tracked_runs` counts it. Should a
terminal event never come (a bug elsewhere), ``max_tracked_runs`` bounds the
state: the oldest entry is dropped, with a warning. A listener attached
while runs are live has no state for them: their counters still count from
then on, but their durations are not observed.

The package: :mod:`.table` (the table of metrics, buckets, content type; attrs only),
:mod:`.gauges` (read at each scrape), :mod:`.readiness` (``/readyz``'s components) and
:mod:`.node_metrics` (:class:`NodeMetrics`: the event-fed counters, the exposition);
they import the model and the runtime, and prometheus_client.

Everything here runs in the Trio thread: :meth:`NodeMetrics.render` reads the
gate without locks, so do not call it from another thread.
"""

from .node_metrics import NodeMetrics
from .table import (
    CONTENT_TYPE,
    FIRST_DELTA_BUCKETS,
    GENAI_DURATION_BUCKETS,
    GENAI_LABELS,
    GENAI_TOKEN_BUCKETS,
    GENAI_TPOT_BUCKETS,
    GENAI_TTFT_BUCKETS,
    METRICS,
    PROCESS_METRICS,
    QUEUE_WAIT_BUCKETS,
    RUN_DURATION_BUCKETS,
    MetricInfo,
)

__all__ = [
    "CONTENT_TYPE",
    "FIRST_DELTA_BUCKETS",
    "GENAI_DURATION_BUCKETS",
    "GENAI_LABELS",
    "GENAI_TOKEN_BUCKETS",
    "GENAI_TPOT_BUCKETS",
    "GENAI_TTFT_BUCKETS",
    "METRICS",
    "PROCESS_METRICS",
    "QUEUE_WAIT_BUCKETS",
    "RUN_DURATION_BUCKETS",
    "MetricInfo",
    "NodeMetrics",
]
