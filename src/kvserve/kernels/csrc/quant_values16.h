// The 32-value formats decoded in registers, 16 lanes at a time: Q4_0, Q4_1, Q8_0 blocks ->
// two __m512 of float32 (values 0-15, 16-31), with the dequantizer's own float operations
// (quant_simd.h), so a kernel using them differs from dequantize-then-matmul only in how it
// sums.
//
// NOT a normal header (as quant_simd.h): included inside an AVX-512 target region and
// namespace, after that region defines
//   __m512 cvt16(__m128i q)          16 signed int8 -> float32
// quant_isa.cpp (the batch-1 GEMV) and quant_amx.cpp (AMX panels, rounded to bfloat16) include
// it. No include guard on purpose.

inline __m512i widen16u(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The 4-bit formats by table: a block's 16 possible values (d * (q - 8), or d * q + m) are
// computed once with the dequantizer's own float operations on q = 0..15 held exactly as
// floats, and each code picks its value with one vpermps (which reads only the low 4 bits of
// an index lane: the widened byte is the low nibble's index as it stands, >> 4 the high
// one's). Bit for bit the values of decoding each code, in ~10 vector ops per 32 values
// instead of ~16 (two conversions, two multiplies and two adds become two permutes).
inline __m512 nibble_iota() {
  return _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
}

// the fp16 at p as float32 in all 16 lanes (a word broadcast from memory, one conversion)
inline __m512 h2f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(bits)));
}

// the fp16 pair at p (d, then m) as floats in lanes 0, 1
inline __m128 h2f_pair(const uint8_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}

struct Q4_0Values16 {
  static constexpr int kBytes = 18;
  static void get(const uint8_t* p, __m512* v) {
    const __m512 d = h2f16(p);
    const __m512 table = _mm512_mul_ps(_mm512_sub_ps(nibble_iota(), _mm512_set1_ps(8.f)), d);
    const __m512i q = widen16u(p + 2);
    v[0] = _mm512_permutexvar_ps(q, table);
    v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
  }
};

struct Q4_1Values16 {
  static constexpr int kBytes = 20;
  static void get(const uint8_t* p, __m512* v) {
    const __m128 dm = h2f_pair(p);
    const __m512 d = _mm512_broadcastss_ps(dm), m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
    // d * q + m (a multiply, then an add: the dequantizer's rounding)
    const __m512 table = _mm512_add_ps(_mm512_mul_ps(nibble_iota(), d), m);
    const __m512i q = widen16u(p + 4);
    v[0] = _mm512_permutexvar_ps(q, table);
    v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
  }
};

struct Q8_0Values16 {
  static constexpr int kBytes = 34;
  static void get(const uint8_t* p, __m512* v) {
    const __m512 d = h2f16(p);
    v[0] = _mm512_mul_ps(cvt16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2))), d);
    v[1] = _mm512_mul_ps(cvt16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 18))), d);
  }
};
