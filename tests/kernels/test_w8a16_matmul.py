"""The 8-bit weight-only matmul (float8_e4m3fn or int8 codes widened in registers, float
activations) against its dense float64 reference, at every kernel level the host runs."""

from __future__ import annotations

import pytest
import torch
from helpers.isa_levels import at_the_host_level

from tokenloom.kernels import w8a16_matmul
from tokenloom.kernels.w8a16_matmul import dequantize_w8, pack_w8, w8a16_linear

pytestmark = [
    pytest.mark.usefixtures("isa_level"),
    pytest.mark.skipif(
        w8a16_matmul._kernel() is None, reason="tokenloom's CPU kernels are switched off or did not build"
    ),
]


def random_codes(out_features: int, in_features: int, dtype: torch.dtype, groups: int = 1, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        codes = torch.randint(-128, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    else:  # every byte but the two NaNs: subnormals, both zeros, +-448
        bits = torch.randint(0, 256, (out_features, in_features), generator=generator, dtype=torch.int32)
        bits = torch.where((bits & 0x7F) == 0x7F, bits - 1, bits)
        codes = bits.to(torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.rand(out_features, groups, generator=generator) * 0.01 + 0.001
    return codes, scales


def exact(x: torch.Tensor, codes, scales) -> torch.Tensor:
    return x.double() @ dequantize_w8(codes, scales).double().T


CODE_DTYPES = [torch.float8_e4m3fn, torch.int8]


@pytest.mark.parametrize("code_dtype", CODE_DTYPES, ids=["fp8", "int8"])
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
@pytest.mark.parametrize("shape, groups", [((16, 32), 1), ((48, 96), 1), ((64, 256), 2), ((80, 128), 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_is_the_dense_product_up_to_float32_summation(code_dtype, rows, shape, groups, dtype):
    codes, scales = random_codes(*shape, code_dtype, groups, seed=rows)
    weight = pack_w8(codes, scales)
    assert weight.codes.dtype == torch.uint8 and weight.codes.numel() == codes.numel()  # one byte per weight
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
    out = w8a16_linear(x, weight)
    assert out.dtype == torch.float32 and out.shape == (rows, shape[0])
    reference = exact(x, codes, scales)
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=1e-5 * reference.abs().max().item())


def test_every_e4m3_code_reads_as_its_value():
    """Each of the 254 finite codes (subnormals, -0, +-448) through a one-hot activation."""
    finite = torch.tensor([bits for bits in range(256) if bits & 0x7F != 0x7F], dtype=torch.uint8)
    codes = finite[: 16 * (finite.numel() // 16)].view(16, -1).view(torch.float8_e4m3fn)  # [16, 15]
    codes = torch.cat([codes, torch.zeros(16, 1, dtype=torch.float8_e4m3fn)], dim=1)  # 16 features
    weight = pack_w8(codes, torch.ones(16, 1))
    out = w8a16_linear(torch.eye(16), weight)
    assert torch.equal(out, codes.float().T)


@pytest.mark.parametrize("code_dtype", CODE_DTYPES, ids=["fp8", "int8"])
@pytest.mark.parametrize("groups", [1, 4])
def test_any_number_of_rows_gives_each_row_the_bits_it_gets_alone(code_dtype, groups):
    codes, scales = random_codes(48, 128, code_dtype, groups, seed=groups)
    weight = pack_w8(codes, scales)
    x = torch.randn(12, 128, generator=torch.Generator().manual_seed(9))
    alone = torch.cat([w8a16_linear(x[row : row + 1], weight) for row in range(12)])
    for rows in range(1, 13):
        assert torch.equal(w8a16_linear(x[:rows], weight), alone[:rows]), rows


@at_the_host_level()  # torch code, the same at every level
def test_without_the_kernel_the_codes_are_kept_and_dequantized_per_call(monkeypatch):
    monkeypatch.setattr(w8a16_matmul, "_kernel", lambda: None)
    codes, scales = random_codes(32, 64, torch.float8_e4m3fn, 2)
    weight = pack_w8(codes, scales)
    assert weight.codes.dtype == torch.float8_e4m3fn and weight.kernel is None
    x = torch.randn(2, 64)
    reference = exact(x, codes, scales)
    torch.testing.assert_close(
        w8a16_linear(x, weight).double(), reference, rtol=0, atol=1e-5 * reference.abs().max().item()
    )


@at_the_host_level()
def test_shapes_the_kernel_cannot_take_are_refused():
    with pytest.raises(ValueError, match="multiples of 16"):
        pack_w8(*random_codes(24, 64, torch.int8))
    with pytest.raises(ValueError, match="int8, not torch.float32"):
        pack_w8(torch.zeros(16, 64), torch.ones(16, 1))
