"""KVCacheManager: each request's block tables (one per cache group), on top of the BlockPool.

Calls and what the caller does next (the scheduler is the only caller):

- ``get_computed_blocks(req)``: the longest prefix of the request's tokens whose blocks are
  cached, per group (at most ``num_tokens - 1`` tokens: the last token is always recomputed for
  its logits). Does not take references; pass the blocks to ``allocate_slots``.
- ``allocate_slots(req, num_new_tokens, computed)``: give back the blocks a sliding window has
  passed, take references on the hits and enough new blocks for ``num_new_tokens`` more tokens.
  Returns None (and allocates nothing) if the pool cannot supply them: the scheduler then
  preempts or waits.
- ``cache_blocks(req, num_computed_tokens)``: after the step ran, register newly full blocks in
  the prefix cache.
- ``free(req)``: drop all its blocks, tail first (tail evicted before head).
- ``fork(parent, child)``: the child shares all of the parent's blocks (n > 1 samples of one
  prompt); ``prepare_write`` later gives a writer its own copy of a shared partial block.
- ``reset()``: after a failure that broke the bookkeeping (engine/faults.py), start over.

Groups (kv/spec.py ``KVCacheSpec.groups``) share the one pool; each has its own table per
request, and its blocks are indexed in the prefix cache under the group's own key (a block of
group 1 never answers a lookup of group 0). A windowed group's table keeps its length: entries
the window has passed hold ``NULL_BLOCK`` (not held, never read; vLLM's null block).
``events`` (kv/events.py) records every change to the prefix-cache index when
``enable_kv_cache_events``; ``take_events`` hands them to a publisher.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvserve.intmath import cdiv
from kvserve.kv.block_pool import BlockPool, KVBlock
from kvserve.kv.cache_explain import CacheExplanation, explain
from kvserve.kv.cache_hits import group_key, longest_hit
from kvserve.kv.events import KVCacheEvent, KVEventLog
from kvserve.kv.prefix_cache import block_hashes
from kvserve.kv.spec import LayerSpec

NULL_BLOCK = KVBlock(-1)  # a table entry a window has passed: no block is held for it

Computed = tuple[list[KVBlock], ...]  # per group: the cache hits, NULL_BLOCK where skipped


class CacheRequest(Protocol):
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None
    block_hashes: list[bytes]
    skip_reading_prefix_cache: bool  # prompt logprobs: every prompt position must be computed


class KVCacheManager:
    """``group_specs``: one spec per cache group (what its layers keep; default one
    full-attention group)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        enable_kv_cache_events: bool = False,
        group_specs: Sequence[LayerSpec] | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_specs: tuple[LayerSpec | None, ...] = tuple(group_specs or (None,))
        for spec in self.group_specs:
            if spec is not None and spec.block_size != block_size:
                raise ValueError(f"group block size {spec.block_size} != {block_size}")
        # one log for the manager's life: a rebuilt pool (reset) records into it too
        self.events = KVEventLog(enabled=enable_kv_cache_events and enable_prefix_caching)
        self.pool = BlockPool(num_blocks, enable_prefix_caching, self.events)
        self.tables: list[dict[str, list[KVBlock]]] = [{} for _ in self.group_specs]
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks already registered
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    @property
    def num_groups(self) -> int:
        return len(self.group_specs)

    @property
    def req_to_blocks(self) -> dict[str, list[KVBlock]]:
        """The first group's tables (the only group of a full-attention model)."""
        return self.tables[0]

    def blocks_of(self, request_id: str, group: int = 0) -> list[KVBlock]:
        return self.tables[group].get(request_id, [])

    def held_blocks(self, request_id: str) -> list[KVBlock]:
        """Every block the request holds a reference on, over all groups."""
        return [b for t in self.tables for b in t.get(request_id, ()) if b is not NULL_BLOCK]

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """One group's block table (-1 where a window has given the block back)."""
        return [b.block_id for b in self.blocks_of(request_id, group)]

    def block_tables(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(self.block_ids(request_id, g) for g in range(self.num_groups))

    def _update_hashes(self, req: CacheRequest) -> None:
        if len(req.block_hashes) < len(req.all_token_ids) // self.block_size:
            req.block_hashes = block_hashes(
                req.all_token_ids, self.block_size, req.cache_salt, req.block_hashes
            )

    def get_computed_blocks(self, req: CacheRequest) -> tuple[Computed, int]:
        """Cached blocks for the request's first tokens, per group, and how many tokens they
        hold (every group's hit covers the same tokens; kv/cache_hits.py)."""
        if not self.enable_prefix_caching or req.skip_reading_prefix_cache:
            return tuple([] for _ in self.group_specs), 0
        self._update_hashes(req)
        hits, num_blocks = longest_hit(
            self.pool, self.group_specs, req.all_token_ids, req.block_hashes, self.block_size
        )
        computed = tuple(
            [NULL_BLOCK if b is None else b for b in group[:num_blocks]] for group in hits
        )
        return computed, num_blocks * self.block_size

    def explain(self, req: CacheRequest, num_hit: int) -> CacheExplanation:
        """Why ``req``'s lookup found ``num_hit`` tokens (kv/cache_explain.py; the first
        group's blocks)."""
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

    def _hit_tokens(self, computed: Computed | None) -> int:
        return len(computed[0]) * self.block_size if computed else 0

    def num_blocks_needed(
        self, req: CacheRequest, num_new_tokens: int, computed: Computed | None = None
    ) -> int:
        """New blocks (all groups) for ``num_new_tokens`` more tokens after the hits."""
        total = req.num_computed_tokens + self._hit_tokens(computed) + num_new_tokens
        entries = cdiv(total, self.block_size)  # table entries each group needs
        need = 0
        for g, table in enumerate(self.tables):
            have = len(table.get(req.request_id, ())) + (len(computed[g]) if computed else 0)
            need += max(0, entries - have)
        return need

    def free_skipped_blocks(self, req: CacheRequest) -> int:
        """Give back the blocks of windowed groups that no query at or after
        ``num_computed_tokens`` reads (sink blocks stay). Returns how many were freed."""
        freed = 0
        for spec, table in zip(self.group_specs, self.tables, strict=True):
            if spec is None or spec.sliding_window is None:
                continue
            blocks = table.get(req.request_id)
            if not blocks:
                continue
            end = min(spec.first_needed_block(req.num_computed_tokens), len(blocks))
            passed = [i for i in range(spec.sink_blocks, end) if blocks[i] is not NULL_BLOCK]
            self.pool.free_blocks(blocks[i] for i in reversed(passed))
            for i in passed:
                blocks[i] = NULL_BLOCK
            freed += len(passed)
        return freed

    def allocate_slots(
        self, req: CacheRequest, num_new_tokens: int, computed: Computed | None = None
    ) -> list[KVBlock] | None:
        """Room for ``num_new_tokens`` after the computed ones; None if the pool is short.
        Returns the new blocks (all groups)."""
        self.free_skipped_blocks(req)
        need = self.num_blocks_needed(req, num_new_tokens, computed)
        # a hit on a free block takes it out of the free queue, so it counts against the room
        hits = [b for group in computed or () for b in group if b is not NULL_BLOCK]
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - free_hits:
            return None
        self.pool.touch(hits)
        total = req.num_computed_tokens + self._hit_tokens(computed) + num_new_tokens
        entries = cdiv(total, self.block_size)
        new_all: list[KVBlock] = []
        for g, table in enumerate(self.tables):
            blocks = table.setdefault(req.request_id, [])
            if computed and computed[g]:
                blocks.extend(computed[g])
            new = self.pool.get_new_blocks(max(0, entries - len(blocks)))
            blocks.extend(new)
            new_all.extend(new)
        if computed and computed[0]:
            self.num_cached_blocks[req.request_id] = len(computed[0])
        return new_all

    def cache_blocks(self, req: CacheRequest, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full once ``num_computed_tokens`` are in."""
        if not self.enable_prefix_caching or req.request_id not in self.tables[0]:
            return
        num_full = min(num_computed_tokens, len(req.all_token_ids)) // self.block_size
        start = self.num_cached_blocks.get(req.request_id, 0)
        if num_full <= start:
            return
        self._update_hashes(req)
        for g, table in enumerate(self.tables):
            blocks = table[req.request_id]
            for i in range(start, min(num_full, len(blocks))):
                if blocks[i] is NULL_BLOCK:
                    continue
                lo = i * self.block_size
                tokens = tuple(req.all_token_ids[lo : lo + self.block_size])
                parent = group_key(req.block_hashes[i - 1], g) if i > 0 else None
                self.pool.cache_full_block(
                    blocks[i], group_key(req.block_hashes[i], g), tokens, parent
                )
        self.num_cached_blocks[req.request_id] = num_full

    def free(self, req: CacheRequest) -> None:
        """Release every block the request holds (tail first). Safe to call twice."""
        for table in self.tables:
            blocks = table.pop(req.request_id, [])
            self.pool.free_blocks(b for b in reversed(blocks) if b is not NULL_BLOCK)
        self.num_cached_blocks.pop(req.request_id, None)

    def fork(self, parent: CacheRequest, child: CacheRequest) -> None:
        """The child shares the parent's blocks (copy-on-write: see ``prepare_write``)."""
        assert child.request_id not in self.tables[0], f"{child.request_id} already has blocks"
        for table in self.tables:
            blocks = list(table.get(parent.request_id, []))
            self.pool.touch(b for b in blocks if b is not NULL_BLOCK)
            table[child.request_id] = blocks
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks.get(parent.request_id, 0)

    def prepare_write(self, req: CacheRequest) -> list[tuple[int, int]]:
        """Before writing at position ``num_computed_tokens``: where that block is shared with
        a fork, swap in a private block. Returns the (src, dst) copies the runner must
        perform before the step (one per group at most). The caller checks room first with
        ``cow_blocks_needed``."""
        idx = req.num_computed_tokens // self.block_size
        copies = []
        for table in self.tables:
            blocks = table.get(req.request_id, [])
            if idx >= len(blocks) or blocks[idx] is NULL_BLOCK or blocks[idx].ref_cnt <= 1:
                continue
            old = blocks[idx]
            (new,) = self.pool.get_new_blocks(1)
            blocks[idx] = new
            self.pool.free_blocks([old])
            copies.append((old.block_id, new.block_id))
        return copies

    def cow_blocks_needed(self, req: CacheRequest) -> int:
        idx = req.num_computed_tokens // self.block_size
        need = 0
        for table in self.tables:
            blocks = table.get(req.request_id, [])
            need += int(idx < len(blocks) and blocks[idx].ref_cnt > 1)
        return need

    def reset(self) -> None:
        """Forget every block table and the whole prefix cache: a fresh pool of the same size,
        for when a failure left the bookkeeping inconsistent. The storage needs nothing: no
        block is read before it is written again. The prefix-cache counters keep counting."""
        self.pool = BlockPool(self.pool.num_blocks, self.enable_prefix_caching, self.events)
        for table in self.tables:
            table.clear()
        self.num_cached_blocks.clear()
        if self.events.enabled:
            self.events.cleared()

    def take_events(self) -> list[KVCacheEvent]:
        """The prefix-cache index changes since the last call (empty when events are off)."""
        return self.events.take()

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for table in self.tables:
            for blocks in table.values():
                for b in blocks:
                    if b is not NULL_BLOCK:
                        refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {refs.get(block.block_id, 0)} requests"
            )
        assert NULL_BLOCK.ref_cnt == 0, "the null block was referenced"
        for spec, table in zip(self.group_specs, self.tables, strict=True):
            if spec is None or spec.sliding_window is None:
                assert all(b is not NULL_BLOCK for blocks in table.values() for b in blocks), (
                    "a full-attention table holds a null block"
                )
