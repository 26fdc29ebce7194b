"""The run manager: starts every run in the node-wide nursery and sees it to one end.

Life of a run (one task each, started with ``nursery.start``):

1. The QUEUED record and its event are written to the store; only then is
   the submitter told the run exists (``start`` returns). A run the
   :class:`Gate` has room for takes its permit first and writes STARTED in
   the same write; the others enter the gate once written, in the order they
   came, and are REJECTED, admitted, or wait in it as data (no task) until
   granted, their deadline or a cancel.
2. Inside the run's own CancelScope: STARTED (unless written with QUEUED),
   the adapter's stream as DELTA events, and the adapter's end.
3. The terminal event (SUCCEEDED, FAILED, CANCELLED or REJECTED) is made and
   written under a shielded scope bounded by ``final_write_timeout``; that of a
   run that started carries its usage (see :meth:`RunManager._finish`).

Foreground and background runs take exactly this path; the only difference
is that :meth:`RunManager.abandon` cancels the foreground runs of an owner
(a lost session). A run task never raises into the nursery: any failure ends
the run FAILED(internal) and is logged.
"""

from __future__ import annotations

import collections
import logging
import math
import re
import time
import uuid
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Hashable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager
from functools import partial

import attrs
import trio

from ..adapters.base import Adapter, AdapterError, AdapterRequest, Chunk, Delta
from ..lifecycle import TRANSITIONS, RunState
from ..model import (
    CHARS_PER_TOKEN,
    LATEST_RUNS,
    MAX_JOINED_TEXT,
    MAX_OUTPUT_TOKENS,
    EventKind,
    InvalidRequest,
    NodeUnavailable,
    RunEvent,
    RunQuery,
    RunRecord,
    RunSpec,
    RunStatus,
    TargetSpec,
    UnknownRun,
    UnknownTarget,
    Usage,
    estimate_prompt_tokens,
    prompt_bytes,
    seconds_problem,
    settle_usage,
    tenant_problem,
)
from ..store.base import RunStore, StoreError, StoreHealth, StoreUnavailable
from .gate import Gate, GateRejected, Permit

log = logging.getLogger(__name__)

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


@attrs.frozen
class Submitted:
    """The ack: the run as stored when the caller is told, and whether it already existed."""

    record: RunRecord
    existing: bool = False


@attrs.frozen
class CancelOutcome:
    run_id: str
    status: RunStatus
    cancelled: bool


@attrs.frozen
class _Outcome:
    status: RunStatus
    reason: str = ""
    message: str = ""
    usage: Usage | None = None  # what the engine reported (its Completion), if it did
    retry_after: float | None = None
    # a run that succeeded: seconds from its request to its first token, and per output
    # token after it (None for fewer than two), for a learned concurrency
    ttft: float | None = None
    tpot: float | None = None


#: How many of a live run's latest events are kept in memory for its watchers;
#: a watcher further behind reads from the store.
EVENT_WINDOW = 1024
#: A live run keeps its events in a plain list up to this many, then in a deque.
SHORT_WINDOW = 16
#: How many stored events a watcher reads at a time.
STORE_PAGE = 1000
#: The most events :meth:`RunWatcher.ready` hands over at once.
READY_LIMIT = 1024
#: A run waits until its events are durable at least every this many deltas.
SYNC_EVERY = 64


@attrs.define(eq=False, repr=False)
class _LiveRun:
    """A run whose task is alive: its state, cancel scope and latest events for watchers.

    ``events`` holds the last :data:`EVENT_WINDOW` published events (each is
    in the store before it is published), so a run's memory does not grow
    with its output. ``ended`` is set once the final event is published (and
    its write done or given up). The wakeup Event is made only when somebody
    waits, which keeps a queued run small.
    """

    state: RunState
    owner: Hashable | None
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    cancelling: bool = False  # a cancel or stop was asked for (the first reason wins)
    cancel_reason: str = ""
    unsynced: int = 0  # deltas taken by the store since the last one that was waited for
    delta_tokens: int = 0  # the engine tokens of the run's delta events so far
    # its prompt's tokens as counted at admission (None: not counted), and whether that
    # was the engine tokenizer's own count
    prompt_tokens: int | None = None
    prompt_exact: bool = False
    # while admitted: its permit, when its engine request went out, its first token
    permit: Permit | None = None
    sent_at: float | None = None
    first_at: float | None = None
    # STARTED, taken by the store and not yet published: published once durable, before
    # anything after it (see RunManager._start)
    held: tuple[RunEvent, trio.Event] | None = None
    stop_outcome: _Outcome | None = None  # set with a cancel that ends the run otherwise
    # a list while it is short (a queued run has one event: an empty deque of the
    # window's size costs about 600 bytes), the window's deque once it grows
    events: list[RunEvent] | collections.deque[RunEvent] = attrs.field(factory=list)
    published: int = 0  # the seq of the last published event
    ended: bool = False
    _changed: trio.Event | None = None

    def __repr__(self) -> str:
        return f"<LiveRun {self.state.record!r} published={self.published}>"

    def stopped(self) -> _Outcome:
        """How a run cancelled or stopped before its own end ends: as the stop said, else
        CANCELLED with the cancel's reason."""
        return self.stop_outcome or _Outcome(RunStatus.CANCELLED, self.cancel_reason or "cancelled")

    def publish(self, event: RunEvent) -> None:
        self.events.append(event)
        if len(self.events) > SHORT_WINDOW and isinstance(self.events, list):
            self.events = collections.deque(self.events, maxlen=EVENT_WINDOW)
        self.published = event.seq
        self._wake()

    def event(self, seq: int) -> RunEvent | None:
        """The published event ``seq`` if it is still in the window, else None."""
        if not self.events:
            return None
        index = seq - self.events[0].seq
        return self.events[index] if 0 <= index < len(self.events) else None

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait_changed(self) -> None:
        """Wait for the next event or the end."""
        if self._changed is None:
            self._changed = trio.Event()
        await self._changed.wait()

    async def wait_ended(self) -> None:
        while not self.ended:
            await self.wait_changed()


@attrs.define(eq=False)
class _Entering:
    """A run being stored QUEUED that enters the gate once it is, in line with the others.

    Runs whose writes end in the same round of the scheduler wake in any order; the
    line makes them enter the gate in the order they came (the store's order), so that
    one does not take the room another that came before it waits for."""

    live: _LiveRun
    target: TargetSpec
    spec: RunSpec
    cost: int = 0  # the tokens it reserves (see RunManager.submit)
    stored: bool = False


class RunWatcher:
    """Async iterator over a run's events with ``seq > after_seq``, live until the terminal one.

    For a run that has ended it yields the stored events and stops. A slow
    reader never slows the run and costs it no memory: it reads from the live
    run's window of recent events while it keeps up, and from the store (a
    page at a time) when it falls behind or once the run has ended.
    """

    def __init__(self, manager: RunManager, run_id: str, after_seq: int) -> None:
        self._manager = manager
        self.run_id = run_id
        self.next_seq = after_seq + 1
        self._live = manager._live.get(run_id)
        self._backlog: collections.deque[RunEvent] = collections.deque()

    def __repr__(self) -> str:
        return f"<RunWatcher {self.run_id} next_seq={self.next_seq}>"

    def __aiter__(self) -> RunWatcher:
        return self

    async def __anext__(self) -> RunEvent:
        while True:
            if self._backlog:
                await trio.lowlevel.checkpoint()
                return self._take(self._backlog.popleft())
            live = self._live
            if live is not None:
                event = live.event(self.next_seq)
                if event is not None:
                    await trio.lowlevel.checkpoint()
                    return self._take(event)
                if self.next_seq > live.published:
                    if live.ended:
                        raise StopAsyncIteration
                    await live.wait_changed()
                    continue
            # the run has ended, or this watcher fell behind its window: the store has it
            page = await self._manager._store.events(
                self.run_id, after_seq=self.next_seq - 1, limit=STORE_PAGE
            )
            if not page:
                if live is None or not live.events:
                    raise StopAsyncIteration
                log.warning(
                    "run %s: events %d-%d are neither stored nor in memory; skipped",
                    self.run_id,
                    self.next_seq,
                    live.events[0].seq - 1,
                )
                self.next_seq = live.events[0].seq
            self._backlog.extend(page)

    def _take(self, event: RunEvent) -> RunEvent:
        self.next_seq = event.seq + 1
        return event

    def ready(self, limit: int = READY_LIMIT) -> list[RunEvent]:
        """The next events that are here now, without waiting (at most ``limit``): those
        of a backlog read from the store, else those still in the live run's window.
        An empty list says nothing is here yet; iterate to wait for more."""
        taken: list[RunEvent] = []
        while self._backlog and len(taken) < limit:
            taken.append(self._take(self._backlog.popleft()))
        live = self._live
        if taken or live is None:
            return taken
        while len(taken) < limit:
            event = live.event(self.next_seq)
            if event is None:
                break
            taken.append(self._take(event))
        return taken


def _rejected(rejected: GateRejected) -> _Outcome:
    return _Outcome(
        RunStatus.REJECTED, rejected.reason.value, str(rejected), retry_after=rejected.retry_after
    )


def notify(
    listeners: Sequence[Callable[[RunEvent, RunRecord], None]], event: RunEvent, record: RunRecord
) -> None:
    """Call each listener with ``(event, record)``; one that raises is logged and skipped."""
    for listener in listeners:
        try:
            listener(event, record)
        except Exception:
            log.exception("event listener %r failed", listener)


#: The priorities a run may ask for.
PRIORITIES = range(-1000, 1001)


def check_spec(spec: RunSpec) -> None:
    """InvalidRequest if the spec's tenant, priority or queue timeout cannot be."""
    problem = tenant_problem(spec.tenant)
    if problem is not None:
        raise InvalidRequest(problem)
    if isinstance(spec.priority, bool) or spec.priority not in PRIORITIES:
        raise InvalidRequest(
            f"priority must be an integer from -1000 to 1000, not {spec.priority!r}"
        )
    if spec.queue_timeout is not None:
        problem = seconds_problem(spec.queue_timeout)
        if problem is None and math.isinf(spec.queue_timeout):
            problem = "must be finite (leave it out to wait as long as the target allows)"
        if problem is not None:
            raise InvalidRequest(f"queue_timeout {problem}")


def _new_run_id() -> str:
    return uuid.uuid4().hex


#: The most chunks :func:`gathered` reads ahead of the run that takes them.
GATHER_LIMIT = 256
#: The most characters of text :func:`gathered` reads ahead (so a run held up, by a
#: store that is slow to write say, does not keep reading its engine into memory).
GATHER_TEXT = 256 * 1024


class _Batches:
    """The chunks a :func:`gathered` reader has taken, a batch at a time."""

    def __init__(self, receive: trio.MemoryReceiveChannel[Chunk | Exception]) -> None:
        self._receive = receive
        self._error: Exception | None = None
        self.text = 0  # characters of delta text read and not yet taken
        self.room = trio.lowlevel.ParkingLot()  # the reader, waiting for the text to go

    def __repr__(self) -> str:
        waiting = self._receive.statistics().current_buffer_used
        return f"<gathered chunks waiting={waiting} text={self.text}>"

    def __aiter__(self) -> _Batches:
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
    batches = _Batches(receive)

    async def read() -> None:
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

    # What leaves the block is raised as it is, after the nursery, not in a group (the
    # run tells a node's shutdown by trio.Cancelled); the channels close without a
    # checkpoint (one in the cancelled nursery would raise Cancelled in place of that
    # exception, and the nursery would swallow it).
    leaving: BaseException | None = None
    with receive:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read)
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


#: Called as ``(target, sent, error)`` by a run that reached its engine and ended by
#: itself: ``sent`` is when its request went out (``trio.current_time()``), ``error`` the
#: AdapterError that ended it, None if it SUCCEEDED. A run that was cancelled, stopped
#: or passed a bound of the node's own says nothing of its engine and is not told.
EngineAnswered = Callable[[str, float, AdapterError | None], None]
#: Told, as a run that succeeded gives back its permit, that permit, the run's time to
#: first token and per output token after it (None for fewer than two tokens).
RunEnded = Callable[[Permit, float, float | None], None]
#: Told, as a run's first token comes, its permit and the seconds since its request went out.
FirstToken = Callable[[Permit, float], None]


class RunManager:
    """Owns the runs of one node; see the module docstring for a run's life."""

    def __init__(
        self,
        *,
        nursery: trio.Nursery,
        gate: Gate,
        store: RunStore,
        adapters: Mapping[str, Adapter],
        targets: Mapping[str, TargetSpec],
        final_write_timeout: float = 10.0,
        store_grace: float = 10.0,
        new_run_id: Callable[[], str] = _new_run_id,
        wall_clock: Callable[[], float] = time.time,
        listeners: list[Callable[[RunEvent, RunRecord], None]] | None = None,
        engine_answered: EngineAnswered | None = None,
        chars_per_token: float = CHARS_PER_TOKEN,
        run_ended: RunEnded | None = None,
        first_token: FirstToken | None = None,
    ) -> None:
        self._nursery = nursery
        self._gate = gate
        self._store = store
        self._adapters = adapters
        self._targets = targets
        self.final_write_timeout = final_write_timeout
        self.store_grace = store_grace
        self._store_outage: trio.CancelScope | None = None
        store.watch_health(self._store_health_changed)
        self._new_run_id = new_run_id
        self._now = wall_clock
        self._live: dict[str, _LiveRun] = {}
        # runs being stored QUEUED that enter the gate after, in the order they came:
        # while there are any, no run takes a permit before its own QUEUED write
        self._entering: collections.deque[_Entering] = collections.deque()
        self._admitting = True
        self._idle = trio.Event()
        self._idle.set()
        # runs wait in the gate as data; their queue deadlines are kept by one task
        nursery.start_soon(gate.expire_waiting)
        # hooks (metrics, logs): called synchronously with each event once it is
        # stored (or given up on) and the run's own live record, which they must
        # not change; one that raises is logged and skipped
        self.listeners = listeners if listeners is not None else []
        # told what each run found of its target's engine (see EngineAnswered)
        self._engine_answered = engine_answered
        # a prompt's tokens where the engine reports none (model.estimate_prompt_tokens)
        self.chars_per_token = chars_per_token
        self._run_ended = run_ended
        self._first_token = first_token
        self._tokenizer_failed: set[str] = set()  # targets whose tokenizer failed once

    def __repr__(self) -> str:
        running = sum(1 for r in self._live.values() if r.state.status is RunStatus.RUNNING)
        return f"<RunManager live={len(self._live)} running={running} admitting={self._admitting}>"

    def awaiting_first_token(self) -> Iterator[tuple[Permit, float]]:
        """The runs whose engine request went out and whose first token has not come:
        their permits, and when each request went out (trio time)."""
        for live in self._live.values():
            if live.sent_at is not None and live.first_at is None and live.permit is not None:
                yield live.permit, live.sent_at

    # --- submitting ----------------------------------------------------------------------

    async def submit(
        self,
        spec: RunSpec,
        *,
        owner: Hashable | None = None,
        create_timeout: float | None = None,
    ) -> Submitted:
        """Create a run and return once it is stored QUEUED (or already known).

        ``owner`` names who asked (a session); foreground runs are cancelled
        by :meth:`abandon` with it. A ``spec.run_id`` that names a known run
        returns that run with ``existing=True`` and starts nothing. Raises
        UnknownTarget, InvalidRequest (a bad run_id, a prompt over the target's
        ``max_prompt_bytes``) or NodeUnavailable without creating a run.

        Storing the run takes at most ``create_timeout`` seconds (None:
        ``store_grace``): past it (a full disk met by this very write, say) the write is
        withdrawn and StoreUnavailable raised, and the run is never stored, nor started;
        a write being committed at that moment ends with that attempt (short), and
        committed, the run exists and this returns. StoreUnavailable at once while the
        store cannot write.
        """
        target = self._targets.get(spec.target)
        if target is None:
            raise UnknownTarget(spec.target)
        if not self._admitting:
            raise NodeUnavailable("the node is draining and admits no new runs")
        health = self._store.health()
        if not health.writable:
            raise StoreUnavailable(f"the node's run store {health}; retry later")
        check_spec(spec)
        # what the caller may set, capped; the run is stored with the options it runs with
        spec = attrs.evolve(spec, options=target.caller_options(spec.options))
        if target.max_prompt_bytes is not None:
            size = prompt_bytes(spec)
            if size > target.max_prompt_bytes:
                raise InvalidRequest(
                    f"the prompt is {size} bytes, over the {target.max_prompt_bytes} "
                    f"(max_prompt_bytes) that {spec.target} takes"
                )
        if spec.run_id is not None:
            if not _RUN_ID.fullmatch(spec.run_id):
                raise InvalidRequest(
                    "run_id must be 1-128 characters of A-Z a-z 0-9 _ . : - "
                    "and start with a letter or digit"
                )
            known = await self.get(spec.run_id)
            if known is not None:
                return Submitted(known, existing=True)
        run_id = spec.run_id or self._new_run_id()
        spec, cost, counted = await self._reservation(spec, target)
        bound = self.store_grace if create_timeout is None else create_timeout
        record: RunRecord = await self._nursery.start(
            partial(self._run, spec, target, run_id, owner, bound, cost=cost, counted=counted)
        )
        return Submitted(record)

    async def _reservation(
        self, spec: RunSpec, target: TargetSpec
    ) -> tuple[RunSpec, int, tuple[int, bool] | None]:
        """What a run reserves, where a token rule applies to it (a token budget, a learned
        capacity, its tenant's token rate or tokens in flight): its prompt's tokens (the
        engine's tokenizer's count where the target says so, else the node's estimate)
        plus the most output it may make (its own bound, else its target's cap, else the
        target's ``max_output_tokens``). A run that asks for no bound is sent with the
        one it reserved, where its engine takes one, so the reservation bounds what it
        holds. Returns the spec it runs with, the cost (0: no rule applies) and the
        prompt's count with whether it is exact (None: not counted)."""
        if not self._gate.counts_tokens(spec.target, spec.tenant):
            return spec, 0, None
        adapter = self._adapters[target.adapter]
        prompt, exact = await self._prompt_tokens(spec, target, adapter)
        params = target.params_for(spec.options)
        bound = None
        for name in adapter.output_limit_options:
            outer, _, inner = name.partition(".")
            value = params.get(outer)
            if inner:
                value = value.get(inner) if isinstance(value, Mapping) else None
            if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
                bound = value
                break
        if bound is None:
            bound = target.max_output_tokens or MAX_OUTPUT_TOKENS
            if adapter.output_limit_options:
                options = dict(spec.options)
                options[adapter.output_limit_options[0]] = bound
                spec = attrs.evolve(spec, options=options)
        return spec, prompt + bound, (prompt, exact)

    async def _prompt_tokens(
        self, spec: RunSpec, target: TargetSpec, adapter: Adapter
    ) -> tuple[int, bool]:
        """The prompt's tokens and whether the engine counted them (its ``tokenizer``); a
        tokenizer that fails is said once a target, and the estimate is used."""
        chars = target.chars_per_token or self.chars_per_token
        if target.tokenizer != "estimate":
            request = AdapterRequest(
                run_id="", model=target.model, prompt=spec.prompt, messages=spec.messages
            )
            try:
                count = await adapter.count_tokens(request, target.tokenizer)
            except AdapterError as exc:
                if target.name not in self._tokenizer_failed:
                    self._tokenizer_failed.add(target.name)
                    log.warning(
                        "target %s: its engine's tokenizer did not count a prompt (%s); "
                        "prompts are estimated at %g bytes a token until it does",
                        target.name,
                        exc.message,
                        chars,
                    )
                count = None
            else:
                self._tokenizer_failed.discard(target.name)
            if count is not None:
                return count, True
        return estimate_prompt_tokens(spec, chars), False

    async def _run(
        self,
        spec: RunSpec,
        target: TargetSpec,
        run_id: str,
        owner: Hashable | None,
        bound: float,
        *,
        cost: int = 0,
        counted: tuple[int, bool] | None = None,
        task_status: trio.TaskStatus[RunRecord],
    ) -> None:
        state, first = RunState.create(
            run_id=run_id,
            target=spec.target,
            background=spec.background,
            time=self._now(),
            prompt=spec.prompt,
            messages=spec.messages,
            options=spec.options,
            tenant=spec.tenant,
            priority=spec.priority,
        )
        if run_id in self._live:
            raise InvalidRequest(f"run {run_id} is being created already")
        live = _LiveRun(state, None if spec.background else owner)
        if counted is not None:
            live.prompt_tokens, live.prompt_exact = counted
        self._live[run_id] = live
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        queued = attrs.evolve(state.record)
        if not self._entering:
            # a run that may start at once stores STARTED with QUEUED: one write, not two
            permit = self._gate.enter_now(
                live, spec.target, priority=spec.priority, tenant=spec.tenant, cost=cost
            )
            if permit is not None:
                await self._create(live, queued, first, permit, bound, task_status)
                await self._carry_on(live, target, spec, permit, started=True)
                return
        # the others enter the gate once stored QUEUED, in the order they came (see
        # _Entering); until they have, nobody takes a permit at once past them
        entry = _Entering(live, target, spec, cost)
        self._entering.append(entry)
        try:
            await self._create(live, queued, first, None, bound, task_status)
        except BaseException:
            self._entering.remove(entry)
            self._enter_stored(None)
            raise
        entry.stored = True
        went = self._enter_stored(entry)
        if went is not None:  # admitted at once, refused, or cancelled while stored
            await went()
        # else this task ends: the run waits in the gate as data (a grant starts its next
        # task, _admitted; its deadline or a cancel ends it, _expired, _cancel), or a run
        # that came before it is stored but not yet woken, and lets it in (the store
        # writes in order, so within the scheduler's round)

    def _enter_stored(self, own: _Entering | None) -> Callable[[], Awaitable[None]] | None:
        """Enter the gate for each run at the head of the line that is stored QUEUED, in
        the order the runs came (the first one not stored yet holds the rest back), and
        start what comes next for each in a task of its own; for ``own``, if it went in,
        return that instead, for its own task to await. A run cancelled while it was
        being stored does not enter: it ends CANCELLED."""
        mine: Callable[[], Awaitable[None]] | None = None
        while self._entering and self._entering[0].stored:
            entry = self._entering.popleft()
            went = self._went_in(entry)
            if entry is own:
                mine = went
            elif went is not None:
                self._nursery.start_soon(went)
        return mine

    def _went_in(self, entry: _Entering) -> Callable[[], Awaitable[None]] | None:
        """Enter ``entry``'s run into the gate: what its task does next, or None (it waits
        in the gate as data)."""
        live, target, spec = entry.live, entry.target, entry.spec
        if live.cancelling:  # cancelled while being stored: it never waits nor starts
            return partial(self._finish, live, live.stopped())
        try:
            permit = self._gate.enter(
                live,
                spec.target,
                on_grant=partial(self._admitted, live, target, spec),
                on_expire=partial(self._expired, live),
                priority=spec.priority,
                tenant=spec.tenant,
                queue_timeout=spec.queue_timeout,
                cost=entry.cost,
            )
        except GateRejected as rejected:
            return partial(self._finish, live, _rejected(rejected))
        return None if permit is None else partial(self._carry_on, live, target, spec, permit)

    async def _create(
        self,
        live: _LiveRun,
        queued: RunRecord,
        first: RunEvent,
        permit: Permit | None,
        bound: float,
        task_status: trio.TaskStatus[RunRecord],
    ) -> None:
        """Store the new run QUEUED (and STARTED if it holds ``permit``) within ``bound``
        seconds, publish what was stored, and tell the submitter (``queued``, its record
        as of QUEUED). If the write fails, is cancelled or is given up on past ``bound``
        (StoreUnavailable; the store withdraws a write it is not committing), the run is
        forgotten and its permit given back."""
        then: tuple[RunEvent, ...] = ()
        try:
            if permit is not None:
                then = (live.state.transition(RunStatus.RUNNING, time=self._now()),)
            with trio.move_on_after(bound) as bounded:
                try:
                    await self._store.create(queued, first, then=then)
                except StoreUnavailable as exc:  # its attempt failed after the bound passed
                    if not bounded.cancel_called:
                        raise
                    raise self._not_stored(bound) from exc
            if bounded.cancelled_caught:
                raise self._not_stored(bound)
        except BaseException:
            if permit is not None:
                permit.release()
            self._forget(queued.run_id)
            raise
        for event in (first, *then):
            self._published(live, event)
        task_status.started(queued)

    def _not_stored(self, bound: float) -> StoreUnavailable:
        health = self._store.health()
        why = "it is behind" if health.writable else f"it {health}"
        return StoreUnavailable(
            f"the node's run store did not store the run within {bound:g}s ({why}); the run "
            "was not created: retry later"
        )

    def _admitted(self, live: _LiveRun, target: TargetSpec, spec: RunSpec, permit: Permit) -> None:
        """The gate granted a run that waited as data: its task goes on from here."""
        self._nursery.start_soon(self._carry_on, live, target, spec, permit)

    def _expired(self, live: _LiveRun, rejected: GateRejected) -> None:
        """A run that waited as data reached its queue deadline."""
        self._nursery.start_soon(self._finish, live, _rejected(rejected))

    async def _carry_on(
        self,
        live: _LiveRun,
        target: TargetSpec,
        spec: RunSpec,
        permit: Permit,
        *,
        started: bool = False,
    ) -> None:
        """Run an admitted run to its end, holding ``permit``; record its end. ``started``:
        its STARTED event is stored already (with QUEUED, see :meth:`_create`)."""
        run_id = live.state.record.run_id
        outcome: _Outcome | None = None
        live.permit = permit
        try:
            with permit:
                if not live.cancelling:  # a run cancelled as it was granted never starts
                    with live.scope:
                        outcome = await self._execute_admitted(live, target, spec, started)
                if outcome is None:  # cancelled, or stopped otherwise
                    outcome = live.stopped()
                # its tokens settle with what it used, the same count its end will carry
                usage = self._settled(live, outcome.usage)
                permit.settle(
                    None
                    if usage is None
                    else (usage.prompt_tokens or 0) + (usage.completion_tokens or 0)
                )
                if (
                    outcome.status is RunStatus.SUCCEEDED
                    and outcome.ttft is not None
                    and self._run_ended is not None
                ):
                    self._run_ended(permit, outcome.ttft, outcome.tpot)
        except trio.Cancelled:
            # the node-wide nursery is being cancelled (shutdown)
            outcome = _Outcome(RunStatus.CANCELLED, "node_shutdown", "the node stopped")
            raise
        except Exception as exc:
            log.exception("run %s: internal error", run_id)
            outcome = _Outcome(RunStatus.FAILED, "internal", f"{type(exc).__name__}: {exc}")
        finally:
            await self._finish(live, outcome or _Outcome(RunStatus.FAILED, "internal"))

    async def _execute_admitted(
        self, live: _LiveRun, target: TargetSpec, spec: RunSpec, started: bool
    ) -> _Outcome:
        if not started:
            self._start(live)
        request = AdapterRequest(
            run_id=live.state.record.run_id,
            model=target.model,
            prompt=spec.prompt,
            messages=spec.messages,
            params=target.params_for(spec.options),
        )
        limit = target.max_run_time
        with trio.move_on_after(math.inf if limit is None else limit):
            return await self._execute(live, self._adapters[target.adapter], request, target)
        # leaving the adapter's stream on the deadline closed it
        return _Outcome(
            RunStatus.FAILED,
            "run_timeout",
            f"the run did not finish within {limit:g}s (max_run_time of {target.name})",
        )

    async def _execute(
        self, live: _LiveRun, adapter: Adapter, request: AdapterRequest, target: TargetSpec
    ) -> _Outcome:
        """Relay the adapter's stream as delta events. The chunks that came in while the
        run was busy (the engine is faster than one event a chunk) become one delta:
        the same text in the same order, fewer events (see :func:`gathered`)."""
        usage: Usage | None = None
        completed = False
        output = 0
        max_output = math.inf if target.max_output_bytes is None else target.max_output_bytes
        sent = live.sent_at = trio.current_time()
        first: float | None = None
        try:
            async with adapter.open_stream(request) as chunks, gathered(chunks) as batches:
                async for batch in batches:
                    text: list[str] = []
                    size = tokens = 0
                    for chunk in batch:
                        if completed:
                            # the first Completion ends the run; the adapter may still be
                            # reading the end of its response (so its connection is reused)
                            log.debug(
                                "run %s: %r after the completion ignored", request.run_id, chunk
                            )
                        elif isinstance(chunk, Delta):
                            output += len(chunk.text.encode())
                            if output > max_output:  # this chunk is neither sent nor counted
                                await self._emit_text(live, text, tokens)
                                return _Outcome(
                                    RunStatus.FAILED,
                                    "output_limit",
                                    f"the output passed {target.max_output_bytes} bytes "
                                    f"(max_output_bytes of {target.name}); the engine was "
                                    "stopped",
                                )
                            if size and size + len(chunk.text) > MAX_JOINED_TEXT:
                                await self._emit_text(live, text, tokens)
                                text, size, tokens = [], 0, 0
                            text.append(chunk.text)
                            size += len(chunk.text)
                            tokens += chunk.tokens
                            if first is None:
                                first = live.first_at = trio.current_time()
                                if self._first_token is not None and live.permit is not None:
                                    self._first_token(live.permit, first - sent)
                        else:
                            usage = chunk.usage
                            completed = True
                    await self._emit_text(live, text, tokens)
        except AdapterError as exc:
            if self._engine_answered is not None:
                self._engine_answered(target.name, sent, exc)
            return _Outcome(RunStatus.FAILED, exc.reason, exc.message, retry_after=exc.retry_after)
        if self._engine_answered is not None:
            self._engine_answered(target.name, sent, None)
        ttft = tpot = None
        if first is not None:
            ttft = first - sent
            made = usage.completion_tokens if usage is not None else None
            made = live.delta_tokens if made is None else made
            if made >= 2:
                tpot = (trio.current_time() - first) / (made - 1)
        return _Outcome(RunStatus.SUCCEEDED, usage=usage, ttft=ttft, tpot=tpot)

    async def _emit_text(self, live: _LiveRun, text: list[str], tokens: int) -> None:
        """Emit the pieces of ``text``, which hold ``tokens`` engine tokens, as one delta
        event (none if they are empty), and count its tokens as the run's."""
        joined = "".join(text)
        if joined:
            event = live.state.delta(joined, time=self._now(), tokens=tokens)
            live.delta_tokens += tokens
            await self._emit(live, event)

    def _start(self, live: _LiveRun) -> None:
        """Make the run's STARTED event and have the store write it at once, without
        waiting: the engine's request goes out while the commit is on its way. STARTED
        is published (so a watcher sees it) only once it is durable, and before any
        later event (:meth:`_emit` waits for it), so its guarantee is the same as if it
        were waited for here; the engine's first token, which takes longer, hides the
        commit. A crash in between leaves the run QUEUED, so INTERRUPTED at restart."""
        event = live.state.transition(RunStatus.RUNNING, time=self._now())
        durable = trio.Event()
        live.unsynced = 0
        live.held = (event, durable)

        def on_durable() -> None:
            durable.set()
            self._publish_held(live, event)

        self._store.append_nowait(event, on_durable=on_durable)

    def _publish_held(self, live: _LiveRun, event: RunEvent) -> None:
        """Publish the held ``event`` unless that was done already."""
        if live.held is not None and live.held[0] is event:
            live.held = None
            self._published(live, event)

    async def _emit(self, live: _LiveRun, event: RunEvent) -> None:
        """Store ``event``, then publish it (after a STARTED still held, once that one is
        durable: see :meth:`_start`).

        A delta is published as soon as the store has taken it; every
        :data:`SYNC_EVERY`-th delta, like every status event, waits until it is
        durable, and with it every delta before it (the store writes in order).
        So a run's deltas are written in batches, at most SYNC_EVERY of them are
        not yet durable (all within its window of events), and a crash leaves
        a whole log whose text is a prefix of what was streamed.
        """
        if live.held is not None:
            started, durable = live.held
            try:
                await durable.wait()
            except BaseException:
                # cancelled: STARTED is taken by the store, and this event is made (its
                # seq is taken), so it is handed over too, in order, and both published;
                # left out, its run's end would be refused for the gap
                self._publish_held(live, started)
                self._store.append_nowait(event)
                self._published(live, event)
                raise
            self._publish_held(live, started)
        if event.kind is EventKind.DELTA and live.unsynced < SYNC_EVERY:
            live.unsynced += 1
            self._store.append_nowait(event)
            self._published(live, event)
            return
        live.unsynced = 0
        try:
            await self._store.append(event)
        finally:
            # the store took the event before its first checkpoint, so it is
            # published even when the wait for durability was cancelled
            self._published(live, event)

    def _published(self, live: _LiveRun, event: RunEvent) -> None:
        live.publish(event)
        notify(self.listeners, event, live.state.record)

    def _settled(self, live: _LiveRun, reported: Usage | None) -> Usage | None:
        """The usage the end of ``live`` carries: none if it never started; else each
        count its engine ``reported`` (exact), or the node's, marked estimated: the engine
        tokens of its delta events (one an engine chunk; what the engine sent that never
        became a delta, or generated and never sent, is not counted) and its prompt
        estimated from its size (``chars_per_token``), sent or not."""
        if live.state.status is not RunStatus.RUNNING:
            return None
        prompt = live.prompt_tokens
        if prompt is None:
            prompt = estimate_prompt_tokens(live.state.record, self.chars_per_token)
        return settle_usage(
            reported, prompt=prompt, completion=live.delta_tokens, prompt_exact=live.prompt_exact
        )

    async def _finish(self, live: _LiveRun, outcome: _Outcome) -> None:
        """Make the run's terminal event from ``outcome``, with its usage if it started
        (:meth:`_settled`), so the usage is stored with the end, in the same write, and
        is never settled twice; write it (bounded, shielded) and publish it."""
        run_id = live.state.record.run_id
        if outcome.status not in TRANSITIONS[live.state.status]:
            # only a bug gets here (e.g. an internal error while QUEUED, which
            # the table does not allow to FAIL): end it CANCELLED, say why
            log.error("run %s: cannot end %s from %s", run_id, outcome, live.state.status)
            outcome = _Outcome(RunStatus.CANCELLED, "internal", outcome.message)
        try:
            event = live.state.transition(
                outcome.status,
                time=self._now(),
                reason=outcome.reason,
                message=outcome.message,
                usage=self._settled(live, outcome.usage),
                retry_after=outcome.retry_after,
            )
            with trio.move_on_after(self.final_write_timeout, shield=True) as scope:
                await self._emit(live, event)
            if scope.cancelled_caught:
                # the store has the event and writes it in order when it can; the run is
                # known here (get, cancel) until then, and its watchers have their end now
                live.end()
                health = self._store.health()
                if health.writable:
                    log.error(
                        "run %s: final status %s not confirmed by the store within %ss",
                        run_id,
                        outcome.status.value,
                        self.final_write_timeout,
                    )
                await self._store.sync()
        except StoreError as exc:
            log.warning("run %s: final status %s not stored: %s", run_id, outcome.status, exc)
        except Exception:
            log.exception("run %s: could not record final status %s", run_id, outcome.status)
        finally:
            live.end()
            self._forget(run_id)

    def _forget(self, run_id: str) -> None:
        self._live.pop(run_id, None)
        if not self._live:
            self._idle.set()

    # --- cancelling ----------------------------------------------------------------------

    def cancel_nowait(self, run_id: str, reason: str = "cancelled") -> bool:
        """Ask a live run to stop; True if it was live. Its end is recorded by its own task.

        A run cancelled before it holds a permit goes QUEUED -> CANCELLED and
        never starts; after, RUNNING -> CANCELLED and its adapter stream is
        closed. The first reason given wins.
        """
        live = self._live.get(run_id)
        if live is None:
            return False
        self._cancel(live, reason)
        return True

    def _cancel(self, live: _LiveRun, reason: str) -> bool:
        """Cancel ``live`` with ``reason``; False if a cancel or stop came first."""
        if live.cancelling:
            return False
        live.cancelling = True
        live.cancel_reason = reason
        if self._gate.withdraw(live):  # it waited as data: it never starts, and ends here
            self._nursery.start_soon(self._finish, live, _Outcome(RunStatus.CANCELLED, reason))
        else:
            live.scope.cancel()
        return True

    def _cancel_many(self, lives: Sequence[_LiveRun], reason: str) -> list[str]:
        """Cancel these runs with ``reason``; return the ids of those cancelled now.

        The ones waiting in the queue are taken out of it and ended together
        (one store write for all: :meth:`_end_in_bulk`); the others are
        cancelled one by one, as :meth:`cancel_nowait` does.
        """
        cancelled: list[str] = []
        waiting: list[_LiveRun] = []
        for live in lives:
            if live.cancelling:
                continue
            live.cancelling = True
            live.cancel_reason = reason
            cancelled.append(live.state.record.run_id)
            if self._gate.withdraw(live):
                waiting.append(live)
            else:
                live.scope.cancel()
        if waiting:
            self._nursery.start_soon(self._end_in_bulk, waiting, reason)
        return cancelled

    async def _end_in_bulk(self, lives: list[_LiveRun], reason: str) -> None:
        """End runs taken out of the queue CANCELLED(``reason``), their events written in
        one go, bounded and shielded like one run's end (see :meth:`_finish`)."""
        now = self._now()
        events = [
            live.state.transition(RunStatus.CANCELLED, time=now, reason=reason) for live in lives
        ]
        try:
            with trio.move_on_after(self.final_write_timeout, shield=True) as scope:
                await self._store.append_many(events)
            if scope.cancelled_caught:
                for live, event in zip(lives, events, strict=True):
                    self._published(live, event)
                    live.end()
                if self._store.health().writable:
                    log.error(
                        "the end of %d cancelled runs not confirmed by the store within %ss",
                        len(lives),
                        self.final_write_timeout,
                    )
                await self._store.sync()
        except StoreError as exc:
            log.warning("the end of %d cancelled runs not all stored: %s", len(lives), exc)
        finally:
            for live, event in zip(lives, events, strict=True):
                if not live.ended:
                    self._published(live, event)
                    live.end()
                self._forget(live.state.record.run_id)

    async def cancel(self, run_id: str, reason: str = "cancelled") -> CancelOutcome:
        """Cancel a run and wait until its final status is recorded.

        ``cancelled`` is False when the run had already ended (its status is
        returned as it is). Raises UnknownRun for an id the node never had.
        """
        live = self._live.get(run_id)
        if live is not None and not live.cancelling:
            self.cancel_nowait(run_id, reason)
            await live.wait_ended()
            record = live.state.record
            return CancelOutcome(run_id, record.status, record.status is RunStatus.CANCELLED)
        if live is not None:
            await live.wait_ended()
            return CancelOutcome(run_id, live.state.record.status, False)
        stored = await self._store.get(run_id)
        if stored is None:
            raise UnknownRun(run_id)
        return CancelOutcome(run_id, stored.status, False)

    def stop_running(self, reason: str, message: str) -> list[str]:
        """End every RUNNING run FAILED with ``reason`` (its engine stream closed); return
        their ids. QUEUED runs go on waiting."""
        ids = []
        for run_id, live in self._live.items():
            if live.state.status is RunStatus.RUNNING and not live.cancelling:
                live.cancelling = True
                live.stop_outcome = _Outcome(RunStatus.FAILED, reason, message)
                live.scope.cancel()
                ids.append(run_id)
        return ids

    def _store_health_changed(self, health: StoreHealth) -> None:
        """A store that cannot write for ``store_grace`` seconds stops the running runs:
        their engines are freed, and their end is stored once the store writes again."""
        if health.writable:
            if self._store_outage is not None:
                self._store_outage.cancel()
                self._store_outage = None
        elif self._store_outage is None:
            self._store_outage = trio.CancelScope()
            self._nursery.start_soon(self._stop_runs_after_grace, self._store_outage, health)

    async def _stop_runs_after_grace(self, scope: trio.CancelScope, health: StoreHealth) -> None:
        with scope:
            await trio.sleep(self.store_grace)
            stopped = self.stop_running(
                "store_unavailable",
                f"the run store {health} for {self.store_grace:g}s; the run was stopped",
            )
            if stopped:
                log.warning(
                    "the run store %s for %gs: stopped %d running runs",
                    health,
                    self.store_grace,
                    len(stopped),
                )

    def abandon(self, owner: Hashable, reason: str = "session_lost") -> list[str]:
        """Cancel the foreground runs of ``owner``; return their ids. Background runs go on."""
        lives = [live for live in self._live.values() if live.owner == owner]
        self._cancel_many(lives, reason)
        return [live.state.record.run_id for live in lives]

    def cancel_all(self, reason: str) -> list[str]:
        """Cancel every live run; return the ids of those this call cancelled."""
        return self._cancel_many(list(self._live.values()), reason)

    # --- admission and draining ----------------------------------------------------------

    @property
    def admitting(self) -> bool:
        return self._admitting

    def stop_admitting(self) -> None:
        """From now on :meth:`submit` raises NodeUnavailable. Runs already in go on."""
        self._admitting = False

    def shut_down(self) -> None:
        """Stop admitting, and end the runs that wait in the queue CANCELLED
        (``node_shutdown``) in one store write; the caller then cancels the nursery,
        which ends the running ones (their final writes are shielded)."""
        self.stop_admitting()
        self._cancel_many(
            [live for live in self._live.values() if self._gate.is_waiting(live)],
            "node_shutdown",
        )

    async def wait_idle(self) -> None:
        """Return when no run is live (at once if none is)."""
        while self._live:
            await self._idle.wait()
        await trio.lowlevel.checkpoint()

    async def drain(self, grace: float, reason: str = "node_draining") -> int:
        """Stop admitting and end every live run within about ``grace`` seconds.

        Runs still QUEUED are cancelled at once (they would not start in time,
        and their caller can resubmit elsewhere); RUNNING runs get ``grace``
        seconds to finish, then are cancelled. Cancelled runs end CANCELLED
        with ``reason``. Returns how many runs were cancelled; every final
        status is recorded before it returns, unless the store cannot write:
        then it returns within ``final_write_timeout`` seconds of the cancel, and
        the rest is the store's to write (or to mark INTERRUPTED at the next start).
        """
        self.stop_admitting()
        queued = [live for live in self._live.values() if live.state.status is RunStatus.QUEUED]
        cancelled = self._cancel_many(queued, reason)
        with trio.move_on_after(grace):
            await self.wait_idle()
        cancelled += self.cancel_all(reason)
        while self._live:
            with trio.move_on_after(self.final_write_timeout):
                await self.wait_idle()
            if self._live and not self._store.health().writable:
                log.warning(
                    "drained without storing the end of %d runs: the run store %s",
                    len(self._live),
                    self._store.health(),
                )
                break
        return len(cancelled)

    # --- reading -------------------------------------------------------------------------

    def live_records(self) -> list[RunRecord]:
        """Copies of the records of every live run (QUEUED or RUNNING, or finishing)."""
        return [attrs.evolve(live.state.record) for live in self._live.values()]

    def live_count(self, status: RunStatus | None = None) -> int:
        if status is None:
            return len(self._live)
        return sum(1 for live in self._live.values() if live.state.status is status)

    async def get(self, run_id: str) -> RunRecord | None:
        live = self._live.get(run_id)
        if live is not None:
            await trio.lowlevel.checkpoint()
            return attrs.evolve(live.state.record)
        return await self._store.get(run_id)

    async def list_runs(self, query: RunQuery = LATEST_RUNS) -> list[RunRecord]:
        """See :meth:`RunStore.list_runs`."""
        return await self._store.list_runs(query)

    async def events(
        self, run_id: str, *, after_seq: int = 0, limit: int | None = None
    ) -> list[RunEvent]:
        """The run's published events with ``seq > after_seq`` (at most ``limit``)."""
        live = self._live.get(run_id)
        after_seq = max(after_seq, 0)
        if live is None or not live.events or live.events[0].seq > after_seq + 1:
            # ended, or asked for events that have left the live window
            return await self._store.events(run_id, after_seq=after_seq, limit=limit)
        await trio.lowlevel.checkpoint()
        found = [e for e in live.events if e.seq > after_seq]
        return found if limit is None else found[: max(limit, 0)]

    def watch(self, run_id: str, *, after_seq: int = 0) -> RunWatcher:
        """Events of ``run_id`` after ``after_seq``, following a live run to its end."""
        return RunWatcher(self, run_id, after_seq)
