"""The paged engine against the reference decoders: identical greedy tokens (float32) alone,
batched, after a prefix-cache hit, with chunked prefill and after preemption; cached-token
counts; refusals; aborts; no leaks."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import make_hf_checkpoint, random_token_ids

from kvserve.engine.limits import RequestRejected
from kvserve.engine.llm import LLM
from kvserve.engine.request import RequestStatus
from kvserve.models.model_session import ModelSession
from kvserve.reference.decoders import DenseCacheDecoder
from kvserve.reference.generation import generate
from kvserve.sampling import SamplingParams

BLOCK = 4


# "dense": float32 weights, oneDNN-packed, eager step. "q8_0": the same checkpoint quantized at
# load, multiplied by the C++ kernels, prefill steps compiled (torch.compile) and decode steps
# through the fused kernel (kvserve::decode_layers) -- every equivalence below then holds the
# compiled and fused steps to the eager reference decoders.
@pytest.fixture(scope="module", params=["dense", "q8_0"])
def session(request, tmp_path_factory) -> ModelSession:
    path, _ = make_hf_checkpoint(
        tmp_path_factory.mktemp("engine"),
        "llama",
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    quantization = None if request.param == "dense" else request.param
    return ModelSession.open(path, "float32", "cpu", quantization=quantization)


def reference_tokens(session: ModelSession, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    decoder = DenseCacheDecoder(session.model, len(prompt) + max_tokens)
    return generate(decoder, prompt, params).token_ids


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def make_llm(session: ModelSession, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    kwargs.setdefault("block_size", BLOCK)
    return LLM(session=session, **kwargs)


def assert_no_leaks(llm: LLM) -> None:
    engine = llm.engine
    engine.check_integrity()
    pool = engine.kv_manager.pool
    assert not engine.has_unfinished_requests()
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert engine.stats().kv_cache_usage == 0.0


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    return [random_token_ids(n, seed=seed + i) for i, n in enumerate(lengths)]


def test_single_request_matches_reference(session: ModelSession) -> None:
    prompt = random_token_ids(13, seed=1)
    llm = make_llm(session)
    (out,) = llm.generate([prompt], greedy(20), use_tqdm=False)
    assert out.token_ids == reference_tokens(session, prompt, 20)
    assert out.finish_reason == "length"
    assert out.kv_projections == 13 + 20 - 1
    assert_no_leaks(llm)


def test_sixteen_requests_batched_match_reference(session: ModelSession) -> None:
    lengths = [1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 23, 31, 32, 33, 40, 57]
    prompts = prompts_of(lengths, seed=100)
    max_tokens = [5 + (i * 7) % 19 for i in range(len(prompts))]
    llm = make_llm(session, max_num_seqs=16)
    outs = llm.generate(prompts, [greedy(m) for m in max_tokens], use_tqdm=False)
    for prompt, m, out in zip(prompts, max_tokens, outs, strict=True):
        assert out.token_ids == reference_tokens(session, prompt, m)
    assert_no_leaks(llm)


def test_prefix_cache_hit_matches_and_counts(session: ModelSession) -> None:
    shared = random_token_ids(22, seed=7)  # 5 full blocks of 4 + 2 tokens
    a = shared + random_token_ids(5, seed=8)
    b = shared + random_token_ids(6, seed=9)
    llm = make_llm(session)
    (out_a,) = llm.generate([a], greedy(8), use_tqdm=False)
    (out_b,) = llm.generate([b], greedy(8), use_tqdm=False)
    assert out_a.num_cached_tokens == 0
    assert out_b.num_cached_tokens == (22 // BLOCK) * BLOCK
    assert out_b.token_ids == reference_tokens(session, b, 8)
    assert out_b.kv_projections == len(b) - 20 + 8 - 1
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits == 20
    assert stats.prefix_cache_queries == len(a) + len(b)
    assert_no_leaks(llm)


@pytest.mark.parametrize("p", [8, 10])
def test_whole_prompt_cached_recomputes_last_token(session: ModelSession, p: int) -> None:
    prompt = random_token_ids(p, seed=11)
    llm = make_llm(session)
    first = llm.generate([prompt], greedy(4), use_tqdm=False)[0]
    again = llm.generate([prompt], greedy(4), use_tqdm=False)[0]
    # a P-token prompt that is all prefix: floor(P / bs) blocks, one less if P % bs == 0
    want = (p // BLOCK) * BLOCK if p % BLOCK else p - BLOCK
    assert again.num_cached_tokens == want
    assert again.token_ids == first.token_ids
    assert_no_leaks(llm)


def test_hit_while_first_owner_still_runs(session: ModelSession) -> None:
    shared = random_token_ids(16, seed=21)
    llm = make_llm(session)
    engine = llm.engine
    first = engine.add_request(shared + [1, 2], greedy(30))
    for _ in range(3):
        engine.step()  # first is decoding, its prompt blocks registered
    second = engine.add_request(shared + [3], greedy(5))
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert second.num_cached_tokens == 16
    assert first.output_token_ids == reference_tokens(session, shared + [1, 2], 30)
    assert second.output_token_ids == reference_tokens(session, shared + [3], 5)
    assert_no_leaks(llm)


def test_chunked_prefill_matches_reference(session: ModelSession) -> None:
    prompts = prompts_of([30, 7, 45, 3], seed=300)
    llm = make_llm(session, max_num_batched_tokens=8)
    outs = llm.generate(prompts, greedy(10), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference_tokens(session, prompt, 10)
    assert_no_leaks(llm)


def test_preemption_recomputes_exactly(session: ModelSession) -> None:
    prompts = prompts_of([10, 14, 9, 12, 11, 13], seed=400)
    # 16 blocks of 4 = 64 slots; six requests of ~12 + 24 tokens cannot all stay resident
    llm = make_llm(session, num_kv_blocks=16)
    outs = llm.generate(prompts, greedy(24), use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    assert sum(o.num_preemptions for o in outs) > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference_tokens(session, prompt, 24)
    assert_no_leaks(llm)


def test_refusals_leave_the_engine_serving(session: ModelSession) -> None:
    llm = make_llm(session, num_kv_blocks=8, max_model_len=64)  # the pool: 32 tokens < 64
    engine = llm.engine
    ok = engine.add_request(random_token_ids(5, seed=1), greedy(6))
    cases = [
        (random_token_ids(30, seed=3), greedy(10), "max_tokens", "at most 32 tokens per request"),
        (random_token_ids(40, seed=2), greedy(1), "prompt", "the prompt is 40 tokens"),
        ([], greedy(4), "prompt", "the prompt is empty"),
        ([1, 10_000], greedy(4), "prompt", "token id 10000 is outside the vocabulary [0, 128)"),
        ([1, 2], SamplingParams(stop_token_ids=[128]), "stop_token_ids", "token id 128"),
    ]
    for prompt, params, param, message in cases:
        with pytest.raises(RequestRejected, match=re.escape(message)) as e:
            engine.add_request(prompt, params)
        assert e.value.param == param
    with pytest.raises(RequestRejected, match=re.escape("lower max_tokens to at most 27")):
        llm.generate([random_token_ids(5, seed=4)], greedy(28), use_tqdm=False)
    # the model's context is the limit when the pool is larger
    roomy = make_llm(session, max_model_len=64).engine
    with pytest.raises(RequestRejected, match="maximum context length is 64 tokens, but 70"):
        roomy.add_request(random_token_ids(60, seed=2), greedy(10))
    assert not roomy.has_unfinished_requests()
    while engine.has_unfinished_requests():
        engine.step()
    assert ok.output_token_ids == reference_tokens(session, ok.prompt_token_ids, 6)
    assert_no_leaks(llm)


def test_abort_in_every_state_frees_blocks(session: ModelSession) -> None:
    llm = make_llm(session, max_num_batched_tokens=8, max_num_seqs=2)
    engine = llm.engine
    running = engine.add_request(random_token_ids(6, seed=1), greedy(50))
    chunking = engine.add_request(random_token_ids(30, seed=2), greedy(50))
    waiting = engine.add_request(random_token_ids(9, seed=3), greedy(50))
    engine.step()
    engine.step()
    assert running.status.value == "running" and waiting.status.value == "waiting"
    assert 0 < chunking.num_computed_tokens < 30  # mid-prefill
    for req in (waiting, chunking, running):
        assert engine.abort_request(req.request_id)
        engine.check_integrity()
    assert not engine.abort_request("no-such-request")
    assert_no_leaks(llm)


def test_stream_stops_early_and_frees(session: ModelSession) -> None:
    llm = make_llm(session)
    stream = llm.stream(random_token_ids(9, seed=5), greedy(40))
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert_no_leaks(llm)


def test_seeded_sampling_is_reproducible_in_a_batch(session: ModelSession) -> None:
    llm = make_llm(session)
    prompt = random_token_ids(7, seed=6)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], params, use_tqdm=False)[0]
    crowd = llm.generate(
        [prompt, random_token_ids(20, seed=7), prompt], [params, greedy(5), params], use_tqdm=False
    )
    assert crowd[0].token_ids == alone.token_ids == crowd[2].token_ids
    torch.manual_seed(0)  # the global RNG does not influence seeded requests
    assert llm.generate([prompt], params, use_tqdm=False)[0].token_ids == alone.token_ids
    assert_no_leaks(llm)


def test_kv_sizes_are_single_sourced(session: ModelSession) -> None:
    llm = make_llm(session, kv_cache_memory="1MiB", num_kv_blocks=None)
    engine = llm.engine
    cfg = session.config
    # the tiny checkpoint: 2 layers, 2 KV heads of 16 dims, float32 -> K and V of one token
    # take 2 * 2 * 2 * 16 * 4 = 512 bytes, a block of 4 tokens 2 KiB: 1 MiB holds 512 blocks
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (2, 2, 16)
    assert engine.spec.bytes_per_token == 512
    assert engine.spec.bytes_per_block == 2048
    assert engine.storage.num_blocks == 512
    assert engine.storage.nbytes == 1 << 20  # the buffer really allocated
    assert engine.stats().num_blocks == 512
    assert engine.kv_manager.pool.num_blocks == 512


def test_shared_prefix_admitted_together_is_computed_once(session: ModelSession) -> None:
    # four requests with one 12-token system prompt, all submitted before the first step:
    # the followers wait for the leader's prefix blocks instead of computing them again
    system = random_token_ids(12, seed=31)
    prompts = [system + random_token_ids(3, seed=40 + i) for i in range(4)]
    llm = make_llm(session)
    outs = llm.generate(prompts, greedy(4), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 12, 12, 12]
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference_tokens(session, prompt, 4)
    assert_no_leaks(llm)


def test_lpm_policy_serves_prefix_hits_first(session: ModelSession) -> None:
    system = random_token_ids(16, seed=51)
    llm = make_llm(session, scheduling_policy="lpm", max_num_seqs=1)
    llm.generate([system + [5]], greedy(2), use_tqdm=False)  # caches the system prompt
    engine = llm.engine
    cold = engine.add_request(random_token_ids(9, seed=52), greedy(2))
    warm = engine.add_request(system + [6], greedy(2))
    engine.step()  # one seat: lpm admits the later request with the 16-token hit
    assert warm.status.value == "running" and cold.status.value == "waiting"
    while engine.has_unfinished_requests():
        engine.step()
    assert warm.num_cached_tokens == 16 and cold.num_cached_tokens == 0
    assert warm.output_token_ids == reference_tokens(session, system + [6], 2)
    assert_no_leaks(llm)


def test_priority_policy_and_prefill_cap_keep_tokens_exact(session: ModelSession) -> None:
    """The server's scheduling (priority + a prefill cap of 8 beside decodes, a 16-token
    step) reorders and splits the work, never changes it: each prompt's greedy tokens are the
    no-cache reference's, and the step-by-step mix really did differ (more steps)."""
    prompts = [random_token_ids(n, seed=60 + n) for n in (5, 23, 9, 31, 14)]
    steps = {}
    for name, kw in {
        "fcfs": {},
        "priority": {"scheduling_policy": "priority", "max_prefill_tokens_with_decodes": 8},
    }.items():
        llm = make_llm(session, max_num_batched_tokens=16, **kw)
        engine = llm.engine
        reqs = [
            engine.add_request(p, greedy(6), priority=prio)
            for p, prio in zip(prompts, [3, 0, 2, 1, 0], strict=True)
        ]
        steps[name] = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps[name] += 1
        for prompt, r in zip(prompts, reqs, strict=True):
            assert r.output_token_ids == reference_tokens(session, prompt, 6), (name, r)
        assert_no_leaks(llm)
    assert steps["priority"] > steps["fcfs"]


def test_generate_priority_orders_and_is_checked(session: ModelSession) -> None:
    llm = make_llm(session, scheduling_policy="priority", max_num_seqs=1)
    prompts = [random_token_ids(6, seed=70 + i) for i in range(3)]
    with pytest.raises(ValueError, match="got 2 priorities for 3 prompts"):
        llm.generate(prompts, greedy(2), use_tqdm=False, priority=[0, 1])
    outs = llm.generate(prompts, greedy(2), use_tqdm=False, priority=[2, 0, 1])
    # outputs stay in prompt order; one seat ran them in priority order
    firsts = [o.queue_time_s for o in outs]  # arrivals are microseconds apart
    assert firsts[1] < firsts[2] < firsts[0]
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference_tokens(session, prompt, 2)
    assert_no_leaks(llm)


@pytest.mark.parametrize("prompt_len", [10, 12])  # a shared partial last block, and none
def test_n_samples_fork_the_prompt_and_match_separate_seeds(
    session: ModelSession, prompt_len: int
) -> None:
    prompt = random_token_ids(prompt_len, seed=61)
    llm = make_llm(session)
    engine = llm.engine
    copies: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        copies.extend(out.block_copies)
        return out

    engine.scheduler.schedule = spy
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=10, n=3, ignore_eos=True)
    outs = llm.generate([prompt], params, use_tqdm=False)
    assert [o.index for o in outs] == [0, 1, 2]
    assert [o.parent_request_id for o in outs] == [None, outs[0].request_id, outs[0].request_id]
    # the siblings never recomputed the prompt: only their own generated tokens
    assert [o.kv_projections for o in outs] == [prompt_len + 7, 7, 7]
    # copy-on-write of the shared partial block happens exactly when there is one
    assert len(copies) == (2 if prompt_len % BLOCK else 0)
    engine.scheduler.schedule = schedule
    for i, out in enumerate(outs):  # sample i == a lone request seeded seed + i
        alone = SamplingParams(max_tokens=8, temperature=1.0, seed=10 + i, ignore_eos=True)
        assert out.token_ids == llm.generate([prompt], alone, use_tqdm=False)[0].token_ids
    assert len({tuple(o.token_ids) for o in outs}) > 1
    assert_no_leaks(llm)


@pytest.mark.parametrize("sample_0_finished", [False, True])
def test_abort_n_samples_aborts_all(session: ModelSession, sample_0_finished: bool) -> None:
    # sample 0 can stop early (EOS, a stop string); its siblings still run and must go too
    llm = make_llm(session)
    engine = llm.engine
    req = engine.add_request(
        random_token_ids(9, seed=62), SamplingParams(max_tokens=30, n=4, seed=1)
    )
    engine.step()
    engine.step()
    if sample_0_finished:
        engine.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
    assert len(engine.scheduler.running) == 4 - sample_0_finished
    assert engine.abort_request(req.request_id)
    assert not engine.has_unfinished_requests()
    assert_no_leaks(llm)
