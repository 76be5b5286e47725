"""Backpressure and bounds that hold, against a real `kvserve serve` process over raw sockets:
a stream nobody reads is paused and then aborted (its KV blocks freed), bodies nested too deep
are refused before parsing at any size, idle or half-sent connections are closed, connections
past the cap get 503, and a fault repeated per connection is logged once per interval.
"""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import ServerProcess, start_server

STALL_S = 1.0  # --stream-stall-timeout-s
HEADER_S = 3.0  # --header-timeout-s: long enough for the cap test to hold its connections
MAX_CONNECTIONS = 6
LIMITS = {
    "--stream-stall-timeout-s": str(STALL_S),
    # far above what a 1 s stall leaves unread: only the time bound can abort the stream
    "--max-stream-buffer-events": "100000",
    "--header-timeout-s": str(HEADER_S),
    "--max-connections": str(MAX_CONNECTIONS),
    "--max-json-depth": "32",
    "--max-num-seqs": "4",
}


@pytest.fixture(scope="module")
def server(chat_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    args = [x for kv in LIMITS.items() for x in kv]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSERVE_KERNELS", "0")  # the reference kernels: no C++ build at start
        mp.setenv("KVSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        proc = start_server(chat_checkpoint, tmp_path_factory.mktemp("backpressure"), *args)
    yield proc
    proc.stop()


def connect(server: ServerProcess, rcvbuf: int | None = None) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:  # before connect: the window the client advertises
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    return sock


def post_raw(sock: socket.socket, path: str, body: dict) -> None:
    content = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(content)}\r\n\r\n"
    )
    sock.sendall(head.encode() + content)


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes; and when it closed (monotonic). Fails
    if it has not closed within ``timeout``."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {timeout} s; got {data[:200]!r}")
    return data, time.monotonic()


def read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length, whole."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"content-length: (\d+)", head.lower())
    assert length is not None, head
    while len(body) < int(length[1]):
        body += sock.recv(65536)
    return data


def kv_blocks(server: ServerProcess) -> dict:
    return httpx.get(f"{server.url}/v1/kv_state", timeout=10).json()


def wait_for_log(server: ServerProcess, text: str, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while text not in server.log():
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.02)
    return time.monotonic()


def test_a_stream_nobody_reads_is_paused_then_aborted_and_its_blocks_freed(
    server: ServerProcess,
) -> None:
    num_blocks = len(kv_blocks(server)["blocks"])
    before = server.metrics()["vllm:generation_tokens_total"]
    # ~2 KB events (20 top logprobs with their bytes): the pause threshold (64 KiB) is reached
    # within a few dozen tokens, long before the 1900 asked for
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1900,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 20,
        "stream": True,
    }
    sock = connect(server, rcvbuf=4096)
    try:
        post_raw(sock, "/v1/chat/completions", body)
        # paused once the connection holds 64 KiB for the client (a few dozen steps), then
        # aborted STALL_S later: how long that is from here depends on the machine's speed
        wait_for_log(server, "(--stream-stall-timeout-s)", timeout=120)
        stalled = re.search(
            r"its client took no bytes for (\d+\.\d) s with (\d+) bytes", server.log()
        )
        assert stalled is not None, server.log()[-3000:]
        assert STALL_S <= float(stalled[1]) < STALL_S + 0.5  # the bound, polled every 50 ms
        assert int(stalled[2]) > 64 << 10  # what the connection held past the pause threshold
        assert "the limit is 1 s (--stream-stall-timeout-s)" in server.log()
        server.wait_idle(timeout=30)
        state = kv_blocks(server)
        assert state["requests"] == []
        assert state["blocks"].count(1) == 0  # no block in use
        assert state["blocks"].count(0) + state["blocks"].count(2) == num_blocks
        # stopped early: far fewer tokens than asked were generated
        generated = server.metrics()["vllm:generation_tokens_total"] - before
        assert 0 < generated < 1900, generated
        # the connection was dropped with what it still held for the client
        read_until_closed(sock, timeout=10)
    finally:
        sock.close()
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


def test_a_reading_client_gets_its_whole_stream(server: ServerProcess) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 40,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 20,
        "stream": True,
    }
    sock = connect(server, rcvbuf=4096)
    try:
        post_raw(sock, "/v1/chat/completions", body)
        data = b""
        sock.settimeout(60)
        while b"data: [DONE]" not in data:
            chunk = sock.recv(4096)
            assert chunk, data[-500:]
            data += chunk
    finally:
        sock.close()
    assert data.count(b'"top_logprobs"') == 40  # one entry per token, each with its top 20


def deep(depth: int, pad: int = 0) -> bytes:
    """A completions body whose prompt nests ``depth`` levels below the top object (so the
    body is depth + 1 deep), padded with a long ``user`` string to ``pad`` bytes."""
    body = b'{"model": "tiny-chat", "prompt": ' + b"[" * depth + b"]" * depth
    body += b', "user": "' + b"x" * max(0, pad - len(body) - 12) + b'"}'
    return body


@pytest.mark.parametrize("pad", [0, 70_000], ids=["small", "over-64KiB"])
def test_json_nested_too_deep_is_a_400_naming_the_limit(server: ServerProcess, pad: int) -> None:
    for depth, path in [(32, "/v1/completions"), (10_000, "/v1/completions"), (33, "/tokenize")]:
        body = deep(depth, pad)
        assert (len(body) >= 64 << 10) == (pad > 0)
        r = httpx.post(
            f"{server.url}{path}",
            content=body,
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["message"] == (
            f"the request body nests {depth + 1} levels deep; the limit is 32 (--max-json-depth)"
        )
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error",
            "json_too_deep",
            None,
        )
    # at the limit it is parsed and validated: an empty nested list is not a prompt
    r = httpx.post(
        f"{server.url}/v1/completions",
        content=deep(31, pad),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and "--max-json-depth" not in r.text, r.text


@pytest.mark.parametrize(
    "sent", [b"", b"GET /health HTTP/1.1\r\nHost: test\r\n"], ids=["idle", "partial-head"]
)
def test_a_connection_without_a_complete_head_is_closed(server: ServerProcess, sent: bytes) -> None:
    sock = connect(server)
    try:
        t0 = time.monotonic()
        sock.sendall(sent)
        data, closed = read_until_closed(sock, timeout=HEADER_S + 10)
        assert data == b""
        assert HEADER_S - 0.5 < closed - t0 < HEADER_S + 5, closed - t0
    finally:
        sock.close()


def test_a_kept_alive_connection_gets_the_same_header_timeout(server: ServerProcess) -> None:
    sock = connect(server)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        t0 = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # then nothing: uvicorn's keep-alive
        data, closed = read_until_closed(sock, timeout=HEADER_S + 10)  # timer is off now
        assert data == b""
        assert HEADER_S - 0.5 < closed - t0 < HEADER_S + 5, closed - t0
    finally:
        sock.close()


def test_connections_past_the_cap_get_503_and_the_cap_frees_up(server: ServerProcess) -> None:
    held = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in held:  # accepted: nothing is sent to a connection that has not asked
            sock.settimeout(0.3)
            with pytest.raises(TimeoutError):
                sock.recv(1)
        extra = connect(server)
        try:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
            data, _ = read_until_closed(extra, timeout=10)
        finally:
            extra.close()
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ")
        assert b"retry-after: 1" in head.lower()
        error = json.loads(body)["error"]
        assert error["code"] == "too_many_connections"
        assert f"holds {MAX_CONNECTIONS} connections" in error["message"]
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while True:  # the server sees the held ones go
        try:
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_fault_repeated_per_connection_is_logged_once_with_a_count(
    server: ServerProcess,
) -> None:
    line = "Invalid HTTP request received."
    before = server.log().count(line)
    for _ in range(20):
        sock = connect(server)
        try:
            sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            data, _ = read_until_closed(sock, timeout=10)
            assert data.startswith(b"HTTP/1.1 400 ")
        finally:
            sock.close()
    # at most one per 10 s interval (another test's malformed requests may have opened it)
    assert server.log().count(line) - before <= 1
