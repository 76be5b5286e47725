// Decoders of the 32-value GGUF block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) into int8 codes
// plus per-16 scale/bias (see quant_kernels.h). Plain C++ that GCC vectorizes with the
// baseline ISA; the formats follow llama.cpp's ggml-common.h:
//
//   block_q4_0 (18 B): fp16 d | u8 qs[16]                value = d * (nibble - 8)
//   block_q4_1 (20 B): fp16 d | fp16 m | u8 qs[16]       value = d * nibble + m
//   block_q5_0 (22 B): fp16 d | u32 qh | u8 qs[16]       value = d * (nibble | bit << 4) - 16 d
//   block_q5_1 (24 B): fp16 d | fp16 m | u32 qh | qs[16] value = d * (nibble | bit << 4) + m
//   block_q8_0 (34 B): fp16 d | i8 qs[32]                value = d * qs
//
// In a 4/5-bit block, value j < 16 is the low nibble of qs[j] and value j + 16 its high
// nibble; qh bit j (little-endian u32) is the fifth bit of value j.
#include <c10/util/Half.h>

#include <cstring>

#include "quant_kernels.h"

namespace kvserve_quant {

float half_to_float(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

namespace {

inline float load_half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return half_to_float(bits);
}

// Nibbles of qs[16] -> 32 codes (low nibbles first), minus `offset`.
inline void unpack_nibbles(const uint8_t* qs, int offset, int8_t* q) {
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>((qs[j] & 0x0F) - offset);
    q[j + 16] = static_cast<int8_t>((qs[j] >> 4) - offset);
  }
}

// 5-bit codes: nibbles plus bit j of qh as bit 4, minus `offset`.
inline void unpack_5bit(const uint8_t* qh_bytes, const uint8_t* qs, int offset, int8_t* q) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
    const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    q[j] = static_cast<int8_t>(lo - offset);
    q[j + 16] = static_cast<int8_t>(hi - offset);
  }
}

}  // namespace

void decode_q4_0(const uint8_t* src, int64_t nblocks, int8_t* q, float* scale, float*) {
  for (int64_t b = 0; b < nblocks; ++b, src += 18, q += 32, scale += 2) {
    scale[0] = scale[1] = load_half(src);
    unpack_nibbles(src + 2, 8, q);
  }
}

void decode_q4_1(const uint8_t* src, int64_t nblocks, int8_t* q, float* scale, float* bias) {
  for (int64_t b = 0; b < nblocks; ++b, src += 20, q += 32, scale += 2, bias += 2) {
    scale[0] = scale[1] = load_half(src);
    bias[0] = bias[1] = load_half(src + 2);
    unpack_nibbles(src + 4, 0, q);
  }
}

void decode_q5_0(const uint8_t* src, int64_t nblocks, int8_t* q, float* scale, float*) {
  for (int64_t b = 0; b < nblocks; ++b, src += 22, q += 32, scale += 2) {
    scale[0] = scale[1] = load_half(src);
    unpack_5bit(src + 2, src + 6, 16, q);
  }
}

void decode_q5_1(const uint8_t* src, int64_t nblocks, int8_t* q, float* scale, float* bias) {
  for (int64_t b = 0; b < nblocks; ++b, src += 24, q += 32, scale += 2, bias += 2) {
    scale[0] = scale[1] = load_half(src);
    bias[0] = bias[1] = load_half(src + 2);
    unpack_5bit(src + 4, src + 8, 0, q);
  }
}

void decode_q8_0(const uint8_t* src, int64_t nblocks, int8_t* q, float* scale, float*) {
  for (int64_t b = 0; b < nblocks; ++b, src += 34, q += 32, scale += 2) {
    scale[0] = scale[1] = load_half(src);
    std::memcpy(q, src + 2, 32);
  }
}

const Format* find_format(int64_t qtype) {
  // {block_elems, block_bytes, has_bias, decode, index}; sizes as gguf.GGML_QUANT_SIZES.
  static const Format q4_0{32, 18, false, decode_q4_0, 0};
  static const Format q4_1{32, 20, true, decode_q4_1, 1};
  static const Format q5_0{32, 22, false, decode_q5_0, 2};
  static const Format q5_1{32, 24, true, decode_q5_1, 3};
  static const Format q8_0{32, 34, false, decode_q8_0, 4};
  static const Format q4_k{256, 144, true, decode_q4_k, 5};
  static const Format q6_k{256, 210, false, decode_q6_k, 6};
  static const Format q5_k{256, 176, true, decode_q5_k, 7};
  switch (qtype) {
    case kQ4_0: return &q4_0;
    case kQ4_1: return &q4_1;
    case kQ5_0: return &q5_0;
    case kQ5_1: return &q5_1;
    case kQ8_0: return &q8_0;
    case kQ4_K: return &q4_k;
    case kQ5_K: return &q5_k;
    case kQ6_K: return &q6_k;
    default: return nullptr;
  }
}

}  // namespace kvserve_quant
