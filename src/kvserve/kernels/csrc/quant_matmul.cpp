// kvserve::quant_matmul and kvserve::dequantize: float32 activations times GGUF-quantized
// weights kept in their block format, dequantized inside the kernel.
//
//   x        (M, K) float32, contiguous
//   qweight  (N, K / block_elems * block_bytes) uint8: exactly a GGUF 2-D tensor's rows
//   out      (M, N) float32 = x @ dequantize(qweight).T
//
// Work split: at::parallel_for over tiles of kNR = 4 weight rows. Per tile and k-chunk
// (<= kChunk values) the 4 rows are decoded once into an L1 buffer of float32, then every
// activation row reads that buffer in register tiles of up to max_mt rows (4 on AVX-512):
//
//        k0          k0+kc
//   w  [ r0 ========== ]    <- decoded once per (tile, chunk)
//      [ r1 ========== ]
//      [ r2 ========== ]
//      [ r3 ========== ]
//   x  [ m0 .. m0+mt-1 ]    <- each register tile: mt x 4 dot products over the chunk
//
// so unpacking costs O(N K) whatever M, and M = 1 streams the weights once (memory bound).
// Results differ from dequantize-then-matmul only in summation order.
//
// isa: -1 = best the CPU supports, 0 = scalar, 1 = AVX2+FMA, 2 = AVX-512 F/BW/VL/DQ; an ISA
// the CPU lacks is an error. kvserve::cpu_isa() returns the best one.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "quant_kernels.h"

namespace kvserve_quant {

void quant_matmul_raw(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t qtype,
                      int64_t N, int64_t isa, float* op) {
  if (M >= gemm_min_rows(isa) && quant_gemm(xp, M, K, wp, qtype, N, isa, op)) return;
  const Format& f = *find_format(qtype);
  const IsaKernels& ik = isa_kernels(isa);
  const int64_t row_bytes = K / f.block_elems * f.block_bytes;
  const int64_t ntiles = (N + kNR - 1) / kNR;
  // >= ~64k weight values per task, so small matrices do not pay for threads they can't use.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (K * kNR));

  if (M == 1 && ik.gemv[f.index] != nullptr) {  // batch-1 decode: decoded in registers
    const GemvFn gemv = ik.gemv[f.index];
    at::parallel_for(0, ntiles, grain, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * kNR;
        gemv(wp + n0 * row_bytes, row_bytes, static_cast<int>(std::min<int64_t>(kNR, N - n0)),
             xp, K, op + n0);
      }
    });
    return;
  }
  if (M >= 2 && M <= kMaxGemvM && ik.gemv_m[f.index] != nullptr) {  // a few decodes
    const GemvMFn gemv_m = ik.gemv_m[f.index];
    at::parallel_for(0, ntiles, grain, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * kNR;
        gemv_m(wp + n0 * row_bytes, row_bytes, static_cast<int>(std::min<int64_t>(kNR, N - n0)),
               xp, M, K, op + n0, N);
      }
    });
    return;
  }
  at::parallel_for(0, ntiles, grain, [&](int64_t t0, int64_t t1) {
    alignas(64) float wbuf[kNR * kChunk];  // (kNR, kChunk) decoded weights, 16 KiB
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kNR;
      const int nr = static_cast<int>(std::min<int64_t>(kNR, N - n0));
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, K - k0);
        for (int r = 0; r < kNR; ++r) {
          float* dst = wbuf + r * kChunk;
          if (r < nr)
            ik.dequant[f.index](wp + (n0 + r) * row_bytes + k0 / f.block_elems * f.block_bytes,
                                kc / f.block_elems, dst);
          else
            std::memset(dst, 0, kc * sizeof(float));  // tail tile: rows beyond N
        }
        for (int64_t m0 = 0; m0 < M; m0 += ik.max_mt) {
          const int mt = static_cast<int>(std::min<int64_t>(ik.max_mt, M - m0));
          ik.tile[mt](wbuf, kChunk, xp + m0 * K + k0, K, kc, op + m0 * N + n0, N, nr, k0 > 0);
        }
      }
    }
  });
}

const Format& checked_format(int64_t qtype) {
  const Format* f = find_format(qtype);
  TORCH_CHECK(f != nullptr, "kvserve: unsupported GGML quantization type ", qtype,
              " (supported: Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q4_K=12, Q6_K=14)");
  return *f;
}

const Format& check_weight(const at::Tensor& qweight, int64_t qtype, int64_t n, int64_t k) {
  const Format& f = checked_format(qtype);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2,
              "kvserve: qweight must be a 2-D uint8 tensor, got ", qweight.scalar_type(), " ",
              qweight.sizes());
  TORCH_CHECK(k % f.block_elems == 0, "kvserve: in_features ", k,
              " is not a multiple of the block size ", f.block_elems, " of type ", qtype);
  const int64_t row_bytes = k / f.block_elems * f.block_bytes;
  TORCH_CHECK(qweight.size(0) == n && qweight.size(1) == row_bytes,
              "kvserve: qweight of type ", qtype, " for (", n, ", ", k, ") must be (", n, ", ",
              row_bytes, "), got ", qweight.sizes());
  return f;
}

namespace {

const char* isa_name(int64_t isa) {
  switch (isa) {
    case kScalar: return "scalar";
    case kAvx2: return "avx2+fma";
    case kAvx512: return "avx512 (f,bw,vl,dq)";
    default: return "unknown";
  }
}

int64_t resolve_isa(int64_t isa) {
  const int64_t best = best_isa();
  if (isa == -1) return best;
  TORCH_CHECK(isa >= kScalar && isa <= kAvx512, "kvserve: isa must be -1 (best), 0 (scalar), ",
              "1 (avx2+fma) or 2 (avx512), got ", isa);
  TORCH_CHECK(isa <= best, "kvserve: isa ", isa, " (", isa_name(isa),
              ") is not supported by this CPU; the best it supports is ", best, " (",
              isa_name(best), ")");
  return isa;
}

// Decode values [k0, k0 + kc) of one weight row into float32 `out`.
inline void dequant_chunk(const Format& f, const IsaKernels& ik, const uint8_t* row, int64_t k0,
                          int64_t kc, float* out) {
  ik.dequant[f.index](row + k0 / f.block_elems * f.block_bytes, kc / f.block_elems, out);
}

// The two float32 ops: quant_matmul (the path by row count) and quant_matmul_gemm (the panel
// GEMM at any row count: tests hold it to the reference at every tile edge, benchmarks time it
// against the dot tiles; the ISA must have one).
at::Tensor quant_matmul_checked(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype,
                                int64_t out_features, int64_t isa, bool force_gemm) {
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu(), "kvserve: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "kvserve: x must be a contiguous 2-D float32 tensor, got ", x.scalar_type(), " ",
              x.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  check_weight(qweight, qtype, N, K);
  const int64_t resolved = resolve_isa(isa);
  TORCH_CHECK(!force_gemm || resolved != kScalar, "kvserve: the panel GEMM needs the avx2+fma "
              "or avx512 path, got isa ", resolved, " (", isa_name(resolved), ")");
  const at::Tensor w = qweight.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (force_gemm) {
    const bool done = quant_gemm(xp, M, K, wp, qtype, N, resolved, out.data_ptr<float>());
    TORCH_INTERNAL_ASSERT(done);  // every non-scalar path has one
  } else {
    quant_matmul_raw(xp, M, K, wp, qtype, N, resolved, out.data_ptr<float>());
  }
  return out;
}

at::Tensor quant_matmul_cpu(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype,
                            int64_t out_features, int64_t isa) {
  return quant_matmul_checked(x, qweight, qtype, out_features, isa, false);
}

at::Tensor quant_matmul_gemm_cpu(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype,
                                 int64_t out_features, int64_t isa) {
  return quant_matmul_checked(x, qweight, qtype, out_features, isa, true);
}

int64_t gemm_min_rows_op(int64_t isa) {
  const int64_t rows = gemm_min_rows(resolve_isa(isa));
  return rows == INT64_MAX ? -1 : rows;
}

at::Tensor dequantize_cpu(const at::Tensor& qweight, int64_t qtype, int64_t out_features,
                          int64_t in_features, int64_t isa) {
  TORCH_CHECK(qweight.device().is_cpu(), "kvserve: CPU tensors only");
  const int64_t N = out_features, K = in_features;
  const Format& f = check_weight(qweight, qtype, N, K);
  const IsaKernels& ik = isa_kernels(resolve_isa(isa));
  const at::Tensor w = qweight.contiguous();
  at::Tensor out = at::empty({N, K}, qweight.options().dtype(at::kFloat));
  if (N == 0 || K == 0) return out;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = w.size(1);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / K);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k0 = 0; k0 < K; k0 += kChunk)
        dequant_chunk(f, ik, wp + n * row_bytes, k0, std::min(kChunk, K - k0), op + n * K + k0);
  });
  return out;
}

// No Meta kernels here: the fake (shape) functions are registered from Python
// (kvserve/kernels/fake_ops.py) because torch.compile needs them to keep the token count
// symbolic; a C++ Meta kernel reading x.size(0) as an int specializes every batch size.

int64_t cpu_isa() { return best_isa(); }

}  // namespace

}  // namespace kvserve_quant

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("quant_matmul(Tensor x, Tensor qweight, int qtype, int out_features, int isa=-1) -> Tensor");
  m.def(
      "dequantize(Tensor qweight, int qtype, int out_features, int in_features, int isa=-1) -> "
      "Tensor");
  m.def(
      "quant_matmul_gemm(Tensor x, Tensor qweight, int qtype, int out_features, int isa=-1) -> "
      "Tensor");
  m.def("quant_gemm_min_rows(int isa=-1) -> int", &kvserve_quant::gemm_min_rows_op);
  m.def("cpu_isa() -> int", &kvserve_quant::cpu_isa);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("quant_matmul", &kvserve_quant::quant_matmul_cpu);
  m.impl("quant_matmul_gemm", &kvserve_quant::quant_matmul_gemm_cpu);
  m.impl("dequantize", &kvserve_quant::dequantize_cpu);
}


