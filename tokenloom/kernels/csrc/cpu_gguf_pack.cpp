// GGUF blocks repacked at load, straight from the memory-mapped file into the kernels' layouts, in
// every build (one per ISA level, see cpu_namespace.h); each takes row shards (uint8 [rows_i, bytes
// per row], rows stacked in list order: a layer's q, k and v, or a few experts of a stacked tensor):
//   `gguf_pack_int4(shards, ggml_types)`: Q4_0, Q4_1 or Q4_K rows -> int4_linear's weight
//   (cpu_qlinear.cpp: per block of 16 rows and group of 32 features, 4 steps of [16 rows, 4 bytes]
//   of nibbles, the 16 rows' d then m as float16), the bytes tokenloom/kernels/int4_matmul.py's
//   torch packer makes from the same codes and float32 scales.
//   `gguf_pack_int6(shards)`: Q6_K rows -> int6_linear's weight (cpu_kquant.cpp: per block of 16
//   rows and superblock of 256 features, the 16 rows' d as float16, then per group of 32 the code
//   nibbles, two planes of high bits and the sub-scales sc[2][16]), the bytes
//   tokenloom/kernels/kquant_matmul.py's pack_int6 makes from the same codes and scales.
// In both layouts the blocks are stored in pairs, unit (group or superblock) by unit, an odd last
// block alone after the pairs.
// Both replace torch chains of strided uint8 operations and concatenations that took most of a 1 GB
// file's start-up (and a 4 GB mixture of experts'); each is one at::parallel_for writing its output once.
//
// The sources build with -ffast-math: the float32 products below are kept in ggml's order and
// rounded as torch rounds them by passing each through a volatile (no reassociation can cancel
// `(8 s - o) - 8 s`), and float16 is made by integer code (round to nearest even), so the bytes
// do not depend on the compiler's licence.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_namespace.h"

#ifdef __F16C__
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace TOKENLOOM_CPU_NAMESPACE {

// (a named namespace: every source is one translation unit, whose anonymous namespaces merge)
namespace gguf_pack {

// ggml's type ids (tokenloom/builtin_plugins/quantization/ggml_types.py)
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ4_K = 12, kQ6_K = 14;
constexpr int64_t kGroup = 32;          // features per group of the int4 layout
constexpr int64_t kBlockRows = 16;      // output rows per block of the int4 layout
constexpr int64_t kGroupBytes = 320;    // 16 rows x 32 codes in nibbles, 16 d, 16 m
constexpr float kCodeOffset = 8.0f;     // int4_matmul.CODE_OFFSET
constexpr int64_t kQ6KBytes = 210;

inline float load_f16(const uint8_t* bytes) {
  uint16_t bits;
  std::memcpy(&bits, bytes, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);  // exact: float32 holds every float16
}

// float32 -> float16 bits, rounding to nearest even (torch's .to(torch.float16)): F16C's
// conversion where the level has it (the same bits for every float32, NaNs included; the integer
// code's data-dependent branches made it most of a Q4_K weight's packing time), else in integers
inline uint16_t to_f16_bits(float value) {
#ifdef __F16C__
  return static_cast<uint16_t>(_cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT));
#else
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((magnitude >> 13) & 0x3FFu));  // NaN
  if (magnitude >= 0x47800000u) {  // >= 65536: infinity, and finite values that round past 65504
    return static_cast<uint16_t>(sign | 0x7C00u);
  }
  if (magnitude < 0x38800000u) {  // below float16's smallest normal: a subnormal (or zero)
    if (magnitude < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25: rounds to zero
    const uint32_t exponent = magnitude >> 23;
    const uint32_t mantissa = (magnitude & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - exponent;  // value = mantissa * 2^(exponent - 150), unit 2^-24
    uint32_t result = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (result & 1u))) ++result;
    return static_cast<uint16_t>(sign | result);
  }
  // normal: rebias the exponent, round the 13 dropped bits to nearest even (a carry may reach infinity)
  uint32_t result = ((magnitude >> 13) - (112u << 10));
  const uint32_t rest = magnitude & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (result & 1u))) ++result;
  return static_cast<uint16_t>(sign | result);
#endif
}

// a float32 product or difference rounded once, as torch computes it, whatever -ffast-math allows
inline float rounded(float value) {
  volatile float stored = value;
  return stored;
}

struct Shard {
  const uint8_t* data;
  int64_t row_stride;
  int64_t ggml_type;
};

// the shards of one packed weight: each output row's shard and row in it
struct Shards {
  std::vector<Shard> views;
  std::vector<int64_t> first_rows;  // the first output row of each shard
  int64_t rows = 0, features = -1;

  // shard [rows_i, bytes per row] of `type`, whose blocks hold block_values values in block_bytes
  void add(const char* name, const at::Tensor& shard, int64_t type, int64_t block_bytes, int64_t block_values) {
    TORCH_CHECK(shard.device().is_cpu() && shard.scalar_type() == at::kByte && shard.dim() == 2 && shard.stride(1) == 1,
                name, ": each shard is uint8 [rows, bytes per row] with contiguous rows");
    TORCH_CHECK(shard.size(1) % block_bytes == 0, name, ": rows are not whole blocks");
    const int64_t shard_features = shard.size(1) / block_bytes * block_values;
    TORCH_CHECK(features < 0 || shard_features == features, name, ": shards differ in row length");
    features = shard_features;
    views.push_back({shard.data_ptr<uint8_t>(), shard.stride(0), type});
    first_rows.push_back(rows);
    rows += shard.size(0);
  }

  // output row `row`'s shard and its row there
  std::pair<const Shard*, int64_t> locate(int64_t row) const {
    size_t index = first_rows.size() - 1;
    while (first_rows[index] > row) --index;
    return {&views[index], row - first_rows[index]};
  }
};

// where block `block`'s unit `unit` (a group or superblock of unit_bytes) starts in a weight of
// `blocks` blocks of `units` units: pairs of blocks interleaved unit by unit, an odd last block alone
inline int64_t unit_offset(int64_t block, int64_t unit, int64_t blocks, int64_t units, int64_t unit_bytes) {
  const int64_t paired = blocks - blocks % 2;
  if (block >= paired) return paired * units * unit_bytes + unit * unit_bytes;
  return (block / 2) * 2 * units * unit_bytes + (unit * 2 + block % 2) * unit_bytes;
}

// one lane's 32 codes of a group into [4 steps, 16 lanes, 4 bytes] of nibbles: step t, byte j holds
// features 8t + j (low nibble) and 8t + 4 + j (high)
inline void put_nibbles(uint8_t* group, int64_t lane, const uint8_t* codes) {
  for (int t = 0; t < 4; ++t)
    for (int j = 0; j < 4; ++j)
      group[t * 64 + lane * 4 + j] = static_cast<uint8_t>((codes[8 * t + j] & 0x0F) | ((codes[8 * t + 4 + j] & 0x0F) << 4));
}

// One 32-feature group `group` of one row: its 32 codes (0..15) and its float16 d and m bits,
// exactly as int4_groups + the torch packer compute them.
inline void group_codes(const Shard& shard, int64_t row, int64_t group, uint8_t codes[kGroup], uint16_t& d_bits,
                        uint16_t& m_bits) {
  const uint8_t* row_bytes = shard.data + row * shard.row_stride;
  float scale, zero;
  if (shard.ggml_type == kQ4_K) {
    const uint8_t* block = row_bytes + (group / 8) * 144;
    const int sub = static_cast<int>(group % 8);
    const uint8_t* packed = block + 4;
    int sc, mn;
    if (sub < 4) {
      sc = packed[sub] & 63;
      mn = packed[sub + 4] & 63;
    } else {
      sc = (packed[sub + 4] & 0x0F) | ((packed[sub - 4] >> 6) << 4);
      mn = (packed[sub + 4] >> 4) | ((packed[sub] >> 6) << 4);
    }
    const uint8_t* qs = block + 16 + 32 * (sub / 2);
    const int shift = 4 * (sub % 2);
    for (int i = 0; i < kGroup; ++i) codes[i] = (qs[i] >> shift) & 0x0F;
    scale = rounded(load_f16(block) * static_cast<float>(sc));
    const float offset = rounded(load_f16(block + 2) * static_cast<float>(mn));
    zero = rounded(rounded(kCodeOffset * scale) - offset);
  } else {
    const bool has_min = shard.ggml_type == kQ4_1;
    const uint8_t* block = row_bytes + group * (has_min ? 20 : 18);
    const uint8_t* qs = block + (has_min ? 4 : 2);
    for (int i = 0; i < 16; ++i) {
      codes[i] = qs[i] & 0x0F;
      codes[i + 16] = qs[i] >> 4;
    }
    scale = load_f16(block);
    // (Q4_0's zero passes through a volatile too: a known 0 - x would be -x, and -0 for x = 0)
    zero = rounded(has_min ? load_f16(block + 2) + rounded(kCodeOffset * scale) : 0.0f);
  }
  d_bits = to_f16_bits(scale);
  m_bits = to_f16_bits(rounded(zero - rounded(kCodeOffset * scale)));
}

// One Q6_K block's 256 codes (0..63) in value order: per half of 128 values, l in 0..31 -> l,
// l + 32, l + 64, l + 96 (ggml's order)
inline void q6_k_codes(const uint8_t* block, uint8_t codes[256]) {
  const uint8_t* ql = block;
  const uint8_t* qh = block + 128;
  for (int half = 0; half < 2; ++half)
    for (int l = 0; l < 32; ++l) {
      const uint8_t low0 = ql[64 * half + l], low1 = ql[64 * half + 32 + l], high = qh[32 * half + l];
      uint8_t* code = codes + 128 * half;
      code[l] = (low0 & 0x0F) | ((high & 3) << 4);
      code[32 + l] = (low1 & 0x0F) | (((high >> 2) & 3) << 4);
      code[64 + l] = (low0 >> 4) | (((high >> 4) & 3) << 4);
      code[96 + l] = (low1 >> 4) | (((high >> 6) & 3) << 4);
    }
}

}  // namespace gguf_pack

at::Tensor gguf_pack_int4(const std::vector<at::Tensor>& shards, c10::IntArrayRef ggml_types) {
  TORCH_CHECK(!shards.empty() && shards.size() == ggml_types.size(), "gguf_pack_int4: one GGML type per shard");
  gguf_pack::Shards rows_of;
  for (size_t i = 0; i < shards.size(); ++i) {
    const int64_t type = ggml_types[i];
    TORCH_CHECK(type == gguf_pack::kQ4_0 || type == gguf_pack::kQ4_1 || type == gguf_pack::kQ4_K, "gguf_pack_int4: GGML type ",
                type, " is not Q4_0, Q4_1 or Q4_K");
    const int64_t block_bytes = type == gguf_pack::kQ4_K ? 144 : (type == gguf_pack::kQ4_1 ? 20 : 18);
    rows_of.add("gguf_pack_int4", shards[i], type, block_bytes, type == gguf_pack::kQ4_K ? 256 : 32);
  }
  TORCH_CHECK(rows_of.rows % gguf_pack::kBlockRows == 0, "gguf_pack_int4: ", rows_of.rows, " rows are not a multiple of 16");
  const int64_t blocks = rows_of.rows / gguf_pack::kBlockRows, groups = rows_of.features / gguf_pack::kGroup;
  at::Tensor packed = at::empty({blocks, groups * gguf_pack::kGroupBytes}, at::kByte);
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    uint8_t codes[gguf_pack::kGroup];
    uint16_t d_bits[gguf_pack::kBlockRows], m_bits[gguf_pack::kBlockRows];
    for (int64_t block = begin; block < end; ++block) {
      std::pair<const gguf_pack::Shard*, int64_t> lanes[gguf_pack::kBlockRows];  // each of the 16 rows' shard and row
      for (int64_t lane = 0; lane < gguf_pack::kBlockRows; ++lane) lanes[lane] = rows_of.locate(block * gguf_pack::kBlockRows + lane);
      for (int64_t group = 0; group < groups; ++group) {
        uint8_t* slot = out + gguf_pack::unit_offset(block, group, blocks, groups, gguf_pack::kGroupBytes);
        for (int64_t lane = 0; lane < gguf_pack::kBlockRows; ++lane) {
          gguf_pack::group_codes(*lanes[lane].first, lanes[lane].second, group, codes, d_bits[lane], m_bits[lane]);
          gguf_pack::put_nibbles(slot, lane, codes);
        }
        std::memcpy(slot + 256, d_bits, sizeof(d_bits));
        std::memcpy(slot + 288, m_bits, sizeof(m_bits));
      }
    }
  });
  return packed;
}

at::Tensor gguf_pack_int6(const std::vector<at::Tensor>& shards) {
  TORCH_CHECK(!shards.empty(), "gguf_pack_int6: no shards");
  gguf_pack::Shards rows_of;
  for (const at::Tensor& shard : shards) rows_of.add("gguf_pack_int6", shard, gguf_pack::kQ6_K, gguf_pack::kQ6KBytes, 256);
  TORCH_CHECK(rows_of.rows % gguf_pack::kBlockRows == 0, "gguf_pack_int6: ", rows_of.rows, " rows are not a multiple of 16");
  constexpr int64_t group_bytes = 256 + 128 + 32, super_bytes = 32 + 8 * group_bytes;  // d[16], 8 groups
  const int64_t blocks = rows_of.rows / gguf_pack::kBlockRows, supers = rows_of.features / 256;
  at::Tensor packed = at::empty({blocks, supers * super_bytes}, at::kByte);
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    uint8_t codes[256];
    for (int64_t block = begin; block < end; ++block)
      for (int64_t lane = 0; lane < gguf_pack::kBlockRows; ++lane) {
        const auto [shard, row] = rows_of.locate(block * gguf_pack::kBlockRows + lane);
        const uint8_t* row_blocks = shard->data + row * shard->row_stride;
        for (int64_t sb = 0; sb < supers; ++sb) {
          const uint8_t* q6 = row_blocks + sb * gguf_pack::kQ6KBytes;
          gguf_pack::q6_k_codes(q6, codes);
          uint8_t* super = out + gguf_pack::unit_offset(block, sb, blocks, supers, super_bytes);
          std::memcpy(super + 2 * lane, q6 + 208, 2);  // d, the file's float16
          for (int g = 0; g < 8; ++g) {
            uint8_t* group = super + 32 + g * group_bytes;
            const uint8_t* group_codes = codes + 32 * g;
            gguf_pack::put_nibbles(group, lane, group_codes);
            for (int h = 0; h < 2; ++h)  // plane h, byte 4 lane + j: bits 2i, 2i+1 are feature 16h + 4i + j's
              for (int j = 0; j < 4; ++j) {
                uint8_t bits = 0;
                for (int i = 0; i < 4; ++i) bits |= static_cast<uint8_t>((group_codes[16 * h + 4 * i + j] >> 4) << (2 * i));
                group[256 + h * 64 + 4 * lane + j] = bits;
              }
            group[384 + lane] = q6[192 + 2 * g];  // the int8 sub-scales of features 0..15 and 16..31
            group[384 + 16 + lane] = q6[192 + 2 * g + 1];
          }
        }
      }
  });
  return packed;
}

}  // namespace TOKENLOOM_CPU_NAMESPACE

TOKENLOOM_LIBRARY_FRAGMENT(m) {
  m.def("gguf_pack_int4(Tensor[] shards, int[] ggml_types) -> Tensor");
  m.def("gguf_pack_int6(Tensor[] shards) -> Tensor");
}

TOKENLOOM_LIBRARY_IMPL_CPU(m) {
  m.impl("gguf_pack_int4", &TOKENLOOM_CPU_NAMESPACE::gguf_pack_int4);
  m.impl("gguf_pack_int6", &TOKENLOOM_CPU_NAMESPACE::gguf_pack_int6);
}
