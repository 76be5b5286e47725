"""`kvserve plan` (plan.py, plan_cli.py): the lessons' example, real public configs against hand
computations, and the plan's pool against what the engine allocates for the same memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_hf_checkpoint, run_cli

from kvserve.config import CacheConfig
from kvserve.engine.engine import LLMEngine
from kvserve.models.config import ModelConfig
from kvserve.models.model_session import ModelSession
from kvserve.plan import PlanInput, plan, plan_row

GB = 10**9

# Llama-3-8B's config.json (the fields that shape the cache), as published on the Hub
LLAMA_3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
}


def test_the_lessons_example() -> None:
    # "32-layer model, 8 KV heads, head dim 128, fp16, at 8k context: bytes ~ 1.05 GB per
    # request. On an 80GB GPU with ~16GB of weights, that's around 60 concurrent users"
    inp = PlanInput(32, 8, 128, device_memory=80 * GB, weights_bytes=16 * GB, reserve=0.0)
    row = plan_row(inp, "float16", 8192)
    assert row.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert row.bytes_per_request == 8192 * 131_072 == 2**30  # 1.07 GB; 8,000 tokens: 1.05 GB
    assert 8000 * row.bytes_per_token == 1_048_576_000
    blocks = 64 * GB // (16 * 131_072)
    assert row.pool_blocks == blocks and row.requests == blocks // 512 == 59  # "around 60"


def test_llama_3_8b_config_by_hand() -> None:
    cfg = ModelConfig.from_hf(LLAMA_3_8B)
    inp = PlanInput(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 80 * 2**30, 16 * GB
    )
    rows = plan(inp, ["bfloat16", "float32"], [8192, 1000])
    bf16_8k, bf16_1k, f32_8k, _ = rows
    assert cfg.head_dim == 128 and bf16_8k.bytes_per_token == 131_072
    assert f32_8k.bytes_per_token == 262_144
    budget = int(80 * 2**30 * 0.9) - 16 * GB
    assert bf16_8k.kv_budget == budget
    assert bf16_8k.pool_blocks == budget // (131_072 * 16)
    # 1,000 tokens take 63 blocks (1,008 token slots): whole blocks are what a request holds
    assert bf16_1k.allocated_per_request == 63 * 16 * 131_072
    assert bf16_1k.bytes_per_request == 1000 * 131_072
    assert bf16_1k.requests == bf16_1k.pool_blocks // 63


@pytest.mark.parametrize(
    "model_dtype,dtype",
    [
        ("float32", "float32"),
        ("bfloat16", "bfloat16"),
        ("float32", "int8"),
        ("bfloat16", "int4_sym"),
        ("bfloat16", "int4"),
        ("float32", "fp8_e4m3"),
        ("bfloat16", "int4_sym/int8"),
        ("bfloat16", "int8/bfloat16"),
    ],
)
@pytest.mark.parametrize("block_size", [4, 16])
def test_the_planned_pool_is_what_the_engine_allocates(
    tmp_path: Path, model_dtype: str, dtype: str, block_size: int
) -> None:
    path, _ = make_hf_checkpoint(tmp_path, "llama", num_key_value_heads=2)
    session = ModelSession.open(path, model_dtype, "cpu")
    cfg = session.config
    inp = PlanInput(
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        cfg.head_dim,
        device_memory=3 * 2**20 + 12345,  # any size: the budget need not be whole blocks
        weights_bytes=2**20,
        block_size=block_size,
    )
    row = plan_row(inp, dtype, 100)
    k, v = (dtype.split("/") * 2)[:2]
    cache = CacheConfig(
        block_size=block_size, kv_cache_memory=row.kv_budget, k_cache_dtype=k, v_cache_dtype=v
    )
    engine = LLMEngine.from_session(session, cache, enforce_eager=True)
    assert engine.spec.cache_dtype_name == dtype
    assert engine.kv_manager.pool.num_blocks == row.pool_blocks > 0
    assert engine.storage.nbytes == row.pool_blocks * block_size * row.bytes_per_token
    assert engine.spec.bytes_per_token == row.bytes_per_token


def test_plan_cli_text_and_json(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    dims = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--kv-cache-dtype", "float16"]
    device = ["--device-memory", "80GB", "--weights-bytes", "16GB", "--reserve", "0"]
    code, out, _ = run_cli(capsys, "plan", *dims, "--context", "8192", *device)
    assert code == 0
    assert "1,073,741,824 bytes = 1.07 GB (1.00 GiB)" in out
    assert "the lessons' rounding: 1.05 GB" in out and "59 requests fit" in out
    code, out, _ = run_cli(capsys, "plan", *dims, "--context", "8192", "4096", *device, "--json")
    report = json.loads(out)
    assert [r["requests"] for r in report["rows"]] == [59, 119]
    # a bare config.json: the shape from it, the weights from the flag
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_3_8B))
    args = ["--model", str(config), "--context", "8192", "--device", "H100-80GB", "--json"]
    code, out, _ = run_cli(capsys, "plan", *args, "--weights-bytes", "16GB")
    row = json.loads(out)["rows"][0]
    assert row["bytes_per_token"] == 131_072 and row["kv_budget"] == int(80 * 2**30 * 0.9) - 16 * GB
    code, _, err = run_cli(capsys, "plan", "--layers", "32", "--context", "8192")
    assert code == 2 and "together" in err


def test_plan_text_costs_its_tokens(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    # the lessons' tokens chapter: a specialist text takes more tokens per word than plain
    # prose, and every token costs the same KV bytes
    from kvserve.default_model import default_model_path
    from kvserve.tokenizer import Tokenizer

    gguf = default_model_path()
    tok = Tokenizer.load(gguf.parent, gguf)
    plain = tmp_path / "plain.txt"
    plain.write_text("The cat sat on the mat and looked at the garden for a long time.\n")
    clinical = tmp_path / "clinical.txt"
    clinical.write_text("Pt w/ hx of NSTEMI, s/p PCI; dx: HFrEF, EF 35%, on ASA, clopidogrel.\n")
    got = {}
    for f in (plain, clinical):
        code, out, _ = run_cli(
            capsys, "plan", "--text", str(f), "--kv-cache-dtype", "bfloat16", "int8",
            "--context", "2048", "--json",
        )  # fmt: skip
        assert code == 0
        bf16, int8 = json.loads(out)["text"]["costs"]
        n = len(tok.encode(f.read_text(), add_special_tokens=False))
        assert bf16["tokens"] == n and bf16["words"] == len(f.read_text().split())
        assert bf16["kv_bytes"] == n * 2 * 30 * 3 * 64 * 2  # SmolLM2-135M, bfloat16
        assert int8["kv_bytes"] == n * 30 * 3 * (68 + 68)  # int8: 64 codes + 2 scales, K and V
        assert bf16["allocated_bytes"] == -(-n // 16) * 16 * 2 * 30 * 3 * 64 * 2
        assert bf16["context_share"]["2048"] == pytest.approx(n / 2048)
        got[f.name] = bf16["tokens_per_word"]
    assert got["clinical.txt"] > got["plain.txt"]
    code, out, _ = run_cli(capsys, "plan", "--text", str(plain), "--context", "8192")
    assert "tokens per word" in out and "of KV" in out


# Mistral-7B-v0.1's config.json: every layer a 4096-token sliding window
MISTRAL_7B_V01 = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
    "rope_theta": 10000.0,
}


def _windows(cfg: ModelConfig) -> tuple[int | None, ...]:
    return tuple(cfg.layer_window(i) for i in range(cfg.num_hidden_layers))


def test_mistral_7b_window_caps_the_request_by_hand() -> None:
    cfg = ModelConfig.from_hf(MISTRAL_7B_V01)
    inp = PlanInput(32, 8, 128, 80 * 2**30, 15 * GB, windows=_windows(cfg))
    short, at_window, long = plan(inp, ["bfloat16"], [1000, 4096, 32768])
    assert short.layout == "sliding 4096" and short.bytes_per_token == 131_072
    assert short.bytes_per_request == 1000 * 131_072  # under the window: every token
    # past the window a request keeps 4,096 tokens' rows, in 4096 / 16 blocks at whole blocks
    # (one more between them: KVCacheSpec.max_blocks)
    assert at_window.bytes_per_request == long.bytes_per_request == 4096 * 131_072
    assert long.allocated_per_request == 256 * 16 * 131_072
    assert long.requests == long.pool_blocks // 256
    assert plan_row(inp, "bfloat16", 32769).requests == long.pool_blocks // 257
    full = plan_row(PlanInput(32, 8, 128, 80 * 2**30, 15 * GB), "bfloat16", 32768)
    assert full.requests == full.pool_blocks // 2048 and long.requests > 7 * full.requests


def test_streaming_plan_rows_are_flat() -> None:
    inp = PlanInput(30, 3, 64, 24 * 2**30, 0, block_size=16, streaming=(4, 1020))
    rows = plan(inp, ["bfloat16"], [512, 2048, 65536])
    assert rows[0].layout == "4 sinks + window 1020"
    assert rows[0].bytes_per_request == 512 * 23_040
    assert rows[1].bytes_per_request == rows[2].bytes_per_request == 1024 * 23_040
    assert rows[1].requests == rows[2].requests


@pytest.mark.parametrize(
    "overrides",
    [
        {"model_type": "mistral", "sliding_window": 8},
        {
            "model_type": "qwen2",
            "use_sliding_window": True,
            "sliding_window": 8,
            "num_hidden_layers": 4,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
    ],
    ids=["mistral", "hybrid"],
)
def test_windowed_planned_pool_is_what_the_engine_allocates(tmp_path: Path, overrides) -> None:
    model_type = overrides.pop("model_type")
    path, _ = make_hf_checkpoint(tmp_path, model_type, num_key_value_heads=2, **overrides)
    session = ModelSession.open(path, "float32", "cpu")
    cfg = session.config
    inp = PlanInput(
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        cfg.head_dim,
        device_memory=3 * 2**20 + 12345,
        weights_bytes=2**20,
        block_size=4,
        windows=_windows(cfg),
    )
    row = plan_row(inp, "float32", 100)
    cache = CacheConfig(block_size=4, kv_cache_memory=row.kv_budget)
    engine = LLMEngine.from_session(session, cache, enforce_eager=True)
    assert engine.kv_manager.pool.num_blocks == row.pool_blocks > 0
    assert engine.storage.nbytes == row.pool_blocks * engine.spec.bytes_per_block
    assert engine.spec.max_blocks(100) * engine.spec.bytes_per_block == row.allocated_per_request


# DeepSeek-V2-Lite's config.json (the fields that shape its cache and the config record)
DEEPSEEK_V2_LITE = {
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "topk_method": "greedy",
    "max_position_embeddings": 163840,
}


def test_three_real_configs_by_hand(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Llama-3-8B (full attention), Mistral-7B-v0.1 (a 4096-token window on every layer) and
    DeepSeek-V2-Lite (an MLA latent cache) through `kvserve plan --model config.json`, each
    against the lessons' arithmetic done by hand, at 32k tokens on an 80 GiB device."""
    rows = {}
    for name, cfg in (
        ("llama", LLAMA_3_8B),
        ("mistral", MISTRAL_7B_V01),
        ("deepseek", DEEPSEEK_V2_LITE),
    ):
        path = tmp_path / name / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(cfg))
        code, out, _ = run_cli(
            capsys, "plan", "--model", str(path), "--device-memory", "80GiB",
            "--weights-bytes", "16GB", "--context", "32768", "--json",
        )  # fmt: skip
        assert code == 0
        (rows[name],) = json.loads(out)["rows"]
    budget = int(80 * 2**30 * 0.9) - 16 * GB
    llama, mistral, deepseek = rows["llama"], rows["mistral"], rows["deepseek"]
    assert llama["bytes_per_token"] == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers x 8 x 128
    assert llama["bytes_per_request"] == 32768 * 131_072
    assert llama["requests"] == budget // (131_072 * 16) // 2048
    assert mistral["layout"] == "sliding 4096"
    assert mistral["bytes_per_request"] == 4096 * 131_072  # the window's rows only
    assert mistral["requests"] == budget // (131_072 * 16) // 256
    assert deepseek["layout"] == "mla"
    assert deepseek["bytes_per_token"] == 27 * (512 + 64) * 2 == 31_104
    assert deepseek["mha_bytes_per_token"] == 27 * 16 * (128 + 64 + 128) * 2 == 276_480
    assert deepseek["requests"] == budget // (31_104 * 16) // 2048
    # at 32k: the window holds 8x the requests of full attention, the latent ~4.2x
    assert mistral["requests"] >= 8 * llama["requests"]
    assert deepseek["requests"] > 4 * llama["requests"]
    # the same latent shape from explicit dims (--layers --mla R P H D V) plans the same
    code, out, _ = run_cli(
        capsys, "plan", "--layers", "27", "--mla", "512", "64", "16", "128", "128",
        "--device-memory", "80GiB", "--weights-bytes", "16GB", "--context", "32768", "--json",
    )  # fmt: skip
    assert code == 0
    (dims,) = json.loads(out)["rows"]
    assert dims == deepseek
