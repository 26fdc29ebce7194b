"""Node metrics scraped over real HTTP on loopback (real clock; every wait is bounded)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import attrs
import httpx
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from iop_trio.adapters.echo import EchoAdapter
from iop_trio.metrics import (
    CONTENT_TYPE,
    FIRST_DELTA_BUCKETS,
    METRICS,
    PROCESS_METRICS,
    QUEUE_WAIT_BUCKETS,
    RUN_DURATION_BUCKETS,
    NodeMetrics,
)
from iop_trio.model import TenantLimits
from iop_trio.ops import OpsApp, serve_ops
from iop_trio.runtime import (
    AdapterSlot,
    EventKind,
    Node,
    RunEvent,
    RunSpec,
    RunState,
    RunStatus,
    RuntimeLimits,
    TargetSpec,
    Usage,
)
from iop_trio.store.memory import MemoryStore

from .support import ScriptedAdapter, logged

WAIT = 10.0  # the bound of any single wait in these tests
A = "scripted/a"
B = "scripted/b"


@attrs.frozen
class Samples:
    """One scrape: sample values by name and labels."""

    values: Mapping[tuple[str, frozenset[tuple[str, str]]], float]
    names: frozenset[str]

    @classmethod
    def parse(cls, text: str) -> Samples:
        values: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        names = set()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name, frozenset(sample.labels.items())] = sample.value
                names.add(sample.name)
        return cls(values, frozenset(names))

    def __call__(self, metric: str, /, **labels: str) -> float:
        return self.values[metric, frozenset(labels.items())]

    def get(self, metric: str, default: float, /, **labels: str) -> float:
        return self.values.get((metric, frozenset(labels.items())), default)

    def buckets(self, metric: str, /, **labels: str) -> dict[float, float]:
        """Cumulative counts of a histogram by upper bound (+Inf included)."""
        want = set(labels.items())
        found: dict[float, float] = {}
        for (sample, sample_labels), value in self.values.items():
            if sample == f"{metric}_bucket" and want <= set(sample_labels):
                rest = dict(sample_labels)
                if set(rest.items()) - want == {("le", rest["le"])}:
                    found[float(rest["le"])] = value
        return dict(sorted(found.items()))


@attrs.define
class Scraper:
    metrics: NodeMetrics
    client: httpx.AsyncClient

    async def scrape(self) -> Samples:
        with trio.fail_after(WAIT):
            response = await self.client.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"] == CONTENT_TYPE
        return Samples.parse(response.text)

    async def health(self) -> tuple[int, str]:
        """/readyz's status and the state of the first component that is not ready
        ("ok" if all are); /healthz must say alive meanwhile."""
        with trio.fail_after(WAIT):
            alive = await self.client.get("/healthz")
            response = await self.client.get("/readyz")
        assert (alive.status_code, alive.text) == (200, "alive\n")
        body = response.json()
        failing = [f"{n}: {c['state']}" for n, c in body["components"].items() if not c["ok"]]
        assert body["ready"] == (not failing)
        return response.status_code, (failing[0] if failing else "ok") + "\n"


@asynccontextmanager
async def serving_metrics(node: Node) -> AsyncIterator[Scraper]:
    """The node's metrics on a real HTTP server; the node is not started here."""
    metrics = NodeMetrics(node)
    async with trio.open_nursery() as nursery:
        with trio.fail_after(WAIT):
            port = await nursery.start(serve_ops, OpsApp(node, metrics), "127.0.0.1", 0)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            yield Scraper(metrics, client)
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def running(node: Node) -> AsyncIterator[Scraper]:
    """The node running, its metrics attached and served."""
    async with serving_metrics(node) as scraper, node.running():
        scraper.metrics.attach()
        yield scraper


def scripted_node(
    *, a_limit: int = 1, b_limit: int = 2, max_queued: int = 50, queue_timeout: float = 30.0
) -> tuple[Node, ScriptedAdapter]:
    adapter = ScriptedAdapter()
    node = Node(
        node_id="m1",
        adapters=[AdapterSlot(adapter)],
        targets=[
            TargetSpec("scripted", "a", concurrency=a_limit),
            TargetSpec("scripted", "b", concurrency=b_limit),
        ],
        limits=RuntimeLimits(concurrency=8, max_queued=max_queued, queue_timeout=queue_timeout),
        store=MemoryStore(),
    )
    return node, adapter


def echo_node(**limits: object) -> Node:
    return Node(
        node_id="e1",
        adapters=[EchoAdapter()],
        targets=[TargetSpec("echo", "a", concurrency=2), TargetSpec("echo", "b", concurrency=1)],
        limits=RuntimeLimits(**limits),  # type: ignore[arg-type],
        store=MemoryStore(),
    )


async def submit(node: Node, target: str, prompt: str = "p", **kw: object) -> str:
    spec = RunSpec(target, prompt, **kw)  # type: ignore[arg-type]
    with trio.fail_after(WAIT):
        submitted = await node.manager.submit(spec)
        await trio.testing.wait_all_tasks_blocked()
    return submitted.record.run_id


async def ended(node: Node, run_id: str) -> RunEvent:
    """Wait for the run's terminal event and return it."""
    with trio.fail_after(WAIT):
        async for event in node.manager.watch(run_id):
            last = event
    assert last.kind.terminal
    return last


async def next_event(node: Node, run_id: str, after_seq: int) -> RunEvent:
    with trio.fail_after(WAIT):
        async for event in node.manager.watch(run_id, after_seq=after_seq):
            return event
    raise AssertionError(f"run {run_id} has no event after {after_seq}")


def check_histogram(samples: Samples, name: str, bounds: tuple[float, ...], **labels: str) -> None:
    """The buckets are the documented ones, cumulative, and +Inf equals the count."""
    buckets = samples.buckets(name, **labels)
    assert list(buckets) == [*bounds, float("inf")]
    counts = list(buckets.values())
    assert counts == sorted(counts)
    assert counts[-1] == samples(f"{name}_count", **labels)


# --- events -> counters and histograms ----------------------------------------------------


async def test_counters_and_histograms_of_echo_runs():
    node = echo_node()
    async with running(node) as s:
        ok = [await submit(node, "echo/a", "one two three") for _ in range(5)]
        failed = [await submit(node, "echo/b", "x y", options={"fail_after": 1}) for _ in range(2)]
        for run_id in ok:
            assert (await ended(node, run_id)).kind is EventKind.SUCCEEDED
        for run_id in failed:
            assert (await ended(node, run_id)).kind is EventKind.FAILED
        m = await s.scrape()

    assert m("iop_runs_submitted_total", target="echo/a") == 5
    assert m("iop_runs_submitted_total", target="echo/b") == 2
    assert m("iop_runs_finished_total", target="echo/a", status="succeeded") == 5
    assert m("iop_runs_finished_total", target="echo/b", status="failed") == 2
    assert m("iop_runs_failed_total", target="echo/b", reason="engine_error") == 2
    assert m("iop_runs_finished_total", target="echo/b", status="succeeded") == 0
    assert m("iop_runs_rejected_total", target="echo/a", reason="queue_full") == 0
    # one a delta event: what came while a run was busy is joined, so up to one a word
    stored = {"echo/a": 0, "echo/b": 0}
    for target, runs in (("echo/a", ok), ("echo/b", failed)):
        for run_id in runs:
            events = await node.store.events(run_id)
            stored[target] += sum(1 for e in events if e.kind is EventKind.DELTA)
    assert 5 <= stored["echo/a"] <= 15 and stored["echo/b"] == 2
    assert m("iop_run_deltas_total", target="echo/a") == stored["echo/a"]
    assert m("iop_run_deltas_total", target="echo/b") == 2
    assert m("iop_run_tokens_total", target="echo/a", kind="prompt") == 15
    assert m("iop_run_tokens_total", target="echo/a", kind="completion") == 15
    assert m.get("iop_run_tokens_total", -1, target="echo/b", kind="prompt") == -1  # failed

    assert m("iop_run_duration_seconds_count", target="echo/a", status="succeeded") == 5
    assert m("iop_run_duration_seconds_count", target="echo/b", status="failed") == 2
    assert m("iop_run_queue_wait_seconds_count", target="echo/a", outcome="started") == 5
    assert m("iop_run_queue_wait_seconds_count", target="echo/b", outcome="started") == 2
    assert m("iop_run_time_to_first_delta_seconds_count", target="echo/a") == 5
    assert m("iop_run_time_to_first_delta_seconds_count", target="echo/b") == 2
    check_histogram(
        m, "iop_run_duration_seconds", RUN_DURATION_BUCKETS, target="echo/a", status="succeeded"
    )
    check_histogram(
        m, "iop_run_queue_wait_seconds", QUEUE_WAIT_BUCKETS, target="echo/a", outcome="started"
    )
    check_histogram(m, "iop_run_time_to_first_delta_seconds", FIRST_DELTA_BUCKETS, target="echo/a")
    assert s.metrics.tracked_runs == 0


async def test_rejections_by_reason_and_queue_wait_by_outcome():
    timeout = 0.3
    node, adapter = scripted_node(a_limit=1, max_queued=1, queue_timeout=timeout)
    async with running(node) as s:
        first = await submit(node, A)  # runs
        timed_out = await submit(node, A)  # waits, then times out
        full = await submit(node, A)  # the queue (1) is full
        assert (await ended(node, full)).reason == "queue_full"
        assert (await ended(node, timed_out)).reason == "queue_timeout"
        cancelled = await submit(node, A)  # waits, then its caller gives up
        await node.manager.cancel(cancelled)
        adapter.script(first).delta("hi")
        adapter.script(first).finish()
        assert (await ended(node, first)).kind is EventKind.SUCCEEDED
        m = await s.scrape()

    assert m("iop_runs_submitted_total", target=A) == 4
    assert m("iop_runs_rejected_total", target=A, reason="queue_full") == 1
    assert m("iop_runs_rejected_total", target=A, reason="queue_timeout") == 1
    assert m("iop_runs_rejected_total", target=B, reason="queue_full") == 0
    assert m("iop_runs_finished_total", target=A, status="rejected") == 2
    assert m("iop_runs_finished_total", target=A, status="cancelled") == 1
    assert m("iop_runs_finished_total", target=A, status="succeeded") == 1

    wait = "iop_run_queue_wait_seconds"
    assert m(f"{wait}_count", target=A, outcome="started") == 1
    assert m(f"{wait}_count", target=A, outcome="rejected") == 2
    assert m(f"{wait}_count", target=A, outcome="cancelled") == 1
    # the timed-out run waited its timeout (event times: the wall clock)
    assert timeout * 0.8 <= m(f"{wait}_sum", target=A, outcome="rejected") < WAIT
    # only the run that started has a duration; runs that never started have none
    assert m("iop_run_duration_seconds_count", target=A, status="succeeded") == 1
    assert m.get("iop_run_duration_seconds_count", -1, target=A, status="rejected") == -1
    assert m.get("iop_run_duration_seconds_count", -1, target=A, status="cancelled") == -1
    assert m("iop_run_time_to_first_delta_seconds_count", target=A) == 1
    assert s.metrics.tracked_runs == 0


async def test_a_run_cancelled_while_running_has_a_duration_but_no_first_delta():
    node, adapter = scripted_node()
    async with running(node) as s:
        run_id = await submit(node, A)
        assert (await next_event(node, run_id, after_seq=1)).kind is EventKind.STARTED
        await node.manager.cancel(run_id, reason="user")
        m = await s.scrape()
    assert m("iop_runs_finished_total", target=A, status="cancelled") == 1
    assert m("iop_run_duration_seconds_count", target=A, status="cancelled") == 1
    assert m("iop_run_queue_wait_seconds_count", target=A, outcome="started") == 1
    assert m.get("iop_run_time_to_first_delta_seconds_count", -1, target=A) == -1
    assert adapter.open_streams == []


def test_durations_come_from_event_times_and_land_in_the_right_buckets():
    node, _ = scripted_node()
    metrics = NodeMetrics(node)
    state, queued = RunState.create(run_id="r1", target=A, background=False, time=100.0)
    events = [
        queued,
        state.transition(RunStatus.RUNNING, time=102.5),  # waited 2.5 s
        state.delta("a", time=103.25),  # first delta after 0.75 s
        state.delta("b", time=110.0),
        state.transition(RunStatus.SUCCEEDED, time=160.0, usage=Usage("stop", 7, 11)),  # ran 57.5 s
    ]
    for event in events:
        metrics.on_event(event, state.record)
        assert metrics.tracked_runs == (0 if event.kind.terminal else 1)

    rejected, q2 = RunState.create(run_id="r2", target=B, background=True, time=0.0)
    metrics.on_event(q2, rejected.record)
    end = rejected.transition(RunStatus.REJECTED, time=30.0, reason="queue_timeout")
    metrics.on_event(end, rejected.record)

    # the wall clock stepped back between QUEUED and STARTED: clamped at 0
    stepped, q3 = RunState.create(run_id="r3", target=B, background=False, time=50.0)
    metrics.on_event(q3, stepped.record)
    metrics.on_event(stepped.transition(RunStatus.RUNNING, time=49.0), stepped.record)

    m = Samples.parse(metrics.render().decode())
    wait = "iop_run_queue_wait_seconds"
    assert m(f"{wait}_sum", target=A, outcome="started") == 2.5
    assert m.buckets(wait, target=A, outcome="started")[2.5] == 1
    assert m.buckets(wait, target=A, outcome="started")[1.0] == 0
    assert m(f"{wait}_sum", target=B, outcome="rejected") == 30.0
    assert m(f"{wait}_sum", target=B, outcome="started") == 0.0
    assert m("iop_run_time_to_first_delta_seconds_sum", target=A) == 0.75
    assert m.buckets("iop_run_time_to_first_delta_seconds", target=A)[0.75] == 1
    assert m.buckets("iop_run_time_to_first_delta_seconds", target=A)[0.5] == 0
    assert m("iop_run_duration_seconds_sum", target=A, status="succeeded") == 57.5
    assert m.buckets("iop_run_duration_seconds", target=A, status="succeeded")[30] == 0
    assert m.buckets("iop_run_duration_seconds", target=A, status="succeeded")[60] == 1
    assert m("iop_run_deltas_total", target=A) == 2
    assert m("iop_run_tokens_total", target=A, kind="prompt") == 7
    assert m("iop_run_tokens_total", target=A, kind="completion") == 11
    assert m("iop_runs_rejected_total", target=B, reason="queue_timeout") == 1
    assert metrics.tracked_runs == 1  # r3 is still running
    assert not any(name.endswith("_created") for name in m.names)


def test_events_of_runs_it_never_saw_queued_count_without_durations():
    node, _ = scripted_node()
    metrics = NodeMetrics(node)
    state, _queued = RunState.create(run_id="late", target=A, background=False, time=1.0)
    started = state.transition(RunStatus.RUNNING, time=2.0)
    delta = state.delta("x", time=3.0)
    done = state.transition(RunStatus.SUCCEEDED, time=4.0)
    for event in (started, delta, done):  # attached after the run was queued
        metrics.on_event(event, state.record)
    m = Samples.parse(metrics.render().decode())
    assert m("iop_runs_finished_total", target=A, status="succeeded") == 1
    assert m("iop_run_deltas_total", target=A) == 1
    assert m("iop_runs_submitted_total", target=A) == 0
    assert m.get("iop_run_duration_seconds_count", -1, target=A, status="succeeded") == -1
    assert metrics.tracked_runs == 0


def test_tracked_state_is_bounded():
    node, _ = scripted_node()
    metrics = NodeMetrics(node, max_tracked_runs=3)
    with logged("iop_trio.metrics") as records:
        for i in range(5):
            state, queued = RunState.create(run_id=f"r{i}", target=A, background=False, time=0)
            metrics.on_event(queued, state.record)
    assert metrics.tracked_runs == 3
    assert sum("more than 3 live runs" in r.getMessage() for r in records) == 2


async def test_per_run_state_is_empty_after_many_runs_of_every_ending():
    node = echo_node(concurrency=4, max_queued=10, queue_timeout=5.0)
    n = 200
    endings: dict[str, EventKind] = {}

    async def one(i: int) -> None:
        target = "echo/a" if i % 2 else "echo/b"
        kind = i % 4
        options: dict[str, object] = {}
        if kind == 1:
            options = {"fail_after": 1}
        elif kind == 2:
            options = {"delay": 60}
        submitted = await node.manager.submit(RunSpec(target, "w1 w2", options=options))
        run_id = submitted.record.run_id
        if kind == 2:
            await node.manager.cancel(run_id)
        endings[run_id] = (await ended(node, run_id)).kind

    async with running(node) as s:
        with trio.fail_after(WAIT * 3):
            for wave in range(0, n, 20):  # 20 at once: more than run (4) and queue (10)
                async with trio.open_nursery() as nursery:
                    for i in range(wave, wave + 20):
                        nursery.start_soon(one, i)
        m = await s.scrape()
        assert s.metrics.tracked_runs == 0

    kinds = set(endings.values())
    assert kinds == {
        EventKind.SUCCEEDED,
        EventKind.FAILED,
        EventKind.CANCELLED,
        EventKind.REJECTED,
    }
    finished = {
        (target, status): m("iop_runs_finished_total", target=target, status=status)
        for target in ("echo/a", "echo/b")
        for status in ("succeeded", "failed", "cancelled", "rejected")
    }
    assert sum(finished.values()) == n
    assert sum(m("iop_runs_submitted_total", target=t) for t in ("echo/a", "echo/b")) == n
    for status in ("succeeded", "failed", "cancelled", "rejected"):
        assert sum(v for (_, st), v in finished.items() if st == status) == sum(
            1 for k in endings.values() if k.value == status
        )
    rejected = sum(
        m("iop_runs_rejected_total", target=t, reason=r)
        for t in ("echo/a", "echo/b")
        for r in ("queue_full", "queue_timeout")
    )
    assert rejected == sum(1 for k in endings.values() if k is EventKind.REJECTED)


# --- gauges read from the gate at scrape time ---------------------------------------------


async def test_gauges_while_runs_are_queued_and_running():
    node, adapter = scripted_node(a_limit=1, b_limit=2)
    async with running(node) as s:
        a_runs = [await submit(node, A) for _ in range(3)]
        b_run = await submit(node, B)
        m = await s.scrape()
        assert m("iop_gate_queued_runs", target=A) == 2
        assert m("iop_gate_queued_runs", target=B) == 0
        assert m("iop_gate_running_runs", target=A) == 1
        assert m("iop_gate_running_runs", target=B) == 1
        assert m("iop_gate_queue_length") == 2
        assert m("iop_gate_queue_max") == 50
        assert m("iop_gate_queue_timeout_seconds") == 30
        assert m("iop_node_live_runs") == 4
        assert m("iop_node_admitting") == 1
        assert m("iop_node_info", node_id="m1", version=node.version) == 1
        borrowed = {
            (level, name): m("iop_gate_permits_in_use", level=level, name=name)
            for level, name in [
                ("global", "global"),
                ("adapter", "scripted"),
                ("target", A),
                ("target", B),
            ]
        }
        assert borrowed == {
            ("global", "global"): 2,
            ("adapter", "scripted"): 2,
            ("target", A): 1,
            ("target", B): 1,
        }
        assert m("iop_gate_permits_limit", level="global", name="global") == 8
        assert m("iop_gate_permits_limit", level="adapter", name="scripted") == float("inf")
        assert m("iop_gate_permits_limit", level="target", name=A) == 1
        assert m("iop_gate_permits_limit", level="target", name=B) == 2

        node.set_limits(concurrency=3, adapters={"scripted": 5}, targets={A: 2})
        await trio.testing.wait_all_tasks_blocked()  # the raised limit starts a queued run
        m = await s.scrape()
        assert m("iop_gate_permits_limit", level="global", name="global") == 3
        assert m("iop_gate_permits_limit", level="adapter", name="scripted") == 5
        assert m("iop_gate_permits_limit", level="target", name=A) == 2
        assert m("iop_gate_queued_runs", target=A) == 1
        assert m("iop_gate_running_runs", target=A) == 2

        for run_id in [*a_runs, b_run]:
            if run_id not in adapter.scripts:
                await next_event(node, run_id, after_seq=1)  # STARTED
            adapter.script(run_id).finish()
            await ended(node, run_id)
        m = await s.scrape()
        assert m("iop_gate_queued_runs", target=A) == 0
        assert m("iop_gate_running_runs", target=A) == 0
        assert m("iop_gate_permits_in_use", level="global", name="global") == 0
        assert m("iop_gate_queue_length") == 0
        assert m("iop_node_live_runs") == 0
        assert m("iop_runs_finished_total", target=A, status="succeeded") == 3
        assert s.metrics.tracked_runs == 0


async def test_per_tenant_series_name_set_tenants_and_lump_the_rest():
    node, adapter = scripted_node(a_limit=1)
    node.set_limits(tenants={"gold": TenantLimits(weight=2, concurrency=3)})
    async with running(node) as s:
        first = await submit(node, A, tenant="gold", priority=1)  # runs
        waiting = [
            await submit(node, A, tenant="gold"),
            await submit(node, A, tenant="guest-17", priority=-5),
            await submit(node, A),
        ]
        m = await s.scrape()
        assert m("iop_gate_tenant_running_runs", tenant="gold") == 1
        assert m("iop_gate_tenant_queued_runs", tenant="gold") == 1
        assert m("iop_gate_tenant_queued_runs", tenant="other") == 1  # guest-17: not set
        assert m("iop_gate_tenant_queued_runs", tenant="") == 1
        assert m("iop_gate_tenant_weight", tenant="gold") == 2
        assert m("iop_gate_permits_limit", level="tenant", name="gold") == 3
        assert m("iop_gate_permits_in_use", level="tenant", name="gold") == 1
        assert not any(labels and ("tenant", "guest-17") in labels for _, labels in m.values)
        assert m("iop_gate_priority_running_runs", priority="high") == 1
        assert m("iop_gate_priority_queued_runs", priority="normal") == 2
        assert m("iop_gate_priority_queued_runs", priority="low") == 1
        assert m("iop_gate_priority_queued_runs", priority="high") == 0
        for run_id in waiting:
            await node.manager.cancel(run_id)
        adapter.script(first).finish()
        await ended(node, first)
        m = await s.scrape()

    finished = "iop_tenant_runs_finished_total"
    assert m(finished, tenant="gold", priority="high", status="succeeded") == 1
    assert m(finished, tenant="gold", priority="normal", status="cancelled") == 1
    assert m(finished, tenant="other", priority="low", status="cancelled") == 1
    assert m(finished, tenant="", priority="normal", status="cancelled") == 1
    wait = "iop_tenant_queue_wait_seconds_count"
    assert m(wait, tenant="gold", priority="high", outcome="started") == 1
    assert m(wait, tenant="other", priority="low", outcome="cancelled") == 1
    assert m("iop_gate_tenant_queued_runs", tenant="other") == 0


async def test_healthz_follows_the_node_and_gauges_work_when_stopped():
    node, _ = scripted_node()
    async with serving_metrics(node) as s:
        assert await s.health() == (503, "node: stopped: the node is not running\n")
        m = await s.scrape()  # the gate is there before the node runs
        assert m("iop_node_admitting") == 0
        assert m("iop_gate_permits_limit", level="target", name=A) == 1
        async with node.running():
            assert await s.health() == (200, "ok\n")
            node.manager.stop_admitting()
            assert await s.health() == (503, "node: draining: the node admits no new runs\n")
            assert (await s.scrape())("iop_node_admitting") == 0
        assert await s.health() == (503, "node: stopped: the node is not running\n")
        with trio.fail_after(WAIT):
            wrong = await s.client.post("/metrics")
        assert wrong.status_code == 405


# --- attaching ------------------------------------------------------------------------------


async def test_attach_before_running_and_twice_counts_each_event_once():
    node, adapter = scripted_node()
    async with serving_metrics(node) as s:
        s.metrics.attach()
        s.metrics.attach()
        assert s.metrics.attached
        async with node.running():
            s.metrics.attach()  # running now: still once
            run_id = await submit(node, A)
            adapter.script(run_id).finish()
            await ended(node, run_id)
            assert (await s.scrape())("iop_runs_submitted_total", target=A) == 1
            s.metrics.detach()
            assert not s.metrics.attached
            other = await submit(node, A)
            adapter.script(other).finish()
            await ended(node, other)
            m = await s.scrape()
        assert m("iop_runs_submitted_total", target=A) == 1
        assert m("iop_runs_finished_total", target=A, status="succeeded") == 1
        assert node.event_listeners == []
    assert repr(s.metrics) == "<NodeMetrics node='m1' detached tracked_runs=0>"


class NodeWithoutEventListeners:
    """A node as it was before ``Node.event_listeners``."""

    def __init__(self, node: Node) -> None:
        self._node = node

    def __getattr__(self, name: str) -> object:
        if name == "event_listeners":
            raise AttributeError(name)
        return getattr(self._node, name)


async def test_attach_falls_back_to_the_running_manager():
    node, adapter = scripted_node()
    metrics = NodeMetrics(NodeWithoutEventListeners(node))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="not running"):
        metrics.attach()
    async with node.running():
        metrics.attach()
        run_id = await submit(node, A)
        adapter.script(run_id).finish()
        await ended(node, run_id)
        m = Samples.parse(metrics.render().decode())
    assert m("iop_runs_finished_total", target=A, status="succeeded") == 1


def test_the_metric_table_matches_what_is_exposed():
    node, _ = scripted_node()
    metrics = NodeMetrics(node)
    metrics.watch_link(attrs.make_class("Link", ["session", "sessions", "attempts"])(None, 0, 1))
    exposed = {
        family.name: family.type
        for family in text_string_to_metric_families(metrics.render().decode())
    }
    table = {m.name.removesuffix("_total"): m.type for m in (*METRICS, *PROCESS_METRICS)}
    assert exposed == table
    with pytest.raises(ValueError, match="Duplicated"):
        NodeMetrics(node, registry=metrics.registry)


async def test_tenant_tokens_count_every_settled_usage_with_the_tenant_label_bounded():
    """Each run that started adds its settled tokens to its tenant (input: the prompt,
    output: the completion), whatever ended it and whether the engine or the node counted
    them; a tenant whose share is not set counts as other, and a run that never started
    adds nothing. A run found running at start is counted as it is interrupted."""
    store = MemoryStore()
    left, first = RunState.create(
        run_id="left", target=A, background=True, time=1.0, prompt="abcdefgh", tenant="gold"
    )
    await store.create(left.record, first)
    await store.append(left.transition(RunStatus.RUNNING, time=2.0))
    await store.append(left.delta("x y z", time=3.0, tokens=3))
    adapter = ScriptedAdapter()
    node = Node(
        node_id="m1",
        adapters=[adapter],
        targets=[TargetSpec("scripted", "a", concurrency=2)],
        limits=RuntimeLimits(tenants={"gold": TenantLimits()}),
        store=store,
    )
    tokens = "iop_tenant_tokens_total"
    async with serving_metrics(node) as s:
        s.metrics.attach()  # before the node starts, as iop-node serve does
        async with node.running():
            m = await s.scrape()
            # interrupted as the node started: its stored deltas, its prompt estimated
            assert (
                m(tokens, tenant="gold", kind="input"),
                m(tokens, tenant="gold", kind="output"),
            ) == (2, 3)
            cancelled = await submit(node, A, "four byte word", tenant="gold")
            stranger = await submit(node, A, "p", tenant="guest-17")
            queued = await submit(node, A, "never started", tenant="gold")
            for run_id in (cancelled, stranger):
                adapter.script(run_id).delta("a")
                adapter.script(run_id).delta("b")
            await trio.testing.wait_all_tasks_blocked()
            await node.manager.cancel(queued)
            await node.manager.cancel(cancelled)
            adapter.script(stranger).finish()
            await ended(node, stranger)
        m = await s.scrape()
    assert m(tokens, tenant="gold", kind="input") == 2 + 4
    assert m(tokens, tenant="gold", kind="output") == 3 + 2
    assert m(tokens, tenant="other", kind="input") == 1
    assert m(tokens, tenant="other", kind="output") == 2
    assert not any(labels and ("tenant", "guest-17") in labels for _, labels in m.values)
    # the node's estimates are not what the engine reported
    assert m.get("iop_run_tokens_total", -1, target=A, kind="prompt") == -1
