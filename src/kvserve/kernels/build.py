"""Build (or load from cache) kvserve's C++ CPU kernels: one shared library, many ops.

Every `csrc/*.cpp` is compiled into one library, `kvserve_kernels`, with
`torch.utils.cpp_extension.load` (ninja). Each source registers its ops into the `kvserve`
namespace with `TORCH_LIBRARY_FRAGMENT(kvserve, m)` plus its CPU and Meta impls, so after a
successful load they are `torch.ops.kvserve.<name>`. Adding a kernel = adding a .cpp file.

The build lands in `$KVSERVE_CACHE_DIR/kernels/<torch version>` (default
`~/.cache/kvserve/kernels/<torch version>`); ninja only recompiles what changed.
`KVSERVE_KERNELS=0` turns the kernels off. Either way, a failure to build is never fatal: one
warning line says why and callers use the pure-PyTorch reference of each op instead.

    python -m kvserve.kernels.build    # build now; print what loaded and the CPU's ISA paths
"""

from __future__ import annotations

import functools
import glob
import logging
import os
import sys
from pathlib import Path

import torch

from kvserve.kernels.fake_ops import register_fakes

logger = logging.getLogger(__name__)

EXTENSION_NAME = "kvserve_kernels"
# kvserve::cpu_isa() return values -> names (the same ids the ops' `isa` argument takes).
ISA_NAMES = {0: "scalar", 1: "avx2+fma", 2: "avx512 (f,bw,vl,dq)"}


def kernel_sources() -> list[str]:
    """The C++ sources of the extension, sorted so the build is reproducible."""
    return sorted(glob.glob(str(Path(__file__).parent / "csrc" / "*.cpp")))


def cache_dir() -> Path:
    """Where the compiled library lives: one folder per torch version (ABI)."""
    root = os.environ.get("KVSERVE_CACHE_DIR") or str(Path.home() / ".cache" / "kvserve")
    return Path(root) / "kernels" / torch.__version__


def kernels_enabled() -> bool:
    """False when the environment sets KVSERVE_KERNELS=0 (or false/no/off)."""
    return os.environ.get("KVSERVE_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def build_kernels(verbose: bool = False) -> None:
    """Compile (if stale) and load the extension into this process; raises on any failure.

    Not memoized: call `load_kernels()` instead unless you want the exception (tests do, so a
    broken build is a failure with its compiler output, not a silent skip).
    """
    from torch.utils import cpp_extension

    sources = kernel_sources()
    if not sources:
        raise FileNotFoundError(f"no C++ sources in {Path(__file__).parent / 'csrc'}")
    build_dir = cache_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    cflags = ["-O3", "-fno-math-errno"]  # torch picks the -std
    ldflags: list[str] = []
    # at::parallel_for is header-only: without -fopenmp it silently runs on one thread. The
    # library then links libgomp.so.1, which resolves to the copy torch has already loaded.
    if torch._C.has_openmp and sys.platform.startswith("linux"):
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    cpp_extension.load(
        name=EXTENSION_NAME,
        sources=sources,
        extra_cflags=cflags,
        extra_ldflags=ldflags,
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=verbose,
    )


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
