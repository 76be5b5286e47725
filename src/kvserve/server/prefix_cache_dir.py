"""`kvserve serve --prefix-cache-dir DIR`: the prefix cache reloaded at start, saved at shutdown
and on ``POST /save_cache`` (the file format, its key and its checks are kv/persist.py's).

Saving copies the cached blocks on the engine loop thread, between two steps (the pool must
not change meanwhile), and writes the file in a worker thread, so the loop stalls only for
the copy. At shutdown the copy is taken after the loop thread has exited; if it did not exit
in time, nothing is saved (a half-stepped pool is not worth keeping) and a warning says so.

One save at a time: each holds a copy of every cached block until its file is written, so
``save_lock`` is held from before the copy until the file is renamed into place (and released
by the thread that wrote it). A ``/save_cache`` that finds it held raises
``SaveInProgressError`` (a 409) at once; the shutdown save waits for it (up to
``shutdown_wait_s``), then saves the final state.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.engine.engine import LLMEngine
from kvserve.kv import persist
from kvserve.kv.persist import CacheSnapshot, PersistReport
from kvserve.server.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


class SaveInProgressError(RuntimeError):
    """Another save of this prefix cache is running."""


@dataclass(frozen=True, slots=True)
class PrefixCacheDir:
    directory: Path
    fingerprint: dict[str, str]  # cache_fingerprint.py: what a saved file must match
    shutdown_wait_s: float = 60.0  # how long the shutdown save waits for a running save
    # held while a save holds its copy of the cache (threading: the shutdown save runs off the
    # event loop, and a save's write ends on a worker thread)
    save_lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def load(self, engine: LLMEngine) -> PersistReport:
        """At start, before the loop runs: remove what killed saves left, then reload."""
        for tmp, size in persist.remove_stale_temps(self.directory):
            logger.warning(
                "prefix cache: removed %s (%.1f MiB), left by a save that never finished",
                tmp,
                size / 2**20,
            )
        report = engine.load_prefix_cache(self.directory, self.fingerprint)
        if report.refused is not None and report.nbytes == 0:
            logger.info("prefix cache: nothing to reload from %s (%s)", report.path, report.refused)
        return report

    async def save(self, loop: AsyncEngine) -> PersistReport:
        """Copy and write the cache now; raises ``SaveInProgressError`` if a save is running."""
        if not self.save_lock.acquire(blocking=False):
            raise SaveInProgressError(
                f"a save of the prefix cache to {self.directory} is already running; "
                "try again when it has finished"
            )
        try:
            snap = await loop.call(LLMEngine.snapshot_prefix_cache)
        except BaseException:
            self.save_lock.release()
            raise
        # shielded: a cancelled request must not cancel the write before its thread runs (the
        # lock would never be released); the thread releases it, whatever happens
        report = await asyncio.shield(asyncio.to_thread(self._write_and_release, snap))
        logger.info("prefix cache: %d blocks saved to %s", report.num_blocks, report.path)
        return report

    def _write_and_release(self, snap: CacheSnapshot) -> PersistReport:
        try:
            return persist.write(snap, self.directory, self.fingerprint)
        finally:
            self.save_lock.release()

    def save_at_shutdown(self, loop: AsyncEngine) -> None:
        if not loop.loop_stopped:
            logger.warning("prefix cache not saved: the engine loop did not stop in time")
            return
        if not self.save_lock.acquire(timeout=self.shutdown_wait_s):
            logger.warning(
                "prefix cache not saved at shutdown: a /save_cache still runs after %.0f s",
                self.shutdown_wait_s,
            )
            return
        try:
            report = persist.write(
                loop.engine.snapshot_prefix_cache(), self.directory, self.fingerprint
            )
        except OSError as e:
            logger.error("prefix cache not saved at shutdown: %s", e)
            return
        finally:
            self.save_lock.release()
        logger.info(
            "prefix cache: %d blocks (%.1f MiB) saved to %s",
            report.num_blocks,
            report.nbytes / 2**20,
            report.path,
        )
