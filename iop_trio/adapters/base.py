"""The adapter interface: how the runtime talks to an inference engine.

An adapter instance serves one namespace (``ollama``, ``vllm-a``, ``echo``);
targets name it as the part before the first ``/``. The runtime calls
:meth:`Adapter.open_stream` once per run, inside the run's cancel scope, and
iterates it in a task of the run's own: the :class:`Delta` s that came while the
run was busy become one DELTA event, and the stream ends with at most one
:class:`Completion`. So the iterator holds no cancel scope or nursery open
across a ``yield`` (as trio asks of every async generator). Leaving the
``async with`` block, for any reason including cancellation, must close the
engine stream (HTTP response, socket) before it returns.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, ClassVar

import attrs

from ..model import Capabilities, EngineSignals, Usage


@attrs.frozen
class AdapterRequest:
    """One run as an adapter sees it. ``params`` = target profile params overlaid by run options.

    ``headers``: extra headers for the engine's HTTP request (the W3C ``traceparent``
    and ``tracestate`` of the run's engine span, so the engine's own spans join its
    trace); over the adapter's own headers of the same name; an adapter that speaks no
    HTTP ignores them.
    """

    run_id: str
    model: str
    prompt: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    params: Mapping[str, Any] = attrs.field(factory=dict)
    headers: Mapping[str, str] = attrs.field(factory=dict)

    @property
    def is_chat(self) -> bool:
        return bool(self.messages)


@attrs.frozen
class Delta:
    """Text the engine sent, and how many engine tokens it holds: one an engine chunk (an
    SSE ``chat.completion.chunk`` with content, an NDJSON line with content, an echoed
    word), so a delta joined of the chunks of one network read holds several. The run
    sums them: its completion tokens when the engine reports none (a cancelled run, an
    engine that sends no usage when streaming)."""

    text: str
    tokens: int = 1


@attrs.frozen
class Completion:
    """The end of a run, with what the engine reported of its tokens (None: not reported)."""

    usage: Usage


Chunk = Delta | Completion


class AdapterError(Exception):
    """The engine could not produce the run: the run ends FAILED with ``reason``.

    ``reason`` is a short stable code (``engine_error``, ``timeout``,
    ``connection``, ``bad_response``, ``empty_response``, ``engine_busy``, ...);
    the message is for people. ``retry_after`` (seconds) is when the engine said to
    ask again (its 429 or 503); the run's FAILED event carries it to the caller.
    ``unresponsive``: the engine did not answer in time (no connection within the
    connect timeout, or no byte for the read timeout, before the headers or between
    two chunks); the node then takes the run's target for unavailable until a run of
    it succeeds (see :meth:`~iop_trio.runtime.Node.probe_engines`).
    """

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        retry_after: float | None = None,
        unresponsive: bool = False,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after = retry_after
        self.unresponsive = unresponsive

    def __repr__(self) -> str:
        extra = "" if self.retry_after is None else f", retry_after={self.retry_after!r}"
        if self.unresponsive:
            extra += ", unresponsive=True"
        return f"AdapterError({self.reason!r}, {self.message!r}{extra})"


@attrs.frozen
class NoSettings:
    """The settings of an adapter kind that takes none."""


class Adapter(abc.ABC):
    """Base class of adapters. Subclasses set ``kind`` and implement ``open_stream``.

    A kind with config keys sets ``settings_type`` to an attrs class holding
    them (config structures a configured adapter's keys into it) and takes an
    instance as its constructor's second argument; the registry builds
    configured adapters as ``kind_class(name, settings, max_concurrency=...)``.
    """

    kind: ClassVar[str]
    settings_type: ClassVar[type[Any]] = NoSettings
    #: The run options a caller may set on a target of this kind unless the target
    #: says otherwise (``TargetSpec.allow_options``): sampling, not the engine's setup.
    caller_options: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, name: str, *, capabilities: Capabilities | None = None) -> None:
        self.name = name
        self.capabilities = capabilities or Capabilities()

    def __repr__(self) -> str:
        cap = self.capabilities.max_concurrency
        return f"<{type(self).__name__} {self.name!r} kind={self.kind} max_concurrency={cap}>"

    @abc.abstractmethod
    def open_stream(
        self, request: AdapterRequest
    ) -> AbstractAsyncContextManager[AsyncIterator[Chunk]]:
        """Start the run on the engine; yields its chunks. Raise AdapterError on engine faults."""

    #: Whether :meth:`served_models` asks an engine (so a node probes it now and then).
    probed: ClassVar[bool] = False
    #: The run options (``outer.inner`` for a key inside a mapping) that bound how many
    #: tokens a run may write, first the one the node sets when it reserves a bound a
    #: run did not ask for; () for a kind that has none.
    output_limit_options: ClassVar[tuple[str, ...]] = ()

    async def count_tokens(self, request: AdapterRequest, tokenizer: str) -> int | None:
        """The prompt tokens of ``request`` as the engine's own tokenizer counts them
        (``tokenizer``: ``vllm`` or ``llamacpp``, the shape of its ``POST /tokenize``);
        None if this kind has no tokenizer. AdapterError if the engine cannot say."""
        return None

    @property
    def server(self) -> tuple[str, int] | None:
        """The engine's host and port (a run's engine span says them); None for a kind
        with no engine of its own."""
        return None

    @property
    def signals_url(self) -> str | None:
        """Where :meth:`engine_signals` reads the engine's metrics; None for a kind that
        reads none (its pools learn from latency)."""
        return None

    async def engine_signals(self, now: float) -> EngineSignals | None:
        """The engine's own signals of its load (its metrics), read at ``now`` (the
        caller's clock); None if it exposes none. AdapterError if it cannot be read."""
        return None

    async def served_models(self) -> frozenset[str] | None:
        """The models the engine serves now; None: any model (nothing to ask, like echo).

        Raises AdapterError when the engine cannot be reached or answers badly
        (the reasons of :meth:`open_stream`). Bounded in time by the adapter.
        """
        return None

    async def probe_generation(self, request: AdapterRequest) -> None:
        """Ask the engine for the smallest answer to ``request`` it allows; return once it
        has answered. Raises AdapterError as :meth:`open_stream` does.

        The node asks this, now and then, of a target whose engine did not answer a run
        in time (:meth:`~iop_trio.runtime.Node.probe_engines`). An HTTP adapter asks for
        one token without streaming, bounded in time; this default reads the run
        itself to its end (an adapter whose runs may not end must bound it).
        """
        async with self.open_stream(request) as chunks:
            async for _chunk in chunks:
                pass

    def serves(self, model: str, served: frozenset[str]) -> bool:
        """Whether ``model`` (a target's) is among ``served`` (the engine's names)."""
        return model in served

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release shared resources (HTTP clients). Called once when the node stops."""
