// Paged-attention primitives for the CPU, read straight from the block-structured KV cache
// (no gathered copy of a sequence's keys and values), registered as torch operators in the
// namespace `tokenloom_cpu`. The torch reference they are tested against is
// tokenloom/kernels/paged_attention.py; tokenloom/kernels/cpu_native.py builds and loads them.
//
// Cache layout (one tensor per layer): [2, num_blocks, block_size, num_kv_heads, head_size],
// contiguous; token p of a sequence lives in slot block_table[p / block_size] * block_size +
// p % block_size. Activations may be float32, bfloat16 or float16; arithmetic is float32. The
// cache holds the activations' dtype, or an 8-bit float format (fp8 e4m3fn or e5m2, vLLM's
// --kv-cache-dtype fp8*) whose elements stand for value * k_scale (keys) or * v_scale (values):
// the scales are folded into the score scale and the output, and each fp8 element is widened
// in registers (AVX-512, AVX2: placed in a float16's bits and converted by F16C) or through a
// 256-entry table (other paths).
// Head sizes of 64/128/256 take explicit vector code for the build's ISA level (AVX-512, with
// bfloat16 dot products where the CPU has them, or AVX2+FMA); others, and other CPUs, take
// generic loops the compiler vectorises.
// Decode rows that continue one sequence (a verifying request's pending token and its drafts:
// one block table, lengths L, L + 1, ...) are one work item that reads each key and value once
// for all of them, each row scoring, normalising and summing its own keys only. Every row's
// output is bit for bit what the kernel gives that row alone, in any batch and at any thread
// count (tests/kernels/test_paged_attention.py holds the kernel to it at every level).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>  // the AVX2 paths below
#define TOKENLOOM_ATTENTION_AVX2 1
#endif

namespace TOKENLOOM_CPU_NAMESPACE {


// kHead > 0: the head size known at compile time (the loops unroll into registers); 0: any
template <int kHead>
inline float dot(const float* a, const float* b, int64_t n) {
  const int64_t size = kHead > 0 ? kHead : n;
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < size; ++i) acc += a[i] * b[i];
  return acc;
}

template <int kHead>
inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  const int64_t size = kHead > 0 ? kHead : n;
#pragma omp simd
  for (int64_t i = 0; i < size; ++i) y[i] += alpha * x[i];
}

#if defined(__AVX512F__)
// 16 float32 lanes of cached keys/values at src (bfloat16 widened by a shift)
template <typename scalar_t>
inline __m512 load16(const scalar_t* src) {
  alignas(64) float buffer[16];
  load_row(src, buffer, 16);
  return _mm512_load_ps(buffer);
}
template <>
inline __m512 load16<float>(const float* src) { return _mm512_loadu_ps(src); }
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* src) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
// e5m2 is the upper byte of a float16 with the same value
template <>
inline __m512 load16<c10::Float8_e5m2>(const c10::Float8_e5m2* src) {
  const __m256i wide = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(wide, 8));
}
// e4m3fn: the sign to bit 15 and exponent+mantissa to bits 13..7 make the float16 of value / 2^8
// (subnormals included: F16C widens float16 subnormals exactly)
template <>
inline __m512 load16<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* src) {
  const __m256i wide = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m256i half_bits =
      _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x80)), 8),
                      _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(half_bits), _mm512_set1_ps(256.f));
}

// lane j of the result = the sum of v[j]'s 16 lanes (a shuffle tree: ~45 instructions for 16
// sums instead of 16 horizontal reductions)
inline __m512 transpose_sum16(__m512 v[16]) {
  __m512 halves[8], quads[4];
  for (int i = 0; i < 8; ++i) {
    // [a.q0 + a.q2, a.q1 + a.q3, b.q0 + b.q2, b.q1 + b.q3]
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 4; ++i) {
    // quad k holds the 4-lane partial sums of source 4 * i + k
    quads[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(quads[0], quads[1]), _mm512_unpackhi_ps(quads[0], quads[1]));
  const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(quads[2], quads[3]), _mm512_unpackhi_ps(quads[2], quads[3]));
  const __m512d ad = _mm512_castps_pd(a), bd = _mm512_castps_pd(b);
  const __m512 sums = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ad, bd)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(ad, bd)));
  // lane 4 * q + k now holds source 4 * k + q
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, sums);
}

// Scores of a KV head's query rows (num_rows of them) against the keys at `slots` (n <= 16 of
// them): scores[r * score_stride + t0 + j] for j < n. Each key's score is its own lanes' sum, the
// same whatever other keys share the run.
template <typename scalar_t, int kHead>
inline void score_chunk(const float* q_rows, int64_t num_rows, const scalar_t* k_cache, const int64_t* slots,
                        int64_t n, int64_t slot_stride, int64_t head_offset, float scale, float* scores,
                        int64_t score_stride, int64_t t0) {
  constexpr int kVecs = kHead / 16;
  __m512 keys[16][kVecs];
  for (int64_t j = 0; j < 16; ++j) {
    for (int c = 0; c < kVecs; ++c) {
      keys[j][c] = j < n ? load16(k_cache + slots[j] * slot_stride + head_offset + 16 * c) : _mm512_setzero_ps();
    }
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  for (int64_t r = 0; r < num_rows; ++r) {
    __m512 query[kVecs];
    for (int c = 0; c < kVecs; ++c) query[c] = _mm512_loadu_ps(q_rows + r * kHead + 16 * c);
    __m512 partial[16];
    for (int j = 0; j < 16; ++j) {
      __m512 acc = _mm512_mul_ps(query[0], keys[j][0]);
      for (int c = 1; c < kVecs; ++c) acc = _mm512_fmadd_ps(query[c], keys[j][c], acc);
      partial[j] = acc;
    }
    _mm512_mask_storeu_ps(scores + r * score_stride + t0, valid,
                          _mm512_mul_ps(transpose_sum16(partial), _mm512_set1_ps(scale)));
  }
}

#if defined(__AVX512BF16__)
// Scores for bfloat16 keys and queries on CPUs with bfloat16 dot products (vdpbf16ps: two exact
// products a lane, summed in float32), keys across the lanes: a run's keys are transposed once
// (column c, lane j: key j's c-th pair of elements), so that each query row costs one
// vdpbf16ps per pair of elements for all 16 keys and no horizontal sum. Transposing is the
// shuffle work the other layout spent on every row's sums, paid here once for all the query
// rows of a KV head (a group's, or a verifying run's rows x group). A row's score for a key is
// the same arithmetic whichever rows and keys share its run: its bits do not depend on the batch.

// rows[c] = lane j: the c-th 32-bit element of rows[j] (a 16 x 16 transpose in 64 shuffles)
inline void transpose16x16_epi32(__m512i rows[16]) {
  __m512i pairs[16], quads[16];
  for (int i = 0; i < 16; i += 2) {
    pairs[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
    pairs[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  // quads[4 g + m], 128-bit lane L: element 4 L + m of rows 4 g .. 4 g + 3
  for (int g = 0; g < 16; g += 4) {
    quads[g] = _mm512_unpacklo_epi64(pairs[g], pairs[g + 2]);
    quads[g + 1] = _mm512_unpackhi_epi64(pairs[g], pairs[g + 2]);
    quads[g + 2] = _mm512_unpacklo_epi64(pairs[g + 1], pairs[g + 3]);
    quads[g + 3] = _mm512_unpackhi_epi64(pairs[g + 1], pairs[g + 3]);
  }
  // element 4 L + m gathers 128-bit lane L of quads[m], quads[4 + m], quads[8 + m], quads[12 + m]
  for (int m = 0; m < 4; ++m) {
    const __m512i low01 = _mm512_shuffle_i32x4(quads[m], quads[4 + m], 0x44);
    const __m512i low23 = _mm512_shuffle_i32x4(quads[8 + m], quads[12 + m], 0x44);
    const __m512i high01 = _mm512_shuffle_i32x4(quads[m], quads[4 + m], 0xEE);
    const __m512i high23 = _mm512_shuffle_i32x4(quads[8 + m], quads[12 + m], 0xEE);
    rows[m] = _mm512_shuffle_i32x4(low01, low23, 0x88);
    rows[4 + m] = _mm512_shuffle_i32x4(low01, low23, 0xDD);
    rows[8 + m] = _mm512_shuffle_i32x4(high01, high23, 0x88);
    rows[12 + m] = _mm512_shuffle_i32x4(high01, high23, 0xDD);
  }
}

// columns[c], lane j: the c-th pair of elements of the key at slots[j] (zero for j >= n)
template <int kHead>
inline void transpose_keys_bf16(const c10::BFloat16* k_cache, const int64_t* slots, int64_t n, int64_t slot_stride,
                                int64_t head_offset, __m512i* columns) {
  for (int block = 0; block < kHead / 32; ++block) {
    __m512i rows[16];
    for (int64_t j = 0; j < 16; ++j) {
      rows[j] = j < n ? _mm512_loadu_si512(k_cache + slots[j] * slot_stride + head_offset + 32 * block)
                      : _mm512_setzero_si512();
    }
    transpose16x16_epi32(rows);
    for (int c = 0; c < 16; ++c) _mm512_store_si512(columns + 16 * block + c, rows[c]);
  }
}

// scores[r * score_stride + t0 + j] for kRows query rows (q_pairs: kHead / 2 pairs each) and
// the n valid lanes of the transposed keys; a row's even and odd pairs go to two chains, so
// that a few rows keep the dot-product unit busy
template <int kHead, int kRows>
inline void score_columns_bf16(const __m512i* columns, const uint32_t* q_pairs, __mmask16 valid, float scale,
                               float* scores, int64_t score_stride, int64_t t0) {
  constexpr int kPairs = kHead / 2;
  __m512 even[kRows], odd[kRows];
  for (int i = 0; i < kRows; ++i) even[i] = odd[i] = _mm512_setzero_ps();
  for (int c = 0; c < kPairs; c += 2) {
    const __m512bh keys0 = (__m512bh)_mm512_load_si512(columns + c);
    const __m512bh keys1 = (__m512bh)_mm512_load_si512(columns + c + 1);
    for (int i = 0; i < kRows; ++i) {
      even[i] = _mm512_dpbf16_ps(even[i], keys0, (__m512bh)_mm512_set1_epi32(q_pairs[i * kPairs + c]));
      odd[i] = _mm512_dpbf16_ps(odd[i], keys1, (__m512bh)_mm512_set1_epi32(q_pairs[i * kPairs + c + 1]));
    }
  }
  for (int i = 0; i < kRows; ++i) {
    _mm512_mask_storeu_ps(scores + i * score_stride + t0, valid,
                          _mm512_mul_ps(_mm512_add_ps(even[i], odd[i]), _mm512_set1_ps(scale)));
  }
}

// the scores of a KV head's num_rows bfloat16 query rows (kHead each) against the keys at `slots`
template <int kHead>
inline void score_chunk_bf16(const uint16_t* q_rows, int64_t num_rows, const c10::BFloat16* k_cache,
                             const int64_t* slots, int64_t n, int64_t slot_stride, int64_t head_offset, float scale,
                             float* scores, int64_t score_stride, int64_t t0) {
  alignas(64) __m512i columns[kHead / 2];
  transpose_keys_bf16<kHead>(k_cache, slots, n, slot_stride, head_offset, columns);
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  const uint32_t* q_pairs = reinterpret_cast<const uint32_t*>(q_rows);
  constexpr int64_t kTile = 8;
  int64_t r0 = 0;
  for (; r0 + kTile <= num_rows; r0 += kTile) {
    score_columns_bf16<kHead, kTile>(columns, q_pairs + r0 * (kHead / 2), valid, scale, scores + r0 * score_stride,
                                     score_stride, t0);
  }
  const uint32_t* tail_q = q_pairs + r0 * (kHead / 2);
  float* tail_scores = scores + r0 * score_stride;
  switch (num_rows - r0) {
    case 7: return score_columns_bf16<kHead, 7>(columns, tail_q, valid, scale, tail_scores, score_stride, t0);
    case 6: return score_columns_bf16<kHead, 6>(columns, tail_q, valid, scale, tail_scores, score_stride, t0);
    case 5: return score_columns_bf16<kHead, 5>(columns, tail_q, valid, scale, tail_scores, score_stride, t0);
    case 4: return score_columns_bf16<kHead, 4>(columns, tail_q, valid, scale, tail_scores, score_stride, t0);
    case 3: return score_columns_bf16<kHead, 3>(columns, tail_q, valid, scale, tail_scores, score_stride, t0);
    case 2: return score_columns_bf16<kHead, 2>(columns, tail_q, valid, scale, tail_scores, score_stride, t0);
    case 1: return score_columns_bf16<kHead, 1>(columns, tail_q, valid, scale, tail_scores, score_stride, t0);
    default: return;
  }
}
#endif

#if defined(__AVX512BF16__)
// Scores of bfloat16 query rows against bfloat16 keys read as they lie (no transposition), for
// models whose KV heads each serve one query head (group size 1: each key is scored by one row of
// a plain decode step, so transposing a run's keys, 128 shuffles a head, cost more than the dot
// products it was to save). Per key: kHead / 32 `vdpbf16ps` (pairs l, l + 16, .. in lane l), then
// the 16 keys' lanes summed by one shuffle tree. A score's arithmetic depends only on its key and
// row: every row of such a model takes this path, alone or in any batch.
template <int kHead>
inline void score_rows_direct_bf16(const uint16_t* q_rows, int64_t num_rows, const c10::BFloat16* k_cache,
                                   const int64_t* slots, int64_t n, int64_t slot_stride, int64_t head_offset,
                                   float scale, float* scores, int64_t score_stride, int64_t t0) {
  constexpr int kVecs = kHead / 32;
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  for (int64_t r = 0; r < num_rows; ++r) {
    __m512bh query[kVecs];
    for (int c = 0; c < kVecs; ++c) query[c] = (__m512bh)_mm512_loadu_si512(q_rows + r * kHead + 32 * c);
    __m512 partial[16];
    for (int j = 0; j < 16; ++j) {
      if (j >= n) {
        partial[j] = _mm512_setzero_ps();
        continue;
      }
      const c10::BFloat16* key = k_cache + slots[j] * slot_stride + head_offset;
      __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(key), query[0]);
      for (int c = 1; c < kVecs; ++c) acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(key + 32 * c), query[c]);
      partial[j] = acc;
    }
    _mm512_mask_storeu_ps(scores + r * score_stride + t0, valid,
                          _mm512_mul_ps(transpose_sum16(partial), _mm512_set1_ps(scale)));
  }
}
#endif

// out rows += the weighted values at `slots` for a KV head's query rows (num_rows of them), row
// r taking only its own keys (t0 + j < row_keys[r]): a run's shorter rows stop before its end
template <typename scalar_t, int kHead>
inline void accumulate_chunk(const float* scores, int64_t score_stride, int64_t t0, int64_t num_rows,
                             const int64_t* row_keys, const scalar_t* v_cache, const int64_t* slots, int64_t n,
                             int64_t slot_stride, int64_t head_offset, float* acc) {
  constexpr int kVecs = kHead / 16;
  constexpr int kTile = kHead <= 64 ? 4 : (kHead <= 128 ? 2 : 1);
  for (int64_t r0 = 0; r0 < num_rows; r0 += kTile) {
    const int64_t tile = std::min<int64_t>(kTile, num_rows - r0);
    int64_t limits[kTile], common = n, widest = 0;
    for (int i = 0; i < kTile; ++i) {
      limits[i] = i < tile ? std::clamp<int64_t>(row_keys[r0 + i] - t0, 0, n) : 0;
      if (i < tile) common = std::min(common, limits[i]);
      widest = std::max(widest, limits[i]);
    }
    __m512 sums[kTile][kVecs];
    for (int i = 0; i < kTile; ++i)
      for (int c = 0; c < kVecs; ++c) sums[i][c] = i < tile ? _mm512_loadu_ps(acc + (r0 + i) * kHead + 16 * c)
                                                           : _mm512_setzero_ps();
    for (int64_t j = 0; j < common; ++j) {
      const scalar_t* value = v_cache + slots[j] * slot_stride + head_offset;
      __m512 row[kVecs];
      for (int c = 0; c < kVecs; ++c) row[c] = load16(value + 16 * c);
      for (int i = 0; i < kTile; ++i) {
        if (i >= tile) break;
        const __m512 weight = _mm512_set1_ps(scores[(r0 + i) * score_stride + t0 + j]);
        for (int c = 0; c < kVecs; ++c) sums[i][c] = _mm512_fmadd_ps(weight, row[c], sums[i][c]);
      }
    }
    // keys only some of the tile's rows reach: each row's sum goes on in the same key order
    for (int64_t j = common; j < widest; ++j) {
      const scalar_t* value = v_cache + slots[j] * slot_stride + head_offset;
      __m512 row[kVecs];
      for (int c = 0; c < kVecs; ++c) row[c] = load16(value + 16 * c);
      for (int i = 0; i < kTile; ++i) {
        if (j >= limits[i]) continue;
        const __m512 weight = _mm512_set1_ps(scores[(r0 + i) * score_stride + t0 + j]);
        for (int c = 0; c < kVecs; ++c) sums[i][c] = _mm512_fmadd_ps(weight, row[c], sums[i][c]);
      }
    }
    for (int i = 0; i < kTile; ++i)
      for (int c = 0; c < kVecs; ++c)
        if (i < tile) _mm512_storeu_ps(acc + (r0 + i) * kHead + 16 * c, sums[i][c]);
  }
}
#endif

#if defined(TOKENLOOM_ATTENTION_AVX2)
// AVX2+FMA (x86-64-v3): 8 float32 lanes and 16 registers, so the AVX-512 shapes (a run's 16
// keys held in registers) do not fit. Keys and values are read from the cache as float32 rows
// -- in place for a float32 cache, widened once per run into a scratch block otherwise (bfloat16
// by a shift, float16 by F16C), so each row is converted once for all the group's query heads.

// n rows of head_size values at `rows[j]` as float32 in `dst` ([n][head_size]), pointing
// rows[j] at them; a float32 cache is read in place.
template <typename scalar_t>
inline void widen_rows8(const scalar_t* const* src, int64_t n, int64_t head_size, float* dst, const float** rows) {
  for (int64_t j = 0; j < n; ++j) {
    load_row(src[j], dst + j * head_size, head_size);
    rows[j] = dst + j * head_size;
  }
}

template <>
inline void widen_rows8<c10::BFloat16>(const c10::BFloat16* const* src, int64_t n, int64_t head_size, float* dst,
                                       const float** rows) {
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(src[j]);
    float* out = dst + j * head_size;
    int64_t i = 0;
    for (; i + 8 <= head_size; i += 8) {
      const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i)));
      _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
    for (; i < head_size; ++i) out[i] = static_cast<float>(src[j][i]);
    rows[j] = out;
  }
}

#if defined(__F16C__)
template <>
inline void widen_rows8<c10::Half>(const c10::Half* const* src, int64_t n, int64_t head_size, float* dst,
                                   const float** rows) {
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(src[j]);
    float* out = dst + j * head_size;
    int64_t i = 0;
    for (; i + 8 <= head_size; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i))));
    for (; i < head_size; ++i) out[i] = static_cast<float>(src[j][i]);
    rows[j] = out;
  }
}
#endif

// fp8 rows through float16 bits (see load16 in the AVX-512 section for the e4m3fn layout)
template <typename fp8_t>
inline void widen_fp8_rows8(const fp8_t* const* src, int64_t n, int64_t head_size, float* dst, const float** rows) {
  constexpr bool e4m3 = std::is_same_v<fp8_t, c10::Float8_e4m3fn>;
  const __m256 unit = _mm256_set1_ps(e4m3 ? 256.f : 1.f);
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* bits = reinterpret_cast<const uint8_t*>(src[j]);
    float* out = dst + j * head_size;
    int64_t i = 0;
    for (; i + 8 <= head_size; i += 8) {
      const __m128i wide = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bits + i)));
      const __m128i half_bits =
          e4m3 ? _mm_or_si128(_mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x80)), 8),
                              _mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x7F)), 7))
               : _mm_slli_epi16(wide, 8);
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtph_ps(half_bits), unit));
    }
    if (i < head_size) load_row(src[j] + i, out + i, head_size - i);
    rows[j] = out;
  }
}

template <>
inline void widen_rows8<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* const* src, int64_t n, int64_t head_size,
                                            float* dst, const float** rows) {
  widen_fp8_rows8(src, n, head_size, dst, rows);
}

template <>
inline void widen_rows8<c10::Float8_e5m2>(const c10::Float8_e5m2* const* src, int64_t n, int64_t head_size,
                                          float* dst, const float** rows) {
  widen_fp8_rows8(src, n, head_size, dst, rows);
}

template <>
inline void widen_rows8<float>(const float* const* src, int64_t n, int64_t, float*, const float** rows) {
  for (int64_t j = 0; j < n; ++j) rows[j] = src[j];
}

// lane j of the result = the sum of v[j]'s 8 lanes
inline __m256 transpose_sum8(const __m256 v[8]) {
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
  // per 128-bit half: the 4-lane partial sums of sources 0-3 (low) and 4-7 (high)
  const __m256 low = _mm256_hadd_ps(s01, s23), high = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

// the first n of 8 lanes
inline __m256i lanes8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Scores of a KV head's query rows (float32, kHead each; num_rows of them) against up to 16
// float32 key rows: scores[r * score_stride + t0 + j] = scale * q_r . keys[j], 8 keys at a time
// (eight accumulators, summed across by one transpose). keys[j] for j >= n may be anything readable.
template <int kHead>
inline void score_rows8(const float* q_rows, int64_t num_rows, const float* const* keys, int64_t n, float scale,
                        float* scores, int64_t score_stride, int64_t t0) {
  const __m256 factor = _mm256_set1_ps(scale);
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int64_t count = std::min<int64_t>(8, n - j0);
    const float* key[8];
    for (int j = 0; j < 8; ++j) key[j] = keys[j0 + (j < count ? j : 0)];
    const __m256i valid = lanes8(count);
    for (int64_t r = 0; r < num_rows; ++r) {
      const float* q = q_rows + r * kHead;
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int c = 0; c < kHead; c += 8) {
        const __m256 query = _mm256_loadu_ps(q + c);
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(query, _mm256_loadu_ps(key[j] + c), acc[j]);
      }
      float* out = scores + r * score_stride + t0 + j0;
      const __m256 result = _mm256_mul_ps(transpose_sum8(acc), factor);
      if (count == 8) {
        _mm256_storeu_ps(out, result);
      } else {
        _mm256_maskstore_ps(out, valid, result);
      }
    }
  }
}

// acc rows [r0, r0 + kRows) += sum_j scores[r][t0 + j] * values[j], over columns [col, col + 8 kCols),
// row r over its own keys only (t0 + j < row_keys[r]): kRows x kCols accumulators stay in
// registers over the run's keys
template <int kRows, int kCols>
inline void accumulate_tile8(const float* scores, int64_t score_stride, int64_t t0, int64_t r0, int64_t head_size,
                             const int64_t* row_keys, const float* const* values, int64_t n, int64_t col,
                             float* acc) {
  int64_t limits[kRows], common = n, widest = 0;
  for (int i = 0; i < kRows; ++i) {
    limits[i] = std::clamp<int64_t>(row_keys[r0 + i] - t0, 0, n);
    common = std::min(common, limits[i]);
    widest = std::max(widest, limits[i]);
  }
  __m256 sums[kRows][kCols];
  for (int i = 0; i < kRows; ++i)
    for (int c = 0; c < kCols; ++c) sums[i][c] = _mm256_loadu_ps(acc + (r0 + i) * head_size + col + 8 * c);
  for (int64_t j = 0; j < common; ++j) {
    const float* value = values[j] + col;
    for (int i = 0; i < kRows; ++i) {
      const __m256 weight = _mm256_broadcast_ss(scores + (r0 + i) * score_stride + t0 + j);
      for (int c = 0; c < kCols; ++c) sums[i][c] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(value + 8 * c), sums[i][c]);
    }
  }
  // keys only some of the rows reach: each row's sum goes on in the same key order
  for (int64_t j = common; j < widest; ++j) {
    const float* value = values[j] + col;
    for (int i = 0; i < kRows; ++i) {
      if (j >= limits[i]) continue;
      const __m256 weight = _mm256_broadcast_ss(scores + (r0 + i) * score_stride + t0 + j);
      for (int c = 0; c < kCols; ++c) sums[i][c] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(value + 8 * c), sums[i][c]);
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int c = 0; c < kCols; ++c) _mm256_storeu_ps(acc + (r0 + i) * head_size + col + 8 * c, sums[i][c]);
}

// out rows += the weighted float32 value rows, for a KV head's query rows (num_rows of them,
// row r over its first row_keys[r] - t0 keys here): tiles of 3 (or 2) rows x 32 columns, or 1
// row x 64 columns, 12 or 8 accumulators (kHead: a multiple of 64)
template <int kHead>
inline void accumulate_rows8(const float* scores, int64_t score_stride, int64_t t0, int64_t num_rows,
                             const int64_t* row_keys, const float* const* values, int64_t n, float* acc) {
  int64_t r0 = 0;
  for (; r0 + 3 <= num_rows; r0 += 3)
    for (int col = 0; col < kHead; col += 32)
      accumulate_tile8<3, 4>(scores, score_stride, t0, r0, kHead, row_keys, values, n, col, acc);
  if (num_rows - r0 == 2) {
    for (int col = 0; col < kHead; col += 32)
      accumulate_tile8<2, 4>(scores, score_stride, t0, r0, kHead, row_keys, values, n, col, acc);
  } else if (num_rows - r0 == 1) {
    for (int col = 0; col < kHead; col += 64)
      accumulate_tile8<1, 8>(scores, score_stride, t0, r0, kHead, row_keys, values, n, col, acc);
  }
}
#endif

// Asks the CPU to bring `row_len` elements from `row_offset` of each of the n slots into L2:
// blocks are scattered, so the hardware prefetcher cannot see the next run coming (the hint's
// level and distance were chosen by measurement: docs/design.md). Callers issue a KV head's
// rows just before they work on that head: a burst of every head's rows at once stalled the
// core on full miss queues (measured on a lone sequence's three heads in one pass).
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* cache, const int64_t* slots, int64_t n, int64_t slot_stride,
                          int64_t row_offset, int64_t row_len) {
  const int64_t row_bytes = row_len * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t j = 0; j < n; ++j) {
    const char* row = reinterpret_cast<const char*>(cache + slots[j] * slot_stride + row_offset);
    for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(row + byte, 0, 1);
  }
}

// Calls visit(t0, slots, n, next_slots, next_n) for runs of up to 16 consecutive positions of
// one block (t0: the run's first key index counted from `first`; slots: their cache slots;
// next_slots: the next run's, for the visitor to prefetch).
template <typename Visit>
inline void for_each_run16(const int64_t* table, int64_t block_size, int64_t first, int64_t seq_len, Visit visit) {
  int64_t slots[16], next_slots[16];
  auto fill = [&](int64_t pos, int64_t* out) -> int64_t {
    const int64_t offset = pos % block_size;
    const int64_t base = table[pos / block_size] * block_size + offset;
    const int64_t run = std::min<int64_t>({block_size - offset, seq_len - pos, 16});
    for (int64_t j = 0; j < run; ++j) out[j] = base + j;
    return run;
  };
  int64_t t = 0;
  int64_t run = first < seq_len ? fill(first, slots) : 0;
  for (int64_t pos = first; pos < seq_len;) {
    const int64_t next_pos = pos + run;
    const int64_t next_run = next_pos < seq_len ? fill(next_pos, next_slots) : 0;
    visit(t, slots, run, static_cast<const int64_t*>(next_slots), next_run);
    t += run;
    pos = next_pos;
    run = next_run;
    std::copy(next_slots, next_slots + next_run, slots);
  }
}

// Softmax of a score row in place (the first score seeds the maximum: every value stays finite,
// as the -ffast-math build assumes), after the optional soft cap. Callers hand it 64-byte
// aligned rows, so that how the compiler splits the sum into vector lanes and a tail depends on
// num_keys alone: a row's bits are the same in whatever batch it comes.
inline void softmax_row(float* s, int64_t num_keys, float cap) {
  if (cap > 0.f) {
    for (int64_t t = 0; t < num_keys; ++t) s[t] = std::tanh(s[t] / cap) * cap;
  }
  float max_score = s[0];
  for (int64_t t = 1; t < num_keys; ++t) max_score = std::max(max_score, s[t]);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < num_keys; ++t) {
    s[t] = std::exp(s[t] - max_score);
    total += s[t];
  }
  const float inv_total = 1.f / total;
#pragma omp simd
  for (int64_t t = 0; t < num_keys; ++t) s[t] *= inv_total;
}

// Query rows that continue one sequence: row i + 1 of a run has one key more than row i, and its
// block table has row i's blocks for every key row i reads (a verifying request's pending token
// and its drafts, laid out by whole_decode_plan). A run reads each key and value once for all
// its rows. Rows whose window starts after key 0 stay runs of one (their first keys differ).
struct DecodeRun {
  int64_t first_row;  // the run's first row of the batch
  int64_t num_rows;
  int64_t first;  // the first key position every row of the run reads
};

// The batch's rows as runs, in order: a row joins the run before it when its length is one more
// than that run's last row's and their block tables agree on the last row's blocks (so the
// run's last table gives every row's keys); costs O(blocks) a row.
inline std::vector<DecodeRun> find_runs(const int64_t* lens, const int64_t* tables, int64_t table_stride,
                                        int64_t num_seqs, int64_t block_size, int64_t sliding_window) {
  std::vector<DecodeRun> runs;
  runs.reserve(num_seqs);
  for (int64_t row = 0; row < num_seqs; ++row) {
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, lens[row] - sliding_window) : 0;
    if (row > 0 && !runs.empty()) {
      DecodeRun& run = runs.back();
      const int64_t previous_len = lens[row - 1];
      const int64_t previous_blocks = (previous_len + block_size - 1) / block_size;
      if (run.first == 0 && first == 0 && previous_len >= 1 && lens[row] == previous_len + 1 &&
          std::memcmp(tables + (row - 1) * table_stride, tables + row * table_stride,
                      previous_blocks * sizeof(int64_t)) == 0) {
        ++run.num_rows;
        continue;
      }
    }
    runs.push_back({row, 1, first});
  }
  return runs;
}

// Float scratch whose start is 64-byte aligned (see softmax_row), grown as needed.
struct AlignedScratch {
  std::vector<float> storage;
  float* get(int64_t count) {
    if (static_cast<int64_t>(storage.size()) < count + 16) storage.resize(count + 16);
    const auto address = reinterpret_cast<uintptr_t>(storage.data());
    return reinterpret_cast<float*>((address + 63) & ~static_cast<uintptr_t>(63));
  }
};

inline int64_t round_up16(int64_t value) { return (value + 15) / 16 * 16; }

// Decode attention, one query token a row, the rows grouped into runs (DecodeRun). A run's
// query rows ("units") are numbered KV head first, then the run's row, then the query head of
// the KV head's group: unit u is KV head u / (num_rows * group_size), row (u / group_size) %
// num_rows, query head u % group_size of that KV head. The work is the units of all runs in
// order, split into one contiguous range per thread of about equal cost (a unit costs its row's
// key count); a thread takes its range's units of one run in one pass over the run's blocks. So
// a lone sequence's KV heads, and a run's rows, are shared out over the threads when there are
// few, and of many sequences only those at a range's edge are read by two threads. Scores live
// in a per-thread scratch buffer, [unit][key]. scalar_t: the activations' dtype; cache_t: the
// cache's (the same, or an fp8 format scaled by k_scale / v_scale).
template <typename scalar_t, typename cache_t, int kHead>
void decode_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                           int64_t sliding_window, double soft_cap, double k_scale, double v_scale) {
  const int64_t num_seqs = query.size(0);
  const int64_t num_q_heads = query.size(1);
  const int64_t head_size = query.size(2);
  const int64_t block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group_size = num_q_heads / num_kv_heads;
  const int64_t q_seq_stride = query.stride(0), q_head_stride = query.stride(1);
  const int64_t out_seq_stride = out.stride(0), out_head_stride = out.stride(1);
  const int64_t table_stride = block_tables.stride(0);
  const int64_t slot_stride = num_kv_heads * head_size;
  const int64_t cache_half = kv_cache.size(1) * block_size * slot_stride;
  // a query row's float32 copy and sum start on 64 bytes in any batch (as the score rows)
  const int64_t row_stride = round_up16(head_size);

  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const cache_t* k_cache = static_cast<const cache_t*>(kv_cache.data_ptr());
  const cache_t* v_cache = k_cache + cache_half;
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  // q . (k_scale k) = k_scale (q . k): the key scale rides on the softmax scale; the value
  // scale multiplies the weighted sum once, when it is stored
  const float fscale = static_cast<float>(scale * k_scale);
  const float value_scale = static_cast<float>(v_scale);
  const float cap = static_cast<float>(soft_cap);

  const std::vector<DecodeRun> runs = find_runs(lens, tables, table_stride, num_seqs, block_size, sliding_window);
  const int64_t num_runs = static_cast<int64_t>(runs.size());
  auto row_keys_of = [&](const DecodeRun& run, int64_t row) {
    return std::max<int64_t>(0, lens[run.first_row + row] - run.first);
  };
  // the split: one range of (run, unit) per task, by cumulative cost
  int64_t total_cost = 0, total_units = 0;
  for (const DecodeRun& run : runs) {
    for (int64_t row = 0; row < run.num_rows; ++row) total_cost += row_keys_of(run, row) * num_q_heads;
    total_units += run.num_rows * num_q_heads;
  }
  if (total_cost == 0) return;
  const int64_t num_tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total_units));
  std::vector<std::pair<int64_t, int64_t>> bounds(num_tasks + 1, {num_runs, 0});
  bounds[0] = {0, 0};
  {
    int64_t task = 1, cost = 0;
    for (int64_t index = 0; index < num_runs && task < num_tasks; ++index) {
      const DecodeRun& run = runs[index];
      const int64_t units = run.num_rows * num_q_heads;
      for (int64_t unit = 0; unit < units && task < num_tasks; ++unit) {
        while (task < num_tasks && cost * num_tasks >= task * total_cost) bounds[task++] = {index, unit};
        cost += row_keys_of(run, (unit / group_size) % run.num_rows);
      }
    }
  }

  at::parallel_for(0, num_tasks, 1, [&](int64_t task_begin, int64_t task_end) {
    std::vector<float> row(head_size);
    std::vector<uint16_t> q_bf16;
    std::vector<int64_t> row_keys, head_keys;
    AlignedScratch q_scratch, acc_scratch, score_scratch;
#if defined(TOKENLOOM_ATTENTION_AVX2)
    // a run's key or value rows of one head widened to float32 (a float32 cache is read in place)
    std::vector<float> wide(std::is_same_v<cache_t, float> ? 0 : 16 * head_size);
    const cache_t* run_rows[16];
    const float* float_rows[16];
#endif
    // units [unit_begin, unit_end) of one run, in one pass over its blocks
    auto attend = [&](const DecodeRun& run, int64_t unit_begin, int64_t unit_end) {
      const int64_t rows_per_head = run.num_rows * group_size;
      const int64_t num_rows = unit_end - unit_begin;
      const int64_t first_kv_head = unit_begin / rows_per_head, last_kv_head = (unit_end - 1) / rows_per_head;
      row_keys.resize(num_rows);
      head_keys.assign(last_kv_head - first_kv_head + 1, 0);
      int64_t num_keys = 0;
      for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t unit = unit_begin + r;
        row_keys[r] = row_keys_of(run, (unit % rows_per_head) / group_size);
        num_keys = std::max(num_keys, row_keys[r]);
        int64_t& widest = head_keys[unit / rows_per_head - first_kv_head];
        widest = std::max(widest, row_keys[r]);
      }
      if (num_keys == 0) return;
      // the run's last row's table holds every row's keys
      const int64_t* table = tables + (run.first_row + run.num_rows - 1) * table_stride;
      const int64_t score_stride = round_up16(num_keys);
      float* q_rows = q_scratch.get(num_rows * row_stride);
      float* acc_data = acc_scratch.get(num_rows * row_stride);
      float* score_rows = score_scratch.get(num_rows * score_stride);
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) q_bf16.resize(num_rows * head_size);
      auto q_source = [&](int64_t r) {
        const int64_t unit = unit_begin + r, within = unit % rows_per_head;
        const int64_t q_head = (unit / rows_per_head) * group_size + within % group_size;
        return std::make_pair(run.first_row + within / group_size, q_head);
      };
      for (int64_t r = 0; r < num_rows; ++r) {
        const auto [seq, q_head] = q_source(r);
        const scalar_t* source = q_ptr + seq * q_seq_stride + q_head * q_head_stride;
        load_row(source, q_rows + r * row_stride, head_size);
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          std::memcpy(q_bf16.data() + r * head_size, source, head_size * sizeof(uint16_t));
        }
      }
      std::fill(acc_data, acc_data + num_rows * row_stride, 0.f);
      // the piece's rows of KV head h: [head_begin(h), head_end(h))
      auto head_begin = [&](int64_t h) { return std::max(unit_begin, h * rows_per_head) - unit_begin; };
      auto head_end = [&](int64_t h) { return std::min(unit_end, (h + 1) * rows_per_head) - unit_begin; };
      const int64_t seq_len = run.first + num_keys;
      // one pass over the blocks for all the piece's heads: work(t0, slots, n, r0, head_rows,
      // head_offset) for each head with keys in the run of slots, after the head's rows of the next
      // run are prefetched
      auto for_each_head_run = [&](const cache_t* cache, auto&& work) {
        for_each_run16(table, block_size, run.first, seq_len,
                       [&](int64_t t0, const int64_t* slots, int64_t n, const int64_t* next_slots, int64_t next_n) {
          for (int64_t h = first_kv_head; h <= last_kv_head; ++h) {
            if (t0 >= head_keys[h - first_kv_head]) continue;
            const int64_t r0 = head_begin(h), head_offset = h * head_size;
            prefetch_rows(cache, next_slots, next_n, slot_stride, head_offset, head_size);
            work(t0, slots, n, r0, head_end(h) - r0, head_offset);
          }
        });
      };
      for_each_head_run(k_cache, [&](int64_t t0, const int64_t* slots, int64_t n, int64_t r0, int64_t head_rows,
                                     int64_t head_offset) {
        const float* head_q = q_rows + r0 * row_stride;
        float* head_scores = score_rows + r0 * score_stride;
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16> &&
                      kHead > 0 && kHead % 32 == 0) {
          if (group_size == 1) {
            score_rows_direct_bf16<kHead>(q_bf16.data() + r0 * head_size, head_rows, k_cache, slots, n, slot_stride,
                                          head_offset, fscale, head_scores, score_stride, t0);
            return;
          }
          score_chunk_bf16<kHead>(q_bf16.data() + r0 * head_size, head_rows, k_cache, slots, n, slot_stride,
                                  head_offset, fscale, head_scores, score_stride, t0);
          return;
        }
#endif
#if defined(TOKENLOOM_ATTENTION_AVX2)
        if constexpr (kHead > 0 && kHead % 64 == 0) {
          for (int64_t j = 0; j < n; ++j) run_rows[j] = k_cache + slots[j] * slot_stride + head_offset;
          widen_rows8(run_rows, n, kHead, wide.data(), float_rows);
          score_rows8<kHead>(head_q, head_rows, float_rows, n, fscale, head_scores, score_stride, t0);
          return;
        }
#endif
#if defined(__AVX512F__)
        if constexpr (kHead > 0 && kHead % 16 == 0) {
          score_chunk<cache_t, kHead>(head_q, head_rows, k_cache, slots, n, slot_stride, head_offset, fscale,
                                       head_scores, score_stride, t0);
          return;
        }
#endif
        for (int64_t j = 0; j < n; ++j) {
          load_row(k_cache + slots[j] * slot_stride + head_offset, row.data(), head_size);
          for (int64_t r = 0; r < head_rows; ++r) {
            head_scores[r * score_stride + t0 + j] =
                dot<kHead>(head_q + r * row_stride, row.data(), head_size) * fscale;
          }
        }
      });
      for (int64_t r = 0; r < num_rows; ++r) {
        if (row_keys[r] > 0) softmax_row(score_rows + r * score_stride, row_keys[r], cap);
      }
      for_each_head_run(v_cache, [&](int64_t t0, const int64_t* slots, int64_t n, int64_t r0, int64_t head_rows,
                                     int64_t head_offset) {
        const float* head_scores = score_rows + r0 * score_stride;
        const int64_t* head_row_keys = row_keys.data() + r0;
        float* head_acc = acc_data + r0 * row_stride;
#if defined(TOKENLOOM_ATTENTION_AVX2)
        if constexpr (kHead > 0 && kHead % 64 == 0) {
          for (int64_t j = 0; j < n; ++j) run_rows[j] = v_cache + slots[j] * slot_stride + head_offset;
          widen_rows8(run_rows, n, kHead, wide.data(), float_rows);
          accumulate_rows8<kHead>(head_scores, score_stride, t0, head_rows, head_row_keys, float_rows, n, head_acc);
          return;
        }
#endif
#if defined(__AVX512F__)
        if constexpr (kHead > 0 && kHead % 16 == 0) {
          accumulate_chunk<cache_t, kHead>(head_scores, score_stride, t0, head_rows, head_row_keys, v_cache, slots,
                                            n, slot_stride, head_offset, head_acc);
          return;
        }
#endif
        for (int64_t j = 0; j < n; ++j) {
          load_row(v_cache + slots[j] * slot_stride + head_offset, row.data(), head_size);
          for (int64_t r = 0; r < head_rows; ++r) {
            if (t0 + j >= head_row_keys[r]) continue;  // a shorter row of the run: not its key
            axpy<kHead>(head_scores[r * score_stride + t0 + j], row.data(), head_acc + r * row_stride, head_size);
          }
        }
      });
      for (int64_t r = 0; r < num_rows; ++r) {
        if (row_keys[r] == 0) continue;  // no keys (length 0): the row is left as it was
        float* sums = acc_data + r * row_stride;
        if constexpr (is_fp8_v<cache_t>) {
          for (int64_t i = 0; i < head_size; ++i) sums[i] *= value_scale;
        }
        const auto [seq, q_head] = q_source(r);
        store_row(sums, out_ptr + seq * out_seq_stride + q_head * out_head_stride, head_size);
      }
    };
    for (int64_t task = task_begin; task < task_end; ++task) {
      const auto [start_run, start_unit] = bounds[task];
      const auto [end_run, end_unit] = bounds[task + 1];
      for (int64_t index = start_run; index <= end_run && index < num_runs; ++index) {
        const DecodeRun& run = runs[index];
        const int64_t unit_begin = index == start_run ? start_unit : 0;
        const int64_t unit_end = index == end_run ? end_unit : run.num_rows * num_q_heads;
        if (unit_begin < unit_end) attend(run, unit_begin, unit_end);
      }
    }
  });
}

void check_cache(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be one contiguous [2, num_blocks, block_size, num_kv_heads, head_size] tensor");
}

bool is_fp8_cache(const at::Tensor& kv_cache) {
  return kv_cache.scalar_type() == at::kFloat8_e4m3fn || kv_cache.scalar_type() == at::kFloat8_e5m2;
}

// by its bits: the -ffast-math build assumes every float finite, so std::isfinite is always true
inline bool positive_and_finite(double value) {
  uint64_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits != 0 && (bits >> 63) == 0 && ((bits >> 52) & 0x7FF) != 0x7FF;
}

// the activations' dtype must be the cache's, unless the cache is fp8; scales are for fp8 caches
void check_cache_dtype(at::ScalarType activations, const at::Tensor& kv_cache, double k_scale, double v_scale,
                       const char* what) {
  if (is_fp8_cache(kv_cache)) {
    TORCH_CHECK(positive_and_finite(k_scale) && positive_and_finite(v_scale),
                "k_scale and v_scale must be positive and finite, got ", k_scale, " and ", v_scale);
  } else {
    TORCH_CHECK(activations == kv_cache.scalar_type(), what, " and kv_cache must share a dtype (or the cache be fp8)");
    TORCH_CHECK(k_scale == 1.0 && v_scale == 1.0, "k_scale and v_scale apply to an fp8 kv_cache only");
  }
}

// calls body(cache_t{}) with cache_t the cache's element type: scalar_t itself, or an fp8 format
template <typename scalar_t, typename Body>
void dispatch_cache(const at::Tensor& kv_cache, Body body) {
  switch (kv_cache.scalar_type()) {
    case at::kFloat8_e4m3fn:
      return body(c10::Float8_e4m3fn());
    case at::kFloat8_e5m2:
      return body(c10::Float8_e5m2());
    default:
      return body(scalar_t());
  }
}

void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                            int64_t sliding_window, double soft_cap, double k_scale, double v_scale) {
  check_cache(kv_cache);
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [num_seqs, num_q_heads, head_size] with "
              "contiguous heads");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 && out.scalar_type() == query.scalar_type(),
              "out must match query");
  check_cache_dtype(query.scalar_type(), kv_cache, k_scale, v_scale, "query");
  TORCH_CHECK(query.size(2) == kv_cache.size(4) && query.size(1) % kv_cache.size(3) == 0,
              "query heads must group evenly over the cache's KV heads of the same size");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1 && block_tables.size(0) == query.size(0),
              "block_tables must be int64 [num_seqs, max_blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() &&
                  seq_lens.numel() == query.size(0),
              "seq_lens must be a contiguous int64 [num_seqs] tensor");
  // every key a row reads must have a block in its table (the kernel and its run detection read them)
  const int64_t table_keys = block_tables.size(1) * kv_cache.size(2);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t row = 0; row < seq_lens.numel(); ++row) {
    TORCH_CHECK(lens[row] <= table_keys, "seq_lens[", row, "] = ", lens[row], " exceeds the ", table_keys,
                " keys its block table holds");
  }
  TOKENLOOM_DISPATCH_ACTIVATION_TYPES(query.scalar_type(), "paged_decode_attention", [&] {
    dispatch_cache<scalar_t>(kv_cache, [&](auto cache_tag) {
      using cache_t = decltype(cache_tag);
      switch (query.size(2)) {
        case 64:
          return decode_attention_impl<scalar_t, cache_t, 64>(out, query, kv_cache, block_tables, seq_lens, scale,
                                                              sliding_window, soft_cap, k_scale, v_scale);
        case 128:
          return decode_attention_impl<scalar_t, cache_t, 128>(out, query, kv_cache, block_tables, seq_lens, scale,
                                                               sliding_window, soft_cap, k_scale, v_scale);
        case 256:
          return decode_attention_impl<scalar_t, cache_t, 256>(out, query, kv_cache, block_tables, seq_lens, scale,
                                                               sliding_window, soft_cap, k_scale, v_scale);
        default:
          return decode_attention_impl<scalar_t, cache_t, 0>(out, query, kv_cache, block_tables, seq_lens, scale,
                                                             sliding_window, soft_cap, k_scale, v_scale);
      }
    });
  });
}

// Stores each token's key and value rows at its flat slot (block_id * block_size + offset): a
// copy into a cache of the activations' dtype, quantized (times 1 / scale) into an fp8 cache.
template <typename scalar_t, typename cache_t>
void write_kv_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                   const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), head_size = key.size(2);
  const int64_t slot_stride = num_kv_heads * head_size;
  const int64_t cache_half = kv_cache.size(1) * kv_cache.size(2) * slot_stride;
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  cache_t* k_cache = static_cast<cache_t*>(kv_cache.data_ptr());
  cache_t* v_cache = k_cache + cache_half;
  const scalar_t* k_ptr = key.data_ptr<scalar_t>();
  const scalar_t* v_ptr = value.data_ptr<scalar_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  // the reciprocal as float32, as the torch reference multiplies by it
  const float k_inverse = static_cast<float>(1.0 / k_scale), v_inverse = static_cast<float>(1.0 / v_scale);
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " is outside the KV cache's ", num_slots,
                " slots");
  }
  auto store = [&](int64_t t) {
    const int64_t slot = slots[t];
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const scalar_t* key_row = k_ptr + t * key.stride(0) + h * key.stride(1);
      const scalar_t* value_row = v_ptr + t * value.stride(0) + h * value.stride(1);
      cache_t* key_slot = k_cache + slot * slot_stride + h * head_size;
      cache_t* value_slot = v_cache + slot * slot_stride + h * head_size;
      if constexpr (is_fp8_v<cache_t>) {
        quantize_row(key_row, key_slot, head_size, k_inverse);
        quantize_row(value_row, value_slot, head_size, v_inverse);
      } else {
        std::memcpy(key_slot, key_row, head_size * sizeof(scalar_t));
        std::memcpy(value_slot, value_row, head_size * sizeof(scalar_t));
      }
    }
  };
  if constexpr (is_fp8_v<cache_t>) {
    // quantizing a prompt's rows is real work: share it out (each token owns its slot)
    at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) store(t);
    });
  } else {
    for (int64_t t = 0; t < num_tokens; ++t) store(t);
  }
}

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
                    const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  check_cache(kv_cache);
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.stride(2) == 1 && value.stride(2) == 1,
              "key and value must be [num_tokens, num_kv_heads, head_size] with contiguous heads");
  TORCH_CHECK(key.size(1) == kv_cache.size(3) && key.size(2) == kv_cache.size(4),
              "key heads must match the cache's");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key and value must share a dtype");
  check_cache_dtype(key.scalar_type(), kv_cache, k_scale, v_scale, "key, value");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0),
              "slot_mapping must be a contiguous int64 [num_tokens] tensor");
  TOKENLOOM_DISPATCH_ACTIVATION_TYPES(key.scalar_type(), "write_kv_cache", [&] {
    dispatch_cache<scalar_t>(kv_cache, [&](auto cache_tag) {
      write_kv_impl<scalar_t, decltype(cache_tag)>(key, value, kv_cache, slot_mapping, k_scale, v_scale);
    });
  });
}

}  // namespace TOKENLOOM_CPU_NAMESPACE

TOKENLOOM_LIBRARY(m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int sliding_window, float soft_cap, float k_scale=1.0, float v_scale=1.0) -> ()");
  m.def(
      "write_kv_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, float k_scale=1.0, "
      "float v_scale=1.0) -> ()");
}

TOKENLOOM_LIBRARY_IMPL_CPU(m) {
  m.impl("paged_decode_attention", &TOKENLOOM_CPU_NAMESPACE::paged_decode_attention);
  m.impl("write_kv_cache", &TOKENLOOM_CPU_NAMESPACE::write_kv_cache);
}
