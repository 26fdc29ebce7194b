"""One target over several engine replicas, through a real node and real HTTP servers on
loopback speaking the OpenAI wire format: the config that names them, runs spread over
them, failover before a first token (refused, 503), no retry after one, every replica
down, and a probe that brings one back.
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import pytest
import trio

from iop_trio.adapters.openai import OpenAIAdapter, OpenAISettings
from iop_trio.cli.check import check_config
from iop_trio.config import ConfigError, structure_config
from iop_trio.model import EventKind, RunSpec, RunStatus
from iop_trio.runtime import AdapterSlot, Node, ReplicaSlot, RuntimeLimits, TargetSpec
from iop_trio.store.memory import MemoryStore

from .engines import (
    SSE,
    EngineServer,
    Exchange,
    Reply,
    openai_error,
    openai_reply,
    openai_stream,
    refused_port,
    wait_end,
)
from .engines import serve as serve_engine

BASE: dict[str, Any] = {
    "node_id": "n",
    "edge": {"url": ""},
    "adapters": {
        "vllm": {
            "kind": "openai",
            "routing": "prefix",
            "replicas": [
                "http://127.0.0.1:8001",
                {"url": "http://127.0.0.1:8002", "weight": 2, "concurrency": 4},
                {"url": "http://user:secret@127.0.0.1:8003", "token_budget": 8000},
            ],
        }
    },
    "targets": [{"adapter": "vllm", "model": "m", "concurrency": 8}],
}


def test_replicas_in_the_config_build_one_adapter_each_and_check_config_says_them():
    config = structure_config(copy.deepcopy(BASE), source="node.yaml")
    [slot] = config.build_adapters()
    assert slot.routing == "prefix"
    assert [r.name for r in slot.replicas] == [
        "http://127.0.0.1:8001",
        "http://127.0.0.1:8002",
        "http://***@127.0.0.1:8003",
    ]
    assert [r.adapter.base_url for r in slot.replicas] == [  # type: ignore[attr-defined]
        "http://127.0.0.1:8001",
        "http://127.0.0.1:8002",
        "http://user:secret@127.0.0.1:8003",
    ]
    assert [(r.concurrency, r.token_budget, r.weight) for r in slot.replicas] == [
        (None, None, 1.0),
        (4, None, 2.0),
        (None, 8000, 1.0),
    ]
    out = _Out()
    assert check_config(config, out) == 0
    text = "".join(out.lines)
    assert "adapter vllm (openai) limit=- routing=prefix" in text
    assert "replica http://127.0.0.1:8002 weight=2 limit=4" in text
    assert "secret" not in text


class _Out:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        self.lines.append(text)
        return len(text)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"replicas": []}, "replicas: must name at least one engine"),
        ({"base_url": "http://x:1"}, "give either base_url or replicas, not both"),
        ({"routing": "fastest"}, "routing: must be one of least_loaded, prefix, round_robin"),
        ({"replicas": ["http://a:1", "http://a:1"]}, "a url is named twice"),
        ({"replicas": [{"url": "http://a:1", "weight": 0}]}, "weight: must be a number > 0"),
        ({"replicas": [{"url": "http://a:1", "colour": 1}]}, "unknown key"),
        ({"replicas": [{"url": "ftp://a"}]}, "base_url"),
        ({"kind": "echo"}, "kind 'echo' has no base_url: it takes no replicas"),
    ],
)
def test_bad_replicas_are_one_clear_line(change, message):
    data = copy.deepcopy(BASE)
    data["adapters"]["vllm"].update(change)
    with pytest.raises(ConfigError, match=message):
        structure_config(data, source="node.yaml").build_adapters()


def _node(urls: list[str], routing: str = "least_loaded", **limits: Any) -> Node:
    replicas = tuple(
        ReplicaSlot(OpenAIAdapter("r", OpenAISettings(base_url=url)), url) for url in urls
    )
    slot = AdapterSlot(replicas[0].adapter, replicas=replicas, routing=routing)
    return Node(
        node_id="test",
        adapters=[slot],
        targets=[TargetSpec("r", "m", concurrency=8)],
        store=MemoryStore(),
        limits=RuntimeLimits(**limits),
    )


def _streams(server: EngineServer) -> None:
    def answer(exchange: Exchange) -> Reply:
        if exchange.path.endswith("/models"):
            return Reply(200, parts=[b'{"data": [{"id": "m"}]}'], content_length=True)
        return openai_reply(["hel", "lo"])

    server.handler = answer


async def test_runs_spread_over_the_replicas_and_each_is_named():
    async with serve_engine() as a, serve_engine() as b:
        _streams(a)
        _streams(b)
        node = _node([a.url, b.url], routing="round_robin")
        async with node.running():
            records = []
            for i in range(4):
                submitted = await node.manager.submit(RunSpec(target="r/m", prompt=f"p{i}"))
                records.append((await wait_end(node, submitted.record.run_id))[0])
        assert all(r.status is RunStatus.SUCCEEDED for r in records)
        hits = collections.Counter(len(s.exchanges) for s in (a, b))
        assert hits == {2: 2}
        # each record names the replica it ran on, as round robin sent them
        assert [r.replica for r in records] == [a.url, b.url, a.url, b.url]


async def test_a_replica_that_refuses_fails_over_once_and_is_marked_down():
    with refused_port() as port:
        async with serve_engine() as b:
            _streams(b)
            dead = f"http://127.0.0.1:{port}"
            node = _node([dead, b.url], routing="round_robin")
            async with node.running():
                ends = []
                for i in range(3):
                    submitted = await node.manager.submit(RunSpec(target="r/m", prompt=f"{i}"))
                    ends.append(await wait_end(node, submitted.record.run_id))
                assert [r.status for r, _ in ends] == [RunStatus.SUCCEEDED] * 3
                # the first run went to the dead one, then to b; nothing stored twice
                record, events = ends[0]
                kinds = [e.kind for e in events]
                assert kinds.count(EventKind.STARTED) == 1
                # it started for the dead one and ended on b, and its record says so
                [started] = [e for e in events if e.kind is EventKind.STARTED]
                assert (started.replica, events[-1].replica) == (dead, b.url)
                assert record.replica == b.url
                assert "".join(e.text for e in events if e.kind is EventKind.DELTA) == "hello"
                assert (("r", dead) in node.replica_health.down) is True
                assert len(b.exchanges) == 3  # the dead one got no run after its mark


async def test_a_503_before_the_first_token_goes_to_another_but_a_cut_stream_does_not():
    async with serve_engine() as a, serve_engine() as b:
        _streams(b)
        a.push(openai_error(503, "loading"))
        node = _node([a.url, b.url], routing="round_robin")
        async with node.running():
            submitted = await node.manager.submit(RunSpec(target="r/m", prompt="x"))
            record, _ = await wait_end(node, submitted.record.run_id)
            assert record.status is RunStatus.SUCCEEDED
            assert ("r", a.url) in node.replica_health.down
            # a run whose stream is cut after a token is not retried
            node.replica_health.answered("r", a.url, None)
            b.handler = None
            b.push(Reply(content_type=SSE, parts=openai_stream(["par"])[:2], end="abort"))
            a.push(openai_reply(["t"]))  # where round robin would go next
            submitted = await node.manager.submit(RunSpec(target="r/m", prompt="y"))
            first = await wait_end(node, submitted.record.run_id)
            submitted = await node.manager.submit(RunSpec(target="r/m", prompt="z"))
            second = await wait_end(node, submitted.record.run_id)
            statuses = sorted(r.status.value for r, _ in (first, second))
            assert statuses == sorted([RunStatus.FAILED.value, RunStatus.SUCCEEDED.value])


async def test_every_replica_down_ends_engine_unavailable_and_a_probe_brings_one_back():
    with refused_port() as p1, refused_port() as p2:
        urls = [f"http://127.0.0.1:{p1}", f"http://127.0.0.1:{p2}"]
        node = _node(urls, probe_interval=3600)
        async with node.running():
            submitted = await node.manager.submit(RunSpec(target="r/m", prompt="x"))
            record, events = await wait_end(node, submitted.record.run_id)
            assert record.status is RunStatus.FAILED
            assert record.reason == "engine_unavailable"
            assert events[-1].retry_after is not None
            # both were tried and are down: the target is unavailable, with why
            submitted = await node.manager.submit(RunSpec(target="r/m", prompt="y"))
            await wait_end(node, submitted.record.run_id)
            assert len(node.replica_health.down) == 2
            assert "every replica is down" in node.unavailable["r/m"]
    # one comes back where the first was: the probe clears it
    async with serve_engine() as up:
        _streams(up)
        node = _node([up.url, urls[1]], probe_interval=3600)
        node.replica_health.answered("r", up.url, "refused")
        assert ("r", up.url) in node.replica_health.down
        with trio.fail_after(10):
            await node.probe_engines()
        assert ("r", up.url) not in node.replica_health.down
        assert ("r", urls[1]) in node.replica_health.down
        assert "r/m" not in node.unavailable
