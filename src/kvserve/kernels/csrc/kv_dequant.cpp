// Quantized KV-cache rows -> float32 (see kv_dequant.h), per ISA, and kvserve::kv_dequantize,
// which runs the same routines over (N, code_bytes) codes so the tests can compare them with
// cache_dtype.dequantize bit for bit (and fp8 over all 256 bytes).
//
// Every format is handled one scale group at a time: a group of G values has one scale (and
// min), its codes are G bytes (int8, fp8) or G / 2 (4 bits: byte j holds value j low, j + G / 2
// high), so a vector of 16 (AVX-512) or 8 (AVX2) consecutive bytes of a group dequantizes to
// consecutive outputs (two runs of them for 4 bits). G is 32 or head_dim: tails are masked
// (AVX-512) or scalar (AVX2). Same TU scheme as paged_attention.cpp: plain -O3 and
// __attribute__((target)) paths chosen at run time. The TU is ISO C++ (-std=c++20), so GCC
// does not contract d * q + m into an FMA: int4 rounds twice, as the reference does.
#include "cpu_isa.h"
#include "kv_dequant.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using c10::Half;
using namespace kvserve_kvq;

// ---- scalar: the portable path, and the tails of the AVX2 one -----------------------------
// float8 e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal
// (m 2^-9), S.1111.111 is NaN (no infinities). All 256 values, exactly.
const std::array<float, 256> kFp8Values = [] {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const float v = e == 15 && m == 7 ? std::numeric_limits<float>::quiet_NaN()
                    : e == 0          ? std::ldexp(float(m), -9)
                                      : std::ldexp(float(8 + m), e - 10);  // (1 + m/8) 2^(e-7)
    t[b] = b & 0x80 ? -v : v;
  }
  return t;
}();

// Values [j0, j1) of one group (codes c, output o; for 4 bits j < G / 2 indexes bytes and
// writes o[j] and o[j + G / 2]).
template <int64_t F>
inline void group_scalar(const uint8_t* c, int64_t G, float d, float m, int64_t j0, int64_t j1,
                         float* o) {
  for (int64_t j = j0; j < j1; ++j) {
    if constexpr (F == kInt8) {
      o[j] = float(int8_t(c[j])) * d;
    } else if constexpr (F == kFp8) {
      o[j] = kFp8Values[c[j]] * d;
    } else if constexpr (F == kInt4) {
      o[j] = float((c[j] & 15) - 8) * d;
      o[j + G / 2] = float((c[j] >> 4) - 8) * d;
    } else {
      o[j] = float(c[j] & 15) * d + m;
      o[j + G / 2] = float(c[j] >> 4) * d + m;
    }
  }
}

constexpr bool is_int4(int64_t F) { return F == kInt4 || F == kInt4Asym; }

template <int64_t F>
void deq_scalar(const uint8_t* codes, int64_t cs, const Half* sc, const Half* mn, int64_t ss,
                int64_t rows, int64_t D, float* out) {
  const int64_t G = group_size(F, D), run = is_int4(F) ? G / 2 : G;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g * G < D; ++g) {
      const float m = F == kInt4Asym ? float(mn[r * ss + g]) : 0.f;
      group_scalar<F>(codes + r * cs + g * run, G, float(sc[r * ss + g]), m, 0, run,
                      out + r * D + g * G);
    }
}

#if defined(__x86_64__)
#define KQ_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KQ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

KQ_AVX2 inline float h2f(Half h) { return _cvtsh_ss(h.x); }

// e4m3 -> f32 through f16: S.EEEE.MMM -> S.0EEEE.MMM0000000 is the f16 of the value / 2^8,
// for normals (f16 exponent bias 15 = 7 + 8) and subnormals (m 2^-9 -> f16 subnormal m 2^-17)
// alike, and f16 -> f32 is exact (DAZ or not: measured), so x = f16 * (2^8 d): the caller
// folds 2^8 into the scale (exact: a power of two). The shift leaves the sign at bit 14; adding
// bit 14 to itself carries it to 15. S.1111.111, NaN in e4m3, would read 1.875 2^8: the
// quantizer never writes it, so a group is checked once and one holding it takes the scalar
// table (4 fewer instructions per vector than masking every vector).
constexpr float kFp8Unscale = 256.f;

// ---- AVX-512: 16 values per vector, masked tails ----------------------------------------
KQ_AVX512 inline __m512 fp8_512(__m128i b) {  // 16 bytes, none NaN
  __m256i w = _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 7);
  w = _mm256_add_epi16(w, _mm256_and_si256(w, _mm256_set1_epi16(0x4000)));
  return _mm512_cvtph_ps(w);
}

KQ_AVX512 inline bool fp8_nan_512(const uint8_t* c, int64_t n) {  // any NaN in bytes [0, n)
  __mmask64 any = 0;
  for (int64_t j = 0; j < n; j += 64) {
    const __mmask64 k = n - j >= 64 ? ~__mmask64{0} : (__mmask64{1} << (n - j)) - 1;
    const __m512i b = _mm512_and_si512(_mm512_maskz_loadu_epi8(k, c + j), _mm512_set1_epi8(0x7F));
    any |= _mm512_mask_cmpeq_epi8_mask(k, b, _mm512_set1_epi8(0x7F));
  }
  return any != 0;
}

KQ_AVX512 inline __mmask16 mask16(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

// DC: head_dim known at compile time (64, 128: the loops unroll), or 0 (read Drt)
template <int64_t F, int64_t DC>
KQ_AVX512 void deq_avx512(const uint8_t* codes, int64_t cs, const Half* sc, const Half* mn,
                          int64_t ss, int64_t rows, int64_t Drt, float* out) {
  const int64_t D = DC ? DC : Drt, G = group_size(F, D), run = is_int4(F) ? G / 2 : G;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g * G < D; ++g) {
      const uint8_t* c = codes + r * cs + g * run;
      float* o = out + r * D + g * G;
      if (F == kFp8 && fp8_nan_512(c, run)) {
        group_scalar<F>(c, G, h2f(sc[r * ss + g]), 0.f, 0, run, o);
        continue;
      }
      const __m512 d = _mm512_set1_ps(h2f(sc[r * ss + g]) * (F == kFp8 ? kFp8Unscale : 1.f));
      for (int64_t j = 0; j < run; j += 16) {
        const __mmask16 k = mask16(run - j);
        const __m128i b = _mm_maskz_loadu_epi8(k, c + j);
        if constexpr (F == kInt8) {
          const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
          _mm512_mask_storeu_ps(o + j, k, _mm512_mul_ps(x, d));
        } else if constexpr (F == kFp8) {
          _mm512_mask_storeu_ps(o + j, k, _mm512_mul_ps(fp8_512(b), d));
        } else {
          const __m512i w = _mm512_cvtepu8_epi32(b), f = _mm512_set1_epi32(15);
          __m512i lo = _mm512_and_si512(w, f), hi = _mm512_srli_epi32(w, 4);
          if constexpr (F == kInt4) {
            lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
            hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
          }
          __m512 xl = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), d);
          __m512 xh = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d);
          if constexpr (F == kInt4Asym) {
            const __m512 m = _mm512_set1_ps(h2f(mn[r * ss + g]));
            xl = _mm512_add_ps(xl, m);
            xh = _mm512_add_ps(xh, m);
          }
          _mm512_mask_storeu_ps(o + j, k, xl);
          _mm512_mask_storeu_ps(o + run + j, k, xh);
        }
      }
    }
}

// ---- AVX2: 8 values per vector, scalar tails ---------------------------------------------
KQ_AVX2 inline __m256 fp8_256(__m128i b) {  // the low 8 bytes of b, none NaN, as fp8_512
  __m128i w = _mm_slli_epi16(_mm_cvtepu8_epi16(b), 7);
  w = _mm_add_epi16(w, _mm_and_si128(w, _mm_set1_epi16(0x4000)));
  return _mm256_cvtph_ps(w);
}

KQ_AVX2 inline bool fp8_nan_256(const uint8_t* c, int64_t n) {  // bytes [0, n), n % 8 == 0
  const __m256i m = _mm256_set1_epi8(0x7F);
  __m256i any = _mm256_setzero_si256();
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + j));
    any = _mm256_or_si256(any, _mm256_cmpeq_epi8(_mm256_and_si256(b, m), m));
  }
  for (; j < n; j += 8) {  // 8 bytes, the upper half of the xmm zero: never 0x7F
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + j));
    const __m128i e = _mm_cmpeq_epi8(_mm_and_si128(b, _mm256_castsi256_si128(m)),
                                     _mm256_castsi256_si128(m));
    any = _mm256_or_si256(any, _mm256_zextsi128_si256(e));
  }
  return !_mm256_testz_si256(any, any);
}

template <int64_t F, int64_t DC>
KQ_AVX2 void deq_avx2(const uint8_t* codes, int64_t cs, const Half* sc, const Half* mn,
                      int64_t ss, int64_t rows, int64_t Drt, float* out) {
  const int64_t D = DC ? DC : Drt, G = group_size(F, D), run = is_int4(F) ? G / 2 : G;
  const int64_t vec = run - run % 8;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g * G < D; ++g) {
      const uint8_t* c = codes + r * cs + g * run;
      float* o = out + r * D + g * G;
      const float ds = h2f(sc[r * ss + g]), ms = F == kInt4Asym ? h2f(mn[r * ss + g]) : 0.f;
      if (F == kFp8 && fp8_nan_256(c, vec)) {
        group_scalar<F>(c, G, ds, 0.f, 0, run, o);
        continue;
      }
      const __m256 d = _mm256_set1_ps(ds * (F == kFp8 ? kFp8Unscale : 1.f));
      const __m256 m = _mm256_set1_ps(ms);
      for (int64_t j = 0; j < vec; j += 8) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + j));  // 8 bytes
        if constexpr (F == kInt8) {
          _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), d));
        } else if constexpr (F == kFp8) {
          _mm256_storeu_ps(o + j, _mm256_mul_ps(fp8_256(b), d));
        } else {
          const __m256i w = _mm256_cvtepu8_epi32(b);
          __m256i lo = _mm256_and_si256(w, _mm256_set1_epi32(15)), hi = _mm256_srli_epi32(w, 4);
          if constexpr (F == kInt4) {
            lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(8));
            hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(8));
          }
          __m256 xl = _mm256_mul_ps(_mm256_cvtepi32_ps(lo), d);
          __m256 xh = _mm256_mul_ps(_mm256_cvtepi32_ps(hi), d);
          if constexpr (F == kInt4Asym) {
            xl = _mm256_add_ps(xl, m);
            xh = _mm256_add_ps(xh, m);
          }
          _mm256_storeu_ps(o + j, xl);
          _mm256_storeu_ps(o + run + j, xh);
        }
      }
      group_scalar<F>(c, G, ds, ms, vec, run, o);
    }
}
#endif  // __x86_64__

template <int64_t F>
DequantFn for_format(int64_t D, int64_t isa) {
#if defined(__x86_64__)
  if (isa == kvserve_isa::kAvx512)
    return D == 64 ? deq_avx512<F, 64> : D == 128 ? deq_avx512<F, 128> : deq_avx512<F, 0>;
  if (isa == kvserve_isa::kAvx2)
    return D == 64 ? deq_avx2<F, 64> : D == 128 ? deq_avx2<F, 128> : deq_avx2<F, 0>;
#endif
  return deq_scalar<F>;
}

// torch's names (ATen prints int8 / uint8 as Char / Byte)
const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kDouble: return "float64";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    default: return c10::toString(t);
  }
}

const char* format_name(int64_t fmt) {
  static const char* names[] = {"float", "int8", "int4_sym", "int4", "fp8_e4m3"};
  return names[fmt];
}

// kvserve::kv_dequantize: codes (N, code_bytes), scales / mins (N, num_groups) -> (N, D) f32
at::Tensor kv_dequantize_cpu(const at::Tensor& codes, const std::optional<at::Tensor>& scales,
                             const std::optional<at::Tensor>& mins, int64_t fmt, int64_t isa) {
  TORCH_CHECK(fmt >= kInt8 && fmt <= kFp8, "format must be a quantized one, 1 (int8), 2 (int4_sym), "
              "3 (int4) or 4 (fp8_e4m3), got ", fmt);
  TORCH_CHECK(codes.dim() == 2, "codes must be (N, code_bytes), got ", codes.sizes());
  const int64_t D = is_int4(fmt) ? 2 * codes.size(1) : codes.size(1);
  check_side("", fmt, codes, scales, mins, D);
  isa = resolve_isa(isa);
  const int64_t N = codes.size(0), ng = num_groups(fmt, D);
  auto out = at::empty({N, D}, codes.options().dtype(at::kFloat));
  const Half* mp = mins ? mins->const_data_ptr<Half>() : nullptr;
  dequant_fn(fmt, D, isa)(static_cast<const uint8_t*>(codes.const_data_ptr()), codes.size(1),
                       scales->const_data_ptr<Half>(), mp, ng, N, D, out.data_ptr<float>());
  return out;
}
}  // namespace

namespace kvserve_kvq {
DequantFn dequant_fn(int64_t fmt, int64_t D, int64_t isa) {
  switch (fmt) {
    case kInt8: return for_format<kInt8>(D, isa);
    case kInt4: return for_format<kInt4>(D, isa);
    case kInt4Asym: return for_format<kInt4Asym>(D, isa);
    default: return for_format<kFp8>(D, isa);
  }
}

int64_t resolve_isa(int64_t isa) {
  using kvserve_isa::best_isa;
  TORCH_CHECK(isa >= -1 && isa <= kvserve_isa::kAvx512, "isa must be -1 (best), 0 (scalar), "
              "1 (avx2) or 2 (avx512), got ", isa);
  TORCH_CHECK(isa <= best_isa(), "isa ", isa, " is not supported by this CPU (best: ",
              best_isa(), ")");
  return isa < 0 ? best_isa() : isa;
}

void check_side(const char* p, int64_t fmt, const at::Tensor& codes,
                const std::optional<at::Tensor>& scales, const std::optional<at::Tensor>& mins,
                int64_t D) {
  TORCH_CHECK(fmt >= kFloat && fmt <= kFp8, p, "format must be 0 (float), 1 (int8), 2 (int4_sym), "
              "3 (int4) or 4 (fp8_e4m3), got ", fmt);
  const char* name = format_name(fmt);
  TORCH_CHECK(codes.device().is_cpu() && codes.is_contiguous(), p, "codes must be a contiguous "
              "CPU tensor");
  const auto ct = codes.scalar_type();
  if (fmt == kFloat) {
    TORCH_CHECK(ct == at::kFloat || ct == at::kBFloat16 || ct == at::kHalf, p, "codes dtype must "
                "be float32, bfloat16 or float16 for ", p, "format 0 (float), got ",
                dtype_name(ct));
    TORCH_CHECK(!scales && !mins, p, "scales and ", p, "mins must be None for ", p,
                "format 0 (float)");
  } else {
    const auto want = fmt == kInt8 ? at::kChar : at::kByte;
    TORCH_CHECK(ct == want, p, "codes dtype must be ", dtype_name(want), " for ", p, "format ",
                fmt, " (", name, "), got ", dtype_name(ct));
    TORCH_CHECK(scales.has_value(), p, "scales must be given for ", p, "format ", fmt, " (",
                name, ")");
    TORCH_CHECK(mins.has_value() == (fmt == kInt4Asym), p, "mins must be ",
                fmt == kInt4Asym ? "given" : "None", " for ", p, "format ", fmt, " (", name, ")");
  }
  TORCH_CHECK(!is_int4(fmt) || D % 2 == 0, "4-bit formats need an even head_dim, got ", D);
  const int64_t cb = fmt == kFloat ? D : code_bytes(fmt, D);
  TORCH_CHECK(codes.dim() >= 1 && codes.size(-1) == cb, p, "codes last dim must be ", cb,
              " (head_dim ", D, ", ", name, "), got ", codes.sizes());
  if (fmt == kFloat) return;
  auto want = codes.sizes().vec();
  want.back() = num_groups(fmt, D);
  for (const auto* t : {&scales, &mins}) {
    if (!t->has_value()) continue;
    const at::Tensor& s = **t;
    const char* what = t == &scales ? "scales" : "mins";
    TORCH_CHECK(s.sizes() == at::IntArrayRef(want) && s.scalar_type() == at::kHalf &&
                    s.is_contiguous() && s.device().is_cpu(),
                p, what, " must be ", at::IntArrayRef(want), " (codes' leading dims, num_groups ",
                want.back(), ") contiguous float16 on CPU, got ", s.sizes(), " ",
                dtype_name(s.scalar_type()));
  }
}
}  // namespace kvserve_kvq

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("kv_dequantize(Tensor codes, Tensor? scales, Tensor? mins, int format, int isa=-1) -> "
        "Tensor");
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("kv_dequantize", &kv_dequantize_cpu); }
