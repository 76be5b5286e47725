// x86 SIMD dequantizers: GGUF blocks -> float32, the same arithmetic as the portable decoders
// (quant_formats.cpp, quant_kquants.cpp; layouts documented there) on 16 codes at a time.
//
// NOT a normal header: quant_isa.cpp includes it once per ISA, inside that ISA's namespace
// and `#pragma GCC target` region, after defining the ISA's primitives:
//   float h2f(const uint8_t* p)                               fp16 at p -> float (F16C)
//   void store16(float* out, __m128i q, float s)              out[i] = float(q[i]) * s
//   void store16b(float* out, __m128i q, float s, float b)    out[i] = float(q[i]) * s + b
// (q: 16 signed int8 codes). The byte shuffling below is SSE2/SSSE3, valid on any AVX2 CPU.
// No include guard on purpose.

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// 16 bytes of packed nibbles -> low nibbles (values 0..15) and high nibbles (values 16..31).
inline void split_nibbles(__m128i qs, __m128i* lo, __m128i* hi) {
  const __m128i m4 = _mm_set1_epi8(0x0F);
  *lo = _mm_and_si128(qs, m4);
  *hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m4);  // 16-bit shift, then drop the neighbour's bits
}

// Bits 16h .. 16h+15 of a block's u32 qh -> 16 bytes, 0x10 where the bit is set (the fifth
// bit of values 16h .. 16h+15).
inline __m128i fifth_bits(const uint8_t* qh, int h) {
  const __m128i bytes = _mm_set1_epi16(static_cast<int16_t>(qh[2 * h] | (qh[2 * h + 1] << 8)));
  // byte j <- qh byte (j / 8), then test bit (j % 8)
  const __m128i spread = _mm_shuffle_epi8(bytes, _mm_set_epi64x(0x0101010101010101LL, 0));
  const __m128i bit = _mm_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit);
  return _mm_and_si128(set, _mm_set1_epi8(0x10));
}

void dequant_q4_0(const uint8_t* src, int64_t nblocks, float* out) {
  const __m128i eight = _mm_set1_epi8(8);
  for (int64_t b = 0; b < nblocks; ++b, src += 18, out += 32) {
    const float d = h2f(src);
    __m128i lo, hi;
    split_nibbles(load16(src + 2), &lo, &hi);
    store16(out, _mm_sub_epi8(lo, eight), d);  // d * (nibble - 8)
    store16(out + 16, _mm_sub_epi8(hi, eight), d);
  }
}

void dequant_q4_1(const uint8_t* src, int64_t nblocks, float* out) {
  for (int64_t b = 0; b < nblocks; ++b, src += 20, out += 32) {
    const float d = h2f(src), m = h2f(src + 2);
    __m128i lo, hi;
    split_nibbles(load16(src + 4), &lo, &hi);
    store16b(out, lo, d, m);  // d * nibble + m
    store16b(out + 16, hi, d, m);
  }
}

void dequant_q5_0(const uint8_t* src, int64_t nblocks, float* out) {
  const __m128i sixteen = _mm_set1_epi8(16);
  for (int64_t b = 0; b < nblocks; ++b, src += 22, out += 32) {
    const float d = h2f(src);
    __m128i lo, hi;
    split_nibbles(load16(src + 6), &lo, &hi);
    store16(out, _mm_sub_epi8(_mm_or_si128(lo, fifth_bits(src + 2, 0)), sixteen), d);
    store16(out + 16, _mm_sub_epi8(_mm_or_si128(hi, fifth_bits(src + 2, 1)), sixteen), d);
  }
}

void dequant_q5_1(const uint8_t* src, int64_t nblocks, float* out) {
  for (int64_t b = 0; b < nblocks; ++b, src += 24, out += 32) {
    const float d = h2f(src), m = h2f(src + 2);
    __m128i lo, hi;
    split_nibbles(load16(src + 8), &lo, &hi);
    store16b(out, _mm_or_si128(lo, fifth_bits(src + 4, 0)), d, m);
    store16b(out + 16, _mm_or_si128(hi, fifth_bits(src + 4, 1)), d, m);
  }
}

void dequant_q8_0(const uint8_t* src, int64_t nblocks, float* out) {
  for (int64_t b = 0; b < nblocks; ++b, src += 34, out += 32) {
    const float d = h2f(src);
    store16(out, load16(src + 2), d);
    store16(out + 16, load16(src + 18), d);
  }
}

// A Q4_K / Q5_K block's per-sub-block scale d * sc_j and bias -(dmin * m_j), the portable
// decoder's math (8 pairs per 256 values: scalar is fine).
inline void k_scales_mins(const uint8_t* src, float* scale, float* bias) {
  const float d = h2f(src), dmin = h2f(src + 2);
  const uint8_t* s = src + 4;
  for (int j = 0; j < 8; ++j) {
    const int sc = j < 4 ? (s[j] & 63) : ((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
    const int mn = j < 4 ? (s[j + 4] & 63) : ((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    scale[j] = d * static_cast<float>(sc);
    bias[j] = -(dmin * static_cast<float>(mn));
  }
}

void dequant_q4_k(const uint8_t* src, int64_t nblocks, float* out) {
  for (int64_t b = 0; b < nblocks; ++b, src += 144, out += 256) {
    float scale[8], bias[8];
    k_scales_mins(src, scale, bias);
    const uint8_t* qs = src + 16;
    for (int c = 0; c < 4; ++c)  // 32 bytes -> sub-blocks 2c (low nibbles), 2c+1 (high)
      for (int h = 0; h < 2; ++h) {
        __m128i lo, hi;
        split_nibbles(load16(qs + 32 * c + 16 * h), &lo, &hi);
        store16b(out + 64 * c + 16 * h, lo, scale[2 * c], bias[2 * c]);
        store16b(out + 64 * c + 32 + 16 * h, hi, scale[2 * c + 1], bias[2 * c + 1]);
      }
  }
}

void dequant_q5_k(const uint8_t* src, int64_t nblocks, float* out) {
  const __m128i one = _mm_set1_epi8(1);
  for (int64_t b = 0; b < nblocks; ++b, src += 176, out += 256) {
    float scale[8], bias[8];
    k_scales_mins(src, scale, bias);
    const uint8_t* qh = src + 16;
    const uint8_t* qs = src + 48;
    for (int h = 0; h < 2; ++h) {  // values l = 16h .. 16h + 15 of every sub-block
      const __m128i bits = load16(qh + 16 * h);  // bit s: sub-block s's fifth bit
      for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high)
        __m128i lo, hi;
        split_nibbles(load16(qs + 32 * c + 16 * h), &lo, &hi);
        const __m128i b0 = _mm_and_si128(_mm_srli_epi16(bits, 2 * c), one);
        const __m128i b1 = _mm_and_si128(_mm_srli_epi16(bits, 2 * c + 1), one);
        lo = _mm_or_si128(lo, _mm_slli_epi16(b0, 4));  // bit 0 -> 4: stays in its byte
        hi = _mm_or_si128(hi, _mm_slli_epi16(b1, 4));
        store16b(out + 64 * c + 16 * h, lo, scale[2 * c], bias[2 * c]);
        store16b(out + 64 * c + 32 + 16 * h, hi, scale[2 * c + 1], bias[2 * c + 1]);
      }
    }
  }
}

void dequant_q6_k(const uint8_t* src, int64_t nblocks, float* out) {
  const __m128i m4 = _mm_set1_epi8(0x0F), m2 = _mm_set1_epi8(0x03), off = _mm_set1_epi8(32);
  for (int64_t b = 0; b < nblocks; ++b, src += 210, out += 256) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(src + 192);
    const float d = h2f(src + 208);
    float scale[16];
    for (int g = 0; g < 16; ++g) scale[g] = d * static_cast<float>(sc[g]);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = src + 64 * h;
      const uint8_t* qh = src + 128 + 32 * h;
      float* o = out + 128 * h;
      const float* s = scale + 8 * h;
      for (int l0 = 0; l0 < 32; l0 += 16) {  // values l0.. of each of the 4 groups of 32
        const __m128i a = load16(ql + l0), c = load16(ql + 32 + l0), hb = load16(qh + l0);
        const int g = l0 / 16;
        // high 2 bits at shifts 0, 2, 4, 6 of qh, moved to bits 4-5 (16-bit shifts + masks)
        const __m128i h0 = _mm_slli_epi16(_mm_and_si128(hb, m2), 4);
        const __m128i h1 = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hb, 2), m2), 4);
        const __m128i h2 = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hb, 4), m2), 4);
        const __m128i h3 = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hb, 6), m2), 4);
        const __m128i q0 = _mm_or_si128(_mm_and_si128(a, m4), h0);
        const __m128i q1 = _mm_or_si128(_mm_and_si128(c, m4), h1);
        const __m128i q2 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), m4), h2);
        const __m128i q3 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(c, 4), m4), h3);
        store16(o + l0, _mm_sub_epi8(q0, off), s[g]);
        store16(o + 32 + l0, _mm_sub_epi8(q1, off), s[2 + g]);
        store16(o + 64 + l0, _mm_sub_epi8(q2, off), s[4 + g]);
        store16(o + 96 + l0, _mm_sub_epi8(q3, off), s[6 + g]);
      }
    }
  }
}

// Indexed by Format::index (quant_formats.cpp: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K,
// Q5_K).
constexpr DequantFn kDequant[kNumFormats] = {dequant_q4_0, dequant_q4_1, dequant_q5_0,
                                             dequant_q5_1, dequant_q8_0, dequant_q4_k,
                                             dequant_q6_k, dequant_q5_k};
