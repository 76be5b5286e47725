"""Measured row thresholds of the quantized matmuls, kept on disk between starts.

Which path multiplies a quantized weight at a given row count (the float32 kernel, the bf16
kernel, its AMX tiles, or dequantize + matmul) is measured at load, per distinct (format,
shape): for the default model that is 7 weights x up to 12 row counts x 3-4 paths, about
20 s of a ~35 s start. The answer depends only on the machine, the thread count, torch and
the kernels, so it is stored under a key made of all of those and read back by the next start
on the same machine (``$KVSERVE_CACHE_DIR``, default ``~/.cache/kvserve``, file
``row-thresholds.json``). ``KVSERVE_REMEASURE=1`` measures again and overwrites.

The file is a cache, never a source of truth: a missing, unreadable or foreign file is
measured over; writes go to a temporary file and are renamed into place, so concurrent
starts (a test suite's servers) never read half a file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from kvserve.kernels.build import kernel_sources
from kvserve.platform import CpuFeatures

logger = logging.getLogger(__name__)

REMEASURE_ENV = "KVSERVE_REMEASURE"
FILE_NAME = "row-thresholds.json"
# 2: a loss of the float32 kernel to the bf16 one is confirmed before it is stored (entries
# measured by version 1 may hold a noisy loss at 1 row); 3: on AMX CPUs the bf16 range is all
# AMX tiles (entries of version 2 may hand 9-15 rows to the VDPBF16PS tiles); 4: a loss of the
# bf16 kernel to dequantize + matmul is confirmed too (version 3 may end its range early)
FORMAT_VERSION = 4

Thresholds = tuple[int, int, int]  # (kernel_max_rows, bf16_kernel_max_rows, amx_min_rows)


def default_path() -> Path:
    root = os.environ.get("KVSERVE_CACHE_DIR") or str(Path.home() / ".cache" / "kvserve")
    return Path(root) / FILE_NAME


def remeasure_requested() -> bool:
    return os.environ.get(REMEASURE_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def kernels_digest() -> str:
    """Hash of the C++ sources and headers: a changed kernel is measured again."""
    h = hashlib.sha256()
    csrc = Path(kernel_sources()[0]).parent if kernel_sources() else None
    if csrc is not None:
        for f in sorted([*csrc.glob("*.cpp"), *csrc.glob("*.h")]):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def machine_key(features: CpuFeatures, threads: int) -> str:
    """Everything a measurement depends on besides the weight: CPU (model and the features
    kvserve sees, a KVSERVE_CPU_FEATURES cap included), threads, torch, kernels."""
    parts = {
        "features": dataclasses.asdict(features),
        "threads": threads,
        "torch": torch.__version__,
        "kernels": kernels_digest(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


class RowThresholdCache:
    """``get``/``put`` measured thresholds by (machine key, measurement arguments).

    ``path=None`` keeps nothing (every lookup misses): what ``KVSERVE_REMEASURE=1`` and
    callers that must measure get. With ``remeasure`` lookups miss but results are stored.
    """

    def __init__(self, path: Path | None, machine: str, remeasure: bool = False) -> None:
        self.path = path
        self.machine = machine
        self.remeasure = remeasure
        self.hits = 0
        self._entries = self._read() if path is not None and not remeasure else {}

    @classmethod
    def default(cls, features: CpuFeatures) -> RowThresholdCache:
        machine = machine_key(features, torch.get_num_threads())
        return cls(default_path(), machine, remeasure_requested())

    def _read(self) -> dict[str, list[int]]:
        assert self.path is not None
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            logger.info("row thresholds: ignoring %s (%s); measuring", self.path, e)
            return {}
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            return {}
        entries = data.get("entries")
        return entries if isinstance(entries, dict) else {}

    def key(self, **args: object) -> str:
        return json.dumps({"machine": self.machine, **args}, sort_keys=True)

    def get(self, key: str) -> Thresholds | None:
        value = self._entries.get(key)
        if (
            not isinstance(value, list)
            or len(value) != 3
            or not all(isinstance(v, int) and v >= 0 for v in value)
        ):
            return None
        self.hits += 1
        return (value[0], value[1], value[2])

    def put(self, key: str, value: Thresholds) -> None:
        self._entries[key] = list(value)
        if self.path is None:
            return
        try:
            # merge with what another process may have written since we read
            on_disk = self._read()
            on_disk.update(self._entries)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".row-thresholds-")
            with os.fdopen(fd, "w") as f:
                json.dump({"version": FORMAT_VERSION, "entries": on_disk}, f)
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only home: measure every start, say so once
            logger.info("row thresholds: could not write %s (%s)", self.path, e)
            self.path = None
