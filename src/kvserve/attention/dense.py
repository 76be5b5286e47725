"""The dense-cache backend of one forward pass: preallocated K/V buffers and a fill pointer."""

from __future__ import annotations

import torch

from kvserve.attention.backend import causal_attention


class DenseAttention:
    """Write this pass's K/V at rows [start, start + T), attend over rows [0, start + T).

    k_cache, v_cache: (layers, kv_heads, max_len, head_dim); rows past the fill pointer are
    stale and never read.
    """

    def __init__(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, scale: float
    ) -> None:
        self.k_cache, self.v_cache, self.start, self.scale = k_cache, v_cache, start, scale

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        end = self.start + q.shape[0]
        self.k_cache[layer_idx, :, self.start : end] = k.transpose(0, 1)
        self.v_cache[layer_idx, :, self.start : end] = v.transpose(0, 1)
        return causal_attention(
            q, self.k_cache[layer_idx, :, :end], self.v_cache[layer_idx, :, :end], self.scale
        )
