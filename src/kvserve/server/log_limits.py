"""Rate-limited log lines for faults that repeat per connection.

A fault that hits every connection (malformed requests from a scanner, accept() failing
when descriptors run out, an app error under a flood) would log once per connection: the
probe that opened 21k connections left 143k tracebacks (64 MB) in the log. Here a line is
logged the first time, then the same line (same logger, level, first line of the message and
exception type) is counted, not logged, for ``interval_s``; the next one after that carries
the count ("... (412 more like this in the last 10 s were not logged)").

``RateLimitedLogger`` wraps uvicorn's per-connection logger (the protocol hands it to every
request cycle); ``rate_limited_exception_handler`` is the event loop's exception handler, which
asyncio's transports and accept loop report to.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, MutableMapping
from typing import Any

DEFAULT_INTERVAL_S = 10.0
MAX_KEYS = 1024  # distinct lines remembered; the least recently seen is forgotten first


class LogRateLimiter:
    """``admit(key)``: None to drop the line, else how many like it were dropped since the
    last one logged (0 the first time)."""

    def __init__(
        self, interval_s: float = DEFAULT_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        self.clock = clock
        self._seen: OrderedDict[tuple, list[float | int]] = OrderedDict()  # key -> [t, dropped]

    def admit(self, key: tuple) -> int | None:
        now = self.clock()
        entry = self._seen.get(key)
        if entry is not None and now - entry[0] < self.interval_s:
            entry[1] += 1
            return None
        dropped = 0 if entry is None else int(entry[1])
        self._seen[key] = [now, 0]
        self._seen.move_to_end(key)
        if len(self._seen) > MAX_KEYS:
            self._seen.popitem(last=False)
        return dropped

    def suffix(self, dropped: int) -> str:
        if not dropped:
            return ""
        return f" ({dropped} more like this in the last {self.interval_s:g} s were not logged)"


def _exc_type(exc_info: object) -> str:
    if isinstance(exc_info, BaseException):
        return type(exc_info).__name__
    if isinstance(exc_info, tuple) and exc_info and exc_info[0] is not None:
        return exc_info[0].__name__
    return ""


class RateLimitedLogger(logging.LoggerAdapter):
    """A logger whose repeated lines are rate-limited by ``limiter`` (shared by every
    connection). Has the ``level`` attribute uvicorn's protocols read."""

    def __init__(self, logger: logging.Logger, limiter: LogRateLimiter) -> None:
        super().__init__(logger, {})
        self.limiter = limiter

    @property
    def level(self) -> int:
        return self.logger.level

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        if not self.isEnabledFor(level):
            return
        text = str(msg) % args if args else str(msg)
        key = (
            self.logger.name,
            level,
            text.partition("\n")[0][:200],
            _exc_type(kwargs.get("exc_info")),
        )
        dropped = self.limiter.admit(key)
        if dropped is None:
            return
        if dropped:
            msg, args = text.rstrip("\n") + self.limiter.suffix(dropped), ()
        self.logger.log(level, msg, *args, **kwargs)

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        return msg, kwargs


def rate_limited_exception_handler(
    limiter: LogRateLimiter,
) -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]:
    """An event-loop exception handler: asyncio's default report, rate-limited by message
    and exception type."""

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        key = ("asyncio", message.partition("\n")[0][:200], _exc_type(context.get("exception")))
        dropped = limiter.admit(key)
        if dropped is None:
            return
        if dropped:
            context = {**context, "message": message + limiter.suffix(dropped)}
        loop.default_exception_handler(context)

    return handle
