"""Q4_K, Q5_K and Q6_K weights interleaved into groups of 16 rows (``interleaved_weights`` has the
32-value formats and the API; ``kernels/csrc/interleaved_tiles.h`` the kernel side).

One (group, super-block of 256 values) holds 16 weight rows side by side, each field of the
GGUF block spread over the rows so that one byte load feeds 16 float32 lanes:

    Q4_K  d[16] fp16 | dmin[16] fp16 | sc[8][16] u8 | mn[8][16] u8 | 8 x 256 code bytes  2368
    Q5_K  as Q4_K, each sub-block's 256 code bytes followed by 64 bytes of fifth bits     2880
    Q6_K  d[16] fp16 | sc[16][16] i8 | 16 x (128 low-nibble bytes | 64 high-bit bytes)   3360

The kernel's chain block is a sub-block (Q4_K, Q5_K: 32 values with a 6-bit scale and min,
Q6_K: 16 values with an int8 scale). Q4_K code bytes are Q4_0's chunks (chunk c of sub-block s,
byte 2i + j: row i's q[32s + 4c + j] | q[32s + 4c + 2 + j] << 4); Q5_K's low nibbles the same,
and per chunk two 32-bit masks of the fifth bits over its words (_q5_to_masks); Q6_K's low
nibbles the same over its 16 values, and high-bit vector p, byte 2i + j: row i's h[8p + j] |
h[8p + 2 + j] << 2 | h[8p + 4 + j] << 4 | h[8p + 6 + j] << 6 (h: the code's bits 4-5).

Q6_K keeps GGUF's 210 bytes per row and super-block; Q4_K's 6-bit scales and mins, packed in
12 bytes per row in GGUF, take a byte each here: 148 bytes instead of 144 (+2.8%; Q5_K: 180
instead of 176, +2.3%), so that a sub-block's 16 scales are one byte load. The re-encodings
are bijective: ``deinterleave`` gives back the GGUF bytes exactly.
"""

from __future__ import annotations

import torch

from kvserve.kernels.quant_ref import QT, _q4_k_scale_min

GROUP_ROWS = 16
SUPER = 256  # values per super-block
KQUANT_BLOCK_BYTES = {QT.Q4_K: 2368, QT.Q5_K: 2880, QT.Q6_K: 3360}
# bytes of one row's share of a (group, super-block), in the row's own order (_row_offsets)
_ROW_BYTES = {QT.Q4_K: 148, QT.Q5_K: 180, QT.Q6_K: 210}
_MIN_TYPES = (QT.Q4_K, QT.Q5_K)  # a 6-bit scale and min per 32-value sub-block


def _row_offsets(qt: QT) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, stride): row i's bytes of a (group, super-block) are at base + stride * i, in the
    row's order: Q4_K d(2) dmin(2) sc(8) mn(8) codes(8 sub-blocks x 8 chunks x 2); Q5_K the
    same, each sub-block's codes followed by its fifth bits (2 vectors x 2, row-aligned: the
    kernel's masks are made from these by _q5_to_masks); Q6_K d(2) sc(16) then per sub-block
    low nibbles (4 chunks x 2) and high bits (2 vectors x 2)."""
    pair = torch.arange(2)
    parts: list[tuple[torch.Tensor, int]] = [(pair, 2)]  # d
    if qt in _MIN_TYPES:
        parts += [(32 + pair, 2), (64 + 16 * torch.arange(8), 1), (192 + 16 * torch.arange(8), 1)]
        sub = 320 + (256 if qt == QT.Q4_K else 320) * torch.arange(8)[:, None]
        vectors = 8 if qt == QT.Q4_K else 10  # 8 code chunks (then 2 high-bit vectors)
        chunk = sub + 32 * torch.arange(vectors)[None, :]
        parts.append(((chunk[..., None] + pair).reshape(-1), 2))
    else:
        parts.append((32 + 16 * torch.arange(16), 1))
        sub = 288 + 192 * torch.arange(16)[:, None]
        lo = (sub[..., None] + 32 * torch.arange(4)[:, None] + pair).reshape(16, 8)
        hi = (sub[..., None] + 128 + 32 * torch.arange(2)[:, None] + pair).reshape(16, 4)
        parts.append((torch.cat([lo, hi], dim=1).reshape(-1), 2))
    base = torch.cat([b for b, _ in parts])
    stride = torch.cat([torch.full_like(b, s) for b, s in parts])
    assert base.numel() == _ROW_BYTES[qt]
    return base, stride


def _pack_q4_k_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """(..., 8) 6-bit scales and mins -> GGUF's 12 packed bytes (inverse of get_scale_min_k4)."""
    d = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    m = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    md = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    return torch.cat([d, m, md], dim=-1)


def _q6_k_codes(b: torch.Tensor) -> torch.Tensor:
    """(..., 210) GGUF Q6_K blocks -> (..., 256) codes 0..63 in value order."""
    lead = b.shape[:-1]
    ql = b[..., :128].reshape(*lead, 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=-2).reshape(*lead, 256)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)
    qh = ((b[..., 128:192].reshape(*lead, 2, 1, 32) >> shifts) & 3).reshape(*lead, 256)
    return ql | (qh << 4)


def _q6_k_pack(q: torch.Tensor) -> torch.Tensor:
    """(..., 256) codes 0..63 -> GGUF's ql (128) | qh (64) bytes."""
    lead = q.shape[:-1]
    lo = (q & 0x0F).reshape(*lead, 2, 2, 64)  # (half, nibble, l)
    ql = lo[..., 0, :] | (lo[..., 1, :] << 4)
    hb = (q >> 4).reshape(*lead, 2, 4, 32)  # (half, t, l): shift 2t
    qh = hb[..., 0, :] | (hb[..., 1, :] << 2) | (hb[..., 2, :] << 4) | (hb[..., 3, :] << 6)
    return torch.cat([ql.reshape(*lead, 128), qh.reshape(*lead, 64)], dim=-1)


def _k_min_codes(b: torch.Tensor, qt: QT) -> torch.Tensor:
    """(..., 144 | 176) GGUF Q4_K / Q5_K blocks -> (..., 256) codes (0..15 | 0..31) in value
    order: value 32s + l is nibble s % 2 of qs[32 (s // 2) + l] (Q5_K: | bit s of qh[l] << 4)."""
    lead = b.shape[:-1]
    at = 16 if qt == QT.Q4_K else 48
    qs = b[..., at:].reshape(*lead, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-2).reshape(*lead, 8, 32)
    if qt == QT.Q5_K:
        shifts = torch.arange(8, dtype=torch.uint8)[:, None]
        q = q | (((b[..., 16:48].reshape(*lead, 1, 32) >> shifts) & 1) << 4)
    return q.reshape(*lead, 256)


def _k_min_pack(q: torch.Tensor, qt: QT) -> torch.Tensor:
    """Inverse of _k_min_codes for the bytes after the scales: Q4_K qs (128), Q5_K qh | qs."""
    lead = q.shape[:-1]
    lo = (q & 0x0F).reshape(*lead, 4, 2, 32)  # (chunk, low / high nibble, l)
    qs = (lo[..., 0, :] | (lo[..., 1, :] << 4)).reshape(*lead, 128)
    if qt == QT.Q4_K:
        return qs
    h = (q >> 4).reshape(*lead, 8, 32)  # (sub-block s = bit, l)
    qh = (h << torch.arange(8, dtype=torch.uint8)[:, None]).sum(-2, dtype=torch.uint8)
    return torch.cat([qh, qs], dim=-1)


def _nibble_chunks(q: torch.Tensor) -> torch.Tensor:
    """(..., V) 4-bit codes (V a multiple of 4) -> (..., V / 2) bytes in chunk order: byte
    2c + j = q[4c + j] | q[4c + 2 + j] << 4 (one row's share of the Q4 chunks)."""
    c = q.reshape(*q.shape[:-1], -1, 2, 2)  # (.., c, half, j)
    return (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(*q.shape[:-1], -1)


def _unnibble_chunks(b: torch.Tensor) -> torch.Tensor:
    """Inverse of _nibble_chunks."""
    c = b.reshape(*b.shape[:-1], -1, 1, 2)
    return torch.cat([c & 0x0F, c >> 4], dim=-2).reshape(*b.shape[:-1], -1)


def _rows_from_gguf(blocks: torch.Tensor, qt: QT) -> torch.Tensor:
    """(..., GGUF block bytes) -> (..., _ROW_BYTES) in _row_offsets' order."""
    lead = blocks.shape[:-1]
    if qt in _MIN_TYPES:
        sc, mn = _q4_k_scale_min(blocks[..., 4:16].reshape(-1, 12))
        q = _k_min_codes(blocks, qt)  # (.., 256) value order
        body = _nibble_chunks(q & 0x0F)
        if qt == QT.Q5_K:  # per sub-block: 16 code bytes, then 4 high-bit bytes (p, j)
            h = (q >> 4).reshape(*lead, 8, 2, 8, 2)  # (sub, p, t, j): value 16p + 2t + j
            bits = (h << torch.arange(8, dtype=torch.uint8)[:, None]).sum(-2, dtype=torch.uint8)
            body = torch.cat([body.reshape(*lead, 8, 16), bits.reshape(*lead, 8, 4)], dim=-1)
        return torch.cat(
            [blocks[..., :4], sc.reshape(*lead, 8), mn.reshape(*lead, 8), body.reshape(*lead, -1)],
            dim=-1,
        )
    q = _q6_k_codes(blocks).reshape(*lead, 16, 16)  # (sub-block, value)
    lo = _nibble_chunks(q & 0x0F)  # (.., 16, 8)
    h = (q >> 4).reshape(*lead, 16, 2, 4, 2)  # (sub, p, t, j): value 8p + 2t + j
    hi = h[..., 0, :] | (h[..., 1, :] << 2) | (h[..., 2, :] << 4) | (h[..., 3, :] << 6)
    body = torch.cat([lo, hi.reshape(*lead, 16, 4)], dim=-1).reshape(*lead, 192)
    return torch.cat([blocks[..., 208:210], blocks[..., 192:208], body], dim=-1)


def _gguf_from_rows(r: torch.Tensor, qt: QT) -> torch.Tensor:
    """Inverse of _rows_from_gguf."""
    lead = r.shape[:-1]
    if qt in _MIN_TYPES:
        scales = _pack_q4_k_scales(r[..., 4:12], r[..., 12:20])
        body = r[..., 20:].reshape(*lead, 8, -1)  # (sub-block, 16 code bytes [| 4 high])
        q = _unnibble_chunks(body[..., :16]).reshape(*lead, 256)  # low nibbles, value order
        if qt == QT.Q5_K:
            hb = body[..., 16:].reshape(*lead, 8, 2, 1, 2)  # (sub, p, 1, j)
            shifts = torch.arange(8, dtype=torch.uint8)[:, None]
            q = q | ((((hb >> shifts) & 1) << 4).reshape(*lead, 256))  # (sub, p, t, j)
        return torch.cat([r[..., :4], scales, _k_min_pack(q, qt)], dim=-1)
    body = r[..., 18:].reshape(*lead, 16, 12)
    lo = _unnibble_chunks(body[..., :8])  # (.., 16, 16) low nibbles
    hi = body[..., 8:].reshape(*lead, 16, 2, 1, 2)
    h = torch.cat([(hi >> s) & 3 for s in (0, 2, 4, 6)], dim=-2).reshape(*lead, 16, 16)
    q = (lo | (h << 4)).reshape(*lead, 256)
    return torch.cat([_q6_k_pack(q), r[..., 2:18], r[..., :2]], dim=-1)


def interleave_kquant(qweight: torch.Tensor, qt: QT, n: int, k: int) -> torch.Tensor:
    """GGUF rows (n, k / 256 x block bytes) -> (ceil(n / 16), k / 256, KQUANT_BLOCK_BYTES)."""
    nsb = k // SUPER
    g = -(-n // GROUP_ROWS)
    blocks = qweight.reshape(n, nsb, -1)
    rows = _rows_from_gguf(blocks, qt)  # (n, nsb, L)
    pad = g * GROUP_ROWS - n
    if pad:  # rows past n: zero scales and codes (the kernel never stores them)
        rows = torch.cat([rows, rows.new_zeros(pad, nsb, rows.shape[-1])])
    base, stride = _row_offsets(qt)
    at = base[None, :] + stride[None, :] * torch.arange(GROUP_ROWS)[:, None]  # (16, L)
    out = torch.zeros(g, nsb, KQUANT_BLOCK_BYTES[qt], dtype=torch.uint8)
    src = rows.reshape(g, GROUP_ROWS, nsb, -1).permute(0, 2, 1, 3)  # (g, nsb, 16, L)
    out[:, :, at.reshape(-1)] = src.reshape(g, nsb, -1)
    return _q5_to_masks(out) if qt == QT.Q5_K else out


def deinterleave_kquant(rows: torch.Tensor, qt: QT, n: int, k: int) -> torch.Tensor:
    """The interleaved layout -> the GGUF rows (n, row bytes) it was made from, exactly."""
    ids = torch.arange(n)
    return deinterleave_kquant_rows(rows, qt, ids, k)


def deinterleave_kquant_rows(rows: torch.Tensor, qt: QT, ids: torch.Tensor, k: int) -> torch.Tensor:
    """GGUF rows (len(ids), row bytes) of weight rows ``ids``: each id's own bytes only."""
    base, stride = _row_offsets(qt)
    at = base[None, :] + stride[None, :] * (ids % GROUP_ROWS)[:, None]  # (T, L)
    nsb = k // SUPER
    if qt == QT.Q5_K:  # the groups' fifth bits back in row-aligned bytes first
        blocks = _q5_from_masks(rows[ids // GROUP_ROWS])  # (T, nsb, 2880)
        got = blocks[torch.arange(ids.shape[0])[:, None, None], torch.arange(nsb)[None, :, None],
                     at[:, None]]  # fmt: skip
    else:
        got = rows[(ids // GROUP_ROWS)[:, None, None], torch.arange(nsb)[None, :, None],
                   at[:, None]]  # fmt: skip
    return _gguf_from_rows(got, qt).reshape(ids.shape[0], -1)


def _bits(b: torch.Tensor) -> torch.Tensor:
    """(..., n) uint8 -> (..., n, 8) its bits, least significant first."""
    return (b[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of _bits."""
    return (bits << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


def _q5_to_masks(x: torch.Tensor) -> torch.Tensor:
    """(..., 2880) Q5_K (group, super-block)s with row-aligned fifth-bit bytes (_row_offsets'
    layout: vector p, byte 2i + j, bit t = row i's h[16p + 2t + j]) -> the kernel's: after a
    sub-block's 8 code chunks, per chunk c two 32-bit masks over its words (bit 2i + j = row
    i's pair value j): lo = h[4c + j] ^ bit 0 of the high nibble sharing its byte, hi =
    h[4c + 2 + j]. A masked add of 16 to the chunk's words (lo: which toggles that bit 4; hi:
    after the shift right by 4) then makes each 5-bit code index: no per-chunk shifting."""
    lead = x.shape[:-1]
    sub = x[..., 320:].reshape(*lead, 8, 320)
    codes = sub[..., :256].reshape(*lead, 8, 8, 32)  # (s, c, word)
    h = _bits(sub[..., 256:].reshape(*lead, 8, 2, 32))  # (s, p, word, t)
    h = h.reshape(*lead, 8, 2, 32, 4, 2).movedim(-3, -1).reshape(*lead, 8, 8, 2, 32)
    lo = h[..., 0, :] ^ ((codes >> 4) & 1)  # (s, c, word)
    masks = torch.stack([lo, h[..., 1, :]], dim=-2)  # (s, c, lo / hi, word)
    mbytes = _pack_bits(masks.reshape(*lead, 8, 8, 2, 4, 8)).reshape(*lead, 8, 64)
    body = torch.cat([codes.reshape(*lead, 8, 256), mbytes], dim=-1)
    return torch.cat([x[..., :320], body.reshape(*lead, 2560)], dim=-1)


def _q5_from_masks(x: torch.Tensor) -> torch.Tensor:
    """Inverse of _q5_to_masks."""
    lead = x.shape[:-1]
    sub = x[..., 320:].reshape(*lead, 8, 320)
    codes = sub[..., :256].reshape(*lead, 8, 8, 32)
    m = _bits(sub[..., 256:].reshape(*lead, 8, 8, 2, 4)).reshape(*lead, 8, 8, 2, 32)
    h = torch.stack([m[..., 0, :] ^ ((codes >> 4) & 1), m[..., 1, :]], dim=-2)
    h = h.reshape(*lead, 8, 2, 4, 2, 32).movedim(-1, -3).reshape(*lead, 8, 2, 32, 8)
    body = torch.cat([codes.reshape(*lead, 8, 256), _pack_bits(h).reshape(*lead, 8, 64)], -1)
    return torch.cat([x[..., :320], body.reshape(*lead, 2560)], dim=-1)


def kquant_chain_blocks(
    qweight: torch.Tensor, qt: QT, n: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GGUF rows -> the kernel's chain blocks in float64: codes (n, nb, V) (Q4_K, Q5_K q; Q6_K
    q - 32), scales (n, nb) (d x sc) and mins (n, nb) (-(dmin x mn); None for Q6_K)."""
    blocks = qweight.reshape(n, k // SUPER, -1)
    at = 208 if qt == QT.Q6_K else 0
    d = blocks[..., at : at + 2].contiguous().view(torch.float16).double()  # (n, nsb, 1)
    if qt in _MIN_TYPES:
        sc, mn = _q4_k_scale_min(blocks[..., 4:16].reshape(-1, 12))
        sc, mn = sc.reshape(n, -1, 8).double(), mn.reshape(n, -1, 8).double()
        dmin = blocks[..., 2:4].contiguous().view(torch.float16).double()
        q = _k_min_codes(blocks, qt).reshape(n, -1, 32).double()
        return q, (d * sc).reshape(n, -1), (-(dmin * mn)).reshape(n, -1)
    q = _q6_k_codes(blocks).double() - 32.0
    sc = blocks[..., 192:208].contiguous().view(torch.int8).double()  # (n, nsb, 16)
    return q.reshape(n, -1, 16), (d * sc).reshape(n, -1), None
