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

}  // namespace kvserve_attn
