// The many-rows path of kvserve::quant_matmul on AVX-512: an outer-product GEMM over panels of
// dequantized weights (prefill chunks, big batches).
//
// The dot-product tiles of quant_matmul.cpp read an activation vector and a weight vector per
// FMA pair and reduce every output horizontally; at a few hundred rows they reach ~65% of
// what oneDNN's packed GEMM does. Here, as in a BLAS micro-kernel:
//
//   panel   wT (kc, 64): 64 weight rows x kc values, dequantized (the same decoders) and
//           transposed so one k holds 64 outputs in 4 vectors
//   tile    acc (6, 64): 6 activation rows; per k, 4 vector loads of wT, 6 broadcasts of x,
//           24 FMAs; no horizontal sums
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
#endif  // __x86_64__

}  // namespace

bool quant_gemm_avx512(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t qtype,
                       int64_t N, float* op) {
#if defined(__x86_64__)
  if (best_isa() < kAvx512) return false;
  panel_gemm<float>(
      xp, M, K, wp, *find_format(qtype), isa_kernels(kAvx512), N, op, transpose_panel,
      [](int mb, const float* panel, const float* x, int64_t ldx, int64_t kc, float* out,
         int64_t ldo, const uint16_t* masks, bool accumulate) {
        kGemmTiles[mb](panel, x, ldx, kc, out, ldo, masks, accumulate);
      });
  return true;
#else
  return false;
#endif
}

}  // namespace kvserve_quant
