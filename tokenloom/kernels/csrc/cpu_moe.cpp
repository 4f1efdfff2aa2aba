// The experts of a mixture-of-experts layer (tokenloom/layers/fused_moe.py), every expert in one
// operator, in every build (one per ISA level, see cpu_namespace.h):
//   `moe_experts(x, expert_offsets, w13, w2, activation)`: rows x [R, H] float32 sorted by expert
//   (expert e's rows are expert_offsets[e] .. expert_offsets[e + 1]), each row through its expert's
//   gated MLP: down(act(gate(x)) * up(x)), float32 out [R, H]. The caller routes the tokens, sorts
//   their (token, expert) pairs and sums each token's rows with its routing weights.
// The experts' weights are stacked:
//   float (float32 or bfloat16): w13 [E, 2 I, H] (gate rows then up rows), w2 [E, H, I];
//   packed (uint8), each projection in its own kind (`w13_bits`, `w2_bits`; a Q4_K_M file's Q4_K
//   gate and up beside its Q6_K down):
//     4 bits: each expert packed for int4_linear (cpu_qlinear.cpp), w13 [E, 2 I / 16, H / 32 * 320],
//       w2 [E, H / 16, I / 32 * 320]; the rows are quantized to 8 bits once per projection, and
//       each tile is cpu_qlinear.cpp's own (cpu_qlinear.h), so a row gets the bits int4_linear
//       gives it;
//     6 bits (Q6_K) or 5 bits (Q5_0, Q5_1, Q5_K; superblocks of `w13_groups`/`w2_groups` groups
//       of 32): each expert packed for int6_linear/int5_linear (cpu_kquant.cpp), [E, N / 16,
//       K / (32 G) * superblock bytes]; each expert's rows go through that operator (on runs of
//       its output blocks), so they get its bits.
// A float or 4-bit projection is one at::parallel_for over every (expert, block of output
// features, chunk of the expert's rows) that has rows: no loop over experts outside it, and an
// expert no row chose costs nothing. A 5- or 6-bit projection is one at::parallel_for too, over
// every (expert with rows, run of 16 output blocks), each calling the kquant operator (whose tile
// is private to cpu_kquant.cpp) on that expert's rows and blocks. Between them the gated
// activation is act_and_mul's (cpu_layers.cpp).
// Float weights take a plain dot-product tile (4 weight rows against each activation row, left to
// the compiler's vectoriser; a bfloat16 weight row is widened once per tile): a decode step's few
// rows per expert are bound by reading the weights.
//   `gguf_repack(blocks, ggml_type, rows, columns)`: rows of a GGUF file's Q4_K or Q6_K blocks
// rewritten in one parallel pass into int4_linear's or int6_linear's layout (what
// kernels/int4_matmul.py's and kquant_matmul.py's torch packers build from the same codes and
// scales; Q4_K's d * sc and -(dmin * mn) rounded to float16 as there), so a 4 GB file's experts
// are packed at load at about the speed of reading them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_ops.h"
#include "cpu_qlinear.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace TOKENLOOM_CPU_NAMESPACE {

namespace {

constexpr int64_t kMoeBlock = 16;      // output features per work item (the 4-bit layout's block)
constexpr int64_t kMoeRowChunk = 64;   // an expert's rows per work item

struct WorkItem {
  int64_t expert, block, row_begin, row_end;
};

// every (expert, output block, row chunk) with rows; blocks_per_item output blocks per item
std::vector<WorkItem> work_items(const int64_t* offsets, int64_t experts, int64_t blocks, int64_t blocks_per_item) {
  std::vector<WorkItem> items;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t m = offsets[e]; m < offsets[e + 1]; m += kMoeRowChunk)
      for (int64_t b = 0; b < blocks; b += blocks_per_item)
        items.push_back({e, b, m, std::min(offsets[e + 1], m + kMoeRowChunk)});
  return items;
}

// out[m, n0 .. n_end) = x[m] . weight[n] for m in [m_begin, m_end); weight [N, K] of one expert
template <typename w_t>
void float_tile(const float* x, const w_t* weight, float* out, int64_t m_begin, int64_t m_end, int64_t n0,
                int64_t n_end, int64_t N, int64_t K) {
  thread_local std::vector<float> widened;
  widened.resize(4 * K);
  for (int64_t n = n0; n < n_end; n += 4) {
    const int64_t count = std::min<int64_t>(4, n_end - n);
    const float* rows[4];
    for (int64_t i = 0; i < 4; ++i) {
      const int64_t row = n + std::min(i, count - 1);
      if constexpr (std::is_same_v<w_t, float>) {
        rows[i] = weight + row * K;
      } else {
        load_row(weight + row * K, widened.data() + i * K, K);
        rows[i] = widened.data() + i * K;
      }
    }
    const float *w0 = rows[0], *w1 = rows[1], *w2 = rows[2], *w3 = rows[3];
    for (int64_t m = m_begin; m < m_end; ++m) {
      const float* xm = x + m * K;
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int64_t k = 0; k < K; ++k) {
        a0 += xm[k] * w0[k];
        a1 += xm[k] * w1[k];
        a2 += xm[k] * w2[k];
        a3 += xm[k] * w3[k];
      }
      const float sums[4] = {a0, a1, a2, a3};
      for (int64_t i = 0; i < count; ++i) out[m * N + n + i] = sums[i];
    }
  }
}

// out [R, N] = each row of x [R, K] times its expert's float weight [E, N, K]
template <typename w_t>
void float_projection(const float* x, const w_t* weight, float* out, const int64_t* offsets, int64_t experts,
                      int64_t N, int64_t K) {
  const int64_t blocks = (N + kMoeBlock - 1) / kMoeBlock;
  const std::vector<WorkItem> items = work_items(offsets, experts, blocks, 1);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const WorkItem& item = items[i];
      const int64_t n0 = item.block * kMoeBlock;
      float_tile(x, weight + item.expert * N * K, out, item.row_begin, item.row_end, n0,
                 std::min(N, n0 + kMoeBlock), N, K);
    }
  });
}

// out [R, N] = each row of x [R, K] times its expert's 4-bit weight (N / 16 blocks of K / 32 groups)
void int4_projection(const float* x, const uint8_t* weight, float* out, const int64_t* offsets, int64_t experts,
                     int64_t N, int64_t K) {
  const int64_t rows = offsets[experts];
  const QuantizedRows quantized = int4_quantize_rows(x, rows, K);
  const int64_t blocks = N / kMoeBlock, expert_bytes = blocks * (K / 32) * 320;
  const std::vector<WorkItem> items = work_items(offsets, experts, blocks, 2);  // pairs of blocks
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const WorkItem& item = items[i];
      int4_rows_times_block_pair(quantized, weight + item.expert * expert_bytes, out, item.row_begin, item.row_end,
                                 item.block, N, K);
    }
  });
}

// out [R, N] = each row of x [R, K] times its expert's 5- or 6-bit weight: one at::parallel_for over
// every (expert with rows, run of kKquantBlocks output blocks), each item the kquant operator on
// that expert's rows and those blocks (whole pairs of blocks are a packed weight of their own;
// inside the loop the operator's own parallel loop runs inline)
constexpr int64_t kKquantBlocks = 16;  // 256 output features per work item, whole pairs of blocks
void kquant_projection(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, const int64_t* offsets,
                       int64_t bits, int64_t groups) {
  const int64_t blocks = weight.size(1);
  std::vector<std::pair<int64_t, int64_t>> items;  // (expert, first block)
  for (int64_t e = 0; e < weight.size(0); ++e)
    if (offsets[e + 1] > offsets[e])
      for (int64_t b = 0; b < blocks; b += kKquantBlocks) items.emplace_back(e, b);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [e, b0] = items[i];
      const int64_t count = std::min(kKquantBlocks, blocks - b0), rows = offsets[e + 1] - offsets[e];
      const at::Tensor x_rows = x.narrow(0, offsets[e], rows);
      const at::Tensor part = weight[e].narrow(0, b0, count);
      const at::Tensor product = bits == 6 ? int6_linear(x_rows, part) : int5_linear(x_rows, part, groups);
      // raw copies: the pool's threads are not in the caller's inference mode, so no in-place ATen op on `out`
      const float* source = product.data_ptr<float>();
      float* target = out.data_ptr<float>() + offsets[e] * out.size(1) + b0 * kMoeBlock;
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(target + r * out.size(1), source + r * count * kMoeBlock, sizeof(float) * count * kMoeBlock);
    }
  });
}

// bytes of one expert's packed [N, K] weight of `bits` (superblocks of `groups` groups of 32)
int64_t packed_row_bytes(int64_t bits, int64_t groups, int64_t K) {
  if (bits == 4) return K / 32 * 320;
  const int64_t group_bytes = 256 + (bits - 4) * 64 + 32, header_bytes = bits == 6 ? 32 : 64;
  return K / (32 * groups) * (header_bytes + groups * group_bytes);
}

void projection(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, const int64_t* offsets, int64_t N,
                int64_t K, int64_t bits, int64_t groups) {
  const int64_t experts = weight.size(0);
  if (weight.scalar_type() == at::kByte && bits != 4)
    kquant_projection(x, weight, out, offsets, bits, groups);
  else if (weight.scalar_type() == at::kByte)
    int4_projection(x.data_ptr<float>(), weight.data_ptr<uint8_t>(), out.data_ptr<float>(), offsets, experts, N, K);
  else if (weight.scalar_type() == at::kBFloat16)
    float_projection(x.data_ptr<float>(), weight.data_ptr<c10::BFloat16>(), out.data_ptr<float>(), offsets, experts,
                     N, K);
  else
    float_projection(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), offsets, experts, N, K);
}

// -- GGUF blocks into the kernels' layouts ------------------------------------------------------

constexpr int64_t kGgmlQ4K = 12, kGgmlQ6K = 14;  // ggml's type ids
constexpr int64_t kQ4KBytes = 144, kQ6KBytes = 210, kSuperValues = 256;

inline float half_at(const uint8_t* bytes) {
  c10::Half value;
  std::memcpy(&value, bytes, 2);
  return static_cast<float>(value);
}

inline void put_half(uint8_t* bytes, float value) {
  const c10::Half half(value);
  std::memcpy(bytes, &half, 2);
}

// where block b's bytes of unit u (a group of 32, or a superblock) start: blocks stored in pairs
// unit by unit (see interleave_block_pairs), an odd last block alone after the pairs
inline int64_t unit_offset(int64_t b, int64_t u, int64_t blocks, int64_t units, int64_t unit_bytes) {
  const int64_t paired = blocks - blocks % 2;
  if (b >= paired) return paired * units * unit_bytes + u * unit_bytes;
  return (b / 2) * 2 * units * unit_bytes + (u * 2 + b % 2) * unit_bytes;
}

// a row's 32 codes of a group into the 4-bit code bytes: byte t * 64 + 4 lane + j holds
// features 8t + j (low nibble) and 8t + 4 + j (high)
inline void put_nibbles(uint8_t* group, int64_t lane, const uint8_t* codes) {
  for (int t = 0; t < 4; ++t)
    for (int j = 0; j < 4; ++j)
      group[t * 64 + 4 * lane + j] = static_cast<uint8_t>((codes[8 * t + j] & 0x0F) | ((codes[8 * t + 4 + j] & 0x0F) << 4));
}

// Q4_K block -> codes[256], and each group's scale and offset: value = code * scale + offset
void decode_q4_k(const uint8_t* block, uint8_t* codes, float* scale, float* offset) {
  const float d = half_at(block), dmin = half_at(block + 2);
  const uint8_t* s = block + 4;
  const uint8_t* q = block + 16;
  for (int g = 0; g < 8; ++g) {
    int sc, mn;
    if (g < 4) {
      sc = s[g] & 63;
      mn = s[g + 4] & 63;
    } else {
      sc = (s[g + 4] & 0x0F) | ((s[g - 4] >> 6) << 4);
      mn = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
    }
    scale[g] = d * static_cast<float>(sc);
    const float subtracted = dmin * static_cast<float>(mn);
    offset[g] = subtracted == 0.f ? 0.f : -subtracted;  // +0 where nothing is subtracted, as the torch packer
  }
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) {
      codes[64 * j + l] = q[32 * j + l] & 0x0F;
      codes[64 * j + 32 + l] = q[32 * j + l] >> 4;
    }
}

// Q6_K block -> codes[256] (0..63), its 16 int8 scales (one per 16 values) and d
float decode_q6_k(const uint8_t* block, uint8_t* codes, int8_t* scales) {
  const uint8_t* ql = block;
  const uint8_t* qh = block + 128;
  std::memcpy(scales, block + 192, 16);
  for (int n = 0; n < 2; ++n)
    for (int l = 0; l < 32; ++l) {
      const uint8_t h = qh[32 * n + l];
      uint8_t* y = codes + 128 * n;
      y[l] = (ql[64 * n + l] & 0x0F) | ((h & 3) << 4);
      y[l + 32] = (ql[64 * n + l + 32] & 0x0F) | (((h >> 2) & 3) << 4);
      y[l + 64] = (ql[64 * n + l] >> 4) | (((h >> 4) & 3) << 4);
      y[l + 96] = (ql[64 * n + l + 32] >> 4) | (((h >> 6) & 3) << 4);
    }
  return half_at(block + 208);
}

// rows of Q4_K blocks -> int4_linear's layout (cpu_qlinear.cpp): per block of 16 rows and group of
// 32 features, the code bytes then d[16] and m[16] as float16 (value = code d + m)
void pack_q4_k(const uint8_t* in, uint8_t* out, int64_t rows, int64_t columns) {
  const int64_t blocks = rows / 16, supers = columns / kSuperValues, groups = columns / 32, unit = 320;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    uint8_t codes[256];
    float scale[8], offset[8];
    for (int64_t b = begin; b < end; ++b)
      for (int64_t lane = 0; lane < 16; ++lane) {
        const uint8_t* row = in + (16 * b + lane) * supers * kQ4KBytes;
        for (int64_t sb = 0; sb < supers; ++sb) {
          decode_q4_k(row + sb * kQ4KBytes, codes, scale, offset);
          for (int g = 0; g < 8; ++g) {
            uint8_t* group = out + unit_offset(b, sb * 8 + g, blocks, groups, unit);
            put_nibbles(group, lane, codes + 32 * g);
            put_half(group + 256 + 2 * lane, scale[g]);
            put_half(group + 288 + 2 * lane, offset[g]);
          }
        }
      }
  });
}

// rows of Q6_K blocks -> int6_linear's layout (cpu_kquant.cpp): per block of 16 rows and
// superblock of 256 features, d[16] as float16, then 8 groups of the code bytes, two planes of
// high bits and the sub-scales sc[2][16]
void pack_q6_k(const uint8_t* in, uint8_t* out, int64_t rows, int64_t columns) {
  const int64_t blocks = rows / 16, supers = columns / kSuperValues, group_bytes = 256 + 128 + 32;
  const int64_t unit = 32 + 8 * group_bytes;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    uint8_t codes[256];
    int8_t scales[16];
    for (int64_t b = begin; b < end; ++b)
      for (int64_t lane = 0; lane < 16; ++lane) {
        const uint8_t* row = in + (16 * b + lane) * supers * kQ6KBytes;
        for (int64_t sb = 0; sb < supers; ++sb) {
          const float d = decode_q6_k(row + sb * kQ6KBytes, codes, scales);
          uint8_t* super = out + unit_offset(b, sb, blocks, supers, unit);
          put_half(super + 2 * lane, d);
          for (int g = 0; g < 8; ++g) {
            uint8_t* group = super + 32 + g * group_bytes;
            const uint8_t* group_codes = codes + 32 * g;
            put_nibbles(group, lane, group_codes);
            for (int h = 0; h < 2; ++h)  // plane h, byte 4 lane + j: bits 2i, 2i+1 are feature 16h + 4i + j's
              for (int j = 0; j < 4; ++j) {
                uint8_t bits = 0;
                for (int i = 0; i < 4; ++i) bits |= static_cast<uint8_t>((group_codes[16 * h + 4 * i + j] >> 4) << (2 * i));
                group[256 + h * 64 + 4 * lane + j] = bits;
              }
            group[384 + lane] = static_cast<uint8_t>(scales[2 * g]);
            group[384 + 16 + lane] = static_cast<uint8_t>(scales[2 * g + 1]);
          }
        }
      }
  });
}

}  // namespace

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& expert_offsets, const at::Tensor& w13,
                       const at::Tensor& w2, const std::string& activation, int64_t w13_bits, int64_t w2_bits,
                       int64_t w13_groups, int64_t w2_groups) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "moe_experts: x must be a contiguous [rows, hidden] float32 tensor");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous() &&
                  w13.scalar_type() == w2.scalar_type() && w13.size(0) == w2.size(0),
              "moe_experts: w13 and w2 must be contiguous stacks [experts, ...] of one dtype");
  const int64_t experts = w13.size(0), rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(expert_offsets.dim() == 1 && expert_offsets.size(0) == experts + 1 &&
                  expert_offsets.scalar_type() == at::kLong && expert_offsets.is_contiguous(),
              "moe_experts: expert_offsets must be [experts + 1] int64");
  const int64_t* offsets = expert_offsets.data_ptr<int64_t>();
  TORCH_CHECK(offsets[0] == 0 && offsets[experts] == rows, "moe_experts: expert_offsets must run from 0 to the rows of x");
  for (int64_t e = 0; e < experts; ++e)
    TORCH_CHECK(offsets[e] <= offsets[e + 1], "moe_experts: expert_offsets must not decrease");
  int64_t gate_up, intermediate;
  if (w13.scalar_type() == at::kByte) {
    for (const auto& [bits, groups] : {std::pair{w13_bits, w13_groups}, std::pair{w2_bits, w2_groups}})
      TORCH_CHECK((bits == 4 || bits == 5 || bits == 6) && (bits != 6 || groups == 8) && groups > 0,
                  "moe_experts: packed experts are 4-, 5- or 6-bit (6-bit in superblocks of 8 groups), not ", bits,
                  "-bit in superblocks of ", groups);
    gate_up = w13.size(1) * kMoeBlock;
    intermediate = gate_up / 2;
    const int64_t w13_span = w13_bits == 4 ? 32 : 32 * w13_groups, w2_span = w2_bits == 4 ? 32 : 32 * w2_groups;
    TORCH_CHECK(hidden % w13_span == 0 && intermediate % w2_span == 0 && intermediate % 32 == 0,
                "moe_experts: packed experts need a hidden size that is a multiple of ", w13_span,
                " and an intermediate size that is a multiple of ", std::max<int64_t>(w2_span, 32));
    TORCH_CHECK(w13.size(2) == packed_row_bytes(w13_bits, w13_groups, hidden) && w2.size(1) * kMoeBlock == hidden &&
                    w2.size(2) == packed_row_bytes(w2_bits, w2_groups, intermediate),
                "moe_experts: packed w13 must be [experts, 2 I / 16, ", packed_row_bytes(w13_bits, w13_groups, hidden),
                "] and w2 [experts, H / 16, bytes of I features] for their bits (", w13_bits, ", ", w2_bits, ")");
  } else {
    TORCH_CHECK(w13.scalar_type() == at::kFloat || w13.scalar_type() == at::kBFloat16,
                "moe_experts: expert weights must be float32, bfloat16 or packed (uint8)");
    gate_up = w13.size(1);
    intermediate = gate_up / 2;
    TORCH_CHECK(gate_up % 2 == 0 && w13.size(2) == hidden && w2.size(1) == hidden && w2.size(2) == intermediate,
                "moe_experts: w13 must be [experts, 2 I, H] and w2 [experts, H, I]");
  }
  at::Tensor out = at::empty({rows, hidden}, x.options());
  if (rows == 0) return out;
  at::Tensor gate_up_rows = at::empty({rows, gate_up}, x.options());
  projection(x, w13, gate_up_rows, offsets, gate_up, hidden, w13_bits, w13_groups);
  const at::Tensor activated = act_and_mul(gate_up_rows, activation);
  projection(activated, w2, out, offsets, hidden, intermediate, w2_bits, w2_groups);
  return out;
}

at::Tensor gguf_repack(const at::Tensor& blocks, int64_t ggml_type, int64_t rows, int64_t columns) {
  TORCH_CHECK(ggml_type == kGgmlQ4K || ggml_type == kGgmlQ6K, "gguf_repack: takes Q4_K (12) and Q6_K (14) blocks, not type ",
              ggml_type);
  const int64_t block_bytes = ggml_type == kGgmlQ4K ? kQ4KBytes : kQ6KBytes;
  TORCH_CHECK(rows > 0 && rows % 16 == 0 && columns > 0 && columns % kSuperValues == 0,
              "gguf_repack: rows must be a multiple of 16 and columns of 256, got ", rows, " x ", columns);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.numel() == rows * columns / kSuperValues * block_bytes,
              "gguf_repack: blocks must be the contiguous uint8 bytes of ", rows, " rows of ", columns, " values");
  const int64_t row_bytes = ggml_type == kGgmlQ4K ? columns / 32 * 320 : columns / kSuperValues * (32 + 8 * 416);
  at::Tensor out = at::empty({rows / 16, row_bytes}, blocks.options());
  if (ggml_type == kGgmlQ4K)
    pack_q4_k(blocks.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), rows, columns);
  else
    pack_q6_k(blocks.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), rows, columns);
  return out;
}

}  // namespace TOKENLOOM_CPU_NAMESPACE

TOKENLOOM_LIBRARY_FRAGMENT(m) {
  m.def(
      "moe_experts(Tensor x, Tensor expert_offsets, Tensor w13, Tensor w2, str activation, int w13_bits=4, "
      "int w2_bits=4, int w13_groups=8, int w2_groups=8) -> Tensor");
  m.def("gguf_repack(Tensor blocks, int ggml_type, int rows, int columns) -> Tensor");
}

TOKENLOOM_LIBRARY_IMPL_CPU(m) {
  m.impl("moe_experts", &TOKENLOOM_CPU_NAMESPACE::moe_experts);
  m.impl("gguf_repack", &TOKENLOOM_CPU_NAMESPACE::gguf_repack);
}
