"""KVCacheManager fork / copy-on-write, free order and eviction order, on the small pool of
test_kv_manager.py (10 blocks of 4 tokens; the shared helpers live in conftest.py)."""

from __future__ import annotations

import pytest
from conftest import assert_no_leaks, finish, free_ids, make_request, prefill, refs


def test_fork_and_copy_on_write(kv):
    parent = make_request("p", list(range(6)))  # block 0 full, block 1 partial (2 tokens)
    assert prefill(kv, parent) == ([0, 1], 0)
    child = make_request("c", list(range(6)))
    kv.fork(parent, child)
    kv.check_integrity()
    assert kv.block_ids("c") == [0, 1]
    assert refs(kv, [0, 1]) == [2, 2]
    assert kv.num_cached_blocks["c"] == 1
    child.num_computed_tokens = parent.num_computed_tokens
    assert free_ids(kv) == [2, 3, 4, 5, 6, 7, 8, 9]

    # forking onto an id that already has blocks is refused
    with pytest.raises(AssertionError):
        kv.fork(parent, child)

    # the child writes its first sample at position 6, inside the shared partial block 1
    child.all_token_ids.append(40)
    assert kv.cow_blocks_needed(child) == 1
    copy = kv.prepare_write(child)
    kv.check_integrity()
    assert copy == [(1, 2)]
    assert kv.block_ids("c") == [0, 2]
    assert kv.block_ids("p") == [0, 1]
    assert refs(kv, [0, 1, 2]) == [2, 1, 1]  # full block 0 stays shared, never copied
    assert free_ids(kv) == [3, 4, 5, 6, 7, 8, 9]
    assert kv.cow_blocks_needed(child) == 0
    assert kv.prepare_write(child) == []  # already private
    assert kv.allocate_slots(child, 1) == []
    child.num_computed_tokens += 1

    # the parent's partial block is private again: no copy for it
    parent.all_token_ids.append(41)
    assert kv.cow_blocks_needed(parent) == 0
    assert kv.prepare_write(parent) == []
    assert kv.block_ids("p") == [0, 1]
    assert kv.allocate_slots(parent, 1) == []
    parent.num_computed_tokens += 1
    kv.check_integrity()

    # fill both to 8 tokens: each registers its own block 1 (different contents)
    for r, t in ((child, 42), (parent, 43)):
        r.all_token_ids.append(t)
        assert kv.allocate_slots(r, 1) == []
        r.num_computed_tokens += 1
        kv.cache_blocks(r, r.num_computed_tokens)
        kv.check_integrity()
    assert kv.pool.blocks[2].token_ids == (4, 5, 40, 42)
    assert kv.pool.blocks[1].token_ids == (4, 5, 41, 43)
    assert kv.pool.blocks[1].block_hash != kv.pool.blocks[2].block_hash

    finish(kv, parent)
    assert refs(kv, [0, 1, 2]) == [1, 0, 1]
    finish(kv, child)
    assert_no_leaks(kv)


def test_fork_full_blocks_are_never_copied(kv):
    parent = make_request("p", list(range(8)))  # exactly 2 full blocks
    assert prefill(kv, parent) == ([0, 1], 0)
    child = make_request("c", list(range(8)))
    kv.fork(parent, child)
    child.num_computed_tokens = 8
    kv.check_integrity()
    assert refs(kv, [0, 1]) == [2, 2]

    child.all_token_ids.append(9)
    assert kv.cow_blocks_needed(child) == 0
    assert kv.prepare_write(child) == []
    assert [b.block_id for b in kv.allocate_slots(child, 1)] == [2]
    child.num_computed_tokens = 9
    kv.check_integrity()
    assert kv.block_ids("c") == [0, 1, 2]
    assert refs(kv, [0, 1, 2]) == [2, 2, 1]

    parent.all_token_ids.append(10)
    assert kv.prepare_write(parent) == []
    assert [b.block_id for b in kv.allocate_slots(parent, 1)] == [3]
    kv.check_integrity()

    finish(kv, child)
    assert refs(kv, [0, 1, 2, 3]) == [1, 1, 0, 1]
    finish(kv, parent)
    assert_no_leaks(kv)


def test_free_order_tail_first_and_eviction_order(kv):
    toks = list(range(12))
    a = make_request("a", toks)
    assert prefill(kv, a) == ([0, 1, 2], 0)
    hashes = list(a.block_hashes)
    assert len(kv.pool.cached) == 3
    finish(kv, a)
    # tail first: the queue ends with 2, 1, 0
    assert free_ids(kv) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]

    # a big unrelated request takes the never-used blocks first, then evicts a's tail
    b = make_request("b", [77] * 32)  # 8 blocks
    assert prefill(kv, b) == ([3, 4, 5, 6, 7, 8, 9, 2], 0)
    assert kv.pool.num_evictions == 1
    assert hashes[2] not in kv.pool.cached
    assert kv.pool.cached[hashes[0]].block_id == 0
    assert kv.pool.cached[hashes[1]].block_id == 1
    assert free_ids(kv) == [1, 0]

    # a's head is still a hit; its evicted tail is not
    c = make_request("c", toks + [5])
    computed, num_hit = kv.get_computed_blocks(c)
    assert [blk.block_id for blk in computed[0]] == [0, 1] and num_hit == 8

    # the next eviction takes block 1 (freed before 0), then 0
    d = make_request("d", [88] * 4)
    assert prefill(kv, d) == ([1], 0)
    assert hashes[1] not in kv.pool.cached and hashes[0] in kv.pool.cached
    assert kv.pool.num_evictions == 2
    computed, num_hit = kv.get_computed_blocks(c)
    assert [blk.block_id for blk in computed[0]] == [0] and num_hit == 4
    e = make_request("e", [99] * 4)
    assert prefill(kv, e) == ([0], 0)
    assert kv.pool.cached.get(hashes[0]) is None
    assert kv.get_computed_blocks(c) == (([],), 0)

    for r in (b, d, e):
        finish(kv, r)
    assert_no_leaks(kv)
