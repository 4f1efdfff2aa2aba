// Would a Q4_K weight decode faster in a layout with Q4_K's own scales (4.625 bits a weight)
// than in tokenloom's int4 layout (5 bits)? One decode row (a c=1 step) against a 1.7B model's
// Q4_K matmuls, each thread's block pairs read two at a time (cpu_qlinear.h's
// for_each_pair_in_two_streams) by a copy of the AVX-512 int4 tile's arithmetic, in three layouts
// of 16 output rows x 32 input features a group:
//   int4         tokenloom's (cpu_qlinear.cpp): 256 bytes of nibbles, then d[16] and m[16] as
//                float16: 320 bytes a group, the pair's two blocks' groups side by side
//   interleaved  per 8 groups a header (d[16], dmin[16] float16 for each of the pair's blocks,
//                128 bytes), then each group's nibbles and sc[16], mn[16] as uint8 (288 bytes),
//                the pair's two blocks' groups side by side: 4.625 bits; the tile forms each
//                group's scales as d * float(sc) and dmin * float(mn) (exact in float32)
//   per-block    the same bytes with each block's superblock whole, the pair's blocks in turn
//                (as cpu_kquant.cpp stores Q5_K/Q6_K), prefetched in each block's own order
// Random codes (the time does not depend on them), float16 scales of 1/256. Each layout's
// matmuls are made COPIES times (far past the last-level cache), timed in turn, 7 rounds.
// Measured on the Intel Xeon (AMX, 2 cores; session 29), ms for 24 layers, two runs of 7 rounds
// at 24 copies: int4 27.6-29.1 (medians 27.9 and 27.9), interleaved 27.2-28.6 (27.4 and 28.0),
// per-block 28.0-30.9; at one thread (12 copies) int4 read 18.1 GB/s, interleaved 16.3, per-block
// 15.8. A core's tile is bound by its instructions per byte (the float conversions and the
// multiply a group the smaller layout adds), so its 7.5 % fewer bytes bought 0-2 % of these
// matmuls' time on two cores and cost 2.5 % on one: not worth a second 4-bit layout through every
// kernel level, AMX and the experts. The int4 layout stays.
// Build and run:
//   g++ -O2 -march=native -fopenmp benchmarks/int4_scale_layouts.cpp -o /tmp/int4_scale_layouts
//   OMP_NUM_THREADS=2 OMP_PROC_BIND=true /tmp/int4_scale_layouts [COPIES]   # default 24
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

enum Layout { kInt4 = 0, kInterleaved = 1, kPerBlock = 2 };
const char* const kNames[] = {"int4", "interleaved", "per-block"};

constexpr int64_t kInt4GroupBytes = 320;  // one block's group in the int4 layout
constexpr int64_t kScaledGroupBytes = 288;  // nibbles, sc[16], mn[16]
constexpr int64_t kHeaderBytes = 64;  // one block's d[16], dmin[16]
constexpr int64_t kBlockSuperblockBytes = kHeaderBytes + 8 * kScaledGroupBytes;
constexpr int64_t kInt4PrefetchBytes = 4 * 2 * kInt4GroupBytes;  // cpu_qlinear.cpp's 4 groups of a pair
constexpr int64_t kPerBlockPrefetchBytes = 4 * kScaledGroupBytes;  // 4 groups of the block's own

// the activation row: codes per feature, per group of 32 the scale s and s * (sum of codes)
struct Row {
  const int8_t* codes;
  const float* scales;
  const float* scaled_sums;
};

// bytes a pair of blocks takes in `layout` for K input features
int64_t pair_bytes(Layout layout, int64_t K) {
  return layout == kInt4 ? K / 32 * 2 * kInt4GroupBytes : K / 256 * 2 * kBlockSuperblockBytes;
}

// one row times two pairs of blocks (starts[0], starts[1]): 64 outputs
template <Layout kLayout>
void two_pairs(const Row& x, const uint8_t* const* starts, float* out, int64_t K) {
  constexpr int kBlocks = 4;  // two pairs of two
  constexpr int64_t kGroupBytes = kLayout == kInt4 ? kInt4GroupBytes : kScaledGroupBytes;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  __m512 acc[kBlocks], d_super[kBlocks], dmin_super[kBlocks];
  for (int b = 0; b < kBlocks; ++b) acc[b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / 32; ++g) {
    const uint8_t* group[kBlocks];
    for (int b = 0; b < kBlocks; ++b) {
      const uint8_t* pair = starts[b / 2];
      if constexpr (kLayout == kInt4) {
        group[b] = pair + (g * 2 + b % 2) * kInt4GroupBytes;
        continue;
      }
      const uint8_t* superblock = pair + (g / 8) * 2 * kBlockSuperblockBytes;
      const uint8_t* header = kLayout == kInterleaved ? superblock + (b % 2) * kHeaderBytes
                                                      : superblock + (b % 2) * kBlockSuperblockBytes;
      if (g % 8 == 0) {
        d_super[b] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(header)));
        dmin_super[b] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(header + 32)));
      }
      group[b] = kLayout == kInterleaved ? superblock + 2 * kHeaderBytes + ((g % 8) * 2 + b % 2) * kScaledGroupBytes
                                         : header + kHeaderBytes + (g % 8) * kScaledGroupBytes;
    }
    if constexpr (kLayout == kPerBlock) {
      // each block's bytes ahead in its own order: its next superblock is a pair's superblock on
      constexpr int64_t kOwn = kBlockSuperblockBytes;
      for (int b = 0; b < kBlocks; ++b) {
        const uint8_t* superblock = starts[b / 2] + (g / 8) * 2 * kOwn + (b % 2) * kOwn;
        const int64_t ahead = (group[b] - superblock) + kPerBlockPrefetchBytes;
        const uint8_t* target = superblock + ahead / kOwn * 2 * kOwn + ahead % kOwn;
        for (int64_t line = 0; line < kGroupBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(target + line), _MM_HINT_T0);
      }
    } else {
      for (int s = 0; s < 2; ++s)
        for (int64_t line = 0; line < 2 * kGroupBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(group[2 * s] + kInt4PrefetchBytes + line), _MM_HINT_T0);
    }
    __m512i sums[kBlocks];
    for (int b = 0; b < kBlocks; ++b) sums[b] = _mm512_setzero_si512();
    for (int step = 0; step < 8; step += 2) {  // two steps of 4 features a 64-byte load
      int32_t features[2];
      std::memcpy(features, x.codes + g * 32 + step * 4, 8);
      const __m512i first = _mm512_set1_epi32(features[0]), second = _mm512_set1_epi32(features[1]);
      for (int b = 0; b < kBlocks; ++b) {
        const __m512i bytes = _mm512_loadu_si512(group[b] + step / 2 * 64);
        sums[b] = _mm512_dpbusd_epi32(sums[b], _mm512_and_si512(bytes, low_nibbles), first);
        sums[b] = _mm512_dpbusd_epi32(sums[b], _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles), second);
      }
    }
    const __m512 s = _mm512_set1_ps(x.scales[g]), scaled_sum = _mm512_set1_ps(x.scaled_sums[g]);
    for (int b = 0; b < kBlocks; ++b) {
      const uint8_t* scales = group[b] + 256;
      if constexpr (kLayout == kInt4) {  // value = d code + m
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32)));
        acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[b]), _mm512_mul_ps(d, s), acc[b]);
        acc[b] = _mm512_fmadd_ps(m, scaled_sum, acc[b]);
      } else {  // value = (d sc) code - (dmin mn)
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales));
        const __m128i mn = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 16));
        const __m512 d = _mm512_mul_ps(d_super[b], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
        const __m512 dmin_mn = _mm512_mul_ps(dmin_super[b], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)));
        acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[b]), _mm512_mul_ps(d, s), acc[b]);
        acc[b] = _mm512_fnmadd_ps(dmin_mn, scaled_sum, acc[b]);
      }
    }
  }
  for (int b = 0; b < kBlocks; ++b) _mm512_storeu_ps(out + 16 * b, acc[b]);
}

struct Matmul {
  int64_t N, K;
  uint8_t* weight;
};

template <Layout kLayout>
void row_times(const Row& x, const Matmul& matmul, float* out) {
  const int64_t bytes = pair_bytes(kLayout, matmul.K), pairs = matmul.N / 32;
#pragma omp parallel
  {
    const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t begin = thread * pairs / threads, end = (thread + 1) * pairs / threads, half = (end - begin) / 2;
    for (int64_t i = 0; i < half; ++i) {  // (an odd pair of a range is left out: equal in every layout)
      const uint8_t* starts[2] = {matmul.weight + (begin + i) * bytes, matmul.weight + (begin + half + i) * bytes};
      float outputs[64];
      two_pairs<kLayout>(x, starts, outputs, matmul.K);
      std::memcpy(out + (begin + i) * 32, outputs, sizeof(float) * 32);
      std::memcpy(out + (begin + half + i) * 32, outputs + 32, sizeof(float) * 32);
    }
  }
}

void run(Layout layout, const Row& x, const Matmul& matmul, float* out) {
  if (layout == kInt4) row_times<kInt4>(x, matmul, out);
  if (layout == kInterleaved) row_times<kInterleaved>(x, matmul, out);
  if (layout == kPerBlock) row_times<kPerBlock>(x, matmul, out);
}

// a weight of N x K in `layout`: random codes, float16 scales of 1/256 (no denormals)
uint8_t* make_weight(Layout layout, int64_t N, int64_t K, int64_t* size) {
  *size = N / 32 * pair_bytes(layout, K);
  const int64_t huge = int64_t{2} << 20;
  uint8_t* weight = static_cast<uint8_t*>(std::aligned_alloc(huge, (*size + huge - 1) / huge * huge));
  madvise(weight, *size, MADV_HUGEPAGE);
  for (int64_t i = 0; i < *size; ++i) weight[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
  const auto set_halves = [&](int64_t offset, int count) {
    for (int j = 0; j < count; ++j) weight[offset + 2 * j] = 0, weight[offset + 2 * j + 1] = 0x1C;
  };
  if (layout == kInt4) {
    for (int64_t offset = 256; offset < *size; offset += kInt4GroupBytes) set_halves(offset, 32);
  } else if (layout == kInterleaved) {
    for (int64_t offset = 0; offset < *size; offset += 2 * kBlockSuperblockBytes) set_halves(offset, 64);
  } else {
    for (int64_t offset = 0; offset < *size; offset += kBlockSuperblockBytes) set_halves(offset, 32);
  }
  return weight;
}

}  // namespace

int main(int argc, char** argv) {
  const int copies = argc > 1 ? std::atoi(argv[1]) : 24;
  // a 1.7B layer's Q4_K matmuls: q and k, o, gate and up, down ([N, K])
  const int64_t shapes[][2] = {{4096, 2048}, {2048, 2048}, {16384, 2048}, {2048, 8192}};
  std::vector<Matmul> matmuls[3];
  double bytes[3] = {0, 0, 0};
  for (int layout = 0; layout < 3; ++layout)
    for (int copy = 0; copy < copies; ++copy)
      for (const auto& shape : shapes) {
        int64_t size = 0;
        uint8_t* weight = make_weight(static_cast<Layout>(layout), shape[0], shape[1], &size);
        matmuls[layout].push_back({shape[0], shape[1], weight});
        bytes[layout] += size;
      }
  std::vector<int8_t> codes(8192, 3);
  std::vector<float> scales(256, 0.01f), scaled_sums(256, 0.5f);
  const Row x{codes.data(), scales.data(), scaled_sums.data()};
  std::vector<float> out(16384);
  for (int round = 0; round < 7; ++round)
    for (int layout = 0; layout < 3; ++layout) {
      const auto started = std::chrono::steady_clock::now();
      for (const Matmul& matmul : matmuls[layout]) run(static_cast<Layout>(layout), x, matmul, out.data());
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
      std::printf("%-12s %5.0f MB in %6.2f ms = %4.1f GB/s; 24 layers %.2f ms\n", kNames[layout],
                  bytes[layout] / 1e6, ms, bytes[layout] / ms / 1e6, ms / copies * 24);
    }
  return 0;
}
