"""Concurrency learned from the engine, sans I/O: what ``concurrency: auto`` does.

An engine does not fill up on runs but on its KV cache, and no fixed number of runs
fits a mixed load. A :class:`LearnedCapacity` holds, for one pool (an adapter's, or a
target's), a learned **limit** (runs at once, within ``[minimum, maximum]`` and under
every static cap, since those are other pools) and a learned **token budget** (the
tokens the node's runs may reserve there at once: what the engine holds, as the node
counts its runs' prompt and most output). It moves them from one of two signals, and
says why it moved (:class:`Move`), so an operator can see it:

**The engine's own signals** (``signal = "engine"``), read from its metrics at a bounded
interval (:class:`~iop_trio.model.EngineSignals`: vLLM's ``vllm:num_requests_waiting``
and ``vllm:kv_cache_usage_perc``, llama.cpp's ``llamacpp:requests_deferred`` and
``llamacpp:kv_cache_usage_ratio``):

- requests wait inside the engine: it has more than it takes. The limit drops to what
  it runs, the budget to the share of the tokens in flight that those hold, and a
  *ceiling* is kept there (``engine_waiting``);
- none wait and the cache is in use: the budget is what the cache holds in all, as the
  node's reservations count it (the tokens in flight over the cache's share in use),
  times :data:`FILL`, under the ceiling; the limit grows while runs wait for it and the
  cache has room (``engine_room``);
- the scrape failed or is older than :data:`STALE_AFTER` intervals: that is *saturated*,
  never free. Nothing more than runs now is let in (``stale``).

**Latency** (``signal = "latency"``), for an engine that shows no signals: a run waited
inside the engine when its time to first token (TTFT) is over :data:`TOLERANCE` times
the baseline, in units of the recent time per output token (TPOT) of the runs that
succeeded. That ratio does not grow with the batch (a larger batch slows both alike) but
jumps when a request waits for others to end. It is read at each first token, and for
runs still without one, every interval while they wait
(:meth:`LearnedCapacity.on_waiting`): a slow start is seen in a step, not in a run's
length. What each run saw at its grant (the runs and tokens in flight, itself
included) says what was safe and what was too much:

- a run that did not wait shows what was *safe*: the most runs and tokens seen in
  flight with no wait are kept, and the budget may be :data:`HEADROOM` times those
  tokens, under the ceiling (``latency_room``);
- a run that waited came when too much was in flight. What explains it is lowered:
  the tokens, if more were in flight than ever safely (the ceiling drops to what was
  in flight before it, and what it came on is kept as the *queued-at* mark), the runs,
  if more ran than ever safely (the limit drops below the runs it came on), or both,
  if neither: the engine has shrunk, and what was safe is forgotten down to it
  (``latency_waited``). A run granted before the last drop, with more in flight than
  the new bounds, says nothing new and moves nothing;
- every interval, runs waiting for a pool that is full grow what binds it
  (:meth:`LearnedCapacity.on_tick`, ``latency_room``): the limit doubles until the
  first wait, then grows by its square root; the budget takes one more waiting run
  (the smallest), under the ceiling, and the ceiling rises by :data:`CEILING_RISE` a
  probe, but not to the queued-at mark until :data:`FORGET_AFTER` seconds have passed
  with no wait.

Both start slow: the limit at ``minimum`` and the budget unbounded (the limit bounds
what is in flight until the first signals say more).

Known pitfalls, and what is done about each: cancelled, failed and rejected runs give
no TPOT (their times say nothing of the engine's pace); the baseline is a minimum that
only moves down, except that it is refreshed from runs that came when at most
:attr:`~AutoConcurrency.minimum` runs were in flight, so sustained load cannot drag it
up; a run is told to wait once; no increase comes within an interval of a drop, and
the learner's interval has jitter, so nodes sharing an engine do not probe in step; a run over
a learned budget on its own still starts in an empty pool (the scheduler's rule), so a
low budget never shuts a large run out.
"""

from __future__ import annotations

import collections
import math
import random

import attrs

from ..model import AutoConcurrency, EngineSignals

#: Scrape intervals after which an engine's last signals are stale (saturated).
STALE_AFTER = 3
#: The share of what the engine's cache holds that the learned budget fills.
FILL = 1.0
#: The cache's share in use over which the limit does not grow.
HIGH_USE = 0.9
#: A run's TTFT/TPOT over this many times the baseline means it waited.
TOLERANCE = 4.0
#: How much more than the most tokens seen in flight safely the budget lets in (latency).
HEADROOM = 1.25
#: Seconds between two increases, at least (each with up to a quarter more, at random).
PROBE_EVERY = 0.5
#: What a ceiling rises by, a probe with no sign of waiting (1.02: 2 %).
CEILING_RISE = 1.02
#: Seconds with no wait after which a latency ceiling may rise past where runs queued.
FORGET_AFTER = 30.0
#: The weight of a new sample in the smoothed TPOT.
SMOOTHING = 0.3


@attrs.frozen
class RunSample:
    """What one run says of the engine: its time to first token (or, for one that has
    none yet, how long it has waited for it), and the runs and tokens in flight in the
    pool when it was admitted (itself included)."""

    ttft: float
    in_flight: int
    reserved: int
    #: the tokens it reserved itself, and when it was granted
    cost: int = 0
    granted_at: float = 0.0


@attrs.frozen
class Move:
    """A change of a learned capacity, and why."""

    reason: str
    limit: int
    budget: float


class LearnedCapacity:
    """One pool's learned limit and token budget; see the module docstring. The time is
    passed in. ``counts_tokens``: the node reserves its runs' tokens here (else the
    budget stays unbounded and only the limit is learned)."""

    def __init__(
        self,
        auto: AutoConcurrency,
        *,
        signal: str,
        now: float,
        counts_tokens: bool = True,
        interval: float = 1.0,
        rng: random.Random | None = None,
    ) -> None:
        if signal not in ("engine", "latency"):
            raise ValueError(f"signal must be engine or latency, not {signal!r}")
        self.auto = auto
        self.signal = signal
        self.counts_tokens = counts_tokens
        self.interval = interval
        self.limit = auto.minimum  # a slow start: it grows while runs wait for it
        self.budget = math.inf
        self.ceiling = math.inf  # tokens: the most known not to make the engine queue
        # latency: the most tokens and runs seen in flight with no run waiting
        self.safe = 0
        self.safe_runs = 0
        self.queued_at = math.inf  # tokens in flight the lowest a run was seen to wait at
        self.baseline: float | None = None  # the lowest TTFT/TPOT
        self.tpot: float | None = None  # the smoothed time per output token of runs
        self._first: float | None = None  # the first TTFT seen, the scale until a TPOT
        self._waits = 0
        self._dropped_at = -math.inf  # when a wait last lowered something
        self._rng = rng or random.Random()
        self._next_probe = now
        self.moves: collections.Counter[str] = collections.Counter()
        self.last: Move | None = None

    def __repr__(self) -> str:
        budget = "-" if self.budget == math.inf else f"{self.budget:.0f}"
        return (
            f"<LearnedCapacity {self.signal} limit={self.limit} in "
            f"[{self.auto.minimum}, {self.auto.maximum}] budget={budget}>"
        )

    def _clamp(self, limit: float) -> int:
        return int(min(self.auto.maximum, max(self.auto.minimum, limit)))

    def _may_probe(self, now: float) -> bool:
        if now < self._next_probe:
            return False
        self._next_probe = now + PROBE_EVERY * (1 + 0.25 * self._rng.random())
        return True

    def _moved(self, reason: str, limit: float, budget: float) -> Move | None:
        limit = self._clamp(limit)
        if not self.counts_tokens:
            budget = math.inf
        budget = min(budget, self.ceiling)
        if budget != math.inf:
            budget = max(1.0, math.floor(budget))
        if limit == self.limit and budget == self.budget:
            return None
        self.limit, self.budget = limit, budget
        self.moves[reason] += 1
        self.last = Move(reason, limit, budget)
        return self.last

    # --- the engine's own signals --------------------------------------------------------

    def on_engine(
        self,
        signals: EngineSignals | None,
        now: float,
        *,
        running: int,
        reserved: int,
        queued: int,
    ) -> Move | None:
        """A scrape of the engine (None: it failed) at ``now``, with the pool's runs and
        tokens in flight and the runs that wait for it. Returns the move, if any."""
        if signals is None or now - signals.at > STALE_AFTER * self.interval:
            # saturated: let nothing more in than runs now
            budget = reserved if self.counts_tokens and reserved else self.budget
            return self._moved("stale", min(self.limit, running), min(self.budget, budget))
        if signals.waiting > 0:
            taken = max(0.0, running - signals.waiting)
            if signals.running is not None:
                taken = min(taken, signals.running)
            if self.counts_tokens and reserved and running:
                self.ceiling = max(1.0, reserved * taken / running)
            return self._moved("engine_waiting", min(self.limit, max(1.0, taken)), self.ceiling)
        if self.ceiling != math.inf and self._may_probe(now):
            self.ceiling *= CEILING_RISE
        budget = self.budget
        use = signals.kv_usage
        if use is not None and use > 0 and reserved > 0:
            budget = reserved / use * FILL
        limit: float = self.limit
        room = use is None or use < HIGH_USE
        if queued and running >= self.limit and room and self._may_probe(now):
            limit = max(self.limit + 1, math.ceil(self.limit * 1.5))
        return self._moved("engine_room", limit, budget)

    # --- latency -------------------------------------------------------------------------

    def on_run_end(self, tpot: float | None) -> None:
        """A run succeeded: its time per output token keeps the scale TTFTs are read in."""
        if tpot is not None and tpot > 0:
            self.tpot = (
                tpot if self.tpot is None else (1 - SMOOTHING) * self.tpot + SMOOTHING * tpot
            )

    def waited_past(self) -> float | None:
        """Seconds past which a run with no first token waits inside the engine (None
        until a run has ended and one first token has been seen)."""
        if self.tpot is None or self.baseline is None:
            return None
        return TOLERANCE * max(self.baseline, 1.0) * self.tpot

    def on_first_token(self, sample: RunSample, now: float) -> Move | None:
        """A run's first token came ``sample.ttft`` seconds after its request went out.
        (Before any run ended, the first TTFT seen is the scale.)"""
        scale = self.tpot if self.tpot is not None else self._first or sample.ttft
        self._first = self._first or sample.ttft
        if scale <= 0:
            return None
        ratio = sample.ttft / scale
        if sample.in_flight <= self.auto.minimum or self.baseline is None:
            # came alone: nothing it waited for was the node's doing; a fresh baseline
            self.baseline = ratio if self.baseline is None else min(self.baseline * 1.5, ratio)
        else:
            self.baseline = min(self.baseline, ratio)
        if ratio > TOLERANCE * max(self.baseline, 1.0):
            return self._waited(sample, now)
        self.safe = max(self.safe, sample.reserved)
        self.safe_runs = max(self.safe_runs, sample.in_flight)
        if not self.counts_tokens or not self.safe:
            return None
        budget = self.safe * HEADROOM
        if self.budget != math.inf:
            budget = max(self.budget, budget)
        return self._moved("latency_room", self.limit, budget)

    def on_waiting(self, age: float, sample: RunSample, now: float) -> Move | None:
        """A run has had no first token for ``age`` seconds since its request went out:
        past :meth:`waited_past`, it waits inside the engine, and that is said now, not
        when its first token comes. Its caller tells each run once."""
        past = self.waited_past()
        if past is None or age <= past:
            return None
        return self._waited(sample, now)

    def on_tick(
        self, now: float, *, running: int, reserved: int, queued: int, smallest: int | None
    ) -> Move | None:
        """Every interval: the pool's runs and tokens in flight, the runs waiting for it,
        and the fewest tokens one of those reserves (None: none waits). While runs wait
        and the pool is full, what binds it grows (module docstring)."""
        if not queued or now - self._dropped_at < self.interval:
            return None
        limit: float = self.limit
        if running >= self.limit:
            limit = self.limit * 2 if not self._waits else self.limit + math.sqrt(self.limit)
        budget = self.budget
        if self.counts_tokens and smallest is not None and reserved + smallest > budget:
            if self.ceiling != math.inf:
                rise = self.ceiling * CEILING_RISE
                if rise >= self.queued_at and now - self._dropped_at < FORGET_AFTER:
                    rise = max(self.ceiling, self.queued_at - 1)
                elif rise >= self.queued_at:
                    self.queued_at = math.inf  # long quiet: the engine may have grown
                self.ceiling = rise
            budget = reserved + smallest
        return self._moved("latency_room", limit, budget)

    def _waited(self, sample: RunSample, now: float) -> Move | None:
        """``sample``'s run waited inside the engine: lower what explains it."""
        before = sample.reserved - sample.cost
        tokens = self.counts_tokens and sample.cost > 0 and before > 0
        if sample.granted_at < self._dropped_at and (
            sample.in_flight > self.limit or (tokens and sample.reserved > self.ceiling)
        ):
            return None  # it came before the last drop, on more than is let in now
        self._waits += 1
        by_tokens = tokens and sample.reserved > self.safe
        by_runs = sample.in_flight > self.safe_runs
        if not by_tokens and not by_runs:  # the engine shrank: forget what was safe
            self.safe = min(self.safe, max(0, before))
            self.safe_runs = min(self.safe_runs, sample.in_flight - 1)
            by_tokens, by_runs = tokens, True
        limit: float = self.limit
        if by_runs:
            limit = min(self.limit, sample.in_flight - 1)
        if by_tokens:
            self.queued_at = min(self.queued_at, sample.reserved)
            self.ceiling = min(self.ceiling, max(1.0, before))
        move = self._moved("latency_waited", limit, min(self.budget, self.ceiling))
        if move is not None:
            self._dropped_at = now
        return move
