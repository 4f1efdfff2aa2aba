// A whole pre-norm decoder layer of the Llama family (RMSNorm, rotary self-attention over the
// paged KV cache, SwiGLU MLP) for a decode step of a few rows, chained in C++ from tokenloom's
// own operators: in Python the same layer is about a dozen module calls and two dozen torch
// calls, each a few microseconds, which at decode sizes cost as much as the arithmetic.
// Registered as `decode_layer` in every build (each ISA level's operators it chains are that
// level's), and as `decode_layer_lora`: the same chain with each projection's LoRA (lora_bgmv_,
// cpu_lora.cpp) added after its matmul, as the Python path adds it after the base matmul; and as
// `decode_layers`: every layer of a model (or of a pipeline stage) in one call, each the
// `decode_layer` chain, so that a decode step runs no Python between its layers.
// Each projection is one or more packed weights of the file's codes, each with its own kernel
// (int4, int5, int6 or int8: a Q4_K_M file's Q4_K q and k beside a Q6_K v), their outputs
// concatenated in row order as the gguf quantization method's Python path concatenates them.
// tokenloom/layers/fused_decode.py decides when a layer may take either. Every step is the
// operator the Python path calls, in the same order on the same inputs, so both give the same bits.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <array>
#include <vector>

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

// One packed weight's matmul, in x's dtype. kind = 100 * bits + the 5-bit layout's superblock
// groups (0 for the other kernels), as tokenloom/layers/fused_decode.py encodes it.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, int64_t kind) {
  switch (kind / 100) {
    case 2: return int2_linear(x, weight).to(x.scalar_type());
    case 3: return int3_linear(x, weight).to(x.scalar_type());
    case 4: return int4_linear(x, weight);
    case 5: return int5_linear(x, weight, kind % 100).to(x.scalar_type());
    case 6: return int6_linear(x, weight).to(x.scalar_type());
    case 8: return int8_linear(x, weight).to(x.scalar_type());
    default: TORCH_CHECK(false, "decode_layer: unknown packed weight kind ", kind);
  }
}

// The packed weights of one projection and their kinds, in row order.
struct Projection {
  std::vector<at::Tensor> weights;
  std::vector<int64_t> kinds;

  at::Tensor operator()(const at::Tensor& x) const {
    if (weights.size() == 1) return packed_linear(x, weights[0], kinds[0]);
    std::vector<at::Tensor> outputs;
    for (size_t index = 0; index < weights.size(); ++index)
      outputs.push_back(packed_linear(x, weights[index], kinds[index]));
    return at::cat(outputs, 1);
  }
};

// weights, kinds: every projection's packed weights and their kinds, projection after projection;
// segments: how many of them each of the 4 projections (qkv, o, gate_up, down) has.
std::array<Projection, 4> projections(const char* op, at::TensorList weights, at::IntArrayRef kinds,
                                      at::IntArrayRef segments) {
  TORCH_CHECK(segments.size() == 4, op, ": segments must give the packed weights of the 4 projections, got ",
              segments.size());
  TORCH_CHECK(kinds.size() == weights.size(), op, ": one kind per packed weight: ", kinds.size(), " kinds for ",
              weights.size(), " weights");
  std::array<Projection, 4> result;
  size_t next = 0;
  for (size_t projection = 0; projection < 4; ++projection) {
    TORCH_CHECK(segments[projection] > 0 && next + segments[projection] <= weights.size(), op,
                ": segments ", segments, " do not divide the ", weights.size(), " packed weights");
    for (int64_t index = 0; index < segments[projection]; ++index, ++next) {
      result[projection].weights.push_back(weights[next]);
      result[projection].kinds.push_back(kinds[next]);
    }
  }
  TORCH_CHECK(next == weights.size(), op, ": segments ", segments, " do not divide the ", weights.size(),
              " packed weights");
  return result;
}

// The one body of both operators, so that they cannot drift apart. LoraArgs is empty for
// decode_layer, and (token_slots, loras, max_rank) for decode_layer_lora; for decode_layer the
// LoRA steps are discarded at compile time, leaving the plain chain.
// weights, kinds, segments: the projections' packed weights (see `projections`). k_scale, v_scale:
// the layer's fp8 KV-cache scales (1.0 for a cache of the activations' dtype).
// Returns (the MLP's output, the residual stream), as the Python layer does.
template <typename... LoraArgs>
std::tuple<at::Tensor, at::Tensor> decode_layer_chain(
    const at::Tensor& hidden, const c10::optional<at::Tensor>& residual, const at::Tensor& positions,
    const at::Tensor& input_norm, const at::Tensor& post_norm, double eps, at::TensorList weights,
    at::IntArrayRef kinds, at::IntArrayRef segments, const at::Tensor& cos_cache, const at::Tensor& sin_cache,
    at::Tensor kv_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads,
    double scale, double k_scale, double v_scale, LoraArgs... lora_args) {
  constexpr bool with_lora = sizeof...(LoraArgs) > 0;
  const char* const op = with_lora ? "decode_layer_lora" : "decode_layer";
  const std::array<Projection, 4> linear = projections(op, weights, kinds, segments);
  if constexpr (with_lora) check_loras(lora_args...);
  TORCH_CHECK(kv_cache.dim() == 5, op, ": kv_cache must be [2, num_blocks, block_size, kv_heads, head_size]");
  const auto add_projection_lora = [&](at::Tensor& out, const at::Tensor& x, int64_t projection) {
    if constexpr (with_lora) add_lora(out, x, projection, lora_args...);
  };
  const int64_t tokens = hidden.size(0), head_size = kv_cache.size(4);
  auto [normed, residual_out] = rms_norm(hidden, residual, input_norm, eps, false);
  at::Tensor qkv = linear[0](normed);
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
  at::Tensor projected = linear[1](attention_rows);
  add_projection_lora(projected, attention_rows, 1);
  auto [mlp_input, residual_next] = rms_norm(projected, residual_out, post_norm, eps, false);
  at::Tensor gate_up = linear[2](mlp_input);
  add_projection_lora(gate_up, mlp_input, 2);
  const at::Tensor activated = act_and_mul(gate_up, "silu");
  at::Tensor down = linear[3](activated);
  add_projection_lora(down, activated, 3);
  return {std::move(down), std::move(residual_next)};
}

// Layers one after another, as decode_layer calls would run them: layer i's norms, cos/sin tables
// and KV cache are entry i of their lists, its packed weights the next segments[4i..4i+3] of
// `weights` and `kinds`; every layer has the same heads and scale, and a KV cache of the
// activations' dtype (the fp8 caches' scales are per layer: their steps take decode_layer).
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden, const c10::optional<at::Tensor>& residual, const at::Tensor& positions,
    at::TensorList input_norms, at::TensorList post_norms, double eps, at::TensorList weights, at::IntArrayRef kinds,
    at::IntArrayRef segments, at::TensorList cos_caches, at::TensorList sin_caches, at::TensorList kv_caches,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads,
    int64_t num_kv_heads, double scale) {
  const size_t layers = kv_caches.size();
  TORCH_CHECK(layers > 0 && input_norms.size() == layers && post_norms.size() == layers &&
                  cos_caches.size() == layers && sin_caches.size() == layers && segments.size() == 4 * layers,
              "decode_layers: one input norm, post norm, cos and sin table and KV cache per layer and 4 segments "
              "per layer, got ", layers, " KV caches, ", input_norms.size(), " and ", post_norms.size(), " norms, ",
              cos_caches.size(), " and ", sin_caches.size(), " tables, ", segments.size(), " segments");
  TORCH_CHECK(kinds.size() == weights.size(), "decode_layers: one kind per packed weight: ", kinds.size(),
              " kinds for ", weights.size(), " weights");
  at::Tensor out = hidden;
  c10::optional<at::Tensor> carried = residual;
  size_t next = 0;
  for (size_t layer = 0; layer < layers; ++layer) {
    const at::IntArrayRef layer_segments = segments.slice(4 * layer, 4);
    size_t count = 0;
    for (const int64_t segment : layer_segments) count += static_cast<size_t>(segment);
    TORCH_CHECK(next + count <= weights.size(), "decode_layers: segments ", segments, " ask for more than the ",
                weights.size(), " packed weights");
    auto [layer_out, layer_residual] = decode_layer_chain<>(
        out, carried, positions, input_norms[layer], post_norms[layer], eps, weights.slice(next, count),
        kinds.slice(next, count), layer_segments, cos_caches[layer], sin_caches[layer], kv_caches[layer], slot_mapping,
        block_tables, seq_lens, num_heads, num_kv_heads, scale, 1.0, 1.0);
    next += count;
    out = std::move(layer_out);
    carried = std::move(layer_residual);
  }
  TORCH_CHECK(next == weights.size(), "decode_layers: segments ", segments, " do not divide the ", weights.size(),
              " packed weights");
  return {std::move(out), std::move(*carried)};
}

}  // namespace

}  // namespace TOKENLOOM_CPU_NAMESPACE

TOKENLOOM_LIBRARY_FRAGMENT(m) {
  m.def(
      "decode_layer(Tensor hidden, Tensor? residual, Tensor positions, Tensor input_norm, Tensor post_norm, "
      "float eps, Tensor[] weights, int[] kinds, int[] segments, Tensor cos_cache, Tensor sin_cache, "
      "Tensor(a!) kv_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int num_heads, "
      "int num_kv_heads, float scale, float k_scale=1.0, "
      "float v_scale=1.0) -> (Tensor, Tensor)");
  m.def(
      "decode_layer_lora(Tensor hidden, Tensor? residual, Tensor positions, Tensor input_norm, Tensor post_norm, "
      "float eps, Tensor[] weights, int[] kinds, int[] segments, Tensor cos_cache, Tensor sin_cache, "
      "Tensor(a!) kv_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int num_heads, "
      "int num_kv_heads, float scale, float k_scale, "
      "float v_scale, Tensor token_slots, Tensor?[] loras, int max_rank) -> (Tensor, Tensor)");
  m.def(
      "decode_layers(Tensor hidden, Tensor? residual, Tensor positions, Tensor[] input_norms, Tensor[] post_norms, "
      "float eps, Tensor[] weights, int[] kinds, int[] segments, Tensor[] cos_caches, Tensor[] sin_caches, "
      "Tensor(a!)[] kv_caches, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int num_heads, "
      "int num_kv_heads, float scale) -> (Tensor, Tensor)");
}

TOKENLOOM_LIBRARY_IMPL_CPU(m) {
  using namespace TOKENLOOM_CPU_NAMESPACE;
  m.impl("decode_layer", &decode_layer_chain<>);
  // the LoRA arguments after the plain operator's: token_slots, loras, max_rank
  m.impl("decode_layer_lora", &decode_layer_chain<const at::Tensor&, const OptionalTensors&, int64_t>);
  m.impl("decode_layers", &decode_layers);
}
