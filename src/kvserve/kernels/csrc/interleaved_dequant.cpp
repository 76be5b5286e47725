// kvserve::interleaved_dequantize_bf16: an interleaved weight (kernels/interleaved_weights.py)
// back to dense bfloat16 (N, K), equal bit for bit to kvserve::dequantize_bf16 of the GGUF
// rows it was made from. The default path holds Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K weights
// interleaved (decode through the interleaved kernel); a prefill chunk above its row threshold
// takes this weight into oneDNN's GEMM, as GGUF rows take dequantize_bf16.
//
// Per (group of 16 rows, 32 values): the format's code pair vectors (lanes = rows, as the
// matmul kernel expands them), widened to float32 (a bfloat16 pair word's halves, exact),
// times the rows' scales (plus the min) with the scalar decoders' operations (quant_simd.h:
// q * d, then + m), rounded to nearest even, and transposed 16 x 16 so that each row's 32
// values are stored contiguously.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "quant_kernels.h"
#include "transpose16.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvserve_quant {

namespace {

#if defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma")
#endif

#include "interleaved_tiles.h"

// bfloat16 pairs (lanes = rows) of float32 even / odd values, each rounded to nearest even
inline __m512i round_pairs(__m512 even, __m512 odd) {
  const __m512i e = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(even)));
  const __m512i o = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(odd)));
  return _mm512_or_si512(e, _mm512_slli_epi32(o, 16));
}

template <typename Fmt>
void dequantize(const uint8_t* w, int64_t N, int64_t K, uint16_t* out) {
  constexpr int kPairs = Fmt::kValues / 2, kPer = 32 / Fmt::kValues;  // chain blocks per tile
  const int64_t nb = K / Fmt::kValues, G = (N + 15) / 16, gbytes = Fmt::group_bytes(K);
  const typename Fmt::Table table = Fmt::table();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float tile[16 * 16], rows[16 * 16];
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* wg = w + g * gbytes;
      const int64_t live = std::min<int64_t>(16, N - 16 * g);
      for (int64_t b = 0; b < nb; b += kPer) {
        for (int h = 0; h < kPer; ++h) {
          __m512 d, m = _mm512_setzero_ps();
          Fmt::scales(wg, b + h, d, m);
          __m512i pr[kPairs];
          Fmt::pairs(Fmt::codes(wg, b + h), table, pr);
          for (int p = 0; p < kPairs; ++p) {
            __m512 even = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(pr[p], 16)), d);
            __m512 odd = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(pr[p], high)), d);
            if constexpr (Fmt::kHasMin) {
              even = _mm512_add_ps(even, m);
              odd = _mm512_add_ps(odd, m);
            }
            _mm512_store_si512(tile + 16 * (h * kPairs + p), round_pairs(even, odd));
          }
        }
        kvserve_simd::transpose16(tile, 16, rows, 16);  // rows[i]: row i's 16 pairs
        const int64_t k0 = b * Fmt::kValues;
        for (int64_t i = 0; i < live; ++i)
          std::memcpy(out + (16 * g + i) * K + k0, rows + 16 * i, 64);
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

at::Tensor interleaved_dequantize_bf16_cpu(const at::Tensor& w, int64_t qtype,
                                           int64_t out_features, int64_t in_features) {
  TORCH_CHECK(has_avx512_bf16(), "kvserve: interleaved_dequantize_bf16 needs AVX-512-BF16, "
              "which this CPU lacks");
  const int64_t N = out_features, K = in_features;
  check_interleaved_weight(w, qtype, N, K, "interleaved_dequantize_bf16");
  at::Tensor out = at::empty({N, K}, w.options().dtype(at::kBFloat16));
#if defined(__x86_64__)
  const uint8_t* wp = w.data_ptr<uint8_t>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  switch (qtype) {
    case kQ4_0: dequantize<Q4_0Rows16>(wp, N, K, op); break;
    case kQ4_1: dequantize<Q4_1Rows16>(wp, N, K, op); break;
    case kQ8_0: dequantize<Q8_0Rows16>(wp, N, K, op); break;
    case kQ4_K: dequantize<Q4_KRows16>(wp, N, K, op); break;
    case kQ5_K: dequantize<Q5_KRows16>(wp, N, K, op); break;
    case kQ6_K: dequantize<Q6_KRows16>(wp, N, K, op); break;
    default: TORCH_CHECK(false, "kvserve: no interleaved layout for GGML type ", qtype);
  }
#endif
  return out;
}

}  // namespace

}  // namespace kvserve_quant

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("interleaved_dequantize_bf16(Tensor w, int qtype, int out_features, int in_features) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("interleaved_dequantize_bf16", &kvserve_quant::interleaved_dequantize_bf16_cpu);
}
