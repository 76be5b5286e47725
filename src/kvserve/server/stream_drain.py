"""Backpressure on a streamed response (``EventStreamResponse``, the routes' SSE): pause while
the client takes no bytes, abort after a bound.

Why the AsyncEngine's unread-events bound (``--max-stream-buffer-events``) alone never fired:
uvicorn's ``send()`` returns as soon as the bytes are in the transport, and the transport
hands them to the kernel, whose socket buffers (the server's send buffer, autotuned to
megabytes on loopback, plus the client's receive buffer) absorb a whole long stream. The
route kept reading every event, so none stayed unread, and all 8,100 tokens were generated
for a client that read none of them.

So before taking the next event from the engine, the response looks at what this connection
still holds for the client: the transport's buffer plus the kernel's unsent and unacknowledged
bytes (``SIOCOUTQ``, Linux; elsewhere the transport's buffer alone). Above ``PAUSE_BYTES`` the
stream is paused: it takes no event, so the engine's events wait unread in the group's queue,
where ``--max-stream-buffer-events`` bounds them. A stream paused for ``stall_timeout_s``
without a break (``--stream-stall-timeout-s``) raises ``StreamStalled``: the route aborts the
engine request (its KV blocks are freed) and drops the connection with what it still held.
A slow client that keeps reading is only paced: each time its backlog falls under the
threshold the clock starts again.

The connection is found through the ASGI scope: ``server/connections.py``'s protocol puts a
``ConnectionHandle`` under ``scope["extensions"][CONNECTION_KEY]``. Without one (another
server, an in-process test client) only the unread-events bound applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.server.request_group import RequestStream

try:  # POSIX; Linux answers SIOCOUTQ (== TIOCOUTQ) on a TCP socket
    import fcntl
    import termios

    _SIOCOUTQ: int | None = termios.TIOCOUTQ
except (ImportError, AttributeError):  # pragma: no cover - not Linux
    _SIOCOUTQ = None

logger = logging.getLogger(__name__)

CONNECTION_KEY = "kvserve.connection"
# bytes held for a client above which its stream pauses: as much as uvicorn's own write
# buffer holds before it applies flow control; a reading client's token stream stays far below
PAUSE_BYTES = 64 << 10
POLL_S = 0.05  # how often a paused stream looks again


@dataclass(frozen=True, slots=True)
class ConnectionHandle:
    """What a request's scope carries about its connection (set by ``connections.py``)."""

    transport: asyncio.Transport
    stall_timeout_s: float  # --stream-stall-timeout-s


class StreamStalled(Exception):
    """The client took no bytes for the bound; the message names it and its flag."""


def connection_of(scope: dict[str, Any]) -> ConnectionHandle | None:
    handle = scope.get("extensions", {}).get(CONNECTION_KEY)
    return handle if isinstance(handle, ConnectionHandle) else None


def kernel_queued_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes the kernel holds for the peer: not sent yet, or sent and not acknowledged
    (``SIOCOUTQ``); 0 where the platform cannot tell."""
    sock = transport.get_extra_info("socket")
    if _SIOCOUTQ is None or sock is None:
        return 0
    try:
        out = fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError):  # not a TCP socket, or already closed
        return 0
    return struct.unpack("i", out)[0]


def queued_bytes(transport: asyncio.WriteTransport) -> int:
    """Bytes written to this connection that the client's TCP has not taken yet."""
    if transport.is_closing():
        return 0
    return transport.get_write_buffer_size() + kernel_queued_bytes(transport)


class DrainWatch:
    """One streamed response's view of its connection. ``wait_drained`` before taking each
    event; ``send`` for each chunk (bounded too: with the kernel's count unavailable, a full
    transport buffer makes uvicorn's ``send`` block)."""

    def __init__(
        self,
        handle: ConnectionHandle | None,
        pause_bytes: int = PAUSE_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.handle = handle
        self.pause_bytes = pause_bytes
        self.clock = clock

    async def wait_drained(self) -> None:
        """Return once the connection holds at most ``pause_bytes`` for the client; raise
        ``StreamStalled`` if it held more for ``stall_timeout_s`` without a break."""
        if self.handle is None:
            return
        transport, bound = self.handle.transport, self.handle.stall_timeout_s
        since: float | None = None
        while (queued := queued_bytes(transport)) > self.pause_bytes:
            now = self.clock()
            since = now if since is None else since
            if now - since >= bound:
                raise StreamStalled(
                    f"its client took no bytes for {now - since:.1f} s with {queued} bytes "
                    f"waiting; the limit is {bound:g} s (--stream-stall-timeout-s)"
                )
            await asyncio.sleep(min(POLL_S, bound))

    async def send(self, send: Callable[[Any], Awaitable[None]], message: Any) -> None:
        if self.handle is None:
            return await send(message)
        bound = self.handle.stall_timeout_s
        try:
            with anyio.fail_after(bound):
                await send(message)
        except TimeoutError as e:
            raise StreamStalled(
                f"a write to its client blocked for {bound:g} s; the limit is {bound:g} s "
                "(--stream-stall-timeout-s)"
            ) from e

    def drop_connection(self) -> None:
        """Close at once, discarding what the connection still holds for the client."""
        if self.handle is not None:
            self.handle.transport.abort()


class EventStreamResponse(StreamingResponse):
    """SSE over an engine stream that aborts the request however the response ends: also
    when the client leaves before the body generator ever started (its ``finally`` would
    then never run), and when the client stops taking bytes (paused, then past
    ``--stream-stall-timeout-s`` aborted with its connection dropped). completions.py and
    chat.py import it from serving.py."""

    def __init__(self, body: AsyncIterator[str], stream: RequestStream) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.engine_stream = stream
        self.watch = DrainWatch(None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.watch = DrainWatch(connection_of(scope))
        try:
            await super().__call__(scope, receive, send)
        except StreamStalled as e:
            group = self.engine_stream.request_ids[0].rpartition("-")[0]  # the response's id
            logger.warning("request %s: %s", group, e)
            self.engine_stream.abort(f"backpressure: {e}")
            self.watch.drop_connection()
            await _until_disconnected(receive)
        finally:
            self.engine_stream.abort()  # no-op once finished

    async def stream_response(self, send: Send) -> None:
        """Starlette's, with each event taken only once the client has drained the
        connection (else the engine's events wait unread in its queue, bounded there)."""
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        chunks = aiter(self.body_iterator)
        while True:
            await self.watch.wait_drained()
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            body = chunk if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset)
            await self.watch.send(
                send, {"type": "http.response.body", "body": body, "more_body": True}
            )
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _until_disconnected(receive: Receive, timeout_s: float = 1.0) -> None:
    """After dropping the connection: wait until the server has seen it go, so it does not
    report a response left incomplete by the app."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            while (await receive())["type"] != "http.disconnect":
                pass
