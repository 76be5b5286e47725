"""Chained block hashes for prefix caching.

A full block's hash covers everything before it: ``sha256(parent hash, token ids, extra
keys)``. Two requests share a block only if they agree on every token up to its end (and on
the extra keys). sha256, not Python's ``hash()``: collisions must be infeasible and not
predictable by clients, since a collision would hand one tenant another's K/V. Hits are also
checked token by token in ``BlockPool.get_cached_block``.

Extra keys: a ``cache_salt`` is hashed into the first block only; because every later hash
chains from it, requests with different salts never share any block.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_ROOT = b"kvserve-prefix-cache-v1"


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: bytes = b"") -> bytes:
    h = hashlib.sha256()
    h.update(parent if parent is not None else HASH_ROOT)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(struct.pack("<q", len(extra_keys)))
    h.update(extra_keys)
    return h.digest()


def salt_bytes(cache_salt: str | None) -> bytes:
    """The extra key a salt puts in a first block's hash (empty: no salt)."""
    # surrogatepass: any Python str is a valid salt, even one no UTF-8 text could carry
    return cache_salt.encode("utf-8", "surrogatepass") if cache_salt else b""


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    start: list[bytes] | None = None,
) -> list[bytes]:
    """Hashes of every full block of ``token_ids``; extends ``start`` (hashes already known)."""
    hashes = list(start or [])
    salt = salt_bytes(cache_salt)
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        chunk = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block(parent, chunk, salt if i == 0 else b""))
    return hashes
