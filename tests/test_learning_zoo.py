"""``concurrency: auto`` over the engine zoo (``benchmarks/engine_zoo.py``), on trio's
MockClock: each example runs, on one node and one engine of a shape (``tests/zoo.py``
says how), the static limits worth trying and both learners (from the engine's metrics,
and from latency) through a load's phases, 2 s of warm-up and 8 s judged.

The issue's targets (issue 30) are, per learner and phase: at least 0.85 of the best
static limit's tokens/s, at most 1.0 request queued inside the engine on average (queued
for room: a request that came mid-step and joins at the next step boundary is not), and,
after a shift from long runs to short ones, 0.85 of the best static within 3 s. They are
held here on the benchmark's sample, where they are met (any miss that must be let
through is listed in :data:`KNOWN_MISSES`, with its cause). Over engines drawn from the
whole of the issue's ranges they are not all met yet (about 21 of 30 drawn engines meet
every target, ``python -m tests.zoo --drawn 30``, 23 of ``--drawn 30 31``, an engine or two
either way from run to run: trio's order of a step's tasks is not seeded; most misses
are the queue a slow start's last rise leaves past the cache, seen a tolerance late on
an engine of 100-200 ms steps), so what Hypothesis holds there is that
the learner never collapses, as the one before issue 30 did (0.04-0.09x of the best
static on two of the sample): at least :data:`FLOOR` of the best static in every phase,
at most :data:`MOST_QUEUED` queued. The examples are few and derandomized (each is
minutes of simulated time); ``python -m tests.zoo`` prints the figures of the sample.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from .zoo import LOADS, LONG, TARGET, Config, judge, measure, verdicts, zoo

REACH = 3.0  # seconds to 0.85x of the best static after a shift from long to short
FLOOR = 0.33  # of the best static's tokens/s, in any phase of any drawn engine
MOST_QUEUED = 6.0  # requests queued in the engine on average, in any phase of any engine
#: The sample's known misses, by shape: (learner, phase index) and why. None since the
#: latency learner's drop to the runs streaming and its probes' backoff (issue 30).
KNOWN_MISSES: dict[str, set[tuple[str, int]]] = {}


@st.composite
def shapes(draw: Any) -> Any:
    ranges = zoo.RANGES
    return zoo.Shape(
        "drawn",
        base_ms=draw(st.floats(*ranges["base_ms"])),
        per_seq_ms=draw(st.floats(*ranges["per_seq_ms"])),
        prefill_us=draw(st.sampled_from([10.0, 20.0, 50.0, 100.0])),
        kv_tokens=draw(st.integers(*ranges["kv_tokens"])),
        max_batch=draw(st.none() | st.integers(*ranges["max_batch"])),
        metrics=draw(st.sampled_from(["vllm", "llamacpp", "none"])),
        scrape_ms=draw(st.floats(*ranges["scrape_ms"])),
        admit=draw(st.sampled_from(["arrival", "step"])),
        kv_mode=draw(st.sampled_from(["reserve", "paged"])),
    )


def judged(shape: Any, load: str) -> dict[str, list[Any]]:
    clock = trio.testing.MockClock(autojump_threshold=0)
    return trio.run(judge, shape, LOADS[load], clock=clock)


def measured(shape: Any, kind: str) -> list[Any]:
    """One learner's figures over the ``shift`` load, on MockClock."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    return trio.run(measure, shape, Config(kind), LOADS["shift"], clock=clock)


def misses(results: dict[str, list[Any]], phases: Any) -> set[tuple[str, int]]:
    """(learner, phase index) of each target missed: the ratio, the queue, the reach."""
    missed = set()
    statics = [v for k, v in results.items() if k.startswith("static")]
    for i, phase in enumerate(phases):
        best = max((s[i] for s in statics), key=lambda s: s.tokens_s)
        shifted = i and phases[i - 1].max_tokens > phase.max_tokens  # long, then short
        for name in ("auto-engine", "auto-latency"):
            f = results[name][i]
            reach = f.reached(TARGET * best.tokens_s) if shifted else 0.0
            if f.tokens_s < TARGET * best.tokens_s or f.queued > 1.0 or reach > REACH:
                missed.add((name, i))
    return missed


@pytest.mark.parametrize("shape", zoo.SAMPLE, ids=[s.name for s in zoo.SAMPLE])
def test_both_learners_hold_the_targets_on_the_benchmarks_sample(shape: Any) -> None:
    results = judged(shape, "shift")
    missed = misses(results, LOADS["shift"]) - KNOWN_MISSES.get(shape.name, set())
    assert not missed, (str(shape), sorted(missed), verdicts(results))


@settings(
    max_examples=6,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],  # no shrinking: an example is slow
)
@given(shape=shapes(), load=st.sampled_from(sorted(LOADS)))
def test_no_learner_collapses_on_any_engine_of_the_zoo(shape: Any, load: str) -> None:
    results = judged(shape, load)
    statics = [v for k, v in results.items() if k.startswith("static")]
    for i in range(len(LOADS[load])):
        best = max(s[i].tokens_s for s in statics)
        for name in ("auto-engine", "auto-latency"):
            f = results[name][i]
            assert f.tokens_s >= FLOOR * best and f.queued <= MOST_QUEUED, (
                str(shape),
                load,
                verdicts(results),
            )


def test_the_latency_learner_takes_back_the_long_runs_it_let_in_past_the_cache() -> None:
    """An engine whose cache holds 25 long runs and that has no batch cap (drawn engine
    14 of ``python -m tests.zoo --drawn 30``): the latency learner lets in a few more
    before it sees the first wait, and those used to wait inside the engine a whole long
    run each (6.98 queued on average through the long phase). Taken back, they wait in
    the node instead, and the engine's queue stays under one."""
    shape = zoo.Shape(
        "kv-25-long",
        base_ms=101.973,
        per_seq_ms=0.618,
        prefill_us=20.0,
        kv_tokens=33282,
        max_batch=None,
        metrics="vllm",
        scrape_ms=119.157,
        admit="arrival",
        kv_mode="reserve",
    )
    figures = measured(shape, "latency")
    long = figures[1]
    assert long.queued <= 1.0, long
    assert long.running >= 0.85 * shape.fits(LONG.prompt_tokens, LONG.max_tokens, 48), long


def test_a_burst_of_prefills_in_one_step_is_not_read_as_a_wait() -> None:
    """An engine with room for every long run and a slow prefill (the sample's
    ``big-kv-no-metrics`` at 100 ms a step and 100 µs a prompt token): the latency
    learner's slow start lets in a burst of long prompts, and the engine prefills them
    all in one step of a second or more. A look just after that step used to see the
    streaming runs just heard from (a live step of 1 ms), read the prefill as a wait,
    and hold the long phase at 12 runs of the 48 that fit. The look now takes half a
    run's last gap between two batches as the step now (about 41 runs)."""
    shape = dataclasses.replace(zoo.BY_NAME["big-kv-no-metrics"], base_ms=100, prefill_us=100)
    figures = measured(shape, "latency")
    long = figures[1]
    assert long.running >= 0.8 * shape.fits(LONG.prompt_tokens, LONG.max_tokens, 48), long


def test_the_runs_behind_one_that_waits_for_room_are_taken_back_with_it() -> None:
    """Drawn engine 19 of ``python -m tests.zoo --drawn 30``: a cache of 30 long runs, no
    batch cap. The slow start's last rise lets in runs past the cache at once. Once the
    oldest of them waits past its bound, those granted after it with no first token
    wait too (the engine admits in order): they are taken back together, rather than
    each a bound of its own later (1.1 queued on average in the long phase before,
    0.8 after: the issue's target is 1.0)."""
    shape = zoo.Shape(
        "kv-30-long",
        base_ms=116.568,
        per_seq_ms=3.17795,
        prefill_us=20.0,
        kv_tokens=40610,
        max_batch=None,
        metrics="vllm",
        scrape_ms=144.841,
        admit="step",
        kv_mode="reserve",
    )
    figures = measured(shape, "latency")
    assert figures[1].queued <= 1.0, figures[1]


def test_the_engine_learner_takes_back_the_runs_it_let_in_past_a_batch_cap() -> None:
    """Drawn engine 24 of ``python -m tests.zoo --drawn 30``: a batch cap of 9 on steps
    of 186 ms, so a short run holds its place 4.6 s. The first phase's slow start lets
    in 16; the engine runs 9 and says 7 wait, and the limit drops to 9. The 7 used to
    stay queued in the engine until places freed (2.4 queued on average through the
    phase); the engine learner now takes them back as the latency learner does."""
    shape = zoo.Shape(
        "cap-9-slow",
        base_ms=186.182,
        per_seq_ms=0.481775,
        prefill_us=20.0,
        kv_tokens=33466,
        max_batch=9,
        metrics="vllm",
        scrape_ms=140.675,
        admit="step",
        kv_mode="paged",
    )
    figures = measured(shape, "engine")
    assert all(f.queued <= 1.0 for f in figures), figures
