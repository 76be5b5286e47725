"""The kernel build: keyed by its sources, an OS lock that dies with its holder, a bounded wait,
and a start killed halfway that leaves nothing to block the next one.

The SIGTERM case compiles the real kernels twice in a fresh cache dir (the killed start and the
one after it): a minute or two on 2 cores, kept in CI because a stale lock once hung every
later start with no word.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvserve.kernels import build
from kvserve.kernels.build_lock import build_lock

HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, str(os.getpid()).encode())
print("held", flush=True)
time.sleep(60)
"""


def _hold_lock(path: Path) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_build_key_follows_the_sources_not_their_path(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(build.CSRC, a)
    shutil.copytree(build.CSRC, b)
    assert build.build_key(a) == build.build_key(b) == build.build_key()
    header = next(iter(sorted(b.glob("*.h"))))
    header.write_text(header.read_text() + "\n// changed\n")
    assert build.build_key(b) != build.build_key(a)


def test_cache_dir_is_keyed_and_under_kvserve_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    d = build.cache_dir()
    assert d.parent == tmp_path / "kernels"
    assert d.name.endswith("-" + build.build_key())


def test_waiting_for_a_live_holder_says_who_within_a_second_and_gives_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lock = tmp_path / "k.lock"
    holder = _hold_lock(lock)
    try:
        caplog.set_level(logging.WARNING, logger="kvserve.kernels.build_lock")
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=f"held by pid {holder.pid}"):
            with build_lock(lock, timeout_s=1.5, first_notice_s=0.5):
                pytest.fail("the lock was taken while another process held it")
        assert 1.5 <= time.monotonic() - start < 5
        notices = [r.getMessage() for r in caplog.records]
        assert len(notices) == 1 and f"held by pid {holder.pid}" in notices[0]
        assert str(lock) in notices[0]
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_holder_releases_the_lock(tmp_path: Path) -> None:
    lock = tmp_path / "k.lock"
    holder = _hold_lock(lock)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert lock.exists()  # the file stays; it is not the lock
    with build_lock(lock, timeout_s=2.0) as waited:
        assert waited < 1.0
        assert lock.read_text().strip() == str(os.getpid())


def test_bad_timeout_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="KVSERVE_KERNEL_BUILD_TIMEOUT.*'soon'"):
        build.build_timeout_s()


def _session_pids(sid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "-s", str(sid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine")
def test_a_build_killed_by_sigterm_leaves_nothing_that_stops_the_next_start(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "KVSERVE_CACHE_DIR": str(tmp_path), "KVSERVE_KERNELS": "1"}
    cmd = [sys.executable, "-m", "kvserve.kernels.build"]
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    build_dir = tmp_path / "kernels"
    worker, deadline = None, time.monotonic() + 90
    while time.monotonic() < deadline:  # wait until the compilers run in the worker's session
        found = subprocess.run(
            ["pgrep", "-f", f"kvserve.kernels.build_worker {build_dir}"],
            capture_output=True,
            text=True,
        ).stdout.split()
        if found and len(_session_pids(int(found[0]))) > 2:
            worker = int(found[0])
            break
        time.sleep(0.2)
    assert worker is not None, "the build never started"
    (build_log,) = list(build_dir.glob("*/build.log"))
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=30)
    assert first.returncode == -signal.SIGTERM
    assert b"building kvserve's C++ kernels" in err  # the progress line came first
    deadline = time.monotonic() + 20
    while _session_pids(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _session_pids(worker) == [], "a compiler outlived the killed start"
    assert not (build_log.parent / build.COMPLETE_STAMP).exists()

    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "kvserve kernels: loaded from" in second.stdout
    assert "built kvserve's C++ kernels" in second.stderr
    assert (build_log.parent / build.COMPLETE_STAMP).is_file()
    # the killed compilers' temporary files went to the build dir, cleared by this start
    assert list((build_log.parent / "tmp").iterdir()) == []

    third = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert third.returncode == 0 and "building" not in third.stderr  # loads, no rebuild
