// The 16 x 16 transpose of 32-bit elements shared by the kernels that lay out tiles: AMX C
// tiles into the output (quant_amx.cpp), keys' bf16 dim pairs into B tiles
// (prefill_attention.cpp), and weight rows' bf16 k pairs into the bf16 panel GEMM's panel
// (quant_bf16.cpp). Float32 lanes or pairs of bfloat16 alike: only the 32 bits move.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>

namespace kvserve_simd {

// out[j * ldo + i] = in[i * ldi + j] for i, j < 16; in, out 64-byte aligned, ldi and ldo
// multiples of 16 (elements)
__attribute__((target("avx512f"))) inline void transpose16(const float* in, int64_t ldi,
                                                           float* out, int64_t ldo) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(in + ldi * i);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  // r[4g + j] holds, in each 128-bit lane L, column 4L + j of rows 4g..4g+3; combine lanes
  for (int i = 0; i < 4; ++i) {
    const __m512 a = r[i], b = r[4 + i], c = r[8 + i], d = r[12 + i];
    const __m512 ab_lo = _mm512_shuffle_f32x4(a, b, 0x88), ab_hi = _mm512_shuffle_f32x4(a, b, 0xDD);
    const __m512 cd_lo = _mm512_shuffle_f32x4(c, d, 0x88), cd_hi = _mm512_shuffle_f32x4(c, d, 0xDD);
    t[i] = _mm512_shuffle_f32x4(ab_lo, cd_lo, 0x88);
    t[8 + i] = _mm512_shuffle_f32x4(ab_lo, cd_lo, 0xDD);
    t[4 + i] = _mm512_shuffle_f32x4(ab_hi, cd_hi, 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(ab_hi, cd_hi, 0xDD);
  }
  for (int i = 0; i < 16; ++i) _mm512_store_ps(out + ldo * i, t[i]);
}

}  // namespace kvserve_simd
#endif
