"""DeepSeek-V2 / V3 (MLA + MoE) and MiniCPM3 against transformers on tiny random checkpoints.

Each case saves a tiny DeepseekV2/V3 model with ``save_pretrained`` (per-expert weights, the
hub layout), loads it with kvserve and compares: float32 logits of a 64-token sequence, and 32
greedy steps (tokens equal, the chosen token's logprob within 2e-3) of kvserve's dense-cache
decoder against transformers run without a cache at every step; the no-cache and cached
decoders give the same tokens. Shapes are small but every dim differs (rank 32, rope 8, nope
16, v 24), so a swapped split or a wrong rope layout shows up.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import hf_logits, make_hf_model, random_token_ids

from kvserve.models.deepseek import DeepseekForCausalLM
from kvserve.models.loader import load_model
from kvserve.reference.decoders import DenseCacheDecoder, NoCacheDecoder, full_logits

MLA = {
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 24,
    "q_lora_rank": None,
}
MOE = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}

MINICPM3 = {
    **MLA,
    "q_lora_rank": 48,
    "scale_emb": 12,
    "scale_depth": 1.4,
    "dim_model_base": 16,  # logits scaling 64 / 16 = 4
}
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.3, 2.1, 3.7],
    "long_factor": [1.5, 2.0, 4.0, 8.0],
    "original_max_position_embeddings": 256,
}

CASES = [
    pytest.param("deepseek_v2", {**MLA, "first_k_dense_replace": 3}, id="v2-dense"),
    pytest.param(
        "deepseek_v2",
        {**MLA, **MOE, "q_lora_rank": 48, "routed_scaling_factor": 1.5},
        id="v2-moe-q-lora",
    ),
    pytest.param(
        "deepseek_v2",
        {
            **MLA,
            **MOE,
            "topk_method": "group_limited_greedy",
            "n_group": 2,
            "topk_group": 1,
            "rope_parameters": YARN,
        },
        id="v2-moe-groups-yarn",
    ),
    pytest.param(
        "deepseek_v3",
        {**MLA, **MOE, "q_lora_rank": 48, "n_group": 1, "topk_group": 1},
        id="v3-sigmoid",
    ),
    pytest.param(
        "deepseek_v3",
        {**MLA, **MOE, "n_group": 2, "topk_group": 1, "rope_interleave": False},
        id="v3-groups-rotate-half",
    ),
    pytest.param("minicpm3", MINICPM3, id="minicpm3"),
    pytest.param(
        "minicpm3",
        {**MINICPM3, "rope_parameters": LONGROPE, "tie_word_embeddings": True},
        id="minicpm3-longrope-tied",
    ),
]


def make_deepseek_checkpoint(tmp_path: Path, model_type: str, **overrides):
    """A tiny random DeepseekV2/V3 (3 layers) saved to tmp_path/hf; V3's score-correction
    bias (a buffer HF initialises to zeros) drawn too, so the choice it shifts is tested."""
    overrides = {"num_hidden_layers": 3, "max_position_embeddings": 256, **overrides}
    model = make_hf_model(model_type, seed=0, **overrides)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.5 * torch.randn(buf.shape, generator=gen))
    directory = tmp_path / "hf"
    model.save_pretrained(directory)
    return directory, model


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    ids, tokens, logprobs = list(prompt), [], []
    for _ in range(steps):
        lp = hf_logits(model, ids)[-1].log_softmax(-1)
        tok = int(lp.argmax())
        tokens.append(tok)
        logprobs.append(float(lp[tok]))
        ids.append(tok)
    return tokens, logprobs


def kv_greedy(decoder, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    logits = decoder.prefill(prompt)
    tokens, logprobs = [], []
    for _ in range(steps):
        lp = logits.log_softmax(-1)
        tok = int(lp.argmax())
        tokens.append(tok)
        logprobs.append(float(lp[tok]))
        logits = decoder.decode(tok)
    return tokens, logprobs


@pytest.mark.parametrize(("model_type", "overrides"), CASES)
def test_float32_matches_transformers(tmp_path: Path, model_type: str, overrides: dict):
    ckpt, hf_model = make_deepseek_checkpoint(tmp_path, model_type, **overrides)
    loaded = load_model(ckpt, dtype="float32")
    model = loaded.model
    assert isinstance(model, DeepseekForCausalLM)
    assert loaded.config.model_type == model_type

    ids = random_token_ids(64)
    torch.testing.assert_close(full_logits(model, ids), hf_logits(hf_model, ids), atol=2e-4, rtol=0)

    prompt = random_token_ids(9, seed=3)
    want_tokens, want_lp = hf_greedy(hf_model, prompt, 32)
    got_tokens, got_lp = kv_greedy(DenseCacheDecoder(model, 64), prompt, 32)
    assert got_tokens == want_tokens
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), atol=2e-3, rtol=0)
    assert kv_greedy(NoCacheDecoder(model), prompt, 32)[0] == want_tokens


def test_router_stays_float32_in_bfloat16(tmp_path: Path):
    ckpt, _ = make_deepseek_checkpoint(
        tmp_path, "deepseek_v3", **MLA, **MOE, n_group=1, topk_group=1
    )
    model = load_model(ckpt, dtype="bfloat16").model
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.float32
    assert gate.e_score_correction_bias.dtype == torch.float32
    assert model.dtype == torch.bfloat16


def test_latent_cache_holds_one_row_per_token(tmp_path: Path):
    ckpt, _ = make_deepseek_checkpoint(tmp_path, "deepseek_v2", **MLA, first_k_dense_replace=3)
    model = load_model(ckpt, dtype="float32").model
    decoder = DenseCacheDecoder(model, 40)
    # 3 layers x 40 positions x (32 latent + 8 rope) float32 values
    assert decoder.cache_bytes == 3 * 40 * (32 + 8) * 4
    spec = model.kv_cache_spec()
    assert spec.bytes_per_token == 3 * 40 * 4
    assert spec.mha_equivalent_bytes_per_token == 3 * 4 * (16 + 8 + 24) * 4  # 4 heads


def test_moe_layer_freq_other_than_one_is_refused():
    from kvserve.models.deepseek_config import DeepseekConfig

    cfg = make_hf_model("deepseek_v2", **MLA, num_hidden_layers=1).config.to_dict()
    cfg["moe_layer_freq"] = 2
    with pytest.raises(ValueError, match="moe_layer_freq"):
        DeepseekConfig.from_hf(cfg)


def test_longrope_past_the_original_length_is_refused():
    from kvserve.models.deepseek_config import DeepseekConfig

    cfg = make_hf_model("minicpm3", **MINICPM3, num_hidden_layers=1).config.to_dict()
    cfg["rope_parameters"] = {**LONGROPE, "original_max_position_embeddings": 64}
    with pytest.raises(ValueError, match="longrope past original_max_position_embeddings"):
        DeepseekConfig.from_hf(cfg)
