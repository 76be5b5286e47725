"""What makes a saved prefix cache trustworthy on disk (kv/persist.py): its HMAC key, the MAC
over the file's contents, and checks that a path is a regular file before anything opens it.

The key: 32 random bytes, hex, in ``DIR/.hmac-key`` (``KEY_FILE``), created mode 0600 at the
first save and kept beside the cache it signs, so copying the directory with its key (``cp
-a``, ``rsync -a``) to another machine keeps the cache loadable there, and copying the cache
file alone does not. A key readable or writable by group or others is refused, as ssh refuses
such a private key: whoever can read it can forge a file. Without a key a saved file is never
loaded (it cannot be authenticated); the next save writes a new key.

Nothing here opens a FIFO, a device or a directory: ``stat_regular`` checks the path first
(stat does not block where open would, e.g. on a FIFO with no writer), and files are opened
``O_NONBLOCK`` and checked again on the descriptor.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

import torch

KEY_FILE = ".hmac-key"
KEY_BYTES = 32
MAC_FIELD = "hmac_sha256"  # the metadata field that holds the MAC (not itself under the MAC)


class KeyFileError(OSError):
    """The key file exists but is not usable (not a regular file, open to others, malformed)."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return name
    return "special file"


def stat_regular(path: Path, what: str) -> os.stat_result | None:
    """``os.stat(path)`` if it is a regular file, None if nothing is there; raises OSError
    naming what is there otherwise (without opening it: opening a FIFO blocks)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise OSError(f"{what} {path} is a {_kind(st.st_mode)}, not a regular file: remove it")
    return st


def key_path(directory: Path) -> Path:
    return Path(directory) / KEY_FILE


def read_key(directory: Path) -> bytes | None:
    """The directory's HMAC key; None when there is none. Raises ``KeyFileError`` for a key
    file that is not a regular file, is open to group or others, or does not hold the key."""
    path = key_path(directory)
    try:
        if stat_regular(path, "the prefix cache's key") is None:
            return None
    except OSError as e:
        raise KeyFileError(str(e)) from e
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)  # the file opened, which a rename may have swapped since the stat
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"the prefix cache's key {path} is not a regular file")
        if st.st_mode & 0o077:
            raise KeyFileError(
                f"the prefix cache's key {path} has mode {stat.S_IMODE(st.st_mode):04o}: "
                f"group or others may read or change it; chmod 600 {path}"
            )
        text = f.read(4 * KEY_BYTES).decode("ascii", errors="replace").strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise KeyFileError(f"the prefix cache's key {path} does not hold {KEY_BYTES} hex bytes")
    return key


def load_or_create_key(directory: Path) -> bytes:
    """The directory's key, written now (mode 0600) if it has none."""
    key = read_key(directory)
    if key is not None:
        return key
    key = secrets.token_bytes(KEY_BYTES)
    path = key_path(directory)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another writer made one first: use theirs
        key = read_key(directory)
        assert key is not None, "the key file was there a moment ago"
        return key
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
        f.flush()
        os.fsync(f.fileno())
    return key


def mac(key: bytes, metadata: Mapping[str, str], tensors: Mapping[str, torch.Tensor]) -> str:
    """HMAC-SHA256 of every metadata field but ``MAC_FIELD`` and of every tensor (name, dtype,
    shape and bytes), each part length-prefixed so that no two different files hash the same
    input. The bytes are read in place (no copy of the cache)."""
    h = hmac.new(key, digestmod=hashlib.sha256)

    def put(data: bytes | memoryview) -> None:
        view = memoryview(data)
        h.update(view.nbytes.to_bytes(8, "little"))
        h.update(view)

    for name in sorted(metadata):
        if name != MAC_FIELD:
            put(name.encode())
            put(metadata[name].encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        put(name.encode())
        put(f"{t.dtype} {tuple(t.shape)}".encode())
        put(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def macs_equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())
