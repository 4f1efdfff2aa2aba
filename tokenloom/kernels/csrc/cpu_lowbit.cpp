// 2- and 3-bit weights times 8-bit activations: GGUF's Q2_K and Q3_K linear layers multiplied in
// their own codes, as cpu_kquant.cpp multiplies the 5- and 6-bit ones (read cpu_qlinear.cpp's
// header first: the activations, the 16-row blocks stored in pairs and the tiles are the same), in
// every build (AVX512-VNNI, AVX2+FMA+F16C with or without AVX-VNNI, plain C++).
//   `int3_linear`: Q3_K, value = d * sc * (code - 4), code 0..7 (2 low bits and a high bit), a
//                  signed 6-bit sc per 16 features (stored as int8) and a float16 d per 256
//   `int2_linear`: Q2_K, value = d * sc * code - dmin * mn, code 0..3, a 4-bit sc and mn per 16
//                  features and float16 d and dmin per 256
// Both give float32 out. The codes and scales are the file's (d * sc is exact in float32), so
// nothing is re-quantized, and a weight reads about the file's bytes (Q3_K: 3.5625 bits for the
// file's 3.4375, its 6-bit scales stored as bytes; Q2_K: the same 2.625).
//
// Arithmetic, per row of x quantized to codes q with scale s per group of 32 (cpu_qlinear.cpp),
// per group and output, S_h the integer code products and A_h the activation codes' sum over the
// group's features 16h..16h+15 (as llama.cpp's q8_K `bsums`, here per group of 32's scale):
//   3-bit: I = sc0 (S0 - 4 A0) + sc1 (S1 - 4 A1);        out += float(I) * (d s)
//   2-bit: I = sc0 S0 + sc1 S1, J = mn0 A0 + mn1 A1;     out += float(I) * (d s) - float(J) * (dmin s)
// every integer exact (|I|, |J| < 2^20), the same float operations in the same order per output at
// every tile size of a level.
//
// Layout, for out_features N (a multiple of 16), in_features K (a multiple of 256): block b
// (output rows 16b..16b+15) has K / 256 superblocks of bytes, stored in pairs of blocks superblock
// by superblock (cpu_kquant.cpp's order). A superblock is a header, d[16] (3-bit) or d[16] then
// dmin[16] (2-bit) as float16, then 8 groups of 32 features, each:
//   the low 2 bits of the codes: 2 x 64 bytes, byte 4l + j of 64 bytes c holding row l's
//   feature 4 step + j of step 4c + i in bits 2i, 2i+1 (features 4 step .. 4 step + 3 are a
//   "step", as in the int4 layout);
//   3-bit: a plane of 64 bytes, bit `step` of byte 4l + j the high bit of that step's code;
//   the sub-scales of the two halves of 16 features, [2][16] bytes: 3-bit sc as int8 (-32..31);
//   2-bit sc | mn << 4.
// A 64-byte load shifted and masked (within 16-bit lanes: the masks drop the bits a shift carries
// across bytes) gives one step's codes of 16 rows x 4 features.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

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
namespace lowbit {
namespace {

constexpr int64_t kSuperblockGroups = 8;
template <int kBits> constexpr int64_t kHeaderBytes = kBits == 3 ? 32 : 64;
constexpr int64_t kLowBytes = 128;
template <int kBits> constexpr int64_t kPlaneBytes = kBits == 3 ? 64 : 0;
constexpr int64_t kSubScaleBytes = 32;
template <int kBits> constexpr int64_t kGroupBytes = kLowBytes + kPlaneBytes<kBits> + kSubScaleBytes;
template <int kBits> constexpr int64_t kSuperblockBytes = kHeaderBytes<kBits> + kSuperblockGroups * kGroupBytes<kBits>;
constexpr int kMaxRows = 4;  // activation rows per tile, at most

// the activation codes' sums over each 16 features: [M, K / 16]
const int32_t* half_group_sums(const QuantizedRows& x, int64_t M, int64_t K) {
  thread_local std::vector<int32_t> sums;
  sums.resize(M * K / 16);
  for (int64_t index = 0; index < M * K / 16; ++index) {
    int32_t sum = 0;
    for (int i = 0; i < 16; ++i) sum += x.codes[16 * index + i];
    sums[index] = sum;
  }
  return sums.data();
}

struct Walk {
  int64_t count;  // superblocks per block row: K / 256
  int64_t width;  // blocks stored side by side in this pair (2, or 1 for an odd last block)
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

// step's codes from the 64-byte loads of its low bits and (3-bit) its plane
template <int kBits>
inline __m512i step_codes(const uint8_t* group, int step) {
  const __m512i low = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(group + (step / 4) * 64), 2 * (step % 4)),
                                       _mm512_set1_epi8(0x03));
  if constexpr (kBits == 2) {
    return low;
  } else {
    const __m512i plane = _mm512_loadu_si512(group + kLowBytes);
    const __m512i moved = step <= 2 ? _mm512_slli_epi16(plane, 2 - step) : _mm512_srli_epi16(plane, step - 2);
    return _mm512_or_si512(low, _mm512_and_si512(moved, _mm512_set1_epi8(0x04)));
  }
}

template <int kBits, int kRows, int kBlocks>
void lowbit_tile(const QuantizedRows& x, const int32_t* half_sums, const uint8_t* weight, float* out, int64_t m0,
                 int64_t b0, int64_t N, int64_t K, const Walk& walk) {
  const int64_t groups = x.groups;
  __m512 acc[kRows][kBlocks];
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm512_setzero_ps();
  const uint8_t* pair_start = weight + b0 * walk.count * kSuperblockBytes<kBits>;
  for (int64_t sb = 0; sb < walk.count; ++sb) {
    const uint8_t* header[kBlocks];
    __m512 d[kBlocks], dmin[kBlocks];
    for (int b = 0; b < kBlocks; ++b) {
      header[b] = pair_start + (sb * walk.width + b) * kSuperblockBytes<kBits>;
      d[b] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(header[b])));
      if constexpr (kBits == 2)
        dmin[b] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(header[b] + 32)));
    }
    for (int64_t gi = 0; gi < kSuperblockGroups; ++gi) {
      const int64_t g = sb * kSuperblockGroups + gi;
      const uint8_t* group[kBlocks];
      for (int b = 0; b < kBlocks; ++b) group[b] = header[b] + kHeaderBytes<kBits> + gi * kGroupBytes<kBits>;
      __m512i total[kRows][kBlocks], mins_total[kRows][kBlocks];  // I, J
      for (int h = 0; h < 2; ++h) {
        __m512i sums[kRows][kBlocks];
        for (int r = 0; r < kRows; ++r)
          for (int b = 0; b < kBlocks; ++b) sums[r][b] = _mm512_setzero_si512();
        for (int step = 4 * h; step < 4 * h + 4; ++step) {
          __m512i codes[kBlocks];
          for (int b = 0; b < kBlocks; ++b) codes[b] = step_codes<kBits>(group[b], step);
          for (int r = 0; r < kRows; ++r) {
            int32_t four;
            std::memcpy(&four, x.codes + (m0 + r) * K + g * kGroup + step * 4, 4);
            const __m512i broadcast = _mm512_set1_epi32(four);
            for (int b = 0; b < kBlocks; ++b) sums[r][b] = _mm512_dpbusd_epi32(sums[r][b], codes[b], broadcast);
          }
        }
        for (int b = 0; b < kBlocks; ++b) {
          const __m128i bytes =
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(group[b] + kLowBytes + kPlaneBytes<kBits> + 16 * h));
          for (int r = 0; r < kRows; ++r) {
            const __m512i a = _mm512_set1_epi32(half_sums[((m0 + r) * groups + g) * 2 + h]);
            __m512i scaled;
            if constexpr (kBits == 3) {
              const __m512i sc = _mm512_cvtepi8_epi32(bytes);
              scaled = _mm512_mullo_epi32(sc, _mm512_sub_epi32(sums[r][b], _mm512_slli_epi32(a, 2)));
            } else {
              const __m512i packed = _mm512_cvtepu8_epi32(bytes);
              const __m512i sc = _mm512_and_si512(packed, _mm512_set1_epi32(0x0F));
              const __m512i mn = _mm512_srli_epi32(packed, 4);
              scaled = _mm512_mullo_epi32(sc, sums[r][b]);
              const __m512i offset = _mm512_mullo_epi32(mn, a);
              mins_total[r][b] = h == 0 ? offset : _mm512_add_epi32(mins_total[r][b], offset);
            }
            total[r][b] = h == 0 ? scaled : _mm512_add_epi32(total[r][b], scaled);
          }
        }
      }
      for (int r = 0; r < kRows; ++r) {
        const int64_t index = (m0 + r) * groups + g;
        const __m512 s = _mm512_set1_ps(x.scales[index]);
        for (int b = 0; b < kBlocks; ++b) {
          acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r][b]), _mm512_mul_ps(d[b], s), acc[r][b]);
          if constexpr (kBits == 2)
            acc[r][b] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins_total[r][b]), _mm512_mul_ps(dmin[b], s), acc[r][b]);
        }
      }
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b) _mm512_storeu_ps(out + (m0 + r) * N + (b0 + b) * kBlockRows, acc[r][b]);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// step's codes of 8 rows (one half of a block's 64 bytes)
template <int kBits>
inline __m256i step_codes(const uint8_t* group, int step, int lanes) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + (step / 4) * 64 + lanes * 32));
  const __m256i low = _mm256_and_si256(_mm256_srli_epi16(bytes, 2 * (step % 4)), _mm256_set1_epi8(0x03));
  if constexpr (kBits == 2) {
    return low;
  } else {
    const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + kLowBytes + lanes * 32));
    const __m256i moved = step <= 2 ? _mm256_slli_epi16(plane, 2 - step) : _mm256_srli_epi16(plane, step - 2);
    return _mm256_or_si256(low, _mm256_and_si256(moved, _mm256_set1_epi8(0x04)));
  }
}

// each block in two halves of 8 output rows (a vector's lanes), as cpu_kquant.cpp's AVX2 tile
template <int kBits, int kRows, int kBlocks>
void lowbit_tile(const QuantizedRows& x, const int32_t* half_sums, const uint8_t* weight, float* out, int64_t m0,
                 int64_t b0, int64_t N, int64_t K, const Walk& walk) {
  const int64_t groups = x.groups;
#if !defined(__AVXVNNI__)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[kRows][kBlocks][2];
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_ps();
  const uint8_t* pair_start = weight + b0 * walk.count * kSuperblockBytes<kBits>;
  for (int64_t sb = 0; sb < walk.count; ++sb) {
    for (int b = 0; b < kBlocks; ++b) {
      const uint8_t* header = pair_start + (sb * walk.width + b) * kSuperblockBytes<kBits>;
      for (int lanes = 0; lanes < 2; ++lanes) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(header + lanes * 16)));
        __m256 dmin = _mm256_setzero_ps();
        if constexpr (kBits == 2)
          dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(header + 32 + lanes * 16)));
        for (int64_t gi = 0; gi < kSuperblockGroups; ++gi) {
          const int64_t g = sb * kSuperblockGroups + gi;
          const uint8_t* group = header + kHeaderBytes<kBits> + gi * kGroupBytes<kBits>;
          __m256i codes[8];
          for (int step = 0; step < 8; ++step) codes[step] = step_codes<kBits>(group, step, lanes);
          __m256i sc[2], mn[2];
          for (int h = 0; h < 2; ++h) {
            const __m128i bytes = _mm_loadl_epi64(
                reinterpret_cast<const __m128i*>(group + kLowBytes + kPlaneBytes<kBits> + 16 * h + 8 * lanes));
            if constexpr (kBits == 3) {
              sc[h] = _mm256_cvtepi8_epi32(bytes);
            } else {
              const __m256i packed = _mm256_cvtepu8_epi32(bytes);
              sc[h] = _mm256_and_si256(packed, _mm256_set1_epi32(0x0F));
              mn[h] = _mm256_srli_epi32(packed, 4);
            }
          }
          for (int r = 0; r < kRows; ++r) {
            const int8_t* row = x.codes + (m0 + r) * K + g * kGroup;
            const int64_t index = (m0 + r) * groups + g;
            __m256i total = _mm256_setzero_si256(), mins_total = _mm256_setzero_si256();
            for (int h = 0; h < 2; ++h) {
              __m256i sums = _mm256_setzero_si256();
              for (int step = 4 * h; step < 4 * h + 4; step += 2) {
                int32_t four[2];
                std::memcpy(four, row + 4 * step, 8);
#if defined(__AVXVNNI__)
                sums = _mm256_dpbusd_avx_epi32(sums, codes[step], _mm256_set1_epi32(four[0]));
                sums = _mm256_dpbusd_avx_epi32(sums, codes[step + 1], _mm256_set1_epi32(four[1]));
#else
                // two steps in int16: at most 2 * 2 * 7 * 127 < 2^15
                const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(codes[step], _mm256_set1_epi32(four[0])),
                                                       _mm256_maddubs_epi16(codes[step + 1], _mm256_set1_epi32(four[1])));
                sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, ones));
#endif
              }
              const __m256i a = _mm256_set1_epi32(half_sums[2 * index + h]);
              if constexpr (kBits == 3) {
                total = _mm256_add_epi32(total, _mm256_mullo_epi32(sc[h], _mm256_sub_epi32(sums, _mm256_slli_epi32(a, 2))));
              } else {
                total = _mm256_add_epi32(total, _mm256_mullo_epi32(sc[h], sums));
                mins_total = _mm256_add_epi32(mins_total, _mm256_mullo_epi32(mn[h], a));
              }
            }
            const __m256 s = _mm256_set1_ps(x.scales[index]);
            acc[r][b][lanes] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, s), acc[r][b][lanes]);
            if constexpr (kBits == 2)
              acc[r][b][lanes] =
                  _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins_total), _mm256_mul_ps(dmin, s), acc[r][b][lanes]);
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
                                   const uint8_t* sub_scales, const QuantizedRows& x, const int32_t* half_sums,
                                   int64_t index) {
  for (int lane = 0; lane < kBlockRows; ++lane) {
    c10::Half d;
    std::memcpy(&d, header + 2 * lane, 2);
    int32_t total = 0, mins_total = 0;
    for (int h = 0; h < 2; ++h) {
      const int32_t a = half_sums[2 * index + h];
      if constexpr (kBits == 3) {
        total += static_cast<int8_t>(sub_scales[16 * h + lane]) * (sums[h][lane] - 4 * a);
      } else {
        total += (sub_scales[16 * h + lane] & 0x0F) * sums[h][lane];
        mins_total += (sub_scales[16 * h + lane] >> 4) * a;
      }
    }
    acc[lane] += static_cast<float>(total) * (static_cast<float>(d) * x.scales[index]);
    if constexpr (kBits == 2) {
      c10::Half dmin;
      std::memcpy(&dmin, header + 32 + 2 * lane, 2);
      acc[lane] -= static_cast<float>(mins_total) * (static_cast<float>(dmin) * x.scales[index]);
    }
  }
}

template <int kBits, int kRows, int kBlocks>
void lowbit_tile(const QuantizedRows& x, const int32_t* half_sums, const uint8_t* weight, float* out, int64_t m0,
                 int64_t b0, int64_t N, int64_t K, const Walk& walk) {
  const int64_t groups = x.groups;
  float acc[kRows][kBlocks][kBlockRows] = {};
  const uint8_t* pair_start = weight + b0 * walk.count * kSuperblockBytes<kBits>;
  for (int64_t sb = 0; sb < walk.count; ++sb) {
    for (int b = 0; b < kBlocks; ++b) {
      const uint8_t* header = pair_start + (sb * walk.width + b) * kSuperblockBytes<kBits>;
      for (int64_t gi = 0; gi < kSuperblockGroups; ++gi) {
        const int64_t g = sb * kSuperblockGroups + gi;
        const uint8_t* group = header + kHeaderBytes<kBits> + gi * kGroupBytes<kBits>;
        uint8_t codes[8][kBlockRows][4];  // [step, output row, feature]
        for (int step = 0; step < 8; ++step)
          for (int lane = 0; lane < kBlockRows; ++lane)
            for (int j = 0; j < 4; ++j) {
              uint8_t code = (group[(step / 4) * 64 + lane * 4 + j] >> (2 * (step % 4))) & 3;
              if constexpr (kBits == 3) code |= ((group[kLowBytes + lane * 4 + j] >> step) & 1) << 2;
              codes[step][lane][j] = code;
            }
        for (int r = 0; r < kRows; ++r) {
          const int8_t* row = x.codes + (m0 + r) * K + g * kGroup;
          int32_t sums[2][kBlockRows] = {};
          for (int step = 0; step < 8; ++step)
            for (int lane = 0; lane < kBlockRows; ++lane)
              for (int j = 0; j < 4; ++j)
                sums[step / 4][lane] += static_cast<int32_t>(codes[step][lane][j]) * row[4 * step + j];
          scale_group<kBits>(acc[r][b], sums, header, group + kLowBytes + kPlaneBytes<kBits>, x, half_sums,
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

template <int kBits, int kBlocks, int... kRows>
constexpr auto lowbit_tiles(std::integer_sequence<int, kRows...>) {
  using Tile = void (*)(const QuantizedRows&, const int32_t*, const uint8_t*, float*, int64_t, int64_t, int64_t,
                        int64_t, const Walk&);
  return std::array<Tile, sizeof...(kRows) + 1>{nullptr, &lowbit_tile<kBits, kRows + 1, kBlocks>...};
}

// rows [m_begin, m_end) in full tiles of kMaxRows and the rest
template <int kBits, int kBlocks>
void lowbit_rows(const QuantizedRows& x, const int32_t* half_sums, const uint8_t* weight, float* out, int64_t m_begin,
                 int64_t m_end, int64_t b0, int64_t N, int64_t K, const Walk& walk) {
  static constexpr auto tiles = lowbit_tiles<kBits, kBlocks>(std::make_integer_sequence<int, kMaxRows>());
  for (int64_t m = m_begin; m < m_end; m += kMaxRows)
    tiles[std::min<int64_t>(m_end - m, kMaxRows)](x, half_sums, weight, out, m, b0, N, K, walk);
}

// x [M, K] bfloat16 or float32; weight packed for kBits; float32 out [M, N]
template <int kBits>
at::Tensor lowbit_linear(const char* name, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              name, ": x must be a contiguous [rows, in_features] bfloat16 or float32 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  constexpr int64_t kSuperblock = kGroup * kSuperblockGroups;
  TORCH_CHECK(K > 0 && K % kSuperblock == 0, name, ": in_features must be a positive multiple of ", kSuperblock,
              ", got ", K);
  const int64_t count = K / kSuperblock;
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() && weight.dim() == 2 &&
                  weight.size(1) == count * kSuperblockBytes<kBits>,
              name, ": weight must be a contiguous [out_features / 16, in_features / ", kSuperblock, " * ",
              kSuperblockBytes<kBits>, "] uint8 tensor");
  const int64_t N = weight.size(0) * kBlockRows;
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return out;
  const QuantizedRows rows = quantize_activation_rows(x);
  const int32_t* half_sums = half_group_sums(rows, M, K);
  const uint8_t* packed = weight.data_ptr<uint8_t>();
  float* result = out.data_ptr<float>();
  for_each_tile(M, N, [&](int64_t m, int64_t m_end, int64_t b0, int width) {
    const Walk walk{count, width};
    if (width == 2)
      lowbit_rows<kBits, 2>(rows, half_sums, packed, result, m, m_end, b0, N, K, walk);
    else
      lowbit_rows<kBits, 1>(rows, half_sums, packed, result, m, m_end, b0, N, K, walk);
  });
  return out;
}

}  // namespace
}  // namespace lowbit

at::Tensor int2_linear(const at::Tensor& x, const at::Tensor& weight) {
  return lowbit::lowbit_linear<2>("int2_linear", x, weight);
}

at::Tensor int3_linear(const at::Tensor& x, const at::Tensor& weight) {
  return lowbit::lowbit_linear<3>("int3_linear", x, weight);
}

}  // namespace TOKENLOOM_CPU_NAMESPACE

TOKENLOOM_LIBRARY_FRAGMENT(m) {
  m.def("int2_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("int3_linear(Tensor x, Tensor weight) -> Tensor");
}

TOKENLOOM_LIBRARY_IMPL_CPU(m) {
  m.impl("int2_linear", &TOKENLOOM_CPU_NAMESPACE::int2_linear);
  m.impl("int3_linear", &TOKENLOOM_CPU_NAMESPACE::int3_linear);
}
