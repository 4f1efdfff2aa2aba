"""Weight-only 4-bit matmul on the CPU: weights stored as 4-bit codes with one affine
``(scale, zero)`` pair per group of input features, multiplied by torch's packed CPU kernel
(``aten._weight_int4pack_mm_for_cpu``) without ever materialising the dense weight.

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

import torch

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


@dataclass
class Int4Weight:
    """A ``[out_features, in_features]`` weight packed for the CPU kernel."""

    packed: torch.Tensor  # [out_features, in_features / 2] uint8 in the kernel's layout
    scales_and_zeros: torch.Tensor  # [in_features / group_size, out_features, 2], activation dtype
    group_size: int

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
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return Int4Weight(packed=packed, scales_and_zeros=scales_and_zeros, group_size=group_size)


def int4_linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W.T + bias`` with ``W`` the int4 weight; ``x`` is cast to the dtype the
    weight was packed for, and the result back to ``x``'s."""
    rows = x.reshape(-1, x.shape[-1]).to(weight.scales_and_zeros.dtype)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(
        rows.contiguous(), weight.packed, weight.group_size, weight.scales_and_zeros
    ).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.out_features)


def prefers_int4(x: torch.Tensor) -> bool:
    """Whether a batch of these activations runs faster on the int4 kernel than dense."""
    return x.numel() <= INT4_MAX_ROWS.get(x.dtype, 0) * x.shape[-1]


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The dense float32 weight the codes stand for (the reference the kernel is tested against)."""
    out_features, in_features = codes.shape
    groups = scales.shape[1]
    grouped = (codes.float() - CODE_OFFSET).view(out_features, groups, in_features // groups)
    return (grouped * scales.float().unsqueeze(-1) + zeros.float().unsqueeze(-1)).view(out_features, in_features)
