"""``concurrency: auto`` learned in process, against the simulated engine, on trio's MockClock.

:class:`SimEngineAdapter` puts the scheduler of ``benchmarks/sim_engine.py`` (its
``Engine``: a KV cache reserved at admission, a batch stepped by a law that grows
with it, an internal FIFO; its docstring says what it leaves out) behind the adapter
interface with no HTTP between: a run is a request added to the engine, its tokens
come as the engine steps them, a run that ends early leaves and frees its cache.
``engine_signals`` reads vLLM's gauges from the engine's state (or none, for the
latency signal), ``count_tokens`` its tokenizer. The engine's wire is tested in
``test_sim_engine.py``, and ``benchmarks/capacity.py`` runs the whole stack on
loopback with the real clock; here time is the mock clock's, so every figure is
exact and the test deterministic. Time is free but CPU is not: the phases are short.

The workload is issue 20's: 48 clients in loops, short runs (60 + 24 tokens: 48 fit in
the 4,096-token cache), then long ones (1,206 + 124: 3 fit), then short again. Each
phase is judged, after a warm-up, on the engine's own time averages against what the
law gives a full engine (48 short runs or 3 long ones in the batch): at least 0.85 of
its tokens/s, at most 1.0 request waiting inside the engine.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from iop_trio.metrics import NodeMetrics
from iop_trio.model import AutoConcurrency, RunSpec, TargetSpec
from iop_trio.runtime import AdapterSlot, Node, RuntimeLimits
from iop_trio.store.memory import MemoryStore

from .zoo import SimEngineAdapter, capacity, sim

CLIENTS = 48
WARMUP = 10.0  # seconds of each phase not judged (mock clock)
WINDOW = 30.0  # seconds judged


def sim_node(engine: Any, *, metrics: bool, **target: Any) -> Node:
    return Node(
        node_id="learner",
        adapters=[SimEngineAdapter(engine, metrics=metrics)],
        targets=[TargetSpec("sim", "bench", tokenizer="vllm", **target)],
        limits=RuntimeLimits(concurrency=1024, max_queued=1024, queue_timeout=600.0),
        store=MemoryStore(),
    )


async def clients(node: Node, spec: RunSpec, until: float) -> None:
    """:data:`CLIENTS` callers, each running ``spec`` again and again until ``until``;
    then their runs are cancelled, as the benchmark's clients leave."""

    async def one() -> None:
        while trio.current_time() < until:
            submitted = await node.manager.submit(spec)
            async for _event in node.manager.watch(submitted.record.run_id):
                pass

    async with trio.open_nursery() as nursery:
        for _ in range(CLIENTS):
            nursery.start_soon(one)
            await trio.sleep(0.02)
        await trio.sleep_until(until)
        nursery.cancel_scope.cancel()
    for run_id in [r.run_id for r in await node.store.list_runs() if not r.status.terminal]:
        await node.manager.cancel(run_id)


def full_engine_rate(law: Any, runs: int) -> float:
    """Tokens/s of an engine that steps ``runs`` requests a step (no prefill)."""
    return float(runs / law.step_time(runs))


@pytest.mark.parametrize("metrics", [True, False], ids=["engine", "latency"])
async def test_auto_fills_the_engine_without_a_queue_inside_it_in_every_phase(
    autojump_clock, metrics
):
    engine = sim.Engine()
    node = sim_node(engine, metrics=metrics, concurrency=64, auto=AutoConcurrency(1, 64))
    figures: list[tuple[str, float, float]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with node.running():
            for phase in capacity.PHASES:
                spec = RunSpec(
                    "sim/bench",
                    messages=(("user", capacity.prompt_of(phase.words)),),
                    options={"max_tokens": phase.max_tokens},
                )
                start = trio.current_time()
                async with trio.open_nursery() as load:
                    load.start_soon(clients, node, spec, start + WARMUP + WINDOW)
                    await trio.sleep(WARMUP)
                    engine.reset()
                    await trio.sleep(WINDOW)
                    stats = engine.reset()
                fits = engine.kv_tokens // (phase.prompt_tokens + phase.max_tokens)
                best = full_engine_rate(engine.law, min(fits, CLIENTS))
                figures.append((phase.name, stats["tokens_per_s"] / best, stats["mean_waiting"]))
                await engine.until(lambda: not engine.running and not engine.waiting)
            learner = node.learners["target:sim/bench"]
            assert learner.signal == ("engine" if metrics else "latency")
            _ready, components = NodeMetrics(node).readiness()
            said = components["capacity:target:sim/bench"]["state"]
            assert said.startswith(f"learned from {learner.signal}: ")
            text = NodeMetrics(node).render().decode()
        nursery.cancel_scope.cancel()
    for name, ratio, waiting in figures:
        assert ratio >= 0.85 and waiting <= 1.0, (name, figures)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    moves = {
        s.labels["reason"]: s.value
        for s in families["iop_gate_limit_adjustments"].samples
        if s.name.endswith("_total")
    }
    assert sum(moves.values()) > 0 and all(
        r.startswith("engine_" if metrics else "latency_") for r in moves if r != "start"
    ), moves
    taken = [s for s in families["iop_gate_runs_taken_back"].samples if s.name.endswith("_total")]
    assert [s.labels["pool"] for s in taken] == ["target:sim/bench"], taken
    assert taken[0].value == learner.taken_back  # none here: nothing let in waits
    signal = [s for s in families["iop_gate_learned_signal"].samples if s.value == 1]
    assert [s.labels["signal"] for s in signal] == [learner.signal]
    limit = [
        s.value
        for s in families["iop_gate_permits_limit"].samples
        if s.labels == {"level": "target", "name": "sim/bench"}
    ]
    assert learner.learned is not None and limit == [learner.learned.limit]


async def test_a_learned_limit_stays_under_a_static_cap_above_it(autojump_clock):
    """The adapter's static concurrency (4) caps a target whose own is learned up to 64:
    the engine never has more than 4, whatever the learner grows to."""
    engine = sim.Engine()
    node = Node(
        node_id="capped",
        adapters=[AdapterSlot(SimEngineAdapter(engine, metrics=True), concurrency=4)],
        targets=[
            TargetSpec(
                "sim", "bench", tokenizer="vllm", concurrency=64, auto=AutoConcurrency(1, 64)
            )
        ],
        limits=RuntimeLimits(concurrency=1024, max_queued=1024, queue_timeout=600.0),
        store=MemoryStore(),
    )
    short = capacity.PHASES[0]
    spec = RunSpec(
        "sim/bench",
        messages=(("user", capacity.prompt_of(short.words)),),
        options={"max_tokens": short.max_tokens},
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with node.running():
            await clients(node, spec, trio.current_time() + 20)
            learned = node.learners["target:sim/bench"].learned
            assert learned is not None and learned.limit > 4  # it saw room, and grew
        nursery.cancel_scope.cancel()
    assert engine.window.max_running == 4
