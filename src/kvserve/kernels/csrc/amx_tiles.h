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

}  // namespace kvserve_amx
#endif
