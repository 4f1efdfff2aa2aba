"""The int4 matmul against its references: tokenloom's kernel, on every kernel level the host runs
(``isa_level``), exactly against the dequantized weight times the 8-bit activations it computes
with, and the levels against each other; torch's weight-only kernel against the dequantized weight."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from helpers.isa_levels import at_the_host_level
from helpers.threads import torch_threads

from tokenloom.kernels import cpu_native, int4_matmul
from tokenloom.kernels.int4_matmul import (
    INT4_MAX_ROWS,
    bf16_amx_available,
    can_pack,
    dequantize_int4,
    int4_linear,
    int4_linear_bf16,
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
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("out_features", [64, 160, 304])
def test_a_decode_steps_rows_read_in_two_streams_get_the_bits_of_any_batch(out_features, threads):
    """A decode step's 1-8 rows read each thread's block pairs two at a time (AVX-512), from the two
    halves of its range, and a pair left over alone (an odd count; 304 outputs: 9 pairs and a lone
    block). Every split of the pairs over 1-3 threads gives each row the bits it gets alone and in
    a batch of 12 (tiles of one pair), and writes every output."""
    codes, scales, zeros = random_int4(out_features, 256, 32, seed=out_features)
    weight = pack_int4(codes, scales, zeros, torch.bfloat16)
    x = torch.randn(12, 256, generator=torch.Generator().manual_seed(threads)).to(torch.bfloat16)
    with torch_threads(threads):
        alone = torch.cat([int4_linear(x[row : row + 1], weight) for row in range(12)])
        for rows in (2, 3, 5, 8, 12):
            assert torch.equal(int4_linear(x[:rows], weight), alone[:rows]), f"{rows} rows"
    torch.testing.assert_close(alone.double(), exact_product(x, codes, scales, zeros), rtol=0.02, atol=0.02)


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


# -- the AMX-BF16 prompt path (int4_linear_bf16, csrc/cpu_amx_bf16.h) --------------------------


@pytest.fixture
def bf16_amx(monkeypatch):
    """The test needs the AMX-BF16 kernels at this level (the avx512 build on a CPU with AMX-BF16)."""
    monkeypatch.delenv("TOKENLOOM_CPU_AMX", raising=False)
    if not bf16_amx_available():
        pytest.skip("no AMX-BF16 path here: not the avx512 level, or the CPU has no amx_bf16 / avx512_bf16")


def bfloat16_weight(codes, scales, zeros) -> torch.Tensor:
    """The weight int4_linear_bf16 multiplies: bf16(d * code + m), d and m the packed float16 pair."""
    out_features, in_features = codes.shape
    d = scales.float().half().float()
    m = (zeros.float() - 8 * scales.float()).half().float()
    grouped = codes.float().view(out_features, -1, 32) * d.unsqueeze(-1) + m.unsqueeze(-1)
    return grouped.view(out_features, in_features).to(torch.bfloat16)


def assert_close_to_float32_sums(out: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, rounding: float) -> None:
    """``out`` within float32 summation error of the float64 product of bfloat16 ``x`` and
    ``dense`` (the products are exact), plus ``rounding`` times the product (the output's own
    rounding: bfloat16's half ulp is at most 2^-8 of the value)."""
    exact = x.double() @ dense.double().T
    magnitude = x.double().abs() @ dense.double().abs().T
    bound = rounding * exact.abs() + 2 * x.shape[1] * 2.0**-24 * magnitude
    excess = (out.double() - exact).abs() - bound
    assert excess.max().item() <= 0, f"worst at {divmod(excess.argmax().item(), out.shape[1])}"


@needs_native
@pytest.mark.parametrize("shape", [(16, 32), (48, 64), (80, 1536), (48, 2080), (32, 8192)])
def test_bf16_prompt_path_is_the_bfloat16_weight_times_the_rows(shape, bf16_amx):
    """One block, odd block counts (3, 5), 1-256 groups, K in chunks of 2048 features (2048 + 32,
    4 x 2048); rows 1, 15 and 16 (one row tile), 17 and 33 (a partial chunk of 32), 300 (chunks and
    a tail, two blocks of rows at K = 8192): float32 sums of the bfloat16 weight's products,
    rounded once to bfloat16."""
    codes, scales, zeros = random_int4(*shape, 32, seed=shape[1])
    weight = pack_int4(codes, scales, zeros, torch.bfloat16)
    dense = bfloat16_weight(codes, scales, zeros)
    for rows in (1, 15, 16, 17, 33, 300):
        x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        out = int4_linear_bf16(x, weight)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, shape[0])
        assert_close_to_float32_sums(out, x, dense, 2.0**-8)


@needs_native
@pytest.mark.parametrize("shape", [(48, 320), (32, 608)])
def test_bf16_prompt_path_reads_every_weight_value_exactly(shape, bf16_amx):
    """One-hot rows read the weight back: each output is one product, exact, so every value the
    panel holds is bf16(d * code + m) bit for bit (K rows: chunks of 32 rows and none left over)."""
    codes, scales, zeros = random_int4(*shape, 32, seed=5)
    weight = pack_int4(codes, scales, zeros, torch.bfloat16)
    one_hot = torch.eye(shape[1], dtype=torch.bfloat16)
    assert torch.equal(int4_linear_bf16(one_hot, weight), bfloat16_weight(codes, scales, zeros).T)


@needs_native
@pytest.mark.parametrize("shape", [(80, 1536), (48, 2080)])
def test_bf16_prompt_path_gives_a_row_the_same_bits_in_any_batch_and_thread_count(shape, bf16_amx):
    """Each row alone, among 1-300 rows, at any position, and on 1 or 2 threads: the same bits
    (K in one chunk, and in two whose sums are stored between them)."""
    codes, scales, zeros = random_int4(*shape, 32, seed=2)
    weight = pack_int4(codes, scales, zeros, torch.bfloat16)
    x = torch.randn(300, shape[1], generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    alone = torch.cat([int4_linear_bf16(x[row : row + 1], weight) for row in range(40)])
    for rows in (1, 15, 16, 17, 33, 40):
        assert torch.equal(int4_linear_bf16(x[:rows], weight), alone[:rows]), f"{rows} rows"
    everything = int4_linear_bf16(x, weight)
    assert torch.equal(everything[:40], alone)
    order = torch.randperm(300, generator=torch.Generator().manual_seed(1))
    assert torch.equal(int4_linear_bf16(x[order], weight), everything[order])
    for count in (1, 2):
        with torch_threads(count):
            assert torch.equal(int4_linear_bf16(x, weight), everything), f"{count} threads"


@needs_native
def test_bf16_prompt_path_rounds_other_rows_in_and_keeps_leading_dimensions(bf16_amx):
    codes, scales, zeros = random_int4(32, 128, 32, seed=4)
    weight = pack_int4(codes, scales, zeros, torch.bfloat16)
    x = torch.randn(2, 3, 128)
    bias = torch.randn(32)
    out = int4_linear_bf16(x, weight, bias)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 32)
    expected = int4_linear_bf16(x.reshape(6, 128).to(torch.bfloat16), weight).float() + bias
    assert torch.equal(out, expected.view(2, 3, 32))


@needs_native
def test_bf16_prompt_path_only_where_the_avx512_build_has_amx_bf16(monkeypatch):
    """At every level: available only in the avx512 build on a CPU with AMX-BF16 and AVX512-BF16,
    never under TOKENLOOM_CPU_AMX=0; where it is not, the kernel refuses with the reason."""
    monkeypatch.delenv("TOKENLOOM_CPU_AMX", raising=False)
    flags = cpu_native.cpu_flags()
    has_it = (
        cpu_native.selected_level().name == "avx512" and {"amx_bf16", "amx_tile", "avx512_bf16", "avx512vbmi"} <= flags
    )
    assert bf16_amx_available() == has_it
    codes, scales, zeros = random_int4(16, 32, 32)
    weight = pack_int4(codes, scales, zeros, torch.bfloat16)
    x = torch.randn(3, 32).to(torch.bfloat16)
    monkeypatch.setenv("TOKENLOOM_CPU_AMX", "0")
    assert not bf16_amx_available()
    with pytest.raises(RuntimeError, match="AMX-BF16 is not available here"):
        int4_linear_bf16(x, weight)
    monkeypatch.delenv("TOKENLOOM_CPU_AMX")
    if not has_it:
        with pytest.raises(RuntimeError, match="AMX-BF16 is not available here"):
            int4_linear_bf16(x, weight)


@needs_native
def test_bf16_prompt_path_writes_a_large_output_as_it_writes_a_small_one(bf16_amx):
    """From 16 MiB the output is asked for huge pages before it is written: 512 rows x 16384
    outputs give each row the bits it gets in calls of 100 rows (small outputs)."""
    codes, scales, zeros = random_int4(16384, 64, 32, seed=3)
    weight = pack_int4(codes, scales, zeros, torch.bfloat16)
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    large = int4_linear_bf16(x, weight)
    assert large.numel() * large.element_size() >= 16 << 20
    assert torch.equal(large, torch.cat([int4_linear_bf16(part, weight) for part in x.split(100)]))
