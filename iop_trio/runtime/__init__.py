"""The node runtime: gate, run manager, node. Independent of any transport.

The data it works on (:mod:`iop_trio.model`) and the lifecycle rules
(:mod:`iop_trio.lifecycle`) are re-exported here, so a user of the runtime
needs one import.
"""

from ..lifecycle import TRANSITIONS, IllegalTransition, RunState
from ..model import (
    EventKind,
    InvalidRequest,
    Limits,
    NodeInfo,
    NodeUnavailable,
    RejectReason,
    RunEvent,
    RunRecord,
    RunSpec,
    RunStatus,
    TargetSpec,
    TenantLimits,
    UnknownRun,
    UnknownTarget,
    Usage,
)
from .gate import Gate, GateRejected, GateStatistics, Permit
from .live import RunWatcher
from .manager import CancelOutcome, RunManager, Submitted
from .node import AdapterSlot, Node, ReplicaSlot, RuntimeLimits

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
    "ReplicaSlot",
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
    "TenantLimits",
    "UnknownRun",
    "UnknownTarget",
    "Usage",
]
