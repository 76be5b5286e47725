"""The floor a batch workload's own arithmetic puts under any exact engine on this machine.

Two lower bounds, each measured here, not taken from a datasheet:

- the FLOPs of the model's linear layers (q/k/v/o, gate/up/down for every token that goes
  through the layers; the lm_head for every token sampled) at the rate this machine's dense
  matmul reaches in the model's dtype (``F.linear`` on a layer-shaped product, which oneDNN runs
  within a few percent of the CPU's peak: bf16 at ~97% of VDPBF16PS's 2 x 216 GFLOP/s on a
  2-core Zen 4);
- the bytes of K and V the decode steps read (each step reads what its request's cache holds:
  the whole context in a full-attention layer, the window and sinks in a sliding one) at the
  memory bandwidth of a streaming read.

Counted for the Llama family (models/config.py's SUPPORTED_MODEL_TYPES: dense MLP, q/k/v/o);
another architecture (DeepSeek's MLA + MoE) is refused rather than miscounted.

An exact engine computes at least these FLOPs in this dtype and reads at least these bytes, so
its time stays above ``floor_s`` (up to the few percent by which a matmul could beat oneDNN's);
an aim of "N x a peer" that asks for less time than the floor is out of reach for any exact
kernel, however good. Attention's own FLOPs, norms, rotary and sampling are left out
(the floor stays a floor).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.models.config import SUPPORTED_MODEL_TYPES


@dataclass(frozen=True)
class ComputeFloor:
    linear_flops: float  # the workload's linear-layer FLOPs
    matmul_flops_s: float  # the dense matmul rate measured here, FLOP/s
    kv_read_bytes: float  # K and V bytes the decode steps read
    bandwidth_bytes_s: float  # streaming read, bytes/s

    @property
    def matmul_s(self) -> float:
        return self.linear_flops / self.matmul_flops_s

    @property
    def kv_s(self) -> float:
        return self.kv_read_bytes / self.bandwidth_bytes_s

    @property
    def floor_s(self) -> float:
        return self.matmul_s + self.kv_s


def linear_flops_per_token(config) -> tuple[int, int]:
    """(FLOPs of one token through every decoder layer's projections, FLOPs of its lm_head
    row) for a Llama-family config (HF names)."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"the floor counts the linear layers of {', '.join(SUPPORTED_MODEL_TYPES)}, got "
            f"model_type {config.model_type!r}"
        )
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    per_layer = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * 3 * h * config.intermediate_size
    return config.num_hidden_layers * per_layer, 2 * h * config.vocab_size


def workload_linear_flops(config, prompt_lens: list[int], output_lens: list[int]) -> int:
    """Prefill runs every prompt token through the layers and samples the first output token
    (one lm_head row per request); each further output token is one decode step (layers +
    lm_head). The last token sampled is never fed back."""
    layers, head = linear_flops_per_token(config)
    prefill = sum(prompt_lens) * layers + len(prompt_lens) * head
    decode = sum(o - 1 for o in output_lens) * (layers + head)
    return prefill + decode


def workload_kv_read_bytes(
    prompt_lens: list[int], output_lens: list[int], bytes_held: Callable[[int], int]
) -> int:
    """Decode step j (1 .. o-1) of a request with p prompt tokens attends over p + j tokens,
    reading ``bytes_held(p + j)``: the K/V bytes a request of that many tokens keeps, over all
    layers (KVCacheSpec.bytes_held: windows and sinks applied)."""
    return sum(
        bytes_held(p + j)
        for p, o in zip(prompt_lens, output_lens, strict=True)
        for j in range(1, o)
    )


def measure_matmul_flops(
    dtype: torch.dtype, rows: int, k: int, n: int, budget_s: float = 1.0
) -> float:
    """FLOP/s of F.linear((rows, k) x (n, k)^T) in ``dtype``, best timing within the budget."""
    if min(rows, k, n) < 1:
        raise ValueError(f"rows, k, n must be >= 1, got {rows}, {k}, {n}")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    F.linear(x, w)  # warm-up: oneDNN picks and caches its kernel
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    while True:
        t = time.perf_counter()
        F.linear(x, w)
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() > deadline:
            break
    return 2.0 * rows * k * n / best


def measure_floor(
    config,
    dtype: torch.dtype,
    bytes_held: Callable[[int], int],
    prompt_lens: list[int],
    output_lens: list[int],
    bandwidth_gb_s: float,
) -> ComputeFloor:
    """The floor of this workload here; the matmul rate on the model's widest layer shape
    (gate/up: 2 x intermediate outputs) at 2048 rows, a prefill-sized product."""
    linear_flops = workload_linear_flops(config, prompt_lens, output_lens)  # refuses first
    rate = measure_matmul_flops(dtype, 2048, config.hidden_size, 2 * config.intermediate_size)
    return ComputeFloor(
        linear_flops=float(linear_flops),
        matmul_flops_s=rate,
        kv_read_bytes=float(workload_kv_read_bytes(prompt_lens, output_lens, bytes_held)),
        bandwidth_bytes_s=bandwidth_gb_s * 1e9,
    )


def describe(floor: ComputeFloor, dtype_name: str, seconds: dict[str, float]) -> list[str]:
    """Lines for a benchmark's output: the floor, and each engine's time against it."""
    lines = [
        f"floor: linear layers {floor.linear_flops / 1e12:.2f} TFLOP at this machine's dense "
        f"{dtype_name} matmul rate {floor.matmul_flops_s / 1e9:.0f} GFLOP/s = "
        f"{floor.matmul_s:.1f} s; decode K/V reads {floor.kv_read_bytes / 1e9:.1f} GB at "
        f"{floor.bandwidth_bytes_s / 1e9:.1f} GB/s = {floor.kv_s:.1f} s; "
        f"together {floor.floor_s:.1f} s, what the arithmetic and the K/V reads alone take here"
    ]
    for name, s in seconds.items():
        lines.append(f"floor / {name}: {floor.floor_s / s:.2f} ({s:.1f} s)")
    return lines
