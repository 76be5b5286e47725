"""Batch-invariant mode's weights: every quantized matmul in one summation order.

``fix_summation_order`` turns a loaded model's quantized layers to the bf16 kernels whose
output elements are summed in one order at every row count (ARCHITECTURE.md "Bitwise
invariance"): weights of a format with an interleaved layout (Q4_0, Q4_1, Q8_0) are
interleaved into 16-row groups (``kernels/interleaved_weights.py``, multiplied by
``kvserve::interleaved_matmul_bf16``); the others keep their GGUF rows and take the bf16 dot
kernel in its fixed order.

A weight's bytes are held once: the members of a fused q/k/v or gate/up (views of the fused
rows, kept for export) become views of the fused weight's interleaved groups, and a tied
embedding looks its rows up in the lm_head's interleaved weight.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch
from torch import nn

from kvserve.kernels.interleaved_weights import GROUP_ROWS, interleavable
from kvserve.models.quantized_linear import QuantizedEmbedding, QuantizedLinear


def fix_summation_order(model: nn.Module) -> str:
    """Batch-invariant mode: every quantized matmul of ``model`` takes a bf16 kernel in its
    fixed order at every row count, in place. Returns why it cannot ("" when done): it needs a
    bfloat16 model whose quantized weights run the C++ kernels on a CPU with AVX-512-BF16."""
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if not quantized:
        return "no quantized weights (dense weights run oneDNN, whose order is not fixed)"
    if not all(m.policy.use_kernels and m.policy.native_bf16 for m in quantized):
        return "the model is not bfloat16 on a native-bf16 CPU with the C++ kernels loaded"
    if not torch.ops.kvserve.cpu_has_avx512_bf16():
        return "the CPU lacks AVX-512-BF16 (the fixed-order kernel's VDPBF16PS)"
    for mods in _by_storage(model):
        _fix_sharing(mods)
    return ""


def _by_storage(model: nn.Module) -> list[list[nn.Module]]:
    """The quantized linears and embeddings, grouped by the storage their bytes live in."""
    mods = [m for m in model.modules() if isinstance(m, QuantizedLinear | QuantizedEmbedding)]
    by_storage: dict[int, list[nn.Module]] = defaultdict(list)
    for m in mods:
        by_storage[m.qweight.untyped_storage().data_ptr()].append(m)
    return list(by_storage.values())


def _fixed(m: QuantizedLinear, interleaved: bool):
    return dataclasses.replace(
        m.policy,
        kernel_max_rows=0,
        bf16_kernel_max_rows=0,
        amx_min_rows=0,
        fixed_order=True,
        interleaved=interleaved,
    )


def _fix_sharing(mods: list[nn.Module]) -> None:
    """The layers over one storage: the one whose weight spans it (a fused or a lone weight,
    or a tied lm_head) and its members (row views) or a tied embedding. Interleaved where the
    format allows, else on the dot kernel's fixed order."""
    linears = [m for m in mods if isinstance(m, QuantizedLinear)]
    if not linears or any(m.policy.interleaved for m in linears):
        return  # an embedding alone (untied), or done before
    owner = max(linears, key=lambda m: m.qweight.numel())
    offsets = {}  # member -> its first row in the owner's weight
    row_bytes = owner.qweight.shape[1]
    for m in linears:
        first, rem = divmod(m.qweight.storage_offset() - owner.qweight.storage_offset(), row_bytes)
        offsets[m] = first if rem == 0 else -1
    embeds = [m for m in mods if isinstance(m, QuantizedEmbedding)]
    # members are whole groups of the owner's rows (a storage holding unrelated tensors, as a
    # memory-mapped file would, fails this and is left in GGUF rows)
    aligned = all(
        o >= 0 and o % GROUP_ROWS == 0 and o + m.out_features <= owner.out_features
        for m, o in offsets.items()
    ) and all(m is owner or m.out_features % GROUP_ROWS == 0 for m in linears)
    if not (interleavable(owner.qtype) and aligned):
        for m in linears:
            m.policy = _fixed(m, interleaved=False)
        return
    owner.interleave(_fixed(owner, interleaved=True))
    for m in linears:
        if m is not owner:  # its rows' groups of the owner's interleaved weight
            g0 = offsets[m] // GROUP_ROWS
            m.qweight = owner.qweight[g0 : g0 + m.out_features // GROUP_ROWS]
            m.policy = _fixed(m, interleaved=True)
    for e in embeds:  # a tied embedding: rows looked up in the lm_head's groups
        e.use_interleaved(owner.qweight)
