// AMX-BF16 "prompt path" GEMM shared by the quantized-weight kernels (cpu_qlinear.cpp's
// int4_linear_bf16, cpu_kquant.cpp's int5_linear_bf16 and int6_linear_bf16; cpu_moe.cpp may chain
// it later): bfloat16 rows x [M, K] times a weight of N outputs stored in 16-output blocks (the
// int4 / k-quant layouts, blocks in pairs), out[m, n] = sum_k x[m, k] * w[n, k] accumulated in
// float32 over the whole K by `tdpbf16ps`, each weight value w a bfloat16 the layout's own code
// and scales give (computed in float32, rounded to nearest even once).
//
// Why: the int8 paths (cpu_qlinear.cpp's AMX-INT8 tile included) scale every group of 32
// features' integer sums into float accumulators, so AMX saves only their integer products. For
// many rows (a prompt's) it pays instead to dequantize each pair of blocks into a bfloat16 panel
// [K x 32 outputs] laid out as AMX B tiles, once per block of rows, and run those rows over it
// with no per-group epilogue. Decode rows keep the int8 paths; which rows take this one is the
// caller's choice, by row role and never by batch size, and a row's bits here do not depend on
// the other rows, their number, its position or the thread count (each output is one thread's,
// over the same tiles in the same K order, K split at fixed points; an AMX row's result reads
// only its own A row).
//
// Panel layout (one per block pair and chunk of K, the calling worker thread's buffer): for each
// step of 32 features k0 = 32 s, per block b (1 or 2): a B tile of 16 rows x 64 bytes, row r
// holding for each of the block's 16 outputs n the bfloat16 pair (w[n, k0 + 2r], w[n, k0 + 2r +
// 1]). A layout's dequantizer fills it with bf16_panel_step: a 64-byte vector of codes with 4
// features per output lane (the int4 layout's "step") and each output's float scale and offset
// (bf16_panel_scales).
//
// Tiles: 0-3 float32 accumulators [16 rows, 16 outputs] (row tile i, block b: 2 i + b); 4-5 rows
// of x [16 rows, 32 features] read in place (stride K; the last partial chunk of 32 rows from a
// zero-padded copy); 6-7 the pair's two B tiles. Rows go in blocks of about 1 MiB of x (which
// stay in L2 while each pair of the thread's range runs over them), K in chunks of up to 2048
// features, each block in chunks of 32 rows (16 when no more are left). Only in the avx512 build
// on a CPU with AMX-BF16, AVX512-BF16 and AVX512-VBMI (the panels' byte gathers; amx_bf16_usable,
// cpu_amx.h); tdpbf16ps reads bfloat16 denormals as zero (prompt activations and GGUF scales are
// far from them).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_amx.h"
#include "cpu_namespace.h"
#include "cpu_pages.h"

namespace TOKENLOOM_CPU_NAMESPACE {

// whether this call may take the AMX-BF16 panel kernels: the build and CPU have them and
// TOKENLOOM_CPU_AMX does not switch AMX off
inline bool bf16_amx_enabled() { return amx_bf16_usable() && !amx_switched_off(); }

#if defined(TOKENLOOM_AMX_BUILD)

constexpr int64_t kPanelFeatures = 32;  // features per panel step (one B tile's rows hold 16 pairs)
constexpr int64_t kPanelTileBytes = 1024;  // one block's B tile of a step: 16 x 64 bytes
constexpr int64_t kPanelChunkRows = 32;  // rows per pass over a panel: two A tiles
// bytes of x rows (of one chunk of features) that each panel is run over before the next pair's
// panel: the rows stay in L2 (2 MiB a core here, beside a panel of 128 KiB) from one pair to the
// next, each panel dequantized once per block of rows. Measured on one thread, int4 2048 -> 2048
// at 2048 rows: 768 KiB, 1 MiB and 1.5 MiB alike (1 MiB best), all rows at once (x from L3) 2.1x
// the time, 32 rows (a dequantization per 32 rows) 2.2x
constexpr int64_t kPanelRowBlockBytes = 1 << 20;
// features per panel, at most: a longer K (8192 -> 2048, down) is split into chunks whose sums are
// stored and loaded back between them, so that a block of rows is 256 rows whatever K (the whole K
// at once left 64 rows a block at K = 8192, and four dequantizations per pair at 256 rows)
constexpr int64_t kPanelChunkFeatures = 2048;

// a block's per-output scale and offset, each duplicated into the lanes of the output's feature
// pairs: [0] lanes 2 n + i for outputs n = 0..7, [1] for n = 8..15 (bf16_panel_step)
struct PanelScales {
  __m512 scale[2], offset[2];
};

__attribute__((target("avx512bf16,avx512bw,avx512f"))) inline PanelScales bf16_panel_scales(__m512 scale,
                                                                                           __m512 offset) {
  const __m512i low = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
  return {{_mm512_permutexvar_ps(low, scale), _mm512_permutexvar_ps(high, scale)},
          {_mm512_permutexvar_ps(low, offset), _mm512_permutexvar_ps(high, offset)}};
}

// bf16_panel_step's vpermb indices: for feature pair p and outputs 8 h.., byte 4 lane takes byte
// 2 p + lane % 2 of output 8 h + lane / 2's 32-bit lane (the other bytes are masked to zero)
struct PanelGatherIndices {
  alignas(64) uint8_t bytes[2][2][64];
};

constexpr PanelGatherIndices panel_gather_indices() {
  PanelGatherIndices table{};
  for (int p = 0; p < 2; ++p)
    for (int h = 0; h < 2; ++h)
      for (int lane = 0; lane < 16; ++lane)
        table.bytes[p][h][4 * lane] = static_cast<uint8_t>(4 * (8 * h + lane / 2) + 2 * p + lane % 2);
  return table;
}

inline constexpr PanelGatherIndices kPanelGather = panel_gather_indices();

// the B tile rows 2 s' and 2 s' + 1 of one block for a step s' of 4 features (rows + 0, rows +
// 64): `codes` holds per output lane n (32 bits) its 4 features' unsigned codes, one per byte, and
// the value of code c is c * scale[n] + offset[n] in float32 (one fused rounding), then rounded
// to bfloat16 to nearest even by vcvtne2ps2bf16 (which flushes float32 denormals: no layout's
// values reach them, their scales are float16 products). Each feature pair's codes are gathered
// in the B tile's order before they are widened (a masked vpermb puts byte 2 p + i of output n's
// lane into lane 2 n + i, the scales duplicated alike by bf16_panel_scales), so vcvtne2ps2bf16
// writes a row as it is stored: per step 4 vpermb, 4 conversions, 4 FMAs and 2 roundings. (Bytes
// extracted by shifts and masks, rounded in feature order and interleaved by vpermw took ~25%
// longer: 0.46 against 0.35 ms for 16 rows x [2048 -> 2048], nearly all dequantization.)
__attribute__((target("avx512bf16,avx512bw,avx512f,avx512vbmi"))) inline void bf16_panel_step(
    __m512i codes, const PanelScales& scales, uint8_t* rows) {
  for (int pair = 0; pair < 2; ++pair) {
    __m512 values[2];
    for (int half = 0; half < 2; ++half) {
      const __m512i gathered = _mm512_maskz_permutexvar_epi8(
          0x1111111111111111ull, _mm512_load_si512(kPanelGather.bytes[pair][half]), codes);
      values[half] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(gathered), scales.scale[half], scales.offset[half]);
    }
    _mm512_store_si512(rows + pair * 64, (__m512i)_mm512_cvtne2ps_pbh(values[1], values[0]));
  }
}

// tiles 0-3: float32 sums [16 rows, 16 outputs]; 4-5: rows of x [16, 32 bfloat16]; 6-7: B tiles
// [16 feature pairs, 16 outputs x 2 bfloat16]
__attribute__((target("amx-tile"))) inline void bf16_amx_configure() {
  static constexpr uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
  static constexpr uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
  amx_configure(rows, colsb);
}

// 16 kRowTiles rows of x (from `a`, row stride a_stride bytes) times the kBlocks blocks of a
// panel of `steps` steps, added to c[r, 16 b + n] (row stride 32 floats) when `accumulate`, else
// written there; the tiles configured by bf16_amx_configure. (Sums stored and loaded back between
// calls are the same floats: a row's bits do not depend on where its K is split.)
template <int kRowTiles, int kBlocks>
__attribute__((target("amx-tile,amx-bf16"))) void bf16_amx_rows_times_panel(const uint8_t* a, int64_t a_stride,
                                                                             const uint8_t* panel, int64_t steps,
                                                                             float* c, bool accumulate) {
  constexpr int64_t stride = 2 * 16 * sizeof(float);
  // (the tile instructions are asm statements without a memory clobber: fence the compiler's own
  // reads and writes of the panel and of c around them)
  asm volatile("" ::: "memory");
  if (accumulate) {
    _tile_loadd(0, c, stride);
    if constexpr (kBlocks == 2) _tile_loadd(1, c + 16, stride);
    if constexpr (kRowTiles == 2) {
      _tile_loadd(2, c + 16 * 32, stride);
      if constexpr (kBlocks == 2) _tile_loadd(3, c + 16 * 32 + 16, stride);
    }
  } else {
    _tile_zero(0);
    if constexpr (kBlocks == 2) _tile_zero(1);
    if constexpr (kRowTiles == 2) {
      _tile_zero(2);
      if constexpr (kBlocks == 2) _tile_zero(3);
    }
  }
  const uint8_t* a1 = a + 16 * a_stride;
  for (int64_t s = 0; s < steps; ++s) {
    const uint8_t* b = panel + s * kBlocks * kPanelTileBytes;
    _tile_loadd(6, b, 64);
    if constexpr (kBlocks == 2) _tile_loadd(7, b + kPanelTileBytes, 64);
    _tile_loadd(4, a + s * 64, a_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kBlocks == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (kRowTiles == 2) {
      _tile_loadd(5, a1 + s * 64, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (kBlocks == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, stride);
  if constexpr (kBlocks == 2) _tile_stored(1, c + 16, stride);
  if constexpr (kRowTiles == 2) {
    _tile_stored(2, c + 16 * 32, stride);
    if constexpr (kBlocks == 2) _tile_stored(3, c + 16 * 32 + 16, stride);
  }
  asm volatile("" ::: "memory");
}

// x [M, K] bfloat16 (as uint16_t bits; K a multiple of k_align, itself a multiple of 32) times the
// N / 16 blocks of a weight: at::parallel_for over the block pairs (an odd last block alone),
// each thread a contiguous range of them. Loops, from the outside: blocks of rows (about
// kPanelRowBlockBytes of x), chunks of features (at most kPanelChunkFeatures, multiples of
// k_align), the thread's pairs, chunks of 32 rows. fill_panel(b0, blocks, k_begin, k_end, panel)
// writes the panel of blocks [b0, b0 + blocks) (2, or 1 for the odd last) and features [k_begin,
// k_end); a row chunk's sums over the whole K are given to store_rows(c, m, rows, b0, blocks) as
// c[r, 16 b + n] (row stride 32 floats) to write out.
template <typename FillPanel, typename StoreRows>
void bf16_amx_panel_gemm(const uint16_t* x, int64_t M, int64_t N, int64_t K, int64_t k_align,
                         const FillPanel& fill_panel, const StoreRows& store_rows) {
  const int64_t blocks = N / 16;
  // the last partial chunk of rows, zero-padded to 32 (A tiles read 16 or 32 rows whatever is left)
  const int64_t full_rows = M - M % kPanelChunkRows;
  std::vector<uint16_t> tail;
  if (full_rows < M) {
    tail.assign(kPanelChunkRows * K, 0);
    std::memcpy(tail.data(), x + full_rows * K, (M - full_rows) * K * sizeof(uint16_t));
  }
  const uint16_t* tail_rows = tail.data();
  const int64_t chunk_features = std::min(K, std::max(k_align, kPanelChunkFeatures / k_align * k_align));
  const int64_t k_chunks = (K + chunk_features - 1) / chunk_features;
  const int64_t block_rows =
      std::max(kPanelChunkRows, kPanelRowBlockBytes / (chunk_features * 2) / kPanelChunkRows * kPanelChunkRows);
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    // the calling thread's panel, and its pairs' float32 sums for a block of rows (one pair's
    // when K is one chunk: nothing to carry from one chunk to the next)
    thread_local std::vector<uint8_t> panel_buffer;
    thread_local std::vector<float> sums_buffer;
    panel_buffer.resize(chunk_features / kPanelFeatures * 2 * kPanelTileBytes + 64);
    const int64_t pair_sums = block_rows * 32;
    sums_buffer.resize(pair_sums * (k_chunks > 1 ? end - begin : 1) + 16);
    uint8_t* panel =
        reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(panel_buffer.data()) + 63) & ~uintptr_t{63});
    float* sums = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sums_buffer.data()) + 63) & ~uintptr_t{63});
    const int64_t a_stride = K * sizeof(uint16_t);
    bf16_amx_configure();  // tile state is per thread
    for (int64_t m_block = 0; m_block < M; m_block += block_rows) {
      const int64_t m_block_end = std::min(M, m_block + block_rows);
      for (int64_t chunk = 0; chunk < k_chunks; ++chunk) {
        const int64_t k_begin = chunk * chunk_features, k_end = std::min(K, k_begin + chunk_features);
        const int64_t steps = (k_end - k_begin) / kPanelFeatures;
        const bool last = chunk == k_chunks - 1;
        for (int64_t pair = begin; pair < end; ++pair) {
          const int64_t b0 = 2 * pair;
          const int width = b0 + 1 < blocks ? 2 : 1;
          fill_panel(b0, width, k_begin, k_end, panel);
          float* pair_rows = sums + (k_chunks > 1 ? (pair - begin) * pair_sums : 0);
          for (int64_t m = m_block; m < m_block_end; m += kPanelChunkRows) {
            const int64_t rows = std::min(kPanelChunkRows, M - m);
            const uint8_t* a = reinterpret_cast<const uint8_t*>((m < full_rows ? x + m * K : tail_rows) + k_begin);
            float* c = pair_rows + (m - m_block) * 32;
            if (rows > 16) {
              if (width == 2)
                bf16_amx_rows_times_panel<2, 2>(a, a_stride, panel, steps, c, chunk > 0);
              else
                bf16_amx_rows_times_panel<2, 1>(a, a_stride, panel, steps, c, chunk > 0);
            } else {
              if (width == 2)
                bf16_amx_rows_times_panel<1, 2>(a, a_stride, panel, steps, c, chunk > 0);
              else
                bf16_amx_rows_times_panel<1, 1>(a, a_stride, panel, steps, c, chunk > 0);
            }
            if (last) store_rows(static_cast<const float*>(c), m, rows, b0, width);
          }
        }
      }
    }
    amx_release();
  });
}

#endif

}  // namespace TOKENLOOM_CPU_NAMESPACE
