"""Fault containment in LLMEngine.step(): a step that raises fails only the requests in it,
leaves no block held and no untrusted block in the prefix cache, and every other request
produces exactly the tokens of a fault-free run (greedy, float32)."""

from __future__ import annotations

import pytest
from conftest import make_hf_checkpoint, random_token_ids

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.engine import engine as engine_module
from kvserve.engine.engine import LLMEngine
from kvserve.engine.faults import FaultInjector, InjectedFault
from kvserve.engine.llm import LLM
from kvserve.engine.request import RequestOutput
from kvserve.models.model_session import ModelSession
from kvserve.sampling import SamplingParams

BLOCK = 4


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> ModelSession:
    path, _ = make_hf_checkpoint(
        tmp_path_factory.mktemp("faults"), "llama", max_position_embeddings=256
    )
    return ModelSession.open(path, "float32", "cpu")


def make_engine(session: ModelSession, faults: FaultInjector | None = None, **sched) -> LLMEngine:
    return LLMEngine.from_session(
        session,
        CacheConfig(block_size=BLOCK, num_blocks=64),
        SchedulerConfig(**sched),
        enforce_eager=True,
        faults=faults,
    )


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n)


def run(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until idle: every request's final output by request id."""
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, f"two final outputs for {out.request_id}"
                finals[out.request_id] = out
    return finals


def fault_free_tokens(session: ModelSession, prompts: dict[str, list[int]], max_tokens: int):
    engine = make_engine(session)
    for rid, prompt in prompts.items():
        engine.add_request(prompt, greedy(max_tokens), rid)
    return {rid: out.token_ids for rid, out in run(engine).items()}


def assert_clean(engine: LLMEngine) -> None:
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.pool.num_used_blocks == 0
    assert engine.kv_manager.req_to_blocks == {}


def cached_token_blocks(engine: LLMEngine) -> set[tuple[int, ...]]:
    return {b.token_ids for b in engine.kv_manager.pool.cached.values()}


def test_a_fault_fails_only_the_requests_in_its_step(session: ModelSession) -> None:
    prompts = {
        "a": random_token_ids(5, seed=1),
        "b": random_token_ids(7, seed=2),
        "c": random_token_ids(9, seed=3),
    }
    want = fault_free_tokens(session, prompts, 6)
    # two run at a time: c waits while a and b prefill (model step 1), decode (2), fail (3)
    engine = make_engine(session, FaultInjector(frozenset({3})), max_num_seqs=2)
    for rid, prompt in prompts.items():
        engine.add_request(prompt, greedy(6), rid)
    finals: dict[str, RequestOutput] = {}
    for _ in range(3):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finals) == ["a", "b"]
    for rid in ("a", "b"):
        out = finals[rid]
        assert (out.finish_reason, out.error) == (
            "error",
            "InjectedFault: injected fault at model step 3",
        )
        assert out.token_ids == want[rid][:2]  # the two tokens of the steps that completed
    # nothing of a's or b's may be served from the cache: their blocks left the hash table
    assert cached_token_blocks(engine) == set()
    engine.check_integrity()
    # a request added after the fault, with a's prompt: computed afresh, a's fault-free tokens
    engine.add_request(prompts["a"], greedy(6), "a-again")
    finals = run(engine)
    assert finals["c"].token_ids == want["c"] and finals["c"].finish_reason == "length"
    assert finals["a-again"].token_ids == want["a"]
    assert finals["a-again"].num_cached_tokens == 0
    assert (engine.num_failed_steps, engine.consecutive_step_failures) == (1, 0)
    assert_clean(engine)


def test_a_failed_chunked_prefill_leaves_none_of_its_blocks_cached(session) -> None:
    prompt = random_token_ids(20, seed=4)
    (want,) = fault_free_tokens(session, {"p": prompt}, 4).values()
    # chunks of 8 tokens: step 1 computes (and registers) blocks 0-1, step 2 fails
    engine = make_engine(session, FaultInjector(frozenset({2})), max_num_batched_tokens=8)
    engine.add_request(prompt, greedy(4), "p")
    engine.step()
    assert len(engine.kv_manager.pool.cached) == 2
    (out,) = engine.step()
    assert (out.finish_reason, out.token_ids) == ("error", [])
    assert engine.kv_manager.pool.cached == {}
    assert_clean(engine)
    engine.add_request(prompt, greedy(4), "again")
    (again,) = run(engine).values()
    assert (again.token_ids, again.num_cached_tokens) == (want, 0)
    assert_clean(engine)


def test_a_sampler_failure_after_the_model_drops_the_blocks_it_registered(
    session: ModelSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = random_token_ids(9, seed=5)
    (want,) = fault_free_tokens(session, {"p": prompt}, 3).values()
    engine = make_engine(session)
    real, calls = engine_module.sample_step, []

    def failing_sample_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("sampler exploded")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "sample_step", failing_sample_step)
    engine.add_request(prompt, greedy(3), "p")
    (out,) = engine.step()  # the model ran and two full blocks were registered, then it raised
    assert (out.finish_reason, out.error) == ("error", "RuntimeError: sampler exploded")
    assert engine.kv_manager.pool.cached == {}
    assert_clean(engine)
    engine.add_request(prompt, greedy(3), "again")
    (again,) = run(engine).values()
    assert (again.token_ids, again.num_cached_tokens) == (want, 0)


def test_requests_already_finished_in_the_failing_step_keep_their_output(
    session: ModelSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "one" finishes (max_tokens 1) on the step where "two"'s token is appended and raises
    engine = make_engine(session)
    real_append = engine_module.append_token

    def append(req, token, lp, max_model_len):
        if req.request_id == "two":
            raise RuntimeError("bad token")
        return real_append(req, token, lp, max_model_len)

    monkeypatch.setattr(engine_module, "append_token", append)
    engine.add_request(random_token_ids(6, seed=6), greedy(1), "one")
    engine.add_request(random_token_ids(6, seed=7), greedy(3), "two")
    outs = {o.request_id: o for o in engine.step()}
    assert (outs["one"].finish_reason, len(outs["one"].token_ids)) == ("length", 1)
    assert (outs["two"].finish_reason, outs["two"].error) == ("error", "RuntimeError: bad token")
    assert_clean(engine)


def test_a_request_whose_final_output_was_lost_fails_and_the_queue_goes_on(
    session: ModelSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "one" finishes in step 1, then building its output raises: no request of the step is
    # live any more, and "queued" (waiting: one sequence at a time) must not pay for it
    prompts = {"queued": random_token_ids(6, seed=19)}
    want = fault_free_tokens(session, prompts, 3)
    engine = make_engine(session, max_num_seqs=1)
    real_make_output = engine_module.make_output

    def make_output(req):
        if req.request_id == "one" and req.error is None:
            raise RuntimeError("no output")
        return real_make_output(req)

    monkeypatch.setattr(engine_module, "make_output", make_output)
    engine.add_request(random_token_ids(6, seed=20), greedy(1), "one")
    engine.add_request(prompts["queued"], greedy(3), "queued")
    (out,) = engine.step()
    assert (out.request_id, out.finish_reason, out.error) == (
        "one",
        "error",
        "RuntimeError: no output",
    )
    finals = run(engine)
    assert finals["queued"].token_ids == want["queued"]
    assert_clean(engine)


@pytest.mark.parametrize("fault_step", [1, 2])
def test_every_sample_of_a_failed_n_request_gets_an_error(session, fault_step: int) -> None:
    # step 1 prefills the parent (and forks its siblings), step 2 decodes all three
    llm = LLM(session=session, num_kv_blocks=64, block_size=BLOCK, enforce_eager=True)
    llm.engine.runner.faults = FaultInjector(frozenset({fault_step}))
    prompt = random_token_ids(6, seed=8)
    outs = llm.generate([prompt], greedy(4, n=3), use_tqdm=False)
    assert [(o.index, o.finish_reason) for o in outs] == [(0, "error"), (1, "error"), (2, "error")]
    assert {len(o.token_ids) for o in outs} == {fault_step - 1}
    assert_clean(llm.engine)
    outs = llm.generate([prompt], greedy(4, n=3), use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length"] * 3
    assert_clean(llm.engine)


def test_broken_bookkeeping_fails_everything_and_rebuilds_the_kv_state(session) -> None:
    prompts = {"a": random_token_ids(5, seed=9), "b": random_token_ids(5, seed=10)}
    want = fault_free_tokens(session, prompts, 4)
    engine = make_engine(session, max_num_seqs=1)  # b waits while a runs
    real_execute = engine.runner.execute

    def corrupting_execute(sched, requests):
        engine.kv_manager.pool.blocks[-1].ref_cnt = 3  # a free block now claims holders
        raise RuntimeError("device lost")

    engine.runner.execute = corrupting_execute
    for rid, prompt in prompts.items():
        engine.add_request(prompt, greedy(4), rid)
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].error == "RuntimeError: device lost"
    assert outs["b"].error == "RuntimeError: device lost (engine state rebuilt)"
    assert_clean(engine)
    engine.runner.execute = real_execute
    engine.add_request(prompts["b"], greedy(4), "b-again")
    (again,) = run(engine).values()
    assert again.token_ids == want["b"]
    assert_clean(engine)


def test_a_scheduler_failure_fails_every_request(session: ModelSession) -> None:
    engine = make_engine(session)
    engine.add_request(random_token_ids(5, seed=11), greedy(4), "a")
    engine.add_request(random_token_ids(5, seed=12), greedy(4), "b")

    def broken_schedule():
        raise AssertionError("scheduler invariant")

    engine.scheduler.schedule = broken_schedule
    outs = engine.step()
    assert sorted((o.request_id, o.error) for o in outs) == [
        ("a", "AssertionError: scheduler invariant"),
        ("b", "AssertionError: scheduler invariant"),
    ]
    assert_clean(engine)


def test_consecutive_failures_are_counted_until_a_step_succeeds(session) -> None:
    engine = make_engine(session, FaultInjector(frozenset({2, 3})))
    engine.add_request(random_token_ids(5, seed=13), greedy(4), "a")
    engine.step()
    assert [o.finish_reason for o in engine.step()] == ["error"]
    assert engine.consecutive_step_failures == 1
    engine.add_request(random_token_ids(5, seed=14), greedy(4), "b")
    assert [o.request_id for o in engine.step()] == ["b"]
    assert (engine.num_failed_steps, engine.consecutive_step_failures) == (2, 2)
    engine.add_request(random_token_ids(5, seed=15), greedy(1), "c")
    assert [o.finish_reason for o in engine.step()] == ["length"]
    assert (engine.num_failed_steps, engine.consecutive_step_failures) == (2, 0)


def test_fail_all_fails_waiting_and_running_and_resets_the_pool(session) -> None:
    engine = make_engine(session, max_num_seqs=1)
    engine.add_request(random_token_ids(9, seed=16), greedy(4), "run")
    engine.add_request(random_token_ids(9, seed=17), greedy(4), "wait")
    engine.step()
    assert engine.kv_manager.pool.num_used_blocks == 3
    outs = engine.fail_all("loop restarted")
    assert sorted((o.request_id, o.finish_reason, o.error) for o in outs) == [
        ("run", "error", "loop restarted"),
        ("wait", "error", "loop restarted"),
    ]
    assert engine.kv_manager.pool.cached == {}
    assert_clean(engine)


def test_keyboard_interrupt_is_not_contained(session: ModelSession) -> None:
    engine = make_engine(session)

    def interrupted(sched, requests):
        raise KeyboardInterrupt

    engine.runner.execute = interrupted
    engine.add_request(random_token_ids(5, seed=18), greedy(2), "a")
    with pytest.raises(KeyboardInterrupt):
        engine.step()


def test_injected_fault_raises_on_the_chosen_model_steps_only() -> None:
    faults = FaultInjector(frozenset({2}))
    faults.before_model()
    with pytest.raises(InjectedFault, match="^injected fault at model step 2$"):
        faults.before_model()
    faults.before_model()
    assert faults.num_model_steps == 3


@pytest.mark.parametrize(
    ("text", "steps"),
    [("5", {5}), ("5,6", {5, 6}), (" 3 , 10-12 ,", {3, 10, 11, 12}), ("7-7", {7})],
)
def test_fault_steps_parse(text: str, steps: set[int]) -> None:
    parsed = FaultInjector.parse(text)
    assert parsed is not None and parsed.steps == frozenset(steps)


def test_no_fault_steps_parse_to_none() -> None:
    assert FaultInjector.parse("") is None and FaultInjector.parse(" , ") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("x", "KVSERVE_FAULT_STEPS: 'x' is not a step or a range like 10-12"),
        ("0", "KVSERVE_FAULT_STEPS: '0' must be N or N-M with 1 <= N <= M"),
        ("5-3", "KVSERVE_FAULT_STEPS: '5-3' must be N or N-M with 1 <= N <= M"),
        ("1-", "KVSERVE_FAULT_STEPS: '1-' is not a step or a range like 10-12"),
    ],
)
def test_bad_fault_steps_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError) as e:
        FaultInjector.parse(text)
    assert str(e.value) == message


def test_fault_injector_refuses_non_positive_steps() -> None:
    with pytest.raises(ValueError, match=r"^fault steps must be integers >= 1, got \[0\]$"):
        FaultInjector(frozenset({0, 3}))
