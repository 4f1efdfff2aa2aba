"""4-bit weight matmul on the CPU: weights stored as 4-bit codes with one affine pair per group
of input features, multiplied without ever materialising the dense weight.

- tokenloom's own kernel (``int4_linear`` of :mod:`tokenloom.kernels.cpu_native`'s operators,
  csrc/cpu_qlinear.cpp; every CPU kernel level: AVX512-VNNI, AVX2, plain C++), where the weight
  has groups of 32: GGML's Q4 x Q8 arithmetic, as llama.cpp runs a 4-bit GGUF on the CPU. Each
  row of activations is quantized to 8 bits per group of 32 (:func:`quantize_activations`), and
  the dot products of codes are summed exactly in integers. Faster than the dense matmul at
  every batch size (docs/design.md has the figures per level), so a layer holding such a weight
  needs no dense copy at all.
- for a prompt's rows, where the avx512 build runs on a CPU with AMX-BF16
  (:func:`bf16_amx_available`), :func:`int4_linear_bf16` on the same packed buffer: each block
  pair dequantized to a bfloat16 panel once per block of rows, bfloat16 rows, float32 sums over
  all of K (csrc/cpu_amx_bf16.h); about 2x :func:`int4_linear` from 256 rows, slower below ~32.
  Which rows take it is the caller's choice, by row role (never by batch size).
- else (kernels switched off or not built) torch's weight-only kernel (``aten._weight_int4pack_mm_for_cpu``, 16-bit activations), which
  beats the dense matmul only for a few rows: layers keep both and choose per call
  (:func:`prefers_int4`).

A weight value is ``(code - 8) * scale + zero`` with ``code`` in ``0..15``: the convention of
torch's kernel, which covers ggml's Q4_0, Q4_1 and Q4_K blocks exactly (their per-group scale
and minimum map onto ``scale`` and ``zero``). tokenloom's kernel stores ``scale`` and
``zero - 8 * scale`` (ggml's d and m) as float16, which is exact for Q4_0 and Q4_1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenloom.kernels import cpu_native

CODE_OFFSET = 8

# the packing kernels want output features in multiples of 16
_ROW_MULTIPLE = 16

# torch's kernel, per activation dtype: batches up to this many rows run the int4 kernel, larger
# ones the dense matmul (where each is faster: measured, docs/design.md "Compute on the CPU")
INT4_MAX_ROWS = {torch.bfloat16: 8, torch.float16: 8, torch.float32: 16}

# the activation dtypes torch's kernel is fast for (a weight packed for one of them)
INT4_DTYPES = (torch.bfloat16, torch.float16)

# tokenloom's kernel: groups of this many features; the row dtypes it takes as they are (others
# are widened to float32 on the way in)
NATIVE_GROUP_SIZE = 32
NATIVE_DTYPES = (torch.bfloat16, torch.float32)
# its layout per block of 16 output rows and group: 16 x 32 codes in nibbles, then 16 d and 16 m
_NATIVE_GROUP_BYTES = 16 * NATIVE_GROUP_SIZE // 2 + 2 * 16 * 2

# activations are quantized to 8 bits per group of this many features
ACTIVATION_GROUP_SIZE = 32
_INVERSE_127 = torch.tensor(1 / 127, dtype=torch.float32)


@dataclass
class Int4Weight:
    """A ``[out_features, in_features]`` weight packed for one of the CPU kernels."""

    # tokenloom's kernel: [out_features / 16, in_features / 32 * 320] uint8 (csrc/cpu_qlinear.cpp);
    # torch's: [out_features, in_features / 2] uint8 in its layout
    packed: torch.Tensor
    out_features: int
    group_size: int
    # torch's kernel: the activation dtype it runs in, and [in_features / group_size, out_features, 2]
    # (scale, zero) of that dtype
    dtype: torch.dtype
    scales_and_zeros: torch.Tensor | None = None
    kernel: Any = None  # tokenloom's kernel when packed for it


def can_pack(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether the kernel takes a weight of this shape and grouping."""
    return (
        out_features % _ROW_MULTIPLE == 0 and group_size > 0 and in_features % group_size == 0 and group_size % 2 == 0
    )


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> Int4Weight:
    """``codes [N, K]`` (integers 0..15), ``scales``/``zeros [N, K / group_size]`` -> an
    :class:`Int4Weight` whose matmul takes activations of ``dtype``: packed for tokenloom's
    kernel when it is built and takes the grouping, else for torch's."""
    out_features, in_features = codes.shape
    group_size = in_features // scales.shape[1]
    if (
        scales.shape != zeros.shape
        or scales.shape[0] != out_features
        or not can_pack(out_features, in_features, group_size)
    ):
        raise ValueError(
            f"cannot pack a {tuple(codes.shape)} int4 weight with {tuple(scales.shape)} group scales: out features "
            f"must be a multiple of {_ROW_MULTIPLE} and in features a multiple of an even group size"
        )
    kernel = _native_kernel()
    if kernel is not None and group_size == NATIVE_GROUP_SIZE:
        return Int4Weight(
            packed=_pack_native(codes, scales.float(), zeros.float()),
            out_features=out_features,
            group_size=group_size,
            dtype=dtype,
            kernel=kernel,
        )
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return Int4Weight(
        packed=packed, out_features=out_features, group_size=group_size, dtype=dtype, scales_and_zeros=scales_and_zeros
    )


def _pack_native(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The layout of csrc/cpu_qlinear.cpp: per block of 16 rows and group of 32 features, 4 steps of
    [16 rows, 4 bytes] whose byte j of step t holds features 8t+j (low nibble) and 8t+4+j (high),
    then the 16 rows' d and m as float16."""
    rows, features = codes.shape
    blocks, groups = rows // 16, features // NATIVE_GROUP_SIZE
    # [block, lane, group, step, half, j] -> [block, group, step, lane, j]
    nibbles = codes.to(torch.uint8).view(blocks, 16, groups, 4, 2, 4)
    code_bytes = (nibbles[..., 0, :] | (nibbles[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)
    d_and_m = torch.stack([scales, zeros - CODE_OFFSET * scales]).to(torch.float16)  # [2, rows, groups]
    d_and_m = d_and_m.view(2, blocks, 16, groups).permute(1, 3, 0, 2).contiguous().view(torch.uint8)
    packed = torch.cat([code_bytes.reshape(blocks, groups, -1), d_and_m.reshape(blocks, groups, -1)], dim=2)
    return interleave_block_pairs(packed)


def interleave_block_pairs(blocks: torch.Tensor) -> torch.Tensor:
    """``[blocks, groups, group_bytes]`` -> the kernels' ``[blocks, groups * group_bytes]`` buffer,
    blocks stored in pairs group by group (``[pair, groups, 2, group_bytes]``; an odd last block
    alone), so a tile of two blocks reads one stream."""
    count, groups, group_bytes = blocks.shape
    paired = blocks[: count - count % 2].view(count // 2, 2, groups, group_bytes).transpose(1, 2)
    return torch.cat([paired.reshape(-1), blocks[count - count % 2 :].reshape(-1)]).view(count, -1)


def _native_kernel():
    """The selected kernel level's ``int4_linear`` (every level has one), else None: kernels
    switched off, or not built here."""
    ops = cpu_native.load()
    return getattr(ops, "int4_linear", None) if ops is not None else None


def int4_linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W.T + bias`` with ``W`` the int4 weight; the result has ``x``'s dtype.
    (Called per layer per decode step: every torch call it saves is a microsecond of the step.)"""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if weight.kernel is not None:
        if rows.dtype not in NATIVE_DTYPES:
            rows = rows.float()
        out = weight.kernel(rows if rows.is_contiguous() else rows.contiguous(), weight.packed)
    else:
        if rows.dtype != weight.dtype:
            rows = rows.to(weight.dtype)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows if rows.is_contiguous() else rows.contiguous(),
            weight.packed,
            weight.group_size,
            weight.scales_and_zeros,
        )
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.out_features)


def finish_float_out(
    out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype | None, out_features: int
) -> torch.Tensor:
    """A kernel's float32 ``[rows, N]`` product of ``x``'s rows, plus ``bias``, rounded once to
    ``dtype`` (default ``x``'s), in ``x``'s leading shape."""
    if bias is not None:
        out = out + bias
    dtype = x.dtype if dtype is None else dtype
    if out.dtype != dtype:
        out = out.to(dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


def bf16_amx_available() -> bool:
    """Whether the AMX-BF16 prompt-path kernels (:func:`int4_linear_bf16`,
    :func:`tokenloom.kernels.kquant_matmul.kquant_linear_bf16`) run in this process now: the
    selected kernel level is the avx512 build, the CPU has AMX-BF16 and AVX512-BF16 (and Linux
    grants the tile registers), and ``TOKENLOOM_CPU_AMX`` does not switch AMX off (read at each
    call, as the kernels read it). False at the avx2 and generic levels."""
    ops = cpu_native.load()
    return ops is not None and hasattr(ops, "bf16_amx_available") and bool(ops.bf16_amx_available())


def int4_linear_bf16(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W.T + bias`` for many rows (a prompt's) through AMX-BF16 (csrc/cpu_amx_bf16.h):
    each weight value ``bf16(d * code + m)`` of the buffer :func:`int4_linear` reads (no copy),
    the rows in bfloat16 (others are rounded to it on the way in), float32 sums over all of ``K``,
    rounded once to bfloat16; the result has ``x``'s dtype. A row's bits do not depend on the other
    rows of the call. Only where :func:`bf16_amx_available` (else a RuntimeError), for a weight
    packed for tokenloom's kernel (``weight.kernel`` set)."""
    if weight.kernel is None:
        raise ValueError("int4_linear_bf16 takes a weight packed for tokenloom's kernel (groups of 32)")
    ops = cpu_native.load()
    if ops is None:
        raise RuntimeError("int4_linear_bf16: tokenloom's CPU kernels are switched off or did not build")
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.dtype != torch.bfloat16:
        rows = rows.to(torch.bfloat16)
    out = ops.int4_linear_bf16(rows if rows.is_contiguous() else rows.contiguous(), weight.packed)
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.out_features)


def prefers_int4(x: torch.Tensor, weight: Int4Weight) -> bool:
    """Whether a batch of these activations runs faster on the int4 kernel than dense (always on
    tokenloom's kernel)."""
    return weight.kernel is not None or x.numel() <= INT4_MAX_ROWS.get(x.dtype, 0) * x.shape[-1]


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The dense float32 weight the codes stand for (the reference the kernel is tested against)."""
    out_features, in_features = codes.shape
    groups = scales.shape[1]
    grouped = (codes.float() - CODE_OFFSET).view(out_features, groups, in_features // groups)
    return (grouped * scales.float().unsqueeze(-1) + zeros.float().unsqueeze(-1)).view(out_features, in_features)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [M, K]`` as tokenloom's kernel quantizes them: ``(codes [M, K]`` float32 integers
    in -127..127, ``scales [M, K / 32])``, per group of 32 ``scale = max|x| / 127`` and ``codes =
    round(x * (127 / max|x|))`` to nearest even (zeros for a zero group), in float32. The
    reference the kernel is tested against; ``codes * scale`` is the value the kernel multiplies."""
    rows, features = x.shape
    groups = x.float().view(rows, features // ACTIVATION_GROUP_SIZE, ACTIVATION_GROUP_SIZE)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    # (a tensor over a tensor: ``127 / amax`` would be torch's reciprocal times 127, rounded twice)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(groups * inverse).view(rows, features)
    return codes, (amax * _INVERSE_127).squeeze(-1)
