"""BlockPool bookkeeping, in the style of vLLM's test_prefix_caching.py: exact block ids, ref
counts, hashes and eviction order after every operation. The free queue alone is tested in
test_free_block_queue.py."""

from __future__ import annotations

import hashlib

import pytest

from kvserve.kv.block_pool import BlockPool, KVBlock


def h(name: str) -> bytes:
    """A stand-in block hash (32 bytes, like the real sha256 digests)."""
    return hashlib.sha256(name.encode()).digest()


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def ref_cnts(pool: BlockPool) -> list[int]:
    return [b.ref_cnt for b in pool.blocks]


# --------------------------------------------------------------------------------------------
# BlockPool


def test_pool_rejects_empty():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_pool_initial_state():
    pool = BlockPool(6)
    pool.check_integrity()
    assert pool.num_free_blocks == 6
    assert pool.num_used_blocks == 0
    assert pool.usage == 0.0
    assert free_ids(pool) == [0, 1, 2, 3, 4, 5]
    assert ref_cnts(pool) == [0] * 6
    assert pool.cached == {}


def test_get_new_blocks_in_free_queue_order():
    pool = BlockPool(6)
    got = pool.get_new_blocks(2)
    pool.check_integrity()
    assert [b.block_id for b in got] == [0, 1]
    assert ref_cnts(pool) == [1, 1, 0, 0, 0, 0]
    assert free_ids(pool) == [2, 3, 4, 5]
    assert pool.num_used_blocks == 2
    assert pool.usage == pytest.approx(2 / 6)

    got = pool.get_new_blocks(3)
    pool.check_integrity()
    assert [b.block_id for b in got] == [2, 3, 4]
    assert free_ids(pool) == [5]
    assert pool.get_new_blocks(0) == []
    pool.check_integrity()


def test_get_new_blocks_too_many_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    pool.check_integrity()
    assert free_ids(pool) == [3]
    assert ref_cnts(pool) == [1, 1, 1, 0]


def test_free_order_determines_eviction_order():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(5)
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, h(f"b{i}"), (i,))
    pool.check_integrity()
    # free tail first, as the manager does for a request
    pool.free_blocks([blocks[4], blocks[2], blocks[0]])
    pool.check_integrity()
    assert free_ids(pool) == [4, 2, 0]
    assert ref_cnts(pool) == [0, 1, 0, 1, 0]
    # freed blocks keep their hash: still prefix-cache hits
    assert set(pool.cached) == {h(f"b{i}") for i in range(5)}

    (first,) = pool.get_new_blocks(1)
    pool.check_integrity()
    assert first.block_id == 4
    assert first.block_hash is None and first.token_ids == ()
    assert h("b4") not in pool.cached
    assert pool.num_evictions == 1
    assert free_ids(pool) == [2, 0]

    pool.free_blocks([blocks[1], blocks[3]])
    pool.check_integrity()
    assert free_ids(pool) == [2, 0, 1, 3]
    assert [b.block_id for b in pool.get_new_blocks(4)] == [2, 0, 1, 3]
    pool.check_integrity()
    assert pool.cached == {}
    assert pool.num_evictions == 5


def test_free_blocks_drops_one_reference_each():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.touch([a])  # a second holder
    pool.check_integrity()
    assert ref_cnts(pool) == [2, 1, 0]
    pool.free_blocks([b, a])
    pool.check_integrity()
    assert ref_cnts(pool) == [1, 0, 0]
    assert free_ids(pool) == [2, 1]  # a still held: not free
    pool.free_blocks([a])
    pool.check_integrity()
    assert free_ids(pool) == [2, 1, 0]


def test_double_free_asserts():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([a])
    pool.check_integrity()


def test_touch_free_cached_block_leaves_queue():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_block(blocks[1], h("x"), (1, 2))
    pool.free_blocks(reversed(blocks))
    pool.check_integrity()
    assert free_ids(pool) == [3, 2, 1, 0]

    hit = pool.get_cached_block(h("x"), (1, 2))
    assert hit is blocks[1]
    pool.touch([hit])
    pool.check_integrity()
    assert hit.ref_cnt == 1
    assert free_ids(pool) == [3, 2, 0]
    assert not pool.free_queue.contains(hit)
    assert pool.num_free_blocks == 3
    # still cached, no eviction happened
    assert pool.cached[h("x")] is hit and hit.block_hash == h("x")
    assert pool.num_evictions == 0

    # touching a used block only bumps its count
    pool.touch([hit])
    pool.check_integrity()
    assert hit.ref_cnt == 2
    assert free_ids(pool) == [3, 2, 0]

    pool.free_blocks([hit, hit])
    pool.check_integrity()
    assert free_ids(pool) == [3, 2, 0, 1]


def test_cache_full_block_first_writer_wins():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, h("p"), (7, 7))
    pool.check_integrity()
    assert pool.cached == {h("p"): a}
    assert a.block_hash == h("p") and a.token_ids == (7, 7)

    # a second block with the same content: it carries the hash but the index keeps the first
    pool.cache_full_block(b, h("p"), (7, 7))
    pool.check_integrity()
    assert pool.cached == {h("p"): a}
    assert b.block_hash == h("p")
    assert pool.get_cached_block(h("p"), (7, 7)) is a

    # evicting the duplicate must not drop the first writer's index entry
    pool.free_blocks([b])
    (again,) = pool.get_new_blocks(1)
    assert again.block_id == 2  # 2 and 3 were ahead of b in the queue
    pool.get_new_blocks(1)
    (again,) = pool.get_new_blocks(1)
    assert again is b
    pool.check_integrity()
    assert b.block_hash is None
    assert pool.cached == {h("p"): a}


def test_cache_full_block_already_cached_block_keeps_its_hash():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, h("one"), (1,))
    pool.cache_full_block(a, h("two"), (2,))
    pool.check_integrity()
    assert a.block_hash == h("one") and a.token_ids == (1,)
    assert pool.cached == {h("one"): a}


def test_get_cached_block_miss_and_token_mismatch():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    assert pool.get_cached_block(h("nothing"), (1, 2)) is None
    pool.cache_full_block(a, h("c"), (1, 2))
    assert pool.get_cached_block(h("c"), (1, 2)) is a
    # a colliding hash with other tokens must never be handed out
    assert pool.get_cached_block(h("c"), (1, 3)) is None
    assert pool.get_cached_block(h("c"), (1,)) is None
    pool.check_integrity()


def test_get_cached_block_simulated_collision():
    """Register a block under a hash that belongs to other tokens: lookups by the real
    tokens miss instead of returning the wrong K/V."""
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    collide = h("collide")
    pool.cache_full_block(a, collide, (9, 9, 9, 9))
    pool.free_blocks([a])
    pool.check_integrity()
    assert pool.get_cached_block(collide, (1, 2, 3, 4)) is None
    assert pool.get_cached_block(collide, (9, 9, 9, 9)) is a
    assert a.ref_cnt == 0 and free_ids(pool) == [1, 2, 0]


def test_eviction_clears_hash_index_entry():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, h("a"), (1,))
    pool.cache_full_block(b, h("b"), (2,))
    pool.free_blocks([b, a])  # queue: b, a
    pool.check_integrity()
    assert set(pool.cached) == {h("a"), h("b")}
    assert pool.num_evictions == 0

    (new,) = pool.get_new_blocks(1)
    pool.check_integrity()
    assert new is b
    assert pool.cached == {h("a"): a}
    assert b.block_hash is None and b.token_ids == ()
    assert pool.get_cached_block(h("b"), (2,)) is None
    assert pool.get_cached_block(h("a"), (1,)) is a
    assert pool.num_evictions == 1

    # a block without a hash is not counted as an eviction
    pool.free_blocks([b])
    pool.get_new_blocks(2)  # a (hash evicted), then b (no hash)
    pool.check_integrity()
    assert pool.cached == {}
    assert pool.num_evictions == 2


def test_reset_prefix_cache_only_drops_free_blocks():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, h("a"), (1,))
    pool.cache_full_block(b, h("b"), (2,))
    pool.free_blocks([b])
    pool.reset_prefix_cache()
    pool.check_integrity()
    assert pool.cached == {h("a"): a}
    assert b.block_hash is None
    assert free_ids(pool) == [2, 1]


def test_enable_caching_false_registers_nothing():
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, h("a"), (1,))
    pool.check_integrity()
    assert pool.cached == {}
    assert a.block_hash is None
    assert pool.get_cached_block(h("a"), (1,)) is None


def test_enable_caching_false_drops_hashes_on_free():
    pool = BlockPool(3, enable_caching=False)
    a, b = pool.get_new_blocks(2)
    # put hashes in by hand (cache_full_block refuses to) to see free drop them
    for blk, name in ((a, "a"), (b, "b")):
        blk.block_hash, blk.token_ids = h(name), (blk.block_id,)
        pool.cached[h(name)] = blk
    pool.check_integrity()
    pool.touch([a])
    pool.free_blocks([a, b])  # a still held once, b freed
    pool.check_integrity()
    assert b.block_hash is None and b.token_ids == ()
    assert pool.cached == {h("a"): a}
    pool.free_blocks([a])
    pool.check_integrity()
    assert a.block_hash is None
    assert pool.cached == {}
    assert free_ids(pool) == [2, 1, 0]


# --------------------------------------------------------------------------------------------
# check_integrity catches corrupted state


def test_integrity_detects_negative_ref_cnt():
    pool = BlockPool(3)
    pool.blocks[1].ref_cnt = -1
    with pytest.raises(AssertionError, match="ref_cnt -1"):
        pool.check_integrity()


def test_integrity_detects_used_block_in_free_queue():
    pool = BlockPool(3)
    pool.blocks[0].ref_cnt = 1  # says used, but still queued
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_detects_free_block_not_in_queue():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    a.ref_cnt = 0  # says free, but not queued
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_detects_wrong_hash_entry():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, h("a"), (1,))
    pool.cache_full_block(b, h("b"), (2,))
    pool.check_integrity()
    pool.cached[h("a")] = b  # index points at a block carrying another hash
    with pytest.raises(AssertionError, match="hash index"):
        pool.check_integrity()


def test_integrity_detects_hash_entry_on_unhashed_block():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.cached[h("ghost")] = a
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_detects_free_count_out_of_sync():
    pool = BlockPool(3)
    pool.free_queue.num_free += 1
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_detects_block_twice_in_queue():
    pool = BlockPool(3)
    blocks = pool.blocks
    # splice block 0 in again after block 2: 0 -> 1 -> 2 -> 0 -> tail
    tail = blocks[2].next_free
    dup = KVBlock(0)
    blocks[2].next_free, dup.prev_free, dup.next_free = dup, blocks[2], tail
    pool.free_queue.num_free += 1
    with pytest.raises(AssertionError):
        pool.check_integrity()
