"""RMSNorm, Llama's and Gemma's ``(1 + weight)`` variant, each optionally fusing the residual
add that precedes it: ``norm(x, residual) -> (normed(x + residual), x + residual)``.

The normalisation runs in float32 whatever the activation dtype, as in transformers: the
variants differ in where they round back (Llama before the weight, Gemma after it). On the CPU a
``[tokens, features]`` input takes one fused operator (``rms_norm`` of tokenloom's CPU
operators, same roundings) instead of the chain of torch operators below, which stays the
reference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenloom.errors import ModelLoadError
from tokenloom.kernels.cpu_native import ops_for
from tokenloom.layers.quantization import materialize


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` (weights initialised to one)."""

    #: the fused operator's variant: weight applied after rounding (Llama) or ``(1 + weight)`` in float32 (Gemma)
    fused_gemma_variant = False

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, params_dtype: torch.dtype | None = None):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(
            torch.full((hidden_size,), self._initial_weight(), dtype=params_dtype or torch.get_default_dtype()),
            requires_grad=False,
        )

    @staticmethod
    def _initial_weight() -> float:
        return 1.0

    def _normalized(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def _scaled(self, normalized: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.weight * normalized.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``."""
        ops = ops_for(x) if x.dim() == 2 and x.stride(-1) == 1 and x.dtype == self.weight.dtype else None
        if ops is not None and (residual is None or residual.stride(-1) == 1):
            normed, summed = ops.rms_norm(x, residual, self.weight, self.eps, self.fused_gemma_variant)
            return normed if residual is None else (normed, summed)
        if residual is not None:
            x = x + residual
            return self._scaled(self._normalized(x), x.dtype), x
        return self._scaled(self._normalized(x), x.dtype)

    def load_checkpoint_weight(self, param_name: str, loaded_weight: Any, shard_id: Any = None) -> None:
        tensor = materialize(loaded_weight, self.weight.dtype)
        if param_name != "weight" or tensor.shape != self.weight.shape:
            raise ModelLoadError(
                f"{type(self).__name__} expects 'weight' of shape {tuple(self.weight.shape)}, "
                f"got {param_name!r} of shape {tuple(tensor.shape)}"
            )
        self.weight.data.copy_(tensor)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's ``x / rms(x) * (1 + weight)``, computed in float32 and rounded once at the end
    (checkpoints store ``weight`` centred on zero)."""

    fused_gemma_variant = True

    @staticmethod
    def _initial_weight() -> float:
        return 0.0

    def _scaled(self, normalized, dtype):
        return (normalized * (1.0 + self.weight.float())).to(dtype)
