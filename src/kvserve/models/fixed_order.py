"""Interleaved weights in a loaded model, and batch-invariant mode's one summation order.

``interleave_weights`` (the default path of a bfloat16 model on a CPU with AVX-512-BF16 and no
AMX) holds every weight of a format with an interleaved layout (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K,
Q6_K) in 16-row groups (``kernels/interleaved_weights.py``): decodes and small batches multiply
through ``kvserve::interleaved_matmul_bf16``, prefill chunks above the weight's measured row
threshold through oneDNN on its dequantized bf16 weight.

``fix_summation_order`` (batch-invariant mode) turns every quantized matmul to a bf16 kernel
whose output elements are summed in one order at every row count (ARCHITECTURE.md "Bitwise
invariance"): interleaved weights take the interleaved kernel at every row count; the others
keep their GGUF rows and take the bf16 dot kernel in its fixed order.

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
        _share(mods, _fixed)
    return ""


def interleave_weights(model: nn.Module) -> int:
    """The default path's layout switch, in place: interleavable weights (their policies
    already carry ``interleaved_max_rows``) take the interleaved layout; returns how many
    linears did. A weight whose storage cannot be shared in groups keeps its GGUF rows and
    policy."""

    def policy(m: QuantizedLinear, interleaved: bool):
        return dataclasses.replace(m.policy, interleaved=True) if interleaved else m.policy

    for mods in _by_storage(model):
        _share(mods, policy)
    return sum(
        1 for m in model.modules() if isinstance(m, QuantizedLinear) and m.policy.interleaved
    )


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


def _share(mods: list[nn.Module], policy) -> None:
    """The layers over one storage: the one whose weight spans it (a fused or a lone weight,
    or a tied lm_head) and its members (row views) or a tied embedding. Interleaved where the
    format allows; each gets ``policy(m, interleaved)``."""
    linears = [m for m in mods if isinstance(m, QuantizedLinear)]
    if not linears:
        return  # an embedding alone (untied)
    if any(m.policy.interleaved for m in linears):  # interleaved at load (the default path)
        for m in linears:
            m.policy = policy(m, m.policy.interleaved)
        return
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
            m.policy = policy(m, False)
        return
    owner.interleave(policy(owner, True))
    for m in linears:
        if m is not owner:  # its rows' groups of the owner's interleaved weight
            g0 = offsets[m] // GROUP_ROWS
            m.qweight = owner.qweight[g0 : g0 + m.out_features // GROUP_ROWS]
            m.policy = policy(m, True)
    for e in embeds:  # a tied embedding: rows looked up in the lm_head's groups
        e.use_interleaved(owner.qweight)
