"""Relaying tokens: a fake OpenAI engine through an edge and a node, beside the engine direct.

    python benchmarks/relay.py [--quick] [--concurrency 1,16,64,256] [--delays-ms 0,20]
                               [--tokens 8,256] [--limit 4] [--window 4] [--store sqlite]
                               [--rev REV] [--cpu-detail] [--node-profile FILE] [--tracing]

Four processes on loopback, each measured alone (CPU time from /proc/<pid>/stat,
utime + stime of all its threads, read at the start and the end of each window):

- the engine: this file run with ``--engine``, a fake OpenAI-compatible server
  on trio and h11. ``POST /v1/chat/completions`` streams server-sent events as
  vLLM does: a chunk with the assistant role, one ``chat.completion.chunk`` per
  token (each ``" tok"``, written on its own after ``delay`` seconds), a chunk
  with ``finish_reason: "stop"``, the usage chunk (``stream_options``) and
  ``data: [DONE]``. Tokens a run and the delay a token are set between
  measurements (``POST /bench/config``); it counts requests in flight and
  reports the peak (``GET /bench/stats``), so the limit L is seen to hold.
  ``GET /v1/models`` lists the one model, for nodes that probe their engines.
- the reference edge: ``iop-node edge`` (one shared token);
- a node: ``iop-node serve`` with a config written to a temporary folder: one
  ``openai`` adapter on the engine, one target ``engine/bench`` at concurrency
  L, the SQLite store there (the default a user has; ``--store memory`` to
  compare), ``queue_timeout`` 600 s so no caller is turned away, metrics on a
  free loopback port, logging at its default (info, text) into a file;
- this process, the client. For each cell (delay a token, tokens a run, C
  callers) it measures two paths the same way, one after the other:

  ``direct``: C callers, each in a loop, POST to the engine with httpx
  (streaming; one ``AsyncClient``) behind a ``trio.Semaphore(L)``, and parse
  the events with the SSE decoder the node's adapter uses and ``json.loads``.

  ``iop``: C callers, each in a loop, submit runs through the edge's
  ``/client`` endpoint over one ``open_runner`` connection (what ``iop-node
  submit`` does) and read the run's events to the terminal one.

  Callers start together; after ``--warmup`` seconds a window of ``--window``
  seconds (at least ``--long-window`` runs' worth of engine time, so a cell
  of 256 tokens at 20 ms is 10.2 s) is measured, then the callers are
  cancelled (leaving the edge cancels their foreground runs) and the next
  measurement waits until the engine and the node are idle and the node and
  the edge quiet (at most 0.02 CPU seconds in 0.5 s). In the window:
  runs/s = runs that ended in it, tokens/s = token text that arrived in it
  (counted by characters, so coalesced deltas count right), time to first
  token (from the call to the first text, queue wait included) of runs whose
  first text came in it, end-to-end of runs that ended in it; CPU seconds a
  process spent in the window per 1,000 tokens the client received in it.
  ``peak`` is the most requests the engine had at once until the window's end
  (not counting the cancellations after it). With C far above L
  and long runs, the window holds only the first waves of queued runs, so
  the latencies there are those of the start of the queue, not of a steady
  state; runs/s and tokens/s are steady-state figures throughout.

Each cell prints direct, iop, and iop/direct: ratios of rates and latencies
and the first-token time the relay adds (p50, ms). At C=1 a last line splits the
first token's time in two, for both paths: from the run's start until the engine
has the request, and from the engine's writing the first token until the client
has it (the engine notes its times on CLOCK_MONOTONIC, which every process on the
machine shares; the n-th request it gets is the n-th run). Where only a few runs end
in a window (256 tokens at 20 ms: 1-8), runs/s moves in steps of a run;
read tokens/s there. Machine facts, the processes' idle CPU and the load
average are printed at the start and the end. Figures are printed, never
asserted. The full matrix takes about 4 minutes; ``--quick`` about 30 s.

``--node-alone RUNS`` measures instead the node's own share of the first token,
with no edge and no WebSocket: RUNS runs one at a time through a node in this
process (the same adapter, the SQLite store) beside httpx straight to the engine.

``--rev REV`` measures a committed revision (``git archive`` of its
``iop_trio`` into a temporary folder, first on PYTHONPATH of every process),
so a before/after comparison needs no checkout. ``--cpu-detail`` adds a line
under each row: each process's share of a core and, for the node and the
edge, the share spent in the kernel and in threads other than the main one
(the SQLite writer, trio's worker threads). ``--node-profile FILE`` runs the
node under cProfile (main thread only; its CPU figures then include the
profiler's). ``--tracing`` starts the edge and the node with tracing on
(``OTEL_TRACES_EXPORTER=console``, ``OTEL_TRACES_SAMPLER=always_on``: every span of
every run is made, batched and written as JSON to their log file in the temporary
folder), so its figures against a run without it are the cost of tracing; without it
every ``OTEL_*`` variable of the environment is dropped, so tracing is off whatever
the shell says. Every process started here is ended by its pid (SIGTERM, then
SIGKILL after a timeout), on errors and Ctrl-C too; the engine also exits
when its parent goes.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import re
import secrets
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager, suppress
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import attrs
import h11
import httpx
import trio

# appended, not inserted: PYTHONPATH (see --rev) decides which iop_trio the processes run
sys.path.append(str(Path(__file__).resolve().parent.parent))

import iop_trio
from iop_trio.adapters.stream_formats import SSEDecoder
from iop_trio.model import EventKind, RunSpec
from iop_trio.transport import RemoteError, RunnerClient, open_runner

ROOT = Path(__file__).resolve().parent.parent
REV_ENV = "RELAY_BENCH_REV"  # set by --rev for the benchmark it runs on the exported code
NODE_BIN = Path(sys.executable).parent / "iop-node"
TOKEN_TEXT = " tok"  # every token the engine sends; its length counts tokens
ADAPTER = "engine"
MODEL = "bench"
TARGET = f"{ADAPTER}/{MODEL}"
PROMPT = "relay benchmark"
CLK_TCK = os.sysconf("SC_CLK_TCK")
START_TIMEOUT = 30.0  # seconds a process may take to come up
STOP_TIMEOUT = 10.0  # seconds between SIGTERM and SIGKILL
SETTLE_TIMEOUT = 60.0  # seconds to wait for the engine and the node to go idle
IDLE_SECONDS = 2.0  # how long the processes' idle CPU is measured
PR_SET_PDEATHSIG = 1
QUIET_SECONDS, QUIET_CPU = 0.5, 0.02  # between measurements: node and edge CPU at most this
MAX_TIMES = 100_000  # request times the engine keeps for --split (a C=1 window has fewer)
#: --tracing: the edge and the node export every span to stdout (their log file)
TRACING_ENV = {"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "always_on"}

# --- the fake engine (its own process: relay.py --engine) --------------------------------


@attrs.define
class EngineState:
    tokens: int = 8
    delay: float = 0.0
    in_flight: int = 0
    peak: int = 0
    requests: int = 0
    tokens_sent: int = 0
    ids: int = 0
    # CLOCK_MONOTONIC (the same in every process) when each completion request came and
    # when its first token went out: what --split pairs with the client's own times
    arrivals: list[float] = attrs.field(factory=list)
    first_tokens: list[float] = attrs.field(factory=list)

    def stats(self) -> dict[str, Any]:
        return {
            "in_flight": self.in_flight,
            "peak": self.peak,
            "requests": self.requests,
            "tokens": self.tokens_sent,
        }


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def chunk(run: str, model: str, delta: dict[str, str], finish: str | None = None) -> bytes:
    return sse(
        {
            "id": run,
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
    )


async def read_request(
    stream: trio.SocketStream, conn: h11.Connection
) -> tuple[h11.Request, bytes] | None:
    """The next request and its body, or None when the client has gone."""
    request: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert request is not None
            return request, bytes(body)
        else:  # ConnectionClosed
            return None


async def send_json(stream: trio.SocketStream, conn: h11.Connection, status: int, obj: Any) -> None:
    data = json.dumps(obj).encode()
    headers = [("content-type", "application/json"), ("content-length", str(len(data)))]
    out = conn.send(h11.Response(status_code=status, headers=headers)) or b""
    out += conn.send(h11.Data(data=data)) or b""
    out += conn.send(h11.EndOfMessage()) or b""
    await stream.send_all(out)


async def stream_completion(
    state: EngineState, stream: trio.SocketStream, conn: h11.Connection, body: bytes
) -> None:
    """One streamed chat completion of ``state.tokens`` tokens, ``state.delay`` s apart."""
    request = json.loads(body)
    model = str(request.get("model", "m"))
    usage = bool((request.get("stream_options") or {}).get("include_usage"))
    tokens, delay = state.tokens, state.delay
    state.ids += 1
    run = f"chatcmpl-bench-{state.ids}"
    piece = chunk(run, model, {"content": TOKEN_TEXT})
    state.requests += 1
    if len(state.arrivals) < MAX_TIMES:
        state.arrivals.append(time.monotonic())
    state.in_flight += 1
    state.peak = max(state.peak, state.in_flight)
    try:
        headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
        head = conn.send(h11.Response(status_code=200, headers=headers)) or b""
        head += conn.send(h11.Data(data=chunk(run, model, {"role": "assistant", "content": ""})))
        await stream.send_all(head)
        for index in range(tokens):
            if delay:
                await trio.sleep(delay)
            if index == 0 and len(state.first_tokens) < MAX_TIMES:
                state.first_tokens.append(time.monotonic())
            await stream.send_all(conn.send(h11.Data(data=piece)) or b"")
            state.tokens_sent += 1
        tail = chunk(run, model, {}, "stop")
        if usage:
            counts = {"prompt_tokens": 5, "completion_tokens": tokens}
            counts["total_tokens"] = 5 + tokens
            tail += sse(
                {
                    "id": run,
                    "object": "chat.completion.chunk",
                    "created": 1700000000,
                    "model": model,
                    "choices": [],
                    "usage": counts,
                }
            )
        tail += b"data: [DONE]\n\n"
        out = conn.send(h11.Data(data=tail)) or b""
        out += conn.send(h11.EndOfMessage()) or b""
        await stream.send_all(out)
    finally:
        state.in_flight -= 1


async def engine_connection(state: EngineState, stream: trio.SocketStream) -> None:
    conn = h11.Connection(h11.SERVER)
    try:
        while True:
            got = await read_request(stream, conn)
            if got is None:
                return
            request, body = got
            path = request.target.split(b"?")[0]
            if path == b"/v1/chat/completions" and request.method == b"POST":
                await stream_completion(state, stream, conn, body)
            elif path == b"/bench/config" and request.method == b"POST":
                config = json.loads(body)
                state.tokens = int(config["tokens"])
                state.delay = float(config["delay"])
                state.peak = state.in_flight
                state.requests = state.tokens_sent = 0
                state.arrivals.clear()
                state.first_tokens.clear()
                await send_json(stream, conn, 200, state.stats())
            elif path == b"/bench/times":
                times = {"arrivals": state.arrivals, "first_tokens": state.first_tokens}
                await send_json(stream, conn, 200, times)
            elif path == b"/v1/models":  # what a node asks to see that the engine is up
                model = {"id": MODEL, "object": "model", "owned_by": "relay-bench"}
                await send_json(stream, conn, 200, {"object": "list", "data": [model]})
            elif path == b"/bench/stats":
                await send_json(stream, conn, 200, state.stats())
            else:
                await send_json(stream, conn, 404, {"error": {"message": "no such path"}})
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
        return
    finally:
        await trio.aclose_forcefully(stream)


async def engine_main() -> None:
    parent = os.getppid()
    state = EngineState()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    print(f"engine listening on 127.0.0.1:{port}", flush=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            partial(trio.serve_listeners, partial(engine_connection, state)), listeners
        )
        while True:
            if os.getppid() != parent:  # the benchmark went away: so do we
                nursery.cancel_scope.cancel()
                return
            await trio.sleep(0.5)


# --- processes -----------------------------------------------------------------------------


def cpu_times(pid: int, thread: int | None = None) -> tuple[float, float]:
    """(utime, stime) in seconds of process ``pid`` (all its threads, those gone too),
    or of one ``thread`` of it."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    with open(path, "rb") as stat:
        data = stat.read()
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@attrs.define
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tail(self, lines: int = 20) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(f"  {self.name}| {line}" for line in text[-lines:])

    def wait_for(self, pattern: str, timeout: float = START_TIMEOUT) -> re.Match[str]:
        """Poll the process's log until ``pattern`` shows (bounded in time)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.log.read_text(errors="replace"))
            if match:
                return match
            if self.popen.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(
            f"{self.name} (pid {self.pid}) did not say {pattern!r} "
            f"(exit code {self.popen.poll()}):\n{self.tail()}"
        )


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the benchmark dies (Linux's PR_SET_PDEATHSIG)."""
    with suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@contextmanager
def processes() -> Iterator[Callable[..., Proc]]:
    """Yields ``start(name, argv, env, log)``; every process started ends with the block."""
    started: list[Proc] = []

    def start(name: str, argv: Sequence[str], env: dict[str, str], log: Path) -> Proc:
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                list(argv),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                cwd=log.parent,
                # Ctrl-C is ours to handle (we end them in order); if we are killed, so are they
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        proc = Proc(name, popen, log)
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in reversed(started):  # the node first, the engine last
            if proc.popen.poll() is None:
                with suppress(ProcessLookupError):
                    proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        for proc in reversed(started):
            try:
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"{proc.name} (pid {proc.pid}) ignored SIGTERM: killed", file=sys.stderr)
                with suppress(ProcessLookupError):
                    proc.popen.kill()
                proc.popen.wait(timeout=STOP_TIMEOUT)


def node_config(folder: Path, *, edge_port: int, engine_port: int, limit: int, store: str) -> Path:
    path = folder / "node.yaml"
    path.write_text(
        f"""\
node_id: relay-bench
edge:
  url: ws://127.0.0.1:{edge_port}/node
  backoff_initial: 0.05
  backoff_max: 0.5
store:
  kind: {store}
  path: {folder / "node.db"}
runtime:
  queue_timeout: 600
  drain_timeout: 2
adapters:
  {ADAPTER}:
    kind: openai
    base_url: http://127.0.0.1:{engine_port}
targets:
  - adapter: {ADAPTER}
    model: {MODEL}
    concurrency: {limit}
metrics:
  listen: 127.0.0.1:{free_port()}
"""
    )
    return path


# --- measuring -----------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile; nan if there are none."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = min(max(1, math.ceil(q / 100 * len(ordered))), len(ordered))
    return ordered[rank - 1]


@attrs.define
class Tally:
    """What the callers saw in the window [start, end) (trio clock)."""

    start: float
    end: float
    expected_chars: int
    chars: int = 0
    runs: int = 0
    started: int = 0
    ttft: list[float] = attrs.field(factory=list)
    e2e: list[float] = attrs.field(factory=list)
    failures: list[str] = attrs.field(factory=list)
    # every run's start, in order, and the time of its first text (trio clock)
    starts: list[float] = attrs.field(factory=list)
    first_texts: dict[float, float] = attrs.field(factory=dict)

    def _in(self, now: float) -> bool:
        return self.start <= now < self.end

    def begin(self) -> float:
        """A run starts now: its start time."""
        now = trio.current_time()
        self.starts.append(now)
        return now

    def text(self, began: float, first: bool, size: int) -> None:
        now = trio.current_time()
        if first:
            self.first_texts[began] = now
        if self._in(now):
            self.chars += size
            if first:
                self.ttft.append(now - began)

    def ended(self, began: float, chars: int, problem: str | None) -> None:
        now = trio.current_time()
        if problem is None and chars != self.expected_chars:
            problem = (
                f"{chars // len(TOKEN_TEXT)} tokens, not {self.expected_chars // len(TOKEN_TEXT)}"
            )
        if problem is not None:
            self.failures.append(problem)
        elif self._in(now):
            self.runs += 1
            self.e2e.append(now - began)


@attrs.frozen
class Figures:
    window: float
    runs: int
    tokens: float
    ttft: Sequence[float]
    e2e: Sequence[float]
    cpu: dict[str, float]  # process -> CPU seconds in the window
    peak: int
    failures: Sequence[str]
    # C=1 only: a run's start to the engine's having its request, and the engine's
    # writing the first token to the client's having it (seconds)
    to_engine: Sequence[float] = ()
    from_engine: Sequence[float] = ()

    @property
    def runs_s(self) -> float:
        return self.runs / self.window

    @property
    def tokens_s(self) -> float:
        return self.tokens / self.window

    def detail(self) -> str:
        """Where the CPU went in the window: % of a core per process; for node and edge,
        the share in the kernel and outside the main (trio) thread."""
        parts = []
        for name in CPU_COLUMNS:
            if name not in self.cpu:
                continue
            used = self.cpu[name]
            part = f"{name} {used / self.window * 100:.0f}%"
            if f"{name}.sys" in self.cpu and used > 0 and name in ("node", "edge"):
                system = self.cpu[f"{name}.sys"] / used * 100
                others = (used - self.cpu[f"{name}.main"]) / used * 100
                part += f" (sys {system:.0f}%, other threads {others:.0f}%)"
            parts.append(part)
        total = sum(self.cpu.get(name, 0.0) for name in CPU_COLUMNS) / self.window * 100
        return f"% of a core: {', '.join(parts)}; together {total:.0f}%"

    def per_1k(self, process: str) -> float:
        if process not in self.cpu or not self.tokens:
            return math.nan
        return self.cpu[process] / self.tokens * 1000


@attrs.define
class Bench:
    """The processes and their addresses, and the measurement settings."""

    engine_url: str
    edge_url: str  # the /client endpoint
    metrics_url: str
    token: str
    pids: dict[str, int]
    limit: int
    warmup: float
    window: float
    long_window: float
    max_runs: int
    control: httpx.AsyncClient

    async def engine(self, path: str, body: Any = None) -> dict[str, Any]:
        if body is None:
            response = await self.control.get(self.engine_url + path)
        else:
            response = await self.control.post(self.engine_url + path, json=body)
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    async def node_live_runs(self) -> int:
        response = await self.control.get(self.metrics_url, params={"name[]": "iop_node_live_runs"})
        match = re.search(r"^iop_node_live_runs\s+(\S+)", response.text, re.M)
        return int(float(match.group(1))) if match else -1

    async def settle(self) -> None:
        """Wait (bounded) until no request is at the engine, no run is live on the node,
        and the node and the edge are quiet (what a cancelled backlog leaves them to do)."""
        busy: dict[str, float] = {}
        with trio.move_on_after(SETTLE_TIMEOUT) as scope:
            while True:
                engine = await self.engine("/bench/stats")
                live = await self.node_live_runs()
                if engine["in_flight"] == 0 and live == 0:
                    break
                await trio.sleep(0.05)
            while True:
                before = self.cpu()
                await trio.sleep(QUIET_SECONDS)
                after = self.cpu()
                busy = {p: after[p] - before[p] for p in ("node", "edge")}
                if max(busy.values()) <= QUIET_CPU:
                    return
        if scope.cancelled_caught:
            print(
                f"  (not idle after {SETTLE_TIMEOUT:g}s: engine {engine}, node live {live}, "
                f"cpu seconds in the last {QUIET_SECONDS:g}s {busy})"
            )

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far: each process's, and its user, system and main thread's."""
        now = {}
        for name, pid in self.pids.items():
            user, system = cpu_times(pid)
            now[name], now[f"{name}.user"], now[f"{name}.sys"] = user + system, user, system
            now[f"{name}.main"] = sum(cpu_times(pid, pid))
        now["client"] = time.process_time()
        return now

    async def measure(
        self,
        tokens: int,
        delay: float,
        callers: int,
        connect: Callable[[], AbstractAsyncContextManager[Callable[[Tally], Awaitable[None]]]],
    ) -> Figures:
        """``callers`` loops of one run each for warmup + window seconds, then cancelled.

        ``connect`` opens the path's connection and yields ``one(tally)``, a run; the
        connection is closed (which cancels what is left of the runs) before the
        engine and the node are waited for to go idle.
        """
        await self.settle()
        await self.engine("/bench/config", {"tokens": tokens, "delay": delay})
        window = max(self.window, self.long_window * tokens * delay)
        cpu: dict[str, dict[str, float]] = {}
        stats: dict[str, Any] = {}
        async with connect() as one:
            now = trio.current_time()
            tally = Tally(now + self.warmup, now + self.warmup + window, tokens * len(TOKEN_TEXT))

            async def caller() -> None:
                while trio.current_time() < tally.end and tally.started < self.max_runs:
                    tally.started += 1
                    await one(tally)

            async def clock(cancel: trio.CancelScope) -> None:
                await trio.sleep_until(tally.start)
                cpu["start"] = self.cpu()
                await trio.sleep_until(tally.end)
                cpu["end"] = self.cpu()
                # the peak before the callers leave: cancelled runs end at the engine
                # only at its next write, after the node may have started the next ones
                stats.update(await self.engine("/bench/stats"))
                cancel.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(clock, nursery.cancel_scope)
                for _ in range(callers):
                    nursery.start_soon(caller)
            if "end" not in cpu:  # every caller stopped early (max_runs): a shorter window
                cpu["end"] = self.cpu()
                tally.end = trio.current_time()
            cpu.setdefault("start", cpu["end"])
            if not stats:
                stats.update(await self.engine("/bench/stats"))
        to_engine: list[float] = []
        from_engine: list[float] = []
        if callers == 1:  # one run at a time: the n-th request the engine got is the n-th run's
            times = await self.engine("/bench/times")
            to_engine, from_engine = split_ttft(tally, times["arrivals"], times["first_tokens"])
        await self.settle()
        return Figures(
            to_engine=to_engine,
            from_engine=from_engine,
            window=max(tally.end - tally.start, 1e-9),
            runs=tally.runs,
            tokens=tally.chars / len(TOKEN_TEXT),
            ttft=tally.ttft,
            e2e=tally.e2e,
            cpu={k: cpu["end"][k] - cpu["start"][k] for k in cpu["end"]},
            peak=int(stats["peak"]),
            failures=tally.failures,
        )

    async def direct(self, tokens: int, delay: float, callers: int) -> Figures:
        gate = trio.Semaphore(self.limit)
        url = self.engine_url + "/v1/chat/completions"
        body = json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": PROMPT}],
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        headers = {"content-type": "application/json"}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)

        @asynccontextmanager
        async def connect() -> AsyncIterator[Callable[[Tally], Awaitable[None]]]:
            async with httpx.AsyncClient(timeout=60, limits=limits) as http:

                async def one(tally: Tally) -> None:
                    began = tally.begin()
                    chars = 0
                    try:
                        async with (
                            gate,
                            http.stream("POST", url, content=body, headers=headers) as response,
                        ):
                            if response.status_code != 200:
                                tally.ended(began, chars, f"HTTP {response.status_code}")
                                return
                            problem = await read_sse(response, tally, began)
                            chars = problem[1]
                    except httpx.HTTPError as exc:
                        tally.ended(began, chars, f"{type(exc).__name__}: {exc}")
                        return
                    tally.ended(began, chars, problem[0])

                yield one

        return await self.measure(tokens, delay, callers, connect)

    async def iop(self, tokens: int, delay: float, callers: int) -> Figures:
        spec = RunSpec(TARGET, PROMPT)

        @asynccontextmanager
        async def connect() -> AsyncIterator[Callable[[Tally], Awaitable[None]]]:
            async with open_runner(self.edge_url, token=self.token) as client:

                async def one(tally: Tally) -> None:
                    began = tally.begin()
                    chars = 0
                    try:
                        async with client.run(spec) as stream:
                            async for event in stream:
                                if event.text:
                                    tally.text(began, not chars, len(event.text))
                                    chars += len(event.text)
                            last = stream.last
                    except RemoteError as exc:
                        tally.ended(began, chars, f"refused: {exc}")
                        return
                    ok = last is not None and last.kind is EventKind.SUCCEEDED
                    tally.ended(began, chars, None if ok else f"ended {last}")

                yield one

        return await self.measure(tokens, delay, callers, connect)


def split_ttft(
    tally: Tally, arrivals: Sequence[float], first_tokens: Sequence[float]
) -> tuple[list[float], list[float]]:
    """Pair each run (one at a time) with the engine's times for the same request: the
    part of its first-token time on the way to the engine and on the way back.

    The engine's times are CLOCK_MONOTONIC, the clock of ``time.monotonic`` in every
    process; trio's is ``perf_counter`` (CLOCK_MONOTONIC on Linux) plus an offset."""
    offset = trio.current_time() - time.perf_counter()
    to_engine, from_engine = [], []
    for began, arrived, written in zip(tally.starts, arrivals, first_tokens, strict=False):
        first = tally.first_texts.get(began)
        if first is not None and tally.start <= first < tally.end:
            to_engine.append(arrived - (began - offset))
            from_engine.append((first - offset) - written)
    return to_engine, from_engine


async def read_sse(
    response: httpx.Response, tally: Tally, began: float, *, finish_reason: str = "stop"
) -> tuple[str | None, int]:
    """Read a streamed chat completion as a client does; (what was wrong or None, chars).
    A stream that ends with another ``finish_reason`` than the one given is wrong."""
    decoder = SSEDecoder()
    finish = ""
    chars = 0
    problem: str | None = "no [DONE]"
    async for data in response.aiter_bytes():
        for event in decoder.feed(data):
            if event.data == "[DONE]":
                problem = None if finish == finish_reason else f"finish_reason {finish!r}"
                continue
            choices = json.loads(event.data).get("choices")
            if not choices:
                continue
            finish = choices[0].get("finish_reason") or finish
            text = choices[0]["delta"].get("content")
            if text:
                tally.text(began, not chars, len(text))
                chars += len(text)
    return problem, chars


async def wait_for_node(bench: Bench) -> float:
    """Retry a run through the edge until one succeeds (bounded); the seconds it took."""
    await bench.engine("/bench/config", {"tokens": 8, "delay": 0.0})
    began = trio.current_time()
    last_error: Exception | None = None
    with trio.move_on_after(START_TIMEOUT):
        async with open_runner(bench.edge_url, token=bench.token) as client:
            while True:
                try:
                    if await _one_run(client):
                        return trio.current_time() - began
                except RemoteError as exc:  # no node serves the target yet
                    last_error = exc
                await trio.sleep(0.1)
    raise RuntimeError(f"no run succeeded through the edge in {START_TIMEOUT:g}s: {last_error}")


async def _one_run(client: RunnerClient) -> bool:
    async with client.run(RunSpec(TARGET, PROMPT)) as stream:
        text, last = await stream.collect()
    if last.kind is not EventKind.SUCCEEDED:
        raise RuntimeError(f"the first run ended {last.kind.value}: {last.reason} {last.message}")
    return text == TOKEN_TEXT * 8


# --- printing ------------------------------------------------------------------------------

CPU_COLUMNS = ("node", "edge", "engine", "client")
HEADER = (
    f"{'ms/tok':>6} {'tok':>4} {'C':>4}  {'path':<10} {'runs/s':>9} {'tok/s':>9}"
    f" {'ttft p50':>9} {'ttft p99':>9} {'e2e p50':>9} {'e2e p99':>9}"
    + "".join(f" {name:>7}" for name in CPU_COLUMNS)
    + f" {'peak':>5} {'runs':>6}"
)
UNITS = (
    f"{'':>6} {'':>4} {'':>4}  {'':<10} {'':>9} {'':>9}"
    f" {'ms':>9} {'ms':>9} {'ms':>9} {'ms':>9}" + f" {'cpu seconds per 1,000 tokens':>31}"
)


def fmt(value: float, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if math.isnan(value) else f"{value:>{width}{spec}}"


def row(cell: str, path: str, f: Figures) -> str:
    lat = [percentile(f.ttft, 50), percentile(f.ttft, 99), percentile(f.e2e, 50)]
    lat.append(percentile(f.e2e, 99))
    line = (
        f"{cell}  {path:<10} {f.runs_s:>9,.2f} {f.tokens_s:>9,.0f}"
        + "".join(fmt(v * 1000, ",.1f", 10) for v in lat)
        + "".join(fmt(f.per_1k(p), ".3f", 8) for p in CPU_COLUMNS)
        + f" {f.peak:>5} {f.runs:>6}"
    )
    if f.failures:
        line += f"  ({len(f.failures)} failed, e.g. {f.failures[0]})"
    return line


def ratio_row(cell: str, direct: Figures, iop: Figures) -> str:
    def rate(a: float, b: float) -> str:
        return f"{a / b:>9.3f}" if b else f"{'-':>9}"

    def slower(a: Sequence[float], b: Sequence[float], q: float) -> str:
        pa, pb = percentile(a, q), percentile(b, q)
        return f"{'-':>10}" if math.isnan(pa) or math.isnan(pb) or not pb else f"{pa / pb:>9.2f}x"

    added = (percentile(iop.ttft, 50) - percentile(direct.ttft, 50)) * 1000
    return (
        f"{cell}  {'iop/direct':<10} {rate(iop.runs_s, direct.runs_s)}"
        f" {rate(iop.tokens_s, direct.tokens_s)}"
        f"{slower(iop.ttft, direct.ttft, 50)}{slower(iop.ttft, direct.ttft, 99)}"
        f"{slower(iop.e2e, direct.e2e, 50)}{slower(iop.e2e, direct.e2e, 99)}"
        f"   ttft p50 {added:+,.1f} ms"
    )


def split_row(direct: Figures, iop: Figures) -> str:
    """Where the first token's time goes at C=1: the way to the engine and back (p50)."""

    def ms(values: Sequence[float]) -> str:
        return f"{percentile(values, 50) * 1000:.2f} ms"

    return (
        f"{'':>18}first token p50: to the engine {ms(iop.to_engine)} "
        f"(direct {ms(direct.to_engine)}), from its first token {ms(iop.from_engine)} "
        f"(direct {ms(direct.from_engine)})"
    )


def git(*args: str) -> str:
    """A read-only git command in the repository; its output, or "?"."""
    try:
        done = subprocess.run(
            ["git", "--no-optional-locks", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "?"
    return done.stdout.strip()


def machine_facts(out: TextIO) -> None:
    model = ""
    with suppress(OSError), open("/proc/cpuinfo") as info:
        names = (line.split(":", 1)[1] for line in info if line.startswith("model name"))
        model = next(names, "").strip()
    package = Path(iop_trio.__file__).resolve().parent
    if package.parent == ROOT:
        head = git("log", "-1", "--format=%h %cs %s")
        changed = sum(1 for line in git("status", "--porcelain", "--", "iop_trio").splitlines())
        head += f"; files changed in iop_trio/ of the working tree: {changed}"
    else:
        head = f"iop_trio from {package} ({os.environ.get(REV_ENV, 'PYTHONPATH')})"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    out.write(
        f"machine: {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), {model}; "
        f"{platform.system()} {platform.release()}\n"
        f"python {sys.version.split()[0]}, trio {trio.__version__}, "
        f"h11 {getattr(h11, '__version__', '?')}, "
        f"httpx {httpx.__version__}, sqlite {sqlite3.sqlite_version}\n"
        f"code: {head}\n"
        f"load average at start (1, 5, 15 min): {load}\n"
    )


# --- main ----------------------------------------------------------------------------------


async def run_matrix(bench: Bench, ns: argparse.Namespace, store: str) -> None:
    took = await wait_for_node(bench)
    print(f"node connected; first run through the edge after {took:.2f}s")
    # warm both paths up (connections, imports, caches); not reported
    await bench.direct(8, 0.0, 16)
    await bench.iop(8, 0.0, 16)
    await bench.settle()
    before = bench.cpu()
    await trio.sleep(IDLE_SECONDS)
    after = bench.cpu()
    idle = ", ".join(
        f"{name} {(after[name] - before[name]) / IDLE_SECONDS * 100:.1f}%" for name in bench.pids
    )
    print(f"idle CPU over {IDLE_SECONDS:g}s, % of a core: {idle}")
    print(
        f"\nL={bench.limit} (target concurrency; direct: trio.Semaphore(L)); {store} store; "
        f"warmup {bench.warmup:g}s, window {bench.window:g}s (or {bench.long_window:g} runs' "
        f"engine time if longer); token {TOKEN_TEXT!r}\n"
    )
    print(HEADER)
    print(UNITS)
    for delay_ms in ns.delays_ms:
        for tokens in ns.tokens:
            for c in ns.concurrency:
                cell = f"{delay_ms:>6g} {tokens:>4} {c:>4}"
                direct = await bench.direct(tokens, delay_ms / 1000, c)
                print(row(cell, "direct", direct))
                if ns.cpu_detail:
                    print(f"{'':>18}{direct.detail()}")
                iop = await bench.iop(tokens, delay_ms / 1000, c)
                print(row(cell, "iop", iop))
                if ns.cpu_detail:
                    print(f"{'':>18}{iop.detail()}")
                print(ratio_row(cell, direct, iop))
                if direct.to_engine and iop.to_engine:
                    print(split_row(direct, iop))
            print()


@attrs.frozen
class Stack:
    """The three processes on loopback, and how to reach them."""

    engine: Proc
    edge: Proc
    node: Proc
    engine_url: str
    edge_url: str  # the /client endpoint
    metrics_url: str
    token: str
    folder: Path

    def bench(self, ns: argparse.Namespace, control: httpx.AsyncClient) -> Bench:
        return Bench(
            engine_url=self.engine_url,
            edge_url=self.edge_url,
            metrics_url=self.metrics_url,
            token=self.token,
            pids={"node": self.node.pid, "edge": self.edge.pid, "engine": self.engine.pid},
            limit=ns.limit,
            warmup=ns.warmup,
            window=ns.window,
            long_window=ns.long_window,
            max_runs=ns.max_runs,
            control=control,
        )


def start_engine(start: Callable[..., Proc], env: dict[str, str], folder: Path) -> tuple[Proc, int]:
    """Start the fake engine (this file with ``--engine``); it and the port it listens on."""
    engine = start(
        "engine",
        [sys.executable, str(Path(__file__).resolve()), "--engine"],
        env,
        folder / "engine.log",
    )
    return engine, int(engine.wait_for(r"engine listening on 127\.0\.0\.1:(\d+)").group(1))


@contextmanager
def stack(
    *,
    limit: int,
    store: str = "sqlite",
    node_profile: str | None = None,
    tracing: bool = False,
) -> Iterator[Stack]:
    """Start the engine, the edge and the node (in a temporary folder); end them after.
    With ``tracing``, the edge and the node trace every run to their log (stdout)."""
    token = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="iop-relay-") as tmp, processes() as start:
        folder = Path(tmp)
        base_env = {k: v for k, v in os.environ.items() if not k.startswith(("IOP_", "OTEL_"))}
        engine, engine_port = start_engine(start, base_env, folder)
        traced = dict(TRACING_ENV) if tracing else {}
        if tracing:
            print(
                "tracing on in the edge and the node: "
                + ", ".join(f"{k}={v}" for k, v in TRACING_ENV.items())
                + f" (spans to {folder}/edge.log and node.log)"
            )
        edge_port = free_port()
        edge = start(
            "edge",
            [str(NODE_BIN), "edge", "--listen", f"127.0.0.1:{edge_port}"],
            {**base_env, **traced, "IOP_EDGE_TOKEN": token},
            folder / "edge.log",
        )
        edge.wait_for(r"edge listening on")
        config = node_config(
            folder, edge_port=edge_port, engine_port=engine_port, limit=limit, store=store
        )
        metrics = re.search(r"listen: (127\.0\.0\.1:\d+)", config.read_text())
        assert metrics is not None
        if node_profile:
            profile = ["-m", "cProfile", "-o", str(Path(node_profile).resolve())]
            argv = [sys.executable, *profile, "-m", "iop_trio.cli", "serve"]
            print("the node runs under cProfile (its CPU figures include the profiler's)")
        else:
            argv = [str(NODE_BIN), "serve"]
        node = start(
            "node",
            [*argv, "--config", str(config)],
            {**base_env, **traced, "IOP_EDGE__TOKEN": token},
            folder / "node.log",
        )
        node.wait_for(r"node relay-bench serving")
        try:
            yield Stack(
                engine,
                edge,
                node,
                engine_url=f"http://127.0.0.1:{engine_port}",
                edge_url=f"ws://127.0.0.1:{edge_port}/client",
                metrics_url=f"http://{metrics.group(1)}/metrics",
                token=token,
                folder=folder,
            )
        except BaseException:
            for proc in (engine, edge, node):
                if proc.popen.poll() is not None:
                    print(f"{proc.name} exited {proc.popen.returncode}:\n{proc.tail()}")
            raise


async def node_alone(engine_url: str, folder: Path, runs: int, delay: float) -> None:
    """The node's own share of the first token, with no edge and no WebSocket: ``runs``
    runs one at a time through a node in this process (the openai adapter on the same
    engine, the SQLite store), beside httpx straight to the engine; p50 of the time until
    the engine has the request (from the call to ``submit``, or to httpx's request) and
    of the time from the engine's first token until the run's watcher (or httpx's
    response) has it."""
    from iop_trio.adapters.openai import OpenAIAdapter, OpenAISettings
    from iop_trio.model import TargetSpec
    from iop_trio.runtime import Node
    from iop_trio.store.sqlite import SqliteStore

    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "stream": True}
    async with httpx.AsyncClient(timeout=30) as http:

        async def configure() -> Tally:
            config = {"tokens": 2, "delay": delay}
            (await http.post(engine_url + "/bench/config", json=config)).raise_for_status()
            return Tally(-math.inf, math.inf, expected_chars=2 * len(TOKEN_TEXT))

        async def halves(tally: Tally) -> tuple[float, float]:
            """p50 (ms) of the way to the engine and of the way back (see split_ttft)."""
            times = (await http.get(engine_url + "/bench/times")).json()
            to, back = split_ttft(tally, times["arrivals"], times["first_tokens"])
            return percentile(to, 50) * 1e3, percentile(back, 50) * 1e3

        tally = await configure()
        for _ in range(runs):
            began = tally.begin()
            async with http.stream("POST", engine_url + "/v1/chat/completions", json=body) as r:
                await read_sse(r, tally, began)
        d_to, d_back = await halves(tally)
        tally = await configure()
        adapter = OpenAIAdapter(ADAPTER, OpenAISettings(base_url=engine_url))
        node = Node(
            node_id="alone",
            adapters=[adapter],
            targets=[TargetSpec(ADAPTER, MODEL, concurrency=4)],
            store=SqliteStore(folder / "alone.db"),
        )
        async with node.running():
            for _ in range(runs):
                began = tally.begin()
                submitted = await node.manager.submit(RunSpec(TARGET, PROMPT))
                chars = 0
                async for event in node.manager.watch(submitted.record.run_id, after_seq=1):
                    if event.text:
                        tally.text(began, not chars, len(event.text))
                        chars += len(event.text)
        n_to, n_back = await halves(tally)
    print(
        f"node alone, {runs} runs one at a time, {delay * 1e3:g} ms a token, p50:\n"
        f"  to the engine:        direct {d_to:.2f} ms, node {n_to:.2f} ms "
        f"({n_to - d_to:+.2f})\n"
        f"  from its first token: direct {d_back:.2f} ms, node {n_back:.2f} ms "
        f"({n_back - d_back:+.2f})"
    )


def main(ns: argparse.Namespace) -> int:
    machine_facts(sys.stdout)
    if ns.node_alone:
        with tempfile.TemporaryDirectory(prefix="iop-relay-") as tmp, processes() as start:
            _, port = start_engine(start, dict(os.environ), Path(tmp))
            for delay in ns.delays_ms:
                trio.run(
                    node_alone, f"http://127.0.0.1:{port}", Path(tmp), ns.node_alone, delay / 1e3
                )
        return 0
    try:
        with stack(
            limit=ns.limit, store=ns.store, node_profile=ns.node_profile, tracing=ns.tracing
        ) as procs:

            async def go() -> None:
                async with httpx.AsyncClient(timeout=30) as control:
                    await run_matrix(procs.bench(ns, control), ns, ns.store)

            trio.run(go)
    finally:
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"load average at end (1, 5, 15 min): {load}")
    return 0


def run_at_rev(rev: str, argv: list[str], script: Path | None = None) -> int:
    """Run ``script`` (this benchmark by default) with ``argv`` less its --rev on ``rev``'s
    iop_trio; its exit code."""
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--rev":
            skip = True
        elif not arg.startswith("--rev="):
            rest.append(arg)
    what = git("log", "-1", "--format=%h %cs %s", rev)
    with tempfile.TemporaryDirectory(prefix="iop-relay-code-") as code:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", rev, "iop_trio"], cwd=ROOT, capture_output=True
        )
        if archive.returncode != 0:
            print(f"git archive {rev}: {archive.stderr.decode().strip()}", file=sys.stderr)
            return 2
        subprocess.run(["tar", "-x", "-C", code], input=archive.stdout, check=True)
        path = os.pathsep.join(p for p in (code, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, REV_ENV: f"git archive of {rev}: {what}"}
        # Ctrl-C reaches the benchmark too, which ends its processes; wait for it. SIGTERM
        # is passed on as Ctrl-C; if this process is killed, the benchmark gets SIGTERM.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        child = subprocess.Popen(
            [sys.executable, str((script or Path(__file__)).resolve()), *rest],
            env=env,
            preexec_fn=_die_with_parent,
        )
        signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGINT))
        return child.wait()


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM is taken as Ctrl-C, which trio delivers where it is safe to."""
    os.kill(os.getpid(), signal.SIGINT)


def interrupted(exc: BaseException) -> bool:
    """``exc`` is Ctrl-C (or SIGTERM), alone or in a group."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(KeyboardInterrupt) is not None
    return isinstance(exc, KeyboardInterrupt)


def numbers(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda text: [kind(part) for part in text.split(",") if part.strip()]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="C=1,16, 8 tokens, 1.5 s windows")
    parser.add_argument("--concurrency", type=numbers(int), default=[1, 16, 64, 256])
    parser.add_argument("--delays-ms", type=numbers(float), default=[0.0, 20.0])
    parser.add_argument("--tokens", type=numbers(int), default=[8, 256])
    parser.add_argument("--limit", type=int, default=4, help="L: the target's concurrency")
    parser.add_argument("--store", choices=("sqlite", "memory"), default="sqlite")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds before a window")
    parser.add_argument("--window", type=float, default=4.0, help="seconds measured a cell")
    parser.add_argument(
        "--long-window", type=float, default=2.0, help="a window is at least this many runs long"
    )
    parser.add_argument("--max-runs", type=int, default=100_000, help="runs a measurement")
    parser.add_argument(
        "--cpu-detail",
        action="store_true",
        help="under each row: %% of a core per process, and for node and edge the share "
        "in the kernel and in threads other than the main one",
    )
    parser.add_argument(
        "--node-profile",
        metavar="FILE",
        help="run the node under cProfile (main thread), stats to FILE when it stops",
    )
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="trace every run in the edge and the node (console exporter to their logs, "
        "always_on sampler), to measure tracing's cost against a run without it",
    )
    parser.add_argument(
        "--node-alone",
        type=int,
        metavar="RUNS",
        help="instead of the matrix: RUNS runs one at a time through a node in this process "
        "(no edge, no WebSocket) beside httpx straight to the engine, at each --delays-ms: "
        "the node's own share of the first token",
    )
    parser.add_argument(
        "--rev",
        help="measure this git revision's iop_trio (exported with git archive, on PYTHONPATH "
        "for every process) instead of the working tree's",
    )
    ns = parser.parse_args()
    if ns.rev:
        sys.exit(run_at_rev(ns.rev, sys.argv[1:]))
    if ns.engine:
        trio.run(engine_main)
        sys.exit(0)
    if ns.quick:
        ns.concurrency, ns.tokens, ns.window, ns.warmup = [1, 16], [8], 1.5, 0.3
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started ignoring it
    signal.signal(signal.SIGTERM, _interrupt)  # so the processes are ended on SIGTERM too
    try:
        sys.exit(main(ns))
    except BaseException as exc:
        if not interrupted(exc):
            raise
        print("interrupted", file=sys.stderr)
        sys.exit(130)
