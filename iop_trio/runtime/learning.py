"""The Trio shell of ``concurrency: auto``: it feeds a :class:`~.capacity.LearnedCapacity`
and carries its moves out on the gate.

One :class:`CapacityLearner` per pool that learns (an adapter's, or a target's). When
the node starts it asks the engine for its signals once: an engine that exposes them
(:meth:`~iop_trio.adapters.base.Adapter.engine_signals`) is read every
:data:`SCRAPE_INTERVAL` seconds from then on (``engine``), bounded by the adapter's own
timeout; one that exposes none is learned from the latency of the runs that succeed
(``latency``), which the run manager reports (:meth:`CapacityLearner.first_token`,
:meth:`CapacityLearner.run_ended`); the learner looks every interval for runs that wait
for their first token too long (:meth:`~.capacity.LearnedCapacity.on_waiting`). An
engine that cannot be asked at start is taken for one that exposes signals, and its
failed scrapes count as saturated until it answers. Each move sets the pool's limit and
token budget in the gate, is counted by reason and logged at debug level.
"""

from __future__ import annotations

import logging
import math
import random
import weakref
from collections.abc import Callable, Iterable

import trio

from ..adapters.base import Adapter, AdapterError
from ..model import AutoConcurrency, EngineSignals
from .capacity import LearnedCapacity, Move, RunSample
from .gate import Gate, Permit
from .tickets import Pool

log = logging.getLogger(__name__)

#: Seconds between two reads of an engine's signals.
SCRAPE_INTERVAL = 0.5


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
        self._rng = rng or random.Random()
        self.learned: LearnedCapacity | None = None
        #: set once :meth:`run` has asked the engine and :attr:`signal` is known
        self.decided = trio.Event()
        self.last_error = ""
        #: the runs in flight with no first token yet, and when each request went out
        #: (the run manager's; set by the node)
        self.awaiting: Callable[[], Iterable[tuple[Permit, float]]] = lambda: ()
        self._told: weakref.WeakSet[Permit] = weakref.WeakSet()  # runs said to wait

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
            interval=SCRAPE_INTERVAL,
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
            return await self.adapter.engine_signals(trio.current_time())
        except AdapterError as exc:
            self.last_error = exc.message
            return exc

    async def run(self) -> None:
        """Until cancelled: decide the signal, then read the engine's (engine), or look
        every interval for runs that wait for their first token too long (latency)."""
        first = await self._read()
        if first is None:
            learned = self._start("latency")
            while True:
                await trio.sleep(SCRAPE_INTERVAL * (1 + 0.25 * self._rng.random()))
                self._look_for_waiting(learned)
                self._apply(
                    learned.on_tick(
                        trio.current_time(),
                        running=self.pool.running,
                        reserved=self.pool.reserved,
                        queued=self.gate.scheduler.waiting_for(self.pool),
                        smallest=self.gate.scheduler.smallest_waiting(self.pool),
                    )
                )
        learned = self._start("engine")
        signals: EngineSignals | AdapterError | None = first
        while True:
            move = learned.on_engine(
                # a failed read, or signals that went away: saturated, not free
                signals if isinstance(signals, EngineSignals) else None,
                trio.current_time(),
                running=self.pool.running,
                reserved=self.pool.reserved,
                queued=self.gate.scheduler.waiting_for(self.pool),
            )
            self._apply(move)
            await trio.sleep(SCRAPE_INTERVAL)
            signals = await self._read()

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
        now = trio.current_time()
        past = learned.waited_past()
        if past is None:
            return
        for permit, sent in list(self.awaiting()):
            if permit in self._told or now - sent <= past:
                continue
            sample = self._sample(permit, now - sent)
            if sample is not None:
                self._told.add(permit)  # told once, whatever it moves
                self._apply(learned.on_waiting(now - sent, sample, now))

    def first_token(self, permit: Permit, ttft: float) -> None:
        """A run through this pool had its first token ``ttft`` seconds after its request
        went out (``latency`` learners use it; a run already told to wait is not told
        again)."""
        learned = self.learned
        if learned is None or learned.signal != "latency" or permit in self._told:
            return
        sample = self._sample(permit, ttft)
        if sample is not None:
            self._apply(learned.on_first_token(sample, trio.current_time()))

    def run_ended(self, permit: Permit, tpot: float | None) -> None:
        """A run through this pool succeeded, ``tpot`` seconds per output token after its
        first (None for fewer than two)."""
        self._told.discard(permit)
        if self.learned is not None and permit.at_grant(self.pool) is not None:
            self.learned.on_run_end(tpot)
