// kvserve::paged_decode_attention_quant: the decode attention of paged_attention.cpp over a
// paged cache whose K and V are stored quantized (kvserve/kv/cache_dtype.py: int8, int4_sym,
// int4, fp8_e4m3) or as floats, K and V each in its own format.
//
//   k_codes  (num_blocks, block_size, num_kv_heads, code_bytes)   contiguous
//   k_scales (num_blocks, block_size, num_kv_heads, num_groups)   float16 (quantized only)
//   k_mins   the same shape, int4 only;  v_* likewise
//   token t of request b is row  [block_tables[b][t / block_size], t % block_size]
//
// Same task loop as paged_attention.cpp (task = (request b, kv head h), scores (G, n), softmax,
// probability-weighted V), but a quantized block is first dequantized, kChunk rows at a time,
// into a float32 scratch (kChunk x head_dim: L1-resident) by kv_dequant.cpp's routine for the
// ISA, and float32 primitives run on that scratch: paged_attention.cpp's, except on AVX-512 at
// head_dim 64 / 128, where qk sums 16 rows at once (sum16) and pv keeps its accumulators in
// registers (measured, int8 B 8 x 2048 one thread: 683 -> 585 us; bf16 through the float
// kernel 780-830). A float side (format 0) runs the typed primitives of paged_attention.cpp on
// the cache rows directly, so K int8 + V bfloat16 mixes both. Why a scratch rather than a
// kernel per format: qk reads each row once per query head of the group (G times), so
// converting once is cheaper than converting in the inner loops, and every format shares the
// register-blocked paths.
#include "cpu_isa.h"
#include "kv_dequant.h"
#include "paged_attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using c10::Half;
using kvserve_attn::RowKernels;
using namespace kvserve_kvq;

// Blocks prefetched ahead (the hardware prefetcher loses the strided per-head stream at every
// block; see paged_attention.cpp), and rows dequantized per scratch fill.
constexpr int64_t kAhead = 4;  // 2 and 8 measured slower (int8, B 64 x 2048 from DRAM)
constexpr int64_t kChunk = 32;

// always_inline: a function that only prefetches has no side effects to GCC, which marks it
// const and deletes the calls (all of them, measured) unless it is inlined first. Into L2
// (prefetcht1), as paged_attention.cpp: Zen 4, 2 threads, `benchmarks.kv_dtype_attention
// --batches 64 --contexts 2048`, 2 alternating runs, T0 -> T1: int8 10.5-10.9 -> 4.8-5.5 ms,
// int4 10.5-10.8 -> 5.0-5.8 ms, fp8_e4m3 11.7-12.0 -> 5.2-6.1 ms.
#define KQ_INLINE inline __attribute__((always_inline))
KQ_INLINE void prefetch_span(const void* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63});
  for (const char* e = static_cast<const char*>(p) + bytes; c < e; c += 64)
    __builtin_prefetch(c, 0, 2);
}

#if defined(__x86_64__)
#define KQ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

// z[j] = the sum of the 16 lanes of row j's vector, where v[i] holds row 4 (i % 4) + i / 4: a
// shuffle tree, 45 instructions for 16 rows instead of 16 x ~8 for _mm512_reduce_add_ps.
KQ_AVX512 inline __m512 sum16(const __m512 (&v)[16]) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: w[i] = (half sums of v[2i], of v[2i+1])
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lanes: x[i] lane l = the 4 partials of one row
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // within lanes: 2 partials of each of 2 rows
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

// qk over float32 rows of head_dim 16 ND (the scratch): per query head, 16 rows' products in
// 16 registers, then one sum16 (see RowKernels::qk for the arguments).
template <int ND>
KQ_AVX512 void qk_f32_tree(const float* q, int64_t G, int64_t, const void* kv, int64_t stride,
                           int64_t rows, float* s, int64_t ss) {
  const float* k = static_cast<const float*>(kv);
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int64_t n = std::min<int64_t>(16, rows - r0);
    for (int64_t g = 0; g < G; ++g) {
      __m512 qv[ND], acc[16];
      for (int c = 0; c < ND; ++c) qv[c] = _mm512_loadu_ps(q + g * 16 * ND + 16 * c);
      // a short chunk reads row min(r, n - 1) for the rows past its end: in bounds, never stored
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        const int64_t r = std::min<int64_t>(4 * (i % 4) + i / 4, n - 1);
        const float* kr = k + (r0 + r) * stride;
        acc[i] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
#pragma GCC unroll 8
        for (int c = 1; c < ND; ++c)
          acc[i] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), acc[i]);
      }
      _mm512_mask_storeu_ps(s + g * ss + r0, __mmask16((1u << n) - 1), sum16(acc));
    }
  }
}

// acc (GN, 16 ND) += p (GN, rows) V (rows, 16 ND), GN known at compile time so the GN x ND
// accumulators stay in registers (paged_attention.cpp's pv takes the count at run time, and
// GCC keeps its accumulators on the stack).
template <int ND, int GN>
KQ_AVX512 void pv_f32_gn(const float* p, int64_t ps, const float* v, int64_t stride,
                         int64_t rows, float* acc) {
  __m512 a[GN][ND];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < ND; ++c) a[g][c] = _mm512_loadu_ps(acc + g * 16 * ND + 16 * c);
  for (int64_t r = 0; r < rows; ++r, v += stride) {
    __m512 vv[ND];
    for (int c = 0; c < ND; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
    for (int g = 0; g < GN; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * ps + r]);
      for (int c = 0; c < ND; ++c) a[g][c] = _mm512_fmadd_ps(w, vv[c], a[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(acc + g * 16 * ND + 16 * c, a[g][c]);
}

// pv over float32 rows of head_dim 16 ND: query heads in register groups of 4 (ND 4) or 2
// (ND 8: 16 accumulators + 8 row vectors of the 32 registers).
template <int ND>
KQ_AVX512 void pv_f32(const float* p, int64_t ps, int64_t G, int64_t, const void* vp,
                      int64_t stride, int64_t rows, float* acc) {
  const float* v = static_cast<const float*>(vp);
  constexpr int64_t step = ND <= 4 ? 4 : 2;
  for (int64_t g0 = 0; g0 < G; g0 += step) {
    const float* pg = p + g0 * ps;
    float* ag = acc + g0 * 16 * ND;
    switch (std::min(step, G - g0)) {
      case 1: pv_f32_gn<ND, 1>(pg, ps, v, stride, rows, ag); break;
      case 2: pv_f32_gn<ND, 2>(pg, ps, v, stride, rows, ag); break;
      case 3: pv_f32_gn<ND, 3>(pg, ps, v, stride, rows, ag); break;
      default: pv_f32_gn<ND, 4>(pg, ps, v, stride, rows, ag); break;
    }
  }
}
#endif

// The float32 primitives the scratch is read with: paged_attention.cpp's, but qk by sum16 and
// pv with register accumulators where head_dim is 64 or 128 on AVX-512.
RowKernels scratch_kernels(int64_t D, int64_t isa) {
  RowKernels kn = kvserve_attn::row_kernels(at::kFloat, isa);
#if defined(__x86_64__)
  if (isa == kvserve_isa::kAvx512 && D == 64) kn.qk = qk_f32_tree<4>, kn.pv = pv_f32<4>;
  if (isa == kvserve_isa::kAvx512 && D == 128) kn.qk = qk_f32_tree<8>, kn.pv = pv_f32<8>;
#endif
  return kn;
}

inline float* align64(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

// One side of the cache (K or V) as stored. A slot is (token row of a block, kv head): slot
// s = (block * block_size + r) * num_kv_heads + h; its codes are row_bytes bytes at
// codes + s * row_bytes, its scales (mins) num_groups halves at scales + s * num_groups.
struct Side {
  int64_t fmt;
  const uint8_t* codes;
  const Half* scales;  // null for a float side
  const Half* mins;    // int4 only
  int64_t row_bytes, ng;
  RowKernels direct;  // format 0: the primitives over the cache's own dtype
  DequantFn deq;      // formats 1..4: slots -> float32 rows

  // the rows r < bs of head h of a block (slot0 = its row 0), and their scales
  KQ_INLINE void prefetch(int64_t slot0, int64_t bs, int64_t KVH) const {
    for (int64_t r = 0; r < bs; ++r)
      prefetch_span(codes + (slot0 + r * KVH) * row_bytes, row_bytes);
    const int64_t span = ((bs - 1) * KVH + 1) * ng * int64_t(sizeof(Half));
    if (scales) prefetch_span(scales + slot0 * ng, span);
    if (mins) prefetch_span(mins + slot0 * ng, span);
  }
};

Side make_side(int64_t fmt, const at::Tensor& codes, const std::optional<at::Tensor>& scales,
               const std::optional<at::Tensor>& mins, int64_t D, int64_t isa) {
  Side s{fmt, static_cast<const uint8_t*>(codes.const_data_ptr()),
         scales ? scales->const_data_ptr<Half>() : nullptr,
         mins ? mins->const_data_ptr<Half>() : nullptr,
         codes.size(3) * int64_t(codes.element_size()), num_groups(fmt, D), {}, nullptr};
  if (fmt == kFloat) s.direct = kvserve_attn::row_kernels(codes.scalar_type(), isa);
  else s.deq = dequant_fn(fmt, D, isa);
  return s;
}

// out (B, H, D) f32 <- attention of q (B, H, D) f32, pre-scaled, over each request's first
// lens[b] tokens of sides k and v. Inputs checked by the caller (max_len = max lens).
void attend(const float* q, const Side& k, const Side& v, const int64_t* tables, int64_t width,
            const int64_t* lens, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t bs,
            int64_t max_len, const RowKernels& f32, float* out) {
  const int64_t G = H / KVH, tasks = B * KVH;
  int64_t rows_total = 0;
  for (int64_t b = 0; b < B; ++b) rows_total += lens[b] * KVH;
  // as paged_attention.cpp: one thread below ~8k K/V rows, else tasks round robin
  const int64_t W = rows_total < 8192 ? 1 : std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, W, 1, [&](int64_t w0, int64_t w1) {
    // the scratch and acc 64-byte aligned: with malloc's 16-byte alignment runs were bimodal,
    // up to 35% slower when every vector stored and loaded there straddled two cache lines
    std::vector<float> scores(G * max_len), inv(G), mem(kChunk * D + G * D + 16);
    float* const buf = align64(mem.data());
    float* const acc = buf + kChunk * D;  // (G, D)
    // f(kernels, rows, stride, first token, count) on every block of head h of side sd: the
    // cache rows of a float side, else the scratch after dequantizing them
    auto pass = [&](const Side& sd, int64_t h, const int64_t* table, int64_t n, auto&& f) {
      const int64_t nb = (n + bs - 1) / bs;
      for (int64_t j = 0; j < std::min(kAhead, nb); ++j)
        sd.prefetch(table[j] * bs * KVH + h, bs, KVH);
      for (int64_t j = 0; j < nb; ++j) {
        if (j + kAhead < nb) sd.prefetch(table[j + kAhead] * bs * KVH + h, bs, KVH);
        const int64_t slot0 = table[j] * bs * KVH + h, rows = std::min(bs, n - j * bs);
        if (sd.fmt == kFloat) {
          f(sd.direct, sd.codes + slot0 * sd.row_bytes, KVH * D, j * bs, rows);
          continue;
        }
        for (int64_t r0 = 0; r0 < rows; r0 += kChunk) {
          const int64_t c = std::min(kChunk, rows - r0), s = slot0 + r0 * KVH;
          sd.deq(sd.codes + s * sd.row_bytes, KVH * sd.row_bytes, sd.scales + s * sd.ng,
                 sd.mins ? sd.mins + s * sd.ng : nullptr, KVH * sd.ng, c, D, buf);
          f(f32, buf, D, j * bs + r0, c);
        }
      }
    };
    for (int64_t w = w0; w < w1; ++w)
      for (int64_t t = w; t < tasks; t += W) {
        const int64_t b = t / KVH, h = t % KVH, n = lens[b], *table = tables + b * width;
        const float* qg = q + (b * H + h * G) * D;  // (G, D): this kv head's query heads
        float* s = scores.data();
        pass(k, h, table, n, [&](const RowKernels& kn, const void* rows, int64_t stride,
                                 int64_t i, int64_t r) {
          kn.qk(qg, G, D, rows, stride, r, s + i, n);  // pass 1: scores (G, n)
        });
        for (int64_t g = 0; g < G; ++g) inv[g] = 1.f / f32.softmax(s + g * n, n);
        std::fill(acc, acc + G * D, 0.f);
        pass(v, h, table, n, [&](const RowKernels& kn, const void* rows, int64_t stride,
                                 int64_t i, int64_t r) {
          kn.pv(s + i, n, G, D, rows, stride, r, acc);  // pass 2: acc = p V
        });
        float* o = out + (b * H + h * G) * D;
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < D; ++d) o[g * D + d] = acc[g * D + d] * inv[g];
      }
  });
}

using OptT = std::optional<at::Tensor>;

at::Tensor paged_decode_attention_quant_cpu(const at::Tensor& q, const at::Tensor& k_codes,
                                            const OptT& k_scales, const OptT& k_mins,
                                            int64_t k_format, const at::Tensor& v_codes,
                                            const OptT& v_scales, const OptT& v_mins,
                                            int64_t v_format, const at::Tensor& block_tables,
                                            const at::Tensor& seq_lens, double scale, int64_t isa) {
  TORCH_CHECK(q.dim() == 3, "q must be (B, num_heads, head_dim), got ", q.sizes());
  const auto qt = q.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16 || qt == at::kHalf,
              "q dtype must be float32, bfloat16 or float16, got ", qt);
  for (const at::Tensor* t : {&q, &block_tables, &seq_lens})
    TORCH_CHECK(t->device().is_cpu(), "paged_decode_attention_quant runs on CPU; got a tensor "
                "on ", t->device());
  TORCH_CHECK(k_codes.dim() == 4, "k_codes must be (num_blocks, block_size, num_kv_heads, "
              "code_bytes), got ", k_codes.sizes());
  TORCH_CHECK(v_codes.dim() == 4 && v_codes.sizes().slice(0, 3) == k_codes.sizes().slice(0, 3),
              "v_codes must be (num_blocks, block_size, num_kv_heads) = ",
              k_codes.sizes().slice(0, 3), " as k_codes, plus code_bytes; got ", v_codes.sizes());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(D > 0, "head_dim must be positive, got ", D);
  check_side("k_", k_format, k_codes, k_scales, k_mins, D);
  check_side("v_", v_format, v_codes, v_scales, v_mins, D);
  const int64_t nblocks = k_codes.size(0), bs = k_codes.size(1), KVH = k_codes.size(2);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "num_heads ", H, " must be a multiple of num_kv_heads ",
              KVH);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B &&
                  block_tables.scalar_type() == at::kLong,
              "block_tables must be (B=", B, ", max_blocks) int64, got ", block_tables.sizes(),
              " ", block_tables.scalar_type());
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == B && seq_lens.scalar_type() == at::kLong,
              "seq_lens must be (B=", B, ",) int64, got ", seq_lens.sizes(), " ",
              seq_lens.scalar_type());
  isa = resolve_isa(isa);
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t width = tables.size(1);
  const int64_t *tp = tables.data_ptr<int64_t>(), *lp = lens.data_ptr<int64_t>();
  const int64_t max_len = kvserve_attn::check_block_tables(tp, width, lp, B, bs, nblocks);
  const Side k = make_side(k_format, k_codes, k_scales, k_mins, D, isa);
  const Side v = make_side(v_format, v_codes, v_scales, v_mins, D, isa);
  auto qs = (q.to(at::kFloat) * scale).contiguous();  // (B, H, D) f32, scaled once
  auto out = at::empty({B, H, D}, q.options().dtype(at::kFloat));
  attend(qs.data_ptr<float>(), k, v, tp, width, lp, B, H, KVH, D, bs, max_len,
         scratch_kernels(D, isa), out.data_ptr<float>());
  return qt == at::kFloat ? out : out.to(qt);
}

// Meta (torch.compile / FakeTensor): sym_sizes only, so traced batch sizes stay symbolic, as
// paged_decode_attention's. Shapes are checked when it runs.
at::Tensor paged_decode_attention_quant_meta(const at::Tensor& q, const at::Tensor& k_codes,
                                             const OptT&, const OptT&, int64_t,
                                             const at::Tensor& v_codes, const OptT&, const OptT&,
                                             int64_t, const at::Tensor&, const at::Tensor&, double,
                                             int64_t) {
  TORCH_CHECK(q.dim() == 3 && k_codes.dim() == 4 && v_codes.dim() == 4,
              "paged_decode_attention_quant: q must be 3-D and k_codes / v_codes 4-D");
  return at::empty_symint(q.sym_sizes(), q.options());
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("paged_decode_attention_quant(Tensor q, Tensor k_codes, Tensor? k_scales, "
        "Tensor? k_mins, int k_format, Tensor v_codes, Tensor? v_scales, Tensor? v_mins, "
        "int v_format, Tensor block_tables, Tensor seq_lens, float scale, int isa=-1) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("paged_decode_attention_quant", &paged_decode_attention_quant_cpu);
}
TORCH_LIBRARY_IMPL(kvserve, Meta, m) {
  m.impl("paged_decode_attention_quant", &paged_decode_attention_quant_meta);
}
