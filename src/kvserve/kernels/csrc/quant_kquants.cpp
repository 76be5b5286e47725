// Decoders of the 256-value "K-quant" super-blocks (Q4_K, Q5_K, Q6_K) into int8 codes plus
// per-16 scale/bias (see quant_kernels.h); layouts from llama.cpp's ggml-common.h.
//
//   block_q4_K (144 B): fp16 d | fp16 dmin | u8 scales[12] | u8 qs[128]
//     8 sub-blocks of 32 values, each with a 6-bit scale sc_j and 6-bit min m_j packed in
//     scales[12] (get_scale_min_k4). value = (d * sc_j) * nibble - (dmin * m_j).
//     qs in 4 chunks of 32 bytes: chunk c's low nibbles are sub-block 2c, high nibbles 2c+1.
//   block_q5_K (176 B): fp16 d | fp16 dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]
//     Q4_K's scales and nibbles, plus a fifth bit: value 32s + l of sub-block s has bit s of
//     qh[l] as its bit 4. value = (d * sc_s) * q5 - (dmin * m_s).
//   block_q6_K (210 B): u8 ql[128] | u8 qh[64] | i8 scales[16] | fp16 d
//     value = (d * scales[i / 16]) * (q6 - 32), q6 = 4 low bits from ql, 2 high bits from qh.
//     Per half h (128 values): ql = ql + 64h, qh = qh + 32h; for l < 32:
//       value l      : ql[l]      & 15 | (qh[l] >> 0 & 3) << 4
//       value l + 32 : ql[l + 32] & 15 | (qh[l] >> 2 & 3) << 4
//       value l + 64 : ql[l]      >> 4 | (qh[l] >> 4 & 3) << 4
//       value l + 96 : ql[l + 32] >> 4 | (qh[l] >> 6 & 3) << 4
#include <cstring>

#include "quant_kernels.h"

namespace kvserve_quant {

namespace {

inline float load_half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return half_to_float(bits);
}

// llama.cpp's get_scale_min_k4: sub-block j's 6-bit scale and min from the 12 packed bytes
//   bytes 0-3: sc_0..3 (low 6 bits), high 2 bits = high bits of sc_4..7
//   bytes 4-7: m_0..3  (low 6 bits), high 2 bits = high bits of m_4..7
//   bytes 8-11: low nibble = low 4 bits of sc_4..7, high nibble = low 4 bits of m_4..7
inline void scale_min_k4(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// A Q4_K / Q5_K block's scale and bias per group of 16 values (two per 32-value sub-block).
// gguf-py: d * sc then (d * sc) * q - dmin * m; the bias is the negated product.
void k_scales_mins16(const uint8_t* src, float* scale, float* bias) {
  const float d = load_half(src);
  const float dmin = load_half(src + 2);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    scale_min_k4(j, src + 4, &sc, &m);
    scale[2 * j] = scale[2 * j + 1] = d * static_cast<float>(sc);
    bias[2 * j] = bias[2 * j + 1] = -(dmin * static_cast<float>(m));
  }
}

}  // namespace

void decode_q4_k(const uint8_t* src, int64_t nblocks, int8_t* q, float* scale, float* bias) {
  for (int64_t b = 0; b < nblocks; ++b, src += 144, q += 256, scale += 16, bias += 16) {
    k_scales_mins16(src, scale, bias);
    const uint8_t* qs = src + 16;
    for (int c = 0; c < 4; ++c) {
      const uint8_t* chunk = qs + 32 * c;
      int8_t* out = q + 64 * c;
      for (int l = 0; l < 32; ++l) {
        out[l] = static_cast<int8_t>(chunk[l] & 0x0F);
        out[l + 32] = static_cast<int8_t>(chunk[l] >> 4);
      }
    }
  }
}

void decode_q5_k(const uint8_t* src, int64_t nblocks, int8_t* q, float* scale, float* bias) {
  for (int64_t b = 0; b < nblocks; ++b, src += 176, q += 256, scale += 16, bias += 16) {
    k_scales_mins16(src, scale, bias);
    const uint8_t* qh = src + 16;
    const uint8_t* qs = src + 48;
    for (int s = 0; s < 8; ++s)
      for (int l = 0; l < 32; ++l) {
        const int nib = (qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0x0F;
        q[32 * s + l] = static_cast<int8_t>(nib | (((qh[l] >> s) & 1) << 4));
      }
  }
}

void decode_q6_k(const uint8_t* src, int64_t nblocks, int8_t* q, float* scale, float*) {
  for (int64_t b = 0; b < nblocks; ++b, src += 210, q += 256, scale += 16) {
    const uint8_t* ql = src;
    const uint8_t* qh = src + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(src + 192);
    const float d = load_half(src + 208);
    for (int g = 0; g < 16; ++g) scale[g] = d * static_cast<float>(sc[g]);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* l4 = ql + 64 * h;
      const uint8_t* h2 = qh + 32 * h;
      int8_t* out = q + 128 * h;
      for (int l = 0; l < 32; ++l) {
        out[l] = static_cast<int8_t>(((l4[l] & 0x0F) | ((h2[l] & 3) << 4)) - 32);
        out[l + 32] = static_cast<int8_t>(((l4[l + 32] & 0x0F) | (((h2[l] >> 2) & 3) << 4)) - 32);
        out[l + 64] = static_cast<int8_t>(((l4[l] >> 4) | (((h2[l] >> 4) & 3) << 4)) - 32);
        out[l + 96] = static_cast<int8_t>(((l4[l + 32] >> 4) | (((h2[l] >> 6) & 3) << 4)) - 32);
      }
    }
  }
}

}  // namespace kvserve_quant
