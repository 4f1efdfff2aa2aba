"""The mixture-of-experts layer (tokenloom/layers/fused_moe.py): routing exactly as transformers'
routers route; the ``moe_experts`` operator (csrc/cpu_moe.cpp) against the torch loop over
experts at every kernel level, for float32, bfloat16 and 4-bit experts (the 4-bit ones bit for
bit against ``int4_linear`` run expert by expert); the layer loading per-expert and stacked
tensors alike, tensor-parallel shards summing to the whole layer, a missing expert named, and a
sigmoid-gated shared expert as transformers' Qwen2-MoE block computes it; a Q4_K_M file's
experts kept in their own codes per projection (Q4_K gate/up, Q6_K down)."""

from __future__ import annotations

import pytest
import torch
from helpers.isa_levels import at_the_host_level
from torch.nn import functional as F

from tokenloom.builtin_plugins.quantization import gguf as gguf_method_module
from tokenloom.builtin_plugins.quantization.gguf import GGUFQuantizationMethod
from tokenloom.builtin_plugins.quantization.gguf_blocks import GGML_TYPES, Q4_K, Q5_K, Q6_K, Q8_0, GGUFWeight
from tokenloom.builtin_plugins.quantization.gguf_int4 import int4_groups
from tokenloom.builtin_plugins.quantization.gguf_kquant import int6_parts
from tokenloom.errors import ModelLoadError
from tokenloom.kernels import cpu_native
from tokenloom.kernels.int4_matmul import int4_linear, pack_int4
from tokenloom.kernels.kquant_matmul import pack_int6
from tokenloom.layers.activation import SiluAndMul
from tokenloom.layers.fused_moe import FusedExperts, FusedMoE, fused_experts, fused_experts_reference, route

pytestmark = pytest.mark.usefixtures("isa_level")

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 6, 64, 48, 2


def routed_batch(num_tokens: int, seed: int = 0):
    """Tokens, their routing (every expert but the last chosen by some token), and float32 experts."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=generator)
    logits = torch.randn(num_tokens, EXPERTS, generator=generator)
    logits[:, -1] = -100.0  # an expert no token chooses costs nothing and changes nothing
    weights, ids = route(logits, TOP_K, renormalize=True)
    w13 = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) / INTERMEDIATE**0.5
    return x, weights, ids, w13, w2


def native_ops():
    ops = cpu_native.load()
    if ops is None:
        pytest.skip("the CPU kernels are off")
    return ops


@at_the_host_level()
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_softmax_routing_matches_transformers_qwen3_moe_router(norm_topk_prob):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob)
    router = Qwen3MoeTopKRouter(config)
    torch.manual_seed(0)
    router.weight.data.normal_()
    x = torch.randn(7, HIDDEN)
    _, expected_weights, expected_ids = router(x)
    weights, ids = route(F.linear(x, router.weight), 3, renormalize=norm_topk_prob)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=0, atol=0)


@at_the_host_level()
def test_sigmoid_routing_and_an_unknown_scoring_refused():
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    weights, ids = route(logits, 2, renormalize=False, scoring="sigmoid")
    assert ids.tolist() == [[1, 3]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[2.0, 1.0]])))
    weights, _ = route(logits, 2, renormalize=True, scoring="sigmoid")
    torch.testing.assert_close(weights.sum(-1), torch.ones(1))
    with pytest.raises(Exception, match="unknown expert scoring function 'relu'"):
        route(logits, 2, renormalize=False, scoring="relu")


@pytest.mark.parametrize("num_tokens", [1, 9, 150])  # a decode row, a small batch, past a row chunk (64)
def test_the_operator_matches_the_torch_loop_over_experts_in_float32(num_tokens):
    ops = native_ops()
    x, weights, ids, w13, w2 = routed_batch(num_tokens)
    expected = fused_experts_reference(x, weights, ids, w13, w2, SiluAndMul())
    got = fused_experts(x, weights, ids, w13, w2, "silu", ops)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_operator_takes_bfloat16_experts_and_rows():
    ops = native_ops()
    x, weights, ids, w13, w2 = routed_batch(12, seed=1)
    w13, w2, x = w13.bfloat16(), w2.bfloat16(), x.bfloat16()
    expected = fused_experts_reference(x.float(), weights, ids, w13.float(), w2.float(), SiluAndMul())
    got = fused_experts(x, weights, ids, w13, w2, "silu", ops)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)


def random_int4(rows: int, columns: int, generator: torch.Generator):
    codes = torch.randint(0, 16, (rows, columns), generator=generator, dtype=torch.uint8)
    scales = torch.rand(rows, columns // 32, generator=generator) * 0.05 + 0.01
    zeros = torch.randn(rows, columns // 32, generator=generator) * 0.01
    return codes, scales, zeros


@pytest.mark.parametrize("num_tokens", [1, 7])
def test_four_bit_experts_give_each_row_the_bits_int4_linear_gives_it(num_tokens):
    ops = native_ops()
    generator = torch.Generator().manual_seed(2)
    x, weights, ids, _, _ = routed_batch(num_tokens, seed=2)
    intermediate = 32  # 4-bit: multiples of 32 (groups) and of 16 (output blocks)
    gate_up = [pack_int4(*random_int4(2 * intermediate, HIDDEN, generator), torch.bfloat16) for _ in range(EXPERTS)]
    down = [pack_int4(*random_int4(HIDDEN, intermediate, generator), torch.bfloat16) for _ in range(EXPERTS)]
    assert all(weight.kernel is not None for weight in gate_up + down)
    w13 = torch.stack([weight.packed for weight in gate_up])
    w2 = torch.stack([weight.packed for weight in down])
    got = fused_experts(x, weights, ids, w13, w2, "silu", ops)
    expected = torch.zeros(num_tokens, HIDDEN)
    for token in range(num_tokens):  # expert by expert, row by row, through int4_linear
        for slot in range(TOP_K):
            expert = int(ids[token, slot])
            hidden = ops.act_and_mul(int4_linear(x[token : token + 1], gate_up[expert]), "silu")
            expected[token] += weights[token, slot] * int4_linear(hidden, down[expert])[0]
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_the_operator_refuses_mismatched_weights_and_routing():
    ops = native_ops()
    x, _, _, w13, w2 = routed_batch(4)
    weights, slots, offsets = torch.ones(4, 1), torch.arange(4), torch.tensor([0, 4, 4, 4, 4, 4, 4])
    with pytest.raises(RuntimeError, match="w13 must be \\[experts, 2 I, H\\] and w2 \\[experts, H, I\\]"):
        ops.moe_experts(x, weights, slots, offsets, w13, w2[:, :, :-1].contiguous(), "silu")
    with pytest.raises(RuntimeError, match="expert_offsets must run from 0 to tokens \\* top_k"):
        ops.moe_experts(x, weights, slots, offsets - 1, w13, w2, "silu")
    with pytest.raises(RuntimeError, match="sorted_slots must hold each of 0 .. tokens \\* top_k once"):
        ops.moe_experts(x, weights, torch.tensor([0, 1, 1, 3]), offsets, w13, w2, "silu")
    with pytest.raises(RuntimeError, match="topk_weights must be a contiguous \\[tokens, top_k\\] float32"):
        ops.moe_experts(x, weights.double(), slots, offsets, w13, w2, "silu")


def expert_tensors(w13: torch.Tensor, w2: torch.Tensor) -> dict[tuple[str, int], torch.Tensor]:
    size = w13.shape[1] // 2
    tensors = {}
    for expert in range(w13.shape[0]):
        tensors[("gate", expert)] = w13[expert, :size]
        tensors[("up", expert)] = w13[expert, size:]
        tensors[("down", expert)] = w2[expert]
    return tensors


class FakeGroup:
    """A tensor-parallel group of ``size`` ranks whose all-reduce is the caller's to do."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def all_reduce(self, tensor):
        return tensor


@at_the_host_level()
def test_per_expert_and_stacked_tensors_load_alike_and_tensor_parallel_shards_sum_to_the_whole():
    x, _, _, w13, w2 = routed_batch(5, seed=3)
    router = torch.randn(EXPERTS, HIDDEN)
    whole = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, "silu", renormalize=True)
    whole.gate.load_checkpoint_weight("weight", router)
    for shard, tensor in expert_tensors(w13, w2).items():
        whole.experts.load_checkpoint_weight("weight", tensor, shard)
    whole.experts.process_weights_after_loading()
    stacked = FusedExperts(EXPERTS, HIDDEN, INTERMEDIATE, "silu")
    size = INTERMEDIATE
    for projection, tensor in (("gate", w13[:, :size]), ("up", w13[:, size:]), ("down", w2)):
        stacked.load_checkpoint_weight("weight", tensor, (projection, None))
    stacked.process_weights_after_loading()
    assert torch.equal(stacked.w13_weight, w13) and torch.equal(stacked.w2_weight, w2)
    expected = whole(x)
    weights, ids = route(F.linear(x, router), TOP_K, renormalize=True)
    torch.testing.assert_close(expected, fused_experts_reference(x, weights, ids, w13, w2, SiluAndMul()))
    partial_sums = []
    for rank in range(2):
        shard = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, "silu", renormalize=True, tp_group=FakeGroup(rank, 2))
        assert shard.experts.w13_weight.shape == (EXPERTS, INTERMEDIATE, HIDDEN)
        shard.gate.load_checkpoint_weight("weight", router)
        for name, tensor in expert_tensors(w13, w2).items():
            shard.experts.load_checkpoint_weight("weight", tensor, name)
        shard.experts.process_weights_after_loading()
        partial_sums.append(shard(x))
    torch.testing.assert_close(partial_sums[0] + partial_sums[1], expected, rtol=1e-5, atol=1e-5)


@at_the_host_level()
def test_a_missing_expert_weight_is_named():
    _, _, _, w13, w2 = routed_batch(1)
    experts = FusedExperts(EXPERTS, HIDDEN, INTERMEDIATE, "silu")
    for shard, tensor in expert_tensors(w13, w2).items():
        if shard != ("down", 2):
            experts.load_checkpoint_weight("weight", tensor, shard)
    with pytest.raises(ModelLoadError, match=r"lacks 1 expert weight\(s\) the model needs: expert 2 down"):
        experts.process_weights_after_loading()
    with pytest.raises(
        ModelLoadError, match=r"expert 1's up weight has shape \(48, 32\), the model expects \(48, 64\)"
    ):
        experts.load_checkpoint_weight("weight", w13[1, INTERMEDIATE:, :32], ("up", 1))


def random_blocks(ggml_type: int, experts: int, rows: int, columns: int, generator: torch.Generator) -> GGUFWeight:
    """A stacked ``[experts, rows, columns]`` GGUF tensor of random blocks whose float16 scales are
    small and finite (Q4_K, Q5_K: d and dmin first; Q6_K: d last; Q8_0: d first)."""
    _, block_values, block_bytes = GGML_TYPES[ggml_type]
    count = experts * rows * columns // block_values
    data = torch.randint(0, 256, (count, block_bytes), generator=generator, dtype=torch.uint8)
    scale = (torch.rand(count, 2, generator=generator) * 1e-3).half().view(torch.uint8)
    if ggml_type == Q6_K:
        data[:, -2:] = scale[:, :2]
    else:
        head = 4 if ggml_type in (Q4_K, Q5_K) else 2
        data[:, :head] = scale[:, :head]
    return GGUFWeight(data.view(experts * rows, -1), ggml_type, torch.Size((experts, rows, columns)), "ffn_exps")


@pytest.mark.parametrize("ggml_type", [Q4_K, Q6_K], ids=["q4_k", "q6_k"])
def test_gguf_expert_rows_are_packed_to_the_torch_packers_bytes(ggml_type):
    """A GGUF file's Q4_K and Q6_K expert rows (48: an odd last block of 16) packed by the linear
    layers' native packers give the bytes the torch packers give from the same blocks."""
    native_ops()
    weight = random_blocks(ggml_type, 1, 48, 512, torch.Generator().manual_seed(5))
    rows = GGUFWeight(weight.data, ggml_type, torch.Size((48, 512)))
    packed = GGUFQuantizationMethod().pack_expert_rows(rows, torch.bfloat16)
    if ggml_type == Q6_K:
        expected = pack_int6(*int6_parts(rows))
    else:
        expected = pack_int4(*int4_groups(rows), torch.bfloat16)
    assert type(packed) is type(expected) and torch.equal(packed.packed, expected.packed)


@pytest.mark.parametrize("down_type", [Q6_K, Q8_0], ids=["q6_k-down", "q8_0-down"])
def test_a_q4_k_m_files_experts_stay_in_their_codes_per_projection(down_type):
    """Q4_K gate and up beside a Q6_K down (a Q4_K_M file's layer) are kept packed, each in its
    own kind, with no dense copy; a type the operator does not take (Q8_0) makes the layer dense.
    Either way each checkpoint tensor's file pages are released once it is loaded."""
    native_ops()
    generator = torch.Generator().manual_seed(4)
    experts, hidden, intermediate = 4, 256, 256
    stacks = {
        "gate": random_blocks(Q4_K, experts, intermediate, hidden, generator),
        "up": random_blocks(Q4_K, experts, intermediate, hidden, generator),
        "down": random_blocks(down_type, experts, hidden, intermediate, generator),
    }
    layer = FusedExperts(
        experts, hidden, intermediate, "silu", quant_method=GGUFQuantizationMethod(), params_dtype=torch.bfloat16
    )
    released = []
    for projection, stack in stacks.items():
        stack.release = lambda projection=projection: released.append(projection)
        layer.load_checkpoint_weight("weight", stack, (projection, None))
        assert released[-1] == projection
    layer.process_weights_after_loading()
    assert released == ["gate", "up", "down"]
    w13 = torch.cat([stacks["gate"].dequantize(), stacks["up"].dequantize()], dim=1)
    w2 = stacks["down"].dequantize()
    if down_type == Q6_K:
        assert layer.w13_weight.is_meta and layer.w2_weight.is_meta
        assert (layer.w13_kind, layer.w2_kind) == ((4, 8), (6, 8))
    else:
        assert layer.w13_packed is None and layer.w2_packed is None
        assert torch.equal(layer.w13_weight, w13.bfloat16()) and torch.equal(layer.w2_weight, w2.bfloat16())
    x = torch.randn(9, hidden, generator=generator)
    weights, ids = route(torch.randn(9, experts, generator=generator), 2, renormalize=True)
    reference = fused_experts_reference(x, weights, ids, w13, w2, SiluAndMul())
    got = layer(x.bfloat16(), weights, ids).float()
    assert (got - reference).abs().max() <= 0.03 * reference.abs().max()


@pytest.mark.parametrize("down_type", [Q4_K, Q6_K, Q5_K], ids=["q4_k-down", "q6_k-down", "q5_k-down"])
def test_a_stacked_down_tensor_packed_in_one_call_holds_the_bytes_of_its_experts_packed_one_by_one(
    down_type, monkeypatch
):
    """A file's stacked down tensor, packed whole straight into ``w2_packed``, gives each expert
    the bytes its own packing gives it (each expert's blocks paired within it), and the layer the
    same output; a 5-bit stack is packed in parts of rows (here one expert's), joined."""
    native_ops()
    monkeypatch.setattr(gguf_method_module, "KQUANT_EXPERT_PACK_ROWS", 256)
    generator = torch.Generator().manual_seed(6)
    experts, hidden, intermediate = 3, 256, 256
    stacks = {
        "gate": random_blocks(Q4_K, experts, intermediate, hidden, generator),
        "up": random_blocks(Q4_K, experts, intermediate, hidden, generator),
        "down": random_blocks(down_type, experts, hidden, intermediate, generator),
    }

    def loaded(per_expert: bool) -> FusedExperts:
        layer = FusedExperts(
            experts, hidden, intermediate, "silu", quant_method=GGUFQuantizationMethod(), params_dtype=torch.bfloat16
        )
        for projection, stack in stacks.items():
            if not per_expert:
                layer.load_checkpoint_weight("weight", stack, (projection, None))
                continue
            rows = stack.shape[1]
            for expert in range(experts):
                one = GGUFWeight(stack.data.view(experts, rows, -1)[expert], stack.ggml_type, stack.shape[1:])
                layer.load_checkpoint_weight("weight", one, (projection, expert))
        layer.process_weights_after_loading()
        return layer

    whole, one_by_one = loaded(per_expert=False), loaded(per_expert=True)
    assert whole.w2_kind == one_by_one.w2_kind == {Q4_K: (4, 8), Q6_K: (6, 8), Q5_K: (5, 8)}[down_type]
    assert whole.w2_packed.is_contiguous() and torch.equal(whole.w2_packed, one_by_one.w2_packed)
    assert torch.equal(whole.w13_packed, one_by_one.w13_packed)
    x = torch.randn(5, hidden, generator=generator).bfloat16()
    weights, ids = route(torch.randn(5, experts, generator=generator), 2, renormalize=True)
    assert torch.equal(whole(x, weights, ids), one_by_one(x, weights, ids))


def load_qwen2_moe_block(moe: FusedMoE, block, shared_gate: torch.Tensor) -> FusedMoE:
    """``moe`` holding the weights of transformers' Qwen2MoeSparseMoeBlock ``block``, the shared
    expert gate given as ``shared_gate`` (a llama.cpp file may hold it as a vector)."""
    from tokenloom.layers.linear import process_weights_after_loading

    size = block.experts.gate_up_proj.shape[1] // 2
    moe.gate.load_checkpoint_weight("weight", block.gate.weight.detach())
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    for projection, tensor in (("gate", gate_up[:, :size]), ("up", gate_up[:, size:]), ("down", down)):
        moe.experts.load_checkpoint_weight("weight", tensor, (projection, None))
    shared = block.shared_expert
    moe.shared_expert.gate_up_proj.load_checkpoint_weight("weight", shared.gate_proj.weight.detach(), 0)
    moe.shared_expert.gate_up_proj.load_checkpoint_weight("weight", shared.up_proj.weight.detach(), 1)
    moe.shared_expert.down_proj.load_checkpoint_weight("weight", shared.down_proj.weight.detach())
    moe.shared_expert_gate.load_checkpoint_weight("weight", shared_gate)
    process_weights_after_loading(moe)
    return moe


@at_the_host_level()
def test_a_gated_shared_expert_matches_transformers_qwen2_moe_block_and_its_tensor_parallel_shards_sum():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    shared_size = 32
    config = Qwen2MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTERMEDIATE,
        shared_expert_intermediate_size=shared_size,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=False,
    )
    torch.manual_seed(0)
    block = Qwen2MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, param.shape[-1] ** -0.5)
    x = torch.randn(5, HIDDEN)
    with torch.no_grad():
        expected = block(x.unsqueeze(0))[0]
    options = dict(renormalize=False, shared_expert_intermediate_size=shared_size, shared_expert_gate=True)
    vector = block.shared_expert_gate.weight.detach().reshape(-1)
    whole = load_qwen2_moe_block(FusedMoE(EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, "silu", **options), block, vector)
    torch.testing.assert_close(whole(x), expected, rtol=1e-5, atol=1e-5)
    shards = [
        load_qwen2_moe_block(
            FusedMoE(EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, "silu", tp_group=FakeGroup(rank, 2), **options),
            block,
            block.shared_expert_gate.weight.detach(),
        )
        for rank in range(2)
    ]
    assert shards[0].shared_expert.down_proj.input_size == shared_size // 2
    torch.testing.assert_close(shards[0](x) + shards[1](x), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ModelLoadError, match=r"SharedExpertGate expects 'weight' of shape \(1, 64\) or \(64,\)"):
        whole.shared_expert_gate.load_checkpoint_weight("weight", torch.zeros(2, HIDDEN))
