"""Rotary embedding of DeepSeek's rope part: inverse frequencies (default, linear, YaRN) and
the interleaved-pair rotation V2 applies (as complex numbers) and V3 with ``rope_interleave``.

Only the ``qk_rope_head_dim`` slice of each query head and the one shared rope key are
rotated. The rotated key is what the latent cache keeps beside the latent (kv/spec.py
``MLASpec``), so q and k must use one layout; the layout itself is free (a dot product does
not care how both sides' dims are ordered), so pairs stay interleaved here, as V2 writes them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.models.deepseek_config import DeepseekConfig, DeepseekRope


def deepseek_inv_freq(dim: int, theta: float, rope: DeepseekRope) -> torch.Tensor:
    """(dim // 2,) float32, as transformers' default / linear / yarn rope init functions."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_freq = 1.0 / pos_freqs
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "longrope":  # HF: the short factors within the original length
        assert rope.short_factor is not None
        return 1.0 / (torch.tensor(rope.short_factor, dtype=torch.float32) * pos_freqs)
    if rope.rope_type != "yarn":
        return inv_freq
    original = rope.original_max_position_embeddings
    assert original is not None

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency; 0: interpolate it
    return (inv_freq / rope.factor) * (1 - extrapolation) + inv_freq * extrapolation


class DeepseekRotary(nn.Module):
    """cos / sin (T, 1, rope_dim // 2) float32 for arbitrary positions, YaRN's factor applied."""

    def __init__(self, config: DeepseekConfig) -> None:
        super().__init__()
        self.dim = config.qk_rope_head_dim
        self.theta = config.rope_theta
        self.rope = config.rope
        self.factor = config.rope.cos_sin_factor
        self.register_buffer(
            "inv_freq", deepseek_inv_freq(self.dim, self.theta, self.rope), persistent=False
        )

    def reset(self, device: torch.device) -> None:
        """Recompute the buffer (a model built on the meta device has none)."""
        self.inv_freq = deepseek_inv_freq(self.dim, self.theta, self.rope).to(device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, dim // 2)
        return (freqs.cos() * self.factor)[:, None, :], (freqs.sin() * self.factor)[:, None, :]


def apply_deepseek_rotary(
    x: torch.Tensor,  # (T, heads, rope_dim)
    cos: torch.Tensor,  # (T, 1, rope_dim // 2) float32
    sin: torch.Tensor,
    interleaved: bool,
) -> torch.Tensor:
    """Rotate pairs (2i, 2i + 1) when ``interleaved`` (the output stays interleaved), else
    pairs (i, i + d/2) (rotate-half); in float32, cast back (HF V2's complex product)."""
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
