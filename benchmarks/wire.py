"""Runs over the proto-socket on loopback, beside raw trio-websocket, and cancel latency.

    python benchmarks/wire.py [--runs N] [--concurrency C] [--latency-runs N] [--cancels N]

An Edge and a Node (EchoAdapter, no delay, MemoryStore) are connected by a
NodeLink on 127.0.0.1, as in tests/test_wire.py. Printed figures:

1. Runs per second and per-run latency p50/p99 for N runs submitted with
   ``edge.run(RunSpec(...))`` and followed to their terminal event, C runs in
   flight at once (and C=1, for pure latency). The prompt is a few words, so a
   run is 1 request + 1 accepted + queued, started, one delta a word and the
   terminal event; the messages a run takes are counted on both sessions.
   Latency = from entering ``edge.run`` to the terminal event at the edge.
2. Beside it, measured in the same process and run: raw trio-websocket, a
   server that echoes each binary message and one client connection. A
   "run-equivalent" is as many messages as a run took, sized like its real
   envelopes (tagged with a 4-byte slot id), sent back to back and done when
   every echo is back; C of them in flight at once, like the runs. Raw
   messages/s are divided by the messages a run takes into run-equivalents/s;
   the ratio is proto-socket runs/s / raw run-equivalents/s. Echo puts twice
   the run's messages on the wire (each goes and comes back), so a second raw
   figure is shaped like a run: the client sends one request-sized message and
   the server answers with the run's replies (accepted + events), sizes and all.
3. Cancel latency: runs on a target whose echo sleeps an hour before each
   delta, one at a time; once the STARTED event is at the edge, the clock
   starts, ``edge.cancel(run_id)`` is called, and two tasks record when the
   CancelResult comes back and when the CANCELLED event arrives on the run's
   stream.

Logging is at WARNING. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import attrs
import trio
import trio_websocket
import wsproto
from google.protobuf import __version__ as protobuf_version
from google.protobuf.internal import api_implementation
from trio_websocket import (
    ConnectionClosed,
    WebSocketConnection,
    WebSocketRequest,
    open_websocket_url,
    serve_websocket,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from iop_trio.adapters.echo import EchoAdapter
from iop_trio.edge import Edge
from iop_trio.protocol import ProtoConnection, Role, pb
from iop_trio.protocol.convert import event_to_pb, request_from_spec
from iop_trio.runtime import EventKind, Node, RunSpec, RuntimeLimits, TargetSpec
from iop_trio.store.memory import MemoryStore
from iop_trio.transport import Backoff, NodeLink, ProtoSession

TOKEN = "bench"
PROMPT = "the quick brown fox"  # four words: four deltas
FAST = "echo/fast"
SLOW = "echo/slow"
SLOW_DELAY = 3600.0  # seconds before each delta: a slow run never ends by itself
SLOT_BYTES = 4


# --- figures -----------------------------------------------------------------------------


@attrs.frozen
class Pass:
    """One measured pass: ``units`` done in ``elapsed`` seconds, a latency each."""

    units: int
    elapsed: float
    latencies: Sequence[float]
    failures: int = 0

    @property
    def rate(self) -> float:
        return self.units / self.elapsed

    def percentile(self, q: float) -> float:
        """Nearest-rank percentile of the latencies, in seconds."""
        ordered = sorted(self.latencies)
        if not ordered:
            return float("nan")
        rank = min(max(1, math.ceil(q / 100 * len(ordered))), len(ordered))
        return ordered[rank - 1]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.2f}"


async def in_flight(
    total: int, concurrency: int, one: Callable[[], Awaitable[float | None]]
) -> Pass:
    """Call ``one`` ``total`` times, ``concurrency`` calls at once.

    ``one`` returns its latency, or None for a failure.
    """
    latencies: list[float] = []
    failures = 0
    left = total

    async def worker() -> None:
        nonlocal left, failures
        while left > 0:
            left -= 1
            latency = await one()
            if latency is None:
                failures += 1
            else:
                latencies.append(latency)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(min(concurrency, total)):
            nursery.start_soon(worker)
    return Pass(total, time.perf_counter() - start, latencies, failures)


# --- the proto-socket stack --------------------------------------------------------------


@attrs.frozen
class Stack:
    edge: Edge
    node: Node
    client: NodeLink
    edge_session: ProtoSession  # the edge's end of the node's session
    node_session: ProtoSession  # the node's end


def make_node(concurrency: int, max_queued: int) -> Node:
    return Node(
        node_id="bench",
        adapters=[EchoAdapter()],
        targets=[
            TargetSpec("echo", "fast", concurrency=concurrency),
            TargetSpec("echo", "slow", concurrency=concurrency, params={"delay": SLOW_DELAY}),
        ],
        limits=RuntimeLimits(
            concurrency=2 * concurrency, max_queued=max_queued, queue_timeout=3600
        ),
        store=MemoryStore(),
    )


@asynccontextmanager
async def proto_stack(concurrency: int, max_queued: int) -> AsyncIterator[Stack]:
    """An Edge and a Node connected on loopback; closed like tests/test_wire.py closes."""
    edge = Edge(token=TOKEN)
    node = make_node(concurrency, max_queued)
    async with trio.open_nursery() as nursery:
        await nursery.start(edge.serve)
        async with node.running(), trio.open_nursery() as client_nursery:
            client = NodeLink(
                node, edge.node_url, token=TOKEN, backoff=Backoff(initial=0.01, maximum=0.05)
            )
            client_nursery.start_soon(client.run)
            handle = await edge.wait_for_node(node.node_id)
            node_session = await client.wait_connected()
            yield Stack(edge, node, client, handle.session, node_session)
            await client.aclose()  # the node hangs up first, cleanly
        nursery.cancel_scope.cancel()


def frames_seen(stack: Stack) -> int:
    """Messages received by either end of the node's session so far."""
    return stack.edge_session.frames_received + stack.node_session.frames_received


async def proto_one(edge: Edge, spec: RunSpec) -> float | None:
    start = time.perf_counter()
    async with edge.run(spec) as stream:
        _, last = await stream.collect()
    latency = time.perf_counter() - start
    return latency if last.kind is EventKind.SUCCEEDED else None


async def proto_pass(stack: Stack, runs: int, concurrency: int) -> tuple[Pass, float]:
    """Runs through the edge; also returns the messages a run took on the session."""
    spec = RunSpec(FAST, PROMPT)
    before = frames_seen(stack)
    result = await in_flight(runs, concurrency, lambda: proto_one(stack.edge, spec))
    return result, (frames_seen(stack) - before) / runs


async def envelope_sizes(stack: Stack) -> list[int]:
    """The byte sizes of the envelopes of one run, in wire order (request first).

    Rebuilt with the protocol's own encoders from a real run's stored events;
    nonces are given a typical 2-byte varint.
    """
    spec = RunSpec(FAST, PROMPT)
    async with stack.edge.run(spec) as stream:
        await stream.collect()
        run_id = stream.run_id
    events = await stack.node.store.events(run_id)
    nonce = 1000
    conn = ProtoConnection(Role.RUNNER)
    request = pb.Envelope(nonce=nonce, run_request=request_from_spec(spec)).SerializeToString()
    accepted = pb.RunAccepted(run_id=run_id, status=pb.RUN_STATUS_QUEUED)
    frames = [request, conn.reply(nonce, "run_accepted", accepted)]
    frames += [conn.reply(nonce, "run_event", event_to_pb(event)) for event in events]
    return [len(frame) for frame in frames]


# --- cancel latency ----------------------------------------------------------------------


@attrs.frozen
class CancelTimes:
    result: float  # cancel() called -> CancelResult back
    event: float  # cancel() called -> CANCELLED on the run's stream
    event_first: bool


async def cancel_one(edge: Edge) -> CancelTimes:
    async with edge.run(RunSpec(SLOW, PROMPT)) as stream:
        while (await stream.__anext__()).kind is not EventKind.STARTED:
            pass
        times: dict[str, float] = {}

        async def result() -> None:
            outcome = await edge.cancel(stream.run_id, "bench")
            times["result"] = time.perf_counter()
            if not outcome.cancelled or outcome.status != pb.RUN_STATUS_CANCELLED:
                raise RuntimeError(f"cancel did not cancel: {outcome}")

        async def event() -> None:
            last = await stream.__anext__()
            times["event"] = time.perf_counter()
            if last.kind is not EventKind.CANCELLED:
                raise RuntimeError(f"expected CANCELLED, got {last}")

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(result)
            nursery.start_soon(event)
    return CancelTimes(
        times["result"] - start, times["event"] - start, times["event"] < times["result"]
    )


# --- raw trio-websocket ------------------------------------------------------------------


def tag(slot: int, size: int) -> bytes:
    """A message of ``size`` bytes whose first bytes name the slot it belongs to."""
    return slot.to_bytes(SLOT_BYTES, "big") + b"\x5a" * max(0, size - SLOT_BYTES)


@asynccontextmanager
async def raw_server(replies: Sequence[int]) -> AsyncIterator[int]:
    """A trio-websocket server on loopback; yields its port.

    Path ``/echo`` echoes each message; ``/shaped`` answers each message with
    messages of the sizes in ``replies``, tagged with the slot of the request.
    """

    async def echo(ws: WebSocketConnection) -> None:
        while True:
            await ws.send_message(await ws.get_message())

    async def shaped(ws: WebSocketConnection) -> None:
        while True:
            message = await ws.get_message()
            assert isinstance(message, bytes)
            slot = int.from_bytes(message[:SLOT_BYTES], "big")
            for size in replies:
                await ws.send_message(tag(slot, size))

    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        with suppress(ConnectionClosed):
            await (shaped if request.path.startswith("/shaped") else echo)(ws)

    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            lambda task_status: serve_websocket(
                handler, "127.0.0.1", 0, ssl_context=None, task_status=task_status
            )
        )
        yield server.port
        nursery.cancel_scope.cancel()


@attrs.define
class _Waiting:
    """A run-equivalent in flight: the messages still to come back."""

    left: int
    done: trio.Event = attrs.field(factory=trio.Event)


async def raw_pass(
    port: int, path: str, sends: Sequence[int], expect: int, total: int, concurrency: int
) -> Pass:
    """``total`` run-equivalents, ``concurrency`` at once, on one client connection.

    Each sends messages of the sizes in ``sends`` and is done when ``expect``
    messages with its slot have come back.
    """
    async with open_websocket_url(f"ws://127.0.0.1:{port}{path}") as ws:
        waiting: dict[int, _Waiting] = {}

        async def reader() -> None:
            while True:
                message = await ws.get_message()
                assert isinstance(message, bytes)
                entry = waiting[int.from_bytes(message[:SLOT_BYTES], "big")]
                entry.left -= 1
                if entry.left == 0:
                    entry.done.set()

        frames = {slot: [tag(slot, size) for size in sends] for slot in range(concurrency)}
        free = list(range(concurrency))

        async def one() -> float:
            slot = free.pop()
            entry = waiting[slot] = _Waiting(expect)
            start = time.perf_counter()
            for frame in frames[slot]:
                await ws.send_message(frame)
            await entry.done.wait()
            latency = time.perf_counter() - start
            free.append(slot)
            return latency

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            result = await in_flight(total, concurrency, one)
            nursery.cancel_scope.cancel()
    return result


# --- main --------------------------------------------------------------------------------


def row(label: str, c: int, p: Pass, per_unit: float, what: str = "runs/s") -> str:
    """One line: rate, messages/s (rate x messages a unit), latency p50/p99."""
    extra = f"  ({p.failures} failed)" if p.failures else ""
    return (
        f"{c:>4}  {label:<34} {p.rate:>10,.0f} {what:<8} {p.rate * per_unit:>10,.0f}"
        f" {ms(p.percentile(50)):>9} {ms(p.percentile(99)):>9}{extra}"
    )


async def main(runs: int, concurrency: int, latency_runs: int, cancels: int) -> None:
    impl = api_implementation.Type()
    print(
        f"python {sys.version.split()[0]}, trio {trio.__version__}, "
        f"trio-websocket {trio_websocket.__version__}, wsproto {wsproto.__version__}, "
        f"protobuf {protobuf_version} ({impl})"
    )
    max_queued = max(runs, 10_000)
    print(
        f"runs {runs:,} at C={concurrency}, {latency_runs:,} at C=1; cancels {cancels:,}; "
        f"prompt {PROMPT!r}; EchoAdapter delay 0; target concurrency {concurrency}, "
        f"global {2 * concurrency}, max_queued {max_queued:,}; MemoryStore; loopback"
    )
    async with proto_stack(concurrency, max_queued) as stack:
        sizes = await envelope_sizes(stack)
        per_run = len(sizes)
        print(
            f"messages a run: {per_run} (request + accepted + {per_run - 2} events); "
            f"envelope bytes in wire order: {', '.join(map(str, sizes))} (total {sum(sizes)})"
        )
        async with raw_server(sizes[1:]) as port:
            # warm up every path before measuring
            await proto_pass(stack, min(runs, 500), concurrency)
            await raw_pass(port, "/echo", sizes, per_run, min(runs, 500), concurrency)
            await raw_pass(port, "/shaped", sizes[:1], per_run - 1, min(runs, 500), concurrency)
            print()
            print(
                f"{'C':>4}  {'':<34} {'rate':>10} {'':<8} {'msgs/s':>10} "
                f"{'p50 ms':>9} {'p99 ms':>9}"
            )
            for c, n in ((concurrency, runs), (1, latency_runs)):
                proto, counted = await proto_pass(stack, n, c)
                echo = await raw_pass(port, "/echo", sizes, per_run, n, c)
                shaped = await raw_pass(port, "/shaped", sizes[:1], per_run - 1, n, c)
                print(row("proto-socket Edge.run", c, proto, per_run))
                print(
                    row(f"raw echo ({per_run} msgs there and back)", c, echo, per_run, "run-eq/s")
                )
                print(row(f"raw shaped (1 -> {per_run - 1} msgs)", c, shaped, per_run, "run-eq/s"))
                for name, raw in (("echo", echo), ("shaped", shaped)):
                    print(
                        f"{c:>4}  {'ratio proto / raw ' + name:<34} {proto.rate / raw.rate:>10.3f}"
                        f"{'':<9} {'':>10} "
                        f"{'x' + format(proto.percentile(50) / raw.percentile(50), '.2f'):>9} "
                        f"{'x' + format(proto.percentile(99) / raw.percentile(99), '.2f'):>9}"
                    )
                note = "" if abs(counted - per_run) < 0.005 else "  (differs from the envelopes!)"
                print(f"{c:>4}  messages a run counted on the session: {counted:.2f}{note}")
                print()

        await cancel_one(stack.edge)  # warm up
        cancel_start = time.perf_counter()
        cancel_times = [await cancel_one(stack.edge) for _ in range(cancels)]
        cancel_elapsed = time.perf_counter() - cancel_start
        results = Pass(cancels, cancel_elapsed, [t.result for t in cancel_times])
        events = Pass(cancels, cancel_elapsed, [t.event for t in cancel_times])
        first = sum(t.event_first for t in cancel_times)
        print(
            f"cancel latency, {cancels:,} RUNNING runs one at a time "
            f"({cancels / cancel_elapsed:,.0f} start+cancel cycles/s):"
        )
        print(
            f"  edge.cancel() -> CancelResult:        p50 {ms(results.percentile(50))} ms, "
            f"p99 {ms(results.percentile(99))} ms"
        )
        print(
            f"  edge.cancel() -> CANCELLED on stream: p50 {ms(events.percentile(50))} ms, "
            f"p99 {ms(events.percentile(99))} ms"
        )
        print(f"  CANCELLED event arrived before the CancelResult in {first:,} of {cancels:,}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5_000, help="runs per figure at C")
    parser.add_argument("--concurrency", type=int, default=64, help="runs in flight at once")
    parser.add_argument(
        "--latency-runs", type=int, default=None, help="runs at C=1 (default: runs, at most 1000)"
    )
    parser.add_argument("--cancels", type=int, default=500)
    ns = parser.parse_args()
    latency_runs = ns.latency_runs if ns.latency_runs is not None else min(ns.runs, 1_000)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    trio.run(main, ns.runs, ns.concurrency, latency_runs, ns.cancels)
