"""8-bit weights times float activations on the CPU, float32 out: float8_e4m3fn or int8 codes with
one float32 scale per output channel or per group of input features, multiplied by tokenloom's
kernel (``w8a16_linear``, csrc/cpu_w8a16.cpp; every CPU kernel level), which reads one byte per
weight and widens the codes to float32 in registers (no dense copy of the weight is made).

The activations are not quantized: they stay in float32 (bfloat16 rows widened), finer than an
8-bit activation a W8A8 checkpoint was calibrated for. :func:`dequantize_w8` is the dense float32
weight the tests hold the kernel to. Where the kernel is not built, :func:`w8a16_linear`
dequantizes the codes at every call (slow, and still no dense weight kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenloom.kernels import cpu_native

BLOCK_ROWS = 16
CODE_DTYPES = (torch.float8_e4m3fn, torch.int8)


@dataclass
class W8Weight:
    """A ``[out_features, in_features]`` weight of 8-bit codes: ``codes`` as the kernel reads them
    (``[out / 16, in, 16]`` uint8, see csrc/cpu_w8a16.cpp) and ``scales`` ``[out / 16, groups, 16]``
    float32; without the kernel (``kernel`` None) ``codes`` ``[out, in]`` in their own dtype and
    ``scales`` ``[out, groups]``."""

    codes: torch.Tensor
    scales: torch.Tensor
    fp8: bool
    out_features: int
    kernel: Any


def _kernel():
    ops = cpu_native.load()
    return getattr(ops, "w8a16_linear", None) if ops is not None else None


def can_pack(out_features: int, in_features: int, groups: int) -> bool:
    """Whether the kernel's layout holds a weight of this shape with ``groups`` scale groups."""
    return (
        out_features % BLOCK_ROWS == 0 and groups > 0 and in_features % groups == 0 and (in_features // groups) % 4 == 0
    )


def pack_w8(codes: torch.Tensor, scales: torch.Tensor) -> W8Weight:
    """``codes [N, K]`` (float8_e4m3fn or int8) and ``scales [N, groups]`` (groups of K / groups
    input features; 1: per output channel) -> a :class:`W8Weight` for :func:`w8a16_linear`."""
    if codes.dtype not in CODE_DTYPES:
        raise ValueError(f"8-bit codes must be float8_e4m3fn or int8, not {codes.dtype}")
    out_features, in_features = codes.shape
    scales = scales.float().reshape(out_features, -1)
    if not can_pack(out_features, in_features, scales.shape[1]):
        raise ValueError(
            f"a [{out_features}, {in_features}] weight with {scales.shape[1]} scale groups does not fit the 8-bit "
            "kernel (output features in multiples of 16, groups of a multiple of 4 input features)"
        )
    fp8, kernel = codes.dtype == torch.float8_e4m3fn, _kernel()
    if kernel is None:
        return W8Weight(codes.contiguous(), scales.contiguous(), fp8, out_features, None)
    blocks = out_features // BLOCK_ROWS
    packed = codes.view(torch.uint8).view(blocks, BLOCK_ROWS, in_features).transpose(1, 2).contiguous()
    block_scales = scales.view(blocks, BLOCK_ROWS, -1).transpose(1, 2).contiguous()
    return W8Weight(packed, block_scales, fp8, out_features, kernel)


def w8a16_linear(x: torch.Tensor, weight: W8Weight) -> torch.Tensor:
    """``x [rows, K] @ W.T`` as float32."""
    if weight.kernel is None:
        return x.float() @ dequantize_w8(weight.codes, weight.scales).T
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    return weight.kernel(x if x.is_contiguous() else x.contiguous(), weight.codes, weight.scales, weight.fp8)


def dequantize_w8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The dense float32 weight of ``codes [N, K]`` and ``scales [N, groups]`` (the reference)."""
    out_features, in_features = codes.shape
    grouped = codes.float().view(out_features, scales.shape[1], -1) * scales.float().unsqueeze(-1)
    return grouped.view(out_features, in_features)
