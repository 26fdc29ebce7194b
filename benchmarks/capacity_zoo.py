"""``capacity.py --zoo``: the learned limit over the engine zoo, through real processes.

    python benchmarks/capacity.py --zoo [SHAPE,...] [--phase-seconds 8] [--warmup 2]
                                  [--clients 48]

For each engine of :data:`engine_zoo.SAMPLE` (or those named), this runs, as
``capacity.py`` does for one engine (its docstring says how: ``sim_engine.py``,
``iop-node edge`` with its OpenAI-compatible door, ``iop-node serve`` with the SQLite
store, 48 streaming clients through the door), the phases short, long, short, each of
2 s warm-up and 8 s measured, for:

- the static limits worth trying on that engine: what fits of each phase's runs (its
  batch cap, its cache) and twice that (up to 64);
- ``auto`` (``concurrency: auto``, ``concurrency_max: 64``, ``tokenizer: vllm``): from
  the engine's metrics, or from latency where the shape exposes none;
- ``auto-latency``: the same with the engine started ``--metrics none``.

Per engine, learner and phase it prints issue 30's targets: tokens/s at least 0.85x of
the best static limit of the same phase (the engine's own counter over its own clock),
at most 1.0 request queued inside the engine on average (``queued``: waiting for room,
as an admission check found it; ``waiting`` beside it is vLLM's gauge, which also
counts a request that came mid-step and joins at the next), and the seconds from the
start of the short phase after the long one until the tokens/s over 0.5 s first reach
0.85x of the best static's (the engine's counter read every 0.1 s by the clients'
process). Figures are printed, never asserted; ``tests/test_learning_zoo.py`` holds the
same targets under MockClock.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import Any

import attrs
import capacity
import engine_zoo
import httpx
import trio
from capacity import PHASES, Bench, Config, Figures, Refused, load, stack

TARGET = 0.85
SAMPLE_EVERY = 0.1  # seconds between two reads of the engine's token counter
RATE_WINDOW = 0.5  # seconds a rate is taken over


def configs(shape: engine_zoo.Shape, clients: int) -> list[Config]:
    """The static limits worth trying on ``shape``, then both learners."""
    limits: set[int] = set()
    for phase in PHASES[:2]:
        fits = shape.fits(phase.prompt_tokens, phase.max_tokens, clients)
        limits |= {fits, min(64, 2 * fits)}
    out = [Config(f"static-{n}", target=f"{{concurrency: {n}}}") for n in sorted(limits)]
    auto = "{concurrency: auto, concurrency_max: 64, tokenizer: vllm}"
    out.append(Config("auto", target=auto))
    out.append(
        Config(
            "auto-latency",
            target="{concurrency: auto, concurrency_max: 64}",
            engine=("--metrics=none",),
        )
    )
    return out


@attrs.frozen
class Run:
    """One configuration's figures in each phase, and each phase's token counter read
    every :data:`SAMPLE_EVERY`: (seconds since the phase began, the counter)."""

    config: str
    figures: Sequence[Figures]
    series: Sequence[Sequence[tuple[float, int]]]

    def reached(self, index: int, rate: float) -> float:
        """Seconds from phase ``index``'s start until the tokens/s over
        :data:`RATE_WINDOW` first reach ``rate`` (inf: never)."""
        series = self.series[index]
        for i, (t1, n1) in enumerate(series):
            # from the last read at least RATE_WINDOW before (reads are not evenly apart)
            back = [(t, n) for t, n in series[:i] if t <= t1 - RATE_WINDOW]
            if back and (n1 - back[-1][1]) / (t1 - back[-1][0]) >= rate:
                return t1
        return math.inf


async def sampled_phase(bench: Bench, config: Config, index: int) -> tuple[Figures, list[Any]]:
    """A phase of ``bench`` with the engine's token counter read beside it."""
    series: list[tuple[float, int]] = []

    async def sample(began: float) -> None:
        while True:
            stats = await bench.engine("/bench/stats")
            series.append((trio.current_time() - began, int(stats["generation_tokens_total"])))
            await trio.sleep(SAMPLE_EVERY)

    await bench.settle()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample, trio.current_time())
        figures = await bench.phase(config, index)
        nursery.cancel_scope.cancel()
    return figures, series


async def measure(config: Config, procs: capacity.Stack, ns: argparse.Namespace) -> Run:
    async with httpx.AsyncClient(timeout=capacity.TIMEOUT) as control:
        bench = Bench(procs, ns.clients, ns.warmup, ns.phase_seconds, control)
        await bench.first_run()
        figures, series = [], []
        for index in range(len(PHASES)):
            f, s = await sampled_phase(bench, config, index)
            print(capacity.row(f))
            figures.append(f)
            series.append(s)
        return Run(config.name, figures, series)


def verdicts(shape: engine_zoo.Shape, runs: Sequence[Run]) -> list[str]:
    """A line per learner and phase (module docstring)."""
    lines = [str(shape)]
    statics = [r for r in runs if r.config.startswith("static-")]
    for run in runs:
        if run.config.startswith("static-"):
            continue
        for i, f in enumerate(run.figures):
            best = max(statics, key=lambda r: r.figures[i].tokens_s).figures[i]
            ratio = f.tokens_s / best.tokens_s if best.tokens_s else math.nan
            queued = capacity.number(f.engine, "mean_queued")
            took = run.reached(i, TARGET * best.tokens_s)
            ok = ratio >= TARGET and queued <= 1.0 and (i != 2 or took <= 3.0)
            lines.append(
                f"  {run.config:<13} {f.phase:<6} {f.tokens_s:8.1f} tok/s {ratio:5.2f}x of "
                f"{best.config:<10} queued {queued:5.2f} waiting {f.waiting:5.2f} "
                f"running {capacity.number(f.engine, 'mean_running'):5.1f} "
                f"reached {took:5.2f}s {'ok' if ok else 'MISS'}"
                + (f" ({len(f.failures)} failed)" if f.failures else "")
            )
    return lines


def main(ns: argparse.Namespace, names: Sequence[str]) -> int:
    """Every shape of ``names`` (all of the sample if empty), each configuration."""
    # capacity.py runs as __main__: the module imported here is another copy of it
    capacity.KEEP, capacity.NODE_LOG_LEVEL = ns.keep, ns.node_log
    capacity.machine_facts(sys.stdout)
    shapes = [engine_zoo.BY_NAME[n] for n in names] if names else list(engine_zoo.SAMPLE)
    print(
        f"engine zoo: {len(shapes)} engines, {ns.clients} clients, warm-up {ns.warmup:g}s, "
        f"window {ns.phase_seconds:g}s a phase\n"
    )
    report: list[str] = []
    try:
        for shape in shapes:
            print(f"{shape}; load average {load()}")
            runs = []
            for config in configs(shape, ns.clients):
                print(f" {config.name}: target {config.target}")
                try:
                    with stack(config, shape.engine_args()) as procs:
                        runs.append(trio.run(measure, config, procs, ns))
                except Refused as exc:
                    print(f"  skipped: the node refuses this configuration: {exc}")
            lines = verdicts(shape, runs)
            report += lines
            print("\n".join(lines), "\n")
        print("\nissue 30's targets: >= 0.85x the best static, <= 1.0 queued in the engine,")
        print("0.85x reached <= 3 s into the short phase after the long one")
        print("\n".join(report))
    finally:
        print(f"load average at end (1, 5, 15 min): {load()}")
    return 0


def shape_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in engine_zoo.BY_NAME]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"no engine {', '.join(unknown)}; there are {', '.join(engine_zoo.BY_NAME)}"
        )
    return names
