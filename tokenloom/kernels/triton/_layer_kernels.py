"""The Triton programs of the layers' operators (launched by
:mod:`tokenloom.kernels.triton.layers`): RMSNorm with the residual add, rotary embedding in
place, gated activations, and the causal softmax of the torch attention path. Each row (a
token, or a row of scores) is one program; everything is computed in float32 and rounded once
where the torch reference rounds (see each launcher's docstring)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    output_ptr,
    residual_output_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    eps,
    num_features,
    stride_x,
    stride_residual,
    stride_output,
    stride_residual_output,
    HAS_RESIDUAL: tl.constexpr,
    GEMMA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    mask = columns < num_features
    x = tl.load(x_ptr + row * stride_x + columns, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + columns, mask=mask, other=0.0)
        # the sum is rounded to the activation dtype, as ``x + residual`` in torch is
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
        tl.store(residual_output_ptr + row * stride_residual_output + columns, x, mask=mask)
    x = x.to(tl.float32)
    inverse_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / num_features + eps)
    weight = tl.load(weight_ptr + columns, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        output = x * inverse_rms * (1.0 + weight)
    else:
        # Llama rounds the normalised value before the weight
        output = (x * inverse_rms).to(dtype).to(tl.float32) * weight
    tl.store(output_ptr + row * stride_output + columns, output.to(dtype), mask=mask)


@triton.jit
def rotary_kernel(
    x_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    num_heads,
    max_position,
    stride_token,
    stride_head,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    # a position outside the table leaves the token as it is (the runner never makes one)
    if (position >= 0) & (position < max_position):
        heads = tl.arange(0, BLOCK_H)
        half = tl.arange(0, BLOCK_HALF)
        half_mask = half < HALF
        cos = tl.load(cos_ptr + position * HALF + half, mask=half_mask, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + position * HALF + half, mask=half_mask, other=0.0).to(tl.float32)
        mask = (heads[:, None] < num_heads) & half_mask[None, :]
        first = x_ptr + token * stride_token + heads[:, None] * stride_head + half[None, :]
        x1 = tl.load(first, mask=mask, other=0.0)
        x2 = tl.load(first + HALF, mask=mask, other=0.0)
        dtype = x1.dtype
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        tl.store(first, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
        tl.store(first + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)


@triton.jit
def act_and_mul_kernel(
    output_ptr,
    x_ptr,
    half_width,
    stride_x,
    stride_output,
    ACTIVATION: tl.constexpr,  # 0 silu, 1 gelu (erf), 2 gelu (tanh)
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < half_width
    gate = tl.load(x_ptr + row * stride_x + columns, mask=mask, other=0.0)
    dtype = gate.dtype
    gate = gate.to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + half_width + columns, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 0:
        activated = gate * tl.sigmoid(gate)
    elif ACTIVATION == 1:
        activated = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    else:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        activated = 0.5 * gate * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    # torch rounds the activation before the product
    output = activated.to(dtype).to(tl.float32) * up
    tl.store(output_ptr + row * stride_output + columns, output.to(dtype), mask=mask)


@triton.jit
def causal_softmax_kernel(
    scores_ptr,
    scale,
    num_keys,
    BLOCK: tl.constexpr,
):
    """Row ``r`` of each ``[T, T]`` matrix: the softmax of its first ``r + 1`` scaled scores
    in float32, zeros after them, in place."""
    row = tl.program_id(0).to(tl.int64)
    visible = row % num_keys + 1
    columns = tl.arange(0, BLOCK)
    pointer = scores_ptr + row * num_keys + columns
    scores = tl.load(pointer, mask=columns < num_keys, other=0.0)
    dtype = scores.dtype
    scores = tl.where(columns < visible, scores.to(tl.float32) * scale, float("-inf"))
    exponentials = tl.exp(scores - tl.max(scores, axis=0))
    tl.store(pointer, (exponentials / tl.sum(exponentials, axis=0)).to(dtype), mask=columns < num_keys)
