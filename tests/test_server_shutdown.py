"""SIGTERM and SIGINT run one orderly shutdown: in-flight requests get --shutdown-timeout to
finish, then the prefix cache is saved and the server exits 0 (uvicorn alone re-raised SIGTERM
after its shutdown: exit 143, no save)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import start_server

PROMPT = "a system prompt that every request of this tenant repeats " * 6


def _cache_files(cache_dir: Path) -> list[Path]:
    return sorted(p for p in cache_dir.rglob("*") if p.is_file() and ".tmp" not in p.name)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_the_prefix_cache_and_exits_0(
    chat_checkpoint: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    cache_dir = tmp_path / "cache"
    args = ("--num-kv-blocks", "64", "--block-size", "16", "--prefix-cache-dir", str(cache_dir))
    body = {"model": "tiny-chat", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    server = start_server(chat_checkpoint, tmp_path, *args)
    with server.http() as http:
        first = http.post("/v1/completions", json=body).json()
    server.proc.send_signal(sig)
    assert server.proc.wait(timeout=30) == 0, server.log()[-3000:]
    log = server.log()
    assert "shutting down" in log and "prefix cache:" in log and "saved to" in log
    assert _cache_files(cache_dir), "nothing saved"

    again = start_server(chat_checkpoint, tmp_path, *args)
    try:
        with again.http() as http:
            warm = http.post("/v1/completions", json=body).json()
    finally:
        again.stop()
    full_blocks = (first["usage"]["prompt_tokens"] - 1) // 16
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == full_blocks * 16 > 0
    assert warm["choices"][0]["text"] == first["choices"][0]["text"]


def _stream(url: str, body: dict, chunks: list[dict], started: threading.Event) -> None:
    """Reads a stream into ``chunks``; a connection cut mid-stream ends it with {"cut": True}."""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
                    started.set()
    except httpx.TransportError:
        chunks.append({"cut": True, "choices": []})
    started.set()


def _stream_in_background(url: str, max_tokens: int) -> tuple[threading.Thread, list[dict]]:
    """A streaming completion of ``max_tokens`` (EOS ignored) read by a thread; returns once
    its first chunk arrived."""
    body = {
        "model": "tiny-chat",
        "prompt": "hello",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    chunks: list[dict] = []
    started = threading.Event()
    client = threading.Thread(target=_stream, args=(url, body, chunks, started))
    client.start()
    assert started.wait(30)
    return client, chunks


def test_an_in_flight_stream_finishes_within_the_grace_period(
    chat_checkpoint: Path, tmp_path: Path
) -> None:
    server = start_server(chat_checkpoint, tmp_path, "--shutdown-timeout", "60")
    client, chunks = _stream_in_background(server.url, 400)
    server.proc.send_signal(signal.SIGTERM)
    # new connections are refused while the stream drains
    time.sleep(0.5)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=2)
    client.join(60)
    assert server.proc.wait(timeout=60) == 0, server.log()[-3000:]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and not chunks[-1].get("cut")


@pytest.mark.parametrize("grace, signals", [("0", 1), ("60", 2)], ids=["no-grace", "second-signal"])
def test_in_flight_requests_are_aborted_after_the_grace_or_a_second_signal_and_it_exits_0(
    chat_checkpoint: Path, tmp_path: Path, grace: str, signals: int
) -> None:
    cache_dir = tmp_path / "cache"
    args = ("--shutdown-timeout", grace, "--prefix-cache-dir", str(cache_dir))
    server = start_server(chat_checkpoint, tmp_path, *args, "--max-model-len", "2048")
    client, chunks = _stream_in_background(server.url, 2000)
    start = time.monotonic()
    for _ in range(signals):
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
    try:
        rc = server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        raise
    client.join(30)
    assert rc == 0, server.log()[-3000:]
    assert time.monotonic() - start < 20
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert "length" not in finishes  # cut before its 2000 tokens
    assert "saved to" in server.log()
