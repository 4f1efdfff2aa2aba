"""The Triton program of the GGUF dequantize-matmul (launched by
:mod:`tokenloom.kernels.triton.gguf`): ``out = x @ dequantize(W).T`` reading ``W``'s ggml
blocks as stored, so a quantized weight stays 4.5 to 8.5 bits a value in device memory.

Block layouts (32 values each; ``d``, ``m`` little-endian float16):
Q4_0 ``d, qs[16]``: value ``j`` is the low nibble of ``qs[j % 16]`` for ``j < 16``, the high
nibble for ``j >= 16``, times ``d`` after subtracting 8; Q4_1 ``d, m, qs[16]``: ``q * d + m``;
Q8_0 ``d, qs[32]`` int8: ``q * d``.
"""

from __future__ import annotations

import triton
import triton.language as tl

Q4_0, Q4_1, Q8_0 = 2, 3, 8


@triton.jit
def _float16_at(row_pointers, mask):
    """The little-endian float16 at each row's pointer, as float32."""
    low = tl.load(row_pointers, mask=mask, other=0).to(tl.uint16)
    high = tl.load(row_pointers + 1, mask=mask, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def gguf_matmul_kernel(
    output_ptr,
    x_ptr,
    weight_ptr,
    num_rows,
    num_outputs,
    num_inputs,
    stride_x,
    stride_output,
    stride_weight_row,
    GGML_TYPE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (BLOCK_M rows of x, BLOCK_N output features); each step of the loop
    dequantizes one ggml block (32 inputs) of each of the BLOCK_N weight rows in registers and
    multiplies it in float32."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    outputs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    output_mask = outputs < num_outputs
    values = tl.arange(0, 32)
    accumulator = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    weight_rows = weight_ptr + outputs.to(tl.int64) * stride_weight_row
    for block in range(0, num_inputs // 32):
        block_start = weight_rows + block * BLOCK_BYTES  # [BLOCK_N] pointers
        scale = _float16_at(block_start, output_mask)
        if GGML_TYPE == 8:
            codes = tl.load(block_start[:, None] + 2 + values[None, :], mask=output_mask[:, None], other=0)
            weights = codes.to(tl.int8, bitcast=True).to(tl.float32) * scale[:, None]
        else:
            quants_offset = 2 if GGML_TYPE == 2 else 4
            packed = tl.load(
                block_start[:, None] + quants_offset + (values[None, :] % 16), mask=output_mask[:, None], other=0
            )
            nibbles = ((packed >> ((values[None, :] // 16) * 4).to(tl.uint8)) & 0xF).to(tl.float32)
            if GGML_TYPE == 2:
                weights = (nibbles - 8.0) * scale[:, None]
            else:
                weights = nibbles * scale[:, None] + _float16_at(block_start + 2, output_mask)[:, None]
        inputs = tl.load(
            x_ptr + rows.to(tl.int64)[:, None] * stride_x + block * 32 + values[None, :],
            mask=row_mask[:, None],
            other=0.0,
        ).to(tl.float32)
        accumulator += tl.dot(inputs, tl.trans(weights), input_precision=DOT_PRECISION)
    tl.store(
        output_ptr + rows.to(tl.int64)[:, None] * stride_output + outputs[None, :],
        accumulator.to(output_ptr.dtype.element_ty),
        mask=row_mask[:, None] & output_mask[None, :],
    )
