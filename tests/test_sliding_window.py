"""Sliding-window layers against transformers, their blocks given back, their prefix hits.

Parity: tiny random Mistral (every layer windowed), Qwen2 with ``use_sliding_window`` and
``max_window_layers`` and a ``layer_types`` hybrid, generated well past the window through the
engine (float32, greedy, block size 4): every token is transformers' greedy choice on the same
prefix and every logprob within 2e-3 of transformers' (teacher-forced on the engine's tokens).
A window that were ignored would fail this: the same weights with full attention give other
logits past the window (checked).
"""

from __future__ import annotations

import pytest
import torch
from conftest import hf_logits, make_hf_checkpoint, random_token_ids
from transformers import AutoModelForCausalLM

from kvserve.engine.llm import LLM
from kvserve.intmath import cdiv
from kvserve.kv.cache_dtype import CacheDtype
from kvserve.kv.manager import NULL_BLOCK, KVCacheManager
from kvserve.kv.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from kvserve.models.config import ModelConfig
from kvserve.sampling import SamplingParams

BS = 4
F32 = CacheDtype.of(torch.float32)

CASES = [
    pytest.param("mistral", {"sliding_window": 8}, id="mistral-w8"),
    pytest.param("mistral", {"sliding_window": 13}, id="mistral-w13"),
    pytest.param(
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
        id="qwen2-max-window-layers",
    ),
    pytest.param(
        "qwen2",
        {
            "use_sliding_window": True,
            "sliding_window": 10,
            "num_hidden_layers": 4,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
        id="qwen2-layer-types-hybrid",
    ),
]


def greedy(n: int, logprobs: int | None = 1) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=logprobs)


@pytest.mark.parametrize(("model_type", "overrides"), CASES)
def test_generation_past_the_window_matches_transformers(tmp_path, model_type, overrides):
    ckpt, hf = make_hf_checkpoint(tmp_path, model_type, num_key_value_heads=2, **overrides)
    window = overrides["sliding_window"]
    # room for both runs without evicting: the second run's hits need the first's blocks
    llm = LLM(str(ckpt), dtype="float32", num_kv_blocks=256, block_size=BS)
    assert llm.engine.spec.has_windows
    prompts = [random_token_ids(12, seed=1), random_token_ids(23, seed=2)]
    n = 5 * window
    outs = llm.generate(prompts, greedy(n), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        full = prompt + out.token_ids
        want = torch.log_softmax(hf_logits(hf, full), -1)[len(prompt) - 1 : -1]  # (n, vocab)
        assert out.token_ids == want.argmax(-1).tolist()
        got = torch.tensor([lp[t] for lp, t in zip(out.logprobs, out.token_ids, strict=True)])
        chosen = want.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(got, chosen, atol=2e-3, rtol=0)
    # the same prompts again: prefix hits on every group, the same tokens
    again = llm.generate(prompts, greedy(n), use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert all(o.num_cached_tokens > 0 for o in again)
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.pool.num_used_blocks == 0
    # the window matters: transformers with full attention disagrees past it
    layers = hf.config.num_hidden_layers
    no_window = {"sliding_window": None}
    if model_type != "mistral":
        no_window.update(use_sliding_window=False, layer_types=["full_attention"] * layers)
    hf_full = AutoModelForCausalLM.from_pretrained(
        ckpt, attn_implementation="eager", **no_window
    ).eval()
    seq = prompts[1] + outs[1].token_ids
    assert not torch.allclose(hf_logits(hf_full, seq)[-1], hf_logits(hf, seq)[-1], atol=1e-3)


def test_windowed_request_holds_bounded_blocks(tmp_path):
    ckpt, _ = make_hf_checkpoint(tmp_path, "mistral", num_key_value_heads=2, sliding_window=8)
    llm = LLM(str(ckpt), dtype="float32", num_kv_blocks=32, block_size=BS)
    engine = llm.engine
    req = engine.add_request(random_token_ids(30), greedy(200, None))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        held.append(len(engine.kv_manager.held_blocks(req.request_id)))
        engine.check_integrity()
    # one group (both layers windowed): ceil(8 / 4) + 1 blocks, however long it ran
    assert max(held[1:-1]) == cdiv(8, BS) + 1
    assert engine.kv_manager.pool.num_used_blocks == 0


def test_window_spec_bytes_and_blocks():
    spec = SlidingWindowSpec(2, 16, F32, F32, BS, sliding_window=8)
    assert spec.bytes_per_token == 2 * 2 * 16 * 4
    # the blocks the last query's window spans: 2 when aligned, 3 when not, never more
    assert [spec.max_blocks(n) for n in (1, 4, 5, 8, 9, 12, 13, 100, 1000)] == [
        1, 1, 2, 2, 3, 2, 3, 2, 2,
    ]  # fmt: skip
    assert max(spec.max_blocks(n) for n in range(1, 500)) == cdiv(8, BS) + 1
    sinks = SlidingWindowSpec(2, 16, F32, F32, BS, sliding_window=8, num_sinks=4)
    assert sinks.max_blocks(1000) == 1 + 2 and sinks.max_blocks(1001) == 1 + 3
    # a hybrid of 21 full and 7 windowed layers of one shape: 4 groups of 7 sharing tensors,
    # a block id costs 7 layers' block
    full = FullAttentionSpec(2, 16, F32, F32, BS)
    hybrid = KVCacheSpec((full,) * 21 + (spec,) * 7)
    assert [len(g.layers) for g in hybrid.groups] == [7, 7, 7, 7]
    assert hybrid.bytes_per_block == 7 * full.bytes_per_block
    assert hybrid.max_blocks(1000) == 3 * cdiv(1000, BS) + 2
    assert hybrid.max_tokens_for(3 * 10 + 3) == 40
    assert KVCacheSpec((spec,) * 4).max_tokens_for(3) is None  # flat: any length


def _prefill_in_chunks(kv: KVCacheManager, req, chunk: int) -> None:
    while req.num_computed_tokens < len(req.all_token_ids) - 1:
        n = min(chunk, len(req.all_token_ids) - 1 - req.num_computed_tokens)
        assert kv.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        kv.cache_blocks(req, req.num_computed_tokens)
        kv.check_integrity()


@pytest.mark.parametrize("sinks", [0, 4])
def test_windowed_prefix_hit_needs_only_the_window(sinks):
    """A's early blocks are given back while it runs, and the first given back is evicted;
    B (A's tokens + 1) still hits all 32 tokens through the window's last blocks (vLLM's
    rule), where a full-attention group would hit nothing. With sinks, block 0 was never given
    back (it holds the sinks), and a hit needs it: once it is gone, nothing is a hit."""
    from conftest import make_request

    spec = SlidingWindowSpec(1, 8, F32, F32, BS, sliding_window=8, num_sinks=sinks)
    kv = KVCacheManager(8, BS, True, False, [spec])
    a = make_request("a", list(range(33)))
    _prefill_in_chunks(kv, a, BS)
    assert sum(b is not NULL_BLOCK for b in kv.blocks_of("a")) <= spec.sink_blocks + 3
    kv.free(a)
    evicted = kv.pool.get_new_blocks(1)  # the least recently freed
    assert evicted[0].block_id == (1 if sinks else 0) and evicted[0].block_hash is None
    kv.pool.free_blocks(evicted)  # back, with no hash: its tokens are gone
    b = make_request("b", list(range(33)) + [99])
    computed, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 32
    first = spec.first_needed_block(32)
    keep = [i < spec.sink_blocks or i >= first for i in range(8)]
    assert [blk is not NULL_BLOCK for blk in computed[0]] == keep
    if sinks:
        kv.pool.uncache([kv.pool.blocks[0]])
        assert kv.get_computed_blocks(b) == (([],), 0)
        return
    assert kv.allocate_slots(b, len(b.all_token_ids) - num_hit, computed) is not None
    b.num_computed_tokens = num_hit
    kv.check_integrity()
    assert kv.block_ids("b")[:first] == [-1] * first


def test_hybrid_hit_is_the_shortest_group_hit():
    """A full group and a windowed group: the hit is where both hold what they need."""
    from conftest import make_request

    full = FullAttentionSpec(1, 8, F32, F32, BS)
    win = SlidingWindowSpec(1, 8, F32, F32, BS, sliding_window=6)
    kv = KVCacheManager(32, BS, True, False, [full, win])
    a = make_request("a", list(range(25)))
    _prefill_in_chunks(kv, a, 8)
    kv.free(a)
    b = make_request("b", list(range(25)) + [7, 7])
    computed, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 24  # 6 full blocks in both groups (the window kept 24 - 6 + 1 on)
    assert all(blk is not NULL_BLOCK for blk in computed[0])
    assert [blk is NULL_BLOCK for blk in computed[1]] == [True] * 4 + [False] * 2


@pytest.mark.parametrize(
    ("cfg", "window", "types"),
    [
        ({"model_type": "mistral", "sliding_window": 4096}, 4096, ("sliding_attention",) * 4),
        ({"model_type": "mistral", "sliding_window": None}, None, ()),
        ({"model_type": "qwen2", "sliding_window": 32, "use_sliding_window": False}, None, ()),
        (
            {
                "model_type": "qwen2",
                "sliding_window": 32,
                "use_sliding_window": True,
                "max_window_layers": 3,
            },
            32,
            ("full_attention",) * 3 + ("sliding_attention",),
        ),
        (
            {
                "model_type": "qwen3",
                "sliding_window": 16,
                "use_sliding_window": True,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
            },
            16,
            ("sliding_attention", "full_attention") * 2,
        ),
    ],
)
def test_config_reads_windows_as_transformers(cfg, window, types):
    base = {
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "max_position_embeddings": 8192,
    }
    config = ModelConfig.from_hf({**base, **cfg})
    assert config.sliding_window == window and config.layer_types == types
    assert config.max_model_len == 8192  # no longer capped at the window


def test_gguf_sliding_window_metadata():
    meta = {
        "general.architecture": "llama",
        "llama.attention.head_count": 4,
        "llama.embedding_length": 64,
        "llama.vocab_size": 32,
        "llama.feed_forward_length": 128,
        "llama.block_count": 2,
        "llama.attention.sliding_window": 4096,
    }
    config = ModelConfig.from_gguf(meta, {"output.weight"})
    assert config.sliding_window == 4096
    assert config.layer_types == ("sliding_attention",) * 2
