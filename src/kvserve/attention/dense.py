"""The dense-cache backend of one forward pass: one preallocated block of ``max_len`` tokens
(a ``KVCacheStorage`` whose block size is the sequence's whole room) and a fill pointer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.attention.backend import causal_attention
from kvserve.attention.mla import MLAWeights, expanded_attention
from kvserve.attention.window import WindowRule, window_attention
from kvserve.kv.storage import KVCacheStorage


class DenseAttention:
    """Write this pass's K/V at positions [start, start + T) of block 0, attend over
    positions [0, start + T). Positions past the fill pointer are stale and never read.
    ``rules``: per layer, its window (attention/window.py) or None (full attention); a
    windowed layer keeps every row here (the paged cache is the one that gives rows back)."""

    def __init__(
        self,
        storage: KVCacheStorage,
        start: int,
        scale: float,
        rules: Sequence[WindowRule | None] = (),
    ) -> None:
        self.storage, self.start, self.scale = storage, start, scale
        self.rules = list(rules)

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        end = self.start + q.shape[0]
        slots = torch.arange(self.start, end, device=q.device)  # block 0: slot = position
        self.storage.write(layer_idx, slots, k, v)
        k_all, v_all = self.storage.read_block(layer_idx, 0, end)  # (end, kv_heads, head_dim)
        rule = self.rules[layer_idx] if self.rules else None
        if rule is not None:
            k_pos = torch.arange(end, device=q.device)
            return window_attention(q, k_all, v_all, slots, k_pos, rule, self.scale)
        return causal_attention(q, k_all.transpose(0, 1), v_all.transpose(0, 1), self.scale)

    def mla(
        self,
        layer_idx: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        weights: MLAWeights,
    ) -> torch.Tensor:
        """Latent attention: write this pass's rows (T, rank + rope) at [start, start + T),
        expand rows [0, start + T) per head (the reference: no absorption)."""
        end = self.start + q_nope.shape[0]
        slots = torch.arange(self.start, end, device=q_nope.device)
        self.storage.write_latent(layer_idx, slots, latent)
        rows = self.storage.read_latent_block(layer_idx, 0, end)  # (end, rank + rope)
        return expanded_attention(q_nope, q_pe, rows, weights, self.scale)
