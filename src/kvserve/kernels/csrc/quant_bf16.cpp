// kvserve::quant_matmul_bf16: bfloat16 activations times GGUF-quantized weights on CPUs with
// AVX-512-BF16 (Zen 4/5, Cooper Lake, Sapphire Rapids and later).
//
//   x        (M, K) bfloat16, contiguous: a bfloat16 model's activations, as they are
//   qweight  (N, K / block_elems * block_bytes) uint8: a GGUF 2-D tensor's rows
//   out      (M, N) float32 = x @ bf16(dequantize(qweight)).T, accumulated in float32
//
// The arithmetic of the bfloat16 dequantize-then-matmul path (weights dequantized to float32,
// rounded to bfloat16, bf16 x bf16 products summed in float32, as oneDNN's bf16 GEMM does),
// without materializing the weight: per tile of kNR weight rows and chunk of K, the rows are
// dequantized (the AVX-512 decoders of quant_isa.cpp), rounded to bfloat16 into an L1 buffer,
// and every activation row is multiplied against it with VDPBF16PS (32 products per
// instruction, twice the float32 FMA's) in register tiles of up to 4 x 4. Products of two
// bfloat16 values are exact in float32; only the summation order (and VDPBF16PS's flushing of
// denormals) differ from the GEMM.
//
// The fixed order (what makes a row's result independent of M, of its place in a batch and of
// the thread that ran it; ARCHITECTURE.md "Bitwise invariance"): per output element (activation
// row m, weight row n) and per chunk of kChunk values of K in increasing order, ONE 16-lane
// float32 accumulator takes VDPBF16PS over the chunk's 32-value steps in increasing k (lane i:
// the pair k + 2i, k + 2i + 1); its lanes are summed by the reduce16 tree (vec_reduce.h); the
// first chunk's sum is stored, each later one added. The dot tiles (any MT, any nr) and the
// register GEMV of 1-4 rows both follow it. The panel GEMM (lane = output column) and the AMX
// tiles sum in other orders: `fixed_order` turns them off.
//
// Why: a bfloat16 model's batches of 64 decodes (offline serving) went through dequantize +
// GEMM every step, re-expanding all weights to 4 bytes each per step; the float32 kernel
// spends twice the instructions per product.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "quant_kernels.h"
#include "quant_panel.h"
#include "transpose16.h"
#include "vec_reduce.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvserve_quant {

bool has_avx512_bf16() {
#if defined(__x86_64__)
  static const bool yes = [] {
    __builtin_cpu_init();
    return best_isa() >= kAvx512 && __builtin_cpu_supports("avx512bf16");
  }();
  return yes;
#else
  return false;
#endif
}

namespace {

#if defined(__x86_64__)
#define KV_BF16 __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

// n floats (a multiple of 32) -> bfloat16, round to nearest even
KV_BF16 void to_bf16(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
    _mm512_storeu_si512(dst + i, reinterpret_cast<__m512i>(v));
  }
}

// out[m * ldo + r] (=, or += when accumulate) the sum of acc[m][r]'s 16 lanes, m < MT,
// r < nr: all through one reduce16 tree when they fill it (lane 4m + r), else hsum16 each (the
// same order: vec_reduce.h), so the sums are the same bits either way.
template <int MT, int NR>
KV_BF16 inline void store_sums(const __m512 (&acc)[MT][NR], float* out, int64_t ldo, int nr,
                               bool accumulate) {
  if constexpr (MT == 4 && NR == 4) {
    if (nr == 4) {  // (at K = 576, 16 _mm512_reduce_add_ps were a third as many instructions
                    // as the 288 products)
      const __m512 sums = kvserve_vec::reduce16(acc[0]);
      for (int m = 0; m < MT; ++m) {
        __m128 v = m == 0   ? _mm512_castps512_ps128(sums)
                   : m == 1 ? _mm512_extractf32x4_ps(sums, 1)
                   : m == 2 ? _mm512_extractf32x4_ps(sums, 2)
                            : _mm512_extractf32x4_ps(sums, 3);
        if (accumulate) v = _mm_add_ps(_mm_loadu_ps(out + m * ldo), v);
        _mm_storeu_ps(out + m * ldo, v);
      }
      return;
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < nr; ++r) {
      const float s = kvserve_vec::hsum16(acc[m][r]);
      out[m * ldo + r] = accumulate ? out[m * ldo + r] + s : s;
    }
}

// out[m * ldo + r] (=, or +=) sum_k x[m * ldx + k] * w[r * ldw + k], bf16 inputs, f32 sums;
// m < MT, r < nr <= kNR, k < kc (a multiple of 32). The fixed order (top of the file): one
// accumulator per (m, r) over the chunk in increasing k, summed by the reduce16 tree whatever
// MT and nr (a 1-row tile once had two interleaved accumulators, and partial tiles
// _mm512_reduce_add_ps: a row's result then depended on M mod 4).
template <int MT>
KV_BF16 void tile_bf16(const uint16_t* w, int64_t ldw, const uint16_t* x, int64_t ldx, int64_t kc,
                       float* out, int64_t ldo, int nr, bool accumulate) {
  __m512 acc[MT][kNR];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kNR; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; k += 32) {
    __m512bh wv[kNR];
    for (int r = 0; r < kNR; ++r)
      wv[r] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + r * ldw + k));
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + m * ldx + k));
      for (int r = 0; r < kNR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  store_sums<MT, kNR>(acc, out, ldo, nr, accumulate);
}

// ---- many rows: outer-product GEMM over bf16 weight panels (as quant_gemm.cpp for float32)
// panel (kc / 2, 64, 2): k pairs interleaved per output column, so one zmm holds 16 columns x
// 2 k values, the layout VDPBF16PS multiplies against a broadcast pair of activations.
template <int MB>
KV_BF16 void gemm_tile_bf16(const uint16_t* panel, const uint16_t* x, int64_t ldx, int64_t kc,
                            float* out, int64_t ldo, const uint16_t* masks, bool accumulate) {
  __m512 acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; k += 2) {
    const uint16_t* pk = panel + k * kPanel;  // (64, 2) for this pair
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_load_si512(pk)),
                   w1 = reinterpret_cast<__m512bh>(_mm512_load_si512(pk + 32)),
                   w2 = reinterpret_cast<__m512bh>(_mm512_load_si512(pk + 64)),
                   w3 = reinterpret_cast<__m512bh>(_mm512_load_si512(pk + 96));
    for (int i = 0; i < MB; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * ldx + k, sizeof pair);
      const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xb, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xb, w1);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], xb, w2);
      acc[i][3] = _mm512_dpbf16_ps(acc[i][3], xb, w3);
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

using GemmTileBf16 = void (*)(const uint16_t*, const uint16_t*, int64_t, int64_t, float*,
                              int64_t, const uint16_t*, bool);
constexpr GemmTileBf16 kGemmTiles[kMB + 1] = {nullptr,           gemm_tile_bf16<1>,
                                              gemm_tile_bf16<2>, gemm_tile_bf16<3>,
                                              gemm_tile_bf16<4>, gemm_tile_bf16<5>,
                                              gemm_tile_bf16<6>};

// 16 weight rows of kc float32 values (rows kc apart; rows nr16..15 taken as zero) -> their
// 16 columns of the (kc / 2, 64, 2) panel at dst (64-byte aligned): each row's 32 values at a
// time rounded to bfloat16 (nearest even, as the dot tiles round) make 16 k pairs, one 32-bit
// word each, and a transpose turns "row i, pairs 0..15" into "pair p, rows 0..15", the
// panel's layout (pair p of the chunk at dst + (k + 2p) * kPanel, kPanel words apart).
KV_BF16 void build_panel_group(const float* src, int64_t kc, int nr16, uint16_t* dst) {
  alignas(64) uint16_t pairs[16 * 32];  // (16 rows, 16 pairs)
  for (int64_t k = 0; k < kc; k += 32) {
    for (int i = 0; i < 16; ++i) {
      const float* row = src + i * kc + k;
      const __m512i v = i < nr16 ? reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
                                       _mm512_loadu_ps(row + 16), _mm512_loadu_ps(row)))
                                 : _mm512_setzero_si512();
      _mm512_store_si512(pairs + 32 * i, v);
    }
    kvserve_simd::transpose16(reinterpret_cast<const float*>(pairs), 16,
                              reinterpret_cast<float*>(dst + k * kPanel), kPanel);
  }
}

// (rows, kc) float32 row-major -> the (kc / 2, 64, 2) bf16 panel (missing rows zero), 16 rows
// at a time. It replaced a scalar loop of c10::BFloat16 conversions: Zen 5, 2 threads, 384
// rows, 3072 x 576 795 -> 903 GF/s, 576 x 1536 737 -> 841 GF/s (oneDNN's dense bf16 GEMM:
// 926-935 and 863-934), which also moved the panel's first row from 384 down to 128.
KV_BF16 void build_panel(const float* src, int64_t kc, int rows, uint16_t* dst) {
  for (int g = 0; g < kPanel / 16; ++g)
    build_panel_group(src + 16 * g * kc, kc, std::clamp(rows - 16 * g, 0, 16), dst + 32 * g);
}

void gemm_bf16(const uint16_t* xp, int64_t M, int64_t K, const uint8_t* wp, const Format& f,
               const IsaKernels& ik, int64_t N, float* op) {
  panel_gemm<uint16_t>(xp, M, K, wp, f, ik, N, op, build_panel,
                       [](int mb, const uint16_t* panel, const uint16_t* x, int64_t ldx,
                          int64_t kc, float* out, int64_t ldo, const uint16_t* masks,
                          bool accumulate) {
                         kGemmTiles[mb](panel, x, ldx, kc, out, ldo, masks, accumulate);
                       });
}

}  // namespace

// ---- the fixed order at 1-4 rows: weights decoded in registers (quant_values16.h: the
// dequantizer's own float operations, so the same float32 values as the dequantize-into-L1
// tiles), rounded to bfloat16 by the same VCVTNE2PS2BF16 pairing as to_bf16, multiplied by
// VDPBF16PS into one accumulator per element, flushed per kChunk values: the tiles' sums bit
// for bit, with batch-1 decode streaming each weight once and never storing it (Zen 5, best
// of 20, 2 threads: Q4_1 192 x 576 at one row 5 us against the tiles' 8).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma")
#endif
namespace bf16_values16 {
inline __m512 cvt16(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }
#include "quant_values16.h"

// out[m * ldo + r] = x rows m < MR (ldx apart) . weight rows r < NR (row_bytes apart), K values
template <typename Fmt, int NR, int MR>
void gemv_rows(const uint8_t* w, int64_t row_bytes, const uint16_t* x, int64_t ldx, int64_t K,
               float* out, int64_t ldo) {
  constexpr int64_t kPerChunk = kChunk / 32;  // blocks per chunk, as the tiles flush
  const int64_t nb = K / 32;
  for (int64_t c0 = 0; c0 < nb; c0 += kPerChunk) {
    const int64_t c1 = std::min(nb, c0 + kPerChunk);
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t b = c0; b < c1; ++b) {
      __m512bh xv[MR];
      for (int m = 0; m < MR; ++m)
        xv[m] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + m * ldx + 32 * b));
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        __m512 v[2];
        Fmt::get(w + r * row_bytes + b * Fmt::kBytes, v);
        const __m512bh wv = _mm512_cvtne2ps_pbh(v[1], v[0]);
        for (int m = 0; m < MR; ++m) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv[m], wv);
      }
    }
    store_sums<MR, NR>(acc, out, ldo, NR, c0 > 0);
  }
}

template <typename Fmt, int MR>
void gemv_nr(const uint8_t* w, int64_t row_bytes, int nr, const uint16_t* x, int64_t K,
             float* out, int64_t ldo) {
  switch (nr) {
    case 4: return gemv_rows<Fmt, 4, MR>(w, row_bytes, x, K, K, out, ldo);
    case 3: return gemv_rows<Fmt, 3, MR>(w, row_bytes, x, K, K, out, ldo);
    case 2: return gemv_rows<Fmt, 2, MR>(w, row_bytes, x, K, K, out, ldo);
    default: return gemv_rows<Fmt, 1, MR>(w, row_bytes, x, K, K, out, ldo);
  }
}

// nr <= kNR weight rows x M <= 4 activation rows
template <typename Fmt>
void gemv(const uint8_t* w, int64_t row_bytes, int nr, const uint16_t* x, int64_t M, int64_t K,
          float* out, int64_t ldo) {
  switch (M) {
    case 4: return gemv_nr<Fmt, 4>(w, row_bytes, nr, x, K, out, ldo);
    case 3: return gemv_nr<Fmt, 3>(w, row_bytes, nr, x, K, out, ldo);
    case 2: return gemv_nr<Fmt, 2>(w, row_bytes, nr, x, K, out, ldo);
    default: return gemv_nr<Fmt, 1>(w, row_bytes, nr, x, K, out, ldo);
  }
}
}  // namespace bf16_values16
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace {

using GemvBf16 = void (*)(const uint8_t*, int64_t, int, const uint16_t*, int64_t, int64_t,
                          float*, int64_t);
constexpr int64_t kMaxGemvRowsBf16 = 4;
// per Format::index (quant_kernels.h): the 4-bit formats. Q8_0 takes the tiles even at one
// row: its register decode (two widenings, two conversions, two multiplies per 32 values) ran
// the default model's 49152 x 576 lm_head in 1.2-2.1 ms at M = 1 against the tiles' 0.9 ms
// (Zen 5, 2 threads, best of 20); Q4_1's 576 x 192 5 us against 8.
constexpr GemvBf16 kGemvBf16[kNumFormats] = {bf16_values16::gemv<bf16_values16::Q4_0Values16>,
                                             bf16_values16::gemv<bf16_values16::Q4_1Values16>,
                                             nullptr, nullptr, nullptr, nullptr, nullptr};

using TileBf16 = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*,
                          int64_t, int, bool);
constexpr int kMaxMTBf16 = 4;
constexpr TileBf16 kTiles[kMaxMTBf16 + 1] = {nullptr, tile_bf16<1>, tile_bf16<2>, tile_bf16<3>,
                                             tile_bf16<4>};
#endif  // __x86_64__

}  // namespace

void f32_to_bf16(const float* src, int64_t n, uint16_t* dst) {
  int64_t i = 0;
#if defined(__x86_64__)
  if (has_avx512_bf16()) {
    i = n - n % 32;
    to_bf16(src, i, dst);
  }
#endif
  for (; i < n; ++i) dst[i] = c10::BFloat16(src[i]).x;  // round to nearest even, as above
}

void quant_matmul_bf16_raw(const uint16_t* xp, int64_t M, int64_t K, const uint8_t* wp,
                           int64_t qtype, int64_t N, float* op, int64_t amx_min_rows,
                           bool fixed_order) {
#if defined(__x86_64__)
  if (!fixed_order && amx_min_rows > 0 && M >= amx_min_rows &&
      quant_matmul_amx_raw(xp, M, K, wp, qtype, N, op))
    return;
  const Format& f = *find_format(qtype);
  const IsaKernels& ik = isa_kernels(kAvx512);
  if (!fixed_order && M >= kGemmMinRowsBf16) return gemm_bf16(xp, M, K, wp, f, ik, N, op);
  const int64_t row_bytes = K / f.block_elems * f.block_bytes;
  const int64_t ntiles = (N + kNR - 1) / kNR;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (K * kNR));
  const GemvBf16 gemv = kGemvBf16[f.index];
  if (M <= kMaxGemvRowsBf16 && gemv != nullptr && K % 32 == 0) {  // decodes: in registers
    at::parallel_for(0, ntiles, grain, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * kNR;
        gemv(wp + n0 * row_bytes, row_bytes, static_cast<int>(std::min<int64_t>(kNR, N - n0)),
             xp, M, K, op + n0, N);
      }
    });
    return;
  }
  // many rows: kGroup weight tiles' chunk decoded into L1 together, and every register tile of
  // activation rows multiplied against all of them while its rows are in L1 (one tile at a
  // time re-read the activations from L2 for every 4 weight rows: at 512-2000 rows that cost
  // 27-52% against the panel GEMM). The sums are each tile's, in the same order.
  const int64_t kGroup = M > 2 * kMaxMTBf16 ? 4 : 1;
  const int64_t ngroups = (ntiles + kGroup - 1) / kGroup;
  const int64_t ggrain = std::max<int64_t>(1, grain / kGroup);
  // Activation rows in blocks of kRowBlock (a 1024-value chunk of 128 rows: 256 KiB, in L2):
  // all M rows per weight group streamed the activations from L3 for every 16 weight rows.
  // Zen 5, 2 threads, the default model's gate/up, down and qkv shapes, against oneDNN on the
  // dequantized weight: 512 rows 1.29x -> 1.13x its time, 2048 rows 1.24x -> 1.16x (64-row
  // and 256-row blocks measured slower). A block re-decodes the weights, 1/128 of its
  // products. Each sum's order is unchanged (chunks in increasing k).
  constexpr int64_t kRowBlock = 128;
  at::parallel_for(0, ngroups, ggrain, [&](int64_t g0, int64_t g1) {
    alignas(64) float wf[kChunk];                         // one row's chunk, float32
    alignas(64) uint16_t wbuf[4 * kNR * kChunk];          // (tiles, kNR, kChunk) bf16, 32 KiB
    for (int64_t mb0 = 0; mb0 < M; mb0 += kRowBlock)
    for (int64_t grp = g0; grp < g1; ++grp) {
      const int64_t t_lo = grp * kGroup, t_hi = std::min(ntiles, t_lo + kGroup);
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, K - k0);
        for (int64_t t = t_lo; t < t_hi; ++t) {
          const int64_t n0 = t * kNR;
          const int nr = static_cast<int>(std::min<int64_t>(kNR, N - n0));
          for (int r = 0; r < kNR; ++r) {
            uint16_t* dst = wbuf + ((t - t_lo) * kNR + r) * kChunk;
            if (r < nr) {
              ik.dequant[f.index](wp + (n0 + r) * row_bytes + k0 / f.block_elems * f.block_bytes,
                                  kc / f.block_elems, wf);
              to_bf16(wf, kc, dst);
            } else {
              std::memset(dst, 0, kc * sizeof(uint16_t));  // tail tile: rows beyond N
            }
          }
        }
        const int64_t mb1 = std::min(M, mb0 + kRowBlock);
        for (int64_t m0 = mb0; m0 < mb1; m0 += kMaxMTBf16) {
          const int mt = static_cast<int>(std::min<int64_t>(kMaxMTBf16, mb1 - m0));
          for (int64_t t = t_lo; t < t_hi; ++t) {
            const int64_t n0 = t * kNR;
            const int nr = static_cast<int>(std::min<int64_t>(kNR, N - n0));
            kTiles[mt](wbuf + (t - t_lo) * kNR * kChunk, kChunk, xp + m0 * K + k0, K, kc,
                       op + m0 * N + n0, N, nr, k0 > 0);
          }
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "kvserve: quant_matmul_bf16 needs an x86-64 CPU with AVX-512-BF16");
#endif
}

namespace {

at::Tensor quant_matmul_bf16_cpu(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype,
                                 int64_t out_features, int64_t amx_min_rows, bool fixed_order) {
  TORCH_CHECK(has_avx512_bf16(), "kvserve: quant_matmul_bf16 needs AVX-512-BF16, which this "
              "CPU lacks (use quant_matmul with float32 activations)");
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu(), "kvserve: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "kvserve: x must be a contiguous 2-D bfloat16 tensor, got ", x.scalar_type(), " ",
              x.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  check_weight(qweight, qtype, N, K);
  const at::Tensor w = qweight.contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  quant_matmul_bf16_raw(reinterpret_cast<const uint16_t*>(x.const_data_ptr()), M, K,
                        w.data_ptr<uint8_t>(), qtype, N, out.data_ptr<float>(), amx_min_rows,
                        fixed_order);
  return out;
}

// dequantize + .to(bfloat16) in one pass: each row's chunk dequantized into an L1 float32
// buffer (the same decoders as kvserve::dequantize) and rounded to nearest even, so the
// result equals the two-step one bit for bit, without the float32 weight in memory (a
// bfloat16 model's prefill re-expands every weight per chunk: 4 bytes written and read back
// per value, now 2 written).
at::Tensor dequantize_bf16_cpu(const at::Tensor& qweight, int64_t qtype, int64_t out_features,
                               int64_t in_features) {
  TORCH_CHECK(qweight.device().is_cpu(), "kvserve: CPU tensors only");
  const int64_t N = out_features, K = in_features;
  const Format& f = check_weight(qweight, qtype, N, K);
  const IsaKernels& ik = isa_kernels(best_isa());
  const at::Tensor w = qweight.contiguous();
  at::Tensor out = at::empty({N, K}, qweight.options().dtype(at::kBFloat16));
  if (N == 0 || K == 0) return out;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t row_bytes = w.size(1);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / K);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    alignas(64) float wf[kChunk];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, K - k0);
        ik.dequant[f.index](wp + n * row_bytes + k0 / f.block_elems * f.block_bytes,
                            kc / f.block_elems, wf);
        f32_to_bf16(wf, kc, op + n * K + k0);
      }
  });
  return out;
}

bool cpu_has_avx512_bf16() { return has_avx512_bf16(); }
int64_t bf16_gemm_min_rows() { return kGemmMinRowsBf16; }
bool cpu_has_amx_bf16() { return has_amx_bf16(); }

}  // namespace

}  // namespace kvserve_quant

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def(
      "quant_matmul_bf16(Tensor x, Tensor qweight, int qtype, int out_features, "
      "int amx_min_rows=0, bool fixed_order=False) -> Tensor");
  m.def("dequantize_bf16(Tensor qweight, int qtype, int out_features, int in_features) -> "
        "Tensor");
  m.def("cpu_has_avx512_bf16() -> bool", &kvserve_quant::cpu_has_avx512_bf16);
  m.def("quant_bf16_gemm_min_rows() -> int", &kvserve_quant::bf16_gemm_min_rows);
  m.def("cpu_has_amx_bf16() -> bool", &kvserve_quant::cpu_has_amx_bf16);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("quant_matmul_bf16", &kvserve_quant::quant_matmul_bf16_cpu);
  m.impl("dequantize_bf16", &kvserve_quant::dequantize_bf16_cpu);
}
