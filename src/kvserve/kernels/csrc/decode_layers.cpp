// kvserve::decode_layers: every decoder layer of a Llama-family model for one batch of token
// rows in one call: decodes (one new token per request), and in batch-invariant mode prefill
// tokens too (each row with its own block table and seq_len = position + 1).
//
// Why: at batch 1 the arithmetic of a step is ~4 ms of quantized matmuls, but the eager (or
// per-layer compiled) step made ~20 PyTorch calls per layer, 600 per token, and their
// dispatch cost as much as the matmuls. Here a layer is the same sequence of steps on raw
// buffers, each the arithmetic of the eager op it replaces:
//
//   h    = rms_norm(x) * input_layernorm          (float32, as torch.rms_norm)
//   qkv  = h @ W_qkv^T                            (quant_matmul_raw: the quant_matmul kernel)
//   q, k = rotate(q, k; cos, sin)                 (HF half layout, as models/layers.py)
//   cache[slot] = k, v                            (converted to the cache dtype, RNE)
//   a    = attention(q * scale; the request's blocks)   (paged_attend_raw, the decode kernel)
//   x    = x + a @ W_o^T
//   h    = rms_norm(x) * post_attention_layernorm
//   g, u = h @ W_gate_up^T
//   x    = x + (silu(g) * u) @ W_down^T
//
// Activations and the residual stream stay float32 whatever the cache dtype (a bfloat16
// model's eager path rounds them to bfloat16 after every op; this one does not). The engine
// uses it for all-decode steps of models whose four projections per layer are quantized
// (engine/fused_decode.py); the eager layers are the reference it is tested against.
//
//   x            (B, hidden) float32: the embedded tokens; returns the residual stream after
//                the last layer (B, hidden) float32 (final norm not applied)
//   cos, sin     (B, head_dim) float32
//   kv           (2, layers, num_blocks, block_size, kv_heads, head_dim): the paged cache,
//                float32 / bfloat16 / float16; written at slot_mapping (B,) int64
//   block_tables (B, width) int64, seq_lens (B,) int64 (this token included)
//   norms        2 per layer: input_layernorm, post_attention_layernorm (hidden,) float32
//   qweights     7 slots per layer: q, k, v, o, gate, up, down (GGUF rows, uint8), qtypes
//                their GGML type ids. A fused qkv_proj sits in the q slot with k and v
//                absent (qtype -1, any tensor), a fused gate_up_proj in the gate slot with up
//                absent: a Q4_K_M file's q/k (Q4_K) and v (Q6_K) cannot be one weight, so each
//                part is multiplied on its own and its columns put in place.
//                bf16[j] != 0: weight j multiplies through the bf16 kernel
//                (quant_matmul_bf16_raw), its input rounded to bfloat16 first (a bfloat16
//                model on an AVX-512-BF16 CPU, at row counts where that is faster);
//                bf16[j] == 2: that kernel's AMX tiles (quant_amx.cpp); bf16[j] == 3: that
//                kernel in its fixed order (quant_bf16.cpp), the same bits at any B;
//                bf16[j] == 4: qweights[j] holds the interleaved layout, multiplied by
//                quant_interleaved.cpp (its one order, the same bits at any B: the default
//                path's decode of a bfloat16 model on AVX-512-BF16 without AMX, and every
//                step in batch-invariant mode)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "paged_attention.h"
#include "paged_attention_dp.h"
#include "quant_kernels.h"
#include "silu_mul.h"

namespace {

using kvserve_quant::quant_matmul_raw;

// y[i] = w[i] * (x[i] * rsqrt(mean(x^2) + eps)), one row of n, in the eager op's order. The
// sum of squares is accumulated in double: at least as accurate as torch.rms_norm's float32
// accumulation, equal to it within rounding. Eight partial sums, not one chain: one chain of
// dependent double adds is bound by the add's latency (~4 cycles a value), and in a batch of
// decodes the norms were part of ~0.1 ms per layer of single-threaded work between the
// matmuls (an instrumented offline-64 run: 0.75 s of its 17 s of decode_layers).
void rms_norm_row(const float* x, const float* w, int64_t n, double eps, float* y) {
  double part[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) part[j] += static_cast<double>(x[i + j]) * x[i + j];
  double ss = 0.0;
  for (; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  for (int j = 0; j < 8; ++j) ss += part[j];
  const float r = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
  for (i = 0; i < n; ++i) y[i] = w[i] * (x[i] * r);
}

// x += y over B rows of n (the residual adds), threads from 64 rows on
void add_rows(float* x, const float* y, int64_t B, int64_t n) {
  at::parallel_for(0, B, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0 * n; i < b1 * n; ++i) x[i] += y[i];
  });
}

// rms_norm_row over B rows, split over threads when the batch is large enough to pay for them
void rms_norm_rows(const float* x, const float* w, int64_t B, int64_t n, double eps, float* y) {
  at::parallel_for(0, B, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) rms_norm_row(x + b * n, w, n, eps, y + b * n);
  });
}

// Rotate `heads` heads of D values in place: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin),
// the HF rotate_half layout (pairs i, i + D/2); cos/sin (D,) as RotaryEmbedding makes them.
void rotate_heads(float* v, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h, v += D)
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] + (-b) * sin[i];
      v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

// rows per slab (decode_layers_cpu): big enough that a matmul call still splits its weight
// groups over the threads, small enough that a slab's float32 gate_up stays in L2/L3
constexpr int64_t kSlabRows = 256;

template <typename T>
inline void store_row(const float* src, int64_t n, T* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);  // RNE for bf16 / f16
}

// out (B, N) = in (B, K) @ W^T through the float32 or the bf16 kernel; xb: scratch for the
// bfloat16 copy of the input (convert false: it already holds this input's).
void project(const float* in, int64_t B, int64_t K, const at::Tensor& w, int64_t qtype,
             int64_t N, int64_t bf16, int64_t isa, std::vector<uint16_t>& xb, float* out,
             bool convert = true) {
  if (bf16) {
    // rows split over threads from 64 on (a prefill chunk: ~6.5M values a layer at 2000 rows,
    // ~3 ms on one thread); each value rounds the same way on any thread
    if (convert)
      at::parallel_for(0, B, 64, [&](int64_t b0, int64_t b1) {
        kvserve_quant::f32_to_bf16(in + b0 * K, (b1 - b0) * K, xb.data() + b0 * K);
      });
    if (bf16 == 4) {
      const bool ran = kvserve_quant::interleaved_matmul_bf16_raw(xb.data(), B, K,
                                                                  w.data_ptr<uint8_t>(), qtype, N, out);
      TORCH_CHECK(ran, "decode_layers: the interleaved kernel cannot run type ", qtype);
      return;
    }
    kvserve_quant::quant_matmul_bf16_raw(xb.data(), B, K, w.data_ptr<uint8_t>(), qtype, N, out,
                                         bf16 == 2 ? 1 : 0, bf16 == 3);
  } else {
    quant_matmul_raw(in, B, K, w.data_ptr<uint8_t>(), qtype, N, isa, out);
  }
}

// quant_matmul's weight check (interleaved: interleaved_matmul_bf16's), with the layer named;
// the raw loops also need CPU, contiguous.
void check_layer_weight(const at::Tensor& w, int64_t qtype, int64_t n, int64_t k,
                        const char* what, int64_t layer, bool interleaved) {
  try {
    if (interleaved)
      kvserve_quant::check_interleaved_weight(w, qtype, n, k, "decode_layers");
    else
      kvserve_quant::check_weight(w, qtype, n, k);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "decode_layers: layer ", layer, " ", what, ": ", e.msg());
  }
  TORCH_CHECK(w.device().is_cpu() && w.is_contiguous(), "decode_layers: layer ", layer, " ",
              what, " must be a contiguous CPU tensor");
}

// out (B, sum of n) = in @ [W_0; W_1; ..]^T for the slots [j, j + count) present (qtype >= 0)
// with their row counts n; one present slot writes out directly, several write their columns
// through part (scratch) in slot order.
void project_parts(const float* in, int64_t B, int64_t K, at::TensorList w, at::IntArrayRef qtypes,
                   at::IntArrayRef bf16, int64_t j, const int64_t* n, int count, int64_t isa,
                   std::vector<uint16_t>& xb, std::vector<float>& part, float* out) {
  int present = 0;
  int64_t N = 0;
  for (int i = 0; i < count; ++i)
    if (qtypes[j + i] >= 0) ++present, N += n[i];
  if (present == 1) {
    for (int i = 0; i < count; ++i)
      if (qtypes[j + i] >= 0)
        project(in, B, K, w[j + i], qtypes[j + i], n[i], bf16[j + i], isa, xb, out);
    return;
  }
  bool converted = false;
  for (int i = 0, col = 0; i < count; col += n[i], ++i) {
    if (qtypes[j + i] < 0) continue;
    project(in, B, K, w[j + i], qtypes[j + i], n[i], bf16[j + i], isa, xb, part.data(),
            !(converted && bf16[j + i]));
    converted = converted || bf16[j + i];
    const int64_t ni = n[i], c0 = col;
    at::parallel_for(0, B, 64, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        std::memcpy(out + b * N + c0, part.data() + b * ni, ni * sizeof(float));
    });
  }
}

at::Tensor decode_layers_cpu(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                             const at::Tensor& kv, const at::Tensor& slot_mapping,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             at::TensorList norms, at::TensorList qweights,
                             at::IntArrayRef qtypes, at::IntArrayRef bf16, int64_t num_heads, int64_t intermediate,
                             double eps, double scale, int64_t isa, bool one_order_attention) {
  // ---- checks: everything the raw loops below rely on ----
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
              "decode_layers: x must be (B, hidden) float32 on CPU, got ", x_in.scalar_type(),
              " ", x_in.sizes());
  TORCH_CHECK(kv.dim() == 6 && kv.size(0) == 2 && kv.is_contiguous(),
              "decode_layers: kv must be a contiguous (2, layers, blocks, block_size, kv_heads, "
              "head_dim) cache, got ", kv.sizes());
  const auto cache_dtype = kv.scalar_type();
  TORCH_CHECK(cache_dtype == at::kFloat || cache_dtype == at::kBFloat16 || cache_dtype == at::kHalf,
              "decode_layers: cache dtype must be float32, bfloat16 or float16, got ", cache_dtype);
  const int64_t B = x_in.size(0), hidden = x_in.size(1);
  const int64_t L = kv.size(1), NB = kv.size(2), bs = kv.size(3), KVH = kv.size(4), D = kv.size(5);
  const int64_t H = num_heads, I = intermediate;
  TORCH_CHECK(H > 0 && KVH > 0 && H % KVH == 0 && D % 2 == 0, "decode_layers: num_heads ", H,
              " must be a multiple of kv_heads ", KVH, " and head_dim ", D, " even");
  constexpr int64_t S = 7;  // weight slots per layer: q, k, v, o, gate, up, down
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * L &&
                  static_cast<int64_t>(qweights.size()) == S * L &&
                  static_cast<int64_t>(qtypes.size()) == S * L &&
                  static_cast<int64_t>(bf16.size()) == S * L,
              "decode_layers: ", L, " layers need ", 2 * L, " norms and ", S * L,
              " weight slots, types and flags, got ", norms.size(), ", ", qweights.size(), ", ",
              qtypes.size(), ", ", bf16.size());
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == B &&
                    t->size(1) == D && t->is_contiguous(),
                "decode_layers: cos/sin must be contiguous (", B, ", ", D, ") float32, got ",
                t->scalar_type(), " ", t->sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == B,
              "decode_layers: slot_mapping must be (", B, ",) int64");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.size(0) == B && seq_lens.scalar_type() == at::kLong &&
                  seq_lens.numel() == B,
              "decode_layers: block_tables must be (", B, ", width) and seq_lens (", B,
              ",) int64");
  const int64_t qkv_n = (H + 2 * KVH) * D;
  for (int64_t l = 0; l < L; ++l) {
    for (int j = 0; j < 2; ++j)
      TORCH_CHECK(norms[2 * l + j].scalar_type() == at::kFloat &&
                      norms[2 * l + j].numel() == hidden && norms[2 * l + j].is_contiguous(),
                  "decode_layers: layer ", l, " norm ", j, " must be (", hidden, ",) float32");
    const int64_t j = S * l;
    const bool fused_qkv = qtypes[j + 1] < 0 && qtypes[j + 2] < 0;
    const bool fused_gu = qtypes[j + 5] < 0;
    TORCH_CHECK(qtypes[j] >= 0 && qtypes[j + 3] >= 0 && qtypes[j + 4] >= 0 && qtypes[j + 6] >= 0 &&
                    (fused_qkv || (qtypes[j + 1] >= 0 && qtypes[j + 2] >= 0)),
                "decode_layers: layer ", l, ": only k and v (a fused qkv_proj in the q slot) or "
                "up (a fused gate_up_proj) may be absent, got types ", qtypes.slice(j, S));
    check_layer_weight(qweights[j], qtypes[j], fused_qkv ? qkv_n : H * D, hidden,
                       fused_qkv ? "qkv_proj" : "q_proj", l, bf16[j] == 4);
    if (!fused_qkv) {
      check_layer_weight(qweights[j + 1], qtypes[j + 1], KVH * D, hidden, "k_proj", l,
                         bf16[j + 1] == 4);
      check_layer_weight(qweights[j + 2], qtypes[j + 2], KVH * D, hidden, "v_proj", l,
                         bf16[j + 2] == 4);
    }
    check_layer_weight(qweights[j + 3], qtypes[j + 3], hidden, H * D, "o_proj", l,
                       bf16[j + 3] == 4);
    check_layer_weight(qweights[j + 4], qtypes[j + 4], fused_gu ? 2 * I : I, hidden,
                       fused_gu ? "gate_up_proj" : "gate_proj", l, bf16[j + 4] == 4);
    if (!fused_gu)
      check_layer_weight(qweights[j + 5], qtypes[j + 5], I, hidden, "up_proj", l,
                         bf16[j + 5] == 4);
    check_layer_weight(qweights[j + 6], qtypes[j + 6], hidden, I, "down_proj", l,
                       bf16[j + 6] == 4);
  }
  for (int64_t j = 0; j < S * L; ++j) {
    if (qtypes[j] < 0) continue;  // an absent slot
    TORCH_CHECK(bf16[j] >= 0 && bf16[j] <= 4, "decode_layers: bf16[", j, "] is ", bf16[j],
                "; 0 (float32 kernel), 1 (bf16 kernel), 2 (bf16 kernel on AMX tiles), 3 "
                "(bf16 kernel, fixed order) or 4 (interleaved kernel)");
    TORCH_CHECK(!bf16[j] || kvserve_quant::has_avx512_bf16(), "decode_layers: weight ", j,
                " asks for the bf16 kernel, which needs AVX-512-BF16 (this CPU lacks it)");
  }
  TORCH_CHECK(isa >= -1 && isa <= kvserve_isa::kAvx512 && isa <= kvserve_isa::best_isa(),
              "decode_layers: isa ", isa, " is not -1 or a path this CPU supports (best: ",
              kvserve_isa::best_isa(), ")");
  if (isa < 0) isa = kvserve_isa::best_isa();
  auto slots = slot_mapping.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sp[b] >= 0 && sp[b] < NB * bs, "decode_layers: slot_mapping[", b, "] = ", sp[b],
                " is not a slot in [0, ", NB * bs, ")");
  const int64_t width = tables.size(1);
  const int64_t max_len = kvserve_attn::check_block_tables(
      tables.data_ptr<int64_t>(), width, lens.data_ptr<int64_t>(), B, bs, NB);

  // batch-invariant mode (one_order_attention, every weight fixed-order: flags 3, 4) takes the
  // attention of one order for decode rows and prefill chunks where it runs (a bfloat16 cache
  // on AVX-512-BF16); elsewhere the decode kernel, itself the same per row whatever the batch
  // (and faster for long contexts' decodes: the default path's choice)
  bool one_order = one_order_attention && cache_dtype == at::kBFloat16 &&
                   kvserve_attn::attend_dp_available(H, KVH, D);
  for (int64_t j = 0; j < S * L; ++j)
    one_order = one_order && (qtypes[j] < 0 || bf16[j] == 3 || bf16[j] == 4);
  const float fscale = static_cast<float>(scale);  // as ATen's float op with a scalar
  at::Tensor x = x_in.contiguous().clone();  // the residual stream, updated in place
  if (B == 0) return x;
  float* xp = x.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  // per-step buffers, reused by every layer
  // Every op but attention is per row, so the layers run a slab of rows at a time: a slab's
  // float32 intermediates (gate_up: kSlabRows x 2I) stay in cache instead of streaming ~50 MB
  // a layer through DRAM at a 2000-token prefill. Attention runs over all B rows once every
  // slab's K/V are in the cache. With one-order weights (flags 3, 4: batch-invariant mode, the
  // default path's interleaved decodes) a row's bits are those of all B rows at once; the
  // other kernels pick their tiles by row count, as they did for B rows.
  const int64_t slab = std::min(B, kSlabRows);
  std::vector<float> h(slab * hidden), qkv(slab * qkv_n), q(B * H * D), attn(B * H * D),
      proj(slab * hidden), gu(slab * 2 * I), act(slab * I);
  std::vector<float> part;  // one unfused part's columns (q, k, v or gate, up) before placing
  for (int64_t l = 0; l < L; ++l)
    if (qtypes[S * l + 1] >= 0 || qtypes[S * l + 5] >= 0)
      part.resize(slab * std::max(H * D, I));
  const int64_t qkv_parts[3] = {H * D, KVH * D, KVH * D}, gu_parts[2] = {I, I};
  const int64_t qkv_fused[3] = {qkv_n, 0, 0}, gu_fused[2] = {2 * I, 0};
  std::vector<uint16_t> xb(slab * std::max({hidden, H * D, I}));  // bf16 copy of a matmul input
  const int64_t row = KVH * D, layer_elems = NB * bs * row;
  const int64_t elem = kv.element_size();
  char* kv_base = static_cast<char*>(kv.data_ptr());

  for (int64_t l = 0; l < L; ++l) {
    const float* w_in = norms[2 * l].data_ptr<float>();
    const float* w_post = norms[2 * l + 1].data_ptr<float>();
    char* kc = kv_base + (0 * L + l) * layer_elems * elem;
    char* vc = kv_base + (1 * L + l) * layer_elems * elem;
    const int64_t j = S * l;  // this layer's first weight slot

    for (int64_t r0 = 0; r0 < B; r0 += slab) {
      const int64_t rb = std::min(slab, B - r0);
      rms_norm_rows(xp + r0 * hidden, w_in, rb, hidden, eps, h.data());
      project_parts(h.data(), rb, hidden, qweights, qtypes, bf16, j,
                    qtypes[j + 1] < 0 ? qkv_fused : qkv_parts, 3, isa, xb, part, qkv.data());
      // per row (its own slot): threads from 32 rows on, a prefill chunk's (~1 us a row)
      at::parallel_for(0, rb, 32, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t b = r0 + i;       // the row in the step
          float* r = &qkv[i * qkv_n];  // [q (H D) | k (KVH D) | v (KVH D)]
          rotate_heads(r, H + KVH, D, cp + b * D, snp + b * D);  // q and k are adjacent
          for (int64_t e = 0; e < H * D; ++e) q[b * H * D + e] = r[e] * fscale;
          const int64_t off = sp[b] * row;
          const float *k = r + H * D, *v = k + row;
          switch (cache_dtype) {
            case at::kFloat:
              std::memcpy(reinterpret_cast<float*>(kc) + off, k, row * sizeof(float));
              std::memcpy(reinterpret_cast<float*>(vc) + off, v, row * sizeof(float));
              break;
            case at::kBFloat16:
              store_row(k, row, reinterpret_cast<c10::BFloat16*>(kc) + off);
              store_row(v, row, reinterpret_cast<c10::BFloat16*>(vc) + off);
              break;
            default:
              store_row(k, row, reinterpret_cast<c10::Half*>(kc) + off);
              store_row(v, row, reinterpret_cast<c10::Half*>(vc) + off);
          }
        }
      });
    }
    if (one_order)  // batch-invariant mode: decode rows and prefill chunks in one order
      kvserve_attn::attend_dp_raw(q.data(), kc, vc, tables.data_ptr<int64_t>(), width,
                                  lens.data_ptr<int64_t>(), B, H, KVH, D, bs, max_len,
                                  attn.data());
    else
      kvserve_attn::paged_attend_raw(q.data(), kc, vc, cache_dtype, tables.data_ptr<int64_t>(),
                                     width, lens.data_ptr<int64_t>(), B, H, KVH, D, bs, max_len,
                                     isa, attn.data());
    for (int64_t r0 = 0; r0 < B; r0 += slab) {
      const int64_t rb = std::min(slab, B - r0);
      float* xr = xp + r0 * hidden;
      project(attn.data() + r0 * H * D, rb, H * D, qweights[j + 3], qtypes[j + 3], hidden,
              bf16[j + 3], isa, xb, proj.data());
      add_rows(xr, proj.data(), rb, hidden);
      rms_norm_rows(xr, w_post, rb, hidden, eps, h.data());
      project_parts(h.data(), rb, hidden, qweights, qtypes, bf16, j + 4,
                    qtypes[j + 5] < 0 ? gu_fused : gu_parts, 2, isa, xb, part, gu.data());
      kvserve_act::silu_mul(gu.data(), rb, I, isa, act.data());
      project(act.data(), rb, I, qweights[j + 6], qtypes[j + 6], hidden, bf16[j + 6], isa, xb,
              proj.data());
      add_rows(xr, proj.data(), rb, hidden);
    }
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def(
      "decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor(a!) kv, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, Tensor[] norms, Tensor[] qweights, int[] qtypes, "
      "int[] bf16, "
      "int num_heads, int intermediate, float eps, float scale, int isa=-1, "
      "bool one_order_attention=False) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("decode_layers", &decode_layers_cpu); }
