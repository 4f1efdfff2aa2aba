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
//   `gguf_unpack_rows(packed, rows, ggml_type)`: the way back for some rows of a packed LM head, to
//   the file's blocks byte for byte (Q6_K from int6_linear's layout, Q8_0 from int8_linear's,
//   tokenloom/kernels/int8_matmul.py's pack_int8): an embedding tied to the head looks its rows up
//   in the head's codes, so the file's copy of the tensor need not stay in memory.
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
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;
constexpr int64_t kGroup = 32;          // features per group of the int4 layout
constexpr int64_t kBlockRows = 16;      // output rows per block of the int4 layout
constexpr int64_t kGroupBytes = 320;    // 16 rows x 32 codes in nibbles, 16 d, 16 m
constexpr float kCodeOffset = 8.0f;     // int4_matmul.CODE_OFFSET
constexpr int64_t kQ6KBytes = 210;
constexpr int64_t kQ6KGroupBytes = 256 + 128 + 32, kQ6KSuperBytes = 32 + 8 * kQ6KGroupBytes;  // int6_linear's
constexpr int64_t kQ8_0Bytes = 34;
constexpr int64_t kInt8GroupBytes = 8 * 64 + 64;  // int8_linear's: 8 steps of [16 rows, 4 codes], 16 float32 scales

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

// Nibble codes are moved a step at a time with word operations (the sources build for
// little-endian x86-64 and aarch64 only): a step of a lane is 4 bytes, byte j holding features
// 8t + j (low nibble) and 8t + 4 + j (high) of its group. When a group's 32 codes are the low
// (`high` false) or high nibbles of 32 consecutive bytes q, step t is made from bytes q[8t .. 8t + 8).
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the packers read nibbles as little-endian words");

inline uint32_t nibble_step(const uint8_t* eight_bytes, bool high) {
  uint64_t word;
  std::memcpy(&word, eight_bytes, 8);
  const uint32_t first = static_cast<uint32_t>(word), second = static_cast<uint32_t>(word >> 32);
  return high ? ((first >> 4) & 0x0F0F0F0Fu) | (second & 0xF0F0F0F0u)
              : (first & 0x0F0F0F0Fu) | ((second & 0x0F0F0F0Fu) << 4);
}

// a lane's four steps of a group whose codes are the low or high nibbles of `bytes` (32 of them)
inline void put_nibble_steps(uint8_t* group, int64_t lane, const uint8_t* bytes, bool high) {
  for (int t = 0; t < 4; ++t) {
    const uint32_t step = nibble_step(bytes + 8 * t, high);
    std::memcpy(group + t * 64 + lane * 4, &step, 4);
  }
}

// a lane's float16 d and m of a group whose affine is (scale, zero), as the torch packer rounds them
inline void put_scales(uint8_t* group, int64_t lane, float scale, float zero) {
  const uint16_t d_bits = to_f16_bits(scale);
  const uint16_t m_bits = to_f16_bits(rounded(zero - rounded(kCodeOffset * scale)));
  std::memcpy(group + 256 + 2 * lane, &d_bits, 2);
  std::memcpy(group + 288 + 2 * lane, &m_bits, 2);
}

// One row (lane `lane` of block `block`) of Q4_0, Q4_1 or Q4_K blocks into its slots of every
// group: a row at a time, so a Q4_K superblock's header (d, dmin, the eight 6-bit scales and
// mins) is decoded once for its eight groups, exactly as int4_groups + the torch packer compute
// each group's scale and zero.
inline void pack_int4_row(const uint8_t* row_bytes, int64_t ggml_type, uint8_t* out, int64_t block, int64_t lane,
                          int64_t blocks, int64_t groups) {
  if (ggml_type == kQ4_K) {
    for (int64_t sb = 0; sb < groups / 8; ++sb) {
      const uint8_t* superblock = row_bytes + sb * 144;
      const uint8_t* packed = superblock + 4;
      const float d = load_f16(superblock), dmin = load_f16(superblock + 2);
      for (int sub = 0; sub < 8; ++sub) {
        int sc, mn;
        if (sub < 4) {
          sc = packed[sub] & 63;
          mn = packed[sub + 4] & 63;
        } else {
          sc = (packed[sub + 4] & 0x0F) | ((packed[sub - 4] >> 6) << 4);
          mn = (packed[sub + 4] >> 4) | ((packed[sub] >> 6) << 4);
        }
        uint8_t* group = out + unit_offset(block, 8 * sb + sub, blocks, groups, kGroupBytes);
        put_nibble_steps(group, lane, superblock + 16 + 32 * (sub / 2), sub % 2 == 1);
        const float scale = rounded(d * static_cast<float>(sc));
        const float offset = rounded(dmin * static_cast<float>(mn));
        put_scales(group, lane, scale, rounded(rounded(kCodeOffset * scale) - offset));
      }
    }
    return;
  }
  const bool has_min = ggml_type == kQ4_1;
  const int64_t block_bytes = has_min ? 20 : 18;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* source = row_bytes + g * block_bytes;
    const uint8_t* qs = source + (has_min ? 4 : 2);
    uint8_t* group = out + unit_offset(block, g, blocks, groups, kGroupBytes);
    // features 0..15 are the low nibbles of the 16 code bytes, 16..31 the high ones
    for (int t = 0; t < 4; ++t) {
      const uint32_t step = nibble_step(qs + 8 * (t % 2), t >= 2);
      std::memcpy(group + t * 64 + lane * 4, &step, 4);
    }
    const float scale = load_f16(source);
    // (Q4_0's zero passes through a volatile too: a known 0 - x would be -x, and -0 for x = 0)
    put_scales(group, lane, scale, rounded(has_min ? load_f16(source + 2) + rounded(kCodeOffset * scale) : 0.0f));
  }
}

// One row (lane `lane` of block `block`) of Q6_K superblocks into int6_linear's layout. A
// superblock's code bytes ql [128] and qh [64] hold, per half h of 128 values and l in 0..31, the
// values l, l + 32, l + 64, l + 96 as the low nibbles of ql[64h + l], ql[64h + 32 + l], their
// high nibbles, and bits 0-1, 2-3, 4-5, 6-7 of qh[32h + l] (ggml's order): group g = 4h + q is
// nibble half q / 2 of ql[64h + 32 (q % 2) ..], with high bits (qh[32h ..] >> 2q) & 3.
inline void pack_int6_row(const uint8_t* row_bytes, uint8_t* out, int64_t block, int64_t lane, int64_t blocks,
                          int64_t supers) {
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* q6 = row_bytes + sb * kQ6KBytes;
    uint8_t* super = out + unit_offset(block, sb, blocks, supers, kQ6KSuperBytes);
    std::memcpy(super + 2 * lane, q6 + 208, 2);  // d, the file's float16
    for (int g = 0; g < 8; ++g) {
      const int half = g / 4, q = g % 4;
      uint8_t* group = super + 32 + g * kQ6KGroupBytes;
      put_nibble_steps(group, lane, q6 + 64 * half + 32 * (q % 2), q >= 2);
      const uint8_t* high_bits = q6 + 128 + 32 * half;
      for (int h = 0; h < 2; ++h) {  // plane h, byte 4 lane + j: bits 2i, 2i+1 are feature 16h + 4i + j's
        uint32_t plane = 0;
        for (int i = 0; i < 4; ++i) {
          uint32_t word;
          std::memcpy(&word, high_bits + 16 * h + 4 * i, 4);
          plane |= ((word >> (2 * q)) & 0x03030303u) << (2 * i);
        }
        std::memcpy(group + 256 + h * 64 + 4 * lane, &plane, 4);
      }
      group[384 + lane] = q6[192 + 2 * g];  // the int8 sub-scales of features 0..15 and 16..31
      group[384 + 16 + lane] = q6[192 + 2 * g + 1];
    }
  }
}


// The inverse of put_nibble_steps: a lane's four steps OR-ed back into the low or high nibbles of
// the 32 bytes they came from (zero there before)
inline void take_nibble_steps(const uint8_t* group, int64_t lane, uint8_t* bytes, bool high) {
  for (int t = 0; t < 4; ++t)
    for (int j = 0; j < 4; ++j) {
      const uint8_t step = group[t * 64 + lane * 4 + j];
      if (high) {
        bytes[8 * t + j] |= static_cast<uint8_t>(step << 4);
        bytes[8 * t + 4 + j] |= static_cast<uint8_t>(step & 0xF0);
      } else {
        bytes[8 * t + j] |= static_cast<uint8_t>(step & 0x0F);
        bytes[8 * t + 4 + j] |= static_cast<uint8_t>(step >> 4);
      }
    }
}

// The inverse of pack_int6_row: lane `lane` of block `block` back to its Q6_K superblocks
// (`row_bytes` zeroed: the nibbles and high bits of four groups share each byte)
inline void unpack_int6_row(const uint8_t* in, uint8_t* row_bytes, int64_t block, int64_t lane, int64_t blocks,
                            int64_t supers) {
  for (int64_t sb = 0; sb < supers; ++sb) {
    uint8_t* q6 = row_bytes + sb * kQ6KBytes;
    const uint8_t* super = in + unit_offset(block, sb, blocks, supers, kQ6KSuperBytes);
    std::memcpy(q6 + 208, super + 2 * lane, 2);
    for (int g = 0; g < 8; ++g) {
      const int half = g / 4, q = g % 4;
      const uint8_t* group = super + 32 + g * kQ6KGroupBytes;
      take_nibble_steps(group, lane, q6 + 64 * half + 32 * (q % 2), q >= 2);
      uint8_t* high_bits = q6 + 128 + 32 * half;
      for (int h = 0; h < 2; ++h) {
        uint32_t plane;
        std::memcpy(&plane, group + 256 + h * 64 + 4 * lane, 4);
        for (int i = 0; i < 4; ++i) {
          uint32_t word;
          std::memcpy(&word, high_bits + 16 * h + 4 * i, 4);
          word |= ((plane >> (2 * i)) & 0x03030303u) << (2 * q);
          std::memcpy(high_bits + 16 * h + 4 * i, &word, 4);
        }
      }
      q6[192 + 2 * g] = group[384 + lane];
      q6[192 + 2 * g + 1] = group[384 + 16 + lane];
    }
  }
}

// Lane `lane` of block `block` of int8_linear's weight back to Q8_0 blocks: each group's float32
// scale (a float16 the packer widened: narrowing it again is exact) and its 32 codes less 128
inline void unpack_int8_row(const uint8_t* in, uint8_t* row_bytes, int64_t block, int64_t lane, int64_t blocks,
                            int64_t groups) {
  for (int64_t g = 0; g < groups; ++g) {
    uint8_t* q8 = row_bytes + g * kQ8_0Bytes;
    const uint8_t* group = in + unit_offset(block, g, blocks, groups, kInt8GroupBytes);
    float scale;
    std::memcpy(&scale, group + 512 + 4 * lane, 4);
    const uint16_t d_bits = to_f16_bits(scale);
    std::memcpy(q8, &d_bits, 2);
    for (int step = 0; step < 8; ++step)
      for (int j = 0; j < 4; ++j) q8[2 + 4 * step + j] = static_cast<uint8_t>(group[step * 64 + lane * 4 + j] - 128);
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
    for (int64_t block = begin; block < end; ++block)
      for (int64_t lane = 0; lane < gguf_pack::kBlockRows; ++lane) {
        const auto [shard, row] = rows_of.locate(block * gguf_pack::kBlockRows + lane);
        gguf_pack::pack_int4_row(shard->data + row * shard->row_stride, shard->ggml_type, out, block, lane, blocks,
                                 groups);
      }
  });
  return packed;
}

at::Tensor gguf_pack_int6(const std::vector<at::Tensor>& shards) {
  TORCH_CHECK(!shards.empty(), "gguf_pack_int6: no shards");
  gguf_pack::Shards rows_of;
  for (const at::Tensor& shard : shards) rows_of.add("gguf_pack_int6", shard, gguf_pack::kQ6_K, gguf_pack::kQ6KBytes, 256);
  TORCH_CHECK(rows_of.rows % gguf_pack::kBlockRows == 0, "gguf_pack_int6: ", rows_of.rows, " rows are not a multiple of 16");
  const int64_t blocks = rows_of.rows / gguf_pack::kBlockRows, supers = rows_of.features / 256;
  at::Tensor packed = at::empty({blocks, supers * gguf_pack::kQ6KSuperBytes}, at::kByte);  // d[16], 8 groups each
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block)
      for (int64_t lane = 0; lane < gguf_pack::kBlockRows; ++lane) {
        const auto [shard, row] = rows_of.locate(block * gguf_pack::kBlockRows + lane);
        gguf_pack::pack_int6_row(shard->data + row * shard->row_stride, out, block, lane, blocks, supers);
      }
  });
  return packed;
}

at::Tensor gguf_unpack_rows(const at::Tensor& packed, const at::Tensor& rows, int64_t ggml_type) {
  TORCH_CHECK(ggml_type == gguf_pack::kQ6_K || ggml_type == gguf_pack::kQ8_0, "gguf_unpack_rows: GGML type ", ggml_type,
              " is not Q6_K or Q8_0");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "gguf_unpack_rows: the packed weight is contiguous uint8 [blocks, bytes per block]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "gguf_unpack_rows: rows is int64 [n]");
  const bool q6 = ggml_type == gguf_pack::kQ6_K;
  const int64_t unit_bytes = q6 ? gguf_pack::kQ6KSuperBytes : gguf_pack::kInt8GroupBytes;
  TORCH_CHECK(packed.size(1) % unit_bytes == 0, "gguf_unpack_rows: a block's bytes are not whole units of the type");
  const int64_t blocks = packed.size(0), units = packed.size(1) / unit_bytes;
  const int64_t row_bytes = units * (q6 ? gguf_pack::kQ6KBytes : gguf_pack::kQ8_0Bytes);
  const at::Tensor ids = rows.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t count = ids.size(0);
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < blocks * gguf_pack::kBlockRows, "gguf_unpack_rows: row ", id[i], " is outside 0..",
                blocks * gguf_pack::kBlockRows - 1);
  at::Tensor out = at::zeros({count, row_bytes}, at::kByte);
  const uint8_t* in = packed.data_ptr<uint8_t>();
  uint8_t* base = out.data_ptr<uint8_t>();
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t block = id[i] / gguf_pack::kBlockRows, lane = id[i] % gguf_pack::kBlockRows;
      if (q6)
        gguf_pack::unpack_int6_row(in, base + i * row_bytes, block, lane, blocks, units);
      else
        gguf_pack::unpack_int8_row(in, base + i * row_bytes, block, lane, blocks, units);
    }
  });
  return out;
}

}  // namespace TOKENLOOM_CPU_NAMESPACE

TOKENLOOM_LIBRARY_FRAGMENT(m) {
  m.def("gguf_pack_int4(Tensor[] shards, int[] ggml_types) -> Tensor");
  m.def("gguf_pack_int6(Tensor[] shards) -> Tensor");
  m.def("gguf_unpack_rows(Tensor packed, Tensor rows, int ggml_type) -> Tensor");
}

TOKENLOOM_LIBRARY_IMPL_CPU(m) {
  m.impl("gguf_pack_int4", &TOKENLOOM_CPU_NAMESPACE::gguf_pack_int4);
  m.impl("gguf_pack_int6", &TOKENLOOM_CPU_NAMESPACE::gguf_pack_int6);
  m.impl("gguf_unpack_rows", &TOKENLOOM_CPU_NAMESPACE::gguf_unpack_rows);
}
