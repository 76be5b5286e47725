"""The paged engine on a DeepSeek-V2 checkpoint (MLA + MoE, q_lora_rank set) against the
dense-cache reference decoder: identical greedy tokens (float32) alone, batched, after a
prefix-cache hit, with chunked prefill, after preemption and for n > 1 forks; the latent pool's
bytes single-sourced from ``MLASpec``; no leaks. The engine's decodes take the absorbed path
(attention/mla.py), the reference expands the latent: equal tokens hold the two to each other."""

from __future__ import annotations

import pytest
from conftest import random_token_ids
from test_deepseek_parity import MLA, MOE, make_deepseek_checkpoint
from test_engine import assert_no_leaks, greedy, prompts_of, reference_tokens

from kvserve.engine.llm import LLM
from kvserve.kv.spec import MLASpec
from kvserve.models.model_session import ModelSession
from kvserve.sampling import SamplingParams

BLOCK = 4


# "dense": float32 weights (oneDNN-packed); "q8_0": the same checkpoint quantized at load
# (every linear, experts included, through the C++ kernels; kv_b_proj and the router stay
# float), the reference decoders running the same quantized model
@pytest.fixture(scope="module", params=["dense", "q8_0"])
def session(request, tmp_path_factory) -> ModelSession:
    path, _ = make_deepseek_checkpoint(
        tmp_path_factory.mktemp("mla"), "deepseek_v2", **{**MLA, **MOE, "q_lora_rank": 48}
    )
    quantization = None if request.param == "dense" else request.param
    return ModelSession.open(path, "float32", "cpu", quantization=quantization)


def make_llm(session: ModelSession, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    kwargs.setdefault("block_size", BLOCK)
    return LLM(session=session, **kwargs)


def test_alone_and_batched_match_reference(session: ModelSession) -> None:
    llm = make_llm(session, max_num_seqs=12)
    (alone,) = llm.generate([random_token_ids(13, seed=1)], greedy(20), use_tqdm=False)
    assert alone.token_ids == reference_tokens(session, random_token_ids(13, seed=1), 20)
    assert alone.kv_projections == 13 + 20 - 1
    prompts = prompts_of([1, 3, 5, 8, 9, 15, 16, 17, 23, 31, 33, 40], seed=100)
    max_tokens = [5 + (i * 7) % 13 for i in range(len(prompts))]
    outs = llm.generate(prompts, [greedy(m) for m in max_tokens], use_tqdm=False)
    for prompt, m, out in zip(prompts, max_tokens, outs, strict=True):
        assert out.token_ids == reference_tokens(session, prompt, m)
    assert_no_leaks(llm)


def test_prefix_hit_and_chunked_prefill_match(session: ModelSession) -> None:
    shared = random_token_ids(22, seed=7)  # 5 full blocks of 4 + 2 tokens
    a, b = shared + random_token_ids(5, seed=8), shared + random_token_ids(6, seed=9)
    llm = make_llm(session, max_num_batched_tokens=8)  # every prompt in chunks of <= 8
    (out_a,) = llm.generate([a], greedy(8), use_tqdm=False)
    (out_b,) = llm.generate([b], greedy(8), use_tqdm=False)
    assert out_a.num_cached_tokens == 0
    assert out_b.num_cached_tokens == 20
    assert out_a.token_ids == reference_tokens(session, a, 8)
    assert out_b.token_ids == reference_tokens(session, b, 8)
    assert out_b.kv_projections == len(b) - 20 + 8 - 1
    assert_no_leaks(llm)


def test_preemption_recomputes_exactly(session: ModelSession) -> None:
    prompts = prompts_of([10, 14, 9, 12, 11, 13], seed=400)
    llm = make_llm(session, num_kv_blocks=16)  # 64 slots for six requests of ~12 + 24
    outs = llm.generate(prompts, greedy(24), use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference_tokens(session, prompt, 24)
    assert_no_leaks(llm)


def test_n_samples_fork_latent_blocks(session: ModelSession) -> None:
    prompt = random_token_ids(10, seed=61)  # a shared partial last block: copy-on-write
    llm = make_llm(session)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=10, n=3, ignore_eos=True)
    outs = llm.generate([prompt], params, use_tqdm=False)
    assert [o.kv_projections for o in outs] == [10 + 7, 7, 7]
    for i, out in enumerate(outs):
        alone = SamplingParams(max_tokens=8, temperature=1.0, seed=10 + i, ignore_eos=True)
        assert out.token_ids == llm.generate([prompt], alone, use_tqdm=False)[0].token_ids
    assert len({tuple(o.token_ids) for o in outs}) > 1
    assert_no_leaks(llm)


def test_latent_pool_is_sized_by_the_spec(session: ModelSession) -> None:
    llm = make_llm(session, kv_cache_memory="1MiB", num_kv_blocks=None)
    engine = llm.engine
    # 3 layers x (32 latent + 8 rope) float32 values = 480 bytes a token, 1920 a block of 4
    assert all(isinstance(layer, MLASpec) for layer in engine.spec.layers)
    assert engine.spec.bytes_per_token == 3 * 40 * 4
    assert engine.spec.bytes_per_block == 1920
    assert engine.storage.num_blocks == (1 << 20) // 1920
    assert engine.storage.nbytes == engine.storage.num_blocks * 1920
    # the same model as MHA: 3 layers x 4 heads x (16 + 8 + 24) float32
    assert engine.spec.mha_equivalent_bytes_per_token == 3 * 4 * 48 * 4
    assert engine.fused_decode is None
    assert not engine.compile_result.compiled


def test_split_cache_dtypes_are_refused(session: ModelSession) -> None:
    with pytest.raises(ValueError, match="one latent row"):
        make_llm(session, k_cache_dtype="float32", v_cache_dtype="bfloat16")


def test_fp8_latent_alone_batched_and_after_a_hit_agree(session: ModelSession) -> None:
    """An fp8_e4m3 latent (rope key float32): lossy against the exact cache, but one engine
    gives a prompt the same tokens alone, batched and from cached fp8 blocks."""
    llm = make_llm(session, kv_cache_dtype="fp8_e4m3", max_num_seqs=8)
    assert llm.engine.spec.bytes_per_token == 3 * (32 + 2 + 8 * 4)
    prompts = prompts_of([9, 13, 22, 30], seed=500)
    alone = [llm.generate([p], greedy(12), use_tqdm=False)[0].token_ids for p in prompts]
    batched = llm.generate(prompts, greedy(12), use_tqdm=False)  # prompts now cached too
    assert [o.token_ids for o in batched] == alone
    assert [o.num_cached_tokens for o in batched] == [8, 12, 20, 28]
    assert_no_leaks(llm)
