"""Adapters: the engines a node runs on."""

from .base import (
    Adapter,
    AdapterError,
    AdapterRequest,
    Capabilities,
    Chunk,
    Completion,
    Delta,
    Usage,
)
from .echo import EchoAdapter
from .ollama import OllamaAdapter
from .openai import OpenAIAdapter
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
    "EchoAdapter",
    "OllamaAdapter",
    "OpenAIAdapter",
    "Usage",
    "default_registry",
]
