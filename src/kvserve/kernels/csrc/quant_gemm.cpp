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
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "quant_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvserve_quant {

namespace {

#if defined(__x86_64__)
#define KV_GEMM __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

constexpr int kPanel = 64;     // weight rows per panel = 4 zmm of outputs
constexpr int kMB = 6;         // activation rows per register tile
constexpr int64_t kKc = 256;   // values per panel chunk: (256, 64) floats = 64 KiB, in L2

// out[m, n0 + j] (= or +=) sum_{k < kc} x[m, k] * wT[k, j] for m < MB, j < 64 (masked to
// nvalid columns on store).
template <int MB>
KV_GEMM void gemm_tile(const float* wT, const float* x, int64_t ldx, int64_t kc, float* out,
                       int64_t ldo, __mmask16 const* masks, bool accumulate) {
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
                          __mmask16 const*, bool);
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
  const Format& f = *find_format(qtype);
  const IsaKernels& ik = isa_kernels(kAvx512);
  const int64_t row_bytes = K / f.block_elems * f.block_bytes;
  const int64_t npanels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, npanels, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) float rows_buf[kPanel * kKc];  // (64, kc) dequantized
    alignas(64) float wT[kKc * kPanel];        // (kc, 64) transposed
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel;
      const int nr = static_cast<int>(std::min<int64_t>(kPanel, N - n0));
      __mmask16 masks[4];
      for (int j = 0; j < 4; ++j) {
        const int left = std::clamp(nr - 16 * j, 0, 16);
        masks[j] = left == 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      }
      for (int64_t k0 = 0; k0 < K; k0 += kKc) {
        const int64_t kc = std::min(kKc, K - k0);
        for (int r = 0; r < nr; ++r)
          ik.dequant[f.index](wp + (n0 + r) * row_bytes + k0 / f.block_elems * f.block_bytes,
                              kc / f.block_elems, rows_buf + r * kc);
        transpose_panel(rows_buf, kc, nr, wT);
        for (int64_t m0 = 0; m0 < M; m0 += kMB) {
          const int mb = static_cast<int>(std::min<int64_t>(kMB, M - m0));
          kGemmTiles[mb](wT, xp + m0 * K + k0, K, kc, op + m0 * N + n0, N, masks, k0 > 0);
        }
      }
    }
  });
  return true;
#else
  return false;
#endif
}

}  // namespace kvserve_quant
