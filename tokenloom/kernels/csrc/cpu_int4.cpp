// 4-bit weights times 8-bit activations (GGML's Q4 x Q8 arithmetic, as llama.cpp computes a
// Q4_1 weight on the CPU), for any number of rows; registered as `tokenloom_cpu::int4_linear`
// only where the CPU has AVX512-VNNI. The Python side (tokenloom/kernels/int4_matmul.py) packs
// the weights and keeps torch's int4 kernel elsewhere; its `quantize_activations` and
// `dequantize_int4` are the reference the tests hold this kernel to.
//
// A weight value is d * code + m: a 4-bit code (0..15) and one (d, m) pair of float16 per
// group of 32 input features. Each row of x is quantized per group of 32 the same way: its
// scale is s = max|x| / 127 and its codes q = round(x * (127 / max|x|)) (to nearest even; all
// zero for a zero group), so that
//   sum_k w_k x_k ~ sum_groups [ d * s * sum_k code_k q_k + m * s * sum_k q_k ]
// in which the inner sums are exact integers (`vpdpbusd`: 16 lanes of 4 unsigned-code times
// signed-activation products each).
//
// Layout, for out_features N (a multiple of 16), in_features K, G = K / 32 groups: [N / 16, G, 320]
// bytes. Block b (output rows 16b..16b+15), group g holds 4 x 64 bytes of codes, then d[16] and
// m[16] as float16. In the codes' 64-byte step t (features 8t..8t+7 of the group), bytes
// 4l..4l+3 belong to row 16b+l: byte j holds feature 8t+j in its low nibble and 8t+4+j in its
// high one. So a block is one stream read front to back, and one 64-byte load, masked and
// shifted, gives the codes of 16 rows times 4 features twice over.

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
constexpr int64_t kBlockRows = 16;    // output rows per block: one vector's lanes
constexpr int64_t kCodeBytes = 256;   // one block's codes of one group
constexpr int64_t kGroupBytes = 320;  // ... followed by its 16 d and 16 m (float16)
constexpr int64_t kRowChunk = 128;    // activation rows per pass over the blocks (kept in L2)
constexpr int kTileRows = 4;          // activation rows per tile
constexpr int64_t kPrefetchBytes = 2048;

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

// rows of x -> codes [M, K] int8, scales and scale * sum(codes) [M, G]
template <typename scalar_t>
void quantize_activations(const scalar_t* x, int8_t* codes, float* scales, float* sums, int64_t M, int64_t K) {
  const int64_t groups = K / kGroup;
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
      scales[index] = scale;
      sums[index] = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high)));
    }
  });
}

// kRows activation rows from m0 times kBlocks blocks from b0: out[m0.., 16 b0..]
template <typename scalar_t, int kRows, int kBlocks>
inline void int4_tile(const int8_t* xq, const float* x_scales, const float* x_sums, const uint8_t* weight,
                      scalar_t* out, int64_t m0, int64_t b0, int64_t N, int64_t K) {
  const int64_t groups = K / kGroup;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  __m512 acc[kRows][kBlocks];
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group[kBlocks];
    for (int b = 0; b < kBlocks; ++b) {
      group[b] = weight + ((b0 + b) * groups + g) * kGroupBytes;
      for (int64_t line = 0; line < kGroupBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(group[b] + kPrefetchBytes + line), _MM_HINT_T0);
    }
    __m512i sums[kRows][kBlocks];
    for (int r = 0; r < kRows; ++r)
      for (int b = 0; b < kBlocks; ++b) sums[r][b] = _mm512_setzero_si512();
    for (int step = 0; step < 4; ++step) {
      __m512i low[kBlocks], high[kBlocks];
      for (int b = 0; b < kBlocks; ++b) {
        const __m512i bytes = _mm512_loadu_si512(group[b] + step * 64);
        low[b] = _mm512_and_si512(bytes, low_nibbles);
        high[b] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
      }
      for (int r = 0; r < kRows; ++r) {
        const int8_t* row = xq + (m0 + r) * K + g * kGroup + step * 8;
        int32_t first, second;  // activation codes of features 8t..8t+3 and 8t+4..8t+7
        std::memcpy(&first, row, 4);
        std::memcpy(&second, row + 4, 4);
        const __m512i x_first = _mm512_set1_epi32(first), x_second = _mm512_set1_epi32(second);
        for (int b = 0; b < kBlocks; ++b) {
          sums[r][b] = _mm512_dpbusd_epi32(sums[r][b], low[b], x_first);
          sums[r][b] = _mm512_dpbusd_epi32(sums[r][b], high[b], x_second);
        }
      }
    }
    for (int b = 0; b < kBlocks; ++b) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group[b] + kCodeBytes)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group[b] + kCodeBytes + 32)));
      for (int r = 0; r < kRows; ++r) {
        const int64_t index = (m0 + r) * groups + g;
        acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][b]), _mm512_mul_ps(d, _mm512_set1_ps(x_scales[index])),
                                    acc[r][b]);
        acc[r][b] = _mm512_fmadd_ps(m, _mm512_set1_ps(x_sums[index]), acc[r][b]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b) store16(out + (m0 + r) * N + (b0 + b) * kBlockRows, acc[r][b]);
}

// rows [m_begin, m_end) times blocks [b0, b0 + kBlocks)
template <typename scalar_t, int kBlocks>
void int4_rows(const int8_t* xq, const float* x_scales, const float* x_sums, const uint8_t* weight, scalar_t* out,
               int64_t m_begin, int64_t m_end, int64_t b0, int64_t N, int64_t K) {
  int64_t m = m_begin;
  for (; m + kTileRows <= m_end; m += kTileRows)
    int4_tile<scalar_t, kTileRows, kBlocks>(xq, x_scales, x_sums, weight, out, m, b0, N, K);
  switch (m_end - m) {
    case 3: int4_tile<scalar_t, 3, kBlocks>(xq, x_scales, x_sums, weight, out, m, b0, N, K); break;
    case 2: int4_tile<scalar_t, 2, kBlocks>(xq, x_scales, x_sums, weight, out, m, b0, N, K); break;
    case 1: int4_tile<scalar_t, 1, kBlocks>(xq, x_scales, x_sums, weight, out, m, b0, N, K); break;
    default: break;
  }
}

template <typename scalar_t>
void int4_matmul(const scalar_t* x, const uint8_t* weight, scalar_t* out, int64_t M, int64_t N, int64_t K) {
  const int64_t groups = K / kGroup, blocks = N / kBlockRows;
  // the quantized rows, in buffers kept per calling thread (a decode step makes 120 calls, and
  // three tensor allocations a call cost a third of a millisecond a step)
  thread_local std::vector<int8_t> code_buffer;
  thread_local std::vector<float> scale_buffer, sum_buffer;
  code_buffer.resize(M * K);
  scale_buffer.resize(M * groups);
  sum_buffer.resize(M * groups);
  quantize_activations(x, code_buffer.data(), scale_buffer.data(), sum_buffer.data(), M, K);
  const int8_t* codes = code_buffer.data();
  const float* scales = scale_buffer.data();
  const float* sums = sum_buffer.data();
  // pairs of blocks, each thread a contiguous range of them (one stream); an odd last block alone
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = 0; m < M; m += kRowChunk) {
      const int64_t m_end = std::min(M, m + kRowChunk);
      for (int64_t pair = begin; pair < end; ++pair) {
        if (2 * pair + 1 < blocks)
          int4_rows<scalar_t, 2>(codes, scales, sums, weight, out, m, m_end, 2 * pair, N, K);
        else
          int4_rows<scalar_t, 1>(codes, scales, sums, weight, out, m, m_end, 2 * pair, N, K);
      }
    }
  });
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "int4_linear: x must be a contiguous [rows, in_features] bfloat16 or float32 tensor");
  const int64_t M = x.size(0), K = x.size(1), groups = K / kGroup;
  TORCH_CHECK(K % kGroup == 0 && K > 0, "int4_linear: in_features must be a positive multiple of 32, got ", K);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() && weight.dim() == 2 &&
                  weight.size(1) == groups * kGroupBytes,
              "int4_linear: weight must be a contiguous [out_features / 16, in_features / 32 * 320] uint8 tensor");
  const int64_t N = weight.size(0) * kBlockRows;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const uint8_t* packed = weight.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kFloat)
    int4_matmul(x.data_ptr<float>(), packed, out.data_ptr<float>(), M, N, K);
  else
    int4_matmul(x.data_ptr<c10::BFloat16>(), packed, out.data_ptr<c10::BFloat16>(), M, N, K);
  return out;
}

}  // namespace tokenloom_cpu

TORCH_LIBRARY_FRAGMENT(tokenloom_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_cpu, CPU, m) {
  m.impl("int4_linear", &tokenloom_cpu::int4_linear);
}

#endif  // __AVX512VNNI__ && __AVX512BW__
