"""The Trio shell of ``concurrency: auto``: it feeds a :class:`~.capacity.LearnedCapacity`
and carries its moves out on the gate.

One :class:`CapacityLearner` per pool that learns (an adapter's, or a target's). When
the node starts it asks the engine for its signals once: an engine that exposes them
(:meth:`~iop_trio.adapters.base.Adapter.engine_signals`) is read from then on
(``engine``), bounded by the adapter's own timeout, each scrape beginning
``max(interval - the last one's time, interval / 4)`` after the last one answered, the
interval being the policy's (a few of the engine's steps), with up to a quarter more at
random; one that exposes none is learned from the latency of the runs that succeed
(``latency``), looked at every interval. The run manager reports every run's first
token and end (:meth:`CapacityLearner.first_token`, :meth:`CapacityLearner.run_ended`:
the engine's step, for both) and, on demand, the runs in the engine and when each was
last heard from (:attr:`CapacityLearner.in_engine`): an engine learner counts the
node's runs stalled there, a latency learner tells the policy of runs that wait for
their first token too long (:meth:`~.capacity.LearnedCapacity.on_waiting`). An engine
that cannot be asked at start is taken for one that exposes signals, and its failed
scrapes count as saturated until it answers. Each move sets the pool's limit and token
budget in the gate, is counted by reason and logged at debug level.

**Runs let in past what the engine holds are taken back.** A run let in over a limit
the learner then lowered waits inside the engine for a place, a whole run's time when
runs are long, out of reach of the node's priorities, cancels and limits. After every
look, while the pool's runs in the engine are over its limit or budget, the youngest
that wait past :meth:`~.capacity.LearnedCapacity.waited_past` for a first token, and
those granted after the oldest of them with no first token either, are
taken back (their request closed: the engine sent nothing for them, so nothing is sent
twice) and wait in the node, holding their permits; as the engine's runs end, those
this learner took back go again, the first granted first, before any new run (their
permits keep their places). The runs
taken back count as waiting for the pool, not as in the engine, in what the policy is
told (:class:`StepsBack`: the node's live runs, `live.LiveRuns`).
"""

from __future__ import annotations

import logging
import math
import random
import weakref
from collections.abc import Callable, Iterable
from typing import Protocol

import trio

from ..adapters.base import Adapter, AdapterError
from ..model import AutoConcurrency, EngineSignals
from .capacity import LearnedCapacity, Move, RunSample
from .gate import Gate, Permit
from .tickets import Pool

log = logging.getLogger(__name__)

#: The share of an interval a scrape waits after the last one, at least.
LEAST_GAP = 0.25


class StepsBack(Protocol):
    """What takes runs' engine requests back and lets them go again (live.LiveRuns)."""

    def held_back(self) -> Iterable[Permit]:
        """The permits of the runs taken back that wait to go again, first granted first."""
        ...

    def step_back(self, permit: Permit) -> bool:
        """Take back the request of the run that holds ``permit``; whether it was."""
        ...

    def go_again(self, permit: Permit) -> None:
        """Let the run that holds ``permit`` send its request again."""
        ...


class _NoneBack:
    def held_back(self) -> Iterable[Permit]:
        return ()

    def step_back(self, permit: Permit) -> bool:
        return False

    def go_again(self, permit: Permit) -> None:
        pass


class CapacityLearner:
    """Learns ``pool``'s limit and token budget from ``adapter``'s engine (module
    docstring). ``signal`` is ``None`` until :meth:`run` has asked the engine."""

    def __init__(
        self,
        name: str,
        auto: AutoConcurrency,
        pool: Pool,
        adapter: Adapter,
        gate: Gate,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self.name = name
        self.auto = auto
        self.pool = pool
        self.adapter = adapter
        self.gate = gate
        # by default from the global one, so that seeding that makes a run repeatable
        self._rng = rng or random.Random(random.getrandbits(64))
        self.learned: LearnedCapacity | None = None
        #: set once :meth:`run` has asked the engine and :attr:`signal` is known
        self.decided = trio.Event()
        self.last_error = ""
        #: the runs in the engine, when each was last heard from and whether its first
        #: token came (the run manager's :meth:`~.manager.RunManager.in_engine`; set by
        #: the node)
        self.in_engine: Callable[[], Iterable[tuple[Permit, float, bool]]] = lambda: ()
        #: the runs in the engine that have had a first token, and the seconds between
        #: the engine's two latest batches for each (the manager's
        #: :meth:`~.manager.RunManager.engine_gaps`; set by the node)
        self.engine_gaps: Callable[[], Iterable[tuple[Permit, float]]] = lambda: ()
        #: takes runs back from the engine (module docstring; set by the node)
        self.steps_back: StepsBack = _NoneBack()
        self._told: weakref.WeakSet[Permit] = weakref.WeakSet()  # runs said to wait
        # the runs this learner took back: only it lets them go (a run in two pools
        # goes again once the pool that took it back has room)
        self._taken: weakref.WeakSet[Permit] = weakref.WeakSet()
        #: runs it has taken back since the start (``iop_gate_runs_taken_back_total``)
        self.taken_back = 0
        #: told each scrape (None: it failed), for a replica's routing (set by the node)
        self.scraped: Callable[[EngineSignals | None], None] | None = None

    def __repr__(self) -> str:
        return f"<CapacityLearner {self.name} {self.learned!r}>"

    @property
    def signal(self) -> str | None:
        """``engine``, ``latency``, or None before the engine was asked."""
        return None if self.learned is None else self.learned.signal

    def _start(self, signal: str) -> LearnedCapacity:
        learned = LearnedCapacity(
            self.auto,
            signal=signal,
            now=trio.current_time(),
            rng=self._rng,
        )
        self.learned = learned
        self.decided.set()
        self._apply(Move("start", learned.limit, learned.budget))
        log.info(
            "%s: concurrency learned from %s, from %d runs at once",
            self.name,
            "the engine's metrics" if signal == "engine" else "the latency of its runs",
            learned.limit,
        )
        return learned

    def _apply(self, move: Move | None) -> None:
        if move is None:
            return
        self.gate.set_pool_limit(self.pool, move.limit)
        self.gate.set_pool_budget(
            self.pool, move.budget if move.budget == math.inf else int(move.budget)
        )
        log.debug("%s: %s -> %d runs, %s tokens", self.name, move.reason, move.limit, move.budget)

    async def _read(self) -> EngineSignals | AdapterError | None:
        """The engine's signals, None if it exposes none, or the AdapterError."""
        try:
            signals = await self.adapter.engine_signals(trio.current_time())
        except AdapterError as exc:
            self.last_error = exc.message
            if self.scraped is not None:
                self.scraped(None)
            return exc
        if self.scraped is not None and signals is not None:
            self.scraped(signals)
        return signals

    def _jittered(self, seconds: float) -> float:
        return seconds * (1 + 0.25 * self._rng.random())

    async def run(self) -> None:
        """Until cancelled: decide the signal, then read the engine's (engine), or look
        every interval for runs that wait for their first token too long (latency)."""
        first = await self._read()
        if first is None:
            await self._learn_latency(self._start("latency"))
        learned = self._start("engine")
        signals: EngineSignals | AdapterError | None = first
        began = trio.current_time()
        while True:
            stalled, unjudged = self._judge(learned)
            held, running, reserved = self._engaged()
            self._apply(
                learned.on_engine(
                    # a failed read, or signals that went away: saturated, not free
                    signals if isinstance(signals, EngineSignals) else None,
                    trio.current_time(),
                    running=running,
                    reserved=reserved,
                    queued=self.gate.scheduler.waiting_for(self.pool) + len(held),
                    stalled=stalled,
                    unjudged=unjudged,
                )
            )
            self._rebalance(learned)
            # the next scrape begins an interval after this one began, or, after a slow
            # one, LEAST_GAP of an interval after it answered
            now = trio.current_time()
            wait = max(learned.interval * LEAST_GAP, began + learned.interval - now)
            await trio.sleep(self._jittered(wait))
            began = trio.current_time()
            signals = await self._read()

    async def _learn_latency(self, learned: LearnedCapacity) -> None:
        while True:
            await trio.sleep(self._jittered(learned.interval))
            _stalled, unjudged = self._judge(learned)  # the step now, first
            self._look_for_waiting(learned)
            held, running, reserved = self._engaged()
            smallest = self.gate.scheduler.smallest_waiting(self.pool)
            if held:
                least = min(p.cost for p in held)
                smallest = least if smallest is None else min(smallest, least)
            self._apply(
                learned.on_tick(
                    trio.current_time(),
                    running=running,
                    reserved=reserved,
                    queued=self.gate.scheduler.waiting_for(self.pool) + len(held),
                    smallest=smallest,
                    unjudged=unjudged,
                )
            )
            self._rebalance(learned)

    def _engaged(self, ending: Permit | None = None) -> tuple[list[Permit], int, int]:
        """The pool's runs taken back (first granted first), and the runs and tokens it
        has in the engine: the rest, but ``ending`` (a run about to give its place back)."""
        held = [p for p in self.steps_back.held_back() if p.at_grant(self.pool) is not None]
        running = self.pool.running - len(held)
        reserved = self.pool.reserved - sum(p.cost for p in held)
        if ending is not None and ending.at_grant(self.pool) is not None:
            running, reserved = running - 1, reserved - ending.cost
        return held, running, reserved

    def _rebalance(self, learned: LearnedCapacity, ending: Permit | None = None) -> None:
        """Over the learned limit or budget, take back the youngest runs that wait for
        a first token past their bound; under them, let those this learner took back go
        again, the first granted first (module docstring). Both learners do."""
        held, running, reserved = self._engaged(ending)
        limit, budget = learned.limit, learned.budget
        if running > limit or (running > 1 and reserved > budget):
            waiting = self._waiting_in_engine(learned, ending)
            for permit in waiting:
                if running <= limit and (running <= 1 or reserved <= budget):
                    break
                if self.steps_back.step_back(permit):
                    self._told.add(permit)  # what it shows after this is not a sample
                    self._taken.add(permit)
                    self.taken_back += 1
                    running, reserved = running - 1, reserved - permit.cost
            return
        for permit in held:
            if permit not in self._taken:
                continue
            if running + 1 > limit or (running and reserved + permit.cost > budget):
                break
            self._taken.discard(permit)
            self.steps_back.go_again(permit)
            running, reserved = running + 1, reserved + permit.cost

    def _waiting_in_engine(self, learned: LearnedCapacity, ending: Permit | None) -> list[Permit]:
        """The pool's runs in the engine (but ``ending``) that wait for a first token
        past their bound, youngest first, and every run granted after the oldest of
        those that has no first token either: the engine admits in order, so a run
        behind one that waits for room waits too, and is taken back without waiting
        out a bound of its own."""
        now = trio.current_time()
        mine = [
            (permit, sent, permit.granted_at or 0.0)
            for permit, sent, had_first in self.in_engine()
            if not had_first and permit is not ending and permit.at_grant(self.pool) is not None
        ]
        past_bound = [
            granted
            for permit, sent, granted in mine
            if (past := self._waited_past(learned, permit)) is not None and now - sent > past
        ]
        if not past_bound:
            return []
        oldest = min(past_bound)
        waiting = [permit for permit, _sent, granted in mine if granted >= oldest]
        waiting.sort(key=lambda p: p.granted_at or 0.0, reverse=True)
        return waiting

    def _waited_past(self, learned: LearnedCapacity, permit: Permit) -> float | None:
        """The seconds past which ``permit``'s run, with no first token, waits inside the
        engine (:meth:`~.capacity.LearnedCapacity.waited_past`, by what it saw in this
        pool at its grant)."""
        return learned.waited_past(permit.cost, permit.at_grant(self.pool))

    def _judge(self, learned: LearnedCapacity) -> tuple[int, int]:
        """The pool's runs in the engine that are stalled (nothing heard for longer than
        the policy allows; none until it has measured a step), and those granted since
        its last rise that await their first token, not stalled, with those told to
        wait that still do (the engine is full while they wait: no rise)."""
        now = trio.current_time()
        mine = [
            (permit, heard, first)
            for permit, heard, first in self.in_engine()
            if permit.at_grant(self.pool) is not None
        ]
        grants = [p.granted_at for p, _heard, _first in mine if p.granted_at is not None]
        # a run just heard from after a long step (a burst of prefills) shows that step
        gaps = dict(self.engine_gaps())
        streams = [(now - heard, gaps.get(p, 0.0)) for p, heard, first in mine if first]
        learned.on_streaming(
            [max(quiet, gap / 2) for quiet, gap in streams],
            now - min(grants) if grants else 0.0,
            [max(quiet, gap) for quiet, gap in streams if gap],
        )
        later_past = learned.stalled_past()
        stalled = unjudged = 0
        for permit, heard, had_first in mine:
            past = later_past if had_first else self._waited_past(learned, permit)
            quiet = past is not None and now - heard > past
            stalled += quiet
            if not had_first and (quiet or permit in self._told):
                unjudged += 1  # it waits in the engine: the engine is full, no rise yet
            elif not had_first:
                # a run the last rise let in (not one that took a place freed since)
                granted = permit.granted_at
                risen = learned.risen_at
                unjudged += granted is not None and risen <= granted <= risen + learned.step
        return stalled, unjudged

    def _sample(self, permit: Permit, ttft: float) -> RunSample | None:
        seen = permit.at_grant(self.pool)
        if seen is None:
            return None
        granted = permit.granted_at
        return RunSample(
            ttft,
            in_flight=seen[0],
            reserved=seen[1],
            cost=permit.cost,
            granted_at=0.0 if granted is None else granted,
        )

    def _look_for_waiting(self, learned: LearnedCapacity) -> None:
        """Tell the policy of each run of the pool that waits past its bound for a first
        token, once, with the tokens the engine holds of the pool's (those of the runs
        not waiting so)."""
        now = trio.current_time()
        waiting = []
        streaming = 0  # the pool's runs that have had their first token
        for permit, sent, had_first in list(self.in_engine()):
            if permit.at_grant(self.pool) is None:
                continue
            streaming += had_first
            past = None if had_first else self._waited_past(learned, permit)
            if past is not None and now - sent > past:
                waiting.append((permit, sent))
        held = self.pool.reserved - sum(permit.cost for permit, _sent in waiting)
        for permit, sent in waiting:
            if permit in self._told:
                continue
            sample = self._sample(permit, now - sent)
            if sample is not None:
                self._told.add(permit)  # told once, whatever it moves
                move = learned.on_waiting(
                    now - sent, sample, now, held=held, streaming=lambda: streaming
                )
                self._apply(move)

    def _streaming(self) -> int:
        """The pool's runs in the engine that have had their first token: what the
        engine's batch held at least, as one of the pool's runs waited for a place."""
        return sum(
            1
            for permit, _heard, had_first in self.in_engine()
            if had_first and permit.at_grant(self.pool) is not None
        )

    def first_token(self, permit: Permit, ttft: float) -> None:
        """A run through this pool had its first token ``ttft`` seconds after its request
        went out (every learner takes the engine's step from it; a latency learner
        judges it too, unless the run was already told to wait)."""
        learned = self.learned
        if learned is None or permit in self._told:
            return
        sample = self._sample(permit, ttft)
        if sample is not None:
            # the streaming runs are counted only for a run the policy finds waited
            now = trio.current_time()
            self._apply(learned.on_first_token(sample, now, streaming=self._streaming))

    def run_ended(self, permit: Permit, tpot: float | None) -> None:
        """A run through this pool succeeded, ``tpot`` seconds per output token after its
        first (None for fewer than two)."""
        self._told.discard(permit)
        if self.learned is not None and permit.at_grant(self.pool) is not None:
            granted = permit.granted_at
            took = None if granted is None else trio.current_time() - granted
            self.learned.on_run_end(tpot, took)
            self._rebalance(self.learned, ending=permit)  # its place: a run taken back's
