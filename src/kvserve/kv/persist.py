"""A prefix cache that outlives the process (llama.cpp's --slot-save-path, LMCache's disk tier).

``snapshot`` copies the indexed blocks (hash, parent hash, token ids and their K/V as the
storage holds them) on the engine's thread; ``write`` puts them in one safetensors file,
atomically (a temporary file, fsync, rename), with the engine's fingerprint and an HMAC-SHA256
of every metadata field and tensor byte in its metadata, under the key kept beside the file
(``DIR/.hmac-key``, made at the first save: kv/persist_auth.py). ``load`` puts them back into a
fresh pool's free blocks (evictable, in the order they would have been evicted) only if all of
this holds, else it refuses the whole file and says why:

- the path is a regular file (a FIFO, a device or a directory is refused unopened);
- the file reads and is this format and version (version 2 files, whose plain sha256 anyone
  could recompute after an edit, are refused);
- its fingerprint equals the engine's (model weights, dtypes, block size, tokenizer, hash
  scheme: ``cache_fingerprint.py``), so the K/V are exactly what this engine would compute;
- the directory's key exists and the file's MAC under it matches: a torn file, or one edited
  by anyone who cannot read the key, never loads (whoever can write the key can forge);
- every block that has a parent hashes to its own hash (``hash_block(parent, tokens)``).

A save interrupted by a kill leaves its temporary file (``.prefix-cache.safetensors.*.tmp``);
``remove_stale_temps`` deletes those at the next start. The directory is one server's.

Tenants stay apart across a restart for the same reason they do in memory: a first block's
hash carries its salt and every later hash chains from it; hits still compare token ids.
Only blocks reachable from a first block are loaded (others could never be hit), the most
recently used first when the pool is smaller than the file.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvserve.kv import persist_auth
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.prefix_cache import hash_block
from kvserve.kv.storage import KVCacheStorage

logger = logging.getLogger(__name__)

FORMAT = "kvserve-prefix-cache"
# 2: blocks as named storage tensors (codes and scales); 3: an HMAC-SHA256 under the
# directory's key instead of a plain sha256
FORMAT_VERSION = 3
FILE_NAME = "prefix-cache.safetensors"
TEMP_GLOB = f".{FILE_NAME}.*.tmp"  # write's temporary files
HASH_BYTES = 32  # sha256

Entry = tuple[bytes, bytes | None, tuple[int, ...]]  # (hash, parent hash, token ids)


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    entries: list[Entry]  # eviction order: the first would be evicted first
    blocks: dict[str, torch.Tensor]  # KVCacheStorage.read_blocks of those blocks, in order


@dataclass(frozen=True, slots=True)
class PersistReport:
    path: Path
    num_blocks: int  # saved, or loaded
    nbytes: int  # of the file
    refused: str | None = None  # why nothing was loaded (None: it was)


def snapshot(pool: BlockPool, storage: KVCacheStorage) -> CacheSnapshot:
    """Copy every indexed block (on the engine's thread: the pool must not change meanwhile)."""
    blocks = pool.cached_in_eviction_order()
    entries = [(b.block_hash, b.parent_hash, b.token_ids) for b in blocks]
    return CacheSnapshot(entries, storage.read_blocks([b.block_id for b in blocks]))  # type: ignore[arg-type]


def write(snap: CacheSnapshot, directory: Path, fingerprint: Mapping[str, str]) -> PersistReport:
    """Save ``snap`` as ``DIR/prefix-cache.safetensors`` (none when it is empty). Raises OSError
    when something that is not a regular file is at the path, or the key is unusable."""
    path = Path(directory) / FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    persist_auth.stat_regular(path, "the prefix cache path")
    n = len(snap.entries)
    if n == 0:
        path.unlink(missing_ok=True)  # nothing cached now: an older file would not be the truth
        return PersistReport(path, 0, 0)
    key = persist_auth.load_or_create_key(path.parent)
    block_size = len(snap.entries[0][2])
    tensors = dict(snap.blocks)
    tensors["block_hashes"] = _hash_rows([e[0] for e in snap.entries])
    tensors["parent_hashes"] = _hash_rows([e[1] or bytes(HASH_BYTES) for e in snap.entries])
    tensors["has_parent"] = torch.tensor([e[1] is not None for e in snap.entries])
    tensors["token_ids"] = torch.tensor([list(e[2]) for e in snap.entries], dtype=torch.long)
    assert tensors["token_ids"].shape == (n, block_size)
    metadata = {
        "format": FORMAT,
        "version": str(FORMAT_VERSION),
        "fingerprint": json.dumps(dict(fingerprint), sort_keys=True),
    }
    metadata[persist_auth.MAC_FIELD] = persist_auth.mac(key, metadata, tensors)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")  # TEMP_GLOB
    try:
        save_file(tensors, tmp, metadata)  # writes from the tensors' memory: no copy
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)  # a crash leaves the old file or the new one, never half of one
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return PersistReport(path, n, path.stat().st_size)


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temps(directory: Path) -> list[tuple[Path, int]]:
    """Delete the temporary files of saves that never finished (killed mid-write); returns
    each one's path and size. Call it before any save of this process can run."""
    removed = []
    for tmp in sorted(Path(directory).glob(TEMP_GLOB)):
        try:
            st = tmp.lstat()
            if not S_ISREG(st.st_mode):
                continue
            tmp.unlink()
        except FileNotFoundError:
            continue
        removed.append((tmp, st.st_size))
    return removed


def _hash_rows(hashes: list[bytes]) -> torch.Tensor:
    assert all(len(h) == HASH_BYTES for h in hashes)
    return torch.frombuffer(bytearray(b"".join(hashes)), dtype=torch.uint8).view(-1, HASH_BYTES)


class Refused(Exception):
    pass


def load(
    pool: BlockPool, storage: KVCacheStorage, directory: Path, fingerprint: Mapping[str, str]
) -> PersistReport:
    """Restore a saved prefix cache into ``pool``'s free blocks; never raises for a bad file
    (the report says why it was refused, and a warning is logged)."""
    path = Path(directory) / FILE_NAME
    try:
        st = persist_auth.stat_regular(path, "the prefix cache path")
        if st is None:
            return PersistReport(path, 0, 0, "no saved prefix cache")
        key = persist_auth.read_key(path.parent)
    except OSError as e:
        logger.warning("prefix cache %s refused, nothing loaded: %s", path, e)
        return PersistReport(path, 0, 0, str(e))
    size = st.st_size
    try:
        if key is None:
            raise Refused(
                f"no key at {persist_auth.key_path(path.parent)} to authenticate it with (the "
                "first save writes it beside the file; copy it along with the cache)"
            )
        entries, blocks = _read(path, fingerprint, key)
        entries, blocks = _fit(entries, blocks, pool.num_free_blocks)
        restored = pool.restore(entries)
        try:
            storage.write_blocks([b.block_id for b in restored], blocks)
        except ValueError:
            pool.uncache(restored)  # indexed but never filled: they must not be hits
            raise
    except (Refused, ValueError) as e:
        logger.warning("prefix cache %s refused, nothing loaded: %s", path, e)
        return PersistReport(path, 0, size, str(e))
    logger.info("prefix cache: %d blocks loaded from %s", len(entries), path)
    return PersistReport(path, len(entries), size)


def _read(
    path: Path, fingerprint: Mapping[str, str], key: bytes
) -> tuple[list[Entry], dict[str, torch.Tensor]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT or meta.get("version") != str(FORMAT_VERSION):
                raise Refused(
                    f"not a {FORMAT} v{FORMAT_VERSION} file (format {meta.get('format')!r}, "
                    f"version {meta.get('version')!r})"
                )
            saved = json.loads(meta.get("fingerprint", "{}"))
            if saved != dict(fingerprint):
                differ = sorted(
                    k for k in {*saved, *fingerprint} if saved.get(k) != fingerprint.get(k)
                )
                raise Refused(f"saved by another engine: {', '.join(differ)} differ")
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open
    except Refused:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors raises its own errors for torn files
        raise Refused(f"unreadable ({type(e).__name__}: {e})") from e
    if not persist_auth.macs_equal(
        persist_auth.mac(key, meta, tensors), meta.get(persist_auth.MAC_FIELD, "")
    ):
        raise Refused(
            f"checksum (HMAC-SHA256 under {persist_auth.key_path(path.parent)}) mismatch: the "
            "file is torn, was altered, or was saved under another key"
        )
    try:
        hashes = [bytes(r) for r in tensors.pop("block_hashes").tolist()]
        parents = [bytes(r) for r in tensors.pop("parent_hashes").tolist()]
        has_parent = tensors.pop("has_parent").tolist()
        tokens = [tuple(r) for r in tensors.pop("token_ids").tolist()]
    except KeyError as e:
        raise Refused(f"the tensor {e} is missing") from e
    entries: list[Entry] = [
        (h, p if has else None, t)
        for h, p, has, t in zip(hashes, parents, has_parent, tokens, strict=True)
    ]
    for h, parent, t in entries:
        if parent is not None and hash_block(parent, t) != h:
            raise Refused("a block's hash does not match its parent and tokens")
    return entries, tensors


def _fit(
    entries: list[Entry], blocks: dict[str, torch.Tensor], room: int
) -> tuple[list[Entry], dict[str, torch.Tensor]]:
    """The most recently used entries that fit in ``room`` blocks and are reachable from a
    first block, in their saved order, and their K/V."""
    start = max(0, len(entries) - room)
    by_hash = {e[0]: e for e in entries[start:]}
    reachable: dict[bytes, bool] = {}

    def ok(h: bytes) -> bool:
        chain = []
        while h not in reachable:  # iterative: chains are as long as the longest prompt
            entry = by_hash.get(h)
            if entry is None:
                reachable[h] = False
                break
            chain.append(h)
            if entry[1] is None:
                reachable[h] = True
                chain.pop()
                break
            h = entry[1]
        result = reachable[h]
        for c in chain:
            reachable[c] = result
        return result

    keep = [i for i in range(start, len(entries)) if ok(entries[i][0])]
    index = torch.tensor(keep, dtype=torch.long)
    kept_blocks = {name: t.index_select(0, index) for name, t in blocks.items()}
    return [entries[i] for i in keep], kept_blocks
