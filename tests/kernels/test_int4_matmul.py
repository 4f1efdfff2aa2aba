"""The weight-only int4 matmul against its dense float32 reference, on torch's kernel and (where
the CPU has AVX512-BF16) tokenloom's."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from tokenloom.kernels import int4_matmul
from tokenloom.kernels.int4_matmul import (
    INT4_MAX_ROWS, can_pack, dequantize_int4, int4_linear, pack_int4, prefers_int4,
)

NATIVE = int4_matmul._native_kernel() is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="tokenloom's int4 kernel needs a CPU with AVX512-BF16")


@pytest.fixture(params=["tokenloom", "torch"])
def kernel(request):
    """Which kernel the weights packed in the test are for."""
    if request.param == "tokenloom" and not NATIVE:
        pytest.skip("tokenloom's int4 kernel needs a CPU with AVX512-BF16")
    if request.param == "torch":
        with mock.patch.object(int4_matmul, "_native_kernel", lambda: None):
            yield request.param
    else:
        yield request.param


def random_int4(out_features: int, in_features: int, group_size: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
    groups = in_features // group_size
    scales = torch.rand(out_features, groups, generator=generator) * 0.1
    zeros = torch.randn(out_features, groups, generator=generator) * 0.1
    return codes, scales, zeros


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
def test_matches_the_dequantized_weight(dtype, rows, kernel):
    codes, scales, zeros = random_int4(48, 128, 32)
    weight = pack_int4(codes, scales, zeros, dtype)
    assert (weight.kernel is not None) == (kernel == "tokenloom" and dtype == torch.bfloat16)
    x = torch.randn(rows, 128, dtype=dtype)
    bias = torch.randn(48, dtype=dtype)
    expected = x.float() @ dequantize_int4(codes, scales, zeros).T + bias.float()
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(int4_linear(x, weight, bias).float(), expected, atol=tolerance, rtol=tolerance)


@needs_native
@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("shape", [(16, 64), (32, 576), (64, 1536)])
def test_tokenloom_kernel_is_exact_up_to_the_rounding_of_its_output(rows, shape):
    """Every row count the kernel specialises; in-features of 1, 9 and 24 pairs of groups (the
    zero terms of 2, 18 and 48 groups: masked tails); scales and zeros are bfloat16 in both."""
    codes, scales, zeros = random_int4(*shape, 32, seed=rows)
    weight = pack_int4(codes, scales, zeros, torch.bfloat16)
    assert weight.kernel is not None
    x = torch.randn(rows, shape[1], dtype=torch.bfloat16, generator=torch.Generator().manual_seed(rows))
    exact = x.double() @ dequantize_int4(codes, scales.bfloat16(), zeros.bfloat16()).double().T
    out = int4_linear(x, weight)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, shape[0])
    # float32 sums, then one rounding to bfloat16 (relative error 2^-9)
    torch.testing.assert_close(out.double(), exact, rtol=2 ** -8, atol=1e-4 * exact.abs().max().item())


@needs_native
def test_the_two_kernels_agree():
    codes, scales, zeros = random_int4(32, 128, 32, seed=7)
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    with mock.patch.object(int4_matmul, "_native_kernel", lambda: None):
        reference = int4_linear(x, pack_int4(codes, scales, zeros, torch.bfloat16)).float()
    torch.testing.assert_close(int4_linear(x, pack_int4(codes, scales, zeros, torch.bfloat16)).float(), reference,
                               rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_activation_dtypes_and_group_sizes_stay_on_torchs_kernel(dtype):
    codes, scales, zeros = random_int4(32, 128, 32)
    assert pack_int4(codes, scales, zeros, dtype).kernel is None
    assert pack_int4(*random_int4(32, 128, 64), torch.bfloat16).kernel is None
    assert pack_int4(*random_int4(32, 96, 32), torch.bfloat16).kernel is None  # 3 groups: not in pairs


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
