// 8-bit weights times float activations, for any number of rows, in every build (one per ISA
// level, see cpu_namespace.h): `w8a16_linear(x, weight, scales, fp8)`, float32 out.
//   fp8 = true:  float8_e4m3fn codes (compressed-tensors FP8, W8A8 and W8A16)
//   fp8 = false: signed int8 codes (compressed-tensors W8A16 int8)
// The Python side (tokenloom/kernels/w8a16_matmul.py) packs the weights, the same layout for every
// level; its `dequantize_w8` is the reference the tests hold these kernels to.
//
// The codes are read as bytes (one byte per weight from memory) and widened to float32 in
// registers; the activations stay float32 (bfloat16 rows are widened once per call), so
//   out[m, n] = sum_groups scale[n, g] * sum_{k in g} value(code[n, k]) * x[m, k]
// in float32 FMAs. No CPU here has fp8 arithmetic: an e4m3fn byte s eeee mmm becomes the float16
// s 0eeee mmm 0000000 (a shift, an and and an add: the same sign, exponent field and mantissa;
// float16's exponent bias is 15 where e4m3's is 7, so its value is the fp8 value times 2^-8,
// exactly, subnormals included), which `vcvtph2ps` (F16C, AVX-512) widens to float32; the 2^8 is
// folded into the scales. The plain C++ level reads every code through a 256-entry float table
// (cpu_common.h's fp8_table), the same values. (e4m3fn's two NaN codes, 0x7F and 0xFF, read as
// +-480 on the vector levels and NaN on the plain one; no checkpoint holds them.)
//
// Layout, for out_features N (a multiple of 16), in_features K (a multiple of 4) and G scale
// groups of K / G input features (G = 1: one scale per output channel):
//   weight [N / 16, K, 16] uint8: block b (output rows 16b..16b+15), per input feature k the 16
//          rows' codes (one 16-byte vector per feature; 64 bytes are 4 features)
//   scales [N / 16, G, 16] float32: per block and group the 16 rows' scales
// Tiles: up to kMaxTileRows activation rows (AVX-512: 8, AVX2: 3, plain C++: 4) times a pair of
// blocks, each thread a contiguous range of pairs (cpu_qlinear.h's for_each_tile). Each output's
// accumulation runs over k in order, the same operations whatever the tile's size, so M rows at
// once give every row the bits it gets alone. With channel scales the scale multiplies the sum
// once at the end; with group scales it multiplies each widened code (one multiply per 16 codes,
// shared by the tile's rows).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_ops.h"
#include "cpu_qlinear.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace TOKENLOOM_CPU_NAMESPACE {

namespace {

constexpr float kFp8ViaHalf = 256.f;  // an e4m3 code read as float16 is its value times 2^-8

struct W8Problem {
  const float* x;  // [M, K] float32
  const uint8_t* weight;
  const float* scales;
  float* out;  // [M, N]
  int64_t N, K, groups;
};

#if defined(__AVX2__)
// 16 e4m3 bytes (zero-extended to 16-bit lanes) as float16 bits: shifted left by 7, the exponent and
// mantissa sit in bits 7..13 and the sign in bit 14, which adding bit 14 to itself carries to bit 15
inline __m256i e4m3_as_half(__m256i wide) {
  const __m256i shifted = _mm256_slli_epi16(wide, 7);
  return _mm256_add_epi16(shifted, _mm256_and_si256(shifted, _mm256_set1_epi16(0x4000)));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)

constexpr int kMaxTileRows = 8;  // 8 rows x 2 blocks: 16 accumulators of the 32 zmm registers

// 16 codes (one feature, 16 rows) widened to float32
template <bool kFp8>
inline __m512 widen16(const uint8_t* codes) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  if constexpr (kFp8) {
    return _mm512_cvtph_ps(e4m3_as_half(_mm256_cvtepu8_epi16(bytes)));
  } else {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  }
}

template <bool kFp8, int kRows, int kBlocks>
void w8_tile(const W8Problem& p, int64_t m0, int64_t b0) {
  const int64_t K = p.K, group_size = K / p.groups;
  const bool per_group = p.groups > 1;
  __m512 acc[kRows][kBlocks];
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm512_setzero_ps();
  const uint8_t* block[kBlocks];
  const float* block_scales[kBlocks];
  for (int b = 0; b < kBlocks; ++b) {
    block[b] = p.weight + (b0 + b) * K * kBlockRows;
    block_scales[b] = p.scales + (b0 + b) * p.groups * kBlockRows;
  }
  const __m512 factor = _mm512_set1_ps(kFp8 ? kFp8ViaHalf : 1.f);
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512 scale[kBlocks];
    for (int b = 0; b < kBlocks; ++b)
      scale[b] = _mm512_mul_ps(_mm512_loadu_ps(block_scales[b] + g * kBlockRows), factor);
    for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) {
      __m512 w[kBlocks];
      for (int b = 0; b < kBlocks; ++b) {
        w[b] = widen16<kFp8>(block[b] + k * kBlockRows);
        if (per_group) w[b] = _mm512_mul_ps(w[b], scale[b]);
      }
      for (int r = 0; r < kRows; ++r) {
        const __m512 xv = _mm512_set1_ps(p.x[(m0 + r) * K + k]);
        for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm512_fmadd_ps(w[b], xv, acc[r][b]);
      }
    }
    if (!per_group)
      for (int r = 0; r < kRows; ++r)
        for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm512_mul_ps(acc[r][b], scale[b]);
  }
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b) _mm512_storeu_ps(p.out + (m0 + r) * p.N + (b0 + b) * kBlockRows, acc[r][b]);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

constexpr int kMaxTileRows = 3;  // 3 rows x 2 blocks x 2 halves: 12 accumulators of the 16 ymm registers

// 16 codes (one feature, 16 rows) widened to float32: rows 0..7 and 8..15
template <bool kFp8>
inline void widen16(const uint8_t* codes, __m256& low, __m256& high) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  if constexpr (kFp8) {
    const __m256i half = e4m3_as_half(_mm256_cvtepu8_epi16(bytes));
    low = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
    high = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
  } else {
    low = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    high = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(bytes, bytes)));
  }
}

template <bool kFp8, int kRows, int kBlocks>
void w8_tile(const W8Problem& p, int64_t m0, int64_t b0) {
  const int64_t K = p.K, group_size = K / p.groups;
  const bool per_group = p.groups > 1;
  __m256 acc[kRows][kBlocks][2];
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_ps();
  const uint8_t* block[kBlocks];
  const float* block_scales[kBlocks];
  for (int b = 0; b < kBlocks; ++b) {
    block[b] = p.weight + (b0 + b) * K * kBlockRows;
    block_scales[b] = p.scales + (b0 + b) * p.groups * kBlockRows;
  }
  const __m256 factor = _mm256_set1_ps(kFp8 ? kFp8ViaHalf : 1.f);
  for (int64_t g = 0; g < p.groups; ++g) {
    __m256 scale[kBlocks][2];
    for (int b = 0; b < kBlocks; ++b)
      for (int h = 0; h < 2; ++h)
        scale[b][h] = _mm256_mul_ps(_mm256_loadu_ps(block_scales[b] + g * kBlockRows + 8 * h), factor);
    for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) {
      __m256 w[kBlocks][2];
      for (int b = 0; b < kBlocks; ++b) {
        widen16<kFp8>(block[b] + k * kBlockRows, w[b][0], w[b][1]);
        if (per_group)
          for (int h = 0; h < 2; ++h) w[b][h] = _mm256_mul_ps(w[b][h], scale[b][h]);
      }
      for (int r = 0; r < kRows; ++r) {
        const __m256 xv = _mm256_set1_ps(p.x[(m0 + r) * K + k]);
        for (int b = 0; b < kBlocks; ++b)
          for (int h = 0; h < 2; ++h) acc[r][b][h] = _mm256_fmadd_ps(w[b][h], xv, acc[r][b][h]);
      }
    }
    if (!per_group)
      for (int r = 0; r < kRows; ++r)
        for (int b = 0; b < kBlocks; ++b)
          for (int h = 0; h < 2; ++h) acc[r][b][h] = _mm256_mul_ps(acc[r][b][h], scale[b][h]);
  }
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b)
      for (int h = 0; h < 2; ++h)
        _mm256_storeu_ps(p.out + (m0 + r) * p.N + (b0 + b) * kBlockRows + 8 * h, acc[r][b][h]);
}

#else  // plain C++: each code through a 256-entry float table, left to the compiler

constexpr int kMaxTileRows = 4;

// the 256 byte values as float32: e4m3fn's or int8's
inline const float* code_table(bool fp8) {
  static const std::array<float, 256> int8_values = [] {
    std::array<float, 256> values{};
    for (int bits = 0; bits < 256; ++bits) values[bits] = static_cast<float>(static_cast<int8_t>(bits));
    return values;
  }();
  return fp8 ? fp8_table<c10::Float8_e4m3fn>() : int8_values.data();
}

template <bool kFp8, int kRows, int kBlocks>
[[gnu::noinline]] void w8_tile(const W8Problem& p, int64_t m0, int64_t b0) {
  const int64_t K = p.K, group_size = K / p.groups;
  const bool per_group = p.groups > 1;
  const float* table = code_table(kFp8);
  float acc[kRows][kBlocks][kBlockRows] = {};
  for (int64_t g = 0; g < p.groups; ++g) {
    float scale[kBlocks][kBlockRows];
    for (int b = 0; b < kBlocks; ++b)
      for (int lane = 0; lane < kBlockRows; ++lane)
        scale[b][lane] = p.scales[((b0 + b) * p.groups + g) * kBlockRows + lane];
    for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) {
      float w[kBlocks][kBlockRows];
      for (int b = 0; b < kBlocks; ++b)
        for (int lane = 0; lane < kBlockRows; ++lane) {
          const float value = table[p.weight[((b0 + b) * K + k) * kBlockRows + lane]];
          w[b][lane] = per_group ? value * scale[b][lane] : value;
        }
      for (int r = 0; r < kRows; ++r) {
        const float xv = p.x[(m0 + r) * K + k];
        for (int b = 0; b < kBlocks; ++b)
          for (int lane = 0; lane < kBlockRows; ++lane) acc[r][b][lane] += w[b][lane] * xv;
      }
    }
    if (!per_group)
      for (int r = 0; r < kRows; ++r)
        for (int b = 0; b < kBlocks; ++b)
          for (int lane = 0; lane < kBlockRows; ++lane) acc[r][b][lane] *= scale[b][lane];
  }
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b)
      std::memcpy(p.out + (m0 + r) * p.N + (b0 + b) * kBlockRows, acc[r][b], sizeof(acc[r][b]));
}

#endif

// w8_tile<kFp8, kRows, kBlocks> for kRows = 1..kMaxTileRows, indexed by kRows
template <bool kFp8, int kBlocks, int... kRows>
constexpr auto w8_tile_table(std::integer_sequence<int, kRows...>) {
  using Tile = void (*)(const W8Problem&, int64_t, int64_t);
  return std::array<Tile, sizeof...(kRows) + 1>{nullptr, &w8_tile<kFp8, kRows + 1, kBlocks>...};
}

// rows [m_begin, m_end) times blocks [b0, b0 + kBlocks): full tiles, then the rows left
template <bool kFp8, int kBlocks>
void w8_rows(const W8Problem& p, int64_t m_begin, int64_t m_end, int64_t b0) {
  static constexpr auto tiles = w8_tile_table<kFp8, kBlocks>(std::make_integer_sequence<int, kMaxTileRows>());
  for (int64_t m = m_begin; m < m_end;) {
    const int64_t rows = std::min<int64_t>(m_end - m, kMaxTileRows);
    tiles[rows](p, m, b0);
    m += rows;
  }
}

template <bool kFp8>
void w8_linear(const W8Problem& p, int64_t M) {
  for_each_tile(M, p.N, [&](int64_t m, int64_t m_end, int64_t b0, int width) {
    if (width == 2)
      w8_rows<kFp8, 2>(p, m, m_end, b0);
    else
      w8_rows<kFp8, 1>(p, m, m_end, b0);
  });
}

}  // namespace

at::Tensor w8a16_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, bool fp8) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "w8a16_linear: x must be a contiguous [rows, in_features] bfloat16 or float32 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() && weight.dim() == 3 &&
                  weight.size(1) == K && weight.size(2) == kBlockRows,
              "w8a16_linear: weight must be a contiguous [out_features / 16, in_features, 16] uint8 tensor");
  const int64_t blocks = weight.size(0), groups = scales.dim() == 3 ? scales.size(1) : 0;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == blocks && scales.size(2) == kBlockRows && groups > 0 && K % groups == 0 &&
                  (K / groups) % 4 == 0,
              "w8a16_linear: scales must be a contiguous [out_features / 16, groups, 16] float32 tensor, "
              "each group a multiple of 4 input features");
  const int64_t N = blocks * kBlockRows;
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  at::Tensor rows = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  const W8Problem problem{rows.data_ptr<float>(), weight.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                          out.data_ptr<float>(), N, K, groups};
  if (fp8)
    w8_linear<true>(problem, M);
  else
    w8_linear<false>(problem, M);
  return out;
}

}  // namespace TOKENLOOM_CPU_NAMESPACE

TOKENLOOM_LIBRARY_FRAGMENT(m) { m.def("w8a16_linear(Tensor x, Tensor weight, Tensor scales, bool fp8) -> Tensor"); }

TOKENLOOM_LIBRARY_IMPL_CPU(m) { m.impl("w8a16_linear", &TOKENLOOM_CPU_NAMESPACE::w8a16_linear); }
