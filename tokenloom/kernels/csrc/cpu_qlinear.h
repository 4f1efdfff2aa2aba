// The pieces of cpu_qlinear.cpp's 4-bit matmul other operators chain (cpu_moe.cpp runs them over
// many experts' weights in one parallel loop): rows of activations quantized once per group of
// 32, and the tile routine over one pair of 16-row weight blocks. The weight layout and the
// arithmetic are described at the top of cpu_qlinear.cpp.
#pragma once

#include <cstdint>

#include "cpu_namespace.h"

namespace TOKENLOOM_CPU_NAMESPACE {

// rows of x quantized per group of 32: codes [M, K]; per row and group the scale s, the sum of
// the codes S, and s * S
struct QuantizedRows {
  const int8_t* codes;
  const float* scales;
  const int32_t* code_sums;
  const float* scaled_sums;
  int64_t groups;
};

// float32 rows x [M, K] (K a multiple of 32) quantized into the calling thread's buffers: valid
// until that thread's next quantization (int4_linear's included)
QuantizedRows int4_quantize_rows(const float* x, int64_t M, int64_t K);

// out[m, 16 b0 .. 16 (b0 + 2)) (one block when b0 is the odd last one) for rows m_begin..m_end of
// x, against a 4-bit weight of N outputs packed for int4_linear; b0 even; out has N columns
void int4_rows_times_block_pair(const QuantizedRows& x, const uint8_t* weight, float* out, int64_t m_begin,
                                int64_t m_end, int64_t b0, int64_t N, int64_t K);

}  // namespace TOKENLOOM_CPU_NAMESPACE
