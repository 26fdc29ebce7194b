"""Replicas: one target over four simulated engines, a replica picked per run (issue 32).

    python benchmarks/replicas.py [--modes prefix,speed] [--seconds 15] [--warmup 5]
                                  [--clients 48] [--rev REV] [--keep DIR]

For each routing a mode compares, this starts on loopback, from nothing:

- four engines: ``benchmarks/sim_engine.py`` (its docstring says what it models);
- ``iop-node edge`` with its OpenAI-compatible door (one shared token);
- ``iop-node serve``: one ``openai`` adapter naming the four as ``replicas:`` with the
  routing compared, one target ``pool/bench`` (``concurrency`` 64, the node's 1,024,
  ``queue_timeout`` 600 s), the SQLite store, logs into a file;
- this process: ``--clients`` streaming clients, each in a loop, POSTing
  ``/v1/chat/completions`` to the door, started 20 ms apart.

The modes:

- ``prefix``: each engine has a prefix cache of 8,192 tokens (``--prefix-cache-tokens``:
  five of the eight system prompts below, so a replica that sees every family, as
  round robin makes each, evicts them before they come round again) and a KV cache of
  32,768, and a GPU's step law (:data:`GPU`: a miss's prefill is nine decode steps).
  Client ``i`` is in family
  ``i % 8``: its messages are its family's system prompt (1,500 words, about 1,500
  tokens, the same for every client of the family) and its own user message (its
  number and its run's), ``max_tokens`` 24. ``prefix`` against ``round_robin``:
  issue 32 asks for a time-to-first-token p50 at most 0.5 of round robin's, and
  tokens/s at least round robin's.
- ``speed``: four engines with a KV cache of 4,096 and a batch of at most 16 (vLLM's
  ``max_num_seqs``), one three times slower (its step's base and per-request cost
  tripled), 40-word prompts, ``max_tokens`` 24.
  ``least_loaded`` against ``round_robin``: issue 32 asks for at least 1.3x the tokens/s
  and fewer requests waiting inside the engines.

Each routing runs ``--warmup`` seconds that are not measured, then ``--seconds`` that
are. The figures: ``tok/s``, the tokens the four engines generated in the window by
their own counters (``POST /bench/reset`` at its start and end) over its length;
``waiting``, the sum over the engines of the time-averaged requests waiting inside
each; ``ttft`` p50 and p90 at the clients (from a request to its first token, the
node's queue included) of the runs whose first token came in the window; ``runs``
that ended in it; ``cached``, the share of prompt tokens the engines' prefix caches
spared; ``shares``, each engine's part of the tokens (the slow one first). Figures are
printed, never asserted; machine facts and the load average are printed. Every process
started here is ended by its pid.

``--auto`` gives the adapter ``concurrency: auto`` (``concurrency_max`` 64): each replica
learns its own limit from its engine's metrics, and its scrapes steer ``least_loaded``.
``--rev REV`` measures a committed revision's ``iop_trio`` as ``relay.py --rev`` does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim_engine
from capacity import check, door_stream, load, start_edge_and_node
from relay import (
    Proc,
    Tally,
    free_port,
    machine_facts,
    percentile,
    processes,
    run_at_rev,
)

ADAPTER, MODEL = "pool", "bench"
NODE_ID = "replicas-bench"
TARGET = f"{ADAPTER}/{MODEL}"
REPLICAS = 4
FAMILIES = 8
SYSTEM_WORDS = 1500
MAX_TOKENS = 24
STAGGER = 0.02
RETRY_PAUSE = 0.2
START_TIMEOUT = 30.0
TIMEOUT = httpx.Timeout(10.0, read=600.0)
SLOW = 3.0  # the slow replica's step, against the others'


@attrs.frozen
class Mode:
    name: str
    routings: tuple[str, str]  # the one the issue asks about, the baseline
    engine_args: tuple[tuple[str, ...], ...]  # each replica's


def _law(scale: float) -> tuple[str, ...]:
    law = sim_engine.StepLaw()
    return (
        "--base-ms",
        f"{law.base * 1e3 * scale:g}",
        "--per-seq-ms",
        f"{law.per_seq * 1e3 * scale:g}",
    )


#: A GPU's shape for the prefix mode: a decode step of 25 ms + 0.4 ms a request, and a
#: prefill of 150 us a prompt token (6,700 tokens/s): a 1,500-token system prompt costs
#: 225 ms to prefill, nine decode steps, as on a GPU (the default law's 50 us against
#: 80 ms steps would make a prefill cheap beside a step, and the cache moot).
GPU = ("--base-ms", "25", "--per-seq-ms", "0.4", "--prefill-us", "150")
MODES = {
    "prefix": Mode(
        "prefix",
        ("prefix", "round_robin"),
        (("--kv-tokens", "32768", "--prefix-cache-tokens", "8192", *GPU),) * REPLICAS,
    ),
    "speed": Mode(
        "speed",
        ("least_loaded", "round_robin"),
        (("--kv-tokens", "4096", "--max-batch", "16", *_law(SLOW)),)
        + (("--kv-tokens", "4096", "--max-batch", "16"),) * (REPLICAS - 1),
    ),
}


def system_prompt(family: int) -> str:
    """A family's system prompt: ``SYSTEM_WORDS`` words, its own from the first."""
    return " ".join(f"f{family}w{i % 97}" for i in range(SYSTEM_WORDS))


def messages(mode: str, client: int, run: int) -> list[dict[str, str]]:
    tail = f"client {client} asks question {run} about the report"
    if mode == "prefix":
        return [
            {"role": "system", "content": system_prompt(client % FAMILIES)},
            {"role": "user", "content": tail},
        ]
    return [{"role": "user", "content": " ".join(["inference node gate"] * 13) + " " + tail}]


@attrs.define
class Stack:
    engines: list[Proc]
    engine_urls: tuple[str, ...]
    door_url: str
    token: str
    config: Path  # the node's
    relaunch: Callable[..., Proc]  # start engine i again, on its port (``wait``: for it)
    node: Proc | None = None


#: --auto: each replica's concurrency learned (``concurrency: auto`` on the adapter)
AUTO = False


def node_config(
    folder: Path, routing: str, urls: Sequence[str], edge_port: int, probe: float | None
) -> Path:
    runtime: dict[str, Any] = {"concurrency": 1024, "max_queued": 1000, "queue_timeout": 600}
    if probe is not None:
        runtime["probe_interval"] = probe
    document = {
        "node_id": NODE_ID,
        "edge": {"url": f"ws://127.0.0.1:{edge_port}/node", "backoff_initial": 0.05},
        "store": {"kind": "sqlite", "path": str(folder / "node.db")},
        "runtime": runtime,
        "adapters": {
            ADAPTER: {
                "kind": "openai",
                "read_timeout": 600,
                "routing": routing,
                "replicas": list(urls),
                **({"concurrency": "auto", "concurrency_max": 64} if AUTO else {}),
            }
        },
        "targets": [{"adapter": ADAPTER, "model": MODEL, "concurrency": 64}],
        "metrics": {"listen": f"127.0.0.1:{free_port()}"},
        "logging": {"level": "info"},
    }
    path = folder / "node.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


@contextmanager
def stack(
    mode: Mode, routing: str, keep: str | None, probe: float | None = None
) -> Iterator[Stack]:
    token = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="iop-replicas-") as tmp, processes() as start:
        folder = Path(tmp)
        if keep is not None:
            folder = Path(keep) / f"{mode.name}-{routing}"
            folder.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("IOP_")}
        ports = [free_port() for _ in mode.engine_args]

        def launch(i: int, *, wait: bool = True) -> Proc:
            argv = [sys.executable, str(Path(sim_engine.__file__).resolve())]
            argv += ["--port", str(ports[i]), "--model", MODEL, "--exit-with-parent"]
            engine = start(f"engine{i}", [*argv, *mode.engine_args[i]], env, folder / f"e{i}.log")
            if wait:
                engine.wait_for(r"sim engine listening on")
            return engine

        engines = [launch(i, wait=False) for i in range(len(ports))]
        for engine in engines:
            engine.wait_for(r"sim engine listening on")
        urls = tuple(f"http://127.0.0.1:{p}" for p in ports)
        path = node_config(folder, routing, urls, free_port(), probe)
        check(path, {**env, "IOP_EDGE__TOKEN": token})
        _edge, node, door_port = start_edge_and_node(start, env, folder, path, token, NODE_ID)
        door = f"http://127.0.0.1:{door_port}/v1"
        yield Stack(engines, urls, door, token, path, launch, node)


@attrs.frozen
class Figures:
    mode: str
    routing: str
    window: float
    engines: tuple[dict[str, Any], ...]
    runs: int
    ttft: Sequence[float]
    failures: Sequence[str]

    @property
    def tokens_s(self) -> float:
        return sum(e.get("tokens", 0) for e in self.engines) / self.window

    @property
    def waiting(self) -> float:
        return sum(float(e.get("mean_waiting") or 0.0) for e in self.engines)

    @property
    def cached(self) -> float:
        spared = sum(e.get("cached_tokens", 0) for e in self.engines)
        paid = sum(e.get("prompt_tokens", 0) for e in self.engines)
        return spared / (spared + paid) if spared + paid else math.nan

    @property
    def shares(self) -> list[float]:
        total = sum(e.get("tokens", 0) for e in self.engines) or 1
        return [e.get("tokens", 0) / total for e in self.engines]


async def measure(mode: Mode, routing: str, procs: Stack, ns: argparse.Namespace) -> Figures:
    limits = httpx.Limits(max_connections=ns.clients + 8, max_keepalive_connections=ns.clients)
    expected = MAX_TOKENS * len(sim_engine.TOKEN_TEXT)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as http:

        async def one(tally: Tally, client: int, run: int) -> str | None:
            began = tally.begin()
            body = {
                "model": TARGET,
                "messages": messages(mode.name, client, run),
                "max_tokens": MAX_TOKENS,
                "stream": True,
            }
            problem, chars = await door_stream(
                http, procs.door_url, procs.token, json.dumps(body).encode(), tally, began
            )
            tally.ended(began, chars, problem)
            return problem

        with trio.fail_after(START_TIMEOUT):  # the node has its edge link and its engines
            for _ in range(int(START_TIMEOUT / 0.1)):
                if await one(Tally(-math.inf, math.inf, expected), -1, 0) is None:
                    break
                await trio.sleep(0.1)
        start = trio.current_time() + ns.warmup
        tally = Tally(start, start + ns.seconds, expected)
        stats: list[dict[str, Any]] = []

        async def client(index: int) -> None:
            run = 0
            while trio.current_time() < tally.end and run < 100_000:
                run += 1
                tally.started += 1
                if await one(tally, index, run) is not None:
                    await trio.sleep(RETRY_PAUSE)

        async def reset_all() -> list[dict[str, Any]]:
            found: list[dict[str, Any]] = [{} for _ in procs.engine_urls]

            async def reset(i: int, url: str) -> None:
                response = await http.post(url + "/bench/reset")
                found[i] = response.json()

            async with trio.open_nursery() as nursery:
                for i, url in enumerate(procs.engine_urls):
                    nursery.start_soon(reset, i, url)
            return found

        async def clock(cancel: trio.CancelScope) -> None:
            await trio.sleep_until(tally.start)
            await reset_all()
            await trio.sleep_until(tally.end)
            stats.extend(await reset_all())
            cancel.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(clock, nursery.cancel_scope)
            for i in range(ns.clients):
                nursery.start_soon(client, i)
                await trio.sleep(STAGGER)
    window = max(float(s.get("elapsed") or ns.seconds) for s in stats)
    return Figures(mode.name, routing, window, tuple(stats), tally.runs, tally.ttft, tally.failures)


def row(f: Figures) -> str:
    ms = [percentile(f.ttft, q) * 1e3 for q in (50, 90)]
    shares = " ".join(f"{s:.2f}" for s in f.shares)
    cached = "-" if math.isnan(f.cached) else f"{f.cached:.2f}"
    return (
        f"{f.mode:<7} {f.routing:<13} {f.tokens_s:8.1f} {f.waiting:8.2f} {ms[0]:8.0f} {ms[1]:8.0f}"
        f" {f.runs:6d} {len(f.failures):5d} {cached:>7}  {shares}"
    )


HEADER = (
    f"{'mode':<7} {'routing':<13} {'tok/s':>8} {'waiting':>8} {'ttft p50':>8} {'p90':>8}"
    f" {'runs':>6} {'fail':>5} {'cached':>7}  shares (engine 0 first)"
)


def verdicts(figures: Sequence[Figures]) -> list[str]:
    lines = []
    by = {(f.mode, f.routing): f for f in figures}
    if ("prefix", "prefix") in by and ("prefix", "round_robin") in by:
        a, b = by["prefix", "prefix"], by["prefix", "round_robin"]
        ttft = percentile(a.ttft, 50) / percentile(b.ttft, 50)
        rate = a.tokens_s / b.tokens_s
        ok = ttft <= 0.5 and rate >= 1.0
        lines.append(
            f"prefix vs round_robin: ttft p50 {ttft:.2f}x (target <= 0.5), tokens/s {rate:.2f}x "
            f"(target >= 1.0): {'ok' if ok else 'MISS'}"
        )
    if ("speed", "least_loaded") in by and ("speed", "round_robin") in by:
        a, b = by["speed", "least_loaded"], by["speed", "round_robin"]
        rate = a.tokens_s / b.tokens_s
        ok = rate >= 1.3 and a.waiting < b.waiting
        lines.append(
            f"least_loaded vs round_robin, one replica {SLOW:g}x slower: tokens/s {rate:.2f}x "
            f"(target >= 1.3), waiting {a.waiting:.2f} vs {b.waiting:.2f} (target: fewer): "
            f"{'ok' if ok else 'MISS'}"
        )
    return lines


def main(ns: argparse.Namespace) -> int:
    global AUTO
    AUTO = ns.auto
    machine_facts(sys.stdout)
    print(
        f"{ns.clients} clients; warm-up {ns.warmup:g}s, window {ns.seconds:g}s; prefix mode: "
        f"{FAMILIES} families of {SYSTEM_WORDS}-word system prompts "
        f"({sim_engine.chat_token_count([('system', system_prompt(0))])} tokens)\n"
    )
    figures: list[Figures] = []
    try:
        for name in ns.modes:
            mode = MODES[name]
            for routing in mode.routings:
                print(f"{name} {routing}: load average {load()}", flush=True)
                with stack(mode, routing, ns.keep) as procs:
                    f = trio.run(measure, mode, routing, procs, ns)
                figures.append(f)
                print("  " + row(f), flush=True)
                if f.failures:
                    print(f"  failures: {sorted(set(f.failures))[:3]}")
        print()
        print(HEADER)
        for f in figures:
            print(row(f))
        for line in verdicts(figures):
            print(line)
    finally:
        print(f"load average at end (1, 5, 15 min): {load()}")
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--modes", type=lambda t: t.split(","), default=list(MODES))
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=48)
    p.add_argument("--keep", default=None, help="a folder the logs and stores stay in")
    p.add_argument("--auto", action="store_true", help="each replica's concurrency learned (auto)")
    p.add_argument("--rev", default=None, help="measure this revision's iop_trio")
    ns = p.parse_args(argv)
    unknown = [m for m in ns.modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {', '.join(unknown)} (known: {', '.join(MODES)})")
    return ns


if __name__ == "__main__":
    args = parse_args()
    if args.rev:
        sys.exit(run_at_rev(args.rev, sys.argv[1:], Path(__file__)))
    sys.exit(main(args))
