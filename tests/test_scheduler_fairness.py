"""Fairness under the "priority" policy (engine/fairness.py), step by step: an interactive
request that finds every seat (or every block) held by batch members is admitted at the next
step by preempting the most recently admitted one; a tenant's n = 64 request gives a seat to
another tenant's request at the next step; a batch never preempts its own tenant. Scheduler +
KVCacheManager without a model (the fake model of test_scheduler_stateful.py checks every read
of every recomputed request); the exact tokens through the engine are in
test_engine_fairness.py."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import rule
from test_scheduler_stateful import (
    PREFIXES,
    VOCAB,
    FakeModel,
    SchedulerMachine,
    assert_all_free,
    check_scheduler_state,
    make_scheduler,
    run_step,
)

from kvserve.engine.fairness import order_fairly, outranks, tenant_loads
from kvserve.engine.request import Request, RequestClass, RequestStatus
from kvserve.engine.scheduler import Scheduler
from kvserve.sampling import SamplingParams

INTERACTIVE, BATCH = RequestClass.INTERACTIVE, RequestClass.BATCH


def req(
    rid: str,
    n_prompt: int,
    klass: RequestClass,
    tenant: str | None = None,
    priority: int = 0,
    max_tokens: int = 20,
    n: int = 1,
    seed: int = 0,
) -> Request:
    return Request(
        rid,
        [seed * 100 + i for i in range(n_prompt)],  # distinct prompts: no shared prefix
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n),
        priority=priority,
        request_class=klass,
        tenant=tenant,
    )


def step(sched: Scheduler, model: FakeModel) -> tuple[dict[str, int], list[str]]:
    out = run_step(sched, model, itertools.repeat(1))
    check_scheduler_state(sched, model)
    return {s.request_id: s.num_new_tokens for s in out.scheduled}, out.preempted


def drain(sched: Scheduler, model: FakeModel) -> None:
    for _ in range(500):
        if not sched.has_unfinished():
            break
        step(sched, model)
    assert not sched.has_unfinished()
    assert_all_free(sched.kv)


def fork(sched: Scheduler, parent: Request) -> list[Request]:
    """What the engine does after an n > 1 request's first token (LLMEngine._fork)."""
    children = []
    for i in range(1, parent.sampling_params.n):
        child = Request(
            f"{parent.request_id}-{i}",
            parent.prompt_token_ids,
            parent.sampling_params,
            arrival_time=parent.arrival_time,
            priority=parent.priority,
            request_class=parent.request_class,
            tenant=parent.tenant,
            all_token_ids=list(parent.all_token_ids),
            parent_id=parent.request_id,
            sample_index=i,
            forked=True,
        )
        sched.add_fork(parent, child)
        children.append(child)
    parent.forked = True
    return children


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_interactive_arrival_takes_a_full_batchs_newest_seat(policy: str) -> None:
    """4 seats, all held by a batch's prompts (8 tokens, 20 to generate). A chat arrives after
    the batch's prefill step. priority: the next step admits it (its 5 prompt tokens) and
    preempts the batch's last prompt (b3); b3 comes back when the chat is done and completes.
    fcfs: the chat waits for a batch prompt to finish (20 steps of decodes)."""
    sched = make_scheduler(num_blocks=64, max_num_seqs=4, max_batched=64, scheduling_policy=policy)
    model = FakeModel(sched)
    batch = [req(f"b{k}", 8, BATCH, priority=k, seed=k) for k in range(4)]
    for r in batch:
        sched.add_request(r)
    assert step(sched, model) == ({"b0": 8, "b1": 8, "b2": 8, "b3": 8}, [])
    chat = req("chat", 5, INTERACTIVE, max_tokens=3, seed=7)
    sched.add_request(chat)
    scheduled, preempted = step(sched, model)
    if policy == "fcfs":
        assert (scheduled, preempted) == ({"b0": 1, "b1": 1, "b2": 1, "b3": 1}, [])
        steps = 2
        while chat.first_scheduled_time is None:
            step(sched, model)
            steps += 1
        assert steps == 21  # b0..b3 finish their 20 tokens at step 20
        drain(sched, model)
        return
    assert (scheduled, preempted) == ({"b0": 1, "b1": 1, "b2": 1, "chat": 5}, ["b3"])
    assert batch[3].status is RequestStatus.PREEMPTED and batch[3].num_output_tokens == 1
    # the chat decodes its other 2 tokens; b3 waits (a batch never preempts a chat)
    assert step(sched, model) == ({"b0": 1, "b1": 1, "b2": 1, "chat": 1}, [])
    assert step(sched, model) == ({"b0": 1, "b1": 1, "b2": 1, "chat": 1}, [])
    assert chat.status is RequestStatus.FINISHED_LENGTH
    # b3 is back: its 8 prompt tokens hit the prefix cache (its own blocks, freed but still
    # cached), so only its 1 output token is recomputed before it samples its second
    assert step(sched, model) == ({"b0": 1, "b1": 1, "b2": 1, "b3": 1}, [])
    assert batch[3].num_cached_tokens == 0  # its first admission's hit, kept
    drain(sched, model)
    assert [r.num_output_tokens for r in batch] == [20] * 4
    assert [r.num_preemptions for r in batch] == [0, 0, 0, 1]


def test_interactive_arrival_preempts_for_blocks_when_seats_are_free() -> None:
    """8 blocks of 4, 2 seats of 4 free: two batch prompts of 16 tokens hold every block. A
    chat of 5 tokens (2 blocks) preempts the newer batch prompt for its blocks."""
    sched = make_scheduler(
        num_blocks=8, max_num_seqs=4, max_batched=64, scheduling_policy="priority"
    )
    model = FakeModel(sched)
    b0 = req("b0", 15, BATCH, max_tokens=4, seed=0)
    b1 = req("b1", 15, BATCH, priority=1, max_tokens=4, seed=1)
    sched.add_request(b0)
    sched.add_request(b1)
    assert step(sched, model) == ({"b0": 15, "b1": 15}, [])
    assert sched.kv.pool.num_free_blocks == 0
    chat = req("chat", 5, INTERACTIVE, max_tokens=2, seed=5)
    sched.add_request(chat)
    assert step(sched, model) == ({"b0": 1, "chat": 5}, ["b1"])
    drain(sched, model)
    assert chat.num_preemptions == 0 and b1.num_preemptions == 1


def test_interactive_requests_do_not_preempt_each_other() -> None:
    """4 seats held by chats: a fifth chat waits for a seat (the same class, one tenant)."""
    sched = make_scheduler(
        num_blocks=64, max_num_seqs=4, max_batched=64, scheduling_policy="priority"
    )
    model = FakeModel(sched)
    for k in range(4):
        sched.add_request(req(f"c{k}", 4, INTERACTIVE, max_tokens=3, seed=k))
    step(sched, model)
    late = req("late", 4, INTERACTIVE, max_tokens=3, seed=9)
    sched.add_request(late)
    assert step(sched, model) == ({f"c{k}": 1 for k in range(4)}, [])
    assert step(sched, model) == ({f"c{k}": 1 for k in range(4)}, [])
    assert step(sched, model) == ({"late": 4}, [])  # the chats are done: a seat is free
    drain(sched, model)


@pytest.mark.parametrize(
    "other, admitted",
    [
        (("B", INTERACTIVE), True),  # another tenant's chat
        (("B", BATCH), True),  # another tenant's batch prompt: fair share
        (("A", BATCH), False),  # the same tenant's batch waits its turn
        ((None, BATCH), True),  # a request without a tenant is a tenant of its own
    ],
)
def test_a_tenants_n64_gives_another_tenant_a_seat_at_the_next_step(
    other: tuple[str | None, RequestClass], admitted: bool
) -> None:
    """64 seats: tenant A's n = 64 request is prefilled, then forked into 64 samples that
    hold every seat. The other request, arriving then, is admitted at the very next step by
    preempting A's most recent sample (a-63), unless it is A's own batch."""
    sched = make_scheduler(
        num_blocks=256, max_num_seqs=64, max_batched=128, scheduling_policy="priority"
    )
    model = FakeModel(sched)
    a = req("a", 8, BATCH, tenant="A", n=64, max_tokens=6)
    sched.add_request(a)
    assert step(sched, model) == ({"a": 8}, [])
    children = fork(sched, a)
    assert len(sched.running) == 64
    tenant, klass = other
    b = req("b", 6, klass, tenant=tenant, max_tokens=2, seed=1)
    sched.add_request(b)
    scheduled, preempted = step(sched, model)
    if not admitted:
        assert preempted == [] and "b" not in scheduled and len(scheduled) == 64
        drain(sched, model)
        return
    assert preempted == ["a-63"] and scheduled["b"] == 6 and len(scheduled) == 64
    assert children[-1].status is RequestStatus.PREEMPTED
    drain(sched, model)
    assert b.num_output_tokens == 2 and children[-1].num_output_tokens == 6


def test_tenants_are_admitted_round_robin_least_running_first() -> None:
    """The waiting queue's order: interactive first; then per tenant by its projected share
    (what it runs plus what waits before it), ties by priority and arrival."""
    running = [req(f"r{k}", 4, BATCH, tenant="A", priority=k) for k in range(3)]
    loads = tenant_loads(running)
    assert loads == {"A": 3}
    waiting = [
        req("a3", 4, BATCH, tenant="A", priority=3),
        req("a4", 4, BATCH, tenant="A", priority=4),
        req("b0", 4, BATCH, tenant="B", priority=0),
        req("b1", 4, BATCH, tenant="B", priority=1),
        req("b2", 4, BATCH, tenant="B", priority=2),
        req("b3", 4, BATCH, tenant="B", priority=3),
        req("chat", 4, INTERACTIVE, tenant="A"),
    ]
    order = [r.request_id for r in order_fairly(waiting, loads)]
    # shares: chat 3 (A runs 3); b0..b3 0..3; a3 4 (A's 3 + the chat), a4 5
    assert order == ["chat", "b0", "b1", "b2", "b3", "a3", "a4"]
    assert outranks(waiting[2], running[0], {"A": 3, "B": 1})  # 1 + 1 < 3
    assert not outranks(waiting[2], running[0], {"A": 3, "B": 2})  # 2 + 1 == 3: no swap


class FairSchedulerMachine(SchedulerMachine):
    """The scheduler's invariants (every read is the request's own tokens, blocks and queues
    consistent, everything drains) with requests of both classes from three tenants, so that
    admissions preempt running requests (and are preempted in turn) all the time."""

    CONFIG = {"scheduling_policy": "priority", "max_prefill_tokens_with_decodes": 5}

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, VOCAB - 1), max_size=40),
        max_tokens=st.integers(1, 8),
        priority=st.integers(0, 3),
        klass=st.sampled_from([INTERACTIVE, BATCH]),
        tenant=st.sampled_from([None, "A", "B"]),
    )
    def add_fair_request(self, prefix, tail, max_tokens, priority, klass, tenant):
        rid = f"r{next(self.ids)}"
        req = Request(
            rid,
            (prefix + tail)[:40] or [0],
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            cache_salt=None if tenant is None else "a",  # the salts the event replay knows
            priority=priority,
            request_class=klass,
            tenant=tenant,
        )
        self.sched.add_request(req)
        self.all_requests[rid] = req


FairSchedulerMachine.TestCase.settings = SchedulerMachine.TestCase.settings
TestFairScheduler = FairSchedulerMachine.TestCase


def test_the_prefill_cap_bounds_batch_prefill_beside_decodes() -> None:
    sched = make_scheduler(
        num_blocks=256,
        max_num_seqs=16,
        max_batched=512,
        scheduling_policy="priority",
        max_prefill_tokens_with_decodes=32,
    )
    model = FakeModel(sched)
    sched.add_request(req("decoding", 4, BATCH, seed=1))
    step(sched, model)
    sched.add_request(req("batch0", 20, BATCH, seed=30))
    sched.add_request(req("batch1", 20, BATCH, seed=31))
    scheduled, _ = step(sched, model)
    assert scheduled == {"decoding": 1, "batch0": 20, "batch1": 12}
    drain(sched, model)
