"""The engine on quantized K/V blocks: prefix hits, copy-on-write (n > 1), preemption and
chunked prefill give the same tokens as the same quantized cache without them, no block leaks;
paged attention over quantized blocks against the reference over dequantized ones; and
``eval-cache`` on a tiny random model (0 KL for the exact cache measured, > 0 for int4_sym)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_checkpoint, random_token_ids
from test_engine import assert_no_leaks, greedy, make_llm
from test_paged_attention import build_step

from kvserve.attention.paged import PagedAttention, reference_paged_attention
from kvserve.eval_cache import CacheVariant, evaluate, window_variants
from kvserve.kernels.build import build_kernels
from kvserve.kv.cache_dtype import CacheDtype
from kvserve.kv.spec import KVCacheSpec
from kvserve.kv.storage import KVCacheStorage
from kvserve.models.model_session import ModelSession
from kvserve.sampling import SamplingParams


@pytest.fixture(scope="module", params=["dense", "q8_0"])
def session(request, tmp_path_factory) -> ModelSession:
    path, _ = make_hf_checkpoint(
        tmp_path_factory.mktemp("kvq"), "llama", num_key_value_heads=2, max_position_embeddings=512
    )
    quantization = None if request.param == "dense" else request.param
    return ModelSession.open(path, "float32", "cpu", quantization=quantization)


KV = [("int8", "int8"), ("int4_sym", "int8"), ("fp8_e4m3", "int4")]


@pytest.mark.parametrize("k,v", KV, ids=["int8", "k4v8", "fp8-k4a"])
def test_prefix_hits_chunks_and_preemption_on_quantized_blocks(session, k: str, v: str) -> None:
    system = random_token_ids(24, seed=7)
    prompts = [system + random_token_ids(n, seed=i) for i, n in enumerate([5, 9, 14, 3])]
    dtypes = dict(k_cache_dtype=k, v_cache_dtype=v)
    plain = make_llm(session, enable_prefix_caching=False, **dtypes)
    want = [o.token_ids for o in plain.generate(prompts, greedy(12), use_tqdm=False)]
    assert plain.engine.storage.is_quantized
    assert plain.engine.spec.cache_dtype_name == (k if k == v else f"{k}/{v}")

    cached = make_llm(session, **dtypes)
    cached.generate(prompts[:1], greedy(12), use_tqdm=False)  # the system prompt's blocks
    outs = cached.generate(prompts, greedy(12), use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert sum(o.num_cached_tokens for o in outs) >= 3 * 24 - 3 * 4
    assert_no_leaks(cached)

    chunked = make_llm(session, max_num_batched_tokens=8, **dtypes)  # prefill in chunks of 8
    assert [o.token_ids for o in chunked.generate(prompts, greedy(12), use_tqdm=False)] == want

    # short prompts that all get admitted, then outgrow the pool while decoding
    short = [random_token_ids(n, seed=40 + i) for i, n in enumerate([10, 14, 9, 12, 11, 13])]
    roomy = make_llm(session, enable_prefix_caching=False, **dtypes)
    want = [o.token_ids for o in roomy.generate(short, greedy(24), use_tqdm=False)]
    small = make_llm(session, num_kv_blocks=16, enable_prefix_caching=False, **dtypes)
    outs = small.generate(short, greedy(24), use_tqdm=False)
    assert small.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == want
    assert_no_leaks(small)


def test_parallel_samples_share_quantized_blocks(session) -> None:
    # n = 3 samples fork the prompt's blocks, copying the partial last block (codes and scales)
    # on write: sample i must equal a lone request seeded seed + i, which owns all its blocks
    prompt = random_token_ids(10, seed=3)  # 10 tokens: the last block (4) is partial
    llm = make_llm(session, kv_cache_dtype="int4_sym")
    engine, copies = llm.engine, []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        copies.extend(out.block_copies)
        return out

    engine.scheduler.schedule = spy
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=10, n=3, ignore_eos=True)
    outs = llm.generate([prompt], params, use_tqdm=False)
    engine.scheduler.schedule = schedule
    assert len(copies) == 2
    for i, out in enumerate(outs):
        alone = SamplingParams(max_tokens=8, temperature=1.0, seed=10 + i, ignore_eos=True)
        assert out.token_ids == llm.generate([prompt], alone, use_tqdm=False)[0].token_ids
    assert_no_leaks(llm)


def test_exact_cache_unchanged_by_the_new_layout(session) -> None:
    # "auto" is the model dtype: one float tensor, the fused decode step where it applies
    llm = make_llm(session)
    assert llm.engine.storage.kv is not None and not llm.engine.storage.is_quantized
    assert llm.engine.spec.cache_dtype_name == "float32"


@pytest.mark.parametrize("k,v", [("int8", "int8"), ("int4_sym", "int4_sym"), ("fp8_e4m3", "int8")])
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "sdpa"])
def test_paged_attention_over_quantized_blocks(k: str, v: str, use_kernel: bool) -> None:
    # decodes and prefill chunks over blocks written quantized, against the plain reference
    # over the same (dequantized) blocks, and close to attention over the float originals
    if use_kernel:
        build_kernels()  # forced on: a broken build fails here, never a silent fallback
    seq_lens, query_lens = [1, 9, 33, 20, 17], [1, 1, 1, 6, 17]
    storage, md, q, kk, vv, dense = build_step(seq_lens, query_lens, torch.float32)
    spec = KVCacheSpec.full_attention(1, storage.spec.layers[0].num_kv_heads, 16, k, 4, v)
    qst = KVCacheStorage(spec, storage.num_blocks, compute_dtype=torch.float32)
    for i, (kd, vd) in enumerate(dense):  # the same history into the quantized storage
        n_hist = seq_lens[i] - query_lens[i]
        if n_hist:
            pos = torch.arange(n_hist)
            slots = md.block_tables[i, pos // 4] * 4 + pos % 4
            qst.write(0, slots, kd[:n_hist], vd[:n_hist])
    out = PagedAttention(qst, md, 16**-0.5, use_kernel=use_kernel)(0, q, kk, vv)
    ref = reference_paged_attention(qst, md, 0, q, 16**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    exact = PagedAttention(storage, md, 16**-0.5)(0, q, kk, vv)
    assert float((out - exact).abs().max()) < (0.1 if "int4_sym" not in (k, v) else 0.6)


def test_eval_cache_on_a_tiny_model(session) -> None:
    text = random_token_ids(150, seed=11)
    variants = [
        CacheVariant("exact again", "auto", "auto"),  # the same path: its KL must be exactly 0
        CacheVariant("int8", "int8", "int8"),
        CacheVariant("int4_sym", "int4_sym", "int4_sym"),
    ]
    prompts = [random_token_ids(6, seed=1), random_token_ids(9, seed=2)]
    report = evaluate(session.model, text, variants, prompts, max_new_tokens=12, chunk=64)
    exact, again, i8, i4 = report.rows
    assert again.mean_kl == 0.0 and again.max_abs_logit_diff == 0.0
    assert again.top1_agreement == 1.0 and again.first_divergence == (None, None)
    assert again.perplexity == exact.perplexity and again.perplexity_delta_pct == 0.0
    assert i4.mean_kl > i8.mean_kl > 0.0 and i4.p99_kl >= i4.mean_kl
    assert i4.max_abs_logit_diff > 0.0 and 0.0 < i4.top1_agreement <= 1.0
    spec = session.model.kv_cache_spec(CacheDtype("int4_sym"), CacheDtype("int4_sym"))
    assert i4.bytes_per_token == spec.bytes_per_token
    assert i4.tokens_per_gib == (1 << 30) // spec.bytes_per_token
    assert exact.bytes_per_token == session.model.kv_cache_spec().bytes_per_token
    assert report.text_tokens == 150


def test_eval_cache_window_rows(session) -> None:
    """A window covering the whole text drops nothing (KL exactly 0: the same attention); a
    short one, with or without sinks, costs something; both report what they keep."""
    text = random_token_ids(150, seed=12)
    variants = [
        CacheVariant("wide", "auto", "auto", (4, 200)),
        *window_variants([32], sinks=4),
    ]
    report = evaluate(session.model, text, variants, (), max_new_tokens=4, chunk=48)
    _, wide, window, sinks = report.rows
    assert wide.max_abs_logit_diff < 1e-4 and wide.kept_tokens == 204
    assert window.variant == "window 32" and window.kept_tokens == 32
    assert sinks.variant == "4 sinks + window 28" and sinks.kept_tokens == 32
    assert window.mean_kl > 0.0 and sinks.mean_kl > 0.0
