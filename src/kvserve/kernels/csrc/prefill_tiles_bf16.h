// The two products of prefill_attention.cpp's flash loop with VDPBF16PS (AVX-512-BF16, no
// AMX: Zen 4 / Zen 5, Cooper Lake), on the same packed key / value blocks the AMX tiles read.
//
// A packed B tile is 16 rows x 16 columns x 2 bf16 (a row: 16 keys x one dim pair for K,
// 16 dims x one key pair for V), so its row is one zmm VDPBF16PS multiplies against a
// broadcast pair of the A side (a query's dim pair, a probability row's key pair): an outer
// product, R rows x 4 vectors of accumulators in registers. Each float32 lane sums the
// products of one pair per instruction, as the AMX tile does per row of B; only the order of
// the float32 additions differs.
//
// NOT a normal header: included by prefill_attention.cpp inside its namespace, after kT, kKB,
// kSK and kTileK; no include guard on purpose.

#define KV_PF_BF16 \
  __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

// the 32-bit word at p (a bf16 pair) in all 16 lanes
KV_PF_BF16 inline __m512bh pair16(const uint16_t* p) {
  int32_t w;
  std::memcpy(&w, p, sizeof w);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(w));
}

// S rows [r0, r0 + R) (stride kSK) = Q rows (stride D) . the 64 keys of kblk
template <int R>
KV_PF_BF16 void scores_rows_bf16(const uint16_t* q, const uint16_t* kblk, int64_t D, float* s) {
  const int64_t kts = D / kTileK;
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t kt = 0; kt < kts; ++kt)
    for (int p = 0; p < kT; ++p) {  // dim pair 16 kt + p; its row in each key tile
      __m512bh kv[4];
      for (int t = 0; t < 4; ++t)
        kv[t] = reinterpret_cast<__m512bh>(
            _mm512_load_si512(kblk + (t * kts + kt) * kT * kTileK + p * kTileK));
      for (int r = 0; r < R; ++r) {
        const __m512bh qp = pair16(q + r * D + kt * kTileK + 2 * p);
        for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], qp, kv[t]);
      }
    }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < 4; ++t) _mm512_storeu_ps(s + r * kSK + 16 * t, acc[r][t]);
}

// S (16 x 64) = Q (16 x D) K^T for key block kblk: rows 6 + 6 + 4 (24 accumulators at most)
KV_PF_BF16 void scores_bf16(const uint16_t* q, const uint16_t* kblk, int64_t D, float* s) {
  scores_rows_bf16<6>(q, kblk, D, s);
  scores_rows_bf16<6>(q + 6 * D, kblk, D, s + 6 * kSK);
  scores_rows_bf16<4>(q + 12 * D, kblk, D, s + 12 * kSK);
}

// O rows (stride D), dims [d0, d0 + 64) += P rows (stride kSK, bf16) . the 64 keys of vblk
template <int R>
KV_PF_BF16 void values_rows_bf16(const uint16_t* p, const uint16_t* vblk, int64_t D, int64_t d0,
                                 float* o) {
  const int64_t dts = D / 16;
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + d0 + 16 * c);
  for (int64_t half = 0; half < 2; ++half) {
    const uint16_t* vt = vblk + (half * dts + d0 / 16) * kT * kTileK;
    for (int kp = 0; kp < kT; ++kp) {  // key pair 16 half + kp; its row in each dim tile
      __m512bh vv[4];
      for (int c = 0; c < 4; ++c)
        vv[c] = reinterpret_cast<__m512bh>(_mm512_load_si512(vt + c * kT * kTileK + kp * kTileK));
      for (int r = 0; r < R; ++r) {
        const __m512bh pp = pair16(p + r * kSK + half * kTileK + 2 * kp);
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pp, vv[c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + r * D + d0 + 16 * c, acc[r][c]);
}

// O (16 x D) += P (16 x 64) V for value block vblk, 64 dims at a time
KV_PF_BF16 void values_bf16(const uint16_t* p, const uint16_t* vblk, int64_t D, float* o) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    values_rows_bf16<6>(p, vblk, D, d0, o);
    values_rows_bf16<6>(p + 6 * kSK, vblk, D, d0, o + 6 * D);
    values_rows_bf16<4>(p + 12 * kSK, vblk, D, d0, o + 12 * D);
  }
}
