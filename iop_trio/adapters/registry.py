"""Adapter kinds by name, so config can say ``kind: ollama`` and get the class and its settings."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .base import Adapter


class AdapterRegistry:
    """Maps an adapter kind (``echo``, ``ollama``, ``openai``) to its adapter class.

    ``create(kind, name, settings)`` builds one instance for the namespace
    ``name``, with ``settings`` an instance of ``settings_type(kind)`` (None
    for the kind's defaults). Registering a kind twice is an error unless
    ``replace=True``.
    """

    def __init__(self) -> None:
        self._kinds: dict[str, type[Adapter]] = {}

    def __repr__(self) -> str:
        return f"<AdapterRegistry kinds={sorted(self._kinds)}>"

    def register(self, kind: str, adapter: type[Adapter], *, replace: bool = False) -> None:
        if kind in self._kinds and not replace:
            raise ValueError(f"adapter kind {kind!r} is already registered")
        self._kinds[kind] = adapter

    def __contains__(self, kind: object) -> bool:
        return kind in self._kinds

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._kinds))

    def _class(self, kind: str) -> type[Adapter]:
        try:
            return self._kinds[kind]
        except KeyError:
            raise ValueError(
                f"unknown adapter kind {kind!r} (known: {', '.join(sorted(self._kinds))})"
            ) from None

    def settings_type(self, kind: str) -> type[Any]:
        """The attrs class of ``kind``'s settings (ValueError for an unknown kind)."""
        return self._class(kind).settings_type

    def create(
        self, kind: str, name: str, settings: Any = None, *, max_concurrency: int | None = None
    ) -> Adapter:
        """An adapter of ``kind`` for namespace ``name`` (ValueError for an unknown kind)."""
        make: Callable[..., Adapter] = self._class(kind)
        if settings is None:
            settings = self.settings_type(kind)()
        return make(name, settings, max_concurrency=max_concurrency)


def default_registry() -> AdapterRegistry:
    """A registry with the built-in kinds."""
    from .echo import EchoAdapter
    from .ollama import OllamaAdapter
    from .openai import OpenAIAdapter

    registry = AdapterRegistry()
    for adapter in (EchoAdapter, OllamaAdapter, OpenAIAdapter):
        registry.register(adapter.kind, adapter)
    return registry
