"""The int4 matmul against its references: tokenloom's kernel, on every kernel level the host runs
(``isa_level``), exactly against the dequantized weight times the 8-bit activations it computes
with, and the levels against each other; torch's weight-only kernel against the dequantized weight."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from helpers.isa_levels import at_the_host_level

from tokenloom.kernels import cpu_native, int4_matmul
from tokenloom.kernels.int4_matmul import (
    INT4_MAX_ROWS,
    can_pack,
    dequantize_int4,
    int4_linear,
    pack_int4,
    prefers_int4,
    quantize_activations,
)

pytestmark = pytest.mark.usefixtures("isa_level")

# every level has the kernel: only kernels switched off (TOKENLOOM_CPU_KERNELS=0) go without it
NATIVE = int4_matmul._native_kernel() is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="tokenloom's CPU kernels are switched off or did not build")


@pytest.fixture
def torch_kernel():
    """Weights packed in the test are for torch's kernel."""
    with mock.patch.object(int4_matmul, "_native_kernel", lambda: None):
        yield


def random_int4(out_features: int, in_features: int, group_size: int, seed: int = 0):
    """Codes, and scales and zeros as Q4_1 has them (d and m float16, zero = m + 8 d)."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
    groups = in_features // group_size
    scales = (torch.rand(out_features, groups, generator=generator) * 0.1).half().float()
    minimums = (torch.randn(out_features, groups, generator=generator) * 0.1).half().float()
    return codes, scales, minimums + 8 * scales


def exact_product(x: torch.Tensor, codes, scales, zeros) -> torch.Tensor:
    """What tokenloom's kernel computes, in float64: the 8-bit activations times the weight."""
    activation_codes, activation_scales = quantize_activations(x)
    rows, features = x.shape
    activations = activation_codes.view(rows, -1, 32).double() * activation_scales.double().unsqueeze(-1)
    return activations.view(rows, features) @ dequantize_int4(codes, scales, zeros).double().T


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 130])
@pytest.mark.parametrize("shape", [(16, 32), (48, 64), (64, 576), (32, 1536)])
def test_tokenloom_kernel_is_exact_in_float32(rows, shape):
    """Row tiles of 4 and their tails of 1-3, chunks of 128 rows, odd and even block counts:
    float32 rows come out within float32 summation error of the exact product."""
    codes, scales, zeros = random_int4(*shape, 32, seed=rows)
    weight = pack_int4(codes, scales, zeros, torch.bfloat16)
    assert weight.kernel is not None
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    out = int4_linear(x, weight)
    assert out.dtype == torch.float32 and out.shape == (rows, shape[0])
    exact = exact_product(x, codes, scales, zeros)
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=1e-5 * exact.abs().max().item())


@needs_native
@pytest.mark.parametrize("rows", [1, 7])
def test_tokenloom_kernel_rounds_bfloat16_rows_once(rows):
    codes, scales, zeros = random_int4(32, 128, 32, seed=rows)
    weight = pack_int4(codes, scales, zeros, torch.bfloat16)
    x = torch.randn(rows, 128).to(torch.bfloat16)
    out = int4_linear(x, weight)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, int4_linear(x.float(), weight).to(torch.bfloat16))


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(48, 32), (96, 576), (80, 1536)])
def test_any_number_of_rows_gives_each_row_the_bits_it_gets_alone(shape, dtype):
    """However the kernel tiles M rows (tiles of several sizes, tails), each output keeps its
    float32 accumulation order over the groups: a batch of M rows gives every row exactly the bits
    a call with that row alone gives (a speculative verify step of M rows decodes as M steps
    would). Odd block counts (48, 80: a lone last block), one group and 48 groups."""
    codes, scales, zeros = random_int4(*shape, 32, seed=shape[1])
    weight = pack_int4(codes, scales, zeros, torch.bfloat16)
    x = torch.randn(20, shape[1], generator=torch.Generator().manual_seed(shape[0])).to(dtype)
    alone = torch.cat([int4_linear(x[row : row + 1], weight) for row in range(20)])
    for rows in range(1, 21):
        together = int4_linear(x[:rows], weight)
        assert together.dtype == dtype
        assert torch.equal(together, alone[:rows]), f"{rows} rows: {(together != alone[:rows]).nonzero()[:4].tolist()}"


@needs_native
def test_activations_are_quantized_per_group_of_32_to_nearest_even():
    x = torch.zeros(1, 64)
    x[0, :4] = torch.tensor([127.0, -63.5, 0.5, 1.5])  # max 127: scale 1, codes the values rounded
    codes, scales = quantize_activations(x)
    assert codes[0, :4].tolist() == [127.0, -64.0, 0.0, 2.0] and scales.tolist() == [[1.0, 0.0]]
    assert codes[0, 32:].abs().sum() == 0  # a zero group: zero codes and scale
    codes, scales, zeros = random_int4(16, 64, 32)
    weight = pack_int4(codes, scales, zeros, torch.bfloat16)
    torch.testing.assert_close(int4_linear(x, weight).double(), exact_product(x, codes, scales, zeros))


@needs_native
def test_tokenloom_kernel_stays_close_to_the_float_product():
    """The 8-bit activations cost at most about a percent of the output's scale."""
    codes, scales, zeros = random_int4(64, 576, 32, seed=5)
    weight = pack_int4(codes, scales, zeros, torch.bfloat16)
    x = torch.randn(6, 576)
    expected = x @ dequantize_int4(codes, scales, zeros).T
    torch.testing.assert_close(int4_linear(x, weight), expected, rtol=0, atol=0.01 * expected.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 8])
@at_the_host_level()  # torch's own kernel: the same at every level
def test_torch_kernel_matches_the_dequantized_weight(dtype, rows, torch_kernel):
    codes, scales, zeros = random_int4(48, 128, 32)
    weight = pack_int4(codes, scales, zeros, dtype)
    assert weight.kernel is None
    x = torch.randn(rows, 128, dtype=dtype)
    bias = torch.randn(48, dtype=dtype)
    expected = x.float() @ dequantize_int4(codes, scales, zeros).T + bias.float()
    torch.testing.assert_close(int4_linear(x, weight, bias).float(), expected, atol=0.05, rtol=0.05)


@needs_native
def test_the_two_kernels_agree():
    codes, scales, zeros = random_int4(32, 128, 32, seed=7)
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    with mock.patch.object(int4_matmul, "_native_kernel", lambda: None):
        reference = int4_linear(x, pack_int4(codes, scales, zeros, torch.bfloat16)).float()
    torch.testing.assert_close(
        int4_linear(x, pack_int4(codes, scales, zeros, torch.bfloat16)).float(),
        reference,
        rtol=0.02,
        atol=0.02 * reference.abs().max().item(),
    )


def test_other_group_sizes_stay_on_torchs_kernel():
    assert pack_int4(*random_int4(32, 128, 64), torch.bfloat16).kernel is None


def test_dequantize_int4_is_code_minus_eight_times_scale_plus_zero():
    codes = torch.tensor([[0, 8, 15, 1]], dtype=torch.uint8)
    scales, zeros = torch.tensor([[2.0, 0.5]]), torch.tensor([[1.0, -1.0]])
    assert dequantize_int4(codes, scales, zeros).tolist() == [[-15.0, 1.0, 2.5, -4.5]]


@pytest.mark.parametrize("native", [True, False])
def test_keeps_leading_dimensions_and_adds_the_bias(native):
    if native and not NATIVE:
        pytest.skip("tokenloom's CPU kernels are switched off or did not build")
    codes, scales, zeros = random_int4(16, 64, 32)
    with mock.patch.object(int4_matmul, "_native_kernel", int4_matmul._native_kernel if native else lambda: None):
        weight = pack_int4(codes, scales, zeros, torch.bfloat16)
    x, bias = torch.randn(2, 3, 64, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    out = int4_linear(x, weight, bias)
    assert out.shape == (2, 3, 16) and torch.equal(out, (int4_linear(x.view(6, 64), weight) + bias).view(2, 3, 16))


def test_shapes_the_kernel_cannot_take_are_refused():
    assert can_pack(32, 64, 32) and not can_pack(24, 64, 32) and not can_pack(32, 48, 32)
    codes, scales, zeros = random_int4(24, 64, 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_int4(codes, scales, zeros, torch.bfloat16)


@at_the_host_level()  # torch's own kernel: the same at every level
def test_torchs_kernel_takes_small_batches_up_to_the_row_limit_of_their_dtype(torch_kernel):
    weight = pack_int4(*random_int4(16, 64, 32), torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        limit = INT4_MAX_ROWS[dtype]
        assert prefers_int4(torch.zeros(limit, 64, dtype=dtype), weight)
        assert prefers_int4(torch.zeros(2, limit // 2, 64, dtype=dtype), weight)
        assert not prefers_int4(torch.zeros(limit + 1, 64, dtype=dtype), weight)
    assert not prefers_int4(torch.zeros(1, 64, dtype=torch.float64), weight)


@needs_native
def test_tokenloom_kernel_takes_every_batch():
    weight = pack_int4(*random_int4(16, 64, 32), torch.bfloat16)
    assert prefers_int4(torch.zeros(4096, 64, dtype=torch.bfloat16), weight)


@pytest.mark.parametrize("rows", [1, 5])
@at_the_host_level()  # torch's own kernel: the same at every level
def test_float32_rows_on_torchs_kernel_are_rounded_in_and_widened_out(rows, torch_kernel):
    codes, scales, zeros = random_int4(32, 64, 32, seed=3)
    weight = pack_int4(codes, scales, zeros, torch.bfloat16)
    x = torch.randn(rows, 64)
    bias = torch.randn(32)
    out = int4_linear(x, weight, bias)
    assert out.dtype == torch.float32
    assert torch.equal(out, int4_linear(x.to(torch.bfloat16), weight).float() + bias)


@needs_native
@pytest.mark.parametrize("rows", [1, 6, 131])
@at_the_host_level()  # it switches through every level itself
def test_every_level_the_host_runs_gives_the_same_integers(rows):
    """The integer sums are exact on every level: float32 and bfloat16 results of the levels
    differ only by float32 summation order."""
    codes, scales, zeros = random_int4(96, 576, 32, seed=11)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    results = {}
    for level in cpu_native.host_levels():
        with cpu_native.using_level(level.name):
            weight = pack_int4(codes, scales, zeros, torch.bfloat16)
            assert weight.kernel is not None
            results[level.name] = int4_linear(x, weight).double()
    exact = exact_product(x, codes, scales, zeros)
    for name, out in results.items():
        torch.testing.assert_close(
            out,
            exact,
            rtol=0,
            atol=1e-5 * exact.abs().max().item(),
            msg=lambda message, name=name: f"{name}: {message}",
        )


def amx_rows() -> int:
    """The row count from which the selected level's int4_linear takes AMX-INT8 here (0: never)."""
    ops = cpu_native.load()
    return int(ops.quantized_amx_min_rows(4)) if ops is not None else 0


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16, 32), (48, 64), (80, 1536), (32, 8192)])
def test_amx_tiles_give_the_vnni_tiles_bits(shape, dtype, monkeypatch):
    """Where the avx512 build takes AMX-INT8 (from amx_rows() rows), every row gets exactly the
    bits the VNNI tile gives it (TOKENLOOM_CPU_AMX=0): 1-40 rows around the threshold and 16- and
    32-row tiles with their tails, 130 rows across the 128-row chunks; one block, an odd block
    count, one group and 256 groups."""
    threshold = amx_rows()
    if not threshold:
        pytest.skip("no AMX-INT8 path here: the CPU has no amx_int8, or not the avx512 level, or TOKENLOOM_CPU_AMX=0")
    codes, scales, zeros = random_int4(*shape, 32, seed=shape[1])
    weight = pack_int4(codes, scales, zeros, torch.bfloat16)
    x = torch.randn(130, shape[1], generator=torch.Generator().manual_seed(shape[0])).to(dtype)
    for rows in [*range(1, 41), 130]:
        monkeypatch.delenv("TOKENLOOM_CPU_AMX", raising=False)
        amx = int4_linear(x[:rows], weight)
        monkeypatch.setenv("TOKENLOOM_CPU_AMX", "0")
        vnni = int4_linear(x[:rows], weight)
        assert amx.dtype == dtype and torch.equal(amx, vnni), f"{rows} rows: {(amx != vnni).nonzero()[:4].tolist()}"
    assert threshold <= 40  # the loop crossed it


@needs_native
def test_cpu_amx_0_keeps_int4_linear_off_amx(monkeypatch):
    """At every level: the 4-bit matmul takes AMX only in the avx512 build on a CPU with AMX-INT8
    (where w8a8_linear takes it), and never under TOKENLOOM_CPU_AMX=0; no other bits have an AMX
    path."""
    ops = cpu_native.load()
    monkeypatch.delenv("TOKENLOOM_CPU_AMX", raising=False)
    has_amx = bool(ops.w8a8_amx_available())
    assert (ops.quantized_amx_min_rows(4) > 0) == has_amx
    assert ops.quantized_amx_min_rows(6) == 0 and ops.quantized_amx_min_rows(8) == 0
    for off in ("0", "off", "False", " no"):
        monkeypatch.setenv("TOKENLOOM_CPU_AMX", off)
        assert ops.quantized_amx_min_rows(4) == 0
    monkeypatch.setenv("TOKENLOOM_CPU_AMX", "1")
    assert (ops.quantized_amx_min_rows(4) > 0) == has_amx
