"""Who waits when one tenant floods the node: the gate with and without tenants.

    python benchmarks/fairness.py [--heavy N]

A node (in-process: Node + MemoryStore + echo adapter) serves one target at
concurrency 2, each run taking 0.1 s, so 20 runs a second. At t=0 a heavy
caller submits ``--heavy`` runs at once; a light caller then submits one run
every 0.25 s for 30 s (4 a second). Time is Trio's MockClock (it jumps when
every task waits), so the waits are exact and the same on every machine;
"cpu s" is the wall time the whole scenario took, i.e. the gate's and the
runtime's work. Each scenario runs twice in one process:

- ``one tenant``: both callers are the default tenant (the gate before
  tenants: FIFO), the baseline;
- ``tenants``: the callers are tenants ``heavy`` and ``light`` (weight 1
  each), so they take turns.

Then both callers flooding at once, at weights 1:1 and 1:3; the flood
against a node-wide ``max_queued`` below it, with and without a
``max_queued`` for the heavy tenant; and a flood of priority 0 with a stream
of priority 5 runs. Waits are from QUEUED to STARTED, in
seconds; rejections are counted with their retry hints. Last, the bare
gate's cost per grant with 1 to 1,000 tenants backlogged at one target
(wall clock, beside the 1-tenant figure); and early rejection under a
Poisson overload, off and on, with how many of the runs it turned away at
once did start when it was off (its error rate).
"""

from __future__ import annotations

import argparse
import bisect
import random
import statistics
import sys
import time
from collections.abc import Mapping

import attrs
import trio
import trio.testing

from iop_trio.adapters.echo import EchoAdapter
from iop_trio.runtime import (
    EventKind,
    Gate,
    Node,
    RunEvent,
    RunRecord,
    RunSpec,
    RuntimeLimits,
    TargetSpec,
    TenantLimits,
)
from iop_trio.store.memory import MemoryStore

TARGET = "echo/m"
RUN_SECONDS = 0.1
LIGHT_EVERY = 0.25
LIGHT_FOR = 30.0


@attrs.define
class Caller:
    """What one caller saw: its runs' queue waits and rejections."""

    waits: list[float] = attrs.field(factory=list)
    rejected: int = 0
    retry_after: list[float] = attrs.field(factory=list)

    def row(self, name: str) -> str:
        waits = sorted(self.waits)
        if waits:
            p50 = statistics.median(waits)
            p99 = waits[min(len(waits) - 1, int(len(waits) * 0.99))]
            spread = f"{p50:>8.2f} {p99:>8.2f} {waits[-1]:>8.2f}"
        else:
            spread = f"{'-':>8} {'-':>8} {'-':>8}"
        hint = f"{statistics.median(self.retry_after):.1f}" if self.retry_after else "-"
        return f"{name:<7} {len(self.waits):>7} {spread} {self.rejected:>8} {hint:>7}"


async def scenario(
    *,
    heavy: int,
    heavy_spec: Mapping[str, object],
    light_spec: Mapping[str, object],
    max_queued: int = 100_000,
    tenants: Mapping[str, TenantLimits] | None = None,
    light_burst: int = 0,
) -> tuple[dict[str, Caller], float]:
    node = Node(
        node_id="bench",
        adapters=[EchoAdapter()],
        targets=[TargetSpec("echo", "m", concurrency=2, params={"delay": RUN_SECONDS})],
        limits=RuntimeLimits(
            concurrency=2, max_queued=max_queued, queue_timeout=3600, tenants=tenants or {}
        ),
        store=MemoryStore(),
    )
    callers = {"heavy": Caller(), "light": Caller()}
    who: dict[str, str] = {}
    queued_at: dict[str, float] = {}

    def listen(event: RunEvent, record: RunRecord) -> None:
        caller = callers[who[record.prompt]]
        if event.kind is EventKind.QUEUED:
            queued_at[event.run_id] = trio.current_time()
        elif event.kind is EventKind.STARTED:
            caller.waits.append(trio.current_time() - queued_at.pop(event.run_id))
        elif event.kind is EventKind.REJECTED:
            caller.rejected += 1
            if event.retry_after is not None:
                caller.retry_after.append(event.retry_after)

    node.event_listeners.append(listen)
    started = time.perf_counter()
    async with node.running():
        manager = node.manager
        for i in range(heavy):
            who[f"h{i}"] = "heavy"
            await manager.submit(RunSpec(TARGET, f"h{i}", **heavy_spec))  # type: ignore[arg-type]
        for i in range(light_burst or int(LIGHT_FOR / LIGHT_EVERY)):
            who[f"l{i}"] = "light"
            await manager.submit(RunSpec(TARGET, f"l{i}", **light_spec))  # type: ignore[arg-type]
            if not light_burst:
                await trio.sleep(LIGHT_EVERY)
        await manager.wait_idle()
    return callers, time.perf_counter() - started


def show(
    title: str,
    baseline: tuple[dict[str, Caller], float],
    *others: tuple[str, tuple[dict[str, Caller], float]],
) -> None:
    print(f"\n{title}")
    print(
        f"{'':<24} {'caller':<7} {'started':>7} {'p50 s':>8} {'p99 s':>8} {'max s':>8} "
        f"{'rejected':>8} {'retry':>7}   cpu s"
    )
    for label, (callers, cpu) in [("one tenant (baseline)", baseline), *others]:
        for name, caller in callers.items():
            print(f"{label:<24} {caller.row(name)}   {cpu:5.2f}")
            label = ""


async def grant_cost(tenants: int, runs: int) -> float:
    """Microseconds per grant of the bare gate, ``runs`` waiting at one target (limit 1),
    spread over ``tenants`` tenants: a grant looks at every backlogged tenant there."""
    gate = Gate(concurrency=1, max_queued=runs + 1, queue_timeout=3600)
    gate.add_adapter("echo", None)
    gate.add_target(TARGET, adapter="echo", limit=1)
    done = 0

    async def one(i: int) -> None:
        nonlocal done
        with await gate.acquire(i, TARGET, tenant=f"t{i % tenants}"):
            await trio.lowlevel.checkpoint()
        done += 1

    async with trio.open_nursery() as nursery:
        hold = await gate.acquire("hold", TARGET)
        for i in range(runs):
            nursery.start_soon(one, i)
        await trio.testing.wait_all_tasks_blocked()
        start = time.perf_counter()
        hold.release()
    elapsed = time.perf_counter() - start
    assert done == runs
    return elapsed / runs * 1e6


def tenants_specs(tenants: Mapping[str, Mapping[str, object]]) -> dict[str, object]:
    return {"heavy_spec": tenants["heavy"], "light_spec": tenants["light"]}


def run(heavy: int) -> None:
    def go(**kw: object) -> tuple[dict[str, Caller], float]:
        async def main() -> tuple[dict[str, Caller], float]:
            return await scenario(heavy=heavy, **kw)  # type: ignore[arg-type]

        return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))

    print(
        f"python {sys.version.split()[0]}, trio {trio.__version__}; one target, concurrency 2, "
        f"{RUN_SECONDS} s a run; heavy: {heavy} runs at t=0; light: one run every "
        f"{LIGHT_EVERY} s for {LIGHT_FOR:g} s"
    )
    show(
        "1. fair queueing",
        go(heavy_spec={}, light_spec={}),
        ("tenants, weight 1:1", go(heavy_spec={"tenant": "heavy"}, light_spec={"tenant": "light"})),
    )
    both = heavy // 2
    tenants = {"heavy": {"tenant": "heavy"}, "light": {"tenant": "light"}}
    show(
        f"2. weights: both flood, {heavy} and {both} runs at t=0",
        go(heavy_spec={}, light_spec={}, light_burst=both),
        ("tenants, weight 1:1", go(**tenants_specs(tenants), light_burst=both)),
        (
            "tenants, weight 1:3",
            go(
                **tenants_specs(tenants),
                light_burst=both,
                tenants={"light": TenantLimits(weight=3)},
            ),
        ),
    )
    bound = heavy // 2
    show(
        f"3. queue bounds: node max_queued {bound}",
        go(heavy_spec={}, light_spec={}, max_queued=bound),
        (
            f"heavy max_queued {bound - 20}",
            go(
                heavy_spec={"tenant": "heavy"},
                light_spec={"tenant": "light"},
                max_queued=bound,
                tenants={"heavy": TenantLimits(max_queued=bound - 20)},
            ),
        ),
    )
    show(
        "4. priority: the light caller's runs at priority 5",
        go(heavy_spec={}, light_spec={}),
        ("priority 5", go(heavy_spec={}, light_spec={"priority": 5})),
    )


@attrs.define
class Overload:
    """What happened to each run (by index) under an overload of one target."""

    fate: dict[int, str] = attrs.field(factory=dict)  # started / early / late
    estimate: dict[int, float] = attrs.field(factory=dict)  # at arrival, if it queued
    wait: dict[int, float] = attrs.field(factory=dict)  # of the runs that started

    def count(self, fate: str) -> int:
        return sum(1 for f in self.fate.values() if f == fate)


async def overload(
    *, early: bool, arrivals: list[tuple[float, float]], deadline: float
) -> Overload:
    """Runs arriving at (gap, run seconds) ``arrivals``, each waiting at most ``deadline``:
    started, rejected at once ("early") or rejected after waiting its deadline ("late");
    and the gate's own wait estimate at each arrival that found the target full."""
    node = Node(
        node_id="bench",
        adapters=[EchoAdapter()],
        targets=[TargetSpec("echo", "m", concurrency=2)],
        limits=RuntimeLimits(
            concurrency=2, max_queued=100_000, queue_timeout=3600, early_reject=early
        ),
        store=MemoryStore(),
    )
    seen = Overload()
    queued_at: dict[str, float] = {}

    def listen(event: RunEvent, record: RunRecord) -> None:
        i = int(record.prompt[1:])
        if event.kind is EventKind.QUEUED:
            queued_at[event.run_id] = trio.current_time()
        elif event.kind is EventKind.STARTED:
            seen.fate[i] = "started"
            seen.wait[i] = trio.current_time() - queued_at[event.run_id]
        elif event.kind is EventKind.REJECTED:
            waited = trio.current_time() - queued_at[event.run_id]
            seen.fate[i] = "late" if waited >= deadline - 1e-6 else "early"

    node.event_listeners.append(listen)
    lane = node.gate._lane(TARGET)  # the gate's own estimate, read as the gate would
    async with node.running():
        for i, (gap, seconds) in enumerate(arrivals):
            await trio.sleep(gap)
            if lane.waiting:  # the target is full: a new run would queue
                estimate = lane.estimated_wait(0, node.gate._tenant(""))
                if estimate is not None:
                    seen.estimate[i] = estimate
            spec = RunSpec(TARGET, f"r{i}", queue_timeout=deadline, options={"delay": seconds})
            await node.manager.submit(spec)
        await node.manager.wait_idle()
    return seen


def early_rejection(load: float, seconds: float, deadline: float) -> None:
    rng = random.Random(9)
    rate = 20 * load  # the target serves 20 runs a second (2 at a time, 0.1 s mean)
    arrivals = [
        (rng.expovariate(rate), rng.uniform(0.05, 0.15)) for _ in range(int(rate * seconds))
    ]

    def go(early: bool) -> Overload:
        async def main() -> Overload:
            return await overload(early=early, arrivals=arrivals, deadline=deadline)

        return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))

    off, on = go(False), go(True)
    print(
        f"\n6. early rejection: Poisson arrivals at {load:g}x what the target serves "
        f"(0.05-0.15 s a run), {len(arrivals):,} runs, each willing to wait {deadline:g} s"
    )
    print(
        f"{'':<20} {'started':>8} {'rejected':>9} {'at once':>8} {'after wait':>11} "
        f"{'s waited in vain':>17}"
    )
    for label, seen in (("off (baseline)", off), ("early_reject: true", on)):
        print(
            f"{label:<20} {seen.count('started'):>8,} "
            f"{seen.count('early') + seen.count('late'):>9,} {seen.count('early'):>8,} "
            f"{seen.count('late'):>11,} {seen.count('late') * deadline:>17,.0f}"
        )
    # how good the estimate is where it decides: runs admitted with it below the deadline
    ratios = sorted(
        on.wait[i] / on.estimate[i] for i in on.wait if on.estimate.get(i, 0) > deadline / 2
    )
    admitted = [i for i, e in on.estimate.items() if e <= deadline]
    missed = sum(1 for i in admitted if on.fate[i] == "late")
    lost = off.count("started") - on.count("started")
    # each run turned away would have made it with the chance that a run admitted on a
    # similar estimate waited less than it did: deadline / estimate of the ratio
    refused = [on.estimate[i] for i, f in on.fate.items() if f == "early"]
    wrong = sum(bisect.bisect_left(ratios, deadline / e) / len(ratios) for e in refused)
    print(
        f"of the {len(refused)} runs turned away at once, about {wrong:.0f} "
        f"({wrong / max(1, len(refused)):.0%}) would have started in time had they waited "
        f"(from how far actual waits stray from the estimate)"
    )
    print(
        f"with the switch on: of {len(admitted):,} runs admitted on an estimate within the "
        f"deadline, {missed} still waited in vain ({missed / max(1, len(admitted)):.1%}); "
        f"actual / estimated wait near the deadline: p10 {ratios[len(ratios) // 10]:.2f}, "
        f"p50 {ratios[len(ratios) // 2]:.2f}, p90 {ratios[len(ratios) * 9 // 10]:.2f}; "
        f"runs started: {lost:+d} off vs on ({lost / max(1, off.count('started')):.2%})"
    )


def costs(runs: int) -> None:
    print(f"\n5. the bare gate: {runs:,} runs waiting at one target, granted one by one")
    print(f"{'tenants':>8} {'us/grant':>9} {'x 1 tenant':>11}")
    base = 0.0
    trio.run(grant_cost, 1, runs // 4)  # warm up
    for tenants in (1, 10, 100, 1000):
        cost = trio.run(grant_cost, tenants, runs)
        base = base or cost
        print(f"{tenants:>8} {cost:>9.1f} {cost / base:>11.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--heavy", type=int, default=600)
    parser.add_argument("--grants", type=int, default=20_000)
    ns = parser.parse_args()
    run(ns.heavy)
    costs(ns.grants)
    early_rejection(load=1.3, seconds=60, deadline=2.0)
