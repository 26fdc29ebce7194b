"""Adapter kinds by name, so config can say ``kind: ollama`` and get a factory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .base import Adapter

AdapterFactory = Callable[..., Adapter]


class AdapterRegistry:
    """Maps an adapter kind (``echo``, ``ollama``, ``openai``) to a factory.

    ``create(kind, name, **options)`` builds one instance for the namespace
    ``name``. Registering a kind twice is an error unless ``replace=True``.
    """

    def __init__(self) -> None:
        self._kinds: dict[str, AdapterFactory] = {}

    def __repr__(self) -> str:
        return f"<AdapterRegistry kinds={sorted(self._kinds)}>"

    def register(self, kind: str, factory: AdapterFactory, *, replace: bool = False) -> None:
        if kind in self._kinds and not replace:
            raise ValueError(f"adapter kind {kind!r} is already registered")
        self._kinds[kind] = factory

    def __contains__(self, kind: object) -> bool:
        return kind in self._kinds

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._kinds))

    def factory(self, kind: str) -> AdapterFactory:
        """The factory registered for ``kind`` (KeyError if none)."""
        return self._kinds[kind]

    def create(self, kind: str, name: str, **options: Any) -> Adapter:
        try:
            factory = self._kinds[kind]
        except KeyError:
            raise ValueError(
                f"unknown adapter kind {kind!r} (known: {', '.join(sorted(self._kinds))})"
            ) from None
        return factory(name, **options)


def default_registry() -> AdapterRegistry:
    """A registry with the built-in kinds."""
    from .echo import EchoAdapter
    from .ollama import OllamaAdapter
    from .openai import OpenAIAdapter

    registry = AdapterRegistry()
    registry.register("echo", EchoAdapter)
    registry.register("ollama", OllamaAdapter)
    registry.register("openai", OpenAIAdapter)
    return registry
