// Paged attention over a bfloat16 cache on CPUs with AVX-512-BF16, in ONE order for decode and
// prefill (ARCHITECTURE.md "Bitwise invariance"): a query's output does not depend on whether
// it was a decode row or one token of a prefill chunk, nor on how many others shared the call.
//
// The order, per (query token, query head g, kv head h), over the request's first n keys:
//   q    = bfloat16(q * scale) as D/2 words (pairs of dims), rounded to nearest even
//   s_j  = VDPBF16PS chain over the pairs p = 0 .. D/2-1 in order, from 0: one float32 lane
//   P    = softmax_dp(s_0 .. s_{n-1}) (max, then exp(s - max) and their sum in 16 lanes over j
//          in order, the lanes summed by _mm512_reduce_add_ps), 1 / sum
//   out  = (VDPBF16PS chain over key pairs (0,1), (2,3), .. in order, from 0, of bfloat16(P)
//          pairs against V pairs; an odd n's last key paired with P = 0, V = 0) * (1 / sum),
//          float32, per dim. P is rounded to bfloat16 as the flash loop's (prefill_tiles_bf16.h)
//          and the AMX tiles' P are; the sum is of the float32 P.
// A chain is one (query token, query head). A decode row's G heads, or up to 16 rows x G heads
// of a prefill chunk, are computed together over the same keys: scores with 16 keys in lanes
// (their rows transposed into pair columns once for all the chains, up to 6 chains x 64 keys
// in registers), P . V with 16 dims in lanes (each V key pair interleaved once per set of up
// to 6 chains). A chain's arithmetic never depends on which others share its set, so a query
// gets the same bits as a decode row or anywhere in any chunk. Products of two bfloat16 values
// are exact in float32.
//
// Why: the decode kernel's scores (float32 FMAs over dims in 16 lanes, then a transpose-add
// tree) cost ~9 instructions a score; run for every token of a prefill it made batch-invariant
// prefill 1.4-2x slower than the eager path's at 512-2000 tokens. P . V in float32 FMAs (a key
// per instruction per 16 dims, each V row widened again per query) was 26% of a 2000-token
// prefill in batch-invariant mode; queries in lanes for the scores (a broadcast load per key
// pair, a transpose per 16 x 16 scores) cost 11%, against the flash loop's 6%.
#include "paged_attention_dp.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "paged_attention.h"
#include "transpose16.h"
#include "vec_exp.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvserve_attn {

#if defined(__x86_64__)
namespace {

#define KV_DP __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")))

KV_DP inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// s[0..n) <- exp(s - max s); returns the sum (the decode kernel's softmax, one order)
KV_DP float softmax_dp(float* s, int64_t n) {
  __m512 vm = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16)
    vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(vm, lanes(n - i), s + i));
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vm));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    const __m512 e = kvserve_vec::exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), mx));
    _mm512_mask_storeu_ps(s + i, m, e);
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// qw (rows, D/2) words <- bfloat16 pairs of q (rows, D) float32, nearest even; D % 32 == 0
KV_DP void to_words(const float* q, int64_t rows, int64_t D, uint32_t* qw) {
  for (int64_t i = 0; i < rows * D; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + i + 16), _mm512_loadu_ps(q + i));
    _mm512_storeu_si512(qw + i / 2, reinterpret_cast<__m512i>(v));
  }
}

inline const BFloat16Bits* key_row(const BFloat16Bits* c, const int64_t* table, int64_t i,
                                   int64_t bs, int64_t blk, int64_t row) {
  return c + table[i / bs] * blk + (i % bs) * row;
}

// rows [i0, i1) of one head's cache (D bf16 values each) towards L2: a decode reads its K and
// V once, from DRAM at long contexts, and the rows of a paged request are not contiguous for
// the hardware prefetcher (the decode kernel's kAhead, as in paged_attention.cpp)
inline void prefetch_rows(const BFloat16Bits* c, const int64_t* table, int64_t i0, int64_t i1,
                          int64_t bs, int64_t blk, int64_t row, int64_t D) {
  for (int64_t i = i0; i < i1; ++i) {
    const char* p = reinterpret_cast<const char*>(key_row(c, table, i, bs, blk, row));
    for (int64_t off = 0; off < D * 2; off += 64) __builtin_prefetch(p + off, 0, 2);
  }
}

// Scores of R chains (query rows of (DW) words, qw rows DW apart) against the 64 keys of kt
// ((4, DW, 16) words: 16 keys in lanes per group), stored for the first `groups` key groups
// of 16 (lanes past n masked): per score a VDPBF16PS chain over the dim pairs in order, 4R
// independent chains in registers.
template <int DW, int R>
KV_DP inline void scores_set(const uint32_t* qw, const uint32_t* kt, int64_t groups, float* s,
                             int64_t ss, int64_t i0, int64_t n) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_setzero_ps();
  for (int p = 0; p < DW; ++p) {
    __m512bh kv[4];
    for (int q = 0; q < 4; ++q)
      kv[q] = reinterpret_cast<__m512bh>(_mm512_load_si512(kt + q * DW * 16 + 16 * p));
    for (int r = 0; r < R; ++r) {
      const __m512bh qv =
          reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(qw[r * DW + p])));
      for (int q = 0; q < 4; ++q)  // groups past n are never stored
        acc[r][q] = _mm512_dpbf16_ps(acc[r][q], qv, kv[q]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t q = 0; q < groups; ++q)
      _mm512_mask_storeu_ps(s + r * ss + i0 + 16 * q, lanes(n - i0 - 16 * q), acc[r][q]);
}

template <int DW, int R = 6>
KV_DP void scores_sets(const uint32_t* qw, int64_t C, const uint32_t* kt, int64_t groups,
                       float* s, int64_t ss, int64_t i0, int64_t n) {
  if constexpr (R >= 1) {
    for (; C >= R; C -= R, qw += R * DW, s += R * ss)
      scores_set<DW, R>(qw, kt, groups, s, ss, i0, n);
    if constexpr (R > 1)
      if (C > 0) scores_sets<DW, R - 1>(qw, C, kt, groups, s, ss, i0, n);
  }
}

// Scores of C chains (qw (C, DW) words: a decode's G query heads, or a prefill chunk's rows x
// G heads) over the first n keys: s[c * ss + i] for i < n. Keys in lanes: each 16 keys'
// rows transposed into pair columns once for all the chains. tile: (16, DW) words, kt:
// (4, DW, 16) words of scratch, 64-byte aligned.
template <int DW>
KV_DP void scores_by_key(const uint32_t* qw, int64_t C, const BFloat16Bits* kc,
                         const int64_t* table, int64_t n, int64_t bs, int64_t blk, int64_t row,
                         float* s, int64_t ss, uint32_t* tile, uint32_t* kt) {
  prefetch_rows(kc, table, 0, std::min<int64_t>(n, 64), bs, blk, row, 2 * DW);
  for (int64_t i0 = 0; i0 < n; i0 += 64) {
    prefetch_rows(kc, table, std::min(n, i0 + 64), std::min(n, i0 + 128), bs, blk, row, 2 * DW);
    const int64_t groups = std::min<int64_t>(4, (n - i0 + 15) / 16);
    for (int64_t q = 0; q < groups; ++q) {  // 16 rows -> (DW, 16) pair columns
      const int64_t i1 = i0 + 16 * q;
      const uint32_t* src = tile;
      int64_t stride = DW;  // words
      const BFloat16Bits* first = key_row(kc, table, i1, bs, blk, row);
      if (i1 % bs + 16 <= bs && reinterpret_cast<uintptr_t>(first) % 64 == 0 && row % 32 == 0) {
        // the 16 rows lie in one block, `row` apart, aligned as transpose16 loads them:
        // transposed straight from the cache (rows past n are the block's unwritten slots:
        // their lanes are never stored). Copying them into `tile` first: ~a fifth more time
        // in these scores over offline-64 (perf samples 16.4k against 12.9k, Zen 5).
        src = reinterpret_cast<const uint32_t*>(first);
        stride = row / 2;
      } else {
        for (int64_t r = 0; r < 16; ++r) {
          const int64_t i = i1 + r;
          if (i < n)
            std::memcpy(tile + r * DW, key_row(kc, table, i, bs, blk, row), DW * 4);
          else
            std::memset(tile + r * DW, 0, DW * 4);
        }
      }
      for (int c = 0; c < DW / 16; ++c)
        kvserve_simd::transpose16(reinterpret_cast<const float*>(src + 16 * c), stride,
                                  reinterpret_cast<float*>(kt + q * DW * 16 + 256 * c), 16);
    }
    scores_sets<DW>(qw, C, kt, groups, s, ss, i0, n);
  }
}

// Score row s (n floats: exp(s - max), softmax_dp's output) -> bfloat16 in place, key order,
// nearest even: 32-bit word i holds (P_2i, P_2i+1), as VDPBF16PS takes a pair. Past n the
// words are 0 (masked loads), so an odd n's last word is (P_n-1, 0). In place is safe: chunk
// i's words land on floats that chunk i or an earlier one has already read.
KV_DP void to_pair_words(float* s, int64_t n) {
  auto* w = reinterpret_cast<uint16_t*>(s);
  for (int64_t i = 0; i < n; i += 32) {
    const __m512 lo = _mm512_maskz_loadu_ps(lanes(n - i), s + i);
    const __m512 hi = _mm512_maskz_loadu_ps(lanes(std::max<int64_t>(0, n - i - 16)), s + i + 16);
    const int64_t words = std::min<int64_t>(32, (n - i + 1) & ~int64_t{1});  // whole pairs
    const __mmask32 m = words == 32 ? ~__mmask32{0} : (__mmask32{1} << words) - 1;
    _mm512_mask_storeu_epi16(w + i, m, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  }
}

// One P . V chain: a (token, query head)'s pair words (to_pair_words), its key count, where
// its D outputs go, and 1 / its softmax sum.
struct PvChain {
  float* pw;  // the chain's score row, turned into pair words in place
  int64_t n;
  float* out;
  float inv;
};

KV_DP inline __m512bh word16(const float* pw, int64_t i) {
  int32_t w;
  std::memcpy(&w, pw + i, sizeof w);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(w));
}

// acc[k] += P pair i of chain k . (V row a, V row b) for the chains in `live`; b == nullptr:
// zeros (an odd count's last pair). Per 32 dims c: unpacklo/hi interleave the two rows' words
// into 16 (a_d, b_d) pairs each, lanes in the order dims 32c + {0-3, 8-11, 16-19, 24-27} and
// {4-7, 12-15, 20-23, 28-31} (pv_set's stores put them back: a permutation, no arithmetic).
template <int NP, int K>
KV_DP inline void pv_pair(__m512 (&acc)[K][2 * NP], const BFloat16Bits* a, const BFloat16Bits* b,
                          const PvChain* ch, int64_t i, unsigned live) {
  for (int c = 0; c < NP; ++c) {
    const __m512i va = _mm512_loadu_si512(a + 32 * c);
    const __m512i vb = b ? _mm512_loadu_si512(b + 32 * c) : _mm512_setzero_si512();
    const __m512bh lo = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(va, vb));
    const __m512bh hi = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(va, vb));
    for (int k = 0; k < K; ++k) {
      if (!((live >> k) & 1u)) continue;
      const __m512bh p = word16(ch[k].pw, i);
      acc[k][2 * c] = _mm512_dpbf16_ps(acc[k][2 * c], p, lo);
      acc[k][2 * c + 1] = _mm512_dpbf16_ps(acc[k][2 * c + 1], p, hi);
    }
  }
}

// out (D) of K chains over one kv head's values (all through the same table): per dim a
// VDPBF16PS chain over key pairs 0, 1, .. in order, then the odd count's last key paired with
// zeros, times 1 / sum. A chain's arithmetic depends only on its own words and n, never on the
// other chains in the set (a decode's G heads, or rows of a prefill chunk).
template <int NP, int K>
KV_DP void pv_set(const PvChain* ch, const BFloat16Bits* vc, const int64_t* table, int64_t bs,
                  int64_t blk, int64_t row, bool prefetch) {
  constexpr int64_t D = 32 * NP;
  __m512 acc[K][2 * NP];
  for (int k = 0; k < K; ++k)
    for (int c = 0; c < 2 * NP; ++c) acc[k][c] = _mm512_setzero_ps();
  int64_t common = ch[0].n / 2, most = ch[0].n / 2;
  for (int k = 1; k < K; ++k) {
    common = std::min(common, ch[k].n / 2);
    most = std::max(most, ch[k].n / 2);
  }
  int64_t reach = 0;  // rows any chain reads (past them the table may have no block)
  for (int k = 0; k < K; ++k) reach = std::max(reach, ch[k].n);
  if (prefetch) prefetch_rows(vc, table, 0, std::min<int64_t>(reach, 32), bs, blk, row, D);
  // pairs block by block: with an even block size a pair never straddles two blocks, so its
  // rows are `row` apart and the table is read once per block (a key_row per row, a division
  // each: a 2000-token chunk's attention 9.9 ms against 9.4, 64 decode rows' 1.73 against
  // 1.41, Zen 5)
  for (int64_t i = 0; i < common;) {
    const int64_t first = 2 * i, off = first % bs;
    const BFloat16Bits* a = vc + table[first / bs] * blk + off * row;
    const int64_t run = bs % 2 == 0 ? std::min(common - i, (bs - off) / 2) : 1;
    for (int64_t j = 0; j < run; ++j, ++i, a += 2 * row) {
      if (prefetch && i % 8 == 0)
        prefetch_rows(vc, table, std::min(reach, 2 * i + 32), std::min(reach, 2 * i + 48), bs,
                      blk, row, D);
      const BFloat16Bits* b = bs % 2 == 0 ? a + row : key_row(vc, table, 2 * i + 1, bs, blk, row);
      pv_pair<NP, K>(acc, a, b, ch, i, ~0u);
    }
  }
  for (int64_t i = common; i < most; ++i) {  // chains with more keys (a chunk's later rows)
    unsigned live = 0;
    for (int k = 0; k < K; ++k) live |= (i < ch[k].n / 2 ? 1u : 0u) << k;
    pv_pair<NP, K>(acc, key_row(vc, table, 2 * i, bs, blk, row),
                   key_row(vc, table, 2 * i + 1, bs, blk, row), ch, i, live);
  }
  for (int k = 0; k < K; ++k)
    if (ch[k].n % 2)
      pv_pair<NP, K>(acc, key_row(vc, table, ch[k].n - 1, bs, blk, row), nullptr, ch,
                     ch[k].n / 2, 1u << k);
  const __m512i lo_idx = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
  for (int k = 0; k < K; ++k) {
    const __m512 w = _mm512_set1_ps(ch[k].inv);
    for (int c = 0; c < NP; ++c) {
      const __m512 l = acc[k][2 * c], h = acc[k][2 * c + 1];
      _mm512_storeu_ps(ch[k].out + 32 * c, _mm512_mul_ps(_mm512_permutex2var_ps(l, lo_idx, h), w));
      _mm512_storeu_ps(ch[k].out + 32 * c + 16,
                       _mm512_mul_ps(_mm512_permutex2var_ps(l, hi_idx, h), w));
    }
  }
}

// Chains per set: their accumulators (2 NP vectors each) stay in registers.
template <int NP>
constexpr int kSetChains = NP == 2 ? 6 : NP == 4 ? 3 : 1;

// pv_set with K = count (1 .. kSetChains): the register tile sized to the set
template <int NP, int K = kSetChains<NP>>
KV_DP void pv_set_of(const PvChain* ch, int64_t count, const BFloat16Bits* vc,
                       const int64_t* table, int64_t bs, int64_t blk, int64_t row, bool prefetch) {
  if constexpr (K >= 1) {
    if (count == K) return pv_set<NP, K>(ch, vc, table, bs, blk, row, prefetch);
    if constexpr (K > 1) pv_set_of<NP, K - 1>(ch, count, vc, table, bs, blk, row, prefetch);
  }
}

// The softmax and P . V of `count` chains over one kv head's values: s rows already hold the
// scores; each becomes pair words in place. The first set prefetches (a decode reads V once).
template <int NP>
KV_DP void softmax_values(PvChain* ch, int64_t count, const BFloat16Bits* vc,
                          const int64_t* table, int64_t bs, int64_t blk, int64_t row) {
  for (int64_t k = 0; k < count; ++k) {
    ch[k].inv = 1.f / softmax_dp(ch[k].pw, ch[k].n);
    to_pair_words(ch[k].pw, ch[k].n);
  }
  constexpr int64_t KS = kSetChains<NP>;
  for (int64_t k0 = 0; k0 < count; k0 += KS)
    pv_set_of<NP>(ch + k0, std::min(KS, count - k0), vc, table, bs, blk, row, k0 == 0);
}

// Rows of one run (a prefill chunk) per unit of work: their scores are computed together
// (chains of the same keys), each row's own first lens keys used. Any split gives the same bits.
constexpr int64_t kUnitRows = 16;

// Per worker, 64-byte aligned. Not cleared: every value read is written first, but for lanes
// of rows past a block's end or past a chunk's last token, computed and never stored or read.
// (Clearing it, 16 score rows of the longest context per layer and worker, was ~1.3 ms of a
// 1500-token decode step of the default model.)
struct Scratch {
  explicit Scratch(int64_t floats) {
    const size_t bytes = (floats * 4 + 63) / 64 * 64;
    p = static_cast<float*>(std::aligned_alloc(64, bytes));
    TORCH_CHECK(p != nullptr, "paged attention: out of memory for ", bytes, " bytes of scratch");
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { std::free(p); }
  float* p;
};

template <int NP>
void attend_dp(const float* q, const BFloat16Bits* kc, const BFloat16Bits* vc,
               const int64_t* tables, int64_t width, const int64_t* lens, int64_t B, int64_t H,
               int64_t KVH, int64_t bs, int64_t max_len, float* out) {
  constexpr int64_t D = 32 * NP, DW = 16 * NP;
  const int64_t G = H / KVH, row = KVH * D, blk = bs * row;
  const int64_t cap = (max_len + 15) / 16 * 16;  // a score row's room
  // runs: consecutive rows of one request at consecutive positions (a prefill chunk), found
  // by their tables and lengths; rows alone (decodes) are runs of one
  std::vector<int64_t> starts{0};
  for (int64_t b = 1; b < B; ++b)
    if (lens[b] != lens[b - 1] + 1 ||
        std::memcmp(tables + b * width, tables + (b - 1) * width, width * 8) != 0)
      starts.push_back(b);
  starts.push_back(B);
  // units of work: up to 16 rows of one run per kv head; a unit's rows x G query heads are
  // its chains, which share each key tile's transpose and each V pair's interleave
  struct Unit {
    int64_t b0, rows, h;
  };
  std::vector<Unit> units;
  int64_t most_rows = 1;
  for (size_t r = 0; r + 1 < starts.size(); ++r)
    for (int64_t b = starts[r]; b < starts[r + 1]; b += kUnitRows) {
      const int64_t rows = std::min(kUnitRows, starts[r + 1] - b);
      most_rows = std::max(most_rows, rows);
      for (int64_t h = 0; h < KVH; ++h) units.push_back({b, rows, h});
    }
  const int64_t nunits = static_cast<int64_t>(units.size());
  const int64_t score_rows = most_rows * G;
  int64_t rows_total = 0;
  for (int64_t b = 0; b < B; ++b) rows_total += lens[b] * KVH;
  const int64_t W = rows_total < 512 ? 1 : std::min<int64_t>(at::get_num_threads(), nunits);
  at::parallel_for(0, W, 1, [&](int64_t w0, int64_t w1) {
    // scores (rows x G, cap), query words (rows x G, DW), a key tile, transposed key tiles
    const int64_t need = score_rows * cap + score_rows * DW + 16 * DW + 4 * DW * 16;
    Scratch scratch(need);
    float* s = scratch.p;
    uint32_t* qw = reinterpret_cast<uint32_t*>(s + score_rows * cap);
    uint32_t* tile = qw + score_rows * DW;
    uint32_t* kt = tile + 16 * DW;
    PvChain chains[kUnitRows * 16];  // rows x G <= 16 heads
    for (int64_t w = w0; w < w1; ++w)
      for (int64_t t = w; t < nunits; t += W) {
        const Unit u = units[t];
        const int64_t* table = tables + u.b0 * width;
        const BFloat16Bits *kh = kc + u.h * D, *vh = vc + u.h * D;
        // chain (l, g) = l * G + g: row b0 + l (position lens - 1), query head h * G + g
        for (int64_t l = 0; l < u.rows; ++l)
          to_words(q + ((u.b0 + l) * H + u.h * G) * D, G, D, qw + l * G * DW);
        const int64_t C = u.rows * G, n_last = lens[u.b0 + u.rows - 1];
        scores_by_key<DW>(qw, C, kh, table, n_last, bs, blk, row, s, cap, tile, kt);
        for (int64_t l = 0; l < u.rows; ++l)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t b = u.b0 + l;
            chains[l * G + g] = {s + (l * G + g) * cap, lens[b], out + (b * H + u.h * G + g) * D,
                                 0.f};
          }
        softmax_values<NP>(chains, C, vh, table, bs, blk, row);
      }
  });
}

}  // namespace
#endif  // __x86_64__

bool attend_dp_available(int64_t H, int64_t KVH, int64_t D) {
#if defined(__x86_64__)
  static const bool cpu = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bf16");
  }();
  return cpu && KVH > 0 && H % KVH == 0 && H / KVH <= 16 && (D == 64 || D == 128 || D == 256);
#else
  (void)H, (void)KVH, (void)D;
  return false;
#endif
}

void attend_dp_raw(const float* q, const void* kc, const void* vc, const int64_t* tables,
                   int64_t width, const int64_t* lens, int64_t B, int64_t H, int64_t KVH,
                   int64_t D, int64_t bs, int64_t max_len, float* out) {
#if defined(__x86_64__)
  const auto* k = static_cast<const BFloat16Bits*>(kc);
  const auto* v = static_cast<const BFloat16Bits*>(vc);
  switch (D) {
    case 64: return attend_dp<2>(q, k, v, tables, width, lens, B, H, KVH, bs, max_len, out);
    case 128: return attend_dp<4>(q, k, v, tables, width, lens, B, H, KVH, bs, max_len, out);
    default: return attend_dp<8>(q, k, v, tables, width, lens, B, H, KVH, bs, max_len, out);
  }
#else
  (void)q, (void)kc, (void)vc, (void)tables, (void)width, (void)lens, (void)B, (void)H;
  (void)KVH, (void)D, (void)bs, (void)max_len, (void)out;
#endif
}

}  // namespace kvserve_attn

namespace {

// kvserve::paged_decode_attention_dp: this file's attention as an op (tests; the engine calls
// it inside decode_layers in batch-invariant mode). q (B, H, D) float32, caches (num_blocks,
// bs, KVH, D) bfloat16, block_tables (B, width) and seq_lens (B,) int64.
at::Tensor paged_decode_attention_dp_cpu(const at::Tensor& q, const at::Tensor& key_cache,
                                         const at::Tensor& value_cache,
                                         const at::Tensor& block_tables,
                                         const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat,
              "paged_decode_attention_dp: q must be (B, H, D) float32, got ", q.sizes());
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.scalar_type() == at::kBFloat16 &&
                  value_cache.sizes() == key_cache.sizes() &&
                  value_cache.scalar_type() == at::kBFloat16,
              "paged_decode_attention_dp: caches must be one (num_blocks, block_size, kv_heads, "
              "head_dim) bfloat16 shape, got ", key_cache.sizes(), " and ", value_cache.sizes());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D, "paged_decode_attention_dp: head_dim ", D, " vs cache ",
              key_cache.size(3));
  TORCH_CHECK(kvserve_attn::attend_dp_available(H, KVH, D),
              "paged_decode_attention_dp: needs AVX-512-BF16, head_dim 64/128/256 and at most "
              "16 query heads per kv head; got heads ", H, ", kv heads ", KVH, ", head_dim ", D);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B &&
                  block_tables.scalar_type() == at::kLong && seq_lens.dim() == 1 &&
                  seq_lens.size(0) == B && seq_lens.scalar_type() == at::kLong,
              "paged_decode_attention_dp: block_tables (B, width) and seq_lens (B,) int64");
  const at::Tensor kc = key_cache.contiguous(), vc = value_cache.contiguous();
  const at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const at::Tensor qs = (q * scale).contiguous();
  at::Tensor out = at::empty_like(qs);
  if (B == 0) return out;
  const int64_t width = tables.size(1), bs = kc.size(1);
  const int64_t max_len = kvserve_attn::check_block_tables(
      tables.data_ptr<int64_t>(), width, lens.data_ptr<int64_t>(), B, bs, kc.size(0));
  kvserve_attn::attend_dp_raw(qs.data_ptr<float>(), kc.const_data_ptr(), vc.const_data_ptr(),
                              tables.data_ptr<int64_t>(), width, lens.data_ptr<int64_t>(), B, H,
                              KVH, D, bs, max_len, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("paged_decode_attention_dp(Tensor q, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("paged_decode_attention_dp", &paged_decode_attention_dp_cpu);
}
