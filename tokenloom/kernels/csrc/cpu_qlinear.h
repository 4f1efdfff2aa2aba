// What the quantized-weight matmuls share (cpu_qlinear.cpp: 4- and 8-bit codes; cpu_kquant.cpp:
// 5- and 6-bit codes; cpu_moe.cpp chains the 4-bit tile over many experts' weights in one parallel
// loop): the activation rows quantized to 8 bits per group of 32, the walk over pairs of 16-row
// weight blocks, and the 4-bit tile routine. The arithmetic and layouts are described in
// cpu_qlinear.cpp.
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
constexpr int64_t kAmxRowSlack = 32;  // allocated activation code rows past the last (read by AMX tiles)

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

// A decode step's rows (one; or up to 8, cpu_qlinear.cpp's 4-bit tiles): each thread's range of
// block pairs read as two streams at once, pair i of the range's first half beside pair i of its
// second half (two_pairs(b0, b1), full pairs), and a pair left over (an odd count, or the odd last
// block) alone (one_pair(b0, width)).
// The hardware prefetcher follows each half front to back across its pairs, and a core keeps more
// of memory's reads in flight with two streams than with one and a prefetch: the AVX-512 4- and
// 6-bit tiles over a 1.7B Q4_K_M file's weights (2 threads, weights from memory) read its int4
// layers in 28.3-28.7 ms a step against 30.1-31.7 and its Q6_K ones in 7.6-7.9 against 8.0-8.5
// (benchmarks/decode_profile.py, alternated). Each output keeps its float operations and their
// order, so a row gets the bits any tiling gives it.
template <typename TwoPairs, typename OnePair>
void for_each_pair_in_two_streams(int64_t N, const TwoPairs& two_pairs, const OnePair& one_pair) {
  const int64_t blocks = N / kBlockRows, full_pairs = blocks / 2;
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    const int64_t half = std::max<int64_t>(std::min(end, full_pairs) - begin, 0) / 2;
    for (int64_t i = 0; i < half; ++i) two_pairs(2 * (begin + i), 2 * (begin + half + i));
    for (int64_t pair = begin + 2 * half; pair < end; ++pair) one_pair(2 * pair, 2 * pair + 1 < blocks ? 2 : 1);
  });
}

// float32 rows x [M, K] (K a multiple of 32) quantized into the calling thread's buffers: valid
// until that thread's next quantization (int4_linear's included)
QuantizedRows int4_quantize_rows(const float* x, int64_t M, int64_t K);

// out[m, 16 b0 .. 16 (b0 + 2)) (one block when b0 is the odd last one) for rows m_begin..m_end of
// x, against a 4-bit weight of N outputs packed for int4_linear; b0 even; out has N columns
void int4_rows_times_block_pair(const QuantizedRows& x, const uint8_t* weight, float* out, int64_t m_begin,
                                int64_t m_end, int64_t b0, int64_t N, int64_t K);

}  // namespace TOKENLOOM_CPU_NAMESPACE
