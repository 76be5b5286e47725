"""What the machine does natively, and the choices that follow from it.

Kernels are chosen from what the CPU *does*, never from an op merely existing: oneDNN's
bfloat16 weight packing exists in every torch build but raises on a CPU without AVX-512BW/VL/DQ
(or AVX-NE-CONVERT), and bfloat16 ``F.linear`` without native bfloat16 is emulated (measured
0.3 GB/s on a Zen 3 machine: 775 ms per decode step of a 135M model).

``CpuFeatures`` is read from torch's own cpuinfo (``torch.cpu.get_capabilities``). Tests and
users can pretend to have less: ``KVSERVE_CPU_FEATURES=avx2`` (or ``none``, ``avx512``) caps
what is reported, so the AVX2-only and portable paths run on every machine.
"""

from __future__ import annotations

import logging
import os
import platform as _platform
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

CPU_FEATURES_ENV = "KVSERVE_CPU_FEATURES"
# levels a machine can be capped to, from least to most
FEATURE_LEVELS = ("none", "avx2", "avx512", "avx512_bf16", "amx")


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    """The instruction-set features kvserve's kernel choices depend on."""

    arch: str  # "x86_64", "aarch64", ...
    name: str
    avx2: bool = False
    fma: bool = False
    avx512f: bool = False
    avx512bw: bool = False
    avx512vl: bool = False
    avx512dq: bool = False
    avx512_vnni: bool = False
    avx512_bf16: bool = False
    avx_ne_convert: bool = False
    amx_bf16: bool = False
    neon: bool = False
    capped_to: str | None = None  # set when KVSERVE_CPU_FEATURES lowered what is reported

    @property
    def avx512(self) -> bool:
        """The AVX-512 subset the kernels use (F, BW, VL, DQ)."""
        return self.avx512f and self.avx512bw and self.avx512vl and self.avx512dq

    @property
    def native_bf16(self) -> bool:
        """bfloat16 arithmetic in hardware: AVX-512-BF16 or AMX-BF16 (x86). ARM's BF16
        extension is not detected here, so aarch64 reports False (float32 is chosen)."""
        return self.avx512_bf16 or self.amx_bf16

    @property
    def onednn_bf16_packing(self) -> bool:
        """oneDNN's bf16 weight reorder runs (it checks exactly this, and raises otherwise)."""
        return self.avx_ne_convert or self.avx512

    def names(self) -> list[str]:
        """The features present, for ``kvserve info`` and logs."""
        flags = (
            "avx2",
            "fma",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512dq",
            "avx512_vnni",
            "avx512_bf16",
            "avx_ne_convert",
            "amx_bf16",
            "neon",
        )
        return [f for f in flags if getattr(self, f)]


def _cap(features: CpuFeatures, level: str) -> CpuFeatures:
    """``features`` with everything above ``level`` switched off."""
    if level not in FEATURE_LEVELS:
        raise ValueError(
            f"{CPU_FEATURES_ENV} must be one of {', '.join(FEATURE_LEVELS)}, got {level!r}"
        )
    rank = FEATURE_LEVELS.index(level)
    keep_avx2 = rank >= 1
    keep_512 = rank >= 2
    keep_bf16 = rank >= 3
    keep_amx = rank >= 4  # "avx512_bf16" keeps the bf16 kernels but not their AMX tiles
    return CpuFeatures(
        arch=features.arch,
        name=features.name,
        avx2=features.avx2 and keep_avx2,
        fma=features.fma and keep_avx2,
        avx512f=features.avx512f and keep_512,
        avx512bw=features.avx512bw and keep_512,
        avx512vl=features.avx512vl and keep_512,
        avx512dq=features.avx512dq and keep_512,
        avx512_vnni=features.avx512_vnni and keep_512,
        avx512_bf16=features.avx512_bf16 and keep_bf16,
        avx_ne_convert=features.avx_ne_convert and keep_bf16,
        amx_bf16=features.amx_bf16 and keep_amx,
        neon=features.neon and rank >= 1,
        capped_to=level,
    )


def detect_cpu_features(cap: str | None = None) -> CpuFeatures:
    """The CPU's features; ``cap`` (default: $KVSERVE_CPU_FEATURES) pretends to have less."""
    caps = torch.cpu.get_capabilities()
    arch = caps.get("architecture") or _platform.machine()
    features = CpuFeatures(
        arch=str(arch),
        name=str(caps.get("cpu_name") or _platform.processor() or "unknown"),
        avx2=bool(caps.get("avx2")),
        fma=bool(caps.get("fma3")),
        avx512f=bool(caps.get("avx512_f")),
        avx512bw=bool(caps.get("avx512_bw")),
        avx512vl=bool(caps.get("avx512_vl")),
        avx512dq=bool(caps.get("avx512_dq")),
        avx512_vnni=bool(caps.get("avx512_vnni")),
        avx512_bf16=bool(caps.get("avx512_bf16")),
        avx_ne_convert=bool(caps.get("avx_ne_convert")),
        amx_bf16=bool(caps.get("amx_bf16")),
        neon=str(arch) in ("aarch64", "arm64"),
    )
    cap = os.environ.get(CPU_FEATURES_ENV) if cap is None else cap
    return _cap(features, cap) if cap else features


def kernel_isa(features: CpuFeatures) -> int:
    """The ISA kvserve's C++ kernels run with (their ``isa`` argument): 2 AVX-512 (F, BW, VL,
    DQ), 1 AVX2 + FMA, 0 portable scalar. Follows a KVSERVE_CPU_FEATURES cap."""
    if features.avx512:
        return 2
    if features.avx2 and features.fma:
        return 1
    return 0


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def auto_dtype(device: torch.device | str, features: CpuFeatures) -> torch.dtype:
    """``--dtype auto``: bfloat16 on CUDA and on CPUs with native bfloat16, float32 elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and features.native_bf16:
        return torch.bfloat16
    return torch.float32


def measure_memory_bandwidth(budget_s: float = 1.0, nbytes: int = 512 << 20) -> float:
    """GB/s of a streaming read (sum of a float32 tensor far larger than the caches): the
    ceiling a decode step, which reads every weight once, is measured against."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()  # first touch
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    while True:
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() > deadline:
            break
    return x.nbytes / best / 1e9
