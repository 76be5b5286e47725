// The 16 sums of 16 float32 vectors in one vector, by a transpose-add tree (~45 shuffles and
// adds, against ~8 each for 16 _mm512_reduce_add_ps). Shared by the hot loops that end in
// many horizontal sums: the scores of paged_attention.cpp (16 rows per query head) and the
// full 4 x 4 dot tiles of quant_bf16.cpp.
//
// hsum16 sums one vector in exactly reduce16's order for each of its vectors (per 128-bit
// lane L: S_L = (v[4L] + v[4L+2]) + (v[4L+1] + v[4L+3]); then (S_0 + S_2) + (S_1 + S_3)), so
// a sum does not depend on whether its vector went through reduce16 with 15 others, through
// hsum16 alone, or into which of reduce16's slots: the bf16 kernel's fixed order
// (quant_bf16.cpp) rests on it. _mm512_reduce_add_ps sums in another order.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

namespace kvserve_vec {

// a: 16 vectors -> one vector whose lane i is the sum of a[i]'s 16 lanes
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"))) inline __m512 reduce16(
    const __m512* a) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: vectors 2i, 2i+1 interleaved
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: vectors 4i .. 4i+3, in order
    const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // fold the four 128-bit lanes of each u: lane q of the result holds vectors 4q .. 4q+3
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44),
                                   _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44),
                                   _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88),
                       _mm512_shuffle_f32x4(x01, x23, 0xDD));
}

// the sum of v's 16 lanes, in reduce16's order (see the top of this file)
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"))) inline float hsum16(__m512 v) {
  const __m512 a = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E));  // lane 4L: v[4L] + v[4L+2]
  const __m512 b = _mm512_add_ps(a, _mm512_permute_ps(a, 0xB1));  // lane 4L: S_L
  const __m512 c = _mm512_add_ps(b, _mm512_shuffle_f32x4(b, b, 0x4E));  // S_0 + S_2, S_1 + S_3
  const __m512 d = _mm512_add_ps(c, _mm512_shuffle_f32x4(c, c, 0xB1));
  return _mm512_cvtss_f32(d);
}

}  // namespace kvserve_vec

#endif  // __x86_64__
