"""The longest prefix-cache hit over every cache group (vLLM v1's rules).

A hit of L blocks means the first L * block_size tokens need not be computed: every group
must then hold what the next query (at position L * block_size) reads.

- A full-attention group needs all L blocks: its hit is the longest run of cached blocks from
  the first, so any shorter hit is one too.
- A windowed group (kv/spec.py ``SlidingWindowSpec``) needs only the blocks inside the window
  of the hit's end, [first_needed_block(L * block_size), L), plus its sink blocks; the blocks
  before the window may have been evicted long ago. Its hits are not prefix-closed (a longer
  hit can be valid where a shorter one is not), so for a bound L it takes the longest valid
  L' <= L.

``longest_hit`` lowers L group by group until every group agrees (each step only lowers it,
so it ends). A windowed group's entries before the window are None: the caller holds no block
for them.

Blocks of group g are indexed under ``group_key(hash, g)``: the same tokens cached by two
groups are two blocks (each holds its own layers), and a lookup must find its group's.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.kv.block_pool import BlockPool, KVBlock
from kvserve.kv.spec import LayerSpec


def group_key(block_hash: bytes, group: int) -> bytes:
    """The index key of a block of ``group``: the first group's is the chain hash itself (what
    KV events and routers see), the others' carry the group number."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "big")


def _lookups(
    pool: BlockPool,
    group: int,
    token_ids: Sequence[int],
    hashes: Sequence[bytes],
    block_size: int,
    max_blocks: int,
    stop_at_miss: bool,
) -> list[KVBlock | None]:
    """The cached block of each of the first ``max_blocks`` blocks (None: not cached); a
    full-attention group stops at its first miss (nothing after it can be used)."""
    out: list[KVBlock | None] = []
    for i in range(max_blocks):
        lo = i * block_size
        tokens = tuple(token_ids[lo : lo + block_size])
        block = pool.get_cached_block(group_key(hashes[i], group), tokens)
        if block is None and stop_at_miss:
            break
        out.append(block)
    return out + [None] * (max_blocks - len(out))


def _is_full(spec: LayerSpec | None) -> bool:
    return spec is None or spec.sliding_window is None


def _window_hit(spec: LayerSpec, cached: list[KVBlock | None], bound: int) -> int:
    """The longest L <= bound whose window blocks and sink blocks are all cached."""
    run = [0] * len(cached)  # run[i]: cached blocks in a row ending at i
    for i, b in enumerate(cached):
        run[i] = 0 if b is None else (run[i - 1] + 1 if i else 1)
    prefix = 0  # cached blocks in a row from the first
    while prefix < len(cached) and cached[prefix] is not None:
        prefix += 1
    for length in range(bound, 0, -1):
        first = spec.first_needed_block(length * spec.block_size)
        sinks = min(spec.sink_blocks, first)
        if run[length - 1] >= length - first and prefix >= sinks:
            return length
    return 0


def longest_hit(
    pool: BlockPool,
    group_specs: Sequence[LayerSpec | None],
    token_ids: Sequence[int],
    hashes: Sequence[bytes],
    block_size: int,
) -> tuple[list[list[KVBlock | None]], int]:
    """Per group, its cached blocks for the first blocks of ``token_ids`` (None where a window
    needs none), and the hit's length in blocks (at most ``len(token_ids) - 1`` tokens: the
    last token is always recomputed for its logits). ``hashes``: the chain hashes."""
    max_blocks = (len(token_ids) - 1) // block_size
    cached = [
        _lookups(pool, g, token_ids, hashes, block_size, max_blocks, _is_full(group_specs[g]))
        for g in range(len(group_specs))
    ]
    length = max_blocks
    changed = True
    while changed and length > 0:
        changed = False
        for spec, blocks in zip(group_specs, cached, strict=True):
            if _is_full(spec):
                full = 0
                while full < length and blocks[full] is not None:
                    full += 1
                new = full
            else:
                new = _window_hit(spec, blocks, length)
            if new < length:
                length, changed = new, True
    result = []
    for spec, blocks in zip(group_specs, cached, strict=True):
        if _is_full(spec):
            result.append(blocks[:length])
            continue
        first = spec.first_needed_block(length * block_size)
        keep = set(range(min(spec.sink_blocks, first))) | set(range(first, length))
        result.append([b if i in keep else None for i, b in enumerate(blocks[:length])])
    return result, length
