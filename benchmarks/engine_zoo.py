"""The engine zoo: shapes of simulated engines (``sim_engine.py``) that ``concurrency: auto``
must learn, and the loads it must follow.

A :class:`Shape` is one engine: its step law (a step of ``base`` ms + ``per_seq`` ms a
request in the batch + ``prefill`` µs a prompt token joining), its KV cache (tokens;
``reserve``: a request holds its worst case from admission, vLLM v0's way; ``paged``:
it holds the blocks of what it has so far and a request admitted last is preempted
when the cache runs out, vLLM v1's way), its batch cap (``max_batch``: vLLM's
``max_num_seqs``, llama.cpp's slots), when a request that fits joins (``arrival``, or
``step``: at the next step's start, so a request can be counted waiting with room to
spare, as a scheduler that admits at step boundaries counts it), the metrics it
exposes (``vllm``, ``llamacpp`` or ``none``) and how long a scrape of them takes.

:data:`SAMPLE` is the fixed sample that ``capacity.py --zoo`` runs through real
processes; :data:`RANGES` are the bounds the Hypothesis tests draw shapes from
(``tests/test_learning_zoo.py``). Standard library only (and ``sim_engine``), so a
benchmark can run it beside any revision of the node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sim_engine

#: the bounds of each drawn parameter (the issue's zoo): step 10-200 ms, per-sequence
#: cost 0.1-5 ms, KV 2k-64k tokens, batch cap 8-256, scrapes of 1-300 ms
RANGES = {
    "base_ms": (10.0, 200.0),
    "per_seq_ms": (0.1, 5.0),
    "kv_tokens": (2048, 65536),
    "max_batch": (8, 256),
    "scrape_ms": (1.0, 300.0),
}


@dataclass(frozen=True)
class Shape:
    """One simulated engine (module docstring)."""

    name: str
    base_ms: float = 80.0
    per_seq_ms: float = 1.6
    prefill_us: float = 50.0
    kv_tokens: int = 4096
    max_batch: int | None = None
    metrics: str = "vllm"
    scrape_ms: float = 0.0
    admit: str = "arrival"
    kv_mode: str = "reserve"

    def __str__(self) -> str:
        cap = "-" if self.max_batch is None else str(self.max_batch)
        return (
            f"{self.name}: {self.base_ms:g}+{self.per_seq_ms:g} ms/seq, prefill "
            f"{self.prefill_us:g} us/tok, KV {self.kv_tokens} ({self.kv_mode}), batch {cap}, "
            f"admit at {self.admit}, metrics {self.metrics}, scrape {self.scrape_ms:g} ms"
        )

    @property
    def law(self) -> sim_engine.StepLaw:
        return sim_engine.StepLaw(self.base_ms / 1e3, self.per_seq_ms / 1e3, self.prefill_us / 1e6)

    def engine(self) -> sim_engine.Engine:
        """A new engine of this shape (inside a trio run)."""
        return sim_engine.Engine(
            kv_tokens=self.kv_tokens,
            law=self.law,
            max_batch=self.max_batch,
            admit=self.admit,
            kv=self.kv_mode,
        )

    def engine_args(self, *, metrics: str | None = None) -> list[str]:
        """``sim_engine.py``'s options for this shape (``metrics`` overrides its own)."""
        args = [
            f"--base-ms={self.base_ms:g}",
            f"--per-seq-ms={self.per_seq_ms:g}",
            f"--prefill-us={self.prefill_us:g}",
            f"--kv-tokens={self.kv_tokens}",
            f"--metrics={metrics or self.metrics}",
            f"--scrape-ms={self.scrape_ms:g}",
            f"--admit={self.admit}",
            f"--kv-mode={self.kv_mode}",
        ]
        if self.max_batch is not None:
            args.append(f"--max-batch={self.max_batch}")
        return args

    def fits(self, prompt_tokens: int, max_tokens: int, clients: int) -> int:
        """Requests of this size the engine runs at once with ``clients`` callers: its
        batch cap, its cache (by worst case; paged, by half the output on average), the
        callers."""
        held = prompt_tokens + (max_tokens if self.kv_mode == "reserve" else max_tokens / 2)
        runs = min(clients, math.floor(self.kv_tokens / held))
        return max(1, runs if self.max_batch is None else min(runs, self.max_batch))


#: The benchmark's sample: the engine the learner was first tuned on, the two of the
#: issue that it failed on, a batch cap of 16 over a 16k cache, and engines at the
#: edges of the ranges. Token rates stay under about 1,100 a second so the relay on
#: this 2-core machine is not what bounds them.
SAMPLE = (
    Shape("default"),
    Shape("fast-4x", base_ms=25, per_seq_ms=0.4),
    Shape(
        "apart",
        base_ms=25,
        per_seq_ms=0.4,
        max_batch=64,
        admit="step",
        kv_mode="paged",
    ),
    Shape(
        "cap16-kv16k",
        base_ms=40,
        per_seq_ms=1.0,
        kv_tokens=16384,
        max_batch=16,
        admit="step",
        kv_mode="paged",
    ),
    Shape(
        "slow-llamacpp",
        base_ms=200,
        per_seq_ms=5.0,
        prefill_us=100,
        kv_tokens=8192,
        metrics="llamacpp",
        scrape_ms=300,
    ),
    Shape(
        "slots-4",
        base_ms=30,
        per_seq_ms=3.0,
        kv_tokens=16384,
        max_batch=4,
        metrics="llamacpp",
        scrape_ms=20,
    ),
    Shape(
        "tiny-kv",
        base_ms=15,
        per_seq_ms=0.2,
        prefill_us=20,
        kv_tokens=2048,
        max_batch=8,
        admit="step",
        kv_mode="paged",
        scrape_ms=5,
    ),
    Shape(
        "big-kv-no-metrics",
        base_ms=40,
        per_seq_ms=0.1,
        prefill_us=20,
        kv_tokens=65536,
        max_batch=256,
        metrics="none",
    ),
    Shape(
        "slow-scrape",
        base_ms=60,
        per_seq_ms=2.0,
        kv_tokens=8192,
        scrape_ms=250,
        admit="step",
        kv_mode="paged",
    ),
    Shape("fast-step", base_ms=10, per_seq_ms=0.8, prefill_us=10, kv_tokens=3072, max_batch=32),
)
BY_NAME = {shape.name: shape for shape in SAMPLE}
