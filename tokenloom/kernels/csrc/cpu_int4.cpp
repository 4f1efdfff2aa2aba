// Weight-only int4 matmul for a few rows of bfloat16 activations (decode steps), registered as
// `tokenloom_cpu::int4_linear` only where the CPU has AVX512-BF16. The Python side
// (tokenloom/kernels/int4_matmul.py) packs the weights and keeps torch's int4 kernel elsewhere;
// its dequantize_int4 is the reference the tests hold this kernel to.
//
// A weight value is (code - 8) * scale + zero, one (scale, zero) pair per group of 32 input
// features. Layout, for out_features N, in_features K, G = K / 32 groups (G even):
//   codes  [N / 8, G / 2, 8, 32] uint8 (given as [N, K / 2]): the 32 bytes of output row
//          8b + r and groups (2p, 2p+1) sit at [b, p, r], byte j holding code (2p)*32 + j in its
//          low nibble and code (2p+1)*32 + j in its high one; so each block of 8 rows is
//          read front to back, one stream the hardware prefetcher follows
//   scales [N, G], zeros [N, G] bfloat16
// A code c ORed into the bits of bfloat16 128.0 is exactly 128 + c, so one ternary-logic op
// (low nibbles) or a shift and an or (high nibbles) turn 32 codes into 32 bfloat16 values;
// `vdpbf16ps` sums their products with x in float32, one fma applies the group's scale:
//   sum_i w_i x_i = scale * sum_i (128 + c_i) x_i + (zero - 136 * scale) * sum_i x_i
// where the second term uses the per-group sums of x computed once per call.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_ops.h"

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace tokenloom_cpu {

constexpr int64_t kGroup = 32;
constexpr int kMaxRows = 8;
constexpr int64_t kBlockRows = 8;  // output rows interleaved in the codes
constexpr int64_t kPairBytes = 32;  // one row's codes of two groups
constexpr int64_t kPrefetchBytes = 2048;  // how far ahead in the stream to prefetch

inline float bf16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof value);
  return value;
}

// kRows activation rows times kTile output rows at a time: kRows * kTile accumulators
template <int kRows, int kTile>
void int4_tiles(const uint16_t* x, const float* sums, const uint8_t* codes, const uint16_t* scales,
                const uint16_t* zeros, uint16_t* out, int64_t N, int64_t K, int64_t tile_begin, int64_t tile_end) {
  const int64_t groups = K / kGroup;
  const __m512i low_nibble = _mm512_set1_epi16(0x000F);
  const __m512i bias = _mm512_set1_epi16(0x4300);  // bfloat16 128.0
  std::vector<float> tile_scales(kTile * groups);
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const int64_t n0 = tile * kTile;
    for (int64_t i = 0; i < kTile * groups; ++i) tile_scales[i] = bf16_to_float(scales[n0 * groups + i]);
    __m512 acc[kTile][kRows];
    for (int t = 0; t < kTile; ++t)
      for (int m = 0; m < kRows; ++m) acc[t][m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g += 2) {
      __m512bh x_a[kRows], x_b[kRows];
      for (int m = 0; m < kRows; ++m) {
        x_a[m] = (__m512bh)_mm512_loadu_si512(x + m * K + g * kGroup);
        x_b[m] = (__m512bh)_mm512_loadu_si512(x + m * K + (g + 1) * kGroup);
      }
      const uint8_t* pair_codes = codes + (n0 / kBlockRows) * kBlockRows * (K / 2) + (g / 2) * kBlockRows * kPairBytes +
                                  (n0 % kBlockRows) * kPairBytes;
      for (int64_t line = 0; line < kTile * kPairBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(pair_codes + kPrefetchBytes + line), _MM_HINT_T0);
      for (int t = 0; t < kTile; ++t) {
        const __m512i bytes = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair_codes + t * kPairBytes)));
        const __m512bh w_a = (__m512bh)_mm512_ternarylogic_epi32(bytes, low_nibble, bias, 0xEA);  // (b & 15) | bias
        const __m512bh w_b = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(bytes, 4), bias);
        const __m512 scale_a = _mm512_set1_ps(tile_scales[t * groups + g]);
        const __m512 scale_b = _mm512_set1_ps(tile_scales[t * groups + g + 1]);
        for (int m = 0; m < kRows; ++m) {
          acc[t][m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), w_a, x_a[m]), scale_a, acc[t][m]);
          acc[t][m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), w_b, x_b[m]), scale_b, acc[t][m]);
        }
      }
    }
    const __m512 offset = _mm512_set1_ps(136.f);
    for (int t = 0; t < kTile; ++t) {
      const int64_t n = n0 + t;
      for (int64_t g = 0; g < groups; g += 16) {
        const __mmask16 mask = tail_mask(groups - g);
        const __m512 scale = load_bf16x16(scales + n * groups + g, mask);
        const __m512 zero = _mm512_fnmadd_ps(offset, scale, load_bf16x16(zeros + n * groups + g, mask));
        for (int m = 0; m < kRows; ++m)
          acc[t][m] = _mm512_fmadd_ps(zero, _mm512_maskz_loadu_ps(mask, sums + m * groups + g), acc[t][m]);
      }
      for (int m = 0; m < kRows; ++m) out[m * N + n] = c10::BFloat16(_mm512_reduce_add_ps(acc[t][m])).x;
    }
  }
}

template <int kRows>
void int4_rows(const uint16_t* x, const float* sums, const uint8_t* codes, const uint16_t* scales,
               const uint16_t* zeros, uint16_t* out, int64_t N, int64_t K) {
  // 8 accumulators per activation row set: 8 output rows for one activation row, 1 for 8
  constexpr int kTile = kRows == 1 ? 8 : kRows == 2 ? 4 : kRows <= 4 ? 2 : 1;
  at::parallel_for(0, N / kTile, 8, [&](int64_t begin, int64_t end) {
    int4_tiles<kRows, kTile>(x, sums, codes, scales, zeros, out, N, K, begin, end);
  });
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& zeros) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "int4_linear: x must be a contiguous [rows, in_features] bfloat16 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), groups = K / kGroup;
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "int4_linear: takes 1 to ", kMaxRows, " rows, got ", M);
  TORCH_CHECK(K % (2 * kGroup) == 0, "int4_linear: in_features must be a multiple of 64, got ", K);
  TORCH_CHECK(N % kBlockRows == 0, "int4_linear: out_features must be a multiple of 8, got ", N);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2 && codes.size(1) == K / 2,
              "int4_linear: codes must be a contiguous [out_features, in_features / 2] uint8 tensor");
  for (const at::Tensor* part : {&scales, &zeros})
    TORCH_CHECK(part->scalar_type() == at::kBFloat16 && part->is_contiguous() && part->dim() == 2 &&
                    part->size(0) == N && part->size(1) == groups,
                "int4_linear: scales and zeros must be contiguous [out_features, in_features / 32] bfloat16");
  const auto* x_bits = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  std::vector<float> sums(M * groups);  // per row and group, the sum of its activations
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) sum += bf16_to_float(x_bits[m * K + g * kGroup + i]);
      sums[m * groups + g] = sum;
    }
  at::Tensor out = at::empty({M, N}, x.options());
  const auto* code_bytes = codes.data_ptr<uint8_t>();
  const auto* scale_bits = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const auto* zero_bits = reinterpret_cast<const uint16_t*>(zeros.data_ptr<at::BFloat16>());
  auto* out_bits = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  switch (M) {
#define TOKENLOOM_INT4_ROWS(rows) \
  case rows:                      \
    int4_rows<rows>(x_bits, sums.data(), code_bytes, scale_bits, zero_bits, out_bits, N, K); \
    break;
    TOKENLOOM_INT4_ROWS(1)
    TOKENLOOM_INT4_ROWS(2)
    TOKENLOOM_INT4_ROWS(3)
    TOKENLOOM_INT4_ROWS(4)
    TOKENLOOM_INT4_ROWS(5)
    TOKENLOOM_INT4_ROWS(6)
    TOKENLOOM_INT4_ROWS(7)
    TOKENLOOM_INT4_ROWS(8)
#undef TOKENLOOM_INT4_ROWS
  }
  return out;
}

}  // namespace tokenloom_cpu

TORCH_LIBRARY_FRAGMENT(tokenloom_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, Tensor zeros) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_cpu, CPU, m) {
  m.impl("int4_linear", &tokenloom_cpu::int4_linear);
}

#endif  // __AVX512BF16__
