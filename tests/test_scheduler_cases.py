"""Scheduler + KVCacheManager without a model, by hand: preemption and recompute, a preempted
request's own cached prefix, step limits and chunked prefill, aborts in every state, and no
prefix caching (the state machine over the same fake model is test_scheduler_stateful.py)."""

from __future__ import annotations

import itertools

from test_scheduler_stateful import (
    VOCAB,
    FakeModel,
    assert_all_free,
    check_scheduler_state,
    drain,
    make_scheduler,
    run_step,
)

from kvserve.engine.request import Request, RequestStatus
from kvserve.sampling import SamplingParams


def test_preemption_and_recompute():
    """4 blocks of 4: two requests of 6 + 6 tokens cannot both grow past 8 tokens."""
    sched = make_scheduler(num_blocks=4, max_num_seqs=2)
    model = FakeModel(sched)
    a = Request("a", [0, 1, 2, 0, 1, 2], SamplingParams(max_tokens=6, ignore_eos=True))
    # b shares no block with a (a shared one would defer b until a's prefix is cached)
    b = Request("b", [3, 1, 2, 0, 2, 2], SamplingParams(max_tokens=6, ignore_eos=True))
    c = Request("c", [1, 1], SamplingParams(max_tokens=2, ignore_eos=True))  # waits: max_num_seqs
    for r in (a, b, c):
        sched.add_request(r)
    tokens = itertools.cycle([1, 2])
    out = run_step(sched, model, tokens)
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    assert sched.kv.block_ids("a") == [0, 1] and sched.kv.block_ids("b") == [2, 3]
    check_scheduler_state(sched, model)

    preempted_at = None
    b_tokens_before = None
    for step in range(100):
        if not sched.has_unfinished():
            break
        if preempted_at is None:
            b_tokens_before = list(b.all_token_ids)
        out = run_step(sched, model, tokens)
        check_scheduler_state(sched, model)
        if out.preempted and preempted_at is None:
            preempted_at = step
            assert out.preempted == ["b"]  # the newest running request goes
            assert b.status == RequestStatus.PREEMPTED
            assert b.num_computed_tokens == 0
            assert list(sched.waiting) == [b, c]  # back in front of the line, ahead of c
            assert "b" not in sched.kv.req_to_blocks
            # the step that preempted admits nothing: only a runs
            assert [s.request_id for s in out.scheduled] == ["a"]
            # b keeps what it generated so far; it is recomputed, not restarted
            assert b.all_token_ids == b_tokens_before
    assert not sched.has_unfinished()
    assert preempted_at is not None
    assert sched.num_preemptions > 0
    assert b.num_preemptions >= 1
    for r in (a, b, c):
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == r.sampling_params.max_tokens
    assert_all_free(sched.kv)


def test_preempted_request_reuses_its_own_cached_prefix():
    sched = make_scheduler(num_blocks=4)
    model = FakeModel(sched)
    a = Request("a", list(range(3)) * 2, SamplingParams(max_tokens=6, ignore_eos=True))
    b = Request("b", [2, 2, 2, 2, 1, 1], SamplingParams(max_tokens=6, ignore_eos=True))
    sched.add_request(a)
    sched.add_request(b)
    tokens = itertools.cycle([0])
    hits_at_preemption = None
    while sched.has_unfinished():
        out = run_step(sched, model, tokens)
        check_scheduler_state(sched, model)
        if out.preempted and hits_at_preemption is None:
            hits_at_preemption = sched.kv.prefix_hits
    assert hits_at_preemption is not None
    # b's full head block survived its preemption in the free queue and was hit on readmission
    assert sched.kv.prefix_hits > hits_at_preemption
    assert_all_free(sched.kv)


def test_step_limits_and_chunked_prefill():
    sched = make_scheduler(num_blocks=32, max_num_seqs=2, max_batched=8)
    model = FakeModel(sched)
    reqs = [
        Request(f"r{i}", [i % VOCAB] * 10, SamplingParams(max_tokens=3, ignore_eos=True))
        for i in range(4)
    ]
    for r in reqs:
        sched.add_request(r)
    tokens = itertools.cycle([1])
    out = run_step(sched, model, tokens)
    # 10-token prompt, 8-token budget: the first prompt is chunked, nobody else fits
    assert [(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [
        ("r0", 0, 8)
    ]
    assert not out.scheduled[0].samples
    out = run_step(sched, model, tokens)
    assert [(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [
        ("r0", 8, 2),
        ("r1", 0, 6),
    ]
    assert [s.samples for s in out.scheduled] == [True, False]
    check_scheduler_state(sched, model)
    steps = drain(sched, model)
    assert steps > 0
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert_all_free(sched.kv)


def test_abort_in_every_state():
    sched = make_scheduler(num_blocks=4, max_num_seqs=1)
    model = FakeModel(sched)
    running = Request("run", [0] * 5, SamplingParams(max_tokens=4, ignore_eos=True))
    waiting = Request("wait", [0] * 5, SamplingParams(max_tokens=4, ignore_eos=True))
    sched.add_request(running)
    sched.add_request(waiting)
    run_step(sched, model, itertools.cycle([1]))
    assert running.status == RequestStatus.RUNNING
    assert waiting.status == RequestStatus.WAITING  # max_num_seqs = 1
    sched.finish(waiting, RequestStatus.FINISHED_ABORTED)
    check_scheduler_state(sched, model)
    sched.finish(running, RequestStatus.FINISHED_ABORTED)
    check_scheduler_state(sched, model)
    assert not sched.has_unfinished()
    assert_all_free(sched.kv)


def test_no_prefix_caching_runs_clean():
    sched = make_scheduler(num_blocks=6, enable_prefix_caching=False)
    model = FakeModel(sched)
    for i in range(5):
        sched.add_request(
            Request(
                f"r{i}",
                [0, 1, 2, 0, 1] + [i % VOCAB],
                SamplingParams(max_tokens=7, ignore_eos=True),
            )
        )
    drain(sched, model)
    assert sched.kv.prefix_hits == 0
    assert sched.kv.pool.cached == {}
    assert_all_free(sched.kv)
