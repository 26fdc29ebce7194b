"""The ``gen_ai_*`` histograms (OpenTelemetry's GenAI metric names): what each observes,
when, with which labels and buckets; after runs through a real node (echo, and each
engine wire on a real HTTP server), and from events with set times."""

from __future__ import annotations

from pathlib import Path

import pytest

from iop_trio.metrics import (
    GENAI_DURATION_BUCKETS,
    GENAI_LABELS,
    GENAI_TOKEN_BUCKETS,
    GENAI_TPOT_BUCKETS,
    GENAI_TTFT_BUCKETS,
    METRICS,
    PROCESS_METRICS,
    NodeMetrics,
)
from iop_trio.model import TenantLimits
from iop_trio.runtime import EventKind, RunSpec, RunState, RunStatus, Usage

from .engines import WIRES, EngineServer, Wire, make_node, run_to_end, serve
from .test_metrics import (
    A,
    B,
    Samples,
    check_histogram,
    echo_node,
    ended,
    next_event,
    running,
    scripted_node,
    submit,
)

TTFT = "gen_ai_server_time_to_first_token_seconds"
TPOT = "gen_ai_server_time_per_output_token_seconds"
DURATION = "gen_ai_server_request_duration_seconds"
TOKENS = "gen_ai_client_token_usage"


def genai(target: str, tenant: str = "", *, provider: str = "echo") -> dict[str, str]:
    """The labels every gen_ai_* histogram has, for a run of ``target`` (adapter/model)."""
    model = target.partition("/")[2]
    return {
        "gen_ai_operation_name": "chat",
        "gen_ai_provider_name": provider,
        "gen_ai_request_model": model,
        "iop_target": target,
        "iop_tenant": tenant,
    }


def series_of(m: Samples, metric: str) -> set[frozenset[tuple[str, str]]]:
    """The label sets of a histogram's ``_count`` series."""
    return {labels for name, labels in m.values if name == f"{metric}_count"}


async def test_echo_runs_by_tenant_with_the_conventions_buckets():
    """Echo answers a word a word: 3 in, 3 out a run. A tenant not in the config is
    ``other``; the default tenant is its own ``""``. A run that failed after its first
    delta has a first token and a duration (error_type its reason) but no time per
    output token; its usage is settled (the completion counted by the node)."""
    node = echo_node()
    node.set_limits(tenants={"gold": TenantLimits()})
    async with running(node) as s:
        runs = [
            await submit(node, "echo/a", "one two three", tenant=tenant)
            for tenant in ("gold", "gold", "guest-17", "")
        ]
        failed = await submit(node, "echo/b", "x y", tenant="gold", options={"fail_after": 1})
        for run_id in runs:
            assert (await ended(node, run_id)).kind is EventKind.SUCCEEDED
        assert (await ended(node, failed)).kind is EventKind.FAILED
        m = await s.scrape()

    gold, other, default = genai("echo/a", "gold"), genai("echo/a", "other"), genai("echo/a")
    for labels, n in ((gold, 2), (other, 1), (default, 1)):
        assert m(f"{TTFT}_count", **labels) == n
        assert m(f"{TPOT}_count", **labels) == n
        assert m(f"{DURATION}_count", **labels, error_type="") == n
        assert m(f"{TOKENS}_count", **labels, gen_ai_token_type="input") == n
        assert m(f"{TOKENS}_sum", **labels, gen_ai_token_type="input") == 3 * n
        assert m(f"{TOKENS}_sum", **labels, gen_ai_token_type="output") == 3 * n
        assert m.buckets(TOKENS, **labels, gen_ai_token_type="output")[4] == n
        assert m.buckets(TOKENS, **labels, gen_ai_token_type="output")[1] == 0
    b = genai("echo/b", "gold")
    assert m(f"{TTFT}_count", **b) == 1
    assert m(f"{DURATION}_count", **b, error_type="engine_error") == 1
    assert m.get(f"{TPOT}_count", -1, **b) == -1
    # the engine reported nothing: the node's estimates (3 bytes of prompt, 1 delta)
    assert m(f"{TOKENS}_sum", **b, gen_ai_token_type="input") == 1
    assert m(f"{TOKENS}_sum", **b, gen_ai_token_type="output") == 1
    assert not any(("iop_tenant", "guest-17") in labels for _, labels in m.values)

    check_histogram(m, TTFT, GENAI_TTFT_BUCKETS, **gold)
    check_histogram(m, TPOT, GENAI_TPOT_BUCKETS, **gold)
    check_histogram(m, DURATION, GENAI_DURATION_BUCKETS, **gold, error_type="")
    check_histogram(m, TOKENS, GENAI_TOKEN_BUCKETS, **gold, gen_ai_token_type="input")
    # the iop_* series of the same runs are as they were
    assert m("iop_run_time_to_first_delta_seconds_count", target="echo/a") == 4
    assert m("iop_run_duration_seconds_count", target="echo/a", status="succeeded") == 4
    assert m("iop_tenant_tokens_total", tenant="other", kind="output") == 3


async def test_runs_that_never_started_have_no_genai_series():
    """Rejected (queue full, queue timeout) and cancelled-while-queued runs: no series;
    a run cancelled while running: a duration (error_type cancelled) and its settled
    usage, no first token (it had no delta) and no time per output token."""
    node, adapter = scripted_node(a_limit=1, max_queued=1, queue_timeout=0.2)
    async with running(node) as s:
        first = await submit(node, A)
        timed_out = await submit(node, A)
        full = await submit(node, A)
        assert (await ended(node, full)).reason == "queue_full"
        assert (await ended(node, timed_out)).reason == "queue_timeout"
        queued = await submit(node, A)
        await node.manager.cancel(queued)
        assert (await next_event(node, first, after_seq=1)).kind is EventKind.STARTED
        await node.manager.cancel(first, reason="user")
        m = await s.scrape()
    labels = genai(A, provider="scripted")
    assert series_of(m, DURATION) == {frozenset({**labels, "error_type": "cancelled"}.items())}
    assert m(f"{DURATION}_count", **labels, error_type="cancelled") == 1
    assert series_of(m, TTFT) == series_of(m, TPOT) == set()
    assert m(f"{TOKENS}_count", **labels, gen_ai_token_type="input") == 1
    assert m(f"{TOKENS}_sum", **labels, gen_ai_token_type="output") == 0
    assert m("iop_runs_finished_total", target=A, status="rejected") == 2
    assert adapter.open_streams == []


@pytest.mark.parametrize("wire", WIRES, ids=repr)
async def test_a_run_over_each_engine_wire(wire: Wire):
    """The provider is the adapter's kind, the model the one the engine is asked for, the
    tokens what the engine reported."""
    server: EngineServer
    async with serve() as server:
        server.push(wire.reply(["Hel", "lo"], usage=Usage("stop", 4, 2)))
        async with (
            wire.adapter(server.url) as engine_adapter,
            running(make_node(engine_adapter, model=wire.model)) as s,
        ):
            target = next(iter(s.metrics.node.targets))
            record, _events = await run_to_end(s.metrics.node, RunSpec(target, "Say hi"))
            m = await s.scrape()
    assert record.status is RunStatus.SUCCEEDED
    labels = genai(target, provider=engine_adapter.kind)
    assert labels["gen_ai_request_model"] == wire.model
    assert m(f"{TTFT}_count", **labels) == 1
    assert m(f"{TPOT}_count", **labels) == 1
    assert m(f"{DURATION}_count", **labels, error_type="") == 1
    assert m(f"{TOKENS}_sum", **labels, gen_ai_token_type="input") == 4
    assert m(f"{TOKENS}_sum", **labels, gen_ai_token_type="output") == 2


def test_times_come_from_the_events_from_queued_on():
    """TTFT and duration count from QUEUED (the queue wait is in them, unlike the iop_*
    ones, which count from STARTED); TPOT is (end - first delta) / (output - 1)."""
    node, _ = scripted_node()
    metrics = NodeMetrics(node)
    state, queued = RunState.create(run_id="r1", target=A, background=False, time=100.0)
    for event in (
        queued,
        state.transition(RunStatus.RUNNING, time=102.5),
        state.delta("a", time=103.25),
        state.delta("b", time=103.5),
        state.transition(RunStatus.SUCCEEDED, time=104.25, usage=Usage("stop", 7, 11)),
    ):
        metrics.on_event(event, state.record)
    # one output token: no time per output token; a clock that stepped back: clamped at 0
    one, q2 = RunState.create(run_id="r2", target=B, background=False, time=50.0)
    for event in (
        q2,
        one.transition(RunStatus.RUNNING, time=49.0),
        one.delta("x", time=48.0),
        one.transition(RunStatus.SUCCEEDED, time=47.0, usage=Usage("stop", 1, 1)),
    ):
        metrics.on_event(event, one.record)

    m = Samples.parse(metrics.render().decode())
    a, b = genai(A, provider="scripted"), genai(B, provider="scripted")
    assert m(f"{TTFT}_sum", **a) == 3.25
    assert m.buckets(TTFT, **a)[5.0] == 1 and m.buckets(TTFT, **a)[2.5] == 0
    assert m(f"{DURATION}_sum", **a, error_type="") == 4.25
    assert m.buckets(DURATION, **a, error_type="")[5.12] == 1
    assert m.buckets(DURATION, **a, error_type="")[2.56] == 0
    assert m(f"{TPOT}_sum", **a) == 0.1  # 1.0 s after the first delta, 10 more tokens
    assert m.buckets(TPOT, **a)[0.1] == 1 and m.buckets(TPOT, **a)[0.075] == 0
    assert m(f"{TOKENS}_sum", **a, gen_ai_token_type="input") == 7
    assert m(f"{TOKENS}_sum", **a, gen_ai_token_type="output") == 11
    assert m.buckets(TOKENS, **a, gen_ai_token_type="output")[16] == 1
    assert m.buckets(TOKENS, **a, gen_ai_token_type="output")[4] == 0
    assert m(f"{TTFT}_sum", **b) == 0.0
    assert m(f"{DURATION}_sum", **b, error_type="") == 0.0
    assert m.get(f"{TPOT}_count", -1, **b) == -1
    assert metrics.tracked_runs == 0


def test_runs_it_never_saw_queued_and_targets_it_does_not_have():
    """Attached late: the usage is observed (from the record's target), the times are not.
    A run of a target the node does not have (from the store) has provider unknown."""
    node, _ = scripted_node()
    metrics = NodeMetrics(node)
    late, _ = RunState.create(run_id="late", target=A, background=False, time=1.0)
    gone, gone_queued = RunState.create(
        run_id="gone", target="old/m@fast", background=False, time=1.0, tenant="guest"
    )
    metrics.on_event(gone_queued, gone.record)
    for state in (late, gone):
        for event in (
            state.transition(RunStatus.RUNNING, time=2.0),
            state.delta("x y", time=3.0, tokens=2),
            state.transition(
                RunStatus.INTERRUPTED, time=4.0, reason="node_restart", usage=Usage("", 5, 2)
            ),
        ):
            metrics.on_event(event, state.record)
    m = Samples.parse(metrics.render().decode())
    a = genai(A, provider="scripted")
    assert m(f"{TOKENS}_sum", **a, gen_ai_token_type="input") == 5
    assert m.get(f"{DURATION}_count", -1, **a, error_type="interrupted") == -1
    assert m.get(f"{TTFT}_count", -1, **a) == -1
    old = {**genai("old/m", "other", provider="unknown"), "iop_target": "old/m@fast"}
    assert m(f"{TOKENS}_sum", **old, gen_ai_token_type="output") == 2
    assert m(f"{DURATION}_count", **old, error_type="interrupted") == 1
    assert m(f"{TTFT}_sum", **old) == 2.0


def test_the_table_names_the_conventions_metrics_and_operations_md_lists_every_metric():
    by_name = {m.name: m for m in METRICS}
    assert by_name[TTFT].labels == by_name[TPOT].labels == GENAI_LABELS
    assert by_name[DURATION].labels == (*GENAI_LABELS, "error_type")
    assert by_name[TOKENS].labels == (*GENAI_LABELS, "gen_ai_token_type")
    operations = (Path(__file__).parents[1] / "docs" / "operations.md").read_text()
    missing = [m.name for m in (*METRICS, *PROCESS_METRICS) if f"| `{m.name}` |" not in operations]
    assert missing == []
