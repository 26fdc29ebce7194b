"""Concurrency learned from the engine, sans I/O: what ``concurrency: auto`` does.

An engine does not fill up on runs but on its KV cache or its batch, and no fixed number
of runs fits every engine or a mixed load. A :class:`LearnedCapacity` holds, for one
pool (an adapter's, or a target's), a learned **limit** (runs at once, within
``[minimum, maximum]`` and under every static cap, since those are other pools) and a
learned **token budget** (the tokens the node's runs may reserve there at once: what
the engine holds, as the node counts its runs' prompt and most output). It moves them
from one of two signals, and says why it moved (:class:`Move`).

**No timing constant belongs to one engine.** Every pace is in units of the engine's
own **step**, measured: the median gap between two batches of the runs streaming now
(:meth:`LearnedCapacity.on_streaming`), else the smoothed time per output token of
the runs that succeeded (before any has, the shortest time to first token seen;
before that :data:`FIRST_STEP`). The learner looks every
:attr:`~LearnedCapacity.interval` (:data:`STEPS_A_LOOK` steps, within
:data:`SHORTEST_LOOK` and :data:`LONGEST_LOOK` seconds); a run is *stalled* when it
has heard nothing from the engine for :attr:`~LearnedCapacity.tolerance` steps (before
its first token: that many times the baseline ratio of time to first token over the
step, since a first token costs a prefill, and at least that many times the shortest
time to first token of its size: :meth:`LearnedCapacity.waited_past`).

**Growth is TCP's**: below the *mark* (the limit at which the engine last queued, as
TCP's ``ssthresh``) the limit doubles each look while runs wait for it and the engine
shows room (slow start); at or past it, it grows by 1, then 2, then 3... looks while
nothing queues (additive, and faster the longer the engine has taken more, so an engine
that grew is found in a few looks). A probe past the mark waits a run's time with no
queue, twice as long after each probe that failed at the same mark, up to
:data:`MOST_BACKOFF` times (:meth:`LearnedCapacity._mark_runs`). A mark is forgotten
after :data:`FORGET_AFTER` looks with no queue. A look taken before the last rise had a
step to show (its scrape began earlier) grows nothing.

**The engine's own signals** (``signal = "engine"``), read from its metrics
(:class:`~iop_trio.model.EngineSignals`: vLLM's ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc``, llama.cpp's ``llamacpp:requests_deferred`` and
``llamacpp:kv_cache_usage_ratio``), read as they are meant:

- *waiting* counts requests waiting for any reason, including one that came in the
  middle of a step and joins at the next (vLLM and llama.cpp admit at step
  boundaries), and one preempted. Only a wait the node sees too is a queue: the queue
  is the engine's waiting, but at most the node's own stalled runs there. A queue
  drops what binds to what the engine takes (the runs in flight less the queue):
  the *batch*, when the cache has room for another run of the mean size (the limit,
  and its mark), or the *cache* (the budget's ceiling: the share of the tokens in flight
  that the runs taken hold, and its mark); with no KV figure, both
  (``engine_waiting``);
- *KV use* counts blocks in use (vLLM v1), not reservations: the cache holds
  ``reserved / use`` tokens as the node counts them, which is the budget (times
  :data:`FILL`) under the ceiling; while the cache has room (under :data:`HIGH_USE`)
  and runs wait for tokens, the ceiling rises to what the cache holds at
  :data:`HIGH_USE` (or doubles below its mark, with no KV figure) (``engine_room``);
- a scrape that **fails** is *saturated*: nothing more than runs now is let in
  (``stale``). A scrape that answers, however slowly, is fresh: an engine too busy to
  answer quickly is busy, not full, and its figures are as of the answer. A slow scrape
  only makes the looks further apart: the next begins
  ``max(interval - its time, interval / 4)`` after it ends.

**Latency** (``signal = "latency"``), for an engine that shows no signals: a run
waited inside the engine when its time to first token (TTFT), in steps, is over
:data:`TOLERANCE` times the baseline (a ratio that a larger batch does not move, but a
wait in the engine's queue does; Gradient2's idea, on the step rather than the
latency); a probe (a run granted past what was ever safe) waits past
:data:`CONFIRM_AFTER` times it (:meth:`LearnedCapacity.tolerance_for`). It is read at
each first token, and every look for runs still without one
(:meth:`LearnedCapacity.on_waiting`). What each run saw at its grant (the runs and
tokens in flight, itself included) says what was safe and what was too much:

- a run that did not wait shows what was *safe*: the most runs and tokens seen in
  flight with no wait are kept, and the budget may be twice those tokens in the tokens'
  slow start, :data:`HEADROOM` times them after it (:meth:`LearnedCapacity._end_slow_start`
  says when it ends and begins again), under the ceiling (``latency_room``); past
  :data:`LIMITED_SLOW_START` runs, a slow start's rise adds at most half that many
  (RFC 3742), so its last rise overshoots the engine by a bounded number of runs;
- a run that waited came when too much was in flight. What explains it is lowered:
  the tokens, if more were in flight than ever safely (the ceiling drops to what was
  in flight before it, and that is the token mark), the runs, if more ran than ever
  safely (the limit drops below the runs it came on: the mark), or both, if neither:
  the engine has shrunk (or its step grew faster than the step measured, at a shift of
  load), and what was safe is forgotten down to it, but the run mark is not lowered:
  the mark is where runs past the most safe queued, so the next rise goes back to it
  at once, and a wait there marks anew (``latency_waited``). A run granted before the
  last drop, with more in flight than the new bounds, says nothing new and moves
  nothing;
- every look, runs waiting for a pool that is full grow what binds it
  (:meth:`LearnedCapacity.on_tick`, ``latency_room``), as above: the limit and the
  budget's ceiling double below their marks and then grow additively. In their slow
  starts the other grows with it when it would bind next (the limit's rise lets in runs
  the tokens would hold back, or the other way), so one round of first tokens judges
  both, rather than each waiting a round for the other. Below its mark the limit also
  doubles at the first token of a run that filled it (granted into its last place) and
  did not wait (:meth:`LearnedCapacity.on_first_token`: TCP grows its window at each
  acknowledgment), not a look later.

Both start slow: the limit at :data:`INITIAL_LIMIT` and the budget unbounded (the limit bounds
what is in flight until the first signals say more).

Known pitfalls, and what is done about each: cancelled, failed and rejected runs give
no step (their times say nothing of the engine's pace); the baseline is a minimum that
only moves down, except that it is refreshed from runs that came when at most
:attr:`~AutoConcurrency.minimum` runs were in flight, so sustained load cannot drag it
up (Envoy's minimum-RTT refresh, without its pause); a run is told to wait once; the
shell jitters its looks, so nodes sharing an engine do not probe in step; a run over a
learned budget on its own still starts in an empty pool (the scheduler's rule), so a
low budget never shuts a large run out.
"""

from __future__ import annotations

import collections
import math
import random
from collections.abc import Callable, Sequence

import attrs

from ..model import AutoConcurrency, EngineSignals

#: The limit a learner starts at (within its bounds): slow start's initial window, as
#: TCP's is 10 segments (RFC 6928), since any batching engine takes a few at once.
INITIAL_LIMIT = 4
#: Seconds a step is taken for until one is measured.
FIRST_STEP = 0.125
#: Steps between two looks at the engine, and the bounds of a look's interval (s).
STEPS_A_LOOK = 1.0
SHORTEST_LOOK = 0.1
LONGEST_LOOK = 1.0
#: The share of what the engine's cache holds that the learned budget fills.
FILL = 1.0
#: The cache's share in use over which nothing grows.
HIGH_USE = 0.9
#: Steps (times the baseline, before a first token) with nothing heard: a run stalled.
TOLERANCE = 4.0
#: The same, for a learner that has the engine's waiting count to confirm it: a request
#: that joins at the next step boundary has its first token within two steps.
CONFIRM_AFTER = 2.5
#: How much more than the most tokens seen in flight safely the budget lets in (latency).
HEADROOM = 1.25
#: The same in the tokens' slow start (:meth:`LearnedCapacity._end_slow_start`).
SLOW_START_HEADROOM = 2.0
#: Runs past which a slow start's rise adds at most half as many runs again (RFC 3742's
#: limited slow start, ``max_ssthresh``): a rise doubles below it, and past it
#: overshoots the engine by a bounded number of runs, which wait a tolerance each.
LIMITED_SLOW_START = 16
#: Looks, and runs' times, with no queue after which a mark is forgotten.
FORGET_AFTER = 50
FORGET_RUNS = 4
#: Looks with no queue before the learner probes past a mark.
PROBE_AFTER = 10
#: The most times longer a probe waits after probes that failed at the same mark.
MOST_BACKOFF = 8.0
#: The least share of the limit a wait leaves that the runs streaming may lower it to
#: (:meth:`LearnedCapacity._waited`): at a shift to longer runs few have streamed yet, and
#: a multiplicative decrease is bounded (CUBIC's is 0.7).
STREAMING_FLOOR = 0.75
#: Runs streaming at once that say what the step is now.
LIVE_RUNS = 4
#: The weight of a new sample in the smoothed step.
SMOOTHING = 0.3


#: Counts the pool's runs that have had their first token (the shell's; called when used).
Streaming = Callable[[], int]


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
        rng: random.Random | None = None,
    ) -> None:
        if signal not in ("engine", "latency"):
            raise ValueError(f"signal must be engine or latency, not {signal!r}")
        self.auto = auto
        self.signal = signal
        self.counts_tokens = counts_tokens
        self.limit = self._clamp(INITIAL_LIMIT)  # a slow start: it grows while runs wait
        self.budget = math.inf
        self.ceiling = math.inf  # tokens: the most known not to make the engine queue
        self.run_mark = math.inf  # the limit at which the engine last queued
        self.token_mark = math.inf  # the tokens in flight at which it last queued
        self._mark_size = -1  # latency: the size of the run whose wait set the token mark
        # latency: the most tokens and runs seen in flight with no run waiting
        self.safe = 0
        self.safe_runs = 0
        self._starting = True  # the tokens' slow start (:meth:`_headroom`)
        # the lowest TTFT in steps, by the size of the run (its prefill grows with it)
        self.baselines: dict[int, float] = {}
        # the shortest TTFT in seconds, by size: a prefill's time, which the step does
        # not scale (:meth:`waited_past`)
        self.shortest: dict[int, float] = {}
        self.tpot: float | None = None  # the smoothed time per output token of runs
        self.run_time = 0.0  # the smoothed seconds a run holds its permit
        self.live_step = 0.0  # the step as the runs streaming now show it (0: unknown)
        self.in_step = 0.0  # how long the step now has lasted at least (0: unknown)
        self.last_step = 0.0  # the longest step a streaming run just showed (0: unknown)
        self.oldest = 0.0  # the seconds the oldest run in flight has held its place
        self._first: float | None = None  # the shortest TTFT seen, the step until a TPOT
        self._rng = rng or random.Random()
        self._queued_at = now  # when the engine last queued (or the start)
        self._dropped_at = -math.inf  # when a queue or a wait last lowered something
        self.risen_at = -math.inf  # when something last grew
        self._streak = 0  # rises past the mark since the last queue
        self._backoff = 1.0  # how many runs' times a probe waits (:meth:`_mark_runs`)
        # the last rise of the limit not yet judged by the engine: the limit before it
        # and the requests the engine ran then
        self._probe: tuple[int, float] | None = None
        self._peak = 0.0  # the most requests the engine ran at a look since the last rise
        self.moves: collections.Counter[str] = collections.Counter()
        self.last: Move | None = None

    def __repr__(self) -> str:
        budget = "-" if self.budget == math.inf else f"{self.budget:.0f}"
        mark = "-" if self.run_mark == math.inf else f"{self.run_mark:.0f}"
        return (
            f"<LearnedCapacity {self.signal} limit={self.limit} in "
            f"[{self.auto.minimum}, {self.auto.maximum}] mark={mark} budget={budget} "
            f"step={self.step * 1e3:.1f}ms>"
        )

    # --- the engine's pace ---------------------------------------------------------------

    @property
    def step(self) -> float:
        """Seconds of one engine step: as the runs streaming now show it, where enough
        do (:meth:`on_streaming`), else as measured (module docstring). The runs that
        ended say what the step was: a batch that grew or shrank since (a shift to
        longer runs, fewer at once) steps at another pace, and long runs end seconds
        later."""
        if self.live_step > 0:
            return self.live_step
        if self.tpot is not None:
            return self.tpot
        return self._first if self._first is not None else FIRST_STEP

    def on_streaming(
        self, quiet: list[float], oldest: float = 0.0, steps: Sequence[float] = ()
    ) -> None:
        """The seconds since each run streaming now was last heard from, and the step
        shown by each that has had two batches (``steps``: its latest gap between two,
        or its quiet if longer). Their median is the step now (with fewer than
        :data:`LIVE_RUNS`, not known): the runs of one batch all hear at once, so their
        quiet is the time since that batch, and twice it (a run's quiet, were they
        spread out) would read a step up to twice too long, or, just after their first
        tokens, ten times too short. The shell passes half a run's latest gap as its
        quiet where that is longer (a run heard from just now, after a long step: a
        burst of prefills). ``oldest``: the seconds the oldest run in flight has held
        its place (a run's time is at least that). The least quiet is how long the
        engine's step now has lasted at least: nothing came for any run since
        (:meth:`waited_past`); the longest of ``steps`` is the step that just ended, at
        least: a run granted during a long step (a burst's prefills) waits it out
        before its own prefill begins, which is not a queue."""
        self.oldest = oldest
        self.in_step = min(quiet, default=0.0)
        shown = sorted(steps)
        self.live_step = shown[len(shown) // 2] if len(shown) >= LIVE_RUNS else 0.0
        self.last_step = shown[-1] if shown else 0.0

    @property
    def interval(self) -> float:
        """Seconds between two looks at the engine: :data:`STEPS_A_LOOK` steps, bounded."""
        return min(LONGEST_LOOK, max(SHORTEST_LOOK, STEPS_A_LOOK * self.step))

    @property
    def measured(self) -> bool:
        """Whether a step has been measured (a first token seen)."""
        return self._first is not None

    @staticmethod
    def _size(cost: int) -> int:
        """The baseline's bucket of a run reserving ``cost`` tokens: a power of two."""
        return max(0, cost).bit_length()

    def baseline(self, cost: int | None = None) -> float | None:
        """The baseline TTFT in steps of runs the size of ``cost`` (None: of the smallest
        runs seen), None until one of that size has had its first token."""
        if cost is None:
            return self.baselines[min(self.baselines)] if self.baselines else None
        return self.baselines.get(self._size(cost))

    def waited_past(
        self, cost: int | None = None, seen: tuple[int, int] | None = None
    ) -> float | None:
        """Seconds past which a run reserving ``cost`` tokens, with no first token, waits
        inside the engine (None until a first token of its size has been seen: the
        first of a new size sets the baseline of its size), in steps at least as long
        as the step now has lasted: a run is not judged to wait while the engine is
        still in a long step (the prefills of a burst), before any batch shows it.
        ``seen``: the runs and tokens in flight at its grant; a run granted past what
        was ever safe is a probe, judged sooner (:meth:`tolerance_for`). At least the
        tolerance times the shortest time to first token of its size: a long prompt's
        prefill takes its time whatever the step, so a step that shrinks (fewer runs
        at once) does not make its first token late."""
        baseline = self.baseline(cost)
        if not self.measured or baseline is None:
            return None
        shortest = self.shortest.get(self._size(cost), 0.0) if cost is not None else 0.0
        step = max(self.step, self.in_step, self.last_step)
        waits = max(max(baseline, 1.0) * step, shortest)
        return self.tolerance_for(seen) * waits

    def tolerance_for(self, seen: tuple[int, int] | None) -> float:
        """The :attr:`tolerance` of a run that saw ``seen`` (runs, tokens) in flight at
        its grant: a latency learner's probe, granted past the most runs or tokens seen
        in flight with no wait, is judged after :data:`CONFIRM_AFTER` steps, not
        :data:`TOLERANCE`: a slow start's last rise overshoots the engine by up to as
        many runs as it had, and each waits the tolerance in the engine before it is
        taken back; a run within what was safe keeps the wider bound (a false wait
        there forgets what was safe)."""
        if seen is None or self.signal != "latency":
            return self.tolerance
        runs, tokens = seen
        probe = runs > self.safe_runs or (self.counts_tokens and tokens > self.safe)
        return CONFIRM_AFTER if probe else self.tolerance

    def stalled_past(self) -> float | None:
        """Seconds with nothing heard past which a run that has had tokens is stalled
        (preempted: the others were heard from since); None until a step is measured.
        In steps at least as long as the step now has lasted, as :meth:`waited_past`:
        in a long step no run is heard from, and none is stalled for it."""
        return self.tolerance * max(self.step, self.in_step) if self.measured else None

    @property
    def tolerance(self) -> float:
        """Steps of quiet that make a run stalled: :data:`TOLERANCE` from latency alone,
        :data:`CONFIRM_AFTER` where the engine's waiting count confirms it."""
        return TOLERANCE if self.signal == "latency" else CONFIRM_AFTER

    def on_run_end(self, tpot: float | None, took: float | None = None) -> None:
        """A run succeeded, having held its permit ``took`` seconds: its time per output
        token is a step of the engine, and its time what a run holds a place."""
        if took is not None and took > 0:
            self.run_time = (1 - SMOOTHING) * self.run_time + SMOOTHING * took
        if tpot is not None and tpot > 0:
            self.tpot = (
                tpot if self.tpot is None else (1 - SMOOTHING) * self.tpot + SMOOTHING * tpot
            )

    def _ratio(self, sample: RunSample) -> float | None:
        """``sample``'s TTFT in steps, the baseline kept; None if there is no scale."""
        self._first = sample.ttft if self._first is None else min(self._first, sample.ttft)
        scale = self.step
        if scale <= 0:
            return None
        ratio = sample.ttft / scale
        size = self._size(sample.cost)
        self.shortest[size] = min(self.shortest.get(size, math.inf), sample.ttft)
        baseline = self.baselines.get(size)
        if sample.in_flight <= self.auto.minimum or baseline is None:
            # came alone: nothing it waited for was the node's doing; a fresh baseline
            self.baselines[size] = ratio if baseline is None else min(baseline * 1.5, ratio)
        else:
            self.baselines[size] = min(baseline, ratio)
        return ratio

    # --- moving --------------------------------------------------------------------------

    def _clamp(self, limit: float) -> int:
        return int(min(self.auto.maximum, max(self.auto.minimum, limit)))

    def _moved(
        self, reason: str, limit: float, budget: float, now: float, *, rise: bool = True
    ) -> Move | None:
        """Move to ``limit`` and ``budget`` (clamped, under the ceiling); a rise of either
        (unless ``rise`` is false: a new estimate, not a probe) is the one the next waits
        to see judged (:meth:`_may_rise`)."""
        limit = self._clamp(limit)
        if not self.counts_tokens:
            budget = math.inf
        budget = min(budget, self.ceiling)
        if budget != math.inf:
            budget = max(1.0, math.floor(budget))
        if limit == self.limit and budget == self.budget:
            return None
        if rise and (limit > self.limit or budget > self.budget):
            self.risen_at = now
        self.limit, self.budget = limit, budget
        self.moves[reason] += 1
        self.last = Move(reason, limit, budget)
        return self.last

    def _may_rise(self, now: float, unjudged: int) -> bool:
        """Whether to grow now: the last rise was judged (every run granted since has
        had its first token, or was found stalled: TCP grows once a round trip) and a
        step has passed since it."""
        return unjudged == 0 and now - self.risen_at >= self.step

    def _probing(self, now: float, *, runs: bool = False) -> bool:
        """Whether a rise past a mark may come: :data:`PROBE_AFTER` looks with no queue,
        and a run's time (a failed probe's run waits about that long for a place): the
        smoothed time of the runs that ended, or the age of the oldest in flight, if
        longer (the runs of a new load have not ended yet). Past the run mark (``runs``),
        that many times the backoff (:meth:`_mark_runs`); the tokens' ceiling has none:
        the cache's room moves with the size of the runs, the batch's does not."""
        backoff = self._backoff if runs else 1.0
        return now - self._queued_at >= self._run_time() * backoff

    def _run_time(self) -> float:
        """What a probe waits for (:meth:`_probing`): at least :data:`PROBE_AFTER` looks."""
        return max(PROBE_AFTER * self.interval, self.run_time, self.oldest)

    def _grown_limit(self, now: float) -> float:
        """The limit one rise makes: doubled below the mark, then +1, +2, ... (once
        :meth:`_probing`)."""
        if self.limit * 2 <= self.run_mark:
            return self._limited(self.limit, self.limit * 2, 1)
        if self.limit < self.run_mark:
            return self.run_mark
        if not self._probing(now, runs=True):
            return self.limit
        self._streak += 1
        return self.limit + self._streak

    def _grown_ceiling(self, now: float, by: float, estimate: float = math.inf) -> None:
        """A rise of the ceiling: to ``estimate`` (what the cache holds at
        :data:`HIGH_USE`), else doubled, up to its mark; past the mark by ``by`` (once
        :meth:`_probing`)."""
        if self.ceiling == math.inf:
            return
        if self.ceiling < self.token_mark:
            rise = estimate if estimate != math.inf else self.ceiling * 2
            self.ceiling = max(self.ceiling, min(rise, self.token_mark))
        elif self._probing(now):
            rise = self.ceiling + by
            if estimate != math.inf:
                rise = max(rise, min(estimate, self.ceiling * 2))
            self.ceiling = rise

    def _forget(self, now: float) -> None:
        """Marks older than :data:`FORGET_AFTER` looks, :data:`FORGET_RUNS` runs' times and
        twice what a probe waits (so a learner backed off probes before it forgets) with
        no queue: the engine may have grown (another load, a restart), so slow start may
        pass them again."""
        quiet = max(
            FORGET_AFTER * self.interval,
            FORGET_RUNS * self._run_time(),
            2 * self._backoff * self._run_time(),
        )
        if now - self._queued_at > quiet:
            self.run_mark = self.token_mark = math.inf
            self._queued_at = now
            self._backoff = 1.0

    def _mark_runs(self, mark: float) -> None:
        """Set the run mark, where the engine queued (before :meth:`_queued`). A probe past
        the mark that failed within one run of it (the engine has not grown) makes the next
        wait twice as long, up to :data:`MOST_BACKOFF` runs' times (exponential backoff:
        a learner that cannot see a queue of one, the latency's, is over its engine's
        batch while it probes, so it probes less often there); a mark elsewhere (the
        engine or its load changed) and marks forgotten (:meth:`_forget`) end the backoff."""
        if abs(mark - self.run_mark) <= 1:
            if self._streak:
                self._backoff = min(MOST_BACKOFF, self._backoff * 2)
        else:
            self._backoff = 1.0
        self.run_mark = mark

    def _queued(self, now: float) -> None:
        self._queued_at = self._dropped_at = now
        self._streak = 0

    # --- the engine's own signals --------------------------------------------------------

    def on_engine(
        self,
        signals: EngineSignals | None,
        now: float,
        *,
        running: int,
        reserved: int,
        queued: int,
        stalled: int | None = None,
        unjudged: int = 0,
    ) -> Move | None:
        """A scrape of the engine (None: it failed) that began at ``signals.at`` and
        answered at ``now``, with the pool's runs and tokens in flight, the runs that
        wait for it, its runs stalled in the engine (None: not known, so the engine's
        waiting is taken as it is) and its runs granted since the last rise that have
        had no first token and are not stalled. Returns the move, if any."""
        if signals is None:
            # saturated: let nothing more in than runs now
            budget = reserved if self.counts_tokens and reserved else self.budget
            return self._moved("stale", min(self.limit, running), min(self.budget, budget), now)
        queue = signals.waiting if stalled is None else min(signals.waiting, stalled)
        if queue > 0:
            return self._engine_queued(signals, now, queue, running, reserved)
        self._forget(now)
        use = signals.kv_usage
        room = use is None or use < HIGH_USE
        budget = self.budget
        # the tokens of the runs the engine took (those it says wait hold no cache)
        held = reserved * max(0.0, running - signals.waiting) / running if running else 0
        if use is not None and use > 0 and held > 0:
            budget = held / use * FILL
        fresh = signals.at >= self.risen_at + self.step
        if signals.running is not None:
            self._peak = max(self._peak, signals.running)
        if signals.at >= self.risen_at and self._probe_taken(signals):
            self._probe = None  # even a scrape begun within a step of the rise shows it
        if fresh and self._failed_probe(signals, unjudged):
            assert self._probe is not None
            limit = self._probe[0]
            self._mark_runs(limit)
            self._probe = None
            self._queued(now)
            return self._moved("engine_waiting", limit, budget, now)
        if not (room and fresh and queued and self._may_rise(now, unjudged)):
            return self._moved("engine_room", self.limit, budget, now, rise=False)
        return self._engine_rise(signals, now, running, reserved, held, budget)

    def _failed_probe(self, signals: EngineSignals, unjudged: int) -> bool:
        """Whether the engine, at no look since the last rise of the limit, ran more
        requests than before it, and now, with the runs of the rise all heard from,
        some wait: its batch is full, whatever its cache says (a rise it took, or one
        it cannot be told about, is forgotten)."""
        if self._probe is None or signals.running is None or unjudged:
            return False
        return signals.waiting > 0

    def _probe_taken(self, signals: EngineSignals) -> bool:
        """Whether the engine ran more requests than before the limit's last rise, or its
        cache is what binds (the budget's matter): the probe is not a failure to judge."""
        if self._probe is None or signals.running is None:
            return False
        return signals.running > self._probe[1] or self._cache_binds(signals, signals.running)

    @staticmethod
    def _cache_binds(signals: EngineSignals, taken: float) -> bool:
        """Whether the engine's cache, not its batch, keeps requests waiting: another of
        the mean size would not fit in what is free, or it is over :data:`HIGH_USE`
        (with no KV figure, either may)."""
        use = signals.kv_usage
        if use is None:
            return True
        engine_runs = max(1.0, signals.running if signals.running is not None else taken)
        return use >= HIGH_USE or 1 - use < use / engine_runs

    def _engine_rise(
        self,
        signals: EngineSignals,
        now: float,
        running: int,
        reserved: int,
        held: float,
        budget: float,
    ) -> Move | None:
        """Grow what binds: the limit if the pool is full, else the tokens' ceiling."""
        limit: float = self.limit
        use = signals.kv_usage
        if running >= self.limit:
            limit = self._grown_limit(now)
            if limit > self.limit and signals.running is not None:
                # judged against the most the engine ran at the limit it leaves
                self._probe, self._peak = (self.limit, self._peak), signals.running
        elif self.counts_tokens:
            # runs wait with the limit not reached: the tokens bind
            known = use is not None and use > 0 and held > 0
            estimate = held / use * HIGH_USE if known and use else math.inf
            self._grown_ceiling(now, reserved / max(1, running), estimate)
        return self._moved("engine_room", limit, budget, now)

    def _engine_queued(
        self, signals: EngineSignals, now: float, queue: float, running: int, reserved: int
    ) -> Move | None:
        """The engine queues ``queue`` of the node's runs: lower what binds."""
        taken = max(1.0, running - queue)
        if signals.running is not None:
            taken = min(taken, max(1.0, signals.running))
        cache_binds = self._cache_binds(signals, taken)
        batch_binds = signals.kv_usage is None or not cache_binds
        limit: float = self.limit
        if batch_binds:
            limit = min(self.limit, taken)
            self._mark_runs(limit)
        if cache_binds and self.counts_tokens and reserved and running:
            self.ceiling = max(1.0, reserved * taken / running)
            self.token_mark = self.ceiling
        self._queued(now)
        self._probe = None
        return self._moved("engine_waiting", limit, min(self.budget, self.ceiling), now)

    # --- latency -------------------------------------------------------------------------

    def on_first_token(
        self, sample: RunSample, now: float, *, streaming: Streaming | None = None
    ) -> Move | None:
        """A run's first token came ``sample.ttft`` seconds after its request went out.
        Every learner takes its step from it; a latency learner judges it too.
        ``streaming``: counts the pool's runs that have had their first token (see
        :meth:`_waited`; called only for a run that waited), if known."""
        ratio = self._ratio(sample)
        # the wider bound, probe or not: a first token that came says the run was let in
        past = self.waited_past(sample.cost)
        if self.signal != "latency" or ratio is None or past is None:
            return None
        if sample.ttft > past:
            return self._waited(sample, now, streaming=streaming)
        self.safe = max(self.safe, sample.reserved)
        self.safe_runs = max(self.safe_runs, sample.in_flight)
        limit: float = self.limit
        if sample.in_flight >= self.limit and self.limit * 2 <= self.run_mark:
            # the run that filled the limit did not wait: in the limit's slow start it
            # doubles at once, as TCP's window grows on each acknowledgment, not a look
            # later
            limit = self._limited(self.limit, self.limit * 2, 1)
        budget = self.budget
        if self.counts_tokens and self.safe:
            ended = self._end_slow_start()
            budget = self._limited(self.safe, self.safe * self._headroom(), sample.cost)
            if self.budget != math.inf and not ended:
                budget = max(self.budget, budget)
        return self._moved("latency_room", limit, budget, now)

    def on_waiting(
        self,
        age: float,
        sample: RunSample,
        now: float,
        *,
        held: float | None = None,
        streaming: Streaming | None = None,
    ) -> Move | None:
        """A run has had no first token for ``age`` seconds since its request went out:
        past :meth:`waited_past`, it waits inside the engine, and that is said now, not
        when its first token comes. ``held``: the pool's tokens in flight less those of
        every run that waits so (what the engine holds), if known; ``streaming``: counts
        the pool's runs that have had their first token, if known. Its caller tells
        each run once."""
        past = self.waited_past(sample.cost, (sample.in_flight, sample.reserved))
        if self.signal != "latency" or past is None or age <= past:
            return None
        return self._waited(sample, now, held, streaming)

    def on_tick(
        self,
        now: float,
        *,
        running: int,
        reserved: int,
        queued: int,
        smallest: int | None,
        unjudged: int = 0,
    ) -> Move | None:
        """Every look (latency): the pool's runs and tokens in flight, the runs waiting
        for it, the fewest tokens one of those reserves (None: none waits) and the runs
        granted since the last rise still without a first token, not yet told to wait.
        While runs wait and the pool is full, what binds it grows (module docstring)."""
        self._forget(now)
        if self._end_slow_start(idle=not queued) and self.counts_tokens and self.safe:
            budget = min(self.budget, max(self.safe, reserved) * HEADROOM)
            return self._moved("latency_room", self.limit, budget, now, rise=False)
        if not queued or now - self._dropped_at < self.interval:
            return None
        if not self._may_rise(now, unjudged):
            return None
        limit: float = self.limit
        if running >= self.limit:
            limit = self._grown_limit(now)
        budget = self.budget
        if not self.counts_tokens or smallest is None:
            return self._moved("latency_room", limit, budget, now)
        if reserved + smallest > budget:
            if self.token_mark == math.inf and not self._starting:
                self._starting = True  # bound by tokens again, with no mark: slow start
            budget = self._grown_tokens(now, reserved, smallest)
            # what the tokens let in now past the limit: it would bind next, so it grows
            # too in its slow start (both are judged by the same round of first tokens)
            lets_in = running + (budget - reserved) / smallest
            if limit == self.limit and lets_in > limit and limit * 2 <= self.run_mark:
                limit = self._grown_limit(now)
        elif limit > self.limit and self.token_mark == math.inf:
            # the limit's rise lets in runs the tokens would hold back: in their slow
            # start they follow it, up to double what is in flight
            need = reserved + smallest * (limit - running)
            budget = max(budget, self._limited(reserved, min(need, reserved * 2), smallest))
        return self._moved("latency_room", limit, budget, now)

    @staticmethod
    def _limited(now_in: float, rise: float, per_run: float) -> float:
        """``rise`` from ``now_in`` (runs, or tokens at ``per_run`` a run), by at most
        half of :data:`LIMITED_SLOW_START` runs once past that many."""
        if now_in <= LIMITED_SLOW_START * per_run:
            return rise
        return min(rise, now_in + LIMITED_SLOW_START / 2 * per_run)

    def _grown_tokens(self, now: float, reserved: int, smallest: int) -> float:
        """The budget one rise makes while a run reserving ``smallest`` waits for tokens:
        doubling what is in flight up to what was safe, then one more waiting run (once
        the tokens have made a run of this size wait, a probe: a run's time apart)."""
        self._grown_ceiling(now, smallest)
        budget = reserved + smallest
        if reserved * 2 <= self.safe * HEADROOM:
            return self._limited(reserved, reserved * 2, smallest)
        if (
            budget > self.safe * HEADROOM
            and self.token_mark != math.inf
            and self._mark_size == self._size(smallest)
            and now - self.risen_at < self._run_time()
        ):
            return self.budget
        return budget

    def _headroom(self) -> float:
        """How far past the most tokens seen in flight safely the budget may go: double
        (:data:`SLOW_START_HEADROOM`) in the tokens' slow start, then :data:`HEADROOM`."""
        return SLOW_START_HEADROOM if self._starting else HEADROOM

    def _end_slow_start(self, *, idle: bool = False) -> bool:
        """End the tokens' slow start if it is due, and say whether it ended just now
        (True once per slow start): tokens made a run wait (the token mark), or no run
        waits for the pool (``idle``: the load, not the budget, bounds what is in flight,
        so the doubled headroom is untested, as TCP's window is not grown while the
        sender has too little to send, RFC 7661). The budget then falls back to
        :data:`HEADROOM` times what was safe, so a load that shifts to larger runs does
        not come in on the headroom the first runs left. A slow start ended idle begins
        again once the tokens bind with no token mark (:meth:`on_tick`), as TCP's does
        after an idle period below ``ssthresh`` (RFC 5681, 4.1)."""
        ended = idle and self.safe > 0 and self.budget != math.inf
        if self._starting and (ended or self.token_mark != math.inf):
            self._starting = False
            return True
        return False

    def _waited(
        self,
        sample: RunSample,
        now: float,
        held: float | None = None,
        streaming: Streaming | None = None,
    ) -> Move | None:
        """``sample``'s run waited inside the engine: lower what explains it (to what
        came before it, or to what the engine holds now, if less). A limit lowered goes
        below the runs the waited run came on, and to the runs streaming, if fewer (but
        not under :data:`STREAMING_FLOOR` of that): a run that waited a place found the
        batch full of them (a wait of a step or two is under :data:`TOLERANCE`, so the
        runs it came on are already past the batch)."""
        before = sample.reserved - sample.cost
        if held is not None and held > 0:
            before = min(before, int(held))
        tokens = self.counts_tokens and sample.cost > 0 and before > 0
        if sample.granted_at < self._dropped_at and (
            sample.in_flight > self.limit or (tokens and sample.reserved > self.ceiling)
        ):
            return None  # it came before the last drop, on more than is let in now
        by_tokens = tokens and sample.reserved > self.safe
        by_runs = sample.in_flight > self.safe_runs
        shrunk = not by_tokens and not by_runs
        if shrunk:  # the engine shrank, or its step did: forget what was safe
            self.safe = min(self.safe, max(0, before))
            self.safe_runs = min(self.safe_runs, sample.in_flight - 1)
            by_tokens, by_runs = tokens, True
        limit: float = self.limit
        if by_runs:
            limit = min(self.limit, sample.in_flight - 1)
            streamed = streaming() if streaming is not None else 0
            if streamed:
                limit = min(limit, max(streamed, math.ceil(limit * STREAMING_FLOOR)))
            mark: float = max(self.auto.minimum, limit)
            if shrunk and self.run_mark != math.inf:
                mark = max(mark, self.run_mark)  # what was safe is not where it queued
            self._mark_runs(mark)
        if by_tokens:
            self.ceiling = min(self.ceiling, max(1.0, before))
            self.token_mark = self.ceiling
            self._mark_size = self._size(sample.cost)
        self._queued(now)
        return self._moved("latency_waited", limit, min(self.budget, self.ceiling), now)
