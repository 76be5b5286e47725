"""Multi-head latent attention (DeepSeek-V2/V3) over cached latent rows.

Each cached row is ``[c | k_pe]``: the normalized latent c (rank values) and the rotated rope
key (rope values), shared by every head. With ``kv_b_proj`` split per head into
W_UK (heads, nope, rank) and W_UV (heads, v, rank) (``MLAWeights``):

    k_h = [W_UK_h c | k_pe],  v_h = W_UV_h c,  score_h = q_nope_h . W_UK_h c + q_pe_h . k_pe

Two ways to attend, equal in exact arithmetic:

- expanded (prefill, the reference decoders): build K and V of every head from the rows,
  causal attention with QK dim nope + rope and V dim v (``expanded_attention``);
- absorbed (the engine's decodes, as vLLM / SGLang / FlashMLA): fold W_UK into the query,
  q_abs_h = [W_UK_h^T q_nope_h | q_pe_h] (rank + rope values), and attend over the rows
  themselves as one key head shared by all query heads (MQA: QK dim rank + rope, V = the
  first rank values of the same rows), then W_UV on the output
  (``absorbed_attention``). Nothing per head is ever materialized for the cached tokens:
  per step it reads S x (rank + rope) values instead of S x heads x (nope + rope + v).

``paged_mla`` is the paged engine's entry point (decodes absorbed, prefill chunks expanded
over the gathered latent prefix); ``reference_paged_mla`` expands everything, per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvserve.intmath import cdiv

if TYPE_CHECKING:
    from kvserve.attention.paged import AttentionMetadata
    from kvserve.kv.storage import KVCacheStorage

DECODE_GROUP = 8  # decodes attended per SDPA call (as attention/paged.py)


@dataclass(slots=True)
class MLAWeights:
    """The two halves of ``kv_b_proj`` per head (views of its weight)."""

    w_uk: torch.Tensor  # (heads, nope, rank)
    w_uv: torch.Tensor  # (heads, v_head_dim, rank)

    @property
    def rank(self) -> int:
        return self.w_uk.shape[2]


def expand_latent(rows: torch.Tensor, w: MLAWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (S, rank + rope) -> k (heads, S, nope + rope), v (heads, S, v_head_dim)."""
    c, k_pe = rows[:, : w.rank], rows[:, w.rank :]
    heads = w.w_uk.shape[0]
    k_nope = torch.einsum("sr,hdr->hsd", c, w.w_uk)  # (heads, S, nope)
    v = torch.einsum("sr,hdr->hsd", c, w.w_uv)  # (heads, S, v)
    k = torch.cat((k_nope, k_pe[None].expand(heads, -1, -1)), dim=-1)
    return k, v


def expanded_attention(
    q_nope: torch.Tensor,  # (T, heads, nope)
    q_pe: torch.Tensor,  # (T, heads, rope), rotated
    rows: torch.Tensor,  # (S, rank + rope): S = offset + T, the last T the queries' own
    w: MLAWeights,
    scale: float,
) -> torch.Tensor:
    """Causal multi-head attention of T queries over S expanded rows -> (T, heads, v)."""
    t, s = q_nope.shape[0], rows.shape[0]
    q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)[None]  # (1, heads, T, nope + rope)
    k, v = expand_latent(rows, w)
    offset = s - t
    if offset == 0:
        out = F.scaled_dot_product_attention(q, k[None], v[None], is_causal=True, scale=scale)
    else:
        # mask[i, j] = key j is visible to query i = j <= offset + i
        visible = torch.arange(s, device=q.device)[None, :] <= (
            torch.arange(t, device=q.device)[:, None] + offset
        )
        out = F.scaled_dot_product_attention(q, k[None], v[None], attn_mask=visible, scale=scale)
    return out[0].transpose(0, 1)  # (T, heads, v)


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w: MLAWeights) -> torch.Tensor:
    """(B, heads, nope), (B, heads, rope) -> q_abs (B, heads, rank + rope)."""
    return torch.cat((torch.einsum("bhd,hdr->bhr", q_nope, w.w_uk), q_pe), dim=-1)


def absorbed_attention(
    q_abs: torch.Tensor,  # (b, heads, rank + rope)
    rows: torch.Tensor,  # (b, S, rank + rope)
    visible: torch.Tensor | None,  # (b, S) bool: the rows each request sees; None: all
    rank: int,
    scale: float,
) -> torch.Tensor:
    """One query per request over its rows as a single shared head -> (b, heads, rank), the
    attention-weighted latent (W_UV not applied yet)."""
    k = rows[:, None]  # (b, 1, S, rank + rope): one KV head for every query head
    mask = None if visible is None else visible[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q_abs[:, None].to(k.dtype), k, k[..., :rank], attn_mask=mask, scale=scale
    )  # (b, 1, heads, rank)
    return out[:, 0]


def unabsorb_output(o_latent: torch.Tensor, w: MLAWeights) -> torch.Tensor:
    """(B, heads, rank) -> (B, heads, v_head_dim): W_UV per head."""
    return torch.einsum("bhr,hvr->bhv", o_latent.to(w.w_uv.dtype), w.w_uv)


def absorbed_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    rows: torch.Tensor,  # (b, S, rank + rope)
    visible: torch.Tensor | None,
    w: MLAWeights,
    scale: float,
) -> torch.Tensor:
    """Absorbed attention end to end: (b, heads, nope), (b, heads, rope) -> (b, heads, v)."""
    o = absorbed_attention(absorb_query(q_nope, q_pe, w), rows, visible, w.rank, scale)
    return unabsorb_output(o, w)


def mla_paged_decode(
    storage: KVCacheStorage,
    layer_idx: int,
    q_nope: torch.Tensor,  # (B, heads, nope): one query per request
    q_pe: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks)
    seq_lens: list[int],
    seq_lens_tensor: torch.Tensor,  # (B,)
    w: MLAWeights,
    scale: float,
) -> torch.Tensor:
    """Absorbed decodes in groups of similar length (the runner sorts them): each group
    gathers its latent rows, masks past each length, one SDPA call -> (B, heads, v)."""
    q_abs = absorb_query(q_nope, q_pe, w)  # (B, heads, rank + rope)
    o = q_abs.new_empty(*q_abs.shape[:2], w.rank)
    block_size = storage.spec.block_size
    for lo in range(0, q_abs.shape[0], DECODE_GROUP):
        hi = min(q_abs.shape[0], lo + DECODE_GROUP)
        nb = cdiv(max(seq_lens[lo:hi]), block_size)
        rows = storage.gather_latent(layer_idx, block_tables[lo:hi, :nb])  # (b, S, W)
        visible = (
            torch.arange(rows.shape[1], device=rows.device)[None, :]
            < (seq_lens_tensor[lo:hi, None])
        )
        o[lo:hi] = absorbed_attention(q_abs[lo:hi], rows, visible, w.rank, scale).to(o.dtype)
    return unabsorb_output(o, w)


def _request_rows(storage: KVCacheStorage, md: AttentionMetadata, layer_idx: int, i: int):
    n = md.seq_lens[i]
    nb = cdiv(n, storage.spec.block_size)
    return storage.gather_latent(layer_idx, md.block_tables[i : i + 1, :nb])[0, :n]


def paged_mla(
    storage: KVCacheStorage,
    md: AttentionMetadata,
    layer_idx: int,
    q_nope: torch.Tensor,  # (T, heads, nope)
    q_pe: torch.Tensor,  # (T, heads, rope)
    latent: torch.Tensor,  # (T, rank + rope): this step's rows
    w: MLAWeights,
    scale: float,
) -> torch.Tensor:
    """Write this step's rows at ``md.slot_mapping``; decodes absorbed, prefill chunks
    expanded over their cached prefix (one request at a time) -> (T, heads, v)."""
    storage.write_latent(layer_idx, md.slot_mapping, latent)
    out = q_nope.new_empty(*q_nope.shape[:2], w.w_uv.shape[1])
    nd = md.num_decodes
    if nd:
        out[:nd] = mla_paged_decode(
            storage,
            layer_idx,
            q_nope[:nd],
            q_pe[:nd],
            md.block_tables[:nd],
            md.seq_lens[:nd],
            md.seq_lens_tensor[:nd],
            w,
            scale,
        )
    for i in range(nd, md.num_reqs):
        lo, hi = md.query_start_loc[i], md.query_start_loc[i + 1]
        rows = _request_rows(storage, md, layer_idx, i)
        out[lo:hi] = expanded_attention(q_nope[lo:hi], q_pe[lo:hi], rows, w, scale)
    return out


def reference_paged_mla(
    storage: KVCacheStorage,
    md: AttentionMetadata,
    layer_idx: int,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    w: MLAWeights,
    scale: float,
) -> torch.Tensor:
    """Every request expanded over its gathered rows; this step's rows must be written."""
    out = q_nope.new_empty(*q_nope.shape[:2], w.w_uv.shape[1])
    for i in range(md.num_reqs):
        lo, hi = md.query_start_loc[i], md.query_start_loc[i + 1]
        rows = _request_rows(storage, md, layer_idx, i)
        out[lo:hi] = expanded_attention(q_nope[lo:hi], q_pe[lo:hi], rows, w, scale)
    return out
