"""Relaying tokens: deltas that gather while a hop is behind go on merged, never changed.

A real node and edge on loopback (tests/test_wire.py's ``stack``); every wait is bounded.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio.testing

from iop_trio.adapters.base import Adapter, AdapterRequest, Chunk, Completion, Delta
from iop_trio.model import EventKind, RunEvent, RunSpec, TargetSpec, Usage
from iop_trio.runtime import Node
from iop_trio.runtime.manager import SYNC_EVERY
from iop_trio.store.memory import MemoryStore
from iop_trio.store.sqlite import SqliteStore

from .test_wire import stack

WAIT = 20


class Burst(Adapter):
    """Streams the prompt's words as deltas all at once: no checkpoint between them, so
    the node has published every one before its stream to the edge runs again."""

    kind = "burst"

    @asynccontextmanager
    async def open_stream(self, request: AdapterRequest) -> AsyncIterator[AsyncIterator[Chunk]]:
        async def chunks() -> AsyncGenerator[Chunk, None]:
            words = request.prompt.split(" ")
            for word in words:
                yield Delta(word + " ")
            yield Completion(Usage("stop", completion_tokens=len(words)))

        yield chunks()


def burst_node() -> Node:
    return Node(
        node_id="n1",
        adapters=[Burst("burst")],
        targets=[TargetSpec("burst", "m", concurrency=4)],
        store=MemoryStore(),
    )


async def relayed(node: Node, prompt: str) -> list[RunEvent]:
    async with stack(node) as s:
        with trio.fail_after(WAIT):
            async with s.edge.run(RunSpec("burst/m", prompt)) as stream:
                return [event async for event in stream]


async def test_deltas_published_while_the_stream_waited_arrive_as_one():
    words = [f"w{i}" for i in range(SYNC_EVERY - 10)]  # no durable wait among them
    events = await relayed(burst_node(), " ".join(words))
    kinds = [e.kind for e in events]
    assert kinds == [EventKind.QUEUED, EventKind.STARTED, EventKind.DELTA, EventKind.SUCCEEDED]
    delta = events[2]
    assert delta.text == "".join(w + " " for w in words)
    assert delta.seq == 2 + len(words)  # the seq of its last piece
    assert events[3].seq == delta.seq + 1


async def test_a_long_burst_keeps_its_text_and_order_in_fewer_frames():
    words = [f"w{i}" for i in range(5000)]
    node = burst_node()
    events = await relayed(node, " ".join(words))
    deltas = [e for e in events if e.kind is EventKind.DELTA]
    assert "".join(e.text for e in deltas) == "".join(w + " " for w in words)
    seqs = [e.seq for e in events]
    assert seqs == sorted(set(seqs)) and seqs[0] == 1 and seqs[-1] == len(words) + 3
    # the run waits for the store every SYNC_EVERY deltas, so at most about that often
    # can its stream catch up and send a delta alone
    assert len(deltas) <= 2 * len(words) // SYNC_EVERY + 2
    # the node kept each piece in its own event: only the wire merges
    stored = await node.store.events(events[0].run_id)
    assert [e.seq for e in stored] == list(range(1, len(words) + 4))


class StepGate:
    """Holds the SQLite writer before each batch until the test lets that one go."""

    def __init__(self, store: SqliteStore) -> None:
        self.batches: list[list[str]] = []
        self._steps = threading.Semaphore(0)
        self._taken = threading.Semaphore(0)
        self._open = True
        store._before_batch = self._hook

    def _hook(self, labels: list[str]) -> None:
        if self._open:
            return
        self.batches.append(labels)
        self._taken.release()
        self._steps.acquire(timeout=WAIT)

    def hold(self) -> None:
        """Hold every batch from now on until :meth:`step` or :meth:`open`."""
        self._open = False

    async def next_batch(self) -> list[str]:
        """Wait until the writer holds its next batch; its labels."""
        assert await trio.to_thread.run_sync(lambda: self._taken.acquire(timeout=WAIT))
        return self.batches[-1]

    def step(self) -> None:
        self._steps.release()

    def open(self) -> None:
        self._open = True
        self._steps.release()


async def test_the_engine_request_goes_out_while_started_is_committed(tmp_path):
    """STARTED is written without waiting: the engine has the request before STARTED is
    durable, and nobody sees STARTED (nor anything after it) until it is."""
    from .engines import OPENAI, Reply, serve

    store = SqliteStore(tmp_path / "runs.db")
    await store.ready()
    gate = StepGate(store)
    async with serve() as server, OPENAI.adapter(server.url) as adapter:
        node = Node(
            node_id="n1",
            adapters=[adapter],
            targets=[TargetSpec(adapter.name, OPENAI.model)],
            store=store,
        )
        reply = server.push(Reply(content_type=OPENAI.content_type, end="hang"))
        try:
            with trio.fail_after(WAIT):
                async with node.running(), trio.open_nursery() as nursery:
                    gate.hold()
                    submitted: list[str] = []

                    async def submit() -> None:
                        spec = RunSpec(OPENAI.target, "hi")
                        submitted.append((await node.manager.submit(spec)).record.run_id)

                    nursery.start_soon(submit)
                    assert await gate.next_batch() == ["create"]
                    gate.step()
                    assert await gate.next_batch() == ["append"]  # STARTED, held
                    await reply.request()  # the engine has the request meanwhile
                    (run,) = submitted
                    watcher = node.manager.watch(run, after_seq=1)
                    await reply.send(OPENAI.piece("Hel"))
                    await trio.testing.wait_all_tasks_blocked()
                    assert watcher.ready() == []  # neither STARTED nor the delta is out
                    gate.open()
                    started = await watcher.__anext__()
                    assert (started.seq, started.kind) == (2, EventKind.STARTED)
                    delta = await watcher.__anext__()
                    assert (delta.seq, delta.text) == (3, "Hel")
                    await reply.send(OPENAI.end(Usage("stop", 1, 1)))
                    await reply.finish()
                    async for _ in watcher:
                        pass
            record = await store.get(run)
        finally:
            gate.open()
            await store.aclose()
    assert record is not None and record.status.value == "succeeded"
