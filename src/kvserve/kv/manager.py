"""KVCacheManager: each request's block table, on top of the BlockPool.

Calls and what the caller does next (the scheduler is the only caller):

- ``get_computed_blocks(req)``: the longest run of cached full blocks matching the request's
  tokens (at most ``num_tokens - 1`` tokens: the last token is always recomputed for its
  logits). Does not take references; pass the blocks to ``allocate_slots``.
- ``allocate_slots(req, num_new_tokens, computed)``: take references on the hits and enough new
  blocks for ``num_new_tokens`` more tokens. Returns None (and changes nothing) if the pool
  cannot supply them: the scheduler then preempts or waits.
- ``cache_blocks(req, num_computed_tokens)``: after the step ran, register newly full blocks in
  the prefix cache.
- ``free(req)``: drop all its blocks, tail first (tail evicted before head).
- ``fork(parent, child)``: the child shares all of the parent's blocks (n > 1 samples of one
  prompt); ``prepare_write`` later gives a writer its own copy of a shared partial block.
- ``reset()``: after a failure that broke the bookkeeping (engine/faults.py), start over.

``events`` (kv/events.py) records every change to the prefix-cache index when
``enable_kv_cache_events``; ``take_events`` hands them to a publisher.
"""

from __future__ import annotations

from typing import Protocol

from kvserve.intmath import cdiv
from kvserve.kv.block_pool import BlockPool, KVBlock
from kvserve.kv.cache_explain import CacheExplanation, explain
from kvserve.kv.events import KVCacheEvent, KVEventLog
from kvserve.kv.prefix_cache import block_hashes


class CacheRequest(Protocol):
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None
    block_hashes: list[bytes]
    skip_reading_prefix_cache: bool  # prompt logprobs: every prompt position must be computed


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        enable_kv_cache_events: bool = False,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # one log for the manager's life: a rebuilt pool (reset) records into it too
        self.events = KVEventLog(enabled=enable_kv_cache_events and enable_prefix_caching)
        self.pool = BlockPool(num_blocks, enable_prefix_caching, self.events)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks already registered
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    def blocks_of(self, request_id: str) -> list[KVBlock]:
        return self.req_to_blocks.get(request_id, [])

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.blocks_of(request_id)]

    def _update_hashes(self, req: CacheRequest) -> None:
        if len(req.block_hashes) < len(req.all_token_ids) // self.block_size:
            req.block_hashes = block_hashes(
                req.all_token_ids, self.block_size, req.cache_salt, req.block_hashes
            )

    def get_computed_blocks(self, req: CacheRequest) -> tuple[list[KVBlock], int]:
        """Cached full blocks matching the request's first tokens, and how many tokens they hold."""
        if not self.enable_prefix_caching or req.skip_reading_prefix_cache:
            return [], 0
        self._update_hashes(req)
        tokens = req.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            lo = i * self.block_size
            block = self.pool.get_cached_block(
                req.block_hashes[i], tuple(tokens[lo : lo + self.block_size])
            )
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def explain(self, req: CacheRequest, num_hit: int) -> CacheExplanation:
        """Why ``req``'s lookup found ``num_hit`` tokens (kv/cache_explain.py)."""
        n = len(req.all_token_ids)
        if not self.enable_prefix_caching or req.skip_reading_prefix_cache:
            cause = "caching_off" if not self.enable_prefix_caching else "skipped"
            return CacheExplanation(n, num_hit, cause, self.block_size)
        return explain(
            self.pool, self.block_size, req.all_token_ids, req.block_hashes, req.cache_salt, num_hit
        )

    def record_prefix_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count an admitted request's lookup once (retries while the pool is full don't)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit

    def num_blocks_needed(
        self, req: CacheRequest, num_new_tokens: int, computed: list[KVBlock] = ()
    ) -> int:
        have = len(self.blocks_of(req.request_id)) + len(computed)
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        return max(0, cdiv(total, self.block_size) - have)

    def allocate_slots(
        self, req: CacheRequest, num_new_tokens: int, computed: list[KVBlock] = ()
    ) -> list[KVBlock] | None:
        """Room for ``num_new_tokens`` after the computed ones; None if the pool is short."""
        need = self.num_blocks_needed(req, num_new_tokens, computed)
        # a hit on a free block takes it out of the free queue, so it counts against the room
        free_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - free_hits:
            return None
        blocks = self.req_to_blocks.setdefault(req.request_id, [])
        self.pool.touch(computed)
        blocks.extend(computed)
        if computed:
            self.num_cached_blocks[req.request_id] = len(blocks)
        new = self.pool.get_new_blocks(need)
        blocks.extend(new)
        return new

    def cache_blocks(self, req: CacheRequest, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full once ``num_computed_tokens`` are in."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_to_blocks.get(req.request_id)
        if not blocks:
            return
        num_full = min(num_computed_tokens, len(req.all_token_ids)) // self.block_size
        start = self.num_cached_blocks.get(req.request_id, 0)
        if num_full <= start:
            return
        self._update_hashes(req)
        for i in range(start, num_full):
            lo = i * self.block_size
            tokens = tuple(req.all_token_ids[lo : lo + self.block_size])
            parent = req.block_hashes[i - 1] if i > 0 else None
            self.pool.cache_full_block(blocks[i], req.block_hashes[i], tokens, parent)
        self.num_cached_blocks[req.request_id] = num_full

    def free(self, req: CacheRequest) -> None:
        """Release every block the request holds (tail first). Safe to call twice."""
        blocks = self.req_to_blocks.pop(req.request_id, [])
        self.num_cached_blocks.pop(req.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def fork(self, parent: CacheRequest, child: CacheRequest) -> None:
        """The child shares the parent's blocks (copy-on-write: see ``prepare_write``)."""
        assert child.request_id not in self.req_to_blocks, f"{child.request_id} already has blocks"
        blocks = list(self.blocks_of(parent.request_id))
        self.pool.touch(blocks)
        self.req_to_blocks[child.request_id] = blocks
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks.get(parent.request_id, 0)

    def prepare_write(self, req: CacheRequest) -> tuple[int, int] | None:
        """Before writing at position ``num_computed_tokens``: if that block is shared with a
        fork, swap in a private block. Returns the (src, dst) copy the runner must perform
        before the step, or None. The caller checks room first with ``cow_blocks_needed``."""
        pos = req.num_computed_tokens
        blocks = self.req_to_blocks.get(req.request_id, [])
        idx = pos // self.block_size
        if idx >= len(blocks) or blocks[idx].ref_cnt <= 1:
            return None
        old = blocks[idx]
        (new,) = self.pool.get_new_blocks(1)
        blocks[idx] = new
        self.pool.free_blocks([old])
        return old.block_id, new.block_id

    def cow_blocks_needed(self, req: CacheRequest) -> int:
        idx = req.num_computed_tokens // self.block_size
        blocks = self.req_to_blocks.get(req.request_id, [])
        return int(idx < len(blocks) and blocks[idx].ref_cnt > 1)

    def reset(self) -> None:
        """Forget every block table and the whole prefix cache: a fresh pool of the same size,
        for when a failure left the bookkeeping inconsistent. The storage needs nothing: no
        block is read before it is written again. The prefix-cache counters keep counting."""
        self.pool = BlockPool(self.pool.num_blocks, self.enable_prefix_caching, self.events)
        self.req_to_blocks.clear()
        self.num_cached_blocks.clear()
        if self.events.enabled:
            self.events.cleared()

    def take_events(self) -> list[KVCacheEvent]:
        """The prefix-cache index changes since the last call (empty when events are off)."""
        return self.events.take()

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {refs.get(block.block_id, 0)} requests"
            )
