// W8A8 int8 matmul, `w8a8_linear`: int8 weights with one float32 scale per output channel times
// activations quantized to int8 per token (one symmetric scale per row), as a compressed-tensors
// `int-quantized` W8A8 checkpoint is meant to run (vLLM's `scaled_int8_quant` + int8 GEMM). The
// Python side is tokenloom/kernels/w8a8_matmul.py (packing, and the torch reference).
//
// Each row m of x is quantized over its whole K: s_m = max|x_m| * (1/127), q = round(x * (127 /
// max|x_m|)) to nearest even (all zero for a zero row). Then, for output channel n with weight
// codes w and scale d_n,
//   out[m, n] = float(sum_k q_k w_nk) * (s_m * d_n) + bias[n]
// with the sum an exact int32 over all of K on every level (|sum| < K * 127 * 128), so the levels
// and tilings agree bit for bit up to the one float epilogue.
//
// Layout (packed once at load, the same for every level): N padded to a multiple of 32 and K to
// a multiple of 64 with zero codes; block b (channels 16b..16b+15) is K/4 steps of 64 bytes, step
// t holding [16 channels, 4 features 4t..4t+3] (bytes 4l..4l+3: channel 16b+l). A step is what
// one `vpdpbusd` multiplies against 4 broadcast activation bytes, and 16 consecutive steps (1 KiB)
// are exactly an AMX B tile of 16 rows x 64 bytes for 64 features: one layout serves both.
//
// Arithmetic per level:
//   AVX512-VNNI (and AVX-VNNI in the avx2 build): `vpdpbusd` takes unsigned x signed bytes: the
//     activations are stored as q + 128 (unsigned) and the weight rows' sums (packed with them)
//     take the offset back out: sum (q+128) w - 128 sum w, exact.
//   AVX2 without VNNI: `vpmaddubsw` would saturate on (q+128) x w, so GGML's sign trick: |w| (at
//     most 128, unsigned) times q carrying w's sign, at most 2 * 128 * 127 per int16 pair, widened
//     to int32 every step.
//   plain C++: int32 products and sums.
//   AMX-INT8 (inside the avx512 build, chosen at run time for many rows where the CPU has it):
//     `tdpbssd` on the signed codes, 32 rows x 32 channels per microkernel, four int32 tiles.
//     Its functions carry target("amx-tile,amx-int8") so the library still loads on an AVX-512
//     CPU without AMX (AMD EPYC), where they are never called. A call of 32 rows asks the next
//     pair of blocks into L2 as it goes (a decode step's tiles otherwise waited on memory).
//
// Tiles (the vector levels): up to kMaxRows activation rows x kTileBlocks blocks, int32
// accumulators in registers over the whole K, the weight stream read once per tile. One row (a
// decode step) streams each block front to back with a software prefetch ahead; many rows are
// walked in chunks of 128 (kept in L2) against each thread's blocks, so a tile's weights come from
// L2 for all the chunk's tiles.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_amx.h"
#include "cpu_common.h"
#include "cpu_namespace.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace TOKENLOOM_CPU_NAMESPACE {
// every helper in its own namespace: the sources build as one translation unit per level
namespace w8a8 {

constexpr int64_t kBlock = 16;      // output channels per block
constexpr int64_t kStepBytes = 64;  // one step: 16 channels x 4 features
constexpr int64_t kKAlign = 64;     // in_features padded to this (one AMX tile row of bytes)
constexpr int64_t kNAlign = 32;     // out_features padded to this (an AMX pair of blocks)
constexpr int64_t kRowChunk = 128;  // activation rows per pass over a thread's blocks (kept in L2)
constexpr int64_t kAmxRows = 16;    // rows of an AMX A tile

// x's rows quantized: codes [rows, stride] (q, or q + 128 as unsigned bytes; zero codes past K
// and in padding rows), scales [rows]. The buffers belong to the calling thread (a decode step
// makes many calls; allocations per call cost) and live until its next call.
struct QuantizedTokens {
  const uint8_t* codes;
  const float* scales;
  int64_t stride;
};

inline QuantizedTokens token_buffers(int64_t padded_rows, int64_t stride) {
  thread_local std::vector<uint8_t> code_buffer;
  thread_local std::vector<float> scale_buffer;
  code_buffer.resize(padded_rows * stride);
  scale_buffer.resize(padded_rows);
  return {code_buffer.data(), scale_buffer.data(), stride};
}

inline float row_inverse(float amax) { return amax > 0.f ? 127.f / amax : 0.f; }
inline float row_scale(float amax) { return amax * (1.f / 127.f); }

// one row: amax and codes; scalar (the generic level, and the vector levels' tails)
template <typename scalar_t>
inline float scalar_amax(const scalar_t* x, int64_t begin, int64_t end, float amax) {
  for (int64_t k = begin; k < end; ++k) amax = std::max(amax, std::fabs(static_cast<float>(x[k])));
  return amax;
}

template <typename scalar_t>
inline void scalar_codes(const scalar_t* x, uint8_t* codes, int64_t begin, int64_t end, float inverse,
                         uint8_t offset) {
  for (int64_t k = begin; k < end; ++k) {
    const float code = std::min(127.f, std::max(-127.f, std::nearbyint(static_cast<float>(x[k]) * inverse)));
    codes[k] = static_cast<uint8_t>(static_cast<int8_t>(code)) ^ offset;
  }
}

#if defined(__AVX512BW__)
inline __m512 load_x16(const float* src, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, src); }
inline __m512 load_x16(const c10::BFloat16* src, __mmask16 mask) { return load_bf16x16(src, mask); }

inline void store_out16(float* dst, __m512 value, __mmask16 mask) { _mm512_mask_storeu_ps(dst, mask, value); }
inline void store_out16(c10::BFloat16* dst, __m512 value, __mmask16 mask) {
  _mm256_mask_storeu_epi16(dst, mask, bf16_bits16(value));
}

template <typename scalar_t>
void quantize_row(const scalar_t* x, uint8_t* codes, float* scale, int64_t K, int64_t stride, uint8_t offset) {
  __m512 amax_lanes = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16)
    amax_lanes = _mm512_max_ps(amax_lanes, _mm512_abs_ps(load_x16(x + k, tail_mask(K - k))));
  const float amax = _mm512_reduce_max_ps(amax_lanes);
  const __m512 inverse = _mm512_set1_ps(row_inverse(amax));
  const __m512 limit = _mm512_set1_ps(127.f);
  const __m128i flip = _mm_set1_epi8(static_cast<char>(offset));
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = tail_mask(K - k);
    const __m512 scaled = _mm512_min_ps(limit, _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), limit),
                                                             _mm512_mul_ps(load_x16(x + k, mask), inverse)));
    const __m128i bytes = _mm_xor_si128(_mm512_cvtepi32_epi8(_mm512_cvtps_epi32(scaled)), flip);
    _mm_mask_storeu_epi8(codes + k, mask, bytes);
  }
  std::memset(codes + K, offset, stride - K);
  *scale = row_scale(amax);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

template <typename scalar_t>
void quantize_row(const scalar_t* x, uint8_t* codes, float* scale, int64_t K, int64_t stride, uint8_t offset) {
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  __m256 amax_lanes = _mm256_setzero_ps();
  const int64_t vector_end = K / 8 * 8;
  for (int64_t k = 0; k < vector_end; k += 8) amax_lanes = _mm256_max_ps(amax_lanes, _mm256_andnot_ps(sign_bit, load8(x + k)));
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(amax_lanes), _mm256_extractf128_ps(amax_lanes, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  const float amax = scalar_amax(x, vector_end, K, _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half))));
  const float inverse_value = row_inverse(amax);
  const __m256 inverse = _mm256_set1_ps(inverse_value);
  const __m256 limit = _mm256_set1_ps(127.f), negative_limit = _mm256_set1_ps(-127.f);
  for (int64_t k = 0; k < vector_end; k += 8) {
    const __m256 scaled = _mm256_min_ps(limit, _mm256_max_ps(negative_limit, _mm256_mul_ps(load8(x + k), inverse)));
    const __m256i q = _mm256_cvtps_epi32(scaled);  // to nearest even (the default rounding mode)
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    const __m128i bytes = _mm_xor_si128(_mm_packs_epi16(words, words), _mm_set1_epi8(static_cast<char>(offset)));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + k), bytes);
  }
  scalar_codes(x, codes, vector_end, K, inverse_value, offset);
  std::memset(codes + K, offset, stride - K);
  *scale = row_scale(amax);
}

#else

template <typename scalar_t>
void quantize_row(const scalar_t* x, uint8_t* codes, float* scale, int64_t K, int64_t stride, uint8_t offset) {
  const float amax = scalar_amax(x, 0, K, 0.f);
  scalar_codes(x, codes, 0, K, row_inverse(amax), offset);
  std::memset(codes + K, offset, stride - K);
  *scale = row_scale(amax);
}

#endif

// rows of x [M, K] quantized into the calling thread's buffers, padded_rows - M rows of zero codes
// after them; `offset` 128 stores q + 128 (for vpdpbusd's unsigned operand), 0 stores q
template <typename scalar_t>
QuantizedTokens quantize_tokens(const scalar_t* x, int64_t M, int64_t padded_rows, int64_t K, int64_t stride,
                                uint8_t offset) {
  const QuantizedTokens tokens = token_buffers(padded_rows, stride);
  uint8_t* codes = const_cast<uint8_t*>(tokens.codes);
  float* scales = const_cast<float*>(tokens.scales);
  at::parallel_for(0, M, std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row(x + m * K, codes + m * stride, scales + m, K, stride, offset);
  });
  if (padded_rows > M) {
    std::memset(codes + M * stride, offset, (padded_rows - M) * stride);
    std::fill(scales + M, scales + padded_rows, 0.f);
  }
  return tokens;
}

// what a tile needs besides the activations
struct PackedWeight {
  const uint8_t* codes;         // [N_padded / 16, K_padded * 16]
  const int32_t* sums;          // [N_padded]: sum_k w_nk
  const float* channel_scales;  // [N_padded]
  const float* bias;            // [N] or nullptr
  int64_t N;                    // out_features (the columns of out)
  int64_t K_padded;
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

constexpr int kMaxRows = 6;  // 6 rows x 4 blocks: 24 accumulators + 4 weight vectors + a broadcast in 32 zmm
constexpr int kTileBlocks = 4;  // blocks per tile, and per unit of parallel work
constexpr uint8_t kCodeOffset = 128;
constexpr int64_t kPrefetchSteps = 16;  // how far ahead of a decode tile each block's stream is prefetched

// acc + 4 unsigned x 4 signed bytes per lane. As an asm statement with the accumulator tied to
// its register: with the intrinsic, GCC 12 copied every accumulator of a tile to another
// register (or the stack) and back around each vpdpbusd of the K loop
inline __m512i dot_accumulate(__m512i acc, __m512i unsigned_bytes, __m512i signed_bytes) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(unsigned_bytes), "v"(signed_bytes));
  return acc;
}

// the epilogue of 16 channels from n0 of one row: float(acc) * (s_m d_n) + bias
template <typename out_t>
inline void store_channels(__m512i acc, float token_scale, const PackedWeight& w, out_t* out_row, int64_t n0) {
  if (n0 >= w.N) return;
  const __mmask16 mask = tail_mask(w.N - n0);
  const __m512 scales = _mm512_mul_ps(_mm512_loadu_ps(w.channel_scales + n0), _mm512_set1_ps(token_scale));
  __m512 value = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), scales);
  if (w.bias != nullptr) value = _mm512_add_ps(value, _mm512_maskz_loadu_ps(mask, w.bias + n0));
  store_out16(out_row + n0, value, mask);
}

// kRows rows from m0 times kBlocks blocks from b0
template <typename out_t, int kRows, int kBlocks>
void vnni_tile(const QuantizedTokens& x, const PackedWeight& w, out_t* out, int64_t m0, int64_t b0) {
  const int64_t block_bytes = w.K_padded * kBlock;
  const uint8_t* blocks[kBlocks];
  for (int b = 0; b < kBlocks; ++b) blocks[b] = w.codes + (b0 + b) * block_bytes;
  __m512i acc[kRows][kBlocks];
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm512_setzero_si512();
  const int64_t steps = w.K_padded / 4;
  for (int64_t step = 0; step < steps; ++step) {
    __m512i codes[kBlocks];
    for (int b = 0; b < kBlocks; ++b) {
      // a few rows per weight read: the loads wait on memory unless the streams are fetched ahead
      if constexpr (kRows <= 2)
        _mm_prefetch(reinterpret_cast<const char*>(blocks[b] + (step + kPrefetchSteps) * kStepBytes), _MM_HINT_T0);
      codes[b] = _mm512_loadu_si512(blocks[b] + step * kStepBytes);
    }
    for (int r = 0; r < kRows; ++r) {
      int32_t four;  // this step's 4 activation bytes of row m0 + r
      std::memcpy(&four, x.codes + (m0 + r) * x.stride + 4 * step, 4);
      const __m512i broadcast = _mm512_set1_epi32(four);
      for (int b = 0; b < kBlocks; ++b) acc[r][b] = dot_accumulate(acc[r][b], broadcast, codes[b]);
    }
  }
  for (int b = 0; b < kBlocks; ++b) {
    const int64_t n0 = (b0 + b) * kBlock;
    // take the +128 of the unsigned activations back out: 128 sum_k w_nk
    const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(w.sums + n0), 7);
    for (int r = 0; r < kRows; ++r)
      store_channels(_mm512_sub_epi32(acc[r][b], offset), x.scales[m0 + r], w, out + (m0 + r) * w.N, n0);
  }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#if defined(__AVXVNNI__)
constexpr int kMaxRows = 3;  // 3 rows x 2 blocks x 2 halves: 12 accumulators of the 16 ymm
constexpr int kTileBlocks = 2;
constexpr uint8_t kCodeOffset = 128;
#else
// the sign trick keeps |w| beside w and needs the ones and a product in registers: 4 rows x 1
// block x 2 halves (8 accumulators) fit the 16 ymm, 3 rows x 2 blocks spilled
constexpr int kMaxRows = 4;
constexpr int kTileBlocks = 1;
constexpr uint8_t kCodeOffset = 0;
#endif
constexpr int64_t kPrefetchSteps = 16;

#if defined(__AVXVNNI__)
// acc + 4 unsigned x 4 signed bytes per lane, the accumulator tied to its register (as the
// AVX-512 dot_accumulate; the signed bytes may stay in memory: 16 ymm registers hold a tile's
// 12 accumulators and the broadcast, not its 4 weight vectors as well)
inline __m256i dot_accumulate8(__m256i acc, __m256i unsigned_bytes, const __m256i& signed_bytes) {
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(unsigned_bytes), "xm"(signed_bytes));
  return acc;
}
#endif

template <typename out_t>
inline void store_channels8(__m256i acc, float token_scale, const PackedWeight& w, out_t* out_row, int64_t n0) {
  if (n0 >= w.N) return;
  const __m256 scales = _mm256_mul_ps(_mm256_loadu_ps(w.channel_scales + n0), _mm256_set1_ps(token_scale));
  __m256 value = _mm256_mul_ps(_mm256_cvtepi32_ps(acc), scales);
  if (n0 + 8 <= w.N) {
    if (w.bias != nullptr) value = _mm256_add_ps(value, _mm256_loadu_ps(w.bias + n0));
    store8(out_row + n0, value);
  } else {
    float lanes[8];
    _mm256_storeu_ps(lanes, value);
    for (int64_t n = n0; n < w.N; ++n) {
      const float with_bias = lanes[n - n0] + (w.bias != nullptr ? w.bias[n] : 0.f);
      store_row(&with_bias, out_row + n, 1);
    }
  }
}

template <typename out_t, int kRows, int kBlocks>
void vnni_tile(const QuantizedTokens& x, const PackedWeight& w, out_t* out, int64_t m0, int64_t b0) {
  const int64_t block_bytes = w.K_padded * kBlock;
  const uint8_t* blocks[kBlocks];
  for (int b = 0; b < kBlocks; ++b) blocks[b] = w.codes + (b0 + b) * block_bytes;
  __m256i acc[kRows][kBlocks][2];
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_si256();
#if !defined(__AVXVNNI__)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  const int64_t steps = w.K_padded / 4;
  for (int64_t step = 0; step < steps; ++step) {
    __m256i codes[kBlocks][2];
#if !defined(__AVXVNNI__)
    __m256i magnitudes[kBlocks][2];
#endif
    for (int b = 0; b < kBlocks; ++b) {
      if constexpr (kRows == 1)
        _mm_prefetch(reinterpret_cast<const char*>(blocks[b] + (step + kPrefetchSteps) * kStepBytes), _MM_HINT_T0);
      for (int half = 0; half < 2; ++half) {
        codes[b][half] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blocks[b] + step * kStepBytes + 32 * half));
#if !defined(__AVXVNNI__)
        magnitudes[b][half] = _mm256_abs_epi8(codes[b][half]);  // at most 128: unsigned
#endif
      }
    }
    for (int r = 0; r < kRows; ++r) {
      int32_t four;
      std::memcpy(&four, x.codes + (m0 + r) * x.stride + 4 * step, 4);
      const __m256i broadcast = _mm256_set1_epi32(four);
      for (int b = 0; b < kBlocks; ++b)
        for (int half = 0; half < 2; ++half) {
#if defined(__AVXVNNI__)
          acc[r][b][half] = dot_accumulate8(acc[r][b][half], broadcast, codes[b][half]);
#else
          // |w| times q with w's sign: at most 2 * 128 * 127 per int16 pair, no saturation
          const __m256i pairs = _mm256_maddubs_epi16(magnitudes[b][half], _mm256_sign_epi8(broadcast, codes[b][half]));
          acc[r][b][half] = _mm256_add_epi32(acc[r][b][half], _mm256_madd_epi16(pairs, ones));
#endif
        }
    }
  }
  for (int b = 0; b < kBlocks; ++b)
    for (int half = 0; half < 2; ++half) {
      const int64_t n0 = (b0 + b) * kBlock + 8 * half;
#if defined(__AVXVNNI__)
      const __m256i offset =
          _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.sums + n0)), 7);
#else
      const __m256i offset = _mm256_setzero_si256();
#endif
      for (int r = 0; r < kRows; ++r)
        store_channels8(_mm256_sub_epi32(acc[r][b][half], offset), x.scales[m0 + r], w, out + (m0 + r) * w.N, n0);
    }
}

#else  // plain C++: the same integers, left to the compiler (ARM, x86 below AVX2)

constexpr int kMaxRows = 4;
constexpr int kTileBlocks = 1;
constexpr uint8_t kCodeOffset = 0;

template <typename out_t, int kRows, int kBlocks>
void vnni_tile(const QuantizedTokens& x, const PackedWeight& w, out_t* out, int64_t m0, int64_t b0) {
  static_assert(kBlocks == 1, "one block per tile");
  const int8_t* block = reinterpret_cast<const int8_t*>(w.codes + b0 * w.K_padded * kBlock);
  int32_t acc[kRows][kBlock] = {};
  const int64_t steps = w.K_padded / 4;
  for (int64_t step = 0; step < steps; ++step) {
    const int8_t* codes = block + step * kStepBytes;
    for (int r = 0; r < kRows; ++r) {
      const int8_t* row = reinterpret_cast<const int8_t*>(x.codes + (m0 + r) * x.stride + 4 * step);
      for (int lane = 0; lane < kBlock; ++lane)
        for (int j = 0; j < 4; ++j) acc[r][lane] += static_cast<int32_t>(codes[4 * lane + j]) * row[j];
    }
  }
  const int64_t n0 = b0 * kBlock;
  for (int r = 0; r < kRows; ++r)
    for (int lane = 0; lane < kBlock && n0 + lane < w.N; ++lane) {
      const int64_t n = n0 + lane;
      float value = static_cast<float>(acc[r][lane]) * (w.channel_scales[n] * x.scales[m0 + r]);
      if (w.bias != nullptr) value += w.bias[n];
      store_row(&value, out + (m0 + r) * w.N + n, 1);
    }
}

#endif

// vnni_tile<out_t, kRows, kBlocks> for kRows = 1..kMaxRows, indexed by kRows
template <typename out_t, int kBlocks, int... kRows>
constexpr auto tile_table(std::integer_sequence<int, kRows...>) {
  using Tile = void (*)(const QuantizedTokens&, const PackedWeight&, out_t*, int64_t, int64_t);
  return std::array<Tile, sizeof...(kRows) + 1>{nullptr, &vnni_tile<out_t, kRows + 1, kBlocks>...};
}

// rows [m_begin, m_end) times kBlocks blocks from b0, in as few tiles as kMaxRows allows, of sizes
// that differ by at most one
template <typename out_t, int kBlocks>
void rows_times_blocks(const QuantizedTokens& x, const PackedWeight& w, out_t* out, int64_t m_begin, int64_t m_end,
                       int64_t b0) {
  static constexpr auto tiles = tile_table<out_t, kBlocks>(std::make_integer_sequence<int, kMaxRows>());
  for (int64_t m = m_begin; m < m_end;) {
    const int64_t left = m_end - m, tiles_left = (left + kMaxRows - 1) / kMaxRows;
    const int64_t rows = (left + tiles_left - 1) / tiles_left;
    tiles[rows](x, w, out, m, b0);
    m += rows;
  }
}

template <typename out_t, int... kBlocks>
constexpr auto block_table(std::integer_sequence<int, kBlocks...>) {
  using Rows = void (*)(const QuantizedTokens&, const PackedWeight&, out_t*, int64_t, int64_t, int64_t);
  return std::array<Rows, sizeof...(kBlocks) + 1>{nullptr, &rows_times_blocks<out_t, kBlocks + 1>...};
}

template <typename in_t, typename out_t>
void vector_linear(const in_t* x, const PackedWeight& w, out_t* out, int64_t M, int64_t K) {
  const QuantizedTokens tokens = quantize_tokens(x, M, M, K, w.K_padded, kCodeOffset);
  static constexpr auto by_blocks = block_table<out_t>(std::make_integer_sequence<int, kTileBlocks>());
  // only blocks holding some of the N outputs (the padding to 32 may add an empty one)
  const int64_t blocks = (w.N + kBlock - 1) / kBlock;
  // each thread an even share of the blocks (576 outputs are 36 blocks: 18 and 18 on 2 threads,
  // where units of 4 blocks split 5 + 4), walked in tiles of kTileBlocks and a narrower last one
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = 0; m < M; m += kRowChunk) {
      const int64_t m_end = std::min(M, m + kRowChunk);
      for (int64_t b0 = begin; b0 < end; b0 += kTileBlocks)
        by_blocks[std::min<int64_t>(kTileBlocks, end - b0)](tokens, w, out, m, m_end, b0);
    }
  });
}

#if defined(TOKENLOOM_AMX_BUILD)

// tiles 0-3: int32 results [16 rows, 16 channels]; 4-5: activation codes [16 rows, 64 features];
// 6-7: weight steps [16 steps, 16 channels x 4 features]: every tile 16 rows of 64 bytes
inline void configure_tiles() {
  static constexpr uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
  static constexpr uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
  amx_configure(rows, colsb);
}

// 16 kRowTiles rows from m0 times 16 kBlocks channels from block b0: int32 tiles, stored to
// results [kRowTiles * 16, kBlocks * 16]. `next` (or nullptr): the kBlocks blocks the caller
// works on next, asked into L2 a step's worth of lines per step, so that their tile loads do not
// wait on memory: a pair of blocks is one microkernel call for up to 32 rows (a decode step),
// and without it each call's first loads found its weights in memory and the tiles waited.
template <int kRowTiles, int kBlocks>
__attribute__((target("amx-tile,amx-int8"))) void amx_microkernel(const QuantizedTokens& x, const PackedWeight& w,
                                                                  int64_t m0, int64_t b0, int32_t* results,
                                                                  const uint8_t* next) {
  asm volatile("" ::: "memory");
  _tile_zero(0);
  if constexpr (kBlocks == 2) _tile_zero(1);
  if constexpr (kRowTiles == 2) _tile_zero(2);
  if constexpr (kRowTiles == 2 && kBlocks == 2) _tile_zero(3);
  const int64_t block_bytes = w.K_padded * kBlock;
  const uint8_t* a0 = x.codes + m0 * x.stride;
  const uint8_t* a1 = a0 + kAmxRows * x.stride;
  const uint8_t* w0 = w.codes + b0 * block_bytes;
  const uint8_t* w1 = w0 + block_bytes;
  for (int64_t k = 0; k < w.K_padded; k += 64) {
    if (next != nullptr) {
      // the same 1 KiB of each next block as this step reads of its own (16 steps x 64 bytes)
      for (int b = 0; b < kBlocks; ++b)
        for (int64_t line = 0; line < kBlock * kStepBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(next + b * block_bytes + k * kBlock + line), _MM_HINT_T1);
    }
    _tile_loadd(4, a0 + k, x.stride);
    _tile_loadd(6, w0 + k * kBlock, 64);
    _tile_dpbssd(0, 4, 6);
    if constexpr (kBlocks == 2) {
      _tile_loadd(7, w1 + k * kBlock, 64);
      _tile_dpbssd(1, 4, 7);
    }
    if constexpr (kRowTiles == 2) {
      _tile_loadd(5, a1 + k, x.stride);
      _tile_dpbssd(2, 5, 6);
      if constexpr (kBlocks == 2) _tile_dpbssd(3, 5, 7);
    }
  }
  const int64_t stride = kBlocks * kBlock * sizeof(int32_t);
  // (the tile instructions are asm statements without a memory clobber: fence the compiler's
  // own reads and writes around them)
  asm volatile("" ::: "memory");
  _tile_stored(0, results, stride);
  if constexpr (kBlocks == 2) _tile_stored(1, results + kBlock, stride);
  if constexpr (kRowTiles == 2) _tile_stored(2, results + kAmxRows * kBlocks * kBlock, stride);
  if constexpr (kRowTiles == 2 && kBlocks == 2) _tile_stored(3, results + kAmxRows * kBlocks * kBlock + kBlock, stride);
  asm volatile("" ::: "memory");
}

template <typename in_t, typename out_t>
void amx_linear(const in_t* x, const PackedWeight& w, out_t* out, int64_t M, int64_t K) {
  const int64_t padded_rows = (M + kAmxRows - 1) / kAmxRows * kAmxRows;
  const QuantizedTokens tokens = quantize_tokens(x, M, padded_rows, K, w.K_padded, 0);
  const int64_t blocks = (w.N + kBlock - 1) / kBlock;
  const int64_t pairs = (blocks + 1) / 2;  // the packed N is a multiple of 32: a pair's second block exists
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();  // tile state is per thread
    alignas(64) int32_t results[2 * kAmxRows * 2 * kBlock];
    for (int64_t m = 0; m < padded_rows; m += kRowChunk) {
      const int64_t m_end = std::min(padded_rows, m + kRowChunk);
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t b0 = 2 * pair;
        // the thread's next pair comes in while this one's first rows are worked on (later rows
        // and chunks find this pair in the caches); not under one row tile (8-16 rows), whose
        // two tdpbssd a step left the prefetches no time to pay for themselves (3% slower)
        const uint8_t* next_pair = pair + 1 < end ? w.codes + (b0 + 2) * w.K_padded * kBlock : nullptr;
        for (int64_t m0 = m; m0 < m_end; m0 += 2 * kAmxRows) {
          const bool two_rows = m0 + kAmxRows < m_end;
          const uint8_t* next = m0 == m && two_rows ? next_pair : nullptr;
          if (two_rows)
            amx_microkernel<2, 2>(tokens, w, m0, b0, results, next);
          else
            amx_microkernel<1, 2>(tokens, w, m0, b0, results, next);
          const int64_t rows = std::min<int64_t>(M - m0, two_rows ? 2 * kAmxRows : kAmxRows);
          for (int64_t r = 0; r < rows; ++r)
            for (int b = 0; b < 2; ++b)
              store_channels(_mm512_load_si512(results + r * 2 * kBlock + b * kBlock), tokens.scales[m0 + r], w,
                             out + (m0 + r) * w.N, (b0 + b) * kBlock);
        }
      }
    }
    amx_release();
  });
}

#endif

template <typename in_t, typename out_t>
void linear(const in_t* x, const PackedWeight& w, out_t* out, int64_t M, int64_t K, int64_t amx_min_rows) {
#if defined(TOKENLOOM_AMX_BUILD)
  if (amx_min_rows > 0 && M >= amx_min_rows && amx_usable()) return amx_linear(x, w, out, M, K);
#endif
  (void)amx_min_rows;
  vector_linear(x, w, out, M, K);
}

}  // namespace w8a8

// x [M, K] bfloat16 or float32 (contiguous); weight packed by w8a8_matmul.pack_w8a8; weight_sums
// int32 and channel_scales float32 [N padded]; bias float32 [N] or None. AMX (where the CPU has
// it) for M >= amx_min_rows; amx_min_rows <= 0: never. out [M, N] in x's dtype, or float32.
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_sums,
                       const at::Tensor& channel_scales, const c10::optional<at::Tensor>& bias, int64_t out_features,
                       bool float_out, int64_t amx_min_rows) {
  using namespace w8a8;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "w8a8_linear: x must be a contiguous [rows, in_features] bfloat16 or float32 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t K_padded = (K + kKAlign - 1) / kKAlign * kKAlign;
  const int64_t N = out_features, N_padded = (N + kNAlign - 1) / kNAlign * kNAlign;
  TORCH_CHECK(K > 0 && N > 0, "w8a8_linear: empty weight");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() && weight.dim() == 2 &&
                  weight.size(0) == N_padded / kBlock && weight.size(1) == K_padded * kBlock,
              "w8a8_linear: weight must be a contiguous [", N_padded / kBlock, ", ", K_padded * kBlock,
              "] uint8 tensor (pack_w8a8's layout)");
  TORCH_CHECK(weight_sums.scalar_type() == at::kInt && weight_sums.is_contiguous() && weight_sums.numel() == N_padded,
              "w8a8_linear: weight_sums must be ", N_padded, " contiguous int32");
  TORCH_CHECK(channel_scales.scalar_type() == at::kFloat && channel_scales.is_contiguous() &&
                  channel_scales.numel() == N_padded,
              "w8a8_linear: channel_scales must be ", N_padded, " contiguous float32");
  const float* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "w8a8_linear: bias must be ", N, " contiguous float32");
    bias_data = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  if (M == 0) return out;
  const PackedWeight packed{weight.data_ptr<uint8_t>(), weight_sums.data_ptr<int32_t>(),
                            channel_scales.data_ptr<float>(), bias_data, N, K_padded};
  if (x.scalar_type() == at::kFloat)
    linear(x.data_ptr<float>(), packed, out.data_ptr<float>(), M, K, amx_min_rows);
  else if (float_out)
    linear(x.data_ptr<c10::BFloat16>(), packed, out.data_ptr<float>(), M, K, amx_min_rows);
  else
    linear(x.data_ptr<c10::BFloat16>(), packed, out.data_ptr<c10::BFloat16>(), M, K, amx_min_rows);
  return out;
}

// whether w8a8_linear can take its AMX-INT8 path in this process (this build, CPU and kernel)
bool w8a8_amx_available() { return amx_usable(); }

}  // namespace TOKENLOOM_CPU_NAMESPACE

TOKENLOOM_LIBRARY_FRAGMENT(m) {
  m.def(
      "w8a8_linear(Tensor x, Tensor weight, Tensor weight_sums, Tensor channel_scales, Tensor? bias, "
      "int out_features, bool float_out, int amx_min_rows) -> Tensor");
  // no tensor argument to dispatch on: one kernel for every dispatch key
  m.def("w8a8_amx_available() -> bool", &TOKENLOOM_CPU_NAMESPACE::w8a8_amx_available);
}

TOKENLOOM_LIBRARY_IMPL_CPU(m) { m.impl("w8a8_linear", &TOKENLOOM_CPU_NAMESPACE::w8a8_linear); }
