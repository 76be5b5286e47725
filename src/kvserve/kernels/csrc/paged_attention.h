// The decode attention of paged_attention.cpp for other kernels of the library (the fused
// decode step): raw pointers, no checks.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace kvserve_attn {

// Raises unless every lens[b] is in [1, width * bs] and every block id it reads is in
// [0, nblocks); returns max lens.
int64_t check_block_tables(const int64_t* tables, int64_t width, const int64_t* lens, int64_t B,
                           int64_t bs, int64_t nblocks);

// out (B, H, D) f32 <- attention of q (B, H, D) f32, already multiplied by the scale, over
// each request's first lens[b] tokens of the caches kc / vc (num_blocks, bs, KVH, D) of
// `dtype` (float32 / bfloat16 / float16), through tables (B, width). Checked by the caller:
// lens[b] in [1, width * bs], every block id read in range, max_len = max lens, isa supported
// (not -1).
void paged_attend_raw(const float* q, const void* kc, const void* vc, at::ScalarType dtype,
                      const int64_t* tables, int64_t width, const int64_t* lens, int64_t B,
                      int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t max_len, int64_t isa,
                      float* out);

// The per-ISA primitives of paged_attention.cpp over rows of one float dtype, for kernels that
// bring their own rows (paged_attention_quant.cpp). A block is `rows` rows of `dtype`,
// `stride` elements apart; s is (G, n) with row stride ss, acc (G, D), q (G, D) pre-scaled.
//   qk: s[g * ss + r] = q[g] . k[r];   pv: acc[g * D + d] += sum_r p[g * ps + r] v[r][d];
//   softmax: s[0..n) <- exp(s - max s), returns the sum.
struct RowKernels {
  void (*qk)(const float* q, int64_t G, int64_t D, const void* k, int64_t stride, int64_t rows,
             float* s, int64_t ss);
  void (*pv)(const float* p, int64_t ps, int64_t G, int64_t D, const void* v, int64_t stride,
             int64_t rows, float* acc);
  float (*softmax)(float* s, int64_t n);
};
// dtype float32 / bfloat16 / float16, isa supported (not -1): checked by the caller.
RowKernels row_kernels(at::ScalarType dtype, int64_t isa);

}  // namespace kvserve_attn
