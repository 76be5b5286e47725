"""The no-cache backend: the forward pass holds the whole sequence, so K/V are this pass's own."""

from __future__ import annotations

import torch

from kvserve.attention.backend import causal_attention
from kvserve.attention.mla import MLAWeights, expanded_attention


class NoCacheAttention:
    """k, v: (T, kv_heads, head_dim) of the whole sequence; causal attention over them."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return causal_attention(q, k.transpose(0, 1), v.transpose(0, 1), self.scale)

    def mla(
        self,
        layer_idx: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        weights: MLAWeights,
    ) -> torch.Tensor:
        """Latent attention (attention/mla.py): latent (T, rank + rope) of the whole sequence,
        expanded per head, causal -> (T, heads, v_head_dim)."""
        return expanded_attention(q_nope, q_pe, latent, weights, self.scale)
