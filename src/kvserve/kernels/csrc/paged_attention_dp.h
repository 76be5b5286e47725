// paged_attention_dp.cpp: paged attention over a bfloat16 cache in one order for decode rows
// and prefill chunks alike (scores and P . V by VDPBF16PS chains), for CPUs with
// AVX-512-BF16. Raw pointers, no checks: the caller (paged_attend_raw) has checked them.
#pragma once

#include <cstdint>

namespace kvserve_attn {

using BFloat16Bits = uint16_t;  // a bfloat16 value's bits, as the cache holds it

// True when this CPU has AVX-512 (F/BW/VL/DQ) and AVX-512-BF16, and the shape is one the
// kernel takes: head_dim 64 / 128 / 256, at most 16 query heads per kv head.
bool attend_dp_available(int64_t H, int64_t KVH, int64_t D);

// out (B, H, D) f32 <- attention of q (B, H, D) f32 (pre-scaled) over each row's first lens[b]
// tokens of the bfloat16 caches kc / vc (num_blocks, bs, KVH, D) through tables (B, width).
// Consecutive rows with the same table and lengths one apart (a prefill chunk: each row's K/V
// already written) are computed 16 at a time; the result is the same bits either way.
void attend_dp_raw(const float* q, const void* kc, const void* vc, const int64_t* tables,
                   int64_t width, const int64_t* lens, int64_t B, int64_t H, int64_t KVH,
                   int64_t D, int64_t bs, int64_t max_len, float* out);

}  // namespace kvserve_attn
