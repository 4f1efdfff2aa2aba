// The experts of a mixture-of-experts layer (tokenloom/layers/fused_moe.py), every expert in one
// operator, in every build (one per ISA level, see cpu_namespace.h):
//   `moe_experts(x, topk_weights, sorted_slots, expert_offsets, w13, w2, activation)`: tokens x
//   [T, H] (float32 or bfloat16), each through the gated MLP down(act(gate(x)) * up(x)) of each of
//   its top_k experts, summed with its routing weights topk_weights [T, top_k] (float32, slot by
//   slot, rounded once to x's dtype): out [T, H]. The caller routes the tokens and sorts their
//   (token, slot) pairs t top_k + j by expert: sorted_slots [T top_k], expert e's pairs
//   expert_offsets[e] .. expert_offsets[e + 1]. The operator gathers those rows as float32, runs
//   the experts on them, and sums each token's rows.
// The experts' weights are stacked:
//   float (float32 or bfloat16): w13 [E, 2 I, H] (gate rows then up rows), w2 [E, H, I];
//   packed (uint8), each projection in its own kind (`w13_bits`, `w2_bits`; a Q4_K_M file's Q4_K
//   gate and up beside its Q6_K down):
//     4 bits: each expert packed for int4_linear (cpu_qlinear.cpp), w13 [E, 2 I / 16, H / 32 * 320],
//       w2 [E, H / 16, I / 32 * 320];
//     6 bits (Q6_K): each expert packed for int6_linear (cpu_kquant.cpp), [E, N / 16, K / 256 * 3360];
//     5 bits (Q5_0, Q5_1, Q5_K; superblocks of `w13_groups`/`w2_groups` groups of 32): each expert
//       packed for int5_linear (cpu_kquant.cpp), [E, N / 16, K / (32 G) * superblock bytes].
// A float, 4- or 6-bit projection is one at::parallel_for over every (expert, pair of blocks of 16
// output features, chunk of the expert's rows) that has rows: no loop over experts outside it, and
// an expert no row chose costs nothing. A 4- or 6-bit projection quantizes its rows to 8 bits once
// and runs the tile of int4_linear (cpu_qlinear.h) or int6_linear (cpu_kquant.h) on them, so a row
// gets the bits those operators give it. A 5-bit projection is one at::parallel_for over every
// (expert with rows, run of 16 output blocks), each calling int5_linear (whose tile is private to
// cpu_kquant.cpp) on that expert's rows and blocks. Between them the gated activation is
// act_and_mul's (cpu_layers.cpp).
// Float weights take a plain dot-product tile (4 weight rows against each activation row, left to
// the compiler's vectoriser; a bfloat16 weight row is widened once per tile): a decode step's few
// rows per expert are bound by reading the weights.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_ops.h"
#include "cpu_kquant.h"
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
constexpr int64_t kSlabRows = 2048;    // rows of whole experts run at a time (a slab)

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

// bytes of one expert's packed [N, K] weight of `bits` (superblocks of `groups` groups of 32)
int64_t packed_row_bytes(int64_t bits, int64_t groups, int64_t K) {
  if (bits == 4) return K / 32 * 320;
  const int64_t group_bytes = 256 + (bits - 4) * 64 + 32, header_bytes = bits == 6 ? 32 : 64;
  return K / (32 * groups) * (header_bytes + groups * group_bytes);
}

// out [R, N] = each row of x [R, K] times its expert's 4- or 6-bit weight (N / 16 blocks, each expert
// `expert_bytes`): the rows quantized once, then every (expert, pair of blocks, chunk of its rows)
// through the tile int4_linear or int6_linear runs on the same rows
void quantized_projection(const float* x, const uint8_t* weight, float* out, const int64_t* offsets, int64_t experts,
                          int64_t N, int64_t K, int64_t bits) {
  const int64_t rows = offsets[experts];
  const QuantizedRows quantized = int4_quantize_rows(x, rows, K);
  const int32_t* half_sums = bits == 6 ? int6_half_group_sums(quantized, rows, K) : nullptr;
  const int64_t blocks = N / kMoeBlock, expert_bytes = blocks * packed_row_bytes(bits, 8, K);
  const std::vector<WorkItem> items = work_items(offsets, experts, blocks, 2);  // pairs of blocks
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const WorkItem& item = items[i];
      const uint8_t* expert_weight = weight + item.expert * expert_bytes;
      if (bits == 6)
        int6_rows_times_block_pair(quantized, half_sums, expert_weight, out, item.row_begin, item.row_end, item.block,
                                   N, K);
      else
        int4_rows_times_block_pair(quantized, expert_weight, out, item.row_begin, item.row_end, item.block, N, K);
    }
  });
}

// out [R, N] = each row of x [R, K] times its expert's 5-bit weight: one at::parallel_for over
// every (expert with rows, run of kKquantBlocks output blocks), each item int5_linear on that
// expert's rows and those blocks (whole pairs of blocks are a packed weight of their own; inside
// the loop the operator's own parallel loop runs inline)
constexpr int64_t kKquantBlocks = 16;  // 256 output features per work item, whole pairs of blocks
void int5_projection(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, const int64_t* offsets,
                     int64_t groups) {
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
      const at::Tensor product = int5_linear(x_rows, part, groups);
      // raw copies: the pool's threads are not in the caller's inference mode, so no in-place ATen op on `out`
      const float* source = product.data_ptr<float>();
      float* target = out.data_ptr<float>() + offsets[e] * out.size(1) + b0 * kMoeBlock;
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(target + r * out.size(1), source + r * count * kMoeBlock, sizeof(float) * count * kMoeBlock);
    }
  });
}

void projection(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, const int64_t* offsets, int64_t N,
                int64_t K, int64_t bits, int64_t groups) {
  const int64_t experts = weight.size(0);
  if (weight.scalar_type() == at::kByte && bits == 5)
    int5_projection(x, weight, out, offsets, groups);
  else if (weight.scalar_type() == at::kByte)
    quantized_projection(x.data_ptr<float>(), weight.data_ptr<uint8_t>(), out.data_ptr<float>(), offsets, experts, N,
                         K, bits);
  else if (weight.scalar_type() == at::kBFloat16)
    float_projection(x.data_ptr<float>(), weight.data_ptr<c10::BFloat16>(), out.data_ptr<float>(), offsets, experts,
                     N, K);
  else
    float_projection(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), offsets, experts, N, K);
}

// rows [R, H] float32: row r the token of (token, slot) pair sorted_slots[r] (slot-major: t k + j)
template <typename x_t>
void gather_rows(const x_t* x, const int64_t* sorted_slots, float* rows, int64_t R, int64_t top_k, int64_t H) {
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) load_row(x + sorted_slots[r] / top_k * H, rows + r * H, H);
  });
}

// sums[t] += weights[t, j] * rows[position[t k + j] - r0] for each slot j whose row is one of
// r0 .. r0 + R, slot by slot
void accumulate_rows(const float* rows, const float* weights, const int64_t* position, float* sums, int64_t T,
                     int64_t top_k, int64_t H, int64_t r0, int64_t R) {
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t r = position[t * top_k + j] - r0;
        if (r < 0 || r >= R) continue;
        const float weight = weights[t * top_k + j];
        const float* row = rows + r * H;
        float* sum = sums + t * H;
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) sum[h] += weight * row[h];
      }
  });
}

}  // namespace

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& sorted_slots,
                       const at::Tensor& expert_offsets, const at::Tensor& w13, const at::Tensor& w2,
                       const std::string& activation, int64_t w13_bits, int64_t w2_bits, int64_t w13_groups,
                       int64_t w2_groups) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "moe_experts: x must be a contiguous [tokens, hidden] float32 or bfloat16 tensor");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(topk_weights.dim() == 2 && topk_weights.size(0) == tokens && topk_weights.is_contiguous() &&
                  topk_weights.scalar_type() == at::kFloat,
              "moe_experts: topk_weights must be a contiguous [tokens, top_k] float32 tensor");
  const int64_t top_k = topk_weights.size(1), rows = tokens * top_k;
  TORCH_CHECK(sorted_slots.dim() == 1 && sorted_slots.size(0) == rows && sorted_slots.is_contiguous() &&
                  sorted_slots.scalar_type() == at::kLong,
              "moe_experts: sorted_slots must be [tokens * top_k] int64");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous() &&
                  w13.scalar_type() == w2.scalar_type() && w13.size(0) == w2.size(0),
              "moe_experts: w13 and w2 must be contiguous stacks [experts, ...] of one dtype");
  const int64_t experts = w13.size(0);
  TORCH_CHECK(expert_offsets.dim() == 1 && expert_offsets.size(0) == experts + 1 &&
                  expert_offsets.scalar_type() == at::kLong && expert_offsets.is_contiguous(),
              "moe_experts: expert_offsets must be [experts + 1] int64");
  const int64_t* offsets = expert_offsets.data_ptr<int64_t>();
  TORCH_CHECK(offsets[0] == 0 && offsets[experts] == rows,
              "moe_experts: expert_offsets must run from 0 to tokens * top_k");
  for (int64_t e = 0; e < experts; ++e)
    TORCH_CHECK(offsets[e] <= offsets[e + 1], "moe_experts: expert_offsets must not decrease");
  // each (token, slot) pair's row: sorted_slots must be a permutation of 0 .. tokens * top_k
  const int64_t* slots = sorted_slots.data_ptr<int64_t>();
  std::vector<int64_t> position(rows, -1);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(slots[r] >= 0 && slots[r] < rows && position[slots[r]] < 0,
                "moe_experts: sorted_slots must hold each of 0 .. tokens * top_k once");
    position[slots[r]] = r;
  }
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
  if (tokens == 0) return at::empty({tokens, hidden}, x.options());
  const at::TensorOptions floats = x.options().dtype(at::kFloat);
  at::Tensor sums = at::zeros({tokens, hidden}, floats);  // out itself for float32 tokens
  const float* weights = topk_weights.data_ptr<float>();
  // the experts in slabs of whole experts of at most kSlabRows rows (or one expert's, if more):
  // the temporaries stay bounded and small enough for the allocator to reuse rather than map
  // fresh zero pages at every call (a 2048-token prefill's rows: ~11% of the layer in page faults)
  for (int64_t e0 = 0; e0 < experts;) {
    int64_t e1 = e0 + 1;
    while (e1 < experts && offsets[e1 + 1] - offsets[e0] <= kSlabRows) ++e1;
    const int64_t r0 = offsets[e0], slab_rows = offsets[e1] - r0;
    if (slab_rows > 0) {
      std::vector<int64_t> slab_offsets(offsets + e0, offsets + e1 + 1);
      for (int64_t& offset : slab_offsets) offset -= r0;
      at::Tensor x_rows = at::empty({slab_rows, hidden}, floats);
      if (x.scalar_type() == at::kFloat)
        gather_rows(x.data_ptr<float>(), slots + r0, x_rows.data_ptr<float>(), slab_rows, top_k, hidden);
      else
        gather_rows(x.data_ptr<c10::BFloat16>(), slots + r0, x_rows.data_ptr<float>(), slab_rows, top_k, hidden);
      at::Tensor gate_up_rows = at::empty({slab_rows, gate_up}, floats);
      projection(x_rows, w13.narrow(0, e0, e1 - e0), gate_up_rows, slab_offsets.data(), gate_up, hidden, w13_bits,
                 w13_groups);
      const at::Tensor activated = act_and_mul(gate_up_rows, activation);
      projection(activated, w2.narrow(0, e0, e1 - e0), x_rows, slab_offsets.data(), hidden, intermediate, w2_bits,
                 w2_groups);  // x_rows already read: reused
      accumulate_rows(x_rows.data_ptr<float>(), weights, position.data(), sums.data_ptr<float>(), tokens, top_k,
                      hidden, r0, slab_rows);
    }
    e0 = e1;
  }
  if (x.scalar_type() == at::kFloat) return sums;
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  const float* sum_rows = sums.data_ptr<float>();
  c10::BFloat16* out_rows = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    store_row(sum_rows + begin * hidden, out_rows + begin * hidden, (end - begin) * hidden);
  });
  return out;
}

}  // namespace TOKENLOOM_CPU_NAMESPACE

TOKENLOOM_LIBRARY_FRAGMENT(m) {
  m.def(
      "moe_experts(Tensor x, Tensor topk_weights, Tensor sorted_slots, Tensor expert_offsets, Tensor w13, Tensor w2, "
      "str activation, int w13_bits=4, int w2_bits=4, int w13_groups=8, int w2_groups=8) -> Tensor");
}

TOKENLOOM_LIBRARY_IMPL_CPU(m) {
  m.impl("moe_experts", &TOKENLOOM_CPU_NAMESPACE::moe_experts);
}
