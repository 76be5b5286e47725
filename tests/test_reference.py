"""Exactness of the reference decoders: no cache vs dense cache, edit reuse, multi-turn chat.

Two models: the embedded SmolLM2-135M-Instruct in float32 (loaded once for the module; the
no-cache run is O(n^2), so prompts are short) and a tiny random-weight GQA Llama saved with
``save_pretrained``, cheap enough for property tests of chunked prefill and edits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv.cache_dtype import CacheDtype
from kvserve.models.llama import LlamaForCausalLM, kv_cache_spec
from kvserve.models.loader import load_model
from kvserve.models.model_session import ModelSession
from kvserve.reference.decoders import DenseCacheDecoder, NoCacheDecoder, full_logits
from kvserve.reference.generation import GenerationResult, generate
from kvserve.reference.sessions import chat_turn, new_conversation
from kvserve.sampling import SamplingParams

GREEDY_TOKENS = 64
DECODER_ATOL = 1e-3  # no cache vs dense cache, logits of every step
REUSE_ATOL = 1e-4  # a reused prefix vs computing it fresh
TINY_ATOL = 1e-5


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def max_step_diff(a: GenerationResult, b: GenerationResult) -> float:
    assert len(a.step_logits) == len(b.step_logits)
    return max(
        float((x - y).abs().max()) for x, y in zip(a.step_logits, b.step_logits, strict=True)
    )


# --------------------------------------------------------------------------------------------
# the default model


@pytest.fixture(scope="module")
def smol() -> ModelSession:
    return ModelSession.open(None, "float32", "cpu")


@pytest.fixture(scope="module")
def prompt_ids(smol: ModelSession) -> list[int]:
    ids = smol.encode_prompt("The key-value cache of a transformer stores")
    assert 5 <= len(ids) <= 10
    return ids


@pytest.fixture(scope="module")
def greedy_pair(smol: ModelSession, prompt_ids: list[int]):
    """64 greedy tokens from both decoders (the expensive part of this module, run once)."""
    params = greedy(GREEDY_TOKENS)
    slow_dec = NoCacheDecoder(smol.model)
    slow = generate(slow_dec, prompt_ids, params, keep_logits=True)
    fast_dec = DenseCacheDecoder(smol.model, len(prompt_ids) + GREEDY_TOKENS)
    fast = generate(fast_dec, prompt_ids, params, keep_logits=True)
    return slow_dec, slow, fast_dec, fast


@pytest.mark.slow  # shares the 64-token O(n^2) no-cache run
def test_no_cache_and_dense_cache_generate_the_same_tokens(greedy_pair) -> None:
    _, slow, _, fast = greedy_pair
    assert slow.completion_tokens == fast.completion_tokens == GREEDY_TOKENS
    assert slow.finish_reason == fast.finish_reason == "length"
    assert slow.token_ids == fast.token_ids


@pytest.mark.slow  # shares the 64-token O(n^2) no-cache run
def test_no_cache_and_dense_cache_logits_agree_at_every_step(greedy_pair) -> None:
    _, slow, _, fast = greedy_pair
    assert len(slow.step_logits) == GREEDY_TOKENS
    for step, (a, b) in enumerate(zip(slow.step_logits, fast.step_logits, strict=True)):
        assert a.shape == b.shape == (49152,) and a.dtype == b.dtype == torch.float32
        diff = float((a - b).abs().max())
        assert diff < DECODER_ATOL, f"step {step}: max |logit diff| {diff}"
        assert int(a.argmax()) == int(b.argmax()) == slow.token_ids[step]


@pytest.mark.slow  # shares the 64-token O(n^2) no-cache run
def test_counters(greedy_pair, prompt_ids: list[int], smol: ModelSession) -> None:
    slow_dec, slow, fast_dec, fast = greedy_pair
    p, n = len(prompt_ids), GREEDY_TOKENS
    # no cache: every step recomputes K/V of the whole sequence (lengths p, p+1, ..., p+n-1)
    assert slow.kv_projections == slow_dec.counters.kv_projections == sum(range(p, p + n))
    assert slow_dec.counters.steps == n
    assert slow_dec.counters.cache_rows_read == 0 and slow_dec.cache_bytes == 0
    # cached: each token's K/V once; the last sampled token is never fed back
    assert fast.kv_projections == fast_dec.counters.kv_projections == p + n - 1
    assert fast_dec.counters.steps == n
    assert fast_dec.counters.last_rows_read == p + n - 2
    assert fast_dec.counters.cache_rows_read == sum(range(p, p + n - 1))
    assert fast.reused_tokens == 0 and fast_dec.counters.computed_tokens == p
    assert len(fast_dec.tokens) == p + n - 1
    assert fast_dec.tokens == prompt_ids + fast.token_ids[:-1]
    cfg = smol.config
    max_len = p + n
    expected = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * max_len * 4
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (30, 3, 64)
    assert fast_dec.cache_bytes == expected
    # the planner's single source of bytes per token agrees with what the decoder allocated
    assert (
        fast_dec.cache_bytes
        == kv_cache_spec(cfg, CacheDtype("float32"), CacheDtype("float32")).bytes_per_token
        * max_len
    )
    assert fast_dec.used_cache_bytes == expected * (p + n - 1) // max_len


@pytest.mark.slow  # shares the 64-token O(n^2) no-cache run
def test_full_logits_matches_the_no_cache_steps(greedy_pair, smol, prompt_ids) -> None:
    """full_logits over prompt + generated tokens gives every step's logits in one pass."""
    _, slow, _, fast = greedy_pair
    k = 8  # a few steps are enough; the pass is over p + k tokens
    rows = full_logits(smol.model, prompt_ids + fast.token_ids[: k - 1])
    assert rows.shape == (len(prompt_ids) + k - 1, 49152)
    for step in range(k):
        row = rows[len(prompt_ids) - 1 + step]
        torch.testing.assert_close(row, slow.step_logits[step], atol=DECODER_ATOL, rtol=0)


EDIT_A = "The quick brown fox jumps over the lazy dog"
EDIT_B = "The quick brown fox sleeps under the lazy dog"


def test_edit_reuses_the_common_prefix(smol: ModelSession) -> None:
    a, b = smol.encode_prompt(EDIT_A), smol.encode_prompt(EDIT_B)
    common = common_prefix(a, b)
    assert 0 < common < min(len(a), len(b))
    params = greedy(8)
    dec = DenseCacheDecoder(smol.model, 64)
    generate(dec, a, greedy(3))  # the cache holds A plus two generated tokens
    assert dec.tokens[: len(a)] == a and len(dec.tokens) == len(a) + 2
    edited = generate(dec, b, params, keep_logits=True)
    assert edited.reused_tokens == dec.counters.reused_tokens == common
    assert dec.counters.computed_tokens == len(b) - common
    fresh_dec = DenseCacheDecoder(smol.model, 64)
    fresh = generate(fresh_dec, b, params, keep_logits=True)
    assert fresh.reused_tokens == 0
    assert edited.token_ids == fresh.token_ids
    assert max_step_diff(edited, fresh) < REUSE_ATOL
    assert dec.tokens == fresh_dec.tokens == b + fresh.token_ids[:-1]


def test_same_prompt_recomputes_only_the_last_token(smol: ModelSession) -> None:
    a = smol.encode_prompt(EDIT_A)
    dec = DenseCacheDecoder(smol.model, 32)
    first = dec.prefill(a)
    again = dec.prefill(a)
    assert dec.counters.reused_tokens == len(a) - 1
    assert dec.counters.computed_tokens == 1
    assert dec.tokens == a
    torch.testing.assert_close(again, first, atol=REUSE_ATOL, rtol=0)


def test_extension_reuses_all_of_the_old_prompt(smol: ModelSession) -> None:
    a = smol.encode_prompt(EDIT_A)
    more = smol.tokenizer.encode(" and runs away.", add_special_tokens=False)
    dec = DenseCacheDecoder(smol.model, 32)
    dec.prefill(a)
    extended = dec.prefill(a + more)
    assert dec.counters.reused_tokens == len(a)
    assert dec.counters.computed_tokens == len(more)
    assert dec.counters.kv_projections == len(a) + len(more)
    fresh = DenseCacheDecoder(smol.model, 32).prefill(a + more)
    torch.testing.assert_close(extended, fresh, atol=REUSE_ATOL, rtol=0)


def test_shorter_prompt_moves_the_fill_pointer_back(smol: ModelSession) -> None:
    a = smol.encode_prompt(EDIT_A)
    dec = DenseCacheDecoder(smol.model, 32)
    dec.prefill(a)
    head = a[:4]
    logits = dec.prefill(head)
    assert dec.counters.reused_tokens == 3 and dec.counters.computed_tokens == 1
    assert dec.tokens == head
    torch.testing.assert_close(
        logits, DenseCacheDecoder(smol.model, 8).prefill(head), atol=REUSE_ATOL, rtol=0
    )


def test_multi_turn_chat_reuses_the_conversation(smol: ModelSession) -> None:
    tok = smol.require_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=12)
    conv = new_conversation(smol, None, max_len=256)
    turn1 = chat_turn(smol, conv, "What is the capital of France?", params)
    assert turn1.reused_tokens == 0 and turn1.computed_tokens == turn1.prompt_tokens
    assert 0 < turn1.completion_tokens <= 12 and turn1.text
    assert [m["role"] for m in conv.messages] == ["user", "assistant"]
    assert conv.messages[1]["content"] == turn1.text
    held = list(conv.decoder.tokens)
    assert len(held) == turn1.cache_tokens == turn1.prompt_tokens + turn1.completion_tokens - 1

    messages = [*conv.messages, {"role": "user", "content": "And of Germany?"}]
    prompt2 = tok.apply_chat_template(messages)
    turn2 = chat_turn(smol, conv, "And of Germany?", params)
    assert turn2.prompt_tokens == len(prompt2)
    assert turn2.reused_tokens == common_prefix(held, prompt2[:-1])
    assert turn2.reused_tokens >= turn1.prompt_tokens  # at least all of turn 1's prompt
    assert turn2.computed_tokens == len(prompt2) - turn2.reused_tokens
    assert conv.decoder.tokens[: len(prompt2)] == prompt2

    fresh = generate(
        DenseCacheDecoder(smol.model, 256),
        prompt2,
        params,
        eos_token_ids=smol.eos_token_ids,
        tokenizer=tok,
    )
    assert turn2.text == fresh.text
    assert turn2.completion_tokens == fresh.completion_tokens
    reply_in_cache = conv.decoder.tokens[len(prompt2) :]
    assert reply_in_cache == fresh.token_ids[: len(reply_in_cache)]
    assert len(reply_in_cache) == fresh.completion_tokens - 1


def test_chat_turn_rejects_a_conversation_that_does_not_fit(smol: ModelSession) -> None:
    conv = new_conversation(smol, "Be brief.", max_len=16)
    with pytest.raises(ValueError, match="no longer fits"):
        chat_turn(smol, conv, "Tell me everything about the history of Europe.", greedy(4))


# --------------------------------------------------------------------------------------------
# a tiny random-weight GQA Llama


TINY_VOCAB = 96


def save_tiny_llama(directory: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random Llama (GQA: 4 query heads, 2 KV heads) saved with save_pretrained.

    Weights are redrawn at unit scale (HF's std 0.02 init would make attention nearly uniform
    and hide position or cache mistakes).
    """
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    kwargs = {
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 112,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **overrides,
    }
    torch.manual_seed(seed)
    model = HFLlama(LlamaConfig(**kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # RMSNorm weights: not all ones
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama-gqa")
    loaded = load_model(path, "float32", "cpu")
    assert loaded.config.num_key_value_heads == 2 and loaded.config.num_attention_heads == 4
    return loaded.model


def tiny_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(
        0, TINY_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def test_tiny_chunked_prefill_matches_full_logits(tiny: LlamaForCausalLM) -> None:
    seq = tiny_tokens(48, seed=1)
    rows = full_logits(tiny, seq)
    assert rows.shape == (48, TINY_VOCAB)
    dec = DenseCacheDecoder(tiny, 64)
    # prefill A, then A + more (a chunk that attends over cached rows), then A + more + more
    for end in (10, 25, 26, 33):
        logits = dec.prefill(seq[:end])
        torch.testing.assert_close(logits, rows[end - 1], atol=TINY_ATOL, rtol=0)
    assert dec.counters.reused_tokens == 26 and dec.counters.computed_tokens == 7
    for i in range(33, 48):
        logits = dec.decode(seq[i])
        torch.testing.assert_close(logits, rows[i], atol=TINY_ATOL, rtol=0)
    assert dec.counters.kv_projections == 48
    assert dec.tokens == seq


def test_tiny_no_cache_decoder_matches_full_logits(tiny: LlamaForCausalLM) -> None:
    seq = tiny_tokens(30, seed=2)
    rows = full_logits(tiny, seq)
    dec = NoCacheDecoder(tiny)
    torch.testing.assert_close(dec.prefill(seq[:5]), rows[4], atol=TINY_ATOL, rtol=0)
    for i in range(5, 30):
        torch.testing.assert_close(dec.decode(seq[i]), rows[i], atol=TINY_ATOL, rtol=0)
    assert dec.counters.kv_projections == sum(range(5, 31))


def test_tiny_logits_depend_on_position_and_context(tiny: LlamaForCausalLM) -> None:
    """Sanity: the random model is not degenerate, so the exactness tests can fail."""
    seq = tiny_tokens(20, seed=3)
    rows = full_logits(tiny, seq)
    shifted = full_logits(tiny, [5, *seq])
    assert float((rows[-1] - shifted[-1]).abs().max()) > 1e-2
    assert float(rows.std(dim=-1).min()) > 0.1


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    steps=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), min_size=1, max_size=5),
)
def test_tiny_edits_reuse_the_common_prefix_exactly(
    tiny: LlamaForCausalLM, seed: int, steps: list[tuple[int, int]]
) -> None:
    """Any sequence of prompts: reuse = common prefix (at most len - 1), logits = fresh."""
    dec = DenseCacheDecoder(tiny, 64)
    gen = torch.Generator().manual_seed(seed)
    held: list[int] = []
    for keep, add in steps:
        new = held[:keep] + torch.randint(0, TINY_VOCAB, (add,), generator=gen).tolist()
        new = new[:64]
        logits = dec.prefill(new)
        reused = min(common_prefix(held, new), len(new) - 1)
        assert dec.counters.reused_tokens == reused
        assert dec.counters.computed_tokens == len(new) - reused
        assert dec.tokens == new
        torch.testing.assert_close(logits, full_logits(tiny, new)[-1], atol=TINY_ATOL, rtol=0)
        held = new


def test_tiny_generate_with_a_seed_is_reproducible(tiny: LlamaForCausalLM) -> None:
    params = SamplingParams(temperature=1.0, top_k=20, max_tokens=12, seed=11, ignore_eos=True)
    prompt = tiny_tokens(6, seed=4)
    a = generate(DenseCacheDecoder(tiny, 32), prompt, params)
    b = generate(NoCacheDecoder(tiny), prompt, params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12


def test_tiny_cache_bytes(tiny: LlamaForCausalLM) -> None:
    dec = DenseCacheDecoder(tiny, 40)
    assert dec.cache_bytes == 2 * 2 * 2 * 16 * 40 * 4
    assert dec.used_cache_bytes == 0
    dec.prefill(tiny_tokens(10, seed=5))
    assert dec.used_cache_bytes == 2 * 2 * 2 * 16 * 10 * 4


def test_dense_decoder_rejects_bad_sizes(tiny: LlamaForCausalLM) -> None:
    with pytest.raises(ValueError, match="max_len"):
        DenseCacheDecoder(tiny, 0)
    with pytest.raises(ValueError, match="max_len"):
        DenseCacheDecoder(tiny, 129)  # beyond max_position_embeddings
    dec = DenseCacheDecoder(tiny, 8)
    with pytest.raises(ValueError, match="at least one token"):
        dec.prefill([])
    with pytest.raises(ValueError, match="do not fit"):
        dec.prefill(list(range(9)))
    dec.prefill(list(range(8)))
    with pytest.raises(ValueError, match="full"):
        dec.decode(3)
    with pytest.raises(ValueError, match="at least one token"):
        NoCacheDecoder(tiny).prefill([])


def test_generate_stops_when_the_cache_is_full(tiny: LlamaForCausalLM) -> None:
    prompt = tiny_tokens(6, seed=6)
    r = generate(DenseCacheDecoder(tiny, 10), prompt, greedy(50), max_len=10)
    assert r.finish_reason == "length"
    assert r.completion_tokens == 4
