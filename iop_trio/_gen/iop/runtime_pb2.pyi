from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATUS_UNSPECIFIED: _ClassVar[RunStatus]
    RUN_STATUS_QUEUED: _ClassVar[RunStatus]
    RUN_STATUS_RUNNING: _ClassVar[RunStatus]
    RUN_STATUS_SUCCEEDED: _ClassVar[RunStatus]
    RUN_STATUS_FAILED: _ClassVar[RunStatus]
    RUN_STATUS_CANCELLED: _ClassVar[RunStatus]
    RUN_STATUS_REJECTED: _ClassVar[RunStatus]
    RUN_STATUS_INTERRUPTED: _ClassVar[RunStatus]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_QUEUED: _ClassVar[EventKind]
    EVENT_KIND_STARTED: _ClassVar[EventKind]
    EVENT_KIND_DELTA: _ClassVar[EventKind]
    EVENT_KIND_SUCCEEDED: _ClassVar[EventKind]
    EVENT_KIND_FAILED: _ClassVar[EventKind]
    EVENT_KIND_CANCELLED: _ClassVar[EventKind]
    EVENT_KIND_REJECTED: _ClassVar[EventKind]
    EVENT_KIND_INTERRUPTED: _ClassVar[EventKind]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_MALFORMED: _ClassVar[ErrorCode]
    ERROR_CODE_UNEXPECTED: _ClassVar[ErrorCode]
    ERROR_CODE_UNKNOWN_TARGET: _ClassVar[ErrorCode]
    ERROR_CODE_UNKNOWN_RUN: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID: _ClassVar[ErrorCode]
    ERROR_CODE_UNAVAILABLE: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
    ERROR_CODE_STORE_UNAVAILABLE: _ClassVar[ErrorCode]
    ERROR_CODE_FORBIDDEN: _ClassVar[ErrorCode]
    ERROR_CODE_RATE_LIMITED: _ClassVar[ErrorCode]
RUN_STATUS_UNSPECIFIED: RunStatus
RUN_STATUS_QUEUED: RunStatus
RUN_STATUS_RUNNING: RunStatus
RUN_STATUS_SUCCEEDED: RunStatus
RUN_STATUS_FAILED: RunStatus
RUN_STATUS_CANCELLED: RunStatus
RUN_STATUS_REJECTED: RunStatus
RUN_STATUS_INTERRUPTED: RunStatus
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_QUEUED: EventKind
EVENT_KIND_STARTED: EventKind
EVENT_KIND_DELTA: EventKind
EVENT_KIND_SUCCEEDED: EventKind
EVENT_KIND_FAILED: EventKind
EVENT_KIND_CANCELLED: EventKind
EVENT_KIND_REJECTED: EventKind
EVENT_KIND_INTERRUPTED: EventKind
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_MALFORMED: ErrorCode
ERROR_CODE_UNEXPECTED: ErrorCode
ERROR_CODE_UNKNOWN_TARGET: ErrorCode
ERROR_CODE_UNKNOWN_RUN: ErrorCode
ERROR_CODE_INVALID: ErrorCode
ERROR_CODE_UNAVAILABLE: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode
ERROR_CODE_STORE_UNAVAILABLE: ErrorCode
ERROR_CODE_FORBIDDEN: ErrorCode
ERROR_CODE_RATE_LIMITED: ErrorCode

class Envelope(_message.Message):
    __slots__ = ("nonce", "reply_to", "answer_within_s", "hello", "hello_ack", "run_request", "run_accepted", "run_event", "cancel_run", "cancel_result", "get_run", "run_info", "list_runs", "run_list", "set_limits", "error", "ping", "pong", "limits", "batch")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    ANSWER_WITHIN_S_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HELLO_ACK_FIELD_NUMBER: _ClassVar[int]
    RUN_REQUEST_FIELD_NUMBER: _ClassVar[int]
    RUN_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    RUN_EVENT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_RUN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_RESULT_FIELD_NUMBER: _ClassVar[int]
    GET_RUN_FIELD_NUMBER: _ClassVar[int]
    RUN_INFO_FIELD_NUMBER: _ClassVar[int]
    LIST_RUNS_FIELD_NUMBER: _ClassVar[int]
    RUN_LIST_FIELD_NUMBER: _ClassVar[int]
    SET_LIMITS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    PONG_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    nonce: int
    reply_to: int
    answer_within_s: float
    hello: Hello
    hello_ack: HelloAck
    run_request: RunRequest
    run_accepted: RunAccepted
    run_event: RunEvent
    cancel_run: CancelRun
    cancel_result: CancelResult
    get_run: GetRun
    run_info: RunInfo
    list_runs: ListRuns
    run_list: RunList
    set_limits: SetLimits
    error: Error
    ping: Ping
    pong: Pong
    limits: Limits
    batch: Batch
    def __init__(self, nonce: _Optional[int] = ..., reply_to: _Optional[int] = ..., answer_within_s: _Optional[float] = ..., hello: _Optional[_Union[Hello, _Mapping]] = ..., hello_ack: _Optional[_Union[HelloAck, _Mapping]] = ..., run_request: _Optional[_Union[RunRequest, _Mapping]] = ..., run_accepted: _Optional[_Union[RunAccepted, _Mapping]] = ..., run_event: _Optional[_Union[RunEvent, _Mapping]] = ..., cancel_run: _Optional[_Union[CancelRun, _Mapping]] = ..., cancel_result: _Optional[_Union[CancelResult, _Mapping]] = ..., get_run: _Optional[_Union[GetRun, _Mapping]] = ..., run_info: _Optional[_Union[RunInfo, _Mapping]] = ..., list_runs: _Optional[_Union[ListRuns, _Mapping]] = ..., run_list: _Optional[_Union[RunList, _Mapping]] = ..., set_limits: _Optional[_Union[SetLimits, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., ping: _Optional[_Union[Ping, _Mapping]] = ..., pong: _Optional[_Union[Pong, _Mapping]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., batch: _Optional[_Union[Batch, _Mapping]] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("envelopes",)
    ENVELOPES_FIELD_NUMBER: _ClassVar[int]
    envelopes: _containers.RepeatedCompositeFieldContainer[Envelope]
    def __init__(self, envelopes: _Optional[_Iterable[_Union[Envelope, _Mapping]]] = ...) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("max_concurrency", "streaming", "chat")
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    max_concurrency: int
    streaming: bool
    chat: bool
    def __init__(self, max_concurrency: _Optional[int] = ..., streaming: _Optional[bool] = ..., chat: _Optional[bool] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "kind", "concurrency", "capabilities")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    concurrency: int
    capabilities: Capabilities
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., concurrency: _Optional[int] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ...) -> None: ...

class TargetInfo(_message.Message):
    __slots__ = ("name", "adapter", "model", "profile", "concurrency", "params", "unavailable")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    adapter: str
    model: str
    profile: str
    concurrency: int
    params: _struct_pb2.Struct
    unavailable: str
    def __init__(self, name: _Optional[str] = ..., adapter: _Optional[str] = ..., model: _Optional[str] = ..., profile: _Optional[str] = ..., concurrency: _Optional[int] = ..., params: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., unavailable: _Optional[str] = ...) -> None: ...

class TenantLimits(_message.Message):
    __slots__ = ("weight", "max_queued", "concurrency", "max_tokens_in_flight", "tokens_per_minute")
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    weight: float
    max_queued: int
    concurrency: int
    max_tokens_in_flight: int
    tokens_per_minute: float
    def __init__(self, weight: _Optional[float] = ..., max_queued: _Optional[int] = ..., concurrency: _Optional[int] = ..., max_tokens_in_flight: _Optional[int] = ..., tokens_per_minute: _Optional[float] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("concurrency", "max_queued", "queue_timeout_s", "adapters", "targets", "tenants")
    class AdaptersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TargetsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TenantsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TenantLimits
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TenantLimits, _Mapping]] = ...) -> None: ...
    CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    concurrency: int
    max_queued: int
    queue_timeout_s: float
    adapters: _containers.ScalarMap[str, int]
    targets: _containers.ScalarMap[str, int]
    tenants: _containers.MessageMap[str, TenantLimits]
    def __init__(self, concurrency: _Optional[int] = ..., max_queued: _Optional[int] = ..., queue_timeout_s: _Optional[float] = ..., adapters: _Optional[_Mapping[str, int]] = ..., targets: _Optional[_Mapping[str, int]] = ..., tenants: _Optional[_Mapping[str, TenantLimits]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("node_id", "version", "targets", "adapters", "limits", "batches")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    version: str
    targets: _containers.RepeatedCompositeFieldContainer[TargetInfo]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    limits: Limits
    batches: bool
    def __init__(self, node_id: _Optional[str] = ..., version: _Optional[str] = ..., targets: _Optional[_Iterable[_Union[TargetInfo, _Mapping]]] = ..., adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., batches: _Optional[bool] = ...) -> None: ...

class HelloAck(_message.Message):
    __slots__ = ("edge_id", "session_id", "batches")
    EDGE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    edge_id: str
    session_id: str
    batches: bool
    def __init__(self, edge_id: _Optional[str] = ..., session_id: _Optional[str] = ..., batches: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("target", "prompt", "messages", "background", "run_id", "options", "priority", "tenant", "queue_timeout_s", "traceparent", "tracestate")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    target: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    background: bool
    run_id: str
    options: _struct_pb2.Struct
    priority: int
    tenant: str
    queue_timeout_s: float
    traceparent: str
    tracestate: str
    def __init__(self, target: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., background: _Optional[bool] = ..., run_id: _Optional[str] = ..., options: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., priority: _Optional[int] = ..., tenant: _Optional[str] = ..., queue_timeout_s: _Optional[float] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ...) -> None: ...

class RunAccepted(_message.Message):
    __slots__ = ("run_id", "status", "existing")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EXISTING_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    status: RunStatus
    existing: bool
    def __init__(self, run_id: _Optional[str] = ..., status: _Optional[_Union[RunStatus, str]] = ..., existing: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("done_reason", "prompt_tokens", "completion_tokens", "prompt_estimated", "completion_estimated")
    DONE_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ESTIMATED_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_ESTIMATED_FIELD_NUMBER: _ClassVar[int]
    done_reason: str
    prompt_tokens: int
    completion_tokens: int
    prompt_estimated: bool
    completion_estimated: bool
    def __init__(self, done_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., prompt_estimated: _Optional[bool] = ..., completion_estimated: _Optional[bool] = ...) -> None: ...

class RunEvent(_message.Message):
    __slots__ = ("run_id", "seq", "kind", "time", "text", "reason", "message", "usage", "retry_after_s", "tokens", "replica")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    seq: int
    kind: EventKind
    time: float
    text: str
    reason: str
    message: str
    usage: Usage
    retry_after_s: float
    tokens: int
    replica: str
    def __init__(self, run_id: _Optional[str] = ..., seq: _Optional[int] = ..., kind: _Optional[_Union[EventKind, str]] = ..., time: _Optional[float] = ..., text: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., retry_after_s: _Optional[float] = ..., tokens: _Optional[int] = ..., replica: _Optional[str] = ...) -> None: ...

class CancelRun(_message.Message):
    __slots__ = ("run_id", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelResult(_message.Message):
    __slots__ = ("run_id", "status", "cancelled")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    status: RunStatus
    cancelled: bool
    def __init__(self, run_id: _Optional[str] = ..., status: _Optional[_Union[RunStatus, str]] = ..., cancelled: _Optional[bool] = ...) -> None: ...

class GetRun(_message.Message):
    __slots__ = ("run_id", "include_events", "after_seq", "follow")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    include_events: bool
    after_seq: int
    follow: bool
    def __init__(self, run_id: _Optional[str] = ..., include_events: _Optional[bool] = ..., after_seq: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class RunSummary(_message.Message):
    __slots__ = ("run_id", "target", "status", "reason", "message", "background", "created", "started", "finished", "last_seq", "tenant", "priority", "retry_after_s", "usage", "replica")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    target: str
    status: RunStatus
    reason: str
    message: str
    background: bool
    created: float
    started: float
    finished: float
    last_seq: int
    tenant: str
    priority: int
    retry_after_s: float
    usage: Usage
    replica: str
    def __init__(self, run_id: _Optional[str] = ..., target: _Optional[str] = ..., status: _Optional[_Union[RunStatus, str]] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., background: _Optional[bool] = ..., created: _Optional[float] = ..., started: _Optional[float] = ..., finished: _Optional[float] = ..., last_seq: _Optional[int] = ..., tenant: _Optional[str] = ..., priority: _Optional[int] = ..., retry_after_s: _Optional[float] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., replica: _Optional[str] = ...) -> None: ...

class RunInfo(_message.Message):
    __slots__ = ("run", "events", "more_events")
    RUN_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    MORE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    run: RunSummary
    events: _containers.RepeatedCompositeFieldContainer[RunEvent]
    more_events: bool
    def __init__(self, run: _Optional[_Union[RunSummary, _Mapping]] = ..., events: _Optional[_Iterable[_Union[RunEvent, _Mapping]]] = ..., more_events: _Optional[bool] = ...) -> None: ...

class ListRuns(_message.Message):
    __slots__ = ("statuses", "target", "limit", "tenant", "run_id_prefix")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_PREFIX_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[RunStatus]
    target: str
    limit: int
    tenant: str
    run_id_prefix: str
    def __init__(self, statuses: _Optional[_Iterable[_Union[RunStatus, str]]] = ..., target: _Optional[str] = ..., limit: _Optional[int] = ..., tenant: _Optional[str] = ..., run_id_prefix: _Optional[str] = ...) -> None: ...

class RunList(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunSummary]
    def __init__(self, runs: _Optional[_Iterable[_Union[RunSummary, _Mapping]]] = ...) -> None: ...

class SetLimits(_message.Message):
    __slots__ = ("concurrency", "max_queued", "queue_timeout_s", "adapters", "targets", "tenants", "node_id")
    class AdaptersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TargetsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TenantsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TenantLimits
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TenantLimits, _Mapping]] = ...) -> None: ...
    CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    concurrency: int
    max_queued: int
    queue_timeout_s: float
    adapters: _containers.ScalarMap[str, int]
    targets: _containers.ScalarMap[str, int]
    tenants: _containers.MessageMap[str, TenantLimits]
    node_id: str
    def __init__(self, concurrency: _Optional[int] = ..., max_queued: _Optional[int] = ..., queue_timeout_s: _Optional[float] = ..., adapters: _Optional[_Mapping[str, int]] = ..., targets: _Optional[_Mapping[str, int]] = ..., tenants: _Optional[_Mapping[str, TenantLimits]] = ..., node_id: _Optional[str] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message", "retry_after_s")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    retry_after_s: float
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ("time",)
    TIME_FIELD_NUMBER: _ClassVar[int]
    time: float
    def __init__(self, time: _Optional[float] = ...) -> None: ...

class Pong(_message.Message):
    __slots__ = ("time",)
    TIME_FIELD_NUMBER: _ClassVar[int]
    time: float
    def __init__(self, time: _Optional[float] = ...) -> None: ...
