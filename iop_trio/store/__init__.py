"""Run stores: where runs and their events are kept."""

from .base import RunStore, StoreError
from .memory import MemoryStore

__all__ = ["MemoryStore", "RunStore", "StoreError"]
