// Rows of a quantized KV cache -> float32, per format and ISA (kv_dequant.cpp): what
// paged_attention_quant.cpp runs on each block before its float32 primitives. The formats are
// kvserve/kv/cache_dtype.py's (FORMAT_CODES), whose `dequantize` is the definition matched.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace kvserve_kvq {

enum Format : int64_t { kFloat = 0, kInt8 = 1, kInt4 = 2, kInt4Asym = 3, kFp8 = 4 };

// Values per scale along head_dim: 32, or the whole head when D % 32 != 0 (fp8: always D).
inline int64_t group_size(int64_t fmt, int64_t D) {
  return fmt == kFp8 || D % 32 ? D : 32;
}
inline int64_t num_groups(int64_t fmt, int64_t D) {
  return fmt == kFloat ? 0 : D / group_size(fmt, D);
}
// Code bytes of one (token, kv head) of a quantized format.
inline int64_t code_bytes(int64_t fmt, int64_t D) {
  return fmt == kInt4 || fmt == kInt4Asym ? D / 2 : D;
}

// out (rows, D) f32 <- rows of one kv head: row r's codes at codes + r * cs (bytes), its
// num_groups scales (and mins, int4 only; else unused) at scales + r * ss, mins + r * ss.
// Exactly cache_dtype.dequantize: one float32 rounding per value (x = d q; d (q - 8); fp8:
// d f; int4: (d q) + m, two roundings, no FMA).
using DequantFn = void (*)(const uint8_t* codes, int64_t cs, const c10::Half* scales,
                           const c10::Half* mins, int64_t ss, int64_t rows, int64_t D,
                           float* out);

// The routine for a quantized format (1..4), head_dim D (64 and 128 get unrolled ones) on a
// supported isa (0..2); checked by the caller.
DequantFn dequant_fn(int64_t fmt, int64_t D, int64_t isa);

// Raises (naming `p`format, `p`codes, `p`scales, `p`mins; p = "k_", "v_" or "") unless fmt is
// 0..4 and codes (..., code_bytes) / scales, mins (..., num_groups) are what format fmt stores
// for head_dim D: codes' dtype, contiguous CPU float16 scales with codes' leading shape, mins
// exactly for int4, neither for a float format.
void check_side(const char* p, int64_t fmt, const at::Tensor& codes,
                const std::optional<at::Tensor>& scales, const std::optional<at::Tensor>& mins,
                int64_t D);

// isa -1 (the best) .. 2, one this CPU runs; raises otherwise. Returns the path to run.
int64_t resolve_isa(int64_t isa);

}  // namespace kvserve_kvq
