"""Attention over K/V that a cache supplies, and the interface between model and cache.

The model never owns a cache. Each attention layer computes q, k, v for the tokens of this
forward pass and hands them to an ``AttentionBackend`` passed in as an argument; the backend
stores k/v wherever its cache lives, and returns the attention output. The no-cache and
dense-cache decoders of ``reference.py`` are two such backends; the paged engine is another.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    """Stores this step's K/V for one layer and attends over everything the sequence has.

    q: (T, num_heads, head_dim); k, v: (T, num_kv_heads, head_dim), already rotated.
    Returns (T, num_heads, head_dim).
    """

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of T new queries over S = offset + T keys of one sequence.

    q: (T, num_heads, head_dim); k, v: (num_kv_heads, S, head_dim) where the last T keys belong
    to the T queries, so query i sits at position offset + i and sees keys 0 .. offset + i.

    Query heads are grouped by KV head (head h uses KV head h // group, as HF's repeat_kv):
    one query (decode) folds the group into the query-length axis, which is a plain batched
    matmul per KV head and far faster on CPU than repeating K/V.
    """
    t, num_heads, head_dim = q.shape
    num_kv_heads, s, _ = k.shape
    group = num_heads // num_kv_heads
    # SDPA gets 4-D inputs: on CPU only those take the fused flash kernel (3-D ones fall back
    # to the math path, measured 3x slower for a 512-token prefill)
    k4, v4 = k[None], v[None]  # (1, kv_heads, S, head_dim)
    if t == 1:
        qg = q.view(1, num_kv_heads, group, head_dim)  # (1, kv_heads, group, head_dim)
        out = F.scaled_dot_product_attention(qg, k4, v4, scale=scale)
        return out.reshape(1, num_heads, head_dim)
    qh = q.transpose(0, 1)[None]  # (1, heads, T, head_dim)
    offset = s - t
    if offset == 0:
        out = F.scaled_dot_product_attention(
            qh, k4, v4, is_causal=True, scale=scale, enable_gqa=group > 1
        )
    else:
        # mask[i, j] = key j is visible to query i = j <= offset + i
        rows = torch.arange(t, device=q.device)[:, None] + offset
        mask = torch.arange(s, device=q.device)[None, :] <= rows  # (T, S)
        out = F.scaled_dot_product_attention(
            qh, k4, v4, attn_mask=mask, scale=scale, enable_gqa=group > 1
        )
    return out[0].transpose(0, 1)  # (T, heads, head_dim)
