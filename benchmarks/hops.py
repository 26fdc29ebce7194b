"""The floor a process hop sets on this machine: what relaying adds before any work.

    python benchmarks/hops.py [--rounds 3000] [--hops 0,1,2] [--size 200] [--kinds tcp,ws,thread]
                              [--gap-ms 0]

One message of ``--size`` bytes at a time (C=1) goes from this process to an echo
process and back, straight or through 1 or 2 relay processes on loopback. Each
relay is a process of its own that forwards what it gets, in both directions,
and does nothing else:

- ``tcp``: trio copies bytes between two sockets, a task each way, no parsing: the
  least a hop through a trio process costs;
- ``ws``: trio-websocket forwards each message, a task each way: what the edge
  and the node do with a frame before they decode it;
- ``thread`` (1 "relay" at most, in this process): a task hands a job to a waiting
  thread and sleeps until the thread wakes it (``TrioToken.run_sync_soon``), as a
  write to the SQLite store that its caller waits for does, without the SQL; its
  baseline is a bare checkpoint.

A run relayed by iop-trio crosses two such hops each way (client, edge, node,
engine) where the direct path crosses none (client, engine). So the growth of
the round trip from 0 to 2 relays is the least the edge and the node can add
to a first token on this machine, whatever they do with it: the floor under
``benchmarks/relay.py``'s "added" first token. Each row prints p50 and p99 of
the round trip and, beside the baseline with no relay measured in the same run,
what the relays add (p50). ``--gap-ms G`` waits G ms between round trips, so that every
process sleeps between messages, as each does between the tokens of a run at G ms a
token: the floor of ``relay.py``'s 20 ms rows, where a process that has gone idle must be
woken for each message (at 0, the default, the processes never sleep, as at 0 ms a
token). Figures are printed, never asserted. Every process
started here is ended by its pid; the whole run takes about 20 s.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import trio
import trio_websocket

sys.path.insert(0, str(Path(__file__).resolve().parent))

from relay import free_port, machine_facts, percentile, processes

ROUND_TIMEOUT = 5.0  # one round trip, at most
WARMUP = 200  # round trips not counted, a path


# --- the echo and the relays (each run as this file with --serve) ----------------------------


async def copy(source: trio.SocketStream, sink: trio.SocketStream) -> None:
    while data := await source.receive_some(65536):
        await sink.send_all(data)
    await sink.send_eof()


async def tcp_serve(port: int, upstream: int | None) -> None:
    async def handle(stream: trio.SocketStream) -> None:
        if upstream is None:  # the echo
            await copy(stream, stream)
            return
        onward = await trio.open_tcp_stream("127.0.0.1", upstream)
        for s in (stream, onward):  # as small messages go, without Nagle's delay
            s.setsockopt(6, 1, 1)  # IPPROTO_TCP, TCP_NODELAY
        async with onward, trio.open_nursery() as nursery:
            nursery.start_soon(copy, stream, onward)
            nursery.start_soon(copy, onward, stream)

    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    print("listening", flush=True)
    await trio.serve_listeners(handle, listeners)


async def forward(
    source: trio_websocket.WebSocketConnection, sink: trio_websocket.WebSocketConnection
) -> None:
    while True:
        await sink.send_message(await source.get_message())


async def ws_serve(port: int, upstream: int | None) -> None:
    async def handle(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        try:
            if upstream is None:  # the echo
                while True:
                    await ws.send_message(await ws.get_message())
            url = f"ws://127.0.0.1:{upstream}/"
            async with (
                trio_websocket.open_websocket_url(url) as onward,
                trio.open_nursery() as nursery,
            ):
                nursery.start_soon(forward, ws, onward)
                nursery.start_soon(forward, onward, ws)
        except* trio_websocket.ConnectionClosed:
            pass

    print("listening", flush=True)
    await trio_websocket.serve_websocket(handle, "127.0.0.1", port, ssl_context=None)


# --- the client ---------------------------------------------------------------------------------


async def tcp_rounds(port: int, message: bytes, rounds: int, gap: float = 0.0) -> list[float]:
    times: list[float] = []
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    stream.setsockopt(6, 1, 1)
    async with stream:
        for i in range(WARMUP + rounds):
            if gap:
                await trio.sleep(gap)
            began = time.perf_counter()
            with trio.fail_after(ROUND_TIMEOUT):
                await stream.send_all(message)
                got = 0
                while got < len(message):
                    data = await stream.receive_some(65536)
                    if not data:
                        raise RuntimeError("the echo closed the connection")
                    got += len(data)
            if i >= WARMUP:
                times.append(time.perf_counter() - began)
    return times


async def ws_rounds(port: int, message: bytes, rounds: int, gap: float = 0.0) -> list[float]:
    times: list[float] = []
    async with trio_websocket.open_websocket_url(f"ws://127.0.0.1:{port}/") as ws:
        for i in range(WARMUP + rounds):
            if gap:
                await trio.sleep(gap)
            began = time.perf_counter()
            with trio.fail_after(ROUND_TIMEOUT):
                await ws.send_message(message)
                assert await ws.get_message() == message
            if i >= WARMUP:
                times.append(time.perf_counter() - began)
    return times


async def thread_rounds(hops: int, rounds: int) -> list[float]:
    times: list[float] = []
    token = trio.lowlevel.current_trio_token()
    wakeup = threading.Condition()
    jobs: collections.deque[trio.lowlevel.Task | None] = collections.deque()

    def worker() -> None:
        while True:
            with wakeup:
                while not jobs:
                    wakeup.wait()
                task = jobs.popleft()
            if task is None:
                return
            token.run_sync_soon(trio.lowlevel.reschedule, task)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        for i in range(WARMUP + rounds):
            began = time.perf_counter()
            if hops:
                with wakeup:
                    jobs.append(trio.lowlevel.current_task())
                    wakeup.notify()
                await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
            else:
                await trio.lowlevel.checkpoint()
            if i >= WARMUP:
                times.append(time.perf_counter() - began)
    finally:
        with wakeup:
            jobs.append(None)
            wakeup.notify()
        thread.join(ROUND_TIMEOUT)
    return times


def main(ns: argparse.Namespace) -> int:
    machine_facts(sys.stdout)
    message = os.urandom(ns.size)
    print(
        f"\n{ns.size}-byte messages, one at a time, {ns.rounds} round trips a row "
        f"(after {WARMUP} not counted)" + (f", {ns.gap_ms:g} ms apart" if ns.gap_ms else "") + "\n"
    )
    print(f"{'kind':<7}{'relays':>7}{'p50 us':>10}{'p99 us':>10}{'added p50 us':>14}")
    with tempfile.TemporaryDirectory(prefix="iop-hops-") as tmp, processes() as start:
        for kind in ns.kinds:
            baseline = None
            for hops in ns.hops:
                if kind == "thread":
                    if hops > 1:
                        continue
                    times = trio.run(thread_rounds, hops, ns.rounds)
                    baseline = report(kind, hops, times, baseline)
                    continue
                # the echo, then each relay in front of the one before
                ports = [free_port() for _ in range(hops + 1)]
                started = []
                for i, port in enumerate(ports):
                    upstream = ports[i - 1] if i else None
                    argv = [sys.executable, __file__, "--serve", kind, "--port", str(port)]
                    if upstream is not None:
                        argv += ["--upstream", str(upstream)]
                    log = Path(tmp) / f"{kind}-{hops}-{i}.log"
                    started.append(start(f"{kind}{i}", argv, dict(os.environ), log))
                for proc in started:
                    proc.wait_for("listening")
                rounds = tcp_rounds if kind == "tcp" else ws_rounds
                times = trio.run(rounds, ports[-1], message, ns.rounds, ns.gap_ms / 1000)
                baseline = report(kind, hops, times, baseline)
                for proc in started:
                    proc.popen.terminate()
                for proc in started:
                    proc.popen.wait(timeout=5)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nload average at the end (1, 5, 15 min): {load}")
    return 0


def report(kind: str, hops: int, times: list[float], baseline: float | None) -> float:
    """Print a row; return the baseline (this row's p50 if it is the first)."""
    p50, p99 = percentile(times, 50) * 1e6, percentile(times, 99) * 1e6
    if baseline is None:
        baseline = p50
    added = f"{p50 - baseline:+14.0f}" if hops else f"{'(baseline)':>14}"
    print(f"{kind:<7}{hops:>7}{p50:>10.0f}{p99:>10.0f}{added}", flush=True)
    return baseline


def numbers(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--hops", type=numbers, default=[0, 1, 2])
    parser.add_argument("--size", type=int, default=200)
    parser.add_argument("--kinds", type=lambda t: t.split(","), default=["tcp", "ws", "thread"])
    parser.add_argument("--gap-ms", type=float, default=0.0)
    parser.add_argument("--serve", choices=["tcp", "ws"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.hops[0] != 0 or ns.rounds < 1 or ns.size < 1 or set(ns.kinds) - {"tcp", "ws", "thread"}:
        parser.error("--hops must start with 0 (the baseline); --rounds and --size > 0")
    return ns


if __name__ == "__main__":
    ns = parse(sys.argv[1:])
    if ns.serve:
        serve = tcp_serve if ns.serve == "tcp" else ws_serve
        trio.run(serve, ns.port, ns.upstream)  # until SIGTERM
        sys.exit(0)
    sys.exit(main(ns))
