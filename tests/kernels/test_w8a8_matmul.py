"""The W8A8 int8 matmul (per-token activations, per-channel weights) against its torch reference,
on every kernel level, with and without AMX."""

from __future__ import annotations

import pytest
import torch
from helpers.isa_levels import at_the_host_level, once_and_per_level

from tokenloom.kernels import cpu_native, w8a8_matmul
from tokenloom.kernels.w8a8_matmul import integer_sums, pack_w8a8, quantize_tokens, reference_w8a8, w8a8_linear

pytestmark = [
    pytest.mark.usefixtures("isa_level"),
    pytest.mark.skipif(
        not cpu_native.enabled() or cpu_native.load() is None,
        reason="tokenloom's CPU kernels are switched off or did not build",
    ),
]

# the vector tiles (AMX never taken) at every level, and AMX for every row count once, at the
# host's own level (only the avx512 build has an AMX path, where the CPU has AMX)
PATHS = once_and_per_level("amx_rows", 1, 0, ("amx", "vector"))


def skip_without_amx(amx_rows: int) -> None:
    if amx_rows and not w8a8_matmul.amx_available():
        pytest.skip(
            f"no AMX-INT8 path at the {cpu_native.selected_level().name} level here "
            "(the CPU has no amx_int8, or the kernel level is not avx512)"
        )


def random_weight(out_features: int, in_features: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    scales = torch.rand(out_features, generator=generator) * 0.01 + 1e-4
    return codes, scales


@PATHS
@pytest.mark.parametrize("rows", [1, 2, 3, 17, 33])
@pytest.mark.parametrize("shape", [(16, 64), (48, 100), (40, 576), (96, 196), (7, 4)])
def test_integer_sums_are_exact(shape, rows, amx_rows):
    """Rows whose largest magnitude is 127 and integer values quantize to themselves with scale 1:
    with unit channel scales each float32 output is the int32 sum itself (exact below 2^24).
    K not a multiple of 64 (100, 196, 4), N not a multiple of 16 or 32 (48, 40, 7)."""
    skip_without_amx(amx_rows)
    out_features, in_features = shape
    codes, _ = random_weight(out_features, in_features, seed=rows)
    generator = torch.Generator().manual_seed(rows + 1)
    x = torch.randint(-127, 128, (rows, in_features), generator=generator).float()
    x[:, 0] = 127.0
    codes_back, token_scales = quantize_tokens(x)
    assert torch.equal(codes_back.float(), x) and torch.equal(token_scales, torch.ones(rows))
    weight = pack_w8a8(codes, torch.ones(out_features))
    out = w8a8_linear(x, weight, amx_rows=amx_rows)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    assert torch.equal(out, (x.long() @ codes.long().T).float())
    assert torch.equal(out.to(torch.int32), integer_sums(x, codes))


@PATHS
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 7, 17, 33, 131])
@pytest.mark.parametrize("shape", [(64, 576), (40, 100), (96, 1536)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_the_reference(shape, rows, dtype, amx_rows):
    """Random rows, scales and bias: equal to the reference's float32 up to the epilogue's
    rounding (one multiply and one add, which the compiler may fuse), then x's dtype."""
    skip_without_amx(amx_rows)
    out_features, in_features = shape
    codes, scales = random_weight(out_features, in_features, seed=rows)
    generator = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, in_features, generator=generator) * 3).to(dtype)
    bias = torch.randn(out_features, generator=generator)
    weight = pack_w8a8(codes, scales)
    out = w8a8_linear(x, weight, bias, amx_rows=amx_rows)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    expected = reference_w8a8(x, codes, scales, bias)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=2e-6, atol=2e-6 * expected.abs().max().item())
    else:
        torch.testing.assert_close(out.float(), expected.to(dtype).float(), rtol=8e-3, atol=1e-3)
        assert (out != expected.to(dtype)).float().mean() < 0.01  # only ties of the rounding differ
    float_out = w8a8_linear(x, weight, bias, float_out=True, amx_rows=amx_rows)
    assert float_out.dtype == torch.float32
    torch.testing.assert_close(float_out, expected, rtol=2e-6, atol=2e-6 * expected.abs().max().item())


@PATHS
def test_rows_are_independent_of_the_batch(amx_rows):
    """A row's output does not depend on the rows beside it (per-token scales, whole-K integer
    sums): 1..40 rows at once give each row the bits it gets alone."""
    skip_without_amx(amx_rows)
    codes, scales = random_weight(80, 192, seed=3)
    weight = pack_w8a8(codes, scales)
    x = torch.randn(40, 192, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    alone = torch.cat([w8a8_linear(x[row : row + 1], weight, amx_rows=amx_rows) for row in range(40)])
    for rows in (1, 2, 5, 16, 17, 32, 33, 40):
        assert torch.equal(w8a8_linear(x[:rows], weight, amx_rows=amx_rows), alone[:rows]), rows


@PATHS
def test_extreme_codes_and_zero_rows(amx_rows):
    """-128 and 127 weight codes against +-127 activations (the largest int16 pairs of the AVX2
    sign trick, the +128 offset of vpdpbusd), an all-zero row (scale 0, output 0 + bias)."""
    skip_without_amx(amx_rows)
    codes = torch.tensor([[-128, 127] * 64, [-128] * 128, [127] * 128] * 6, dtype=torch.int8)
    x = torch.tensor([[-127.0, 127.0] * 64, [127.0] * 128, [-127.0] * 128, [0.0] * 128])
    weight = pack_w8a8(codes, torch.ones(18))
    bias = torch.arange(18, dtype=torch.float32)
    out = w8a8_linear(x, weight, bias, amx_rows=amx_rows)
    assert torch.equal(out, (x.long() @ codes.long().T).float() + bias)


@pytest.mark.parametrize("rows", [1, 7, 8, 40])
def test_the_default_path_matches_the_reference(rows):
    """amx_rows left to the module (AMX from AMX_MIN_ROWS rows where the CPU has it)."""
    codes, scales = random_weight(96, 320, seed=rows)
    x = torch.randn(rows, 320, generator=torch.Generator().manual_seed(rows))
    expected = reference_w8a8(x, codes, scales)
    out = w8a8_linear(x, pack_w8a8(codes, scales))
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=2e-6 * expected.abs().max().item())


def test_no_rows():
    codes, scales = random_weight(32, 64, seed=0)
    out = w8a8_linear(torch.empty(0, 64), pack_w8a8(codes, scales))
    assert out.shape == (0, 32)


def test_amx_and_vector_paths_agree():
    """Where AMX runs, both paths give the same bits (the same integers, the same epilogue)."""
    skip_without_amx(1)
    codes, scales = random_weight(1536, 576, seed=9)
    weight = pack_w8a8(codes, scales)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    assert torch.equal(w8a8_linear(x, weight, amx_rows=1), w8a8_linear(x, weight, amx_rows=0))


@at_the_host_level()
def test_amx_switch(monkeypatch):
    monkeypatch.setenv(w8a8_matmul.ENV_AMX, "0")
    assert w8a8_matmul.amx_min_rows() == 0
    monkeypatch.setenv(w8a8_matmul.ENV_AMX, "1")
    assert w8a8_matmul.amx_min_rows() == w8a8_matmul.AMX_MIN_ROWS


@at_the_host_level()
def test_quantize_tokens_reference():
    x = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]])
    codes, scales = quantize_tokens(x)
    assert codes.tolist() == [[64, -127, 32], [0, 0, 0]]  # 63.5 rounds to even
    assert torch.equal(scales, torch.tensor([1.0, 0.0]) * torch.tensor(1 / 127, dtype=torch.float32))
