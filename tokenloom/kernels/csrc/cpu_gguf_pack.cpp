// GGUF blocks repacked at load, straight from the memory-mapped file into the kernels' layouts, in
// every build (one per ISA level, see cpu_namespace.h):
//   `gguf_pack_int4(shards, ggml_types)`: row shards of Q4_0, Q4_1 or Q4_K blocks (uint8
//   [rows_i, bytes per row], rows stacked in list order) -> int4_linear's weight (cpu_qlinear.cpp:
//   per block of 16 rows and group of 32 features, 4 steps of [16 rows, 4 bytes] of nibbles, the
//   16 rows' d then m as float16; blocks stored in pairs group by group), the bytes
//   tokenloom/kernels/int4_matmul.py's torch packer makes from the same codes and float32 scales.
//   `gguf_q6_k_parts(blocks)`: Q6_K blocks [n, 210] -> (codes [n, 256] 0..63 in value order,
//   scales [n, 16] int8, d [n, 1] float16), the parts kquant_matmul.pack_int6 takes.
// Both replace torch chains of strided uint8 operations and concatenations that took most of a 1 GB
// file's start-up; each is one at::parallel_for writing its output once.
//
// The sources build with -ffast-math: the float32 products below are kept in ggml's order and
// rounded as torch rounds them by passing each through a volatile (no reassociation can cancel
// `(8 s - o) - 8 s`), and float16 is made by integer code (round to nearest even), so the bytes
// do not depend on the compiler's licence.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_namespace.h"

#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace TOKENLOOM_CPU_NAMESPACE {

// (a named namespace: every source is one translation unit, whose anonymous namespaces merge)
namespace gguf_pack {

// ggml's type ids (tokenloom/builtin_plugins/quantization/ggml_types.py)
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ4_K = 12;
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

// float32 -> float16 bits, rounding to nearest even (torch's .to(torch.float16)), in integers
inline uint16_t to_f16_bits(float value) {
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

}  // namespace gguf_pack

at::Tensor gguf_pack_int4(const std::vector<at::Tensor>& shards, c10::IntArrayRef ggml_types) {
  TORCH_CHECK(!shards.empty() && shards.size() == ggml_types.size(), "gguf_pack_int4: one GGML type per shard");
  int64_t rows = 0, features = -1;
  std::vector<gguf_pack::Shard> views;
  std::vector<int64_t> first_rows;  // the first output row of each shard
  for (size_t i = 0; i < shards.size(); ++i) {
    const at::Tensor& shard = shards[i];
    const int64_t type = ggml_types[i];
    TORCH_CHECK(type == gguf_pack::kQ4_0 || type == gguf_pack::kQ4_1 || type == gguf_pack::kQ4_K, "gguf_pack_int4: GGML type ", type,
                " is not Q4_0, Q4_1 or Q4_K");
    TORCH_CHECK(shard.device().is_cpu() && shard.scalar_type() == at::kByte && shard.dim() == 2 && shard.stride(1) == 1,
                "gguf_pack_int4: each shard is uint8 [rows, bytes per row] with contiguous rows");
    const int64_t block_bytes = type == gguf_pack::kQ4_K ? 144 : (type == gguf_pack::kQ4_1 ? 20 : 18);
    const int64_t block_values = type == gguf_pack::kQ4_K ? 256 : 32;
    TORCH_CHECK(shard.size(1) % block_bytes == 0, "gguf_pack_int4: rows are not whole blocks");
    const int64_t shard_features = shard.size(1) / block_bytes * block_values;
    TORCH_CHECK(features < 0 || shard_features == features, "gguf_pack_int4: shards differ in row length");
    features = shard_features;
    views.push_back({shard.data_ptr<uint8_t>(), shard.stride(0), type});
    first_rows.push_back(rows);
    rows += shard.size(0);
  }
  TORCH_CHECK(rows % gguf_pack::kBlockRows == 0 && features % gguf_pack::kGroup == 0, "gguf_pack_int4: ", rows,
              " rows are not a multiple of 16");
  const int64_t blocks = rows / gguf_pack::kBlockRows, groups = features / gguf_pack::kGroup;
  at::Tensor packed = at::empty({blocks, groups * gguf_pack::kGroupBytes}, at::kByte);
  uint8_t* out = packed.data_ptr<uint8_t>();
  const int64_t paired_blocks = blocks - blocks % 2;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    uint8_t codes[gguf_pack::kBlockRows][gguf_pack::kGroup];
    uint16_t d_bits[gguf_pack::kBlockRows], m_bits[gguf_pack::kBlockRows];
    for (int64_t block = begin; block < end; ++block) {
      // the shard and row of each of the block's 16 rows
      const gguf_pack::Shard* row_shard[gguf_pack::kBlockRows];
      int64_t shard_row[gguf_pack::kBlockRows];
      for (int64_t lane = 0; lane < gguf_pack::kBlockRows; ++lane) {
        const int64_t row = block * gguf_pack::kBlockRows + lane;
        size_t index = first_rows.size() - 1;
        while (first_rows[index] > row) --index;
        row_shard[lane] = &views[index];
        shard_row[lane] = row - first_rows[index];
      }
      const bool paired = block < paired_blocks;
      const int64_t in_pair = paired ? block % 2 : 0;
      uint8_t* base = out + (block - in_pair) * groups * gguf_pack::kGroupBytes + in_pair * gguf_pack::kGroupBytes;
      const int64_t group_stride = (paired ? 2 : 1) * gguf_pack::kGroupBytes;
      for (int64_t group = 0; group < groups; ++group) {
        for (int64_t lane = 0; lane < gguf_pack::kBlockRows; ++lane) {
          gguf_pack::group_codes(*row_shard[lane], shard_row[lane], group, codes[lane], d_bits[lane], m_bits[lane]);
        }
        uint8_t* slot = base + group * group_stride;
        // step t, lane, byte j: features 8t + j (low nibble) and 8t + 4 + j (high)
        for (int t = 0; t < 4; ++t) {
          for (int64_t lane = 0; lane < gguf_pack::kBlockRows; ++lane) {
            for (int j = 0; j < 4; ++j) {
              slot[t * 64 + lane * 4 + j] =
                  static_cast<uint8_t>(codes[lane][8 * t + j] | (codes[lane][8 * t + 4 + j] << 4));
            }
          }
        }
        std::memcpy(slot + 256, d_bits, sizeof(d_bits));
        std::memcpy(slot + 288, m_bits, sizeof(m_bits));
      }
    }
  });
  return packed;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gguf_q6_k_parts(const at::Tensor& blocks) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.size(1) == gguf_pack::kQ6KBytes && blocks.stride(1) == 1,
              "gguf_q6_k_parts: blocks are uint8 [n, 210] with contiguous rows");
  const int64_t count = blocks.size(0), stride = blocks.stride(0);
  at::Tensor codes = at::empty({count, 256}, at::kByte);
  at::Tensor scales = at::empty({count, 16}, at::kChar);
  at::Tensor d = at::empty({count, 1}, at::kHalf);
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  uint8_t* code_out = codes.data_ptr<uint8_t>();
  uint8_t* scale_out = reinterpret_cast<uint8_t*>(scales.data_ptr<int8_t>());
  uint8_t* d_out = reinterpret_cast<uint8_t*>(d.data_ptr<at::Half>());
  at::parallel_for(0, count, 256, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const uint8_t* block = in + index * stride;
      const uint8_t* ql = block;
      const uint8_t* qh = block + 128;
      uint8_t* code = code_out + index * 256;
      // ggml's order: per half of 128 values, l in 0..31 -> l, l + 32, l + 64, l + 96
      for (int half = 0; half < 2; ++half) {
        for (int l = 0; l < 32; ++l) {
          const uint8_t low0 = ql[64 * half + l], low1 = ql[64 * half + 32 + l], high = qh[32 * half + l];
          code[128 * half + l] = (low0 & 0x0F) | ((high & 3) << 4);
          code[128 * half + 32 + l] = (low1 & 0x0F) | (((high >> 2) & 3) << 4);
          code[128 * half + 64 + l] = (low0 >> 4) | (((high >> 4) & 3) << 4);
          code[128 * half + 96 + l] = (low1 >> 4) | (((high >> 6) & 3) << 4);
        }
      }
      std::memcpy(scale_out + index * 16, block + 192, 16);
      std::memcpy(d_out + index * 2, block + 208, 2);
    }
  });
  return {codes, scales, d};
}

}  // namespace TOKENLOOM_CPU_NAMESPACE

TOKENLOOM_LIBRARY_FRAGMENT(m) {
  m.def("gguf_pack_int4(Tensor[] shards, int[] ggml_types) -> Tensor");
  m.def("gguf_q6_k_parts(Tensor blocks) -> (Tensor, Tensor, Tensor)");
}

TOKENLOOM_LIBRARY_IMPL_CPU(m) {
  m.impl("gguf_pack_int4", &TOKENLOOM_CPU_NAMESPACE::gguf_pack_int4);
  m.impl("gguf_q6_k_parts", &TOKENLOOM_CPU_NAMESPACE::gguf_q6_k_parts);
}
