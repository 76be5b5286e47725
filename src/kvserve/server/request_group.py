"""A request group (what one HTTP request submits: its prompts, each with n samples) on both
sides of the AsyncEngine, and the typed commands that carry it to the engine loop thread.

Threads: ``RequestGroup`` is written by the loop thread, except ``received``, which only the
caller's event loop writes (each int has one writer, so ``sent - received``, the events the
caller has not read yet, is exact up to events in flight).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.server.engine_records import ErrorEvent, Event, PromptSpec

if TYPE_CHECKING:
    from kvserve.engine.engine import LLMEngine
    from kvserve.server.async_engine import AsyncEngine


@dataclass(slots=True, eq=False)
class RequestGroup:
    """Prompt i runs as engine request ``request_ids[i]``; ``prompts[:num_fed]`` have been
    handed to the engine, the rest wait in the AsyncEngine's round-robin (``num_fed`` only
    grows)."""

    group_id: str
    loop: asyncio.AbstractEventLoop
    request_ids: list[str]
    prompts: list[PromptSpec]
    cache_salt: str | None
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    index: dict[str, int] = field(default_factory=dict)  # request id -> prompt index
    num_sequences: int = 0  # sum of n over the prompts
    expected: int = 0  # samples still to finish
    num_fed: int = 0
    done: bool = False  # finished, failed or aborted: nothing more is delivered
    sent: int = 0  # events put (loop thread)
    received: int = 0  # events taken by the caller (caller's event loop)
    arrival: float = field(default_factory=time.monotonic)
    last_token_at: dict[str, float] = field(default_factory=dict)  # per sample

    def __post_init__(self) -> None:
        self.index = {rid: i for i, rid in enumerate(self.request_ids)}
        self.num_sequences = sum(p.params.n for p in self.prompts)
        self.expected = self.num_sequences

    @property
    def unread(self) -> int:
        return self.sent - self.received

    def unfed_sequences(self) -> int:
        return sum(p.params.n for p in self.prompts[self.num_fed :])

    def put(self, event: Event) -> None:
        self.sent += 1
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop has closed (server shutting down)
            pass


@dataclass(frozen=True, slots=True)
class AddCommand:
    group: RequestGroup


@dataclass(frozen=True, slots=True)
class AbortCommand:
    group: RequestGroup
    reason: str


@dataclass(frozen=True, slots=True)
class CallCommand:
    """Run ``fn(engine)`` on the loop thread between steps; ``done`` gets its result."""

    fn: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future[Any]


Command = AddCommand | AbortCommand | CallCommand


class RequestStream:
    """What a caller holds: iterate it for events; ``abort()`` if it stops listening early."""

    def __init__(self, owner: AsyncEngine, group: RequestGroup) -> None:
        self._owner = owner
        self._group = group
        self.request_ids = group.request_ids
        self._remaining = group.expected
        self.done = False

    async def __aiter__(self) -> AsyncIterator[Event]:
        while not self.done:
            event = await self._group.queue.get()
            self._group.received += 1
            if isinstance(event, ErrorEvent):
                self.done = True
            elif event.output.finished:
                self._remaining -= 1
                self.done = self._remaining == 0
            yield event

    def abort(self, reason: str = "the client went away") -> None:
        """Abort every prompt of the group that has not finished (idempotent)."""
        if not self.done:
            self.done = True
            self._owner.abort(self._group, reason)
