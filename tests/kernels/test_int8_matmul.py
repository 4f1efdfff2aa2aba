"""The int8 matmul (GGML Q8_0 weights times 8-bit activations) against its exact reference, and
the LM head that keeps a Q8_0 checkpoint tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from helpers.isa_levels import at_the_host_level

from tokenloom.builtin_plugins.quantization.gguf_blocks import GGUFWeight, PackedRows
from tokenloom.kernels import cpu_native, int8_matmul
from tokenloom.kernels.int4_matmul import quantize_activations
from tokenloom.kernels.int8_matmul import dequantize_int8, int8_linear, pack_int8
from tokenloom.layers.embedding import ParallelLMHead, VocabParallelEmbedding

# on every kernel level the host runs; only kernels switched off go without the int8 kernel
pytestmark = [
    pytest.mark.usefixtures("isa_level"),
    pytest.mark.skipif(
        int8_matmul._kernel() is None, reason="tokenloom's CPU kernels are switched off or did not build"
    ),
]


def random_int8(out_features: int, in_features: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    scales = torch.rand(out_features, in_features // 32, generator=generator) * 0.01
    return codes, scales


def exact_product(x: torch.Tensor, codes, scales) -> torch.Tensor:
    """What the kernel computes, in float64: the 8-bit activations times the Q8_0 weight."""
    activation_codes, activation_scales = quantize_activations(x)
    rows, features = x.shape
    activations = activation_codes.view(rows, -1, 32).double() * activation_scales.double().unsqueeze(-1)
    return activations.view(rows, features) @ dequantize_int8(codes, scales).double().T


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 131])
@pytest.mark.parametrize("shape", [(16, 32), (64, 576), (48, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_is_exact_up_to_float32_summation(rows, shape, dtype):
    codes, scales = random_int8(*shape, seed=rows)
    weight = pack_int8(codes, scales)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
    out = int8_linear(x, weight)
    assert out.dtype == torch.float32 and out.shape == (rows, shape[0])
    exact = exact_product(x, codes, scales)
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=1e-5 * exact.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(48, 32), (96, 576), (80, 1536)])
def test_any_number_of_rows_gives_each_row_the_bits_it_gets_alone(shape, dtype):
    """However the kernel tiles M rows, each float32 logit keeps its accumulation order over the
    groups: M rows at once give every row exactly the bits it gets alone (a verify step's logits
    are a decode step's). Odd block counts (48, 80), one group and 48 groups."""
    codes, scales = random_int8(*shape, seed=shape[1])
    weight = pack_int8(codes, scales)
    x = torch.randn(20, shape[1], generator=torch.Generator().manual_seed(shape[0])).to(dtype)
    alone = torch.cat([int8_linear(x[row : row + 1], weight) for row in range(20)])
    for rows in range(1, 21):
        together = int8_linear(x[:rows], weight)
        assert together.dtype == torch.float32
        assert torch.equal(together, alone[:rows]), f"{rows} rows: {(together != alone[:rows]).nonzero()[:4].tolist()}"


def test_extreme_codes_are_exact():
    """-128 and 127 (the unsigned codes 0 and 255), against activations of both signs."""
    codes = torch.tensor([[-128, 127] * 16] * 16, dtype=torch.int8)
    scales = torch.ones(16, 1)
    x = torch.tensor([[1.0, -1.0] * 16, [-1.0, 1.0] * 16])
    torch.testing.assert_close(
        int8_linear(x, pack_int8(codes, scales)),
        torch.full((2, 16), 1.0) * torch.tensor([[-255.0 * 16], [255.0 * 16]]),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("rows", [1, 5, 130])
@at_the_host_level()  # it switches through every level itself
def test_every_level_the_host_runs_gives_the_same_integers(rows):
    """AVX-512's unsigned codes less 128 times the code sum and AVX2's sign trick are the same
    integers: the levels differ only by float32 summation order."""
    codes, scales = random_int8(64, 576, seed=rows)
    codes[0, :32] = -128  # the extreme codes, whose magnitude 128 only fits unsigned
    codes[1, :32] = 127
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    exact = exact_product(x, codes, scales)
    for level in cpu_native.host_levels():
        with cpu_native.using_level(level.name):
            out = int8_linear(x, pack_int8(codes, scales)).double()
        torch.testing.assert_close(
            out,
            exact,
            rtol=0,
            atol=1e-5 * exact.abs().max().item(),
            msg=lambda message, name=level.name: f"{name}: {message}",
        )


def test_shapes_the_kernel_cannot_take_are_not_packed():
    assert pack_int8(*random_int8(24, 64)) is None  # rows not in blocks of 16
    codes, _ = random_int8(16, 64)
    assert pack_int8(codes, torch.rand(16, 3)) is None  # not one scale per 32 codes


def q8_0(rows: int, cols: int, seed: int = 0) -> GGUFWeight:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    packed = quantize(values, GGMLQuantizationType.Q8_0)
    return GGUFWeight(
        torch.from_numpy(packed.copy()), int(GGMLQuantizationType.Q8_0), (rows, cols), name="token_embd.weight"
    )


def test_q8_0_groups_are_the_stored_values():
    weight = q8_0(16, 64)
    codes, scales = weight.int8_groups()
    assert codes.dtype == torch.int8 and codes.shape == (16, 64) and scales.shape == (16, 2)
    assert torch.equal(dequantize_int8(codes, scales), weight.dequantize(torch.float32))
    other = GGUFWeight(
        torch.from_numpy(quantize(np.ones((16, 64), np.float32), GGMLQuantizationType.Q4_1).copy()),
        int(GGMLQuantizationType.Q4_1),
        (16, 64),
    )
    assert other.int8_groups() is None


def test_a_tied_bfloat16_head_multiplies_the_q8_0_values_at_every_batch():
    weight = q8_0(48, 64, seed=1)
    embedding = VocabParallelEmbedding(48, 64, params_dtype=torch.bfloat16)
    head = ParallelLMHead(48, 64, params_dtype=torch.bfloat16)
    head.tie_to(embedding)
    embedding.load_checkpoint_weight("weight", weight)
    head.process_weights_after_loading()
    assert head.kernel_weight is not None and isinstance(embedding.row_blocks, PackedRows)
    # no dense weight and no second copy: the head multiplies the codes, the embedding reads its
    # rows back out of them
    assert embedding.weight.is_meta and head.weight is embedding.weight and head.packed_weight is None
    exact = weight.dequantize(torch.float32)
    ids = torch.tensor([[0, 47], [5, 5]])
    assert torch.equal(embedding(ids), exact[ids].to(torch.bfloat16))
    for rows in (3, 40):
        hidden = torch.randn(rows, 64, dtype=torch.bfloat16)
        logits = head.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (rows, 48)
        torch.testing.assert_close(logits, hidden.float() @ exact.T, rtol=0, atol=0.02 * logits.abs().max().item())
        assert torch.equal(logits, int8_linear(hidden, head.kernel_weight))


def test_float32_heads_are_dense_and_untied_embeddings_look_up_in_the_blocks():
    head = ParallelLMHead(48, 64, params_dtype=torch.float32)
    head.load_checkpoint_weight("weight", q8_0(48, 64))
    head.process_weights_after_loading()
    assert head.kernel_weight is None and head.row_blocks is None
    assert torch.equal(head.weight, q8_0(48, 64).dequantize(torch.float32))
    embedding = VocabParallelEmbedding(48, 64, params_dtype=torch.bfloat16)
    embedding.load_checkpoint_weight("weight", q8_0(48, 64))
    embedding.process_weights_after_loading()
    assert embedding.row_blocks is not None and embedding.weight.is_meta
    ids = torch.tensor([3, 0, 47])
    assert torch.equal(embedding(ids), q8_0(48, 64).dequantize(torch.bfloat16)[ids])


def test_a_float32_head_the_platform_chose_multiplies_the_q8_0_values_and_keeps_no_float16_copy():
    """float32 the platform chose (a CPU without native bfloat16: the model asks for a float16
    small-batch copy, so its dtype need not stay exact) takes the int8 kernel too."""
    weight = q8_0(48, 64, seed=2)
    embedding = VocabParallelEmbedding(48, 64, params_dtype=torch.float32)
    head = ParallelLMHead(48, 64, params_dtype=torch.float32, small_batch_dtype=torch.float16)
    head.tie_to(embedding)
    embedding.load_checkpoint_weight("weight", weight)
    head.process_weights_after_loading()
    assert head.kernel_weight is not None and head.small_batch_weight is None and embedding.row_blocks is not None
    hidden = torch.randn(3, 64)
    logits = head.compute_logits(hidden)
    assert torch.equal(logits, int8_linear(hidden, head.kernel_weight))
    torch.testing.assert_close(
        logits, hidden @ weight.dequantize(torch.float32).T, rtol=0, atol=0.02 * logits.abs().max().item()
    )
