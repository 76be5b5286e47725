"""Pure-PyTorch reference of the quantized-weight kernels: GGUF block formats on uint8 rows.

A quantized weight (N, K) is kept as GGUF stores it: a uint8 tensor (N, K // block_elems *
block_bytes), each row a run of blocks (layouts in csrc/quant_formats.cpp and
csrc/quant_kquants.cpp, after llama.cpp's ggml-common.h). `dequantize_ref` reproduces
gguf-py's `gguf.quants.dequantize` bit for bit (same float32 ops in the same order), vectorized
over all blocks; `reference_quant_matmul` is the slow twin of `kvserve::quant_matmul`.
`quantize` (HF checkpoints quantized at load) goes through gguf-py itself.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

SUPPORTED_QTYPES = (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K)
QUANTIZABLE_QTYPES = (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0)  # gguf-py can quantize these


def block_size(qtype: int) -> tuple[int, int]:
    """(values per block, bytes per block) of a supported type, from gguf.GGML_QUANT_SIZES."""
    qt = QT(qtype)
    if qt not in SUPPORTED_QTYPES:
        names = ", ".join(t.name for t in SUPPORTED_QTYPES)
        raise ValueError(f"unsupported quantization type {qt.name}; supported: {names}")
    return gguf.GGML_QUANT_SIZES[qt]


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one quantized row of k values."""
    elems, nbytes = block_size(qtype)
    if k % elems:
        raise ValueError(
            f"in_features {k} is not a multiple of {QT(qtype).name}'s block of {elems}"
        )
    return k // elems * nbytes


def _half(b: torch.Tensor) -> torch.Tensor:
    # (nb, 2) uint8 little-endian fp16 -> (nb, 1) float32
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # (nb, 16) -> (nb, 32): low nibbles are values 0..15, high nibbles 16..31
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    # (nb, 4) little-endian u32 -> (nb, 32) bit j of value j
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 32)


def _q4_k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # (nb, 12) packed 6-bit scales/mins -> two (nb, 8); llama.cpp's get_scale_min_k4
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _dequantize_blocks(b: torch.Tensor, qt: QT) -> torch.Tensor:
    """(nb, block_bytes) uint8 -> (nb, block_elems) float32, op for op as gguf-py."""
    nb = b.shape[0]
    if qt == QT.Q8_0:
        return _half(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()
    if qt == QT.Q4_0:
        q = _nibbles(b[:, 2:]).to(torch.int8) - 8
        return _half(b[:, :2]) * q.float()
    if qt == QT.Q4_1:
        return _half(b[:, :2]) * _nibbles(b[:, 4:]).float() + _half(b[:, 2:4])
    if qt == QT.Q5_0:
        q = (_nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4)).to(torch.int8) - 16
        return _half(b[:, :2]) * q.float()
    if qt == QT.Q5_1:
        q = _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4)
        return _half(b[:, :2]) * q.float() + _half(b[:, 2:4])
    if qt == QT.Q4_K:
        sc, mn = _q4_k_scale_min(b[:, 4:16])
        d = (_half(b[:, 0:2]) * sc.float()).unsqueeze(-1)  # (nb, 8, 1)
        dm = (_half(b[:, 2:4]) * mn.float()).unsqueeze(-1)
        # qs (nb, 4 chunks, 32): low nibbles = sub-block 2c, high = 2c + 1
        qs = b[:, 16:].reshape(nb, 4, 1, 32)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(nb, 8, 32).float()
        return (d * q - dm).reshape(nb, 256)
    if qt == QT.Q5_K:  # Q4_K's scales, then qh (32) | qs (128)
        sc, mn = _q4_k_scale_min(b[:, 4:16])
        d = (_half(b[:, 0:2]) * sc.float()).unsqueeze(-1)  # (nb, 8, 1)
        dm = (_half(b[:, 2:4]) * mn.float()).unsqueeze(-1)
        qs = b[:, 48:].reshape(nb, 4, 1, 32)
        ql = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(nb, 8, 32)
        # value l of sub-block s: bit s of qh[l]
        shifts = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 8, 1)
        qh = (b[:, 16:48].reshape(nb, 1, 32) >> shifts) & 1
        q = (ql | (qh << 4)).float()
        return (d * q - dm).reshape(nb, 256)
    if qt == QT.Q6_K:
        scales = b[:, 192:208].contiguous().view(torch.int8).float()
        d = (_half(b[:, 208:210]) * scales).reshape(nb, 16, 1)
        # ql (nb, 2 halves, 64) -> low nibbles then high nibbles: (nb, 8 groups of 32)
        ql = b[:, :128].reshape(nb, 2, 1, 64)
        ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(nb, 8, 32)
        # qh (nb, 2 halves, 32) -> 2-bit fields at shifts 0, 2, 4, 6: (nb, 8 groups of 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
        qh = ((b[:, 128:192].reshape(nb, 2, 1, 32) >> shifts) & 3).reshape(nb, 8, 32)
        q = (ql | (qh << 4)).to(torch.int8) - 32
        return (d * q.reshape(nb, 16, 16).float()).reshape(nb, 256)
    raise AssertionError(qt)  # block_size() already refused unsupported types


def dequantize_ref(qweight: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """uint8 (n, row_bytes) in GGUF block layout -> float32 (n, k), equal to gguf-py's."""
    elems, nbytes = block_size(qtype)
    rb = row_bytes(qtype, k)
    if qweight.dtype != torch.uint8 or tuple(qweight.shape) != (n, rb):
        raise ValueError(
            f"qweight must be uint8 ({n}, {rb}) for {QT(qtype).name} ({n}, {k}), "
            f"got {qweight.dtype} {tuple(qweight.shape)}"
        )
    blocks = qweight.reshape(n * (k // elems), nbytes)  # (n * blocks_per_row, block_bytes)
    return _dequantize_blocks(blocks, QT(qtype)).reshape(n, k)


def dequantize_rows(qweight: torch.Tensor, qtype: int, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Embedding lookup: only rows `ids` (any shape) of a quantized (vocab, k) table.

    Returns float32 (*ids.shape, k).
    """
    rows = qweight[ids.reshape(-1)]  # (num_ids, row_bytes)
    return dequantize_ref(rows, qtype, rows.shape[0], k).reshape(*ids.shape, k)


def reference_quant_matmul(
    x: torch.Tensor, qweight: torch.Tensor, qtype: int, n: int
) -> torch.Tensor:
    """x (M, K) float32 @ dequantize_ref(qweight).T -> (M, N) float32: the kernel's slow twin."""
    return x @ dequantize_ref(qweight, qtype, n, x.shape[-1]).T


def quantize(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """float (N, K) -> uint8 (N, row_bytes) in GGUF layout, quantized by gguf-py (as llama.cpp's
    converter does); K must be a multiple of the block size."""
    qt = QT(qtype)
    if qt not in QUANTIZABLE_QTYPES:
        names = ", ".join(t.name for t in QUANTIZABLE_QTYPES)
        raise ValueError(f"cannot quantize to {qt.name}; gguf-py quantizes: {names}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (N, K), got shape {tuple(weight.shape)}")
    row_bytes(qt, weight.shape[1])  # checks K
    data = weight.detach().to(torch.float32, copy=False).cpu().numpy()
    q = gguf.quants.quantize(np.ascontiguousarray(data), qt)  # (N, row_bytes) uint8
    return torch.from_numpy(np.ascontiguousarray(q))
