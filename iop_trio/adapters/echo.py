"""The built-in ``echo`` adapter: streams the input back, for tests and the demo.

Each word of the prompt (or of the last chat message) comes back as one
delta, whitespace kept. Behaviour is set per adapter and overridden per run
by params (target profile or run options):

- ``delay`` (seconds, default 0): sleep before each delta (a checkpoint
  either way, so a cancel always lands).
- ``fail_after`` (int): raise AdapterError("engine_error") after that many
  deltas; ``fail_message`` sets its message.
- ``repeat`` (int, default 1): echo the text that many times.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from ..model import Capabilities, Usage, field_check, limit_problem, seconds_problem
from .base import Adapter, AdapterError, AdapterRequest, Chunk, Completion, Delta

_WORD = re.compile(r"\S+\s*|\s+")


def _number(params: Mapping[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise AdapterError("invalid_params", f"echo param {key!r} must be a finite number >= 0")
    return float(value)


@attrs.frozen(kw_only=True)
class EchoSettings:
    """The config keys of kind ``echo``: its ``delay`` and ``fail_after`` when a run sets none."""

    delay: float = attrs.field(default=0.0, validator=field_check(seconds_problem))
    fail_after: int | None = attrs.field(default=None, validator=field_check(limit_problem))


class EchoAdapter(Adapter):
    """Echo adapter. ``opened``/``closed`` count streams, so tests can see a close."""

    kind = "echo"
    caller_options = frozenset({"delay", "fail_after", "fail_message", "repeat"})
    settings_type = EchoSettings

    def __init__(
        self,
        name: str = "echo",
        settings: EchoSettings | None = None,
        *,
        max_concurrency: int | None = None,
    ) -> None:
        super().__init__(name, capabilities=Capabilities(max_concurrency=max_concurrency))
        self.settings = settings or EchoSettings()
        self.opened = 0
        self.closed = 0

    @property
    def active(self) -> int:
        """Streams opened and not yet closed."""
        return self.opened - self.closed

    @asynccontextmanager
    async def open_stream(self, request: AdapterRequest) -> AsyncIterator[AsyncIterator[Chunk]]:
        params = request.params
        delay = _number(params, "delay", self.settings.delay)
        fail_after = params.get("fail_after", self.settings.fail_after)
        if fail_after is not None:
            fail_after = int(_number(params, "fail_after", 0))
        repeat = int(_number(params, "repeat", 1))
        text = request.messages[-1][1] if request.messages else request.prompt
        chunks = self._chunks(text, repeat, delay, fail_after, str(params.get("fail_message", "")))
        self.opened += 1
        try:
            yield chunks
        finally:
            self.closed += 1
            await chunks.aclose()

    async def _chunks(
        self, text: str, repeat: int, delay: float, fail_after: int | None, fail_message: str
    ) -> AsyncGenerator[Chunk, None]:
        # words are found as they are sent, so a long echo costs no memory of its own
        words = (word.group() for _ in range(repeat) for word in _WORD.finditer(text))
        sent = 0
        for word in itertools.islice(words, fail_after):
            await trio.sleep(delay)
            yield Delta(word)  # a word: one token
            sent += 1
        if fail_after is not None:
            raise AdapterError("engine_error", fail_message or f"echo failed after {sent} deltas")
        await trio.lowlevel.checkpoint()
        yield Completion(Usage("stop", prompt_tokens=sent, completion_tokens=sent))
