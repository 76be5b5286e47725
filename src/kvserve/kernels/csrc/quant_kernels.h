// Shared declarations of the quantized-weight kernels (quant_*.cpp).
//
// A GGUF weight row (K values) is a run of blocks of `block_elems` values, `block_bytes` each.
// Every kernel works in two stages per chunk of a row (chunk = whole blocks, <= kChunk values):
//
//   1. dequantize the chunk into an L1 buffer of float32, reproducing llama.cpp's / gguf-py's
//      dequantization bit for bit (same float ops, same order). Portable path: decode
//      (quant_formats.cpp / quant_kquants.cpp) to int8 codes plus, per group of 16 values,
//      a float scale and bias, value[i] = float(q[i]) * scale[i / 16] (+ bias[i / 16]);
//      16 is the finest scale granularity of any format (Q6_K). x86 paths: the same
//      arithmetic straight from the block bytes in SIMD registers (quant_simd.h).
//   2. multiply (per ISA, quant_isa.cpp): a register tile of up to kMaxMT activation rows x
//      kNR weight rows over the buffer.
// The unpacking is thus done once per weight row whatever the number of activation rows M.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>  // INT64_MAX

#include "cpu_isa.h"

namespace kvserve_quant {

// GGML type ids (gguf.GGMLQuantizationType).
enum QType : int64_t {
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
};

// The `isa` argument of the ops and the result of kvserve::cpu_isa().
using kvserve_isa::Isa;
using kvserve_isa::kAvx2;
using kvserve_isa::kAvx512;
using kvserve_isa::kScalar;

constexpr int64_t kGroup = 16;    // values per scale/bias group
constexpr int64_t kChunk = 1024;  // values per decoded chunk: a multiple of 256 (K-quant blocks)
constexpr int kNR = 4;            // weight rows per register tile (all ISAs)

// Decode `nblocks` consecutive blocks at `src` into q[nblocks * block_elems] and
// scale/bias[nblocks * block_elems / 16] (bias left untouched when the format has none).
// The portable path; the x86 paths decode straight to float32 (quant_simd.h).
using DecodeFn = void (*)(const uint8_t* src, int64_t nblocks, int8_t* q, float* scale,
                          float* bias);

// Dequantize `nblocks` consecutive blocks at `src` into out[nblocks * block_elems] (float32).
using DequantFn = void (*)(const uint8_t* src, int64_t nblocks, float* out);

constexpr int kNumFormats = 8;

struct Format {
  int64_t block_elems;
  int64_t block_bytes;
  bool has_bias;
  DecodeFn decode;
  int index;  // into IsaKernels::dequant, 0 .. kNumFormats - 1
};

// The format of a GGML type id; nullptr when it is not supported.
const Format* find_format(int64_t qtype);

// Per-format decoders (quant_formats.cpp: 32-value blocks; quant_kquants.cpp: 256-value).
void decode_q4_0(const uint8_t*, int64_t, int8_t*, float*, float*);
void decode_q4_1(const uint8_t*, int64_t, int8_t*, float*, float*);
void decode_q5_0(const uint8_t*, int64_t, int8_t*, float*, float*);
void decode_q5_1(const uint8_t*, int64_t, int8_t*, float*, float*);
void decode_q8_0(const uint8_t*, int64_t, int8_t*, float*, float*);
void decode_q4_k(const uint8_t*, int64_t, int8_t*, float*, float*);
void decode_q5_k(const uint8_t*, int64_t, int8_t*, float*, float*);
void decode_q6_k(const uint8_t*, int64_t, int8_t*, float*, float*);

// out[m * ldo + r] (=, or += when accumulate) sum_k x[m * ldx + k] * w[r * ldw + k]
// for m < MT (the tile's activation rows), r < nr <= kNR, k < kc (a multiple of 32).
// w rows nr..kNR-1 must be readable (they are zero-filled); their results are dropped.
using TileFn = void (*)(const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t kc,
                        float* out, int64_t ldo, int nr, bool accumulate);

constexpr int kMaxMT = 4;

// One activation row against nr <= kNR weight rows, decoding in registers (no L1 buffer):
// out[r] = sum_k x[k] * w_r[k] over K values (a multiple of the block size), w_r at
// w + r * row_bytes. The weight values are the dequantizer's own (same float ops); only the
// summation order differs from dequantize-then-matmul.
using GemvFn = void (*)(const uint8_t* w, int64_t row_bytes, int nr, const float* x, int64_t K,
                        float* out);

// M = 2..kMaxGemvM activation rows (x rows K apart) against nr <= kNR weight rows, decoding
// each block once into registers for all M: out[m * ldo + r]. Each row's result is the batch-1
// GemvFn's for that row, bit for bit.
using GemvMFn = void (*)(const uint8_t* w, int64_t row_bytes, int nr, const float* x, int64_t M,
                         int64_t K, float* out, int64_t ldo);
constexpr int64_t kMaxGemvM = 4;

struct IsaKernels {
  DequantFn dequant[kNumFormats];  // by Format::index
  int max_mt;                      // largest activation-row tile (tile[1..max_mt] are set)
  TileFn tile[kMaxMT + 1];
  GemvFn gemv[kNumFormats];        // M = 1 in registers, by Format::index; nullptr: none
  GemvMFn gemv_m[kNumFormats];     // M = 2..kMaxGemvM in registers; nullptr: none (the dot tiles)
};

int64_t best_isa();                        // the best ISA this CPU supports
const IsaKernels& isa_kernels(int64_t isa);  // isa must be supported (checked by the caller)

// out (M, N) = x (M, K) @ dequantize(w).T, float32, row-major and contiguous; w is the
// GGUF rows of type qtype (K / block_elems * block_bytes bytes each). No checks: the caller
// has validated qtype, shapes and isa (a supported one, not -1). Threads over weight tiles.
void quant_matmul_raw(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t qtype,
                      int64_t N, int64_t isa, float* out);

// The format of qtype; raises naming the supported types when there is none.
const Format& checked_format(int64_t qtype);

// Raises unless qweight is the uint8 (n, k / block_elems * block_bytes) rows of an (n, k)
// weight of type qtype (and k a multiple of its block size); returns the format.
const Format& check_weight(const at::Tensor& qweight, int64_t qtype, int64_t n, int64_t k);

// The many-rows path of quant_matmul_raw (quant_gemm.cpp): out = x @ dequantize(w).T through
// weight panels and outer-product tiles, on the AVX-512 or the AVX2 path (`isa`, resolved);
// false (nothing written) for the scalar path or an ISA the CPU lacks.
bool quant_gemm(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t qtype,
                int64_t N, int64_t isa, float* out);
// Rows from which quant_matmul_raw takes it, per ISA (measured: below, the dot tiles win,
// their activations in L2). AVX2's dot tiles hold only 2 activation rows, so it wins sooner.
constexpr int64_t kGemmMinRowsAvx512 = 384;
constexpr int64_t kGemmMinRowsAvx2 = 64;
inline int64_t gemm_min_rows(int64_t isa) {
  return isa == kAvx512 ? kGemmMinRowsAvx512 : isa == kAvx2 ? kGemmMinRowsAvx2 : INT64_MAX;
}
// The bf16 kernel's (quant_bf16.cpp) panel GEMM, from this many rows. Measured on Zen 5, the
// default model's 120 layer matmuls from DRAM, 2 threads, two alternating runs: dot tiles
// against panel 96 rows 31-32 ms both, 128 rows 39-40 both, 192 rows 55-58 against 53-55,
// 256 rows 76-79 against 68-69, 384 rows 112-118 against 98-99.
constexpr int64_t kGemmMinRowsBf16 = 128;

// True on an x86-64 CPU with AVX-512 (F/BW/VL/DQ) and AVX-512-BF16 (VDPBF16PS).
bool has_avx512_bf16();

// out (M, N) float32 = x (M, K) bfloat16 @ bf16(dequantize(w)).T (quant_bf16.cpp). No checks:
// the caller has validated shapes and qtype, and has_avx512_bf16(). From amx_min_rows rows
// on (0: never) the AMX tiles of quant_amx.cpp do it where the CPU has them. fixed_order:
// every output element summed in the one order of quant_bf16.cpp's top comment at every M
// (no AMX tiles, no panel GEMM, which sum in others): a row's result does not depend on M.
void quant_matmul_bf16_raw(const uint16_t* x, int64_t M, int64_t K, const uint8_t* w,
                           int64_t qtype, int64_t N, float* out, int64_t amx_min_rows = 0,
                           bool fixed_order = false);

// out (M, N) float32 = x (M, K) bfloat16 times a weight repacked into 16-row groups
// (quant_interleaved.cpp: the layout, and the one summation order it keeps at every M). No
// shape checks; false (nothing written) where the CPU lacks AVX-512-BF16, K is not a multiple
// of 32 or qtype has no packed layout (Q4_0, Q4_1, Q8_0 have).
// Bytes of one (group, block) of the interleaved layout of qtype; 0 when it has none.
int64_t interleaved_block_bytes(int64_t qtype);
// Values per (group, block) of that layout along K: 256 for the K-quants, else 32.
int64_t interleaved_block_values(int64_t qtype);
// TORCH_CHECKs an interleaved (N, K) weight of qtype for `op`: its type, K, and the shape.
void check_interleaved_weight(const at::Tensor& w, int64_t qtype, int64_t N, int64_t K,
                              const char* op);
// out_bf16 set: the results rounded to bfloat16 (nearest even) there instead of out.
bool interleaved_matmul_bf16_raw(const uint16_t* x, int64_t M, int64_t K, const uint8_t* w,
                                 int64_t qtype, int64_t N, float* out,
                                 uint16_t* out_bf16 = nullptr);

// True on an x86-64 Linux CPU with AMX-TILE + AMX-BF16 (and AVX-512-BF16) whose kernel
// granted this process the tile state.
bool has_amx_bf16();

// The same product through AMX tiles (quant_amx.cpp); false (nothing written) where the CPU
// lacks AMX-BF16 or K is not a multiple of 32.
bool quant_matmul_amx_raw(const uint16_t* x, int64_t M, int64_t K, const uint8_t* w,
                          int64_t qtype, int64_t N, float* out);

// dst[i] = bfloat16(src[i]), round to nearest even (AVX-512-BF16 where the CPU has it).
void f32_to_bf16(const float* src, int64_t n, uint16_t* dst);

// fp16 bits -> float (portable; once per block, so speed does not matter).
float half_to_float(uint16_t bits);

}  // namespace kvserve_quant
