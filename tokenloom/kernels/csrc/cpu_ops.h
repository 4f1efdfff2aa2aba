// The entry points of tokenloom's CPU operators (each also registered in torch's op namespace of
// its build, see cpu_namespace.h), declared for operators that chain them without going back through Python.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>

#include "cpu_namespace.h"

// AT_DISPATCH over the activations' dtypes a model runs in (float32, bfloat16, float16): torch's
// AT_DISPATCH_FLOATING_TYPES_AND2 also instantiates every body for double, which no model uses and
// which cost each level's build about a tenth of its compile time (the attention kernel's
// instantiations most); a double tensor is refused by name ("not implemented for 'Double'").
#define TOKENLOOM_DISPATCH_ACTIVATION_TYPES(TYPE, NAME, ...)                                     \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                      \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace TOKENLOOM_CPU_NAMESPACE {

// cpu_layers.cpp
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps, bool gemma);
void rotary_embedding_(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos_cache,
                       const at::Tensor& sin_cache);
at::Tensor act_and_mul(const at::Tensor& x, const std::string& activation);

// cpu_attention.cpp
void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                            int64_t sliding_window, double soft_cap, double k_scale, double v_scale);
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
                    const at::Tensor& slot_mapping, double k_scale, double v_scale);

// cpu_qlinear.cpp
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& weight);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight);
at::Tensor int4_linear_bf16(const at::Tensor& x, const at::Tensor& weight);
bool bf16_amx_available();

// cpu_w8a16.cpp
at::Tensor w8a16_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, bool fp8);
// cpu_kquant.cpp
at::Tensor int5_linear(const at::Tensor& x, const at::Tensor& weight, int64_t superblock_groups);
at::Tensor int6_linear(const at::Tensor& x, const at::Tensor& weight);
at::Tensor int5_linear_bf16(const at::Tensor& x, const at::Tensor& weight, int64_t superblock_groups);
at::Tensor int6_linear_bf16(const at::Tensor& x, const at::Tensor& weight);
// cpu_lowbit.cpp
at::Tensor int2_linear(const at::Tensor& x, const at::Tensor& weight);
at::Tensor int3_linear(const at::Tensor& x, const at::Tensor& weight);

// cpu_lora.cpp
void lora_bgmv_(at::Tensor out, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b_t,
                const at::Tensor& token_slots, const at::Tensor& shard_table, int64_t max_rank);

// cpu_moe.cpp
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& sorted_slots,
                       const at::Tensor& expert_offsets, const at::Tensor& w13, const at::Tensor& w2,
                       const std::string& activation, int64_t w13_bits, int64_t w2_bits, int64_t w13_groups,
                       int64_t w2_groups);

}  // namespace TOKENLOOM_CPU_NAMESPACE
