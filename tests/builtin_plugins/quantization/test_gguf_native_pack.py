"""The kernels' GGUF repacking at load (csrc/cpu_gguf_pack.cpp) against the torch path it replaces,
byte for byte, on every CPU kernel level the host runs: Q4_0/Q4_1/Q4_K row shards (mixed, odd
and even block counts, float16 edge scales) into int4_linear's layout, and Q6_K row shards (odd
block counts, narrowed rows) into int6_linear's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from tests.builtin_plugins.quantization.test_gguf_blocks import random_blocks
from tokenloom.builtin_plugins.quantization.gguf_blocks import GGML_TYPES, GGUFWeight
from tokenloom.builtin_plugins.quantization.gguf_int4 import int4_groups, pack_native
from tokenloom.builtin_plugins.quantization.gguf_kquant import int6_parts, pack_native_q6_k
from tokenloom.kernels import cpu_native
from tokenloom.kernels.int4_matmul import _pack_native
from tokenloom.kernels.kquant_matmul import pack_int6

pytestmark = pytest.mark.usefixtures("isa_level")

Q = GGMLQuantizationType
# float16 bit patterns at the edges of the conversions: zeros of both signs, the smallest
# subnormal, the largest finite value (a Q4_K d times its 6-bit scale overflows to infinity)
EDGE_SCALES = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00], dtype=np.uint16)


def shard(quant_type: GGMLQuantizationType, rows: int, cols: int, seed: int) -> GGUFWeight:
    """Random blocks of ``quant_type``, the first rows' float16 fields set to edge values."""
    _, block_values, block_bytes = GGML_TYPES[int(quant_type)]
    blocks = random_blocks(int(quant_type), rows * cols // block_values, seed)
    f16_fields = blocks[: len(EDGE_SCALES), :4].copy().view(np.uint16)
    f16_fields[:] = EDGE_SCALES[:, None]
    blocks[: len(EDGE_SCALES), :4] = f16_fields.view(np.uint8)
    return GGUFWeight(torch.from_numpy(blocks.reshape(rows, -1)), int(quant_type), (rows, cols))


def torch_packed(shards: list[GGUFWeight]) -> torch.Tensor:
    """What the loader packed before the native repacking: int4_groups, stacked, packed by torch."""
    codes, scales, zeros = (torch.cat([int4_groups(part)[index] for part in shards]) for index in range(3))
    return _pack_native(codes, scales, zeros)


@pytest.mark.parametrize(
    "types, rows",
    [
        ([Q.Q4_K], [48]),  # three blocks of 16 rows: a pair and an odd last block
        ([Q.Q4_0], [32]),
        ([Q.Q4_1], [64]),
        ([Q.Q4_K, Q.Q4_K, Q.Q4_0], [32, 16, 16]),  # a fused layer's row shards, one of another type
    ],
    ids=["q4_k-odd-blocks", "q4_0", "q4_1", "mixed-shards"],
)
def test_int4_repacking_gives_the_torch_packers_bytes(types, rows):
    if cpu_native.load() is None:
        pytest.skip("the kernels are switched off: the torch packer runs")
    shards = [shard(quant_type, count, 512, seed) for seed, (quant_type, count) in enumerate(zip(types, rows))]
    weight = pack_native(shards, torch.bfloat16)
    assert weight is not None and weight.out_features == sum(rows) and weight.kernel is not None
    assert torch.equal(weight.packed, torch_packed(shards))


def test_int4_repacking_reads_permuted_and_narrowed_rows():
    if cpu_native.load() is None:
        pytest.skip("the kernels are switched off: the torch packer runs")
    whole = shard(Q.Q4_K, 64, 512, seed=7)
    # a Llama q/k's unpermuted rows (a copy) beside a slice of the file's rows (a strided view)
    parts = [
        whole.permute_rows(torch.randperm(64, generator=torch.Generator().manual_seed(0))),
        whole.narrow_rows(16, 32),
    ]
    assert torch.equal(pack_native(parts, torch.bfloat16).packed, torch_packed(parts))


def test_int4_repacking_leaves_shapes_the_kernel_does_not_take_to_the_caller():
    if cpu_native.load() is None:
        pytest.skip("the kernels are switched off: the torch packer runs")
    assert pack_native([shard(Q.Q4_0, 8, 64, seed=1)], torch.bfloat16) is None  # 8 rows: not a block of 16


@pytest.mark.parametrize("rows", [[48], [32, 16, 16]], ids=["odd-blocks", "three-shards"])
def test_q6_k_repacking_gives_pack_int6s_bytes(rows):
    if cpu_native.load() is None:
        pytest.skip("the kernels are switched off: Q6_K layers are dense")
    shards = [shard(Q.Q6_K, count, 512, seed) for seed, count in enumerate(rows)]
    weight = pack_native_q6_k(shards)
    expected = pack_int6(*(torch.cat(parts) for parts in zip(*(int6_parts(part) for part in shards))))
    assert weight is not None and weight.out_features == sum(rows) and weight.kernel is not None
    assert torch.equal(weight.packed, expected.packed)


def test_q6_k_repacking_reads_narrowed_rows_and_leaves_other_shapes_to_the_caller():
    if cpu_native.load() is None:
        pytest.skip("the kernels are switched off: Q6_K layers are dense")
    whole = shard(Q.Q6_K, 64, 512, seed=3)
    parts = [whole.narrow_rows(16, 32), whole.narrow_rows(0, 16)]  # strided views of the file's rows
    expected = pack_int6(*(torch.cat(parts) for parts in zip(*(int6_parts(part) for part in parts))))
    assert torch.equal(pack_native_q6_k(parts).packed, expected.packed)
    assert pack_native_q6_k([whole.narrow_rows(0, 8)]) is None  # 8 rows: not a block of 16


@pytest.mark.parametrize("mode", ["auto", "dequantize"])
def test_a_layer_releases_the_file_pages_of_every_shard_it_packed(mode):
    from tests.builtin_plugins.quantization.test_gguf_kquant import loaded_layer

    released: list[str] = []
    shards = [shard(quant_type, 32, 512, seed) for seed, quant_type in enumerate([Q.Q4_K, Q.Q4_K, Q.Q6_K])]
    for index, part in enumerate(shards):
        part.release = lambda index=index: released.append(f"shard {index}")
        part.name = f"blk.0.attn_{'qkv'[index]}.weight"
    loaded_layer([part.narrow_rows(0, 32) for part in shards], mode=mode)  # cut weights keep their source's release
    assert sorted(released) == ["shard 0", "shard 1", "shard 2"]
