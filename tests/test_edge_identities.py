"""Identities at the reference edge: a token per caller and per node (issue 10, findings 2
and 3). Real WebSockets on loopback; every wait is bounded."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
from trio_websocket import ConnectionRejected

from iop_trio.edge import Edge
from iop_trio.edge.identities import (
    CallerLimits,
    Identities,
    IdentityError,
    token_digest,
)
from iop_trio.model import TokenBucket
from iop_trio.protocol import pb
from iop_trio.runtime import Node, RunSpec
from iop_trio.transport import NodeLink, RemoteError, open_runner

from .test_wire import FAST, echo_node

IDENTITIES = {
    "callers": {
        "alice": {"token_sha256": token_digest("alice-token"), "max_priority": 5},
        "ops": {"token_sha256": token_digest("ops-token"), "may_set_limits": True},
        "bob": {
            "token_sha256": token_digest("bob-token"),
            "tenant": "team-b",
            "targets": ["echo/a"],
        },
    },
    "nodes": {
        "n1": {"token_sha256": token_digest("n1-token")},
        "n2": {"token_sha256": token_digest("n2-token")},
    },
}
WAIT = 20


@asynccontextmanager
async def edge_with_nodes(*nodes: tuple[Node, str]) -> AsyncIterator[Edge]:
    """An edge with IDENTITIES and ``nodes`` (each with its token) linked to it."""
    edge = Edge(token=None, identities=Identities.from_data(IDENTITIES))
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(edge.serve)
            async with trio.open_nursery() as links:
                for node, token in nodes:
                    await links.start(run_node, node, edge.node_url, token)
                for node, _ in nodes:
                    await edge.wait_for_node(node.node_id)
                yield edge
                links.cancel_scope.cancel()
            nursery.cancel_scope.cancel()


async def run_node(
    node: Node, url: str, token: str, task_status: trio.TaskStatus[NodeLink]
) -> None:
    async with node.running():
        link = NodeLink(node, url, token=token, backoff=FAST)
        task_status.started(link)
        await link.run()


def test_the_identities_file_is_checked():
    found = Identities.from_data(IDENTITIES)
    bob = found.caller("bob-token")
    assert bob is not None and (bob.name, bob.tenant, bob.max_priority) == ("bob", "team-b", 0)
    assert found.caller("n1-token") is None and found.node("n1-token") is not None
    assert found.caller("nobody") is None
    for data, match in [
        ({"callers": {"x": {"token_sha256": "plain-text"}}}, "must be sha256:"),
        ({"callers": {"x": {"token_sha256": token_digest("t"), "role": "admin"}}}, "role"),
        (
            {
                "callers": {"x": {"token_sha256": token_digest("t")}},
                "nodes": {"y": {"token_sha256": token_digest("t")}},
            },
            "the same token",
        ),
        ({"callers": {"bad name": {"token_sha256": token_digest("t")}}}, "a name is"),
        ({"users": {}}, "limits, callers and nodes"),
    ]:
        with pytest.raises(IdentityError, match=match):
            Identities.from_data(data)


async def test_a_token_for_one_node_cannot_pose_as_another():
    real = echo_node(("a", 1))  # node id n1
    async with edge_with_nodes((real, "n1-token")) as edge:
        first = edge.nodes["n1"].session
        impostor = echo_node(("a", 1))  # also says n1, with n2's token
        async with impostor.running():
            link = NodeLink(impostor, edge.node_url, token="n2-token", backoff=FAST)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(link.run)
                with trio.fail_after(WAIT):
                    await link.wait_attempts(1)
                nursery.cancel_scope.cancel()
        assert "this token is for node 'n2', not 'n1'" in link.last_error
        assert link.sessions == 0
        assert edge.nodes["n1"].session is first  # the real node was not replaced
        with pytest.raises(ConnectionRejected):  # a caller's token is no node's
            async with open_runner(edge.node_url, token="alice-token"):
                pass


async def test_a_caller_sees_and_touches_only_its_own_runs():
    async with (
        edge_with_nodes((echo_node(("a", 1), ("b", 1)), "n1-token")) as edge,
        open_runner(edge.client_url, token="alice-token") as alice,
        open_runner(edge.client_url, token="bob-token") as bob,
    ):
        async with alice.run(RunSpec("echo/a", "alice's secret", run_id="x")) as stream:
            await stream.collect()
        assert stream.run_id == "alice:x"
        # bob cannot list, read, follow or cancel it
        assert [r.run_id for r in await alice.list_runs()] == ["alice:x"]
        assert await bob.list_runs() == []
        for call in (
            bob.get_run("alice:x", include_events=True),
            bob.cancel("alice:x"),
        ):
            with pytest.raises(RemoteError) as unknown:
                await call
            assert unknown.value.code == pb.ERROR_CODE_UNKNOWN_RUN
        # reusing alice's id names a run of bob's own, never her stream
        async with bob.run(RunSpec("echo/a", "bob's words", run_id="x")) as theirs:
            text, _ = await theirs.collect()
        assert (theirs.run_id, theirs.existing, text) == ("bob:x", False, "bob's words")
        async with bob.run(RunSpec("echo/a", "again", run_id="alice:x")) as prefixed:
            await prefixed.collect()
        assert prefixed.run_id == "bob:alice:x"
        [record] = [r for r in await bob.list_runs() if r.run_id == "bob:x"]
        assert record.tenant == "team-b"  # from bob's identity


async def test_a_caller_is_held_to_its_targets_and_priority():
    async with (
        edge_with_nodes((echo_node(("a", 1), ("b", 1)), "n1-token")) as edge,
        open_runner(edge.client_url, token="bob-token") as bob,
        open_runner(edge.client_url, token="alice-token") as alice,
    ):
        with pytest.raises(RemoteError) as target:
            await bob.submit(RunSpec("echo/b", "not mine"))
        assert target.value.code == pb.ERROR_CODE_FORBIDDEN
        assert "may not use target 'echo/b'" in target.value.message
        with pytest.raises(RemoteError) as priority:
            await bob.submit(RunSpec("echo/a", "me first", priority=1))
        assert priority.value.code == pb.ERROR_CODE_FORBIDDEN
        assert "priority 0 at most" in priority.value.message
        assert (await alice.submit(RunSpec("echo/b", "mine", priority=5))).startswith("alice:")
        with pytest.raises(ConnectionRejected):
            async with open_runner(edge.client_url, token="n1-token"):  # a node's token
                pass


async def test_a_run_id_cannot_name_runs_on_two_nodes():
    one = echo_node(("a", 1))
    two = Node(
        node_id="n2",
        adapters=one.adapters.values(),  # type: ignore[arg-type]
        targets=[t for t in echo_node(("b", 1)).targets.values()],
        store=type(one.store)(),
    )
    async with (
        edge_with_nodes((one, "n1-token"), (two, "n2-token")) as edge,
        open_runner(edge.client_url, token="alice-token") as alice,
    ):
        await alice.submit(RunSpec("echo/a", "on n1", run_id="same"))
        with pytest.raises(RemoteError) as twice:
            await alice.submit(RunSpec("echo/b", "on n2", run_id="same"))
        assert twice.value.code == pb.ERROR_CODE_INVALID
        assert "names a run on another node" in twice.value.message


async def test_changing_limits_through_the_edge_needs_the_right():
    node = echo_node(("a", 1))
    async with (
        edge_with_nodes((node, "n1-token")) as edge,
        open_runner(edge.client_url, token="alice-token") as alice,
        open_runner(edge.client_url, token="ops-token") as ops,
    ):
        with pytest.raises(RemoteError) as refused:
            await alice.set_limits(node_id="n1", targets={"echo/a": 5})
        assert refused.value.code == pb.ERROR_CODE_FORBIDDEN
        assert node.limits().targets["echo/a"] == 1
        limits = await ops.set_limits(node_id="n1", targets={"echo/a": 5})
        assert limits.targets["echo/a"] == 5 == node.limits().targets["echo/a"]
        with pytest.raises(RemoteError) as gone:
            await ops.set_limits(node_id="n9", concurrency=1)
        assert gone.value.code == pb.ERROR_CODE_UNAVAILABLE


def test_a_callers_limits_come_from_its_entry_over_the_files_defaults():
    data = {
        "limits": {"requests_per_second": 10, "max_runs": 4},
        "callers": {
            "a": {"token_sha256": token_digest("a")},
            "b": {"token_sha256": token_digest("b"), "burst": 3, "max_runs": 9},
        },
    }
    found = Identities.from_data(data)
    a, b = found.caller("a"), found.caller("b")
    assert a is not None and b is not None
    assert (a.limits.requests_per_second, a.limits.bucket_size, a.limits.max_runs) == (10, 20, 4)
    assert (b.limits.requests_per_second, b.limits.bucket_size, b.limits.max_runs) == (10, 3, 9)
    plain = Identities.from_data(IDENTITIES).caller("bob-token")
    assert plain is not None and plain.limits == CallerLimits()  # sane defaults
    for bad, match in [
        (
            {"limits": {"requests_per_second": 0}},
            "limits.requests_per_second: must be a number > 0",
        ),
        ({"limits": {"rate": 1}}, "limits: a mapping of"),
        (
            {"callers": {"x": {"token_sha256": token_digest("t"), "max_runs": 0}}},
            "callers.x.max_runs: must be an integer >= 1",
        ),
    ]:
        with pytest.raises(IdentityError, match=match):
            Identities.from_data(bad)


def test_a_token_bucket_refills_at_its_rate_up_to_its_size():
    bucket = TokenBucket(rate=2.0, size=3.0, now=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [None, None, None]
    assert bucket.take(0.0) == pytest.approx(0.5)  # the next token comes in half a second
    assert bucket.take(0.5) is None
    assert bucket.take(100.0) is None and bucket.tokens == pytest.approx(2.0)  # never over 3


LIMITED = {
    "callers": {
        "greedy": {
            "token_sha256": token_digest("greedy-token"),
            "requests_per_second": 1,
            "burst": 3,
            "max_runs": 1,
        },
        "quiet": {"token_sha256": token_digest("quiet-token")},
    },
    "nodes": {"n1": {"token_sha256": token_digest("n1-token")}},
}


async def test_a_caller_over_its_rate_or_its_runs_is_rate_limited_and_others_are_not(
    autojump_clock,
):
    edge = Edge(token=None, identities=Identities.from_data(LIMITED))
    node = echo_node(("a", 4), delay=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(edge.serve)
        await nursery.start(run_node, node, edge.node_url, "n1-token")
        await edge.wait_for_node("n1")
        async with (
            open_runner(edge.client_url, token="greedy-token") as greedy,
            open_runner(edge.client_url, token="quiet-token") as quiet,
        ):
            async with greedy.run(RunSpec("echo/a", "one two three")) as running:
                # its one run is open: a second is refused, however it asks
                with pytest.raises(RemoteError) as busy:
                    await greedy.submit(RunSpec("echo/a", "more"))
                assert busy.value.code == pb.ERROR_CODE_RATE_LIMITED
                assert "max_runs" in busy.value.message and busy.value.retry_after
                # its burst of 3 is spent (a run, a refused run, now a list): over its rate
                await greedy.list_runs()
                with pytest.raises(RemoteError) as fast:
                    await greedy.list_runs()
                assert fast.value.code == pb.ERROR_CODE_RATE_LIMITED
                assert fast.value.retry_after == pytest.approx(1.0, abs=0.05)
                # another caller is not held back by it
                for _ in range(20):
                    await quiet.list_runs()
                assert (await running.collect())[0] == "one two three"
            await trio.sleep(1.0)  # a token again, and no run open
            assert await greedy.submit(RunSpec("echo/a", "later"))
        nursery.cancel_scope.cancel()
