"""The 2- and 3-bit matmul (csrc/cpu_lowbit.cpp) on every kernel level the host runs (``isa_level``):
within float32 summation error of the dequantized weight times the 8-bit activations it computes
with, each row's bits the same in any batch, and the packed weight about the file's bytes."""

from __future__ import annotations

import pytest
import torch

from tokenloom.kernels import lowbit_matmul
from tokenloom.kernels.int4_matmul import quantize_activations
from tokenloom.kernels.lowbit_matmul import dequantize_int2, dequantize_int3, lowbit_linear, pack_int2, pack_int3

pytestmark = pytest.mark.usefixtures("isa_level")

NATIVE = lowbit_matmul._kernel(3, 16, 256) is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="tokenloom's CPU kernels are switched off or did not build")


def random_int3(out_features: int, in_features: int, seed: int = 0):
    """Q3_K's parts: codes 0..7, a signed 6-bit scale per 16 features, a float16 d per 256."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 8, (out_features, in_features), generator=generator, dtype=torch.uint8)
    scales = torch.randint(-32, 32, (out_features, in_features // 16), generator=generator).to(torch.int8)
    d = (torch.rand(out_features, in_features // 256, generator=generator) * 0.01).half()
    return codes, scales, d


def random_int2(out_features: int, in_features: int, seed: int = 0):
    """Q2_K's parts: codes 0..3, a 4-bit scale and min per 16 features, float16 d and dmin per 256."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 4, (out_features, in_features), generator=generator, dtype=torch.uint8)
    scales, mins = (
        torch.randint(0, 16, (out_features, in_features // 16), generator=generator, dtype=torch.uint8) for _ in "ab"
    )
    d, dmin = ((torch.rand(out_features, in_features // 256, generator=generator) * 0.01).half() for _ in "ab")
    return codes, scales, mins, d, dmin


def exact_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: the 8-bit activations times the dense weight."""
    codes, scales = quantize_activations(x)
    rows, features = x.shape
    activations = codes.view(rows, -1, 32).double() * scales.double().unsqueeze(-1)
    return activations.view(rows, features) @ weight.double().T


def weight_for(bits: int, shape: tuple[int, int], seed: int):
    """The packed weight and its dense float32 value."""
    if bits == 3:
        parts = random_int3(*shape, seed=seed)
        return pack_int3(*parts), dequantize_int3(*parts)
    parts = random_int2(*shape, seed=seed)
    return pack_int2(*parts), dequantize_int2(*parts)


# one and three superblocks; 16 rows (one block), 48 (a lone last block), 64 (pairs only)
SHAPES = [(16, 256), (48, 768), (64, 512)]


@needs_native
@pytest.mark.parametrize("rows", [*range(1, 18), 130])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "x".join(map(str, shape)))
@pytest.mark.parametrize("bits", [2, 3])
def test_kernel_is_exact_up_to_float32_summation(bits, shape, rows):
    """Tiles of 1-4 rows and their remainders up to 17 rows, chunks of 128 rows, odd and even
    block counts, one and several superblocks: within float32 summation error of the exact product."""
    weight, dense = weight_for(bits, shape, seed=rows)
    assert weight is not None and weight.bits == bits
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    out = lowbit_linear(x, weight)
    assert out.dtype == torch.float32 and out.shape == (rows, shape[0])
    exact = exact_product(x, dense)
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=1e-5 * exact.abs().max().item())


@needs_native
@pytest.mark.parametrize("bits", [2, 3])
def test_any_number_of_rows_gives_each_row_the_bits_it_gets_alone(bits):
    weight, _ = weight_for(bits, (48, 768), seed=11)
    x = torch.randn(11, 768, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    alone = torch.cat([lowbit_linear(x[row : row + 1], weight) for row in range(11)])
    for rows in range(1, 12):
        assert torch.equal(lowbit_linear(x[:rows], weight), alone[:rows]), f"{rows} rows"


@needs_native
def test_bfloat16_rows_and_bias_round_once_into_the_rows_dtype():
    weight, _ = weight_for(3, (16, 256), seed=2)
    x = torch.randn(2, 3, 256).to(torch.bfloat16)
    bias = torch.randn(16)
    out = lowbit_linear(x, weight, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 16)
    assert torch.equal(out, (lowbit_linear(x.float().view(6, 256), weight) + bias).to(torch.bfloat16).view(2, 3, 16))


@needs_native
@pytest.mark.parametrize("bits", [2, 3])
def test_extreme_codes_and_scales_do_not_overflow(bits):
    """The largest codes, scales and mins against the largest activation codes of either sign."""
    top = 7 if bits == 3 else 3
    codes = torch.full((16, 512), top, dtype=torch.uint8)
    codes[:, ::2] = 0
    d = torch.full((16, 2), 0.5).half()
    x = torch.where(torch.arange(512) % 2 == 0, -1.0, 1.0).repeat(3, 1)
    if bits == 3:
        scales = torch.full((16, 32), -32, dtype=torch.int8)
        weight, dense = pack_int3(codes, scales, d), dequantize_int3(codes, scales, d)
    else:
        scales = torch.full((16, 32), 15, dtype=torch.uint8)
        weight, dense = pack_int2(codes, scales, scales, d, d), dequantize_int2(codes, scales, scales, d, d)
    exact = exact_product(x, dense)
    torch.testing.assert_close(lowbit_linear(x, weight).double(), exact, rtol=1e-6, atol=1e-6)


@needs_native
def test_packed_bytes_are_about_the_files():
    """Per 256 features of a row: Q3_K's file stores 110 bytes, the layout 114 (its 6-bit
    scales as bytes); Q2_K's file 84, the layout 84."""
    three, _ = weight_for(3, (32, 512), seed=0)
    two, _ = weight_for(2, (32, 512), seed=0)
    assert three.packed.numel() == 32 * 2 * 114 and two.packed.numel() == 32 * 2 * 84


def test_shapes_the_kernel_does_not_take_are_refused_with_none():
    """Rows not in blocks of 16, or features not in superblocks of 256: the caller keeps a dense weight."""
    assert pack_int3(*random_int3(24, 256)) is None
    codes, scales, mins, d, dmin = random_int2(16, 512)
    assert pack_int2(codes[:, :480], scales[:, :30], mins[:, :30], d, dmin) is None
