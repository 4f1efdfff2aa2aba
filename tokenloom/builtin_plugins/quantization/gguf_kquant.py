"""GGML's 5- and 6-bit block formats (Q5_0, Q5_1, Q5_K, Q6_K) as the weights of
:mod:`tokenloom.kernels.kquant_matmul`: the file's codes, sub-scales and float16 scales, read
out of the blocks unchanged. No value is re-quantized."""

from __future__ import annotations

import torch

from tokenloom.builtin_plugins.quantization.gguf_blocks import (
    GGML_TYPES,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    GGUFWeight,
    _high_bits,
    _k_scales_and_mins,
    _nibbles,
    _split_32s,
)
from tokenloom.kernels import cpu_native
from tokenloom.kernels.kquant_matmul import Q6_SUPERBLOCK_GROUPS, KQuantWeight, can_pack, pack_int5

# superblock groups of 32 per 5-bit type: Q5_K's d and dmin cover 256 values, Q5_0's and Q5_1's 32
_INT5_SUPERBLOCK_GROUPS = {Q5_0: 1, Q5_1: 1, Q5_K: 8}


def _f16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte ``start`` of each block, as ``[num_blocks, 1]`` float16."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16)


def _q6_k(blocks):
    num_blocks = blocks.shape[0]
    # the order of gguf_blocks._dequantize_q6_k
    low = _split_32s(blocks[:, 0:128], 4).view(num_blocks, 2, 2, 2, 32).transpose(2, 3).reshape(num_blocks, 256)
    codes = low | (_split_32s(blocks[:, 128:192], 2) << 4)
    return codes, blocks[:, 192:208].contiguous().view(torch.int8), _f16_field(blocks, 208)


def _q5_k(blocks):
    scales, mins = _k_scales_and_mins(blocks[:, 4:16])
    codes = _split_32s(blocks[:, 48:176], 4) | (_split_32s(blocks[:, 16:48], 1) << 4)
    return codes, scales.to(torch.uint8), mins.to(torch.uint8), _f16_field(blocks, 0), _f16_field(blocks, 2)


def _q5_0(blocks):
    codes = _nibbles(blocks[:, 6:22]) | (_high_bits(blocks[:, 2:6], 32) << 4)
    d = _f16_field(blocks, 0)
    ones = torch.ones(blocks.shape[0], 1, dtype=torch.uint8)
    return codes, ones, torch.full_like(ones, 16), d, d  # d * q - d * 16


def _q5_1(blocks):
    codes = _nibbles(blocks[:, 8:24]) | (_high_bits(blocks[:, 4:8], 32) << 4)
    ones = torch.ones(blocks.shape[0], 1, dtype=torch.uint8)
    return codes, ones, ones, _f16_field(blocks, 0), -_f16_field(blocks, 2)  # d * q - (-m) * 1


_INT5_CONVERTERS = {Q5_0: _q5_0, Q5_1: _q5_1, Q5_K: _q5_k}
KQUANT_TYPES = frozenset({Q6_K, *_INT5_CONVERTERS})


def int6_parts(weight: GGUFWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q6_K weight's ``(codes [N, K] uint8 0..63, scales [N, K / 16] int8, d [N, K / 256] float16)``."""
    rows, cols = weight.shape[0], weight.shape[-1]
    blocks = weight.data.reshape(-1, GGML_TYPES[Q6_K][2])
    codes, scales, d = _q6_k(blocks)
    return codes.reshape(rows, cols), scales.reshape(rows, cols // 16), d.reshape(rows, cols // 256)


def int5_parts(weight: GGUFWeight) -> tuple[torch.Tensor, ...]:
    """A Q5_0/Q5_1/Q5_K weight's ``(codes [N, K] 0..31, scales, mins [N, K / 32] uint8, d, dmin
    [N, K / (32 G)] float16)``, ``G`` its :func:`superblock_groups`."""
    rows = weight.shape[0]
    parts = _INT5_CONVERTERS[weight.ggml_type](weight.data.reshape(-1, GGML_TYPES[weight.ggml_type][2]))
    return tuple(part.reshape(rows, -1) for part in parts)


def superblock_groups(ggml_type: int) -> int:
    """Groups of 32 values per superblock in the kernel's layout (6 for Q6_K's 256 too)."""
    return 8 if ggml_type == Q6_K else _INT5_SUPERBLOCK_GROUPS[ggml_type]


def pack_native_q6_k(shards: list[GGUFWeight]) -> KQuantWeight | None:
    """Q6_K row shards (stacked in list order) packed for int6_linear straight from their blocks
    (``gguf_pack_int6``, csrc/cpu_gguf_pack.cpp: the bytes :func:`int6_parts` and
    :func:`~tokenloom.kernels.kquant_matmul.pack_int6` make, in one pass without their
    intermediate tensors); None when the kernels are not loaded here or the rows are not whole
    blocks of 16."""
    ops = cpu_native.load()
    rows = sum(shard.shape[0] for shard in shards)
    if ops is None or not can_pack(rows, shards[0].shape[-1], Q6_SUPERBLOCK_GROUPS):
        return None
    packed = ops.gguf_pack_int6([shard.data.reshape(shard.shape[0], -1) for shard in shards])
    return KQuantWeight(packed, rows, 6, Q6_SUPERBLOCK_GROUPS, ops.int6_linear)


def pack_kquant(shards: list[GGUFWeight]) -> KQuantWeight | None:
    """Row shards of one layer, all Q6_K or all one 5-bit superblock size, stacked and packed for
    the kernel; None when it is not built here or the rows do not suit it."""
    if shards[0].ggml_type == Q6_K:
        return pack_native_q6_k(shards)
    codes, scales, mins, d, dmin = (torch.cat(parts) for parts in zip(*(int5_parts(shard) for shard in shards)))
    return pack_int5(codes, scales, mins, d, dmin, superblock_groups(shards[0].ggml_type))
