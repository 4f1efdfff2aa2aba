"""The weight-only int4 matmul against its dense float32 reference."""

from __future__ import annotations

import pytest
import torch

from tokenloom.kernels.int4_matmul import (
    INT4_MAX_ROWS, can_pack, dequantize_int4, int4_linear, pack_int4, prefers_int4,
)


def random_int4(out_features: int, in_features: int, group_size: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
    groups = in_features // group_size
    scales = torch.rand(out_features, groups, generator=generator) * 0.1
    zeros = torch.randn(out_features, groups, generator=generator) * 0.1
    return codes, scales, zeros


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
def test_matches_the_dequantized_weight(dtype, rows):
    codes, scales, zeros = random_int4(48, 96, 32)
    weight = pack_int4(codes, scales, zeros, dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    bias = torch.randn(48, dtype=dtype)
    expected = x.float() @ dequantize_int4(codes, scales, zeros).T + bias.float()
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(int4_linear(x, weight, bias).float(), expected, atol=tolerance, rtol=tolerance)


def test_dequantize_int4_is_code_minus_eight_times_scale_plus_zero():
    codes = torch.tensor([[0, 8, 15, 1]], dtype=torch.uint8)
    scales, zeros = torch.tensor([[2.0, 0.5]]), torch.tensor([[1.0, -1.0]])
    assert dequantize_int4(codes, scales, zeros).tolist() == [[-15.0, 1.0, 2.5, -4.5]]


def test_keeps_leading_dimensions():
    codes, scales, zeros = random_int4(16, 64, 32)
    weight = pack_int4(codes, scales, zeros, torch.bfloat16)
    assert int4_linear(torch.randn(2, 3, 64, dtype=torch.bfloat16), weight).shape == (2, 3, 16)


def test_shapes_the_kernel_cannot_take_are_refused():
    assert can_pack(32, 64, 32) and not can_pack(24, 64, 32) and not can_pack(32, 48, 32)
    codes, scales, zeros = random_int4(24, 64, 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_int4(codes, scales, zeros, torch.bfloat16)


def test_small_batches_prefer_int4_up_to_the_row_limit_of_their_dtype():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        limit = INT4_MAX_ROWS[dtype]
        assert prefers_int4(torch.zeros(limit, 64, dtype=dtype))
        assert prefers_int4(torch.zeros(2, limit // 2, 64, dtype=dtype))
        assert not prefers_int4(torch.zeros(limit + 1, 64, dtype=dtype))
    assert not prefers_int4(torch.zeros(1, 64, dtype=torch.float64))


@pytest.mark.parametrize("rows", [1, 5])
def test_float32_rows_on_a_bfloat16_weight_are_rounded_in_and_widened_out(rows):
    codes, scales, zeros = random_int4(32, 64, 32, seed=3)
    weight = pack_int4(codes, scales, zeros, torch.bfloat16)
    x = torch.randn(rows, 64)
    bias = torch.randn(32)
    out = int4_linear(x, weight, bias)
    assert out.dtype == torch.float32
    # exactly the bfloat16 computation, widened, plus the float32 bias
    assert torch.equal(out, int4_linear(x.to(torch.bfloat16), weight).float() + bias)
    expected = x @ dequantize_int4(codes, scales, zeros).T + bias
    torch.testing.assert_close(out, expected, atol=0.05, rtol=0.02)
