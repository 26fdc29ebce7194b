"""benchmarks/sim_engine.py, the simulated continuous-batching engine of benchmarks/capacity.py.

The scheduler (``Engine``) is tested on trio's MockClock (``autojump_clock``), where its
step times are exact; the HTTP side on a real loopback server with a fast law and the
real clock, waiting on the engine's own state (``Engine.until``), never on time.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from iop_trio.adapters import AdapterRequest, Completion, Delta
from iop_trio.adapters.openai import OpenAIAdapter, OpenAISettings
from iop_trio.adapters.stream_formats import SSEDecoder

from .engines import collect

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
sim = importlib.import_module("sim_engine")

WAIT = 10  # seconds a test waits for the engine, at most (real clock)
FAST = sim.StepLaw(base=0.001, per_seq=0.0, prefill=0.0)


# --- the tokenizer ---------------------------------------------------------------------------


def test_a_token_is_up_to_five_characters_of_a_word_or_one_other_character():
    assert list(sim.pieces("hello inference, ok!")) == ["hello", "infer", "ence", ",", "ok", "!"]
    assert sim.count_tokens("") == 0
    assert sim.count_tokens(sim.TOKEN_TEXT * 5) == 5  # what the engine writes counts as made
    assert sim.tokenize("hello hello") == [sim.token_id("hello")] * 2
    assert all(sim.FIRST_TEXT_ID <= t < sim.VOCAB for t in sim.tokenize("any text at all, ok"))


def test_a_chat_prompt_is_its_template_and_its_contents():
    messages = [("system", "be brief"), ("user", "inference node gate")]
    ids = sim.chat_tokens(messages)
    assert len(ids) == sim.chat_token_count(messages) == (4 + 2) + (4 + 4) + 2
    assert ids[:2] == [sim.MESSAGE_START, sim.ROLE_IDS["system"]]
    assert ids[-2:] == [sim.MESSAGE_START, sim.ROLE_IDS["assistant"]]
    assert len(sim.chat_tokens(messages, add_generation_prompt=False)) == len(ids) - 2


def test_the_benchmark_prompts_come_to_four_thirds_of_a_token_a_word():
    capacity = importlib.import_module("capacity")
    short, long_, _ = capacity.PHASES
    assert sim.count_tokens(capacity.prompt_of(900)) == 1200
    assert (short.prompt_tokens, long_.prompt_tokens) == (60, 1206)
    # all 48 short runs fit in the default cache at once; 3 long ones
    assert 48 * (60 + 24) <= 4096 < 49 * (60 + 24)
    assert 3 * (1206 + 124) <= 4096 < 4 * (1206 + 124)


# --- the scheduler, on the mock clock --------------------------------------------------------


@asynccontextmanager
async def looping(engine: Any) -> AsyncIterator[Any]:
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        yield engine
        nursery.cancel_scope.cancel()


async def token_times(seq: Any) -> list[float]:
    """When each of ``seq``'s tokens came out (trio clock), until it is done."""
    times: list[float] = []
    while not seq.done:
        await seq.wait_beyond(len(times))
        times += [trio.current_time()] * (seq.generated - len(times))
    return times


async def test_a_request_waits_in_the_fifo_until_its_prompt_and_output_fit(autojump_clock):
    engine = sim.Engine(kv_tokens=100, law=sim.StepLaw(1.0, 0.0, 0.0))
    async with looping(engine):
        a = engine.add(40, 20)  # 60: fits
        b = engine.add(30, 20)  # 50 > 40 free: waits
        c = engine.add(5, 5)  # 10 would fit, but waits behind b (head of line)
        assert (a.state, b.state, c.state) == ("running", "waiting", "waiting")
        assert engine.kv_used == 60 and list(engine.waiting) == [b, c]
        await engine.until(lambda: a.done)
        # a's cache freed at the end of its last step: both admitted at that instant
        assert (a.finish_reason, b.state, c.state) == ("length", "running", "running")
        assert engine.kv_used == 60 and not engine.waiting
        assert a.generated == 20 and b.generated == c.generated == 0


async def test_a_step_takes_base_plus_per_request_plus_the_prefill_of_those_joining(
    autojump_clock,
):
    law = sim.StepLaw(base=1.0, per_seq=0.5, prefill=0.01)
    engine = sim.Engine(kv_tokens=1000, law=law)
    async with looping(engine), trio.open_nursery() as nursery:
        t0 = trio.current_time()
        a = engine.add(10, 4)
        times: dict[str, list[float]] = {}

        async def record(name: str, seq: Any) -> None:
            times[name] = await token_times(seq)

        nursery.start_soon(record, "a", a)
        # a alone: its first step prefills its 10 prompt tokens
        await trio.sleep_until(t0 + 1.6 + 0.7)  # in its second step
        b = engine.add(20, 2)  # joins at the next step, with its prefill
        nursery.start_soon(record, "b", b)
    first = t0 + 1.0 + 0.5 + 0.1
    second = first + 1.5  # a alone
    third = second + 1.0 + 2 * 0.5 + 0.2  # a and b; b's prefill
    fourth = third + 2.0  # a and b (a's last, b's last)
    assert times["a"] == pytest.approx([first, second, third, fourth])
    assert times["b"] == pytest.approx([third, fourth])
    assert engine.window.steps == 4 and engine.window.tokens == 6


async def test_a_prefix_cached_skips_its_prefill_and_a_new_one_pays_it(autojump_clock):
    law = sim.StepLaw(base=0.0, per_seq=0.0, prefill=0.01)
    engine = sim.Engine(kv_tokens=10_000, law=law, prefix_cache_tokens=64)
    system = sim.chat_tokens([("system", "alpha " * 40)], add_generation_prompt=False)
    tails = [sim.tokenize(f"{i} asks a question") for i in range(3)]  # apart at once
    prompts = [system + tail for tail in tails]
    other = sim.chat_tokens([("system", "beta " * 40)], add_generation_prompt=False)

    async def first_token_after(ids: list[int]) -> float:
        began = trio.current_time()
        seq = engine.add(len(ids), 1, blocks=sim.block_hashes(ids))
        await seq.wait_beyond(0)
        return trio.current_time() - began

    async with looping(engine):
        cold = await first_token_after(prompts[0])
        warm = await first_token_after(prompts[1])
        assert cold == pytest.approx(len(prompts[0]) * 0.01)
        # the blocks that are all system prompt (the cache holds 4) are spared
        spared = min(len(system) // 16, 4) * 16
        assert warm == pytest.approx((len(prompts[1]) - spared) * 0.01)
        # another prefix pays in full, and evicts the least recently used
        assert await first_token_after(other) == pytest.approx(len(other) * 0.01)
    assert engine.window.cached_tokens == spared
    assert engine.prefix_cache is not None and engine.prefix_cache.hits == spared


async def test_an_idle_engine_steps_as_soon_as_a_request_comes(autojump_clock):
    engine = sim.Engine(law=sim.StepLaw(1.0, 0.0, 0.0))
    async with looping(engine):
        await trio.sleep(5)
        t0 = trio.current_time()
        times = await token_times(engine.add(1, 2))
    assert times == pytest.approx([t0 + 1.0, t0 + 2.0])


async def test_stop_after_ends_a_request_before_max_tokens(autojump_clock):
    engine = sim.Engine(law=sim.StepLaw(1.0, 0.0, 0.0))
    async with looping(engine):
        seq = engine.add(5, 10, stop_after=3)
        await token_times(seq)
        capped = engine.add(5, 2, stop_after=3)
        await token_times(capped)
    assert (seq.generated, seq.finish_reason) == (3, "stop")
    assert (capped.generated, capped.finish_reason) == (2, "length")
    assert engine.kv_used == 0


async def test_a_client_that_leaves_frees_its_cache_at_once(autojump_clock):
    engine = sim.Engine(kv_tokens=100, law=sim.StepLaw(1.0, 0.0, 0.0))
    async with looping(engine):
        a = engine.add(50, 40)  # 90
        b = engine.add(50, 40)  # waits
        c = engine.add(5, 6)  # 11: waits behind b
        await a.wait_beyond(0)
        engine.leave(a)  # mid-run: b is admitted in the same instant; no room left for c
        assert (a.state, b.state, c.state) == ("gone", "running", "waiting")
        assert engine.kv_used == 90
        engine.leave(c)  # a waiting request leaves the FIFO
        assert not engine.waiting and engine.window.gone == 2
        generated = a.generated
        await token_times(b)
        assert a.generated == generated  # nothing more for a request that has gone
        engine.leave(b)  # done already: nothing
    assert engine.kv_used == 0 and engine.window.gone == 2


async def test_a_head_that_leaves_lets_the_fifo_behind_it_in(autojump_clock):
    engine = sim.Engine(kv_tokens=100, law=sim.StepLaw(1.0, 0.0, 0.0))
    async with looping(engine):
        engine.add(40, 20)  # 60
        big = engine.add(50, 40)  # 90: waits
        small = engine.add(10, 10)  # 20: fits, but behind big
        assert small.state == "waiting"
        engine.leave(big)
        assert small.state == "running" and engine.kv_used == 80


async def test_waiting_and_running_are_integrated_over_time(autojump_clock):
    engine = sim.Engine(kv_tokens=100, law=sim.StepLaw(1.0, 0.0, 0.0))
    async with looping(engine):
        engine.reset()
        a = engine.add(40, 10)  # 50
        b = engine.add(40, 10)  # 50: fits with a
        c = engine.add(40, 10)  # waits 10 s, then runs 10 s
        await token_times(c)
        stats = engine.reset()
        assert a.done and b.done
        assert stats["elapsed"] == pytest.approx(20.0)
        assert stats["mean_waiting"] == pytest.approx(10 / 20)
        assert stats["mean_running"] == pytest.approx((2 * 10 + 10) / 20)
        assert stats["mean_kv_usage"] == pytest.approx((1.0 * 10 + 0.5 * 10) / 20)
        assert (stats["max_waiting"], stats["max_running"]) == (1, 2)
        assert (stats["tokens"], stats["steps"], stats["finished"]) == (30, 20, 3)
        assert stats["tokens_per_s"] == pytest.approx(1.5)
        assert stats["prompt_tokens"] == 120
        assert stats["lag_mean_ms"] == 0 and stats["lost_s"] == 0
        await trio.sleep(4)  # an idle window
        idle = engine.reset()
        assert idle["elapsed"] == pytest.approx(4.0)
        assert (idle["tokens"], idle["mean_waiting"], idle["mean_running"]) == (0, 0, 0)


async def test_a_request_that_can_never_fit_is_refused(autojump_clock):
    engine = sim.Engine(kv_tokens=100)
    with pytest.raises(sim.TooLong, match="maximum context length is 100"):
        engine.add(60, 41)
    with pytest.raises(ValueError, match=">= 1"):
        engine.add(10, 0)
    seq = engine.add(30, None)  # the rest of the context, as vLLM's default
    assert seq.max_tokens == 70 and seq.reserved == 100
    assert engine.window.refused == 2 and "Engine" in repr(engine) and "Request 1" in repr(seq)


# --- the HTTP side, on loopback ------------------------------------------------------------


@asynccontextmanager
async def served(engine: Any, metrics: str = "vllm") -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(sim.serve, engine, metrics=metrics))
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


def chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": "bench", "messages": [{"role": "user", "content": content}], **fields}


async def stream_events(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[str]:
    """The data of each server-sent event of a streamed completion."""
    decoder = SSEDecoder()
    out: list[str] = []
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for data in response.aiter_bytes():
            out += [event.data for event in decoder.feed(data)]
    return out


async def test_a_stream_is_a_role_chunk_a_chunk_a_token_the_usage_and_done():
    engine = sim.Engine(law=FAST)
    prompt = "Count the inference tokens, please."
    async with served(engine) as url, httpx.AsyncClient(timeout=WAIT) as http:
        body = chat(prompt, max_tokens=7, stream=True, stream_options={"include_usage": True})
        events = await stream_events(http, url, body)
        counted = await http.post(url + "/tokenize", json={"model": "bench", **body})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = chunks[1:-1]
    assert [c["choices"][0]["delta"]["content"] for c in tokens] == [sim.TOKEN_TEXT] * 7
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 6 + ["length"]
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == len(tokens)
    assert usage["usage"]["prompt_tokens"] == counted.json()["count"]
    assert counted.json()["count"] == sim.count_tokens(prompt) + 6
    assert engine.window.tokens == 7 and engine.kv_used == 0


async def test_without_include_usage_a_stream_has_no_usage_chunk():
    engine = sim.Engine(law=FAST)
    async with served(engine) as url, httpx.AsyncClient(timeout=WAIT) as http:
        events = await stream_events(http, url, chat("hi", max_tokens=2, stream=True))
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["choices"] for e in events[:-1])


async def test_a_whole_completion_carries_its_text_finish_reason_and_usage():
    engine = sim.Engine(law=FAST)
    async with served(engine) as url, httpx.AsyncClient(timeout=WAIT) as http:
        body = chat("inference node gate", max_completion_tokens=9, stop_after=4)
        answer = (await http.post(url + "/v1/chat/completions", json=body)).json()
    choice = answer["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": sim.TOKEN_TEXT * 4}
    assert choice["finish_reason"] == "stop"
    assert answer["usage"] == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}


async def test_tokenize_answers_in_vllm_and_llamacpp_shapes():
    engine = sim.Engine(kv_tokens=2048, law=FAST)
    text = "A prompt, in words: inference!"
    async with served(engine) as url, httpx.AsyncClient(timeout=WAIT) as http:
        prompt = (
            await http.post(url + "/tokenize", json={"model": "bench", "prompt": text})
        ).json()
        bare = (await http.post(url + "/tokenize", json={"prompt": text})).json()
        llama = (await http.post(url + "/tokenize", json={"content": text})).json()
        pieces = await http.post(url + "/tokenize", json={"content": text, "with_pieces": True})
        other = await http.post(url + "/tokenize", json={"model": "other", "prompt": text})
        empty = await http.post(url + "/tokenize", json={"model": "bench"})
    assert (
        prompt
        == bare
        == {
            "count": sim.count_tokens(text),
            "max_model_len": 2048,
            "tokens": sim.tokenize(text),
            "token_strs": None,
        }
    )
    assert llama == {"tokens": sim.tokenize(text)}
    assert [p["piece"] for p in pieces.json()["tokens"]] == list(sim.pieces(text))
    assert other.status_code == 404 and "does not exist" in other.json()["error"]["message"]
    assert empty.status_code == 400


def families(text: str) -> dict[str, tuple[str, float]]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = (family.type, sample.value)
    return out


async def test_metrics_have_vllms_names_and_say_what_runs_and_waits():
    engine = sim.Engine(kv_tokens=100, law=sim.StepLaw(3600.0, 0.0, 0.0))  # no step ends
    engine.add(40, 20)
    engine.add(40, 20)  # waits
    async with served(engine) as url, httpx.AsyncClient(timeout=WAIT) as http:
        response = await http.get(url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    seen = families(response.text)
    assert seen == {
        "vllm:num_requests_running": ("gauge", 1.0),
        "vllm:num_requests_waiting": ("gauge", 1.0),
        "vllm:kv_cache_usage_perc": ("gauge", 0.6),
        "vllm:prompt_tokens_total": ("counter", 40.0),  # a's, prefilled in the first step
        "vllm:generation_tokens_total": ("counter", 0.0),
    }
    assert 'vllm:num_requests_running{model_name="bench"} 1.0' in response.text


async def test_metrics_can_have_llamacpps_names_or_be_absent():
    engine = sim.Engine(kv_tokens=100, law=FAST)
    async with httpx.AsyncClient(timeout=WAIT) as http:
        async with served(engine, metrics="llamacpp") as url:
            llama = families((await http.get(url + "/metrics")).text)
        async with served(engine, metrics="none") as url:
            none = await http.get(url + "/metrics")
    assert {"llamacpp:requests_processing", "llamacpp:requests_deferred"} <= set(llama)
    assert llama["llamacpp:kv_cache_usage_ratio"] == ("gauge", 0.0)
    assert llama["llamacpp:tokens_predicted_total"][0] == "counter"
    assert none.status_code == 404


async def test_a_client_that_disconnects_mid_stream_frees_its_cache_at_once():
    engine = sim.Engine(kv_tokens=1000, law=sim.StepLaw(0.01, 0.0, 0.0))
    async with served(engine) as url, httpx.AsyncClient(timeout=WAIT) as http:
        body = chat("stream me", max_tokens=900, stream=True)
        with trio.fail_after(WAIT):
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
                async for data in response.aiter_bytes():
                    if sim.TOKEN_TEXT.encode() in data:
                        break  # leaving closes the connection mid-stream
            await engine.until(lambda: engine.kv_used == 0)
    assert engine.window.gone == 1 and not engine.running
    assert engine.window.tokens < 900


async def test_a_client_that_disconnects_while_waiting_leaves_the_fifo():
    engine = sim.Engine(kv_tokens=100, law=sim.StepLaw(3600.0, 0.0, 0.0))
    engine.add(50, 40)  # holds the cache for an hour
    async with served(engine) as url, httpx.AsyncClient(timeout=WAIT) as http:
        with trio.fail_after(WAIT):
            async with trio.open_nursery() as nursery:

                async def ask() -> None:
                    await http.post(url + "/v1/chat/completions", json=chat("hi", max_tokens=20))

                nursery.start_soon(ask)
                await engine.until(lambda: len(engine.waiting) == 1)
                nursery.cancel_scope.cancel()  # the client closes its connection
            await engine.until(lambda: not engine.waiting)
    assert engine.window.gone == 1 and engine.kv_used == 90


async def test_a_streamed_request_that_waits_has_its_headers_and_nothing_more():
    engine = sim.Engine(kv_tokens=100, law=sim.StepLaw(3600.0, 0.0, 0.0))
    engine.add(50, 40)  # holds the cache for an hour
    async with served(engine) as url, httpx.AsyncClient(timeout=WAIT) as http:
        body = chat("hi", max_tokens=20, stream=True)
        with trio.fail_after(WAIT):
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200  # as vLLM: headers before any token
                assert len(engine.waiting) == 1
            await engine.until(lambda: not engine.waiting)  # closed: out of the FIFO
    assert engine.window.gone == 1 and engine.window.tokens == 0


async def test_requests_the_engine_cannot_serve_are_refused_with_openais_error_shape():
    engine = sim.Engine(kv_tokens=100, law=FAST)
    async with served(engine) as url, httpx.AsyncClient(timeout=WAIT) as http:
        path = url + "/v1/chat/completions"
        too_long = await http.post(path, json=chat("hi", max_tokens=100))
        wrong_model = await http.post(path, json={**chat("hi"), "model": "gpt"})
        no_messages = await http.post(path, json={"model": "bench"})
        not_json = await http.post(path, content=b"{")
        bad_count = await http.post(path, json=chat("hi", max_tokens=0))
        nowhere = await http.get(url + "/v2/anything")
        wrong_method = await http.get(path)
        models = (await http.get(url + "/v1/models")).json()
        health = await http.get(url + "/health")
    assert too_long.status_code == 400
    assert "maximum context length is 100" in too_long.json()["error"]["message"]
    assert wrong_model.status_code == 404
    assert [r.status_code for r in (no_messages, not_json, bad_count)] == [400] * 3
    assert (nowhere.status_code, wrong_method.status_code) == (404, 405)
    assert [m["id"] for m in models["data"]] == ["bench"]
    assert models["data"][0]["max_model_len"] == 100
    assert health.status_code == 200 and engine.window.refused == 1


async def test_bench_stats_are_exact_counters_and_reset_starts_a_window():
    engine = sim.Engine(law=FAST)
    async with served(engine) as url, httpx.AsyncClient(timeout=WAIT) as http:
        await http.post(url + "/v1/chat/completions", json=chat("a b c", max_tokens=5))
        ended = (await http.post(url + "/bench/reset")).json()
        after = (await http.get(url + "/bench/stats")).json()
    assert (ended["tokens"], ended["finished"], ended["arrived"]) == (5, 1, 1)
    assert ended["law"] == {"base": 0.001, "per_seq": 0.0, "prefill": 0.0}
    assert (after["tokens"], after["finished"], after["steps"]) == (0, 0, 0)
    assert after["mean_batch"] is None  # no step in the window: null, not NaN


async def test_the_nodes_openai_adapter_reads_the_stream_and_its_usage():
    engine = sim.Engine(law=FAST)
    async with served(engine) as url:
        adapter = OpenAIAdapter("sim", OpenAISettings(base_url=url))
        try:
            request = AdapterRequest(
                run_id="r1", model="bench", prompt="inference node", params={"max_tokens": 6}
            )
            chunks = await collect(adapter, request)
            assert await adapter.served_models() == frozenset({"bench"})
        finally:
            await adapter.aclose()
    text = "".join(c.text for c in chunks if isinstance(c, Delta))
    assert text == sim.TOKEN_TEXT * 6
    end = chunks[-1]
    assert isinstance(end, Completion)
    assert (end.usage.done_reason, end.usage.completion_tokens) == ("length", 6)
    assert end.usage.prompt_tokens == sim.chat_token_count([("user", "inference node")]) == 9
