"""The latency learner's token budget, told its signals directly (sans-IO, no clock):
the tokens' slow start doubles what was safe, and ends once, falling back to
:data:`~iop_trio.runtime.capacity.HEADROOM` times it."""

from __future__ import annotations

import random

from iop_trio.model import AutoConcurrency
from iop_trio.runtime.capacity import HEADROOM, LearnedCapacity, RunSample


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


def test_a_run_that_ends_ends_the_slow_start():
    learned = learner()
    assert safe_at(learned, 800, 0.5) == 1600
    learned.on_run_end(0.125, 2.0)
    assert safe_at(learned, 800, 2.5) == 800 * HEADROOM
