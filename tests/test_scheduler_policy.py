"""What each step holds: the prefill cap beside decodes, decodes before prefill chunks, and
the priority policy's order. Scheduler + KVCacheManager without a model (the fake model of
test_scheduler_stateful.py checks every read); exact tokens through the engine are tested in
test_engine.py."""

from __future__ import annotations

import itertools

import pytest
from test_scheduler_stateful import FakeModel, SchedulerMachine, drain, make_scheduler, run_step

from kvserve.config import SchedulerConfig
from kvserve.engine.request import Request
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.sampling import SamplingParams


def req(rid: str, n: int, max_tokens: int = 4, priority: int = 0) -> Request:
    return Request(
        rid,
        [i % 3 for i in range(n)],
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        priority=priority,
    )


def sched_for(**config: object) -> tuple[Scheduler, FakeModel]:
    # no prefix caching: equal prompts neither hit nor defer each other here
    sched = make_scheduler(num_blocks=64, enable_prefix_caching=False, **config)
    return sched, FakeModel(sched)


def step(sched: Scheduler, model: FakeModel) -> dict[str, int]:
    out: SchedulerOutput = run_step(sched, model, itertools.repeat(1))
    return {s.request_id: s.num_new_tokens for s in out.scheduled}


@pytest.mark.parametrize("cap, chunk", [(None, 40), (8, 8)])
def test_prefill_beside_decodes_is_capped(cap: int | None, chunk: int) -> None:
    """Budget 64: "big" (40 tokens) arrives while "a" decodes. Uncapped it is prefilled in one
    step; with a cap of 8 the steps that carry a's decode take 8 of its tokens each."""
    sched, model = sched_for(max_batched=64, max_prefill_tokens_with_decodes=cap)
    sched.add_request(req("a", 2, max_tokens=8))
    assert step(sched, model) == {"a": 2}
    sched.add_request(req("big", 40))
    assert step(sched, model) == {"a": 1, "big": chunk}
    if cap is not None:
        for _ in range(4):  # 8 + 4 x 8 = 40: the prompt is done in five capped steps
            assert step(sched, model) == {"a": 1, "big": 8}
    assert step(sched, model) == {"a": 1, "big": 1}  # both decode
    drain(sched, model)


def test_a_step_without_decodes_takes_the_whole_budget() -> None:
    sched, model = sched_for(max_batched=64, max_prefill_tokens_with_decodes=8)
    sched.add_request(req("big", 40))
    sched.add_request(req("b2", 20))
    assert step(sched, model) == {"big": 40, "b2": 20}
    drain(sched, model)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_overtakes_a_running_prefill(policy: str) -> None:
    """Budget 8. "low" (priority 5, 40 tokens) is being prefilled when "high" (priority 0)
    arrives. fcfs: low's chunks go on and high waits for the budget. priority: high is
    admitted first, and from then on decodes before low's chunk."""
    sched, model = sched_for(max_batched=8, scheduling_policy=policy)
    sched.add_request(req("low", 40, priority=5))
    assert step(sched, model) == {"low": 8}
    sched.add_request(req("high", 3, max_tokens=3))
    if policy == "fcfs":
        for _ in range(3):
            assert step(sched, model) == {"low": 8}
        assert step(sched, model) == {"low": 8}  # the last 8 of low's 40: budget spent
        assert step(sched, model) == {"low": 1, "high": 3}
    else:
        assert step(sched, model) == {"low": 5, "high": 3}
        assert step(sched, model) == {"high": 1, "low": 7}
        assert step(sched, model) == {"high": 1, "low": 7}  # high's third and last token
        assert step(sched, model) == {"low": 8}  # 8 + 5 + 7 + 7 + 8 = 35
    drain(sched, model)


def first_steps(sched: Scheduler, model: FakeModel) -> list[str]:
    """Request ids in the order they were first scheduled."""
    order: list[str] = []
    while sched.has_unfinished():
        for rid in step(sched, model):
            if rid not in order:
                order.append(rid)
    return order


@pytest.mark.parametrize(
    "policy, expected",
    [("fcfs", ["p2", "p0", "p1", "q0"]), ("priority", ["p0", "q0", "p1", "p2"])],
)
def test_waiting_order(policy: str, expected: list[str]) -> None:
    """One seat: admission order is arrival (fcfs) or (priority, arrival)."""
    sched, model = sched_for(max_num_seqs=1, scheduling_policy=policy)
    for rid, prio in [("p2", 2), ("p0", 0), ("p1", 1), ("q0", 0)]:
        sched.add_request(req(rid, 5, max_tokens=2, priority=prio))
    assert first_steps(sched, model) == expected


def test_config_names_the_allowed_values() -> None:
    with pytest.raises(ValueError, match="fcfs, lpm, priority.*'sjf'"):
        SchedulerConfig(scheduling_policy="sjf")
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes.*0"):
        SchedulerConfig(max_prefill_tokens_with_decodes=0)


class PrioritySchedulerMachine(SchedulerMachine):
    """The same invariants under the server's defaults: the priority policy (a waiting request
    may overtake a running prefill) and a prefill cap beside decodes."""

    CONFIG = {"scheduling_policy": "priority", "max_prefill_tokens_with_decodes": 5}


PrioritySchedulerMachine.TestCase.settings = SchedulerMachine.TestCase.settings
TestPriorityScheduler = PrioritySchedulerMachine.TestCase


def test_priority_step_that_defers_and_preempts_puts_the_preempted_first() -> None:
    """A hypothesis example of the machine above, kept as a case: in one step an admission is
    deferred (its next block is being computed for another request) and a running prefill is
    preempted; the preempted request must go back in front of the deferred one (it went
    behind). The machine's step rule checks the queue after every step, teardown included."""
    state = PrioritySchedulerMachine()
    shared = [2, 2, 1, 1, 0, 0, 2, 2, 1, 1, 0, 0]
    state.add_request(cache_salt=None, max_tokens=1, prefix=[], priority=0, tail=[0, 0, 0])
    state.add_request(cache_salt=None, max_tokens=1, prefix=shared, priority=1, tail=[0] * 17)
    state.step(tokens=[0, 0, 0, 0])
    for _ in range(3):
        state.add_request(cache_salt=None, max_tokens=1, prefix=[], priority=0, tail=[])
    state.abort(idx=1)
    state.step(tokens=[0, 0, 0, 0])
    state.add_request(cache_salt=None, max_tokens=1, prefix=[], priority=0, tail=[])
    state.add_request(cache_salt="a", max_tokens=1, prefix=shared, priority=0, tail=[0])
    state.add_request(cache_salt="a", max_tokens=1, prefix=shared, priority=0, tail=[])
    state.teardown()
