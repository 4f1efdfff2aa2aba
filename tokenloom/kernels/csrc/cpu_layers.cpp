// Fused per-token operators of a decoder layer for the CPU, registered in the namespace
// `tokenloom_cpu`: RMSNorm with the residual add before it, rotary embedding in place, the
// gated activations, and the causal softmax between a prompt's two attention matmuls. Each replaces a chain of 3-9 torch operators whose dispatch costs more than
// their arithmetic at decode sizes. Arithmetic is float32; the result is rounded once to the
// activations' dtype. The torch references are in tokenloom/layers (layernorm.py, rotary.py,
// activation.py), and tests/kernels/test_cpu_layers.py holds them to each other. RMSNorm,
// SiLU-and-mul and the causal softmax have explicit vector rows for AVX512-BF16 (bfloat16) and
// AVX2+FMA+F16C (every dtype), where they beat what the compiler makes of the generic loops.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_ops.h"
#include "cpu_pages.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#include <immintrin.h>  // the AVX2 row paths below

#include <cstring>
#define TOKENLOOM_ROWS_AVX2 1
#endif

namespace TOKENLOOM_CPU_NAMESPACE {


// rows per parallel task: small batches stay on the calling thread
constexpr int64_t kRowGrain = 16;

#if defined(__AVX512BF16__)
// bfloat16 rows with AVX512-BF16: 16 values a register, widened by a shift and rounded back
// to nearest even by vcvtneps2bf16, the rounding store_row does (finite values)
inline __m512 widen16(const c10::BFloat16* src, __mmask16 mask) { return load_bf16x16(src, mask); }

inline void store16(c10::BFloat16* dst, __m512 value, __mmask16 mask) {
  _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(dst), mask, (__m256i)_mm512_cvtneps_pbh(value));
}

inline __m512 round16(__m512 value) {  // to bfloat16 and back
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(value)), 16));
}

// RMSNorm of one bfloat16 row (Llama's: the normalised value rounded before the weight), with
// the residual added (and stored, rounded) first when there is one
void rms_norm_row_bf16(const c10::BFloat16* x, const c10::BFloat16* residual, const float* scale, float eps,
                       int64_t features, c10::BFloat16* out, c10::BFloat16* residual_out) {
  __m512 squares = _mm512_setzero_ps();
  const c10::BFloat16* summed = residual != nullptr ? residual_out : x;
  for (int64_t j = 0; j < features; j += 16) {
    const __mmask16 mask = tail_mask(features - j);
    __m512 value = widen16(x + j, mask);
    if (residual != nullptr) {
      value = round16(_mm512_add_ps(value, widen16(residual + j, mask)));
      store16(residual_out + j, value, mask);
    }
    squares = _mm512_fmadd_ps(value, value, squares);
  }
  const __m512 inv_rms = _mm512_set1_ps(
      1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(features) + eps));
  for (int64_t j = 0; j < features; j += 16) {
    const __mmask16 mask = tail_mask(features - j);
    const __m512 normed = round16(_mm512_mul_ps(widen16(summed + j, mask), inv_rms));
    store16(out + j, _mm512_mul_ps(normed, _mm512_maskz_loadu_ps(mask, scale + j)), mask);
  }
}

// e^x for x <= 0 (silu's use): 2^n * p(r), r = x - n ln 2 in [-ln2/2, ln2/2], p of degree 6
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// silu(gate) * up for one bfloat16 row: silu(v) = v / (1 + e^-v), with e^-|v| so the
// exponential never overflows
void silu_and_mul_row_bf16(const c10::BFloat16* gate, const c10::BFloat16* up, int64_t width, c10::BFloat16* out) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 mask = tail_mask(width - j);
    const __m512 v = widen16(gate + j, mask);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(v)));  // e^-|v|
    // v >= 0: v / (1 + e^-v); v < 0: v e^v / (1 + e^v)
    const __mmask16 negative = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 numerator = _mm512_mask_mul_ps(v, negative, v, e);
    const __m512 denominator = _mm512_add_ps(one, e);  // in [1, 2]: rcp14 and one Newton step
    __m512 reciprocal = _mm512_rcp14_ps(denominator);
    reciprocal = _mm512_mul_ps(reciprocal, _mm512_fnmadd_ps(denominator, reciprocal, _mm512_set1_ps(2.f)));
    const __m512 silu = _mm512_mul_ps(numerator, reciprocal);
    store16(out + j, _mm512_mul_ps(silu, widen16(up + j, mask)), mask);
  }
}

// softmax over the first `visible` scores of a bfloat16 row (scaled), zeros after them, in place
void causal_softmax_row_bf16(c10::BFloat16* row, int64_t visible, int64_t keys, float scale, float* values) {
  __m512 maximum = _mm512_set1_ps(-3.0e38f);
  for (int64_t k = 0; k < visible; k += 16) {
    const __mmask16 mask = tail_mask(visible - k);
    maximum = _mm512_mask_max_ps(maximum, mask, maximum, widen16(row + k, mask));
  }
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(maximum));
  const __m512 factor = _mm512_set1_ps(scale);
  __m512 total = _mm512_setzero_ps();
  for (int64_t k = 0; k < visible; k += 16) {
    const __mmask16 mask = tail_mask(visible - k);
    const __m512 e = _mm512_maskz_mov_ps(
        mask, exp_nonpositive(_mm512_mul_ps(_mm512_sub_ps(widen16(row + k, mask), shift), factor)));
    _mm512_mask_storeu_ps(values + k, mask, e);
    total = _mm512_add_ps(total, e);
  }
  const __m512 inverse = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
  for (int64_t k = 0; k < keys; k += 16) {
    const __mmask16 mask = tail_mask(keys - k);
    const __m512 value = k < visible ? _mm512_maskz_loadu_ps(tail_mask(visible - k) & mask, values + k)
                                     : _mm512_setzero_ps();
    store16(row + k, _mm512_mul_ps(value, inverse), mask);
  }
}
#endif

#if defined(TOKENLOOM_ROWS_AVX2)
// Rows with AVX2+FMA+F16C (x86-64-v3), 8 float32 lanes a register for every storage dtype
// (load8/store8 and the bfloat16 rounding in cpu_common.h). AVX2 has no masked 16-bit loads or
// stores: a row's last n < 8 values go through a zero-padded buffer, with the same arithmetic
// as the others.

// value rounded to scalar_t and widened back
template <typename scalar_t>
inline __m256 round8(__m256 value);
template <>
inline __m256 round8<float>(__m256 value) { return value; }
template <>
inline __m256 round8<c10::BFloat16>(__m256 value) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(value), 16)); }
template <>
inline __m256 round8<c10::Half>(__m256 value) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// the last n < 8 values of a row, zero-padded
template <typename scalar_t>
inline __m256 load_tail8(const scalar_t* src, int64_t n) {
  alignas(32) scalar_t buffer[8];
  std::memset(static_cast<void*>(buffer), 0, sizeof(buffer));
  std::memcpy(static_cast<void*>(buffer), src, n * sizeof(scalar_t));
  return load8(buffer);
}
template <typename scalar_t>
inline void store_tail8(scalar_t* dst, __m256 value, int64_t n) {
  alignas(32) scalar_t buffer[8];
  store8(buffer, value);
  std::memcpy(static_cast<void*>(dst), buffer, n * sizeof(scalar_t));
}

// calls step(j, count) over a row of n values in steps of 8, count < 8 only for the last one
template <typename Step>
inline void for_each8(int64_t n, Step step) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) step(j, 8);
  if (j < n) step(j, n - j);
}
template <typename scalar_t>
inline __m256 load8n(const scalar_t* src, int64_t count) { return count == 8 ? load8(src) : load_tail8(src, count); }
template <typename scalar_t>
inline void store8n(scalar_t* dst, __m256 value, int64_t count) {
  if (count == 8) {
    store8(dst, value);
  } else {
    store_tail8(dst, value, count);
  }
}

inline float sum8(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}
inline float max8(__m256 v) {
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
}

// e^x for x <= 0, as exp_nonpositive above: 2^n * p(r), r = x - n ln 2, p of degree 6; 2^n
// built in the exponent bits (n >= -126 after the clamp: a normal float)
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

// RMSNorm of one row, the residual added (and stored, rounded) first when there is one; Llama
// rounds the normalised value to the dtype before the weight (round_normed), Gemma does not
template <typename scalar_t>
void rms_norm_row8(const scalar_t* x, const scalar_t* residual, const float* scale, float eps, int64_t features,
                   bool round_normed, scalar_t* out, scalar_t* residual_out) {
  const scalar_t* summed = residual != nullptr ? residual_out : x;
  __m256 squares = _mm256_setzero_ps();
  for_each8(features, [&](int64_t j, int64_t count) {
    __m256 value = load8n(x + j, count);
    if (residual != nullptr) {
      value = round8<scalar_t>(_mm256_add_ps(value, load8n(residual + j, count)));
      store8n(residual_out + j, value, count);
    }
    squares = _mm256_fmadd_ps(value, value, squares);
  });
  const __m256 inv_rms = _mm256_set1_ps(1.f / std::sqrt(sum8(squares) / static_cast<float>(features) + eps));
  for_each8(features, [&](int64_t j, int64_t count) {
    __m256 normed = _mm256_mul_ps(load8n(summed + j, count), inv_rms);
    if (round_normed) normed = round8<scalar_t>(normed);
    store8n(out + j, _mm256_mul_ps(normed, load8n(scale + j, count)), count);
  });
}

// silu(gate) * up for one row: silu(v) = v / (1 + e^-v), with e^-|v| so the exponential never
// overflows (v < 0: v e^v / (1 + e^v)); the reciprocal of 1 + e in [1, 2] by rcp and one Newton step
template <typename scalar_t>
void silu_and_mul_row8(const scalar_t* gate, const scalar_t* up, int64_t width, scalar_t* out) {
  const __m256 one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f), zero = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for_each8(width, [&](int64_t j, int64_t count) {
    const __m256 v = load8n(gate + j, count);
    const __m256 e = exp_nonpositive8(_mm256_or_ps(v, sign));  // e^-|v|
    const __m256 numerator = _mm256_blendv_ps(v, _mm256_mul_ps(v, e), _mm256_cmp_ps(v, zero, _CMP_LT_OQ));
    const __m256 denominator = _mm256_add_ps(one, e);
    __m256 reciprocal = _mm256_rcp_ps(denominator);
    reciprocal = _mm256_mul_ps(reciprocal, _mm256_fnmadd_ps(denominator, reciprocal, two));
    store8n(out + j, _mm256_mul_ps(_mm256_mul_ps(numerator, reciprocal), load8n(up + j, count)), count);
  });
}

// softmax over the first `visible` scores of a row (scaled), zeros after them, in place;
// values: float32 scratch of the row's length
template <typename scalar_t>
void causal_softmax_row8(scalar_t* row, int64_t visible, int64_t keys, float scale, float* values) {
  __m256 maximum = _mm256_set1_ps(-3.0e38f);
  for_each8(visible, [&](int64_t k, int64_t count) {
    __m256 value = load8n(row + k, count);
    if (count < 8) value = _mm256_blendv_ps(_mm256_set1_ps(-3.0e38f), value, _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
    maximum = _mm256_max_ps(maximum, value);
    _mm256_storeu_ps(values + k, value);  // values has room for whole registers (keys rounded up)
  });
  const __m256 shift = _mm256_set1_ps(max8(maximum)), factor = _mm256_set1_ps(scale);
  __m256 total = _mm256_setzero_ps();
  for_each8(visible, [&](int64_t k, int64_t count) {
    // the padding lanes (-3e38) come out as e^-87-ish after the clamp: zeroed before the sum
    __m256 e = exp_nonpositive8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(values + k), shift), factor));
    if (count < 8) e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(
        _mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
    _mm256_storeu_ps(values + k, e);
    total = _mm256_add_ps(total, e);
  });
  const __m256 inverse = _mm256_set1_ps(1.f / sum8(total));
  for_each8(keys, [&](int64_t k, int64_t count) {
    const __m256 value = k < visible ? _mm256_mul_ps(_mm256_loadu_ps(values + k), inverse) : _mm256_setzero_ps();
    store8n(row + k, value, count);
  });
}
#endif

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [rows, features] with contiguous features");
}

template <typename scalar_t>
void rms_norm_impl(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                   double eps, bool gemma, at::Tensor& out, at::Tensor& residual_out) {
  const int64_t rows = x.size(0), features = x.size(1);
  const scalar_t* x_ptr = x.data_ptr<scalar_t>();
  const scalar_t* r_ptr = residual ? residual->data_ptr<scalar_t>() : nullptr;
  const int64_t x_stride = x.stride(0), r_stride = residual ? residual->stride(0) : 0;
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  scalar_t* sum_ptr = residual ? residual_out.data_ptr<scalar_t>() : nullptr;
  const float feps = static_cast<float>(eps);
  // the weight as float32, with Gemma's 1 + w folded in
  std::vector<float> scale(features);
  load_row(weight.data_ptr<scalar_t>(), scale.data(), features);
  if (gemma) {
    for (int64_t j = 0; j < features; ++j) scale[j] += 1.f;
  }
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (!gemma) {
      at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i)
          rms_norm_row_bf16(x_ptr + i * x_stride, r_ptr != nullptr ? r_ptr + i * r_stride : nullptr, scale.data(),
                            feps, features, out_ptr + i * features,
                            sum_ptr != nullptr ? sum_ptr + i * features : nullptr);
      });
      return;
    }
  }
#endif
#if defined(TOKENLOOM_ROWS_AVX2)
  if constexpr (!std::is_same_v<scalar_t, double>) {
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        rms_norm_row8(x_ptr + i * x_stride, r_ptr != nullptr ? r_ptr + i * r_stride : nullptr, scale.data(), feps,
                      features, !gemma, out_ptr + i * features, sum_ptr != nullptr ? sum_ptr + i * features : nullptr);
    });
    return;
  }
#endif
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(features), other(features);
    float* row_data = row.data();
    const float* scale_data = scale.data();
    for (int64_t i = begin; i < end; ++i) {
      load_row(x_ptr + i * x_stride, row_data, features);
      if (r_ptr != nullptr) {
        // x + residual is rounded to the activations' dtype first: it is the next residual
        load_row(r_ptr + i * r_stride, other.data(), features);
        const float* other_data = other.data();
#pragma omp simd
        for (int64_t j = 0; j < features; ++j) row_data[j] += other_data[j];
        store_row(row_data, sum_ptr + i * features, features);
        load_row(sum_ptr + i * features, row_data, features);
      }
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t j = 0; j < features; ++j) squares += row_data[j] * row_data[j];
      const float inv_rms = 1.f / std::sqrt(squares / static_cast<float>(features) + feps);
#pragma omp simd
      for (int64_t j = 0; j < features; ++j) row_data[j] *= inv_rms;
      if (!gemma) {
        // Llama rounds the normalised value to the dtype before the weight multiplies it
        store_row(row_data, out_ptr + i * features, features);
        load_row(out_ptr + i * features, row_data, features);
      }
#pragma omp simd
      for (int64_t j = 0; j < features; ++j) row_data[j] *= scale_data[j];
      store_row(row_data, out_ptr + i * features, features);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps, bool gemma) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [features] tensor of x's dtype");
  if (residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x");
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor residual_out = residual ? at::empty(x.sizes(), x.options()) : x;
  TOKENLOOM_DISPATCH_ACTIVATION_TYPES(x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(x, residual, weight, eps, gemma, out, residual_out);
  });
  return {out, residual_out};
}

// x: [tokens, heads, head_size] (any token and head strides, contiguous features), rotated in
// place to `positions` in the rotate-half layout over its first rotary_dim features; cos/sin
// caches: [max_position, rotary_dim / 2].
template <typename scalar_t>
void rotary_impl(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_cache, const at::Tensor& sin_cache) {
  const int64_t tokens = x.size(0), heads = x.size(1);
  const int64_t half = cos_cache.size(1);
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  scalar_t* x_ptr = x.data_ptr<scalar_t>();
  const int64_t* pos_ptr = positions.data_ptr<int64_t>();
  const scalar_t* cos_ptr = cos_cache.data_ptr<scalar_t>();
  const scalar_t* sin_ptr = sin_cache.data_ptr<scalar_t>();
  const int64_t max_position = cos_cache.size(0);
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> cos_row(half), sin_row(half);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t position = pos_ptr[t];
      TORCH_CHECK(position >= 0 && position < max_position, "position ", position, " is outside the rotary table's ",
                  max_position, " positions");
      for (int64_t j = 0; j < half; ++j) {
        cos_row[j] = static_cast<float>(cos_ptr[position * half + j]);
        sin_row[j] = static_cast<float>(sin_ptr[position * half + j]);
      }
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* head = x_ptr + t * token_stride + h * head_stride;
        for (int64_t j = 0; j < half; ++j) {
          const float first = static_cast<float>(head[j]), second = static_cast<float>(head[j + half]);
          head[j] = static_cast<scalar_t>(first * cos_row[j] - second * sin_row[j]);
          head[j + half] = static_cast<scalar_t>(second * cos_row[j] + first * sin_row[j]);
        }
      }
    }
  });
}

void rotary_embedding_(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos_cache,
                       const at::Tensor& sin_cache) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [tokens, heads, head_size] with contiguous features");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
              "positions must be a contiguous int64 [tokens] tensor");
  TORCH_CHECK(cos_cache.dim() == 2 && cos_cache.is_contiguous() && sin_cache.sizes() == cos_cache.sizes() &&
                  sin_cache.is_contiguous() && cos_cache.scalar_type() == x.scalar_type() &&
                  sin_cache.scalar_type() == x.scalar_type(),
              "cos/sin caches must be contiguous [positions, rotary_dim / 2] tensors of x's dtype");
  TORCH_CHECK(2 * cos_cache.size(1) <= x.size(2), "the rotary dimension exceeds the head size");
  TOKENLOOM_DISPATCH_ACTIVATION_TYPES(x.scalar_type(), "rotary_embedding_", [&] {
    rotary_impl<scalar_t>(x, positions, cos_cache, sin_cache);
  });
}

// out[:, j] = act(x[:, j]) * x[:, d + j] for x: [rows, 2d]; act maps a float32 row in place
template <typename scalar_t, typename Act>
void act_and_mul_impl(const at::Tensor& x, at::Tensor& out, Act act) {
  const int64_t rows = x.size(0), width = x.size(1) / 2;
  const scalar_t* x_ptr = x.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t x_stride = x.stride(0);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(width), up(width);
    float* gate_data = gate.data();
    const float* up_data = up.data();
    for (int64_t i = begin; i < end; ++i) {
      load_row(x_ptr + i * x_stride, gate_data, width);
      load_row(x_ptr + i * x_stride + width, up.data(), width);
      act(gate_data, width);
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) gate_data[j] *= up_data[j];
      store_row(gate_data, out_ptr + i * width, width);
    }
  });
}

// the activations, each mapping a float32 row in place (outside the dispatch macro: a
// #pragma cannot stand in a macro's argument)
void silu_rows(float* v, int64_t n) {
  // the exponent is clamped: the build assumes finite values
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) v[j] = v[j] / (1.f + std::exp(std::min(-v[j], 80.f)));
}

void gelu_tanh_rows(float* v, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float inner = 0.7978845608028654f * (v[j] + 0.044715f * v[j] * v[j] * v[j]);
    v[j] = 0.5f * v[j] * (1.f + std::tanh(inner));
  }
}

void gelu_rows(float* v, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) v[j] = 0.5f * v[j] * (1.f + std::erf(v[j] * 0.7071067811865476f));
}

#if defined(TOKENLOOM_ROWS_AVX2)
template <typename scalar_t>
void silu_and_mul_rows8(const at::Tensor& x, at::Tensor& out) {
  if constexpr (!std::is_same_v<scalar_t, double>) {
    const int64_t width = x.size(1) / 2, x_stride = x.stride(0);
    const scalar_t* x_ptr = x.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        silu_and_mul_row8(x_ptr + i * x_stride, x_ptr + i * x_stride + width, width, out_ptr + i * width);
    });
  }
}
#endif

at::Tensor act_and_mul(const at::Tensor& x, const std::string& activation) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must hold gate and up halves of equal width");
  void (*act)(float*, int64_t) = nullptr;
  if (activation == "silu") {
    act = silu_rows;
  } else if (activation == "gelu_tanh") {
    act = gelu_tanh_rows;
  } else if (activation == "gelu") {
    act = gelu_rows;
  }
  TORCH_CHECK(act != nullptr, "unknown activation ", activation, "; known: silu, gelu_tanh, gelu");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  huge_output_pages(out.data_ptr(), static_cast<int64_t>(out.nbytes()));
#if defined(__AVX512BF16__)
  if (act == silu_rows && x.scalar_type() == at::kBFloat16) {
    const int64_t width = x.size(1) / 2, x_stride = x.stride(0);
    const auto* x_ptr = x.data_ptr<c10::BFloat16>();
    auto* out_ptr = out.data_ptr<c10::BFloat16>();
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        silu_and_mul_row_bf16(x_ptr + i * x_stride, x_ptr + i * x_stride + width, width, out_ptr + i * width);
    });
    return out;
  }
#endif
#if defined(TOKENLOOM_ROWS_AVX2)
  if (act == silu_rows && x.scalar_type() != at::kDouble) {
    TOKENLOOM_DISPATCH_ACTIVATION_TYPES(x.scalar_type(), "act_and_mul", [&] {
      silu_and_mul_rows8<scalar_t>(x, out);
    });
    return out;
  }
#endif
  TOKENLOOM_DISPATCH_ACTIVATION_TYPES(x.scalar_type(), "act_and_mul", [&] {
    act_and_mul_impl<scalar_t>(x, out, act);
  });
  return out;
}

// Causal softmax of attention scores in place, for a prompt attending to itself after
// `K - Q` earlier keys: scores [batch, Q, K]; row q keeps keys 0 .. K - Q + q (scaled, softmaxed
// in float32) and zeroes the rest. Replaces scale, mask, softmax and the dtype round trip.
template <typename scalar_t>
void causal_softmax_impl(at::Tensor& scores, double scale) {
  const int64_t batch = scores.size(0), queries = scores.size(1), keys = scores.size(2);
  const int64_t context = keys - queries;
  scalar_t* base = scores.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    at::parallel_for(0, batch * queries, kRowGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> row(keys);
      for (int64_t index = begin; index < end; ++index)
        causal_softmax_row_bf16(base + index * keys, context + index % queries + 1, keys, fscale, row.data());
    });
    return;
  }
#endif
#if defined(TOKENLOOM_ROWS_AVX2)
  if constexpr (!std::is_same_v<scalar_t, double>) {
    at::parallel_for(0, batch * queries, kRowGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> row(keys + 8);  // whole registers past the row's end
      for (int64_t index = begin; index < end; ++index)
        causal_softmax_row8(base + index * keys, context + index % queries + 1, keys, fscale, row.data());
    });
    return;
  }
#endif
  at::parallel_for(0, batch * queries, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(keys);
    float* values = row.data();
    for (int64_t index = begin; index < end; ++index) {
      scalar_t* scores_row = base + index * keys;
      const int64_t visible = context + index % queries + 1;
      load_row(scores_row, values, visible);
      // the first score seeds the maximum: every value stays finite (the build is -ffast-math)
      float max_score = values[0];
      for (int64_t k = 1; k < visible; ++k) max_score = std::max(max_score, values[k]);
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t k = 0; k < visible; ++k) {
        values[k] = std::exp((values[k] - max_score) * fscale);
        total += values[k];
      }
      const float inv_total = 1.f / total;
#pragma omp simd
      for (int64_t k = 0; k < visible; ++k) values[k] *= inv_total;
#pragma omp simd
      for (int64_t k = visible; k < keys; ++k) values[k] = 0.f;
      store_row(values, scores_row, keys);
    }
  });
}

void causal_softmax_(at::Tensor scores, double scale) {
  TORCH_CHECK(scores.dim() == 3 && scores.is_contiguous() && scores.size(2) >= scores.size(1),
              "scores must be a contiguous [batch, queries, keys] tensor with keys >= queries");
  TORCH_CHECK(scale > 0, "the softmax scale must be positive");
  TOKENLOOM_DISPATCH_ACTIVATION_TYPES(scores.scalar_type(), "causal_softmax_", [&] {
    causal_softmax_impl<scalar_t>(scores, scale);
  });
}

}  // namespace TOKENLOOM_CPU_NAMESPACE

TOKENLOOM_LIBRARY_FRAGMENT(m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps, bool gemma) -> (Tensor, Tensor)");
  m.def("rotary_embedding_(Tensor(a!) x, Tensor positions, Tensor cos_cache, Tensor sin_cache) -> ()");
  m.def("act_and_mul(Tensor x, str activation) -> Tensor");
  m.def("causal_softmax_(Tensor(a!) scores, float scale) -> ()");
}

TOKENLOOM_LIBRARY_IMPL_CPU(m) {
  m.impl("rms_norm", &TOKENLOOM_CPU_NAMESPACE::rms_norm);
  m.impl("rotary_embedding_", &TOKENLOOM_CPU_NAMESPACE::rotary_embedding_);
  m.impl("act_and_mul", &TOKENLOOM_CPU_NAMESPACE::act_and_mul);
  m.impl("causal_softmax_", &TOKENLOOM_CPU_NAMESPACE::causal_softmax_);
}
