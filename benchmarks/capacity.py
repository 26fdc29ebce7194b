"""Capacity: the node's gate on a mixed load, in front of a simulated continuous-batching engine.

    python benchmarks/capacity.py [--configs static-4,static-64,...] [--phase-seconds 30]
                                  [--warmup 5] [--clients 48] [--quick] [--list]
                                  [--engine-args "--base-ms 40"] [--rev REV]

Issue 20's workload. For each *configuration* of the node's target (a named YAML
fragment in :data:`CONFIGS`; ``--list`` prints them) this starts, on loopback:

- the engine: ``benchmarks/sim_engine.py`` (its docstring says what it models), with
  a KV cache of 4,096 tokens and its default step law, plus the configuration's own
  engine options (``auto-latency`` starts it without metrics);
- ``iop-node edge`` with its OpenAI-compatible door (``--openai-listen``; one shared
  token);
- ``iop-node serve``: one ``openai`` adapter on the engine, one target
  ``engine/bench`` with the configuration's fragment, the node-wide limit far above
  it (1,024) so that only the fragment bounds the runs, ``queue_timeout`` 600 s so no
  caller is turned away, the SQLite store, logs into a file;
- this process: ``--clients`` (48) streaming clients, each in a loop, POSTing
  ``/v1/chat/completions`` to the door (``stream``, ``stream_options.include_usage``,
  one httpx client), started 20 ms apart (arrivals spread over the warm-up's first
  second rather than one burst).

Three phases, one after the other on the same processes: ``short`` (40-word prompts:
60 prompt tokens with the chat template, ``max_tokens`` 24), ``long`` (900 words:
1,206 tokens, ``max_tokens`` 124), ``short`` again, each ``--warmup`` seconds that are
not measured, then ``--phase-seconds`` that are. The clients are cancelled at the end
of each phase (the door cancels their runs, the engine frees their cache) and the next
phase waits until the engine and the node are idle: a phase starts from an empty
engine but from the node as the phases before left it, so a gate that learns (``auto``)
carries what it learned into the next phase, and short runs after long ones show
whether it unlearns. The figures of a phase:

- ``tok/s``: tokens the engine generated in the window by its own counter, over its
  own clock (``POST /bench/reset`` at the window's start and end);
- ``waiting``: the time-average of requests waiting inside the engine (for KV cache)
  in the window, integrated by the engine over every change; ``running``: of those in
  its batch; ``kv``: the time-average share of its cache reserved;
- ``runs``: runs whose stream ended in the window (``finish_reason: "length"`` and
  ``[DONE]``) at the clients; ``ttft``: p50 of the time from a client's request to its
  first token, of the runs whose first token came in the window (queueing included);
- ``node``, ``edge``, ``eng``, ``cli``: CPU of each process in the window, % of a
  core (``/proc/<pid>/stat``; the clients: this process);
- ``lag``: how late the engine's step loop woke, mean ms a step (a loop late by less
  than a step catches up; more would be lost time, ``lost`` in the note). The
  engine's law holds while this is small beside its step (80-160 ms): then the engine,
  not the relay, is what bounds the figures.

Then, for each phase, each configuration's tokens/s against the best ``static-*``
configuration of the same run and phase, and issue 20's targets: at least 0.85x the
best static, and at most 1.0 request waiting inside the engine on average. A
configuration whose fragment the node refuses (``iop-node check-config``) is skipped
with the node's reason (a revision older than issue 20 has no ``auto`` or
``token_budget``). Figures are printed, never asserted; machine facts and the load
average are printed at the start, before each configuration and at the end. Every
process started here is ended by its pid (SIGTERM, then SIGKILL), on errors and
Ctrl-C too. The default run (all 8 configurations, 30 s phases) takes about 15
minutes; ``--quick`` (static-4, static-64, token-budget-4096, auto and auto-latency,
8 s phases, 2 s warm-up) about 2 minutes.

``--rev REV`` measures a committed revision's ``iop_trio`` as ``relay.py --rev`` does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim_engine
from relay import (
    NODE_BIN,
    Proc,
    Tally,
    _interrupt,
    cpu_times,
    free_port,
    interrupted,
    machine_facts,
    percentile,
    processes,
    read_sse,
    run_at_rev,
)

ADAPTER, MODEL = "engine", "bench"
NODE_ID = "capacity-bench"
TARGET = f"{ADAPTER}/{MODEL}"
KV_TOKENS = 4096
START_TIMEOUT = 30.0  # seconds until a first run goes through the door
SETTLE_TIMEOUT = 60.0  # seconds to wait for the engine and the node to go idle
QUIET_SECONDS, QUIET_CPU = 0.5, 0.02  # between phases: node and edge CPU at most this
STAGGER = 0.02  # seconds between two clients' first requests
MAX_RUNS = 100_000  # runs a client loop starts in a phase, at most
RETRY_PAUSE = 0.2  # seconds a client waits after a failed request
TIMEOUT = httpx.Timeout(10.0, read=900.0)  # a long run may wait minutes for its first token


# --- the configurations ------------------------------------------------------------------------


@attrs.frozen
class Config:
    """A named fragment of the node's config (YAML, merged into the target's and the
    adapter's mappings) and the engine's command-line options."""

    name: str
    target: str = "{}"
    adapter: str = "{}"
    engine: tuple[str, ...] = ()
    note: str = ""


CONFIGS = [
    Config("static-4", target="{concurrency: 4}"),
    Config("static-8", target="{concurrency: 8}"),
    Config("static-16", target="{concurrency: 16}"),
    Config("static-32", target="{concurrency: 32}"),
    Config("static-64", target="{concurrency: 64}"),
    Config(
        "auto",
        target="{concurrency: auto, concurrency_max: 64, tokenizer: vllm}",
        note="learned from the engine's metrics (vllm:num_requests_waiting, kv cache use)",
    ),
    Config(
        "auto-latency",
        target="{concurrency: auto, concurrency_max: 64}",
        engine=("--metrics", "none"),
        note="learned from TTFT / time per output token: the engine exposes no metrics, "
        "prompts estimated from their size",
    ),
    Config(
        "token-budget-4096",
        target="{concurrency: 64, token_budget: 4096, tokenizer: vllm}",
        note="prompt tokens (the engine's /tokenize) + max_tokens reserved at admission",
    ),
]
BY_NAME = {c.name: c for c in CONFIGS}
#: --keep (a folder the configurations' logs and stores stay in) and --node-log
KEEP: str | None = None
NODE_LOG_LEVEL = "info"
DEFAULT_CONFIGS = [c.name for c in CONFIGS]  # issue 20 asks for them side by side


@attrs.frozen
class Phase:
    name: str
    words: int
    max_tokens: int

    @property
    def prompt(self) -> str:
        return prompt_of(self.words)

    @property
    def prompt_tokens(self) -> int:
        return sim_engine.chat_token_count([("user", self.prompt)])


PHASES = (Phase("short", 40, 24), Phase("long", 900, 124), Phase("short", 40, 24))
WORDS = ("inference", "node", "gate")  # 2 + 1 + 1 tokens: 4/3 a word


def prompt_of(words: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(words))


def node_config(
    folder: Path, config: Config, *, edge_port: int, engine_port: int, metrics_port: int
) -> Path:
    """The node's YAML: the bench's defaults with ``config``'s fragments merged in."""
    adapter: dict[str, Any] = {
        "kind": "openai",
        "base_url": f"http://127.0.0.1:{engine_port}",
        "read_timeout": 900,
    }
    target: dict[str, Any] = {"adapter": ADAPTER, "model": MODEL}
    for into, fragment in ((adapter, config.adapter), (target, config.target)):
        extra = yaml.safe_load(fragment) or {}
        if not isinstance(extra, dict):
            raise ValueError(f"{config.name}: a fragment must be a mapping, not {fragment!r}")
        into.update(extra)
    document = {
        "node_id": NODE_ID,
        "edge": {
            "url": f"ws://127.0.0.1:{edge_port}/node",
            "backoff_initial": 0.05,
            "backoff_max": 0.5,
        },
        "store": {"kind": "sqlite", "path": str(folder / "node.db")},
        "runtime": {
            "concurrency": 1024,
            "max_queued": 1000,
            "queue_timeout": 600,
            "drain_timeout": 2,
        },
        "adapters": {ADAPTER: adapter},
        "targets": [target],
        "metrics": {"listen": f"127.0.0.1:{metrics_port}"},
        "logging": {"level": NODE_LOG_LEVEL},
    }
    path = folder / "node.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


# --- the stack of one configuration --------------------------------------------------------------


@attrs.frozen
class Stack:
    engine: Proc
    edge: Proc
    node: Proc
    engine_url: str
    door_url: str  # .../v1
    metrics_url: str
    token: str

    @property
    def pids(self) -> dict[str, int]:
        return {"node": self.node.pid, "edge": self.edge.pid, "eng": self.engine.pid}


class Refused(Exception):
    """The node refuses the configuration (its check-config output is the message)."""


def check(config_path: Path, env: dict[str, str]) -> None:
    done = subprocess.run(
        [str(NODE_BIN), "check-config", "--config", str(config_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0:  # the message, without the temporary folder's name
        raise Refused((done.stderr or done.stdout).strip().replace(str(config_path), "node.yaml"))


@contextmanager
def stack(config: Config, engine_args: Sequence[str]) -> Iterator[Stack]:
    """Check ``config`` with the node, then start the engine, the edge and the node in a
    temporary folder; end them after. Refused if the node refuses the config."""
    token = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="iop-capacity-") as tmp, processes() as start:
        folder = Path(tmp)
        if KEEP is not None:  # --keep: the logs and the store stay for a look after
            folder = Path(KEEP) / config.name
            folder.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("IOP_")}
        edge_port, engine_port = free_port(), free_port()
        path = node_config(
            folder, config, edge_port=edge_port, engine_port=engine_port, metrics_port=free_port()
        )
        check(path, {**env, "IOP_EDGE__TOKEN": token})
        engine = start(
            "engine",
            [
                sys.executable,
                str(Path(sim_engine.__file__).resolve()),
                "--port",
                str(engine_port),
                "--model",
                MODEL,
                "--kv-tokens",
                str(KV_TOKENS),
                "--exit-with-parent",
                *engine_args,
                *config.engine,
            ],
            env,
            folder / "engine.log",
        )
        engine.wait_for(r"sim engine listening on")
        edge, node, door_port = start_edge_and_node(start, env, folder, path, token, NODE_ID)
        metrics = re.search(r"listen: (127\.0\.0\.1:\d+)", path.read_text())
        assert metrics is not None
        try:
            yield Stack(
                engine,
                edge,
                node,
                engine_url=f"http://127.0.0.1:{engine_port}",
                door_url=f"http://127.0.0.1:{door_port}/v1",
                metrics_url=f"http://{metrics.group(1)}/metrics",
                token=token,
            )
        except BaseException:
            for proc in (engine, edge, node):
                if proc.popen.poll() is not None:
                    print(f"{proc.name} exited {proc.popen.returncode}:\n{proc.tail()}")
            raise


# --- measuring -----------------------------------------------------------------------------------


@attrs.frozen
class Figures:
    """One configuration's figures in one phase."""

    config: str
    index: int  # of the phase in PHASES
    phase: str
    window: float
    engine: dict[str, Any]  # /bench/reset at the window's end
    runs: int
    ttft: Sequence[float]
    cpu: dict[str, float]  # process -> CPU seconds in the window
    failures: Sequence[str]

    @property
    def tokens_s(self) -> float:
        value = self.engine.get("tokens_per_s")
        return math.nan if value is None else float(value)

    @property
    def waiting(self) -> float:
        value = self.engine.get("mean_waiting")
        return math.nan if value is None else float(value)

    def share(self, process: str) -> float:
        return self.cpu.get(process, math.nan) / self.window * 100


async def door_stream(
    http: httpx.AsyncClient, door_url: str, token: str, body: bytes, tally: Tally, began: float
) -> tuple[str | None, int]:
    """One streamed chat completion POSTed to the door at ``door_url`` (its text told to
    ``tally`` as it comes): what was wrong (None) and the characters of text it got."""
    headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
    try:
        url = door_url + "/chat/completions"
        async with http.stream("POST", url, content=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread())[:200].decode(errors="replace")
                return f"HTTP {response.status_code}: {text}", 0
            return await read_sse(response, tally, began, finish_reason="length")
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}", 0


def start_edge_and_node(
    start: Any, env: dict[str, str], folder: Path, config: Path, token: str, node_id: str
) -> tuple[Proc, Proc, int]:
    """Start ``iop-node edge`` (with its OpenAI door) and ``iop-node serve --config
    config`` (whose edge.url names the edge's port), each waited for; and the door's port."""
    found = re.search(r"ws://127\.0\.0\.1:(\d+)/node", config.read_text())
    assert found is not None, config
    edge_port, door_port = int(found.group(1)), free_port()
    edge = start(
        "edge",
        [
            str(NODE_BIN),
            "edge",
            "--listen",
            f"127.0.0.1:{edge_port}",
            "--openai-listen",
            f"127.0.0.1:{door_port}",
        ],
        {**env, "IOP_EDGE_TOKEN": token},
        folder / "edge.log",
    )
    edge.wait_for(r"OpenAI-compatible API on")
    node = start(
        "node",
        [str(NODE_BIN), "serve", "--config", str(config)],
        {**env, "IOP_EDGE__TOKEN": token},
        folder / "node.log",
    )
    node.wait_for(rf"node {node_id} serving")
    return edge, node, door_port


@attrs.define
class Bench:
    stack: Stack
    clients: int
    warmup: float
    seconds: float
    control: httpx.AsyncClient

    async def engine(self, path: str, *, post: bool = False) -> dict[str, Any]:
        url = self.stack.engine_url + path
        response = await (self.control.post(url) if post else self.control.get(url))
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    def cpu(self) -> dict[str, float]:
        now = {name: sum(cpu_times(pid)) for name, pid in self.stack.pids.items()}
        now["cli"] = time.process_time()
        return now

    async def node_live_runs(self) -> int:
        response = await self.control.get(
            self.stack.metrics_url, params={"name[]": "iop_node_live_runs"}
        )
        match = re.search(r"^iop_node_live_runs\s+(\S+)", response.text, re.M)
        return int(float(match.group(1))) if match else -1

    async def settle(self) -> None:
        """Wait (bounded) until the engine has no request, the node no live run, and the
        node and the edge are quiet."""
        state: Any = None
        with trio.move_on_after(SETTLE_TIMEOUT) as scope:
            while True:
                stats = await self.engine("/bench/stats")
                live = await self.node_live_runs()
                state = (stats["running"], stats["waiting"], live)
                if state == (0, 0, 0):
                    break
                await trio.sleep(0.05)
            while True:
                before = self.cpu()
                await trio.sleep(QUIET_SECONDS)
                after = self.cpu()
                state = {p: round(after[p] - before[p], 3) for p in ("node", "edge")}
                if max(state.values()) <= QUIET_CPU:
                    return
        if scope.cancelled_caught:
            print(f"  (not idle after {SETTLE_TIMEOUT:g}s: {state})")

    def body(self, phase: Phase) -> bytes:
        return json.dumps(
            {
                "model": TARGET,
                "messages": [{"role": "user", "content": phase.prompt}],
                "max_tokens": phase.max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()

    async def first_run(self) -> float:
        """Retry one short run through the door until it succeeds (bounded); seconds."""
        began = trio.current_time()
        last = ""
        with trio.move_on_after(START_TIMEOUT):
            while True:
                tally = Tally(-math.inf, math.inf, expected_chars=len(sim_engine.TOKEN_TEXT))
                problem = await self.one(tally, self.body(Phase("first", 3, 1)))
                if problem is None:
                    return trio.current_time() - began
                last = problem
                await trio.sleep(0.1)
        raise RuntimeError(f"no run went through the door in {START_TIMEOUT:g}s: {last}")

    async def one(
        self, tally: Tally, body: bytes, http: httpx.AsyncClient | None = None
    ) -> str | None:
        """One streamed run through the door; what was wrong, or None."""
        began = tally.begin()
        failed = len(tally.failures)
        problem, chars = await door_stream(
            http or self.control, self.stack.door_url, self.stack.token, body, tally, began
        )
        tally.ended(began, chars, problem)
        return tally.failures[-1] if len(tally.failures) > failed else None

    async def phase(self, config: Config, index: int) -> Figures:
        phase = PHASES[index]
        await self.settle()
        body = self.body(phase)
        now = trio.current_time()
        start = now + self.warmup
        tally = Tally(start, start + self.seconds, phase.max_tokens * len(sim_engine.TOKEN_TEXT))
        cpu: dict[str, dict[str, float]] = {}
        stats: dict[str, Any] = {}
        limits = httpx.Limits(
            max_connections=self.clients + 8, max_keepalive_connections=self.clients
        )
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as http:

            async def client() -> None:
                started = 0
                while trio.current_time() < tally.end and started < MAX_RUNS:
                    started += 1
                    tally.started += 1
                    if await self.one(tally, body, http) is not None:
                        await trio.sleep(RETRY_PAUSE)

            async def clock(cancel: trio.CancelScope) -> None:
                await trio.sleep_until(tally.start)
                await self.engine("/bench/reset", post=True)
                cpu["start"] = self.cpu()
                await trio.sleep_until(tally.end)
                stats.update(await self.engine("/bench/reset", post=True))
                cpu["end"] = self.cpu()
                cancel.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(clock, nursery.cancel_scope)
                for _ in range(self.clients):
                    nursery.start_soon(client)
                    await trio.sleep(STAGGER)
        return Figures(
            config=config.name,
            index=index,
            phase=phase.name,
            window=float(stats.get("elapsed") or self.seconds),
            engine=stats,
            runs=tally.runs,
            ttft=tally.ttft,
            cpu={k: cpu["end"][k] - cpu["start"][k] for k in cpu["end"]},
            failures=tally.failures,
        )


# --- printing ------------------------------------------------------------------------------------

HEADER = (
    f"{'config':<18} {'phase':<6} {'tok/s':>7} {'waiting':>8} {'running':>8} {'kv %':>5}"
    f" {'runs':>5} {'ttft p50':>9} {'node':>5} {'edge':>5} {'eng':>5} {'cli':>5} {'lag':>6}"
)
UNITS = f"{'':<18} {'':<6} {'engine':>7} {'in the engine, mean':>23} {'':>5} {'ms':>9}" + (
    f" {'% of a core':>23} {'ms':>6}"
)


def fmt(value: float, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if math.isnan(value) else f"{value:>{width}{spec}}"


def number(stats: dict[str, Any], key: str) -> float:
    value = stats.get(key)
    return math.nan if value is None else float(value)


def row(f: Figures) -> str:
    e = f.engine
    line = (
        f"{f.config:<18} {f.phase:<6} {fmt(f.tokens_s, ',.1f', 7)} {fmt(f.waiting, '.2f', 8)}"
        f" {fmt(number(e, 'mean_running'), '.2f', 8)}"
        f" {fmt(number(e, 'mean_kv_usage') * 100, '.0f', 5)} {f.runs:>5}"
        f" {fmt(percentile(f.ttft, 50) * 1000, ',.0f', 9)}"
        + "".join(fmt(f.share(p), ".0f", 6) for p in ("node", "edge", "eng", "cli"))
        + f" {fmt(number(e, 'lag_mean_ms'), '.1f', 6)}"
    )
    notes = []
    if number(e, "lost_s") > 0:
        notes.append(f"engine lost {number(e, 'lost_s'):.2f}s to stalls")
    if f.failures:
        notes.append(f"{len(f.failures)} failed, e.g. {f.failures[0][:120]}")
    return line + (f"  ({'; '.join(notes)})" if notes else "")


def summary(figures: Sequence[Figures]) -> list[str]:
    """Per phase: each configuration against the best static one, and the targets."""
    lines = [
        "",
        "against the best static configuration of the same phase; issue 20's targets: "
        ">= 0.85x its tokens/s and <= 1.0 waiting in the engine",
    ]
    for index, phase in enumerate(PHASES):
        mine = [f for f in figures if f.index == index]
        statics = [f for f in mine if f.config.startswith("static-") and not math.isnan(f.tokens_s)]
        best = max(statics, key=lambda f: f.tokens_s, default=None)
        head = f"phase {index + 1} ({phase.name}):"
        if best is None:
            lines.append(f"{head} no static configuration ran")
            continue
        lines.append(f"{head} best static {best.config}, {best.tokens_s:,.1f} tokens/s")
        for f in mine:
            ratio = f.tokens_s / best.tokens_s if best.tokens_s else math.nan
            misses = []
            if not ratio >= 0.85:
                misses.append(f"{ratio:.2f}x")
            if not f.waiting <= 1.0:
                misses.append(f"{f.waiting:.1f} waiting")
            verdict = "yes" if not misses else "no (" + ", ".join(misses) + ")"
            lines.append(
                f"  {f.config:<18} {fmt(f.tokens_s, ',.1f', 7)} tok/s {fmt(ratio, '.3f', 6)}x"
                f" {fmt(f.waiting, '.2f', 6)} waiting   targets: {verdict}"
            )
    return lines


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


# --- main ----------------------------------------------------------------------------------------


async def measure(config: Config, stack_: Stack, ns: argparse.Namespace) -> list[Figures]:
    async with httpx.AsyncClient(timeout=TIMEOUT) as control:
        bench = Bench(stack_, ns.clients, ns.warmup, ns.phase_seconds, control)
        took = await bench.first_run()
        print(f"  first run through the door after {took:.2f}s")
        out = []
        for index in range(len(PHASES)):
            figures = await bench.phase(config, index)
            print(row(figures))
            out.append(figures)
        return out


def main(ns: argparse.Namespace) -> int:
    global KEEP, NODE_LOG_LEVEL
    KEEP, NODE_LOG_LEVEL = ns.keep, ns.node_log
    machine_facts(sys.stdout)
    for phase in PHASES[:2]:
        print(
            f"phase {phase.name}: {phase.words}-word prompts, {phase.prompt_tokens} prompt tokens "
            f"(the engine's count, chat template included), max_tokens {phase.max_tokens}: "
            f"{phase.prompt_tokens + phase.max_tokens} KV tokens a run, "
            f"{KV_TOKENS // (phase.prompt_tokens + phase.max_tokens)} runs fit in {KV_TOKENS}"
        )
    law = sim_engine.parse_args(ns.engine_args)
    print(
        f"engine: step {law.base_ms:g} ms + {law.per_seq_ms:g} ms a running request + "
        f"{law.prefill_us:g} us a prompt token joining; {ns.clients} clients; "
        f"warm-up {ns.warmup:g}s, window {ns.phase_seconds:g}s a phase\n"
    )
    figures: list[Figures] = []
    try:
        for name in ns.configs:
            config = BY_NAME[name]
            print(
                f"{name}: target {config.target}"
                + (f", adapter {config.adapter}" if config.adapter != "{}" else "")
                + (f", engine {' '.join(config.engine)}" if config.engine else "")
                + f"; load average {load()}"
            )
            try:
                with stack(config, ns.engine_args) as procs:
                    figures += trio.run(measure, config, procs, ns)
            except Refused as exc:
                reason = " ".join(str(exc).split())
                print(f"  skipped: the node refuses this configuration: {reason}")
                if config.note:
                    print(f"  (pending: {config.note})")
        print()
        print(HEADER)
        print(UNITS)
        for index in range(len(PHASES)):
            for f in figures:
                if f.index == index:
                    print(row(f))
        for line in summary(figures):
            print(line)
    finally:
        print(f"load average at end (1, 5, 15 min): {load()}")
    return 0


def config_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"no configuration {', '.join(unknown)}; there are {', '.join(BY_NAME)}"
        )
    return names


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--configs",
        type=config_list,
        default=DEFAULT_CONFIGS,
        help=f"comma-separated (default: all): {','.join(BY_NAME)}",
    )
    parser.add_argument("--phase-seconds", type=float, default=30.0, help="measured, a phase")
    parser.add_argument("--warmup", type=float, default=5.0, help="not measured, before each")
    parser.add_argument("--clients", type=int, default=48)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="static-4, static-64, the budget and both autos; 8 s phases",
    )
    parser.add_argument("--list", action="store_true", help="print the configurations")
    parser.add_argument(
        "--zoo",
        nargs="?",
        const="",
        metavar="SHAPE,...",
        help="the engine zoo's sample (or the engines named): capacity_zoo.py says what",
    )
    parser.add_argument(
        "--engine-args", type=shlex.split, default=[], help="more sim_engine.py options"
    )
    parser.add_argument("--rev", help="measure this git revision's iop_trio (see relay.py)")
    parser.add_argument("--keep", metavar="DIR", help="keep each configuration's logs and store")
    parser.add_argument(
        "--node-log", default="info", help="the node's log level (default %(default)s)"
    )
    ns = parser.parse_args()
    if ns.list:
        for c in CONFIGS:
            extra = f" adapter {c.adapter}" if c.adapter != "{}" else ""
            extra += f" engine {' '.join(c.engine)}" if c.engine else ""
            print(f"{c.name:<18} target {c.target}{extra}" + (f"  # {c.note}" if c.note else ""))
        sys.exit(0)
    if ns.rev:
        sys.exit(run_at_rev(ns.rev, sys.argv[1:], Path(__file__)))
    run = main
    if ns.zoo is not None:
        import capacity_zoo

        names = capacity_zoo.shape_list(ns.zoo)
        if ns.phase_seconds == parser.get_default("phase_seconds"):
            ns.phase_seconds = 8.0  # the issue's phases
        if ns.warmup == parser.get_default("warmup"):
            ns.warmup = 2.0
        run = lambda ns: capacity_zoo.main(ns, names)  # noqa: E731
    if ns.quick:
        ns.configs = ["static-4", "static-64", "token-budget-4096", "auto", "auto-latency"]
        ns.phase_seconds, ns.warmup = 8.0, 2.0
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        sys.exit(run(ns))
    except BaseException as exc:
        if not interrupted(exc):
            raise
        print("interrupted", file=sys.stderr)
        sys.exit(130)
