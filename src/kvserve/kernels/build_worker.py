"""The child process that compiles the kernels: ``python -m kvserve.kernels.build_worker DIR PID``.

`build.py` starts it as the leader of a new process group, holding the build lock itself. The
worker must not outlive that parent: on Linux it asks the kernel for a SIGTERM when the parent
dies (``PR_SET_PDEATHSIG``), and on SIGTERM it kills every process of its session, ninja and the
compilers with it (ninja runs each compiler in a process group of its own, so killing the
worker's group alone would orphan them; a session survives ``setpgid``). So however the parent ends (SIGTERM, SIGKILL, a crash), no compiler keeps running
and nothing but ninja's finished objects is left for the next start.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1


def _session_members(sid: int) -> list[int]:
    """Pids of the processes in session ``sid`` (Linux /proc; field 6 of stat is the session)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # the command name (field 2) may hold spaces and parentheses: split after its ')'
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        if int(fields[3]) == sid:
            pids.append(int(stat.parent.name))
    return pids


def _kill_own_group(signum: int, frame: object) -> None:
    me = os.getpid()  # the session's leader (start_new_session): its id is our pid
    if Path("/proc/self/stat").exists():
        for pid in _session_members(me):
            if pid != me:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    os.killpg(0, signal.SIGKILL)  # our own group, ourselves last


def _die_with_parent(parent_pid: int) -> None:
    signal.signal(signal.SIGTERM, _kill_own_group)
    signal.signal(signal.SIGINT, _kill_own_group)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before the request above took effect
        _kill_own_group(signal.SIGTERM, None)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: python -m kvserve.kernels.build_worker BUILD_DIR PARENT_PID\n")
        return 2
    build_dir, parent_pid = Path(argv[0]), int(argv[1])
    _die_with_parent(parent_pid)
    from torch.utils import cpp_extension

    from kvserve.kernels.build import EXTENSION_NAME, build_flags, kernel_sources

    cflags, ldflags = build_flags()
    cpp_extension.load(
        name=EXTENSION_NAME,
        sources=kernel_sources(),
        extra_cflags=cflags,
        extra_ldflags=ldflags,
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
