"""tokenloom's native BGMV (``lora_bgmv_``, kernels/csrc/cpu_lora.cpp) against the torch
reference of :mod:`tokenloom.lora.layers` at every CPU kernel level: mixed slots (and base-model
tokens) in one batch, fused shards, ranks below ``max_rank``, bfloat16 activations and LoRA
weights of another dtype; a token's result does not depend on the rest of the batch; and the
fused decode layer with adapters equals the layer's Python path."""

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
    exact = base.double() + torch.nn.functional.linear(
        torch.nn.functional.linear(x.double(), lora.lora_a.double()) * state.mask(len(shards)).double(),
        lora.lora_b.double(),
    )
    torch.testing.assert_close(native.double(), exact, rtol=tolerance, atol=tolerance)
    if activation_dtype == lora_dtype == torch.float32:  # the torch path rounds x to a 16-bit LoRA dtype
        torch_path = base + lora._delta(x, state.mask(len(shards)))
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
    with mock.patch.object(FusedDecodeLayer, "__call__", lambda *args: None):
        unfused = lora_generate(llm, requests)
    assert fused == unfused
    base = lora_generate(llm, None)
    assert fused[1] == base[1] and fused[3] == base[3]  # the base rows of the mixed batch
    assert fused[0][0] != base[0][0] and fused[2][0] != base[2][0]  # the adapters change their rows
    # each request alone gets what it got in the mixed batch
    for row, request in enumerate(requests):
        alone = lora_generate(llm, [request] * len(PROMPTS))
        assert alone[row] == fused[row], row
