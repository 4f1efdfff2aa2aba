"""Weight-only int8 matmul on the CPU for a few rows, float32 out: weights as int8 codes with
one float32 scale per group of 32 input features (GGML's Q8_0 exactly), multiplied by
tokenloom's kernel (``tokenloom_cpu::int8_linear``, csrc/cpu_int8.cpp; CPUs with AVX-512).

The LM head of a GGUF model whose token embedding is Q8_0 (SmolLM2's) keeps it this way for
decode steps: a step reads half the bytes of the bfloat16 head, and the logits come from the
file's exact values rather than their bfloat16 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenloom.kernels import cpu_native

GROUP_SIZE = 32
MAX_ROWS = 4  # the kernel's limit; the dense head is as fast from a few rows on
_BLOCK_ROWS = 8


@dataclass
class Int8Weight:
    """A ``[out_features, in_features]`` weight packed for the kernel (see csrc/cpu_int8.cpp)."""

    codes: torch.Tensor  # [out / 8, groups, 8, 32] int8, as [out, in]
    scales: torch.Tensor  # [out / 8, groups, 8] float32, as [out, groups]
    kernel: Any

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]


def _kernel():
    ops = cpu_native.load()
    return getattr(ops, "int8_linear", None) if ops is not None else None


def pack_int8(codes: torch.Tensor, scales: torch.Tensor) -> Int8Weight | None:
    """``codes [N, K]`` (int8) and ``scales [N, K / 32]`` -> an :class:`Int8Weight`; None when
    the kernel is not built here or the shape does not suit it."""
    kernel = _kernel()
    out_features, in_features = codes.shape
    if kernel is None or out_features % _BLOCK_ROWS or in_features % GROUP_SIZE \
            or scales.shape != (out_features, in_features // GROUP_SIZE):
        return None
    groups = in_features // GROUP_SIZE
    blocked = codes.to(torch.int8).view(out_features // _BLOCK_ROWS, _BLOCK_ROWS, groups, GROUP_SIZE)
    packed_scales = scales.float().view(out_features // _BLOCK_ROWS, _BLOCK_ROWS, groups)
    return Int8Weight(codes=blocked.transpose(1, 2).reshape(out_features, in_features).contiguous(),
                      scales=packed_scales.transpose(1, 2).reshape(out_features, groups).contiguous(),
                      kernel=kernel)


def int8_linear(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """``x [rows, K] @ W.T`` as float32, for up to ``MAX_ROWS`` rows."""
    return weight.kernel(x.float().contiguous(), weight.codes, weight.scales)


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The dense float32 weight (the reference the kernel is tested against)."""
    out_features, in_features = codes.shape
    grouped = codes.float().view(out_features, -1, GROUP_SIZE) * scales.float().unsqueeze(-1)
    return grouped.view(out_features, in_features)
