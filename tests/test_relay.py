"""Relaying tokens: deltas that gather while a hop is behind go on merged, never changed.

A real node and edge on loopback (tests/test_wire.py's ``stack``); every wait is bounded.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio
import trio.testing

from iop_trio.adapters.base import Adapter, AdapterRequest, Chunk, Completion, Delta
from iop_trio.model import MAX_JOINED_TEXT, EventKind, RunEvent, RunSpec, TargetSpec, Usage
from iop_trio.runtime import Node
from iop_trio.runtime.live import SYNC_EVERY, RunWatcher
from iop_trio.runtime.pipeline import GATHER_LIMIT, GATHER_TEXT, gathered
from iop_trio.store.memory import MemoryStore
from iop_trio.store.sqlite import SqliteStore, SqliteStoreHooks

from .engines import OPENAI, EngineServer, Reply, serve
from .test_wire import stack

WAIT = 20


class Burst(Adapter):
    """Streams the prompt's words as deltas all at once: no checkpoint between them, so
    they are all there before the run takes the first. With ``drip``, a checkpoint after
    each word: the run and its stream to the edge may run between any two."""

    kind = "burst"

    def __init__(self, name: str, *, drip: bool = False) -> None:
        super().__init__(name)
        self.drip = drip

    @asynccontextmanager
    async def open_stream(self, request: AdapterRequest) -> AsyncIterator[AsyncIterator[Chunk]]:
        async def chunks() -> AsyncGenerator[Chunk, None]:
            words = request.prompt.split(" ")
            for word in words:
                yield Delta(word + " ")
                if self.drip:
                    await trio.lowlevel.checkpoint()
            yield Completion(Usage("stop", completion_tokens=len(words)))

        yield chunks()


def burst_node(*, drip: bool = False) -> Node:
    return Node(
        node_id="n1",
        adapters=[Burst("burst", drip=drip)],
        targets=[TargetSpec("burst", "m", concurrency=4)],
        store=MemoryStore(),
    )


async def relayed(node: Node, prompt: str) -> list[RunEvent]:
    async with stack(node) as s:
        with trio.fail_after(WAIT):
            async with s.edge.run(RunSpec("burst/m", prompt)) as stream:
                return [event async for event in stream]


def text_of(events: list[RunEvent]) -> str:
    return "".join(e.text for e in events if e.kind is EventKind.DELTA)


async def test_what_came_while_the_run_was_busy_is_one_delta_stored_and_relayed():
    words = [f"w{i}" for i in range(SYNC_EVERY - 10)]
    node = burst_node()
    events = await relayed(node, " ".join(words))
    kinds = [e.kind for e in events]
    assert kinds == [EventKind.QUEUED, EventKind.STARTED, EventKind.DELTA, EventKind.SUCCEEDED]
    assert events[2].text == "".join(w + " " for w in words)
    assert [e.seq for e in events] == [1, 2, 3, 4]
    assert [(e.seq, e.text) for e in await node.store.events(events[0].run_id)] == [
        (e.seq, e.text) for e in events
    ]


async def test_a_long_burst_keeps_its_text_and_order_in_fewer_events():
    words = [f"w{i}" for i in range(5000)]
    node = burst_node()
    events = await relayed(node, " ".join(words))
    assert text_of(events) == "".join(w + " " for w in words)
    stored = await node.store.events(events[0].run_id)
    assert [e.seq for e in stored] == list(range(1, len(stored) + 1))  # whole, no gap
    assert text_of(stored) == text_of(events)
    # the run takes what its reader holds, at most GATHER_LIMIT chunks (and the one its
    # reader waits to hand over) at a time
    assert sum(e.kind is EventKind.DELTA for e in stored) <= len(words) // GATHER_LIMIT + 2
    seqs = [e.seq for e in events]
    assert seqs == sorted(set(seqs)) and seqs[-1] == stored[-1].seq


async def test_a_dripping_stream_keeps_its_text_and_order_on_the_wire():
    """Chunks one checkpoint apart: how they are joined (by the run, or merged by its stream
    to the edge) depends on who runs first; the text, its order and the seqs never do."""
    words = [f"w{i}" for i in range(2000)]
    node = burst_node(drip=True)
    events = await relayed(node, " ".join(words))
    assert text_of(events) == "".join(w + " " for w in words)
    stored = await node.store.events(events[0].run_id)
    assert [e.seq for e in stored] == list(range(1, len(stored) + 1))
    assert text_of(stored) == text_of(events)
    seqs = [e.seq for e in events]
    assert seqs == sorted(set(seqs)) and seqs[-1] == stored[-1].seq
    # the wire never splits a stored delta: each relayed one ends where a stored one does
    ends = {e.seq for e in stored}
    assert all(e.seq in ends for e in events)


class StepGate(SqliteStoreHooks):
    """A store's hooks: holds the SQLite writer before each batch until the test lets that
    one go."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self._steps = threading.Semaphore(0)
        self._taken = threading.Semaphore(0)
        self._open = True

    def before_batch(self, labels: list[str]) -> None:
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


@asynccontextmanager
async def engine_node(
    tmp_path: Path, *, concurrency: int | None = None
) -> AsyncIterator[EngineNode]:
    """A running node with the SQLite store (its writer under a :class:`StepGate`) and the
    openai adapter on a scripted engine; the store is closed after, the gate opened."""
    gate = StepGate()
    store = SqliteStore(tmp_path / "runs.db", hooks=gate)
    await store.ready()
    try:
        async with serve() as server, OPENAI.adapter(server.url) as adapter:
            limit = {} if concurrency is None else {"concurrency": concurrency}
            node = Node(
                node_id="n1",
                adapters=[adapter],
                targets=[TargetSpec(adapter.name, OPENAI.model, **limit)],
                store=store,
            )
            with trio.fail_after(WAIT):
                async with node.running():
                    yield EngineNode(node, server, store, gate)
    finally:
        gate.open()
        await store.aclose()


@attrs.frozen
class EngineNode:
    node: Node
    server: EngineServer
    store: SqliteStore
    gate: StepGate

    def reply(self) -> Reply:
        """Script the engine's next answer: headers now, then what the test sends."""
        return self.server.push(Reply(content_type=OPENAI.content_type, end="hang"))

    async def succeed(self, reply: Reply, watcher: RunWatcher) -> None:
        """End the engine's answer well and follow the run to its end: SUCCEEDED."""
        await reply.send(OPENAI.end(Usage("stop", 1, 1)))
        await reply.finish()
        async for event in watcher:
            last = event
        assert last.kind is EventKind.SUCCEEDED


async def test_a_run_that_may_start_at_once_stores_started_with_queued(tmp_path):
    """One write, before the caller hears of the run; its engine has the request while
    that write commits (issue 23), and nothing it streams is seen until the write is
    durable. The caller's record is that of QUEUED, and STARTED follows it."""
    async with engine_node(tmp_path) as e, trio.open_nursery() as nursery:
        reply = e.reply()
        e.gate.hold()
        submitted: list[str] = []
        heard = trio.Event()

        async def submit() -> None:
            record = (await e.node.manager.submit(RunSpec(OPENAI.target, "hi"))).record
            assert (record.status.value, record.last_seq) == ("queued", 1)
            submitted.append(record.run_id)
            heard.set()

        nursery.start_soon(submit)
        assert await e.gate.next_batch() == ["create"]
        await reply.request()  # the engine has the request; the write is held
        await reply.send(OPENAI.piece("Hel"))
        await trio.testing.wait_all_tasks_blocked()
        assert submitted == []  # the caller hears of the run once it is durable
        assert [live.events for live in e.node.manager.runs] == [[]]  # nothing is out
        before = e.store.statistics()
        e.gate.open()
        with trio.fail_after(10):
            await heard.wait()
        (run,) = submitted
        assert e.store.statistics().commits - before.commits >= 1
        stored = await e.store.events(run)
        assert [(ev.seq, ev.kind) for ev in stored][:2] == [
            (1, EventKind.QUEUED),
            (2, EventKind.STARTED),
        ]
        watcher = e.node.manager.watch(run, after_seq=1)
        started = await watcher.__anext__()
        assert (started.seq, started.kind) == (2, EventKind.STARTED)
        delta = await watcher.__anext__()
        assert (delta.seq, delta.text) == (3, "Hel")
        await e.succeed(reply, watcher)


async def test_a_run_that_waited_sends_its_request_while_started_is_committed(tmp_path):
    """A run granted after waiting writes STARTED without waiting for it: the engine has
    the request before STARTED is durable, and nobody sees STARTED (nor anything after
    it) until it is."""
    async with engine_node(tmp_path, concurrency=1) as e:
        first, reply = e.reply(), e.reply()
        spec = RunSpec(OPENAI.target, "hi")
        await e.node.manager.submit(spec)
        await first.request()
        run = (await e.node.manager.submit(spec)).record.run_id
        assert e.node.gate.statistics().queued == 1  # it waits for the first
        e.gate.hold()
        await first.send(OPENAI.end(Usage("stop", 1, 1)))  # the first ends: room for the run
        await first.finish()
        await e.gate.next_batch()  # from here on nothing is durable
        await reply.request()  # the engine has the request meanwhile
        watcher = e.node.manager.watch(run, after_seq=1)
        await reply.send(OPENAI.piece("Hel"))
        await trio.testing.wait_all_tasks_blocked()
        assert watcher.ready() == []  # neither STARTED nor the delta is out
        e.gate.open()
        started = await watcher.__anext__()
        assert (started.seq, started.kind) == (2, EventKind.STARTED)
        delta = await watcher.__anext__()
        assert (delta.seq, delta.text) == (3, "Hel")
        await e.succeed(reply, watcher)


class Endless:
    """Deltas of ``size`` characters for ever, none of them waiting: counts those taken."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.taken = 0

    async def chunks(self) -> AsyncGenerator[Chunk, None]:
        while True:
            self.taken += 1
            yield Delta("x" * self.size)


async def test_a_run_that_takes_nothing_lets_its_reader_read_only_so_far_ahead():
    for size, bound in (
        (1, GATHER_LIMIT + 1),  # the channel's room, and the chunk waiting to go in
        (2048, GATHER_TEXT // 2048 + 1),  # the text, and the chunk that passed it
    ):
        source = Endless(size)
        async with gathered(source.chunks()) as batches:
            await trio.testing.wait_all_tasks_blocked()
            assert source.taken == bound
            # taking what is there lets it read as far again, and no further
            batch = await batches.__anext__()
            assert "".join(c.text for c in batch if isinstance(c, Delta)) == "x" * size * len(batch)
            await trio.testing.wait_all_tasks_blocked()
            assert source.taken == bound + len(batch)


async def test_a_delta_made_of_gathered_chunks_stays_within_its_size():
    """However much came at once, one delta carries at most MAX_JOINED_TEXT characters
    (so its frame stays far below max_message_size); the text is whole and in order."""
    words = [f"{i:04d}" + "x" * 995 for i in range(300)]  # 1,000 characters each
    node = burst_node()
    events = await relayed(node, " ".join(words))
    stored = await node.store.events(events[0].run_id)
    sizes = [len(e.text) for e in stored if e.kind is EventKind.DELTA]
    assert len(sizes) > 1 and max(sizes) <= MAX_JOINED_TEXT
    assert text_of(stored) == text_of(events) == "".join(w + " " for w in words)
