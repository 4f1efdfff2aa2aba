"""5- and 6-bit weight matmul on the CPU: GGUF's Q5_0, Q5_1, Q5_K and Q6_K weights multiplied in
their own codes and scales by tokenloom's kernels (``int5_linear``, ``int6_linear``,
csrc/cpu_kquant.cpp; every CPU kernel level), in the Q4 x Q8 arithmetic of
:mod:`tokenloom.kernels.int4_matmul`: each row of activations quantized to 8 bits per group of 32
(:func:`~tokenloom.kernels.int4_matmul.quantize_activations`), integer dot products, float32
scales. The layout is the int4 one (the low 4 bits of each code) plus a plane of high bits
(1 for 5-bit codes, 2 for 6-bit), so a weight reads about the bytes its file stores.

- 6-bit (:func:`pack_int6`, Q6_K): ``d * scale * (code - 32)``, ``code`` in ``0..63``, a signed
  8-bit ``scale`` per 16 input features and a float16 ``d`` per 256.
- 5-bit (:func:`pack_int5`): ``d * scale * code - dmin * min``, ``code`` in ``0..31``, an unsigned
  8-bit ``scale`` and ``min`` per 32 features, float16 ``d`` and ``dmin`` per superblock of
  ``superblock_groups`` groups of 32 (Q5_K: 8; Q5_0 and Q5_1: 1, with scale 1).

For a prompt's rows, where AMX-BF16 runs
(:func:`~tokenloom.kernels.int4_matmul.bf16_amx_available`), :func:`kquant_linear_bf16` multiplies
bfloat16 rows by the same packed weight dequantized to bfloat16 panels (``int6_linear_bf16``,
``int5_linear_bf16``, csrc/cpu_amx_bf16.h), float32 sums over all of K.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenloom.kernels import cpu_native
from tokenloom.kernels.int4_matmul import NATIVE_DTYPES, finish_float_out, interleave_block_pairs

GROUP_SIZE = 32
Q6_SCALE_FEATURES = 16  # features per 6-bit sub-scale
Q6_SUPERBLOCK_GROUPS = 8  # groups of 32 per 6-bit d
Q6_CODE_OFFSET = 32
_BLOCK_ROWS = 16


@dataclass
class KQuantWeight:
    """A ``[out_features, in_features]`` 5- or 6-bit weight packed for the kernel:
    ``[out / 16, in / (32 superblock_groups) * superblock bytes]`` uint8 (csrc/cpu_kquant.cpp)."""

    packed: torch.Tensor
    out_features: int
    bits: int
    superblock_groups: int
    kernel: Any


def _kernel(name: str):
    ops = cpu_native.load()
    return getattr(ops, name, None) if ops is not None else None


def can_pack(out_features: int, in_features: int, superblock_groups: int) -> bool:
    """Whether the kernels take a weight of this shape (rows in blocks of 16, whole superblocks)."""
    return out_features % _BLOCK_ROWS == 0 and in_features % (GROUP_SIZE * superblock_groups) == 0


def _block_rows(values: torch.Tensor, per_row: int) -> torch.Tensor:
    """``[N, per_row * G']`` -> ``[N / 16, G', 16 * per_row]``: each group's entries for the 16
    rows of a block, row by row."""
    rows = values.shape[0]
    return (
        values.reshape(rows // _BLOCK_ROWS, _BLOCK_ROWS, -1, per_row)
        .transpose(1, 2)
        .reshape(rows // _BLOCK_ROWS, -1, _BLOCK_ROWS * per_row)
    )


def _code_groups(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes [N, K]`` -> ``[N / 16, K / 32, 256 + 64 (bits - 4)]``: each group's nibbles in the
    int4 layout, then its planes of high bits."""
    rows, features = codes.shape
    blocks, groups = rows // _BLOCK_ROWS, features // GROUP_SIZE
    codes = codes.to(torch.uint8)
    # [block, lane, group, t, half, j] -> [block, group, t, lane, j]: steps 2t and 2t+1 in the low and high nibbles
    nibbles = (codes & 0x0F).view(blocks, _BLOCK_ROWS, groups, 4, 2, 4)
    nibble_bytes = (nibbles[..., 0, :] | (nibbles[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(blocks, groups, -1)
    high = codes >> 4
    # (the bits ORed in uint8, one scalar shift per step: a broadcast shift and sum in int32 took
    # 15x as long, most of a 1.7B model's load)
    if bits == 5:  # bit `step` of byte (lane, j)
        steps = high.view(blocks, _BLOCK_ROWS, groups, 8, 4)
        plane = steps[:, :, :, 0]
        for step in range(1, 8):
            plane = plane | (steps[:, :, :, step] << step)
        plane = plane.permute(0, 2, 1, 3)
    else:  # bits 2i, 2i+1 of plane h's byte (lane, j): step 4h + i
        steps = high.view(blocks, _BLOCK_ROWS, groups, 2, 4, 4)
        plane = steps[..., 0, :]
        for i in range(1, 4):
            plane = plane | (steps[..., i, :] << (2 * i))
        plane = plane.permute(0, 2, 3, 1, 4)
    return torch.cat([nibble_bytes, plane.reshape(blocks, groups, -1)], dim=2)


def _pack(
    codes: torch.Tensor, bits: int, sub_scales: torch.Tensor, headers: list[torch.Tensor], superblock_groups: int
) -> torch.Tensor:
    """Groups (codes and ``sub_scales [N / 16, K / 32, 32]`` uint8) gathered into superblocks
    behind their float16 ``headers`` (each ``[N, K / (32 G)]``), blocks stored in pairs."""
    group_bytes = torch.cat([_code_groups(codes, bits), sub_scales], dim=2)
    blocks, groups, _ = group_bytes.shape
    header = torch.cat([_block_rows(h.to(torch.float16).contiguous().view(torch.uint8), 2) for h in headers], dim=2)
    superblocks = group_bytes.reshape(blocks, groups // superblock_groups, -1)
    return interleave_block_pairs(torch.cat([header, superblocks], dim=2).contiguous())


def pack_int6(codes: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> KQuantWeight | None:
    """``codes [N, K]`` (0..63), ``scales [N, K / 16]`` (int8), ``d [N, K / 256]`` (float16
    values) -> a :class:`KQuantWeight`; None when the kernel is not built here or the shape does
    not suit it."""
    kernel = _kernel("int6_linear")
    out_features, in_features = codes.shape
    if kernel is None or not can_pack(out_features, in_features, Q6_SUPERBLOCK_GROUPS):
        return None
    # [N, groups, 2] -> per group sc[2][16]: each row's first 16 features' scale, then the second's
    sub_scales = scales.to(torch.int8).view(torch.uint8).reshape(out_features // _BLOCK_ROWS, _BLOCK_ROWS, -1, 2)
    sub_scales = sub_scales.permute(0, 2, 3, 1).reshape(out_features // _BLOCK_ROWS, -1, 2 * _BLOCK_ROWS)
    packed = _pack(codes, 6, sub_scales, [d], Q6_SUPERBLOCK_GROUPS)
    return KQuantWeight(packed, out_features, 6, Q6_SUPERBLOCK_GROUPS, kernel)


def pack_int5(
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    d: torch.Tensor,
    dmin: torch.Tensor,
    superblock_groups: int,
) -> KQuantWeight | None:
    """``codes [N, K]`` (0..31), ``scales`` and ``mins [N, K / 32]`` (0..255), ``d`` and ``dmin
    [N, K / (32 superblock_groups)]`` (float16 values) -> a :class:`KQuantWeight`; None when the
    kernel is not built here or the shape does not suit it."""
    kernel = _kernel("int5_linear")
    out_features, in_features = codes.shape
    if kernel is None or not can_pack(out_features, in_features, superblock_groups):
        return None
    sub_scales = torch.cat([_block_rows(scales.to(torch.uint8), 1), _block_rows(mins.to(torch.uint8), 1)], dim=2)
    packed = _pack(codes, 5, sub_scales, [d, dmin], superblock_groups)
    return KQuantWeight(packed, out_features, 5, superblock_groups, kernel)


def kquant_linear(
    x: torch.Tensor, weight: KQuantWeight, bias: torch.Tensor | None = None, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x [..., K] @ W.T + bias`` in ``dtype`` (default ``x``'s; float32 accumulation, rounded once)."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.dtype not in NATIVE_DTYPES:
        rows = rows.float()
    rows = rows if rows.is_contiguous() else rows.contiguous()
    if weight.bits == 6:
        out = weight.kernel(rows, weight.packed)
    else:
        out = weight.kernel(rows, weight.packed, weight.superblock_groups)
    return finish_float_out(out, x, bias, dtype, weight.out_features)


def kquant_linear_bf16(
    x: torch.Tensor, weight: KQuantWeight, bias: torch.Tensor | None = None, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x [..., K] @ W.T + bias`` in ``dtype`` (default ``x``'s) for many rows (a prompt's) through
    AMX-BF16 (``int6_linear_bf16`` / ``int5_linear_bf16``, csrc/cpu_amx_bf16.h): each weight value
    the dequantized one rounded to bfloat16, read from the buffer :func:`kquant_linear` reads (no
    copy), the rows in bfloat16 (others are rounded to it on the way in), float32 sums over all of
    ``K`` (the kernel's float32 out, then rounded once to ``dtype``). A row's bits do not depend on
    the other rows of the call. Only where
    :func:`~tokenloom.kernels.int4_matmul.bf16_amx_available` (else a RuntimeError)."""
    ops = cpu_native.load()
    if ops is None:
        raise RuntimeError("kquant_linear_bf16: tokenloom's CPU kernels are switched off or did not build")
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.dtype != torch.bfloat16:
        rows = rows.to(torch.bfloat16)
    rows = rows if rows.is_contiguous() else rows.contiguous()
    if weight.bits == 6:
        out = ops.int6_linear_bf16(rows, weight.packed)
    else:
        out = ops.int5_linear_bf16(rows, weight.packed, weight.superblock_groups)
    return finish_float_out(out, x, bias, dtype, weight.out_features)


def dequantize_int6(codes: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The dense float32 weight (exact: ``d * scale`` and its product with ``code - 32`` fit
    float32's significand); the reference the kernel is tested against."""
    rows, features = codes.shape
    sub_scale = d.float().repeat_interleave(256 // Q6_SCALE_FEATURES, dim=1) * scales.float()
    centred = (codes.float() - Q6_CODE_OFFSET).view(rows, -1, Q6_SCALE_FEATURES)
    return (sub_scale.unsqueeze(-1) * centred).view(rows, features)


def dequantize_int5(
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    d: torch.Tensor,
    dmin: torch.Tensor,
    superblock_groups: int,
) -> torch.Tensor:
    """The dense float32 weight ``d * scale * code - dmin * min``; the reference the kernel is tested against."""
    rows, features = codes.shape
    scale = d.float().repeat_interleave(superblock_groups, dim=1) * scales.float()
    offset = dmin.float().repeat_interleave(superblock_groups, dim=1) * mins.float()
    grouped = codes.float().view(rows, -1, GROUP_SIZE)
    return (scale.unsqueeze(-1) * grouped - offset.unsqueeze(-1)).view(rows, features)
