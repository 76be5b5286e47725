"""Attention over the paged KV cache, for a batch of requests of different lengths.

The model runner lays a step's tokens out flat, decodes first:

    tokens   [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]      3 decodes, 2 prefill chunks
    query_start_loc  0  1  2  3           7     9

and describes each request by its ``seq_len`` (tokens cached after this step, the new ones
included) and its block table. ``PagedAttention`` writes this step's K/V at ``slot_mapping``
and then attends:

- decodes, on CPU with the C++ kernels loaded: ``kvserve::paged_decode_attention`` (float
  K/V) or ``kvserve::paged_decode_attention_quant`` (either side quantized, each block
  dequantized in L1) reads every request's K/V in place through its block table
  (kernels/paged_attention_ops.py; 3-5x faster than the gather below at every shape
  benchmarks/paged_attention.py covers; over int8 / int4_sym blocks 1.4-1.8x faster than over
  bfloat16 at B 64, benchmarks/kv_dtype_attention.py);
- otherwise (no kernel, KVSERVE_KERNELS=0, CUDA) ``sdpa_decode``: in groups of DECODE_GROUP
  requests of similar length (the runner sorts them), gather each request's blocks into
  (B, S, kv_heads, head_dim), mask keys past its length, one SDPA call per group with the
  query heads folded into their KV groups (small groups measured ~3x faster than one call
  over 64 requests on CPU, and pad less);
- prefill chunks over a bfloat16 cache on CPUs with AVX-512-BF16 (on AMX tiles where there
  are): all of the step's chunks in one ``kvserve::paged_prefill_attention`` call, reading K/V
  in place through the block tables (kernels/paged_attention_ops.py);
- otherwise prefill chunks one request at a time: gather its blocks, causal attention whose
  offset is the number of tokens already cached (new tokens see the cached prefix plus
  earlier new tokens).

``reference_paged_attention`` is the plain per-request version the fast ones are tested
against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.attention.backend import causal_attention
from kvserve.attention.mla import paged_mla
from kvserve.attention.paged_window import windowed_paged_attention
from kvserve.attention.window import Rotary, WindowRule
from kvserve.intmath import cdiv
from kvserve.kernels.paged_attention_ops import (
    decode_kernel_available,
    default_isa,
    paged_decode_attention,
    paged_decode_attention_quant,
    paged_prefill_attention,
    prefill_kernel_available,
)
from kvserve.kv.storage import KVCacheStorage


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go and what each request attends to. Built by the runner."""

    slot_mapping: torch.Tensor  # (T,) long: cache slot of every token of the step
    query_start_loc: list[int]  # (B + 1,): request i owns tokens [q[i], q[i + 1])
    seq_lens: list[int]  # (B,): tokens in the cache after this step, per request
    block_tables: torch.Tensor  # (B, max_blocks) long, padded with 0 past each request's blocks
    num_decodes: int  # requests [0, num_decodes) have exactly one query token
    seq_lens_tensor: torch.Tensor  # (B,) long, same as seq_lens, on the device
    # per cache group (kv/spec.py KVCacheSpec.groups): its slot mapping and block tables;
    # None: one group, the two fields above
    group_slot_mappings: list[torch.Tensor] | None = None
    group_block_tables: list[torch.Tensor] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    def for_group(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot_mapping, block_tables) of one cache group."""
        if self.group_slot_mappings is None or self.group_block_tables is None:
            assert group == 0, f"metadata has one group, asked for group {group}"
            return self.slot_mapping, self.block_tables
        return self.group_slot_mappings[group], self.group_block_tables[group]


def _attend_one(
    storage: KVCacheStorage,
    md: AttentionMetadata,
    layer_idx: int,
    i: int,
    q: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Request i's queries (t, H, D) over its cached keys: causal, offset = seq_len - t."""
    lo, hi, n = md.query_start_loc[i], md.query_start_loc[i + 1], md.seq_lens[i]
    nb = cdiv(n, storage.spec.block_size)
    tables = md.for_group(storage.group_of(layer_idx))[1]
    k, v = storage.gather(layer_idx, tables[i : i + 1, :nb])  # (1, nb * bs, H, D)
    return causal_attention(q[lo:hi], k[0, :n].transpose(0, 1), v[0, :n].transpose(0, 1), scale)


DECODE_GROUP = 8  # decodes attended per SDPA call (measured best of 4, 8, 16, 32)


def sdpa_decode(
    q: torch.Tensor,
    storage: KVCacheStorage,
    layer_idx: int,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    seq_lens_tensor: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decodes q (B, heads, head_dim), one query each, over gathered (dequantized) blocks: the
    PyTorch twin of the decode kernels (seq_lens also as a list, so no sync)."""
    out = torch.empty_like(q)
    block_size = storage.spec.block_size
    # groups of DECODE_GROUP: each gathers and pads only to its own longest context (the
    # runner sorts decodes by length, so groups are similar)
    for lo in range(0, q.shape[0], DECODE_GROUP):
        hi = min(q.shape[0], lo + DECODE_GROUP)
        nb = cdiv(max(seq_lens[lo:hi]), block_size)
        k, v = storage.gather(layer_idx, block_tables[lo:hi, :nb])  # (b, S, kvh, D)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (b, kvh, S, D)
        b, kvh, s, d = k.shape
        qg = q[lo:hi].view(b, kvh, -1, d).to(k.dtype)  # (b, kvh, group, D)
        visible = torch.arange(s, device=q.device)[None, :] < seq_lens_tensor[lo:hi, None]
        o = F.scaled_dot_product_attention(
            qg, k, v, attn_mask=visible[:, None, None, :], scale=scale
        )  # (b, kvh, group, D)
        out[lo:hi] = o.reshape(b, -1, d).to(q.dtype)
    return out


class PagedAttention:
    """The ``AttentionBackend`` of one engine step.

    ``scale``: the softmax scale (``ModelConfig.attention_scale``). ``use_kernel``: attend
    decodes with a C++ kernel (None: whenever it is loaded and the cache is on CPU); False takes
    the grouped-SDPA path.
    """

    def __init__(
        self,
        storage: KVCacheStorage,
        metadata: AttentionMetadata,
        scale: float,
        use_kernel: bool | None = None,
        rotary: Rotary | None = None,
    ) -> None:
        self.storage = storage
        self.md = metadata
        self.scale = scale
        self.rotary = rotary  # the model's rotary embedding: attention sinks need it
        self.rules = [WindowRule.of(layer) for layer in storage.spec.layers]
        if use_kernel is None:
            use_kernel = decode_kernel_available(storage.device)
        self.use_kernel = use_kernel
        self.isa = default_isa()  # read once per step, not once per layer
        self._prefill_args: tuple[torch.Tensor, ...] | None = None  # built on first use

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        slot_mapping, tables = self.md.for_group(self.storage.group_of(layer_idx))
        self.storage.write(layer_idx, slot_mapping, k, v)
        rule = self.rules[layer_idx]
        if rule is not None:
            return windowed_paged_attention(
                self.storage, self.md, layer_idx, q, tables, rule, self.scale, self.rotary
            )
        out = torch.empty_like(q)
        nd = self.md.num_decodes
        # the layer's K/V planes as the kernels read them: looked up once, for both phases
        planes = self._planes(layer_idx) if self.use_kernel else None
        if nd:
            out[:nd] = self._decode(layer_idx, q[:nd], planes)
        if nd == self.md.num_reqs:
            return out
        if planes is not None and self._prefill_kernel(*planes, q):
            kp, vp = planes
            lo = self.md.query_start_loc[nd]
            out[lo:] = paged_prefill_attention(
                q[lo:], kp.codes, vp.codes, *self._prefill_tables(tables), self.scale
            )
            return out
        for i in range(nd, self.md.num_reqs):  # prefill chunks: one request at a time
            out[self.md.query_start_loc[i] : self.md.query_start_loc[i + 1]] = _attend_one(
                self.storage, self.md, layer_idx, i, q, self.scale
            )
        return out

    def _planes(self, layer_idx: int) -> tuple:
        return self.storage.plane(layer_idx, "k"), self.storage.plane(layer_idx, "v")

    def _prefill_kernel(self, kp, vp, q: torch.Tensor) -> bool:
        """The prefill kernel serves this layer's planes: float bfloat16 K/V, bf16 queries."""
        if kp.dtype.is_quantized or vp.dtype.is_quantized or q.dtype != torch.bfloat16:
            return False
        if kp.codes.dtype != torch.bfloat16 or vp.codes.dtype != torch.bfloat16:
            return False
        return prefill_kernel_available(q.device, q.dtype, q.shape[-1])

    def _prefill_tables(self, tables: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(block_tables, query_start_loc, seq_lens) of the prefill requests, relative to the
        first prefill token; built once per step (every layer of a cache group shares them)."""
        if self._prefill_args is None or self._prefill_args[0] is not tables:
            nd, md = self.md.num_decodes, self.md
            qsl = torch.tensor(md.query_start_loc[nd:], dtype=torch.long)
            self._prefill_args = (tables, tables[nd:], qsl - qsl[0], md.seq_lens_tensor[nd:])
        return self._prefill_args[1:]

    def mla(self, layer_idx, q_nope, q_pe, latent, weights) -> torch.Tensor:
        """Latent (MLA) layers: attention/mla.py ``paged_mla`` (decodes absorbed)."""
        return paged_mla(
            self.storage, self.md, layer_idx, q_nope, q_pe, latent, weights, self.scale
        )

    def _decode(self, layer_idx: int, q: torch.Tensor, planes: tuple | None) -> torch.Tensor:
        """Decode requests [0, B): q (B, heads, head_dim), one query each; ``planes``: the
        layer's (K, V) planes where the kernels run, else None (grouped SDPA)."""
        md, nd, st = self.md, q.shape[0], self.storage
        tables = md.for_group(st.group_of(layer_idx))[1][:nd]
        lens = md.seq_lens_tensor[:nd]
        if planes is not None:
            kp, vp = planes
            if not (kp.dtype.is_quantized or vp.dtype.is_quantized) and kp.dtype == vp.dtype:
                return paged_decode_attention(
                    q, kp.codes, vp.codes, tables, lens, self.scale, self.isa
                )
            return paged_decode_attention_quant(
                q,
                *(kp.codes, kp.scales, kp.mins, kp.dtype.format_code),
                *(vp.codes, vp.scales, vp.mins, vp.dtype.format_code),
                tables,
                lens,
                self.scale,
                self.isa,
            )
        return sdpa_decode(q, st, layer_idx, tables, md.seq_lens[:nd], lens, self.scale)


def reference_paged_attention(
    storage: KVCacheStorage,
    md: AttentionMetadata,
    layer_idx: int,
    q: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Per request: gather its blocks, causal SDPA. K/V of this step must already be written."""
    out = torch.empty_like(q)
    for i in range(md.num_reqs):
        out[md.query_start_loc[i] : md.query_start_loc[i + 1]] = _attend_one(
            storage, md, layer_idx, i, q, scale
        )
    return out
