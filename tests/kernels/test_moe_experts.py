"""The ``moe_experts`` operator (csrc/cpu_moe.cpp) with each projection packed in its own kind, as a
GGUF file stores it (a Q4_K_M file's Q4_K gate and up beside a Q6_K down; Q5_K_M's Q5_K; Q5_0),
on every kernel level the host runs: 1 to 1100 tokens routed top-k over experts loaded unevenly
(one expert most rows, one none), each row given exactly the bits the projection's own operator
(int4_linear, int5_linear, int6_linear) gives it, and the whole within the 8-bit activations'
error of the torch loop over the dequantized experts."""

from __future__ import annotations

import pytest
import torch

from tokenloom.kernels import cpu_native
from tokenloom.kernels.int4_matmul import Int4Weight, dequantize_int4, int4_linear, pack_int4
from tokenloom.kernels.kquant_matmul import dequantize_int5, dequantize_int6, kquant_linear, pack_int5, pack_int6
from tokenloom.layers.activation import SiluAndMul
from tokenloom.layers.fused_moe import fused_experts, fused_experts_reference, route

pytestmark = pytest.mark.usefixtures("isa_level")

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 5, 256, 256, 2
# (bits, superblock groups) of each kind, as fused_experts takes them
KINDS = {"q4": (4, 8), "q6_k": (6, 8), "q5_k": (5, 8), "q5_0": (5, 1)}


def random_weight(kind: str, rows: int, columns: int, generator: torch.Generator):
    """A packed weight of ``kind`` (random codes and scales) and its dense float32 value."""
    if kind == "q4":
        codes = torch.randint(0, 16, (rows, columns), generator=generator, dtype=torch.uint8)
        scales = torch.rand(rows, columns // 32, generator=generator) * 0.02 + 0.005
        zeros = torch.randn(rows, columns // 32, generator=generator) * 0.01
        return pack_int4(codes, scales, zeros, torch.bfloat16), dequantize_int4(codes, scales, zeros)
    if kind == "q6_k":
        codes = torch.randint(0, 64, (rows, columns), generator=generator, dtype=torch.uint8)
        scales = torch.randint(-128, 128, (rows, columns // 16), generator=generator).to(torch.int8)
        d = (torch.rand(rows, columns // 256, generator=generator) * 2e-4).half()
        return pack_int6(codes, scales, d), dequantize_int6(codes, scales, d)
    groups = KINDS[kind][1]
    codes = torch.randint(0, 32, (rows, columns), generator=generator, dtype=torch.uint8)
    scales, mins = (torch.randint(0, 64, (rows, columns // 32), generator=generator, dtype=torch.uint8) for _ in "ab")
    d, dmin = ((torch.rand(rows, columns // (32 * groups), generator=generator) * 1e-3).half() for _ in "ab")
    parts = (codes, scales, mins, d, dmin, groups)
    return pack_int5(*parts), dequantize_int5(*parts)


def uneven_routing(num_tokens: int, generator: torch.Generator):
    """Top-k routing where expert 0 takes most rows and the last expert none."""
    logits = torch.randn(num_tokens, EXPERTS, generator=generator)
    logits[:, 0] += 10.0
    logits[:, -1] = -100.0
    return route(logits, TOP_K, renormalize=True)


def one_row(weight, x: torch.Tensor) -> torch.Tensor:
    """What the projection's own operator gives one row."""
    return int4_linear(x, weight) if isinstance(weight, Int4Weight) else kquant_linear(x, weight)


@pytest.mark.parametrize(
    "w13_kind, w2_kind, num_tokens, dtype",
    [
        ("q4", "q6_k", 1, torch.float32),  # Q4_K_M: a decode step
        ("q4", "q6_k", 17, torch.float32),
        ("q4", "q6_k", 8, torch.bfloat16),  # a bfloat16 model's tokens: summed in float32, rounded once
        ("q4", "q6_k", 1100, torch.float32),  # 2200 rows: the experts run in two slabs
        ("q6_k", "q6_k", 4, torch.float32),
        ("q5_k", "q6_k", 9, torch.float32),  # Q5_K_M
        ("q5_0", "q5_0", 2, torch.float32),
        ("q4", "q5_k", 17, torch.float32),
    ],
)
def test_experts_of_each_kind_give_each_row_the_bits_of_its_projections_operator(w13_kind, w2_kind, num_tokens, dtype):
    ops = cpu_native.load()
    if ops is None:
        pytest.skip("the CPU kernels are off")
    generator = torch.Generator().manual_seed(num_tokens)
    gate_up = [random_weight(w13_kind, 2 * INTERMEDIATE, HIDDEN, generator) for _ in range(EXPERTS)]
    down = [random_weight(w2_kind, HIDDEN, INTERMEDIATE, generator) for _ in range(EXPERTS)]
    w13 = torch.stack([packed.packed for packed, _ in gate_up])
    w2 = torch.stack([packed.packed for packed, _ in down])
    x = torch.randn(num_tokens, HIDDEN, generator=generator).to(dtype).float()  # values the dtype holds
    weights, ids = uneven_routing(num_tokens, generator)
    assert (ids == 0).sum() == num_tokens and not (ids == EXPERTS - 1).any()

    with torch.inference_mode():  # as the engine runs it (the operator's threads are not in that mode)
        got = fused_experts(x.to(dtype), weights, ids, w13, w2, "silu", ops, (KINDS[w13_kind], KINDS[w2_kind]))
    assert got.dtype == dtype

    expected = torch.zeros(num_tokens, HIDDEN)
    for token in range(num_tokens):  # expert by expert, row by row, through each projection's operator
        for slot in range(TOP_K):
            expert = int(ids[token, slot])
            hidden = ops.act_and_mul(one_row(gate_up[expert][0], x[token : token + 1]), "silu")
            expected[token] += weights[token, slot] * one_row(down[expert][0], hidden)[0]
    torch.testing.assert_close(got, expected.to(dtype), rtol=1e-6, atol=1e-6)
    dense13 = torch.stack([dense for _, dense in gate_up])
    dense2 = torch.stack([dense for _, dense in down])
    reference = fused_experts_reference(x, weights, ids, dense13, dense2, SiluAndMul())
    assert (got.float() - reference).abs().max() <= 0.03 * reference.abs().max()


def test_the_operator_refuses_an_unknown_kind_and_a_packed_size_of_another_kind():
    ops = cpu_native.load()
    if ops is None:
        pytest.skip("the CPU kernels are off")
    generator = torch.Generator().manual_seed(0)
    w13 = torch.stack([random_weight("q4", 2 * INTERMEDIATE, HIDDEN, generator)[0].packed] * 2)
    w2 = torch.stack([random_weight("q6_k", HIDDEN, INTERMEDIATE, generator)[0].packed] * 2)
    x, weights, slots, offsets = torch.randn(2, HIDDEN), torch.ones(2, 1), torch.arange(2), torch.tensor([0, 1, 2])
    with pytest.raises(RuntimeError, match="packed experts are 4-, 5- or 6-bit"):
        ops.moe_experts(x, weights, slots, offsets, w13, w2, "silu", 4, 3)
    with pytest.raises(RuntimeError, match="packed w13 must be"):
        ops.moe_experts(x, weights, slots, offsets, w13, w2, "silu", 4, 4)  # a 6-bit down read as 4-bit
