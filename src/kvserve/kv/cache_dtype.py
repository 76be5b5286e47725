"""What one side of the cache (K or V) is stored as: a float dtype, or codes plus scales.

A ``CacheDtype`` is one of

    name        codes per value          scales (float16)               bytes per 32 values
    float32     float32                  -                              128
    bfloat16    bfloat16                 -                              64
    float16     float16                  -                              64
    int8        int8, x = d q            d per group of 32 along D      34   (llama.cpp q8_0)
    int4        4 bits, x = d q + m      d and m per group of 32        20   (q4_1)
    int4_sym    4 bits, x = d (q - 8)    d per group of 32              18   (q4_0)
    fp8_e4m3    float8 e4m3fn, x = d f   d per (token, kv head)         32 + 2 per head

int4 is asymmetric (a minimum per group) because measured on the default model it costs half
the perplexity of the symmetric form for 11% more bytes (``kvserve eval-cache``: +4.8% vs
+10.0%): keys have channels whose values sit far from zero, which a scale alone wastes levels
on. int4_sym is there for the extra tokens.

Groups run along the head dimension of one token and one KV head (a group is 32 values, or the
whole head when head_dim is not a multiple of 32), so a token's codes never depend on other
tokens: a block can be written once, copied, shared and saved like a float one. fp8 keeps one
scale per token and head (amax / 448) rather than vLLM's per-tensor scale, which would need a
calibration pass before the first write.

Layout of one side of one layer, for ``n`` slots (``n = num_blocks * block_size``) and ``H``
KV heads of ``D`` values:

    codes   (n, H, code_bytes)    int8 (int8), uint8 (int4 / int4_sym / fp8 bits), or the
                                  float dtype itself; code_bytes = D, D // 2 for 4 bits
    scales  (n, H, num_groups)    float16, absent for float dtypes
    mins    (n, H, num_groups)    float16, int4 only

Both int4 formats pack a group of G values into G / 2 bytes as llama.cpp does: byte j holds value j in its
low nibble and value j + G / 2 in its high nibble.

Rounding: scales are rounded to float16 first and the codes computed with the rounded scale,
so dequantize(quantize(x)) is the best the stored scale allows. ``quantize`` / ``dequantize``
here are the reference the C++ decode kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32  # values per scale group along the head dimension (llama.cpp's QK8_0 / QK4_0)
FP8_MAX = 448.0  # largest finite float8 e4m3fn

FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZED = ("int8", "int4", "int4_sym", "fp8_e4m3")
CACHE_DTYPE_NAMES = ("auto", *FLOAT_DTYPES, *QUANTIZED)
# the C++ kernel's format argument (kernels/csrc/paged_attention_quant.cpp)
FORMAT_CODES = {"float": 0, "int8": 1, "int4_sym": 2, "int4": 3, "fp8_e4m3": 4}


@dataclass(frozen=True, slots=True)
class CacheDtype:
    """The stored form of K or of V. ``name`` is a float dtype's name or one of QUANTIZED."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in FLOAT_DTYPES and self.name not in QUANTIZED:
            allowed = ", ".join(n for n in CACHE_DTYPE_NAMES if n != "auto")
            raise ValueError(f"cache dtype must be one of {allowed}, got {self.name!r}")

    @classmethod
    def parse(cls, name: str, model_dtype: torch.dtype) -> CacheDtype:
        """``auto`` is the model's activation dtype (the exact cache), as vLLM's default."""
        if name == "auto":
            return cls.of(model_dtype)
        return cls(name)

    @classmethod
    def of(cls, dtype: torch.dtype) -> CacheDtype:
        names = {v: k for k, v in FLOAT_DTYPES.items()}
        if dtype not in names:
            raise ValueError(
                f"a float cache dtype must be one of {list(FLOAT_DTYPES)}, got {dtype}"
            )
        return cls(names[dtype])

    @property
    def is_quantized(self) -> bool:
        return self.name in QUANTIZED

    @property
    def format_code(self) -> int:
        return FORMAT_CODES["float" if not self.is_quantized else self.name]

    @property
    def code_dtype(self) -> torch.dtype:
        if not self.is_quantized:
            return FLOAT_DTYPES[self.name]
        return torch.int8 if self.name == "int8" else torch.uint8

    def group_size(self, head_dim: int) -> int:
        if self.name == "fp8_e4m3" or head_dim % GROUP:
            return head_dim
        return GROUP

    def num_groups(self, head_dim: int) -> int:
        return head_dim // self.group_size(head_dim) if self.is_quantized else 0

    def code_bytes(self, head_dim: int) -> int:
        """Codes of one token and KV head, in elements of ``code_dtype``."""
        if self.name in ("int4_sym", "int4"):
            if head_dim % 2:
                raise ValueError(f"4-bit caches need an even head_dim, got {head_dim}")
            return head_dim // 2
        return head_dim

    def bytes_per_head(self, head_dim: int) -> int:
        """Bytes one token of one KV head occupies: codes, scales and mins, exactly."""
        code = self.code_bytes(head_dim) * self.code_dtype.itemsize
        scale_planes = 2 if self.name == "int4" else 1 if self.is_quantized else 0
        return code + scale_planes * self.num_groups(head_dim) * 2

    # ---- the reference quantizer -----------------------------------------------------------

    def quantize(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """x (..., D) float -> codes (..., code_bytes), scales and mins (..., num_groups) or None."""
        if not self.is_quantized:
            return x.to(self.code_dtype), None, None
        d_full = x.shape[-1]
        g = self.group_size(d_full)
        xg = x.float().reshape(*x.shape[:-1], d_full // g, g)  # (..., groups, G)
        if self.name == "int8":
            d = _f16_scale(xg.abs().amax(-1) / 127.0)
            q = torch.round(xg / d.float()[..., None]).clamp(-127, 127).to(torch.int8)
            return q.reshape(*x.shape[:-1], d_full), d, None
        if self.name == "fp8_e4m3":
            d = _f16_scale(xg.abs().amax(-1) / FP8_MAX)
            f = (xg / d.float()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            return f.view(torch.uint8).reshape(*x.shape[:-1], d_full), d, None
        if self.name == "int4_sym":
            # q4_0: the value of largest magnitude maps to -8, so its sign decides the scale's
            idx = xg.abs().argmax(-1, keepdim=True)
            d = _f16_scale(xg.gather(-1, idx)[..., 0] / -8.0)
            q = (torch.round(xg / d.float()[..., None]) + 8).clamp(0, 15).to(torch.uint8)
            return _pack4(q, x.shape, d_full), d, None
        lo, hi = xg.amin(-1), xg.amax(-1)  # int4, q4_1
        m = lo.to(torch.float16)
        d = _f16_scale((hi - m.float()) / 15.0)
        q = torch.round((xg - m.float()[..., None]) / d.float()[..., None]).clamp(0, 15)
        return _pack4(q.to(torch.uint8), x.shape, d_full), d, m

    def dequantize(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor | None,
        mins: torch.Tensor | None,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """The inverse of ``quantize``: (..., code_bytes) -> (..., head_dim) in ``dtype``."""
        if not self.is_quantized:
            return codes.to(dtype)
        g = self.group_size(head_dim)
        lead = codes.shape[:-1]
        d = scales.float()[..., None]  # (..., groups, 1)
        if self.name == "int8":
            x = codes.float().reshape(*lead, head_dim // g, g) * d
        elif self.name == "fp8_e4m3":
            f = codes.view(torch.float8_e4m3fn).float()
            x = f.reshape(*lead, head_dim // g, g) * d
        else:
            packed = codes.reshape(*lead, head_dim // g, g // 2)
            q = torch.cat([packed & 0xF, packed >> 4], -1).float()  # (..., groups, G)
            x = (q - 8) * d if self.name == "int4_sym" else q * d + mins.float()[..., None]
        return x.reshape(*lead, head_dim).to(dtype)


def _f16_scale(d: torch.Tensor) -> torch.Tensor:
    """A group's scale as stored (float16); an all-zero group gets 1 so its codes are 0."""
    d16 = d.to(torch.float16)
    return torch.where(d16 == 0, torch.ones_like(d16), d16)


def _pack4(q: torch.Tensor, shape: torch.Size, head_dim: int) -> torch.Tensor:
    """(..., groups, G) nibbles -> (..., head_dim // 2) bytes: low = j, high = j + G / 2."""
    half = q.shape[-1] // 2
    packed = q[..., :half] | (q[..., half:] << 4)
    return packed.reshape(*shape[:-1], head_dim // 2)
