"""The engine zoo in process, on trio's MockClock: a node over a simulated engine of any
:class:`~engine_zoo.Shape`, loads that shift, and the figures a phase gives.

:class:`SimEngineAdapter` puts ``benchmarks/sim_engine.py``'s scheduler (its ``Engine``;
its docstring says what it models and leaves out) behind the adapter interface with no
HTTP between: a run is a request added to the engine, its tokens come as the engine
steps them, a run that ends early leaves and frees its cache. ``engine_signals`` reads
vLLM's gauges from the engine's state after the shape's scrape time (or none, for the
latency signal), ``count_tokens`` its tokenizer. ``benchmarks/capacity.py --zoo`` runs
the same shapes through real processes; here every figure is exact, but a run is not
quite repeatable: trio orders the tasks of a step at random (an unseeded generator of its
own), so a phase's figures move by a few percent from run to run. ``python -m tests.zoo
[SHAPE ...]`` prints the figures of the sample.
"""

from __future__ import annotations

import importlib
import math
import random
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from iop_trio.adapters import Adapter, AdapterRequest, Chunk, Completion, Delta
from iop_trio.model import AutoConcurrency, EngineSignals, RunSpec, TargetSpec, Usage
from iop_trio.runtime import Node, RuntimeLimits
from iop_trio.store.memory import MemoryStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
sim = importlib.import_module("sim_engine")
zoo = importlib.import_module("engine_zoo")
capacity = importlib.import_module("capacity")

CLIENTS = 48
WARMUP = 2.0  # seconds of a phase not judged
WINDOW = 8.0  # seconds judged
SAMPLE_EVERY = 0.1  # seconds between two reads of the engine's token counter
RATE_WINDOW = 0.5  # seconds a rate in the time series is taken over
TARGET = 0.85  # of the best static limit's tokens/s


class SimEngineAdapter(Adapter):
    """The simulated engine's scheduler as an adapter (module docstring)."""

    kind = "sim"
    caller_options = frozenset({"max_tokens"})
    output_limit_options = ("max_tokens",)

    def __init__(self, engine: Any, *, metrics: bool, scrape_delay: float = 0.0) -> None:
        super().__init__("sim")
        self.engine = engine
        self.metrics = metrics
        self.scrape_delay = scrape_delay

    @staticmethod
    def _messages(request: AdapterRequest) -> list[tuple[str, str]]:
        return list(request.messages) or [("user", request.prompt)]

    @asynccontextmanager
    async def open_stream(self, request: AdapterRequest) -> AsyncIterator[AsyncIterator[Chunk]]:
        prompt = sim.chat_token_count(self._messages(request))
        seq = self.engine.add(prompt, int(request.params["max_tokens"]))
        try:
            yield self._chunks(seq)
        finally:
            self.engine.leave(seq)

    async def _chunks(self, seq: Any) -> AsyncIterator[Chunk]:
        sent = 0
        while not seq.done:
            await seq.wait_beyond(sent)
            for _ in range(seq.generated - sent):
                yield Delta(sim.TOKEN_TEXT)
            sent = seq.generated
        yield Completion(Usage(seq.finish_reason or "length", seq.prompt_tokens, seq.generated))

    async def count_tokens(self, request: AdapterRequest, tokenizer: str) -> int | None:
        return int(sim.chat_token_count(self._messages(request)))

    async def engine_signals(self, now: float) -> EngineSignals | None:
        if not self.metrics:
            return None
        if self.scrape_delay:
            await trio.sleep(self.scrape_delay)
        engine = self.engine
        return EngineSignals(
            len(engine.waiting), len(engine.running), engine.kv_used / engine.kv_tokens, now
        )


@attrs.frozen
class Config:
    """How the target's concurrency is set: ``static`` (a number) or ``auto`` from the
    engine's metrics (``engine``) or its runs' latency (``latency``)."""

    kind: str
    limit: int = 0

    def __str__(self) -> str:
        return f"static-{self.limit}" if self.kind == "static" else f"auto-{self.kind}"

    def target(self) -> dict[str, Any]:
        if self.kind == "static":
            return {"concurrency": self.limit}
        return {"concurrency": 64, "auto": AutoConcurrency(1, 64)}


@attrs.frozen
class Phase:
    name: str
    words: int
    max_tokens: int
    clients: int = CLIENTS

    @property
    def prompt_tokens(self) -> int:
        return int(sim.chat_token_count([("user", capacity.prompt_of(self.words))]))

    def spec(self) -> RunSpec:
        return RunSpec(
            "sim/bench",
            messages=(("user", capacity.prompt_of(self.words)),),
            options={"max_tokens": self.max_tokens},
        )


SHORT, LONG = Phase("short", 40, 24), Phase("long", 900, 124)
#: the loads: short, long, short (the issue's); a ramp of callers; a burst
LOADS: dict[str, tuple[Phase, ...]] = {
    "shift": (SHORT, LONG, SHORT),
    "ramp": (
        attrs.evolve(SHORT, name="ramp-8", clients=8),
        attrs.evolve(SHORT, name="ramp-24", clients=24),
        attrs.evolve(SHORT, name="ramp-48", clients=48),
    ),
    "burst": (attrs.evolve(SHORT, name="few", clients=4), attrs.evolve(LONG, name="burst")),
}


@attrs.frozen
class Figures:
    """One configuration's figures in one phase: the engine's own time averages over
    the window, and its tokens counted every :data:`SAMPLE_EVERY` from the phase's start."""

    config: str
    phase: str
    tokens_s: float
    waiting: float
    queued: float
    running: float
    kv: float
    series: tuple[tuple[float, int], ...]  # (seconds since the phase began, tokens)
    limit: int | None = None
    budget: float | None = None

    def reached(self, rate: float) -> float:
        """Seconds from the phase's start until the tokens/s over :data:`RATE_WINDOW`
        first reach ``rate`` (inf: never)."""
        for (t0, n0), (t1, n1) in zip(self.series, self.series[1:], strict=False):
            del t0
            back = [(t, n) for t, n in self.series if t1 - RATE_WINDOW - 1e-9 <= t <= t1]
            tb, nb = back[0]
            if t1 - tb >= RATE_WINDOW - 1e-9 and (n1 - nb) / (t1 - tb) >= rate:
                return t1
            del n0
        return math.inf


def sim_node(engine: Any, shape: Any, config: Config) -> Node:
    metrics = config.kind == "engine" and shape.metrics != "none"
    adapter = SimEngineAdapter(engine, metrics=metrics, scrape_delay=shape.scrape_ms / 1e3)
    return Node(
        node_id="zoo",
        adapters=[adapter],
        targets=[TargetSpec("sim", "bench", tokenizer="vllm", **config.target())],
        limits=RuntimeLimits(concurrency=1024, max_queued=1024, queue_timeout=600.0),
        store=MemoryStore(),
    )


async def callers(node: Node, phase: Phase, until: float) -> None:
    """``phase.clients`` callers, each running the phase's spec again and again until
    ``until`` (started 20 ms apart); the caller cancels what they leave (:func:`cancel_all`)."""
    spec = phase.spec()

    async def one() -> None:
        while trio.current_time() < until:
            submitted = await node.manager.submit(spec)
            async for _event in node.manager.watch(submitted.record.run_id):
                pass

    async with trio.open_nursery() as nursery:
        for _ in range(phase.clients):
            nursery.start_soon(one)
            await trio.sleep(0.02)
        await trio.sleep_until(until)
        nursery.cancel_scope.cancel()


async def cancel_all(node: Node) -> None:
    """Cancel every run not yet ended (a phase's leftovers, queued or running)."""
    for run_id in [r.run_id for r in await node.store.list_runs() if not r.status.terminal]:
        await node.manager.cancel(run_id)


async def measure(shape: Any, config: Config, phases: Sequence[Phase]) -> list[Figures]:
    """Each phase of the load, one after the other on one node and one engine (the
    learners' jitter seeded; trio's order of a step's tasks is not: module docstring)."""
    random.seed(0)
    engine = shape.engine()
    node = sim_node(engine, shape, config)
    out: list[Figures] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with node.running():
            for phase in phases:
                out.append(await _phase(node, engine, phase, config))
                await engine.until(lambda: not engine.running and not engine.waiting)
                await trio.sleep(0.5)
        nursery.cancel_scope.cancel()
    return out


async def _phase(node: Node, engine: Any, phase: Phase, config: Config) -> Figures:
    start = trio.current_time()
    series: list[tuple[float, int]] = []
    async with trio.open_nursery() as load:
        load.start_soon(callers, node, phase, start + WARMUP + WINDOW)

        async def sample() -> None:
            while True:
                series.append((trio.current_time() - start, engine.generation_tokens_total))
                await trio.sleep(SAMPLE_EVERY)

        load.start_soon(sample)
        await trio.sleep(WARMUP)
        engine.reset()
        await trio.sleep(WINDOW)
        stats = engine.reset()
        learner = node.learners.get("target:sim/bench")
        learned = None if learner is None else learner.learned
        load.cancel_scope.cancel()
    await cancel_all(node)
    return Figures(
        str(config),
        phase.name,
        stats["tokens_per_s"],
        stats["mean_waiting"],
        stats["mean_queued"],
        stats["mean_running"],
        stats["mean_kv_usage"],
        tuple(series),
        None if learned is None else learned.limit,
        None if learned is None else learned.budget,
    )


def static_limits(shape: Any, phases: Sequence[Phase]) -> list[int]:
    """The static limits worth trying: what fits of each phase's runs, and one past."""
    found = set()
    for phase in phases:
        fits = shape.fits(phase.prompt_tokens, phase.max_tokens, phase.clients)
        found |= {fits, min(phase.clients, fits + 1), min(64, 2 * fits)}
    return sorted(found)


async def judge(shape: Any, phases: Sequence[Phase]) -> dict[str, list[Figures]]:
    """Every static limit worth trying and both learners over ``phases``."""
    configs = [Config("static", n) for n in static_limits(shape, phases)]
    configs += [Config("engine"), Config("latency")]
    return {str(c): await measure(shape, c, phases) for c in configs}


def verdicts(results: dict[str, list[Figures]]) -> list[str]:
    """A line per learner and phase: its ratio to the best static, its waiting, and the
    seconds it took to reach :data:`TARGET` of the best static (a short phase after a
    long one)."""
    lines = []
    statics = [v for k, v in results.items() if k.startswith("static")]
    for name in ("auto-engine", "auto-latency"):
        for i, f in enumerate(results[name]):
            best = max((s[i] for s in statics), key=lambda s: s.tokens_s)
            ratio = f.tokens_s / best.tokens_s
            took = f.reached(TARGET * best.tokens_s)
            ok = ratio >= TARGET and f.queued <= 1.0
            lines.append(
                f"  {name:<13} {f.phase:<8} {f.tokens_s:8.1f} tok/s {ratio:5.2f}x of "
                f"{best.config:<10} queued {f.queued:5.2f} waiting {f.waiting:5.2f} "
                f"running {f.running:5.1f} "
                f"reached {took:5.2f}s limit {f.limit} budget {f.budget} "
                f"{'ok' if ok else 'MISS'}"
            )
    return lines


def drawn(count: int, seed: int = 30) -> None:
    """How many of ``count`` engines drawn from the zoo's ranges (``random.Random(seed)``,
    one load each) meet every target for both learners; a line for each."""
    import random

    from .test_learning_zoo import judged, misses

    rng = random.Random(seed)
    ranges, met = zoo.RANGES, 0
    for i in range(count):
        shape = zoo.Shape(
            "drawn",
            base_ms=rng.uniform(*ranges["base_ms"]),
            per_seq_ms=rng.uniform(*ranges["per_seq_ms"]),
            prefill_us=rng.choice([10.0, 20.0, 50.0, 100.0]),
            kv_tokens=rng.randint(*ranges["kv_tokens"]),
            max_batch=rng.choice([None, rng.randint(*ranges["max_batch"])]),
            metrics=rng.choice(["vllm", "llamacpp", "none"]),
            scrape_ms=rng.uniform(*ranges["scrape_ms"]),
            admit=rng.choice(["arrival", "step"]),
            kv_mode=rng.choice(["reserve", "paged"]),
        )
        load = rng.choice(sorted(LOADS))
        missed = misses(judged(shape, load), LOADS[load])
        met += not missed
        print(i, load, "ok" if not missed else f"MISS {sorted(missed)}", shape, flush=True)
    print(f"{met}/{count} drawn engines meet every target")


def main(names: Sequence[str]) -> None:
    """``python -m tests.zoo [SHAPE...]``: the sample's figures (or the shapes named);
    ``python -m tests.zoo --drawn N [SEED]``: :func:`drawn`."""
    if names[:1] == ["--drawn"]:
        drawn(int(names[1]) if len(names) > 1 else 30, int(names[2]) if len(names) > 2 else 30)
        return
    shapes = [zoo.BY_NAME[n] for n in names] if names else list(zoo.SAMPLE)
    for shape in shapes:
        print(shape)
        results = trio.run(
            judge, shape, LOADS["shift"], clock=trio.testing.MockClock(autojump_threshold=0)
        )
        for line in verdicts(results):
            print(line, flush=True)


if __name__ == "__main__":
    import trio.testing

    main(sys.argv[1:])
