// The interleaved kernel's formats and register tile (quant_interleaved.cpp has the layout
// and the order they keep): per format, how a chunk of codes becomes bfloat16 pairs and its
// products with broadcast activation pairs; `tile`, the chains of one register tile.
//
// NOT a normal header (as quant_values16.h): included once, inside quant_interleaved.cpp's
// AVX-512-BF16 target region and its anonymous namespace, after kGroupRows. No include guard
// on purpose.

inline __m512bh bcast_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(v));
}

// bfloat16 bits of small integers: word i of the table = bf16(i % 16 + offset)
inline __m512i code_table(int offset) {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const float v = static_cast<float>(i % 16 + offset);
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    t[i] = static_cast<uint16_t>(bits >> 16);  // exact: small integers
  }
  return _mm512_load_si512(t);
}

// Q4_0 (codes q - 8, kMin false) and Q4_1 (codes q, plus the block's min: kMin true).
// products: s[g][f][m] += the products of group g's block f with activation rows m < MR:
// groups g < NG at blk + g * gstride, blocks f < BF at + f * kBytes, x rows ldx apart from
// block 0's first value. Chunks of all NG x BF blocks are interleaved so that NG x BF x MR
// independent VDPBF16PS chains are in flight (one block after another, the out-of-order
// window overlapped too few), and each activation pair broadcast feeds the NG groups (one
// broadcast per product was half the instructions).
template <bool kMin>
struct Q4Rows16 {
  static constexpr int64_t kBytes = kMin ? 320 : 288, kHead = kMin ? 64 : 32;
  static constexpr bool kHasMin = kMin;
  static inline __m512i table() { return code_table(kMin ? 0 : -8); }
  template <int MR, int BF, int NG>
  static inline void products(const uint8_t* blk, int64_t gstride, const __m512i table,
                              const uint16_t* x, int64_t ldx, __m512 (&s)[NG][BF][MR]) {
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c)
#pragma GCC unroll 4
      for (int f = 0; f < BF; ++f) {
        __m512bh lo[NG], hi[NG];
#pragma GCC unroll 4
        for (int g = 0; g < NG; ++g) {
          const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(blk + kHead + g * gstride + f * kBytes + 32 * c)));
          lo[g] = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(w, table));
          hi[g] = reinterpret_cast<__m512bh>(
              _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table));
        }
        const uint16_t* xf = x + 32 * f + 4 * c;
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) {
          const __m512bh a = bcast_pair(xf + m * ldx);
#pragma GCC unroll 4
          for (int g = 0; g < NG; ++g) s[g][f][m] = _mm512_dpbf16_ps(s[g][f][m], lo[g], a);
        }
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) {
          const __m512bh a = bcast_pair(xf + m * ldx + 2);
#pragma GCC unroll 4
          for (int g = 0; g < NG; ++g) s[g][f][m] = _mm512_dpbf16_ps(s[g][f][m], hi[g], a);
        }
      }
  }
};
using Q4_0Rows16 = Q4Rows16<false>;
using Q4_1Rows16 = Q4Rows16<true>;

struct Q8_0Rows16 {
  static constexpr int64_t kBytes = 544, kHead = 32;
  static constexpr bool kHasMin = false;
  static inline __m512i table() { return _mm512_setzero_si512(); }
  template <int MR, int BF, int NG>
  static inline void products(const uint8_t* blk, int64_t gstride, const __m512i,
                              const uint16_t* x, int64_t ldx, __m512 (&s)[NG][BF][MR]) {
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p)
#pragma GCC unroll 4
      for (int f = 0; f < BF; ++f) {
        __m512bh w[NG];
#pragma GCC unroll 4
        for (int g = 0; g < NG; ++g) {
          const __m128i* src = reinterpret_cast<const __m128i*>(blk + g * gstride + f * kBytes +
                                                                kHead + 32 * p);
          const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src)));
          const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src + 1)));
          w[g] = _mm512_cvtne2ps_pbh(b, a);  // exact: |q| <= 128
        }
        const uint16_t* xf = x + 32 * f + 2 * p;
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) {
          const __m512bh a = bcast_pair(xf + m * ldx);
#pragma GCC unroll 4
          for (int g = 0; g < NG; ++g) s[g][f][m] = _mm512_dpbf16_ps(s[g][f][m], w[g], a);
        }
      }
  }
};

// out[m * ldo + 16 g + i] for rows m < MR, groups g < NG (gstride bytes apart; the last one's
// lanes in `mask`), float32, or rounded to bfloat16 (nearest even, as .to(bfloat16)) into
// outb when that is set: the order at the top, BF blocks' chains side by side. wg: group 0's first
// block; xs: the rows' block sums (Q4_1; nb apart). The running sums live in an L1 buffer, not
// registers: every register goes to the chains.
template <typename Fmt, int MR, int BF, int NG>
void tile(const uint8_t* wg, int64_t gstride, int64_t nb, const uint16_t* x, int64_t ldx,
                const float* xs, float* out, uint16_t* outb, int64_t ldo, __mmask16 mask) {
  const __m512i table = Fmt::table();
  alignas(64) float acc[NG][MR][16] = {};
  // acc = fma(d, s, acc) (Q4_1: then fma(min, xsum, acc)) for block b of each group, its
  // sums s[g][f][m] (s: [NG][BF][MR] in the loop, [NG][1][MR] for the last blocks)
  auto fold = [&](int64_t b, const auto& s, int f) {
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) {
      const uint8_t* blk = wg + g * gstride + b * Fmt::kBytes;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
      __m512 mn = _mm512_setzero_ps();
      if constexpr (Fmt::kHasMin)
        mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        __m512 a = _mm512_fmadd_ps(d, s[g][f][m], _mm512_load_ps(acc[g][m]));
        if constexpr (Fmt::kHasMin) a = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[m * nb + b]), a);
        _mm512_store_ps(acc[g][m], a);
      }
    }
  };
  int64_t b = 0;
  for (; b + BF <= nb; b += BF) {
    __m512 s[NG][BF][MR];
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g)
#pragma GCC unroll 4
      for (int f = 0; f < BF; ++f)
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) s[g][f][m] = _mm512_setzero_ps();
    Fmt::template products<MR, BF, NG>(wg + b * Fmt::kBytes, gstride, table, x + 32 * b, ldx, s);
#pragma GCC unroll 4
    for (int f = 0; f < BF; ++f) fold(b + f, s, f);
  }
  for (; b < nb; ++b) {
    __m512 s[NG][1][MR];
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g)
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) s[g][0][m] = _mm512_setzero_ps();
    Fmt::template products<MR, 1, NG>(wg + b * Fmt::kBytes, gstride, table, x + 32 * b, ldx, s);
    fold(b, s, 0);
  }
#pragma GCC unroll 4
  for (int g = 0; g < NG; ++g)
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __mmask16 k = g == NG - 1 ? mask : __mmask16(0xFFFF);
      const __m512 v = _mm512_load_ps(acc[g][m]);
      if (outb != nullptr)
        _mm256_mask_storeu_epi16(outb + m * ldo + 16 * g, k,
                                 reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
      else
        _mm512_mask_storeu_ps(out + m * ldo + 16 * g, k, v);
    }
}
