// Quantized weights times 8-bit activations, GGML's Q4 x Q8 and Q8 x Q8 arithmetic (as llama.cpp
// runs a GGUF on the CPU), for any number of rows; registered where the CPU has AVX512-VNNI:
//   `tokenloom_cpu::int4_linear`: 4-bit weights (GGUF Q4_0/Q4_1/Q4_K linear layers), out in x's dtype
//   `tokenloom_cpu::int8_linear`: 8-bit weights (a Q8_0 LM head), float32 out (the logits)
// The Python side (tokenloom/kernels/int4_matmul.py, int8_matmul.py) packs the weights; its
// `quantize_activations` and `dequantize_int4` / `dequantize_int8` are the reference the tests
// hold these kernels to.
//
// A weight value is d * code + m with an unsigned code (4-bit: 0..15; 8-bit: Q8_0's signed code
// plus 128, so m = -128 d) and one (d, m) pair per group of 32 input features. Each row of x is
// quantized per group of 32 the same way: its scale is s = max|x| / 127 and its codes
// q = round(x * (127 / max|x|)) (to nearest even; all zero for a zero group), so that
//   sum_k w_k x_k ~ sum_groups [ d * s * sum_k code_k q_k + m * s * sum_k q_k ]
// in which the inner sums are exact integers (`vpdpbusd`: 16 lanes of 4 unsigned-code times
// signed-activation products each). For 8-bit weights the m term is taken in integers
// (sum_k code_k q_k - 128 sum_k q_k), so their result is exact up to float32 summation.
//
// Layout, for out_features N (a multiple of 16), in_features K, G = K / 32 groups: block b
// (output rows 16b..16b+15) has G groups of bytes; its group g holds the codes in 8
// steps of [16 rows, 4 features] (64 bytes each: bytes 4l..4l+3 of a step are row 16b+l's
// features 4t..4t+3), then the scales:
//   4-bit, 320 bytes: the steps in nibbles, step 2t in the low and 2t+1 in the high nibbles of
//          64 bytes t = 0..3; then d[16] and m[16] as float16
//   8-bit, 576 bytes: 8 x 64 bytes of codes; then d[16] as float32
// Blocks are stored in pairs, group by group: [pair, G, 2, group bytes] (an odd last block
// [G, group bytes]), so a tile of a pair reads one stream front to back; each 64-byte load
// (masked and shifted, for 4 bits) gives the codes of 16 rows times 4 features.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_ops.h"

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace tokenloom_cpu {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlockRows = 16;  // output rows per block: one vector's lanes
// one block's codes of one group, and with its scales
template <int kBits> constexpr int64_t kCodeBytes = kBlockRows * kGroup * kBits / 8;
template <int kBits> constexpr int64_t kGroupBytes = kBits == 4 ? 320 : 576;
constexpr int64_t kRowChunk = 128;  // activation rows per pass over the blocks (kept in L2)
constexpr int kTileRows = 4;        // activation rows per tile

inline __m512 load16(const c10::BFloat16* src) { return load_bf16x16(src, 0xFFFF); }
inline __m512 load16(const float* src) { return _mm512_loadu_ps(src); }

inline void store16(float* dst, __m512 value) { _mm512_storeu_ps(dst, value); }
inline void store16(c10::BFloat16* dst, __m512 value) {
  // rounded to nearest even, NaN kept a quiet NaN, as c10 rounds
  const __m512i bits = _mm512_castps_si512(value);
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                              _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)))),
      16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  const __m512i result = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(result));
}

// rows of x quantized per group of 32: codes [M, K]; per row and group the scale s, the sum of
// the codes S, and s * S
struct QuantizedRows {
  const int8_t* codes;
  const float* scales;
  const int32_t* code_sums;
  const float* scaled_sums;
  int64_t groups;
};

template <typename scalar_t>
QuantizedRows quantize_activations(const scalar_t* x, int64_t M, int64_t K) {
  // buffers kept per calling thread: a decode step makes 120 calls, and three tensor
  // allocations a call cost a third of a millisecond a step
  // (pointers taken here: in the worker threads these names are their own, empty, buffers)
  thread_local std::vector<int8_t> code_buffer;
  thread_local std::vector<float> scale_buffer, scaled_sum_buffer;
  thread_local std::vector<int32_t> code_sum_buffer;
  const int64_t groups = K / kGroup;
  code_buffer.resize(M * K);
  scale_buffer.resize(M * groups);
  scaled_sum_buffer.resize(M * groups);
  code_sum_buffer.resize(M * groups);
  int8_t* codes = code_buffer.data();
  float* scales = scale_buffer.data();
  float* scaled_sums = scaled_sum_buffer.data();
  int32_t* code_sums = code_sum_buffer.data();
  at::parallel_for(0, M * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t offset = (index / groups) * K + (index % groups) * kGroup;
      const __m512 low = load16(x + offset), high = load16(x + offset + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
      const float inverse = amax > 0.f ? 127.f / amax : 0.f;
      const __m512i q_low = _mm512_cvtps_epi32(_mm512_mul_ps(low, _mm512_set1_ps(inverse)));
      const __m512i q_high = _mm512_cvtps_epi32(_mm512_mul_ps(high, _mm512_set1_ps(inverse)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + offset), _mm512_cvtepi32_epi8(q_low));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + offset + 16), _mm512_cvtepi32_epi8(q_high));
      const float scale = amax * (1.f / 127.f);
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high));
      scales[index] = scale;
      code_sums[index] = sum;
      scaled_sums[index] = scale * static_cast<float>(sum);
    }
  });
  return {codes, scales, code_sums, scaled_sums, groups};
}

// kRows activation rows from m0 times kBlocks blocks from b0: out[m0.., 16 b0..]
template <int kBits, typename out_t, int kRows, int kBlocks>
inline void qlinear_tile(const QuantizedRows& x, const uint8_t* weight, out_t* out, int64_t m0, int64_t b0,
                         int64_t N, int64_t K) {
  const int64_t groups = x.groups;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  __m512 acc[kRows][kBlocks];
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm512_setzero_ps();
  // blocks are stored in pairs (b0 is even), group by group (the pair's two groups g side by
  // side: one stream for a tile of the pair), an odd last block alone
  const uint8_t* pair_start = weight + b0 * groups * kGroupBytes<kBits>;
  const int64_t width = b0 + 1 < N / kBlockRows ? 2 : 1;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group[kBlocks];
    for (int b = 0; b < kBlocks; ++b) group[b] = pair_start + (g * width + b) * kGroupBytes<kBits>;
    __m512i sums[kRows][kBlocks];
    for (int r = 0; r < kRows; ++r)
      for (int b = 0; b < kBlocks; ++b) sums[r][b] = _mm512_setzero_si512();
    // steps of 4 features: two per 64-byte load of 4-bit codes, one per load of 8-bit codes
    constexpr int kStepsPerLoad = kBits == 4 ? 2 : 1;
    for (int step = 0; step < 8; step += kStepsPerLoad) {
      __m512i codes[kBlocks][kStepsPerLoad];
      for (int b = 0; b < kBlocks; ++b) {
        const __m512i bytes = _mm512_loadu_si512(group[b] + step / kStepsPerLoad * 64);
        if constexpr (kBits == 4) {
          codes[b][0] = _mm512_and_si512(bytes, low_nibbles);
          codes[b][kStepsPerLoad - 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
        } else {
          codes[b][0] = bytes;
        }
      }
      for (int r = 0; r < kRows; ++r) {
        const int8_t* row = x.codes + (m0 + r) * K + g * kGroup + step * 4;
        for (int half = 0; half < kStepsPerLoad; ++half) {
          int32_t four;  // the activation codes of this step's 4 features
          std::memcpy(&four, row + 4 * half, 4);
          const __m512i broadcast = _mm512_set1_epi32(four);
          for (int b = 0; b < kBlocks; ++b) sums[r][b] = _mm512_dpbusd_epi32(sums[r][b], codes[b][half], broadcast);
        }
      }
    }
    for (int b = 0; b < kBlocks; ++b) {
      const uint8_t* scales = group[b] + kCodeBytes<kBits>;
      if constexpr (kBits == 4) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32)));
        for (int r = 0; r < kRows; ++r) {
          const int64_t index = (m0 + r) * groups + g;
          acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][b]),
                                      _mm512_mul_ps(d, _mm512_set1_ps(x.scales[index])), acc[r][b]);
          acc[r][b] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.scaled_sums[index]), acc[r][b]);
        }
      } else {  // m = -128 d: sum (code - 128) q in integers
        const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(scales));
        for (int r = 0; r < kRows; ++r) {
          const int64_t index = (m0 + r) * groups + g;
          const __m512i centred = _mm512_sub_epi32(sums[r][b], _mm512_set1_epi32(x.code_sums[index] * 128));
          acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_mul_ps(d, _mm512_set1_ps(x.scales[index])),
                                      acc[r][b]);
        }
      }
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b) store16(out + (m0 + r) * N + (b0 + b) * kBlockRows, acc[r][b]);
}

// rows [m_begin, m_end) times blocks [b0, b0 + kBlocks): tiles of 4 rows, then the 1-3 left
template <int kBits, typename out_t, int kBlocks>
void qlinear_rows(const QuantizedRows& x, const uint8_t* weight, out_t* out, int64_t m_begin, int64_t m_end,
                  int64_t b0, int64_t N, int64_t K) {
  int64_t m = m_begin;
  for (; m + kTileRows <= m_end; m += kTileRows) qlinear_tile<kBits, out_t, kTileRows, kBlocks>(x, weight, out, m, b0, N, K);
  switch (m_end - m) {
    case 3: qlinear_tile<kBits, out_t, 3, kBlocks>(x, weight, out, m, b0, N, K); break;
    case 2: qlinear_tile<kBits, out_t, 2, kBlocks>(x, weight, out, m, b0, N, K); break;
    case 1: qlinear_tile<kBits, out_t, 1, kBlocks>(x, weight, out, m, b0, N, K); break;
    default: break;
  }
}

template <int kBits, typename in_t, typename out_t>
void qlinear(const in_t* x, const uint8_t* weight, out_t* out, int64_t M, int64_t N, int64_t K) {
  const QuantizedRows rows = quantize_activations(x, M, K);
  const int64_t blocks = N / kBlockRows;
  // pairs of blocks, each thread a contiguous range of them (one stream); an odd last block alone
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = 0; m < M; m += kRowChunk) {
      const int64_t m_end = std::min(M, m + kRowChunk);
      for (int64_t pair = begin; pair < end; ++pair) {
        if (2 * pair + 1 < blocks)
          qlinear_rows<kBits, out_t, 2>(rows, weight, out, m, m_end, 2 * pair, N, K);
        else
          qlinear_rows<kBits, out_t, 1>(rows, weight, out, m, m_end, 2 * pair, N, K);
      }
    }
  });
}

// x [M, K] bfloat16 or float32, weight packed for kBits; out [M, N] of x's dtype, or float32
template <int kBits>
at::Tensor qlinear_op(const char* name, const at::Tensor& x, const at::Tensor& weight, bool float_out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              name, ": x must be a contiguous [rows, in_features] bfloat16 or float32 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kGroup == 0 && K > 0, name, ": in_features must be a positive multiple of 32, got ", K);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() && weight.dim() == 2 &&
                  weight.size(1) == K / kGroup * kGroupBytes<kBits>,
              name, ": weight must be a contiguous [out_features / 16, in_features / 32 * ", kGroupBytes<kBits>,
              "] uint8 tensor");
  const int64_t N = weight.size(0) * kBlockRows;
  at::Tensor out = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  if (M == 0) return out;
  const uint8_t* packed = weight.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kFloat)
    qlinear<kBits>(x.data_ptr<float>(), packed, out.data_ptr<float>(), M, N, K);
  else if (float_out)
    qlinear<kBits>(x.data_ptr<c10::BFloat16>(), packed, out.data_ptr<float>(), M, N, K);
  else
    qlinear<kBits>(x.data_ptr<c10::BFloat16>(), packed, out.data_ptr<c10::BFloat16>(), M, N, K);
  return out;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& weight) {
  return qlinear_op<4>("int4_linear", x, weight, false);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight) {
  return qlinear_op<8>("int8_linear", x, weight, true);
}

}  // namespace tokenloom_cpu

TORCH_LIBRARY_FRAGMENT(tokenloom_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_cpu, CPU, m) {
  m.impl("int4_linear", &tokenloom_cpu::int4_linear);
  m.impl("int8_linear", &tokenloom_cpu::int8_linear);
}

#endif  // __AVX512VNNI__ && __AVX512BW__
