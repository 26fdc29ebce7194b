"""A run's spans on the node: the run, its wait in the gate, its engine call, its last write.

One :class:`RunSpans` a live run (``LiveRun.spans``; None when tracing is off, so a
run without spans pays one ``is None`` at each step). A run's life spans several
tasks (its submission, the gate's grant, a cancel), so no span is taken from the
current context: each is started with an explicit parent, and kept here until it ends.

- ``iop.run`` (SERVER): from the run's submission to its end; its parent is the
  caller's W3C context (``RunSpec.traceparent``), else it starts a trace. It ends with
  the run's status, usage, finish reason and queue wait; a run that did not succeed
  has an error status whose description is its reason (and ``iop.reject.reason`` for
  a rejected one).
- ``iop.gate.wait``: only a run that waited in the gate, from when it began to wait
  (with the level that was full then, :func:`~.tickets.full_level`) to its grant, or
  to its end if it never started (an error status: its reject or cancel reason).
- ``iop.engine`` (CLIENT): the request to the engine to the end of its stream, with
  ``first_token`` and ``end`` events; its context goes to the engine as headers.
- ``iop.store.final_write``: the write of the run's terminal event.

Attributes are set only on a span that records (``is_recording()``): a trace sampled
out still passes its context on (to the engine), and costs no attribute dicts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import attrs
from opentelemetry import context as otel_context
from opentelemetry.trace import Span, SpanKind, Tracer
from opentelemetry.util.types import AttributeValue

from .. import tracing as t
from ..adapters.base import Adapter, AdapterRequest
from ..model import RunEvent, RunRecord, RunSpec, RunStatus, TargetSpec, Usage
from ..options import output_bound
from .live import Outcome


def usage_attributes(usage: Usage | None) -> dict[str, AttributeValue]:
    """The GenAI usage and finish-reason attributes of ``usage`` (what is known of it)."""
    if usage is None:
        return {}
    return t.usage_attributes(usage.prompt_tokens, usage.completion_tokens, usage.done_reason)


@attrs.define(eq=False, slots=True)
class RunSpans:
    """The open spans of one live run (see the module docstring)."""

    tracer: Tracer
    run: Span
    gate: Span | None = None
    engine: Span | None = None
    store: Span | None = None

    def __repr__(self) -> str:
        ids = t.ids_of(self.run)
        open_ = [n for n in ("gate", "engine", "store") if getattr(self, n) is not None]
        return f"<RunSpans trace={ids[0] if ids else '-'} open={open_}>"

    def _child(self, name: str, kind: SpanKind = SpanKind.INTERNAL) -> Span:
        return self.tracer.start_span(name, context=t.context_of(self.run), kind=kind)

    def wait_began(self, level: str) -> None:
        """The run began to wait in the gate, ``level`` being full."""
        self.gate = self._child(t.SPAN_GATE_WAIT)
        if self.gate.is_recording():
            self.gate.set_attribute(t.IOP_QUEUE_LEVEL, level)

    def admitted(self) -> None:
        """The run's wait ended in a grant."""
        if self.gate is not None:
            self.gate.end()
            self.gate = None

    def engine_began(
        self, request: AdapterRequest, server: tuple[str, int] | None = None
    ) -> AdapterRequest:
        """The engine span starts (``server``: the engine's host and port, the replica's
        where the adapter has several); ``request`` with its context as headers."""
        self.engine = span = self._child(t.SPAN_ENGINE, SpanKind.CLIENT)
        if span.is_recording():
            span.set_attributes(
                {
                    t.GEN_AI_OPERATION_NAME: t.OPERATION_CHAT,
                    t.GEN_AI_REQUEST_MODEL: request.model,
                    t.IOP_RUN_ID: request.run_id,
                }
            )
            if server is not None:
                span.set_attributes({t.SERVER_ADDRESS: server[0], t.SERVER_PORT: server[1]})
        headers = t.headers_of(span)
        return attrs.evolve(request, headers={**request.headers, **headers}) if headers else request

    def first_token(self) -> None:
        if self.engine is not None:
            self.engine.add_event(t.EVENT_FIRST_TOKEN)

    def engine_ended(self, outcome: Outcome | None) -> None:
        """The engine's stream ended as ``outcome`` (None: the run was cancelled or
        stopped while in it, or the node failed)."""
        span, self.engine = self.engine, None
        if span is None:
            return
        if span.is_recording():
            status = "cancelled" if outcome is None else outcome.status.value
            span.add_event(t.EVENT_END, {t.IOP_STATUS: status})
            if outcome is not None:
                span.set_attributes(usage_attributes(outcome.usage))
        if outcome is None:
            t.fail(span, "cancelled", "the run ended before its engine's stream did")
        elif outcome.status is not RunStatus.SUCCEEDED:
            t.fail(span, outcome.reason, outcome.message)
        span.end()

    def write_began(self) -> None:
        self.store = self._child(t.SPAN_STORE_FINAL_WRITE)

    def write_ended(self) -> None:
        if self.store is not None:
            self.store.end()
            self.store = None

    @contextmanager
    def current(self) -> Iterator[None]:
        """The run's span is the current one in the block (for the log lines about it)."""
        token = otel_context.attach(t.context_of(self.run))
        try:
            yield
        finally:
            otel_context.detach(token)

    def make_current(self) -> None:
        """The run's span is the current one for the rest of the calling task: a run's
        own tasks (whose contexts end with them) say so for their log lines."""
        otel_context.attach(t.context_of(self.run))

    def ended(self, last: RunEvent | None, record: RunRecord) -> None:
        """The run ended with ``last`` (None: it was never stored): end every open span."""
        reason = "not_stored" if last is None else last.reason or last.kind.value
        if self.gate is not None:  # it never left the gate
            t.fail(self.gate, reason)
            self.gate.end()
        self.engine_ended(None)
        self.write_ended()
        span = self.run
        if span.is_recording():
            self._end_attributes(span, last, record)
        if last is None or last.kind.status is not RunStatus.SUCCEEDED:
            t.fail(span, reason, "" if last is None else last.message)
        span.end()

    @staticmethod
    def _end_attributes(span: Span, last: RunEvent | None, record: RunRecord) -> None:
        ended = record.finished if record.finished is not None else record.created
        began = record.started if record.started is not None else ended
        found: dict[str, AttributeValue] = {t.IOP_QUEUE_WAIT_S: max(0.0, began - record.created)}
        if last is not None:
            found[t.IOP_STATUS] = last.kind.value
            found.update(usage_attributes(last.usage))
            if last.kind.status is RunStatus.REJECTED:
                found[t.IOP_REJECT_REASON] = last.reason
        span.set_attributes(found)


class RunTracer:
    """Starts each run's spans with ``tracer`` (None: tracing off, no spans at all) on
    node ``node_id``, whose adapters (by name) say the runs' providers (their kinds)
    and which options bound their output."""

    def __init__(
        self,
        tracer: Tracer | None,
        node_id: str = "",
        adapters: Mapping[str, Adapter] | None = None,
    ) -> None:
        self.tracer = tracer
        self.node_id = node_id
        self.adapters = dict(adapters or {})

    def __repr__(self) -> str:
        return f"<RunTracer node={self.node_id!r} {'on' if self.tracer else 'off'}>"

    def begin(self, run_id: str, spec: RunSpec, target: TargetSpec) -> RunSpans | None:
        """The spans of a new run, its run span started; None when there is no span to
        keep (no tracer, or one that makes no valid span: the no-op provider)."""
        if self.tracer is None:
            return None
        span = self.tracer.start_span(
            t.SPAN_RUN,
            context=t.parent(spec.traceparent, spec.tracestate),
            kind=SpanKind.SERVER,
        )
        if not span.get_span_context().is_valid:
            return None
        if span.is_recording():
            span.set_attributes(self._attributes(run_id, spec, target))
        return RunSpans(self.tracer, span)

    def _provider(self, name: str) -> str:
        adapter = self.adapters.get(name)
        return name if adapter is None else adapter.kind

    def _attributes(
        self, run_id: str, spec: RunSpec, target: TargetSpec
    ) -> dict[str, AttributeValue]:
        found: dict[str, AttributeValue] = {
            t.GEN_AI_OPERATION_NAME: t.OPERATION_CHAT,
            t.GEN_AI_PROVIDER_NAME: self._provider(target.adapter),
            t.GEN_AI_REQUEST_MODEL: target.model,
            t.IOP_TARGET: spec.target,
            t.IOP_TENANT: spec.tenant,
            t.IOP_PRIORITY: spec.priority,
            t.IOP_RUN_ID: run_id,
            t.IOP_NODE_ID: self.node_id,
        }
        adapter = self.adapters.get(target.adapter)
        if adapter is not None:
            bound = output_bound(target.params_for(spec.options), adapter.output_limit_options)
            if bound is not None:
                found[t.GEN_AI_REQUEST_MAX_TOKENS] = bound
        return found


#: The tracer of a manager given none: no spans.
NO_TRACER = RunTracer(None)
