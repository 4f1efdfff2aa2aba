"""Weight-only 4-bit matmul on the CPU: weights stored as 4-bit codes with one affine
``(scale, zero)`` pair per group of input features, multiplied without ever materialising the
dense weight: by tokenloom's own kernel (``tokenloom_cpu::int4_linear``, csrc/cpu_int4.cpp)
where the CPU has AVX512-BF16 and the weight's shape suits it (groups of 32, bfloat16
activations), else by torch's packed CPU kernel (``aten._weight_int4pack_mm_for_cpu``).

A weight value is ``(code - 8) * scale + zero`` with ``code`` in ``0..15``: the convention of
torch's kernel, which covers ggml's Q4_0, Q4_1 and Q4_K blocks exactly (their per-group scale
and minimum map onto ``scale`` and ``zero``). At one to a few rows per step the kernel reads a
quarter of the bytes of a bfloat16 weight (an eighth of a float32 one) and beats the dense
matmul 2-4x; from about a dozen rows on the dense matmul wins, so layers keep both and choose
per call (:func:`prefers_int4`).

The kernel is vectorised for 16-bit activations only (with float32 ones it is 5-40x slower
than a dense float32 matmul), so a weight packed for bfloat16 also serves float32 layers: their
rows are rounded to bfloat16 on the way in and the result widened on the way out, as ggml's
own CPU kernels round activations to 8 bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenloom.kernels import cpu_native

CODE_OFFSET = 8

# the packing kernel wants output features in multiples of 16
_ROW_MULTIPLE = 16

# per activation dtype, batches up to this many rows run the int4 kernel, larger ones the dense
# matmul. 16-bit, measured on a 2-core AVX512-BF16 CPU: int4 2.5-4x faster at 1-4 rows, even
# at 8, 1.5-2x slower from 16. float32 (bfloat16 inside the kernel), measured on a 2-core AVX2
# CPU against the dense float32 matmul over SmolLM2's 30 layers: 2.5x faster at 1 row, 1.7x at
# 8, 1.1x at 16, 7% slower at 24
INT4_MAX_ROWS = {torch.bfloat16: 8, torch.float16: 8, torch.float32: 16}

# the activation dtypes the kernel is fast for (a weight packed for one of them)
INT4_DTYPES = (torch.bfloat16, torch.float16)


# tokenloom's kernel: groups of this many features, taken in pairs, a few rows per call
NATIVE_GROUP_SIZE = 32
NATIVE_MAX_ROWS = 8


@dataclass
class Int4Weight:
    """A ``[out_features, in_features]`` weight packed for one of the CPU kernels."""

    # torch's kernel: [out_features, in_features / 2] uint8 in its layout;
    # tokenloom's: [out_features / 8, groups / 2, 8, 32] (see csrc/cpu_int4.cpp), byte j of a row's
    # pair of groups (g, g+1) = code g*32+j | code (g+1)*32+j << 4
    packed: torch.Tensor
    # torch's kernel: [in_features / group_size, out_features, 2];
    # tokenloom's: [2, out_features, in_features / group_size] (scales, then zeros); activation dtype
    scales_and_zeros: torch.Tensor
    group_size: int
    kernel: Any = None  # tokenloom's kernel when packed for it; it reads these two views
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]


def can_pack(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether the kernel takes a weight of this shape and grouping."""
    return out_features % _ROW_MULTIPLE == 0 and group_size > 0 and in_features % group_size == 0 \
        and group_size % 2 == 0


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> Int4Weight:
    """``codes [N, K]`` (integers 0..15), ``scales``/``zeros [N, K / group_size]`` -> an
    :class:`Int4Weight` whose matmul takes activations of ``dtype``."""
    out_features, in_features = codes.shape
    group_size = in_features // scales.shape[1]
    if scales.shape != zeros.shape or scales.shape[0] != out_features or not can_pack(out_features, in_features,
                                                                                      group_size):
        raise ValueError(
            f"cannot pack a {tuple(codes.shape)} int4 weight with {tuple(scales.shape)} group scales: out features "
            f"must be a multiple of {_ROW_MULTIPLE} and in features a multiple of an even group size"
        )
    kernel = _native_kernel()
    if kernel is not None and dtype == torch.bfloat16 and group_size == NATIVE_GROUP_SIZE \
            and in_features % (2 * NATIVE_GROUP_SIZE) == 0:
        pairs = codes.to(torch.uint8).view(out_features // 8, 8, in_features // (2 * group_size), 2, group_size)
        packed = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).transpose(1, 2).reshape(out_features, in_features // 2)
        scales_and_zeros = torch.stack([scales, zeros]).to(dtype).contiguous()
        return Int4Weight(packed=packed, scales_and_zeros=scales_and_zeros, group_size=group_size, kernel=kernel,
                          scales=scales_and_zeros[0], zeros=scales_and_zeros[1])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return Int4Weight(packed=packed, scales_and_zeros=scales_and_zeros, group_size=group_size)


def _native_kernel():
    """``tokenloom_cpu::int4_linear`` when built (only where the CPU has AVX512-BF16), else None."""
    ops = cpu_native.load()
    return getattr(ops, "int4_linear", None) if ops is not None else None


def int4_linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W.T + bias`` with ``W`` the int4 weight; ``x`` is cast to the dtype the
    weight was packed for, and the result back to ``x``'s. (Called per layer per decode step:
    every torch call it saves is a microsecond of the step.)"""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.dtype != weight.scales_and_zeros.dtype:
        rows = rows.to(weight.scales_and_zeros.dtype)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    if weight.kernel is not None:
        out = weight.kernel(rows, weight.packed, weight.scales, weight.zeros) if rows.shape[0] <= NATIVE_MAX_ROWS \
            else torch.cat([weight.kernel(rows[start:start + NATIVE_MAX_ROWS], weight.packed, weight.scales,
                                          weight.zeros) for start in range(0, rows.shape[0], NATIVE_MAX_ROWS)])
    else:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, weight.packed, weight.group_size,
                                                         weight.scales_and_zeros)
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.out_features)


def prefers_int4(x: torch.Tensor) -> bool:
    """Whether a batch of these activations runs faster on the int4 kernel than dense."""
    return x.numel() <= INT4_MAX_ROWS.get(x.dtype, 0) * x.shape[-1]


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The dense float32 weight the codes stand for (the reference the kernel is tested against)."""
    out_features, in_features = codes.shape
    groups = scales.shape[1]
    grouped = (codes.float() - CODE_OFFSET).view(out_features, groups, in_features // groups)
    return (grouped * scales.float().unsqueeze(-1) + zeros.float().unsqueeze(-1)).view(out_features, in_features)
