"""GGUF weights interleaved into groups of 16 rows for ``kvserve::interleaved_matmul_bf16``.

The kernel (``kernels/csrc/quant_interleaved.cpp``, which documents the layout) multiplies
bfloat16 activations by a weight whose 16 rows of a group lie side by side, one row per
float32 lane, so one expanded chunk of codes feeds every activation row of a tile and each
output element is summed in one order at every row count (ARCHITECTURE.md "Bitwise
invariance"). Interleaving is a permutation of the GGUF bytes (the same bytes per value: scales
stay fp16, codes stay 4 or 8 bits); ``deinterleave`` inverts it exactly. Q4_K, Q5_K and Q6_K
(``interleaved_kquants``) are interleaved per super-block of 256 values; Q4_K's packed 6-bit
scales take a byte each there (+2.8%).

``interleaved_matmul_ref`` is the kernel's slow twin: the same sum per block, scale applied per
block, in float64 (the kernel's float32 sums differ from it by rounding only).
"""

from __future__ import annotations

import torch

from kvserve.kernels.interleaved_kquants import (
    KQUANT_BLOCK_BYTES,
    deinterleave_kquant,
    deinterleave_kquant_rows,
    interleave_kquant,
    kquant_chain_blocks,
)
from kvserve.kernels.quant_ref import QT, block_size, row_bytes

GROUP_ROWS = 16  # weight rows per group (one zmm of float32 lanes)
# bytes of one (group, block): 16 rows x GGUF's block bytes (K-quants: per super-block)
INTERLEAVED_BLOCK_BYTES = {QT.Q4_0: 288, QT.Q4_1: 320, QT.Q8_0: 544, **KQUANT_BLOCK_BYTES}


def block_values(qtype: int) -> int:
    """Values along K of one (group, block) of the layout: 256 for the K-quants, else 32."""
    return 256 if qtype in KQUANT_BLOCK_BYTES else 32


def interleaved_shape(qtype: int, n: int, k: int) -> tuple[int, int, int]:
    """Shape of the interleaved weight of an (n, k) ``qtype`` weight."""
    return (-(-n // GROUP_ROWS), k // block_values(qtype), INTERLEAVED_BLOCK_BYTES[QT(qtype)])


def interleavable(qtype: int) -> bool:
    """Whether ``qtype`` has an interleaved layout."""
    return qtype in INTERLEAVED_BLOCK_BYTES


def _check(qtype: int) -> QT:
    if not interleavable(qtype):
        names = ", ".join(t.name for t in INTERLEAVED_BLOCK_BYTES)
        raise ValueError(f"no interleaved layout for GGML type {qtype}; interleaved types: {names}")
    return QT(qtype)


def _parts_check(qweight: torch.Tensor, qt: QT, n: int, k: int) -> None:
    rb = row_bytes(qt, k)
    if qweight.dtype != torch.uint8 or tuple(qweight.shape) != (n, rb):
        raise ValueError(
            f"qweight must be uint8 ({n}, {rb}) for {qt.name} ({n}, {k}), "
            f"got {qweight.dtype} {tuple(qweight.shape)}"
        )


def _parts(qweight: torch.Tensor, qt: QT, n: int, k: int):
    """GGUF rows -> (scales (n, nb, S) uint8 bytes, codes (n, nb, 32) uint8 or int8)."""
    elems, nbytes = block_size(qt)
    _parts_check(qweight, qt, n, k)
    blocks = qweight.reshape(n, k // elems, nbytes)
    if qt == QT.Q8_0:
        return blocks[..., :2], blocks[..., 2:]  # int8 codes as raw bytes
    head = 2 if qt == QT.Q4_0 else 4
    qs = blocks[..., head:]  # (n, nb, 16): byte i = q[i] | q[i + 16] << 4
    return blocks[..., :head], torch.cat([qs & 15, qs >> 4], dim=-1)  # (n, nb, 32): q[0..31]


def interleave(qweight: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """GGUF rows (n, row_bytes) -> the interleaved (ceil(n / 16), k / 32, block bytes) uint8
    (K-quants: k / 256 super-blocks)."""
    qt = _check(qtype)
    if qt in KQUANT_BLOCK_BYTES:
        _parts_check(qweight, qt, n, k)
        return interleave_kquant(qweight, qt, n, k)
    scales, codes = _parts(qweight, qt, n, k)
    nb = k // 32
    g = -(-n // GROUP_ROWS)
    pad = g * GROUP_ROWS - n
    if pad:  # rows past n: zero scales and codes (the kernel never stores them)
        scales = torch.cat([scales, scales.new_zeros(pad, nb, scales.shape[-1])])
        codes = torch.cat([codes, codes.new_zeros(pad, nb, 32)])
    # scales (g, nb, [d | m] x 16 rows x 2 bytes): each fp16 field for the group's 16 rows
    s = scales.reshape(g, GROUP_ROWS, nb, -1, 2).permute(0, 2, 3, 1, 4).reshape(g, nb, -1)
    c = codes.reshape(g, GROUP_ROWS, nb, 32).permute(0, 2, 1, 3)  # (g, nb, row, k)
    if qt == QT.Q8_0:  # chunk p, byte 2i + j = q[i][2p + j]
        body = c.reshape(g, nb, GROUP_ROWS, 16, 2).permute(0, 1, 3, 2, 4).reshape(g, nb, 512)
    else:  # chunk c, byte 2i + j = q[i][4c + j] | q[i][4c + 2 + j] << 4
        c = c.reshape(g, nb, GROUP_ROWS, 8, 2, 2).permute(0, 1, 3, 2, 5, 4)  # (.., c, i, j, half)
        body = (c[..., 0] | (c[..., 1] << 4)).reshape(g, nb, 256)
    return torch.cat([s, body], dim=-1).contiguous()


def deinterleave(rows: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """The interleaved layout -> the GGUF rows it was made from, byte for byte."""
    qt = _check(qtype)
    nb = k // 32
    g = -(-n // GROUP_ROWS)
    shape = interleaved_shape(qt, n, k)
    if rows.dtype != torch.uint8 or tuple(rows.shape) != shape:
        raise ValueError(
            f"interleaved weight must be uint8 {shape} for {qt.name} ({n}, {k}), "
            f"got {rows.dtype} {tuple(rows.shape)}"
        )
    if qt in KQUANT_BLOCK_BYTES:
        return deinterleave_kquant(rows, qt, n, k)
    head = 32 if qt != QT.Q4_1 else 64
    fields = head // 32
    s = rows[..., :head].reshape(g, nb, fields, GROUP_ROWS, 2).permute(0, 3, 1, 2, 4)
    scales = s.reshape(g * GROUP_ROWS, nb, 2 * fields)
    body = rows[..., head:]
    if qt == QT.Q8_0:
        q = body.reshape(g, nb, 16, GROUP_ROWS, 2).permute(0, 3, 1, 2, 4)
        out = torch.cat([scales, q.reshape(g * GROUP_ROWS, nb, 32)], dim=-1)
    else:
        b = body.reshape(g, nb, 8, GROUP_ROWS, 2)
        q = torch.stack([b & 15, b >> 4], dim=-1)  # (g, nb, c, i, j, half)
        q = q.permute(0, 3, 1, 2, 5, 4).reshape(g * GROUP_ROWS, nb, 32)  # k = 4c + 2 half + j
        out = torch.cat([scales, q[..., :16] | (q[..., 16:] << 4)], dim=-1)
    return out[:n].reshape(n, row_bytes(qt, k)).contiguous()


def deinterleave_rows(rows: torch.Tensor, qtype: int, ids: torch.Tensor, k: int) -> torch.Tensor:
    """The GGUF rows (len(ids), row_bytes) of weight rows ``ids`` (1-D) of an interleaved
    weight (a tied embedding's lookups in the lm_head's weight): each id's own bytes gathered
    from its group -- every byte of a group-block belongs to one row -- and its codes put back
    in GGUF's order."""
    qt = _check(qtype)
    if qt in KQUANT_BLOCK_BYTES:
        return deinterleave_kquant_rows(rows, qt, ids, k)
    fields = 2 if qt == QT.Q4_1 else 1  # fp16 scale fields per row: d (and m)
    head = 32 * fields
    pair = torch.arange(2)
    scale_at = (32 * torch.arange(fields)[:, None] + pair).reshape(-1)
    chunks = 16 if qt == QT.Q8_0 else 8
    code_at = (head + 32 * torch.arange(chunks)[:, None] + pair).reshape(-1)
    at = torch.cat([scale_at, code_at])[None, :] + 2 * (ids % GROUP_ROWS)[:, None]  # (T, bytes)
    nb = k // 32
    got = rows[(ids // GROUP_ROWS)[:, None, None], torch.arange(nb)[None, :, None], at[:, None]]
    if qt != QT.Q8_0:  # (T, nb, [scales | 16 bytes (c, j): q[4c + j] | q[4c + 2 + j] << 4])
        b = got[..., 2 * fields :].reshape(*got.shape[:2], 8, 1, 2)
        q = torch.cat([b & 15, b >> 4], dim=-2).reshape(*got.shape[:2], 32)  # q[4c + 2h + j]
        got = torch.cat([got[..., : 2 * fields], q[..., :16] | (q[..., 16:] << 4)], dim=-1)
    return got.reshape(ids.shape[0], row_bytes(qt, k))


def interleaved_matmul_ref(x: torch.Tensor, rows: torch.Tensor, qtype: int, n: int) -> torch.Tensor:
    """x (M, K) @ W.T in float64 as the kernel sums it: per chain block (32 values; a Q6_K
    sub-block: 16), the activations (rounded to bfloat16) against the integer codes, times the
    block's scale (Q4_1, Q4_K: plus its min times the block's activation sum). Returns float64
    (M, n)."""
    qt = _check(qtype)
    m, k = x.shape
    gguf = deinterleave(rows, qtype, n, k)
    if qt in KQUANT_BLOCK_BYTES:
        q, d, mins = kquant_chain_blocks(gguf, qt, n, k)
    else:
        scales, codes = _parts(gguf, qt, n, k)
        d = scales[..., :2].contiguous().view(torch.float16).double()[..., 0]  # (n, nb)
        if qt == QT.Q8_0:
            q = codes.contiguous().view(torch.int8).double()
        else:
            q = codes.double() - (8.0 if qt == QT.Q4_0 else 0.0)
        mins = None
        if qt == QT.Q4_1:
            mins = scales[..., 2:4].contiguous().view(torch.float16).double()[..., 0]
    v = q.shape[-1]
    xb = x.to(torch.bfloat16).double().reshape(m, k // v, v)
    s = torch.einsum("mbk,nbk->mnb", xb, q)  # (M, n, nb): each chain block's integer-code sum
    out = (s * d).sum(-1)
    if mins is not None:
        out = out + xb.sum(-1) @ mins.T
    return out
