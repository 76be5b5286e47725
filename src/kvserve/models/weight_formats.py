"""What each weight of a loaded model becomes in memory, and how it is multiplied.

After the checkpoint's tensors are checked and loaded (loader.py), every ``nn.Linear`` (and a
quantized token embedding) is replaced by the layer that fits the weight and the machine:

    GGUF Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K    -> QuantizedLinear (stays in its block format)
    --quantization q8_0|q4_0 (HF weights)  -> quantized at load, then QuantizedLinear
    float32, CPU                           -> PackedLinear (oneDNN pre-packed)
    bfloat16, CPU with oneDNN bf16 support -> PackedLinear
    bfloat16, CPU without native bf16      -> UpcastLinear (bf16 weights, float32 matmul)
    anything on CUDA                       -> nn.Linear as loaded

The choices are made from ``CpuFeatures`` (what the CPU does), and the quantized matmul's
row threshold from a measurement on this machine. ``WeightsReport`` says what was chosen.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from kvserve.kernels.build import load_kernels
from kvserve.kernels.interleaved_weights import interleavable, interleave
from kvserve.kernels.quant_ref import quantize
from kvserve.models.fixed_order import interleave_weights
from kvserve.models.gguf_checkpoint import QuantizedTensor
from kvserve.models.packed_linear import PackedLinear
from kvserve.models.quantized_linear import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantPolicy,
    measure_interleaved_max_rows,
    measure_kernel_max_rows,
)
from kvserve.models.row_thresholds import RowThresholdCache
from kvserve.platform import CpuFeatures, kernel_isa

logger = logging.getLogger(__name__)

QUANTIZATIONS = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512"}


class UpcastLinear(nn.Module):
    """bfloat16/float16 weights, float32 matmul: on CPUs without native bfloat16 the dtype's
    own ``F.linear`` is emulated and ~30x slower than converting (measured on Zen 3)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


@dataclass(slots=True)
class WeightsReport:
    """What the loaded model keeps in memory and which matmul path each format takes."""

    resident_bytes: int = 0  # parameters + buffers, the tied embedding counted once
    tensors_by_format: Counter = field(default_factory=Counter)  # "Q4_1" -> 210, ...
    paths: dict[str, str] = field(default_factory=dict)  # format -> matmul path, for humans

    def summary(self) -> str:
        formats = ", ".join(f"{n} {name}" for name, n in sorted(self.tensors_by_format.items()))
        return f"{self.resident_bytes / 2**20:.1f} MiB resident ({formats})"


def describe_policy(policy: QuantPolicy) -> str:
    """One line for ``kvserve info`` and the load log: which path takes which row counts."""
    if not policy.use_kernels:
        return "reference (PyTorch dequantize + matmul)"
    if policy.fixed_order:
        layout = "interleaved rows" if policy.interleaved else "GGUF rows"
        return f"bf16 kernel (avx512_bf16) on {layout}, fixed order at every row count"
    if policy.interleaved:
        return (
            f"interleaved kernel (avx512_bf16) up to {policy.interleaved_max_rows} rows, "
            "dequant+matmul above"
        )
    isa = ISA_NAMES[policy.isa if policy.isa >= 0 else 2]
    text = f"kernel ({isa}) up to {policy.kernel_max_rows} rows"
    if policy.bf16_kernel_max_rows > policy.kernel_max_rows:
        if policy.amx_min_rows > policy.kernel_max_rows + 1:
            text += f", bf16 kernel (avx512_bf16) up to {policy.amx_min_rows - 1}"
        if policy.amx_min_rows:
            text += f", bf16 kernel on AMX tiles up to {policy.bf16_kernel_max_rows}"
        else:
            text += f", bf16 kernel (avx512_bf16) up to {policy.bf16_kernel_max_rows}"
    return text + ", dequant+matmul above"


def resident_bytes(model: nn.Module) -> int:
    """Bytes of every distinct parameter and buffer storage (a tied weight counts once)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "meta" or t.is_mkldnn:
            continue
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    total = sum(seen.values())
    for m in model.modules():  # oneDNN-packed weights are opaque: count their dense size
        if isinstance(m, PackedLinear):
            total += m.packed.numel() * m.packed.element_size()
    return total


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _interleaves(features: CpuFeatures, dtype: torch.dtype) -> bool:
    """Whether interleavable weights (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) take the interleaved
    layout at load: a bfloat16 model on a CPU with AVX-512-BF16 and no AMX. Decode runs through the
    interleaved kernel there (a 1.1B Q4_0 / Q4_K_M file decoded 2.6x / 4x faster than through
    the measured GGUF-row paths, Zen 5, benchmarks/decode.py), prefill chunks through oneDNN
    on the dequantized weight as before. AMX CPUs keep their measured paths (AMX tiles for
    prefill; the interleaved kernel is unmeasured there)."""
    return (
        dtype == torch.bfloat16
        and features.native_bf16
        and features.avx512_bf16
        and features.avx512
        and not (features.amx_bf16 and torch.ops.kvserve.cpu_has_amx_bf16())
    )


def _policies(
    layers: dict[str, QuantizedTensor],
    device: torch.device,
    features: CpuFeatures,
    dtype: torch.dtype,
    thresholds: RowThresholdCache | None = None,
) -> dict[tuple[int, int, int], QuantPolicy]:
    """One policy per distinct (qtype, rows, cols): the kernel's row threshold is measured,
    or read from ``thresholds`` where this machine measured it before."""
    use = device.type == "cpu" and load_kernels()
    isa = kernel_isa(features)
    interleaves = use and _interleaves(features, dtype)
    out: dict[tuple[int, int, int], QuantPolicy] = {}
    measured = 0
    start = time.monotonic()
    for q in layers.values():
        key = (q.qtype, *q.shape)
        if key in out:
            continue
        if not use:
            out[key] = QuantPolicy(use_kernels=False)
            continue
        bf16 = features.native_bf16 and dtype == torch.bfloat16
        # the bf16 kernel needs AVX-512-BF16 itself (AMX-only CPUs have it too, in practice)
        bf16_kernel = bf16 and features.avx512_bf16 and features.avx512
        amx = bf16_kernel and features.amx_bf16 and torch.ops.kvserve.cpu_has_amx_bf16()
        args = {"qtype": q.qtype, "shape": list(q.shape), "isa": isa, "bf16": bf16}
        args |= {"bf16_kernel": bf16_kernel, "amx": amx}
        inter = interleaves and interleavable(q.qtype)
        if inter:
            args["interleaved"] = True
        cache_key = thresholds.key(**args) if thresholds is not None else ""
        found = thresholds.get(cache_key) if thresholds is not None else None
        if found is None:
            if measured == 0:  # a cold start says what it is doing (info level is off)
                logger.warning(
                    "measuring which quantized matmul path is fastest at each row count on "
                    "this machine (once per weight shape; kept in %s)",
                    "memory only" if thresholds is None else thresholds.path,
                )
            measured += 1
            if inter:  # the interleaved kernel against oneDNN; GGUF-row paths unmeasured
                # (cached as (0, its rows, 0): the key says interleaved)
                rows = interleave(q.data, q.qtype, q.shape[0], q.shape[1])
                found = (0, measure_interleaved_max_rows(rows, *key), 0)
            else:
                found = measure_kernel_max_rows(
                    q.data, q.qtype, q.shape[0], q.shape[1], isa, bf16, bf16_kernel, amx=amx
                )
            if thresholds is not None:
                thresholds.put(cache_key, found)
        if inter:
            # placeholder until interleave_weights switches the layout: dequant+matmul on
            # GGUF rows (kept only by a weight whose storage cannot be shared in groups)
            inter_rows = found[1]
            out[key] = QuantPolicy(
                use_kernels=True,
                isa=isa,
                kernel_max_rows=0,
                native_bf16=True,
                interleaved_max_rows=inter_rows,
            )
            continue
        rows, bf16_rows, amx_rows = found
        out[key] = QuantPolicy(
            use_kernels=True,
            isa=isa,
            kernel_max_rows=rows,
            native_bf16=bf16,
            bf16_kernel_max_rows=bf16_rows,
            amx_min_rows=amx_rows,
        )
    if measured:
        logger.warning("measured %d weight shape(s) in %.1f s", measured, time.monotonic() - start)
    return out


def quantize_linears(model: nn.Module, quantization: str) -> dict[str, QuantizedTensor]:
    """``--quantization``: every linear weight (and a tied embedding) quantized at load."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}"
        )
    qtype = int(QUANTIZATIONS[quantization])
    out: dict[str, QuantizedTensor] = {}
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, module in model.named_modules():
        if tied and name == "lm_head":
            continue  # the embedding's bytes serve both (finalize_weights)
        if isinstance(module, nn.Linear | nn.Embedding) and module.weight.shape[1] % 32 == 0:
            w = module.weight.detach().float()
            out[f"{name}.weight"] = QuantizedTensor(quantize(w, qtype), qtype, tuple(w.shape))
    return out


# fused module -> the weights it concatenates by rows, in output order (HF names under a layer)
FUSIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_quantized(
    model: nn.Module, quantized: dict[str, QuantizedTensor]
) -> dict[str, QuantizedTensor]:
    """Row-concatenated weights for each FUSIONS group whose members share a qtype and have no
    bias: one matmul instead of three (two), with more rows to split over threads -- a decode
    step of the default model makes 121 quantized calls instead of 211. The members' data
    become views of the fused tensor, so no byte is held twice. Returns fused name -> tensor."""
    fused: dict[str, QuantizedTensor] = {}
    for i in range(len(getattr(model.model, "layers", ()))):
        prefix = f"model.layers.{i}."
        for target, members in FUSIONS.items():
            parts = [quantized.get(f"{prefix}{m}.weight") for m in members]
            if any(p is None for p in parts):
                continue  # not quantized, or a family without these members (DeepSeek's MLA)
            biased = any(
                getattr(model.get_submodule(prefix + m), "bias", None) is not None for m in members
            )
            if any(p is None for p in parts) or biased or len({p.qtype for p in parts}) != 1:
                continue
            data = torch.cat([p.data for p in parts])  # (sum of rows, bytes per row)
            rows = 0
            for m, p in zip(members, parts, strict=True):
                quantized[f"{prefix}{m}.weight"] = QuantizedTensor(
                    data[rows : rows + p.shape[0]], p.qtype, p.shape
                )
                rows += p.shape[0]
            fused[prefix + target] = QuantizedTensor(
                data, parts[0].qtype, (rows, parts[0].shape[1])
            )
    return fused


def finalize_weights(
    model: nn.Module,
    quantized: dict[str, QuantizedTensor],
    dtype: torch.dtype,
    device: torch.device,
    features: CpuFeatures,
    pack: bool = True,
    thresholds: RowThresholdCache | None = None,
) -> WeightsReport:
    """Swap in the layer each weight takes (see the module docstring); report the result.

    ``quantized``: HF weight name -> QuantizedTensor, for weights that stay quantized; the
    model must already hold every other weight (built by loader.build_model).
    """
    report = WeightsReport()
    fused = fuse_quantized(model, quantized)
    policies = _policies({**quantized, **fused}, device, features, dtype, thresholds)
    embed_name = "model.embed_tokens.weight"
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, q in quantized.items():
        module_name = name.removesuffix(".weight")
        policy = policies[(q.qtype, *q.shape)]
        data = q.data.to(device)
        fmt = GGMLQuantizationType(q.qtype).name
        report.tensors_by_format[fmt] += 1
        report.paths[fmt] = describe_policy(policy)
        if name == embed_name:
            rows, dim = q.shape
            _set_module(model, module_name, QuantizedEmbedding(data, q.qtype, rows, dim, dtype))
            if tied:  # the lm_head multiplies by the same bytes
                model.lm_head = QuantizedLinear(data, q.qtype, dim, rows, policy)
            continue
        old = model.get_submodule(module_name)
        bias = getattr(old, "bias", None)
        layer = QuantizedLinear(data, q.qtype, q.shape[1], q.shape[0], policy, bias)
        _set_module(model, module_name, layer)
    for module_name, q in fused.items():
        policy = policies[(q.qtype, *q.shape)]
        layer = QuantizedLinear(q.data.to(device), q.qtype, q.shape[1], q.shape[0], policy)
        _set_module(model, module_name, layer)
    if any(p.interleaved_max_rows for p in policies.values()):
        interleave_weights(model)
        for m in model.modules():
            if isinstance(m, QuantizedLinear) and m.policy.interleaved_max_rows:
                fmt = GGMLQuantizationType(m.qtype).name
                report.paths[fmt] = describe_policy(m.policy)
                if not m.policy.interleaved:
                    logger.warning(
                        "a %s weight (%d x %d) shares its storage in a way that cannot be "
                        "interleaved: it keeps GGUF rows and dequantizes at every call",
                        fmt, m.out_features, m.in_features,
                    )  # fmt: skip
    _finalize_dense(model, dtype, device, features, pack, report)
    report.resident_bytes = resident_bytes(model)
    return report


def _finalize_dense(
    model: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    features: CpuFeatures,
    pack: bool,
    report: WeightsReport,
) -> None:
    """Dense linears: oneDNN packing where the CPU runs it, float32 matmul for emulated bf16."""
    name = str(dtype).removeprefix("torch.")
    cpu = device.type == "cpu" and torch.backends.mkldnn.is_available()
    if cpu and dtype != torch.float32 and not (dtype == torch.bfloat16 and features.native_bf16):
        make, path = UpcastLinear, "float32 matmul of the weights (no native bfloat16)"
    elif cpu and pack and (dtype == torch.float32 or features.onednn_bf16_packing):
        make, path = PackedLinear, "oneDNN pre-packed"
    else:
        make, path = None, "F.linear"
    for module_name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            report.tensors_by_format[name] += 1
            report.paths[name] = path
            if make is not None:
                _set_module(model, module_name, make(module))
