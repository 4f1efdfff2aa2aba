"""The 5- and 6-bit matmul (csrc/cpu_kquant.cpp) on every kernel level the host runs (``isa_level``):
within float32 summation error of the dequantized weight times the 8-bit activations it computes
with, each row's bits the same in any batch, and the packed weight about the file's bytes."""

from __future__ import annotations

import pytest
import torch
from helpers.threads import torch_threads

from tokenloom.kernels import kquant_matmul
from tokenloom.kernels.int4_matmul import bf16_amx_available, quantize_activations
from tokenloom.kernels.kquant_matmul import (
    dequantize_int5,
    dequantize_int6,
    kquant_linear,
    kquant_linear_bf16,
    pack_int5,
    pack_int6,
)

pytestmark = pytest.mark.usefixtures("isa_level")

NATIVE = kquant_matmul._kernel("int6_linear") is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="tokenloom's CPU kernels are switched off or did not build")


def random_int6(out_features: int, in_features: int, seed: int = 0):
    """Q6_K's parts: codes 0..63, a signed scale per 16 features, a float16 d per 256."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 64, (out_features, in_features), generator=generator, dtype=torch.uint8)
    scales = torch.randint(-128, 128, (out_features, in_features // 16), generator=generator).to(torch.int8)
    d = (torch.rand(out_features, in_features // 256, generator=generator) * 0.01).half()
    return codes, scales, d


def random_int5(out_features: int, in_features: int, superblock_groups: int, seed: int = 0):
    """Q5_K's parts (superblock_groups 8: 6-bit scale and min per 32, float16 d and dmin per 256),
    or Q5_0-like ones with superblocks of one group."""
    generator = torch.Generator().manual_seed(seed)
    groups = in_features // 32
    codes = torch.randint(0, 32, (out_features, in_features), generator=generator, dtype=torch.uint8)
    scales, mins = (torch.randint(0, 64, (out_features, groups), generator=generator, dtype=torch.uint8) for _ in "ab")
    d, dmin = ((torch.rand(out_features, groups // superblock_groups, generator=generator) * 0.01).half() for _ in "ab")
    return codes, scales, mins, d, dmin, superblock_groups


def exact_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: the 8-bit activations times the dense weight."""
    codes, scales = quantize_activations(x)
    rows, features = x.shape
    activations = codes.view(rows, -1, 32).double() * scales.double().unsqueeze(-1)
    return activations.view(rows, features) @ weight.double().T


# Q6_K and Q5_K with 1 and 3 superblocks, Q5_0's 20 groups of 32 (Gemma 3 270M's 640 features);
# 16 rows (one block), 48 (a lone last block), 64
CASES = [
    ("int6", (16, 256)),
    ("int6", (48, 768)),
    ("int5-k", (64, 256)),
    ("int5-k", (48, 768)),
    ("int5-0", (48, 640)),
]


def weight_for(case: str, shape: tuple[int, int], seed: int):
    """The packed weight and its dense float32 value."""
    if case == "int6":
        parts = random_int6(*shape, seed=seed)
        return pack_int6(*parts), dequantize_int6(*parts)
    parts = random_int5(*shape, 8 if case == "int5-k" else 1, seed=seed)
    return pack_int5(*parts), dequantize_int5(*parts)


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 13, 32, 33, 130])
@pytest.mark.parametrize("case, shape", CASES)
def test_kernel_is_exact_up_to_float32_summation(case, shape, rows):
    """Tiles of 1-4 rows (AVX-512: 1-8, each decoding the codes as it reads them); 5-32 rows (AVX-512:
    9-32) over one decoding of the codes, in one or more tiles a block, and 33 (a second decoding
    for the last row); chunks of 128 rows; odd and even block
    counts, one and several superblocks: within float32 summation error of the exact product."""
    weight, dense = weight_for(case, shape, seed=rows)
    assert weight is not None
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    out = kquant_linear(x, weight)
    assert out.dtype == torch.float32 and out.shape == (rows, shape[0])
    exact = exact_product(x, dense)
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=1e-5 * exact.abs().max().item())


@needs_native
@pytest.mark.parametrize("case, shape", [CASES[1], CASES[3], CASES[4]])
def test_any_number_of_rows_gives_each_row_the_bits_it_gets_alone(case, shape):
    weight, _ = weight_for(case, shape, seed=11)
    x = torch.randn(17, shape[1], generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    alone = torch.cat([kquant_linear(x[row : row + 1], weight) for row in range(17)])
    for rows in range(1, 18):
        assert torch.equal(kquant_linear(x[:rows], weight), alone[:rows]), f"{rows} rows"


@needs_native
def test_bfloat16_rows_and_bias_round_once_into_the_rows_dtype():
    weight, _ = weight_for("int6", (16, 256), seed=2)
    x = torch.randn(2, 3, 256).to(torch.bfloat16)
    bias = torch.randn(16)
    out = kquant_linear(x, weight, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 16)
    assert torch.equal(out, (kquant_linear(x.float().view(6, 256), weight) + bias).to(torch.bfloat16).view(2, 3, 16))


@needs_native
def test_extreme_codes_and_scales_do_not_overflow():
    """The largest codes and scales against the largest activation codes: a 6-bit group's integer
    sum near 2^24, past float32's exact integers."""
    codes = torch.full((16, 256), 63, dtype=torch.uint8)
    codes[:, ::2] = 0
    scales = torch.full((16, 16), -128, dtype=torch.int8)
    d = torch.full((16, 1), 0.5).half()
    dense = dequantize_int6(codes, scales, d)
    x = torch.where(torch.arange(256) % 2 == 0, -1.0, 1.0).repeat(3, 1)
    exact = exact_product(x, dense)
    torch.testing.assert_close(kquant_linear(x, pack_int6(codes, scales, d)).double(), exact, rtol=1e-6, atol=0)


@needs_native
def test_packed_weights_read_about_the_files_bytes():
    """Not widened: Q6_K's 6.5625 bits per weight exactly, Q5_K 5.625 (the file 5.5)."""
    int6, _ = weight_for("int6", (32, 512), seed=0)
    int5, _ = weight_for("int5-k", (32, 512), seed=0)
    assert int6.packed.numel() * 8 / (32 * 512) == 6.5625
    assert int5.packed.numel() * 8 / (32 * 512) == 5.625


@needs_native
def test_shapes_the_kernel_cannot_take_are_not_packed():
    assert pack_int6(*random_int6(24, 256)) is None  # rows not in blocks of 16
    codes, scales, mins, d, dmin, _ = random_int5(16, 96, 1)
    assert pack_int5(codes, scales, mins, d, dmin, 1) is not None
    assert pack_int5(codes, scales, mins, d[:, :1], dmin[:, :1], 2) is None  # 96 features: not whole superblocks of 64
    weight, _ = weight_for("int6", (16, 256), seed=0)
    with pytest.raises(RuntimeError, match="in_features must be a positive multiple of 256"):
        weight.kernel(torch.randn(1, 128), weight.packed)


# -- the AMX-BF16 prompt path (int6_linear_bf16, int5_linear_bf16, csrc/cpu_amx_bf16.h) -----------


@pytest.fixture
def bf16_amx(monkeypatch):
    """The test needs the AMX-BF16 kernels at this level (the avx512 build on a CPU with AMX-BF16)."""
    monkeypatch.delenv("TOKENLOOM_CPU_AMX", raising=False)
    if not bf16_amx_available():
        pytest.skip("no AMX-BF16 path here: not the avx512 level, or the CPU has no amx_bf16 / avx512_bf16")


@needs_native
@pytest.mark.parametrize("case, shape", [*CASES, ("int6", (32, 2048)), ("int6", (48, 4608)), ("int5-0", (16, 2080))])
def test_bf16_prompt_path_is_the_bfloat16_weight_times_the_rows(case, shape, bf16_amx):
    """One block and odd block counts, one and several superblocks, Q5_0's 640 features (not a
    multiple of 256), K in chunks of 2048 features (2 x 2048 + 512; Q5_0's 2048 + 32); rows 1,
    15, 16, 17, 33, 300: float32 sums of the products of the bfloat16 rows and the dequantized
    weight rounded to bfloat16 (float32 out, no rounding of its own)."""
    weight, dense = weight_for(case, shape, seed=shape[1])
    weight_bf16 = dense.to(torch.bfloat16).double()
    for rows in (1, 15, 16, 17, 33, 300):
        x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        out = kquant_linear_bf16(x, weight, dtype=torch.float32)
        assert out.dtype == torch.float32 and out.shape == (rows, shape[0])
        exact = x.double() @ weight_bf16.T
        bound = 2 * shape[1] * 2.0**-24 * (x.double().abs() @ weight_bf16.abs().T)
        excess = (out.double() - exact).abs() - bound
        assert excess.max().item() <= 0, f"{rows} rows: worst at {divmod(excess.argmax().item(), shape[0])}"


@needs_native
@pytest.mark.parametrize("case, shape", [CASES[1], CASES[3], CASES[4]])
def test_bf16_prompt_path_reads_every_weight_value_exactly(case, shape, bf16_amx):
    """One-hot rows read the weight back (one exact product per output): every panel value is the
    dequantized float32 weight rounded to bfloat16, bit for bit."""
    weight, dense = weight_for(case, shape, seed=7)
    one_hot = torch.eye(shape[1], dtype=torch.bfloat16)
    assert torch.equal(kquant_linear_bf16(one_hot, weight, dtype=torch.float32), dense.to(torch.bfloat16).float().T)


@needs_native
@pytest.mark.parametrize("case, shape", [CASES[1], CASES[4], ("int6", (48, 4608))])
def test_bf16_prompt_path_gives_a_row_the_same_bits_in_any_batch_and_thread_count(case, shape, bf16_amx):
    weight, _ = weight_for(case, shape, seed=11)
    x = torch.randn(300, shape[1], generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    alone = torch.cat([kquant_linear_bf16(x[row : row + 1], weight) for row in range(40)])
    for rows in (1, 15, 16, 17, 33, 40):
        assert torch.equal(kquant_linear_bf16(x[:rows], weight), alone[:rows]), f"{rows} rows"
    everything = kquant_linear_bf16(x, weight)
    assert torch.equal(everything[:40], alone)
    order = torch.randperm(300, generator=torch.Generator().manual_seed(1))
    assert torch.equal(kquant_linear_bf16(x[order], weight), everything[order])
    for count in (1, 2):
        with torch_threads(count):
            assert torch.equal(kquant_linear_bf16(x, weight), everything), f"{count} threads"


@needs_native
def test_bf16_prompt_path_refuses_where_amx_bf16_is_not_available(monkeypatch):
    weight, _ = weight_for("int6", (16, 256), seed=0)
    int5, _ = weight_for("int5-0", (48, 640), seed=0)
    x = torch.randn(2, 256).to(torch.bfloat16)
    monkeypatch.setenv("TOKENLOOM_CPU_AMX", "0")
    assert not bf16_amx_available()
    for matmul, rows in ((weight, x), (int5, torch.randn(2, 640))):
        with pytest.raises(RuntimeError, match="AMX-BF16 is not available here"):
            kquant_linear_bf16(rows, matmul)


@needs_native
def test_bf16_prompt_path_writes_a_large_output_as_it_writes_a_small_one(bf16_amx):
    """From 16 MiB the output is asked for huge pages before it is written: 256 rows x 16384
    float32 outputs give each row the bits it gets in calls of 100 rows."""
    weight, _ = weight_for("int6", (16384, 256), seed=5)
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    large = kquant_linear_bf16(x, weight, dtype=torch.float32)
    assert large.numel() * large.element_size() >= 16 << 20
    assert torch.equal(
        large, torch.cat([kquant_linear_bf16(part, weight, dtype=torch.float32) for part in x.split(100)])
    )


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("case", ["int6", "int5-k"])
def test_one_row_read_in_two_streams_gets_the_bits_of_a_batchs_row(case, threads):
    """One row reads each thread's block pairs two at a time (AVX-512), a pair left over alone: 304
    outputs are 9 pairs and a lone block. Every split over 1-3 threads gives the row the bits it gets
    inside a batch, within float32 summation error of the exact product."""
    weight, dense = weight_for(case, (304, 512), seed=threads)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(threads))
    with torch_threads(threads):
        alone = torch.cat([kquant_linear(x[row : row + 1], weight) for row in range(3)])
    assert torch.equal(alone, kquant_linear(x, weight))
    exact = exact_product(x, dense)
    torch.testing.assert_close(alone.double(), exact, rtol=0, atol=1e-5 * exact.abs().max().item())
