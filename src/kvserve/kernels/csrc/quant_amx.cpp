// The AMX path of kvserve::quant_matmul_bf16: bfloat16 activations times GGUF-quantized
// weights through Intel AMX tiles (TDPBF16PS: 16 x 16 x 32 products per instruction, 8x
// VDPBF16PS's), on CPUs with AMX-BF16 (Sapphire Rapids and later Xeons).
//
//   x    (M, K) bfloat16, row-major;  w  (N, K) GGUF rows;  out (M, N) float32
//
// The arithmetic is the bf16 kernel's: each weight value dequantized to float32 exactly as
// gguf-py does, rounded to bfloat16, bf16 x bf16 products summed in float32. Only the
// summation order differs from the dequantize-then-GEMM reference.
//
// Roles are swapped so that dequantized weights need no reshuffle: per tile we compute
// out^T = W x^T, with
//   A tile (16 weight rows x 32 k, bf16): the rows as dequantized, row stride 64 bytes;
//   B tile (16 k pairs x 16 activation rows x 2, bf16): x packed once per call (VNNI pairs);
//   C tile (16 weight rows x 16 activation rows, float32): transposed into out on the way out.
// Per 32 weight rows (two A tiles, dequantized once for the whole K into an L2 buffer) and
// 32 activation rows (two B tiles), four C tiles accumulate over K: 4 loads per 4 products.
// Activation rows are padded to a multiple of 16 with zeros (an odd last tile runs alone);
// weight rows beyond N are zero.
//
// Why: at 64 rows (a batch of decodes) the VDPBF16PS kernel reaches ~190 GFLOP/s and
// dequantize + oneDNN pays a full float32 weight per call; AMX does the products ~8x faster
// and the weight is still read in its block format.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>

#include "amx_tiles.h"
#include "quant_kernels.h"
#include "transpose16.h"

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KV_HAVE_AMX 1
#endif

namespace kvserve_quant {

bool has_amx_bf16() {
#if defined(KV_HAVE_AMX)
  static const bool yes = [] {
    if (!has_avx512_bf16()) return false;  // the conversions below use AVX-512-BF16
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
    if (!tile || !bf16) return false;
    // Linux hands out the 8 KiB tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM
    // for XFEATURE_XTILEDATA); without it the first tile instruction faults.
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return yes;
#else
  return false;
#endif
}

#if defined(KV_HAVE_AMX)
namespace {

using kvserve_amx::configure_tiles;
using kvserve_simd::transpose16;

constexpr int kT = 16;         // tile rows (and 32-bit columns)
constexpr int kTileK = 32;     // bf16 values of k per tile row
constexpr int kTileElems = kT * kTileK;  // bf16 values per A or B tile (1 KiB)

// x (M, K) bf16 -> B tiles [m tile][k tile][16 k pairs][16 rows][2], rows >= M zero
void pack_activations(const uint16_t* x, int64_t M, int64_t K, int64_t mtiles, uint16_t* dst) {
  const int64_t ktiles = K / kTileK;
  std::memset(dst, 0, mtiles * ktiles * kTileElems * sizeof(uint16_t));
  for (int64_t m = 0; m < M; ++m) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(x + m * K);  // k pairs
    const int64_t mt = m / kT, c = m % kT;
    for (int64_t kt = 0; kt < ktiles; ++kt) {
      uint32_t* tile = reinterpret_cast<uint32_t*>(dst + (mt * ktiles + kt) * kTileElems);
      for (int kp = 0; kp < kT; ++kp) tile[kp * kT + c] = row[kt * kT + kp];
    }
  }
}

// n floats (a multiple of 32) -> bf16, round to nearest even
KV_AMX inline void to_bf16_32(const float* src, uint16_t* dst) {
  const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
  _mm512_store_si512(dst, reinterpret_cast<__m512i>(v));
}

// C tile (16 weight rows x 16 activation rows) -> out[(m0 + c) * N + n0 + r], c < mc, r < nc
KV_AMX void store_tile(const float* ct, float* scratch, float* out, int64_t N, int64_t m0,
                       int64_t n0, int mc, int nc) {
  transpose16(ct, 16, scratch, 16);  // scratch[c][r]
  const __mmask16 mask = nc == 16 ? __mmask16(0xFFFF) : __mmask16((1u << nc) - 1);
  for (int c = 0; c < mc; ++c)
    _mm512_mask_storeu_ps(out + (m0 + c) * N + n0, mask, _mm512_load_ps(scratch + 16 * c));
}

}  // namespace

// The 32-value formats straight into a tile row: a block is 32 values of k, one A-tile row
// (kTileK), decoded in registers (quant_values16.h: the dequantizer's float operations) and
// rounded to bfloat16 as to_bf16_32 does, without the float32 row in between. Measured on a
// 2-core Sapphire Rapids guest, best of 20, 2 threads: Q4_1 3072 x 576 at 16 rows 417 -> 314
// us, 1152 x 576 164 -> 133 us; at 64 rows 5-10% (the tile products dominate there).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma")
#endif
namespace values16 {
inline float h2f(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}
inline __m512 cvt16(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }
#include "quant_values16.h"

// One weight row of nblocks blocks -> bf16 at dst + b * stride (b: block = k tile)
template <typename Fmt>
void row_to_tiles(const uint8_t* src, int64_t nblocks, uint16_t* dst, int64_t stride) {
  for (int64_t b = 0; b < nblocks; ++b, src += Fmt::kBytes, dst += stride) {
    __m512 v[2];
    Fmt::get(src, v);
    _mm512_store_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v[1], v[0])));
  }
}
}  // namespace values16
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace {

using RowToTilesFn = void (*)(const uint8_t*, int64_t, uint16_t*, int64_t);
// by Format::index (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K, Q5_K); nullptr: via the float32 row
constexpr RowToTilesFn kRowToTiles[kNumFormats] = {
    values16::row_to_tiles<values16::Q4_0Values16>, values16::row_to_tiles<values16::Q4_1Values16>,
    nullptr, nullptr, values16::row_to_tiles<values16::Q8_0Values16>, nullptr, nullptr};

// Weight rows [n0, n0 + 32) dequantized into a panel: its two A-tile columns over all of K,
// [2][k tile][16 rows][32] bf16; rows beyond N zero. `row`: K floats of scratch.
KV_AMX void dequant_panel(const uint8_t* wp, int64_t row_bytes, const Format& f,
                          const IsaKernels& ik, int64_t K, int64_t n0, int nr, float* row,
                          uint16_t* apanel) {
  const int64_t ktiles = K / kTileK;
  const RowToTilesFn direct = kRowToTiles[f.index];
  for (int r = 0; r < 2 * kT; ++r) {
    uint16_t* base = apanel + (r / kT) * ktiles * kTileElems + (r % kT) * kTileK;
    if (r < nr && direct != nullptr) {
      direct(wp + (n0 + r) * row_bytes, ktiles, base, kTileElems);
    } else if (r < nr) {
      ik.dequant[f.index](wp + (n0 + r) * row_bytes, K / f.block_elems, row);
      for (int64_t kt = 0; kt < ktiles; ++kt) to_bf16_32(row + kt * kTileK, base + kt * kTileElems);
    } else {
      for (int64_t kt = 0; kt < ktiles; ++kt)
        std::memset(base + kt * kTileElems, 0, kTileK * sizeof(uint16_t));
    }
  }
}

// One panel (weight rows [n0, n0 + nr)) against every pair of activation tiles: four C tiles
// accumulate over K per pair, then go to out transposed. An odd last activation tile (M in
// (32j, 32j + 16]) runs alone on two C tiles: padding it to a pair did twice the tile
// products needed up to 16 rows (a third more at 40), and a batch of decodes shrinks through
// every M. Measured on the 2-core AMX Xeon, all 120 layer matmuls of the default model
// (fused shapes, from DRAM, 2 threads, 3 alternating rounds of a throwaway script): 8 rows
// 19.2-24.5 -> 13.2-15.6 ms, 16 rows 20.3-23.6 -> 14.6-17.3 ms; 40 and 48 rows within noise.
// (A single 3072 x 576 weight timed at 24..64 rows showed no gain, and this was once reverted
// for it; the gain is at 16 rows and fewer, where all the activations are one tile.
// Dequantizing each k tile right before its products, instead of the whole panel first, was
// tried for up to 32 rows: 15-20% slower at 1..32 rows, alternating A/B; so was a chunk of 8
// k tiles at a time (16 KiB, so that it and its B tiles stay in L1): ~10% slower. Also no
// gain, 4 alternating rounds at 8, 16 and 48 rows: the panel's fp16 scales converted ahead of
// its block loop (half the port-5 shuffles per block), and a software prefetch of the next
// panel's weights during this one's products.)
KV_AMX void panel_times_pairs(const uint16_t* apanel, const uint16_t* xpack, int64_t mtiles,
                              int64_t ktiles, int64_t M, int64_t N, int64_t n0, int nr,
                              float* ct, float* scratch, float* out) {
  const uint16_t* a0 = apanel;
  const uint16_t* a1 = apanel + ktiles * kTileElems;
  const int nc0 = std::min(nr, kT), nc1 = std::max(nr - kT, 0);
  for (int64_t mt = 0; mt < mtiles; mt += 2) {
    const uint16_t* b0 = xpack + mt * ktiles * kTileElems;
    const int64_t m0 = mt * kT;
    const int mc0 = static_cast<int>(std::clamp<int64_t>(M - m0, 0, kT));
    if (mt + 1 == mtiles) {  // the odd last tile
      _tile_zero(0);
      _tile_zero(2);
      for (int64_t kt = 0; kt < ktiles; ++kt) {
        _tile_loadd(4, a0 + kt * kTileElems, 64);
        _tile_loadd(5, a1 + kt * kTileElems, 64);
        _tile_loadd(6, b0 + kt * kTileElems, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
      }
      _tile_stored(0, ct, 64);
      store_tile(ct, scratch, out, N, m0, n0, mc0, nc0);
      if (nc1 > 0) {
        _tile_stored(2, ct, 64);
        store_tile(ct, scratch, out, N, m0, n0 + kT, mc0, nc1);
      }
      break;
    }
    const uint16_t* b1 = b0 + ktiles * kTileElems;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kt = 0; kt < ktiles; ++kt) {
      _tile_loadd(4, a0 + kt * kTileElems, 64);
      _tile_loadd(5, a1 + kt * kTileElems, 64);
      _tile_loadd(6, b0 + kt * kTileElems, 64);
      _tile_loadd(7, b1 + kt * kTileElems, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    const int mc1 = static_cast<int>(std::clamp<int64_t>(M - m0 - kT, 0, kT));
    _tile_stored(0, ct, 64);
    store_tile(ct, scratch, out, N, m0, n0, mc0, nc0);
    if (mc1 > 0) {
      _tile_stored(1, ct, 64);
      store_tile(ct, scratch, out, N, m0 + kT, n0, mc1, nc0);
    }
    if (nc1 > 0) {
      _tile_stored(2, ct, 64);
      store_tile(ct, scratch, out, N, m0, n0 + kT, mc0, nc1);
      if (mc1 > 0) {
        _tile_stored(3, ct, 64);
        store_tile(ct, scratch, out, N, m0 + kT, n0 + kT, mc1, nc1);
      }
    }
  }
}

// panels [p0, p1) of 32 weight rows against every activation tile; one thread's share. Each
// panel is dequantized, then every activation tile runs against it while it is in L1.
// (Blocking the activation rows for prefill-sized M, with panels dequantized a group at a
// time, was tried: 1.2-2x faster than this at 2048 rows, still 1.6-4x slower than
// dequantize + oneDNN there, which the measured row thresholds keep choosing.)
KV_AMX void amx_panels(int64_t p0, int64_t p1, const uint16_t* xpack, int64_t M, int64_t mtiles,
                       int64_t K, const uint8_t* wp, const Format& f, const IsaKernels& ik,
                       int64_t N, float* out) {
  const int64_t ktiles = K / kTileK;
  const int64_t row_bytes = K / f.block_elems * f.block_bytes;
  configure_tiles();
  uint16_t* apanel =
      static_cast<uint16_t*>(std::aligned_alloc(64, 2 * ktiles * kTileElems * sizeof(uint16_t)));
  float* row = static_cast<float*>(std::aligned_alloc(64, K * sizeof(float)));
  alignas(64) float ct[kT * kT];
  alignas(64) float scratch[kT * kT];
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * 2 * kT;
    const int nr = static_cast<int>(std::min<int64_t>(2 * kT, N - n0));
    dequant_panel(wp, row_bytes, f, ik, K, n0, nr, row, apanel);
    panel_times_pairs(apanel, xpack, mtiles, ktiles, M, N, n0, nr, ct, scratch, out);
  }
  std::free(row);
  std::free(apanel);
  _tile_release();
}

void amx_matmul(const uint16_t* x, int64_t M, int64_t K, const uint8_t* wp, const Format& f,
                const IsaKernels& ik, int64_t N, float* out) {
  const int64_t ktiles = K / kTileK;
  const int64_t mtiles = (M + kT - 1) / kT;  // B tiles: pairs, and maybe one odd last
  uint16_t* xpack = static_cast<uint16_t*>(
      std::aligned_alloc(64, mtiles * ktiles * kTileElems * sizeof(uint16_t)));
  pack_activations(x, M, K, mtiles, xpack);
  const int64_t npanels = (N + 2 * kT - 1) / (2 * kT);
  at::parallel_for(0, npanels, 1, [&](int64_t p0, int64_t p1) {
    amx_panels(p0, p1, xpack, M, mtiles, K, wp, f, ik, N, out);
  });
  std::free(xpack);
}

}  // namespace
#endif  // KV_HAVE_AMX

bool quant_matmul_amx_raw(const uint16_t* x, int64_t M, int64_t K, const uint8_t* w,
                          int64_t qtype, int64_t N, float* out) {
#if defined(KV_HAVE_AMX)
  if (!has_amx_bf16() || K % 32 != 0) return false;
  amx_matmul(x, M, K, w, *find_format(qtype), isa_kernels(kAvx512), N, out);
  return true;
#else
  (void)x, (void)M, (void)K, (void)w, (void)qtype, (void)N, (void)out;
  return false;
#endif
}

}  // namespace kvserve_quant
