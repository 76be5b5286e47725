// exp(x) over SIMD vectors (Cephes expf, ~1 ulp), shared by the kernels that need it in a
// hot loop: the softmax of paged_attention.cpp and the SiLU of silu_mul.cpp.
//   n = round(x log2 e), r = x - n ln 2 (in two parts), e^r by a degree-6 polynomial, * 2^n.
// x is clamped to [-87.3, 88]: below, 2^n stays a normal float (the lost tail is < 1e-38);
// above, e^x would overflow the exponent field of exp256's 2^n (e^88 = 1.65e38 is finite).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#define KV_EXP_POLY(V, SET1, FMA, MUL, ADD, MAX, MIN, ROUND)                      \
  x = MIN(MAX(x, SET1(-87.3f)), SET1(88.f));                                      \
  V n = ROUND(MUL(x, SET1(1.44269504f)));                                         \
  V r = FMA(n, SET1(2.12194440e-4f), FMA(n, SET1(-0.693359375f), x));            \
  V y = SET1(1.9875691500e-4f);                                                   \
  y = FMA(y, r, SET1(1.3981999507e-3f));                                          \
  y = FMA(y, r, SET1(8.3334519073e-3f));                                          \
  y = FMA(y, r, SET1(4.1665795894e-2f));                                          \
  y = FMA(y, r, SET1(1.6666665459e-1f));                                          \
  y = FMA(y, r, SET1(5.0000001201e-1f));                                          \
  y = FMA(y, MUL(r, r), ADD(r, SET1(1.f)));

namespace kvserve_vec {

#define KV_ROUND512(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"))) inline __m512 exp512(
    __m512 x) {
  KV_EXP_POLY(__m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_mul_ps, _mm512_add_ps,
              _mm512_max_ps, _mm512_min_ps, KV_ROUND512)
  return _mm512_scalef_ps(y, n);  // y * 2^n
}

#define KV_ROUND256(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
__attribute__((target("avx2,fma,f16c"))) inline __m256 exp256(__m256 x) {
  KV_EXP_POLY(__m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_mul_ps, _mm256_add_ps,
              _mm256_max_ps, _mm256_min_ps, KV_ROUND256)
  // y * 2^n: n + 127 into the exponent bits (n in [-126, 127] after the clamp: still normal)
  __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

}  // namespace kvserve_vec
#endif  // __x86_64__
