"""The AsyncEngine's feeder (server/feeding.py) driven step by step: what it hands the engine
under fcfs and under priority while a batch's prompts are fed but not yet started."""

from __future__ import annotations

import asyncio
import threading

import pytest
from conftest import make_hf_checkpoint
from test_async_engine import assert_no_leaks, drain, spec, wait_until

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.engine.engine import LLMEngine
from kvserve.models.model_session import ModelSession
from kvserve.server.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> ModelSession:
    path, _ = make_hf_checkpoint(tmp_path_factory.mktemp("feed"), "llama")
    return ModelSession.open(path, "float32", "cpu")


class SteppedLoop:
    """Patches ``engine.step`` so that each step waits for its own ``release()``; records
    the ids the loop feeds to the engine, in order."""

    def __init__(self, engine: LLMEngine) -> None:
        self.real_step, self.real_add = engine.step, engine.add_request
        self.gate = threading.Semaphore(0)
        self.steps = 0
        self.held_at: int | None = None  # the step the loop waits to enter, if it waits
        self.free = False  # set: steps run without waiting
        self.fed: list[str] = []
        engine.step, engine.add_request = self.step, self.add_request

    def step(self):
        self.steps += 1
        if not self.free:
            self.held_at = self.steps
            self.gate.acquire(timeout=30)
        return self.real_step()

    def add_request(self, prompt, p, rid, salt, priority, **kwargs):
        self.fed.append(rid)
        return self.real_add(prompt, p, rid, salt, priority=priority, **kwargs)

    async def release_until_step(self, n: int) -> None:
        """Let steps run, one at a time, until the loop is held entering step ``n``."""
        while True:
            await wait_until(lambda: self.held_at is not None)
            if self.held_at >= n:
                return
            self.held_at = None
            self.gate.release()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_batchs_unstarted_prompts_hold_out_a_single_request_only_under_fcfs(
    session: ModelSession, policy: str
) -> None:
    """Budget 8 with 4 prefill tokens beside a decode: the engine starts a 6-token batch
    prompt per step or two while the loop feeds them as the budget allows. A single request
    that arrives when one fed batch prompt is still unstarted: fcfs counts it against the
    budget (6 + the next batch prompt's 6 >= 8, so the request waits a turn); priority counts
    only prompts that the engine would run before it (none), so it is fed at once."""
    engine = LLMEngine.from_session(
        session,
        CacheConfig(num_blocks=256, block_size=4),
        SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=8,
            scheduling_policy=policy,
            max_prefill_tokens_with_decodes=4,
        ),
        enforce_eager=True,
    )
    stepped = SteppedLoop(engine)
    loop = AsyncEngine(engine, max_queued_requests=100)
    loop.start()

    async def main() -> None:
        blocker = loop.submit([spec(max_tokens=20)], group_id="blocker")  # decodes throughout
        await stepped.release_until_step(1)  # held in step 1 (the blocker's prefill)
        big = loop.submit([spec(prompt=(1, 2, 3, 4, 5, 6))] * 6, group_id="big")
        # fed before step 2: big-0, big-1 (12 >= 8 tokens); step 2 starts big-0 (4 of its 6
        # tokens beside the blocker's decode); fed before step 3: big-2 (big-1's 6 + 6)
        await stepped.release_until_step(3)
        assert stepped.fed == ["blocker-0", "big-0", "big-1", "big-2"]
        small = loop.submit([spec(prompt=(9, 8, 7))], group_id="small")
        # step 3 starts big-1; before step 4, big-2 is fed and unstarted
        await stepped.release_until_step(4)
        if policy == "fcfs":
            assert stepped.fed[4:] == ["big-3"]  # small waits: 6 + 6 tokens are ahead of it
        else:
            assert stepped.fed[4:] == ["big-3", "small-0"]
        stepped.free = True
        stepped.gate.release()
        await drain(small)
        await drain(big)
        await drain(blocker)

    try:
        asyncio.run(main())
    finally:
        stepped.free = True
        stepped.gate.release()
        loop.shutdown()
    assert_no_leaks(engine)
