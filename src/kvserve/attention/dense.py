"""The dense-cache backend of one forward pass: one preallocated block of ``max_len`` tokens
(a ``KVCacheStorage`` whose block size is the sequence's whole room) and a fill pointer."""

from __future__ import annotations

import torch

from kvserve.attention.backend import causal_attention
from kvserve.kv.storage import KVCacheStorage


class DenseAttention:
    """Write this pass's K/V at positions [start, start + T) of block 0, attend over
    positions [0, start + T). Positions past the fill pointer are stale and never read."""

    def __init__(self, storage: KVCacheStorage, start: int, scale: float) -> None:
        self.storage, self.start, self.scale = storage, start, scale

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        end = self.start + q.shape[0]
        slots = torch.arange(self.start, end, device=q.device)  # block 0: slot = position
        self.storage.write(layer_idx, slots, k, v)
        k_all, v_all = self.storage.read_block(layer_idx, 0, end)  # (end, kv_heads, head_dim)
        return causal_attention(q, k_all.transpose(0, 1), v_all.transpose(0, 1), self.scale)
