"""Adapters: the engines a node runs on.

The package exports the adapter contract and the registry of kinds; the
adapters themselves are imported from their modules:
:mod:`~iop_trio.adapters.echo`, :mod:`~iop_trio.adapters.ollama`,
:mod:`~iop_trio.adapters.openai`.
"""

from ..model import Capabilities, Usage
from .base import Adapter, AdapterError, AdapterRequest, Chunk, Completion, Delta
from .registry import AdapterRegistry, default_registry

__all__ = [
    "Adapter",
    "AdapterError",
    "AdapterRegistry",
    "AdapterRequest",
    "Capabilities",
    "Chunk",
    "Completion",
    "Delta",
    "Usage",
    "default_registry",
]
