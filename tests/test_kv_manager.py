"""KVCacheManager on a small pool (10 blocks of 4 tokens), in the style of vLLM's
test_prefix_caching.py: exact block ids, ref counts, hashes and prefix-cache hits after each
allocation, integrity checked throughout, and no leaks at the end. Fork / copy-on-write and
eviction order are tested in test_kv_fork.py; the shared helpers live in conftest.py."""

from __future__ import annotations

import pytest
from conftest import (
    BS,
    NUM_BLOCKS,
    assert_no_leaks,
    decode,
    finish,
    free_ids,
    make_request,
    prefill,
    refs,
)

from kvserve.kv.manager import KVCacheManager
from kvserve.kv.prefix_cache import block_hashes


def test_rejects_bad_block_size():
    with pytest.raises(ValueError):
        KVCacheManager(4, 0)


def test_allocate_prefill_exact_ids(kv):
    req = make_request("a", list(range(12)))  # exactly 3 full blocks
    computed, num_hit = kv.get_computed_blocks(req)
    assert computed == ([],) and num_hit == 0
    new = kv.allocate_slots(req, 12, computed)
    kv.check_integrity()
    assert [b.block_id for b in new] == [0, 1, 2]
    assert kv.block_ids("a") == [0, 1, 2]
    assert refs(kv, [0, 1, 2]) == [1, 1, 1]
    assert free_ids(kv) == [3, 4, 5, 6, 7, 8, 9]
    # nothing is registered before the step has run
    assert kv.pool.cached == {}

    req.num_computed_tokens = 12
    kv.cache_blocks(req, 12)
    kv.check_integrity()
    hashes = block_hashes(list(range(12)), BS)
    assert req.block_hashes == hashes
    assert [kv.pool.blocks[i].block_hash for i in (0, 1, 2)] == hashes
    assert kv.pool.blocks[1].token_ids == (4, 5, 6, 7)
    assert kv.pool.cached == {
        hashes[0]: kv.pool.blocks[0],
        hashes[1]: kv.pool.blocks[1],
        hashes[2]: kv.pool.blocks[2],
    }
    assert kv.num_cached_blocks["a"] == 3

    finish(kv, req)
    assert_no_leaks(kv)


def test_partial_last_block(kv):
    req = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    new, hit = prefill(kv, req)
    assert new == [0, 1, 2] and hit == 0
    assert kv.num_cached_blocks["a"] == 2
    assert kv.pool.blocks[2].block_hash is None  # partial: not cached
    assert len(kv.pool.cached) == 2

    # decodes fill the partial block without new allocations, then spill into a new one
    assert decode(kv, req, 100) == []
    assert kv.pool.blocks[2].block_hash is None
    assert decode(kv, req, 101) == []
    # 12 tokens computed: block 2 became full and got registered
    assert kv.pool.blocks[2].block_hash == block_hashes(req.all_token_ids, BS)[2]
    assert kv.pool.blocks[2].token_ids == (8, 9, 100, 101)
    assert kv.num_cached_blocks["a"] == 3
    assert decode(kv, req, 102) == [3]
    assert kv.block_ids("a") == [0, 1, 2, 3]
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9]

    finish(kv, req)
    assert_no_leaks(kv)


def test_chunked_prefill_registers_blocks_as_they_fill(kv):
    req = make_request("a", list(range(10)))
    assert [b.block_id for b in kv.allocate_slots(req, 6)] == [0, 1]
    req.num_computed_tokens = 6
    kv.cache_blocks(req, 6)
    kv.check_integrity()
    assert kv.num_cached_blocks["a"] == 1
    assert kv.pool.blocks[0].block_hash is not None
    assert kv.pool.blocks[1].block_hash is None
    assert [b.block_id for b in kv.allocate_slots(req, 4)] == [2]
    req.num_computed_tokens = 10
    kv.cache_blocks(req, 10)
    kv.check_integrity()
    assert kv.num_cached_blocks["a"] == 2
    assert kv.pool.blocks[1].block_hash is not None
    finish(kv, req)
    assert_no_leaks(kv)


def test_shared_prefix_hit_while_owner_runs(kv):
    common = list(range(8))
    a = make_request("a", common + [50, 51, 52])  # blocks 0,1 full + partial 2
    assert prefill(kv, a) == ([0, 1, 2], 0)

    b = make_request("b", common + [60, 61])
    computed, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in computed[0]] == [0, 1]
    assert num_hit == 8
    # no reference taken yet
    assert refs(kv, [0, 1]) == [1, 1]
    new = kv.allocate_slots(b, b.num_tokens - num_hit, computed)
    kv.check_integrity()
    assert [blk.block_id for blk in new] == [3]
    assert kv.block_ids("b") == [0, 1, 3]
    assert refs(kv, [0, 1, 2, 3]) == [2, 2, 1, 1]
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9]
    assert kv.num_cached_blocks["b"] == 2

    b.num_computed_tokens = b.num_tokens
    kv.cache_blocks(b, b.num_computed_tokens)
    kv.check_integrity()

    # the first owner finishes: shared blocks stay with b, its private tail is freed first
    finish(kv, a)
    assert refs(kv, [0, 1, 2, 3]) == [1, 1, 0, 1]
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9, 2]
    finish(kv, b)
    # b frees tail first: 3, then 1, then 0
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert_no_leaks(kv)


def test_shared_prefix_hit_after_owner_finished(kv):
    common = list(range(8))
    a = make_request("a", common + [50])
    assert prefill(kv, a) == ([0, 1, 2], 0)
    finish(kv, a)
    assert free_ids(kv) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert refs(kv, [0, 1, 2]) == [0, 0, 0]
    # freed blocks keep their hashes
    assert kv.pool.blocks[0].block_hash is not None
    assert kv.pool.blocks[1].block_hash is not None

    b = make_request("b", common + [60, 61, 62])
    computed, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in computed[0]] == [0, 1] and num_hit == 8
    new = kv.allocate_slots(b, b.num_tokens - num_hit, computed)
    kv.check_integrity()
    # the hits come off the free queue with ref_cnt 1; the new block is the queue head
    assert [blk.block_id for blk in new] == [3]
    assert kv.block_ids("b") == [0, 1, 3]
    assert refs(kv, [0, 1, 3]) == [1, 1, 1]
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9, 2]
    assert kv.pool.num_evictions == 0
    finish(kv, b)
    assert_no_leaks(kv)


def test_computed_blocks_never_cover_last_token(kv):
    toks = list(range(8))
    a = make_request("a", toks)
    assert prefill(kv, a) == ([0, 1], 0)
    assert len(kv.pool.cached) == 2

    # the same 2-block prompt: only block 0 is a hit, the last token is recomputed
    b = make_request("b", toks)
    computed, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in computed[0]] == [0]
    assert num_hit == 4
    new = kv.allocate_slots(b, 4, computed)
    kv.check_integrity()
    assert [blk.block_id for blk in new] == [2]
    assert kv.block_ids("b") == [0, 2]

    # one token more and both full blocks are hits
    c = make_request("c", toks + [99])
    computed, num_hit = kv.get_computed_blocks(c)
    assert [blk.block_id for blk in computed[0]] == [0, 1] and num_hit == 8

    # a single-block prompt never hits
    d = make_request("d", toks[:4])
    assert kv.get_computed_blocks(d) == (([],), 0)

    finish(kv, a)
    finish(kv, b)
    assert_no_leaks(kv)


def test_prefix_counters_in_tokens(kv):
    toks = list(range(12))
    a = make_request("a", toks)
    prefill(kv, a)
    assert (kv.prefix_queries, kv.prefix_hits) == (12, 0)

    def lookup(req) -> None:
        _, num_hit = kv.get_computed_blocks(req)
        kv.get_computed_blocks(req)  # a retry (pool full) is not counted again
        kv.record_prefix_lookup(req.num_tokens, num_hit)

    b = make_request("b", toks + [1, 2, 3])  # 15 tokens: 3 full blocks hit
    lookup(b)
    assert (kv.prefix_queries, kv.prefix_hits) == (27, 12)

    c = make_request("c", toks[:8] + [7])  # 9 tokens: 2 blocks hit
    lookup(c)
    assert (kv.prefix_queries, kv.prefix_hits) == (36, 20)

    d = make_request("d", [42] * 6)  # miss
    lookup(d)
    assert (kv.prefix_queries, kv.prefix_hits) == (42, 20)

    finish(kv, a)
    assert_no_leaks(kv)


def test_no_prefix_caching():
    kv = KVCacheManager(NUM_BLOCKS, BS, enable_prefix_caching=False)
    toks = list(range(9))
    a = make_request("a", toks)
    assert prefill(kv, a) == ([0, 1, 2], 0)
    assert kv.pool.cached == {}
    assert all(b.block_hash is None for b in kv.pool.blocks)
    b = make_request("b", toks)
    assert kv.get_computed_blocks(b) == (([],), 0)
    assert (kv.prefix_queries, kv.prefix_hits) == (0, 0)
    finish(kv, a)
    assert_no_leaks(kv)


def test_salt_isolation(kv):
    toks = list(range(9))
    a = make_request("a", toks, cache_salt="tenant-1")
    prefill(kv, a)
    assert len(kv.pool.cached) == 2

    other_salt = make_request("b", toks, cache_salt="tenant-2")
    assert kv.get_computed_blocks(other_salt) == (([],), 0)
    no_salt = make_request("c", toks)
    assert kv.get_computed_blocks(no_salt) == (([],), 0)

    same_salt = make_request("d", toks, cache_salt="tenant-1")
    computed, num_hit = kv.get_computed_blocks(same_salt)
    assert [blk.block_id for blk in computed[0]] == [0, 1] and num_hit == 8
    kv.record_prefix_lookup(same_salt.num_tokens, num_hit)
    assert kv.prefix_hits == 8

    # the salted request's blocks carry salted hashes
    assert other_salt.block_hashes[0] != a.block_hashes[0] != no_salt.block_hashes[0]
    assert same_salt.block_hashes == a.block_hashes

    # and a salt-less owner is not visible to salted requests either
    finish(kv, a)
    e = make_request("e", toks)
    prefill(kv, e)
    f = make_request("f", toks, cache_salt="tenant-1")
    computed, _ = kv.get_computed_blocks(f)
    assert [blk.block_id for blk in computed[0]] == [0, 1]  # tenant-1's freed blocks, not e's
    g = make_request("g", toks)
    computed, _ = kv.get_computed_blocks(g)
    assert [blk.block_id for blk in computed[0]] == kv.block_ids("e")[:2]
    finish(kv, e)
    assert_no_leaks(kv)


def test_allocate_slots_returns_none_when_short(kv):
    hog = make_request("hog", [1] * 32)  # 8 blocks
    prefill(kv, hog)
    assert free_ids(kv) == [8, 9]

    req = make_request("r", list(range(9)))  # 3 blocks
    snapshot = ([b.ref_cnt for b in kv.pool.blocks], free_ids(kv), dict(kv.pool.cached))
    assert kv.allocate_slots(req, 9) is None
    kv.check_integrity()
    assert "r" not in kv.req_to_blocks
    assert kv.block_ids("r") == []
    assert ([b.ref_cnt for b in kv.pool.blocks], free_ids(kv), dict(kv.pool.cached)) == snapshot

    # it fits with exactly the free blocks
    assert [b.block_id for b in kv.allocate_slots(req, 8)] == [8, 9]
    kv.check_integrity()
    assert kv.pool.num_free_blocks == 0
    # a running request that cannot grow gets None and keeps its blocks
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 1) is None
    assert kv.block_ids("r") == [8, 9]
    assert kv.pool.num_free_blocks == 0
    finish(kv, req)
    finish(kv, hog)
    assert_no_leaks(kv)


def test_free_hits_count_against_room(kv):
    common = list(range(8))
    a = make_request("a", common + [50])
    assert prefill(kv, a) == ([0, 1, 2], 0)
    finish(kv, a)
    assert free_ids(kv) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]

    hog = make_request("hog", [1] * 28)  # 7 blocks: 3..9
    assert prefill(kv, hog) == ([3, 4, 5, 6, 7, 8, 9], 0)
    assert free_ids(kv) == [2, 1, 0]

    # 17 tokens: hits on the free blocks 0, 1 plus 3 new blocks; only 3 free in all
    b = make_request("b", common + list(range(100, 109)))
    computed, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in computed[0]] == [0, 1] and num_hit == 8
    assert kv.num_blocks_needed(b, b.num_tokens - num_hit, computed) == 3
    snapshot = ([blk.ref_cnt for blk in kv.pool.blocks], free_ids(kv), dict(kv.pool.cached))
    assert kv.allocate_slots(b, b.num_tokens - num_hit, computed) is None
    kv.check_integrity()
    assert ([blk.ref_cnt for blk in kv.pool.blocks], free_ids(kv), dict(kv.pool.cached)) == snapshot
    assert "b" not in kv.req_to_blocks

    # 13 tokens: 2 hits + 2 new = 4 > 3 free: still short
    c = make_request("c", common + list(range(100, 105)))
    computed, num_hit = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, c.num_tokens - num_hit, computed) is None
    assert ([blk.ref_cnt for blk in kv.pool.blocks], free_ids(kv), dict(kv.pool.cached)) == snapshot

    # 9 tokens: 2 hits + 1 new = 3 free: fits exactly; the new block is 2 (not a hit block)
    d = make_request("d", common + [100])
    computed, num_hit = kv.get_computed_blocks(d)
    new = kv.allocate_slots(d, d.num_tokens - num_hit, computed)
    kv.check_integrity()
    assert [blk.block_id for blk in new] == [2]
    assert kv.block_ids("d") == [0, 1, 2]
    assert free_ids(kv) == []
    assert refs(kv, [0, 1, 2]) == [1, 1, 1]

    finish(kv, d)
    finish(kv, hog)
    assert_no_leaks(kv)


def test_free_twice_is_safe(kv):
    a = make_request("a", list(range(5)))
    prefill(kv, a)
    finish(kv, a)
    finish(kv, a)
    assert_no_leaks(kv)


def test_manager_integrity_detects_ref_mismatch(kv):
    a = make_request("a", list(range(5)))
    prefill(kv, a)
    kv.pool.blocks[0].ref_cnt += 1  # a reference nobody holds
    with pytest.raises(AssertionError):
        kv.check_integrity()
    kv.pool.blocks[0].ref_cnt -= 1
    kv.check_integrity()
    kv.req_to_blocks["ghost"] = [kv.pool.blocks[1]]  # a holder the pool does not count
    with pytest.raises(AssertionError):
        kv.check_integrity()
