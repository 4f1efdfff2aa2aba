"""8-bit weights on the CPU, float32 out: int8 codes with one scale per group of 32 input
features (GGML's Q8_0 exactly), multiplied by tokenloom's kernel (``int8_linear``,
csrc/cpu_qlinear.cpp; every CPU kernel level) in GGML's Q8 x Q8 arithmetic: each row of
activations quantized to 8 bits per group of 32 (:func:`~tokenloom.kernels.int4_matmul.quantize_activations`,
as for the int4 layers), integer dot products, one float32 scale per group.

The LM head of a GGUF model whose token embedding is Q8_0 (SmolLM2's) computes its logits this
way at every batch size: it reads half the bytes of a 16-bit head and multiplies the file's
exact weight values (figures in docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenloom.kernels import cpu_native
from tokenloom.kernels.int4_matmul import NATIVE_DTYPES, interleave_block_pairs

GROUP_SIZE = 32
_BLOCK_ROWS = 16
# the kernel's codes are unsigned: a Q8_0 code plus this
_CODE_OFFSET = 128


@dataclass
class Int8Weight:
    """A ``[out_features, in_features]`` weight packed for the kernel: ``[out / 16, in / 32 * 576]``
    uint8 (see csrc/cpu_qlinear.cpp)."""

    packed: torch.Tensor
    out_features: int
    kernel: Any


def _kernel():
    ops = cpu_native.load()
    return getattr(ops, "int8_linear", None) if ops is not None else None


def pack_int8(codes: torch.Tensor, scales: torch.Tensor) -> Int8Weight | None:
    """``codes [N, K]`` (int8) and ``scales [N, K / 32]`` -> an :class:`Int8Weight`; None when
    the kernel is not built here or the shape does not suit it."""
    kernel = _kernel()
    out_features, in_features = codes.shape
    if (
        kernel is None
        or out_features % _BLOCK_ROWS
        or in_features % GROUP_SIZE
        or scales.shape != (out_features, in_features // GROUP_SIZE)
    ):
        return None
    blocks, groups = out_features // _BLOCK_ROWS, in_features // GROUP_SIZE
    unsigned = (codes.to(torch.int16) + _CODE_OFFSET).to(torch.uint8)
    # [block, lane, group, step, 4] -> [block, group, step, lane, 4]: per group 8 steps of 16 rows x 4 codes
    steps = unsigned.view(blocks, _BLOCK_ROWS, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(blocks, groups, -1)
    block_scales = scales.float().view(blocks, _BLOCK_ROWS, groups).transpose(1, 2).contiguous().view(torch.uint8)
    packed = interleave_block_pairs(torch.cat([steps, block_scales.reshape(blocks, groups, -1)], dim=2))
    return Int8Weight(packed=packed, out_features=out_features, kernel=kernel)


def int8_linear(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """``x [rows, K] @ W.T`` as float32."""
    if x.dtype not in NATIVE_DTYPES:  # the row dtypes the kernel takes, as for int4
        x = x.float()
    return weight.kernel(x if x.is_contiguous() else x.contiguous(), weight.packed)


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The dense float32 weight (the reference the kernel is tested against)."""
    out_features, in_features = codes.shape
    grouped = codes.float().view(out_features, -1, GROUP_SIZE) * scales.float().unsqueeze(-1)
    return grouped.view(out_features, in_features)
