// The many-rows path of kvserve::quant_matmul on AVX-512 and on AVX2: an outer-product GEMM
// over panels of dequantized weights (prefill chunks, big batches).
//
// The dot-product tiles of quant_matmul.cpp read an activation vector and a weight vector per
// FMA pair and reduce every output horizontally; at a few hundred rows they reach ~65% of
// what oneDNN's packed GEMM does (AVX-512), and on AVX2, where their tiles hold only 2
// activation rows, far less. Here, as in a BLAS micro-kernel:
//
//   AVX-512  panel wT (kc, 64): 64 weight rows x kc values, dequantized (the same decoders)
//            and transposed so one k holds 64 outputs in 4 vectors; tile acc (6, 64): per k,
//            4 vector loads of wT, 6 broadcasts of x, 24 FMAs; no horizontal sums
//   AVX2     panel (4, kc, 16): the same 64 rows as 4 column groups of 16, each group's
//            (kc, 16) slice contiguous; tile acc (6, 16) = 12 ymm per group: per k, 2 vector
//            loads, 6 broadcasts, 12 FMAs (16 ymm registers hold no more)
//
// Each output is still sum_k x[m, k] w[n, k] in float32 (sequential in k within a panel
// chunk, chunks added in order): it differs from dequantize-then-matmul only in summation
// order, as the other tiles do.
#include <cstring>

#include "quant_kernels.h"
#include "quant_panel.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvserve_quant {

namespace {

#if defined(__x86_64__)
#define KV_GEMM __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

// out[m, n0 + j] (= or +=) sum_{k < kc} x[m, k] * wT[k, j] for m < MB, j < 64 (masked to
// nvalid columns on store).
template <int MB>
KV_GEMM void gemm_tile(const float* wT, const float* x, int64_t ldx, int64_t kc, float* out,
                       int64_t ldo, const uint16_t* masks, bool accumulate) {
  __m512 acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const float* wk = wT + k * kPanel;
    const __m512 w0 = _mm512_load_ps(wk), w1 = _mm512_load_ps(wk + 16),
                 w2 = _mm512_load_ps(wk + 32), w3 = _mm512_load_ps(wk + 48);
    for (int i = 0; i < MB; ++i) {
      const __m512 xb = _mm512_set1_ps(x[i * ldx + k]);
      acc[i][0] = _mm512_fmadd_ps(xb, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xb, w1, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(xb, w2, acc[i][2]);
      acc[i][3] = _mm512_fmadd_ps(xb, w3, acc[i][3]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) {
      float* o = out + i * ldo + 16 * j;
      __m512 v = acc[i][j];
      if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(masks[j], o), v);
      _mm512_mask_storeu_ps(o, masks[j], v);
    }
}

using GemmTile = void (*)(const float*, const float*, int64_t, int64_t, float*, int64_t,
                          const uint16_t*, bool);
constexpr GemmTile kGemmTiles[kMB + 1] = {nullptr,        gemm_tile<1>, gemm_tile<2>, gemm_tile<3>,
                                          gemm_tile<4>,   gemm_tile<5>, gemm_tile<6>};

// (rows, kc) row-major -> (kc, 64) (rows < 64: the other columns are zero)
KV_GEMM void transpose_panel(const float* src, int64_t kc, int rows, float* dst) {
  if (rows < kPanel) std::memset(dst, 0, kc * kPanel * sizeof(float));
  for (int r = 0; r < rows; ++r)
    for (int64_t k = 0; k < kc; ++k) dst[k * kPanel + r] = src[r * kc + k];
}

// ---- AVX2 + FMA ----
#define KV_GEMM2 __attribute__((target("avx2,fma")))

constexpr int kGroupCols = 16;                     // outputs per AVX2 column group (2 ymm)
constexpr int kGroups = kPanel / kGroupCols;       // column groups per panel

// One column group: out[m, j] (= or +=) sum_{k < kc} x[m, k] * wg[k, j], m < MB, j < valid.
template <int MB>
KV_GEMM2 void gemm_group_avx2(const float* wg, const float* x, int64_t ldx, int64_t kc,
                              float* out, int64_t ldo, int valid, bool accumulate) {
  __m256 acc[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_load_ps(wg + k * kGroupCols);
    const __m256 w1 = _mm256_load_ps(wg + k * kGroupCols + 8);
    for (int i = 0; i < MB; ++i) {
      const __m256 xb = _mm256_broadcast_ss(x + i * ldx + k);
      acc[i][0] = _mm256_fmadd_ps(xb, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xb, w1, acc[i][1]);
    }
  }
  // The accumulators leave registers once, here, through constant indices: an epilogue that
  // indexes acc at run time made GCC keep acc in memory and store it on every k (2.5x slower).
  alignas(32) float res[MB][kGroupCols];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) {
    _mm256_store_ps(res[i], acc[i][0]);
    _mm256_store_ps(res[i] + 8, acc[i][1]);
  }
  for (int i = 0; i < MB; ++i) {
    float* o = out + i * ldo;
    if (valid == kGroupCols) {
      __m256 v0 = _mm256_load_ps(res[i]), v1 = _mm256_load_ps(res[i] + 8);
      if (accumulate) {
        v0 = _mm256_add_ps(_mm256_loadu_ps(o), v0);
        v1 = _mm256_add_ps(_mm256_loadu_ps(o + 8), v1);
      }
      _mm256_storeu_ps(o, v0);
      _mm256_storeu_ps(o + 8, v1);
    } else {  // the last panel's partial group: only `valid` columns exist in out
      for (int j = 0; j < valid; ++j) o[j] = accumulate ? o[j] + res[i][j] : res[i][j];
    }
  }
}

using GroupTile = void (*)(const float*, const float*, int64_t, int64_t, float*, int64_t, int,
                           bool);
constexpr GroupTile kGroupTiles[kMB + 1] = {
    nullptr,           gemm_group_avx2<1>, gemm_group_avx2<2>, gemm_group_avx2<3>,
    gemm_group_avx2<4>, gemm_group_avx2<5>, gemm_group_avx2<6>};

// In place: v[i][j] -> v[j][i] for an 8 x 8 block of floats, one row per register.
KV_GEMM2 inline void transpose8(__m256* v) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);      // a0 b0 a1 b1 | a4 b4 a5 b5
    t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);  // a2 b2 a3 b3 | a6 b6 a7 b7
  }
  for (int i = 0; i < 8; i += 4)
    for (int h = 0; h < 2; ++h) {
      u[i + h] = _mm256_shuffle_ps(t[i + h], t[i + 2 + h], 0x44);      // a0 b0 c0 d0 | a4..d4
      u[i + 2 + h] = _mm256_shuffle_ps(t[i + h], t[i + 2 + h], 0xEE);  // a1 b1 c1 d1 | a5..d5
    }
  // u[0] = col 0|4 (rows 0-3), u[2] = col 1|5, u[1] = col 2|6, u[3] = col 3|7; u[4..7] rows 4-7
  const int col[4] = {0, 2, 1, 3};
  for (int c = 0; c < 4; ++c) {
    v[c] = _mm256_permute2f128_ps(u[col[c]], u[4 + col[c]], 0x20);
    v[c + 4] = _mm256_permute2f128_ps(u[col[c]], u[4 + col[c]], 0x31);
  }
}

// (rows, kc) row-major -> (kGroups, kc, 16): row r lands in group r / 16, column r % 16
// (rows < 64: the other columns are zero). 8 x 8 register transposes for whole runs of 8
// rows (kc is a multiple of 32): done per element it cost a quarter of a 64-row GEMM.
KV_GEMM2 void group_panel(const float* src, int64_t kc, int rows, float* dst) {
  if (rows < kPanel) std::memset(dst, 0, kc * kPanel * sizeof(float));
  const int full = rows - rows % 8;
  for (int r0 = 0; r0 < full; r0 += 8) {
    float* d = dst + (r0 / kGroupCols) * kc * kGroupCols + r0 % kGroupCols;
    for (int64_t k0 = 0; k0 < kc; k0 += 8) {
      __m256 v[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(src + (r0 + i) * kc + k0);
      transpose8(v);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(d + (k0 + j) * kGroupCols, v[j]);
    }
  }
  for (int r = full; r < rows; ++r) {
    float* d = dst + (r / kGroupCols) * kc * kGroupCols + r % kGroupCols;
    for (int64_t k = 0; k < kc; ++k) d[k * kGroupCols] = src[r * kc + k];
  }
}

void gemm_tile_avx2(int mb, const float* panel, const float* x, int64_t ldx, int64_t kc,
                    float* out, int64_t ldo, const uint16_t* masks, bool accumulate) {
  for (int g = 0; g < kGroups && masks[g]; ++g)
    kGroupTiles[mb](panel + g * kc * kGroupCols, x, ldx, kc, out + g * kGroupCols, ldo,
                    __builtin_popcount(masks[g]), accumulate);
}
#endif  // __x86_64__

}  // namespace

bool quant_gemm(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t qtype,
               int64_t N, int64_t isa, float* op) {
#if defined(__x86_64__)
  if (isa == kAvx512 && best_isa() >= kAvx512) {
    panel_gemm<float>(
        xp, M, K, wp, *find_format(qtype), isa_kernels(kAvx512), N, op, transpose_panel,
        [](int mb, const float* panel, const float* x, int64_t ldx, int64_t kc, float* out,
           int64_t ldo, const uint16_t* masks, bool accumulate) {
          kGemmTiles[mb](panel, x, ldx, kc, out, ldo, masks, accumulate);
        });
    return true;
  }
  if (isa == kAvx2 && best_isa() >= kAvx2) {
    panel_gemm<float>(xp, M, K, wp, *find_format(qtype), isa_kernels(kAvx2), N, op, group_panel,
                      gemm_tile_avx2);
    return true;
  }
#endif
  return false;
}

}  // namespace kvserve_quant
