"""The node runtime: lifecycle, gate, run manager, node. Independent of any transport."""

from .gate import Gate, GateRejected, GateStatistics, Permit, UnknownTarget
from .lifecycle import (
    TRANSITIONS,
    EventKind,
    IllegalTransition,
    RejectReason,
    RunEvent,
    RunRecord,
    RunState,
    RunStatus,
    Usage,
)
from .manager import (
    CancelOutcome,
    InvalidRequest,
    NodeUnavailable,
    RunManager,
    RunSpec,
    RunWatcher,
    Submitted,
    TargetSpec,
    UnknownRun,
)
from .node import AdapterSlot, Limits, Node, NodeInfo, RuntimeLimits

__all__ = [
    "TRANSITIONS",
    "AdapterSlot",
    "CancelOutcome",
    "EventKind",
    "Gate",
    "GateRejected",
    "GateStatistics",
    "IllegalTransition",
    "InvalidRequest",
    "Limits",
    "Node",
    "NodeInfo",
    "NodeUnavailable",
    "Permit",
    "RejectReason",
    "RunEvent",
    "RunManager",
    "RunRecord",
    "RunSpec",
    "RunState",
    "RunStatus",
    "RunWatcher",
    "RuntimeLimits",
    "Submitted",
    "TargetSpec",
    "UnknownRun",
    "UnknownTarget",
    "Usage",
]
