"""Run stores: where runs and their events are kept."""

from .base import RunStore, StoreError
from .memory import MemoryStore
from .sqlite import SqliteStore, SqliteStoreStatistics

__all__ = ["MemoryStore", "RunStore", "SqliteStore", "SqliteStoreStatistics", "StoreError"]
