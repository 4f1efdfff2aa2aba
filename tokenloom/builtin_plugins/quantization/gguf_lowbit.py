"""GGML's 2- and 3-bit block formats (Q2_K, Q3_K) as the weights of
:mod:`tokenloom.kernels.lowbit_matmul`: the file's codes, sub-scales and float16 scales, read out
of the blocks unchanged (in the value order of gguf_blocks' dequantizers). No value is re-quantized."""

from __future__ import annotations

import torch

from tokenloom.builtin_plugins.quantization.gguf_blocks import GGML_TYPES, Q2_K, Q3_K, GGUFWeight, _split_32s
from tokenloom.kernels.lowbit_matmul import LowbitWeight, pack_int2, pack_int3

LOWBIT_TYPES = frozenset({Q2_K, Q3_K})


def _f16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte ``start`` of each block, as ``[num_blocks, 1]`` float16."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16)


def _q3_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_blocks = blocks.shape[0]
    packed_scales = blocks[:, 96:108]
    low = torch.cat([packed_scales[:, 0:8] & 0x0F, packed_scales[:, 0:8] >> 4], dim=1)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8).view(1, -1, 1)
    high = ((packed_scales[:, 8:12].unsqueeze(1) >> shifts) & 3).reshape(num_blocks, 16)
    scales = (low | (high << 4)).to(torch.int8) - 32
    # value l's high bit is bit l // 32 of hmask[l % 32]
    bit_shifts = torch.arange(8, dtype=torch.uint8).view(1, -1, 1)
    high_bit = ((blocks[:, 0:32].unsqueeze(1) >> bit_shifts) & 1).reshape(num_blocks, 256)
    codes = _split_32s(blocks[:, 32:96], 2) | (high_bit << 2)
    return codes, scales, _f16_field(blocks, 108)


def _q2_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    packed_scales = blocks[:, 0:16]
    codes = _split_32s(blocks[:, 16:80], 2)
    return codes, packed_scales & 0x0F, packed_scales >> 4, _f16_field(blocks, 80), _f16_field(blocks, 82)


def lowbit_parts(weight: GGUFWeight) -> tuple[torch.Tensor, ...]:
    """A Q3_K weight's ``(codes [N, K] 0..7, scales [N, K / 16] int8, d [N, K / 256] float16)``,
    or a Q2_K weight's ``(codes 0..3, scales, mins [N, K / 16] uint8 0..15, d, dmin [N, K / 256])``."""
    rows = weight.shape[0]
    convert = _q3_k if weight.ggml_type == Q3_K else _q2_k
    parts = convert(weight.data.reshape(-1, GGML_TYPES[weight.ggml_type][2]))
    return tuple(part.reshape(rows, -1) for part in parts)


def pack_lowbit(shards: list[GGUFWeight]) -> LowbitWeight | None:
    """Row shards of one layer, all Q2_K or all Q3_K, stacked and packed for the kernel; None when
    it is not built here or the rows do not suit it."""
    parts = [torch.cat(part) for part in zip(*(lowbit_parts(shard) for shard in shards))]
    return pack_int3(*parts) if shards[0].ggml_type == Q3_K else pack_int2(*parts)
