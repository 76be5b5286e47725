"""KV cache events: what the prefix-cache index gained and lost, for routers that track it.

vLLM's three events (vllm/distributed/kv_events.py), recorded by ``BlockPool`` when the hash
index changes, and taken by whoever publishes them (``server/kv_events.py``) after each step:

- ``BlockStored``: hashes entered the index (consecutive blocks of one request coalesce into
  one event: ``block_hashes[i]`` chains from ``block_hashes[i - 1]``, the first from
  ``parent_block_hash``; ``token_ids`` are all their tokens in order);
- ``BlockRemoved``: hashes left the index (evicted for new data, dropped by a flush, dropped
  after a failed step);
- ``AllBlocksCleared``: the index is empty (a flush that emptied it, a rebuilt pool).

Exactly the index, never more: a block whose hash another block already holds ("first writer
wins" in ``BlockPool.cache_full_block``) is not stored, and its eviction removes nothing. So
replaying the events from an empty set gives ``set(BlockPool.cached)`` after every step, the
invariant the tests check.

Pure Python records (no msgspec, no zmq): the wire format is the publisher's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]  # len(block_hashes) * block_size tokens
    block_size: int


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[bytes]


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventLog:
    """The events since the last ``take``. Disabled (the default) it records nothing, so the
    pool pays one attribute check per change."""

    enabled: bool = False
    pending: list[KVCacheEvent] = field(default_factory=list)

    def stored(self, block_hash: bytes, parent: bytes | None, tokens: tuple[int, ...]) -> None:
        last = self.pending[-1] if self.pending else None
        if (
            isinstance(last, BlockStored)
            and parent is not None
            and last.block_hashes[-1] == parent
            and last.block_size == len(tokens)
        ):
            last.block_hashes.append(block_hash)  # the next block of the same chain
            last.token_ids.extend(tokens)
            return
        self.pending.append(BlockStored([block_hash], parent, list(tokens), len(tokens)))

    def removed(self, block_hash: bytes) -> None:
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self.pending.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        # nothing recorded before matters to a consumer: the index is empty now
        self.pending = [AllBlocksCleared()]

    def take(self) -> list[KVCacheEvent]:
        out, self.pending = self.pending, []
        return out


def replay(events: list[KVCacheEvent], cached: set[bytes] | None = None) -> set[bytes]:
    """The index a consumer rebuilds from ``events`` (applied to ``cached``, default empty)."""
    state = set(cached or ())
    for event in events:
        if isinstance(event, BlockStored):
            state.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            state.difference_update(event.block_hashes)
        else:
            state.clear()
    return state
