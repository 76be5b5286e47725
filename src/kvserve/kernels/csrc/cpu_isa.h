// The instruction-set paths every kvserve kernel chooses between at run time, and the one
// detection of which this CPU runs (the `isa` argument of the ops uses the same numbers).
#pragma once

#include <cstdint>

namespace kvserve_isa {

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// AVX-512 here means F + BW + VL + DQ; AVX2 means AVX2 + FMA + F16C. Detected once.
inline int64_t best_isa() {
  static const int64_t best = [] {
#if defined(__x86_64__)
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      return int64_t{kAvx512};
    if (avx2) return int64_t{kAvx2};
#endif
    return int64_t{kScalar};
  }();
  return best;
}

}  // namespace kvserve_isa
