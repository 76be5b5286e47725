"""Paged attention: the batched decode path and per-request prefill path against the plain
gather + SDPA reference, and against dense causal attention over each request's own K/V."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.backend import causal_attention
from kvserve.attention.paged import AttentionMetadata, PagedAttention, reference_paged_attention
from kvserve.kv.spec import KVCacheSpec
from kvserve.kv.storage import KVCacheStorage

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 16, 4


def build_step(seq_lens: list[int], query_lens: list[int], dtype: torch.dtype, seed: int = 0):
    """Random K/V history per request in shuffled blocks; returns storage, metadata, q/k/v of
    this step, and each request's full dense K/V (history + this step)."""
    gen = torch.Generator().manual_seed(seed)
    spec = KVCacheSpec.full_attention(1, KV_HEADS, HEAD_DIM, dtype, BLOCK)
    need = [-(-n // BLOCK) for n in seq_lens]
    storage = KVCacheStorage(spec, sum(need) + 3)
    perm = torch.randperm(storage.num_blocks, generator=gen).tolist()
    tables, dense, slots, starts = [], [], [], [0]
    q_all, k_new, v_new = [], [], []
    for n, t, nb in zip(seq_lens, query_lens, need, strict=True):
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        dense.append((k, v))
        all_slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
        hist = torch.tensor(all_slots[: n - t])
        if len(hist):  # history already in the cache
            storage.write(0, hist, k[: n - t], v[: n - t])
        slots += all_slots[n - t :]
        q_all.append(torch.randn(t, HEADS, HEAD_DIM, generator=gen).to(dtype))
        k_new.append(k[n - t :])
        v_new.append(v[n - t :])
        starts.append(starts[-1] + t)
    width = max(len(t) for t in tables)
    block_tables = torch.zeros(len(tables), width, dtype=torch.long)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=starts,
        seq_lens=seq_lens,
        block_tables=block_tables,
        num_decodes=sum(1 for t in query_lens if t == 1),
        seq_lens_tensor=torch.tensor(seq_lens),
    )
    return storage, md, torch.cat(q_all), torch.cat(k_new), torch.cat(v_new), dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_matches_reference_and_dense(dtype: torch.dtype) -> None:
    # decodes first (query length 1), then prefill chunks with and without a cached prefix
    seq_lens = [1, 5, 8, 13, 33, 7, 12, 9]
    query_lens = [1, 1, 1, 1, 1, 7, 5, 9]
    storage, md, q, k, v, dense = build_step(seq_lens, query_lens, dtype)
    out = PagedAttention(storage, md, HEAD_DIM**-0.5)(
        0, q, k, v
    )  # writes this step's K/V, then attends
    ref = reference_paged_attention(storage, md, 0, q, HEAD_DIM**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    for i, (kd, vd) in enumerate(dense):
        lo, hi = md.query_start_loc[i], md.query_start_loc[i + 1]
        want = causal_attention(q[lo:hi], kd.transpose(0, 1), vd.transpose(0, 1), HEAD_DIM**-0.5)
        torch.testing.assert_close(out[lo:hi], want, atol=tol, rtol=tol)


def test_only_own_blocks_are_read() -> None:
    seq_lens, query_lens = [6, 3], [1, 1]
    storage, md, q, k, v, _ = build_step(seq_lens, query_lens, torch.float32, seed=1)
    before = PagedAttention(storage, md, HEAD_DIM**-0.5)(0, q, k, v)
    used = set(md.block_tables[0, :2].tolist()) | set(md.block_tables[1, :1].tolist())
    for b in range(storage.num_blocks):  # scribble over every block nobody owns
        if b not in used:
            storage.kv[:, :, b] = 1e4
    storage.kv[:, 0, md.block_tables[0, 1], 2:] = 1e4  # and past request 0's length (6)
    after = PagedAttention(storage, md, HEAD_DIM**-0.5)(0, q, k, v)
    torch.testing.assert_close(after, before)
