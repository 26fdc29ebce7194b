"""The edge's spans: a door request, a proto-socket client's run request, the relay.

- The door's ``chat {model}`` (SERVER): one ``POST /v1/chat/completions``, from its
  arrival to its answer; its parent is the request's W3C ``traceparent`` (and
  ``tracestate``) header, else it starts a trace. It ends with the run's usage and
  finish reason, or an error status whose description is the answer's code
  (``iop.reject.reason`` too for a rejected run). It is the current span while the
  request is handled, so the door's log lines name its trace.
- A ``/client`` RunRequest's ``chat {target}`` (SERVER), whose parent is the request's
  ``traceparent`` field, to the end of its relay.
- ``iop.relay`` (CLIENT), the child of either: the run's relay to one node
  (``iop.node_id``), from the RunRequest sent to the end of its stream; its context is
  what goes to the node in the RunRequest's ``traceparent``.

With the no-op provider every span is invalid and nothing records: no header is
decoded, no attribute set, and the RunRequest carries no context.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import attrs
from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Tracer
from opentelemetry.util.types import AttributeValue

from .. import tracing as t
from ..model import EventKind, RunEvent, RunSpec
from ..options import output_bound
from ..protocol import pb

#: The options the door sends a run's ``max_tokens`` as (front_door.OPTION_NAMES: an
#: ollama target's is ``num_predict``).
DOOR_OUTPUT_OPTIONS = ("max_tokens", "num_predict")

#: The HTTP headers of the W3C trace context, as ASGI gives them (lower case).
TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})
HTTP_STATUS = "http.response.status_code"


def end_attributes(last: RunEvent | None) -> dict[str, AttributeValue]:
    """What a run's end says on an edge span: its usage, finish reason, reject reason."""
    found: dict[str, AttributeValue] = {}
    if last is None:
        return found
    found[t.IOP_STATUS] = last.kind.value
    usage = last.usage
    if usage is not None:
        found |= t.usage_attributes(usage.prompt_tokens, usage.completion_tokens, usage.done_reason)
    if last.kind is EventKind.REJECTED:
        found[t.IOP_REJECT_REASON] = last.reason
    return found


def request_attributes(
    target: str, tenant: str, priority: int, options: Mapping[str, Any], provider: str = ""
) -> dict[str, AttributeValue]:
    """The GenAI and iop attributes of a run request for ``target``."""
    found: dict[str, AttributeValue] = {
        t.GEN_AI_OPERATION_NAME: t.OPERATION_CHAT,
        t.GEN_AI_REQUEST_MODEL: target,
        t.IOP_TARGET: target,
        t.IOP_TENANT: tenant,
        t.IOP_PRIORITY: priority,
    }
    if provider:
        found[t.GEN_AI_PROVIDER_NAME] = provider
    bound = output_bound(options, DOOR_OUTPUT_OPTIONS)
    if bound is not None:
        found[t.GEN_AI_REQUEST_MAX_TOKENS] = bound
    return found


def carry(spec: RunSpec, span: Span) -> RunSpec:
    """``spec`` with ``span``'s context as its parent (as it was, for an invalid span)."""
    headers = t.headers_of(span)
    if not headers:
        return spec
    return attrs.evolve(
        spec, traceparent=headers["traceparent"], tracestate=headers.get("tracestate", "")
    )


@attrs.define(eq=False)
class DoorSpan:
    """One door request's span (see the module docstring)."""

    span: Span
    failed: bool = False

    def requested(self, spec: RunSpec, provider: str = "") -> RunSpec:
        """The request asks for ``spec``: name the span after its target, set what it
        asks for; ``spec`` with the span as its parent."""
        if self.span.is_recording():
            self.span.update_name(f"{t.OPERATION_CHAT} {spec.target}")
            self.span.set_attributes(
                request_attributes(spec.target, spec.tenant, spec.priority, spec.options, provider)
            )
        return carry(spec, self.span)

    def ended(self, last: RunEvent | None, run_id: str) -> None:
        """Run ``run_id`` ended with ``last`` (None: no end came)."""
        if self.span.is_recording():
            self.span.set_attributes({t.IOP_RUN_ID: run_id, **end_attributes(last)})

    def refused(self, code: str, status: int, message: str) -> None:
        """The request was answered with an error: HTTP ``status``, OpenAI's ``code``."""
        self.failed = True
        t.fail(self.span, code, message)
        if self.span.is_recording():
            self.span.set_attribute(HTTP_STATUS, status)


def headers_from(scope_headers: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The trace-context headers of an ASGI request (latin-1, as HTTP's are)."""
    return {
        name.decode("latin-1"): value.decode("latin-1")
        for name, value in scope_headers
        if name in TRACE_HEADERS
    }


@contextmanager
def door_span(tracer: Tracer, scope_headers: Iterable[tuple[bytes, bytes]]) -> Iterator[DoorSpan]:
    """The span of one door request, current in the block and ended on leaving it; an
    exception that leaves it (a client gone, a cancel) is its error unless
    :meth:`DoorSpan.refused` said one."""
    span = tracer.start_span(
        t.OPERATION_CHAT, context=t.extract(headers_from(scope_headers)), kind=SpanKind.SERVER
    )
    door = DoorSpan(span)
    token = otel_context.attach(t.context_of(span))
    try:
        yield door
    except BaseException as exc:
        if not door.failed:
            t.fail(span, type(exc).__name__)
        raise
    finally:
        otel_context.detach(token)
        span.end()


def client_span(tracer: Tracer, request: pb.RunRequest) -> Span:
    """The span of a ``/client`` RunRequest whose tenant the edge has set."""
    span = tracer.start_span(
        f"{t.OPERATION_CHAT} {request.target}",
        context=t.parent(request.traceparent, request.tracestate),
        kind=SpanKind.SERVER,
    )
    if span.is_recording():
        span.set_attributes(
            request_attributes(request.target, request.tenant, request.priority, {})
        )
    return span


def relay_span(tracer: Tracer, parent: Context, node_id: str) -> Span:
    """The relay of a run to node ``node_id``, the child of ``parent``'s span."""
    span = tracer.start_span(t.SPAN_RELAY, context=parent, kind=SpanKind.CLIENT)
    if span.is_recording():
        span.set_attribute(t.IOP_NODE_ID, node_id)
    return span
