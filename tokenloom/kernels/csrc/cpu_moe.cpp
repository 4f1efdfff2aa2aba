// The experts of a mixture-of-experts layer (tokenloom/layers/fused_moe.py), every expert in one
// operator, in every build (one per ISA level, see cpu_namespace.h):
//   `moe_experts(x, expert_offsets, w13, w2, activation)`: rows x [R, H] float32 sorted by expert
//   (expert e's rows are expert_offsets[e] .. expert_offsets[e + 1]), each row through its expert's
//   gated MLP: down(act(gate(x)) * up(x)), float32 out [R, H]. The caller routes the tokens, sorts
//   their (token, expert) pairs and sums each token's rows with its routing weights.
// The experts' weights are stacked:
//   float (float32 or bfloat16): w13 [E, 2 I, H] (gate rows then up rows), w2 [E, H, I];
//   4-bit (uint8, each expert packed for int4_linear, cpu_qlinear.cpp): w13 [E, 2 I / 16, H / 32 * 320],
//   w2 [E, H / 16, I / 32 * 320]; the rows are quantized to 8 bits once per projection, and each
//   tile is cpu_qlinear.cpp's own (cpu_qlinear.h), so a row gets the bits int4_linear gives it.
// Each projection is one at::parallel_for over every (expert, block of output features, chunk of
// the expert's rows) that has rows: no loop over experts outside it, and an expert no row chose
// costs nothing. Between them the gated activation is act_and_mul's (cpu_layers.cpp).
// Float weights take a plain dot-product tile (4 weight rows against each activation row, left to
// the compiler's vectoriser; a bfloat16 weight row is widened once per tile): a decode step's few
// rows per expert are bound by reading the weights.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_ops.h"
#include "cpu_qlinear.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
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

void projection(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, const int64_t* offsets, int64_t N,
                int64_t K) {
  const int64_t experts = weight.size(0);
  if (weight.scalar_type() == at::kByte)
    int4_projection(x.data_ptr<float>(), weight.data_ptr<uint8_t>(), out.data_ptr<float>(), offsets, experts, N, K);
  else if (weight.scalar_type() == at::kBFloat16)
    float_projection(x.data_ptr<float>(), weight.data_ptr<c10::BFloat16>(), out.data_ptr<float>(), offsets, experts,
                     N, K);
  else
    float_projection(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), offsets, experts, N, K);
}

}  // namespace

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& expert_offsets, const at::Tensor& w13,
                       const at::Tensor& w2, const std::string& activation) {
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
    TORCH_CHECK(hidden % 32 == 0, "moe_experts: 4-bit experts need a hidden size that is a multiple of 32");
    gate_up = w13.size(1) * kMoeBlock;
    intermediate = gate_up / 2;
    TORCH_CHECK(w13.size(2) == hidden / 32 * 320 && intermediate % 32 == 0 && w2.size(1) * kMoeBlock == hidden &&
                    w2.size(2) == intermediate / 32 * 320,
                "moe_experts: 4-bit w13 must be [experts, 2 I / 16, H / 32 * 320] and w2 [experts, H / 16, I / 32 * "
                "320], with I a multiple of 32");
  } else {
    TORCH_CHECK(w13.scalar_type() == at::kFloat || w13.scalar_type() == at::kBFloat16,
                "moe_experts: expert weights must be float32, bfloat16 or packed 4-bit (uint8)");
    gate_up = w13.size(1);
    intermediate = gate_up / 2;
    TORCH_CHECK(gate_up % 2 == 0 && w13.size(2) == hidden && w2.size(1) == hidden && w2.size(2) == intermediate,
                "moe_experts: w13 must be [experts, 2 I, H] and w2 [experts, H, I]");
  }
  at::Tensor out = at::empty({rows, hidden}, x.options());
  if (rows == 0) return out;
  at::Tensor gate_up_rows = at::empty({rows, gate_up}, x.options());
  projection(x, w13, gate_up_rows, offsets, gate_up, hidden);
  const at::Tensor activated = act_and_mul(gate_up_rows, activation);
  projection(activated, w2, out, offsets, hidden, intermediate);
  return out;
}

}  // namespace TOKENLOOM_CPU_NAMESPACE

TOKENLOOM_LIBRARY_FRAGMENT(m) {
  m.def("moe_experts(Tensor x, Tensor expert_offsets, Tensor w13, Tensor w2, str activation) -> Tensor");
}

TOKENLOOM_LIBRARY_IMPL_CPU(m) { m.impl("moe_experts", &TOKENLOOM_CPU_NAMESPACE::moe_experts); }
