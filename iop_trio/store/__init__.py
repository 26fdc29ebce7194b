"""Run stores: where runs and their events are kept.

The package exports the interface; the implementations are imported from
their modules: :mod:`iop_trio.store.sqlite` (the default) and
:mod:`iop_trio.store.memory`.
"""

from .base import (
    RunStore,
    StoreError,
    StoreHealth,
    StoreUnavailable,
    UsageGroup,
    UsageTotal,
    unfinished_usage,
)

__all__ = [
    "RunStore",
    "StoreError",
    "StoreHealth",
    "StoreUnavailable",
    "UsageGroup",
    "UsageTotal",
    "unfinished_usage",
]
