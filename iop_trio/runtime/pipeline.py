"""The stream pipeline: an engine's chunks become a run's delta events, within its bounds.

:func:`gathered` reads an adapter's stream in a task of its own and hands the run its
chunks in batches; :class:`StreamRelay` joins each batch into as few delta events as
:data:`~iop_trio.model.MAX_JOINED_TEXT` allows, stops a run whose output passes its
target's ``max_output_bytes``, and says how the run's engine answered.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

import attrs
import trio

from ..adapters.base import Adapter, AdapterError, AdapterRequest, Chunk, Delta
from ..model import ENGINE_RETRY_AFTER, MAX_JOINED_TEXT, RunStatus, TargetSpec, Usage
from .gate import Permit
from .live import LiveRun, LiveRuns, Outcome

log = logging.getLogger(__name__)

#: The most chunks :func:`gathered` reads ahead of the run that takes them.
GATHER_LIMIT = 256
#: The most characters of text :func:`gathered` reads ahead (so a run held up, by a
#: store that is slow to write say, does not keep reading its engine into memory).
GATHER_TEXT = 256 * 1024

#: Called as ``(target, sent, error)`` by a run that reached its engine and ended by
#: itself: ``sent`` is when its request went out (``trio.current_time()``), ``error`` the
#: AdapterError that ended it, None if it SUCCEEDED. A run that was cancelled, stopped
#: or passed a bound of the node's own says nothing of its engine and is not told.
EngineAnswered = Callable[[str, float, AdapterError | None], None]
#: Told, as a run's first token comes, its permit and the seconds since its request went out.
FirstToken = Callable[[Permit, float], None]
#: Told ``(adapter, replica, why)`` how a replica answered a run: ``why`` is None if it
#: streamed it, else why it failed it before a first token (it is then marked down).
ReplicaAnswered = Callable[[str, str, str | None], None]
#: The reasons of a replica's failure before a run's first token after which the run
#: goes to another replica, once: it refused to connect, did not answer in time, or
#: said it is busy or unavailable (429, 503). Any other failure is the run's own.
FAILOVER_REASONS = frozenset({"connection", "timeout", "engine_busy", "engine_unavailable"})
#: Seconds a run taken back waits to be told to go again before it goes anyway (so a
#: learner that stopped, at a drain say, never strands it: it then waits in its engine).
HOLD_AT_MOST = 30.0
#: What one attempt of a run ends as when its request was taken back (LiveRun.step_back):
#: never a run's end; its engine span says so.
STEPPED_BACK = Outcome(
    RunStatus.FAILED, "stepped_back", "the engine queued it: taken back to wait in the node"
)


class Batches:
    """The chunks a :func:`gathered` reader has taken, a batch at a time."""

    def __init__(self, receive: trio.MemoryReceiveChannel[Chunk | Exception]) -> None:
        self._receive = receive
        self._error: Exception | None = None
        self.text = 0  # characters of delta text read and not yet taken
        self.room = trio.lowlevel.ParkingLot()  # the reader, waiting for the text to go

    def __repr__(self) -> str:
        waiting = self._receive.statistics().current_buffer_used
        return f"<gathered chunks waiting={waiting} text={self.text}>"

    def __aiter__(self) -> Batches:
        return self

    async def __anext__(self) -> list[Chunk]:
        if self._error is not None:
            raise self._error
        try:
            item = await self._receive.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        batch: list[Chunk] = []
        while True:
            if isinstance(item, Exception):
                if not batch:
                    raise item
                self._error = item  # raised at the next call, after this batch
                break
            batch.append(item)
            if isinstance(item, Delta):
                self.text -= len(item.text)
            try:
                item = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        self.room.unpark_all()
        return batch


async def _read_ahead(
    chunks: AsyncIterator[Chunk],
    send: trio.MemorySendChannel[Chunk | Exception],
    batches: Batches,
) -> None:
    """Read ``chunks`` into ``send`` within the bounds :func:`gathered` states."""
    with send:
        try:
            async for chunk in chunks:
                if isinstance(chunk, Delta):
                    batches.text += len(chunk.text)
                try:
                    # no checkpoint while there is room: the next chunk is read at
                    # once if it is here, so chunks gather until a network read
                    send.send_nowait(chunk)
                except trio.WouldBlock:
                    await send.send(chunk)
                while batches.text > GATHER_TEXT:
                    await batches.room.park()
        except Exception as exc:  # delivered in order, raised by the run
            await send.send(exc)


@asynccontextmanager
async def gathered(chunks: AsyncIterator[Chunk]) -> AsyncIterator[AsyncIterator[list[Chunk]]]:
    """Read ``chunks`` in a task of its own and yield them in batches: each batch is every
    chunk that came while the run taking them was busy (storing and publishing its
    events), in order, so a run that is behind takes one batch a wakeup, not one chunk.

    A run that keeps up gets each chunk as it comes, alone: the reading task gives way
    at each network read (at each checkpoint of ``chunks``), and the run wakes then. At
    most :data:`GATHER_LIMIT` chunks, and :data:`GATHER_TEXT` characters of text (and
    the chunk that passed it), are read ahead; then the reading task waits, and so does
    the engine's connection. An exception from ``chunks`` (an AdapterError) is raised
    after the chunks before it have been taken. Leaving the block cancels the reading
    task; ``chunks`` is then closed by its owner, as before (an adapter's stream must,
    as trio asks of every async generator, hold no cancel scope across a yield).
    """
    send, receive = trio.open_memory_channel[Chunk | Exception](GATHER_LIMIT)
    batches = Batches(receive)
    # What leaves the block is raised as it is, after the nursery, not in a group (the
    # run tells a node's shutdown by trio.Cancelled); the channels close without a
    # checkpoint (one in the cancelled nursery would raise Cancelled in place of that
    # exception, and the nursery would swallow it).
    leaving: BaseException | None = None
    with receive:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_read_ahead, chunks, send, batches)
                try:
                    yield batches
                except BaseException as exc:
                    leaving = exc
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # the reader raises nothing but Cancelled (its errors go through the
            # channel), from a cancel of a scope around this block: raise that
            leaving = leaving or group.exceptions[0]
    if leaving is not None:
        raise leaving


@attrs.define
class _Pending:
    """The pieces of text of the next delta event, their size and engine tokens."""

    text: list[str] = attrs.field(factory=list)
    size: int = 0
    tokens: int = 0

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text)
        self.size += len(delta.text)
        self.tokens += delta.tokens


@attrs.define
class _Relayed:
    """What a run's stream has brought so far."""

    sent: float  # when the request went out (trio time)
    max_output: float  # its target's max_output_bytes (math.inf: none)
    output: int = 0  # bytes of delta text
    first: float | None = None  # when its first token came (trio time)
    usage: Usage | None = None  # its engine's Completion's
    completed: bool = False  # a Completion came: what follows is ignored


def _unavailable(why: str, last: Outcome) -> Outcome:
    """``engine_unavailable``: no replica could take a run (``last``: the last failure),
    with its engine's retry hint or :data:`~iop_trio.model.ENGINE_RETRY_AFTER`."""
    return Outcome(
        RunStatus.FAILED,
        "engine_unavailable",
        f"{why} ({last.message})",
        retry_after=last.retry_after or ENGINE_RETRY_AFTER,
    )


@attrs.frozen
class ReplicaEngines:
    """The adapters of each adapter's replicas (by adapter, then replica name), and who
    is told how each answers a run."""

    adapters: Mapping[str, Mapping[str, Adapter]]
    answered: ReplicaAnswered


@attrs.define(eq=False)
class StreamRelay:
    """Relays an admitted run's engine stream as its delta events (see the module
    docstring); the events are written (stored, then published) by ``runs``."""

    runs: LiveRuns
    wall_clock: Callable[[], float]
    engine_answered: EngineAnswered | None = None
    first_token: FirstToken | None = None
    replicas: ReplicaEngines | None = None

    async def relay_run(
        self, live: LiveRun, adapter: Adapter, request: AdapterRequest, target: TargetSpec
    ) -> Outcome:
        """:meth:`relay` on ``adapter``, or, where the run's permit holds a replica, on that
        replica's; a replica that fails the run before its first token for one of
        :data:`FAILOVER_REASONS` is marked down and the run goes to another that has
        room now, once (nothing was streamed, so nothing is stored twice). With none to
        go to, or when that one fails it the same way, it ends ``engine_unavailable``
        (:func:`_unavailable`)."""
        permit, replicas = live.permit, self.replicas
        replica = None if permit is None else permit.replica
        if permit is None or replica is None or replicas is None:
            return await self.attempts(live, adapter, request, target)
        engines = replicas.adapters[target.adapter]
        outcome = await self.attempts(live, engines[replica], request, target)
        failed = outcome.status is RunStatus.FAILED and outcome.reason in FAILOVER_REASONS
        if failed or outcome.ttft is not None:
            replicas.answered(target.adapter, replica, outcome.message if failed else None)
        if not failed or live.first_at is not None:
            return outcome
        other = permit.reroute()
        if other is None:
            return _unavailable(f"no other replica of adapter {target.adapter!r} is up", outcome)
        log.info(
            "run %s: %s failed it (%s), on to %s", request.run_id, replica, outcome.reason, other
        )
        live.replica = other
        outcome = await self.attempts(live, engines[other], request, target)
        if outcome.reason not in FAILOVER_REASONS or live.first_at is not None:
            return outcome
        replicas.answered(target.adapter, other, outcome.message)
        return _unavailable(f"{replica} and {other} both failed the run", outcome)

    async def attempts(
        self, live: LiveRun, adapter: Adapter, request: AdapterRequest, target: TargetSpec
    ) -> Outcome:
        """:meth:`relay`, and again each time the run's request is taken back
        (:meth:`LiveRun.step_back`: it had nothing from the engine, so nothing is sent
        twice), once the run may go again (:meth:`LiveRun.go_again`), or after
        :data:`HOLD_AT_MOST` seconds."""
        try:
            while True:
                outcome = await self.relay(live, adapter, request, target)
                back = live.back
                if outcome is not STEPPED_BACK or back is None:
                    return outcome
                log.debug("run %s: taken back from its engine", request.run_id)
                with trio.move_on_after(HOLD_AT_MOST):
                    await back.wait()
                live.back = None
        finally:
            live.back = None  # however it ends, it is not held back any more

    async def relay(
        self, live: LiveRun, adapter: Adapter, request: AdapterRequest, target: TargetSpec
    ) -> Outcome:
        """Relay the adapter's stream as delta events. The chunks that came in while the
        run was busy (the engine is faster than one event a chunk) become one delta:
        the same text in the same order, fewer events (see :func:`gathered`). A run with
        spans has its engine span around it, whose context goes with the request."""
        spans = live.spans
        if spans is None:
            return await self._relay(live, adapter, request, target)
        outcome: Outcome | None = None
        try:
            began = spans.engine_began(request, adapter.server)
            outcome = await self._relay(live, adapter, began, target)
            return outcome
        finally:
            spans.engine_ended(outcome)

    async def _relay(
        self, live: LiveRun, adapter: Adapter, request: AdapterRequest, target: TargetSpec
    ) -> Outcome:
        """:meth:`_stream` in a scope that :meth:`LiveRun.step_back` may cancel until the
        engine sends something (then :data:`STEPPED_BACK`)."""
        with trio.CancelScope() as attempt:
            live.attempt = attempt
            try:
                return await self._stream(live, adapter, request, target)
            finally:
                live.attempt = None
        return STEPPED_BACK

    async def _stream(
        self, live: LiveRun, adapter: Adapter, request: AdapterRequest, target: TargetSpec
    ) -> Outcome:
        limit = target.max_output_bytes
        sent = live.sent_at = live.heard_at = trio.current_time()
        relayed = _Relayed(sent, math.inf if limit is None else limit)
        try:
            async with adapter.open_stream(request) as chunks, gathered(chunks) as batches:
                async for batch in batches:
                    stopped = await self._take(live, batch, relayed, target)
                    if stopped is not None:
                        return stopped
        except AdapterError as exc:
            if self.engine_answered is not None:
                self.engine_answered(target.name, sent, exc)
            return Outcome(RunStatus.FAILED, exc.reason, exc.message, retry_after=exc.retry_after)
        finally:
            live.heard_at = None  # out of the engine
        if self.engine_answered is not None:
            self.engine_answered(target.name, sent, None)
        return self._succeeded(live, relayed)

    async def _take(
        self, live: LiveRun, batch: list[Chunk], relayed: _Relayed, target: TargetSpec
    ) -> Outcome | None:
        """Write one batch of chunks as delta events; the run's end if its output passed
        its bound (the chunk that passed it is neither sent nor counted), else None."""
        if live.back is not None:
            # taken back as this batch was handed over (the reader's send woke the run,
            # which had not run yet): the batch is dropped, nothing of it is written
            return STEPPED_BACK
        now = trio.current_time()
        if live.first_at is not None and live.heard_at is not None:
            live.gap = now - live.heard_at
        live.heard_at = now  # the learners' sign that it is not stalled
        live.attempt = None  # the engine has answered it: it is not taken back now
        pending = _Pending()
        for chunk in batch:
            if relayed.completed:
                # the first Completion ends the run; the adapter may still be reading
                # the end of its response (so its connection is reused)
                log.debug(
                    "run %s: %r after the completion ignored", live.state.record.run_id, chunk
                )
            elif isinstance(chunk, Delta):
                relayed.output += len(chunk.text.encode())
                if relayed.output > relayed.max_output:
                    await self._write_text(live, pending)
                    return Outcome(
                        RunStatus.FAILED,
                        "output_limit",
                        f"the output passed {target.max_output_bytes} bytes "
                        f"(max_output_bytes of {target.name}); the engine was stopped",
                    )
                if pending.size and pending.size + len(chunk.text) > MAX_JOINED_TEXT:
                    await self._write_text(live, pending)
                    pending = _Pending()
                pending.add(chunk)
                if relayed.first is None:
                    self._first_came(live, relayed)
            else:
                relayed.usage = chunk.usage
                relayed.completed = True
        # text its engine's end came with goes out with the run's end (LiveRuns.hold)
        await self._write_text(live, pending, last=relayed.completed)
        return None

    def _first_came(self, live: LiveRun, relayed: _Relayed) -> None:
        first = relayed.first = live.first_at = trio.current_time()
        if live.spans is not None:
            live.spans.first_token()
        # a run taken back gives no sample: its wait was cut, and what its grant saw is
        # not what its last request met
        if self.first_token is not None and live.permit is not None and not live.steps_back:
            self.first_token(live.permit, first - relayed.sent)

    def _succeeded(self, live: LiveRun, relayed: _Relayed) -> Outcome:
        """SUCCEEDED, with the run's time to first token and per output token after it."""
        ttft = tpot = None
        first = relayed.first
        if first is not None:
            ttft = first - relayed.sent
            usage = relayed.usage
            made = usage.completion_tokens if usage is not None else None
            made = live.delta_tokens if made is None else made
            if made >= 2:
                tpot = (trio.current_time() - first) / (made - 1)
        return Outcome(RunStatus.SUCCEEDED, usage=relayed.usage, ttft=ttft, tpot=tpot)

    async def _write_text(self, live: LiveRun, pending: _Pending, *, last: bool = False) -> None:
        """Write the pending text as one delta event (none if it is empty), and count its
        engine tokens as the run's; the ``last`` text, which came with its engine's end,
        is held to be published with the run's end."""
        joined = "".join(pending.text)
        if joined:
            event = live.state.delta(joined, time=self.wall_clock(), tokens=pending.tokens)
            live.delta_tokens += pending.tokens
            if last:
                self.runs.hold(live, event)
            else:
                await self.runs.write(live, event)
