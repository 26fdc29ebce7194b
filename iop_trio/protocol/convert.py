"""Conversions between runtime values and protobuf messages.

The runtime never sees protobuf; sessions convert at the edge of the wire.
:func:`spec_from_request` is where a RunRequest from the network is checked.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from google.protobuf import struct_pb2

from .._gen.iop import runtime_pb2 as pb
from ..model import (
    MAX_JOINED_TEXT,
    TERMINAL_STATUSES,
    EventKind,
    InvalidRequest,
    Limits,
    NodeInfo,
    RunEvent,
    RunQuery,
    RunRecord,
    RunSpec,
    RunStatus,
    TenantLimits,
    Usage,
)

MAX_PROMPT_CHARS = 4 * 1024 * 1024
MAX_MESSAGES = 4096
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
#: The longest ``traceparent`` and ``tracestate`` a RunRequest's run keeps (W3C: 55
#: characters for version 00; a tracestate of 512 need be passed on): a longer one is
#: dropped, as the propagator drops a malformed one, and the run starts a new trace.
MAX_TRACEPARENT = 128
MAX_TRACESTATE = 512

_STATUS_TO_PB: Mapping[RunStatus, int] = {
    RunStatus.QUEUED: pb.RUN_STATUS_QUEUED,
    RunStatus.RUNNING: pb.RUN_STATUS_RUNNING,
    RunStatus.SUCCEEDED: pb.RUN_STATUS_SUCCEEDED,
    RunStatus.FAILED: pb.RUN_STATUS_FAILED,
    RunStatus.CANCELLED: pb.RUN_STATUS_CANCELLED,
    RunStatus.REJECTED: pb.RUN_STATUS_REJECTED,
    RunStatus.INTERRUPTED: pb.RUN_STATUS_INTERRUPTED,
}
_STATUS_FROM_PB = {v: k for k, v in _STATUS_TO_PB.items()}
_KIND_TO_PB: Mapping[EventKind, int] = {
    EventKind.QUEUED: pb.EVENT_KIND_QUEUED,
    EventKind.STARTED: pb.EVENT_KIND_STARTED,
    EventKind.DELTA: pb.EVENT_KIND_DELTA,
    EventKind.SUCCEEDED: pb.EVENT_KIND_SUCCEEDED,
    EventKind.FAILED: pb.EVENT_KIND_FAILED,
    EventKind.CANCELLED: pb.EVENT_KIND_CANCELLED,
    EventKind.REJECTED: pb.EVENT_KIND_REJECTED,
    EventKind.INTERRUPTED: pb.EVENT_KIND_INTERRUPTED,
}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}

#: The wire values of the terminal statuses and event kinds (the model says which those are).
TERMINAL_STATUSES_PB = frozenset(_STATUS_TO_PB[s] for s in TERMINAL_STATUSES)
TERMINAL_KINDS_PB = frozenset(_KIND_TO_PB[k] for k in EventKind if k.terminal)


def status_to_pb(status: RunStatus) -> pb.RunStatus:
    return _STATUS_TO_PB[status]  # type: ignore[return-value]


def status_from_pb(value: int) -> RunStatus:
    """InvalidRequest for UNSPECIFIED or an unknown number."""
    try:
        return _STATUS_FROM_PB[value]
    except KeyError:
        raise InvalidRequest(f"unknown run status {value}") from None


def kind_from_pb(value: int) -> EventKind:
    """InvalidRequest for UNSPECIFIED or an unknown number."""
    try:
        return _KIND_FROM_PB[value]
    except KeyError:
        raise InvalidRequest(f"unknown event kind {value}") from None


def struct_from_dict(values: Mapping[str, Any]) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(dict(values))
    return struct


def dict_from_struct(struct: struct_pb2.Struct, what: str = "option") -> dict[str, Any]:
    """A plain dict; whole numbers come back as int (Struct only has doubles).
    InvalidRequest naming the key (``what`` and its path) for a number that is NaN or
    infinite, which no engine's JSON can carry."""

    def plain(value: Any, path: str) -> Any:
        if isinstance(value, struct_pb2.Struct):
            return {key: plain(item, f"{path}.{key}") for key, item in value.items()}
        if isinstance(value, struct_pb2.ListValue):
            return [plain(item, f"{path}[{i}]") for i, item in enumerate(value)]
        if isinstance(value, float):
            if not math.isfinite(value):
                raise InvalidRequest(f"{what} {path!r} is {value!r}: numbers must be finite")
            if value.is_integer() and abs(value) < 2**53:
                return int(value)
        return value

    return {key: plain(value, key) for key, value in struct.items()}


def event_to_pb(event: RunEvent) -> pb.RunEvent:
    message = pb.RunEvent(
        run_id=event.run_id,
        seq=event.seq,
        kind=_KIND_TO_PB[event.kind],  # type: ignore[arg-type]
        time=event.time,
        text=event.text,
        reason=event.reason,
        message=event.message,
        retry_after_s=event.retry_after or 0.0,
        tokens=event.tokens,
        replica=event.replica,
    )
    if event.usage is not None:
        message.usage.CopyFrom(usage_to_pb(event.usage))
    return message


_DELTA_PB = pb.EVENT_KIND_DELTA


def merge_deltas(
    events: Iterable[pb.RunEvent], max_text: int = MAX_JOINED_TEXT
) -> list[pb.RunEvent]:
    """``events`` with each run of consecutive DELTA events of one run merged into one.

    A merged delta has the texts joined in order, the sum of their engine
    ``tokens``, and the ``seq`` and ``time`` of its last piece, so a caller that
    resumes ``after_seq`` it misses nothing and gets nothing twice. Status events
    are never merged nor moved; a merged text stays within ``max_text``
    characters (one piece longer than that is kept whole). The messages are
    changed in place; pass ones you own.
    """
    merged: list[pb.RunEvent] = []
    last: pb.RunEvent | None = None
    for event in events:
        if (
            last is not None
            and event.kind == _DELTA_PB
            and last.kind == _DELTA_PB
            and last.run_id == event.run_id
            and len(last.text) + len(event.text) <= max_text
        ):
            last.text += event.text
            last.tokens += event.tokens
            last.seq = event.seq
            last.time = event.time
            continue
        merged.append(event)
        last = event
    return merged


def event_from_pb(message: pb.RunEvent) -> RunEvent:
    usage = usage_from_pb(message.usage) if message.HasField("usage") else None
    return RunEvent(
        run_id=message.run_id,
        seq=message.seq,
        kind=kind_from_pb(message.kind),
        time=message.time,
        text=message.text,
        reason=message.reason,
        message=message.message,
        usage=usage,
        retry_after=message.retry_after_s or None,
        tokens=message.tokens,
        replica=message.replica,
    )


def usage_to_pb(usage: Usage) -> pb.Usage:
    """A count that is None is left out; 0 is sent as 0 (an older peer reads it as None)."""
    message = pb.Usage(
        done_reason=usage.done_reason,
        prompt_estimated=usage.prompt_estimated,
        completion_estimated=usage.completion_estimated,
    )
    if usage.prompt_tokens is not None:
        message.prompt_tokens = usage.prompt_tokens
    if usage.completion_tokens is not None:
        message.completion_tokens = usage.completion_tokens
    return message


def usage_from_pb(message: pb.Usage) -> Usage:
    """A count left out is None; so is an older peer's 0 (it sends no 0, it meant none)."""
    return Usage(
        done_reason=message.done_reason,
        prompt_tokens=message.prompt_tokens if message.HasField("prompt_tokens") else None,
        completion_tokens=(
            message.completion_tokens if message.HasField("completion_tokens") else None
        ),
        prompt_estimated=message.prompt_estimated,
        completion_estimated=message.completion_estimated,
    )


def query_to_pb(query: RunQuery) -> pb.ListRuns:
    """The ListRuns request of ``query`` (a ``tenant`` of None is an absent one)."""
    message = pb.ListRuns(
        statuses=[status_to_pb(s) for s in sorted(query.statuses, key=lambda s: s.value)],
        target=query.target,
        limit=query.limit,
        run_id_prefix=query.run_id_prefix,
    )
    if query.tenant is not None:
        message.tenant = query.tenant
    return message


def query_from_pb(message: pb.ListRuns) -> RunQuery:
    """The query of a ListRuns request: a ``limit`` of 0 is the default (100), an
    absent ``tenant`` any; InvalidRequest for an unknown status."""
    return RunQuery(
        statuses=[status_from_pb(s) for s in message.statuses],
        target=message.target,
        tenant=message.tenant if message.HasField("tenant") else None,
        run_id_prefix=message.run_id_prefix,
        limit=message.limit or 100,
    )


def summary_from_record(record: RunRecord) -> pb.RunSummary:
    summary = pb.RunSummary(
        run_id=record.run_id,
        target=record.target,
        status=status_to_pb(record.status),
        reason=record.reason,
        message=record.message,
        background=record.background,
        created=record.created,
        started=record.started or 0.0,
        finished=record.finished or 0.0,
        last_seq=record.last_seq,
        tenant=record.tenant,
        priority=record.priority,
        retry_after_s=record.retry_after or 0.0,
        replica=record.replica,
    )
    if record.usage is not None:
        summary.usage.CopyFrom(usage_to_pb(record.usage))
    return summary


def limits_to_pb(limits: Limits) -> pb.Limits:
    return pb.Limits(
        concurrency=limits.concurrency,
        max_queued=limits.max_queued,
        queue_timeout_s=limits.queue_timeout,
        adapters={k: v for k, v in limits.adapters.items() if v is not None},
        targets=dict(limits.targets),
        tenants={name: tenant_limits_to_pb(t) for name, t in limits.tenants.items()},
    )


def tenant_limits_to_pb(limits: TenantLimits) -> pb.TenantLimits:
    message = pb.TenantLimits(weight=limits.weight)
    if limits.max_queued is not None:
        message.max_queued = limits.max_queued
    if limits.concurrency is not None:
        message.concurrency = limits.concurrency
    if limits.max_tokens_in_flight is not None:
        message.max_tokens_in_flight = limits.max_tokens_in_flight
    if limits.tokens_per_minute is not None:
        message.tokens_per_minute = limits.tokens_per_minute
    return message


def tenant_limits_from_pb(message: pb.TenantLimits) -> TenantLimits:
    """0 (unset) on the wire is weight 1; a bound left out is no bound."""
    return TenantLimits(
        weight=message.weight or 1.0,
        max_queued=message.max_queued if message.HasField("max_queued") else None,
        concurrency=message.concurrency if message.HasField("concurrency") else None,
        max_tokens_in_flight=(
            message.max_tokens_in_flight if message.HasField("max_tokens_in_flight") else None
        ),
        tokens_per_minute=(
            message.tokens_per_minute if message.HasField("tokens_per_minute") else None
        ),
    )


def hello_from_info(info: NodeInfo) -> pb.Hello:
    hello = pb.Hello(
        node_id=info.node_id,
        version=info.version,
        limits=limits_to_pb(info.limits),
        batches=True,  # this node reads Batch frames
    )
    for target in info.targets:
        hello.targets.append(
            pb.TargetInfo(
                name=target.name,
                adapter=target.adapter,
                model=target.model,
                profile=target.profile,
                concurrency=info.limits.targets.get(target.name, target.concurrency),
                params=struct_from_dict(target.params),
                unavailable=info.unavailable.get(target.name, ""),
            )
        )
    for adapter in info.adapters:
        caps = adapter.capabilities
        entry = pb.AdapterInfo(
            name=adapter.name,
            kind=adapter.kind,
            capabilities=pb.Capabilities(
                max_concurrency=caps.max_concurrency or 0, streaming=caps.streaming, chat=caps.chat
            ),
        )
        if adapter.concurrency is not None:
            entry.concurrency = adapter.concurrency
        hello.adapters.append(entry)
    return hello


def spec_from_request(request: pb.RunRequest) -> RunSpec:
    """The RunSpec a RunRequest asks for; InvalidRequest says what is wrong with it."""
    if not request.target:
        raise InvalidRequest("run request without a target")
    if len(request.prompt) > MAX_PROMPT_CHARS:
        raise InvalidRequest(f"prompt longer than {MAX_PROMPT_CHARS} characters")
    if len(request.messages) > MAX_MESSAGES:
        raise InvalidRequest(f"more than {MAX_MESSAGES} chat messages")
    messages = []
    for i, m in enumerate(request.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(
                f"messages[{i}].role {m.role!r} is not one of {', '.join(sorted(CHAT_ROLES))}"
            )
        messages.append((m.role, m.content))
    if not request.prompt and not messages:
        raise InvalidRequest("run request with neither a prompt nor messages")
    options = dict_from_struct(request.options) if request.HasField("options") else {}
    traceparent, tracestate = _trace_context(request.traceparent, request.tracestate)
    return RunSpec(
        target=request.target,
        prompt=request.prompt,
        messages=tuple(messages),
        background=request.background,
        run_id=request.run_id or None,
        options=options,
        priority=request.priority,
        tenant=request.tenant,
        queue_timeout=(request.queue_timeout_s if request.HasField("queue_timeout_s") else None),
        traceparent=traceparent,
        tracestate=tracestate,
    )


def _trace_context(traceparent: str, tracestate: str) -> tuple[str, str]:
    """The trace context a run keeps of a request's: none if it is over the bounds."""
    if not traceparent or len(traceparent) > MAX_TRACEPARENT:
        return "", ""
    return traceparent, tracestate if len(tracestate) <= MAX_TRACESTATE else ""


def request_from_spec(spec: RunSpec) -> pb.RunRequest:
    """The RunRequest for ``spec``; InvalidRequest for a value the wire cannot carry (a
    priority outside int32, an option JSON cannot hold)."""
    if not -(2**31) <= spec.priority < 2**31:
        raise InvalidRequest(f"priority must be an integer from -1000 to 1000, not {spec.priority}")
    request = pb.RunRequest(
        target=spec.target,
        prompt=spec.prompt,
        background=spec.background,
        run_id=spec.run_id or "",
        priority=spec.priority,
        tenant=spec.tenant,
        traceparent=spec.traceparent,
        tracestate=spec.tracestate,
    )
    if spec.queue_timeout is not None:
        request.queue_timeout_s = spec.queue_timeout
    for role, content in spec.messages:
        request.messages.append(pb.ChatMessage(role=role, content=content))
    if spec.options:
        try:
            request.options.CopyFrom(struct_from_dict(spec.options))
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"the run's options cannot cross the wire: {exc}") from None
    return request
