"""Why a prompt missed the prefix cache: the lessons' "a cached prefix is valid only if every
token id matches… a change in chat template, tokenizer version, or whitespace silently misses
the cache", made visible.

At admission, for a request that asks (``explain_cache``), the manager looks at the first
block the cache could not serve and at what the cache holds beside it:

- ``hit``: every block a lookup may serve was served (the last prompt token is always
  computed, for its logits; so is a last block that is not full);
- ``content``: a cached block continues the same prefix (same parent hash, so same salt and
  every earlier token) but differs inside this block: ``diverged_at`` is the first token
  position where it differs, with the cached and the new tokens around it;
- ``salt``: nothing cached under this request's salt starts the prompt, but a first block
  with exactly these tokens is cached under another salt (another tenant or ``cache_salt``);
- ``partial_block``: the tokens after the last full block (fewer than ``block_size``) can
  never be cached, so they are computed whatever the cache holds;
- ``no_cached_prefix``: nothing cached continues this prompt past ``cached_tokens``;
- ``caching_off`` / ``skipped`` (prompt logprobs need every position computed).

Pure Python over the pool's index: a scan of the cached blocks, paid only by requests that
ask. Rehashing a cached first block with this request's salt tells whether it was stored
under the same salt (the salt is hashed into first blocks only).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvserve.kv.block_pool import BlockPool, KVBlock
from kvserve.kv.prefix_cache import hash_block, salt_bytes

WINDOW = 8  # tokens shown on each side of a divergence


@dataclass(frozen=True, slots=True)
class CacheExplanation:
    prompt_tokens: int
    cached_tokens: int  # served from the prefix cache
    cause: str  # hit | content | salt | partial_block | no_cached_prefix | caching_off | skipped
    block_size: int
    diverged_at: int | None = None  # content: first position where the cached prefix differs
    window_start: int | None = None  # position of the first id of the two windows below
    cached_token_ids: tuple[int, ...] = ()  # what the cache holds from window_start
    new_token_ids: tuple[int, ...] = ()  # what this prompt has from window_start

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def explain(
    pool: BlockPool,
    block_size: int,
    tokens: Sequence[int],
    hashes: Sequence[bytes],
    salt: str | None,
    num_hit: int,
) -> CacheExplanation:
    """Why ``tokens`` (the prompt; ``hashes`` its full blocks') got ``num_hit`` cached tokens."""
    n = len(tokens)
    base = dict(prompt_tokens=n, cached_tokens=num_hit, block_size=block_size)
    i = num_hit // block_size  # the first block not served
    if i >= (n - 1) // block_size:  # every block a lookup may serve was served
        # the rest is a last block that is not full, or (n a multiple of the block size) the
        # last full block, which holds the last token: computed for its logits
        return CacheExplanation(cause="partial_block" if n % block_size else "hit", **base)
    parent = hashes[i - 1] if i else None
    mine = tuple(tokens[i * block_size : (i + 1) * block_size])
    # a first block shares a prefix with this prompt only if it agrees on its first token
    same_salt = [
        b
        for b in _children(pool, parent)
        if i or (b.token_ids[:1] == mine[:1] and _first_block_of(b, salt))
    ]
    if same_salt:
        best = max(same_salt, key=lambda b: _common(b.token_ids, mine))
        at = i * block_size + _common(best.token_ids, mine)
        lo = max(0, at - WINDOW)
        return CacheExplanation(
            cause="content",
            diverged_at=at,
            window_start=lo,
            cached_token_ids=tuple(tokens[lo:at]) + best.token_ids[at - i * block_size :][:WINDOW],
            new_token_ids=tuple(tokens[lo : at + WINDOW]),
            **base,
        )
    if i == 0 and any(b.token_ids == mine for b in _children(pool, None)):
        return CacheExplanation(cause="salt", **base)
    return CacheExplanation(cause="no_cached_prefix", **base)


def _children(pool: BlockPool, parent: bytes | None) -> list[KVBlock]:
    """Cached blocks that continue the prefix ending in ``parent`` (None: first blocks)."""
    return [b for b in pool.cached.values() if b.parent_hash == parent]


def _first_block_of(block: KVBlock, salt: str | None) -> bool:
    """Whether a cached first block was stored under ``salt``."""
    return hash_block(None, block.token_ids, salt_bytes(salt)) == block.block_hash


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of a and b."""
    k = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        k += 1
    return k


REASONS = {
    "hit": "every whole block the cache may serve was served; the block holding the last "
    "token is computed for its logits",
    "content": "a cached prefix under the same salt differs from this prompt",
    "salt": "this prompt's first block is cached, but under another salt (tenant or cache_salt)",
    "partial_block": "the last {tail} tokens fill no whole block of {block_size} and are "
    "always computed",
    "no_cached_prefix": "nothing cached continues this prompt",
    "caching_off": "prefix caching is off",
    "skipped": "prompt logprobs need every prompt position computed, so the cache is not read",
}


def as_dict(e: CacheExplanation, decode: Callable[[Sequence[int]], str] | None) -> dict:
    """The explanation as clients read it; ``decode`` (a tokenizer's) adds the texts."""
    d = {
        "prompt_tokens": e.prompt_tokens,
        "cached_tokens": e.cached_tokens,
        "computed_tokens": e.computed_tokens,
        "cause": e.cause,
        "reason": REASONS[e.cause].format(
            tail=e.prompt_tokens % e.block_size, block_size=e.block_size
        ),
        "block_size": e.block_size,
    }
    if e.diverged_at is not None:
        d["diverged_at"] = e.diverged_at
        d["window_start"] = e.window_start
        d["cached_token_ids"] = list(e.cached_token_ids)
        d["new_token_ids"] = list(e.new_token_ids)
        if decode is not None:
            d["cached_text"] = decode(e.cached_token_ids)
            d["new_text"] = decode(e.new_token_ids)
    return d


def describe(e: CacheExplanation, decode: Callable[[Sequence[int]], str] | None) -> str:
    """One or two lines for a terminal."""
    d = as_dict(e, decode)
    line = (
        f"prefix cache: {e.cached_tokens} of {e.prompt_tokens} prompt tokens from the cache, "
        f"{e.computed_tokens} computed ({e.cause}: {d['reason']})"
    )
    if e.diverged_at is not None:
        line += f"; diverged at token {e.diverged_at}"
        if decode is not None:
            line += f": cached {d['cached_text']!r} vs new {d['new_text']!r}"
    return line
