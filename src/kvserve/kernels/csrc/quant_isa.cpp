// Per-ISA halves of the quantized kernels (see quant_kernels.h): int8 codes -> float32 and the
// register-tiled dot products of activation rows with dequantized weight rows.
//
// The TU is compiled with plain -O3 (no -march), so it runs on any x86-64: the AVX2 and
// AVX-512 functions carry __attribute__((target)) and are picked at run time from
// __builtin_cpu_supports. Elsewhere only the scalar path is built.
//
// Tile: acc[u][m][r] holds lane-partial sums of x row m . w row r over the k-slice u (U-way
// unroll over k when the tile is small, so at least 8 FMA chains are in flight and M = 1 is
// not bound by FMA latency); each weight vector load is reused for MT rows, each activation
// vector load for kNR rows.
#include "quant_kernels.h"

#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvserve_quant {

namespace {

// ---- scalar (portable C++; GCC vectorizes the fixed-width lane loops) ----

// Portable dequantization: the format's decoder, one block at a time, then codes * scale (+ bias).
template <DecodeFn kDecode, bool kBias, int kElems, int kBytes>
void dequant_scalar(const uint8_t* src, int64_t nblocks, float* out) {
  int8_t q[kElems];
  float scale[kElems / kGroup], bias[kElems / kGroup];
  for (int64_t b = 0; b < nblocks; ++b, out += kElems) {
    kDecode(src + b * kBytes, 1, q, scale, bias);
    for (int g = 0; g < kElems / kGroup; ++g)
      for (int i = 0; i < kGroup; ++i) {
        float v = static_cast<float>(q[g * kGroup + i]) * scale[g];
        if (kBias) v += bias[g];
        out[g * kGroup + i] = v;
      }
  }
}

template <int MT>
void tile_scalar(const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t kc, float* out,
                 int64_t ldo, int nr, bool accumulate) {
  constexpr int L = 16;  // independent partial sums per (m, r): kc is a multiple of 32
  float acc[MT][kNR][L] = {};
  for (int64_t k = 0; k < kc; k += L) {
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < kNR; ++r)
        for (int l = 0; l < L; ++l) acc[m][r][l] += x[m * ldx + k + l] * w[r * ldw + k + l];
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < nr; ++r) {
      float s = 0.0f;
      for (int l = 0; l < L; ++l) s += acc[m][r][l];
      out[m * ldo + r] = accumulate ? out[m * ldo + r] + s : s;
    }
}

#if defined(__x86_64__)

// ---- AVX2 + FMA: 8 lanes, 16 ymm registers -> tiles of up to 2 x 4 ----

#define KV_AVX2 __attribute__((target("avx2,fma,f16c")))

KV_AVX2 inline float h2f_avx2(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

KV_AVX2 inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int MT>
KV_AVX2 void tile_avx2(const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t kc,
                       float* out, int64_t ldo, int nr, bool accumulate) {
  constexpr int U = MT == 1 ? 2 : 1;  // k unroll: >= 8 accumulators in flight
  constexpr int V = 8;
  __m256 acc[U][MT][kNR];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < kNR; ++r) acc[u][m][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; k += U * V) {
#pragma GCC unroll 2
    for (int u = 0; u < U; ++u) {
      __m256 wv[kNR];
      for (int r = 0; r < kNR; ++r) wv[r] = _mm256_loadu_ps(w + r * ldw + k + u * V);
      for (int m = 0; m < MT; ++m) {
        const __m256 xv = _mm256_loadu_ps(x + m * ldx + k + u * V);
        for (int r = 0; r < kNR; ++r) acc[u][m][r] = _mm256_fmadd_ps(xv, wv[r], acc[u][m][r]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < nr; ++r) {
      __m256 a = acc[0][m][r];
      for (int u = 1; u < U; ++u) a = _mm256_add_ps(a, acc[u][m][r]);
      const float s = hsum_avx2(a);
      out[m * ldo + r] = accumulate ? out[m * ldo + r] + s : s;
    }
}

// ---- AVX-512 (F, BW, VL, DQ): 16 lanes, 32 zmm registers -> tiles of up to 4 x 4 ----

#define KV_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

template <int MT>
KV_AVX512 void tile_avx512(const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t kc,
                           float* out, int64_t ldo, int nr, bool accumulate) {
  constexpr int U = MT == 1 ? 2 : 1;  // kc is a multiple of 32 = U * V
  constexpr int V = 16;
  __m512 acc[U][MT][kNR];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < kNR; ++r) acc[u][m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; k += U * V) {
#pragma GCC unroll 2
    for (int u = 0; u < U; ++u) {
      __m512 wv[kNR];
      for (int r = 0; r < kNR; ++r) wv[r] = _mm512_loadu_ps(w + r * ldw + k + u * V);
      for (int m = 0; m < MT; ++m) {
        const __m512 xv = _mm512_loadu_ps(x + m * ldx + k + u * V);
        for (int r = 0; r < kNR; ++r) acc[u][m][r] = _mm512_fmadd_ps(xv, wv[r], acc[u][m][r]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < nr; ++r) {
      __m512 a = acc[0][m][r];
      for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[u][m][r]);
      const float s = _mm512_reduce_add_ps(a);
      out[m * ldo + r] = accumulate ? out[m * ldo + r] + s : s;
    }
}

#endif  // __x86_64__

}  // namespace

#if defined(__x86_64__)
// The SIMD dequantizers, once per ISA (see quant_simd.h): namespace avx2 and avx512 each get
// their own copy compiled for their target, built on these primitives.
// (GCC: push_options / target pragmas; clang: attribute push.)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace avx2 {
inline float h2f(const uint8_t* p) { return h2f_avx2(p); }
inline __m256 cvt8(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }
inline void store16(float* out, __m128i q, float s) {
  const __m256 vs = _mm256_set1_ps(s);
  _mm256_storeu_ps(out, _mm256_mul_ps(cvt8(q), vs));
  _mm256_storeu_ps(out + 8, _mm256_mul_ps(cvt8(_mm_srli_si128(q, 8)), vs));
}
inline void store16b(float* out, __m128i q, float s, float b) {
  const __m256 vs = _mm256_set1_ps(s), vb = _mm256_set1_ps(b);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_mul_ps(cvt8(q), vs), vb));
  _mm256_storeu_ps(out + 8, _mm256_add_ps(_mm256_mul_ps(cvt8(_mm_srli_si128(q, 8)), vs), vb));
}
#include "quant_simd.h"

// ---- M = 1 in registers (AVX2): the 4-bit 32-value formats (the default model's Q4_1) ----
//
// Per block of 32 and row: the codes widened to 4 x 8 int32 lanes straight from the block's
// bytes (vpmovzx from memory), converted and scaled exactly as dequant_* above does, and
// FMA'd with x; x's 4 vectors of the block are loaded once for the kNR rows. Per 32 values
// and row this is ~22 vector ops where dequantize-into-L1 + dot tile took ~39 (and an L1 store
// and reload of every value): decode at batch 1 is bound by this arithmetic, not by memory,
// on the 2-core machines we run on.
inline __m256i widen8u(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// The block's 32 values of one row as 4 vectors (values 0-7, 8-15, 16-23, 24-31), each the
// float the format's dequantizer writes.
struct Q4_0Values {
  static constexpr int kBytes = 18;
  static void get(const uint8_t* p, __m256* v) {
    const __m256 d = _mm256_set1_ps(h2f(p));
    const __m256i m4 = _mm256_set1_epi32(0x0F), eight = _mm256_set1_epi32(8);
    const __m256i a = widen8u(p + 2), c = widen8u(p + 10);  // qs bytes 0-7, 8-15
    // value j < 16: low nibble of qs[j]; j + 16: its high nibble; d * (nibble - 8)
    v[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(a, m4), eight)), d);
    v[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(c, m4), eight)), d);
    v[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(a, 4), eight)), d);
    v[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(c, 4), eight)), d);
  }
};

struct Q4_1Values {
  static constexpr int kBytes = 20;
  static void get(const uint8_t* p, __m256* v) {
    const __m256 d = _mm256_set1_ps(h2f(p)), m = _mm256_set1_ps(h2f(p + 2));
    const __m256i m4 = _mm256_set1_epi32(0x0F);
    const __m256i a = widen8u(p + 4), c = widen8u(p + 12);
    // d * nibble + m (a multiply, then an add: the dequantizer's rounding, not an FMA's)
    v[0] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(a, m4)), d), m);
    v[1] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c, m4)), d), m);
    v[2] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), d), m);
    v[3] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)), d), m);
  }
};

// NR weight rows x MR activation rows (x rows K apart): out[m * ldo + r]. Batch 1 takes up to
// kNR weight rows (x's 4 vectors of a block loaded once for all of them); 2..4 activation rows
// take one weight row at a time (16 ymm registers: 2 accumulators per activation row and the 4
// decoded vectors, x read from L1 as FMA operands). Each block is decoded once for all MR
// rows, and per (activation row, weight row) the operations are the same whatever MR: every
// row of a few-rows product equals the batch-1 result for that row, bit for bit. Measured with
// this path on the AMX Xeon (best of 20, 2 threads) against the dot tiles that took 2-4 rows
// before: Q4_1 1536 x 576 at 2 rows 149 -> 99 us, at 4 rows 204 -> 122; the 49152 x 576 lm_head
// at 4 rows 6.6 -> 4.1 ms. Not measured on a Zen 3.
template <typename Fmt, int NR, int MR>
void gemv_rows(const uint8_t* w, int64_t row_bytes, const float* x, int64_t K, float* out,
               int64_t ldo) {
  __m256 acc[MR][NR][2];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r][0] = acc[m][r][1] = _mm256_setzero_ps();
  const int64_t nb = K / 32;
  for (int64_t b = 0; b < nb; ++b) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      __m256 v[4];
      Fmt::get(w + r * row_bytes + b * Fmt::kBytes, v);
      for (int m = 0; m < MR; ++m) {
        const float* xb = x + m * K + 32 * b;
        acc[m][r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xb), v[0], acc[m][r][0]);
        acc[m][r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), v[1], acc[m][r][1]);
        acc[m][r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), v[2], acc[m][r][0]);
        acc[m][r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), v[3], acc[m][r][1]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r)
      out[m * ldo + r] = hsum_avx2(_mm256_add_ps(acc[m][r][0], acc[m][r][1]));
}

template <typename Fmt>
void gemv(const uint8_t* w, int64_t row_bytes, int nr, const float* x, int64_t K, float* out) {
  switch (nr) {
    case 4: return gemv_rows<Fmt, 4, 1>(w, row_bytes, x, K, out, 0);
    case 3: return gemv_rows<Fmt, 3, 1>(w, row_bytes, x, K, out, 0);
    case 2: return gemv_rows<Fmt, 2, 1>(w, row_bytes, x, K, out, 0);
    default: return gemv_rows<Fmt, 1, 1>(w, row_bytes, x, K, out, 0);
  }
}

template <typename Fmt>
void gemv_m(const uint8_t* w, int64_t row_bytes, int nr, const float* x, int64_t M, int64_t K,
            float* out, int64_t ldo) {
  for (int r = 0; r < nr; ++r, w += row_bytes, ++out) {
    switch (M) {
      case 4: gemv_rows<Fmt, 1, 4>(w, row_bytes, x, K, out, ldo); break;
      case 3: gemv_rows<Fmt, 1, 3>(w, row_bytes, x, K, out, ldo); break;
      default: gemv_rows<Fmt, 1, 2>(w, row_bytes, x, K, out, ldo);
    }
  }
}

constexpr GemvMFn kGemvM[kNumFormats] = {gemv_m<Q4_0Values>, gemv_m<Q4_1Values>, nullptr, nullptr,
                                         nullptr, nullptr, nullptr};

// By Format::index (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K, Q5_K); the others take the dot
// tiles.
// Q8_0 too: the same scheme for it (pmovsx from memory, no nibbles) measured slower than
// dequantize-into-L1 + dot tile on the 49152 x 576 lm_head (7.8 vs 5.8 ms, Zen 3).
constexpr GemvFn kGemv[kNumFormats] = {gemv<Q4_0Values>, gemv<Q4_1Values>, nullptr, nullptr,
                                       nullptr, nullptr, nullptr};
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif
namespace avx512 {
inline float h2f(const uint8_t* p) { return h2f_avx2(p); }
inline __m512 cvt16(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }
inline void store16(float* out, __m128i q, float s) {
  _mm512_storeu_ps(out, _mm512_mul_ps(cvt16(q), _mm512_set1_ps(s)));
}
inline void store16b(float* out, __m128i q, float s, float b) {
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_mul_ps(cvt16(q), _mm512_set1_ps(s)), _mm512_set1_ps(b)));
}
#include "quant_simd.h"

// ---- M = 1..4 in registers (AVX-512): the 32-value formats ----
//
// As the AVX2 gemv above, on 16 lanes: a block's 16 code bytes widen to one vector of 16
// int32 (vpmovzxbd from memory); its low nibbles are values 0-15, its high ones 16-31, each
// converted and scaled as the dequantizer does. ~10 vector ops per 32 values and row, where
// dequantize-into-L1 + dot tile took ~2.5x that. Measured on a 2-core AMX Xeon against that
// path (best of 30, 2 threads): Q4_1 5.8 -> 7.8 GB/s (the default model's 3072 x 576), and
// Q8_0 (unlike on AVX2: see its kGemv) 9.0-9.5 -> 10.0-11.0 GB/s on the 49152 x 576 lm_head.
// The 4-bit formats then moved to a 16-entry table per block (quant_values16.h): same AMX
// Xeon, 1 thread, in cache, Q4_1 1536 x 576 103 -> 85 us, 576 x 1536 105 -> 83 us; the
// decode step's 211 matmuls from DRAM, 2 threads, 11.8 -> 10.1 ms (benchmarks/quant_matmul.py).
#include "quant_values16.h"

// NR weight rows x MR activation rows (x rows K apart): out[m * ldo + r]. Batch 1 takes up to
// kNR weight rows; 2..4 activation rows (a few decodes) two weight rows at a time, so the
// 2 x MR x 2 accumulators and the MR rows' 2 x vectors stay in registers. Each block is
// decoded once for all MR rows, and per (activation row, weight row) the operations are the
// same whatever MR: every row of a few-rows product equals the batch-1 result for that row,
// bit for bit, so a request's logits do not depend on how many others share its step while
// the step stays in this range. (Before, 2-4 rows took the dot tiles over a float32 copy of
// the weights in L1, stored and then reloaded per row tile.)
template <typename Fmt, int NR, int MR>
void gemv_rows(const uint8_t* w, int64_t row_bytes, const float* x, int64_t K, float* out,
               int64_t ldo) {
  __m512 acc[MR][NR][2];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r][0] = acc[m][r][1] = _mm512_setzero_ps();
  const int64_t nb = K / 32;
  for (int64_t b = 0; b < nb; ++b) {
    __m512 xv[MR][2];
    for (int m = 0; m < MR; ++m) {
      xv[m][0] = _mm512_loadu_ps(x + m * K + 32 * b);
      xv[m][1] = _mm512_loadu_ps(x + m * K + 32 * b + 16);
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      __m512 v[2];
      Fmt::get(w + r * row_bytes + b * Fmt::kBytes, v);
      for (int m = 0; m < MR; ++m) {
        acc[m][r][0] = _mm512_fmadd_ps(xv[m][0], v[0], acc[m][r][0]);
        acc[m][r][1] = _mm512_fmadd_ps(xv[m][1], v[1], acc[m][r][1]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r)
      out[m * ldo + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][r][0], acc[m][r][1]));
}

template <typename Fmt>
void gemv(const uint8_t* w, int64_t row_bytes, int nr, const float* x, int64_t K, float* out) {
  switch (nr) {
    case 4: return gemv_rows<Fmt, 4, 1>(w, row_bytes, x, K, out, 0);
    case 3: return gemv_rows<Fmt, 3, 1>(w, row_bytes, x, K, out, 0);
    case 2: return gemv_rows<Fmt, 2, 1>(w, row_bytes, x, K, out, 0);
    default: return gemv_rows<Fmt, 1, 1>(w, row_bytes, x, K, out, 0);
  }
}

template <typename Fmt, int MR>
void gemv_m_pairs(const uint8_t* w, int64_t row_bytes, int nr, const float* x, int64_t K,
                  float* out, int64_t ldo) {
  for (int r = 0; r < nr; r += 2) {
    if (nr - r >= 2)
      gemv_rows<Fmt, 2, MR>(w + r * row_bytes, row_bytes, x, K, out + r, ldo);
    else
      gemv_rows<Fmt, 1, MR>(w + r * row_bytes, row_bytes, x, K, out + r, ldo);
  }
}

template <typename Fmt>
void gemv_m(const uint8_t* w, int64_t row_bytes, int nr, const float* x, int64_t M, int64_t K,
            float* out, int64_t ldo) {
  switch (M) {
    case 4: return gemv_m_pairs<Fmt, 4>(w, row_bytes, nr, x, K, out, ldo);
    case 3: return gemv_m_pairs<Fmt, 3>(w, row_bytes, nr, x, K, out, ldo);
    default: return gemv_m_pairs<Fmt, 2>(w, row_bytes, nr, x, K, out, ldo);
  }
}

constexpr GemvMFn kGemvM[kNumFormats] = {gemv_m<Q4_0Values16>, gemv_m<Q4_1Values16>, nullptr,
                                         nullptr, gemv_m<Q8_0Values16>, nullptr, nullptr};

constexpr GemvFn kGemv[kNumFormats] = {gemv<Q4_0Values16>, gemv<Q4_1Values16>, nullptr,
                                       nullptr, gemv<Q8_0Values16>, nullptr, nullptr};
}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // __x86_64__

int64_t best_isa() { return kvserve_isa::best_isa(); }

const IsaKernels& isa_kernels(int64_t isa) {
  static const IsaKernels scalar{
      {dequant_scalar<decode_q4_0, false, 32, 18>, dequant_scalar<decode_q4_1, true, 32, 20>,
       dequant_scalar<decode_q5_0, false, 32, 22>, dequant_scalar<decode_q5_1, true, 32, 24>,
       dequant_scalar<decode_q8_0, false, 32, 34>, dequant_scalar<decode_q4_k, true, 256, 144>,
       dequant_scalar<decode_q6_k, false, 256, 210>, dequant_scalar<decode_q5_k, true, 256, 176>},
      1,
      {nullptr, tile_scalar<1>, nullptr, nullptr, nullptr},
      {},
      {}};
#if defined(__x86_64__)
  static const IsaKernels avx2{
      {avx2::kDequant[0], avx2::kDequant[1], avx2::kDequant[2], avx2::kDequant[3],
       avx2::kDequant[4], avx2::kDequant[5], avx2::kDequant[6], avx2::kDequant[7]},
      2,
      {nullptr, tile_avx2<1>, tile_avx2<2>, nullptr, nullptr},
      {avx2::kGemv[0], avx2::kGemv[1], avx2::kGemv[2], avx2::kGemv[3], avx2::kGemv[4],
       avx2::kGemv[5], avx2::kGemv[6], avx2::kGemv[7]},
      {avx2::kGemvM[0], avx2::kGemvM[1], avx2::kGemvM[2], avx2::kGemvM[3], avx2::kGemvM[4],
       avx2::kGemvM[5], avx2::kGemvM[6], avx2::kGemvM[7]}};
  static const IsaKernels avx512{
      {avx512::kDequant[0], avx512::kDequant[1], avx512::kDequant[2], avx512::kDequant[3],
       avx512::kDequant[4], avx512::kDequant[5], avx512::kDequant[6], avx512::kDequant[7]},
      4,
      {nullptr, tile_avx512<1>, tile_avx512<2>, tile_avx512<3>, tile_avx512<4>},
      {avx512::kGemv[0], avx512::kGemv[1], avx512::kGemv[2], avx512::kGemv[3],
       avx512::kGemv[4], avx512::kGemv[5], avx512::kGemv[6], avx512::kGemv[7]},
      {avx512::kGemvM[0], avx512::kGemvM[1], avx512::kGemvM[2], avx512::kGemvM[3],
       avx512::kGemvM[4], avx512::kGemvM[5], avx512::kGemvM[6], avx512::kGemvM[7]}};
  if (isa == kAvx512) return avx512;
  if (isa == kAvx2) return avx2;
#endif
  return scalar;
}

}  // namespace kvserve_quant
