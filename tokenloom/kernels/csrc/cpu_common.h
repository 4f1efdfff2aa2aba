// Row loads and stores shared by tokenloom's CPU operators: any float dtype widened to float32
// and rounded back, written so that the compiler vectorises them (bfloat16 by bit shifts), and
// the 8-bit float formats of an fp8 KV cache (e4m3fn, e5m2) read through a lookup table.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_namespace.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace TOKENLOOM_CPU_NAMESPACE {

template <typename scalar_t>
inline void load_row(const scalar_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// bfloat16 widens by a shift (the bits moved by memcpy: writing floats through a uint32_t
// pointer breaks strict aliasing, and at -O3 the caller's reads of dst moved before the writes)
template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t widened = static_cast<uint32_t>(bits[i]) << 16;
    float value;
    std::memcpy(&value, &widened, sizeof(value));
    dst[i] = value;
  }
}

// -- 8-bit float KV caches ------------------------------------------------------------------
// A cache element is an fp8 value q; the float it stands for is q * scale (vLLM's per-layer
// k_scale / v_scale). Writes store fp8(clamp(x * (1 / scale))), rounded to nearest even and
// saturated to the format's largest finite value as vLLM's kernels do (torch's own cast does
// not saturate e5m2); the torch reference (kernels/paged_attention.py) computes the same bits.

template <typename T>
inline constexpr bool is_fp8_v = std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;

template <typename fp8_t>
inline constexpr float fp8_max_finite() {
  return std::is_same_v<fp8_t, c10::Float8_e4m3fn> ? 448.f : 57344.f;
}

// the 256 values of an fp8 format as float32, built once per format from c10's conversion (1 KiB:
// stays in L1 while a row is read)
template <typename fp8_t>
inline const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> values{};
    for (int bits = 0; bits < 256; ++bits) {
      values[bits] = static_cast<float>(fp8_t(static_cast<uint8_t>(bits), fp8_t::from_bits()));
    }
    return values;
  }();
  return table.data();
}

template <>
inline void load_row<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* src, float* dst, int64_t n) {
  const uint8_t* bits = reinterpret_cast<const uint8_t*>(src);
  const float* table = fp8_table<c10::Float8_e4m3fn>();
  for (int64_t i = 0; i < n; ++i) dst[i] = table[bits[i]];
}

template <>
inline void load_row<c10::Float8_e5m2>(const c10::Float8_e5m2* src, float* dst, int64_t n) {
  const uint8_t* bits = reinterpret_cast<const uint8_t*>(src);
  const float* table = fp8_table<c10::Float8_e5m2>();
  for (int64_t i = 0; i < n; ++i) dst[i] = table[bits[i]];
}

// n values times inv_scale, saturated and rounded to the fp8 format
template <typename fp8_t, typename scalar_t>
inline void quantize_row(const scalar_t* src, fp8_t* dst, int64_t n, float inv_scale) {
  constexpr float limit = fp8_max_finite<fp8_t>();
  for (int64_t i = 0; i < n; ++i) {
    const float scaled = static_cast<float>(src[i]) * inv_scale;
    dst[i] = fp8_t(std::min(std::max(scaled, -limit), limit));
  }
}

template <typename scalar_t>
inline void store_row(const float* src, scalar_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<scalar_t>(src[i]);
}

template <>
inline void store_row<float>(const float* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}

// float32 -> bfloat16 rounded to nearest even (NaN stays a quiet NaN), as c10 rounds
template <>
inline void store_row<c10::BFloat16>(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t value;
    std::memcpy(&value, src + i, sizeof(value));
    const uint32_t rounded = (value + 0x7FFFu + ((value >> 16) & 1u)) >> 16;
    out[i] = static_cast<uint16_t>((value & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
  }
}

#if defined(__AVX512BW__)
// 16 lanes at a time: the mask of the lanes left in a row, and bfloat16 values widened to
// float32 (by a shift) from the lanes a mask keeps (the others read as zero, never touched)
inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1);
}

inline __m512 load_bf16x16(const void* src, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(src))), 16));
}

// float32 -> bfloat16 bits of 16 lanes, to nearest even, NaN kept a quiet NaN (as c10 rounds)
inline __m256i bf16_bits16(__m512 value) {
  const __m512i bits = _mm512_castps_si512(value);
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                              _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)))),
      16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0)));
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
// 8 lanes at a time (AVX2 + F16C): float32 as is, bfloat16 widened by a shift and rounded back
// to nearest even in integer registers (NaN kept a quiet NaN, as store_row and c10 round),
// float16 by F16C (also to nearest even). Shared by every source's AVX2 rows: the sources
// compile as one translation unit per level (kernels/cpu_native.py), where a second definition
// is an error.
inline __m256 load8(const float* src) { return _mm256_loadu_ps(src); }
inline __m256 load8(const c10::BFloat16* src) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load8(const c10::Half* src) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}

// float32 -> bfloat16 bits, to nearest even, one per 32-bit lane
inline __m256i bf16_bits8(__m256 value) {
  const __m256i bits = _mm256_castps_si256(value);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}

inline void store8(float* dst, __m256 value) { _mm256_storeu_ps(dst, value); }
inline void store8(c10::BFloat16* dst, __m256 value) {
  const __m256i bits = bf16_bits8(value);  // < 2^16: the unsigned pack keeps them
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}
inline void store8(c10::Half* dst, __m256 value) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

}  // namespace TOKENLOOM_CPU_NAMESPACE
