"""A saved prefix cache on disk that cannot be forged, hang the server or leak space
(kv/persist.py, kv/persist_auth.py, server/prefix_cache_dir.py): an HMAC under the directory's
key (an edited file with its checksum recomputed is refused; the key travels with the
directory; no key, no load), no open of a FIFO or a directory at the path, temporary files of
a killed save removed at the next start, and one save at a time."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import make_hf_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

from kvserve.cache_fingerprint import cache_fingerprint
from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.engine.engine import LLMEngine
from kvserve.kv import persist, persist_auth
from kvserve.models.model_session import ModelSession
from kvserve.sampling import SamplingParams
from kvserve.server.prefix_cache_dir import PrefixCacheDir, SaveInProgressError

BS = 4
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]  # 4 full blocks + 1 token
NUM_SAVED = 5  # 17 + 6 tokens, 22 computed: 5 full blocks


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> ModelSession:
    path, _ = make_hf_checkpoint(tmp_path_factory.mktemp("auth"), "llama")
    return ModelSession.open(path, "float32", "cpu")


def make_engine(session: ModelSession) -> LLMEngine:
    return LLMEngine.from_session(
        session,
        CacheConfig(num_blocks=64, block_size=BS),
        SchedulerConfig(max_num_seqs=4),
        enforce_eager=True,
    )


@pytest.fixture(scope="module")
def warm(session: ModelSession) -> tuple[LLMEngine, dict[str, str]]:
    """An engine with NUM_SAVED cached blocks, and its fingerprint."""
    engine = make_engine(session)
    engine.add_request(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    return engine, cache_fingerprint(session, engine.spec, None)


def save(warm, directory: Path) -> persist.PersistReport:
    engine, fingerprint = warm
    report = persist.write(engine.snapshot_prefix_cache(), directory, fingerprint)
    assert report.num_blocks == NUM_SAVED
    return report


def load(session: ModelSession, warm, directory: Path) -> persist.PersistReport:
    fresh = make_engine(session)
    report = fresh.load_prefix_cache(directory, warm[1])
    assert len(fresh.kv_manager.pool.cached) == report.num_blocks
    return report


def read_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}, f.metadata()  # noqa: SIM118


def test_the_key_is_made_0600_beside_the_file_and_travels_with_the_directory(
    session, warm, tmp_path: Path
) -> None:
    save(warm, tmp_path / "a")
    key = tmp_path / "a" / persist_auth.KEY_FILE
    assert key.stat().st_mode & 0o777 == 0o600 and len(bytes.fromhex(key.read_text())) == 32
    first = key.read_text()
    save(warm, tmp_path / "a")  # a second save keeps the key
    assert key.read_text() == first
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # to another machine, key and all
    assert load(session, warm, tmp_path / "b").num_blocks == NUM_SAVED
    (tmp_path / "c").mkdir()  # the file alone: nothing can authenticate it
    shutil.copy(tmp_path / "a" / persist.FILE_NAME, tmp_path / "c")
    got = load(session, warm, tmp_path / "c")
    assert got.num_blocks == 0 and got.refused.startswith(f"no key at {tmp_path / 'c'}")


def test_an_edited_file_with_its_checksum_recomputed_is_refused(
    session, warm, tmp_path: Path
) -> None:
    """The attack a plain sha256 let through: change K/V, recompute the checksum (and a MAC
    under a key of one's own). Only the directory's key makes a file that loads."""
    report = save(warm, tmp_path)
    tensors, meta = read_file(report.path)
    tensors["kv"] = tensors["kv"] + 1.0  # garbage K/V, the same hashes and token ids
    sha = hashlib.sha256()  # version 2's checksum, recomputed as it was
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        sha.update(name.encode() + str(tuple(t.shape)).encode() + str(t.dtype).encode())
        sha.update(t.view(torch.uint8).numpy().tobytes())
    meta["checksum"] = sha.hexdigest()
    forged = dict(meta)
    forged[persist_auth.MAC_FIELD] = persist_auth.mac(b"k" * 32, forged, tensors)
    save_file(tensors, report.path, forged)
    got = load(session, warm, tmp_path)
    assert got.num_blocks == 0
    assert got.refused.startswith("checksum (HMAC-SHA256 under") and "altered" in got.refused
    # the same edit under the directory's own key does load: the MAC is what refused it
    key = persist_auth.read_key(tmp_path)
    meta[persist_auth.MAC_FIELD] = persist_auth.mac(key, meta, tensors)
    save_file(tensors, report.path, meta)
    assert load(session, warm, tmp_path).num_blocks == NUM_SAVED


def test_a_version_2_file_is_refused(session, warm, tmp_path: Path) -> None:
    report = save(warm, tmp_path)
    tensors, meta = read_file(report.path)
    del meta[persist_auth.MAC_FIELD]
    save_file(tensors, report.path, dict(meta, version="2", checksum="0" * 64))
    got = load(session, warm, tmp_path)
    assert got.num_blocks == 0
    assert (
        got.refused
        == "not a kvserve-prefix-cache v3 file (format 'kvserve-prefix-cache', version '2')"
    )


def test_without_its_key_nothing_loads_and_the_next_save_makes_one(
    session, warm, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save(warm, tmp_path)
    (tmp_path / persist_auth.KEY_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger="kvserve.kv.persist"):
        got = load(session, warm, tmp_path)
    assert got.num_blocks == 0 and "to authenticate it with" in got.refused
    assert f"prefix cache {tmp_path / persist.FILE_NAME} refused, nothing loaded: no key at" in (
        caplog.text
    )
    save(warm, tmp_path)
    assert load(session, warm, tmp_path).num_blocks == NUM_SAVED


def test_a_key_open_to_others_is_refused(session, warm, tmp_path: Path) -> None:
    save(warm, tmp_path)
    key = tmp_path / persist_auth.KEY_FILE
    key.chmod(0o644)
    got = load(session, warm, tmp_path)
    assert got.num_blocks == 0 and got.refused.endswith(f"chmod 600 {key}")
    with pytest.raises(persist_auth.KeyFileError, match="mode 0644"):
        save(warm, tmp_path)
    key.chmod(0o600)
    key.write_text("not hex\n")
    assert "does not hold 32 hex bytes" in load(session, warm, tmp_path).refused


@contextlib.contextmanager
def fifo_watchdog(fifo: Path, seconds: float = 5.0) -> Iterator[None]:
    """Bounds a test that might block opening ``fifo``: another process opens its write end
    after ``seconds``, which lets a reader stuck in open() go. (A thread cannot: the reader
    may be stuck in native code that holds the GIL, which is how the whole server froze.)"""
    watchdog = subprocess.Popen(["sh", "-c", f"sleep {seconds}; : > '{fifo}'"])
    try:
        yield
    finally:
        watchdog.kill()
        watchdog.wait()


@pytest.mark.parametrize("where", ["file", "key"])
def test_a_fifo_at_the_path_is_refused_without_blocking(
    session, warm, tmp_path: Path, where: str
) -> None:
    save(warm, tmp_path)
    path = tmp_path / (persist.FILE_NAME if where == "file" else persist_auth.KEY_FILE)
    path.unlink()
    os.mkfifo(path)
    with fifo_watchdog(path):
        start = time.monotonic()
        got = load(session, warm, tmp_path)
        took = time.monotonic() - start
        with pytest.raises(OSError, match="is a FIFO, not a regular file"):
            save(warm, tmp_path)
    assert took < 2.0, f"loading took {took:.1f} s: it blocked on the FIFO"
    assert got.num_blocks == 0
    assert f"{path} is a FIFO, not a regular file: remove it" in got.refused


def test_a_directory_at_the_path_is_refused(session, warm, tmp_path: Path) -> None:
    (tmp_path / persist.FILE_NAME).mkdir()
    got = load(session, warm, tmp_path)
    assert (
        got.refused
        == f"the prefix cache path {tmp_path / persist.FILE_NAME} is a directory, not a regular file: remove it"
    )
    with pytest.raises(OSError, match="is a directory"):
        save(warm, tmp_path)


KILLED_SAVE = """
import os, signal, sys
import safetensors.torch
from kvserve.kv import persist

def save_file(tensors, path, metadata):  # half a file, then the OOM killer
    with open(path, "wb") as f:
        f.write(b"x" * 100_000)
        f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

persist.save_file = save_file
snap = persist.CacheSnapshot([(bytes(32), None, (1, 2))], {"kv": persist.torch.zeros(1, 4)})
persist.write(snap, sys.argv[1], {})
"""


def test_a_killed_save_leaves_a_temp_file_that_the_next_start_removes(
    session, warm, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save(warm, tmp_path)
    env = dict(os.environ, KVSERVE_CACHE_DIR=str(tmp_path / "kvserve-cache"))
    proc = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(tmp_path)], env=env, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    (left,) = tmp_path.glob(".prefix-cache.safetensors.*.tmp")
    assert left.stat().st_size == 100_000
    (tmp_path / "notes.tmp").write_text("not ours")
    engine = make_engine(session)
    with caplog.at_level(logging.WARNING, logger="kvserve.server.prefix_cache_dir"):
        report = PrefixCacheDir(tmp_path, warm[1]).load(engine)
    assert not left.exists() and (tmp_path / "notes.tmp").exists()
    assert f"removed {left} (0.1 MiB), left by a save that never finished" in caplog.text
    assert report.num_blocks == NUM_SAVED  # the last complete file still loads


def test_a_failed_write_removes_its_temp_file(warm, tmp_path: Path, monkeypatch) -> None:
    def torn(tensors, path, metadata):
        Path(path).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(persist, "save_file", torn)
    with pytest.raises(OSError, match="No space left"):
        persist.write(warm[0].snapshot_prefix_cache(), tmp_path, warm[1])
    assert sorted(p.name for p in tmp_path.iterdir()) == [persist_auth.KEY_FILE]


class FakeLoop:
    """What PrefixCacheDir asks of AsyncEngine: ``call`` on the engine, ``loop_stopped``."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.loop_stopped = True

    async def call(self, fn):
        return fn(self.engine)


def test_one_save_at_a_time_and_shutdown_waits_for_it(
    warm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    live, peak, order = [0], [0], []
    release, writing = threading.Event(), threading.Event()
    snapshot, write = LLMEngine.snapshot_prefix_cache, persist.write

    def counting_snapshot(engine):
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        return snapshot(engine)

    def slow_write(snap, directory, fingerprint):
        order.append(threading.current_thread().name)
        writing.set()
        assert release.wait(10)
        try:
            return write(snap, directory, fingerprint)
        finally:
            live[0] -= 1

    monkeypatch.setattr(LLMEngine, "snapshot_prefix_cache", counting_snapshot)
    monkeypatch.setattr(persist, "write", slow_write)
    cache_dir = PrefixCacheDir(tmp_path, warm[1])
    loop = FakeLoop(warm[0])

    async def four_saves():
        return await asyncio.gather(
            *(cache_dir.save(loop) for _ in range(4)), return_exceptions=True
        )

    shutdown = threading.Thread(target=cache_dir.save_at_shutdown, args=(loop,), name="shutdown")

    def release_later() -> None:
        assert writing.wait(10)
        shutdown.start()  # waits on the lock, behind the running save
        time.sleep(0.2)
        assert order == [order[0]] and shutdown.is_alive()
        release.set()

    helper = threading.Thread(target=release_later)
    helper.start()
    results = asyncio.run(four_saves())
    helper.join(10)
    shutdown.join(10)
    assert [type(r).__name__ for r in results] == ["PersistReport"] + ["SaveInProgressError"] * 3
    assert isinstance(results[1], SaveInProgressError) and "already running" in str(results[1])
    assert order[1] == "shutdown" and len(order) == 2 and peak[0] == 1 and live[0] == 0
    assert not cache_dir.save_lock.locked()
