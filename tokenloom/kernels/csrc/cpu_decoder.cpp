// A whole pre-norm decoder layer of the Llama family (RMSNorm, rotary self-attention over the
// paged KV cache, SwiGLU MLP) for a decode step of a few rows, chained in C++ from tokenloom's
// own operators: in Python the same layer is about a dozen module calls and two dozen torch
// calls, each a few microseconds, which at decode sizes cost as much as the arithmetic.
// Registered as `decode_layer` in every build (each ISA level's operators it chains are that
// level's); tokenloom/layers/fused_decode.py decides when a layer may take it. Every step is the operator
// the Python path calls, in the same order on the same inputs, so both give the same bits.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_ops.h"

namespace TOKENLOOM_CPU_NAMESPACE {

// weights: the packed int4 weights of qkv, o, gate_up and down, in that order. k_scale, v_scale:
// the layer's fp8 KV-cache scales (1.0 for a cache of the activations' dtype).
// Returns (the MLP's output, the residual stream), as the Python layer does.
std::tuple<at::Tensor, at::Tensor> decode_layer(const at::Tensor& hidden, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& positions, const at::Tensor& input_norm,
                                                const at::Tensor& post_norm, double eps, at::TensorList weights,
                                                const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                                                at::Tensor kv_cache, const at::Tensor& slot_mapping,
                                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                                int64_t num_heads, int64_t num_kv_heads, double scale,
                                                double k_scale, double v_scale) {
  TORCH_CHECK(weights.size() == 4, "decode_layer: weights must be the 4 packed int4 weights, got ", weights.size());
  TORCH_CHECK(kv_cache.dim() == 5, "decode_layer: kv_cache must be [2, num_blocks, block_size, kv_heads, head_size]");
  const int64_t tokens = hidden.size(0), head_size = kv_cache.size(4);
  auto [normed, residual_out] = rms_norm(hidden, residual, input_norm, eps, false);
  const at::Tensor qkv = int4_linear(normed, weights[0]);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_size,
              "decode_layer: the qkv projection's width does not match the heads");
  const at::Tensor heads = qkv.view({tokens, num_heads + 2 * num_kv_heads, head_size});
  rotary_embedding_(heads.narrow(1, 0, num_heads + num_kv_heads), positions, cos_cache, sin_cache);
  write_kv_cache(heads.narrow(1, num_heads, num_kv_heads), heads.narrow(1, num_heads + num_kv_heads, num_kv_heads),
                 kv_cache, slot_mapping, k_scale, v_scale);
  at::Tensor attention = at::empty({tokens, num_heads, head_size}, hidden.options());
  paged_decode_attention(attention, heads.narrow(1, 0, num_heads), kv_cache, block_tables, seq_lens, scale, 0, 0.0,
                         k_scale, v_scale);
  const at::Tensor projected = int4_linear(attention.view({tokens, num_heads * head_size}), weights[1]);
  auto [mlp_input, residual_next] = rms_norm(projected, residual_out, post_norm, eps, false);
  const at::Tensor activated = act_and_mul(int4_linear(mlp_input, weights[2]), "silu");
  return {int4_linear(activated, weights[3]), residual_next};
}

}  // namespace TOKENLOOM_CPU_NAMESPACE

TOKENLOOM_LIBRARY_FRAGMENT(m) {
  m.def(
      "decode_layer(Tensor hidden, Tensor? residual, Tensor positions, Tensor input_norm, Tensor post_norm, "
      "float eps, Tensor[] weights, Tensor cos_cache, Tensor sin_cache, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, int num_heads, int num_kv_heads, float scale, float k_scale=1.0, "
      "float v_scale=1.0) -> (Tensor, Tensor)");
}

TOKENLOOM_LIBRARY_IMPL_CPU(m) {
  m.impl("decode_layer", &TOKENLOOM_CPU_NAMESPACE::decode_layer);
}

