"""A simulated continuous-batching LLM engine with vLLM's wire, on trio and h11.

    python benchmarks/sim_engine.py [--host 127.0.0.1] [--port 0] [--model bench]
        [--kv-tokens 4096] [--max-model-len N] [--base-ms 80] [--per-seq-ms 1.6]
        [--prefill-us 50] [--metrics vllm|llamacpp|none] [--max-batch N]
        [--admit arrival|step] [--kv-mode reserve|paged] [--scrape-ms 0]
        [--prefix-cache-tokens 0] [--exit-with-parent]

It prints ``sim engine listening on HOST:PORT`` once it serves. Standard library,
trio and h11 only, so it runs beside any version of the node (``capacity.py --rev``).
Importable: :class:`Engine` is the scheduler without any I/O (the tests drive it
on trio's MockClock) and :func:`serve` puts HTTP in front of it.

**What it models** (the respects in which a node's gate meets an engine):

- *A KV cache of* ``kv_tokens`` *tokens, reserved at admission.* A request needs
  its prompt tokens + ``max_tokens`` (vLLM v0-style reservation of the worst
  case); it joins the running batch as soon as that fits in the free cache,
  else it waits in the engine's own FIFO. Head of line: while the first waiting
  request does not fit, none behind it is admitted, even one that would. The
  check runs when a request arrives and whenever cache is freed (a request
  finishing at the end of a step, or a client leaving), so a request that fits
  reserves at once and is never counted waiting; it joins the batch at the
  start of the next step (a running engine does not interrupt a step for it).
  With ``admit="step"`` the check runs only at step boundaries, as vLLM's and
  llama.cpp's schedulers do, so a request that arrives mid-step is counted
  waiting until the step ends even when the cache has room.
- *Paged KV* (``kv="paged"``, vLLM v1): a request is admitted when its prompt's
  blocks (``BLOCK`` = 16 tokens) fit, and takes a block more as its tokens fill
  one. When a step would need a block the cache has not, the request admitted
  last is preempted: its blocks are freed and it goes back to the head of the
  FIFO, to be prefilled again (recompute), its tokens so far kept. Its client
  sees a pause, not an error.
- *A batch cap* (``max_batch``, vLLM's ``max_num_seqs``, llama.cpp's slots):
  at most that many requests run; the rest wait in the FIFO whatever the cache.
- *A step loop.* Each step produces one token for every request in the batch
  as the step began, and takes ``base + per_seq * batch + prefill * P`` seconds,
  where P is the prompt tokens of the requests that joined the batch in that
  step (their prefill; the first token comes out of the step that prefills it,
  as in vLLM). An idle engine starts a step as soon as a request is admitted.
- *Ends.* A request leaves when it has produced ``max_tokens``
  (``finish_reason: "length"``) or its own ``stop_after`` tokens, if fewer
  (``"stop"``: an end-of-sequence the sampler chose; a field of this engine
  only). A client that disconnects (its socket closed, while it waits or
  runs) is taken out at once: its cache is freed, so the FIFO's head may be
  admitted in the same instant. A request that could never fit
  (prompt + max_tokens > ``max_model_len``, which is at most ``kv_tokens``) is
  refused 400 as vLLM refuses it, so it cannot block the FIFO for ever; one that
  gives no ``max_tokens`` gets ``max_model_len - prompt`` (vLLM's default), so it
  reserves the whole context.
- *A deterministic tokenizer* (:func:`tokenize`), used for ``POST /tokenize``
  and for the engine's own accounting alike: a token is a piece of up to 5
  characters of a word (a run of letters, digits or ``_``), or one other
  non-space character; so a word of 1-5 letters is one token and one of 6-10 two,
  and English prose comes to about 4/3 tokens a word (1.26 for the words of this
  project's README, 1.32 for a paragraph of Dickens with its punctuation). A chat's prompt is its
  template: 4 tokens a message around its content's tokens (start, role, end,
  newline) and 2 for the assistant's turn (the generation prompt), so one user
  message of n tokens is n + 6. Every generated token is the text ``" tok"``,
  which this tokenizer counts as one token.
- *Its wire*: OpenAI ``POST /v1/chat/completions``, streamed (server-sent
  ``chat.completion.chunk`` events: the headers at once and a role chunk with
  the first token, as vLLM sends them, so a request waiting in the FIFO has its
  headers and no byte more; one token a chunk, ``finish_reason`` on the last
  token's chunk; a usage chunk when ``stream_options.include_usage``; then
  ``data: [DONE]``) or whole; ``GET /v1/models``; ``GET /health``; ``POST
  /tokenize`` in vLLM's shape (``{"model", "prompt"}`` or ``{"model",
  "messages"[, "add_generation_prompt"]}`` -> ``{"count", "max_model_len",
  "tokens"}``) and llama.cpp server's (``{"content"[, "with_pieces"]}`` ->
  ``{"tokens": [...]}``); ``GET /metrics`` in Prometheus' text format with
  vLLM's names (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` 0..1 — the reserved share in ``reserve`` mode,
  which is what admission checks; the blocks in use in ``paged`` mode, as vLLM
  counts it — ``vllm:prompt_tokens_total`` counted at prefill,
  ``vllm:generation_tokens_total``), or llama.cpp's (``llamacpp:requests_processing``,
  ``llamacpp:requests_deferred``, ``llamacpp:kv_cache_usage_ratio`` and its two
  token counters), or none (404, as a server started without them). With
  ``scrape_ms`` the metrics answer that many ms late (an engine whose HTTP loop
  is busy), the figures taken as the answer leaves.
- *Exact counters for benchmarks*: ``GET /bench/stats`` and ``POST /bench/reset``
  (which answers the stats of the window it ends, then starts a new one, with no
  checkpoint in between): tokens generated and prompt tokens prefilled in the
  window, requests that arrived, finished, left and were refused, and the
  time averages of the requests waiting and running and of the cache reserved,
  integrated over every change (not sampled), with their peaks, and of the requests
  *queued* (``mean_queued``: those of the waiting that an admission check left
  waiting, for want of cache or of a place in the batch, and the preempted; with
  ``admit="step"`` a request that came mid-step and joins at the next step is
  waiting, not queued); the steps, and
  how late the step loop woke against the law (``lag_*``; a loop that is late by
  less than a step catches up on the next one, so scheduling jitter does not
  change the rate; the time lost to longer stalls is ``lost_s``).

- *A prefix cache* (``--prefix-cache-tokens N``, off by default): a prompt's leading
  16-token blocks that this engine prefilled recently skip their prefill, charged per
  prompt token, so a miss on a long prompt is slow; bounded, least recently used
  evicted (``prefix_cache.py`` says what it models and leaves out). ``cached_tokens``
  in ``/bench/stats`` counts the prompt tokens it spared.

**What it leaves out:** swapping preempted blocks to CPU (a preempted request
is always recomputed), vLLM's watermark of free blocks kept at admission,
prefix caching as part of the KV cache (the prefix cache is a bound of its own),
chunked prefill (a long prompt's prefill is one step, however
long), speculative decoding, sampling and text (every token is ``" tok"``;
``temperature``, ``stop`` and the other sampling fields are accepted and ignored),
priorities, ``n`` > 1, the legacy ``/v1/completions``, tools, and the engine's own
CPU (the step time is the model's, slept on trio's clock; the loop does little
else).

**The default law**, ``base`` 80 ms + ``per_seq`` 1.6 ms a request in the batch +
``prefill`` 50 µs a prompt token, has the shape of the field test of issue 20 at
a third of its speed: a batch of 48 short requests steps in 157 ms before any
prefill, 305 tokens/s
(the field's engine: 905), a batch of 4 in 86 ms, 46 tokens/s (the field's: 136);
the ratio, 6.6x, is the field's. A third because the relay has to stay far from
the machine's limit: on the 2-core development VM (shared with two other engineers'
work) the node, the edge and 48 streaming clients took 16%, 11% and 7% of a core at
290 tokens/s (``capacity.py``, a token a chunk: about 1.2 ms of CPU a token between
them), so at the field's 905 they would want more than a core and would compete
with each other and the engine's own loop for the CPU; the engine's lag
(``/bench/stats``) shows whether it kept its law. With
``kv_tokens`` 4096, 48 short chat requests (40 words, 60 prompt tokens with the
template, ``max_tokens`` 24) all fit at once, long ones (900 words, 1206 prompt
tokens, ``max_tokens`` 124) three at a time: the issue's workload.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import h11
import trio
from prefix_cache import PrefixCache, block_hashes

TOKEN_TEXT = " tok"  # every token the engine generates
PIECE = 5  # characters of a word one token covers
VOCAB = 32_000  # token ids are 0 <= id < VOCAB; the first few are the template's
MESSAGE_START, MESSAGE_END, NEWLINE, BOS = 1, 2, 3, 4
ROLE_IDS = {"system": 5, "user": 6, "assistant": 7, "tool": 8}
OTHER_ROLE = 9
FIRST_TEXT_ID = 16
MESSAGE_TOKENS = 4  # the template's tokens around a message's content
GENERATION_PROMPT_TOKENS = 2  # the assistant's turn the engine answers in
METRICS_KINDS = ("vllm", "llamacpp", "none")
ADMIT_KINDS = ("arrival", "step")  # when a request that fits joins: at once, or at a step
KV_KINDS = ("reserve", "paged")  # what a request holds: its worst case, or its blocks
BLOCK = 16  # tokens of a cache block (paged)
MAX_BODY = 64 * 1024 * 1024  # bytes of a request body, at most
CREATED = 1_700_000_000  # the "created" of every completion (deterministic output)

_PIECES = re.compile(r"\w+|[^\w\s]")


# --- the tokenizer -----------------------------------------------------------------------------


def pieces(text: str) -> Iterator[str]:
    """The text of each token of ``text``: words cut into pieces of up to :data:`PIECE`
    characters, each other non-space character alone; white space is dropped."""
    for match in _PIECES.finditer(text):
        word = match.group()
        for start in range(0, len(word), PIECE):
            yield word[start : start + PIECE]


def token_id(piece: str) -> int:
    """A piece's id: the same for the same text, in every process (CRC-32, not hash())."""
    return FIRST_TEXT_ID + zlib.crc32(piece.encode()) % (VOCAB - FIRST_TEXT_ID)


def tokenize(text: str) -> list[int]:
    """The token ids of ``text`` (no special tokens)."""
    return [token_id(piece) for piece in pieces(text)]


def count_tokens(text: str) -> int:
    return sum(1 for _ in pieces(text))


def chat_tokens(
    messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool = True
) -> list[int]:
    """The token ids of a chat's prompt, template included: each ``(role, content)`` as
    start, role, content, end, newline; then start, assistant (the generation prompt)."""
    ids: list[int] = []
    for role, content in messages:
        ids += [MESSAGE_START, ROLE_IDS.get(role, OTHER_ROLE), *tokenize(content)]
        ids += [MESSAGE_END, NEWLINE]
    if add_generation_prompt:
        ids += [MESSAGE_START, ROLE_IDS["assistant"]]
    return ids


def chat_token_count(messages: Sequence[tuple[str, str]]) -> int:
    """``len(chat_tokens(messages))``, without making the ids."""
    return GENERATION_PROMPT_TOKENS + sum(
        MESSAGE_TOKENS + count_tokens(content) for _, content in messages
    )


# --- the engine, without I/O -------------------------------------------------------------------


@dataclass(frozen=True)
class StepLaw:
    """How long a step takes: ``base + per_seq * batch + prefill * prompt tokens joining``
    (seconds; ``prefill`` a prompt token)."""

    base: float = 0.080
    per_seq: float = 0.0016
    prefill: float = 0.000050

    def step_time(self, batch: int, prefill_tokens: int = 0) -> float:
        return self.base + self.per_seq * batch + self.prefill * prefill_tokens


WAITING, RUNNING, FINISHED, GONE = "waiting", "running", "finished", "gone"


@dataclass(eq=False)
class Request:
    """One request inside the engine. ``state``: waiting (in the FIFO), running
    (its cache reserved; in the batch from the next step on), finished, or gone (its
    client left first)."""

    id: int
    prompt_tokens: int
    max_tokens: int
    stop_after: int | None
    arrived: float
    state: str = WAITING
    generated: int = 0
    prefilled: bool = False
    kv: int = 0  # cache tokens it holds now (its reservation, or its blocks)
    preempted: int = 0
    passed_over: bool = False  # left waiting by an admission check (queued for room)
    finish_reason: str | None = None
    blocks: tuple[int, ...] = ()  # its prompt's block hashes (a prefix cache's keys)
    _lot: trio.lowlevel.ParkingLot = field(default_factory=trio.lowlevel.ParkingLot)

    def __repr__(self) -> str:
        return (
            f"<Request {self.id} {self.state} prompt={self.prompt_tokens} "
            f"max_tokens={self.max_tokens} generated={self.generated}>"
        )

    @property
    def reserved(self) -> int:
        """Cache tokens it needs: its prompt and its whole output."""
        return self.prompt_tokens + self.max_tokens

    @property
    def limit(self) -> int:
        """Tokens it will produce (if its client stays)."""
        return self.max_tokens if self.stop_after is None else min(self.max_tokens, self.stop_after)

    @property
    def done(self) -> bool:
        return self.state in (FINISHED, GONE)

    async def wait_beyond(self, seen: int) -> None:
        """Return once more than ``seen`` tokens are out, or the sequence is done."""
        while self.generated <= seen and not self.done:
            await self._lot.park()

    def _wake(self) -> None:
        self._lot.unpark_all()


class TooLong(ValueError):
    """A request that can never fit (prompt + max_tokens > max_model_len)."""


@dataclass
class Window:
    """Counters of the engine since ``since`` (reset by :meth:`Engine.reset`)."""

    since: float
    tokens: int = 0
    prompt_tokens: int = 0
    arrived: int = 0
    finished: int = 0
    gone: int = 0
    refused: int = 0
    steps: int = 0
    waiting_area: float = 0.0  # integral of len(waiting) dt
    queued_area: float = 0.0  # integral of the waiting that an admission check passed over
    running_area: float = 0.0
    kv_area: float = 0.0  # integral of kv_used / kv_tokens dt
    max_waiting: int = 0
    max_running: int = 0
    preempted: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache spared a prefill
    lag_sum: float = 0.0
    lag_max: float = 0.0
    lost: float = 0.0


class Engine:
    """The scheduler and step loop of the module docstring; no I/O. Make it inside a trio
    run, call :meth:`add` from any task, keep :meth:`run` running in a nursery; time is
    trio's clock."""

    def __init__(
        self,
        *,
        kv_tokens: int = 4096,
        law: StepLaw | None = None,
        max_model_len: int | None = None,
        max_batch: int | None = None,
        admit: str = "arrival",
        kv: str = "reserve",
        prefix_cache_tokens: int = 0,
    ) -> None:
        if kv_tokens < 1:
            raise ValueError(f"kv_tokens must be >= 1, not {kv_tokens}")
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, not {max_batch}")
        if admit not in ADMIT_KINDS or kv not in KV_KINDS:
            raise ValueError(f"admit must be one of {ADMIT_KINDS}, kv one of {KV_KINDS}")
        self.kv_tokens = kv_tokens
        self.max_batch = max_batch
        self.admit = admit
        self.kv = kv
        self.max_model_len = min(max_model_len or kv_tokens, kv_tokens)
        self.law = law or StepLaw()
        #: prompts' leading blocks seen recently (prefix_cache.py), None: no prefix cache
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.kv_used = 0
        self.ids = 0
        # lifetime counters (Prometheus counters never go down)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._last = trio.current_time()
        self.window = Window(since=self._last)
        self._work = trio.Event()  # set when an idle loop has a batch to step
        self._changed = trio.lowlevel.ParkingLot()

    def __repr__(self) -> str:
        return (
            f"<Engine running={len(self.running)} waiting={len(self.waiting)} "
            f"kv={self.kv_used}/{self.kv_tokens} ({self.kv}) batch<={self.max_batch} "
            f"admit={self.admit} {self.law}>"
        )

    # --- what the HTTP side calls ---

    def add(
        self,
        prompt_tokens: int,
        max_tokens: int | None,
        stop_after: int | None = None,
        blocks: tuple[int, ...] = (),
    ) -> Request:
        """A new request: admitted at once if it fits and nobody waits, else queued.
        ``max_tokens`` None is the rest of ``max_model_len``; ``blocks``: its prompt's
        block hashes, for the prefix cache. TooLong if it can never fit, ValueError if
        a count is below 1."""
        if max_tokens is None:
            max_tokens = self.max_model_len - prompt_tokens
        if prompt_tokens < 1 or max_tokens < 1 or (stop_after is not None and stop_after < 1):
            self.window.refused += 1
            raise ValueError("prompt_tokens, max_tokens and stop_after must be >= 1")
        if prompt_tokens + max_tokens > self.max_model_len:
            self.window.refused += 1
            raise TooLong(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {prompt_tokens + max_tokens} tokens "
                f"({prompt_tokens} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion."
            )
        self._integrate()
        self.ids += 1
        seq = Request(self.ids, prompt_tokens, max_tokens, stop_after, trio.current_time())
        seq.blocks = blocks
        self.waiting.append(seq)
        self.window.arrived += 1
        self._admit()
        self._note()
        return seq

    def leave(self, seq: Request) -> None:
        """Its client has gone: out of the FIFO or the batch now, its cache freed (and the
        FIFO's head admitted if it now fits). Nothing if it is done already."""
        if seq.done:
            return
        self._integrate()
        if seq.state == WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self.kv_used -= seq.kv
            seq.kv = 0
        seq.state = GONE
        self.window.gone += 1
        seq._wake()
        self._admit()
        self._note()

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds; it is checked after every change of state."""
        while not predicate():
            await self._changed.park()

    # --- the loop ---

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The step loop (for ever)."""
        task_status.started()
        clock: float | None = None  # when the last step ended by the law; None: idle since
        while True:
            self._admit(at_step=True)
            if not self.running:
                clock = None
                self._work = trio.Event()
                await self._work.wait()
                continue
            batch = list(self.running)
            joining = [seq for seq in batch if not seq.prefilled]
            # a request preempted before recomputes its output too (vLLM's recompute)
            prefill = sum(seq.prompt_tokens + seq.generated for seq in joining)
            for seq in joining:
                seq.prefilled = True
            prefill -= self._cached(joining)
            self.prompt_tokens_total += prefill
            self.window.prompt_tokens += prefill
            took = self.law.step_time(len(batch), prefill)
            start = trio.current_time() if clock is None else clock
            deadline = start + took
            await trio.sleep_until(deadline)
            now = trio.current_time()
            lag = now - deadline
            self.window.lag_sum += lag
            self.window.lag_max = max(self.window.lag_max, lag)
            if lag <= took:  # jitter: the next step makes up for it
                clock = deadline
            else:  # a stall: that time is lost, as it would be on a real engine
                self.window.lost += lag
                clock = now
            self._end_step(batch)

    def _cached(self, joining: list[Request]) -> int:
        """The prompt tokens of the requests ``joining`` the batch that the prefix cache
        holds (so their prefill is spared), their blocks cached from now on."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        spared = 0
        for seq in joining:
            spared += cache.cached(seq.blocks, seq.prompt_tokens)
            cache.store(seq.blocks)
        self.window.cached_tokens += spared
        return spared

    def _end_step(self, batch: list[Request]) -> None:
        self._integrate()
        self.window.steps += 1
        for seq in batch:
            if seq.state != RUNNING:  # its client left (or it was preempted) in the step
                continue
            seq.generated += 1
            self.generation_tokens_total += 1
            self.window.tokens += 1
            if seq.generated >= seq.limit:
                seq.state = FINISHED
                seq.finish_reason = "length" if seq.generated >= seq.max_tokens else "stop"
                self.running.remove(seq)
                self.kv_used -= seq.kv
                seq.kv = 0
                self.window.finished += 1
            elif self.kv == "paged":
                self._grow(seq)
            seq._wake()
        self._admit()
        self._note()

    def _blocks(self, tokens: int) -> int:
        """Cache tokens that ``tokens`` take in whole blocks."""
        return -(-tokens // BLOCK) * BLOCK

    def _grow(self, seq: Request) -> None:
        """Paged: ``seq`` needs a block for its next token; with none free, the request
        admitted last is preempted (back to the FIFO's head, its blocks freed, to be
        recomputed), until ``seq`` fits or is itself the one preempted."""
        need = self._blocks(seq.prompt_tokens + seq.generated + 1) - seq.kv
        while need > self.kv_tokens - self.kv_used and seq.state == RUNNING:
            victim = self.running[-1]
            self.running.remove(victim)
            self.kv_used -= victim.kv
            victim.kv, victim.state, victim.prefilled = 0, WAITING, False
            victim.preempted += 1
            victim.passed_over = True
            self.window.preempted += 1
            self.waiting.appendleft(victim)
        if seq.state == RUNNING:
            seq.kv += need
            self.kv_used += need

    def _needs(self, seq: Request) -> int:
        """Cache tokens ``seq`` takes at admission: its worst case (reserve), or the
        blocks of what it has so far and its next token, plus a watermark (paged)."""
        if self.kv == "reserve":
            return seq.reserved
        return self._blocks(seq.prompt_tokens + seq.generated + 1)

    def _admit(self, *, at_step: bool = False) -> None:
        """Admit from the head of the FIFO while the head fits (head of line) and the
        batch is under its cap; with ``admit == "step"`` only at a step's start (else it
        only wakes an idle loop)."""
        if self.admit == "arrival" or at_step:
            watermark = 0 if self.kv == "reserve" else self.kv_tokens // 100
            while self.waiting and (self.max_batch is None or len(self.running) < self.max_batch):
                seq = self.waiting[0]
                needs = self._needs(seq)
                free = self.kv_tokens - self.kv_used - (watermark if self.running else 0)
                if needs > free:
                    break
                self.waiting.popleft()
                seq.state = RUNNING
                seq.kv = needs
                self.kv_used += needs
                self.running.append(seq)
            for seq in self.waiting:
                seq.passed_over = True
        if self.running or self.waiting:
            self._work.set()

    # --- accounting ---

    def _integrate(self) -> None:
        """Add the time since the last change, at the state before this one."""
        now = trio.current_time()
        dt = now - self._last
        if dt > 0:
            w = self.window
            w.waiting_area += len(self.waiting) * dt
            w.queued_area += sum(1 for seq in self.waiting if seq.passed_over) * dt
            w.running_area += len(self.running) * dt
            w.kv_area += self.kv_used / self.kv_tokens * dt
        self._last = now

    def _note(self) -> None:
        w = self.window
        w.max_waiting = max(w.max_waiting, len(self.waiting))
        w.max_running = max(w.max_running, len(self.running))
        self._changed.unpark_all()

    def stats(self) -> dict[str, Any]:
        """The window's figures (see the module docstring), and the state now."""
        self._integrate()
        w = self.window
        elapsed = self._last - w.since
        per = (lambda area: area / elapsed) if elapsed > 0 else (lambda area: math.nan)
        return {
            "elapsed": elapsed,
            "tokens": w.tokens,
            "tokens_per_s": w.tokens / elapsed if elapsed > 0 else math.nan,
            "prompt_tokens": w.prompt_tokens,
            "cached_tokens": w.cached_tokens,
            "arrived": w.arrived,
            "finished": w.finished,
            "gone": w.gone,
            "refused": w.refused,
            "preempted": w.preempted,
            "generation_tokens_total": self.generation_tokens_total,
            "steps": w.steps,
            "mean_batch": w.tokens / w.steps if w.steps else math.nan,
            "mean_waiting": per(w.waiting_area),
            "mean_queued": per(w.queued_area),
            "mean_running": per(w.running_area),
            "mean_kv_usage": per(w.kv_area),
            "max_waiting": w.max_waiting,
            "max_running": w.max_running,
            "lag_mean_ms": w.lag_sum / w.steps * 1e3 if w.steps else math.nan,
            "lag_max_ms": w.lag_max * 1e3,
            "lost_s": w.lost,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_used": self.kv_used,
            "kv_tokens": self.kv_tokens,
        }

    def reset(self) -> dict[str, Any]:
        """The stats of the window that ends now; a new one starts at once."""
        stats = self.stats()
        self.window = Window(
            since=self._last, max_waiting=len(self.waiting), max_running=len(self.running)
        )
        return stats


# --- metrics -----------------------------------------------------------------------------------


def metrics_text(engine: Engine, kind: str, model: str) -> str:
    """Prometheus' text format (0.0.4) with vLLM's or llama.cpp's names."""
    usage = engine.kv_used / engine.kv_tokens
    if kind == "vllm":
        label = '{model_name="' + model.replace("\\", "\\\\").replace('"', '\\"') + '"}'
        families = [
            (
                "vllm:num_requests_running",
                "gauge",
                "Number of requests in model execution batches.",
                len(engine.running),
            ),
            (
                "vllm:num_requests_waiting",
                "gauge",
                "Number of requests waiting to be processed.",
                len(engine.waiting),
            ),
            (
                "vllm:kv_cache_usage_perc",
                "gauge",
                "KV-cache usage. 1 means 100 percent usage.",
                usage,
            ),
            (
                "vllm:prompt_tokens_total",
                "counter",
                "Number of prefill tokens processed.",
                engine.prompt_tokens_total,
            ),
            (
                "vllm:generation_tokens_total",
                "counter",
                "Number of generation tokens processed.",
                engine.generation_tokens_total,
            ),
        ]
    elif kind == "llamacpp":
        label = ""
        families = [
            (
                "llamacpp:prompt_tokens_total",
                "counter",
                "Number of prompt tokens processed.",
                engine.prompt_tokens_total,
            ),
            (
                "llamacpp:tokens_predicted_total",
                "counter",
                "Number of generation tokens processed.",
                engine.generation_tokens_total,
            ),
            (
                "llamacpp:kv_cache_usage_ratio",
                "gauge",
                "KV-cache usage. 1 means 100 percent usage.",
                usage,
            ),
            ("llamacpp:kv_cache_tokens", "gauge", "KV-cache tokens.", engine.kv_used),
            (
                "llamacpp:requests_processing",
                "gauge",
                "Number of requests processing.",
                len(engine.running),
            ),
            (
                "llamacpp:requests_deferred",
                "gauge",
                "Number of requests deferred.",
                len(engine.waiting),
            ),
        ]
    else:
        raise ValueError(f"no metrics of kind {kind!r}")
    lines = []
    for name, kind_, help_, value in families:
        lines += [
            f"# HELP {name} {help_}",
            f"# TYPE {name} {kind_}",
            f"{name}{label} {float(value)!r}",
        ]
    return "\n".join(lines) + "\n"


# --- HTTP --------------------------------------------------------------------------------------


class BadRequest(Exception):
    """An answer other than 200: its status and OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": kind, "param": None, "code": status}}


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _finite(value: Any) -> Any:
    """NaN is not JSON: null instead."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def parse_messages(value: Any) -> list[tuple[str, str]]:
    """``[{"role", "content"}]`` with text content (a string or text parts) -> pairs.
    BadRequest otherwise."""
    if not isinstance(value, list) or not value:
        raise BadRequest(400, "'messages' must be a non-empty list")
    out = []
    for index, message in enumerate(value):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise BadRequest(400, f"messages[{index}] must be an object with a 'role'")
        content = message.get("content", "")
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, Mapping)]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise BadRequest(400, f"messages[{index}].content: only text parts are served")
            content = "".join(str(t) for t in texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise BadRequest(400, f"messages[{index}].content must be text")
        out.append((message["role"], content))
    return out


def _count_field(request: Mapping[str, Any], *names: str) -> int | None:
    for name in names:
        value = request.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadRequest(400, f"'{name}' must be an integer >= 1, not {value!r}")
        return value
    return None


def _json_body(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(400, f"the body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BadRequest(400, "the body must be a JSON object")
    return value


async def read_request(
    stream: trio.SocketStream, conn: h11.Connection
) -> tuple[h11.Request, bytes] | None:
    """The next request and its body, or None when the client has gone (or sent more than
    :data:`MAX_BODY`, which closes the connection)."""
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
            if len(body) > MAX_BODY:
                return None
        elif isinstance(event, h11.EndOfMessage):
            assert request is not None
            return request, bytes(body)
        else:  # ConnectionClosed, or PAUSED (a client that pipelined: not served)
            return None


async def send_whole(
    stream: trio.SocketStream,
    conn: h11.Connection,
    status: int,
    body: bytes,
    content_type: str = "application/json",
) -> None:
    headers = [("content-type", content_type), ("content-length", str(len(body)))]
    out = conn.send(h11.Response(status_code=status, headers=headers)) or b""
    out += conn.send(h11.Data(data=body)) or b""
    out += conn.send(h11.EndOfMessage()) or b""
    await stream.send_all(out)


async def send_json(stream: trio.SocketStream, conn: h11.Connection, status: int, obj: Any) -> None:
    await send_whole(stream, conn, status, json.dumps(obj).encode())


class Server:
    """The HTTP routes of the module docstring over ``engine``."""

    def __init__(
        self,
        engine: Engine,
        *,
        model: str = "bench",
        metrics: str = "vllm",
        scrape_delay: float = 0.0,
    ) -> None:
        if metrics not in METRICS_KINDS:
            raise ValueError(f"metrics must be one of {METRICS_KINDS}, not {metrics!r}")
        self.engine = engine
        self.model = model
        self.metrics = metrics
        self.scrape_delay = scrape_delay  # seconds before /metrics answers

    def __repr__(self) -> str:
        return f"<Server model={self.model!r} metrics={self.metrics} {self.engine!r}>"

    async def connection(self, stream: trio.SocketStream) -> None:
        """Serve one connection's requests, one after the other (keep-alive)."""
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                got = await read_request(stream, conn)
                if got is None:
                    return
                request, body = got
                await self.answer(stream, conn, request, body)
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return
        finally:
            await trio.aclose_forcefully(stream)

    async def answer(
        self, stream: trio.SocketStream, conn: h11.Connection, request: h11.Request, body: bytes
    ) -> None:
        path = request.target.split(b"?")[0].decode("latin-1")
        method = request.method.decode("latin-1")
        routes: dict[tuple[str, str], Callable[[], Any]] = {
            ("POST", "/v1/chat/completions"): partial(self.completion, stream, conn, body),
            ("GET", "/v1/models"): lambda: self.models(),
            ("GET", "/health"): lambda: {},
            ("POST", "/tokenize"): partial(self.tokenize, body),
            ("GET", "/metrics"): lambda: self.prometheus(),
            ("GET", "/bench/stats"): lambda: self.bench(self.engine.stats()),
            ("POST", "/bench/reset"): lambda: self.bench(self.engine.reset()),
        }
        route = routes.get((method, path))
        try:
            if route is None:
                allowed = any(p == path for _, p in routes)
                raise BadRequest(405 if allowed else 404, f"no route {method} {path}", "NotFound")
            if path == "/v1/chat/completions":
                await route()
                return
            if path == "/metrics" and self.scrape_delay > 0:
                await trio.sleep(self.scrape_delay)  # a busy exporter: the state at the end
            result = route()
            if isinstance(result, str):
                await send_whole(stream, conn, 200, result.encode(), "text/plain; version=0.0.4")
            else:
                await send_json(stream, conn, 200, result)
        except BadRequest as exc:
            if conn.our_state is h11.SEND_RESPONSE:
                await send_json(stream, conn, exc.status, exc.body)

    # --- routes ---

    def models(self) -> dict[str, Any]:
        card = {
            "id": self.model,
            "object": "model",
            "created": CREATED,
            "owned_by": "sim-engine",
            "root": self.model,
            "parent": None,
            "max_model_len": self.engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    def _check_model(self, request: Mapping[str, Any], required: bool) -> None:
        model = request.get("model")
        if model is None and not required:
            return
        if model != self.model:
            raise BadRequest(404, f"The model `{model}` does not exist.", "NotFoundError")

    def tokenize(self, body: bytes) -> dict[str, Any]:
        """vLLM's ``/tokenize`` (``prompt`` or ``messages``) or llama.cpp's (``content``).
        No special token is ever added (this tokenizer has no BOS)."""
        request = _json_body(body)
        if "content" in request:  # llama.cpp server
            content = request["content"]
            if not isinstance(content, str):
                raise BadRequest(400, "'content' must be a string")
            if request.get("with_pieces"):
                return {"tokens": [{"id": token_id(p), "piece": p} for p in pieces(content)]}
            return {"tokens": tokenize(content)}
        self._check_model(request, required=False)
        if "messages" in request:
            messages = parse_messages(request["messages"])
            generation = request.get("add_generation_prompt", True)
            ids = chat_tokens(messages, add_generation_prompt=bool(generation))
        elif isinstance(request.get("prompt"), str):
            ids = tokenize(request["prompt"])
        else:
            raise BadRequest(400, "give 'prompt' (a string) or 'messages', or 'content'")
        return {
            "count": len(ids),
            "max_model_len": self.engine.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }

    def prometheus(self) -> str:
        if self.metrics == "none":
            raise BadRequest(404, "Not Found", "NotFound")
        return metrics_text(self.engine, self.metrics, self.model)

    def bench(self, stats: dict[str, Any]) -> dict[str, Any]:
        law = self.engine.law
        stats = {k: _finite(v) for k, v in stats.items()}
        stats["law"] = {"base": law.base, "per_seq": law.per_seq, "prefill": law.prefill}
        stats["metrics"] = self.metrics
        return stats

    async def completion(
        self, stream: trio.SocketStream, conn: h11.Connection, body: bytes
    ) -> None:
        """One chat completion, streamed or whole; the request leaves the engine when
        this returns, whether it finished, its client left or the writing failed."""
        request = _json_body(body)
        self._check_model(request, required=True)
        messages = parse_messages(request.get("messages"))
        max_tokens = _count_field(request, "max_completion_tokens", "max_tokens")
        stop_after = _count_field(request, "stop_after")
        streaming = bool(request.get("stream"))
        options = request.get("stream_options")
        include_usage = isinstance(options, Mapping) and bool(options.get("include_usage"))
        try:
            if self.engine.prefix_cache is None:
                seq = self.engine.add(chat_token_count(messages), max_tokens, stop_after)
            else:
                ids = chat_tokens(messages)
                seq = self.engine.add(len(ids), max_tokens, stop_after, block_hashes(ids))
        except ValueError as exc:  # TooLong too
            raise BadRequest(400, str(exc)) from None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_for_close, stream, conn, nursery.cancel_scope)
                if streaming:
                    await self._stream(stream, conn, seq, include_usage)
                else:
                    await self._whole(stream, conn, seq)
                nursery.cancel_scope.cancel()
        finally:
            self.engine.leave(seq)  # nothing if it finished

    async def _stream(
        self, stream: trio.SocketStream, conn: h11.Connection, seq: Request, include_usage: bool
    ) -> None:
        rid = f"chatcmpl-sim-{seq.id}"

        def chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return sse(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": CREATED,
                    "model": self.model,
                    "choices": [choice],
                }
            )

        token = chunk({"content": TOKEN_TEXT})
        # the headers at once (vLLM's server returns its streaming response before the
        # request has a token), the role chunk with the first token
        headers = [
            ("content-type", "text/event-stream; charset=utf-8"),
            ("cache-control", "no-cache"),
        ]
        await stream.send_all(conn.send(h11.Response(status_code=200, headers=headers)) or b"")
        sent = 0
        while True:
            await seq.wait_beyond(sent)
            if seq.state == GONE:
                return
            out = b""
            if sent == 0:
                out += conn.send(h11.Data(data=chunk({"role": "assistant", "content": ""}))) or b""
            now = seq.generated
            finished = seq.state == FINISHED
            parts = [token] * (now - sent - 1 if finished else now - sent)
            if finished:
                parts.append(chunk({"content": TOKEN_TEXT}, seq.finish_reason))
                if include_usage:
                    parts.append(sse(self._usage_chunk(rid, seq)))
                parts.append(b"data: [DONE]\n\n")
            sent = now
            out += conn.send(h11.Data(data=b"".join(parts))) or b""
            if finished:
                out += conn.send(h11.EndOfMessage()) or b""
            await stream.send_all(out)
            if finished:
                return

    def _usage(self, seq: Request) -> dict[str, int]:
        return {
            "prompt_tokens": seq.prompt_tokens,
            "completion_tokens": seq.generated,
            "total_tokens": seq.prompt_tokens + seq.generated,
        }

    def _usage_chunk(self, rid: str, seq: Request) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": self.model,
            "choices": [],
            "usage": self._usage(seq),
        }

    async def _whole(self, stream: trio.SocketStream, conn: h11.Connection, seq: Request) -> None:
        while not seq.done:
            await seq.wait_beyond(seq.generated)
        if seq.state == GONE:
            return
        message = {"role": "assistant", "content": TOKEN_TEXT * seq.generated}
        choice = {"index": 0, "message": message, "logprobs": None}
        choice["finish_reason"] = seq.finish_reason
        await send_json(
            stream,
            conn,
            200,
            {
                "id": f"chatcmpl-sim-{seq.id}",
                "object": "chat.completion",
                "created": CREATED,
                "model": self.model,
                "choices": [choice],
                "usage": self._usage(seq),
            },
        )


async def _watch_for_close(
    stream: trio.SocketStream, conn: h11.Connection, scope: trio.CancelScope
) -> None:
    """While a request is answered: cancel ``scope`` as soon as its client closes the
    connection (EOF or an error). Bytes that come meanwhile (a request pipelined
    behind) are kept in ``conn`` for their turn."""
    while True:
        try:
            data = await stream.receive_some(65536)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            scope.cancel()
            return
        conn.receive_data(data)


async def serve(
    engine: Engine,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    model: str = "bench",
    metrics: str = "vllm",
    scrape_delay: float = 0.0,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run ``engine``'s step loop and serve it on ``host:port`` (for ever); reports the
    port it listens on to ``nursery.start``."""
    server = Server(engine, model=model, metrics=metrics, scrape_delay=scrape_delay)
    listeners = await trio.open_tcp_listeners(port, host=host)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        nursery.start_soon(trio.serve_listeners, server.connection, listeners)
        task_status.started(listeners[0].socket.getsockname()[1])


async def main(ns: argparse.Namespace) -> None:
    parent = os.getppid()
    law = StepLaw(ns.base_ms / 1e3, ns.per_seq_ms / 1e3, ns.prefill_us / 1e6)
    engine = Engine(
        kv_tokens=ns.kv_tokens,
        law=law,
        max_model_len=ns.max_model_len,
        max_batch=ns.max_batch,
        admit=ns.admit,
        kv=ns.kv_mode,
        prefix_cache_tokens=ns.prefix_cache_tokens,
    )
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            partial(
                serve,
                engine,
                host=ns.host,
                port=ns.port,
                model=ns.model,
                metrics=ns.metrics,
                scrape_delay=ns.scrape_ms / 1e3,
            )
        )
        print(f"sim engine listening on {ns.host}:{port} ({engine!r})", flush=True)
        while ns.exit_with_parent:
            if os.getppid() != parent:  # whoever started us went away: so do we
                nursery.cancel_scope.cancel()
                return
            await trio.sleep(0.5)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    p.add_argument("--model", default="bench", help="the one model it serves")
    p.add_argument("--kv-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=None, help="default: --kv-tokens")
    law = StepLaw()
    p.add_argument("--base-ms", type=float, default=law.base * 1e3)
    p.add_argument("--per-seq-ms", type=float, default=law.per_seq * 1e3)
    p.add_argument("--prefill-us", type=float, default=law.prefill * 1e6)
    p.add_argument("--metrics", choices=METRICS_KINDS, default="vllm")
    p.add_argument("--max-batch", type=int, default=None, help="requests a step, at most")
    p.add_argument(
        "--admit",
        choices=ADMIT_KINDS,
        default="arrival",
        help="a request joins at once or at a step",
    )
    p.add_argument(
        "--kv-mode", choices=KV_KINDS, default="reserve", help="worst case reserved, or blocks"
    )
    p.add_argument("--scrape-ms", type=float, default=0.0, help="before /metrics answers")
    p.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=0,
        help="a prefix cache of this many tokens (prefix_cache.py); 0: none",
    )
    p.add_argument(
        "--exit-with-parent", action="store_true", help="exit when the parent process goes"
    )
    return p.parse_args(argv)


if __name__ == "__main__":
    try:
        trio.run(main, parse_args())
    except KeyboardInterrupt:
        sys.exit(130)
