"""`kvserve serve --prefix-cache-dir DIR`: the prefix cache reloaded at start, saved at shutdown
and on ``POST /save_cache`` (the file format and its checks are kv/persist.py's).

Saving copies the cached blocks on the engine loop thread, between two steps (the pool must
not change meanwhile), and writes the file in a worker thread, so the loop stalls only for
the copy. At shutdown the copy is taken after the loop thread has exited; if it did not exit
in time, nothing is saved (a half-stepped pool is not worth keeping) and a warning says so.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from kvserve.engine.engine import LLMEngine
from kvserve.kv import persist
from kvserve.kv.persist import PersistReport
from kvserve.server.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefixCacheDir:
    directory: Path
    fingerprint: dict[str, str]  # cache_fingerprint.py: what a saved file must match

    def load(self, engine: LLMEngine) -> PersistReport:
        """At start, before the loop runs."""
        report = engine.load_prefix_cache(self.directory, self.fingerprint)
        if report.refused is not None and report.nbytes == 0:
            logger.info("prefix cache: nothing to reload from %s (%s)", report.path, report.refused)
        return report

    async def save(self, loop: AsyncEngine) -> PersistReport:
        snap = await loop.call(LLMEngine.snapshot_prefix_cache)
        report = await asyncio.to_thread(persist.write, snap, self.directory, self.fingerprint)
        logger.info("prefix cache: %d blocks saved to %s", report.num_blocks, report.path)
        return report

    def save_at_shutdown(self, loop: AsyncEngine) -> None:
        if not loop.loop_stopped:
            logger.warning("prefix cache not saved: the engine loop did not stop in time")
            return
        report = persist.write(
            loop.engine.snapshot_prefix_cache(), self.directory, self.fingerprint
        )
        logger.info(
            "prefix cache: %d blocks (%.1f MiB) saved to %s",
            report.num_blocks,
            report.nbytes / 2**20,
            report.path,
        )
