"""GGUF Q4_0 / Q4_1 / Q8_0 weights multiplied as stored, by a Triton kernel
(:mod:`tokenloom.kernels.triton._gguf_kernels`). The torch reference is
:func:`tokenloom.builtin_plugins.quantization.gguf_blocks.dequantize_blocks` followed by a
dense matmul."""

from __future__ import annotations

import torch

from tokenloom.errors import ConfigError
from tokenloom.kernels import triton as triton_kernels

# ggml type id -> bytes per block of 32 values
BLOCK_BYTES = {2: 18, 3: 20, 8: 34}
SUPPORTED = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}


def runs_on(weight: torch.Tensor) -> bool:
    """True when a layer whose (dense, not yet loaded) weight is ``weight`` should keep GGUF
    blocks for :func:`gguf_matmul`: it lives on a GPU and triton is installed."""
    import importlib.util

    return weight.device.type == "cuda" and importlib.util.find_spec("triton") is not None


def gguf_matmul(
    x: torch.Tensor,
    weight_blocks: torch.Tensor,
    ggml_type: int,
    num_outputs: int,
    bias: torch.Tensor | None = None,
    *,
    block_m: int = 16,
    block_n: int = 32,
) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias)`` -> ``[..., N]`` in x's dtype, where ``weight_blocks`` is
    ``W`` as stored in the GGUF file: ``[N, K / 32 * block_bytes]`` uint8, rows of whole
    blocks. ``block_m``/``block_n`` (at least 16: ``tl.dot``'s minimum) tile the output."""
    if ggml_type not in BLOCK_BYTES:
        raise ConfigError(
            f"the Triton GGUF matmul multiplies {', '.join(SUPPORTED.values())} blocks, not GGML type {ggml_type}"
        )
    num_inputs = x.shape[-1]
    block_bytes = BLOCK_BYTES[ggml_type]
    if num_inputs % 32 or tuple(weight_blocks.shape) != (num_outputs, num_inputs // 32 * block_bytes):
        raise ConfigError(
            f"GGUF {SUPPORTED[ggml_type]} weight of shape {tuple(weight_blocks.shape)} does not hold "
            f"{num_outputs} rows of {num_inputs} inputs in blocks of 32"
        )
    if weight_blocks.dtype != torch.uint8 or weight_blocks.stride(-1) != 1:
        raise ConfigError("GGUF weight blocks must be uint8 rows with contiguous bytes")
    rows = x.reshape(-1, num_inputs)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    output = torch.empty((rows.shape[0], num_outputs), dtype=x.dtype, device=x.device)
    if rows.shape[0] and num_outputs:
        kernels = triton_kernels.import_kernels("_gguf_kernels")
        grid = (-(-rows.shape[0] // block_m), -(-num_outputs // block_n))
        kernels.gguf_matmul_kernel[grid](
            output,
            rows,
            weight_blocks,
            rows.shape[0],
            num_outputs,
            num_inputs,
            rows.stride(0),
            output.stride(0),
            weight_blocks.stride(0),
            GGML_TYPE=ggml_type,
            BLOCK_BYTES=block_bytes,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        )
    if bias is not None:
        output += bias
    return output.view(*x.shape[:-1], num_outputs)
