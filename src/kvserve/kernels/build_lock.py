"""The kernel build's lock: an OS file lock (``fcntl.flock``) that dies with its holder.

A lock *file* whose existence is the lock (torch's ``FileBaton``) outlives a process killed by
SIGTERM or SIGKILL and then hangs every later start. ``flock`` is released by the kernel when
the holder's file descriptor closes, however the holder ended, so a dead builder never blocks
anyone. The file itself stays (it is only the inode we lock) and holds the holder's pid, so a
waiting process can say whom it waits for.

Waiting is bounded: a process that waits longer than ``timeout_s`` raises ``TimeoutError``
(the caller then runs the PyTorch reference) instead of sleeping for ever, and it says within
``first_notice_s`` that it is waiting, naming the lock and the holder's pid.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

POLL_S = 0.25
NOTICE_EVERY_S = 30.0


def _holder_pid(lock_file: Path) -> str:
    try:
        text = lock_file.read_text().strip()
    except OSError:
        return "unknown"
    return text or "unknown"


@contextmanager
def build_lock(lock_file: Path, timeout_s: float, first_notice_s: float = 1.0) -> Iterator[float]:
    """Hold an exclusive ``flock`` on ``lock_file`` for the ``with`` body; yields the seconds
    spent waiting for it. Raises ``TimeoutError`` after ``timeout_s`` seconds of waiting."""
    if timeout_s <= 0:
        raise ValueError(f"kernel build lock timeout must be > 0 seconds, got {timeout_s}")
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start = time.monotonic()
        next_notice = start + first_notice_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            now = time.monotonic()
            if now - start >= timeout_s:
                raise TimeoutError(
                    f"waited {now - start:.0f} s for the kvserve kernel build lock {lock_file} "
                    f"(held by pid {_holder_pid(lock_file)}); KVSERVE_KERNEL_BUILD_TIMEOUT "
                    "sets the bound"
                )
            if now >= next_notice:
                logger.warning(
                    "waiting for another process's kvserve kernel build (lock %s, held by pid "
                    "%s; %.0f s so far, giving up after %.0f s)",
                    lock_file,
                    _holder_pid(lock_file),
                    now - start,
                    timeout_s,
                )
                next_notice = now + NOTICE_EVERY_S
            time.sleep(POLL_S)
        waited = time.monotonic() - start
        # the pid is for the messages of processes that wait; the lock is the flock alone
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield waited
    finally:
        os.close(fd)  # releases the flock (so does the holder's death)
