// kvserve::paged_prefill_attention: causal attention of prefill chunks over a bfloat16 paged
// KV cache, read through the block tables, on AMX tiles (CPUs with AMX-BF16) or with
// VDPBF16PS (AVX-512-BF16 without AMX: prefill_tiles_bf16.h).
//
//   q      (T, H, D) bf16: the chunks' queries, request b owning rows [qsl[b], qsl[b + 1])
//   caches (num_blocks, bs, KVH, D) bf16;  block_tables (B, width);  seq_lens (B)
//   out    (T, H, D) bf16
//
// Request b's chunk of n = qsl[b + 1] - qsl[b] tokens is its last n of seq_lens[b]: query t
// sits at position offset + t (offset = seq_lens[b] - n, the tokens already cached) and sees
// keys 0 .. offset + t, as kvserve.attention.backend.causal_attention. Query head h uses KV
// head h / (H / KVH).
//
// Why: prefill went through SDPA's flash kernel one request at a time, after gathering the
// request's blocks; on a 2-core Sapphire Rapids guest that ran at ~60 GFLOP/s and took a
// quarter of offline-64's prefill (on a Zen 4, 3.5 of its ~13 s). AMX does the two products
// 16 x 16 x 32 per instruction; VDPBF16PS 16 x 2 per instruction, from the same packing.
//
// Flash attention with rows = (token, head of the KV group) pairs, 16 per work item (one A /
// C tile height), so a KV head's keys serve its whole query group at once:
//   1. pack each (request, KV head)'s keys and values once into B-tile order, per 64 keys:
//      Kp [4 key tiles][D / 32][16 dim pairs][16 keys][2];  Vp [2 key halves][D / 16][16 key
//      pairs][16 dims][2]; keys past seq_len zero;
//   2. per work item (request, KV head, 16 rows) and pair of 64-key blocks up to its last
//      visible key: S = Q K^T (4 C tiles per block), masked online softmax in float32
//      (AVX-512) over both, P rounded to bf16, O (float32, in C tiles 16 dims each) =
//      O * alpha + P V.
// The arithmetic is SDPA's flash kernel's: bf16 products summed in float32, P in bf16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "amx_tiles.h"
#include "quant_kernels.h"  // kvserve_quant::has_amx_bf16
#include "transpose16.h"
#include "vec_exp.h"

namespace {

constexpr int kT = 16;    // tile rows
constexpr int kKB = 64;   // keys per packed block: 4 key tiles
constexpr int kSpan = 2;  // blocks per softmax pass (128 keys: its per-row fixed costs halved)
constexpr int kSK = kSpan * kKB;  // row stride of S and P
constexpr int kTileK = 32;  // bf16 values per tile row

#if defined(__x86_64__) && defined(__linux__)

using kvserve_simd::transpose16;

#include "prefill_tiles_bf16.h"

// Keys [0, L) of one KV head -> nkb blocks of Kp and Vp (see the top), zero past L. Per 16
// keys (one key tile): K's dim pairs are a 16 x 16 transpose of 32-bit words; V's key pairs
// interleave two rows' bf16 values.
KV_AMX void pack_head(const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t L,
                      int64_t nkb, int64_t bs, int64_t KVH, int64_t D, int64_t h, uint16_t* kp,
                      uint16_t* vp) {
  alignas(64) static const uint16_t zeros[256] = {};  // a row past L (D <= 256)
  alignas(64) uint32_t words[kT * kT];
  const int64_t kts = D / 32, dts = D / 16, per_block = int64_t(kKB) * D, full = L / kKB;
  if (nkb > full) {  // the partial last block: its keys past L stay zero
    std::memset(kp + full * per_block, 0, per_block * sizeof(uint16_t));
    std::memset(vp + full * per_block, 0, per_block * sizeof(uint16_t));
  }
  // (a0..a15, b0..b15) -> a0 b0 a1 b1 ... a15 b15: one V tile row
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                              9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                              17, 1, 16, 0);
  for (int64_t j0 = 0; j0 < L; j0 += kT) {
    const uint16_t *krow[kT], *vrow[kT];
    for (int64_t r = 0; r < kT; ++r) {
      const int64_t j = j0 + r;
      const int64_t off = j < L ? ((table[j / bs] * bs + j % bs) * KVH + h) * D : -1;
      krow[r] = off < 0 ? zeros : kc + off;
      vrow[r] = off < 0 ? zeros : vc + off;
    }
    const int64_t kb = j0 / kKB, jj = j0 % kKB;
    uint16_t* kblk = kp + kb * per_block + (jj / kT) * kts * kT * kTileK;
    for (int64_t kt = 0; kt < kts; ++kt) {  // 16 keys x 16 dim pairs -> 16 dim pairs x 16 keys
      for (int r = 0; r < kT; ++r)
        _mm512_store_si512(words + r * kT, _mm512_loadu_si512(krow[r] + kt * kTileK));
      transpose16(reinterpret_cast<const float*>(words), kT,
                  reinterpret_cast<float*>(kblk + kt * kT * kTileK), kT);
    }
    uint16_t* vblk = vp + kb * per_block + (jj / 32) * dts * kT * kTileK;
    for (int64_t p = 0; p < kT / 2; ++p) {  // key pair (jj % 32) / 2 + p of its half
      const int64_t pair = (jj % 32) / 2 + p;
      for (int64_t dt = 0; dt < dts; ++dt) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[2 * p] + dt * kT));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[2 * p + 1] + dt * kT));
        const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        _mm512_store_si512(vblk + (dt * kT + pair) * kTileK, _mm512_permutexvar_epi16(interleave, ab));
      }
    }
  }
}

struct Item {
  int64_t req, head, row0;  // request, KV head, first of its 16 rows
};

struct Scratch {  // one worker's buffers, 64-byte aligned rows
  alignas(64) uint16_t q[kT * 256];   // 16 rows x D (<= 256) bf16
  alignas(64) float s[kT * kSK];      // scores of up to kSpan blocks
  alignas(64) uint16_t p[kT * kSK];   // probabilities, bf16
  alignas(64) float o[kT * 256];      // output accumulators
  float m[kT], l[kT];
  int64_t last[kT];                   // last visible key per row
};

// S (16 x 64) = Q (16 x D) K^T for key block kblk
KV_AMX void scores(const uint16_t* q, const uint16_t* kblk, int64_t D, float* s) {
  const int64_t kts = D / 32;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kt = 0; kt < kts; ++kt) {
    _tile_loadd(4, q + kt * 32, D * 2);
    _tile_loadd(5, kblk + (0 * kts + kt) * 512, 64);
    _tile_loadd(6, kblk + (1 * kts + kt) * 512, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(7, kblk + (2 * kts + kt) * 512, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, kblk + (3 * kts + kt) * 512, 64);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, s, kSK * 4);
  _tile_stored(1, s + 16, kSK * 4);
  _tile_stored(2, s + 32, kSK * 4);
  _tile_stored(3, s + 48, kSK * 4);
}

// O (16 x D) += P (16 x 64) V for value block vblk, 64 dims (4 C tiles) at a time
KV_AMX void values(const uint16_t* p, const uint16_t* vblk, int64_t D, float* o) {
  const int64_t dts = D / 16;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    _tile_loadd(0, o + d0, D * 4);
    _tile_loadd(1, o + d0 + 16, D * 4);
    _tile_loadd(2, o + d0 + 32, D * 4);
    _tile_loadd(3, o + d0 + 48, D * 4);
    for (int64_t half = 0; half < 2; ++half) {
      const uint16_t* vt = vblk + (half * dts + d0 / 16) * 512;
      _tile_loadd(4, p + half * 32, kSK * 2);
      _tile_loadd(5, vt, 64);
      _tile_loadd(6, vt + 512, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(7, vt + 1024, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, vt + 1536, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, o + d0, D * 4);
    _tile_stored(1, o + d0 + 16, D * 4);
    _tile_stored(2, o + d0 + 32, D * 4);
    _tile_stored(3, o + d0 + 48, D * 4);
  }
}

// Online softmax of the keys [k0, k0 + n) (n <= kSK, whole blocks) over the 16 rows of S:
// P <- exp(S * scale - m), masked past each row's last key; m, l and O updated.
KV_AMX void softmax_span(Scratch& w, int64_t k0, int64_t n, int64_t D, float scale) {
  constexpr int kV = kSK / 16;  // vectors per row
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int r = 0; r < kT; ++r) {
    const int64_t visible = std::min<int64_t>(n, w.last[r] - k0 + 1);
    uint16_t* prow = w.p + r * kSK;
    if (visible <= 0) {  // nothing of these keys for this row (the tile's earlier tokens)
      std::memset(prow, 0, n * 2);
      continue;
    }
    const int nv = static_cast<int>(n / 16);
    __m512 x[kV];
    __mmask16 keep[kV];
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int c = 0; c < nv; ++c) {
      const int64_t left = std::clamp<int64_t>(visible - 16 * c, 0, 16);
      keep[c] = left == 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      x[c] = _mm512_mul_ps(_mm512_loadu_ps(w.s + r * kSK + 16 * c), vscale);
      mx = _mm512_mask_max_ps(mx, keep[c], mx, x[c]);
    }
    const float m_new = std::max(w.m[r], _mm512_reduce_max_ps(mx));
    const float alpha = std::exp(w.m[r] - m_new);  // 0 on the first keys (m = -inf)
    const __m512 vm = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < nv; ++c) {
      x[c] = _mm512_maskz_mov_ps(keep[c], kvserve_vec::exp512(_mm512_sub_ps(x[c], vm)));
      sum = _mm512_add_ps(sum, x[c]);
    }
    for (int c = 0; c < nv; c += 2)
      _mm512_storeu_si512(prow + 16 * c,
                          reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(x[c + 1], x[c])));
    w.l[r] = w.l[r] * alpha + _mm512_reduce_add_ps(sum);
    w.m[r] = m_new;
    if (alpha != 1.f) {
      const __m512 va = _mm512_set1_ps(alpha);
      float* orow = w.o + r * D;
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), va));
    }
  }
}

struct Problem {
  const uint16_t* q;
  uint16_t* out;
  const int64_t *qsl, *lens;
  const uint16_t *kp, *vp;         // packed keys / values
  const int64_t* pack_off;         // per request: first packed block of its KV head 0
  int64_t H, KVH, D, G;
  float scale;
};

template <bool Amx>
KV_AMX void run_item(const Problem& pb, const Item& it, Scratch& w) {
  const int64_t D = pb.D, G = pb.G, b = it.req;
  const int64_t n = pb.qsl[b + 1] - pb.qsl[b], rows = n * G, offset = pb.lens[b] - n;
  const int64_t nkb_req = (pb.lens[b] + kKB - 1) / kKB;
  int64_t last_max = 0;
  for (int r = 0; r < kT; ++r) {
    const int64_t row = std::min(it.row0 + r, rows - 1);  // padding rows repeat the last
    const int64_t t = row / G, g = row % G;
    std::memcpy(w.q + r * D, pb.q + ((pb.qsl[b] + t) * pb.H + it.head * G + g) * D, D * 2);
    w.last[r] = offset + t;
    last_max = std::max(last_max, w.last[r]);
    w.m[r] = -std::numeric_limits<float>::infinity();
    w.l[r] = 0.f;
  }
  std::memset(w.o, 0, kT * D * sizeof(float));
  const int64_t per_block = int64_t(kKB) * D;
  const int64_t base = (pb.pack_off[b] + it.head * nkb_req) * per_block;
  const int64_t nkb = last_max / kKB + 1;  // blocks with a visible key
  for (int64_t kb = 0; kb < nkb; kb += kSpan) {
    const int64_t span = std::min<int64_t>(kSpan, nkb - kb);
    for (int64_t j = 0; j < span; ++j) {
      if constexpr (Amx)
        scores(w.q, pb.kp + base + (kb + j) * per_block, D, w.s + j * kKB);
      else
        scores_bf16(w.q, pb.kp + base + (kb + j) * per_block, D, w.s + j * kKB);
    }
    softmax_span(w, kb * kKB, span * kKB, D, pb.scale);
    for (int64_t j = 0; j < span; ++j) {
      if constexpr (Amx)
        values(w.p + j * kKB, pb.vp + base + (kb + j) * per_block, D, w.o);
      else
        values_bf16(w.p + j * kKB, pb.vp + base + (kb + j) * per_block, D, w.o);
    }
  }
  for (int r = 0; r < kT && it.row0 + r < rows; ++r) {
    const int64_t row = it.row0 + r, t = row / G, g = row % G;
    uint16_t* dst = pb.out + ((pb.qsl[b] + t) * pb.H + it.head * G + g) * D;
    const __m512 inv = _mm512_set1_ps(1.f / w.l[r]);
    for (int64_t d = 0; d < D; d += 16) {
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(w.o + r * D + d), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), reinterpret_cast<__m256i>(v));
    }
  }
}

template <bool Amx>
KV_AMX void run_items(const Problem& pb, const std::vector<Item>& items, std::atomic<int64_t>& next) {
  if constexpr (Amx) kvserve_amx::configure_tiles();
  auto w = std::make_unique<Scratch>();
  for (int64_t i = next.fetch_add(1); i < int64_t(items.size()); i = next.fetch_add(1))
    run_item<Amx>(pb, items[i], *w);
  if constexpr (Amx) _tile_release();
}

#endif  // x86_64 Linux

at::Tensor paged_prefill_attention_cpu(const at::Tensor& q, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache,
                                       const at::Tensor& block_tables,
                                       const at::Tensor& query_start_loc,
                                       const at::Tensor& seq_lens, double scale,
                                       int64_t tiles) {
  TORCH_CHECK(tiles >= -1 && tiles <= 1, "paged_prefill_attention: tiles must be -1 (best), "
              "0 (VDPBF16PS) or 1 (AMX), got ", tiles);
  const bool amx_ok = kvserve_quant::has_amx_bf16();
  TORCH_CHECK(kvserve_quant::has_avx512_bf16() && (tiles != 1 || amx_ok),
              "paged_prefill_attention", tiles == 1 ? " on AMX tiles needs AMX-BF16 (and the "
              "OS's tile permission)" : " needs AVX-512-BF16", "; this CPU has not: use "
              "kvserve.attention.backend.causal_attention");
  const bool amx = tiles == 1 || (tiles == -1 && amx_ok);
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.is_contiguous(),
              "paged_prefill_attention: q must be contiguous (T, H, D) bfloat16, got ",
              q.sizes(), " ", q.scalar_type());
  for (const at::Tensor* c : {&key_cache, &value_cache})
    TORCH_CHECK(c->dim() == 4 && c->scalar_type() == at::kBFloat16 && c->is_contiguous(),
                "paged_prefill_attention: caches must be contiguous (num_blocks, block_size, "
                "kv_heads, head_dim) bfloat16, got ", c->sizes(), " ", c->scalar_type());
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(),
              "paged_prefill_attention: key and value caches differ in shape");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = key_cache.size(0), bs = key_cache.size(1), KVH = key_cache.size(2);
  TORCH_CHECK(D % 64 == 0 && D <= 256 && key_cache.size(3) == D,
              "paged_prefill_attention: head_dim must be a multiple of 64 up to 256 and equal "
              "in q and caches, got ", D, " and ", key_cache.size(3));
  TORCH_CHECK(KVH >= 1 && H % KVH == 0, "paged_prefill_attention: num_heads ", H,
              " is not a multiple of num_kv_heads ", KVH);
  const int64_t B = seq_lens.numel();
  TORCH_CHECK(query_start_loc.numel() == B + 1 && block_tables.dim() == 2 &&
                  block_tables.size(0) == B,
              "paged_prefill_attention: query_start_loc must have B + 1 entries and "
              "block_tables B rows, B = ", B);
  auto qsl_t = query_start_loc.to(at::kLong).contiguous();
  auto lens_t = seq_lens.to(at::kLong).contiguous();
  auto tables_t = block_tables.to(at::kLong).contiguous();
  const int64_t *qsl = qsl_t.data_ptr<int64_t>(), *lens = lens_t.data_ptr<int64_t>();
  const int64_t* tables = tables_t.data_ptr<int64_t>();
  const int64_t width = block_tables.size(1);
  TORCH_CHECK(qsl[0] == 0 && qsl[B] == T, "paged_prefill_attention: query_start_loc must run "
              "from 0 to T = ", T, ", got ", qsl[0], " .. ", qsl[B]);
  std::vector<int64_t> pack_off(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = qsl[b + 1] - qsl[b];
    TORCH_CHECK(n >= 1 && n <= lens[b] && lens[b] <= width * bs, "paged_prefill_attention: "
                "request ", b, " has ", n, " queries and seq_len ", lens[b], "; need 1 <= "
                "queries <= seq_len <= ", width * bs, " (block_tables width x block_size)");
    for (int64_t j = 0; j * bs < lens[b]; ++j)
      TORCH_CHECK(tables[b * width + j] >= 0 && tables[b * width + j] < NB, "block_tables[", b,
                  ", ", j, "] = ", tables[b * width + j], " is not a block id in [0, ", NB, ")");
    pack_off[b + 1] = pack_off[b] + KVH * ((lens[b] + kKB - 1) / kKB);
  }
  auto out = at::empty_like(q);
#if defined(__x86_64__) && defined(__linux__)
  const int64_t per_block = int64_t(kKB) * D;
  auto kpack = at::empty({pack_off[B] * per_block}, q.options());
  auto vpack = at::empty({pack_off[B] * per_block}, q.options());
  auto* kp = reinterpret_cast<uint16_t*>(kpack.data_ptr());
  auto* vp = reinterpret_cast<uint16_t*>(vpack.data_ptr());
  const auto* kc = reinterpret_cast<const uint16_t*>(key_cache.data_ptr());
  const auto* vc = reinterpret_cast<const uint16_t*>(value_cache.data_ptr());
  at::parallel_for(0, B * KVH, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / KVH, h = i % KVH, nkb = (lens[b] + kKB - 1) / kKB;
      const int64_t at_ = (pack_off[b] + h * nkb) * per_block;
      pack_head(kc, vc, tables + b * width, lens[b], nkb, bs, KVH, D, h, kp + at_, vp + at_);
    }
  });
  const int64_t G = H / KVH;
  std::vector<Item> items;  // the longest (last rows: most keys) first, for the balance
  for (int64_t b = 0; b < B; ++b)
    for (int64_t row0 = ((qsl[b + 1] - qsl[b]) * G - 1) / kT * kT; row0 >= 0; row0 -= kT)
      for (int64_t h = 0; h < KVH; ++h) items.push_back({b, h, row0});
  std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) {
    return lens[x.req] - (qsl[x.req + 1] - qsl[x.req]) + x.row0 / G >
           lens[y.req] - (qsl[y.req + 1] - qsl[y.req]) + y.row0 / G;
  });
  const Problem pb{reinterpret_cast<const uint16_t*>(q.data_ptr()),
                   reinterpret_cast<uint16_t*>(out.data_ptr()), qsl, lens, kp, vp,
                   pack_off.data(), H, KVH, D, G, static_cast<float>(scale)};
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), int64_t(items.size()));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    if (amx)
      run_items<true>(pb, items, next);
    else
      run_items<false>(pb, items, next);
  });
#endif
  return out;
}

at::Tensor paged_prefill_attention_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&,
                                        const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        double, int64_t) {
  return at::empty_symint(q.sym_sizes(), q.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("paged_prefill_attention(Tensor q, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, "
        "int tiles=-1) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention_cpu);
}
TORCH_LIBRARY_IMPL(kvserve, Meta, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention_meta);
}
