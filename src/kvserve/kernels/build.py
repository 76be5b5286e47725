"""Build (or load from cache) kvserve's C++ CPU kernels: one shared library, many ops.

Every `csrc/*.cpp` is compiled into one library, `kvserve_kernels`, with
`torch.utils.cpp_extension.load` (ninja). Each source registers its ops into the `kvserve`
namespace with `TORCH_LIBRARY_FRAGMENT(kvserve, m)` plus its CPU and Meta impls, so after a
successful load they are `torch.ops.kvserve.<name>`. Adding a kernel = adding a .cpp file.

The build lands in `$KVSERVE_CACHE_DIR/kernels/<torch version>-<key>` (default
`~/.cache/kvserve/...`), where the key hashes the kernel sources (`.cpp` and `.h`), the
compile flags, the compiler's name and the torch version: two checkouts with the same sources
share one build, different sources never rebuild each other's. A finished build leaves a
`complete` stamp, and later starts load the library directly (no ninja run, no lock).

Building is done once, by one process at a time: the builder holds an OS file lock
(`build_lock.py`) that dies with it, and compiles in a child process group that dies with it
too (the child asks the kernel for a signal when its parent dies and then kills its group), so a
start killed halfway (SIGTERM, SIGKILL, Ctrl-C) leaves no lock and no compiler behind; ninja
picks up what finished. A process that finds another one building says so within a second and
waits at most `KVSERVE_KERNEL_BUILD_TIMEOUT` seconds. `KVSERVE_KERNELS=0` turns the kernels
off. Either way, a failure to build is never fatal: one warning line says why and callers use
the pure-PyTorch reference of each op instead.

    python -m kvserve.kernels.build    # build now; print what loaded and the CPU's ISA paths
"""

from __future__ import annotations

import functools
import glob
import hashlib
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvserve.kernels.build_lock import build_lock
from kvserve.kernels.fake_ops import register_fakes

logger = logging.getLogger(__name__)

EXTENSION_NAME = "kvserve_kernels"
# kvserve::cpu_isa() return values -> names (the same ids the ops' `isa` argument takes).
ISA_NAMES = {0: "scalar", 1: "avx2+fma", 2: "avx512 (f,bw,vl,dq)"}
TIMEOUT_ENV = "KVSERVE_KERNEL_BUILD_TIMEOUT"
DEFAULT_TIMEOUT_S = 1200.0  # a cold build takes 1-3 minutes on 2 cores; 20 is far past it
COMPLETE_STAMP = "complete"
BUILD_LOG = "build.log"
PROGRESS_EVERY_S = 30.0
# measured: 15 sources in ~70 s on 2 cores of a Sapphire Rapids and ~80 s on a Zen 4 (-O3)
_SECONDS_PER_SOURCE_CORE = 10.0


CSRC = Path(__file__).parent / "csrc"


def kernel_sources() -> list[str]:
    """The C++ sources of the extension, sorted so the build is reproducible."""
    return sorted(glob.glob(str(CSRC / "*.cpp")))


def build_flags() -> tuple[list[str], list[str]]:
    """(cflags, ldflags) of the build; part of its key."""
    cflags = ["-O3", "-fno-math-errno"]  # torch picks the -std
    ldflags: list[str] = []
    # at::parallel_for is header-only: without -fopenmp it silently runs on one thread. The
    # library then links libgomp.so.1, which resolves to the copy torch has already loaded.
    if torch._C.has_openmp and sys.platform.startswith("linux"):
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    return cflags, ldflags


def build_key(csrc: Path = CSRC) -> str:
    """A hash of everything the library depends on: sources and headers (by name and content),
    flags, the compiler's name and torch's version (the ABI). Not their paths: two checkouts
    of the same sources share one build."""
    h = hashlib.sha256()
    for f in sorted([*csrc.glob("*.cpp"), *csrc.glob("*.h")]):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    cflags, ldflags = build_flags()
    h.update(repr((cflags, ldflags, os.environ.get("CXX", "c++"), torch.__version__)).encode())
    return h.hexdigest()[:16]


def kvserve_cache_root() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve")


def cache_dir() -> Path:
    """Where the compiled library lives: one folder per torch version and source hash."""
    return kvserve_cache_root() / "kernels" / f"{torch.__version__}-{build_key()}"


def kernels_enabled() -> bool:
    """False when the environment sets KVSERVE_KERNELS=0 (or false/no/off)."""
    return os.environ.get("KVSERVE_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def build_timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds > 0, got {raw!r}")
    return value


def estimated_build_minutes() -> int:
    cores = max(1, min(os.cpu_count() or 1, len(kernel_sources())))
    return max(1, math.ceil(len(kernel_sources()) * _SECONDS_PER_SOURCE_CORE / cores / 60))


def _library(build_dir: Path) -> Path:
    return build_dir / f"{EXTENSION_NAME}.so"


def _complete(build_dir: Path) -> bool:
    return (build_dir / COMPLETE_STAMP).is_file() and _library(build_dir).is_file()


def build_kernels(verbose: bool = False) -> None:
    """Compile (unless a complete build of these sources exists) and load the extension into
    this process; raises on any failure.

    Not memoized: call `load_kernels()` instead unless you want the exception (tests do, so a
    broken build is a failure with its compiler output, not a silent skip).
    """
    if not kernel_sources():
        raise FileNotFoundError(f"no C++ sources in {CSRC}")
    build_dir = cache_dir()
    if not _complete(build_dir):
        timeout_s = build_timeout_s()
        with build_lock(build_dir.parent / f"{build_dir.name}.lock", timeout_s):
            if not _complete(build_dir):  # another process may have built it while we waited
                _compile(build_dir, timeout_s, verbose)
    torch.ops.load_library(str(_library(build_dir)))


def _compile(build_dir: Path, timeout_s: float, verbose: bool) -> None:
    """Run the build in a child session (the caller holds the build lock)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    # torch's own lock file, left by a build killed before it could remove it; we hold the
    # flock, so no kvserve process is building here now
    (build_dir / "lock").unlink(missing_ok=True)
    # the compilers' temporary files: a killed gcc leaves its .s files behind, here rather
    # than in /tmp, and this start clears what an earlier killed one left
    tmp = build_dir / "tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    logger.warning(
        "building kvserve's C++ kernels in %s: about %d minute(s) on this machine, once "
        "(later starts load them in a second)",
        build_dir,
        estimated_build_minutes(),
    )
    start = time.monotonic()
    log_path = build_dir / BUILD_LOG
    with open(log_path, "wb") as log:
        child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvserve.kernels.build_worker",
                str(build_dir),
                str(os.getpid()),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # build.log as it happens; compiler temporaries in the build dir
            env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp)},
            start_new_session=True,  # its own session: killed as one (ninja, compilers)
        )
        try:
            while True:
                try:
                    rc = child.wait(timeout=PROGRESS_EVERY_S)
                    break
                except subprocess.TimeoutExpired:
                    elapsed = time.monotonic() - start
                    if elapsed >= timeout_s:
                        raise TimeoutError(
                            f"the kernel build ran {elapsed:.0f} s ({TIMEOUT_ENV} sets the "
                            f"bound); its log: {log_path}"
                        ) from None
                    logger.warning("still building kvserve's C++ kernels (%.0f s)", elapsed)
        except BaseException:
            # Ctrl-C, a timeout, a SIGTERM turned into an exception: no compiler outlives us
            _kill_group(child)
            raise
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"kernel build failed (exit {rc}; log {log_path}): {tail}")
    if verbose:
        sys.stderr.write(log_path.read_text(errors="replace"))
    stamp = build_dir / COMPLETE_STAMP
    partial = stamp.with_name(f"{COMPLETE_STAMP}.{os.getpid()}.tmp")
    partial.write_text(f"built in {time.monotonic() - start:.1f} s by pid {os.getpid()}\n")
    os.replace(partial, stamp)  # atomic: a reader sees no stamp or a whole one
    logger.warning("built kvserve's C++ kernels in %.0f s", time.monotonic() - start)


def _kill_group(child: subprocess.Popen) -> None:
    """Stop the worker and everything it started: SIGTERM makes it kill its whole session
    (ninja puts each compiler in a process group of its own, so the worker's group alone would
    orphan them); SIGKILL for the group if it does not end in 10 s."""
    try:
        os.kill(child.pid, signal.SIGTERM)
        child.wait(timeout=10)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    child.wait()


@functools.cache
def _load(enabled: bool) -> bool:
    # Memoized per process and per setting, so each outcome is logged once.
    if not enabled:
        logger.info("kvserve C++ kernels disabled (KVSERVE_KERNELS=0); using the PyTorch reference")
        return False
    try:
        build_kernels()
        register_fakes()
    except Exception as e:  # noqa: BLE001 - any build/load failure means "use the reference"
        reason = " ".join(str(e).split())[-300:]  # one line: compiler output can be long
        logger.warning(
            "kvserve C++ kernels unavailable (%s: %s); using the PyTorch reference",
            type(e).__name__,
            reason,
        )
        return False
    return True


def load_kernels() -> bool:
    """Build/load the extension once per process; True when `torch.ops.kvserve.*` are usable.

    Reads KVSERVE_KERNELS on every call (cheap), so a test can turn the kernels off with
    monkeypatch even after they were loaded; the ops stay registered, callers just stop
    choosing them.
    """
    return _load(kernels_enabled())


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ok = load_kernels()
    if not ok:
        print("kvserve kernels: NOT loaded (the PyTorch reference will be used)")
        return 0 if not kernels_enabled() else 1
    best = int(torch.ops.kvserve.cpu_isa())
    paths = ", ".join(ISA_NAMES[i] for i in range(best + 1))
    print(f"kvserve kernels: loaded from {cache_dir()}")
    print(f"CPU ISA paths: {paths} (best: {ISA_NAMES[best]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
