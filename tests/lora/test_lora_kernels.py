"""tokenloom's native BGMV (``lora_bgmv_``, kernels/csrc/cpu_lora.cpp) against the torch
reference of :mod:`tokenloom.lora.layers` at every CPU kernel level: mixed slots (and base-model
tokens) in one batch, fused shards, ranks below ``max_rank``, bfloat16 activations and LoRA
weights of another dtype; a token's result does not depend on the rest of the batch; and the
fused decode layer with adapters equals the layer's Python path and, without one, decode_layer."""

from __future__ import annotations

import pytest
import torch

from tokenloom.kernels import cpu_native
from tokenloom.lora.layers import LinearLoRA, LoRABatchState

pytestmark = pytest.mark.usefixtures("isa_level")


def randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def native_ops():
    ops = cpu_native.ops_for(torch.zeros(1))
    if ops is None:
        pytest.skip("the CPU kernels are off: the torch path is the only one")
    return ops


def filled_lora(input_size, shards, *, max_loras, max_rank, dtype, ranks):
    state = LoRABatchState(max_loras=max_loras, max_rank=max_rank, dtype=dtype)
    output_size = sum(size for _, size in shards)
    lora = LinearLoRA(input_size, output_size, shards, state)
    for slot, rank in ranks.items():
        for shard_index, (_, size) in enumerate(shards):
            seed = 100 * slot + shard_index
            lora.set_slot(
                slot, shard_index, randn(rank, input_size, seed=seed), randn(size, rank, seed=seed + 50) * 0.5
            )
    return lora, state


@pytest.mark.parametrize(
    ("activation_dtype", "lora_dtype", "tolerance"),
    [
        (torch.float32, torch.float32, 1e-5),
        (torch.bfloat16, torch.bfloat16, 8e-3),
        (torch.float32, torch.bfloat16, 1e-5),
    ],
    ids=["float32", "bfloat16", "bf16-weights"],
)
def test_bgmv_equals_the_torch_reference(activation_dtype, lora_dtype, tolerance):
    """Against the exact float64 delta of the same weights: the operator sums in float32 and
    rounds once (the torch path rounds x and its rank-sized product to the LoRA dtype first, so
    in bfloat16 the two may differ by a few of its steps: compared in float32 only)."""
    ops = native_ops()
    shards = [(0, 40), (40, 24), (64, 24)]  # q, k, v
    lora, state = filled_lora(72, shards, max_loras=4, max_rank=16, dtype=lora_dtype, ranks={0: 16, 1: 5, 3: 8})
    token_slots = [3, -1, 0, 1, 1, 3, -1, 0]
    x = randn(len(token_slots), 72, seed=7, dtype=activation_dtype)
    base = randn(len(token_slots), 88, seed=8, dtype=activation_dtype)
    state.set_batch(token_slots)
    native = base.clone()
    ops.lora_bgmv_(native, x, lora.lora_a, lora.lora_b_t, state.token_slots, lora.shard_table, state.max_rank)
    # each token's own slot's columns (all shards), none for base-model tokens
    columns_per_slot = len(shards) * state.max_rank
    column_slot = torch.arange(lora.lora_a.shape[0]) // columns_per_slot
    own_columns = (column_slot.unsqueeze(0) == state.token_slots.unsqueeze(1)).double()
    exact = base.double() + torch.nn.functional.linear(
        torch.nn.functional.linear(x.double(), lora.lora_a.double()) * own_columns, lora.lora_b.double()
    )
    torch.testing.assert_close(native.double(), exact, rtol=tolerance, atol=tolerance)
    if activation_dtype == lora_dtype == torch.float32:  # the torch path rounds x to a 16-bit LoRA dtype
        torch_path = lora.add_delta_torch(x, base)
        torch.testing.assert_close(native, torch_path, rtol=tolerance, atol=tolerance)
    for row, slot in enumerate(token_slots):
        if slot < 0:
            assert torch.equal(native[row], base[row])  # base-model tokens are left as they are
    # the layer's own add_delta takes the native operator, in place
    assert torch.equal(lora.add_delta(x, base.clone()), native)


def test_a_tokens_delta_does_not_depend_on_the_batch():
    ops = native_ops()
    lora, state = filled_lora(64, [(0, 64)], max_loras=3, max_rank=8, dtype=torch.bfloat16, ranks={0: 8, 2: 4})
    x = randn(6, 64, seed=1, dtype=torch.bfloat16)
    token_slots = torch.tensor([2, 0, -1, 2, 0, 2])
    batch = torch.zeros(6, 64, dtype=torch.bfloat16)
    ops.lora_bgmv_(batch, x, lora.lora_a, lora.lora_b_t, token_slots, lora.shard_table, 8)
    for row in range(6):
        alone = torch.zeros(1, 64, dtype=torch.bfloat16)
        ops.lora_bgmv_(
            alone, x[row : row + 1], lora.lora_a, lora.lora_b_t, token_slots[row : row + 1], lora.shard_table, 8
        )
        assert torch.equal(alone[0], batch[row]), row


def test_bad_arguments_are_errors_not_crashes():
    ops = native_ops()
    lora, state = filled_lora(8, [(0, 8)], max_loras=1, max_rank=2, dtype=torch.float32, ranks={0: 2})
    out, x = torch.zeros(2, 8), torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="beyond the stacks"):
        ops.lora_bgmv_(out, x, lora.lora_a, lora.lora_b_t, torch.tensor([0, 1]), lora.shard_table, 2)
    with pytest.raises(RuntimeError, match="one per token"):
        ops.lora_bgmv_(out, x, lora.lora_a, lora.lora_b_t, torch.tensor([0]), lora.shard_table, 2)
    with pytest.raises(RuntimeError, match="outside the output"):
        ops.lora_bgmv_(out, x, lora.lora_a, lora.lora_b_t, torch.tensor([0, 0]), torch.tensor([[4, 8]]), 2)


# ---- the fused decode layer with adapters ----------------------------------------------------

PROMPTS = [[5 + (7 * index + 3 * position) % 80 for position in range(9 + 5 * index)] for index in range(4)]


@pytest.fixture(scope="module")
def lora_llm(tmp_path_factory, isa_level):
    """A tiny random Llama GGUF with Q4_1 projections (the int4 kernel's, which the fused layer
    chains) in bfloat16, and two adapters made with PEFT for its shapes."""
    import transformers
    from gguf import GGMLQuantizationType
    from helpers.gguf_files import tiny_model_state_dict, write_model_gguf
    from helpers.lora_adapters import ALL_PROJECTIONS, save_random_adapter

    from tokenloom import LLM

    if cpu_native.ops_for(torch.zeros(1)) is None:
        pytest.skip("the CPU kernels are off: no fused layer")
    config, state_dict = tiny_model_state_dict("llama", seed=3)
    directory = tmp_path_factory.mktemp("lora-fused")
    path = write_model_gguf(
        str(directory / "model.gguf"), "llama", config, state_dict, quant_type=GGMLQuantizationType.Q4_1
    )
    hf_model = transformers.LlamaForCausalLM(config)
    adapters = {
        "all": save_random_adapter(hf_model, directory / "all", r=8, alpha=16, targets=ALL_PROJECTIONS, seed=1),
        "qv": save_random_adapter(hf_model, directory / "qv", r=4, alpha=8, targets=["q_proj", "v_proj"], seed=2),
    }
    llm = LLM(
        model=path,
        dtype="bfloat16",
        max_model_len=128,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    return llm, adapters


def lora_generate(llm, lora_requests, max_tokens=8):
    from tokenloom import SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], sampling, lora_request=lora_requests)
    return [
        (
            output.outputs[0].token_ids,
            [{token: entry.logprob for token, entry in step.items()} for step in output.outputs[0].logprobs],
        )
        for output in outputs
    ]


def test_decode_steps_with_adapters_stay_fused_and_give_the_python_paths_bits(lora_llm):
    from unittest import mock

    from tests.layers.test_fused_decode import unfused as python_path
    from tokenloom import LoRARequest
    from tokenloom.layers.fused_decode import FusedDecodeLayer

    llm, adapters = lora_llm
    requests = [LoRARequest("all", 1, adapters["all"]), None, LoRARequest("qv", 2, adapters["qv"]), None]
    taken = {"fused": 0, "lora": 0}
    original = FusedDecodeLayer.__call__

    def counting(self, positions, hidden_states, *args):
        result = original(self, positions, hidden_states, *args)
        if result is not None:
            taken["fused"] += 1
            taken["lora"] += any(projection.lora.applies() for projection in self.projections)
        return result

    with mock.patch.object(FusedDecodeLayer, "__call__", counting):
        fused = lora_generate(llm, requests)
    assert taken["lora"] > 0  # decode steps with adapters took the operator
    with python_path():  # neither the layers' operator nor the whole stack's
        unfused = lora_generate(llm, requests)
    assert fused == unfused
    base = lora_generate(llm, None)
    assert fused[1] == base[1] and fused[3] == base[3]  # the base rows of the mixed batch
    assert fused[0][0] != base[0][0] and fused[2][0] != base[2][0]  # the adapters change their rows
    # each request alone gets what it got in the mixed batch
    for row, request in enumerate(requests):
        alone = lora_generate(llm, [request] * len(PROMPTS))
        assert alone[row] == fused[row], row


def decode_layer_arguments(tokens=4):
    """decode_layer's arguments for a small random layer (2 query heads, 1 KV head of 32, int4
    projections packed for the kernel) and a decode step of ``tokens`` rows, each its own
    sequence over one 16-slot block."""
    from tokenloom.kernels.int4_matmul import _pack_native

    hidden, heads, kv_heads, head_size, intermediate = 64, 2, 1, 32, 128

    def int4(out_features, in_features, seed):
        groups = in_features // 32
        codes = torch.randint(0, 16, (out_features, in_features), generator=torch.Generator().manual_seed(seed))
        return _pack_native(
            codes, randn(out_features, groups, seed=seed).abs() * 0.05, randn(out_features, groups, seed=seed + 1) * 0.1
        )

    lens = torch.tensor([3, 9, 16, 5][:tokens])
    frequencies = torch.outer(torch.arange(32.0), 1.0 / 10000 ** (torch.arange(0, head_size, 2) / head_size))
    return [
        randn(tokens, hidden, seed=20, dtype=torch.bfloat16),  # hidden
        randn(tokens, hidden, seed=21, dtype=torch.bfloat16),  # residual
        lens - 1,  # positions
        (1 + 0.1 * randn(hidden, seed=22)).to(torch.bfloat16),  # input_norm
        (1 + 0.1 * randn(hidden, seed=23)).to(torch.bfloat16),  # post_norm
        1e-5,
        [
            int4((heads + 2 * kv_heads) * head_size, hidden, 30),
            int4(hidden, heads * head_size, 31),
            int4(2 * intermediate, hidden, 32),
            int4(hidden, intermediate, 33),
        ],
        [400] * 4,  # kinds: every packed weight int4
        [1, 1, 1, 1],  # segments: one packed weight per projection
        frequencies.cos().to(torch.bfloat16),
        frequencies.sin().to(torch.bfloat16),
        randn(2, tokens + 1, 16, kv_heads, head_size, seed=24, dtype=torch.bfloat16),  # kv_cache
        torch.arange(tokens) * 16 + lens - 1,  # slot_mapping: row t's block is t
        torch.arange(tokens).view(tokens, 1),  # block_tables
        lens,
        heads,
        kv_heads,
        head_size**-0.5,
        1.0,
        1.0,
    ]


def test_decode_layer_lora_is_decode_layer_plus_the_adapters_deltas():
    """The two operators are one C++ body: without an adapter the LoRA one gives decode_layer's
    bits (output, residual and KV cache), and with adapters a base-model row keeps them."""
    ops = native_ops()
    arguments = decode_layer_arguments()
    kv_cache = arguments[11]

    def run(operator, *extra):
        cache = kv_cache.clone()
        output, residual = operator(*arguments[:11], cache, *arguments[12:], *extra)
        return output, residual, cache

    plain = run(ops.decode_layer)
    token_slots = torch.tensor([0, -1, 1, -1])
    no_adapter = run(ops.decode_layer_lora, token_slots, [None] * 12, 8)
    assert all(torch.equal(a, b) for a, b in zip(plain, no_adapter))
    # adapters on qkv (q, k, v shards) and down; o and gate_up untouched this step
    qkv, _ = filled_lora(
        64, [(0, 64), (64, 32), (96, 32)], max_loras=2, max_rank=8, dtype=torch.bfloat16, ranks={0: 8, 1: 4}
    )
    down, _ = filled_lora(128, [(0, 64)], max_loras=2, max_rank=8, dtype=torch.bfloat16, ranks={0: 8, 1: 8})
    loras = [qkv.lora_a, qkv.lora_b_t, qkv.shard_table, None, None, None, None, None, None]
    loras += [down.lora_a, down.lora_b_t, down.shard_table]
    adapted = run(ops.decode_layer_lora, token_slots, loras, 8)
    for row, slot in enumerate(token_slots.tolist()):  # the residual stream carries the qkv adapter's change too
        assert torch.equal(adapted[0][row], plain[0][row]) == (slot < 0), row
        assert torch.equal(adapted[1][row], plain[1][row]) == (slot < 0), row
    with pytest.raises(RuntimeError, match="decode_layer_lora: loras must be 4"):
        run(ops.decode_layer_lora, token_slots, [None] * 11, 8)
    with pytest.raises(RuntimeError, match=r"decode_layer: segments \[1, 1, 1, 1\] do not divide the 3 packed"):
        ops.decode_layer(*arguments[:6], arguments[6][:3], [400] * 3, *arguments[8:])
    with pytest.raises(RuntimeError, match="decode_layer: one kind per packed weight: 3 kinds for 4 weights"):
        ops.decode_layer(*arguments[:7], [400] * 3, *arguments[8:])
