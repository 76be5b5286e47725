"""The no-cache backend: the forward pass holds the whole sequence, so K/V are this pass's own."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.attention.backend import causal_attention
from kvserve.attention.mla import MLAWeights, expanded_attention
from kvserve.attention.window import WindowRule, window_attention


class NoCacheAttention:
    """k, v: (T, kv_heads, head_dim) of the whole sequence; causal attention over them.
    ``rules``: per layer, its window (attention/window.py) or None (full attention)."""

    def __init__(self, scale: float, rules: Sequence[WindowRule | None] = ()) -> None:
        self.scale = scale
        self.rules = list(rules)

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        rule = self.rules[layer_idx] if self.rules else None
        if rule is not None:
            pos = torch.arange(q.shape[0], device=q.device)
            return window_attention(q, k, v, pos, pos, rule, self.scale)
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
