"""Chained sha256 block hashes (kvserve.kv.prefix_cache)."""

from __future__ import annotations

import hashlib
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv.prefix_cache import HASH_ROOT, block_hashes, hash_block

BS = 4


def test_only_full_blocks_are_hashed():
    assert block_hashes([], BS) == []
    assert block_hashes([1, 2, 3], BS) == []
    assert len(block_hashes([1, 2, 3, 4], BS)) == 1
    assert len(block_hashes(list(range(7)), BS)) == 1
    assert len(block_hashes(list(range(8)), BS)) == 2
    assert len(block_hashes(list(range(11)), BS)) == 2
    # the partial tail does not influence the full blocks' hashes
    assert block_hashes(list(range(8)), BS) == block_hashes(list(range(8)) + [99, 98], BS)


def test_digests_are_sha256_bytes():
    hashes = block_hashes(list(range(12)), BS)
    assert len(hashes) == 3
    for d in hashes:
        assert isinstance(d, bytes) and len(d) == 32
    assert len(set(hashes)) == 3
    # exactly sha256(parent, tokens as <q, len(extra) as <q, extra)
    first = hashlib.sha256(
        HASH_ROOT + struct.pack("<4q", 0, 1, 2, 3) + struct.pack("<q", 0)
    ).digest()
    assert hashes[0] == first
    second = hashlib.sha256(first + struct.pack("<4q", 4, 5, 6, 7) + struct.pack("<q", 0)).digest()
    assert hashes[1] == second
    assert hash_block(None, [0, 1, 2, 3]) == first
    assert hash_block(first, [4, 5, 6, 7]) == second


def test_deterministic():
    toks = [5, 3, 9, 1, 0, 0, 2, 7, 8]
    assert block_hashes(toks, BS) == block_hashes(list(toks), BS)
    assert block_hashes(tuple(toks), BS) == block_hashes(toks, BS)


def test_chaining_change_in_block0_changes_every_hash():
    base = list(range(16))
    changed = list(base)
    changed[2] = 100
    a, b = block_hashes(base, BS), block_hashes(changed, BS)
    assert len(a) == len(b) == 4
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_chaining_change_in_block1_keeps_block0():
    base = list(range(16))
    changed = list(base)
    changed[5] = 100
    a, b = block_hashes(base, BS), block_hashes(changed, BS)
    assert a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2] and a[3] != b[3]


def test_same_block_at_another_position_hashes_differently():
    # block contents [1,2,3,4] twice in a row: the parent makes the two hashes differ
    hashes = block_hashes([1, 2, 3, 4, 1, 2, 3, 4], BS)
    assert hashes[0] != hashes[1]


def test_incremental_extension_equals_from_scratch():
    toks = list(range(30))
    full = block_hashes(toks, BS)
    assert len(full) == 7
    start = block_hashes(toks[:9], BS)  # 2 blocks known
    assert block_hashes(toks, BS, start=start) == full
    # start is not mutated
    assert len(start) == 2
    # extending by nothing, or with every hash known, is a no-op
    assert block_hashes(toks, BS, start=full) == full
    assert block_hashes(toks[:9], BS, start=start) == start


@settings(max_examples=50, deadline=None)
@given(
    toks=st.lists(st.integers(0, 5), max_size=40),
    cut=st.integers(0, 40),
    salt=st.sampled_from([None, "a", "tenant-b"]),
)
def test_incremental_extension_property(toks, cut, salt):
    full = block_hashes(toks, BS, salt)
    prefix = block_hashes(toks[: min(cut, len(toks))], BS, salt)
    assert block_hashes(toks, BS, salt, start=prefix) == full


def test_cache_salt_changes_every_hash():
    toks = list(range(12))
    plain = block_hashes(toks, BS)
    salted = block_hashes(toks, BS, cache_salt="a")
    other = block_hashes(toks, BS, cache_salt="b")
    for x, y, z in zip(plain, salted, other, strict=True):
        assert len({x, y, z}) == 3
    # the salt only enters block 0; later blocks differ through the chain
    assert salted[1] == hash_block(salted[0], toks[4:8])
    assert salted[0] == hash_block(None, toks[:4], b"a")


def test_same_salt_same_hashes():
    toks = list(range(12))
    assert block_hashes(toks, BS, "a") == block_hashes(list(toks), BS, "a")


def test_incremental_extension_with_salt():
    toks = list(range(20))
    start = block_hashes(toks[:8], BS, "s")
    assert block_hashes(toks, BS, "s", start=start) == block_hashes(toks, BS, "s")


def test_block_size_matters():
    toks = list(range(8))
    assert block_hashes(toks, 4)[0] != block_hashes(toks, 8)[0]
    assert len(block_hashes(toks, 8)) == 1
    assert len(block_hashes(toks, 2)) == 4


def test_large_token_ids():
    toks = [2**40, 0, 2**31, 1]
    (d,) = block_hashes(toks, BS)
    assert d != block_hashes([0, 0, 2**31, 1], BS)[0]
