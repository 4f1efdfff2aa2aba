"""W8A8 int8 on the CPU: int8 weights with one scale per output channel times activations
quantized to int8 per token (one symmetric scale per row), by tokenloom's kernel ``w8a8_linear``
(csrc/cpu_w8a8.cpp; every CPU kernel level, AMX-INT8 for many rows where the CPU has it): the
arithmetic of a compressed-tensors ``int-quantized`` W8A8 checkpoint (vLLM's
``scaled_int8_quant`` then an int8 GEMM), int32 sums over the whole row, one float multiply per
output.

:func:`pack_w8a8` lays the weight out for the kernel once, at load; :func:`quantize_tokens` and
:func:`reference_w8a8` are the torch reference the tests hold the kernel to. Where the kernel is
not built the layer keeps its codes and takes its own torch path (see the compressed-tensors
plugin). ``TOKENLOOM_CPU_AMX=0`` keeps the kernel off AMX (the path an AVX-512 CPU without AMX
takes), for tests and A/B measurements.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from tokenloom.kernels import cpu_native

BLOCK_ROWS = 16  # output channels per block of the layout
K_ALIGN = 64  # in_features padded to this (one AMX tile row)
N_ALIGN = 32  # out_features padded to this (two blocks: an AMX tile pair)
# rows from which the kernel takes AMX where the CPU has it: from 8 rows AMX was ahead on every
# shape measured (SmolLM2-135M's and 2048x8192), at 1 to 4 rows level or behind (an A tile of 16
# rows mostly padding; the layer is a weight stream either way). Figures in docs/design.md.
AMX_MIN_ROWS = 8
ENV_AMX = "TOKENLOOM_CPU_AMX"
_INVERSE_127 = torch.tensor(1 / 127, dtype=torch.float32)


@dataclass
class W8A8Weight:
    """A ``[out_features, in_features]`` int8 weight packed for the kernel: ``packed``
    ``[N' / 16, K' * 16]`` uint8 (N' and K' padded to multiples of 32 and 64, see
    csrc/cpu_w8a8.cpp), ``weight_sums`` ``[N']`` int32 (each channel's sum of codes) and
    ``channel_scales`` ``[N']`` float32."""

    packed: torch.Tensor
    weight_sums: torch.Tensor
    channel_scales: torch.Tensor
    out_features: int
    in_features: int
    kernel: Any


def _ops():
    return cpu_native.load()


def amx_min_rows() -> int:
    """The row count from which the kernel takes AMX (0: never, under ``TOKENLOOM_CPU_AMX=0``)."""
    return 0 if os.environ.get(ENV_AMX, "1").strip().lower() in ("0", "false", "no", "off") else AMX_MIN_ROWS


def amx_available() -> bool:
    """Whether the selected kernel level can take its AMX-INT8 path here (the avx512 level on a
    CPU with AMX-INT8, the tile registers granted to the process)."""
    ops = _ops()
    return ops is not None and hasattr(ops, "w8a8_amx_available") and bool(ops.w8a8_amx_available())


def pack_w8a8(codes: torch.Tensor, channel_scales: torch.Tensor) -> W8A8Weight | None:
    """``codes [N, K]`` int8 and ``channel_scales`` (``N`` values) -> a :class:`W8A8Weight`;
    None when the kernel is not built here."""
    ops = _ops()
    kernel = getattr(ops, "w8a8_linear", None) if ops is not None else None
    if kernel is None:
        return None
    if codes.dtype != torch.int8:
        raise ValueError(f"W8A8 weight codes must be int8, not {codes.dtype}")
    out_features, in_features = codes.shape
    padded_out = -(-out_features // N_ALIGN) * N_ALIGN
    padded_in = -(-in_features // K_ALIGN) * K_ALIGN
    padded = torch.zeros(padded_out, padded_in, dtype=torch.int8)
    padded[:out_features, :in_features] = codes
    blocks = padded_out // BLOCK_ROWS
    # [block, channel, step, 4] -> [block, step, channel, 4]: a step is 16 channels x 4 features
    packed = padded.view(blocks, BLOCK_ROWS, padded_in // 4, 4).transpose(1, 2).contiguous()
    scales = torch.zeros(padded_out, dtype=torch.float32)
    scales[:out_features] = channel_scales.float().reshape(-1)
    return W8A8Weight(
        packed=packed.view(torch.uint8).view(blocks, padded_in * BLOCK_ROWS),
        weight_sums=padded.sum(dim=1, dtype=torch.int32),
        channel_scales=scales,
        out_features=out_features,
        in_features=in_features,
        kernel=kernel,
    )


def w8a8_linear(
    x: torch.Tensor,
    weight: W8A8Weight,
    bias: torch.Tensor | None = None,
    *,
    float_out: bool = False,
    amx_rows: int | None = None,
) -> torch.Tensor:
    """``x [rows, K] @ W.T + bias`` in ``x``'s dtype (bfloat16 or float32; other dtypes are
    computed from float32), or float32 with ``float_out``. ``amx_rows`` overrides the row count
    from which AMX is taken (0: never; tests and benchmarks)."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    return weight.kernel(
        x if x.is_contiguous() else x.contiguous(),
        weight.packed,
        weight.weight_sums,
        weight.channel_scales,
        bias,
        weight.out_features,
        float_out,
        amx_min_rows() if amx_rows is None else amx_rows,
    )


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [M, K]`` as the kernel quantizes them: ``(codes [M, K]`` int8, ``scales [M]``
    float32): per row ``scale = max|x| * float32(1/127)`` and ``codes = round(x * (127 /
    max|x|))`` to nearest even, in float32 (zeros for a zero row)."""
    rows = x.float()
    amax = rows.abs().amax(dim=1, keepdim=True)
    # (a tensor over a tensor: ``127 / amax`` would be torch's reciprocal times 127, rounded twice)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(rows * inverse).clamp(-127, 127).to(torch.int8)
    return codes, (amax * _INVERSE_127).squeeze(1)


def integer_sums(x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The exact int32 sums the kernel accumulates: ``quantize_tokens(x)`` codes times ``codes.T``."""
    token_codes, _ = quantize_tokens(x)
    return (token_codes.long() @ codes.long().T).to(torch.int32)


def reference_w8a8(
    x: torch.Tensor, codes: torch.Tensor, channel_scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What the kernel computes, in float32: ``float(int32 sums) * (channel_scale * token_scale)
    + bias``."""
    _, token_scales = quantize_tokens(x)
    scales = channel_scales.float().reshape(1, -1) * token_scales.reshape(-1, 1)
    out = integer_sums(x, codes).float() * scales
    return out if bias is None else out + bias.float()
