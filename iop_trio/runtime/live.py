"""Live runs: a run's phase, its window of recent events, its watchers, and publishing.

A run is *live* from its submission until its end is published (and its write done or
given up). Its :class:`RunPhase` moves only along :data:`PHASE_MOVES`; a move not in
the table is a bug and raises RuntimeError. Whether somebody asked it to end (a cancel,
or a stop) is not a phase but what it was asked (:attr:`LiveRun.asked`): a run asked to
end still moves on (a run being stored goes on being stored, a STARTED taken by the
store is still published), and its own task ends it as it was asked.

*Publishing* an event (:meth:`LiveRun.publish`) is the one act by which an event
becomes visible: it joins the run's window, its watchers wake, and the listeners are
told. Every event is in the store (taken by it, and durable as
:meth:`LiveRuns.write` says) before it is published.
"""

from __future__ import annotations

import collections
import enum
import logging
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
import trio

from ..lifecycle import RunState
from ..model import EventKind, RunEvent, RunRecord, RunStatus, Usage
from ..store.base import RunStore
from .gate import Permit

if TYPE_CHECKING:
    from .spans import RunSpans

log = logging.getLogger(__name__)

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

#: Told ``(event, record)`` of each published event: hooks (metrics, logs), called
#: synchronously with the run's own live record, which they must not change.
Listener = Callable[[RunEvent, RunRecord], None]


def notify(listeners: Sequence[Listener], event: RunEvent, record: RunRecord) -> None:
    """Call each listener with ``(event, record)``; one that raises is logged and skipped."""
    for listener in listeners:
        try:
            listener(event, record)
        except Exception:
            log.exception("event listener %r failed", listener)


@attrs.frozen
class Outcome:
    """How a run ends (or is asked to end): its terminal status and what it carries."""

    status: RunStatus
    reason: str = ""
    message: str = ""
    usage: Usage | None = None  # what the engine reported (its Completion), if it did
    retry_after: float | None = None
    # a run that succeeded: seconds from its request to its first token, and per output
    # token after it (None for fewer than two), for a learned concurrency
    ttft: float | None = None
    tpot: float | None = None


#: The most times a run's engine request is taken back (:meth:`LiveRun.step_back`): after
#: that it waits where it is, inside its engine.
MOST_STEPS_BACK = 2


class RunPhase(enum.Enum):
    """Where a live run is on its way (see :data:`PHASE_MOVES`)."""

    #: its QUEUED record (and STARTED, if it got a permit at once) is being stored
    ENTERING = "entering"
    #: stored QUEUED, without a permit: in the line to enter the gate, or waiting in it
    QUEUED = "queued"
    #: granted a permit; its task is on its way to start it
    ADMITTED = "admitted"
    #: its STARTED is taken by the store and published once durable
    STARTING = "starting"
    #: STARTED is published: its engine's stream is relayed until its end
    RUNNING = "running"
    #: its end is published (or it was never stored); it is no longer live
    ENDED = "ended"


#: The moves a live run may make. ENTERING -> RUNNING: stored with its STARTED (a run
#: with room at once); ENTERING -> ENDED: not stored (the submitter is told why).
#: STARTING -> ENDED only when its end could not be recorded (a bug, logged).
PHASE_MOVES: Mapping[RunPhase, frozenset[RunPhase]] = {
    RunPhase.ENTERING: frozenset({RunPhase.QUEUED, RunPhase.RUNNING, RunPhase.ENDED}),
    RunPhase.QUEUED: frozenset({RunPhase.ADMITTED, RunPhase.ENDED}),
    RunPhase.ADMITTED: frozenset({RunPhase.STARTING, RunPhase.ENDED}),
    RunPhase.STARTING: frozenset({RunPhase.RUNNING, RunPhase.ENDED}),
    RunPhase.RUNNING: frozenset({RunPhase.ENDED}),
    RunPhase.ENDED: frozenset(),
}


@attrs.define(eq=False, repr=False)
class LiveRun:
    """A run whose task is alive: its phase, cancel scope and latest events for watchers.

    ``events`` holds the last :data:`EVENT_WINDOW` published events (each is in the
    store before it is published), so a run's memory does not grow with its output. The
    wakeup Event is made only when somebody waits, which keeps a queued run small.
    """

    state: RunState
    owner: Hashable | None
    listeners: Sequence[Listener]
    phase: RunPhase = RunPhase.ENTERING
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    # the end a cancel or a stop asked for (the first one wins), None if none did
    asked: Outcome | None = None
    unsynced: int = 0  # deltas taken by the store since the last one that was waited for
    delta_tokens: int = 0  # the engine tokens of the run's delta events so far
    # its prompt's tokens as counted at admission (None: not counted), and whether that
    # was the engine tokenizer's own count
    prompt_tokens: int | None = None
    prompt_exact: bool = False
    # while admitted: its permit, when its engine request went out, its first token,
    # and when the engine was last heard from (the request, or its latest chunks)
    permit: Permit | None = None
    sent_at: float | None = None
    first_at: float | None = None
    heard_at: float | None = None
    # the seconds between the engine's two latest batches for it after its first token
    # (0: none yet): a step of the engine, as long as the longest prefill it held up
    gap: float = 0.0
    # from its STARTED on: the replica its engine request goes to ("" where its adapter
    # has none); another after a failover (pipeline.StreamRelay.relay_run)
    replica: str = ""
    # while its engine request may be taken back (sent, nothing heard from the engine
    # yet): that request's cancel scope; once taken back, the Event that lets it go
    # again; how many times it was (see :meth:`step_back`)
    attempt: trio.CancelScope | None = None
    back: trio.Event | None = None
    steps_back: int = 0
    # while STARTING: its STARTED event, and the Event set once that is durable
    starting: tuple[RunEvent, trio.Event] | None = None
    # a list while it is short (a queued run has one event: an empty deque of the
    # window's size costs about 600 bytes), the window's deque once it grows
    events: list[RunEvent] | collections.deque[RunEvent] = attrs.field(factory=list)
    published: int = 0  # the seq of the last published event
    # a delta made and not yet stored: stored and published with the next (LiveRuns.hold)
    held: RunEvent | None = None
    _changed: trio.Event | None = None
    # its open spans (runtime/spans.py); None when tracing is off
    spans: RunSpans | None = None

    def __repr__(self) -> str:
        asked = "" if self.asked is None else f" asked={self.asked.status.value}"
        return (
            f"<LiveRun {self.state.record!r} {self.phase.value}{asked} published={self.published}>"
        )

    @property
    def ended(self) -> bool:
        return self.phase is RunPhase.ENDED

    def move(self, to: RunPhase) -> None:
        """Move to phase ``to``; RuntimeError (naming both phases) if the table forbids it."""
        if to not in PHASE_MOVES[self.phase]:
            raise RuntimeError(
                f"run {self.state.record.run_id} cannot go from {self.phase.value} to {to.value}"
            )
        self.phase = to

    def step_back(self) -> bool:
        """Take its engine request back: close it and have the run wait, holding its
        permit, until :meth:`go_again` (``concurrency: auto`` does this to a run that
        waits inside an engine found full, so the wait is in the node's hands, where a
        cancel, a priority and the learned limit reach it). Only while the engine has
        sent nothing for it, so nothing it relays is sent twice; False (nothing done)
        otherwise, or once it was taken back :data:`MOST_STEPS_BACK` times."""
        attempt = self.attempt
        if attempt is None or self.first_at is not None or self.steps_back >= MOST_STEPS_BACK:
            return False
        self.steps_back += 1
        self.attempt = None
        self.back = trio.Event()
        attempt.cancel()
        return True

    @property
    def held_back(self) -> bool:
        """Whether it was taken back (:meth:`step_back`) and waits to go again."""
        return self.back is not None and not self.back.is_set()

    def go_again(self) -> None:
        """Let a run taken back send its request again (nothing if it was not)."""
        if self.back is not None:
            self.back.set()

    def start_event(self, time: float) -> RunEvent:
        """Move its state to RUNNING; the STARTED event, which names the replica its
        permit holds a place at (and so does :attr:`replica` from now on)."""
        permit = self.permit
        self.replica = (None if permit is None else permit.replica) or ""
        return self.state.transition(RunStatus.RUNNING, time=time, replica=self.replica)

    def admit(self, permit: Permit) -> None:
        """A run that waited (QUEUED) was granted ``permit``."""
        self.move(RunPhase.ADMITTED)
        self.permit = permit
        if self.spans is not None:
            self.spans.admitted()

    def ask(self, outcome: Outcome) -> bool:
        """Ask the run to end as ``outcome``; False (and nothing asked) if a cancel or a
        stop came first. Its own task ends it (see :meth:`stopped`)."""
        if self.asked is not None:
            return False
        self.asked = outcome
        return True

    def stopped(self) -> Outcome:
        """How a run cancelled or stopped before its own end ends: as it was asked, else
        CANCELLED("cancelled")."""
        return self.asked or Outcome(RunStatus.CANCELLED, "cancelled")

    def publish(self, event: RunEvent) -> None:
        """Publish ``event`` (stored already): into the window, to the watchers and the
        listeners."""
        self.events.append(event)
        if len(self.events) > SHORT_WINDOW and isinstance(self.events, list):
            self.events = collections.deque(self.events, maxlen=EVENT_WINDOW)
        self.published = event.seq
        self._wake()
        if self.spans is not None and event.kind.terminal:
            with self.spans.current():  # the log line of its end names its trace
                notify(self.listeners, event, self.state.record)
            return
        notify(self.listeners, event, self.state.record)

    def publish_start(self) -> None:
        """Publish the STARTED a STARTING run holds and move it to RUNNING; nothing if
        that was done already (whichever comes first: its durability, or the run)."""
        if self.phase is RunPhase.STARTING and self.starting is not None:
            started, _ = self.starting
            self.starting = None
            self.move(RunPhase.RUNNING)
            self.publish(started)

    def event(self, seq: int) -> RunEvent | None:
        """The published event ``seq`` if it is still in the window, else None."""
        if not self.events:
            return None
        index = seq - self.events[0].seq
        return self.events[index] if 0 <= index < len(self.events) else None

    def end(self) -> None:
        """Its end is published (or given up on): ENDED, its watchers are woken, and its
        spans end with its last event."""
        self.move(RunPhase.ENDED)
        self._wake()
        if self.spans is not None:
            last = self.events[-1] if self.events else None
            self.spans.ended(
                last if last is not None and last.kind.terminal else None, self.state.record
            )
            self.spans = None

    def discard(self) -> None:
        """It was never stored: ENDED, without waking anybody (nobody was told of it);
        its spans end, an error (``not_stored``)."""
        self.move(RunPhase.ENDED)
        if self.spans is not None:
            self.spans.ended(None, self.state.record)
            self.spans = None

    def trace_here(self) -> None:
        """Its run span is the current span for the rest of the calling task (one of the
        run's own: for the log lines about it); nothing without spans."""
        if self.spans is not None:
            self.spans.make_current()

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


class LiveRuns:
    """The live runs of one manager, by id, and how their events are stored and
    published (the one place both happen)."""

    def __init__(
        self, store: RunStore, listeners: list[Listener], wall_clock: Callable[[], float]
    ) -> None:
        self.store = store
        self._now = wall_clock
        # hooks (metrics, logs) told of each published event; see Listener
        self.listeners = listeners
        self._runs: dict[str, LiveRun] = {}
        self._idle = trio.Event()
        self._idle.set()

    def __repr__(self) -> str:
        return f"<LiveRuns {len(self._runs)}>"

    def __len__(self) -> int:
        return len(self._runs)

    def __iter__(self) -> Iterator[LiveRun]:
        return iter(self._runs.values())

    def held_back(self) -> Iterator[Permit]:
        """The permits of the runs taken back from their engine (:meth:`LiveRun.step_back`)
        that wait to go again, the first granted first (learning.StepsBack)."""
        held = [
            live.permit
            for live in self
            if live.held_back and live.permit is not None and not live.permit.released
        ]
        yield from sorted(held, key=lambda p: p.granted_at or 0.0)

    def step_back(self, permit: Permit) -> bool:
        """Take back the engine request of the run that holds ``permit``; whether it was."""
        live = self._holding(permit)
        return live is not None and live.step_back()

    def go_again(self, permit: Permit) -> None:
        """Let the run that holds ``permit``, taken back, send its request again."""
        live = self._holding(permit)
        if live is not None:
            live.go_again()

    def _holding(self, permit: Permit) -> LiveRun | None:
        return next((live for live in self if live.permit is permit), None)

    def __contains__(self, run_id: str) -> bool:
        return run_id in self._runs

    def get(self, run_id: str) -> LiveRun | None:
        return self._runs.get(run_id)

    def add(self, run_id: str, state: RunState, owner: Hashable | None) -> LiveRun:
        """A new live run, ENTERING."""
        live = self._runs[run_id] = LiveRun(state, owner, self.listeners)
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        return live

    def forget(self, run_id: str) -> None:
        """The run is no longer live (ended, or never stored)."""
        self._runs.pop(run_id, None)
        if not self._runs:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return when no run is live (at once if none is)."""
        while self._runs:
            await self._idle.wait()
        await trio.lowlevel.checkpoint()

    def start(self, live: LiveRun) -> None:
        """Make the run's STARTED event (ADMITTED -> STARTING) and have the store write it
        at once, without waiting: the engine's request goes out while the commit is on
        its way. STARTED is published (so a watcher sees it) only once it is durable,
        and before any later event (:meth:`write` waits for it), so its guarantee is the
        same as if it were waited for here; the engine's first token, which takes
        longer, hides the commit. A crash in between leaves the run QUEUED, so
        INTERRUPTED at restart."""
        event = live.start_event(self._now())
        durable = trio.Event()
        live.unsynced = 0
        live.move(RunPhase.STARTING)
        live.starting = (event, durable)

        def on_durable() -> None:
            durable.set()
            live.publish_start()

        self.store.append_nowait(event, on_durable=on_durable)

    async def write(self, live: LiveRun, event: RunEvent) -> None:
        """Store ``event``, then publish it (after a STARTED still held, once that one is
        durable: see :meth:`start`; after a delta held, stored with it: see :meth:`hold`).

        A delta is published as soon as the store has taken it; every
        :data:`SYNC_EVERY`-th delta, like every status event, waits until it is
        durable, and with it every delta before it (the store writes in order).
        So a run's deltas are written in batches, at most SYNC_EVERY of them are
        not yet durable (all within its window of events), and a crash leaves
        a whole log whose text is a prefix of what was streamed.
        """
        if live.starting is not None:
            _, durable = live.starting
            try:
                await durable.wait()
            except BaseException:
                # cancelled: STARTED is taken by the store, and this event is made (its
                # seq is taken), so it is handed over too, in order, and both published;
                # left out, its run's end would be refused for the gap
                if not live.ended:
                    live.publish_start()
                    self.release_held(live)
                    self.store.append_nowait(event)
                    live.publish(event)
                raise
            if live.ended:
                return  # its create failed (RunManager._create): never stored, nothing goes
            live.publish_start()
        if event.kind is EventKind.DELTA and live.held is None and live.unsynced < SYNC_EVERY:
            live.unsynced += 1
            self.store.append_nowait(event)
            live.publish(event)
            return
        live.unsynced = 0
        spans = live.spans if event.kind.terminal else None
        if spans is not None:
            spans.write_began()
        events = self._with_held(live, event)
        try:
            if len(events) == 1:
                await self.store.append(event)
            else:
                await self.store.append_many(events)
        finally:
            if spans is not None:
                spans.write_ended()
            # the store took the events before its first checkpoint, so they are
            # published even when the wait for durability was cancelled
            for made in events:
                live.publish(made)

    @staticmethod
    def _with_held(live: LiveRun, event: RunEvent) -> tuple[RunEvent, ...]:
        """``event``, after the delta ``live`` holds (taken from it), if any."""
        held, live.held = live.held, None
        return (event,) if held is None else (held, event)

    def hold(self, live: LiveRun, event: RunEvent) -> None:
        """Keep the delta ``event`` for the run's next write, which stores both in one write
        and publishes both in one step: for the last delta of a run whose engine has said
        it is done, so that its text and its end take one commit, not two, and go out
        together (one frame, one send on each hop) instead of the text alone and the end a
        commit later. The text waits for no more than its end's commit, which its
        engine's end has begun. It is neither stored nor published until then: a crash
        in between loses text nobody was sent (the log stays a prefix of what was). A
        delta held already goes first, alone (:meth:`release_held`)."""
        self.release_held(live)
        live.held = event

    def release_held(self, live: LiveRun) -> None:
        """Store and publish the delta ``live`` holds, if any, now: its end will not be
        written (a run given up on without one)."""
        if live.held is not None:
            held, live.held = live.held, None
            self.store.append_nowait(held)
            live.publish(held)

    async def stored_events(
        self, run_id: str, *, after_seq: int, limit: int | None
    ) -> list[RunEvent]:
        """The run's stored events with ``seq > after_seq`` (at most ``limit``)."""
        return await self.store.events(run_id, after_seq=after_seq, limit=limit)

    async def events(
        self, run_id: str, *, after_seq: int = 0, limit: int | None = None
    ) -> list[RunEvent]:
        """The run's published events with ``seq > after_seq`` (at most ``limit``)."""
        live = self._runs.get(run_id)
        after_seq = max(after_seq, 0)
        if live is None or not live.events or live.events[0].seq > after_seq + 1:
            # ended, or asked for events that have left the live window
            return await self.stored_events(run_id, after_seq=after_seq, limit=limit)
        await trio.lowlevel.checkpoint()
        found = [e for e in live.events if e.seq > after_seq]
        return found if limit is None else found[: max(limit, 0)]

    def watch(self, run_id: str, *, after_seq: int = 0) -> RunWatcher:
        """Events of ``run_id`` after ``after_seq``, following a live run to its end."""
        return RunWatcher(self, run_id, after_seq)


class RunWatcher:
    """Async iterator over a run's events with ``seq > after_seq``, live until the terminal one.

    For a run that has ended it yields the stored events and stops. A slow
    reader never slows the run and costs it no memory: it reads from the live
    run's window of recent events while it keeps up, and from the store (a
    page at a time) when it falls behind or once the run has ended.
    """

    def __init__(self, runs: LiveRuns, run_id: str, after_seq: int) -> None:
        self._runs = runs
        self.run_id = run_id
        self.next_seq = after_seq + 1
        self._live = runs.get(run_id)
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
            page = await self._runs.stored_events(
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
