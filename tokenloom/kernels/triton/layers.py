"""The layers' operators as Triton kernels, with the signatures of tokenloom's CPU operators
(:mod:`tokenloom.kernels.cpu_native`): ``ops_for`` hands this module to RMSNorm, rotary
embedding, the gated activations and the torch attention path when their tensors are on a GPU.
Their torch references are the layers' own torch code (``layers/layernorm.py``,
``layers/rotary.py``, ``layers/activation.py``)."""

from __future__ import annotations

import torch

from tokenloom.errors import ConfigError
from tokenloom.kernels import triton as triton_kernels

_ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


def _kernels():
    return triton_kernels.import_kernels("_layer_kernels")


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, int(value) - 1).bit_length()


def _check_rows(tensor: torch.Tensor, name: str) -> None:
    if tensor.dim() != 2 or tensor.stride(-1) != 1:
        raise ConfigError(f"{name} must be a [rows, features] tensor with contiguous features")


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)`` (without ``residual``: ``(norm(x), x)``) of a
    ``[rows, features]`` ``x``: Llama's ``weight * round(x / rms)`` or Gemma's
    ``round(x / rms * (1 + weight))``, the sum rounded to x's dtype first."""
    _check_rows(x, "x")
    if residual is not None:
        _check_rows(residual, "residual")
    num_rows, num_features = x.shape
    output = torch.empty_like(x)
    residual_output = torch.empty_like(x) if residual is not None else x
    if num_rows:
        _kernels().rms_norm_kernel[(num_rows,)](
            output,
            residual_output,
            x,
            residual if residual is not None else x,
            weight,
            float(eps),
            num_features,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            output.stride(0),
            residual_output.stride(0),
            HAS_RESIDUAL=residual is not None,
            GEMMA=bool(gemma),
            BLOCK=_next_power_of_two(num_features),
        )
    return output, residual_output


def rotary_embedding_(
    x: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor
) -> None:
    """Rotates ``x [tokens, heads, head_size]`` (any token and head strides) in place to
    ``positions``, rotate-half layout over its first ``2 * cos_cache.shape[1]`` features."""
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ConfigError("x must be [tokens, heads, head_size] with contiguous features")
    num_tokens, num_heads, _ = x.shape
    half = cos_cache.shape[1]
    if num_tokens:
        _kernels().rotary_kernel[(num_tokens,)](
            x,
            positions,
            cos_cache.contiguous(),
            sin_cache.contiguous(),
            num_heads,
            cos_cache.shape[0],
            x.stride(0),
            x.stride(1),
            HALF=half,
            BLOCK_H=_next_power_of_two(num_heads),
            BLOCK_HALF=_next_power_of_two(half),
        )


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(x[:, :d]) * x[:, d:]`` for ``activation`` silu, gelu (erf) or gelu_tanh."""
    _check_rows(x, "x")
    if activation not in _ACTIVATIONS:
        raise ConfigError(f"unknown gated activation {activation!r}; known: {', '.join(_ACTIVATIONS)}")
    num_rows, width = x.shape
    half_width = width // 2
    output = torch.empty((num_rows, half_width), dtype=x.dtype, device=x.device)
    block = min(1024, _next_power_of_two(half_width))
    if num_rows and half_width:
        _kernels().act_and_mul_kernel[(num_rows, -(-half_width // block))](
            output, x, half_width, x.stride(0), output.stride(0), ACTIVATION=_ACTIVATIONS[activation], BLOCK=block
        )
    return output


def causal_softmax_(scores: torch.Tensor, scale: float) -> None:
    """In place over contiguous ``[matrices, T, T]`` scores: row ``r`` becomes the softmax of
    its first ``r + 1`` scores times ``scale`` (float32 inside), zeros after them."""
    if scores.dim() != 3 or scores.shape[1] != scores.shape[2] or not scores.is_contiguous():
        raise ConfigError("scores must be a contiguous [matrices, T, T] tensor")
    num_keys = scores.shape[2]
    if scores.numel():
        _kernels().causal_softmax_kernel[(scores.shape[0] * num_keys,)](
            scores, float(scale), num_keys, BLOCK=_next_power_of_two(num_keys)
        )
