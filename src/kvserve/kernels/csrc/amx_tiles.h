// The AMX tile set-up shared by the AMX kernels (quant_amx.cpp, prefill_attention.cpp):
// the target attribute and one configuration, every tile 16 rows x 64 bytes (16 x 32 bf16
// for A/B, 16 x 16 float32 for C). The configuration is per thread: each worker loads it
// before its first tile instruction and releases the tiles when done.
#pragma once

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define KV_AMX \
  __attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

namespace kvserve_amx {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

KV_AMX inline void configure_tiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {  // every tile 16 rows x 64 bytes
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// 16 x 16 float32 transpose: in rows r (stride 16) -> out rows (stride 16)
KV_AMX inline void transpose16(const float* in, float* out) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(in + 16 * i);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  // r[4g + j] holds, in each 128-bit lane L, column 4L' .. of rows 4g..4g+3; combine lanes
  for (int i = 0; i < 4; ++i) {
    // rows block g = 0..3 (4 rows each), element j within lane
    const __m512 a = r[i], b = r[4 + i], c = r[8 + i], d = r[12 + i];
    const __m512 ab_lo = _mm512_shuffle_f32x4(a, b, 0x88), ab_hi = _mm512_shuffle_f32x4(a, b, 0xDD);
    const __m512 cd_lo = _mm512_shuffle_f32x4(c, d, 0x88), cd_hi = _mm512_shuffle_f32x4(c, d, 0xDD);
    t[i] = _mm512_shuffle_f32x4(ab_lo, cd_lo, 0x88);
    t[8 + i] = _mm512_shuffle_f32x4(ab_lo, cd_lo, 0xDD);
    t[4 + i] = _mm512_shuffle_f32x4(ab_hi, cd_hi, 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(ab_hi, cd_hi, 0xDD);
  }
  for (int i = 0; i < 16; ++i) _mm512_store_ps(out + 16 * i, t[i]);
}

}  // namespace kvserve_amx
#endif
