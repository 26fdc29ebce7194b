"""Tracing: the OpenTelemetry API as the package uses it, and the names of its spans.

Imports only the OpenTelemetry *API* (``opentelemetry.trace``, ``.context``, the W3C
trace-context propagator) and the standard library, never the SDK: what records and
exports spans is installed by the CLI (``iop-node serve``/``edge``), or handed to a
component as its ``tracer_provider``. With neither, the API's global provider is a
no-op: every span is :data:`~opentelemetry.trace.INVALID_SPAN`, nothing records, and
the components skip their attributes (they ask ``span.is_recording()`` first).

The W3C context (``traceparent``, ``tracestate``) crosses each hop as plain strings: an
HTTP header at the door and to the engine, a RunRequest field on the proto-socket.
An empty or malformed ``traceparent`` is no parent: a new trace starts there.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode, Tracer, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from . import __version__

#: The instrumentation scope of every span the package makes.
INSTRUMENTATION = "iop_trio"

_PROPAGATOR = TraceContextTextMapPropagator()

# --- span names, and the names of their events -------------------------------------------
#: the edge's relay of one run to a node (CLIENT)
SPAN_RELAY = "iop.relay"
#: a run on a node, from its submission to its end (SERVER)
SPAN_RUN = "iop.run"
#: a run's wait in the gate; only a run that waited has one
SPAN_GATE_WAIT = "iop.gate.wait"
#: the run's request to its engine, to the end of its stream (CLIENT)
SPAN_ENGINE = "iop.engine"
#: the write of a run's terminal event to the store
SPAN_STORE_FINAL_WRITE = "iop.store.final_write"
EVENT_FIRST_TOKEN = "first_token"
EVENT_END = "end"

# --- attributes: the GenAI semantic conventions', then iop's own -------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
#: the conventions' low-cardinality name of what went wrong (a reject or end reason)
ERROR_TYPE = "error.type"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
IOP_TENANT = "iop.tenant"
IOP_PRIORITY = "iop.priority"
IOP_TARGET = "iop.target"
IOP_RUN_ID = "iop.run_id"
IOP_NODE_ID = "iop.node_id"
#: seconds from a run's submission to its start (or to its end, for one never started)
IOP_QUEUE_WAIT_S = "iop.queue.wait_s"
#: which level was full when a run began to wait: tenant, target, adapter, global,
#: replica (no replica of its adapter fitted it), queue
IOP_QUEUE_LEVEL = "iop.queue.level"
IOP_REJECT_REASON = "iop.reject.reason"
#: the run's terminal status (succeeded, failed, cancelled, rejected, interrupted)
IOP_STATUS = "iop.status"

#: the GenAI operation of every run: a chat (or text) completion
OPERATION_CHAT = "chat"


def get_tracer(provider: TracerProvider | None = None) -> Tracer:
    """The package's tracer from ``provider``, else from the global provider (a proxy:
    it records once a provider is installed globally, even if that comes later)."""
    if provider is None:
        return trace.get_tracer(INSTRUMENTATION, __version__)
    return provider.get_tracer(INSTRUMENTATION, __version__)


def extract(carrier: Mapping[str, str]) -> Context:
    """The context whose span is the remote parent ``carrier`` names (its lowercase
    ``traceparent`` and ``tracestate``); an empty Context (a new trace) when it names
    none or a malformed one. Never reads the current context."""
    if not carrier.get("traceparent"):
        return Context()
    return _PROPAGATOR.extract(carrier, Context())


def inject(context: Context | None = None) -> dict[str, str]:
    """The ``traceparent`` (and ``tracestate``, if any) of the span in ``context`` (None:
    the current context); empty when it holds no valid span (tracing is off)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context)
    return carrier


def parent(traceparent: str, tracestate: str = "") -> Context:
    """:func:`extract` for the two strings a RunRequest or a RunSpec carries."""
    if not traceparent:
        return Context()
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    return _PROPAGATOR.extract(carrier, Context())


def context_of(span: Span) -> Context:
    """A context whose span is ``span``: the explicit parent of its children."""
    return trace.set_span_in_context(span, Context())


def headers_of(span: Span) -> dict[str, str]:
    """``span``'s W3C context as headers (:func:`inject`); empty for an invalid span."""
    if not span.get_span_context().is_valid:
        return {}
    return inject(context_of(span))


def ids_of(span: Span) -> tuple[str, str] | None:
    """``span``'s trace id and span id in hex (32 and 16 digits), None if it is invalid."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return trace.format_trace_id(ctx.trace_id), trace.format_span_id(ctx.span_id)


def current_ids() -> tuple[str, str] | None:
    """:func:`ids_of` the current span (what the running task set as current)."""
    return ids_of(trace.get_current_span())


def fail(span: Span, reason: str, message: str = "") -> None:
    """Give ``span`` an error status described by ``reason`` (and ``message``), and the
    reason as ``error.type`` (``error`` if it is empty)."""
    span.set_status(Status(StatusCode.ERROR, f"{reason}: {message}" if message else reason))
    if span.is_recording():
        span.set_attribute(ERROR_TYPE, reason or "error")


def usage_attributes(
    prompt_tokens: int | None, completion_tokens: int | None, done_reason: str
) -> dict[str, AttributeValue]:
    """The GenAI usage and finish-reason attributes of a run's usage: what is known of
    it (a count that is None, an empty reason, is left out)."""
    found: dict[str, AttributeValue] = {}
    if prompt_tokens is not None:
        found[GEN_AI_USAGE_INPUT_TOKENS] = prompt_tokens
    if completion_tokens is not None:
        found[GEN_AI_USAGE_OUTPUT_TOKENS] = completion_tokens
    if done_reason:
        found[GEN_AI_RESPONSE_FINISH_REASONS] = (done_reason,)
    return found
