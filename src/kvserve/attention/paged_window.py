"""Windowed layers over the paged cache (attention/window.py's rule): only the blocks a query
can see are gathered -- the sink blocks and those from the window's first on. The blocks before
were given back (kv/manager.py) and their table entries are never read.

Decodes go in batches of WINDOW_DECODE_GROUP: each request's visible blocks gathered into one
padded (b, m * block_size) tensor, one masked attention call (a window makes every request's
span about the same, so little is padding). Prefill chunks go one request at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention.window import Rotary, WindowRule, window_attention
from kvserve.intmath import cdiv
from kvserve.kv.storage import KVCacheStorage
from kvserve.models.layers import apply_rotary

WINDOW_DECODE_GROUP = 16  # decodes per gather: bounds the padded K/V copy


def _visible_blocks(spec, first_query: int, n: int) -> list[int]:
    """Table columns a request's queries [first_query, n) can read."""
    first = spec.first_needed_block(first_query)
    return list(range(min(spec.sink_blocks, first))) + list(range(first, cdiv(n, spec.block_size)))


def windowed_paged_attention(
    storage: KVCacheStorage,
    md,
    layer_idx: int,
    q: torch.Tensor,
    tables: torch.Tensor,
    rule: WindowRule,
    scale: float,
    rotary: Rotary | None,
) -> torch.Tensor:
    """q (T, heads, D) of the step's tokens (decodes first, attention/paged.py's layout) ->
    (T, heads, D). ``tables``: this layer's group's block tables (B, width)."""
    out = torch.empty_like(q)
    bs = storage.spec.block_size
    spec = storage.spec.layers[layer_idx]
    dev = q.device
    nd = md.num_decodes
    for lo in range(0, nd, WINDOW_DECODE_GROUP):
        hi = min(nd, lo + WINDOW_DECODE_GROUP)
        out[lo:hi] = _decode_group(
            storage, layer_idx, q[lo:hi], tables[lo:hi], md.seq_lens[lo:hi], rule, scale, rotary
        )
    for i in range(nd, md.num_reqs):
        lo, hi, n = md.query_start_loc[i], md.query_start_loc[i + 1], md.seq_lens[i]
        index = torch.tensor(_visible_blocks(spec, n - (hi - lo), n), device=dev)
        k, v = storage.gather(layer_idx, tables[i : i + 1, index])  # (1, len * bs, kvh, D)
        k_pos = (index[:, None] * bs + torch.arange(bs, device=dev)[None, :]).flatten()
        q_pos = torch.arange(n - (hi - lo), n, device=dev)
        keep = k_pos < n  # the last block's slots past the sequence
        out[lo:hi] = window_attention(
            q[lo:hi], k[0][keep], v[0][keep], q_pos, k_pos[keep], rule, scale, rotary
        )
    return out


def _decode_group(
    storage: KVCacheStorage,
    layer_idx: int,
    q: torch.Tensor,  # (b, heads, D): one query each, at position seq_len - 1
    tables: torch.Tensor,  # (b, width)
    seq_lens: list[int],
    rule: WindowRule,
    scale: float,
    rotary: Rotary | None,
) -> torch.Tensor:
    spec = storage.spec.layers[layer_idx]
    bs = spec.block_size
    dev = q.device
    cols = [_visible_blocks(spec, n - 1, n) for n in seq_lens]
    m = max(len(c) for c in cols)
    index = torch.tensor([c + [c[-1]] * (m - len(c)) for c in cols], device=dev)  # (b, m)
    real = torch.tensor([[j < len(c) for j in range(m)] for c in cols], device=dev)
    k, v = storage.gather(layer_idx, tables.gather(1, index))  # (b, m * bs, kvh, D)
    k_pos = (index[:, :, None] * bs + torch.arange(bs, device=dev)).flatten(1)  # (b, S)
    q_pos = torch.tensor(seq_lens, device=dev) - 1  # (b,)
    qp, kp = q_pos[:, None], k_pos
    visible = (
        real.repeat_interleave(bs, 1) & (kp <= qp) & ((kp > qp - rule.window) | (kp < rule.sinks))
    )
    b, heads, d = q.shape
    kvh = k.shape[2]
    g = heads // kvh
    parted = (kp < rule.sinks) & (kp <= qp - rule.window)
    if not rule.sinks or not bool(parted.any()):
        out = F.scaled_dot_product_attention(  # float32, as the decode kernels accumulate
            q.view(b, kvh, g, d).float(),
            k.transpose(1, 2).float(),
            v.transpose(1, 2).float(),
            attn_mask=visible[:, None, None, :],
            scale=scale,
        )  # (b, kvh, g, D)
        return out.reshape(b, heads, d).to(q.dtype)
    assert rotary is not None, "attention sinks need the model's rotary embedding"
    cos, sin = rotary(rule.sink_delta(q_pos), torch.float32)  # (b, 1, D)
    qf = q.float()
    q_sink = apply_rotary(qf, cos, -sin)  # turned back for the sink scores
    kf, vf = k.float(), v.float()
    main = torch.einsum("bkgd,bskd->bkgs", qf.view(b, kvh, g, d), kf)
    sink = torch.einsum("bkgd,bskd->bkgs", q_sink.view(b, kvh, g, d), kf)
    scores = torch.where(parted[:, None, None, :], sink, main) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.einsum("bkgs,bskd->bkgd", torch.softmax(scores, -1), vf)
    return out.reshape(b, heads, d).to(q.dtype)
