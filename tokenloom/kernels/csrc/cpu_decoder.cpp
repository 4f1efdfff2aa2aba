// A whole pre-norm decoder layer of the Llama family (RMSNorm, rotary self-attention over the
// paged KV cache, SwiGLU MLP) for a decode step of a few rows, chained in C++ from tokenloom's
// own operators: in Python the same layer is about a dozen module calls and two dozen torch
// calls, each a few microseconds, which at decode sizes cost as much as the arithmetic.
// Registered as `decode_layer` in every build (each ISA level's operators it chains are that
// level's), and as `decode_layer_lora`: the same chain with each projection's LoRA (lora_bgmv_,
// cpu_lora.cpp) added after its int4 matmul, as the Python path adds it after the base matmul.
// tokenloom/layers/fused_decode.py decides when a layer may take either. Every step is the
// operator the Python path calls, in the same order on the same inputs, so both give the same bits.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_ops.h"

namespace TOKENLOOM_CPU_NAMESPACE {

namespace {

using OptionalTensors = c10::List<c10::optional<at::Tensor>>;

// loras: 12 entries, (lora_a, lora_b_t, shard_table) for qkv, o, gate_up and down in that order,
// None for a projection no adapter of the step targets.
void check_loras(const at::Tensor& /*token_slots*/, const OptionalTensors& loras, int64_t /*max_rank*/) {
  TORCH_CHECK(loras.size() == 12, "decode_layer_lora: loras must be 4 (A, B_t, shards) triples, got ", loras.size());
}

// projection (0 qkv, 1 o, 2 gate_up, 3 down): its LoRA added to out, when one applies this step
void add_lora(at::Tensor& out, const at::Tensor& x, int64_t projection, const at::Tensor& token_slots,
              const OptionalTensors& loras, int64_t max_rank) {
  const c10::optional<at::Tensor> lora_a = loras.get(3 * projection);
  if (!lora_a.has_value()) return;
  lora_bgmv_(out, x, *lora_a, *loras.get(3 * projection + 1), token_slots, *loras.get(3 * projection + 2), max_rank);
}

// The one body of both operators, so that they cannot drift apart. LoraArgs is empty for
// decode_layer, and (token_slots, loras, max_rank) for decode_layer_lora; for decode_layer the
// LoRA steps are discarded at compile time, leaving the plain chain.
// weights: the packed int4 weights of qkv, o, gate_up and down, in that order. k_scale, v_scale:
// the layer's fp8 KV-cache scales (1.0 for a cache of the activations' dtype).
// Returns (the MLP's output, the residual stream), as the Python layer does.
template <typename... LoraArgs>
std::tuple<at::Tensor, at::Tensor> decode_layer_chain(
    const at::Tensor& hidden, const c10::optional<at::Tensor>& residual, const at::Tensor& positions,
    const at::Tensor& input_norm, const at::Tensor& post_norm, double eps, at::TensorList weights,
    const at::Tensor& cos_cache, const at::Tensor& sin_cache, at::Tensor kv_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads,
    double scale, double k_scale, double v_scale, LoraArgs... lora_args) {
  constexpr bool with_lora = sizeof...(LoraArgs) > 0;
  const char* const op = with_lora ? "decode_layer_lora" : "decode_layer";
  TORCH_CHECK(weights.size() == 4, op, ": weights must be the 4 packed int4 weights, got ", weights.size());
  if constexpr (with_lora) check_loras(lora_args...);
  TORCH_CHECK(kv_cache.dim() == 5, op, ": kv_cache must be [2, num_blocks, block_size, kv_heads, head_size]");
  const auto add_projection_lora = [&](at::Tensor& out, const at::Tensor& x, int64_t projection) {
    if constexpr (with_lora) add_lora(out, x, projection, lora_args...);
  };
  const int64_t tokens = hidden.size(0), head_size = kv_cache.size(4);
  auto [normed, residual_out] = rms_norm(hidden, residual, input_norm, eps, false);
  at::Tensor qkv = int4_linear(normed, weights[0]);
  add_projection_lora(qkv, normed, 0);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_size, op,
              ": the qkv projection's width does not match the heads");
  const at::Tensor heads = qkv.view({tokens, num_heads + 2 * num_kv_heads, head_size});
  rotary_embedding_(heads.narrow(1, 0, num_heads + num_kv_heads), positions, cos_cache, sin_cache);
  write_kv_cache(heads.narrow(1, num_heads, num_kv_heads), heads.narrow(1, num_heads + num_kv_heads, num_kv_heads),
                 kv_cache, slot_mapping, k_scale, v_scale);
  at::Tensor attention = at::empty({tokens, num_heads, head_size}, hidden.options());
  paged_decode_attention(attention, heads.narrow(1, 0, num_heads), kv_cache, block_tables, seq_lens, scale, 0, 0.0,
                         k_scale, v_scale);
  const at::Tensor attention_rows = attention.view({tokens, num_heads * head_size});
  at::Tensor projected = int4_linear(attention_rows, weights[1]);
  add_projection_lora(projected, attention_rows, 1);
  auto [mlp_input, residual_next] = rms_norm(projected, residual_out, post_norm, eps, false);
  at::Tensor gate_up = int4_linear(mlp_input, weights[2]);
  add_projection_lora(gate_up, mlp_input, 2);
  const at::Tensor activated = act_and_mul(gate_up, "silu");
  at::Tensor down = int4_linear(activated, weights[3]);
  add_projection_lora(down, activated, 3);
  return {std::move(down), std::move(residual_next)};
}

}  // namespace

}  // namespace TOKENLOOM_CPU_NAMESPACE

TOKENLOOM_LIBRARY_FRAGMENT(m) {
  m.def(
      "decode_layer(Tensor hidden, Tensor? residual, Tensor positions, Tensor input_norm, Tensor post_norm, "
      "float eps, Tensor[] weights, Tensor cos_cache, Tensor sin_cache, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, int num_heads, int num_kv_heads, float scale, float k_scale=1.0, "
      "float v_scale=1.0) -> (Tensor, Tensor)");
  m.def(
      "decode_layer_lora(Tensor hidden, Tensor? residual, Tensor positions, Tensor input_norm, Tensor post_norm, "
      "float eps, Tensor[] weights, Tensor cos_cache, Tensor sin_cache, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, int num_heads, int num_kv_heads, float scale, float k_scale, "
      "float v_scale, Tensor token_slots, Tensor?[] loras, int max_rank) -> (Tensor, Tensor)");
}

TOKENLOOM_LIBRARY_IMPL_CPU(m) {
  using namespace TOKENLOOM_CPU_NAMESPACE;
  m.impl("decode_layer", &decode_layer_chain<>);
  // the LoRA arguments after the plain operator's: token_slots, loras, max_rank
  m.impl("decode_layer_lora", &decode_layer_chain<const at::Tensor&, const OptionalTensors&, int64_t>);
}
