"""2- and 3-bit weight matmul on the CPU: GGUF's Q2_K and Q3_K weights multiplied in their own
codes and scales by tokenloom's kernels (``int2_linear``, ``int3_linear``, csrc/cpu_lowbit.cpp;
every CPU kernel level), in the Q x Q8 arithmetic of :mod:`tokenloom.kernels.int4_matmul`: each
row of activations quantized to 8 bits per group of 32
(:func:`~tokenloom.kernels.int4_matmul.quantize_activations`), integer dot products, float32
scales. The layout keeps the low 2 bits of each code, 4 to a byte, plus (3-bit) a plane of high
bits, and the file's sub-scales per 16 features, so a weight reads about the bytes its file stores.

- 3-bit (:func:`pack_int3`, Q3_K): ``d * scale * (code - 4)``, ``code`` in ``0..7``, a signed
  6-bit ``scale`` per 16 input features and a float16 ``d`` per 256.
- 2-bit (:func:`pack_int2`, Q2_K): ``d * scale * code - dmin * min``, ``code`` in ``0..3``, a
  4-bit ``scale`` and ``min`` per 16 features, float16 ``d`` and ``dmin`` per 256.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenloom.kernels import cpu_native
from tokenloom.kernels.int4_matmul import NATIVE_DTYPES, finish_float_out, interleave_block_pairs

GROUP_SIZE = 32
SUPERBLOCK = 256  # features per float16 d (and dmin)
SCALE_FEATURES = 16  # features per sub-scale
Q3_CODE_OFFSET = 4
_BLOCK_ROWS = 16
_STEP = 4  # features per step of the layout


@dataclass
class LowbitWeight:
    """A ``[out_features, in_features]`` 2- or 3-bit weight packed for the kernel:
    ``[out / 16, in / 256 * superblock bytes]`` uint8 (csrc/cpu_lowbit.cpp)."""

    packed: torch.Tensor
    out_features: int
    bits: int
    kernel: Any


def can_pack(out_features: int, in_features: int) -> bool:
    """Whether the kernels take a weight of this shape (rows in blocks of 16, whole superblocks)."""
    return out_features % _BLOCK_ROWS == 0 and in_features % SUPERBLOCK == 0


def _kernel(bits: int, out_features: int, in_features: int):
    """The selected level's kernel for ``bits`` when it is built and takes the shape, else None."""
    ops = cpu_native.load()
    kernel = getattr(ops, f"int{bits}_linear", None) if ops is not None else None
    return kernel if kernel is not None and can_pack(out_features, in_features) else None


def _block_rows(values: torch.Tensor, per_row: int) -> torch.Tensor:
    """``[N, per_row * G']`` -> ``[N / 16, G', 16 * per_row]``: each entry's 16 rows of a block, row by row."""
    rows = values.shape[0]
    return (
        values.reshape(rows // _BLOCK_ROWS, _BLOCK_ROWS, -1, per_row)
        .transpose(1, 2)
        .reshape(rows // _BLOCK_ROWS, -1, _BLOCK_ROWS * per_row)
    )


def _code_groups(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes [N, K]`` -> ``[N / 16, K / 32, 128 (+ 64)]``: each group's low 2 bits, step
    ``4c + i`` in bits ``2i, 2i + 1`` of 64 bytes ``c``, then (3-bit) the plane of high bits, bit
    ``step`` of each byte."""
    rows, features = codes.shape
    blocks, groups = rows // _BLOCK_ROWS, features // GROUP_SIZE
    codes = codes.to(torch.uint8)
    # [block, lane, group, c, i, j] -> bytes [block, group, c, lane, j]
    steps = (codes & 0x03).view(blocks, _BLOCK_ROWS, groups, 2, 4, _STEP)
    low = steps[..., 0, :]
    for i in range(1, 4):
        low = low | (steps[..., i, :] << (2 * i))
    parts = [low.permute(0, 2, 3, 1, 4).reshape(blocks, groups, -1)]
    if bits == 3:
        high = (codes >> 2).view(blocks, _BLOCK_ROWS, groups, 8, _STEP)
        plane = high[:, :, :, 0]
        for step in range(1, 8):
            plane = plane | (high[:, :, :, step] << step)
        parts.append(plane.permute(0, 2, 1, 3).reshape(blocks, groups, -1))
    return torch.cat(parts, dim=2)


def _pack(codes: torch.Tensor, bits: int, sub_scales: torch.Tensor, headers: list[torch.Tensor]) -> torch.Tensor:
    """``sub_scales [N, K / 16]`` uint8 bytes and the codes gathered per group (``[2][16]`` bytes
    after the codes), groups into superblocks of 8 behind their float16 ``headers`` (each ``[N, K /
    256]``), blocks stored in pairs."""
    rows = codes.shape[0]
    blocks = rows // _BLOCK_ROWS
    # [block, lane, group, half] -> [block, group, half, lane]
    scale_bytes = (
        sub_scales.reshape(blocks, _BLOCK_ROWS, -1, 2).permute(0, 2, 3, 1).reshape(blocks, -1, 2 * _BLOCK_ROWS)
    )
    group_bytes = torch.cat([_code_groups(codes, bits), scale_bytes], dim=2)
    header = torch.cat([_block_rows(h.to(torch.float16).contiguous().view(torch.uint8), 2) for h in headers], dim=2)
    superblocks = group_bytes.reshape(blocks, header.shape[1], -1)
    return interleave_block_pairs(torch.cat([header, superblocks], dim=2).contiguous())


def pack_int3(codes: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> LowbitWeight | None:
    """``codes [N, K]`` (0..7), ``scales [N, K / 16]`` (-32..31), ``d [N, K / 256]`` (float16
    values) -> a :class:`LowbitWeight`; None when the kernel is not built here or the shape does
    not suit it."""
    out_features, in_features = codes.shape
    kernel = _kernel(3, out_features, in_features)
    if kernel is None:
        return None
    sub_scales = scales.to(torch.int8).view(torch.uint8)
    return LowbitWeight(_pack(codes, 3, sub_scales, [d]), out_features, 3, kernel)


def pack_int2(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
) -> LowbitWeight | None:
    """``codes [N, K]`` (0..3), ``scales`` and ``mins [N, K / 16]`` (0..15), ``d`` and ``dmin
    [N, K / 256]`` (float16 values) -> a :class:`LowbitWeight`; None when the kernel is not built
    here or the shape does not suit it."""
    out_features, in_features = codes.shape
    kernel = _kernel(2, out_features, in_features)
    if kernel is None:
        return None
    sub_scales = scales.to(torch.uint8) | (mins.to(torch.uint8) << 4)
    return LowbitWeight(_pack(codes, 2, sub_scales, [d, dmin]), out_features, 2, kernel)


def lowbit_linear(
    x: torch.Tensor, weight: LowbitWeight, bias: torch.Tensor | None = None, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x [..., K] @ W.T + bias`` in ``dtype`` (default ``x``'s; float32 accumulation, rounded once)."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.dtype not in NATIVE_DTYPES:
        rows = rows.float()
    out = weight.kernel(rows if rows.is_contiguous() else rows.contiguous(), weight.packed)
    return finish_float_out(out, x, bias, dtype, weight.out_features)


def dequantize_int3(codes: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The dense float32 weight ``d * scale * (code - 4)`` (exact in float32); the reference the
    kernel is tested against."""
    rows, features = codes.shape
    sub_scale = d.float().repeat_interleave(SUPERBLOCK // SCALE_FEATURES, dim=1) * scales.float()
    centred = (codes.float() - Q3_CODE_OFFSET).view(rows, -1, SCALE_FEATURES)
    return (sub_scale.unsqueeze(-1) * centred).view(rows, features)


def dequantize_int2(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
) -> torch.Tensor:
    """The dense float32 weight ``d * scale * code - dmin * min``; the reference the kernel is tested against."""
    rows, features = codes.shape
    per_scale = SUPERBLOCK // SCALE_FEATURES
    scale = d.float().repeat_interleave(per_scale, dim=1) * scales.float()
    offset = dmin.float().repeat_interleave(per_scale, dim=1) * mins.float()
    grouped = codes.float().view(rows, -1, SCALE_FEATURES)
    return (scale.unsqueeze(-1) * grouped - offset.unsqueeze(-1)).view(rows, features)
