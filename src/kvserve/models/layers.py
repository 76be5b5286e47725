"""Building blocks shared by the Llama family: RMSNorm, rotary embedding, gated MLP.

Each follows the Hugging Face transformers arithmetic step for step (dtype casts included),
so that float32 logits match it to rounding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.models.config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), computed in float32 then cast back (as HF)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused op for HF's x.float() * rsqrt(x.pow(2).mean(-1) + eps) (measured: 7 ops
        # per norm were a visible share of a decode step); then HF's cast and weight
        h = torch.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling, freq_factors: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse frequencies, shape (head_dim // 2,), float32.

    ``freq_factors`` is llama.cpp's ``rope_freqs`` tensor (GGUF): per-frequency divisors that
    encode Llama 3.1 scaling.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if freq_factors is not None:
        return inv_freq / freq_factors.float()
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin for arbitrary positions, computed per forward (cheap: positions x head_dim/2).

    Computing on the fly rather than from a max-length table keeps memory flat for 128k-context
    models and makes "positions continue from the cache length" a plain argument.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.theta = config.rope_theta
        self.scaling = config.rope_scaling
        # computed on the CPU, then moved to the default device: built under
        # torch.device("meta") (the loader, which recomputes it on the real device), its
        # arithmetic would go through torch._refs and import torch._dynamo (~1 s of a start)
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", inv_freq.to(torch.empty(0).device), persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: (T,) -> cos, sin: (T, 1, head_dim), broadcast over heads
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of x: (T, heads, head_dim) -- the HF / NeoX half layout."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), HF names gate_proj / up_proj / down_proj."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        # gate and up in one matmul (vLLM's MergedColumnParallelLinear), set by
        # weight_formats.py where both weights share a quantized format
        self.gate_up_proj: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(nn.functional.silu(gate) * up)
