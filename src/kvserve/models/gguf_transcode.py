"""Lossless re-encoding of GGUF block formats that have no kernel into ones that do.

Two GGUF formats are exactly a subset of a format kvserve multiplies in place:

- **Q3_K -> Q6_K.** A Q3_K value is ``d * (sc - 32) * q`` with ``d`` one float16 per 256
  values, ``sc`` a 6-bit scale per 16 values and ``q`` in -4..3. Q6_K's value is
  ``d * sc8 * (q6 - 32)`` with the same float16 ``d``, an int8 ``sc8`` per 16 values and ``q6``
  in 0..63: ``sc8 = sc - 32``, ``q6 = q + 32`` carries every value over. 210 bytes per 256
  values against Q3_K's 110 (1.91x), still 2.4x smaller than bfloat16.
- **Q5_0 -> Q8_0.** A Q5_0 value is ``d * (q - 16)``, ``q`` 5 bits, one float16 ``d`` per 32
  values; Q8_0's is ``d * q8``: ``q8 = q - 16``. 34 bytes per 32 values against 22 (1.55x).

"Lossless" holds bit for bit, not just in value: both sides compute ``(d * scale) * q`` in
float32 with the same factors (gguf-py's and llama.cpp's dequantizers, and every kvserve
kernel's), and each product is exact (an 11-bit float16 mantissa times a 6-bit scale times a
3-bit code fits float32's 24 bits). So a transcoded weight takes the fused decode step, the
interleaved layout and every GGUF-row kernel of its target format, with the file's numbers.

Q2_K and Q5_1 have no such superset (a per-16-value min, a float16 min per block), so they
stay dequantized at load.

Pure numpy over a weight's (rows, bytes per row) uint8 array; no I/O.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

Q3_K_BYTES = 110  # hmask[32], qs[64], scales[12], d (float16)
Q6_K_BYTES = 210  # ql[128], qh[64], scales[16] (int8), d (float16)
Q5_0_BYTES = 22  # d (float16), qh (uint32), qs[16]
Q8_0_BYTES = 34  # d (float16), qs[32] (int8)

# source format -> the format it is held in
TRANSCODED = {
    GGMLQuantizationType.Q3_K: GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.Q5_0: GGMLQuantizationType.Q8_0,
}


def transcode(data: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, int]:
    """(rows, bytes per row) uint8 of a ``TRANSCODED`` format -> (the target format's rows,
    its GGMLQuantizationType value)."""
    if data.dtype != np.uint8 or data.ndim != 2:
        raise ValueError(f"expected a 2-D uint8 array of GGUF rows, got {data.dtype} {data.shape}")
    if qtype == GGMLQuantizationType.Q3_K:
        return _blocks(data, Q3_K_BYTES, q3_k_to_q6_k), int(GGMLQuantizationType.Q6_K)
    if qtype == GGMLQuantizationType.Q5_0:
        return _blocks(data, Q5_0_BYTES, q5_0_to_q8_0), int(GGMLQuantizationType.Q8_0)
    have = ", ".join(t.name for t in TRANSCODED)
    raise ValueError(f"no lossless transcoding for {qtype.name}; have {have}")


def _blocks(data: np.ndarray, block_bytes: int, fn) -> np.ndarray:
    rows, width = data.shape
    if width % block_bytes:
        raise ValueError(f"a row of {width} bytes is not whole {block_bytes}-byte blocks")
    out = fn(np.ascontiguousarray(data).reshape(-1, block_bytes))
    return out.reshape(rows, -1)


def q3_k_to_q6_k(blocks: np.ndarray) -> np.ndarray:
    """(n, 110) Q3_K blocks -> (n, 210) Q6_K blocks of the same values."""
    n = blocks.shape[0]
    hmask, qs = blocks[:, :32], blocks[:, 32:96]
    scales, d = blocks[:, 96:108], blocks[:, 108:110]
    # the 6-bit scales, as gguf-py unpacks them: low nibbles from bytes 0-7 (two per byte),
    # high 2 bits from bytes 8-11 (four per byte)
    lo = (scales[:, None, :8] >> np.array([0, 4], np.uint8)[None, :, None]).reshape(n, 16)
    hi = (scales[:, None, 8:] >> np.array([0, 2, 4, 6], np.uint8)[None, :, None]).reshape(n, 16)
    sc = ((lo & 0x0F) | ((hi & 0x03) << 4)).astype(np.int16) - 32  # -32..31
    # codes: value j = 128 * h + 32 * k + i takes bits 2k..2k+1 of qs[32 h + i] and bit
    # (4 h + k) of hmask[i]; a clear hmask bit subtracts 4 (gguf-py's order)
    ql = qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]
    qh = hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8)[None, :, None]
    q = (ql.reshape(n, 256) & 3).astype(np.int16) - 4 * ((qh.reshape(n, 256) & 1) ^ 1)
    return _pack_q6_k(q + 32, sc.astype(np.int8), d)


def _pack_q6_k(q6: np.ndarray, sc: np.ndarray, d: np.ndarray) -> np.ndarray:
    """(n, 256) codes 0..63, (n, 16) int8 scales, (n, 2) float16 bytes -> (n, 210) Q6_K."""
    n = q6.shape[0]
    q6 = q6.astype(np.uint8)
    # ql byte 64 h + i: value 128 h + i (low nibble), 128 h + 64 + i (high nibble)
    low = (q6 & 0x0F).reshape(n, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    # qh byte 32 h + i: bits 2k..2k+1 hold value 128 h + 32 k + i's top two bits
    top = (q6 >> 4).reshape(n, 2, 4, 32)
    qh = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)
    out = np.concatenate([ql, qh.reshape(n, 64), sc.view(np.uint8), d], axis=1)
    assert out.shape == (n, Q6_K_BYTES)
    return out


def q5_0_to_q8_0(blocks: np.ndarray) -> np.ndarray:
    """(n, 22) Q5_0 blocks -> (n, 34) Q8_0 blocks of the same values."""
    n = blocks.shape[0]
    d, qh, qs = blocks[:, :2], blocks[:, 2:6], blocks[:, 6:22]
    high = np.ascontiguousarray(qh).view("<u4").reshape(n, 1) >> np.arange(32, dtype=np.uint32)
    low = qs.reshape(n, 1, 16) >> np.array([0, 4], np.uint8)[None, :, None]
    q = ((low.reshape(n, 32) & 0x0F) | ((high & 1).astype(np.uint8) << 4)).astype(np.int16)
    out = np.concatenate([d, (q - 16).astype(np.int8).view(np.uint8)], axis=1)
    assert out.shape == (n, Q8_0_BYTES)
    return out
