"""The node's data: runs, their events and statuses, targets, limits, and what can go wrong.

Plain attrs classes and enums that every layer shares (protocol, store,
adapters, runtime, transport). This module imports only attrs, the
standard library and its three helpers below it, whose names it re-exports:
:mod:`iop_trio.tokens` (usage, prompt estimates, the token bucket),
:mod:`iop_trio.options` (the rules of a caller's run options) and
:mod:`iop_trio.checks` (what a limit, a duration or a weight must be). The rules
of how a run moves from one status to another live in :mod:`iop_trio.lifecycle`,
which alone makes events.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from .checks import (
    check_limit,
    check_seconds,
    field_check,
    limit_problem,
    positive_problem,
    seconds_problem,
)
from .options import (
    OPTION_FLOORS,
    PINNED_OPTIONS,
    OptionRange,
    option_range,
    option_rules_problem,
    overlay,
    pinned_problem,
)
from .tokens import (
    CHARS_PER_TOKEN,
    AutoConcurrency,
    EngineSignals,
    Prompted,
    TokenBucket,
    Usage,
    estimate_prompt_tokens,
    prompt_bytes,
    settle_usage,
)

# The values of the tokens, caller options and value checks live in their own modules
# (below this one); they are re-exported here, where every layer imports them from.
__all__ = [
    "CHARS_PER_TOKEN",
    "ENGINE_RETRY_AFTER",
    "LIVE_STATUSES",
    "MAX_JOINED_TEXT",
    "MAX_OUTPUT_TOKENS",
    "MAX_RETRY_AFTER",
    "MIN_RETRY_AFTER",
    "OPTION_FLOORS",
    "PINNED_OPTIONS",
    "REJECT_REASONS",
    "TENANT_NAME",
    "TERMINAL_STATUSES",
    "TOKENIZERS",
    "AdapterInfo",
    "AutoConcurrency",
    "Capabilities",
    "EngineSignals",
    "EventKind",
    "InvalidRequest",
    "Limits",
    "NodeInfo",
    "NodeUnavailable",
    "OptionRange",
    "Prompted",
    "RejectReason",
    "RunEvent",
    "RunRecord",
    "RunSpec",
    "RunStatus",
    "TargetSpec",
    "TenantLimits",
    "TokenBucket",
    "UnknownRun",
    "UnknownTarget",
    "Usage",
    "check_limit",
    "check_seconds",
    "check_tenant_limits",
    "clamp_retry_after",
    "estimate_prompt_tokens",
    "field_check",
    "limit_problem",
    "option_range",
    "option_rules_problem",
    "overlay",
    "pinned_problem",
    "positive_problem",
    "prompt_bytes",
    "redact_url",
    "seconds_problem",
    "settle_usage",
    "tenant_problem",
]

# --- statuses and events ---------------------------------------------------------------------


class RunStatus(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    INTERRUPTED = "interrupted"

    @property
    def terminal(self) -> bool:
        """True for the statuses a run never leaves (every status but QUEUED and RUNNING)."""
        return self not in LIVE_STATUSES

    @property
    def event_kind(self) -> EventKind:
        """The kind of the event that moves a run to this status."""
        return _KIND_OF_STATUS[self]


#: The statuses of a run that has not ended; every other status is terminal.
LIVE_STATUSES = frozenset({RunStatus.QUEUED, RunStatus.RUNNING})
TERMINAL_STATUSES = frozenset(RunStatus) - LIVE_STATUSES


class EventKind(enum.Enum):
    QUEUED = "queued"
    STARTED = "started"
    DELTA = "delta"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    INTERRUPTED = "interrupted"

    @property
    def status(self) -> RunStatus | None:
        """The status this event moves the run to; None for DELTA."""
        return _STATUS_OF_KIND.get(self)

    @property
    def terminal(self) -> bool:
        status = self.status
        return status is not None and status.terminal


_KIND_OF_STATUS: Mapping[RunStatus, EventKind] = {
    RunStatus.QUEUED: EventKind.QUEUED,
    RunStatus.RUNNING: EventKind.STARTED,
    RunStatus.SUCCEEDED: EventKind.SUCCEEDED,
    RunStatus.FAILED: EventKind.FAILED,
    RunStatus.CANCELLED: EventKind.CANCELLED,
    RunStatus.REJECTED: EventKind.REJECTED,
    RunStatus.INTERRUPTED: EventKind.INTERRUPTED,
}
_STATUS_OF_KIND: Mapping[EventKind, RunStatus] = {k: s for s, k in _KIND_OF_STATUS.items()}


class RejectReason(enum.Enum):
    """Why the gate turned a run away: its queue was full, it waited its queue timeout,
    it reserves more tokens than a budget it needs holds at all (``too_large``: it can
    never start), or its tenant's token rate or tokens in flight kept it out
    (``rate_limited``)."""

    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    TOO_LARGE = "too_large"
    RATE_LIMITED = "rate_limited"


#: Reasons a REJECTED event may carry; other terminal events take free-form reasons.
REJECT_REASONS = frozenset(r.value for r in RejectReason)

#: Bounds on a retry hint, in seconds: the gate's own, and an engine's ``Retry-After``.
MIN_RETRY_AFTER = 0.1
MAX_RETRY_AFTER = 3600.0
#: The retry hint (seconds) of an engine's 429 or 503 that gives no ``Retry-After`` (or
#: one that is no number of seconds nor a date): the status itself says to ask again
#: later, and a caller is never left without a hint (the gate's before it has seen a
#: grant is the same). Also the hint of a run no replica of its adapter could take.
ENGINE_RETRY_AFTER = 1.0


def clamp_retry_after(seconds: float) -> float:
    """``seconds`` within :data:`MIN_RETRY_AFTER` .. :data:`MAX_RETRY_AFTER`, to a tenth
    of a second: a negative hint gives the least, an infinite one the most. NaN is no
    number of seconds: ValueError (a caller that may meet one decides what it means)."""
    if math.isnan(seconds):
        raise ValueError("a retry hint cannot be NaN")
    return round(min(MAX_RETRY_AFTER, max(MIN_RETRY_AFTER, seconds)), 1)


#: The most text (characters) of a delta joined of several pieces (by a run from what its
#: engine sent at once, or on the wire from deltas that waited), so its frame stays far
#: below max_message_size; one piece longer than that is kept whole.
MAX_JOINED_TEXT = 64 * 1024


@attrs.frozen
class RunEvent:
    """One entry of a run's event log. ``seq`` starts at 1 and has no gaps.

    Made only by :class:`iop_trio.lifecycle.RunState` (and decoded from the
    wire or the store).
    """

    run_id: str
    seq: int
    kind: EventKind
    time: float
    text: str = ""
    reason: str = ""
    message: str = ""
    # the end of a run that started: its tokens (see Usage); None for any other event
    usage: Usage | None = None
    # REJECTED: when a run like it would likely get in; FAILED: when its engine said to
    # ask again (its 429 or 503)
    retry_after: float | None = None
    # DELTA: the engine tokens its text holds (one an engine chunk; see adapters.Delta);
    # 0 for every other event
    tokens: int = 0
    # STARTED: the replica the run was sent to; the end of a run that started: the one it
    # ended on (another after a failover); "" for any other event, or an adapter with none
    replica: str = ""

    @property
    def status(self) -> RunStatus | None:
        return self.kind.status

    def __repr__(self) -> str:
        extra = ""
        if self.text:
            extra += f" text={self.text!r}"
        if self.kind is EventKind.DELTA and self.tokens != 1:
            extra += f" tokens={self.tokens}"
        if self.reason:
            extra += f" reason={self.reason}"
        if self.usage is not None:
            extra += f" {self.usage!r}"
        return f"<RunEvent {self.run_id}#{self.seq} {self.kind.value}{extra}>"


@attrs.define
class RunRecord:
    """A run as the store keeps it. ``status`` always equals the last status event.

    Changed only by :func:`iop_trio.lifecycle.fold`, one event at a time.
    """

    run_id: str
    target: str
    status: RunStatus
    background: bool
    created: float
    prompt: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    options: Mapping[str, Any] = attrs.field(factory=dict)
    started: float | None = None
    finished: float | None = None
    reason: str = ""
    message: str = ""
    last_seq: int = 0
    usage: Usage | None = None
    tenant: str = ""
    priority: int = 0
    retry_after: float | None = None
    # the replica (its URL without credentials) that ran it, as its last event that named
    # one said; "" if none did (it never started, or its adapter has no replicas)
    replica: str = ""

    def __repr__(self) -> str:
        reason = f"({self.reason})" if self.reason else ""
        mode = "bg" if self.background else "fg"
        return (
            f"<RunRecord {self.run_id} {self.target} {self.status.value}{reason} "
            f"{mode} seq={self.last_seq}>"
        )


def _status_set(statuses: Iterable[RunStatus]) -> frozenset[RunStatus]:
    return frozenset(statuses)


@attrs.frozen(repr=False)
class RunQuery:
    """Which runs a listing (``list_runs``) gives, newest (last created) first.

    A run is listed if its status is one of ``statuses`` (empty: any), its target is
    ``target`` ("": any), its tenant is ``tenant`` (None: any; "" is the default
    tenant) and its id starts with ``run_id_prefix`` ("": any); at most ``limit``
    runs, none for ``limit`` <= 0. ``statuses`` may be any iterable; it is kept as a
    frozenset.
    """

    statuses: frozenset[RunStatus] = attrs.field(default=frozenset(), converter=_status_set)
    target: str = ""
    tenant: str | None = None
    run_id_prefix: str = ""
    limit: int = 100

    def __repr__(self) -> str:
        shown = [f"statuses={sorted(s.value for s in self.statuses)}"] if self.statuses else []
        shown += [f"target={self.target!r}"] if self.target else []
        shown += [f"tenant={self.tenant!r}"] if self.tenant is not None else []
        shown += [f"run_id_prefix={self.run_id_prefix!r}"] if self.run_id_prefix else []
        return f"<RunQuery {' '.join([*shown, f'limit={self.limit}'])}>"

    def matches(self, record: RunRecord) -> bool:
        """Whether ``record`` is one of the runs asked for (``limit`` aside)."""
        return (
            (not self.statuses or record.status in self.statuses)
            and (not self.target or record.target == self.target)
            and (self.tenant is None or record.tenant == self.tenant)
            and record.run_id.startswith(self.run_id_prefix)
        )


#: The listing with no arguments: the newest 100 runs, of any status, target or tenant.
LATEST_RUNS = RunQuery()


# --- what callers ask for --------------------------------------------------------------------


@attrs.frozen
class RunSpec:
    """What a caller asks for. ``messages`` (role, content) make a chat run.

    ``priority``: higher starts first. ``tenant``: who the run is for ("" is the
    default tenant); tenants share a target fairly by weight. ``queue_timeout``:
    the caller's own bound on waiting (the smaller of it and the target's applies).
    ``traceparent``/``tracestate``: the W3C trace context of the caller's span, the
    parent of the run's spans ("": none, a new trace starts; a malformed one is none).
    """

    target: str
    prompt: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    background: bool = False
    run_id: str | None = None
    options: Mapping[str, Any] = attrs.field(factory=dict)
    priority: int = 0
    tenant: str = ""
    queue_timeout: float | None = None
    traceparent: str = ""
    tracestate: str = ""


#: Where a target's runs' prompt tokens are counted at admission: the node's estimate
#: (:func:`estimate_prompt_tokens`), or the engine's own tokenizer (``POST /tokenize``
#: as vLLM takes it, with the messages, or as llama.cpp's server does, with the content).
TOKENIZERS = frozenset({"estimate", "vllm", "llamacpp"})
#: The most output tokens a run reserves when neither it, its target's caps nor its
#: target's ``max_output_tokens`` say (``runtime.max_output_tokens``).
MAX_OUTPUT_TOKENS = 1024


def _names_or_none(names: Iterable[str] | None) -> frozenset[str] | None:
    return None if names is None else frozenset(names)


@attrs.frozen
class TargetSpec:
    """A target: an adapter namespace, a model and the profile settings runs get.

    Its name is ``adapter/model``, or ``adapter/model@profile`` when a profile
    is named, so one model can be served under several profiles. A run of it
    is refused (InvalidRequest) if its prompt and messages are over
    ``max_prompt_bytes`` of UTF-8, and ends FAILED with ``output_limit`` once
    its output passes ``max_output_bytes``, or with ``run_timeout`` if it
    runs for more than ``max_run_time`` seconds (queue wait not counted).
    A caller's run options are limited to ``allow_options`` and capped by
    ``option_caps`` (see :meth:`caller_options`); the profile's ``params`` are
    the operator's and may set anything.
    """

    adapter: str
    model: str
    profile: str = ""
    concurrency: int = 1
    max_queued: int | None = None
    queue_timeout: float | None = None
    params: Mapping[str, Any] = attrs.field(factory=dict)
    # a run's bounds; None takes the node's (RuntimeLimits), which may be None: no bound
    max_prompt_bytes: int | None = None
    max_output_bytes: int | None = None
    max_run_time: float | None = None
    # what callers may set (see caller_options); None takes the adapter's default
    allow_options: frozenset[str] | None = attrs.field(default=None, converter=_names_or_none)
    option_caps: Mapping[str, float | Mapping[str, float]] = attrs.field(factory=dict)
    # tokens: the most its runs reserve at once (None: no budget), the most output a run
    # reserves when it asks for no bound (None: the node's), how prompt tokens are counted
    token_budget: int | None = None
    max_output_tokens: int | None = None
    tokenizer: str = "estimate"
    chars_per_token: float | None = None  # None: the node's (runtime.chars_per_token)
    #: a learned concurrency instead of ``concurrency`` (None: ``concurrency`` is the limit)
    auto: AutoConcurrency | None = None

    @property
    def name(self) -> str:
        base = f"{self.adapter}/{self.model}"
        return f"{base}@{self.profile}" if self.profile else base

    def params_for(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The params a run gets: the profile's ``params`` with the run's ``options`` on top."""
        return overlay(self.params, options)

    def caller_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` as a caller may give them for this target, capped; InvalidRequest
        naming the first option a caller may not set.

        A caller may set the keys in ``allow_options`` (resolved: the node fills in the
        adapter's default), and a key inside a mapping option as ``"outer.inner"``
        (``"extra_body.min_p"``); never the keys in :data:`PINNED_OPTIONS`. No number in
        an option (however deep) may be NaN or infinite. A capped option
        (``option_caps``, see :func:`option_range`) must be a number: one under the
        range's low end is refused, one over its high end is lowered to it, and a run
        that sets none (nor the profile) gets the high end, so a cap on ``max_tokens``
        bounds every run.
        """
        allowed = self.allow_options or frozenset()
        given: dict[str, Any] = {}
        for key, value in options.items():
            _check_finite(self, key, value)
            if isinstance(value, Mapping):
                inner = {}
                for sub, sub_value in value.items():
                    _check_option(self, allowed, f"{key}.{sub}", sub)
                    inner[sub] = _capped(self, f"{key}.{sub}", sub_value)
                given[key] = inner
            else:
                _check_option(self, allowed, key, key)
                given[key] = _capped(self, key, value)
        for name, cap in self.option_caps.items():
            high = option_range(name, cap).high
            if high is None:
                continue
            outer, _, inner_key = name.partition(".")
            profile = self.params.get(outer)
            if inner_key:
                if inner_key not in given.get(outer, {}) and not (
                    isinstance(profile, Mapping) and inner_key in profile
                ):
                    given[outer] = {**given.get(outer, {}), inner_key: _as_given(high)}
            elif outer not in given and profile is None:
                given[outer] = _as_given(high)
        return given


def _check_option(target: TargetSpec, allowed: frozenset[str], name: str, leaf: str) -> None:
    if leaf in PINNED_OPTIONS or name not in allowed:
        may = ", ".join(sorted(allowed)) or "none"
        raise InvalidRequest(
            f"option {name!r} may not be set by a caller on {target.name} (allowed: {may})"
        )


def _check_finite(target: TargetSpec, name: str, value: Any) -> None:
    """InvalidRequest naming ``name`` if a number in ``value`` (however deep) is NaN or
    infinite: no engine's JSON can carry one. The walk is iterative and bounded."""
    stack: list[Any] = [value]
    seen = 0
    while stack and seen < 100_000:
        item = stack.pop()
        seen += 1
        if isinstance(item, float) and not math.isfinite(item):
            raise InvalidRequest(
                f"option {name!r} on {target.name} holds {item!r}: numbers must be finite"
            )
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)


def _as_given(bound: float) -> int | float:
    return int(bound) if float(bound).is_integer() else bound


def _capped(target: TargetSpec, name: str, value: Any) -> Any:
    cap = target.option_caps.get(name)
    if cap is None:
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"option {name!r} must be a number, not {value!r}")
    bounds = option_range(name, cap)
    if value < bounds.low:
        raise InvalidRequest(
            f"option {name!r} must be at least {bounds.low:g} on {target.name}, not {value!r}"
        )
    if bounds.high is not None and value > bounds.high:
        high = bounds.high
        return int(high) if isinstance(value, int) and float(high).is_integer() else high
    return value


# --- what a node says about itself -----------------------------------------------------------


@attrs.frozen
class Capabilities:
    """What an adapter can do. ``max_concurrency`` None = no bound of its own."""

    max_concurrency: int | None = None
    streaming: bool = True
    chat: bool = True


@attrs.frozen
class TenantLimits:
    """A tenant's share: its fair-queueing ``weight`` (> 0), and optional bounds on its
    waiting runs (node-wide), on its runs at once, on the tokens its runs reserve at
    once (``max_tokens_in_flight``) and on the tokens it may reserve a minute
    (``tokens_per_minute``, a token bucket of a minute's worth, charged on reservation
    and corrected at settlement). A tenant not set has these."""

    weight: float = 1.0
    max_queued: int | None = None
    concurrency: int | None = None
    max_tokens_in_flight: int | None = None
    tokens_per_minute: float | None = None


def redact_url(url: str) -> str:
    """``url`` with any user name and password in it replaced by ``***`` (for messages,
    logs and stored errors)."""
    return re.sub(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]*@", r"\1***@", url)


#: A tenant's name: what a config key, a store column and a metric label can hold.
TENANT_NAME = re.compile(r"[A-Za-z0-9_.:@-]{0,128}")


def tenant_problem(name: object) -> str | None:
    """What is wrong with ``name`` as a tenant's name ("" is the default tenant), or None."""
    if isinstance(name, str) and TENANT_NAME.fullmatch(name):
        return None
    return f"tenant {name!r} must be up to 128 characters of A-Z a-z 0-9 _ . : @ -"


def check_tenant_limits(name: str, limits: TenantLimits) -> TenantLimits:
    """``limits`` if they can be a tenant's share (weight a finite number > 0, bounds
    limits or None), else ValueError naming the tenant."""
    problem = tenant_problem(name)
    if problem is not None:
        raise ValueError(problem)
    weight_problem = positive_problem(limits.weight)
    if weight_problem is not None:
        raise ValueError(f"tenant {name!r} weight {weight_problem}")
    if limits.max_queued is not None:
        check_limit(f"tenant {name!r} max_queued", limits.max_queued)
    if limits.concurrency is not None:
        check_limit(f"tenant {name!r} concurrency", limits.concurrency)
    if limits.max_tokens_in_flight is not None:
        check_limit(f"tenant {name!r} max_tokens_in_flight", limits.max_tokens_in_flight, 1)
    if limits.tokens_per_minute is not None:
        rate_problem = positive_problem(limits.tokens_per_minute)
        if rate_problem is not None:
            raise ValueError(f"tenant {name!r} tokens_per_minute {rate_problem}")
    return limits


@attrs.frozen
class Limits:
    """The limits in force. An adapter mapped to None has no bound of its own; tenants
    lists those whose share was set."""

    concurrency: int
    max_queued: int
    queue_timeout: float
    adapters: Mapping[str, int | None]
    targets: Mapping[str, int]
    tenants: Mapping[str, TenantLimits] = attrs.field(factory=dict)


@attrs.frozen
class AdapterInfo:
    name: str
    kind: str
    concurrency: int | None  # in force; None = unbounded
    capabilities: Capabilities


@attrs.frozen
class NodeInfo:
    """What a node tells an edge in its Hello."""

    node_id: str
    version: str
    targets: tuple[TargetSpec, ...]
    adapters: tuple[AdapterInfo, ...]
    limits: Limits
    #: target name -> why its engine cannot serve it now (absent: available)
    unavailable: Mapping[str, str] = attrs.field(factory=dict)


# --- what can go wrong -----------------------------------------------------------------------


class InvalidRequest(ValueError):
    """A request with bad values (the message says which); nothing was changed."""


class UnknownTarget(KeyError):
    """No target of that name is configured."""

    def __str__(self) -> str:
        return f"unknown target {self.args[0]!r}"


class UnknownRun(KeyError):
    """No run of that id is known."""

    def __str__(self) -> str:
        return f"unknown run {self.args[0]!r}"


class NodeUnavailable(Exception):
    """The node is draining or stopped and admits no new runs."""
