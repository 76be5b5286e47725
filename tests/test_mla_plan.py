"""The planner and `kvserve info` on latent-attention (MLA) models: bytes per token from
``MLASpec`` (the spec the engine allocates with), next to the multi-head cache the same model
would need; the plan's pool is the engine's."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli
from test_deepseek_parity import MLA, make_deepseek_checkpoint

from kvserve.engine.llm import LLM
from kvserve.models.model_session import ModelSession
from kvserve.plan import MLAShape, PlanInput, plan_row

GIB = 2**30
# DeepSeek-V3's attention shape (config.json of deepseek-ai/DeepSeek-V3, the fields kvserve reads)
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "max_position_embeddings": 163840,
}


def test_plan_of_deepseek_v3_config(tmp_path: Path, capsys) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3))
    code, out, _ = run_cli(
        capsys, "plan", "--model", str(path), "--device-memory", "80GiB", "--context", "8192",
        "--json",
    )  # fmt: skip
    assert code == 0
    (row,) = json.loads(out)["rows"]
    assert row["bytes_per_token"] == 61 * 576 * 2 == 70_272  # bfloat16 latent rows
    assert row["mha_bytes_per_token"] == 61 * 128 * (128 + 64 + 128) * 2 == 4_997_120
    budget = int(80 * GIB * 0.9)
    assert row["pool_blocks"] == budget // (70_272 * 16)
    assert row["requests"] == row["pool_blocks"] // 512
    assert row["mha_requests"] == budget // (4_997_120 * 16) // 512
    code, text, _ = run_cli(
        capsys, "plan", "--model", str(path), "--device-memory", "80GiB", "--context", "8192"
    )
    assert "MLA latent 512 + rope 64 (576 values/token/layer" in text
    assert "as MHA b/token" in text and "4,997,120" in text


def test_plan_pool_is_the_engines(tmp_path: Path) -> None:
    ckpt, _ = make_deepseek_checkpoint(tmp_path, "deepseek_v2", **MLA, first_k_dense_replace=3)
    session = ModelSession.open(ckpt, "float32", "cpu")
    c = session.config
    shape = MLAShape(c.kv_lora_rank, c.qk_rope_head_dim, 4, c.qk_nope_head_dim, c.v_head_dim)
    inp = PlanInput(3, 4, 24, device_memory=8 << 20, weights_bytes=0, block_size=4, mla=shape)
    row = plan_row(inp, "float32", 64)
    engine = LLM(session=session, block_size=4, kv_cache_memory=row.kv_budget).engine
    assert engine.storage.num_blocks == row.pool_blocks
    assert engine.spec.bytes_per_token == row.bytes_per_token == 3 * 40 * 4
    assert engine.spec.mha_equivalent_bytes_per_token == row.mha_bytes_per_token


def test_info_shows_latent_bytes_beside_mha(tmp_path: Path) -> None:
    from kvserve.info import describe_kv_cache

    ckpt, _ = make_deepseek_checkpoint(tmp_path, "deepseek_v2", **MLA, first_k_dense_replace=3)
    spec = ModelSession.open(ckpt, "float32", "cpu").model.kv_cache_spec()
    assert describe_kv_cache(spec) == (
        "3 x mla (latent 32 + rope 8, float32; 160 B/token/layer vs 768 as MHA): "
        "480 B/token, as MHA 2,304 B/token (20.8%)"
    )
