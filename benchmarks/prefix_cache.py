"""A simulated engine's prefix cache: vLLM's automatic prefix caching, in outline.

Imported by ``sim_engine.py`` (``--prefix-cache-tokens N``); standard library only.

**What it models.** A prompt is cut into blocks of :data:`BLOCK` tokens; each full
block is named by a hash chained over every token before it and its own (vLLM's block
hash), so two prompts share a cached block only where they are the same up to its end.
A request whose first k blocks are cached skips their prefill: it is charged, per
prompt token, only for the tokens past them (at least one: the last token is always
computed, as vLLM recomputes it for its logits). Once a request has been prefilled,
its blocks are in the cache. The cache holds at most ``tokens`` worth of blocks and
evicts the least recently used (a hit and a store both count as a use).

**What it leaves out.** In vLLM the cached blocks are the free blocks of the KV cache
itself (a block is evictable only while no running request holds it); here the cache
is a separate bound, so a cache hit never makes room in the KV cache and a full KV
cache never evicts it. Partial blocks, multimodal and LoRA keys, and the cost of the
lookup are left out too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

#: Tokens a block.
BLOCK = 16


def block_hashes(ids: Sequence[int]) -> tuple[int, ...]:
    """The chained hash of each full block of ``ids`` (the same in every process: ints
    and tuples of ints hash without Python's string salt)."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(ids) - BLOCK + 1, BLOCK):
        parent = hash((parent, tuple(ids[start : start + BLOCK])))
        hashes.append(parent)
    return tuple(hashes)


class PrefixCache:
    """At most ``tokens`` worth of blocks, least recently used evicted first."""

    def __init__(self, tokens: int) -> None:
        if tokens < BLOCK:
            raise ValueError(f"a prefix cache holds at least one block ({BLOCK} tokens)")
        self.capacity = tokens // BLOCK
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of those, found cached (vLLM's prefix_cache_hits)

    def __repr__(self) -> str:
        return f"<PrefixCache {len(self._blocks)}/{self.capacity} blocks hits={self.hits}>"

    def cached(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """The prompt tokens of a request with block ``hashes`` found cached: its leading
        blocks that are, each a use; at most ``prompt_tokens - 1``."""
        found = 0
        for block in hashes:
            if block not in self._blocks:
                break
            self._blocks.move_to_end(block)
            found += 1
        tokens = min(found * BLOCK, max(0, prompt_tokens - 1))
        self.queries += prompt_tokens
        self.hits += tokens
        return tokens

    def store(self, hashes: Sequence[int]) -> None:
        """A request was prefilled: its blocks are cached (used now), the least recently
        used evicted past the capacity."""
        for block in hashes:
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
