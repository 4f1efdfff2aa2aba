// The 6-bit matmul of cpu_kquant.cpp for other sources (cpu_moe.cpp's Q6_K experts, say): the
// activation rows quantized by quantize_activation_rows / int4_quantize_rows (cpu_qlinear.h), the
// weight packed for int6_linear (tokenloom/kernels/kquant_matmul.py pack_int6).
#pragma once

#include <cstdint>

#include "cpu_qlinear.h"

namespace TOKENLOOM_CPU_NAMESPACE {

// -32 times the sum of each 16 activation codes of x [M, K] (K a multiple of 256: the 6-bit code
// offset's share of each 16 features' code products), which int6 tiles take; the calling thread's
// buffer, valid until its next call
const int32_t* int6_half_group_sums(const QuantizedRows& x, int64_t M, int64_t K);

// out[m, 16 b0 .. 16 (b0 + 2)) (one block when b0 is the odd last one) for rows m_begin..m_end of
// x, against a 6-bit weight of N outputs packed for int6_linear; b0 even; out has N columns
void int6_rows_times_block_pair(const QuantizedRows& x, const int32_t* half_offsets, const uint8_t* weight, float* out,
                                int64_t m_begin, int64_t m_end, int64_t b0, int64_t N, int64_t K);

}  // namespace TOKENLOOM_CPU_NAMESPACE
