// Quantized weights times 8-bit activations, GGML's Q4 x Q8 and Q8 x Q8 arithmetic (as llama.cpp
// runs a GGUF on the CPU), for any number of rows, in every build (one per ISA level, see
// cpu_namespace.h): AVX512-VNNI, AVX2+FMA+F16C, and plain C++ below them.
//   `int4_linear`: 4-bit weights (GGUF Q4_0/Q4_1/Q4_K linear layers), out in x's dtype
//   `int8_linear`: 8-bit weights (a Q8_0 LM head), float32 out (the logits)
// The Python side (tokenloom/kernels/int4_matmul.py, int8_matmul.py) packs the weights, the same
// layout for every level; its `quantize_activations` and `dequantize_int4` / `dequantize_int8` are
// the reference the tests hold these kernels to.
//
// A weight value is d * code + m with an unsigned code (4-bit: 0..15; 8-bit: Q8_0's signed code
// plus 128, so m = -128 d) and one (d, m) pair per group of 32 input features. Each row of x is
// quantized per group of 32 the same way: its scale is s = max|x| / 127 and its codes
// q = round(x * (127 / max|x|)) (to nearest even; all zero for a zero group), so that
//   sum_k w_k x_k ~ sum_groups [ d * s * sum_k code_k q_k + m * s * sum_k q_k ]
// in which the inner sums are exact integers, on every level (so the levels agree up to float32
// summation order). For 8-bit weights the m term is taken in integers (sum_k (code_k - 128) q_k),
// so their result is exact up to float32 summation.
//   AVX512-VNNI: `vpdpbusd`, 16 lanes of 4 unsigned-code times signed-activation products each.
//   AVX2: `vpmaddubsw` (pairs of u8 x s8 products summed to int16, saturating) then `vpmaddwd`
//   against ones (int16 pairs to int32). 4-bit codes times 7-bit activations stay below 2 * 15 *
//   127 per pair, so a group's 8 steps sum in int16 (at most 30480) before one widening; 8-bit
//   codes would saturate (2 * 255 * 127), so they take GGML's sign trick: the signed code
//   c = code ^ 0x80, |c| (at most 128, unsigned) times q carrying c's sign (at most 2 * 128 * 127
//   per pair), widened every step.
//   AVX2 + AVX-VNNI (built with -mavxvnni where the host has it): 256-bit `vpdpbusd`, the 8-bit
//   codes as AVX-512 takes them; the same integers.
//   AMX-INT8 (inside the avx512 build, 4-bit weights, from kInt4AmxMinRows rows where the CPU has
//   it; TOKENLOOM_CPU_AMX=0 keeps it off, cpu_amx.h): `tdpbsud` forms each group's integer sums
//   for 16 or 32 rows x 2 blocks, then the VNNI tile's float operations: the same bits.
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
// (masked and shifted, for 4 bits) gives the codes of 16 rows times 4 features (AVX2: each
// 32-byte half the codes of 8 rows).
//
// Tiles: up to kMaxTileRows activation rows (AVX-512: 6, AVX2 and plain C++: 4) times a pair of
// blocks. On AVX-512 M rows take as few tiles as that allows, of sizes that differ by at most one
// (5 rows one tile, 9 rows 5 + 4: a speculative verify step's 2-9 rows read the weights once or
// twice), and the tile prefetches the 4-bit weight stream a few groups ahead; the other levels
// take full tiles and the 1-3 rows left. AVX-512, 4-bit, 1 to kMaxStreamRows rows (a decode step
// of up to 8 sequences): one tile over two pairs at once, each thread reading two streams of its
// pairs (for_each_pair_in_two_streams, cpu_qlinear.h). Each output's float accumulation runs over the groups
// in order, the same operations whatever the tile's size, so M rows at once give every row the
// bits it gets alone (tested).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_amx.h"
#include "cpu_amx_bf16.h"
#include "cpu_common.h"
#include "cpu_ops.h"
#include "cpu_qlinear.h"

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

// one block's codes of one group, and with its scales
template <int kBits> constexpr int64_t kCodeBytes = kBlockRows * kGroup * kBits / 8;
template <int kBits> constexpr int64_t kGroupBytes = kBits == 4 ? 320 : 576;

// a tile's place among the tiles that run over one block pair: tile `tile` of `tiles`
struct PairTile {
  int64_t tile, tiles;
};

// (buffers kept per calling thread: a decode step makes 120 calls, and three tensor allocations
// a call cost a third of a millisecond a step; pointers taken in the calling thread: in the
// worker threads these names are their own, empty, buffers. The codes run kAmxRowSlack rows past
// the last: an AMX tile reads 16 or 32 rows whatever the rows left, and drops the extra results)
inline QuantizedRows quantized_rows_buffers(int64_t M, int64_t K) {
  thread_local std::vector<int8_t> code_buffer;
  thread_local std::vector<float> scale_buffer, scaled_sum_buffer;
  thread_local std::vector<int32_t> code_sum_buffer;
  const int64_t groups = K / kGroup;
  code_buffer.resize((M + kAmxRowSlack) * K);
  scale_buffer.resize(M * groups);
  scaled_sum_buffer.resize(M * groups);
  code_sum_buffer.resize(M * groups);
  return {code_buffer.data(), scale_buffer.data(), code_sum_buffer.data(), scaled_sum_buffer.data(), groups};
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

// activation rows per tile, at most: 6 rows x 2 blocks keep 12 accumulators and 12 integer sums
// in the 32 zmm registers, so 2 to 6 rows read the weights once and 7 to 12 twice (8-bit weights,
// and 4-bit ones from kMaxStreamRows + 1 rows)
constexpr int kMaxTileRows = 6;
constexpr bool kBalancedTiles = true;  // see qlinear_rows
constexpr int64_t kPrefetchGroups = 4;  // how far ahead of the tile the 4-bit weight stream is prefetched
// 4-bit: batches of 2 to this many rows take one two-stream tile (int4_two_stream_rows_tile); with
// more, its float accumulators on the stack cost more than a second read of the pairs from L2
// saves (12 and 32 rows 10-30 % slower than kMaxTileRows' tiles), and from 16 rows AMX takes them
// where the CPU has it
constexpr int kMaxStreamRows = 8;
// rows from which the 4-bit matmul takes AMX where the CPU has it: from 16 rows AMX was 1.15-1.4x
// the VNNI tile on 1.7B shapes (one thread), at 8 rows 0.8x (an A tile of 16 rows half padding)
constexpr int64_t kInt4AmxMinRows = 16;

inline __m512 load16(const c10::BFloat16* src) { return load_bf16x16(src, 0xFFFF); }
inline __m512 load16(const float* src) { return _mm512_loadu_ps(src); }

inline void store16(float* dst, __m512 value) { _mm512_storeu_ps(dst, value); }
inline void store16(c10::BFloat16* dst, __m512 value) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bf16_bits16(value));
}

// acc + one 4-bit group of 16 outputs for an activation row: d s (integer sums) + m (s A), the
// operations every AVX-512 tile (VNNI and AMX) takes in this order, so any tile gives a row its bits
inline __m512 add_int4_group(__m512 acc, __m512 group_sums, __m512 d, __m512 m, float scale, float scaled_sum) {
  acc = _mm512_fmadd_ps(group_sums, _mm512_mul_ps(d, _mm512_set1_ps(scale)), acc);
  return _mm512_fmadd_ps(m, _mm512_set1_ps(scaled_sum), acc);
}

template <typename scalar_t>
QuantizedRows quantize_activations(const scalar_t* x, int64_t M, int64_t K) {
  const QuantizedRows rows = quantized_rows_buffers(M, K);
  const int64_t groups = rows.groups;
  int8_t* codes = const_cast<int8_t*>(rows.codes);
  float* scales = const_cast<float*>(rows.scales);
  float* scaled_sums = const_cast<float*>(rows.scaled_sums);
  int32_t* code_sums = const_cast<int32_t*>(rows.code_sums);
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
  return rows;
}

// kRows activation rows from m0 times kStreams runs of kBlocks blocks, run s from b0s[s]:
// out[m0.., 16 b0s[s]..]. Each run is one stream of the weight (a pair of blocks, or an odd last
// block); one row's tiles read two full pairs at once (for_each_pair_in_two_streams, cpu_qlinear.h).
template <int kBits, typename out_t, int kRows, int kBlocks, int kStreams>
inline void qlinear_streams_tile(const QuantizedRows& x, const uint8_t* weight, out_t* out, int64_t m0,
                                 const int64_t* b0s, int64_t N, int64_t K, [[maybe_unused]] PairTile place) {
  static_assert(kStreams == 1 || kBlocks == 2, "several streams are full pairs");
  constexpr int kAll = kStreams * kBlocks;
  const int64_t groups = x.groups;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  __m512 acc[kRows][kAll];
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kAll; ++b) acc[r][b] = _mm512_setzero_ps();
  // blocks are stored in pairs (b0 is even), group by group (the pair's two groups g side by
  // side: one stream for a tile of the pair), an odd last block alone
  const uint8_t* pair_start[kStreams];
  for (int s = 0; s < kStreams; ++s) pair_start[s] = weight + b0s[s] * groups * kGroupBytes<kBits>;
  const int64_t width = b0s[0] + 1 < N / kBlockRows ? 2 : 1;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group[kAll];
    for (int s = 0; s < kStreams; ++s)
      for (int b = 0; b < kBlocks; ++b)
        group[s * kBlocks + b] = pair_start[s] + (g * width + b) * kGroupBytes<kBits>;
    // 4-bit codes: the hardware prefetcher alone leaves the stream's loads waiting on memory (or
    // L3) between the tile's dot products; reading kPrefetchGroups groups ahead (past the pair's
    // end: the next pair's stream, which this thread reads next) overlaps them. (The 8-bit head,
    // whose groups are nearly twice the bytes, measured a little slower with it.)
    // When several tiles run over the pair (9 rows and more: 2-8 take int4_two_stream_rows_tile),
    // the first reads the stream from memory and the others from L2, so memory idled while they
    // ran: each tile also asks for its share of the next pair's stream into L2 (tile t of n, at group g:
    // bytes (t G + g) / n of it), spreading the next pair's reads over all of this pair's
    // tiles. A 1.7B model's 8-row step, weights from memory: its Q4_K layers 56.8 -> 48.5 ms, the
    // step 102 -> 94 ms (alternated). (With the weights in L3, a few copies of a layer, it
    // measured ~10 % slower: no model that fits there is slow at 8 rows.)
    if constexpr (kBits == 4) {
      for (int s = 0; s < kStreams; ++s)
        for (int64_t line = 0; line < kBlocks * kGroupBytes<kBits>; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(group[s * kBlocks] + kPrefetchGroups * width * kGroupBytes<kBits> +
                                                     line),
                       _MM_HINT_T0);
      if (kStreams == 1 && place.tiles > 1) {
        const int64_t stream_bytes = width * kGroupBytes<kBits>;
        const uint8_t* next_pair = pair_start[0] + groups * stream_bytes;
        const int64_t from = (place.tile * groups + g) * stream_bytes / place.tiles;
        const int64_t to = from + stream_bytes / place.tiles;
        for (int64_t line = from & ~int64_t{63}; line < to; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(next_pair + line), _MM_HINT_T1);
      }
    }
    __m512i sums[kRows][kAll];
    for (int r = 0; r < kRows; ++r)
      for (int b = 0; b < kAll; ++b) sums[r][b] = _mm512_setzero_si512();
    // steps of 4 features: two per 64-byte load of 4-bit codes, one per load of 8-bit codes
    constexpr int kStepsPerLoad = kBits == 4 ? 2 : 1;
    for (int step = 0; step < 8; step += kStepsPerLoad) {
      __m512i codes[kAll][kStepsPerLoad];
      for (int b = 0; b < kAll; ++b) {
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
          for (int b = 0; b < kAll; ++b) sums[r][b] = _mm512_dpbusd_epi32(sums[r][b], codes[b][half], broadcast);
        }
      }
    }
    for (int b = 0; b < kAll; ++b) {
      const uint8_t* scales = group[b] + kCodeBytes<kBits>;
      if constexpr (kBits == 4) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32)));
        for (int r = 0; r < kRows; ++r) {
          const int64_t index = (m0 + r) * groups + g;
          acc[r][b] = add_int4_group(acc[r][b], _mm512_cvtepi32_ps(sums[r][b]), d, m, x.scales[index],
                                     x.scaled_sums[index]);
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
    for (int s = 0; s < kStreams; ++s)
      for (int b = 0; b < kBlocks; ++b)
        store16(out + (m0 + r) * N + (b0s[s] + b) * kBlockRows, acc[r][s * kBlocks + b]);
}

// 4-bit, 2 to kMaxStreamRows activation rows from m0 times two full pairs from b0s[0] and
// b0s[1], read as two streams at once as one row's tile reads them (for_each_pair_in_two_streams):
// a few rows' tile needs memory's reads in flight as much as one row's does, and one stream
// leaves a core waiting on them between its dot products (a 1.7B model's Q4_K layers at 4 and 8
// rows, weights from memory: see qlinear). The four blocks are taken one after another within a
// group, so one block's kRows integer sums are live at a time; the kRows x 4 float accumulators
// are left to the compiler (registers, or the stack past 4 rows). Each output gets the float
// operations of qlinear_streams_tile in their order, so the same bits.
template <typename out_t, int kRows>
inline void int4_two_stream_rows_tile(const QuantizedRows& x, const uint8_t* weight, out_t* out, int64_t m0,
                                      const int64_t* b0s, int64_t N, int64_t K) {
  constexpr int kAll = 4;  // two pairs
  constexpr int64_t kPairGroupBytes = 2 * kGroupBytes<4>;
  const int64_t groups = x.groups;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  __m512 acc[kRows][kAll];
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kAll; ++b) acc[r][b] = _mm512_setzero_ps();
  const uint8_t* pair_start[2] = {weight + b0s[0] * groups * kGroupBytes<4>, weight + b0s[1] * groups * kGroupBytes<4>};
  for (int64_t g = 0; g < groups; ++g) {
    for (int s = 0; s < 2; ++s)
      for (int64_t line = 0; line < kPairGroupBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(pair_start[s] + (g + kPrefetchGroups) * kPairGroupBytes + line),
                     _MM_HINT_T0);
    for (int b = 0; b < kAll; ++b) {
      const uint8_t* group = pair_start[b / 2] + g * kPairGroupBytes + (b % 2) * kGroupBytes<4>;
      __m512i sums[kRows];
      for (int r = 0; r < kRows; ++r) sums[r] = _mm512_setzero_si512();
      for (int t = 0; t < 4; ++t) {  // 64 bytes t: features 8t..8t+3 in the low nibbles, 8t+4.. in the high
        const __m512i bytes = _mm512_loadu_si512(group + t * 64);
        const __m512i low = _mm512_and_si512(bytes, low_nibbles);
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
        for (int r = 0; r < kRows; ++r) {
          const int8_t* row = x.codes + (m0 + r) * K + g * kGroup + t * 8;
          int32_t four_low, four_high;
          std::memcpy(&four_low, row, 4);
          std::memcpy(&four_high, row + 4, 4);
          sums[r] = _mm512_dpbusd_epi32(sums[r], low, _mm512_set1_epi32(four_low));
          sums[r] = _mm512_dpbusd_epi32(sums[r], high, _mm512_set1_epi32(four_high));
        }
      }
      const uint8_t* scales = group + kCodeBytes<4>;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32)));
      for (int r = 0; r < kRows; ++r) {
        const int64_t index = (m0 + r) * groups + g;
        acc[r][b] = add_int4_group(acc[r][b], _mm512_cvtepi32_ps(sums[r]), d, m, x.scales[index], x.scaled_sums[index]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kAll; ++b) store16(out + (m0 + r) * N + (b0s[b / 2] + b % 2) * kBlockRows, acc[r][b]);
}

// int4_two_stream_rows_tile<out_t, kRows> for kRows = 1..kMaxStreamRows, indexed by kRows
template <typename out_t, int... kRows>
constexpr auto two_stream_tile_table(std::integer_sequence<int, kRows...>) {
  using Tile = void (*)(const QuantizedRows&, const uint8_t*, out_t*, int64_t, const int64_t*, int64_t, int64_t);
  return std::array<Tile, sizeof...(kRows) + 1>{nullptr, &int4_two_stream_rows_tile<out_t, kRows + 1>...};
}

// kRows activation rows from m0 times kBlocks blocks from b0: out[m0.., 16 b0..]
template <int kBits, typename out_t, int kRows, int kBlocks>
inline void qlinear_tile(const QuantizedRows& x, const uint8_t* weight, out_t* out, int64_t m0, int64_t b0,
                         int64_t N, int64_t K, PairTile place) {
  qlinear_streams_tile<kBits, out_t, kRows, kBlocks, 1>(x, weight, out, m0, &b0, N, K, place);
}

#if defined(TOKENLOOM_AMX_BUILD)

// AMX-INT8, for many rows (from kInt4AmxMinRows, where the CPU has it): a block's group of 4-bit
// codes, unpacked from its nibbles, is exactly an AMX B tile of 8 rows x 64 bytes (row t: step t,
// 16 outputs x 4 features), and 16 rows' activation codes of the group an A tile of 16 rows x 32
// bytes (read in place: x.codes, stride K; the buffer has kAmxRowSlack rows past the last, whose
// results are dropped). `tdpbsud` (signed activations x unsigned codes) forms the int32 sums the
// VNNI tile forms; they are stored kAmxGroups groups at a time, then scaled into each output's
// float accumulator with the VNNI tile's operations in its order, so a row gets the bits the VNNI
// tile gives it (tested). The gain is bounded by that scaling: every 32 features each int32 tile
// is stored and read back, and its 16 rows take the four vector operations per 16 outputs the
// VNNI tile also takes; the tile's integer products are what AMX saves (8 `vpdpbusd` per row and
// 16 outputs). Tried and measured no faster: A tiles repacked contiguous, runs of groups formed
// while the previous run is scaled, one group's B tiles shared by 128 rows.
constexpr int64_t kAmxTileRows = 16;  // rows of an A tile
// groups whose int32 tiles are formed before they are scaled: 1 and 2 measured alike, 4 a little
// and 8 much slower (256 rows x [2048 -> 8192], one thread)
constexpr int64_t kAmxGroups = 2;

// tiles 0-3: int32 sums [16 rows, 16 outputs] (row tile i's block b: 2 i + b); 4-5: activation
// codes [16 rows, 32 features]; 6-7: a block's codes [8 steps, 16 outputs x 4 features]
__attribute__((target("amx-tile"))) inline void int4_amx_configure() {
  static constexpr uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 8, 8};
  static constexpr uint16_t colsb[8] = {64, 64, 64, 64, 32, 32, 64, 64};
  amx_configure(rows, colsb);
}

// rows [m0, m0 + rows) (at most 16 kRowTiles; the tiles read 16 kRowTiles) times kBlocks blocks
// from b0 (even): out[m0.., 16 b0..]
template <typename out_t, int kRowTiles, int kBlocks>
__attribute__((target("amx-tile,amx-int8"))) void int4_amx_tile(const QuantizedRows& x, const uint8_t* weight,
                                                                 out_t* out, int64_t m0, int64_t rows, int64_t b0,
                                                                 int64_t N, int64_t K) {
  constexpr int64_t kWidth = kBlocks * kBlockRows;
  constexpr int64_t kTileRows = kRowTiles * kAmxTileRows;
  const int64_t groups = x.groups;
  const uint8_t* pair_start = weight + b0 * groups * kGroupBytes<4>;
  const int64_t width = b0 + 1 < N / kBlockRows ? 2 : 1;
  alignas(64) int32_t sums[kAmxGroups][kTileRows][kWidth];
  alignas(64) uint8_t codes[kBlocks][8 * 64];
  alignas(64) float acc[kTileRows][kWidth];
  __m512 d[kAmxGroups][kBlocks], m[kAmxGroups][kBlocks];
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  for (int64_t r = 0; r < rows; ++r)
    for (int b = 0; b < kBlocks; ++b) _mm512_store_ps(acc[r] + b * kBlockRows, _mm512_setzero_ps());
  const int8_t* a0 = x.codes + m0 * K;
  for (int64_t g0 = 0; g0 < groups; g0 += kAmxGroups) {
    const int64_t chunk = std::min(kAmxGroups, groups - g0);
    for (int64_t gi = 0; gi < chunk; ++gi) {
      const int64_t g = g0 + gi;
      for (int b = 0; b < kBlocks; ++b) {
        const uint8_t* group = pair_start + (g * width + b) * kGroupBytes<4>;
        for (int t = 0; t < 4; ++t) {  // 64 bytes t: step 2t in the low nibbles, 2t+1 in the high
          const __m512i bytes = _mm512_loadu_si512(group + t * 64);
          _mm512_store_si512(codes[b] + 2 * t * 64, _mm512_and_si512(bytes, low_nibbles));
          _mm512_store_si512(codes[b] + (2 * t + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles));
        }
        d[gi][b] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + kCodeBytes<4>)));
        m[gi][b] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + kCodeBytes<4> + 32)));
      }
      // (the tile instructions are asm statements without a memory clobber: fence the compiler's
      // own reads and writes around them)
      asm volatile("" ::: "memory");
      _tile_loadd(6, codes[0], 64);
      if constexpr (kBlocks == 2) _tile_loadd(7, codes[1], 64);
      _tile_loadd(4, a0 + g * kGroup, K);
      _tile_zero(0);
      _tile_dpbsud(0, 4, 6);
      if constexpr (kBlocks == 2) {
        _tile_zero(1);
        _tile_dpbsud(1, 4, 7);
      }
      if constexpr (kRowTiles == 2) {
        _tile_loadd(5, a0 + kAmxTileRows * K + g * kGroup, K);
        _tile_zero(2);
        _tile_dpbsud(2, 5, 6);
        if constexpr (kBlocks == 2) {
          _tile_zero(3);
          _tile_dpbsud(3, 5, 7);
        }
      }
      constexpr int64_t stride = kWidth * sizeof(int32_t);
      _tile_stored(0, sums[gi][0], stride);
      if constexpr (kBlocks == 2) _tile_stored(1, sums[gi][0] + kBlockRows, stride);
      if constexpr (kRowTiles == 2) {
        _tile_stored(2, sums[gi][kAmxTileRows], stride);
        if constexpr (kBlocks == 2) _tile_stored(3, sums[gi][kAmxTileRows] + kBlockRows, stride);
      }
      asm volatile("" ::: "memory");
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t index = (m0 + r) * groups + g0;
      for (int b = 0; b < kBlocks; ++b) {
        __m512 total = _mm512_load_ps(acc[r] + b * kBlockRows);
        for (int64_t gi = 0; gi < chunk; ++gi) {
          const __m512 group_sums = _mm512_cvtepi32_ps(_mm512_load_si512(sums[gi][r] + b * kBlockRows));
          total = add_int4_group(total, group_sums, d[gi][b], m[gi][b], x.scales[index + gi], x.scaled_sums[index + gi]);
        }
        _mm512_store_ps(acc[r] + b * kBlockRows, total);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int b = 0; b < kBlocks; ++b) store16(out + (m0 + r) * N + (b0 + b) * kBlockRows, _mm512_load_ps(acc[r] + b * kBlockRows));
}

// rows [m_begin, m_end) times blocks [b0, b0 + kBlocks), tiles of 32 rows and a last of 16 or 32;
// the calling thread's tiles configured by int4_amx_configure
template <typename out_t, int kBlocks>
void int4_amx_rows(const QuantizedRows& x, const uint8_t* weight, out_t* out, int64_t m_begin, int64_t m_end,
                   int64_t b0, int64_t N, int64_t K) {
  for (int64_t m = m_begin; m < m_end; m += 2 * kAmxTileRows) {
    const int64_t rows = std::min(m_end - m, 2 * kAmxTileRows);
    if (rows > kAmxTileRows)
      int4_amx_tile<out_t, 2, kBlocks>(x, weight, out, m, rows, b0, N, K);
    else
      int4_amx_tile<out_t, 1, kBlocks>(x, weight, out, m, rows, b0, N, K);
  }
}

#endif

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

constexpr int kMaxTileRows = 4;  // activation rows per tile, at most
constexpr bool kBalancedTiles = false;  // see qlinear_rows

// load8/store8: cpu_common.h
inline float horizontal_max(__m256 value) {
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(value), _mm256_extractf128_ps(value, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
}

inline int32_t horizontal_sum(__m256i value) {
  __m128i half = _mm_add_epi32(_mm256_castsi256_si128(value), _mm256_extracti128_si256(value, 1));
  half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(half, _mm_shuffle_epi32(half, 0xB1)));
}

template <typename scalar_t>
QuantizedRows quantize_activations(const scalar_t* x, int64_t M, int64_t K) {
  const QuantizedRows rows = quantized_rows_buffers(M, K);
  const int64_t groups = rows.groups;
  int8_t* codes = const_cast<int8_t*>(rows.codes);
  float* scales = const_cast<float*>(rows.scales);
  float* scaled_sums = const_cast<float*>(rows.scaled_sums);
  int32_t* code_sums = const_cast<int32_t*>(rows.code_sums);
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  at::parallel_for(0, M * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t offset = (index / groups) * K + (index % groups) * kGroup;
      __m256 values[4];
      for (int i = 0; i < 4; ++i) values[i] = load8(x + offset + 8 * i);
      const __m256 amax_lanes = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign_bit, values[0]), _mm256_andnot_ps(sign_bit, values[1])),
                                              _mm256_max_ps(_mm256_andnot_ps(sign_bit, values[2]), _mm256_andnot_ps(sign_bit, values[3])));
      const float amax = horizontal_max(amax_lanes);
      const __m256 inverse = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m256i q[4];  // rounded to nearest even (the default rounding mode)
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(values[i], inverse));
      // 32 x int32 -> 32 x int8 (no saturation: |q| <= 127); the packs interleave the 128-bit lanes
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + offset),
                          _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      const float scale = amax * (1.f / 127.f);
      const int32_t sum = horizontal_sum(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
      scales[index] = scale;
      code_sums[index] = sum;
      scaled_sums[index] = scale * static_cast<float>(sum);
    }
  });
  return rows;
}

// kRows activation rows from m0 times kBlocks blocks from b0: out[m0.., 16 b0..]; each block in
// two halves of 8 output rows (a vector's lanes)
template <int kBits, typename out_t, int kRows, int kBlocks>
inline void qlinear_tile(const QuantizedRows& x, const uint8_t* weight, out_t* out, int64_t m0, int64_t b0,
                         int64_t N, int64_t K, [[maybe_unused]] PairTile place) {
  const int64_t groups = x.groups;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i sign_flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[kRows][kBlocks][2];
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_ps();
  const uint8_t* pair_start = weight + b0 * groups * kGroupBytes<kBits>;
  const int64_t width = b0 + 1 < N / kBlockRows ? 2 : 1;
  for (int64_t g = 0; g < groups; ++g) {
    for (int b = 0; b < kBlocks; ++b) {
      const uint8_t* group = pair_start + (g * width + b) * kGroupBytes<kBits>;
      for (int half = 0; half < 2; ++half) {
        if constexpr (kBits == 4) {
          __m256i codes[8];  // steps 2t and 2t+1 from the low and high nibbles of 64 bytes t
          for (int t = 0; t < 4; ++t) {
            const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + t * 64 + half * 32));
            codes[2 * t] = _mm256_and_si256(bytes, low_nibbles);
            codes[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_nibbles);
          }
          const uint8_t* scales = group + kCodeBytes<4>;
          const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + half * 16)));
          const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 32 + half * 16)));
          for (int r = 0; r < kRows; ++r) {
            const int8_t* row = x.codes + (m0 + r) * K + g * kGroup;
#if defined(__AVXVNNI__)
            // AVX-VNNI: 4 products summed into each int32 lane in one instruction
            __m256i sums = _mm256_setzero_si256();
            for (int step = 0; step < 8; ++step) {
              int32_t four;
              std::memcpy(&four, row + 4 * step, 4);
              sums = _mm256_dpbusd_avx_epi32(sums, codes[step], _mm256_set1_epi32(four));
            }
#else
            // a group's 8 steps summed in int16 (at most 8 * 2 * 15 * 127), then widened once
            __m256i pairs = _mm256_setzero_si256();
            for (int step = 0; step < 8; ++step) {
              int32_t four;
              std::memcpy(&four, row + 4 * step, 4);
              pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(codes[step], _mm256_set1_epi32(four)));
            }
            const __m256i sums = _mm256_madd_epi16(pairs, ones);
#endif
            const int64_t index = (m0 + r) * groups + g;
            acc[r][b][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_set1_ps(x.scales[index])),
                                              acc[r][b][half]);
            acc[r][b][half] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.scaled_sums[index]), acc[r][b][half]);
          }
        } else {
#if defined(__AVXVNNI__)
          // AVX-VNNI, as AVX-512: sum(code * q) - 128 sum(q), the same integers as the sign trick
          __m256i codes[8];
          for (int step = 0; step < 8; ++step)
            codes[step] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + step * 64 + half * 32));
#else
          // the signed codes c = code - 128 (code ^ 0x80) and |c| (at most 128: unsigned)
          __m256i signed_codes[8], magnitudes[8];
          for (int step = 0; step < 8; ++step) {
            signed_codes[step] = _mm256_xor_si256(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + step * 64 + half * 32)), sign_flip);
            magnitudes[step] = _mm256_abs_epi8(signed_codes[step]);
          }
#endif
          const __m256 d = _mm256_loadu_ps(reinterpret_cast<const float*>(group + kCodeBytes<8>) + half * 8);
          for (int r = 0; r < kRows; ++r) {
            const int8_t* row = x.codes + (m0 + r) * K + g * kGroup;
            const int64_t index = (m0 + r) * groups + g;
#if defined(__AVXVNNI__)
            __m256i sums = _mm256_set1_epi32(-128 * x.code_sums[index]);
            for (int step = 0; step < 8; ++step) {
              int32_t four;
              std::memcpy(&four, row + 4 * step, 4);
              sums = _mm256_dpbusd_avx_epi32(sums, codes[step], _mm256_set1_epi32(four));
            }
#else
            __m256i sums = _mm256_setzero_si256();
            for (int step = 0; step < 8; ++step) {
              int32_t four;
              std::memcpy(&four, row + 4 * step, 4);
              // |c| times q with c's sign: at most 2 * 128 * 127 per pair, no saturation
              const __m256i pairs = _mm256_maddubs_epi16(magnitudes[step],
                                                         _mm256_sign_epi8(_mm256_set1_epi32(four), signed_codes[step]));
              sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, ones));
            }
#endif
            acc[r][b][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_set1_ps(x.scales[index])),
                                              acc[r][b][half]);
          }
        }
      }
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b)
      for (int half = 0; half < 2; ++half) store8(out + (m0 + r) * N + (b0 + b) * kBlockRows + half * 8, acc[r][b][half]);
}

#else  // plain C++: the same integer arithmetic, left to the compiler (ARM, x86 below AVX2)

constexpr int kMaxTileRows = 4;  // activation rows per tile, at most
constexpr bool kBalancedTiles = false;  // see qlinear_rows

template <typename scalar_t>
QuantizedRows quantize_activations(const scalar_t* x, int64_t M, int64_t K) {
  const QuantizedRows rows = quantized_rows_buffers(M, K);
  const int64_t groups = rows.groups;
  int8_t* codes = const_cast<int8_t*>(rows.codes);
  float* scales = const_cast<float*>(rows.scales);
  float* scaled_sums = const_cast<float*>(rows.scaled_sums);
  int32_t* code_sums = const_cast<int32_t*>(rows.code_sums);
  at::parallel_for(0, M * groups, 256, [&](int64_t begin, int64_t end) {
    float values[kGroup];
    for (int64_t index = begin; index < end; ++index) {
      const int64_t offset = (index / groups) * K + (index % groups) * kGroup;
      load_row(x + offset, values, kGroup);
      float amax = 0.f;
      for (int i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(values[i]));
      const float inverse = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int i = 0; i < kGroup; ++i) {
        const int32_t code = static_cast<int32_t>(std::nearbyint(values[i] * inverse));  // to nearest even
        codes[offset + i] = static_cast<int8_t>(code);
        sum += code;
      }
      const float scale = amax * (1.f / 127.f);
      scales[index] = scale;
      code_sums[index] = sum;
      scaled_sums[index] = scale * static_cast<float>(sum);
    }
  });
  return rows;
}

// one row's group of one block, scaled into its 16 accumulators. Not inlined: under -ffast-math
// the compiler may order these float operations differently in each tile it is inlined into (it
// did), and every tiling of the rows must give each output the same bits
template <int kBits>
[[gnu::noinline]] void scale_group(float* acc, const int32_t* sums, const uint8_t* scales, const QuantizedRows& x,
                                   int64_t index) {
  for (int lane = 0; lane < kBlockRows; ++lane) {
    if constexpr (kBits == 4) {
      c10::Half d, m;
      std::memcpy(&d, scales + 2 * lane, 2);
      std::memcpy(&m, scales + 32 + 2 * lane, 2);
      acc[lane] += static_cast<float>(sums[lane]) * (static_cast<float>(d) * x.scales[index]) +
                   static_cast<float>(m) * x.scaled_sums[index];
    } else {  // m = -128 d: sum (code - 128) q in integers
      float d;
      std::memcpy(&d, scales + 4 * lane, 4);
      acc[lane] += static_cast<float>(sums[lane] - 128 * x.code_sums[index]) * (d * x.scales[index]);
    }
  }
}

template <int kBits, typename out_t, int kRows, int kBlocks>
inline void qlinear_tile(const QuantizedRows& x, const uint8_t* weight, out_t* out, int64_t m0, int64_t b0,
                         int64_t N, int64_t K, [[maybe_unused]] PairTile place) {
  const int64_t groups = x.groups;
  float acc[kRows][kBlocks][kBlockRows] = {};
  const uint8_t* pair_start = weight + b0 * groups * kGroupBytes<kBits>;
  const int64_t width = b0 + 1 < N / kBlockRows ? 2 : 1;
  for (int64_t g = 0; g < groups; ++g) {
    for (int b = 0; b < kBlocks; ++b) {
      const uint8_t* group = pair_start + (g * width + b) * kGroupBytes<kBits>;
      uint8_t codes[8][kBlockRows][4];  // [step, output row, feature]
      for (int step = 0; step < 8; ++step)
        for (int lane = 0; lane < kBlockRows; ++lane)
          for (int j = 0; j < 4; ++j) {
            if constexpr (kBits == 4) {
              const uint8_t byte = group[(step / 2) * 64 + lane * 4 + j];
              codes[step][lane][j] = step % 2 == 0 ? byte & 0x0F : byte >> 4;
            } else {
              codes[step][lane][j] = group[step * 64 + lane * 4 + j];
            }
          }
      const uint8_t* scales = group + kCodeBytes<kBits>;
      for (int r = 0; r < kRows; ++r) {
        const int8_t* row = x.codes + (m0 + r) * K + g * kGroup;
        const int64_t index = (m0 + r) * groups + g;
        int32_t sums[kBlockRows] = {};
        for (int step = 0; step < 8; ++step)
          for (int lane = 0; lane < kBlockRows; ++lane)
            for (int j = 0; j < 4; ++j) sums[lane] += static_cast<int32_t>(codes[step][lane][j]) * row[4 * step + j];
        scale_group<kBits>(acc[r][b], sums, scales, x, index);
      }
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b) store_row(acc[r][b], out + (m0 + r) * N + (b0 + b) * kBlockRows, kBlockRows);
}

#endif

// qlinear_tile<..., kRows, ...> for kRows = 1..kMaxTileRows, indexed by kRows
template <int kBits, typename out_t, int kBlocks, int... kRows>
constexpr auto tile_table(std::integer_sequence<int, kRows...>) {
  using Tile = void (*)(const QuantizedRows&, const uint8_t*, out_t*, int64_t, int64_t, int64_t, int64_t, PairTile);
  return std::array<Tile, sizeof...(kRows) + 1>{nullptr, &qlinear_tile<kBits, out_t, kRows + 1, kBlocks>...};
}

// rows [m_begin, m_end) times blocks [b0, b0 + kBlocks), in as few tiles as kMaxTileRows allows:
// balanced on AVX-512 (sizes that differ by at most one: 9 rows 5 + 4, not 6 + 3), else full tiles
// and the rest (9 rows 4 + 4 + 1; balanced splits measured no faster on AVX2, the head slower)
template <int kBits, typename out_t, int kBlocks>
void qlinear_rows(const QuantizedRows& x, const uint8_t* weight, out_t* out, int64_t m_begin, int64_t m_end,
                  int64_t b0, int64_t N, int64_t K) {
  static constexpr auto tiles = tile_table<kBits, out_t, kBlocks>(std::make_integer_sequence<int, kMaxTileRows>());
  const int64_t count = (m_end - m_begin + kMaxTileRows - 1) / kMaxTileRows;
  for (int64_t m = m_begin, tile = 0; m < m_end; ++tile) {
    const int64_t left = m_end - m, tiles_left = (left + kMaxTileRows - 1) / kMaxTileRows;
    const int64_t rows = kBalancedTiles ? (left + tiles_left - 1) / tiles_left : std::min<int64_t>(left, kMaxTileRows);
    tiles[rows](x, weight, out, m, b0, N, K, PairTile{tile, count});
    m += rows;
  }
}

// the row count from which the 4-bit matmul takes AMX in this call, 0 for never (no AMX here, or
// TOKENLOOM_CPU_AMX=0)
int64_t int4_amx_min_rows() {
#if defined(TOKENLOOM_AMX_BUILD)
  if (amx_enabled()) return kInt4AmxMinRows;
#endif
  return 0;
}

template <int kBits, typename in_t, typename out_t>
void qlinear(const in_t* x, const uint8_t* weight, out_t* out, int64_t M, int64_t N, int64_t K) {
  const QuantizedRows rows = quantize_activations(x, M, K);
#if defined(TOKENLOOM_AMX_BUILD)
  if constexpr (kBits == 4) {
    const int64_t amx_rows = int4_amx_min_rows();
    if (amx_rows > 0 && M >= amx_rows) {
      const int64_t blocks = N / kBlockRows;
      at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
        int4_amx_configure();  // tile state is per thread
        for (int64_t m = 0; m < M; m += kRowChunk) {
          const int64_t m_end = std::min(M, m + kRowChunk);
          for (int64_t pair = begin; pair < end; ++pair) {
            if (2 * pair + 1 < blocks)
              int4_amx_rows<out_t, 2>(rows, weight, out, m, m_end, 2 * pair, N, K);
            else
              int4_amx_rows<out_t, 1>(rows, weight, out, m, m_end, 2 * pair, N, K);
          }
        }
        amx_release();
      });
      return;
    }
  }
#endif
  // rows [m, m_end) times one block pair (or the odd last block)
  auto rows_times_pair = [&](int64_t m, int64_t m_end, int64_t b0, int width) {
    if (width == 2)
      qlinear_rows<kBits, out_t, 2>(rows, weight, out, m, m_end, b0, N, K);
    else
      qlinear_rows<kBits, out_t, 1>(rows, weight, out, m, m_end, b0, N, K);
  };
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if constexpr (kBits == 4) {
    if (M <= kMaxStreamRows) {
      // each thread's pairs read two at a time (for_each_pair_in_two_streams), for any batch up to
      // kMaxStreamRows: one stream left a core waiting on memory between its dot products at 2-8
      // rows as at one (a 1.7B model's Q4_K layers, weights from memory, 2 threads: [2048 -> 8192]
      // 0.59 / 0.49 / 0.55 ms at 2 / 4 / 8 rows with one stream, 0.37 / 0.38 / 0.46 with two)
      static constexpr auto stream_tiles =
          two_stream_tile_table<out_t>(std::make_integer_sequence<int, kMaxStreamRows>());
      for_each_pair_in_two_streams(
          N,
          [&](int64_t first, int64_t second) {
            const int64_t b0s[2] = {first, second};
            if (M == 1)
              qlinear_streams_tile<kBits, out_t, 1, 2, 2>(rows, weight, out, 0, b0s, N, K, PairTile{0, 1});
            else
              stream_tiles[M](rows, weight, out, 0, b0s, N, K);
          },
          [&](int64_t b0, int width) { rows_times_pair(0, M, b0, width); });
      return;
    }
  }
#endif
  for_each_tile(M, N, rows_times_pair);
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

QuantizedRows quantize_activation_rows(const at::Tensor& x) {
  if (x.scalar_type() == at::kFloat) return quantize_activations(x.data_ptr<float>(), x.size(0), x.size(1));
  return quantize_activations(x.data_ptr<c10::BFloat16>(), x.size(0), x.size(1));
}

QuantizedRows int4_quantize_rows(const float* x, int64_t M, int64_t K) { return quantize_activations(x, M, K); }

void int4_rows_times_block_pair(const QuantizedRows& x, const uint8_t* weight, float* out, int64_t m_begin,
                                int64_t m_end, int64_t b0, int64_t N, int64_t K) {
#if defined(TOKENLOOM_AMX_BUILD)
  const int64_t amx_rows = int4_amx_min_rows();
  if (amx_rows > 0 && m_end - m_begin >= amx_rows) {
    int4_amx_configure();
    if (b0 + 1 < N / kBlockRows)
      int4_amx_rows<float, 2>(x, weight, out, m_begin, m_end, b0, N, K);
    else
      int4_amx_rows<float, 1>(x, weight, out, m_begin, m_end, b0, N, K);
    amx_release();
    return;
  }
#endif
  if (b0 + 1 < N / kBlockRows)
    qlinear_rows<4, float, 2>(x, weight, out, m_begin, m_end, b0, N, K);
  else
    qlinear_rows<4, float, 1>(x, weight, out, m_begin, m_end, b0, N, K);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& weight) {
  return qlinear_op<4>("int4_linear", x, weight, false);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight) {
  return qlinear_op<8>("int8_linear", x, weight, true);
}

#if defined(TOKENLOOM_AMX_BUILD)

// int4_linear_bf16's panel: blocks [b0, b0 + blocks) of the 4-bit weight, every group (one panel
// step of 32 features) dequantized as bf16(d * code + m) (cpu_amx_bf16.h)
__attribute__((target("avx512bf16,avx512bw,avx512f,avx512vbmi"))) void int4_fill_panel(const uint8_t* weight, int64_t b0,
                                                                           int blocks, int64_t N, int64_t K,
                                                                           int64_t k_begin, int64_t k_end,
                                                                           uint8_t* panel) {
  const int64_t groups = K / kGroup;
  const uint8_t* pair_start = weight + b0 * groups * kGroupBytes<4>;
  const int64_t width = b0 + 1 < N / kBlockRows ? 2 : 1;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  for (int64_t g = k_begin / kGroup; g < k_end / kGroup; ++g) {
    for (int b = 0; b < blocks; ++b) {
      const uint8_t* group = pair_start + (g * width + b) * kGroupBytes<4>;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + kCodeBytes<4>)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + kCodeBytes<4> + 32)));
      uint8_t* tile = panel + ((g - k_begin / kGroup) * blocks + b) * kPanelTileBytes;
      const PanelScales scales = bf16_panel_scales(d, m);
      for (int t = 0; t < 4; ++t) {  // 64 bytes t: step 2t in the low nibbles, 2t+1 in the high
        const __m512i bytes = _mm512_loadu_si512(group + t * 64);
        bf16_panel_step(_mm512_and_si512(bytes, low_nibbles), scales, tile + 2 * (2 * t) * 64);
        bf16_panel_step(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles), scales,
                        tile + 2 * (2 * t + 1) * 64);
      }
    }
  }
}

#endif

// x [M, K] bfloat16 times the 4-bit weight through AMX-BF16 panels (cpu_amx_bf16.h): each weight
// value bf16(d * code + m), float32 sums over the whole K, out [M, N] bfloat16 rounded once
at::Tensor int4_linear_bf16(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(bf16_amx_enabled(), "int4_linear_bf16: AMX-BF16 is not available here (it needs the avx512 kernel "
              "build on a CPU with AMX-BF16 and AVX512-BF16, and TOKENLOOM_CPU_AMX not switched off): check "
              "bf16_amx_available() first");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "int4_linear_bf16: x must be a contiguous [rows, in_features] bfloat16 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kGroup == 0 && K > 0, "int4_linear_bf16: in_features must be a positive multiple of 32, got ", K);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() && weight.dim() == 2 &&
                  weight.size(1) == K / kGroup * kGroupBytes<4>,
              "int4_linear_bf16: weight must be a contiguous [out_features / 16, in_features / 32 * ", kGroupBytes<4>,
              "] uint8 tensor (packed for int4_linear)");
  const int64_t N = weight.size(0) * kBlockRows;
  at::Tensor out = at::empty({M, N}, x.options());
#if defined(TOKENLOOM_AMX_BUILD)
  if (M == 0) return out;
  const uint8_t* packed = weight.data_ptr<uint8_t>();
  uint16_t* result = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  huge_output_pages(result, M * N * static_cast<int64_t>(sizeof(uint16_t)));
  bf16_amx_panel_gemm(
      reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()), M, N, K, kGroup,
      [&](int64_t b0, int blocks, int64_t k_begin, int64_t k_end, uint8_t* panel) {
        int4_fill_panel(packed, b0, blocks, N, K, k_begin, k_end, panel);
      },
      [&](const float* c, int64_t m, int64_t rows, int64_t b0, int blocks) {
        for (int64_t r = 0; r < rows; ++r)
          for (int b = 0; b < blocks; ++b)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(result + (m + r) * N + (b0 + b) * kBlockRows),
                                bf16_bits16(_mm512_load_ps(c + r * 32 + b * 16)));
      });
#endif
  return out;
}

// whether int4_linear_bf16 and the 5- and 6-bit ones may be called in this process now
bool bf16_amx_available() { return bf16_amx_enabled(); }

// the row count from which the `bits`-bit matmul (4: int4_linear and the MoE experts' 4-bit tile)
// takes AMX-INT8 in this process, 0 for never (no AMX in this build or CPU, TOKENLOOM_CPU_AMX=0,
// or no AMX path for those bits)
int64_t quantized_amx_min_rows(int64_t bits) { return bits == 4 ? int4_amx_min_rows() : 0; }

}  // namespace TOKENLOOM_CPU_NAMESPACE

TOKENLOOM_LIBRARY_FRAGMENT(m) {
  m.def("int4_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor weight) -> Tensor");
  // no tensor argument to dispatch on: one kernel for every dispatch key
  m.def("quantized_amx_min_rows(int bits) -> int", &TOKENLOOM_CPU_NAMESPACE::quantized_amx_min_rows);
  m.def("int4_linear_bf16(Tensor x, Tensor weight) -> Tensor");
  m.def("bf16_amx_available() -> bool", &TOKENLOOM_CPU_NAMESPACE::bf16_amx_available);
}

TOKENLOOM_LIBRARY_IMPL_CPU(m) {
  m.impl("int4_linear", &TOKENLOOM_CPU_NAMESPACE::int4_linear);
  m.impl("int8_linear", &TOKENLOOM_CPU_NAMESPACE::int8_linear);
  m.impl("int4_linear_bf16", &TOKENLOOM_CPU_NAMESPACE::int4_linear_bf16);
}

