"""The latency learner told its signals directly (sans-IO, no clock): the tokens' slow
start doubles what was safe, ends idle (falling back to
:data:`~iop_trio.runtime.capacity.HEADROOM` times it) and begins again; a wait lowers
the limit to the runs streaming; probes that fail at one mark back off."""

from __future__ import annotations

import random

import pytest

from iop_trio.model import AutoConcurrency
from iop_trio.runtime.capacity import HEADROOM, MOST_BACKOFF, LearnedCapacity, RunSample
from iop_trio.tokens import EngineSignals


def learner() -> LearnedCapacity:
    learned = LearnedCapacity(
        AutoConcurrency(1, 64), signal="latency", now=0.0, rng=random.Random(1)
    )
    # a run alone: the baseline (one step to its first token)
    assert learned.on_first_token(RunSample(0.125, 1, 100, 100, 0.0), 0.1) is not None
    return learned


def safe_at(learned: LearnedCapacity, reserved: int, now: float) -> float:
    """The budget after a run came with ``reserved`` tokens in flight and did not wait."""
    learned.on_first_token(RunSample(0.125, reserved // 100, reserved, 100, now), now)
    return learned.budget


def test_the_budget_doubles_what_was_safe_until_the_load_stops_filling_it():
    learned = learner()
    assert learned.budget == 200
    assert safe_at(learned, 800, 0.5) == 1600
    # a look with runs waiting for the pool: still starting
    learned.on_tick(1.0, running=8, reserved=800, queued=3, smallest=100)
    assert safe_at(learned, 1600, 1.5) == 3200
    # nothing waits: the doubled headroom is untested, and is given back once
    move = learned.on_tick(2.0, running=16, reserved=1600, queued=0, smallest=None)
    assert move is not None and move.budget == 1600 * HEADROOM
    assert safe_at(learned, 1700, 2.5) == 1700 * HEADROOM
    assert learned.on_tick(3.0, running=16, reserved=1600, queued=0, smallest=None) is None


def test_a_run_that_waits_ends_the_slow_start():
    learned = learner()
    assert safe_at(learned, 800, 0.5) == 1600
    # a run of 100 tokens came on 1,500 and waited 10 steps: the tokens explain it
    waited = learned.on_first_token(RunSample(1.25, 15, 1500, 100, 0.6), 1.0)
    assert waited is not None and waited.reason == "latency_waited"
    assert learned.budget == 1400
    # a run that did not wait, after it, moves nothing past the tokens' ceiling
    assert safe_at(learned, 1200, 1.5) == 1400
    assert learned.ceiling == learned.token_mark == 1400


def test_a_slow_start_ended_idle_begins_again_when_the_tokens_bind_with_no_mark():
    """A light load ends the slow start (nothing waits); a burst of larger runs after it
    doubles again a round (TCP's restart after idle below ``ssthresh``), not 1.25x."""
    learned = learner()
    assert safe_at(learned, 800, 0.5) == 1600
    learned.on_run_end(0.125, 2.0)  # a run's end is no sign of the engine's room
    assert safe_at(learned, 800, 2.5) == 1600
    move = learned.on_tick(3.0, running=8, reserved=800, queued=0, smallest=None)
    assert move is not None and move.budget == 800 * HEADROOM  # idle: ended
    # runs of 400 tokens wait for tokens: the slow start begins again
    learned.on_tick(4.0, running=5, reserved=1000, queued=8, smallest=400)
    assert learned.budget == 1400
    assert safe_at(learned, 1400, 4.5) == 2800  # twice what was safe, not 1.25x


def test_the_tokens_follow_the_limit_in_their_slow_start():
    learned = learner()
    assert safe_at(learned, 300, 0.5) == 600
    # runs of 100 wait for a full pool of 4: the limit doubles, and the tokens, which
    # would hold back the runs it lets in, follow it (one round judges both)
    learned.on_tick(1.0, running=4, reserved=400, queued=9, smallest=100)
    assert (learned.limit, learned.budget) == (8, 800)


def runs_learner() -> LearnedCapacity:
    """A latency learner of runs only (no token counts), its baseline one step."""
    learned = LearnedCapacity(
        AutoConcurrency(1, 64),
        signal="latency",
        now=0.0,
        counts_tokens=False,
        rng=random.Random(1),
    )
    learned.on_first_token(RunSample(0.125, 1, 0, 0, 0.0), 0.1)
    learned.limit = 32
    return learned


def waited(learned: LearnedCapacity, now: float, in_flight: int, streaming: int | None) -> int:
    """A run that came on ``in_flight`` runs waited ten steps for its first token."""
    move = learned.on_first_token(
        RunSample(1.25, in_flight, 0, 0, now - 1.25),
        now,
        streaming=None if streaming is None else lambda: streaming,
    )
    assert move is None or move.reason == "latency_waited"
    return learned.limit


def test_past_16_runs_a_rise_of_the_slow_start_adds_8():
    """RFC 3742's limited slow start: the last rise overshoots by a bounded number."""
    learned = runs_learner()
    learned.on_tick(1.0, running=32, reserved=0, queued=5, smallest=None)
    assert learned.limit == 40
    learned.limit = 8
    learned.on_tick(2.0, running=8, reserved=0, queued=5, smallest=None)
    assert learned.limit == 16


def probe_after(learned: LearnedCapacity, since: float) -> float:
    """Seconds from ``since`` to the first rise past the mark, runs waiting for the pool
    at every look (a look every 10 ms, at most 60 s)."""
    mark = learned.limit
    for tick in range(1, 6001):
        now = since + tick / 100
        learned.on_tick(now, running=learned.limit, reserved=0, queued=5, smallest=None)
        if learned.limit > mark:
            return now - since
    raise AssertionError("no probe within 60 s")


def test_a_wait_lowers_the_limit_to_the_runs_streaming_if_fewer():
    # a queue of a step or two is under the tolerance, so a run that waits long enough
    # to be seen came on several runs past the batch: the runs streaming say where it is
    assert waited(runs_learner(), 2.0, in_flight=20, streaming=16) == 16
    assert waited(runs_learner(), 2.0, in_flight=20, streaming=None) == 19
    assert waited(runs_learner(), 2.0, in_flight=12, streaming=16) == 11
    # but by a quarter at most: at a shift to longer runs few have streamed yet
    assert waited(runs_learner(), 2.0, in_flight=13, streaming=2) == 9


def test_probes_that_fail_at_the_same_mark_back_off_and_a_new_mark_ends_it():
    learned = runs_learner()
    assert waited(learned, 2.0, in_flight=20, streaming=16) == 16
    first = probe_after(learned, 2.0)
    now = 2.0 + first
    gaps = []
    for _ in range(4):  # each probe fails at the same mark: the next waits twice as long
        now += 0.3
        assert waited(learned, now, in_flight=learned.limit + 1, streaming=16) == 16
        gap = probe_after(learned, now)
        gaps.append(gap)
        now += gap
    assert gaps[0] == pytest.approx(2 * first, abs=0.02)
    assert gaps[1] == pytest.approx(4 * first, abs=0.02)
    assert gaps[2:] == pytest.approx([MOST_BACKOFF * first] * 2, abs=0.02)
    # a wait that marks elsewhere (the engine shrank): probes wait one run's time again
    now += 0.3
    assert waited(learned, now, in_flight=learned.limit + 1, streaming=8) == 13
    assert probe_after(learned, now) == pytest.approx(first, abs=0.02)


def test_a_wait_that_what_was_safe_does_not_explain_keeps_the_mark():
    learned = runs_learner()
    # 30 runs in flight were safe; a run that came on 33 waited: the mark is 31
    learned.on_first_token(RunSample(0.125, 30, 0, 0, 0.4), 0.5)
    assert waited(learned, 2.0, in_flight=33, streaming=31) == 31
    assert learned.run_mark == 31
    # a run that came on 20 waited (a step that grew at a shift of load, or an engine
    # that shrank): the limit drops under it, but the mark is where it last queued
    assert waited(learned, 4.0, in_flight=20, streaming=20) == 19
    assert learned.run_mark == 31
    # so the next rise goes back to the mark at once, not a run at a time
    learned.on_tick(5.0, running=19, reserved=0, queued=5, smallest=None)
    assert learned.limit == 31
    # and a wait there, past what is safe now, marks where it is
    assert waited(learned, 6.0, in_flight=31, streaming=27) == 27
    assert learned.run_mark == 27


def test_the_run_that_filled_the_limit_doubles_it_at_its_first_token():
    """TCP's slow start grows its window at each acknowledgment, not a round trip later:
    a run granted into the limit's last place that did not wait says the limit was
    safe, and below the mark the limit doubles then (past 16, by 8), not at the next
    look. One granted with places free says nothing of the limit (a window the load
    does not fill is not grown, RFC 7661), and past a wait's mark nothing doubles."""
    learned = runs_learner()
    learned.limit = 8
    learned.on_first_token(RunSample(0.125, 7, 0, 0, 0.4), 0.5)
    assert learned.limit == 8
    learned.on_first_token(RunSample(0.125, 8, 0, 0, 0.4), 0.5)
    assert learned.limit == 16
    learned.on_first_token(RunSample(0.125, 16, 0, 0, 0.6), 0.7)
    assert learned.limit == 32
    learned.on_first_token(RunSample(0.125, 32, 0, 0, 0.8), 0.9)
    assert learned.limit == 40
    dropped = waited(learned, 2.0, in_flight=40, streaming=30)
    assert dropped == 30 and learned.run_mark < 2 * dropped
    learned.on_first_token(RunSample(0.125, dropped, 0, 0, 2.1), 2.2)
    assert learned.limit == dropped


def test_a_rise_the_engine_took_is_not_judged_a_failed_probe_by_a_later_dip():
    """The engine learner judges a rise of the limit that its batch may not take: if,
    once the rise's runs are heard from, the engine runs no more than before it and some
    wait, its batch is full. A scrape begun just after the rise (within a step: too soon
    to judge a failure) that shows the engine running more says it took the rise, and a
    later scrape with a few requests waiting for the next step (an engine that admits at
    step boundaries), and so fewer running, must not undo it (drawn engine 5: the first
    phase's limit fell from 16 to 8 and took 7 s to climb back)."""
    learned = LearnedCapacity(AutoConcurrency(1, 64), signal="engine", now=0.0)
    learned.limit = 8
    kw = {"reserved": 800, "queued": 5, "stalled": 0}
    # the engine ran 14 (runs let in before the limit was learned) when it rose
    learned.on_engine(EngineSignals(0, 14, 0.1, 0.9), 1.0, running=14, **kw)
    assert learned.limit == 16
    learned.on_engine(EngineSignals(0, 16, 0.2, 1.02), 1.05, running=16, **kw)
    learned.on_engine(EngineSignals(3, 13, 0.2, 1.4), 1.5, running=16, **kw)
    assert learned.limit >= 16


def test_no_run_waits_or_stalls_while_the_engine_is_still_in_a_long_step():
    """A burst of long prompts prefilled in one step: no run hears anything until it
    ends, not even those streaming before it. A run is judged in steps at least as long
    as the step now has lasted (the least time since any run streaming was heard), so
    the burst is not read as a queue; a run quiet while others are heard still is."""
    learned = learner()
    waits, stalls = learned.waited_past(100), learned.stalled_past()
    assert waits is not None and stalls is not None
    learned.on_streaming([0.9, 1.0], 0.0)  # nothing from either for 0.9 s at least
    assert learned.waited_past(100) == pytest.approx(waits / learned.step * 0.9)
    assert learned.stalled_past() == pytest.approx(stalls / learned.step * 0.9)
    learned.on_streaming([0.01, 1.0], 0.0)  # one was heard just now: the other stalls
    assert learned.stalled_past() == pytest.approx(stalls)


def test_a_run_granted_past_what_was_ever_safe_is_judged_sooner():
    """A slow start's last rise overshoots the engine by up to as many runs as it had;
    each waits in the engine until it is judged. A latency learner judges a run granted
    past the most runs or tokens seen in flight with no wait (a probe) after 2.5 steps
    times the baseline, not 4; a run within what was safe keeps the wider bound."""
    learned = learner()
    safe_at(learned, 800, 0.5)
    assert (learned.safe_runs, learned.safe) == (8, 800)
    within = learned.waited_past(100, (8, 800))
    probe = learned.waited_past(100, (9, 900))
    tokens_probe = learned.waited_past(100, (8, 900))
    assert within is not None and probe is not None
    assert probe == tokens_probe == pytest.approx(within * 2.5 / 4)
    assert learned.waited_past(100) == within  # not known: the wider bound
    # a run of the probe waits at 3 of its bound's steps: said now, not at 4
    assert learned.on_waiting(probe * 1.2, RunSample(0.0, 9, 900, 100, 0.5), 0.6) is not None


def test_the_step_is_what_the_runs_of_one_batch_show_between_their_batches():
    """The runs of one batch all hear at once: 2 ms after a batch every one has been
    quiet 2 ms, and 100 ms after it 100 ms. The step is the median gap between two
    batches of a run (or its quiet, if longer: a step that lasts), not twice a quiet
    (4 ms, or 200 ms), and a run with one batch so far shows none."""
    learned = learner()
    learned.on_run_end(0.4)  # the runs that ended stepped at 400 ms (a larger batch)
    learned.on_streaming([0.002] * 6, 0.0, [0.1] * 6)
    assert learned.step == pytest.approx(0.1)
    learned.on_streaming([0.1] * 6, 0.0, [0.1] * 6)
    assert learned.step == pytest.approx(0.1)
    learned.on_streaming([0.3] * 6, 0.0, [0.3] * 6)  # a long step: the quiet shows it
    assert learned.step == pytest.approx(0.3)
    learned.on_streaming([0.002] * 6, 0.0, [0.1] * 2)  # four had one batch only
    assert learned.step == pytest.approx(0.4)  # too few show the step: the runs' TPOT


def test_a_long_prompts_first_token_is_not_late_for_a_step_that_shrank():
    """A prefill takes its time whatever the step: a long prompt's first token 150 ms
    out, on 100 ms steps, is 1.5 steps. When the batch shrinks to 20 ms steps, the same
    prefill is 7.5 steps, not a wait: a run waits past the tolerance times the shortest
    time to first token of its size too."""
    learned = learner()
    learned.on_first_token(RunSample(0.15, 1, 1000, 1000, 0.2), 0.4)
    learned.on_streaming([0.001] * 6, 0.0, [0.02] * 6)
    assert learned.step == pytest.approx(0.02)
    past = learned.waited_past(1000, (2, 2000))
    assert past is not None and past >= 2.5 * 0.15
    late = learned.on_first_token(RunSample(0.16, 2, 2000, 1000, 1.0), 1.2)
    assert late is None or late.reason != "latency_waited"


def test_a_run_granted_during_a_long_step_is_not_late_for_waiting_it_out():
    """A burst's prefills make one long step; a run granted during it joins only at the
    next, so its first token comes a long step and its own step late. The step that
    just ended (the longest a streaming run just showed) bounds the wait too, for a
    run still without a first token and for one whose first token came."""
    learned = learner()
    safe_at(learned, 800, 0.2)  # runs of 2 and 3 in flight are within what was safe
    learned.on_streaming([0.01] * 6, 0.0, [0.1] * 5 + [0.6])
    assert learned.step == pytest.approx(0.1)
    past = learned.waited_past(100, (2, 200))
    assert past is not None and past >= 4 * 0.6
    assert learned.on_waiting(0.7, RunSample(0.0, 2, 200, 100, 0.5), 1.2) is None
    late = learned.on_first_token(RunSample(0.7, 2, 200, 100, 0.5), 1.2)
    assert late is None or late.reason != "latency_waited"
    learned.on_streaming([0.01] * 6, 0.0, [0.1] * 6)  # steps of 0.1 s again: it waited
    assert learned.on_first_token(RunSample(0.7, 3, 300, 100, 1.3), 2.0) is not None
