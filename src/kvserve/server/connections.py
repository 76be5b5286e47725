"""Connection bounds: a header timeout, a connection cap, rate-limited per-connection logs.

uvicorn alone closes a connection only after a response (``timeout_keep_alive``): one that
never sends a complete request head stays open forever, and a probe holding 21k of them ran
the process out of file descriptors (/health then waited 10 s). Its ``limit_concurrency`` does
count idle connections, but answers its 503 only once a request head arrives, so idle ones
still pile up. This module's protocol (uvicorn's own HTTP/1.1 protocol, subclassed):

- closes a connection that has not sent a complete request head within
  ``header_timeout_s`` of opening, or of its previous response (``--header-timeout-s``);
- answers a connection beyond ``max_connections`` with a 503 (OpenAI's error shape,
  ``Retry-After``) at once and closes it, so open sockets stay bounded
  (``--max-connections``, lowered to fit the process's descriptor limit);
- tells the app its transport and the stall bound (``stream_drain.ConnectionHandle`` in the
  scope's extensions), so a stream can pause for a client that stopped reading;
- logs through a shared ``LogRateLimiter``: a fault repeated per connection is one line and a
  count per interval; the event loop's exception handler (accept() failures) likewise.

``uvicorn_options(config)`` is what ``run_server`` passes to ``uvicorn.Config``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from kvserve.server.config import ServerConfig
from kvserve.server.log_limits import (
    LogRateLimiter,
    RateLimitedLogger,
    rate_limited_exception_handler,
)
from kvserve.server.stream_drain import CONNECTION_KEY, ConnectionHandle

logger = logging.getLogger(__name__)

RESERVED_FDS = 128  # descriptors kept for everything but client connections (files, pools)
REFUSED_LINGER_S = 1.0  # a refused connection is read (and dropped) this long for its 503


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_s: float
    max_connections: int
    stream_stall_timeout_s: float
    limiter: LogRateLimiter


def fd_bounded_cap(max_connections: int, soft_fd_limit: int | None = None) -> int:
    """``max_connections``, lowered so the connections leave ``RESERVED_FDS`` descriptors of
    the process's soft ``RLIMIT_NOFILE`` to everything else."""
    if soft_fd_limit is None:
        soft_fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft_fd_limit == resource.RLIM_INFINITY:
        return max_connections
    return max(1, min(max_connections, soft_fd_limit - RESERVED_FDS))


def refusal_bytes(max_connections: int) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": f"the server holds {max_connections} connections, its limit "
                "(--max-connections); retry later",
                "type": "server_error",
                "param": None,
                "code": "too_many_connections",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class BoundedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP/1.1 protocol (h11's, or httptools' where installed) with the bounds above.
    ``limits`` is set on the subclass ``protocol_class`` makes."""

    limits: ConnectionLimits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logger = RateLimitedLogger(logging.getLogger("uvicorn.error"), self.limits.limiter)
        self._log = RateLimitedLogger(logger, self.limits.limiter)
        self._header_timer: asyncio.TimerHandle | None = None
        self._refused = False
        if self.loop.get_exception_handler() is None:
            self.loop.set_exception_handler(rate_limited_exception_handler(self.limits.limiter))

    # -- the cap -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self._refuse(transport)
            return
        super().connection_made(transport)
        self._arm_header_timer()

    def _refuse(self, transport: asyncio.Transport) -> None:
        """Answer 503 before reading the request, then read (and drop) what the client sends
        until it closes, at most ``REFUSED_LINGER_S``: closing with its request unread would
        reset the connection and could lose the 503 on the client's side."""
        self._refused = True
        self.transport = transport
        self._log.warning(
            "refused a connection: %d connections are open, the limit (--max-connections)",
            self.limits.max_connections,
        )
        transport.write(refusal_bytes(self.limits.max_connections))
        if transport.can_write_eof():
            transport.write_eof()
        self._header_timer = self.loop.call_later(REFUSED_LINGER_S, transport.close)

    # -- the header timeout --------------------------------------------------------------
    def _awaiting_head(self) -> bool:
        """No request is in progress: the connection is waiting for a request head."""
        cycle = self.cycle
        return (cycle is None or cycle.response_complete) and not getattr(self, "pipeline", ())

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        timeout = self.limits.header_timeout_s
        self._header_timer = self.loop.call_later(timeout, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._awaiting_head():
            return  # a request is running: its response re-arms the timer
        self._log.info(
            "closed a connection that sent no complete request head within %g s "
            "(--header-timeout-s)",
            self.limits.header_timeout_s,
        )
        self.transport.close()

    def _tag_request(self) -> None:
        """A request head arrived: stop the clock, hand the app its connection."""
        if self._awaiting_head():
            return
        self._cancel_header_timer()
        handle = ConnectionHandle(self.transport, self.limits.stream_stall_timeout_s)
        self.cycle.scope.setdefault("extensions", {})[CONNECTION_KEY] = handle

    # -- uvicorn's hooks -----------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        self._tag_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self._awaiting_head():
            self._arm_header_timer()
        else:
            self._tag_request()  # a pipelined request started in super()

    def eof_received(self) -> bool | None:
        if self._refused:
            return None  # the client has read its 503: close
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        if not self._refused:
            super().connection_lost(exc)

    def pause_writing(self) -> None:
        if not self._refused:
            super().pause_writing()

    def resume_writing(self) -> None:
        if not self._refused:
            super().resume_writing()


def protocol_class(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    return type("KVServeHTTPProtocol", (BoundedHTTPProtocol,), {"limits": limits})


def uvicorn_options(config: ServerConfig) -> dict[str, Any]:
    """The keyword arguments of ``uvicorn.Config`` that apply these bounds."""
    cap = fd_bounded_cap(config.max_connections)
    if cap < config.max_connections:
        logger.info(
            "at most %d connections (--max-connections %d, lowered to leave %d of the %d file "
            "descriptors this process may open to everything else)",
            cap,
            config.max_connections,
            RESERVED_FDS,
            resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        )
    limits = ConnectionLimits(
        header_timeout_s=config.header_timeout_s,
        max_connections=cap,
        stream_stall_timeout_s=config.stream_stall_timeout_s,
        limiter=LogRateLimiter(),
    )
    return {"http": protocol_class(limits)}
