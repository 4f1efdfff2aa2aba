// 5- and 6-bit weights times 8-bit activations: GGUF's Q5_0, Q5_1, Q5_K and Q6_K linear layers
// multiplied in their own codes, as cpu_qlinear.cpp multiplies the 4-bit ones (read its header
// first: the activations, the 16-row blocks stored in pairs and the tiles are the same), in every
// build (AVX512-VNNI, AVX2+FMA+F16C with or without AVX-VNNI, plain C++).
//   `int6_linear`: Q6_K, value = d * sc * (code - 32), code 0..63, a signed 8-bit sc per 16
//                  features and a float16 d per 256
//   `int5_linear`: value = d * sc * code - dmin * mn, code 0..31, an unsigned sc and mn per 32
//                  features and float16 d, dmin per superblock of G groups of 32 (Q5_K: G = 8 with
//                  its 6-bit sc and mn; Q5_0: G = 1, sc = 1, dmin = d, mn = 16; Q5_1: G = 1,
//                  sc = 1, dmin = -m, mn = 1)
// Both give float32 out. The codes are the file's and so are the scales (d * sc is exact in
// float32), so nothing is re-quantized; the bytes read per weight are about the file's (Q6_K: the
// same 6.5625 bits; Q5_K 5.625 for the file's 5.5; Q5_0/Q5_1 6.5 for 5.5/6).
//
// Arithmetic, per row of x quantized to codes q with scale s per group of 32 (cpu_qlinear.cpp):
// the integer dot products of codes are exact, then
//   6-bit: I = sc0 (S0 - 32 A0) + sc1 (S1 - 32 A1) per group, S_h the code products and A_h the
//          activation codes' sum over features 16h..16h+15 (|I| < 2^26); out += float(I) * (d s)
//   5-bit: out += float(sc S) * (d s) - (dmin mn) (s A), A the group's sum of activation codes
// the same operations, in the same order per output, at every level and tile size (AVX-512 forms
// float(I) in float multiplies, which give the same float exactly: see kquant_tile).
//
// Layout, for out_features N (a multiple of 16), in_features K (a multiple of 32 G): block b
// (output rows 16b..16b+15) has K / (32 G) superblocks of bytes, stored in pairs of blocks
// superblock by superblock, as cpu_qlinear.cpp stores its groups. A superblock is a header, d[16]
// (6-bit) or d[16] then dmin[16] (5-bit) as float16, then G groups of 32 features, each:
//   the low 4 bits of the codes: 4 x 64 bytes exactly as the int4 layout (byte 4l + j of 64
//   bytes t: row l's feature 8t + j in the low nibble, 8t + 4 + j in the high one; features
//   4 step .. 4 step + 3 are a "step");
//   the high bits, in as many 64-byte planes as bits (byte 4l + j again): 5-bit: bit `step` of
//   the one plane is step's high bit; 6-bit: bits 2i, 2i+1 of plane h are step 4h + i's two;
//   the sub-scales: 6-bit sc[2][16] int8 (features 0..15, 16..31 of each row); 5-bit sc[16] and
//   mn[16] uint8.
// A 64-byte load of a plane, shifted and masked (within 16-bit lanes: the masks drop the bits a
// shift carries across bytes), puts a step's high bits above its nibbles.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_amx_bf16.h"
#include "cpu_kquant.h"
#include "cpu_qlinear.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace TOKENLOOM_CPU_NAMESPACE {
namespace {

template <int kBits> constexpr int64_t kHeaderBytes = kBits == 6 ? 32 : 64;
template <int kBits> constexpr int64_t kPlaneBytes = (kBits - 4) * 64;
constexpr int64_t kNibbleBytes = 256;
constexpr int64_t kSubScaleBytes = 32;
template <int kBits> constexpr int64_t kKGroupBytes = kNibbleBytes + kPlaneBytes<kBits> + kSubScaleBytes;
constexpr int kMaxRows = 4;  // activation rows per tile, at most (AVX-512: 4 x 2 blocks x 2 integer sets in zmm)
// AVX-512: rows up to which one tile decodes the codes as it reads them (see kquant_rows)
constexpr int kMaxDirectRows = 8;
constexpr int64_t kDecodedRows = 32;  // AVX-512: activation rows that share one decoding of the codes
constexpr int64_t kDecodedGroups = 8;  // AVX-512: groups of 32 features decoded at once, at least
// AVX-512, a tile reading the codes straight from the stream (1-8 rows): how far ahead of it the weight stream is prefetched (about
// one 6-bit superblock of a pair). One thread's Q6_K LM head and layers of a 1.7B model took
// 15-30 % less CPU time at 6 KB than with the hardware prefetcher alone (10 KB was as good,
// 1.5 and 3 KB less)
constexpr int64_t kDirectPrefetchBytes = 6144;

struct Superblocks {
  int64_t groups;  // G: groups of 32 features per superblock
  int64_t bytes;  // one block's bytes of one superblock
  int64_t count;  // per block row: K / (32 G)
};

template <int kBits>
Superblocks superblocks(int64_t K, int64_t groups) {
  return {groups, kHeaderBytes<kBits> + groups * kKGroupBytes<kBits>, K / (kGroup * groups)};
}

// -32 A for each 16 features: [M, K / 16], A the activation codes' sum (the 6-bit code offset's
// share of the code products S, which start from it: S - 32 A with no subtraction, and no
// multiply and broadcast from a general register per row in the tiles)
const int32_t* half_group_offsets(const QuantizedRows& x, int64_t M, int64_t K) {
  thread_local std::vector<int32_t> offsets;
  offsets.resize(M * K / 16);
  for (int64_t index = 0; index < M * K / 16; ++index) {
    int32_t sum = 0;
    for (int i = 0; i < 16; ++i) sum += x.codes[16 * index + i];
    offsets[index] = -32 * sum;
  }
  return offsets.data();
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

// step's codes from its nibbles (already masked) and the plane byte holding its high bits
template <int kBits>
inline __m512i with_high_bits(__m512i nibbles, __m512i plane, int step) {
  if constexpr (kBits == 6) {
    const __m512i mask = _mm512_set1_epi8(0x30);
    switch (step % 4) {
      case 0: return _mm512_or_si512(nibbles, _mm512_and_si512(_mm512_slli_epi16(plane, 4), mask));
      case 1: return _mm512_or_si512(nibbles, _mm512_and_si512(_mm512_slli_epi16(plane, 2), mask));
      case 2: return _mm512_or_si512(nibbles, _mm512_and_si512(plane, mask));
      default: return _mm512_or_si512(nibbles, _mm512_and_si512(_mm512_srli_epi16(plane, 2), mask));
    }
  } else {
    const __m512i mask = _mm512_set1_epi8(0x10);
    const __m512i moved = step <= 4 ? _mm512_slli_epi16(plane, 4 - step) : _mm512_srli_epi16(plane, step - 4);
    return _mm512_or_si512(nibbles, _mm512_and_si512(moved, mask));
  }
}

// the codes of one block's group at steps `step` and `step + 1`, from its packed bytes
template <int kBits>
inline void decode_steps(const uint8_t* group, int step, __m512i (&codes)[2]) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const __m512i bytes = _mm512_loadu_si512(group + (step / 2) * 64);
  const __m512i plane = _mm512_loadu_si512(group + kNibbleBytes + (kBits == 6 ? step / 4 : 0) * 64);
  codes[0] = with_high_bits<kBits>(_mm512_and_si512(bytes, low_nibbles), plane, step);
  codes[1] = with_high_bits<kBits>(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles), plane, step + 1);
}

// a block's decoded codes: per group of the superblocks decoded together, 8 steps x 64 bytes
constexpr int64_t kDecodedGroupBytes = 8 * 64;

// superblocks [sb_begin, sb_end) of the pair's kBlocks blocks decoded into `decoded`, block b's
// from b * block_stride bytes on. The superblocks are one run of the pair's stream, read front to
// back; the next run (the next chunk's, or past the pair's end the next pair's, which this thread
// decodes next) is prefetched as this one is read: without it the decoding waited on memory, and
// 5-16 rows (a batch's decode step) ran the 6-bit weight at two thirds of the 4-bit tile's bytes
// per second
template <int kBits, int kBlocks>
void decode_superblocks(const uint8_t* pair_start, int64_t width, const Superblocks& layout, int64_t sb_begin,
                        int64_t sb_end, uint8_t* decoded, int64_t block_stride) {
  const int64_t run_bytes = (sb_end - sb_begin) * width * layout.bytes;
  for (int64_t sb = sb_begin; sb < sb_end; ++sb)
    for (int b = 0; b < kBlocks; ++b) {
      const uint8_t* header = pair_start + (sb * width + b) * layout.bytes;
      for (int64_t gi = 0; gi < layout.groups; ++gi) {
        const uint8_t* group = header + kHeaderBytes<kBits> + gi * kKGroupBytes<kBits>;
        // (the lines from the group's start on cover the next header too: kKGroupBytes is 32 short of a line)
        for (int64_t line = 0; line < kKGroupBytes<kBits>; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(group + run_bytes + line), _MM_HINT_T0);
        uint8_t* target = decoded + b * block_stride + ((sb - sb_begin) * layout.groups + gi) * kDecodedGroupBytes;
        for (int step = 0; step < 8; step += 2) {
          __m512i codes[2];
          decode_steps<kBits>(group, step, codes);
          _mm512_storeu_si512(target + step * 64, codes[0]);
          _mm512_storeu_si512(target + (step + 1) * 64, codes[1]);
        }
      }
    }
}

// kRows activation rows from m0 times kBlocks blocks (blocks b0.. of a pair, whose stream starts
// at pair_start) over superblocks [sb_begin, sb_end), added to acc: row r's block b at
// acc_rows + r * acc_stride + 16 b. The codes are decoded here from the packed stream
// (kFromDecoded false), or read from `decoded` (decode_superblocks of these superblocks, block b's
// from b * block_stride bytes on): the same integers, the same float operations in the same order, so every row
// gets the same bits. kStreams pairs read at once (one row's tiles: for_each_pair_in_two_streams in
// cpu_qlinear.h), pair s from pair_starts[s], its blocks' accumulators after the earlier pairs'.
template <int kBits, int kRows, int kBlocks, bool kFromDecoded, int kStreams = 1>
void kquant_streams_tile(const QuantizedRows& x, const int32_t* half_offsets, const uint8_t* const* pair_starts,
                         int64_t width, const Superblocks& layout, int64_t sb_begin, int64_t sb_end,
                         const uint8_t* decoded, int64_t block_stride, float* acc_rows, int64_t acc_stride, int64_t m0,
                         int64_t K) {
  static_assert(kStreams == 1 || (kBlocks == 2 && !kFromDecoded), "several streams are full pairs, read directly");
  constexpr int kAll = kStreams * kBlocks;
  const int64_t groups = x.groups;
  for (int64_t sb = sb_begin; sb < sb_end; ++sb) {
    const uint8_t* header[kAll];
    __m512 d[kAll], dmin[kAll];
    for (int b = 0; b < kAll; ++b) {
      header[b] = pair_starts[b / kBlocks] + (sb * width + b % kBlocks) * layout.bytes;
      d[b] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(header[b])));
      if constexpr (kBits == 5)
        dmin[b] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(header[b] + 32)));
    }
    for (int64_t gi = 0; gi < layout.groups; ++gi) {
      const int64_t g = sb * layout.groups + gi;
      const uint8_t* group[kAll];
      for (int b = 0; b < kAll; ++b) group[b] = header[b] + kHeaderBytes<kBits> + gi * kKGroupBytes<kBits>;
      const uint8_t* decoded_group = decoded + ((sb - sb_begin) * layout.groups + gi) * kDecodedGroupBytes;
      // read straight from the stream (1-8 rows: a decode step, the LM head, a mixture of
      // experts' 1-2 rows per expert at a batch's decode step): the stream prefetched
      // kDirectPrefetchBytes ahead of each block's group (past the superblock's or pair's end: the
      // bytes this thread reads next), as the 4-bit tile does. At 2-4 rows the dot products did
      // not hide the loads: one OLMoE Q4_K_M layer's experts at an 8-token step (1-3 rows per
      // expert) took ~3% less CPU time with it
      if constexpr (!kFromDecoded)
        for (int b = 0; b < kAll; ++b)
          for (int64_t line = 0; line < kKGroupBytes<kBits>; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(group[b] + kDirectPrefetchBytes + line), _MM_HINT_T0);
      // I in float32, as float(I) exactly: each sc (S - 32 A) is an integer below 2^24 (|code - 32|
      // <= 32: 16 x 32 x 127 x 128 < 2^23) so its float product is exact, and the sum of the two
      // is rounded once, as the conversion of the integer I would be (5-bit: sc S, one rounding).
      // Float multiplies instead of vpmulld: at 4 or more rows two vpmulld a group ran as long as
      // its 8 dot products
      __m512 total[kRows][kAll];
      // (unrolled: each step's shifts are constants; the accumulators stay in memory, updated once a
      // group, so that the integer sums of 4 rows x 2 blocks stay in registers: held there too,
      // they spilled)
#pragma GCC unroll 2
      for (int h = 0; h < (kBits == 6 ? 2 : 1); ++h) {
        // 6-bit: the group in halves of 16 features (steps 4h..4h+3); 5-bit: all 8 steps at once
        constexpr int kSteps = kBits == 6 ? 4 : 8;
        // 6-bit: S - 32 A, from -32 A on
        __m512i sums[kRows][kAll];
        for (int r = 0; r < kRows; ++r) {
          const __m512i start = kBits == 6 ? _mm512_set1_epi32(half_offsets[((m0 + r) * groups + g) * 2 + h])
                                           : _mm512_setzero_si512();
          for (int b = 0; b < kAll; ++b) sums[r][b] = start;
        }
#pragma GCC unroll 4
        for (int t = 0; t < kSteps / 2; ++t) {
          const int step = h * 4 + 2 * t;
          __m512i codes[kAll][2];
          for (int b = 0; b < kAll; ++b) {
            if constexpr (kFromDecoded) {
              for (int i = 0; i < 2; ++i)
                codes[b][i] = _mm512_loadu_si512(decoded_group + b * block_stride + (step + i) * 64);
            } else {
              decode_steps<kBits>(group[b], step, codes[b]);
            }
          }
          for (int r = 0; r < kRows; ++r) {
            const int8_t* row = x.codes + (m0 + r) * K + g * kGroup + step * 4;
            for (int half = 0; half < 2; ++half) {
              int32_t four;
              std::memcpy(&four, row + 4 * half, 4);
              const __m512i broadcast = _mm512_set1_epi32(four);
              for (int b = 0; b < kAll; ++b) sums[r][b] = _mm512_dpbusd_epi32(sums[r][b], codes[b][half], broadcast);
            }
          }
        }
        for (int b = 0; b < kAll; ++b) {
          const uint8_t* sub_scales = group[b] + kNibbleBytes + kPlaneBytes<kBits>;
          if constexpr (kBits == 6) {
            const __m512 sc = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub_scales + 16 * h))));
            for (int r = 0; r < kRows; ++r) {
              const __m512 centred = _mm512_cvtepi32_ps(sums[r][b]);
              total[r][b] = h == 0 ? _mm512_mul_ps(sc, centred) : _mm512_fmadd_ps(sc, centred, total[r][b]);
            }
          } else {
            const __m512 sc = _mm512_cvtepi32_ps(
                _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub_scales))));
            for (int r = 0; r < kRows; ++r) total[r][b] = _mm512_mul_ps(sc, _mm512_cvtepi32_ps(sums[r][b]));
          }
        }
      }
      for (int b = 0; b < kAll; ++b) {
        __m512 dmin_mn;
        if constexpr (kBits == 5) {
          const uint8_t* mins = group[b] + kNibbleBytes + kPlaneBytes<kBits> + 16;
          dmin_mn = _mm512_mul_ps(dmin[b], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(mins)))));
        }
        for (int r = 0; r < kRows; ++r) {
          const int64_t index = (m0 + r) * groups + g;
          float* acc = acc_rows + r * acc_stride + b * kBlockRows;
          __m512 sum =
              _mm512_fmadd_ps(total[r][b], _mm512_mul_ps(d[b], _mm512_set1_ps(x.scales[index])), _mm512_loadu_ps(acc));
          if constexpr (kBits == 5) sum = _mm512_fnmadd_ps(dmin_mn, _mm512_set1_ps(x.scaled_sums[index]), sum);
          _mm512_storeu_ps(acc, sum);
        }
      }
    }
  }
}

template <int kBits, int kRows, int kBlocks, bool kFromDecoded>
void kquant_tile(const QuantizedRows& x, const int32_t* half_offsets, const uint8_t* pair_start, int64_t width,
                 const Superblocks& layout, int64_t sb_begin, int64_t sb_end, const uint8_t* decoded, int64_t block_stride,
                 float* acc_rows, int64_t acc_stride, int64_t m0, int64_t K) {
  kquant_streams_tile<kBits, kRows, kBlocks, kFromDecoded>(x, half_offsets, &pair_start, width, layout, sb_begin,
                                                           sb_end, decoded, block_stride, acc_rows, acc_stride, m0, K);
}

template <int kBits, int kBlocks, bool kFromDecoded, int... kRows>
constexpr auto kquant_tiles(std::integer_sequence<int, kRows...>) {
  using Tile = void (*)(const QuantizedRows&, const int32_t*, const uint8_t*, int64_t, const Superblocks&, int64_t,
                        int64_t, const uint8_t*, int64_t, float*, int64_t, int64_t, int64_t);
  return std::array<Tile, sizeof...(kRows) + 1>{nullptr, &kquant_tile<kBits, kRows + 1, kBlocks, kFromDecoded>...};
}

// rows [m_begin, m_end) times the pair of blocks from b0, kDecodedRows rows at a time: up to
// kMaxDirectRows in one tile that decodes the codes as it reads them; more over one decoding of
// each kDecodedGroups groups of the pair into an L1 buffer, in tiles of at most kMaxRows of sizes
// that differ by at most one (9 rows 5 + 4) (decoding, a dozen shifts and masks per 64 codes,
// cost about as much as the dot products of 4 rows: 8 rows decoding twice ran the 6-bit weight at
// a third of the int4 tile's speed per byte). A batch's decode step of 5-8 sequences takes one
// direct tile: its decoding once, with no trip through the buffer (Q6_K and Q5_K layers of a
// 1.7B model at 6 and 8 rows 20-28 % faster than the buffer's tiles of 3-4 rows; from 12 rows the
// buffer's 4-row tiles measured as fast as 6- and 8-row ones, or faster, so they stay)
template <int kBits, int kBlocks>
void kquant_rows(const QuantizedRows& x, const int32_t* half_offsets, const uint8_t* weight, float* out, int64_t m_begin,
                 int64_t m_end, int64_t b0, int64_t N, int64_t K, const Superblocks& layout) {
  static constexpr auto direct =
      kquant_tiles<kBits, kBlocks, false>(std::make_integer_sequence<int, kMaxDirectRows>());
  static constexpr auto from_decoded = kquant_tiles<kBits, kBlocks, true>(std::make_integer_sequence<int, kMaxRows>());
  const uint8_t* pair_start = weight + b0 * layout.count * layout.bytes;
  const int64_t width = b0 + 1 < N / kBlockRows ? 2 : 1;
  const int64_t chunk = std::max<int64_t>(1, kDecodedGroups / layout.groups);  // superblocks decoded at once
  const int64_t block_stride = chunk * layout.groups * kDecodedGroupBytes;
  thread_local std::vector<uint8_t> decoded;
  alignas(64) float acc[kDecodedRows * kBlocks * kBlockRows];
  constexpr int64_t acc_stride = kBlocks * kBlockRows;
  for (int64_t m = m_begin; m < m_end; m += kDecodedRows) {
    const int64_t rows = std::min<int64_t>(kDecodedRows, m_end - m);
    std::fill_n(acc, rows * acc_stride, 0.f);
    if (rows <= kMaxDirectRows) {
      direct[rows](x, half_offsets, pair_start, width, layout, 0, layout.count, nullptr, 0, acc, acc_stride, m, K);
    } else {
      decoded.resize(kBlocks * block_stride);
      for (int64_t sb = 0; sb < layout.count; sb += chunk) {
        const int64_t sb_end = std::min(layout.count, sb + chunk);
        decode_superblocks<kBits, kBlocks>(pair_start, width, layout, sb, sb_end, decoded.data(), block_stride);
        for (int64_t r = 0; r < rows;) {
          const int64_t left = rows - r, tiles_left = (left + kMaxRows - 1) / kMaxRows;
          const int64_t tile_rows = (left + tiles_left - 1) / tiles_left;
          from_decoded[tile_rows](x, half_offsets, pair_start, width, layout, sb, sb_end, decoded.data(), block_stride,
                                  acc + r * acc_stride, acc_stride, m + r, K);
          r += tile_rows;
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(out + (m + r) * N + b0 * kBlockRows, acc + r * acc_stride, sizeof(float) * acc_stride);
  }
}

#if defined(TOKENLOOM_AMX_BUILD)

// int5_linear_bf16's and int6_linear_bf16's panel (cpu_amx_bf16.h): blocks [b0, b0 + blocks) of
// the weight, each group one panel step, its codes decoded as the int8 tiles decode them and each
// value rounded once to bfloat16 from float32: 6-bit (d sc) * code - 32 (d sc), 5-bit (d sc) *
// code - dmin mn, in one fused multiply-add of exact terms (d sc and dmin mn are exact in float32,
// so is 32 d sc, and so is 5-bit's (d sc) * code): the float32 the dequantized weight holds
template <int kBits>
__attribute__((target("avx512bf16,avx512bw,avx512f,avx512vbmi"))) void kquant_fill_panel(const uint8_t* weight, int64_t b0,
                                                                             int blocks, int64_t N,
                                                                             const Superblocks& layout,
                                                                             int64_t k_begin, int64_t k_end,
                                                                             uint8_t* panel) {
  const uint8_t* pair_start = weight + b0 * layout.count * layout.bytes;
  const int64_t width = b0 + 1 < N / kBlockRows ? 2 : 1;
  const int64_t superblock_features = kGroup * layout.groups, sb_begin = k_begin / superblock_features;
  for (int64_t sb = sb_begin; sb < k_end / superblock_features; ++sb) {
    for (int b = 0; b < blocks; ++b) {
      const uint8_t* header = pair_start + (sb * width + b) * layout.bytes;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(header)));
      for (int64_t gi = 0; gi < layout.groups; ++gi) {
        const uint8_t* group = header + kHeaderBytes<kBits> + gi * kKGroupBytes<kBits>;
        const uint8_t* sub_scales = group + kNibbleBytes + kPlaneBytes<kBits>;
        __m512 scale[2], offset[2];
        if constexpr (kBits == 6) {
          for (int h = 0; h < 2; ++h) {  // sc per 16 features
            scale[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub_scales + 16 * h)))));
            offset[h] = _mm512_mul_ps(scale[h], _mm512_set1_ps(-32.f));
          }
        } else {
          const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(header + 32)));
          scale[0] = scale[1] = _mm512_mul_ps(
              d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub_scales)))));
          offset[0] = offset[1] = _mm512_mul_ps(
              dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub_scales + 16)))));
          offset[0] = offset[1] = _mm512_sub_ps(_mm512_setzero_ps(), offset[0]);
        }
        const PanelScales scales[2] = {bf16_panel_scales(scale[0], offset[0]),
                                       kBits == 6 ? bf16_panel_scales(scale[1], offset[1]) : PanelScales{}};
        uint8_t* tile = panel + (((sb - sb_begin) * layout.groups + gi) * blocks + b) * kPanelTileBytes;
        for (int step = 0; step < 8; step += 2) {
          __m512i codes[2];
          decode_steps<kBits>(group, step, codes);
          for (int i = 0; i < 2; ++i)
            bf16_panel_step(codes[i], scales[kBits == 6 ? (step + i) / 4 : 0], tile + 2 * (step + i) * 64);
        }
      }
    }
  }
}

#endif

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

template <int kBits>
inline __m256i with_high_bits(__m256i nibbles, __m256i plane, int step) {
  if constexpr (kBits == 6) {
    const __m256i mask = _mm256_set1_epi8(0x30);
    switch (step % 4) {
      case 0: return _mm256_or_si256(nibbles, _mm256_and_si256(_mm256_slli_epi16(plane, 4), mask));
      case 1: return _mm256_or_si256(nibbles, _mm256_and_si256(_mm256_slli_epi16(plane, 2), mask));
      case 2: return _mm256_or_si256(nibbles, _mm256_and_si256(plane, mask));
      default: return _mm256_or_si256(nibbles, _mm256_and_si256(_mm256_srli_epi16(plane, 2), mask));
    }
  } else {
    const __m256i mask = _mm256_set1_epi8(0x10);
    const __m256i moved = step <= 4 ? _mm256_slli_epi16(plane, 4 - step) : _mm256_srli_epi16(plane, step - 4);
    return _mm256_or_si256(nibbles, _mm256_and_si256(moved, mask));
  }
}

// each block in two halves of 8 output rows (a vector's lanes), as cpu_qlinear.cpp's AVX2 tile
template <int kBits, int kRows, int kBlocks>
void kquant_tile(const QuantizedRows& x, const int32_t* half_offsets, const uint8_t* weight, float* out, int64_t m0,
                 int64_t b0, int64_t N, int64_t K, const Superblocks& layout) {
  const int64_t groups = x.groups;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
#if !defined(__AVXVNNI__)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[kRows][kBlocks][2];
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_ps();
  const uint8_t* pair_start = weight + b0 * layout.count * layout.bytes;
  const int64_t width = b0 + 1 < N / kBlockRows ? 2 : 1;
  for (int64_t sb = 0; sb < layout.count; ++sb) {
    for (int b = 0; b < kBlocks; ++b) {
      const uint8_t* header = pair_start + (sb * width + b) * layout.bytes;
      for (int lanes = 0; lanes < 2; ++lanes) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(header + lanes * 16)));
        __m256 dmin = _mm256_setzero_ps();
        if constexpr (kBits == 5)
          dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(header + 32 + lanes * 16)));
        for (int64_t gi = 0; gi < layout.groups; ++gi) {
          const int64_t g = sb * layout.groups + gi;
          const uint8_t* group = header + kHeaderBytes<kBits> + gi * kKGroupBytes<kBits>;
          __m256i codes[8];
          for (int t = 0; t < 4; ++t) {
            const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + t * 64 + lanes * 32));
            const __m256i plane = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(group + kNibbleBytes + (kBits == 6 ? t / 2 : 0) * 64 + lanes * 32));
            codes[2 * t] = with_high_bits<kBits>(_mm256_and_si256(bytes, low_nibbles), plane, 2 * t);
            codes[2 * t + 1] =
                with_high_bits<kBits>(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_nibbles), plane, 2 * t + 1);
          }
          const uint8_t* sub_scales = group + kNibbleBytes + kPlaneBytes<kBits>;
          __m256i sc[2];
          __m256 dmin_mn = _mm256_setzero_ps();
          if constexpr (kBits == 6) {
            for (int h = 0; h < 2; ++h)
              sc[h] = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub_scales + 16 * h + 8 * lanes)));
          } else {
            sc[0] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub_scales + 8 * lanes)));
            dmin_mn = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub_scales + 16 + 8 * lanes)))));
          }
          for (int r = 0; r < kRows; ++r) {
            const int8_t* row = x.codes + (m0 + r) * K + g * kGroup;
            const int64_t index = (m0 + r) * groups + g;
            // the code products of each 16 features (steps 4h..4h+3) in int32
            __m256i sums[2];
            for (int h = 0; h < 2; ++h) {
              sums[h] = _mm256_setzero_si256();
              for (int step = 4 * h; step < 4 * h + 4; step += 2) {
                int32_t four[2];
                std::memcpy(four, row + 4 * step, 8);
#if defined(__AVXVNNI__)
                sums[h] = _mm256_dpbusd_avx_epi32(sums[h], codes[step], _mm256_set1_epi32(four[0]));
                sums[h] = _mm256_dpbusd_avx_epi32(sums[h], codes[step + 1], _mm256_set1_epi32(four[1]));
#else
                // two steps in int16: at most 2 * 2 * 63 * 127 < 2^15
                const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(codes[step], _mm256_set1_epi32(four[0])),
                                                       _mm256_maddubs_epi16(codes[step + 1], _mm256_set1_epi32(four[1])));
                sums[h] = _mm256_add_epi32(sums[h], _mm256_madd_epi16(pairs, ones));
#endif
              }
            }
            __m256i total;
            if constexpr (kBits == 6) {
              total = _mm256_add_epi32(
                  _mm256_mullo_epi32(sc[0], _mm256_add_epi32(sums[0], _mm256_set1_epi32(half_offsets[2 * index]))),
                  _mm256_mullo_epi32(sc[1], _mm256_add_epi32(sums[1], _mm256_set1_epi32(half_offsets[2 * index + 1]))));
            } else {
              total = _mm256_mullo_epi32(sc[0], _mm256_add_epi32(sums[0], sums[1]));
            }
            acc[r][b][lanes] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(x.scales[index])),
                                               acc[r][b][lanes]);
            if constexpr (kBits == 5)
              acc[r][b][lanes] = _mm256_fnmadd_ps(dmin_mn, _mm256_set1_ps(x.scaled_sums[index]), acc[r][b][lanes]);
          }
        }
      }
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b)
      for (int lanes = 0; lanes < 2; ++lanes)
        _mm256_storeu_ps(out + (m0 + r) * N + (b0 + b) * kBlockRows + lanes * 8, acc[r][b][lanes]);
}

#else  // plain C++: the same integer arithmetic, left to the compiler

// one row's group of one block, scaled into its 16 accumulators; not inlined, so that every
// tile orders these float operations the same way (see cpu_qlinear.cpp's scale_group)
template <int kBits>
[[gnu::noinline]] void scale_group(float* acc, const int32_t (*sums)[kBlockRows], const uint8_t* header,
                                   const uint8_t* sub_scales, const QuantizedRows& x, const int32_t* half_offsets,
                                   int64_t index) {
  for (int lane = 0; lane < kBlockRows; ++lane) {
    c10::Half d;
    std::memcpy(&d, header + 2 * lane, 2);
    int32_t total;
    if constexpr (kBits == 6) {
      const int8_t* sc = reinterpret_cast<const int8_t*>(sub_scales);
      total = sc[lane] * (sums[0][lane] + half_offsets[2 * index]) +
              sc[16 + lane] * (sums[1][lane] + half_offsets[2 * index + 1]);
    } else {
      total = sub_scales[lane] * (sums[0][lane] + sums[1][lane]);
    }
    acc[lane] += static_cast<float>(total) * (static_cast<float>(d) * x.scales[index]);
    if constexpr (kBits == 5) {
      c10::Half dmin;
      std::memcpy(&dmin, header + 32 + 2 * lane, 2);
      acc[lane] -= (static_cast<float>(dmin) * static_cast<float>(sub_scales[16 + lane])) * x.scaled_sums[index];
    }
  }
}

template <int kBits, int kRows, int kBlocks>
void kquant_tile(const QuantizedRows& x, const int32_t* half_offsets, const uint8_t* weight, float* out, int64_t m0,
                 int64_t b0, int64_t N, int64_t K, const Superblocks& layout) {
  const int64_t groups = x.groups;
  float acc[kRows][kBlocks][kBlockRows] = {};
  const uint8_t* pair_start = weight + b0 * layout.count * layout.bytes;
  const int64_t width = b0 + 1 < N / kBlockRows ? 2 : 1;
  for (int64_t sb = 0; sb < layout.count; ++sb) {
    for (int b = 0; b < kBlocks; ++b) {
      const uint8_t* header = pair_start + (sb * width + b) * layout.bytes;
      for (int64_t gi = 0; gi < layout.groups; ++gi) {
        const int64_t g = sb * layout.groups + gi;
        const uint8_t* group = header + kHeaderBytes<kBits> + gi * kKGroupBytes<kBits>;
        uint8_t codes[8][kBlockRows][4];  // [step, output row, feature]
        for (int step = 0; step < 8; ++step)
          for (int lane = 0; lane < kBlockRows; ++lane)
            for (int j = 0; j < 4; ++j) {
              const uint8_t byte = group[(step / 2) * 64 + lane * 4 + j];
              const uint8_t low = step % 2 == 0 ? byte & 0x0F : byte >> 4;
              const uint8_t high = kBits == 6
                                       ? (group[kNibbleBytes + (step / 4) * 64 + lane * 4 + j] >> (2 * (step % 4))) & 3
                                       : (group[kNibbleBytes + lane * 4 + j] >> step) & 1;
              codes[step][lane][j] = static_cast<uint8_t>(low | (high << 4));
            }
        for (int r = 0; r < kRows; ++r) {
          const int8_t* row = x.codes + (m0 + r) * K + g * kGroup;
          int32_t sums[2][kBlockRows] = {};
          for (int step = 0; step < 8; ++step)
            for (int lane = 0; lane < kBlockRows; ++lane)
              for (int j = 0; j < 4; ++j)
                sums[step / 4][lane] += static_cast<int32_t>(codes[step][lane][j]) * row[4 * step + j];
          scale_group<kBits>(acc[r][b], sums, header, group + kNibbleBytes + kPlaneBytes<kBits>, x, half_offsets,
                             (m0 + r) * groups + g);
        }
      }
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b)
      std::memcpy(out + (m0 + r) * N + (b0 + b) * kBlockRows, acc[r][b], sizeof(float) * kBlockRows);
}


#endif

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
template <int kBits, int kBlocks, int... kRows>
constexpr auto kquant_tiles(std::integer_sequence<int, kRows...>) {
  using Tile = void (*)(const QuantizedRows&, const int32_t*, const uint8_t*, float*, int64_t, int64_t, int64_t,
                        int64_t, const Superblocks&);
  return std::array<Tile, sizeof...(kRows) + 1>{nullptr, &kquant_tile<kBits, kRows + 1, kBlocks>...};
}

// rows [m_begin, m_end) in full tiles of kMaxRows and the rest
template <int kBits, int kBlocks>
void kquant_rows(const QuantizedRows& x, const int32_t* half_offsets, const uint8_t* weight, float* out, int64_t m_begin,
                 int64_t m_end, int64_t b0, int64_t N, int64_t K, const Superblocks& layout) {
  static constexpr auto tiles = kquant_tiles<kBits, kBlocks>(std::make_integer_sequence<int, kMaxRows>());
  for (int64_t m = m_begin; m < m_end; m += kMaxRows)
    tiles[std::min<int64_t>(m_end - m, kMaxRows)](x, half_offsets, weight, out, m, b0, N, K, layout);
}
#endif

// The superblock layout of a kBits weight for x's K, checking x's and the weight's shapes (x already
// checked for its dtype); N is the weight's out_features.
template <int kBits>
Superblocks checked_layout(const char* name, const at::Tensor& x, const at::Tensor& weight, int64_t groups,
                           int64_t* N) {
  TORCH_CHECK(groups > 0, name, ": superblock_groups must be positive, got ", groups);
  const int64_t K = x.size(1);
  TORCH_CHECK(K > 0 && K % (kGroup * groups) == 0, name, ": in_features must be a positive multiple of ",
              kGroup * groups, ", got ", K);
  const Superblocks layout = superblocks<kBits>(K, groups);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() && weight.dim() == 2 &&
                  weight.size(1) == layout.count * layout.bytes,
              name, ": weight must be a contiguous [out_features / 16, in_features / ", kGroup * groups, " * ",
              layout.bytes, "] uint8 tensor");
  *N = weight.size(0) * kBlockRows;
  return layout;
}

// x [M, K] bfloat16 or float32; weight packed for kBits in superblocks of `groups` groups; float32 out [M, N]
template <int kBits>
at::Tensor kquant_linear(const char* name, const at::Tensor& x, const at::Tensor& weight, int64_t groups) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              name, ": x must be a contiguous [rows, in_features] bfloat16 or float32 tensor");
  int64_t N = 0;
  const Superblocks layout = checked_layout<kBits>(name, x, weight, groups, &N);
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return out;
  const QuantizedRows rows = quantize_activation_rows(x);
  const int32_t* half_offsets = kBits == 6 ? half_group_offsets(rows, M, K) : nullptr;
  const uint8_t* packed = weight.data_ptr<uint8_t>();
  float* result = out.data_ptr<float>();
  // rows [m, m_end) times one block pair (or the odd last block)
  auto rows_times_pair = [&](int64_t m, int64_t m_end, int64_t b0, int width) {
    if (width == 2)
      kquant_rows<kBits, 2>(rows, half_offsets, packed, result, m, m_end, b0, N, K, layout);
    else
      kquant_rows<kBits, 1>(rows, half_offsets, packed, result, m, m_end, b0, N, K, layout);
  };
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (M == 1) {
    for_each_pair_in_two_streams(
        N,
        [&](int64_t first, int64_t second) {
          alignas(64) float acc[2 * 2 * kBlockRows];  // (in the calling thread's frame)
          const uint8_t* starts[2] = {packed + first * layout.count * layout.bytes,
                                      packed + second * layout.count * layout.bytes};
          std::fill_n(acc, 4 * kBlockRows, 0.f);
          kquant_streams_tile<kBits, 1, 2, false, 2>(rows, half_offsets, starts, 2, layout, 0, layout.count, nullptr, 0,
                                                     acc, 4 * kBlockRows, 0, K);
          std::memcpy(result + first * kBlockRows, acc, sizeof(float) * 2 * kBlockRows);
          std::memcpy(result + second * kBlockRows, acc + 2 * kBlockRows, sizeof(float) * 2 * kBlockRows);
        },
        [&](int64_t b0, int width) { rows_times_pair(0, 1, b0, width); });
    return out;
  }
#endif
  for_each_tile(M, N, rows_times_pair);
  return out;
}

// x [M, K] bfloat16 times the kBits weight through AMX-BF16 panels: float32 out [M, N]
template <int kBits>
at::Tensor kquant_linear_bf16(const char* name, const at::Tensor& x, const at::Tensor& weight, int64_t groups) {
  TORCH_CHECK(bf16_amx_enabled(), name, ": AMX-BF16 is not available here (it needs the avx512 kernel build on a CPU "
              "with AMX-BF16 and AVX512-BF16, and TOKENLOOM_CPU_AMX not switched off): check bf16_amx_available() first");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, name,
              ": x must be a contiguous [rows, in_features] bfloat16 tensor");
  int64_t N = 0;
  const Superblocks layout = checked_layout<kBits>(name, x, weight, groups, &N);
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
#if defined(TOKENLOOM_AMX_BUILD)
  if (M == 0) return out;
  const uint8_t* packed = weight.data_ptr<uint8_t>();
  float* result = out.data_ptr<float>();
  huge_output_pages(result, M * N * static_cast<int64_t>(sizeof(float)));
  bf16_amx_panel_gemm(
      reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()), M, N, K, kGroup * groups,
      [&](int64_t b0, int blocks, int64_t k_begin, int64_t k_end, uint8_t* panel) {
        kquant_fill_panel<kBits>(packed, b0, blocks, N, layout, k_begin, k_end, panel);
      },
      [&](const float* c, int64_t m, int64_t rows, int64_t b0, int blocks) {
        for (int64_t r = 0; r < rows; ++r)
          std::memcpy(result + (m + r) * N + b0 * kBlockRows, c + r * 32, sizeof(float) * kBlockRows * blocks);
      });
#endif
  return out;
}

}  // namespace

const int32_t* int6_half_group_sums(const QuantizedRows& x, int64_t M, int64_t K) { return half_group_offsets(x, M, K); }

void int6_rows_times_block_pair(const QuantizedRows& x, const int32_t* half_offsets, const uint8_t* weight, float* out,
                                int64_t m_begin, int64_t m_end, int64_t b0, int64_t N, int64_t K) {
  const Superblocks layout = superblocks<6>(K, 8);
  if (b0 + 1 < N / kBlockRows)
    kquant_rows<6, 2>(x, half_offsets, weight, out, m_begin, m_end, b0, N, K, layout);
  else
    kquant_rows<6, 1>(x, half_offsets, weight, out, m_begin, m_end, b0, N, K, layout);
}

at::Tensor int5_linear(const at::Tensor& x, const at::Tensor& weight, int64_t superblock_groups) {
  return kquant_linear<5>("int5_linear", x, weight, superblock_groups);
}

at::Tensor int6_linear(const at::Tensor& x, const at::Tensor& weight) {
  return kquant_linear<6>("int6_linear", x, weight, 8);
}

at::Tensor int5_linear_bf16(const at::Tensor& x, const at::Tensor& weight, int64_t superblock_groups) {
  return kquant_linear_bf16<5>("int5_linear_bf16", x, weight, superblock_groups);
}

at::Tensor int6_linear_bf16(const at::Tensor& x, const at::Tensor& weight) {
  return kquant_linear_bf16<6>("int6_linear_bf16", x, weight, 8);
}

}  // namespace TOKENLOOM_CPU_NAMESPACE

TOKENLOOM_LIBRARY_FRAGMENT(m) {
  m.def("int5_linear(Tensor x, Tensor weight, int superblock_groups) -> Tensor");
  m.def("int6_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("int5_linear_bf16(Tensor x, Tensor weight, int superblock_groups) -> Tensor");
  m.def("int6_linear_bf16(Tensor x, Tensor weight) -> Tensor");
}

TOKENLOOM_LIBRARY_IMPL_CPU(m) {
  m.impl("int5_linear", &TOKENLOOM_CPU_NAMESPACE::int5_linear);
  m.impl("int6_linear", &TOKENLOOM_CPU_NAMESPACE::int6_linear);
  m.impl("int5_linear_bf16", &TOKENLOOM_CPU_NAMESPACE::int5_linear_bf16);
  m.impl("int6_linear_bf16", &TOKENLOOM_CPU_NAMESPACE::int6_linear_bf16);
}
