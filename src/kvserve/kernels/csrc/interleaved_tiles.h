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

// bfloat16 bits of small integers: word i of the table = bf16(i % period + offset)
inline __m512i code_table(int offset, int period = 16) {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const float v = static_cast<float>(i % period + offset);
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    t[i] = static_cast<uint16_t>(bits >> 16);  // exact: small integers
  }
  return _mm512_load_si512(t);
}

// s[g][f][m] += w[g] . (x pair at xp + m * ldx) for rows m < MR and groups g < NG: one code
// pair vector per group, each activation pair broadcast once for the NG groups
template <int MR, int BF, int NG>
__attribute__((always_inline)) inline void mac(__m512 (&s)[NG][BF][MR], int f,
                                               const __m512bh (&w)[NG], const uint16_t* xp,
                                               int64_t ldx) {
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    const __m512bh a = bcast_pair(xp + m * ldx);
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) s[g][f][m] = _mm512_dpbf16_ps(s[g][f][m], w[g], a);
  }
}

// Products of BF chain blocks' 4-bit codes with broadcast activation pairs: s[g][f][m] +=
// the products of group g's chain block f with activation rows m < MR. Chain block f's codes
// at codes + g * gstride + f * fstride, 8 chunks of 32 bytes (chunk c, byte 2i + j: row i's
// q[4c + j] | q[4c + 2 + j] << 4); x rows ldx apart from block 0's first value, blocks 32
// values apart. Chunks of all NG x BF blocks are interleaved so that NG x BF x MR independent
// VDPBF16PS chains are in flight (one block after another, the out-of-order window overlapped
// too few), and each activation pair broadcast feeds the NG groups (one broadcast per product
// was half the instructions).
template <int MR, int BF, int NG>
inline void q4_products(const uint8_t* codes, int64_t fstride, int64_t gstride,
                        const __m512i table, const uint16_t* x, int64_t ldx,
                        __m512 (&s)[NG][BF][MR]) {
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c)
#pragma GCC unroll 4
    for (int f = 0; f < BF; ++f) {
      __m512bh lo[NG], hi[NG];
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) {
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(codes + g * gstride + f * fstride + 32 * c)));
        lo[g] = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(w, table));
        hi[g] = reinterpret_cast<__m512bh>(
            _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table));
      }
      const uint16_t* xf = x + 32 * f + 4 * c;
      mac<MR, BF, NG>(s, f, lo, xf, ldx);
      mac<MR, BF, NG>(s, f, hi, xf + 2, ldx);
    }
}

// The 16 code pair vectors of one 32-value chain block of 4-bit codes (pair 2c: chunk c's low
// nibbles, 2c + 1 its high ones), as q4_products expands them: a dequantizer's input.
inline void q4_pairs(const uint8_t* codes, const __m512i table, __m512i (&pr)[16]) {
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    const __m512i w = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * c)));
    pr[2 * c] = _mm512_permutexvar_epi16(w, table);
    pr[2 * c + 1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
  }
}

// A format: kValues per chain block (one fresh VDPBF16PS chain, then folded with its scale),
// kHasMin (Q4_1, Q4_K: a min times the block's activation sum too), group_bytes(K), where
// chain block b's codes are (codes(); BF blocks from a multiple of BF lie kCodeStride apart),
// its scales as float32 lanes (scales(): d, and the min term's factor m), products(), and
// pairs() (a chain block's kValues / 2 code pair vectors, for the dequantizer).

// fp16 field of 16 rows at p -> float32 lanes
inline __m512 half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Q4_0 (codes q - 8, kMin false) and Q4_1 (codes q, plus the block's min: kMin true): a
// (group, block) is d[16] fp16 (| m[16] fp16) | 8 chunks.
template <bool kMin>
struct Q4Rows16 {
  static constexpr int64_t kValues = 32, kBytes = kMin ? 320 : 288, kHead = kMin ? 64 : 32;
  static constexpr int64_t kCodeStride = kBytes;
  static constexpr bool kHasMin = kMin;
  using Table = __m512i;
  static inline Table table() { return code_table(kMin ? 0 : -8); }
  static inline int64_t group_bytes(int64_t K) { return K / 32 * kBytes; }
  static inline const uint8_t* codes(const uint8_t* wg, int64_t b) {
    return wg + b * kBytes + kHead;
  }
  static inline void scales(const uint8_t* wg, int64_t b, __m512& d, __m512& m) {
    d = half16(wg + b * kBytes);
    if constexpr (kMin) m = half16(wg + b * kBytes + 32);
  }
  template <int MR, int BF, int NG>
  static inline void products(const uint8_t* codes, int64_t fstride, int64_t gstride,
                              const Table& table, const uint16_t* x, int64_t ldx,
                              __m512 (&s)[NG][BF][MR]) {
    q4_products<MR, BF, NG>(codes, fstride, gstride, table, x, ldx, s);
  }
  static inline void pairs(const uint8_t* codes, const Table& table, __m512i (&pr)[16]) {
    q4_pairs(codes, table, pr);
  }
};
using Q4_0Rows16 = Q4Rows16<false>;
using Q4_1Rows16 = Q4Rows16<true>;

// Q8_0: a (group, block) is d[16] fp16 | 16 chunks (chunk p, byte 2i + j: row i's int8
// q[2p + j]).
struct Q8_0Rows16 {
  static constexpr int64_t kValues = 32, kBytes = 544, kHead = 32, kCodeStride = kBytes;
  static constexpr bool kHasMin = false;
  using Table = __m512i;
  static inline Table table() { return _mm512_setzero_si512(); }
  static inline int64_t group_bytes(int64_t K) { return K / 32 * kBytes; }
  static inline const uint8_t* codes(const uint8_t* wg, int64_t b) {
    return wg + b * kBytes + kHead;
  }
  static inline void scales(const uint8_t* wg, int64_t b, __m512& d, __m512&) {
    d = half16(wg + b * kBytes);
  }
  // chunk p (32 int8 codes: row i's pair at bytes 2i, 2i + 1) as 16 bfloat16 pairs
  static inline __m512bh pair_words(const uint8_t* chunk) {
    const __m128i* src = reinterpret_cast<const __m128i*>(chunk);
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src)));
    const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src + 1)));
    return _mm512_cvtne2ps_pbh(b, a);  // exact: |q| <= 128
  }
  template <int MR, int BF, int NG>
  static inline void products(const uint8_t* codes, int64_t fstride, int64_t gstride,
                              const Table&, const uint16_t* x, int64_t ldx,
                              __m512 (&s)[NG][BF][MR]) {
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p)
#pragma GCC unroll 4
      for (int f = 0; f < BF; ++f) {
        __m512bh w[NG];
#pragma GCC unroll 4
        for (int g = 0; g < NG; ++g) w[g] = pair_words(codes + g * gstride + f * fstride + 32 * p);
        mac<MR, BF, NG>(s, f, w, x + 32 * f + 2 * p, ldx);
      }
  }
  static inline void pairs(const uint8_t* codes, const Table&, __m512i (&pr)[16]) {
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p) pr[p] = reinterpret_cast<__m512i>(pair_words(codes + 32 * p));
  }
};

// Q4_K: a (group, super-block of 256 values) is d[16] fp16 | dmin[16] fp16 | sc[8][16] u8 |
// mn[8][16] u8 | 8 sub-blocks of 8 chunks. Chain block = sub-block s (32 values): its scale
// d * sc[s] and min factor -(dmin * mn[s]), each exact in float32 (11 x 6 bits).
// Q5_K (kFifth): the same, each sub-block's 8 chunks followed by 8 x 2 masks of 32 bits (chunk
// c: lo, hi; bit 2i + j = row i's pair value j): hi = the fifth bit of the chunk's high
// nibbles' values, lo = that of its low nibbles' XOR bit 0 of the high nibble sharing their
// byte (kernels/interleaved_kquants.py writes them). Codes 0..31 from a 32-entry table.
template <bool kFifth>
struct KMinRows16 {
  static constexpr int64_t kValues = 32, kSuper = kFifth ? 2880 : 2368, kHead = 320;
  static constexpr int64_t kCodeStride = kFifth ? 320 : 256;
  static constexpr bool kHasMin = true;
  struct Table {
    __m512i codes, sixteen;
  };
  static inline Table table() {
    return {code_table(0, kFifth ? 32 : 16), _mm512_set1_epi16(16)};
  }
  static inline int64_t group_bytes(int64_t K) { return K / 256 * kSuper; }
  static inline const uint8_t* codes(const uint8_t* wg, int64_t b) {
    return wg + (b >> 3) * kSuper + kHead + (b & 7) * kCodeStride;
  }
  static inline __m512 bytes16(const uint8_t* p) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static inline void scales(const uint8_t* wg, int64_t b, __m512& d, __m512& m) {
    const uint8_t* h = wg + (b >> 3) * kSuper;
    const int64_t s = b & 7;
    d = _mm512_mul_ps(half16(h), bytes16(h + 64 + 16 * s));
    // -(dmin * mn), the sign flipped as the scalar decoder's negation (a zero stays signed)
    m = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(_mm512_mul_ps(half16(h + 32), bytes16(h + 192 + 16 * s))),
        _mm512_set1_epi32(static_cast<int>(0x80000000u))));
  }
  // Q5_K chunk c's two code pair vectors. vpermw reads an index's low 5 bits: a word's bits
  // 0-3 are its low nibble and bit 4 the high nibble's bit 0, which the lo mask's add of 16
  // turns into the fifth bit (the carry lands in bit 5, ignored); the high nibble shifted
  // down has a zero bit 4 for the hi mask's add to set.
  __attribute__((always_inline)) static inline void chunk5(const uint8_t* codes, int c,
                                                           const Table& t, __m512bh& lo,
                                                           __m512bh& hi) {
    const __m512i w = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * c)));
    const uint8_t* m = codes + 256 + 8 * c;
    __mmask32 klo, khi;
    std::memcpy(&klo, m, sizeof klo);
    std::memcpy(&khi, m + 4, sizeof khi);
    const __m512i wh = _mm512_srli_epi16(w, 4);
    const __m512i il = _mm512_mask_add_epi16(w, klo, w, t.sixteen);
    const __m512i ih = _mm512_mask_add_epi16(wh, khi, wh, t.sixteen);
    lo = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(il, t.codes));
    hi = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(ih, t.codes));
  }
  template <int MR, int BF, int NG>
  static inline void products(const uint8_t* codes, int64_t fstride, int64_t gstride,
                              const Table& table, const uint16_t* x, int64_t ldx,
                              __m512 (&s)[NG][BF][MR]) {
    if constexpr (!kFifth) {
      q4_products<MR, BF, NG>(codes, fstride, gstride, table.codes, x, ldx, s);
    } else {
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c)
#pragma GCC unroll 4
        for (int f = 0; f < BF; ++f) {
          __m512bh lo[NG], hi[NG];
#pragma GCC unroll 4
          for (int g = 0; g < NG; ++g)
            chunk5(codes + g * gstride + f * fstride, c, table, lo[g], hi[g]);
          const uint16_t* xf = x + 32 * f + 4 * c;
          mac<MR, BF, NG>(s, f, lo, xf, ldx);
          mac<MR, BF, NG>(s, f, hi, xf + 2, ldx);
        }
    }
  }
  static inline void pairs(const uint8_t* codes, const Table& table, __m512i (&pr)[16]) {
    if constexpr (!kFifth) {
      q4_pairs(codes, table.codes, pr);
    } else {
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        __m512bh lo, hi;
        chunk5(codes, c, table, lo, hi);
        pr[2 * c] = reinterpret_cast<__m512i>(lo);
        pr[2 * c + 1] = reinterpret_cast<__m512i>(hi);
      }
    }
  }
};
using Q4_KRows16 = KMinRows16<false>;
using Q5_KRows16 = KMinRows16<true>;

// Q6_K: a (group, super-block) is d[16] fp16 | sc[16][16] int8 | 16 sub-blocks of 16 values,
// each 4 chunks of low nibbles (as Q4's) then 2 x 32 bytes of high bits (vector p, byte
// 2i + j: row i's h[8p + j] | h[8p + 2 + j] << 2 | h[8p + 4 + j] << 4 | h[8p + 6 + j] << 6).
// Codes q - 32 (-32 .. 31) from a 64-entry table; chain block = sub-block (16 values), scale
// d * sc[s] (exact: 11 x 8 bits).
struct Q6_KRows16 {
  static constexpr int64_t kValues = 16, kSuper = 3360, kHead = 288, kCodeStride = 192;
  static constexpr bool kHasMin = false;
  struct Table {
    __m512i lo, hi, nibble;
  };
  static inline Table table() {
    return {code_table(-32, 32), code_table(0, 32), _mm512_set1_epi16(0x0F)};
  }
  static inline int64_t group_bytes(int64_t K) { return K / 256 * kSuper; }
  static inline const uint8_t* codes(const uint8_t* wg, int64_t b) {
    return wg + (b >> 4) * kSuper + kHead + (b & 15) * kCodeStride;
  }
  static inline void scales(const uint8_t* wg, int64_t b, __m512& d, __m512&) {
    const uint8_t* h = wg + (b >> 4) * kSuper;
    d = _mm512_mul_ps(half16(h), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                     reinterpret_cast<const __m128i*>(h + 32 + 16 * (b & 15))))));
  }
  // 6-bit index: low 4 bits from w, bits 4-5 from hb (higher bits are ignored by vpermt2w)
  __attribute__((always_inline)) static inline __m512bh lookup(const Table& t, __m512i w,
                                                               __m512i hb) {
    const __m512i idx = _mm512_ternarylogic_epi32(w, hb, t.nibble, 0xE4);  // c ? a : b
    return reinterpret_cast<__m512bh>(_mm512_permutex2var_epi16(t.lo, idx, t.hi));
  }
  // chunk c's two code pair vectors (values 4c, 4c + 1 and 4c + 2, 4c + 3 of the sub-block)
  __attribute__((always_inline)) static inline void chunk(const uint8_t* codes, int c,
                                                          const Table& table, __m512bh& lo,
                                                          __m512bh& hi) {
    const __m512i w = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * c)));
    const __m512i hb = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 128 + 32 * (c >> 1))));
    // chunk 2p: its pairs' high bits at bits 0-1 (low) and 2-3 (high); 2p + 1: 4-5, 6-7
    const __m512i hl = (c & 1) ? hb : _mm512_slli_epi16(hb, 4);
    const __m512i hh = (c & 1) ? _mm512_srli_epi16(hb, 2) : _mm512_slli_epi16(hb, 2);
    lo = lookup(table, w, hl);
    hi = lookup(table, _mm512_srli_epi16(w, 4), hh);
  }
  template <int MR, int BF, int NG>
  static inline void products(const uint8_t* codes, int64_t fstride, int64_t gstride,
                              const Table& table, const uint16_t* x, int64_t ldx,
                              __m512 (&s)[NG][BF][MR]) {
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c)
#pragma GCC unroll 4
      for (int f = 0; f < BF; ++f) {
        __m512bh lo[NG], hi[NG];
#pragma GCC unroll 4
        for (int g = 0; g < NG; ++g) chunk(codes + g * gstride + f * fstride, c, table, lo[g], hi[g]);
        const uint16_t* xf = x + 16 * f + 4 * c;
        mac<MR, BF, NG>(s, f, lo, xf, ldx);
        mac<MR, BF, NG>(s, f, hi, xf + 2, ldx);
      }
  }
  static inline void pairs(const uint8_t* codes, const Table& table, __m512i (&pr)[8]) {
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      __m512bh lo, hi;
      chunk(codes, c, table, lo, hi);
      pr[2 * c] = reinterpret_cast<__m512i>(lo);
      pr[2 * c + 1] = reinterpret_cast<__m512i>(hi);
    }
  }
};

// out[m * ldo + 16 g + i] for rows m < MR, groups g < NG (gstride bytes apart; the last one's
// lanes in `mask`), float32, or rounded to bfloat16 (nearest even, as .to(bfloat16)) into
// outb when that is set: the order at the top, BF chain blocks side by side. wg: group 0's
// first byte; nb: chain blocks in K; xs: the rows' sums of 32 activations (formats with a min;
// nb apart). The running sums live in an L1 buffer, not registers: every register goes to
// the chains.
template <typename Fmt, int MR, int BF, int NG>
void tile(const uint8_t* wg, int64_t gstride, int64_t nb, const uint16_t* x, int64_t ldx,
                const float* xs, float* out, uint16_t* outb, int64_t ldo, __mmask16 mask) {
  const typename Fmt::Table table = Fmt::table();
  alignas(64) float acc[NG][MR][16] = {};
  // acc = fma(d, s, acc) (with a min: then fma(m, xsum, acc)) for chain block b of each
  // group, its sums s[g][f][m] (s: [NG][BF][MR] in the loop, [NG][1][MR] for the last blocks)
  auto fold = [&](int64_t b, const auto& s, int f) {
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) {
      __m512 d, mn = _mm512_setzero_ps();
      Fmt::scales(wg + g * gstride, b, d, mn);
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
    Fmt::template products<MR, BF, NG>(Fmt::codes(wg, b), Fmt::kCodeStride, gstride, table,
                                       x + Fmt::kValues * b, ldx, s);
#pragma GCC unroll 4
    for (int f = 0; f < BF; ++f) fold(b + f, s, f);
  }
  for (; b < nb; ++b) {
    __m512 s[NG][1][MR];
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g)
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) s[g][0][m] = _mm512_setzero_ps();
    Fmt::template products<MR, 1, NG>(Fmt::codes(wg, b), Fmt::kCodeStride, gstride, table,
                                      x + Fmt::kValues * b, ldx, s);
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
