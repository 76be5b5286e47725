"""benchmarks/compute_floor.py: the FLOPs and K/V bytes a batch workload needs equal a
step-by-step count of what an engine does (a sliding-window layer read up to its window);
other architectures are refused; the matmul rate is positive and refuses empty shapes."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is a package at the repository root
    sys.path.insert(0, str(ROOT))

from benchmarks import compute_floor  # noqa: E402
from kvserve.kv.cache_dtype import CacheDtype  # noqa: E402
from kvserve.kv.spec import KVCacheSpec  # noqa: E402

# the default model's shapes (SmolLM2-135M)
CONFIG = SimpleNamespace(
    hidden_size=576,
    head_dim=64,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    num_hidden_layers=30,
    vocab_size=49152,
    model_type="smollm",
)
BF16 = CacheDtype.of(torch.bfloat16)


def step_by_step(prompts: list[int], outputs: list[int], layer_bytes: list[tuple[int, int | None]]):
    """What an engine does, one step at a time: each linear layer as (out, in) weight shapes;
    each decode step reads, per cache layer (bytes per token, window or None), the rows that
    layer holds for the request's context."""
    c = CONFIG
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = [(q, c.hidden_size), (kv, c.hidden_size), (kv, c.hidden_size), (c.hidden_size, q)]
    shapes += [(c.intermediate_size, c.hidden_size)] * 2 + [(c.hidden_size, c.intermediate_size)]
    layer = c.num_hidden_layers * sum(2 * n * k for n, k in shapes)
    head = 2 * c.vocab_size * c.hidden_size
    flops = reads = 0
    for p, o in zip(prompts, outputs, strict=True):
        flops += p * layer + head  # prefill, then the first token sampled
        context = p
        for _ in range(o - 1):  # each further token: one decode step over the whole context
            context += 1
            flops += layer + head
            for nbytes, window in layer_bytes:
                reads += nbytes * (context if window is None else min(context, window))
    return flops, reads


def test_counts_equal_a_step_by_step_count() -> None:
    prompts, outputs = [32, 500, 77], [1, 2, 256]
    # 3 layers of 3 bf16 kv heads x 64: two full, one sliding over 100 tokens
    spec = KVCacheSpec.for_layers(3, 64, BF16, BF16, 16, [None, 100, None])
    per_layer = 2 * 3 * 64 * 2
    layers = [(per_layer, None), (per_layer, 100), (per_layer, None)]
    flops, reads = step_by_step(prompts, outputs, layers)
    assert compute_floor.workload_linear_flops(CONFIG, prompts, outputs) == flops
    assert compute_floor.workload_kv_read_bytes(prompts, outputs, spec.bytes_held) == reads


def test_other_architectures_are_refused_not_miscounted() -> None:
    deepseek = SimpleNamespace(**{**vars(CONFIG), "model_type": "deepseek_v2"})
    with pytest.raises(ValueError, match="got model_type 'deepseek_v2'"):
        compute_floor.workload_linear_flops(deepseek, [8], [2])


def test_the_default_models_linear_flops_per_token() -> None:
    # 30 layers x (qkv 576 x 960 + o 576 x 576 + gate/up/down 3 x 576 x 1536) x 2; lm_head
    layers, head = compute_floor.linear_flops_per_token(CONFIG)
    assert layers == 30 * 2 * (576 * 960 + 576 * 576 + 3 * 576 * 1536)
    assert head == 2 * 576 * 49152


def test_floor_adds_both_bounds_and_describe_names_each_engine() -> None:
    floor = compute_floor.ComputeFloor(
        linear_flops=4e12, matmul_flops_s=4e11, kv_read_bytes=3e10, bandwidth_bytes_s=2e10
    )
    assert floor.matmul_s == pytest.approx(10.0) and floor.kv_s == pytest.approx(1.5)
    assert floor.floor_s == pytest.approx(11.5)
    lines = compute_floor.describe(floor, "bfloat16", {"kvserve": 23.0, "vllm": 46.0})
    assert "4.00 TFLOP" in lines[0] and "together 11.5 s" in lines[0]
    assert lines[1:] == ["floor / kvserve: 0.50 (23.0 s)", "floor / vllm: 0.25 (46.0 s)"]


def test_matmul_rate_is_measured_and_refuses_empty_shapes() -> None:
    assert compute_floor.measure_matmul_flops(torch.float32, 64, 32, 48, budget_s=0.01) > 0
    with pytest.raises(ValueError, match="rows, k, n must be >= 1, got 0, 32, 48"):
        compute_floor.measure_matmul_flops(torch.float32, 0, 32, 48)
