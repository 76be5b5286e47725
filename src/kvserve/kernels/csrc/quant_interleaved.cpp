// kvserve::interleaved_matmul_bf16: bfloat16 activations times GGUF weights interleaved at
// load into groups of 16 rows (kvserve/kernels/interleaved_weights.py), in ONE summation
// order per output element at every row count: the same bits for a row whether it is alone
// (a decode), one of 64 (a batch) or one of 2000 (a prefill), on any thread. Batch-invariant
// mode's matmul for Q4_0 / Q4_1 / Q8_0 (models/fixed_order.py).
//
//   x       (M, K) bfloat16, contiguous
//   w       (ceil(N / 16), K / 32, group_block_bytes) uint8, the layout below
//   out     (M, N) float32, or with out_bf16 that rounded to bfloat16 (nearest even) as it is
//           stored
//
// One (group g, block b) holds weight rows n = 16g + i (i < 16; rows past N are zero) and
// values k = 32b .. 32b + 31, in GGUF's own bytes per value:
//   Q4_0  d[16] fp16 | codes[8][32]              288 bytes = 16 x 18
//   Q4_1  d[16] fp16 | m[16] fp16 | codes[8][32]   320 bytes = 16 x 20
//   Q8_0  d[16] fp16 | q[16][32] int8            544 bytes = 16 x 34
// Q4 chunk c, byte 2i + j: low nibble q[i][4c + j], high nibble q[i][4c + 2 + j]; Q8 chunk p,
// byte 2i + j: q[i][2p + j]. A chunk half widened to words and looked up in a 32-entry table
// (vpermw reads an index's low 5 bits, so the table repeats the 16 codes' values and the high
// nibble's bit 4 never matters) is one zmm of bfloat16 pairs, lane i row i's pair for k
// (2p, 2p + 1): what VDPBF16PS multiplies against a broadcast activation pair. The codes are
// small integers (q - 8, q, or int8 q), exact in bfloat16, and their products with bfloat16
// activations exact in float32, so only the adds round.
//
// The order, per output element (m, n), whatever M, the register tile or the thread:
//   acc = 0
//   for each block b, in increasing k:
//     s = 0; for each pair p of the block in increasing k: s = VDPBF16PS(s, x pair, code pair)
//     acc = fma(d[n, b], s, acc)
//     Q4_1 also: acc = fma(m[n, b], xsum[m, b], acc)   (xsum: the block's 32 activations,
//                                                        summed per row in one order, below)
// Several blocks' s run side by side (independent chains hide VDPBF16PS's latency) and are
// folded into acc in block order, so how many run together never changes a sum.
//
// Why: the fixed-order dot tiles of quant_bf16.cpp sum 16 lanes of k per output and reduce
// them at the end, which suits one row but costs a transpose-add tree per output and keeps
// many-row calls ~15% behind oneDNN (Zen 5, the default model's 120 layer matmuls from DRAM,
// benchmarks.bf16_matmul_step: this kernel takes 0.56x the dot kernel's time at one row,
// 0.84x at 64, 0.91x at 2048, ~1.05x oneDNN's on the dequantized weight); here lanes are
// output rows, so a weight chunk expanded
// once feeds every activation row of the tile, and the scale is applied once per block
// instead of being multiplied into every weight (the dequantize-then-round path's per-value
// float work and its bfloat16 rounding of each weight are gone: this is closer to the float32
// dequantized product, not equal to the bfloat16-rounded one).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvserve_quant {

namespace {

constexpr int64_t kGroupRows = 16;  // weight rows per group: one zmm of float32 lanes

#if defined(__x86_64__)
// The whole kernel in one target region: its lambdas (the per-block fold, parallel_for's
// body) need the ISA too, which a function attribute does not pass on to them.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma")
#endif

#include "interleaved_tiles.h"

// xs[m * nb + b] = the 32 activations of row m's block b summed: VDPBF16PS against ones (lane
// i: x[2i + 1] + x[2i], in the instruction's order), then the lanes by one fixed tree (pairs 8,
// 4, 2, 1 apart): per row, the same whatever M.
void block_sums(const uint16_t* x, int64_t M, int64_t K, float* xs) {
  const int64_t nb = K / 32;
  const __m512bh ones = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3F80));  // bf16 1.0
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        const __m512bh v =
            reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + m * K + 32 * b));
        const __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), v, ones);
        __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
        __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        q = _mm_add_ps(q, _mm_movehl_ps(q, q));
        q = _mm_add_ss(q, _mm_movehdup_ps(q));
        xs[m * nb + b] = _mm_cvtss_f32(q);
      }
  });
}

// Register tiles: 8 rows x 2 groups x 1 block of chains (16 of the 32 registers, the rest
// free for the expanded codes and the fold) in the bulk; fewer rows run more blocks side by
// side. (Rows x groups x blocks, measured on Zen 5, one thread, 2016 rows, against the earlier
// 6 x 2 x 2: Q4_0 / Q4_1 0-8%, Q8_0 14-16%, Q5_K 8-10%, Q6_K ~5% faster, Q4_K the same;
// 4 x 2 x 3, 6 x 3 x 1 and 3 x 4 x 2 no better than 8 x 2 x 1; 12 x 2 x 1 was 5-15% slower
// than 6 x 2 x 2. The chains are the same whatever the tile: the bits never change.)
constexpr int kMaxMR = 8;

template <typename Fmt, int NG>
void run_tile(int mr, const uint8_t* wg, int64_t gstride, int64_t nb, const uint16_t* x,
                    int64_t ldx, const float* xs, float* out, uint16_t* outb, int64_t ldo,
                    __mmask16 mask) {
  constexpr int kBF = NG == 1 ? 4 : 2;
  switch (mr) {
    case 8: return tile<Fmt, 8, NG == 1 ? 2 : 1, NG>(wg, gstride, nb, x, ldx, xs, out, outb, ldo, mask);
    case 7: return tile<Fmt, 7, NG == 1 ? 2 : 1, NG>(wg, gstride, nb, x, ldx, xs, out, outb, ldo, mask);
    case 6: return tile<Fmt, 6, NG == 1 ? 4 : 2, NG>(wg, gstride, nb, x, ldx, xs, out, outb, ldo, mask);
    case 5: return tile<Fmt, 5, 2, NG>(wg, gstride, nb, x, ldx, xs, out, outb, ldo, mask);
    case 4: return tile<Fmt, 4, kBF, NG>(wg, gstride, nb, x, ldx, xs, out, outb, ldo, mask);
    case 3: return tile<Fmt, 3, kBF, NG>(wg, gstride, nb, x, ldx, xs, out, outb, ldo, mask);
    case 2: return tile<Fmt, 2, 4, NG>(wg, gstride, nb, x, ldx, xs, out, outb, ldo, mask);
    default: return tile<Fmt, 1, 4, NG>(wg, gstride, nb, x, ldx, xs, out, outb, ldo, mask);
  }
}

template <typename Fmt>
void matmul(const uint16_t* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
            float* out, uint16_t* outb) {
  const int64_t nb = K / Fmt::kValues, G = (N + kGroupRows - 1) / kGroupRows;
  const int64_t gbytes = Fmt::group_bytes(K);
  std::vector<float> xs;
  if constexpr (Fmt::kHasMin) {
    static_assert(Fmt::kValues == 32, "block_sums sums 32 activations");
    xs.resize(M * nb);
    block_sums(x, M, K, xs.data());
  }
  // Threads split pairs of groups (a tile's two groups); activation rows in blocks that stay
  // in L2 while every pair of the thread's share passes over them (a pair's weights stay in
  // L1 for the block's tiles). One row (a decode) takes one group at a time: nothing to share.
  const int ng = M > 1 ? 2 : 1;
  const int64_t units = (G + ng - 1) / ng;
  constexpr int64_t kRowBlock = 96;
  const int64_t grain =
      std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, gbytes * ng));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    for (int64_t mb0 = 0; mb0 < M; mb0 += kRowBlock) {
      const int64_t mb1 = std::min(M, mb0 + kRowBlock);
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t g = u * ng, gn = std::min<int64_t>(ng, G - g);
        const int64_t rows = std::min<int64_t>(kGroupRows, N - (g + gn - 1) * kGroupRows);
        const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1u);
        for (int64_t m0 = mb0, mr = 0; m0 < mb1; m0 += mr) {
          const int64_t left = mb1 - m0;
          mr = std::min<int64_t>(kMaxMR, left);
          const float* xs_m = Fmt::kHasMin ? xs.data() + m0 * nb : nullptr;
          const int64_t at = m0 * N + g * kGroupRows;
          float* o = outb == nullptr ? out + at : nullptr;
          uint16_t* ob = outb == nullptr ? nullptr : outb + at;
          const uint8_t* wg = w + g * gbytes;
          if (gn == 2)
            run_tile<Fmt, 2>(static_cast<int>(mr), wg, gbytes, nb, x + m0 * K, K, xs_m, o, ob, N,
                             mask);
          else
            run_tile<Fmt, 1>(static_cast<int>(mr), wg, gbytes, nb, x + m0 * K, K, xs_m, o, ob, N,
                             mask);
        }
      }
    }
  });
}
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // __x86_64__

}  // namespace

int64_t interleaved_block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 288;
    case kQ4_1: return 320;
    case kQ8_0: return 544;
    case kQ4_K: return 2368;
    case kQ5_K: return 2880;
    case kQ6_K: return 3360;
    default: return 0;
  }
}

int64_t interleaved_block_values(int64_t qtype) {
  return qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K ? 256 : 32;
}

void check_interleaved_weight(const at::Tensor& w, int64_t qtype, int64_t N, int64_t K,
                              const char* op) {
  const int64_t bb = interleaved_block_bytes(qtype), bv = interleaved_block_values(qtype);
  TORCH_CHECK(bb > 0, "kvserve: ", op, " supports Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K (GGML "
              "types 2, 3, 8, 12, 13, 14), got type ", qtype);
  TORCH_CHECK(K > 0 && K % bv == 0, "kvserve: ", op, " needs K a positive multiple of ", bv,
              " for type ", qtype, ", got ", K);
  TORCH_CHECK(N > 0, "kvserve: out_features must be positive, got ", N);
  const int64_t G = (N + kGroupRows - 1) / kGroupRows;
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.dim() == 3 && w.size(0) == G && w.size(1) == K / bv && w.size(2) == bb,
              "kvserve: the interleaved weight must be contiguous uint8 (", G, ", ", K / bv, ", ",
              bb, ") for N=", N, " K=", K, ", got ", w.scalar_type(), " ", w.sizes());
}

bool interleaved_matmul_bf16_raw(const uint16_t* x, int64_t M, int64_t K, const uint8_t* w,
                            int64_t qtype, int64_t N, float* out, uint16_t* out_bf16) {
#if defined(__x86_64__)
  if (!has_avx512_bf16() || K % interleaved_block_values(qtype) != 0) return false;
  switch (qtype) {
    case kQ4_0: matmul<Q4_0Rows16>(x, M, K, w, N, out, out_bf16); return true;
    case kQ4_1: matmul<Q4_1Rows16>(x, M, K, w, N, out, out_bf16); return true;
    case kQ8_0: matmul<Q8_0Rows16>(x, M, K, w, N, out, out_bf16); return true;
    case kQ4_K: matmul<Q4_KRows16>(x, M, K, w, N, out, out_bf16); return true;
    case kQ5_K: matmul<Q5_KRows16>(x, M, K, w, N, out, out_bf16); return true;
    case kQ6_K: matmul<Q6_KRows16>(x, M, K, w, N, out, out_bf16); return true;
    default: return false;
  }
#else
  return false;
#endif
}

namespace {

at::Tensor interleaved_matmul_bf16_cpu(const at::Tensor& x, const at::Tensor& w, int64_t qtype,
                                  int64_t out_features, bool out_bf16) {
  TORCH_CHECK(has_avx512_bf16(), "kvserve: interleaved_matmul_bf16 needs AVX-512-BF16, which this "
              "CPU lacks");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "kvserve: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "kvserve: x must be a contiguous 2-D bfloat16 tensor, got ", x.scalar_type(), " ",
              x.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  check_interleaved_weight(w, qtype, N, K, "interleaved_matmul_bf16");
  at::Tensor out = at::empty({M, N}, x.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  if (M == 0) return out;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  const bool ok =
      out_bf16 ? interleaved_matmul_bf16_raw(xp, M, K, w.data_ptr<uint8_t>(), qtype, N, nullptr,
                                             reinterpret_cast<uint16_t*>(out.data_ptr()))
               : interleaved_matmul_bf16_raw(xp, M, K, w.data_ptr<uint8_t>(), qtype, N,
                                             out.data_ptr<float>());
  TORCH_CHECK(ok, "kvserve: interleaved_matmul_bf16 could not run");
  return out;
}

}  // namespace

}  // namespace kvserve_quant

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("interleaved_matmul_bf16(Tensor x, Tensor w, int qtype, int out_features, "
        "bool out_bf16=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("interleaved_matmul_bf16", &kvserve_quant::interleaved_matmul_bf16_cpu);
}
