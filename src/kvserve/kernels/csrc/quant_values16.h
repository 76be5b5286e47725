// The 32-value formats decoded in registers, 16 lanes at a time: Q4_0, Q4_1, Q8_0 blocks ->
// two __m512 of float32 (values 0-15, 16-31), with the dequantizer's own float operations
// (quant_simd.h), so a kernel using them differs from dequantize-then-matmul only in how it
// sums.
//
// NOT a normal header (as quant_simd.h): included inside an AVX-512 target region and
// namespace, after that region defines
//   float h2f(const uint8_t* p)      fp16 at p -> float (F16C)
//   __m512 cvt16(__m128i q)          16 signed int8 -> float32
// quant_isa.cpp (the batch-1 GEMV) and quant_amx.cpp (AMX panels, rounded to bfloat16) include
// it. No include guard on purpose.

inline __m512i widen16u(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

struct Q4_0Values16 {
  static constexpr int kBytes = 18;
  static void get(const uint8_t* p, __m512* v) {
    const __m512 d = _mm512_set1_ps(h2f(p));
    const __m512i q = widen16u(p + 2), m4 = _mm512_set1_epi32(0x0F), eight = _mm512_set1_epi32(8);
    v[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(q, m4), eight)), d);
    v[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(q, 4), eight)), d);
  }
};

struct Q4_1Values16 {
  static constexpr int kBytes = 20;
  static void get(const uint8_t* p, __m512* v) {
    const __m512 d = _mm512_set1_ps(h2f(p)), m = _mm512_set1_ps(h2f(p + 2));
    const __m512i q = widen16u(p + 4), m4 = _mm512_set1_epi32(0x0F);
    // d * nibble + m (a multiply, then an add: the dequantizer's rounding)
    v[0] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, m4)), d), m);
    v[1] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d), m);
  }
};

struct Q8_0Values16 {
  static constexpr int kBytes = 34;
  static void get(const uint8_t* p, __m512* v) {
    const __m512 d = _mm512_set1_ps(h2f(p));
    v[0] = _mm512_mul_ps(cvt16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2))), d);
    v[1] = _mm512_mul_ps(cvt16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 18))), d);
  }
};
