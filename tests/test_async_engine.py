"""AsyncEngine and the engine's abort, driven directly (no HTTP): admission counted in
sequences, round-robin feeding, O(batch) abort, backpressure, and the health verdict.

The loop thread is held inside a step (a patched ``step`` waiting on an Event) wherever a
test needs the commands to pile up before the loop drains them, so every count is exact.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from conftest import make_hf_checkpoint

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.request import RequestStatus
from kvserve.models.model_session import ModelSession
from kvserve.sampling import RequestOutputKind, SamplingParams
from kvserve.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    ErrorEvent,
    OutputEvent,
    PromptSpec,
    QueueFullError,
)
from kvserve.server.engine_records import Health


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> ModelSession:
    path, _ = make_hf_checkpoint(tmp_path_factory.mktemp("async"), "llama")
    return ModelSession.open(path, "float32", "cpu")


def make_engine(session: ModelSession, max_num_seqs: int = 4, num_blocks: int = 256) -> LLMEngine:
    return LLMEngine.from_session(
        session,
        CacheConfig(num_blocks=num_blocks, block_size=4),
        SchedulerConfig(max_num_seqs=max_num_seqs),
        enforce_eager=True,
    )


def params(max_tokens: int = 1, n: int = 1) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        n=n,
        temperature=0.0 if n == 1 else 1.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )


def spec(max_tokens: int = 1, n: int = 1, prompt: tuple[int, ...] = (5, 6, 7)) -> PromptSpec:
    return PromptSpec(list(prompt), params(max_tokens, n))


class HeldStep:
    """Patches ``engine.step`` so that the loop blocks inside a step until released; records
    the engine's queue sizes at every step."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.real = engine.step
        self.release = threading.Event()
        self.entered = threading.Event()
        self.in_engine: list[int] = []  # waiting + running sequences at each step
        engine.step = self.step

    def step(self):
        self.entered.set()
        self.release.wait(30)
        sched = self.engine.scheduler
        self.in_engine.append(len(sched.waiting) + len(sched.running))
        return self.real()


def assert_no_leaks(engine: LLMEngine) -> None:
    engine.check_integrity()
    pool = engine.kv_manager.pool
    assert not engine.has_unfinished_requests()
    assert pool.num_free_blocks == pool.num_blocks
    assert engine.scheduler.requests == {} and engine.scheduler.children == {}


async def drain(stream) -> list:
    return [event async for event in stream]


async def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


# -- the engine's abort -------------------------------------------------------------------------


def test_abort_of_a_16k_prompt_batch_is_one_pass(session: ModelSession) -> None:
    engine = make_engine(session, num_blocks=64)
    ids = [f"b-{i}" for i in range(16000)]
    for rid in ids:
        engine.add_request([5, 6, 7], params(max_tokens=5), rid)
    engine.step()  # four of them run, holding blocks; the rest wait
    assert len(engine.scheduler.running) == 4 and len(engine.scheduler.waiting) == 15996
    t0 = time.perf_counter()
    assert engine.abort_requests(ids) == 16000
    elapsed = time.perf_counter() - t0
    print(f"abort of 16k requests: {elapsed * 1e3:.1f} ms")
    assert elapsed < 1.0  # ~20 ms here; the bound is 100 ms, 10x margin for CI
    assert_no_leaks(engine)


def test_aborting_a_parent_id_aborts_its_samples_after_sample_0_finished(
    session: ModelSession,
) -> None:
    engine = make_engine(session)
    engine.add_request([5, 6, 7], params(max_tokens=40, n=3), "p")
    engine.step()  # the prompt is cached: samples p-1, p-2 are forked
    assert sorted(engine.scheduler.children) == ["p"]
    engine.scheduler.finish(engine.scheduler.requests["p"], RequestStatus.FINISHED_STOPPED)
    assert [c.request_id for c in engine.scheduler.children["p"]] == ["p-1", "p-2"]
    assert engine.abort_request("p") is True
    assert_no_leaks(engine)
    assert engine.abort_request("p") is False


# -- admission ----------------------------------------------------------------------------------


def test_the_bound_counts_sequences_where_requests_enter(session: ModelSession) -> None:
    engine = make_engine(session)
    held = HeldStep(engine)
    loop = AsyncEngine(engine, max_queued_requests=11)
    loop.start()

    async def main() -> None:
        blocker = loop.submit([spec(max_tokens=1)])
        await asyncio.to_thread(held.entered.wait, 10)  # the loop is inside its first step
        assert loop.num_waiting == 1  # scheduled, but the step has not returned yet
        a = loop.submit([spec(n=3), spec(n=3)])  # 6 sequences
        assert loop.num_waiting == 7 and loop.stats().num_waiting == 7
        with pytest.raises(QueueFullError, match="7 sequences are already waiting"):
            loop.submit([spec(n=5)])
        with pytest.raises(ValueError, match="12 sequences"):
            loop.submit([spec()] * 12)
        b = loop.submit([spec(n=2), spec(n=2)])  # fills the bound exactly
        assert loop.num_waiting == 11
        held.release.set()
        for stream, samples in [(blocker, 1), (a, 6), (b, 4)]:
            events = await drain(stream)
            assert sum(e.output.finished for e in events) == samples
        assert loop.num_waiting == 0

    try:
        asyncio.run(main())
        assert_no_leaks(engine)
    finally:
        loop.shutdown()


def test_a_big_batch_is_fed_round_robin_and_keeps_the_engine_queue_small(
    session: ModelSession,
) -> None:
    engine = make_engine(session, max_num_seqs=4)
    held = HeldStep(engine)
    fed: list[str] = []
    real_add = engine.add_request

    priorities: dict[str, int] = {}

    def add_request(prompt, p, rid, salt, priority, **kwargs):
        fed.append(rid)
        priorities[rid] = priority
        return real_add(prompt, p, rid, salt, priority=priority, **kwargs)

    engine.add_request = add_request
    loop = AsyncEngine(engine, max_queued_requests=1000)
    loop.start()

    async def main() -> None:
        blocker = loop.submit([spec()], group_id="blocker")
        await asyncio.to_thread(held.entered.wait, 10)
        big = loop.submit([spec()] * 200, group_id="big")
        small = loop.submit([spec(), spec()], group_id="small")
        held.release.set()
        await drain(blocker)
        small_events = await drain(small)
        big_events = await drain(big)
        assert [e.prompt_index for e in small_events] == [0, 1]
        assert sorted(e.prompt_index for e in big_events) == list(range(200))

    try:
        asyncio.run(main())
    finally:
        loop.shutdown()
    # one prompt per group per turn, only as many as the next step can seat (4)
    assert fed[:6] == ["blocker-0", "big-0", "small-0", "big-1", "small-1", "big-2"]
    assert fed[6:] == [f"big-{i}" for i in range(3, 200)]
    assert max(held.in_engine) == 4  # never more than max_num_seqs in the engine
    # each prompt's priority is its index in its group: batches yield to single requests
    assert priorities == {rid: int(rid.rsplit("-", 1)[1]) for rid in fed}
    assert priorities["big-199"] == 199 and priorities["small-1"] == 1
    assert_no_leaks(engine)


def test_aborting_a_16k_prompt_group_returns_its_place_at_once(session: ModelSession) -> None:
    engine = make_engine(session)
    held = HeldStep(engine)
    loop = AsyncEngine(engine, max_queued_requests=20000)
    loop.start()

    async def main() -> float:
        blocker = loop.submit([spec()])
        await asyncio.to_thread(held.entered.wait, 10)
        big = loop.submit([spec()] * 16000)
        held.release.set()
        await wait_until(lambda: len(engine.scheduler.running) > 0)  # part of it runs
        t0 = time.perf_counter()
        big.abort()
        await wait_until(lambda: loop.num_waiting == 0 and not engine.has_unfinished_requests())
        elapsed = time.perf_counter() - t0
        await drain(blocker)
        return elapsed

    try:
        elapsed = asyncio.run(main())
    finally:
        loop.shutdown()
    print(f"abort of a 16k-prompt group: {elapsed * 1e3:.1f} ms")
    assert elapsed < 1.0  # a few ms here: the unfed prompts never reach the engine
    assert_no_leaks(engine)


# -- backpressure and health --------------------------------------------------------------------


def test_a_stream_nobody_reads_is_aborted_at_its_buffer_bound(session: ModelSession) -> None:
    engine = make_engine(session)
    loop = AsyncEngine(engine, max_stream_buffer_events=4)
    loop.start()

    async def main() -> list:
        stream = loop.submit([spec(max_tokens=100)])
        # nobody reads: the loop aborts once more than 4 events are unread. Wait for the
        # loop thread to close the group, not for an idle engine: the engine is idle too
        # before the loop has fed the request, and reading then would never fall behind.
        group = stream._group
        await wait_until(lambda: group.done and not engine.has_unfinished_requests())
        await asyncio.sleep(0.05)  # let the last call_soon_threadsafe land
        return await drain(stream)

    try:
        events = asyncio.run(main())
    finally:
        loop.shutdown()
    assert [type(e) for e in events] == [OutputEvent] * 5 + [ErrorEvent]
    assert "stopped reading: 5 events unread, the limit is 4" in events[-1].message
    assert sum(len(e.output.new_token_ids) for e in events[:-1]) == 5
    assert loop.num_waiting == 0
    assert_no_leaks(engine)


def test_health_is_wedged_during_a_stalled_step_and_dead_after_a_crash(
    session: ModelSession,
) -> None:
    engine = make_engine(session)
    held = HeldStep(engine)
    # max_restarts=0: the first escaped exception kills the loop (restarts: test_server_faults)
    loop = AsyncEngine(engine, health_stall_timeout_s=0.2, max_restarts=0)
    loop.start()

    async def main() -> None:
        assert loop.health().state is Health.OK
        stream = loop.submit([spec(max_tokens=2)])
        await asyncio.to_thread(held.entered.wait, 10)
        await asyncio.sleep(0.4)
        status = loop.health()
        assert status.state is Health.WEDGED
        assert "the limit is 0.2 s, --health-stall-timeout-s" in status.message
        held.release.set()
        await drain(stream)
        assert loop.health().state is Health.OK

        def crash():
            raise RuntimeError("simulated")

        engine.step = crash
        events = await drain(loop.submit([spec()]))
        assert isinstance(events[-1], ErrorEvent) and "simulated" in events[-1].message
        status = loop.health()
        assert status.state is Health.DEAD and "simulated" in status.message

    try:
        asyncio.run(main())
    finally:
        loop.shutdown()


def test_flush_prefix_cache_runs_on_the_loop_thread(session: ModelSession) -> None:
    engine = make_engine(session)
    loop = AsyncEngine(engine, max_queued_requests=10)
    loop.start()

    async def main() -> None:
        await drain(loop.submit([spec(prompt=tuple(range(5, 14)))]))  # 9 tokens: 2 full blocks
        assert await loop.flush_prefix_cache() == 2
        assert await loop.flush_prefix_cache() == 0
        assert engine.kv_manager.pool.cached == {}

    try:
        asyncio.run(main())
    finally:
        loop.shutdown()
    assert_no_leaks(engine)
    with pytest.raises(EngineDeadError, match="stopped"):
        asyncio.run(loop.flush_prefix_cache())
