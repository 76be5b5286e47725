// The panel GEMM driver shared by the float32 (quant_gemm.cpp) and bfloat16 (quant_bf16.cpp)
// many-rows paths: threads over panels of kPanel weight rows; per panel and chunk of kKc
// values, the rows are dequantized, laid out by `build` (transposed, or pair-interleaved) and
// multiplied against every activation row in register tiles of up to kMB rows by `tile`.
//
//   build(const float* rows (nr, kc), int64_t kc, int nr, P* panel)
//   tile(int mb, const P* panel, const X* x, int64_t ldx, int64_t kc, float* out,
//        int64_t ldo, const uint16_t* masks, bool accumulate)
//
// masks[j]: the valid columns of output vector j (16 columns each) of a panel with nr rows.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "quant_kernels.h"

namespace kvserve_quant {

constexpr int kPanel = 64;    // weight rows per panel = 4 AVX-512 vectors of outputs
constexpr int kMB = 6;        // activation rows per register tile (24 accumulators)
constexpr int64_t kKc = 256;  // values per panel chunk: a multiple of every block size

template <typename P, typename X, typename Build, typename Tile>
void panel_gemm(const X* xp, int64_t M, int64_t K, const uint8_t* wp, const Format& f,
                const IsaKernels& ik, int64_t N, float* op, Build build, Tile tile) {
  const int64_t row_bytes = K / f.block_elems * f.block_bytes;
  const int64_t npanels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, npanels, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) float rows[kPanel * kKc];  // (nr, kc) dequantized, 64 KiB
    alignas(64) P panel[kKc * kPanel];     // laid out by build
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel;
      const int nr = static_cast<int>(std::min<int64_t>(kPanel, N - n0));
      uint16_t masks[4];
      for (int j = 0; j < 4; ++j) {
        const int left = std::clamp(nr - 16 * j, 0, 16);
        masks[j] = left == 16 ? uint16_t{0xFFFF} : static_cast<uint16_t>((1u << left) - 1);
      }
      for (int64_t k0 = 0; k0 < K; k0 += kKc) {
        const int64_t kc = std::min(kKc, K - k0);
        for (int r = 0; r < nr; ++r)
          ik.dequant[f.index](wp + (n0 + r) * row_bytes + k0 / f.block_elems * f.block_bytes,
                              kc / f.block_elems, rows + r * kc);
        build(rows, kc, nr, panel);
        for (int64_t m0 = 0; m0 < M; m0 += kMB) {
          const int mb = static_cast<int>(std::min<int64_t>(kMB, M - m0));
          tile(mb, panel, xp + m0 * K + k0, K, kc, op + m0 * N + n0, N, masks, k0 > 0);
        }
      }
    }
  });
}

}  // namespace kvserve_quant
