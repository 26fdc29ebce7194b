"""Token budgets and tenants in tokens, as a caller meets them: through the proto-socket
(``open_runner``), the ``iop-node submit`` CLI (a real process) and the OpenAI door
(the ``openai`` package), each on a real stack on loopback: an echo node linked to an
edge over a WebSocket.

- a run whose reservation (its prompt, estimated at 4 bytes a token, plus its most
  output) is over a budget on its own is REJECTED ``too_large`` at once, with a message
  that says which budget and what to do; the door answers 400 and the CLI one line;
  nothing of it starts, and the session goes on serving;
- a tenant over its ``tokens_per_minute`` whose refill comes after its queue timeout is
  REJECTED ``rate_limited`` with a ``retry_after``: the door answers 429 with
  ``Retry-After``, the CLI says when to retry;
- the run's output bound is what it reserves: ``max_tokens`` when it asks, else the
  target's ``max_output_tokens``, which is then sent to the engine as its bound.
"""

from __future__ import annotations

import json
import re

import openai
import pytest
import trio

from iop_trio.model import EventKind, RunSpec, RunStatus, TargetSpec, TenantLimits, Usage
from iop_trio.runtime import Node, RuntimeLimits
from iop_trio.store.memory import MemoryStore
from iop_trio.transport import open_runner

from .engines import OPENAI, EngineServer, Exchange, Reply, make_node, run_to_end, serve
from .support import CountingEcho, logged
from .test_cli import cli
from .test_front_door import Door, in_thread
from .test_wire import TOKEN, stack

LONG = "word " * 200  # 1,000 bytes: 250 prompt tokens by the estimate


def token_node(
    *, budget: int | None = None, tenants: dict[str, TenantLimits] | None = None, **target: object
) -> Node:
    return Node(
        node_id="n1",
        adapters=[CountingEcho()],
        targets=[
            TargetSpec("echo", "a", concurrency=4, token_budget=budget, **target)  # type: ignore[arg-type]
        ],
        limits=RuntimeLimits(tenants=tenants or {}, queue_timeout=2.0),
        store=MemoryStore(),
    )


async def test_a_run_too_large_for_its_budget_is_rejected_at_once_and_others_go_on():
    node = token_node(budget=200, max_output_tokens=16)
    async with stack(node) as s, open_runner(s.edge.client_url, token=TOKEN) as client:
        async with client.run(RunSpec("echo/a", LONG)) as stream:
            text, last = await stream.collect()
        assert text == ""
        assert (last.kind, last.reason) == (EventKind.REJECTED, "too_large")
        assert last.retry_after is None  # retrying it the same never helps
        assert "reserves 266 tokens" in last.message
        assert "target echo/a's token_budget of 200" in last.message
        assert "max_tokens" in last.message and "shorter prompt" in last.message
        [record] = await node.store.list_runs()
        assert (record.status, record.reason, record.started) == (
            RunStatus.REJECTED,
            "too_large",
            None,
        )
        # the same session serves a run that fits
        async with client.run(RunSpec("echo/a", "small enough")) as stream:
            text, last = await stream.collect()
        assert (text, last.kind) == ("small enough", EventKind.SUCCEEDED)


async def test_submit_says_a_run_is_too_large_in_one_line():
    async with stack(token_node(budget=200, max_output_tokens=16)) as s:
        result = await cli(
            "submit", "--edge", s.edge.url, "--token", TOKEN, "--target", "echo/a", LONG
        )
        assert result.returncode == 1
        err = result.stderr.decode()
        assert "Traceback" not in err
        last = err.splitlines()[-1]
        assert last.startswith("rejected (too_large: the run reserves 266 tokens"), last
        assert "retry after" not in last


async def test_submit_says_when_a_rate_limited_tenant_may_retry():
    tenants = {"t": TenantLimits(tokens_per_minute=300)}  # 5 tokens a second
    async with stack(token_node(tenants=tenants, max_output_tokens=20), client_tenant="t") as s:
        argv = ["submit", "--edge", s.edge.url, "--token", TOKEN, "--target", "echo/a"]
        first = await cli(*argv, LONG)  # 270 of the bucket's 300
        assert first.returncode == 0, first.stderr
        second = await cli(*argv, LONG)  # 270 more: about 48 s away, past its 2 s
        assert second.returncode == 1
        last = second.stderr.decode().splitlines()[-1]
        assert last.startswith("rejected (rate_limited: "), last
        match = re.search(r"; retry after (\d+(\.\d+)?)s$", last)
        # the first run was charged what it used (the echo's count), not what it reserved
        done = [r for r in await s.node.store.list_runs() if r.status is RunStatus.SUCCEEDED]
        assert len(done) == 1 and done[0].usage is not None
        used = (done[0].usage.prompt_tokens or 0) + (done[0].usage.completion_tokens or 0)
        refill = (used + 270 - 300) / 5
        assert match is not None and refill - 5 < float(match[1]) <= refill, last


async def test_the_door_answers_400_for_too_large_and_429_with_retry_after_for_rate_limited():
    from iop_trio.edge.front_door import serve_door

    tenants = {"t": TenantLimits(tokens_per_minute=300)}
    node = token_node(budget=400, tenants=tenants, max_output_tokens=20)
    async with stack(node, client_tenant="t") as s, trio.open_nursery() as nursery:
        port = await nursery.start(serve_door, s.edge, "127.0.0.1", 0)
        d = Door(s.edge, node, f"http://127.0.0.1:{port}")
        client = d.client()

        def ask(content: str, **kw: object) -> object:
            return client.chat.completions.create(
                model="echo/a",
                messages=[{"role": "user", "content": content}],
                **kw,  # type: ignore[arg-type]
            )

        with pytest.raises(openai.BadRequestError) as large:
            await in_thread(lambda: ask(LONG * 2, stream=True))
        assert large.value.status_code == 400
        body = large.value.body
        assert isinstance(body, dict) and "token_budget of 400" in body["message"]
        assert "retry-after" not in large.value.response.headers

        first = await in_thread(lambda: ask(LONG))  # it reserves 252 + 20 of the 300
        used = first.usage.total_tokens  # type: ignore[attr-defined]
        refill = (used + 272 - 300) / 5  # it was charged what it used: 272 more are due
        with pytest.raises(openai.RateLimitError) as limited:
            await in_thread(lambda: ask(LONG))
        response = limited.value.response
        assert response.status_code == 429
        assert refill - 5 < int(response.headers["retry-after"]) <= refill + 1
        assert "tokens_per_minute" in limited.value.message
        nursery.cancel_scope.cancel()


# --- what a run reserves, against engines' wire formats ---------------------------------------


def wire_engine(
    server: EngineServer, *, count: dict[str, object] | None
) -> list[dict[str, object]]:
    """Script ``server`` as an OpenAI-compatible engine: its models, a completion of two
    tokens, and ``/tokenize`` answering ``count`` (None: 404, as a server without one).
    Returns the bodies the completions were asked with, as they come."""
    asked: list[dict[str, object]] = []

    def answer(exchange: Exchange) -> Reply:
        if exchange.path == "/v1/models":
            return Reply(
                parts=[b'{"object": "list", "data": [{"id": "qwen"}]}'], content_length=True
            )
        if exchange.path == "/tokenize":
            if count is None:
                return Reply(404, parts=[b'{"detail": "Not Found"}'], content_length=True)
            return Reply(parts=[json.dumps(count).encode()], content_length=True)
        asked.append(json.loads(exchange.body))
        return OPENAI.reply(["a", "b"], usage=Usage("length", 9, 2))

    server.handler = answer
    return asked


@pytest.mark.parametrize(
    ("tokenizer", "count", "prompt_tokens"),
    [
        ("vllm", {"count": 37, "max_model_len": 4096}, 37),  # vLLM: the chat template's count
        ("llamacpp", {"tokens": list(range(21))}, 21),  # llama.cpp's server: the ids
        ("estimate", None, 250),  # 1,000 bytes at 4 a token
    ],
)
async def test_a_prompt_is_counted_by_the_engines_tokenizer_the_target_names(
    tokenizer, count, prompt_tokens
):
    async with serve() as server:
        wire_engine(server, count=count)
        node = make_node(
            OPENAI.adapter(server.url),
            model="qwen",
            token_budget=prompt_tokens + 10,
            max_output_tokens=16,
            tokenizer=tokenizer,
        )
        async with node.running():
            record, _ = await run_to_end(node, RunSpec("vllm/qwen", LONG))
        assert (record.status, record.reason) == (RunStatus.REJECTED, "too_large")
        assert f"reserves {prompt_tokens + 16} tokens" in record.message
        tokenized = [e for e in server.exchanges if e.path == "/tokenize"]
        assert len(tokenized) == (0 if tokenizer == "estimate" else 1)
        if tokenizer == "vllm":
            body = json.loads(tokenized[0].body)
            assert body == {"model": "qwen", "messages": [{"role": "user", "content": LONG}]}
        elif tokenizer == "llamacpp":
            assert json.loads(tokenized[0].body) == {"content": LONG}


async def test_a_tokenizer_that_fails_is_said_once_and_the_prompt_estimated():
    async with serve() as server:
        asked = wire_engine(server, count=None)
        node = make_node(
            OPENAI.adapter(server.url),
            model="qwen",
            token_budget=1000,
            max_output_tokens=16,
            tokenizer="vllm",
        )
        with logged("iop_trio.runtime.reservation") as records:
            async with node.running():
                for _ in range(2):
                    record, _ = await run_to_end(node, RunSpec("vllm/qwen", "count me"))
                    assert record.status is RunStatus.SUCCEEDED
        said = [r.getMessage() for r in records if "tokenizer" in r.getMessage()]
        assert len(said) == 1 and "estimated at 4 bytes a token" in said[0], said
        assert len(asked) == 2


async def test_a_run_that_asks_no_bound_is_sent_the_one_it_reserved_and_settles_what_it_used():
    async with serve() as server:
        asked = wire_engine(server, count={"count": 9})
        node = make_node(
            OPENAI.adapter(server.url),
            model="qwen",
            concurrency=2,
            token_budget=100,
            max_output_tokens=30,
            tokenizer="vllm",
        )
        async with node.running():
            first, _ = await run_to_end(node, RunSpec("vllm/qwen", "no bound"))
            second, _ = await run_to_end(
                node, RunSpec("vllm/qwen", "its own", options={"max_tokens": 5})
            )
            pool = node.gate.target_pool("vllm/qwen")
            assert (pool.reserved, pool.running) == (0, 0)  # settled and given back
        assert first.status is second.status is RunStatus.SUCCEEDED
        assert [body["max_tokens"] for body in asked] == [30, 5]
        assert first.usage is not None
        assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (9, 2)
        assert not first.usage.prompt_estimated and not first.usage.completion_estimated
