"""BlockPool: the KV blocks, their reference counts, the free queue and the prefix-cache index.

Pure Python bookkeeping (no torch): block ids index ``KVCacheStorage``.

Invariants (``check_integrity`` asserts them):
- every block is either in the free queue (ref_cnt == 0) or used (ref_cnt >= 1), never both:
  ``num_free + num_used == num_blocks``;
- ref counts are >= 0;
- every entry of the hash index points at a block carrying that hash; a free block may keep
  its hash (it is still a prefix-cache hit until evicted).

Every change to the hash index is recorded in ``events`` (kv/events.py) when enabled.

Eviction order: the free queue is least-recently-freed first. A request frees its blocks tail
first, so among one request's blocks the tail is evicted before the head (a later request is
more likely to share the head: the system prompt). Taking a block off the head of the queue for
new data evicts its hash.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvserve.kv.events import KVEventLog


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered
    parent_hash: bytes | None = None  # the previous block's hash (None: a first block)
    token_ids: tuple[int, ...] = ()  # the tokens a cached block holds: checked on every hit
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) popleft, append and removal from the middle
    (a cache hit on a free block takes it out of the queue)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None and block.prev_free is None and block.next_free is None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise IndexError("no free blocks")
        self.remove(first)
        return first

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not free"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def contains(self, block: KVBlock) -> bool:
        return block.prev_free is not None

    def __iter__(self):
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_caching: bool = True, events: KVEventLog | None = None
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.events = events if events is not None else KVEventLog()
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}  # block hash -> the block holding it
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """n blocks for new data, ref_cnt 1 each; evicts their old hashes. Caller checks room."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            self._unhash(block, record=True)
            self.num_evictions += 1

    def _unhash(self, block: KVBlock, record: bool) -> None:
        """Forget the block's hash (and its index entry, if the entry is this block)."""
        h = block.block_hash
        if h is not None and self.cached.get(h) is block:
            del self.cached[h]
            if record and self.events.enabled:
                self.events.removed(h)
        block.block_hash, block.parent_hash, block.token_ids = None, None, ()

    def get_cached_block(self, block_hash: bytes, token_ids: tuple[int, ...]) -> KVBlock | None:
        """The block holding this hash, if its tokens are exactly ``token_ids``."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None  # a hash collision must never hand out the wrong K/V
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache hits; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_block(
        self,
        block: KVBlock,
        block_hash: bytes,
        token_ids: tuple[int, ...],
        parent_hash: bytes | None = None,
    ) -> None:
        """Register a block that just became full. First writer wins for a given hash."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            if self.events.enabled:
                self.events.stored(block_hash, parent_hash, token_ids)

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue in this order
        (pass a request's blocks tail first, so its tail is evicted first)."""
        for block in ordered:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if not self.enable_caching:
                    self._evict(block)
                self.free_queue.append(block)

    def uncache(self, blocks: Iterable[KVBlock]) -> int:
        """Take the free ones of these blocks out of the prefix cache (after a failed step their
        K/V are not to be trusted); blocks still held keep their hash. Returns how many lost it.
        Not counted as evictions."""
        dropped = 0
        for block in blocks:
            if block.ref_cnt == 0 and block.block_hash is not None:
                self._unhash(block, record=True)
                dropped += 1
        return dropped

    def reset_prefix_cache(self) -> int:
        """Drop the hash of every free cached block; held blocks keep theirs. Returns how
        many were dropped (not counted as evictions). One ``AllBlocksCleared`` event if the
        index ends empty, else a ``BlockRemoved`` of the dropped hashes."""
        dropped = 0
        removed = []
        for block in self.blocks:
            if block.ref_cnt == 0 and block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    removed.append(block.block_hash)
                self._unhash(block, record=False)
                dropped += 1
        if self.events.enabled and removed:
            if self.cached:
                for h in removed:
                    self.events.removed(h)
            else:
                self.events.cleared()
        return dropped

    def cached_in_eviction_order(self) -> list[KVBlock]:
        """Every indexed block, the next to be evicted first: the free queue's, then those
        held by requests (most recently used last)."""
        free = [
            b
            for b in self.free_queue
            if b.block_hash is not None and self.cached.get(b.block_hash) is b
        ]
        held = [b for b in self.cached.values() if b.ref_cnt > 0]
        return free + held

    def restore(self, entries: list[tuple[bytes, bytes | None, tuple[int, ...]]]) -> list[KVBlock]:
        """Index free blocks for ``(hash, parent hash, token ids)`` entries, the first to be
        evicted first, as a reloaded prefix cache; returns the blocks, one per entry, for the
        caller to fill with the saved K/V. Needs that many free blocks, and hashes not
        already indexed."""
        if not self.enable_caching:
            raise ValueError("prefix caching is off: there is no cache to restore into")
        if len(entries) > self.num_free_blocks:
            raise ValueError(f"{len(entries)} blocks to restore, {self.num_free_blocks} free")
        hashes = {e[0] for e in entries}
        if len(hashes) < len(entries) or not hashes.isdisjoint(self.cached):
            raise ValueError("restored block hashes must be new to the prefix cache and unique")
        blocks = self.get_new_blocks(len(entries))
        for block, (block_hash, parent, tokens) in zip(blocks, entries, strict=True):
            block.block_hash, block.parent_hash, block.token_ids = block_hash, parent, tokens
            self.cached[block_hash] = block
        self.free_blocks(blocks)  # evictable, in entry order
        if self.events.enabled:
            # parents before children (eviction order is mostly the reverse), depth first so
            # that each chain goes out as one BlockStored
            children: dict[bytes | None, list[tuple[bytes, bytes | None, tuple[int, ...]]]] = {}
            roots = []
            for entry in entries:
                (children.setdefault(entry[1], []) if entry[1] in hashes else roots).append(entry)
            stack = roots[::-1]
            while stack:
                block_hash, parent, tokens = stack.pop()
                self.events.stored(block_hash, parent, tokens)
                stack.extend(children.get(block_hash, ())[::-1])
        return blocks

    def check_integrity(self) -> None:
        free = list(self.free_queue)
        assert len(free) == self.free_queue.num_free, "free queue count out of sync"
        assert len({b.block_id for b in free}) == len(free), "a block is twice in the free queue"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            in_queue = self.free_queue.contains(block)
            assert in_queue == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in free queue = {in_queue}"
            )
        assert self.num_free_blocks + sum(b.ref_cnt > 0 for b in self.blocks) == self.num_blocks
        for h, block in self.cached.items():
            assert block.block_hash == h, (
                f"hash index entry points at block {block.block_id} with another hash"
            )
