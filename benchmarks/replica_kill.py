"""Replica failover: SIGKILL one of four engines under load, then start it again (issue 32).

    python benchmarks/replica_kill.py [--seconds 20] [--warmup 5] [--clients 48]
                                      [--kill-at 5] [--back-at 10] [--keep DIR] [--rev REV]

On loopback, as ``replicas.py`` starts them: four ``sim_engine.py`` engines (a KV cache
of 4,096, a batch of at most 16), ``iop-node edge`` with its OpenAI door, and
``iop-node serve`` with one ``openai`` adapter naming the four as ``replicas:``
(``least_loaded``, ``runtime.probe_interval`` 1 s). ``--clients`` streaming clients
loop on 40-word chats (``max_tokens`` 24) through the door. ``--kill-at`` seconds into
the window engine 0 gets SIGKILL (its pid, started here); ``--back-at`` seconds in, it
is started again on its port. After the window the clients stop, the node is stopped
(SIGTERM: it drains), and its store is read with ``iop-node runs list --json`` and
``iop-node usage --json``.

What it prints, against issue 32's "Done when":

- every request answered: each got a whole stream or an error, and the store holds one
  terminal run for each request the clients made (none left QUEUED or RUNNING);
- the requests that failed, by what the client saw and when they began (before the
  kill, within 3 s after it, later): none may fail from 3 s after the kill on;
- the store, the usage ledger and the clients agree: runs SUCCEEDED in the store =
  whole streams at the clients; the ledger's completion tokens = the stored runs'
  usage summed; the tokens the clients received from runs that succeeded = those runs'
  completion tokens;
- engine 0 is used again after it came back (the tokens it generated since its
  restart, by its own counter) without a restart of the node.

Figures are printed; a line says ``ok`` or ``MISS`` per target. Every process started
here is ended by its pid.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim_engine
from capacity import door_stream, load
from relay import NODE_BIN, Tally, machine_facts, run_at_rev
from replicas import MAX_TOKENS, TARGET, TIMEOUT, Mode, messages, stack

ENGINES = (("--kv-tokens", "4096", "--max-batch", "16"),) * 4
AFTER = 3.0  # seconds after the kill from which no request may fail


@attrs.define
class Request:
    began: float
    ended: float = 0.0
    chars: int = 0
    problem: str | None = None


async def load_and_kill(procs: Any, ns: argparse.Namespace) -> tuple[list[Request], float, int]:
    """The clients' requests, when engine 0 was killed (trio time), and the tokens it
    generated after it came back."""
    limits = httpx.Limits(max_connections=ns.clients + 8, max_keepalive_connections=ns.clients)
    requests: list[Request] = []
    killed_at = 0.0
    after_back = 0
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as http:

        async def one(client: int, run: int) -> Request:
            request = Request(trio.current_time())
            requests.append(request)
            tally = Tally(-1e18, 1e18, MAX_TOKENS * len(sim_engine.TOKEN_TEXT))
            body = {
                "model": TARGET,
                "messages": messages("speed", client, run),
                "max_tokens": MAX_TOKENS,
                "stream": True,
            }
            request.problem, request.chars = await door_stream(
                http, procs.door_url, procs.token, json.dumps(body).encode(), tally, request.began
            )
            if request.problem is None and request.chars != tally.expected_chars:
                request.problem = f"{request.chars // len(sim_engine.TOKEN_TEXT)} tokens"
            request.ended = trio.current_time()
            return request

        for _ in range(300):  # the node has its edge link and its engines
            if (await one(-1, 0)).problem is None:
                break
            await trio.sleep(0.1)
        start = trio.current_time() + ns.warmup
        end = start + ns.seconds

        async def client(index: int) -> None:
            run = 0
            while trio.current_time() < end and run < 100_000:
                run += 1
                if (await one(index, run)).problem is not None:
                    await trio.sleep(0.2)

        async def chaos() -> None:
            nonlocal killed_at, after_back
            await trio.sleep_until(start + ns.kill_at)
            killed_at = trio.current_time()
            os.kill(procs.engines[0].pid, signal.SIGKILL)
            await trio.sleep_until(start + ns.back_at)
            # started from this thread: a child's PR_SET_PDEATHSIG fires when the thread
            # that forked it ends, so not from a worker thread (trio's idle out in 10 s)
            procs.engines[0] = engine = procs.relaunch(0, wait=False)
            await trio.to_thread.run_sync(engine.wait_for, r"sim engine listening on")
            await trio.sleep_until(end)
            response = await http.get(procs.engine_urls[0] + "/bench/stats")
            after_back = int(response.json()["tokens"])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(chaos)
            for i in range(ns.clients):
                nursery.start_soon(client, i)
                await trio.sleep(0.02)
    return requests, killed_at, after_back


def node_cli(procs: Any, *args: str) -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("IOP_")}
    done = subprocess.run(
        [str(NODE_BIN), *args, "--config", str(procs.config), "--json"],
        env={**env, "IOP_EDGE__TOKEN": procs.token},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"iop-node {' '.join(args)}: {done.stderr.strip()}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def report(
    requests: list[Request],
    killed_at: float,
    after_back: int,
    runs: list[dict[str, Any]],
    usage: list[dict[str, Any]],
) -> list[str]:
    lines = []
    answered = all(r.ended for r in requests)
    statuses = Counter(r["status"] for r in runs)
    live = statuses.get("queued", 0) + statuses.get("running", 0)
    ok_requests = sum(1 for r in requests if r.problem is None)
    lines.append(
        f"requests {len(requests)}: {ok_requests} whole streams, "
        f"{len(requests) - ok_requests} errors; store: {len(runs)} runs {dict(statuses)}"
    )
    target = answered and len(runs) == len(requests) and not live
    lines.append(f"every request answered, one stored run each: {'ok' if target else 'MISS'}")
    when = Counter()
    kinds: Counter[str] = Counter()
    for r in requests:
        if r.problem is None:
            continue
        phase = (
            "before"
            if r.began < killed_at
            else "within"
            if r.began < killed_at + AFTER
            else "after"
        )
        when[phase] += 1
        kinds[r.problem.split(":")[0][:60]] += 1
    lines.append(
        f"failed requests by start: {when.get('before', 0)} before the kill, "
        f"{when.get('within', 0)} within {AFTER:g} s of it, {when.get('after', 0)} later; "
        f"as seen: {dict(kinds)}"
    )
    late = sorted(
        f"{r.began - killed_at:.1f}..{r.ended - killed_at:.1f}"
        for r in requests
        if r.problem is not None and r.began >= killed_at + AFTER
    )
    lines.append(
        f"no request fails from {AFTER:g} s after the kill: "
        + ("ok" if not late else f"MISS (from the kill, s: {', '.join(late[:12])})")
    )
    reasons = Counter(r.get("reason") or "" for r in runs if r["status"] == "failed")
    lines.append(f"stored failures by reason: {dict(reasons)}")
    succeeded = [r for r in runs if r["status"] == "succeeded"]
    stored_tokens = sum(((r.get("usage") or {}).get("completion_tokens") or 0) for r in runs)
    ledger = sum(int(u.get("completion_tokens") or 0) for u in usage)
    client_tokens = sum(r.chars for r in requests if r.problem is None) // len(
        sim_engine.TOKEN_TEXT
    )
    ok_tokens = sum(((r.get("usage") or {}).get("completion_tokens") or 0) for r in succeeded)
    agree = len(succeeded) == ok_requests and ledger == stored_tokens and client_tokens == ok_tokens
    lines.append(
        f"succeeded: store {len(succeeded)}, clients {ok_requests}; completion tokens: ledger "
        f"{ledger}, stored runs {stored_tokens}; of the runs that succeeded: stored "
        f"{ok_tokens}, received {client_tokens}: {'ok' if agree else 'MISS'}"
    )
    lines.append(
        f"engine 0 back: {after_back} tokens since its restart: {'ok' if after_back else 'MISS'}"
    )
    return lines


def main(ns: argparse.Namespace) -> int:
    machine_facts(sys.stdout)
    mode = Mode("kill", ("least_loaded", "least_loaded"), ENGINES)
    print(
        f"{ns.clients} clients; warm-up {ns.warmup:g}s, window {ns.seconds:g}s; engine 0 "
        f"killed at {ns.kill_at:g}s, back at {ns.back_at:g}s; load average {load()}",
        flush=True,
    )
    with stack(mode, "least_loaded", ns.keep, probe=1.0) as procs:
        requests, killed_at, after_back = trio.run(load_and_kill, procs, ns)
        assert procs.node is not None
        procs.node.popen.send_signal(signal.SIGTERM)  # it drains; its store is then read
        procs.node.popen.wait(timeout=60)
        runs = node_cli(procs, "runs", "list", "--limit", "1000000")
        usage = node_cli(procs, "usage", "--by", "target")
    for line in report(requests, killed_at, after_back, runs, usage):
        print(line)
    print(f"load average at end (1, 5, 15 min): {load()}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=48)
    p.add_argument("--kill-at", type=float, default=5.0)
    p.add_argument("--back-at", type=float, default=10.0)
    p.add_argument("--keep", default=None)
    p.add_argument("--rev", default=None)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    if args.rev:
        sys.exit(run_at_rev(args.rev, sys.argv[1:], Path(__file__)))
    sys.exit(main(args))
