"""AsyncEngine: one LLMEngine driven by a background thread, many asyncio callers.

``LLMEngine`` is single-threaded, so only the loop thread ever touches it. Callers (the HTTP
handlers, on the asyncio event loop) send commands -- add, abort -- through a thread-safe
queue and wake the loop; the loop thread hands each request's events to that request's own
``asyncio.Queue`` with ``call_soon_threadsafe``. A request group (one HTTP request: several
prompts, each with n samples) shares one queue and ends when every sample has finished.

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
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from kvserve.engine.engine import EngineStats, LLMEngine
from kvserve.engine.faults import describe
from kvserve.engine.request import Request, RequestOutput
from kvserve.sampling import SamplingParams
from kvserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The bounded waiting queue is full; retry later."""


class EngineDeadError(Exception):
    """The engine loop has stopped; nothing more will run."""


class RepeatedStepFailure(RuntimeError):
    """Engine steps keep failing: the loop restarts to rebuild the engine's state."""


@dataclass(frozen=True, slots=True)
class OutputEvent:
    prompt_index: int  # which prompt of the group
    output: RequestOutput


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    message: str
    status: int  # the HTTP status it would have had before streaming began


Event = OutputEvent | ErrorEvent


@dataclass(frozen=True, slots=True)
class PromptSpec:
    """One prompt of a group, already tokenized and checked."""

    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class _Group:
    """Loop-thread bookkeeping of one submitted group."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Event]
    request_ids: list[str]
    expected: int  # samples still to finish
    arrival: float = field(default_factory=time.monotonic)
    last_token_at: dict[str, float] = field(default_factory=dict)  # per sample

    def put(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop has closed (server shutting down)
            pass


class RequestStream:
    """What a caller holds: iterate it for events; ``abort()`` if it stops listening early."""

    def __init__(self, owner: AsyncEngine, request_ids: list[str], expected: int) -> None:
        self._owner = owner
        self.request_ids = request_ids
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._remaining = expected
        self.done = False

    async def __aiter__(self) -> AsyncIterator[Event]:
        while not self.done:
            event = await self._queue.get()
            if isinstance(event, ErrorEvent):
                self.done = True
            elif event.output.finished:
                self._remaining -= 1
                self.done = self._remaining == 0
            yield event

    def abort(self) -> None:
        """Abort every prompt of the group that has not finished (idempotent)."""
        if not self.done:
            self.done = True
            self._owner.abort(self.request_ids)


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        metrics: ServerMetrics | None = None,
        max_queued_requests: int = 256,
        log_interval_s: float = 10.0,
        max_consecutive_step_failures: int = 3,
        max_restarts: int = 3,
        restart_window_s: float = 60.0,
    ) -> None:
        if max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
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
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _num_queued
        self._num_queued = 0  # submitted prompts not yet scheduled for the first time
        self._ids = itertools.count()
        self._groups: dict[str, _Group] = {}  # loop thread only: engine request id -> group
        self._not_started: dict[str, Request] = {}  # loop thread only
        self._stats: EngineStats = engine.stats()  # the loop's latest snapshot
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)

    # -- caller side (asyncio event loop) ----------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stop.is_set()

    def stats(self) -> EngineStats:
        return self._stats

    def submit(
        self,
        prompts: Sequence[PromptSpec],
        cache_salt: str | None = None,
        group_id: str | None = None,
    ) -> RequestStream:
        """Queue a group of prompts; raises QueueFullError / EngineDeadError (nothing queued).

        Prompt i runs as engine request ``{group_id}-{i}`` (samples: ``{group_id}-{i}-{j}``),
        so log lines carry the id the client got back.
        """
        if not self.alive:
            raise EngineDeadError(f"the engine loop has stopped: {self.error!r}")
        with self._lock:
            # an empty queue takes any group, so a batch larger than the bound is not
            # refused forever
            queued = self._num_queued
            if queued > 0 and queued + len(prompts) > self.max_queued_requests:
                raise QueueFullError(
                    f"{self._num_queued} requests are already waiting (the limit is "
                    f"{self.max_queued_requests}); retry later"
                )
            self._num_queued += len(prompts)
        base = group_id or f"group-{next(self._ids)}"
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        stream = RequestStream(self, ids, sum(p.params.n for p in prompts))
        group = _Group(asyncio.get_running_loop(), stream._queue, ids, stream._remaining)
        self._commands.put(("add", group, list(prompts), cache_salt))
        self._wake.set()
        if self.error is not None:  # died meanwhile: its last drain may have missed this add
            group.put(ErrorEvent(f"the engine loop died: {self.error!r}", 500))
        return stream

    def abort(self, request_ids: Sequence[str]) -> None:
        self._commands.put(("abort", list(request_ids)))
        self._wake.set()

    # -- loop thread -------------------------------------------------------------------------
    def _serve(self) -> None:
        engine = self.engine
        last_log = time.monotonic()
        busy_since_log = False
        while not self._stop.is_set():
            self._drain_commands()
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
            self._stats = engine.stats()
            now = time.monotonic()
            if busy_since_log and now - last_log >= self.log_interval_s:
                self._log_stats()
                last_log, busy_since_log = now, engine.has_unfinished_requests()

    # -- faults (loop thread) ------------------------------------------------------------------
    def _run(self) -> None:
        """Serve; restart on an exception that escaped the engine's containment or on steps
        failing in a row; die past ``max_restarts`` restarts within ``restart_window_s``, on a
        restart that fails, or on KeyboardInterrupt / SystemExit."""
        restarts: deque[float] = deque()  # monotonic times of the recent restarts
        while True:
            try:
                self._serve()
                return  # shut down
            except Exception as e:  # noqa: BLE001 - every failure restarts or kills the loop
                now = time.monotonic()
                while restarts and now - restarts[0] > self.restart_window_s:
                    restarts.popleft()
                if len(restarts) >= self.max_restarts:
                    logger.error(
                        "the engine loop failed %d times within %.0f s; giving up",
                        len(restarts) + 1, self.restart_window_s,
                    )  # fmt: skip
                    self._die(e)
                    return
                restarts.append(now)
                try:
                    self._restart(e)
                except Exception as broken:  # noqa: BLE001 - a loop that cannot restart dies
                    self._die(broken)
                    return
            except BaseException as e:  # noqa: BLE001 - whatever killed the loop goes to every stream
                self._die(e)
                return

    def _check_step_failures(self) -> None:
        failures = self.engine.consecutive_step_failures
        if failures >= self.max_consecutive_step_failures:
            raise RepeatedStepFailure(f"{failures} engine steps in a row failed")

    def _restart(self, error: Exception) -> None:
        """Fail every request in flight, rebuild the engine's KV state, serve again. Commands
        not drained yet (adds, aborts) stay queued and run after the restart."""
        message = f"the engine loop restarted after: {describe(error)}"
        groups = {id(g): g for g in self._groups.values()}
        logger.error(
            "%s; failing %d request groups in flight", message, len(groups), exc_info=error
        )
        for group in groups.values():
            group.put(ErrorEvent(message, 500))
        self._groups.clear()
        for rid in list(self._not_started):
            self._forget_not_started(rid)
        self.engine.fail_all(message)  # their outputs are not needed: the groups have the error
        self.num_restarts += 1
        self._stats = self.engine.stats()

    def _die(self, e: BaseException) -> None:
        self.error = e
        logger.error("the engine loop died", exc_info=e)
        groups = {id(g): g for g in self._groups.values()}
        while True:  # adds that raced the death would otherwise wait forever
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                groups[id(command[1])] = command[1]
        for group in groups.values():
            group.put(ErrorEvent(f"the engine loop died: {e!r}", 500))
        self._groups.clear()

    def _fail_group(self, group: _Group, out: RequestOutput) -> None:
        """A sample failed in the engine (its step raised): the whole group ends with an
        ErrorEvent naming the failure (in-band on a stream, a JSON 500 otherwise) and its other
        prompts are aborted."""
        for rid in group.request_ids:
            if self._groups.pop(rid, None) is not None:
                self._forget_not_started(rid)
                self.engine.abort_request(rid)
        logger.warning("request %s failed: %s", out.request_id, out.error)
        group.put(ErrorEvent(f"request {out.request_id} failed in the engine: {out.error}", 500))

    # -- commands and delivery (loop thread) ------------------------------------------------------

    def _drain_commands(self) -> None:
        engine = self.engine
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, group, prompts, cache_salt = command
                self._add(group, prompts, cache_salt)
            else:
                for rid in command[1]:
                    if self._groups.pop(rid, None) is not None:
                        self._forget_not_started(rid)
                        engine.abort_request(rid)
                        logger.info("request %s aborted", rid)

    def _add(self, group: _Group, prompts: list[PromptSpec], cache_salt: str | None) -> None:
        added = []
        try:
            for rid, p in zip(group.request_ids, prompts, strict=True):
                req = self.engine.add_request(p.prompt_token_ids, p.params, rid, cache_salt)
                self._groups[rid] = group
                self._not_started[rid] = req
                added.append(rid)
        except ValueError as e:  # checked by the handler already; a last line of defence
            for rid in added:
                self._groups.pop(rid, None)
                self._forget_not_started(rid)
                self.engine.abort_request(rid)
            with self._lock:
                self._num_queued -= len(prompts) - len(added)
            group.put(ErrorEvent(str(e), 400))

    def _forget_not_started(self, rid: str) -> None:
        if self._not_started.pop(rid, None) is not None:
            with self._lock:
                self._num_queued -= 1

    def _note_started(self) -> None:
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
            self._observe(group, out, now)
            group.put(OutputEvent(group.request_ids.index(rid), out))
            if out.finished:
                group.expected -= 1
                self._log_finished(out)
                if group.expected == 0:
                    for r in group.request_ids:
                        self._groups.pop(r, None)
                    if self.metrics is not None:
                        self.metrics.e2e_latency.observe(now - group.arrival)

    def _observe(self, group: _Group, out: RequestOutput, now: float) -> None:
        if self.metrics is None or not out.new_token_ids:
            return
        prev = group.last_token_at.get(out.request_id)
        if prev is None:
            if out.ttft_s is not None:
                self.metrics.ttft.observe(out.ttft_s)
        else:
            self.metrics.inter_token_latency.observe(now - prev)
        group.last_token_at[out.request_id] = now
        if out.finished:
            self.metrics.request_finished(out.finish_reason)

    def _log_finished(self, out: RequestOutput) -> None:
        def ms(s: float | None) -> str:
            return "-" if s is None else f"{s * 1e3:.0f} ms"

        logger.info(
            "request %s finished (%s): prompt %d tokens (%d cached), generated %d; "
            "queue %s, TTFT %s, decode %s",
            out.request_id,
            out.finish_reason,
            len(out.prompt_token_ids),
            out.num_cached_tokens,
            len(out.token_ids),
            ms(out.queue_time_s),
            ms(out.ttft_s),
            ms(out.decode_time_s),
        )

    def _log_stats(self) -> None:
        s = self._stats
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        logger.info(
            "running %d, waiting %d, KV cache usage %.1f%% (%d/%d blocks), prefix cache hit "
            "rate %.1f%%, %d preemptions",
            s.num_running,
            s.num_waiting,
            100 * s.kv_cache_usage,
            s.num_used_blocks,
            s.num_blocks,
            100 * hit_rate,
            s.num_preemptions,
        )
