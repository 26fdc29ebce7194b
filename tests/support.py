"""Test helpers: a scripted adapter whose runs end when the test says so, and the like."""

from __future__ import annotations

import logging
import math
import os
import stat
import subprocess
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from iop_trio.adapters._http import HTTPAdapter
from iop_trio.adapters.base import (
    Adapter,
    AdapterError,
    AdapterRequest,
    Capabilities,
    Chunk,
    Completion,
    Delta,
    Usage,
)
from iop_trio.adapters.echo import EchoAdapter
from iop_trio.store import RunStore, StoreHealth


@attrs.define(eq=False)
class Script:
    """The controls of one scripted run: send deltas, then finish or fail it."""

    run_id: str
    send: trio.MemorySendChannel[tuple[str, str]]
    closed: bool = False

    def delta(self, text: str) -> None:
        self.send.send_nowait(("delta", text))

    def finish(self) -> None:
        self.send.send_nowait(("finish", ""))

    def fail(self, message: str = "scripted failure") -> None:
        self.send.send_nowait(("fail", message))


class ScriptedAdapter(Adapter):
    """Each run streams what its :class:`Script` is told; it blocks until then."""

    kind = "scripted"

    def __init__(self, name: str = "scripted", *, max_concurrency: int | None = None) -> None:
        super().__init__(name, capabilities=Capabilities(max_concurrency=max_concurrency))
        self.scripts: dict[str, Script] = {}
        self.started: list[str] = []

    def script(self, run_id: str) -> Script:
        return self.scripts[run_id]

    @property
    def open_streams(self) -> list[str]:
        return [s.run_id for s in self.scripts.values() if not s.closed]

    @asynccontextmanager
    async def open_stream(self, request: AdapterRequest) -> AsyncIterator[AsyncIterator[Chunk]]:
        send, receive = trio.open_memory_channel[tuple[str, str]](math.inf)
        script = Script(request.run_id, send)
        self.scripts[request.run_id] = script
        self.started.append(request.run_id)
        chunks = self._chunks(receive)
        try:
            yield chunks
        finally:
            script.closed = True
            await chunks.aclose()

    async def _chunks(
        self, receive: trio.MemoryReceiveChannel[tuple[str, str]]
    ) -> AsyncGenerator[Chunk, None]:
        async for what, text in receive:
            if what == "delta":
                yield Delta(text)
            elif what == "fail":
                raise AdapterError("engine_error", text)
            else:
                yield Completion(Usage("stop"))
                return


class CountingEcho(EchoAdapter):
    """An echo adapter that records the most streams open at once, per model and in all."""

    def __init__(self, name: str = "echo", **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.active_by_model: dict[str, int] = {}
        self.peak_by_model: dict[str, int] = {}
        self.peak = 0

    @asynccontextmanager
    async def open_stream(self, request: AdapterRequest) -> AsyncIterator[AsyncIterator[Chunk]]:
        model = request.model
        self.active_by_model[model] = self.active_by_model.get(model, 0) + 1
        self.peak_by_model[model] = max(
            self.peak_by_model.get(model, 0), self.active_by_model[model]
        )
        self.peak = max(self.peak, self.active)
        try:
            async with super().open_stream(request) as chunks:
                self.peak = max(self.peak, self.active)
                yield chunks
        finally:
            self.active_by_model[model] -= 1


class _Keep(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__(logging.DEBUG)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def logged(name: str) -> Iterator[list[logging.LogRecord]]:
    """The records logged under ``name`` meanwhile (works without pytest's logging plugin)."""
    records: list[logging.LogRecord] = []
    logger = logging.getLogger(name)
    handler, level = _Keep(records), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class HealthLog:
    """The health changes a store reports, and a way to wait for the next one."""

    def __init__(self, store: RunStore, *, limit: float = 20.0) -> None:
        self.seen: list[StoreHealth] = []
        self.limit = limit  # seconds any wait_for may take
        self._changed = trio.Event()
        store.watch_health(self._on)

    def __repr__(self) -> str:
        return f"<HealthLog seen={[str(h) for h in self.seen]}>"

    def _on(self, health: StoreHealth) -> None:
        self.seen.append(health)
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, writable: bool) -> StoreHealth:
        """The latest health once it says ``writable`` (at most ``limit`` seconds)."""
        with trio.fail_after(self.limit):
            while not self.seen or self.seen[-1].writable is not writable:
                await self._changed.wait()
        return self.seen[-1]


@contextmanager
def read_only(path: Path) -> Iterator[None]:
    """Make ``path`` (a file or a folder) one this process may not write, for the block:
    ``chmod a-w``, or for root (whom modes do not stop) the immutable attribute
    (``chattr +i``); skips the test where neither can be had."""
    if os.geteuid() != 0:
        mode = stat.S_IMODE(path.stat().st_mode)
        path.chmod(mode & ~0o222)
        try:
            yield
        finally:
            path.chmod(mode)
        return
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot make {path} immutable: {done.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process to listen on)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# --- the sends of an HTTP adapter's requests (adapters/engine_http.py) ------------------


class CountedStream(trio.abc.Stream):
    """A Trio stream that notes the size of each send; otherwise the stream it wraps
    (its ``socket`` too, so the pool still sees an idle connection the engine closed)."""

    def __init__(self, stream: trio.SocketStream, writes: list[int]) -> None:
        self._stream, self._writes = stream, writes
        self.socket = stream.socket

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self._writes.append(len(data))
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self._stream.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self._stream.aclose()


@attrs.define
class SendCounter:
    """The sizes of the sends on the connections an adapter's pool opened from now on."""

    writes: list[int] = attrs.field(factory=list)
    connections: int = 0


def count_sends(adapter: HTTPAdapter) -> SendCounter:
    """Count the sends of the connections ``adapter``'s own pool opens from now on (its
    connector replaced by one that opens TCP streams and counts their sends)."""
    pool = adapter.engine_pool
    assert pool is not None, "the adapter sends its runs through httpx"
    counter = SendCounter()

    async def connect(host: str, port: int) -> trio.abc.Stream:
        counter.connections += 1
        return CountedStream(await trio.open_tcp_stream(host, port), counter.writes)

    pool.connector = connect
    return counter
