"""The pieces of the server's backpressure and bounds, without a server: the JSON depth scan
and the body check's refusal at any size, the stream's drain watch, rate-limited logs, the
descriptor-bounded connection cap. (The same, end to end: test_server_backpressure.py.)"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvserve.server.body_check import MIN_CHECKED_BYTES, BodyCheckMiddleware
from kvserve.server.bounds import json_depth
from kvserve.server.config import ServerConfig
from kvserve.server.connections import RESERVED_FDS, fd_bounded_cap
from kvserve.server.log_limits import LogRateLimiter, RateLimitedLogger
from kvserve.server.stream_drain import ConnectionHandle, DrainWatch, StreamStalled


@pytest.mark.parametrize(
    ("raw", "depth"),
    [
        (b"1", 0),
        (b"[]", 1),
        (b'{"a": [1, [2, {"b": "]]]] [[[[ {{"}]]}', 4),
        (b'"[[[[ \\" [[["', 0),  # brackets inside a string, past an escaped quote
        (b'{"a": "\\\\"}', 1),  # an escaped backslash ends the string
        (b"[" + b"[" * 5 + b"]" * 5 + b", [[]]]", 6),
    ],
)
def test_json_depth_counts_levels_outside_strings(raw: bytes, depth: int) -> None:
    assert json_depth(raw) == depth
    assert json_depth(raw) == _parsed_depth(json.loads(raw))


def _parsed_depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_parsed_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_parsed_depth, value), default=0)
    return 0


async def _accepted(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"passed"})


def _post(path: str, body: bytes, limit: int = 64) -> httpx.Response:
    with ThreadPoolExecutor(1) as pool:  # the side process's work, in a thread here
        app = BodyCheckMiddleware(_accepted, ServerConfig(max_json_depth=limit), pool)

        async def run() -> httpx.Response:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                return await client.post(path, content=body)

        return asyncio.run(run())


@pytest.mark.parametrize("size", [1000, MIN_CHECKED_BYTES + 1000], ids=["small", "over-64KiB"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_body_nested_too_deep_is_refused_before_parsing(path: str, size: int) -> None:
    for depth in (65, 100_000):  # 100k levels: RecursionError in json.loads, a 500 before
        nest = b"[" * depth + b"]" * depth
        pad = b"x" * max(0, size - len(nest) - 30)
        body = b'{"prompt": ' + nest[1:-1] + b', "user": "' + pad + b'"}'
        r = _post(path, body)
        assert r.status_code == 400, r.text
        assert r.json() == {
            "error": {
                "message": f"the request body nests {depth} levels deep; the limit is 64 "
                "(--max-json-depth)",
                "type": "invalid_request_error",
                "param": None,
                "code": "json_too_deep",
            }
        }
    at_limit = b'{"prompt": ' + b"[" * 63 + b"1" + b"]" * 63 + b"}"
    r = _post("/tokenize", at_limit)
    assert (r.status_code, r.text) == (200, "passed")


class FakeTransport(asyncio.WriteTransport):
    """A transport whose write buffer holds what the test says (no socket: the kernel's
    count reads 0)."""

    def __init__(self, buffered: list[int]) -> None:
        super().__init__()
        self.buffered = buffered  # popped front to back, the last one repeats
        self.aborted = False

    def get_write_buffer_size(self) -> int:
        return self.buffered.pop(0) if len(self.buffered) > 1 else self.buffered[0]

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True


def test_a_stream_waits_while_its_client_drains_and_stalls_past_the_bound() -> None:
    async def run() -> None:
        # above the threshold twice, then drained: it waits (paused) and goes on
        transport = FakeTransport([100_000, 100_000, 10])
        watch = DrainWatch(ConnectionHandle(transport, 5.0), pause_bytes=65536)
        t0 = asyncio.get_running_loop().time()
        await watch.wait_drained()
        assert 0.09 < asyncio.get_running_loop().time() - t0 < 1.0  # two polls of 50 ms
        # above it the whole time: stalled after the bound, with the flag in the message
        stuck = DrainWatch(ConnectionHandle(FakeTransport([70_000]), 0.2), pause_bytes=65536)
        with pytest.raises(StreamStalled, match=r"70000 bytes waiting; the limit is 0.2 s "):
            await stuck.wait_drained()
        stuck.drop_connection()
        assert stuck.handle is not None and stuck.handle.transport.is_closing()
        # a send that blocks past the bound (a full transport, kernel count unavailable)
        never = asyncio.Event()

        async def blocked_send(message: object) -> None:
            await never.wait()

        with pytest.raises(StreamStalled, match="a write to its client blocked for 0.2 s"):
            await stuck.send(blocked_send, {})
        # no connection known (another server): never pauses
        await DrainWatch(None).wait_drained()

    asyncio.run(run())


def test_repeated_log_lines_are_logged_once_per_interval_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    limiter = LogRateLimiter(10.0, clock=lambda: now[0])
    log = RateLimitedLogger(logging.getLogger("test.limited"), limiter)
    with caplog.at_level(logging.INFO, logger="test.limited"):
        for i in range(50):
            now[0] = i * 0.1  # 5 s of the same fault
            log.warning("Invalid HTTP request received.")
            log.error("Exception in ASGI application\n", exc_info=ValueError("x"))
        log.warning("another fault %d", 7)  # a different line is its own
        now[0] = 10.0
        log.warning("Invalid HTTP request received.")
    assert [r.getMessage() for r in caplog.records] == [
        "Invalid HTTP request received.",
        "Exception in ASGI application\n",
        "another fault 7",
        "Invalid HTTP request received. (49 more like this in the last 10 s were not logged)",
    ]
    assert caplog.records[1].exc_info is not None  # the traceback, once


def test_the_connection_cap_leaves_descriptors_for_the_rest() -> None:
    assert fd_bounded_cap(4096, soft_fd_limit=1024) == 1024 - RESERVED_FDS
    assert fd_bounded_cap(100, soft_fd_limit=1024) == 100
    assert fd_bounded_cap(4096, soft_fd_limit=100) == 1
    with pytest.raises(ValueError, match="max_connections must be >= 1, got 0"):
        ServerConfig(max_connections=0)
    with pytest.raises(ValueError, match="header_timeout_s must be positive, got 0"):
        ServerConfig(header_timeout_s=0)
