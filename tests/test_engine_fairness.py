"""Fairness under the "priority" policy with a real (tiny, random) model: a batch member
preempted for an interactive request resumes and yields exactly the tokens it yields alone (the
no-cache reference's), and through the AsyncEngine a chat that arrives while a batch holds
every seat is fed and admitted at the next step (the scheduler's rules, step by step, are in
test_scheduler_fairness.py)."""

from __future__ import annotations

import asyncio

import pytest
from conftest import make_hf_checkpoint, random_token_ids
from test_async_engine import assert_no_leaks, drain, params
from test_async_feed import SteppedLoop
from test_scheduler_stateful import make_scheduler

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.request import Request, RequestClass, RequestStatus
from kvserve.models.model_session import ModelSession
from kvserve.reference.decoders import DenseCacheDecoder
from kvserve.reference.generation import generate
from kvserve.sampling import SamplingParams
from kvserve.server.async_engine import AsyncEngine, PromptSpec
from kvserve.server.preempt_room import PreemptRoom


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> ModelSession:
    path, _ = make_hf_checkpoint(tmp_path_factory.mktemp("fair"), "llama", num_key_value_heads=2)
    return ModelSession.open(path, "float32", "cpu")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def reference_tokens(session: ModelSession, prompt: list[int], max_tokens: int) -> list[int]:
    decoder = DenseCacheDecoder(session.model, len(prompt) + max_tokens)
    return generate(decoder, prompt, greedy(max_tokens)).token_ids


def make_engine(session: ModelSession, max_num_seqs: int = 2) -> LLMEngine:
    return LLMEngine.from_session(
        session,
        CacheConfig(num_blocks=64, block_size=4),
        SchedulerConfig(max_num_seqs=max_num_seqs, scheduling_policy="priority"),
        enforce_eager=True,
    )


def test_a_batch_member_preempted_for_a_chat_resumes_with_the_same_tokens(
    session: ModelSession,
) -> None:
    """2 seats, both a batch's (11 and 9 tokens, 12 to generate). After 3 steps a chat
    arrives: the next step admits it by preempting b1 (3 tokens generated); b1 comes back
    when the chat is done. Every request's tokens are the reference's."""
    engine = make_engine(session)
    prompts = [random_token_ids(n, seed=80 + n) for n in (11, 9)]
    batch = [
        engine.add_request(p, greedy(12), f"b{k}", priority=k, request_class=RequestClass.BATCH)
        for k, p in enumerate(prompts)
    ]
    for _ in range(3):
        engine.step()
    chat_prompt = random_token_ids(6, seed=90)
    chat = engine.add_request(chat_prompt, greedy(4), "chat", tenant="someone")
    engine.step()
    assert chat.status is RequestStatus.RUNNING and chat.num_output_tokens == 1
    assert batch[1].status is RequestStatus.PREEMPTED and batch[1].num_output_tokens == 3
    assert [r.num_preemptions for r in (*batch, chat)] == [0, 1, 0]
    while engine.has_unfinished_requests():
        engine.step()
    assert chat.output_token_ids == reference_tokens(session, chat_prompt, 4)
    for prompt, r in zip(prompts, batch, strict=True):
        assert r.output_token_ids == reference_tokens(session, prompt, 12), r.request_id
    assert chat.finished_time < batch[1].finished_time
    engine.check_integrity()
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_blocks


def test_a_chat_is_fed_and_admitted_beside_a_batch_that_holds_every_seat(
    session: ModelSession,
) -> None:
    """4 seats, a 4-prompt batch holding them (40 tokens each to generate). A chat submitted
    while the loop is held in step 3 is fed to the full engine before step 4 and admitted in
    step 4, preempting the batch's last prompt; its tenant is the one its spec names."""
    engine = make_engine(session, max_num_seqs=4)
    stepped = SteppedLoop(engine)
    loop = AsyncEngine(engine, max_queued_requests=100)
    loop.start()

    async def main() -> None:
        batch = loop.submit(
            [PromptSpec([5 + k, 6, 7], params(40)) for k in range(4)], group_id="big"
        )
        await stepped.release_until_step(3)
        assert stepped.fed == [f"big-{k}" for k in range(4)]
        assert len(engine.scheduler.running) == 4
        chat = loop.submit([PromptSpec([9, 8, 7], params(2), tenant="t")], group_id="chat")
        await stepped.release_until_step(4)
        assert stepped.fed[4:] == ["chat-0"]  # fed to the full engine (4 running)
        req = engine.scheduler.requests["chat-0"]
        assert (req.request_class, req.tenant) == (RequestClass.INTERACTIVE, "t")
        assert req.first_scheduled_time is None and len(engine.scheduler.running) == 4
        await stepped.release_until_step(5)
        assert req.first_scheduled_time is not None  # admitted in step 4
        assert engine.scheduler.requests["big-3"].num_preemptions == 1
        assert engine.scheduler.requests["big-0"].request_class is RequestClass.BATCH
        stepped.free = True
        stepped.gate.release()
        await drain(chat)
        await drain(batch)

    try:
        asyncio.run(main())
    finally:
        stepped.free = True
        stepped.gate.release()
        loop.shutdown()
    assert_no_leaks(engine)


def test_a_full_engine_is_fed_only_what_will_preempt_for_its_seat() -> None:
    """4 seats held by tenant A's batch, one chat already waiting: 3 more chats may be fed
    (one per batch seat no waiting chat takes), then none; tenant B's batch prompts while B
    runs two or more sequences fewer than A (0, 1, 2 fed; a 4th would make 3 + 1 = A's 4)."""
    sched = make_scheduler(num_blocks=64, max_num_seqs=4, scheduling_policy="priority")
    for k in range(4):
        r = Request(f"a{k}", [k, 1], greedy(4), request_class=RequestClass.BATCH, tenant="A")
        sched.add_request(r)
    sched.schedule()
    sched.add_request(Request("chat", [7, 7], greedy(4)))
    room = PreemptRoom.of(sched)
    assert (room.spare_batch, room.loads) == (3, {"A": 4, None: 1})
    assert [room.take(RequestClass.INTERACTIVE, None, 1) for _ in range(4)] == [True] * 3 + [False]
    assert [room.take(RequestClass.BATCH, "B", 1) for _ in range(4)] == [True] * 3 + [False]
    assert not room.take(RequestClass.BATCH, "A", 1)
