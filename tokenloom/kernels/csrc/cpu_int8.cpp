// Weight-only int8 matmul for a few rows (decode steps) with float32 outputs, registered as
// `tokenloom_cpu::int8_linear` where the CPU has AVX-512: the LM head of a GGUF model whose
// token embedding is Q8_0, multiplied on the file's exact values (code * scale, one float scale
// per 32 codes) instead of their bfloat16 rounding, reading half the bytes of a bfloat16 head.
// tokenloom/kernels/int8_matmul.py packs the weights; its dequantize_int8 is the reference.
//
// Layout, for out_features N (a multiple of 8), in_features K (of 32), G = K / 32 groups:
//   codes  [N / 8, G, 8, 32] int8 (given as [N, K]): the 32 codes of row 8b + r, group g at [b, g, r]
//   scales [N / 8, G, 8] float32 (given as [N, G])
// so each block of 8 rows is one stream read front to back. Activations come as float32 rows;
// codes widen exactly to float32, and each group's sum of products is scaled once.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>


#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace tokenloom_cpu {

constexpr int64_t kInt8Group = 32;
constexpr int64_t kInt8BlockRows = 8;
constexpr int kInt8MaxRows = 4;
constexpr int64_t kInt8PrefetchBytes = 2048;

template <int kRows, int kTile>
void int8_tiles(const float* x, const int8_t* codes, const float* scales, float* out, int64_t N, int64_t K,
                int64_t tile_begin, int64_t tile_end) {
  const int64_t groups = K / kInt8Group;
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const int64_t n0 = tile * kTile, block = n0 / kInt8BlockRows, sub = n0 % kInt8BlockRows;
    const int8_t* block_codes = codes + block * kInt8BlockRows * K;
    const float* block_scales = scales + block * kInt8BlockRows * groups;
    __m512 acc[kTile][kRows];
    for (int t = 0; t < kTile; ++t)
      for (int m = 0; m < kRows; ++m) acc[t][m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m512 x_low[kRows], x_high[kRows];
      for (int m = 0; m < kRows; ++m) {
        x_low[m] = _mm512_loadu_ps(x + m * K + g * kInt8Group);
        x_high[m] = _mm512_loadu_ps(x + m * K + g * kInt8Group + 16);
      }
      const int8_t* group_codes = block_codes + (g * kInt8BlockRows + sub) * kInt8Group;
      for (int64_t line = 0; line < kTile * kInt8Group; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(group_codes + kInt8PrefetchBytes + line), _MM_HINT_T0);
      for (int t = 0; t < kTile; ++t) {
        const int8_t* row_codes = group_codes + t * kInt8Group;
        const __m512 w_low =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row_codes))));
        const __m512 w_high = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row_codes + 16))));
        const __m512 scale = _mm512_set1_ps(block_scales[g * kInt8BlockRows + sub + t]);
        for (int m = 0; m < kRows; ++m) {
          const __m512 dot = _mm512_fmadd_ps(w_high, x_high[m], _mm512_mul_ps(w_low, x_low[m]));
          acc[t][m] = _mm512_fmadd_ps(dot, scale, acc[t][m]);
        }
      }
    }
    for (int t = 0; t < kTile; ++t)
      for (int m = 0; m < kRows; ++m) out[m * N + n0 + t] = _mm512_reduce_add_ps(acc[t][m]);
  }
}

template <int kRows>
void int8_rows(const float* x, const int8_t* codes, const float* scales, float* out, int64_t N, int64_t K) {
  constexpr int kTile = kRows <= 2 ? 8 : 4;  // at most 16 accumulators
  at::parallel_for(0, N / kTile, 16, [&](int64_t begin, int64_t end) {
    int8_tiles<kRows, kTile>(x, codes, scales, out, N, K, begin, end);
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int8_linear: x must be a contiguous [rows, in_features] float32 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(M >= 1 && M <= kInt8MaxRows, "int8_linear: takes 1 to ", kInt8MaxRows, " rows, got ", M);
  TORCH_CHECK(K % kInt8Group == 0, "int8_linear: in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(N % kInt8BlockRows == 0, "int8_linear: out_features must be a multiple of 8, got ", N);
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.dim() == 2 && codes.size(1) == K,
              "int8_linear: codes must be a contiguous [out_features, in_features] int8 tensor");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == K / kInt8Group,
              "int8_linear: scales must be a contiguous [out_features, in_features / 32] float32 tensor");
  at::Tensor out = at::empty({M, N}, x.options());
  const float* x_ptr = x.data_ptr<float>();
  const int8_t* code_ptr = codes.data_ptr<int8_t>();
  const float* scale_ptr = scales.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  switch (M) {
    case 1: int8_rows<1>(x_ptr, code_ptr, scale_ptr, out_ptr, N, K); break;
    case 2: int8_rows<2>(x_ptr, code_ptr, scale_ptr, out_ptr, N, K); break;
    case 3: int8_rows<3>(x_ptr, code_ptr, scale_ptr, out_ptr, N, K); break;
    default: int8_rows<4>(x_ptr, code_ptr, scale_ptr, out_ptr, N, K); break;
  }
  return out;
}

}  // namespace tokenloom_cpu

TORCH_LIBRARY_FRAGMENT(tokenloom_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_cpu, CPU, m) {
  m.impl("int8_linear", &tokenloom_cpu::int8_linear);
}

#endif  // __AVX512F__
