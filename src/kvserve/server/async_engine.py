"""AsyncEngine: one LLMEngine driven by a background thread, many asyncio callers.

``LLMEngine`` is single-threaded, so only the loop thread ever touches it. Callers (the HTTP
handlers, on the asyncio event loop) send typed commands (``AddCommand``, ``AbortCommand``)
through a thread-safe queue and wake the loop; the loop thread hands each group's events to
that group's own ``asyncio.Queue`` with ``call_soon_threadsafe``.

Admission, fair and O(batch):

- ``submit`` counts *sequences* (n x prompts) against ``max_queued_requests``, where requests
  enter: a group that does not fit next to what already waits is refused at once
  (``QueueFullError``, a 503 with Retry-After); one larger than the whole bound is a
  ``ValueError`` (it could never fit).
- Groups wait here, not in the engine: each loop iteration feeds the engine round-robin, one
  prompt per group per turn, only as much as its next step can admit (free ``max_num_seqs``
  slots, ``max_num_batched_tokens`` of prompt). So a small request that arrives behind a
  1000-prompt batch starts within a step or two, the engine's waiting queue stays O(batch),
  and aborting a big batch drops its unfed prompts without the engine seeing them.
- Each fed prompt carries its index in its group as its priority (a single request: 0). Under
  the "priority" scheduling policy (``kvserve serve``'s default) the engine admits a single
  request before the rest of a batch's prompts, even ahead of a batch prompt already being
  prefilled.

Backpressure: a group whose caller has left more than ``max_stream_buffer_events`` events per
sequence unread (a client that stopped reading its stream) is aborted with a logged reason.

Health: ``health()`` is DEAD once the loop has stopped, WEDGED while work waits and no loop
iteration has finished for ``health_stall_timeout_s``.

Faults: a step that raises fails only its own requests (engine/faults.py); their groups get an
``ErrorEvent`` naming the failure and the rest go on. An exception that escapes the loop, or
``max_consecutive_step_failures`` failed steps in a row, restarts it: every request in flight
gets an ``ErrorEvent``, the engine's KV state is rebuilt, and the loop serves again. Only a loop
that restarts more than ``max_restarts`` times within ``restart_window_s`` (or cannot rebuild)
dies: new submissions then raise ``EngineDeadError`` and ``alive`` turns False (the server's
/health answers 503).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvserve.engine.engine import EngineStats, LLMEngine
from kvserve.engine.request import Request, RequestOutput
from kvserve.kv.events import KVCacheEvent
from kvserve.server.engine_log import log_finished, log_stats, observe
from kvserve.server.engine_records import (
    EngineDeadError,
    ErrorEvent,
    Event,
    Health,
    HealthStatus,
    OutputEvent,
    PromptSpec,
    QueueFullError,
)
from kvserve.server.feeding import Feeding
from kvserve.server.latency_window import LatencyWindow
from kvserve.server.loop_faults import LoopFaults
from kvserve.server.metrics import ServerMetrics
from kvserve.server.request_group import (
    AbortCommand,
    AddCommand,
    CallCommand,
    Command,
    RequestGroup,
    RequestStream,
)

__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "ErrorEvent",
    "Event",
    "OutputEvent",
    "PromptSpec",
    "QueueFullError",
    "RequestStream",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngine(LoopFaults, Feeding):
    def __init__(
        self,
        engine: LLMEngine,
        metrics: ServerMetrics | None = None,
        max_queued_requests: int = 4096,
        log_interval_s: float = 10.0,
        max_stream_buffer_events: int = 1024,
        health_stall_timeout_s: float = 30.0,
        max_consecutive_step_failures: int = 3,
        max_restarts: int = 3,
        restart_window_s: float = 60.0,
        publish_kv_events: Callable[[list[KVCacheEvent]], None] | None = None,
    ) -> None:
        if max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        if max_stream_buffer_events < 1:
            raise ValueError(
                f"max_stream_buffer_events must be >= 1, got {max_stream_buffer_events}"
            )
        if not health_stall_timeout_s > 0:
            raise ValueError(f"health_stall_timeout_s must be > 0, got {health_stall_timeout_s}")
        if max_consecutive_step_failures < 1:
            raise ValueError(
                f"max_consecutive_step_failures must be >= 1, got {max_consecutive_step_failures}"
            )
        if max_restarts < 0 or restart_window_s <= 0:
            raise ValueError(
                f"max_restarts must be >= 0 and restart_window_s > 0, got {max_restarts} and "
                f"{restart_window_s}"
            )
        self.max_consecutive_step_failures = max_consecutive_step_failures
        self.max_restarts = max_restarts  # within restart_window_s; one more and it dies
        self.restart_window_s = restart_window_s
        self.num_restarts = 0
        self.engine = engine
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.log_interval_s = log_interval_s
        self.max_stream_buffer_events = max_stream_buffer_events
        self.health_stall_timeout_s = health_stall_timeout_s
        # called on the loop thread with each batch of prefix-cache index changes
        self.publish_kv_events = publish_kv_events
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _num_queued
        # sequences submitted and not yet scheduled for the first time: unfed here, or fed
        # and waiting in the engine. The truth for the bound and for /metrics' waiting.
        self._num_queued = 0
        self._ids = itertools.count()
        # loop thread only:
        self._groups: dict[str, RequestGroup] = {}  # fed engine request id -> its group
        self._pending: deque[RequestGroup] = deque()  # groups with unfed prompts, round-robin
        self._not_started: dict[str, Request] = {}  # fed, never scheduled (<= max_num_seqs)
        self._num_preempted_waiting = 0  # waiting in the engine after a preemption
        self._stats: EngineStats = engine.stats()  # the loop's latest snapshot
        self._heartbeat = time.monotonic()  # when the loop last finished an iteration
        self.latency = LatencyWindow()  # the last finished sequences' TTFT / TPOT (web view)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)

    # -- caller side (asyncio event loop) ----------------------------------------------------
    def start(self) -> None:
        self._heartbeat = time.monotonic()
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stop.is_set()

    @property
    def num_waiting(self) -> int:
        """Sequences waiting to run: queued here or in the engine, preempted ones too."""
        return self._num_queued + self._num_preempted_waiting

    def stats(self) -> EngineStats:
        """The loop's latest snapshot, with the waiting count as it is now."""
        return dataclasses.replace(self._stats, num_waiting=self.num_waiting)

    def health(self) -> HealthStatus:
        if not self.alive:
            return HealthStatus(Health.DEAD, f"the engine loop has stopped: {self.error!r}")
        stalled = time.monotonic() - self._heartbeat
        busy = self._num_queued > 0 or self._stats.num_running > 0
        if busy and stalled > self.health_stall_timeout_s:
            return HealthStatus(
                Health.WEDGED,
                f"no engine step has finished for {stalled:.1f} s while {self.num_waiting} "
                f"sequences wait (the limit is {self.health_stall_timeout_s:g} s, "
                "--health-stall-timeout-s)",
            )
        return HealthStatus(Health.OK)

    def submit(
        self,
        prompts: Sequence[PromptSpec],
        cache_salt: str | None = None,
        group_id: str | None = None,
    ) -> RequestStream:
        """Queue a group of prompts; raises QueueFullError / EngineDeadError / ValueError
        (nothing queued then).

        Prompt i runs as engine request ``{group_id}-{i}`` (samples: ``{group_id}-{i}-{j}``),
        so log lines carry the id the client got back.
        """
        if not self.alive:
            raise EngineDeadError(f"the engine loop has stopped: {self.error!r}")
        seqs = sum(p.params.n for p in prompts)
        if seqs > self.max_queued_requests:
            raise ValueError(
                f"this request is {seqs} sequences (n x prompts), more than the server queues "
                f"at once ({self.max_queued_requests}, --max-queued-requests)"
            )
        with self._lock:
            if self._num_queued + seqs > self.max_queued_requests:
                raise QueueFullError(
                    f"{self._num_queued} sequences are already waiting and this request adds "
                    f"{seqs} (the limit is {self.max_queued_requests}, --max-queued-requests); "
                    "retry later"
                )
            self._num_queued += seqs
        base = group_id or f"group-{next(self._ids)}"
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        group = RequestGroup(base, asyncio.get_running_loop(), ids, list(prompts), cache_salt)
        stream = RequestStream(self, group)
        self._commands.put(AddCommand(group))
        self._wake.set()
        if self.error is not None:  # died meanwhile: its last drain may have missed this add
            group.put(ErrorEvent(f"the engine loop died: {self.error!r}", 500))
        return stream

    async def flush_prefix_cache(self) -> int:
        """Drop every cached block no request holds; returns how many. Running requests'
        blocks are never touched."""
        return await self.call(LLMEngine.reset_prefix_cache)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """``fn(engine)`` on the loop thread between two steps (the engine is
        single-threaded); raises EngineDeadError if the loop stops or restarts first."""
        if not self.alive:
            raise EngineDeadError(f"the engine loop has stopped: {self.error!r}")
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put(CallCommand(fn, done))
        self._wake.set()
        return await asyncio.wrap_future(done)

    @property
    def loop_stopped(self) -> bool:
        """The loop thread has exited: the engine is the caller's to touch now."""
        return not self._thread.is_alive()

    def abort(self, group: RequestGroup, reason: str = "the client went away") -> None:
        self._commands.put(AbortCommand(group, reason))
        self._wake.set()

    # -- loop thread -------------------------------------------------------------------------
    def _serve(self) -> None:
        engine = self.engine
        last_log = time.monotonic()
        busy_since_log = False
        while not self._stop.is_set():
            self._drain_commands()
            self._feed()
            self._snapshot()
            if engine.has_unfinished_requests():
                busy_since_log = True
                outputs = engine.step()
                # before delivering: a client that sees this token may submit at once,
                # and must not find this request still counted as waiting
                self._note_started()
                self._deliver(outputs)
                self._check_step_failures()
            else:
                self._wake.wait(timeout=min(self.log_interval_s, 1.0))
                self._wake.clear()
            self._snapshot()
            now = time.monotonic()
            if busy_since_log and now - last_log >= self.log_interval_s:
                log_stats(self.stats())
                last_log, busy_since_log = now, engine.has_unfinished_requests()

    # -- commands and delivery (loop thread) -------------------------------------------------
    def _fail_all(self, event: ErrorEvent) -> None:
        """Send ``event`` to every group the loop knows of, and to adds still in the queue
        (they raced the death and would otherwise wait forever)."""
        groups = {id(g): g for g in [*self._groups.values(), *self._pending]}
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, AddCommand):
                groups[id(command.group)] = command.group
            elif isinstance(command, CallCommand) and not command.done.done():
                command.done.set_exception(EngineDeadError(event.message))
        for group in groups.values():
            if not group.done:
                group.done = True
                group.put(event)
        self._groups.clear()
        self._pending.clear()

    def _snapshot(self) -> None:
        sched = self.engine.scheduler
        self._num_preempted_waiting = max(0, len(sched.waiting) - len(self._not_started))
        self._stats = self.engine.stats()
        self._heartbeat = time.monotonic()
        if self.publish_kv_events is not None:
            # after every step, flush and restart: a subscriber is one batch behind at most
            events = self.engine.take_kv_events()
            if events:
                self.publish_kv_events(events)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, AddCommand):
                self._pending.append(command.group)
            elif isinstance(command, CallCommand):
                if not command.done.done():
                    try:
                        command.done.set_result(command.fn(self.engine))
                    except Exception as e:  # noqa: BLE001 - the caller gets it, the loop goes on
                        command.done.set_exception(e)
            else:
                self._abort_group(command.group, command.reason)

    def _abort_group(self, group: RequestGroup, reason: str, in_engine: bool = True) -> None:
        """Abort every unfinished prompt of the group: O(its prompts), never O(all).
        ``in_engine=False`` leaves the engine's requests to the caller (a restart)."""
        if group.done:
            return
        group.done = True
        live = [r for r in group.request_ids[: group.num_fed] if self._groups.pop(r, None)]
        for rid in live:
            self._forget_not_started(rid)
        unfed = group.unfed_sequences()
        with self._lock:
            self._num_queued -= unfed
        if in_engine:
            self.engine.abort_requests(live)
        logger.info("request %s aborted (%s)", group.group_id, reason)

    def _forget_not_started(self, rid: str) -> None:
        req = self._not_started.pop(rid, None)
        if req is not None:
            with self._lock:
                self._num_queued -= req.sampling_params.n

    def _note_started(self) -> None:
        # _not_started holds only what _feed let in: at most max_num_seqs requests
        started = [rid for rid, r in self._not_started.items() if r.first_scheduled_time]
        for rid in started:
            self._forget_not_started(rid)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            rid = out.parent_request_id or out.request_id
            group = self._groups.get(rid)
            if group is None:
                continue  # aborted by its caller in the meantime
            if out.finish_reason == "error":
                self._fail_group(group, out)
                continue
            if self.metrics is not None:
                observe(self.metrics, group.last_token_at, out, now)
            group.put(OutputEvent(group.index[rid], out))
            if out.finished:
                group.expected -= 1
                log_finished(out)
                self.latency.record(out)
                if group.expected == 0:
                    group.done = True
                    for r in group.request_ids:
                        self._groups.pop(r, None)
                    if self.metrics is not None:
                        self.metrics.e2e_latency.observe(now - group.arrival)
            elif group.unread > self.max_stream_buffer_events * group.num_sequences:
                self._stalled(group)

    def _stalled(self, group: RequestGroup) -> None:
        """Its caller stopped reading: abort, so a stalled stream holds bounded memory."""
        unread = group.unread
        reason = (
            f"its client stopped reading: {unread} events unread, the limit is "
            f"{self.max_stream_buffer_events} per sequence (--max-stream-buffer-events)"
        )
        logger.warning("request %s: %s", group.group_id, reason)
        self._abort_group(group, "backpressure")
        group.put(ErrorEvent(f"the request was aborted: {reason}", 500))
