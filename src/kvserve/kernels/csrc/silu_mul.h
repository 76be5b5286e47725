// SiLU-and-multiply of the MLP, for the fused decode step (decode_layers.cpp).
#pragma once

#include <cstdint>

namespace kvserve_act {

// act (rows, I) <- silu(g) * u = g / (1 + exp(-g)) * u, where gu (rows, 2I) holds [g | u] per
// row (the fused gate_up projection's output). isa: a path this CPU supports (not -1),
// checked by the caller. The SIMD paths use kvserve_vec's exp (~1 ulp), the scalar one
// std::exp; torch's own silu is itself vectorized (Sleef), so neither is "the" answer.
void silu_mul(const float* gu, int64_t rows, int64_t I, int64_t isa, float* act);

}  // namespace kvserve_act
