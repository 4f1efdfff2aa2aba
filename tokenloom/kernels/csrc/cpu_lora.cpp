// LoRA beside tokenloom's CPU operators: the batched gather-matmul of vLLM's punica kernels
// (BGMV: each token's own adapter, shrink x @ A.T to the rank, expand by B into the output) as
// one operator. Per token, the arithmetic reads only that token's slot (not the masked product
// of every slot in the step the torch path computes) and does not depend on the other tokens of
// the batch: a request gets the same bits alone and in any batch. The Python layers call
// lora_bgmv_ (tokenloom/lora/layers.py) and so does decode_layer_lora (cpu_decoder.cpp) after
// each of its projections, so the fused layer and the Python path give the same bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu_common.h"
#include "cpu_ops.h"

namespace TOKENLOOM_CPU_NAMESPACE {

namespace {

template <typename out_t, typename lora_t>
void bgmv_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b_t,
               const int64_t* slots, const int64_t* shard_table, int64_t num_shards, int64_t max_rank) {
  const int64_t tokens = x.size(0), in_features = x.size(1), out_features = out.size(1);
  const int64_t columns = lora_a.size(0);
  const out_t* x_data = x.data_ptr<out_t>();
  out_t* out_data = out.data_ptr<out_t>();
  const lora_t* a_data = lora_a.data_ptr<lora_t>();
  const lora_t* b_data = lora_b_t.data_ptr<lora_t>();
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x_row(in_features), a_row(in_features), shrunk(max_rank), b_row(out_features),
        delta(out_features);
    for (int64_t token = begin; token < end; ++token) {
      const int64_t slot = slots[token];
      if (slot < 0) continue;
      TORCH_CHECK((slot + 1) * num_shards * max_rank <= columns, "lora_bgmv_: slot ", slot, " beyond the stacks");
      load_row(x_data + token * in_features, x_row.data(), in_features);
      out_t* out_row = out_data + token * out_features;
      for (int64_t shard = 0; shard < num_shards; ++shard) {
        const int64_t offset = shard_table[2 * shard], size = shard_table[2 * shard + 1];
        const int64_t first_column = (slot * num_shards + shard) * max_rank;
        // shrink: the token's hidden state onto the adapter's rank
        for (int64_t r = 0; r < max_rank; ++r) {
          load_row(a_data + (first_column + r) * in_features, a_row.data(), in_features);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t k = 0; k < in_features; ++k) sum += x_row[k] * a_row[k];
          shrunk[r] = sum;
        }
        // expand: B's rows for this shard, summed in float32, then added to the output once
        std::fill(delta.begin(), delta.begin() + size, 0.f);
        for (int64_t r = 0; r < max_rank; ++r) {
          if (shrunk[r] == 0.f) continue;  // a rank below max_rank leaves zero columns
          load_row(b_data + (first_column + r) * out_features + offset, b_row.data(), size);
          const float weight = shrunk[r];
#pragma omp simd
          for (int64_t o = 0; o < size; ++o) delta[o] += weight * b_row[o];
        }
        load_row(out_row + offset, b_row.data(), size);
#pragma omp simd
        for (int64_t o = 0; o < size; ++o) b_row[o] += delta[o];
        store_row(b_row.data(), out_row + offset, size);
      }
    }
  });
}

template <typename out_t>
void bgmv_dispatch_lora(at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b_t,
                        const int64_t* slots, const int64_t* shard_table, int64_t num_shards, int64_t max_rank) {
  switch (lora_a.scalar_type()) {
    case at::kFloat:
      return bgmv_rows<out_t, float>(out, x, lora_a, lora_b_t, slots, shard_table, num_shards, max_rank);
    case at::kBFloat16:
      return bgmv_rows<out_t, c10::BFloat16>(out, x, lora_a, lora_b_t, slots, shard_table, num_shards, max_rank);
    case at::kHalf:
      return bgmv_rows<out_t, c10::Half>(out, x, lora_a, lora_b_t, slots, shard_table, num_shards, max_rank);
    default:
      TORCH_CHECK(false, "lora_bgmv_: LoRA weights of dtype ", lora_a.scalar_type(), " are not supported");
  }
}

}  // namespace

// out [tokens, out] += per token t with token_slots[t] >= 0, per shard (offset, size) of
// shard_table [shards, 2]: x[t] @ A[cols of (slot, shard)].T @ B_t[same cols, offset:offset+size].
// lora_a [slots * shards * max_rank, in] and lora_b_t [same, out] are the layer's stacks; a token
// of slot -1 (the base model) is left as it is.
void lora_bgmv_(at::Tensor out, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b_t,
                const at::Tensor& token_slots, const at::Tensor& shard_table, int64_t max_rank) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0), "lora_bgmv_: x and out must be [tokens, n]");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "lora_bgmv_: x and out must share a dtype");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "lora_bgmv_: x and out must be contiguous");
  TORCH_CHECK(lora_a.is_contiguous() && lora_b_t.is_contiguous(), "lora_bgmv_: the stacks must be contiguous");
  TORCH_CHECK(lora_a.scalar_type() == lora_b_t.scalar_type(), "lora_bgmv_: A and B must share a dtype");
  TORCH_CHECK(lora_a.size(1) == x.size(1) && lora_b_t.size(1) == out.size(1) && lora_a.size(0) == lora_b_t.size(0),
              "lora_bgmv_: the stacks do not fit x and out");
  TORCH_CHECK(token_slots.scalar_type() == at::kLong && token_slots.numel() == x.size(0),
              "lora_bgmv_: token_slots must be int64, one per token");
  TORCH_CHECK(shard_table.scalar_type() == at::kLong && shard_table.dim() == 2 && shard_table.size(1) == 2,
              "lora_bgmv_: shard_table must be int64 [shards, 2]");
  const at::Tensor slots = token_slots.contiguous(), shards = shard_table.contiguous();
  const int64_t num_shards = shards.size(0);
  const int64_t* shard_data = shards.data_ptr<int64_t>();
  for (int64_t shard = 0; shard < num_shards; ++shard) {
    TORCH_CHECK(shard_data[2 * shard] >= 0 && shard_data[2 * shard] + shard_data[2 * shard + 1] <= out.size(1),
                "lora_bgmv_: a shard lies outside the output");
  }
  TORCH_CHECK(lora_a.size(0) % (num_shards * max_rank) == 0, "lora_bgmv_: the stacks are not whole slots");
  const int64_t* slot_data = slots.data_ptr<int64_t>();
  switch (x.scalar_type()) {
    case at::kFloat:
      return bgmv_dispatch_lora<float>(out, x, lora_a, lora_b_t, slot_data, shard_data, num_shards, max_rank);
    case at::kBFloat16:
      return bgmv_dispatch_lora<c10::BFloat16>(out, x, lora_a, lora_b_t, slot_data, shard_data, num_shards, max_rank);
    case at::kHalf:
      return bgmv_dispatch_lora<c10::Half>(out, x, lora_a, lora_b_t, slot_data, shard_data, num_shards, max_rank);
    default:
      TORCH_CHECK(false, "lora_bgmv_: activations of dtype ", x.scalar_type(), " are not supported");
  }
}

}  // namespace TOKENLOOM_CPU_NAMESPACE

TOKENLOOM_LIBRARY_FRAGMENT(m) {
  m.def(
      "lora_bgmv_(Tensor(a!) out, Tensor x, Tensor lora_a, Tensor lora_b_t, Tensor token_slots, Tensor shard_table, "
      "int max_rank) -> ()");
}

TOKENLOOM_LIBRARY_IMPL_CPU(m) {
  m.impl("lora_bgmv_", &TOKENLOOM_CPU_NAMESPACE::lora_bgmv_);
}
