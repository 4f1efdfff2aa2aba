"""GGML's 4-bit block formats (Q4_0, Q4_1, Q4_K) as the group-wise affine int4 weights of
:mod:`tokenloom.kernels.int4_matmul`: the same 4-bit codes, with each 32-value group's scale
and minimum rewritten as ``(code - 8) * scale + zero``. No value is re-quantized.

At load, :func:`pack_native` repacks the file's blocks straight into tokenloom's kernel layout
(``gguf_pack_int4``, csrc/cpu_gguf_pack.cpp: the bytes :func:`int4_groups` and
:func:`~tokenloom.kernels.int4_matmul.pack_int4` make, without their intermediate tensors)."""

from __future__ import annotations

import torch

from tokenloom.builtin_plugins.quantization.gguf_blocks import (
    GGML_TYPES,
    Q4_0,
    Q4_1,
    Q4_K,
    GGUFWeight,
    _f16,
    _k_scales_and_mins,
    _nibbles,
    _split_32s,
)
from tokenloom.kernels import cpu_native, int4_matmul
from tokenloom.kernels.int4_matmul import CODE_OFFSET, NATIVE_GROUP_SIZE, Int4Weight, can_pack

GROUP_SIZE = 32


def _q4_0(blocks):
    scale = _f16(blocks, 0)
    return _nibbles(blocks[:, 2:18]), scale, torch.zeros_like(scale)


def _q4_1(blocks):
    scale = _f16(blocks, 0)
    return _nibbles(blocks[:, 4:20]), scale, _f16(blocks, 2) + CODE_OFFSET * scale


def _q4_k(blocks):
    scales, mins = _k_scales_and_mins(blocks[:, 4:16])
    scale = _f16(blocks, 0) * scales  # [blocks, 8]: one per 32-value sub-block
    offset = _f16(blocks, 2) * mins
    return _split_32s(blocks[:, 16:144], 4), scale, CODE_OFFSET * scale - offset


_CONVERTERS = {Q4_0: _q4_0, Q4_1: _q4_1, Q4_K: _q4_k}


def is_int4_type(ggml_type: int) -> bool:
    return ggml_type in _CONVERTERS


def int4_groups(weight: GGUFWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes [N, K] uint8, scales [N, K/32] float32, zeros [N, K/32] float32)`` of a
    Q4_0/Q4_1/Q4_K weight, so that ``(codes - 8) * scale + zero`` is its dequantized value."""
    if not is_int4_type(weight.ggml_type):
        raise ValueError(f"GGML type {weight.type_name} is not a 4-bit block format")
    rows, cols = weight.shape[0], weight.shape[-1]
    _, _, block_bytes = GGML_TYPES[weight.ggml_type]
    codes, scales, zeros = _CONVERTERS[weight.ggml_type](weight.data.reshape(-1, block_bytes))
    return codes.reshape(rows, cols), scales.reshape(rows, cols // GROUP_SIZE), zeros.reshape(rows, cols // GROUP_SIZE)


def pack_native(shards: list[GGUFWeight], dtype: torch.dtype) -> Int4Weight | None:
    """4-bit row shards (stacked in list order) packed for tokenloom's int4 kernel directly from
    their blocks; None when the kernels are not loaded here or the rows do not suit the kernel
    (the caller then takes :func:`int4_groups` and ``pack_int4``)."""
    kernel = int4_matmul._native_kernel()  # (pack_int4's switch between the two kernels)
    rows, cols = sum(shard.shape[0] for shard in shards), shards[0].shape[-1]
    if kernel is None or not can_pack(rows, cols, NATIVE_GROUP_SIZE):
        return None
    shard_bytes, types = [shard.data for shard in shards], [shard.ggml_type for shard in shards]
    packed = cpu_native.load().gguf_pack_int4(shard_bytes, types)
    return Int4Weight(packed=packed, out_features=rows, group_size=NATIVE_GROUP_SIZE, dtype=dtype, kernel=kernel)
