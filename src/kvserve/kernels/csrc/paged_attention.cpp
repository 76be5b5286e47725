// kvserve::paged_decode_attention: decode attention (one query token per request) that reads
// K/V where they lie in the paged cache, instead of gathering each request's context into a
// new tensor first (what the grouped-SDPA path of paged_attention.py does, every layer, every
// step).
//
//   key_cache (num_blocks, block_size, num_kv_heads, head_dim), contiguous:
//   token t of request b is row  key_cache[block_tables[b][t / block_size], t % block_size]
//
// One task = (request b, kv head h): the G = num_heads / num_kv_heads query heads of that
// group (HF repeat_kv order: query head h * G + g uses kv head h) are handled together, so
// each K/V row is read once per group. Two passes per task: scores (G, n) into a small
// buffer (n = seq_len; 4k tokens x G = tens of KB), softmax in place, then the
// probability-weighted sum of V rows. Accumulation is float32 whatever the cache dtype.
//
// ISA paths (scalar, AVX2+FMA, AVX-512 F/BW/VL/DQ) live in one TU compiled with plain -O3:
// the vector ones are __attribute__((target)) functions chosen at run time, so the library
// runs on any x86-64. bf16 -> f32 is a 16-bit shift; f16 uses F16C / AVX-512F conversions.
// A bfloat16 cache with head_dim 64 / 128 / 256 on the AVX-512 path runs each task through
// attend_task_bf16 instead (K/V words split into even/odd float32 lanes without shuffles, the
// scores of 16 rows reduced by one transpose-add tree): measured on a 2-core Sapphire Rapids
// guest, benchmarks/paged_attention.py, 2 threads, B 8 x 128..2048 tokens (in L3) 1.6-1.8x
// faster; B 48 x 400 (from DRAM, offline-64's decode) 1.1-1.25x, 3 alternating runs with the
// old path behind a temporary switch (not kept).
#include "cpu_isa.h"
#include "paged_attention.h"
#include "vec_exp.h"
#include "vec_reduce.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using c10::BFloat16;
using c10::Half;

using kvserve_isa::kAvx2;
using kvserve_isa::kAvx512;
using kvserve_isa::kScalar;

using kvserve_isa::best_isa;

// The three per-ISA primitives. A "block" is up to block_size consecutive rows of one kv head,
// `stride` elements apart (num_kv_heads * head_dim). Scores s are (G, n) with row stride ss.
template <typename T>
struct Kernels {
  // s[g * ss + r] = q[g] . k[r]  (q already scaled), r < rows
  void (*qk)(const float* q, int64_t G, int64_t D, const T* k, int64_t stride, int64_t rows,
             float* s, int64_t ss);
  // acc[g * D + d] += sum_r p[g * ps + r] * v[r][d]
  void (*pv)(const float* p, int64_t ps, int64_t G, int64_t D, const T* v, int64_t stride,
             int64_t rows, float* acc);
  // s[0..n) <- exp(s - max s); returns the sum
  float (*softmax)(float* s, int64_t n);
};

// ---- scalar: the portable reference path --------------------------------------------------
inline float to_f32(float x) { return x; }
inline float to_f32(Half x) { return static_cast<float>(x); }
inline float to_f32(BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;  // bf16 is the top half of an f32
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
void qk_scalar(const float* q, int64_t G, int64_t D, const T* k, int64_t stride, int64_t rows,
               float* s, int64_t ss) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += q[g * D + d] * to_f32(k[r * stride + d]);
      s[g * ss + r] = acc;
    }
}

template <typename T>
void pv_scalar(const float* p, int64_t ps, int64_t G, int64_t D, const T* v, int64_t stride,
               int64_t rows, float* acc) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p[g * ps + r] * to_f32(v[r * stride + d]);
}

float softmax_scalar(float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity(), sum = 0.f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
  for (int64_t i = 0; i < n; ++i) sum += (s[i] = std::exp(s[i] - m));
  return sum;
}

#if defined(__x86_64__)
using kvserve_vec::exp256;
using kvserve_vec::exp512;
#define KV_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KV_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

// ---- AVX-512: 16 floats per vector; tails by masked loads -------------------------------
KV_AVX512 inline __m512 ld512(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
KV_AVX512 inline __m512 ld512(const BFloat16* p, __mmask16 m) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
KV_AVX512 inline __m512 ld512(const Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
KV_AVX512 inline __mmask16 mask16(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}
// head_dim = 16 * ND (64, 128: most models): each K row is loaded and converted once for
// all G query heads (the generic loop converts it G times), the queries stay in registers.
template <typename T, int ND>
KV_AVX512 void qk_avx512_nd(const float* q, int64_t G, const T* k, int64_t stride,
                            int64_t rows, float* s, int64_t ss) {
  constexpr int64_t D = 16 * ND;
  for (int64_t g0 = 0; g0 < G; g0 += 4) {  // 4 heads of queries in registers at a time
    const int64_t gn = std::min<int64_t>(4, G - g0);
    __m512 qv[4][ND];
    for (int64_t g = 0; g < gn; ++g)
      for (int c = 0; c < ND; ++c) qv[g][c] = _mm512_loadu_ps(q + (g0 + g) * D + 16 * c);
    const T* kr = k;
    for (int64_t r = 0; r < rows; ++r, kr += stride) {
      __m512 kv[ND];
      for (int c = 0; c < ND; ++c) kv[c] = ld512(kr + 16 * c, 0xFFFF);
      for (int64_t g = 0; g < gn; ++g) {
        __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int c = 1; c < ND; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
        s[(g0 + g) * ss + r] = _mm512_reduce_add_ps(acc);
      }
    }
  }
}

// acc (G, 16 ND) += p (G, rows) V (rows, 16 ND): each V row loaded and converted once for all G
// heads; the accumulators of 4 heads stay in registers across the block's rows.
template <typename T, int ND>
KV_AVX512 void pv_avx512_nd(const float* p, int64_t ps, int64_t G, const T* v, int64_t stride,
                            int64_t rows, float* acc) {
  constexpr int64_t D = 16 * ND;
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t gn = std::min<int64_t>(4, G - g0);
    __m512 a[4][ND];
    for (int64_t g = 0; g < gn; ++g)
      for (int c = 0; c < ND; ++c) a[g][c] = _mm512_loadu_ps(acc + (g0 + g) * D + 16 * c);
    const T* vr = v;
    for (int64_t r = 0; r < rows; ++r, vr += stride) {
      __m512 vv[ND];
      for (int c = 0; c < ND; ++c) vv[c] = ld512(vr + 16 * c, 0xFFFF);
      for (int64_t g = 0; g < gn; ++g) {
        const __m512 w = _mm512_set1_ps(p[(g0 + g) * ps + r]);
        for (int c = 0; c < ND; ++c) a[g][c] = _mm512_fmadd_ps(w, vv[c], a[g][c]);
      }
    }
    for (int64_t g = 0; g < gn; ++g)
      for (int c = 0; c < ND; ++c) _mm512_storeu_ps(acc + (g0 + g) * D + 16 * c, a[g][c]);
  }
}

template <typename T>
KV_AVX512 void qk_avx512(const float* q, int64_t G, int64_t D, const T* k, int64_t stride,
                         int64_t rows, float* s, int64_t ss) {
  if (D == 64) return qk_avx512_nd<T, 4>(q, G, k, stride, rows, s, ss);
  if (D == 128) return qk_avx512_nd<T, 8>(q, G, k, stride, rows, s, ss);
  for (int64_t r = 0; r < rows; ++r, k += stride)
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        __mmask16 m = mask16(D - d);
        acc = _mm512_fmadd_ps(ld512(q + g * D + d, m), ld512(k + d, m), acc);
      }
      s[g * ss + r] = _mm512_reduce_add_ps(acc);
    }
}

template <typename T>
KV_AVX512 void pv_avx512(const float* p, int64_t ps, int64_t G, int64_t D, const T* v,
                         int64_t stride, int64_t rows, float* acc) {
  if (D == 64) return pv_avx512_nd<T, 4>(p, ps, G, v, stride, rows, acc);
  if (D == 128) return pv_avx512_nd<T, 8>(p, ps, G, v, stride, rows, acc);
  // d outer, rows inner: each accumulator stays in a register across the block's rows
  for (int64_t d = 0; d < D; d += 16) {
    __mmask16 m = mask16(D - d);
    for (int64_t g = 0; g < G; ++g) {
      __m512 a = ld512(acc + g * D + d, m);
      for (int64_t r = 0; r < rows; ++r)
        a = _mm512_fmadd_ps(_mm512_set1_ps(p[g * ps + r]), ld512(v + r * stride + d, m), a);
      _mm512_mask_storeu_ps(acc + g * D + d, m, a);
    }
  }
}

KV_AVX512 float softmax_avx512(float* s, int64_t n) {
  __m512 vm = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16)
    vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(vm, mask16(n - i), s + i));
  __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vm)), sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = mask16(n - i);
    __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), mx));
    _mm512_mask_storeu_ps(s + i, m, e);
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// ---- AVX2: 8 floats per vector; a scalar tail when D % 8 != 0 ---------------------------
KV_AVX2 inline __m256 ld256(const float* p) { return _mm256_loadu_ps(p); }
KV_AVX2 inline __m256 ld256(const BFloat16* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
KV_AVX2 inline __m256 ld256(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
KV_AVX2 inline float hsum256(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
// Four key rows at a time: each query vector load serves 4 rows and the 4 FMA chains are
// independent (one row at a time made every score a chain of D/8 dependent FMAs plus its own
// horizontal sum: at 64-row decode on a Zen 3 this pass took twice pv's time); the 4 sums are
// reduced together by one hadd tree.
template <typename T>
KV_AVX2 void qk_avx2(const float* q, int64_t G, int64_t D, const T* k, int64_t stride,
                     int64_t rows, float* s, int64_t ss) {
  const int64_t dv = D - D % 8;
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    const T *k0 = k + r * stride, *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < dv; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + d);
        a0 = _mm256_fmadd_ps(qv, ld256(k0 + d), a0);
        a1 = _mm256_fmadd_ps(qv, ld256(k1 + d), a1);
        a2 = _mm256_fmadd_ps(qv, ld256(k2 + d), a2);
        a3 = _mm256_fmadd_ps(qv, ld256(k3 + d), a3);
      }
      // hadd(a0, a1), hadd(a2, a3), hadd of those: per 128-bit half [a0, a1, a2, a3] partials
      const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
      alignas(16) float out4[4];
      _mm_store_ps(out4, sum4);
      for (int64_t d = dv; d < D; ++d) {
        out4[0] += qg[d] * to_f32(k0[d]);
        out4[1] += qg[d] * to_f32(k1[d]);
        out4[2] += qg[d] * to_f32(k2[d]);
        out4[3] += qg[d] * to_f32(k3[d]);
      }
      std::memcpy(s + g * ss + r, out4, sizeof(out4));
    }
  }
  for (k += r * stride; r < rows; ++r, k += stride)
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < dv; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), ld256(k + d), acc);
      float t = hsum256(acc);
      for (int64_t d = dv; d < D; ++d) t += qg[d] * to_f32(k[d]);
      s[g * ss + r] = t;
    }
}

// D a multiple of 64: per query head and 64-value slice, 8 accumulators stay in registers
// across the block's rows (8 independent FMA chains per row); otherwise one vector at a
// time, the rows' FMAs a single chain.
template <typename T>
KV_AVX2 void pv_avx2(const float* p, int64_t ps, int64_t G, int64_t D, const T* v,
                     int64_t stride, int64_t rows, float* acc) {
  if (D % 64 == 0) {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        float* ag = acc + g * D + d0;
        __m256 a[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) a[j] = _mm256_loadu_ps(ag + 8 * j);
        for (int64_t r = 0; r < rows; ++r) {
          const __m256 pr = _mm256_set1_ps(p[g * ps + r]);
          const T* vr = v + r * stride + d0;
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(pr, ld256(vr + 8 * j), a[j]);
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(ag + 8 * j, a[j]);
      }
    return;
  }
  const int64_t dv = D - D % 8;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < dv; d += 8) {
      __m256 a = _mm256_loadu_ps(acc + g * D + d);
      for (int64_t r = 0; r < rows; ++r)
        a = _mm256_fmadd_ps(_mm256_set1_ps(p[g * ps + r]), ld256(v + r * stride + d), a);
      _mm256_storeu_ps(acc + g * D + d, a);
    }
    for (int64_t d = dv; d < D; ++d)
      for (int64_t r = 0; r < rows; ++r)
        acc[g * D + d] += p[g * ps + r] * to_f32(v[r * stride + d]);
  }
}

KV_AVX2 float softmax_avx2(float* s, int64_t n) {
  const int64_t nv = n - n % 8;
  float m = -std::numeric_limits<float>::infinity();
  __m256 vm = _mm256_set1_ps(m);
  for (int64_t i = 0; i < nv; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vm);
  for (float x : lanes) m = std::max(m, x);
  for (int64_t i = nv; i < n; ++i) m = std::max(m, s[i]);
  __m256 mx = _mm256_set1_ps(m), sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < nv; i += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), mx));
    _mm256_storeu_ps(s + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = hsum256(sum);
  for (int64_t i = nv; i < n; ++i) total += (s[i] = std::exp(s[i] - m));
  return total;
}
#endif  // __x86_64__

template <typename T>
Kernels<T> kernels_for(int64_t isa) {
#if defined(__x86_64__)
  if (isa == kAvx512) return {qk_avx512<T>, pv_avx512<T>, softmax_avx512};
  if (isa == kAvx2) return {qk_avx2<T>, pv_avx2<T>, softmax_avx2};
#endif
  return {qk_scalar<T>, pv_scalar<T>, softmax_scalar};
}

// The same primitives with the element type erased (paged_attention.h): captureless lambdas
// that cast the rows back to T.
template <typename T, auto QK, auto PV>
kvserve_attn::RowKernels erased(float (*softmax)(float*, int64_t)) {
  return {[](const float* q, int64_t G, int64_t D, const void* k, int64_t stride, int64_t rows,
             float* s, int64_t ss) { QK(q, G, D, static_cast<const T*>(k), stride, rows, s, ss); },
          [](const float* p, int64_t ps, int64_t G, int64_t D, const void* v, int64_t stride,
             int64_t rows, float* acc) {
            PV(p, ps, G, D, static_cast<const T*>(v), stride, rows, acc);
          },
          softmax};
}

template <typename T>
kvserve_attn::RowKernels row_kernels_for(int64_t isa) {
#if defined(__x86_64__)
  if (isa == kAvx512) return erased<T, qk_avx512<T>, pv_avx512<T>>(softmax_avx512);
  if (isa == kAvx2) return erased<T, qk_avx2<T>, pv_avx2<T>>(softmax_avx2);
#endif
  return erased<T, qk_scalar<T>, pv_scalar<T>>(softmax_scalar);
}

// Blocks sit anywhere in the pool and a kv head's rows are strided, so the hardware
// prefetcher loses the stream at every block: fetch the rows kAhead blocks ahead ourselves
// (measured from DRAM, one thread: float32 7.7 -> 11 GB/s, bfloat16 6 -> 10 GB/s; 2 and 4
// alike, 1 less). Into L2 (prefetcht1), not L1: a block's rows are 16 x 3 heads x 128 B per
// plane, and with 4 blocks in flight T0 fetches evict the rows being read. Zen 4, 2 threads,
// `benchmarks.paged_attention --batches 64 --contexts 1024 2048`, 2 alternating runs: T0
// 9.4-11.7 GB/s, T1 13.8-18.6 GB/s (float32 and bfloat16 alike); a 30-layer batch-48
// bfloat16 sweep from DRAM 8-10 -> 17-18 GB/s.
constexpr int64_t kAhead = 4;
template <typename T>
inline void prefetch_rows(const T* p, int64_t stride, int64_t rows, int64_t D) {
  for (int64_t r = 0; r < rows; ++r, p += stride)
    for (int64_t off = 0; off < D * int64_t(sizeof(T)); off += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(p) + off, 0, 2);
}

// The blocks of one pass over K (or V) of task (b, h): prefetch kAhead ahead, call f on each.
template <typename T, typename F>
inline void for_blocks(const T* cache, const int64_t* table, int64_t n, int64_t bs,
                       int64_t blk, int64_t row, int64_t D, F f) {
  const int64_t nb = (n + bs - 1) / bs;
  for (int64_t j = 0; j < std::min(kAhead, nb); ++j)
    prefetch_rows(cache + table[j] * blk, row, bs, D);
  for (int64_t j = 0; j < nb; ++j) {
    if (j + kAhead < nb) prefetch_rows(cache + table[j + kAhead] * blk, row, bs, D);
    f(cache + table[j] * blk, j * bs, std::min(bs, n - j * bs));  // rows, first token, count
  }
}

#if defined(__x86_64__)
// ---- AVX-512 over a bfloat16 cache, head_dim = 32 * NP (64, 128, 256): a whole task ------
// The generic AVX-512 path widens bf16 with a zero-extension per 16 values (a port-5
// shuffle) and reduces every score with _mm512_reduce_add_ps (~4 shuffles + 4 adds per row
// and query head): compute-bound below DRAM speed (B 64 x 128 tokens, in cache, ~10 GB/s on
// 2 threads of a Sapphire Rapids guest). Here:
//  - a K/V row is loaded as 32-bit words of two bf16 values each: word << 16 is the even
//    element as float32, word & 0xFFFF0000 the odd one (two ALU ops per 32 values); the
//    queries and the P.V accumulators are kept deinterleaved to match (evens, then odds);
//  - the partial vectors of up to 16 rows per query head go to a scratch tile and one
//    transpose-add tree (reduce16) turns them into 16 scores: ~3 ops per row and head.
// The products and the float32 accumulation are the generic path's; only the order of the
// sums differs.
KV_AVX512 inline void bf16_pairs(const BFloat16* p, __m512& even, __m512& odd) {
  const __m512i w = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// v: 16 vectors (rows) of 16 floats -> one vector whose lane r is the sum of row r
KV_AVX512 inline __m512 reduce16(const float* v) {
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_load_ps(v + 16 * i);
  return kvserve_vec::reduce16(a);
}

// Floats of scratch attend_task_bf16 needs per worker (beyond the (G, max_len) scores).
inline int64_t bf16_task_work(int64_t G, int64_t D) { return G * 256 + 2 * G * D + G; }

// One task (request b, kv head h): G query heads qg (G, D), f32, pre-scaled, over the n rows
// of head h (kc, vc: the cache at head h's column; table: the request's blocks) -> out
// (G, D). s: (G, n) scores; work: bf16_task_work(G, D) floats, 64-byte aligned.
// (Tasks of a whole request, every kv head per block, reading each block front to back,
// were tried: no faster from DRAM, B 48 x 400 tokens, 3 alternating runs.)
template <int NP>
KV_AVX512 void attend_task_bf16(const float* qg, int64_t G, const BFloat16* kc,
                                const BFloat16* vc, const int64_t* table, int64_t n, int64_t bs,
                                int64_t blk, int64_t row, float* s, float* work, float* out) {
  constexpr int64_t D = 32 * NP;
  constexpr int64_t GC = NP <= 2 ? 4 : 8 / NP;  // heads whose accumulators fit in registers
  float* part = work;          // (G, 16 rows, 16): partial dot products of one row group
  float* qd = part + G * 256;  // (G, NP, [evens 16 | odds 16]) queries
  float* acc = qd + G * D;     // (G, NP, [evens 16 | odds 16]) P.V accumulators
  float* inv = acc + G * D;    // (G,) 1 / softmax sums
  const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
  for (int64_t i = 0; i < G * NP; ++i) {
    const __m512 lo = _mm512_loadu_ps(qg + 32 * i), hi = _mm512_loadu_ps(qg + 32 * i + 16);
    _mm512_store_ps(qd + 32 * i, _mm512_permutex2var_ps(lo, ev, hi));
    _mm512_store_ps(qd + 32 * i + 16, _mm512_permutex2var_ps(lo, od, hi));
  }
  // (the blocks are walked here, not by for_blocks: a lambda would not inherit KV_AVX512)
  const int64_t nb = (n + bs - 1) / bs;
  // pass 1: s (G, n) = q . k
  for (int64_t j = 0; j < std::min(kAhead, nb); ++j) prefetch_rows(kc + table[j] * blk, row, bs, D);
  for (int64_t j = 0; j < nb; ++j) {
    if (j + kAhead < nb) prefetch_rows(kc + table[j + kAhead] * blk, row, bs, D);
    const BFloat16* k = kc + table[j] * blk;
    const int64_t first = j * bs, rows = std::min(bs, n - first);
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
      const int64_t rn = std::min<int64_t>(16, rows - r0);
      for (int64_t r = 0; r < 16; ++r) {
        if (r >= rn) {  // absent rows: zeros (their lanes are never stored)
          for (int64_t g = 0; g < G; ++g)
            _mm512_store_ps(part + (g * 16 + r) * 16, _mm512_setzero_ps());
          continue;
        }
        __m512 e[NP], o[NP];
        for (int c = 0; c < NP; ++c) bf16_pairs(k + (r0 + r) * row + 32 * c, e[c], o[c]);
        for (int64_t g = 0; g < G; ++g) {
          const float* qe = qd + g * D;
          __m512 a = _mm512_mul_ps(_mm512_load_ps(qe), e[0]);
          a = _mm512_fmadd_ps(_mm512_load_ps(qe + 16), o[0], a);
          for (int c = 1; c < NP; ++c) {
            a = _mm512_fmadd_ps(_mm512_load_ps(qe + 32 * c), e[c], a);
            a = _mm512_fmadd_ps(_mm512_load_ps(qe + 32 * c + 16), o[c], a);
          }
          _mm512_store_ps(part + (g * 16 + r) * 16, a);
        }
      }
      const __mmask16 m = mask16(rn);
      for (int64_t g = 0; g < G; ++g)
        _mm512_mask_storeu_ps(s + g * n + first + r0, m, reduce16(part + g * 256));
    }
  }
  for (int64_t g = 0; g < G; ++g) inv[g] = 1.f / softmax_avx512(s + g * n, n);
  // pass 2: acc (G, D) = p V, GC heads' accumulators in registers per pass over a block
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t j = 0; j < std::min(kAhead, nb); ++j) prefetch_rows(vc + table[j] * blk, row, bs, D);
  for (int64_t j = 0; j < nb; ++j) {
    if (j + kAhead < nb) prefetch_rows(vc + table[j + kAhead] * blk, row, bs, D);
    const BFloat16* v = vc + table[j] * blk;
    const int64_t first = j * bs, rows = std::min(bs, n - first);
    for (int64_t g0 = 0; g0 < G; g0 += GC) {
      const int64_t gn = std::min<int64_t>(GC, G - g0);
      __m512 a[GC][2 * NP];
      for (int64_t g = 0; g < gn; ++g)
        for (int c = 0; c < 2 * NP; ++c) a[g][c] = _mm512_load_ps(acc + (g0 + g) * D + 16 * c);
      for (int64_t r = 0; r < rows; ++r) {
        __m512 e[NP], o[NP];
        for (int c = 0; c < NP; ++c) bf16_pairs(v + r * row + 32 * c, e[c], o[c]);
        for (int64_t g = 0; g < gn; ++g) {
          const __m512 p = _mm512_set1_ps(s[(g0 + g) * n + first + r]);
          for (int c = 0; c < NP; ++c) {
            a[g][2 * c] = _mm512_fmadd_ps(p, e[c], a[g][2 * c]);
            a[g][2 * c + 1] = _mm512_fmadd_ps(p, o[c], a[g][2 * c + 1]);
          }
        }
      }
      for (int64_t g = 0; g < gn; ++g)
        for (int c = 0; c < 2 * NP; ++c) _mm512_store_ps(acc + (g0 + g) * D + 16 * c, a[g][c]);
    }
  }
  // interleave back: out[g][32c + 2i] = evens[i], out[g][32c + 2i + 1] = odds[i]
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  for (int64_t g = 0; g < G; ++g) {
    const __m512 w = _mm512_set1_ps(inv[g]);
    for (int c = 0; c < NP; ++c) {
      const __m512 e = _mm512_load_ps(acc + g * D + 32 * c);
      const __m512 o = _mm512_load_ps(acc + g * D + 32 * c + 16);
      _mm512_storeu_ps(out + g * D + 32 * c, _mm512_mul_ps(_mm512_permutex2var_ps(e, lo, o), w));
      _mm512_storeu_ps(out + g * D + 32 * c + 16,
                       _mm512_mul_ps(_mm512_permutex2var_ps(e, hi, o), w));
    }
  }
}

using Bf16TaskFn = void (*)(const float*, int64_t, const BFloat16*, const BFloat16*,
                            const int64_t*, int64_t, int64_t, int64_t, int64_t, float*, float*,
                            float*);

// The whole-task path for a bfloat16 cache at this head_dim and ISA, or nullptr (then the
// per-block kernels).
inline Bf16TaskFn bf16_task_for(int64_t isa, int64_t D) {
  if (isa != kAvx512) return nullptr;
  if (D == 64) return attend_task_bf16<2>;
  if (D == 128) return attend_task_bf16<4>;
  if (D == 256) return attend_task_bf16<8>;
  return nullptr;
}
#endif  // __x86_64__

// out (B, H, D) f32 <- attention of q (B, H, D) f32, pre-scaled, over each request's first
// seq_lens[b] cached tokens. Inputs already checked by the caller.
template <typename T>
void attend(const float* q, const T* kc, const T* vc, const int64_t* tables, int64_t width,
            const int64_t* lens, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t bs,
            int64_t max_len, Kernels<T> kn, int64_t isa, float* out) {
  const int64_t G = H / KVH, row = KVH * D, blk = bs * row;
#if defined(__x86_64__)
  Bf16TaskFn fast = nullptr;
  if constexpr (std::is_same_v<T, BFloat16>) fast = bf16_task_for(isa, D);
#else
  (void)isa;
#endif
  const int64_t tasks = B * KVH;
  int64_t rows_total = 0;
  for (int64_t b = 0; b < B; ++b) rows_total += lens[b] * KVH;
  // below ~512 K/V rows the threads cost more to wake than they save (benchmarks/
  // paged_attention.py, bf16, 2 threads, 3 alternating rounds on the AMX Xeon with the
  // threshold behind a temporary switch: B 1 x 128 tokens even; B 1 x 256 23-24 us on two
  // threads against 26-38 on one; B 4 x 1024 156-204 against 213-251; the threshold was
  // 8192 rows before the faster kernels). A task is
  // (b, kv head h): one head per task measured 1.4-1.6x faster from DRAM than whole requests
  // (each block read front to back). Tasks are b-major and the runner sorts decodes by length,
  // so worker w takes tasks w, w + W, ... (round robin), not a contiguous all-short or
  // all-long slice.
  const int64_t W = rows_total < 512 ? 1 : std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, W, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores(G * max_len), acc(G * D), inv(G);  // (G, n) and (G, D)
#if defined(__x86_64__)
    float* work = nullptr;  // the whole-task path's scratch
    if (fast != nullptr)
      work = static_cast<float*>(
          std::aligned_alloc(64, (bf16_task_work(G, D) * 4 + 63) / 64 * 64));
#endif
    for (int64_t w = w0; w < w1; ++w)
      for (int64_t t = w; t < tasks; t += W) {
        const int64_t b = t / KVH, h = t % KVH, n = lens[b], *table = tables + b * width;
        const float* qg = q + (b * H + h * G) * D;  // (G, D): this kv head's query heads
#if defined(__x86_64__)
        if (fast != nullptr) {
          if constexpr (std::is_same_v<T, BFloat16>)
            fast(qg, G, kc + h * D, vc + h * D, table, n, bs, blk, row, scores.data(), work,
                 out + (b * H + h * G) * D);
          continue;
        }
#endif
        for_blocks(kc + h * D, table, n, bs, blk, row, D, [&](const T* k, int64_t i, int64_t r) {
          kn.qk(qg, G, D, k, row, r, scores.data() + i, n);  // pass 1: scores (G, n)
        });
        for (int64_t g = 0; g < G; ++g) inv[g] = 1.f / kn.softmax(scores.data() + g * n, n);
        std::fill(acc.begin(), acc.end(), 0.f);
        for_blocks(vc + h * D, table, n, bs, blk, row, D, [&](const T* v, int64_t i, int64_t r) {
          kn.pv(scores.data() + i, n, G, D, v, row, r, acc.data());  // pass 2: acc = p V
        });
        float* o = out + (b * H + h * G) * D;
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < D; ++d) o[g * D + d] = acc[g * D + d] * inv[g];
      }
#if defined(__x86_64__)
    std::free(work);
#endif
  });
}

// Shapes and dtypes of the inputs; raises naming the value.
void check_shapes(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                  const at::Tensor& tables, const at::Tensor& lens) {
  TORCH_CHECK(q.dim() == 3, "q must be (B, num_heads, head_dim), got ", q.sizes());
  TORCH_CHECK(kc.dim() == 4,
              "key_cache must be (num_blocks, block_size, num_kv_heads, head_dim), got ",
              kc.sizes());
  TORCH_CHECK(vc.sizes() == kc.sizes(), "value_cache shape ", vc.sizes(),
              " must equal key_cache shape ", kc.sizes());
  TORCH_CHECK(vc.scalar_type() == kc.scalar_type(), "value_cache dtype ", vc.scalar_type(),
              " must equal key_cache dtype ", kc.scalar_type());
  const auto kt = kc.scalar_type();
  TORCH_CHECK(kt == at::kFloat || kt == at::kBFloat16 || kt == at::kHalf,
              "key_cache dtype must be float32, bfloat16 or float16, got ", kt);
  const auto qt = q.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16 || qt == at::kHalf,
              "q dtype must be float32, bfloat16 or float16, got ", qt);
  const int64_t B = q.size(0), H = q.size(1), KVH = kc.size(2);
  TORCH_CHECK(q.size(2) == kc.size(3), "q head_dim ", q.size(2), " must equal key_cache head_dim ",
              kc.size(3));
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "num_heads ", H,
              " must be a multiple of num_kv_heads ", KVH);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && tables.scalar_type() == at::kLong,
              "block_tables must be (B=", B, ", max_blocks) int64, got ", tables.sizes(), " ",
              tables.scalar_type());
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == B && lens.scalar_type() == at::kLong,
              "seq_lens must be (B=", B, ",) int64, got ", lens.sizes(), " ", lens.scalar_type());
}

at::Tensor paged_decode_attention_cpu(const at::Tensor& q, const at::Tensor& key_cache,
                                      const at::Tensor& value_cache, const at::Tensor& block_tables,
                                      const at::Tensor& seq_lens, double scale, int64_t isa) {
  check_shapes(q, key_cache, value_cache, block_tables, seq_lens);
  for (const at::Tensor* t : {&q, &key_cache, &value_cache, &block_tables, &seq_lens})
    TORCH_CHECK(t->device().is_cpu(), "paged_decode_attention runs on CPU; got a tensor on ",
                t->device());
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "key_cache and value_cache must be contiguous (views of the storage)");
  TORCH_CHECK(isa >= -1 && isa <= kAvx512, "isa must be -1 (best), 0 (scalar), 1 (avx2) or 2 "
              "(avx512), got ", isa);
  TORCH_CHECK(isa <= best_isa(), "isa ", isa, " is not supported by this CPU (best: ",
              best_isa(), ")");
  if (isa < 0) isa = best_isa();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t nblocks = key_cache.size(0), bs = key_cache.size(1), KVH = key_cache.size(2);
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t width = tables.size(1);
  const int64_t *tp = tables.data_ptr<int64_t>(), *lp = lens.data_ptr<int64_t>();
  const int64_t max_len = kvserve_attn::check_block_tables(tp, width, lp, B, bs, nblocks);
  auto qs = (q.to(at::kFloat) * scale).contiguous();  // (B, H, D) f32, scaled once
  auto out = at::empty({B, H, D}, q.options().dtype(at::kFloat));
  kvserve_attn::paged_attend_raw(qs.data_ptr<float>(), key_cache.const_data_ptr(),
                                 value_cache.const_data_ptr(), key_cache.scalar_type(), tp, width,
                                 lp, B, H, KVH, D, bs, max_len, isa, out.data_ptr<float>());
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

// Meta (torch.compile / FakeTensor): sym_sizes only, so traced batch sizes stay symbolic
// (reading an integer size would specialize the graph on it). Shapes are checked when it runs.
at::Tensor paged_decode_attention_meta(const at::Tensor& q, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache, const at::Tensor&,
                                       const at::Tensor&, double, int64_t) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4,
              "paged_decode_attention: q must be 3-D and key_cache / value_cache 4-D");
  return at::empty_symint(q.sym_sizes(), q.options());
}
}  // namespace

namespace kvserve_attn {
int64_t check_block_tables(const int64_t* tp, int64_t width, const int64_t* lp, int64_t B,
                           int64_t bs, int64_t nblocks) {
  // every block read must exist: a bad id would read outside the cache
  int64_t max_len = 1;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= width * bs, "seq_lens[", b, "] = ", lp[b],
                " must be in [1, ", width * bs, "] (block_tables width x block_size)");
    for (int64_t j = 0; j * bs < lp[b]; ++j)
      TORCH_CHECK(tp[b * width + j] >= 0 && tp[b * width + j] < nblocks, "block_tables[", b, ", ",
                  j, "] = ", tp[b * width + j], " is not a block id in [0, ", nblocks, ")");
    max_len = std::max(max_len, lp[b]);
  }
  return max_len;
}

RowKernels row_kernels(at::ScalarType dtype, int64_t isa) {
  switch (dtype) {
    case at::kFloat: return row_kernels_for<float>(isa);
    case at::kBFloat16: return row_kernels_for<BFloat16>(isa);
    case at::kHalf: return row_kernels_for<Half>(isa);
    default: TORCH_CHECK(false, "paged attention: row dtype must be float32, bfloat16 or "
                         "float16, got ", dtype);
  }
}

void paged_attend_raw(const float* q, const void* kc, const void* vc, at::ScalarType dtype,
                      const int64_t* tables, int64_t width, const int64_t* lens, int64_t B,
                      int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t max_len, int64_t isa,
                      float* out) {
  auto run = [&](auto tag) {  // tag: a null pointer of the cache's element type
    using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    attend<T>(q, static_cast<const T*>(kc), static_cast<const T*>(vc), tables, width, lens, B, H,
              KVH, D, bs, max_len, kernels_for<T>(isa), isa, out);
  };
  switch (dtype) {
    case at::kFloat: run(static_cast<const float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<const BFloat16*>(nullptr)); break;
    case at::kHalf: run(static_cast<const Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "paged attention: cache dtype must be float32, bfloat16 or "
                         "float16, got ", dtype);
  }
}
}  // namespace kvserve_attn

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, int isa=-1) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention_cpu);
}
TORCH_LIBRARY_IMPL(kvserve, Meta, m) {
  m.impl("paged_decode_attention", &paged_decode_attention_meta);
}
