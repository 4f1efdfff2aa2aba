// What the quantized-weight matmuls share (cpu_qlinear.cpp: 4- and 8-bit codes; cpu_kquant.cpp:
// 5- and 6-bit codes): the activation rows quantized to 8 bits per group of 32, and the walk over
// pairs of 16-row weight blocks. The arithmetic and layouts are described in cpu_qlinear.cpp.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "cpu_namespace.h"

namespace TOKENLOOM_CPU_NAMESPACE {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlockRows = 16;  // output rows per block
constexpr int64_t kRowChunk = 128;  // activation rows per pass over the blocks (kept in L2)

// rows of x quantized per group of 32: codes [M, K]; per row and group the scale s, the sum of
// the codes S, and s * S
struct QuantizedRows {
  const int8_t* codes;
  const float* scales;
  const int32_t* code_sums;
  const float* scaled_sums;
  int64_t groups;
};

// x [M, K] (bfloat16 or float32, contiguous, K a multiple of 32) quantized as GGML's Q8 blocks
// (cpu_qlinear.cpp); the buffers belong to the calling thread and live until its next call
QuantizedRows quantize_activation_rows(const at::Tensor& x);

// pairs of blocks, each thread a contiguous range of them (one stream); an odd last block alone.
// Tile(rows, weight, out, m_begin, m_end, b0, blocks_in_tile) computes out[m_begin..m_end, 16 b0..]
template <typename RowsTimesBlocks>
void for_each_tile(int64_t M, int64_t N, const RowsTimesBlocks& rows_times_blocks) {
  const int64_t blocks = N / kBlockRows;
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = 0; m < M; m += kRowChunk) {
      const int64_t m_end = std::min(M, m + kRowChunk);
      for (int64_t pair = begin; pair < end; ++pair) rows_times_blocks(m, m_end, 2 * pair, 2 * pair + 1 < blocks ? 2 : 1);
    }
  });
}

}  // namespace TOKENLOOM_CPU_NAMESPACE
