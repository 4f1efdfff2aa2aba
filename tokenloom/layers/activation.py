"""Gated activations of fused gate/up projections: ``act(x[..., :d]) * x[..., d:]``; on the
CPU a ``[tokens, 2d]`` input takes one fused operator (``act_and_mul`` of tokenloom's CPU operators)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tokenloom.errors import ConfigError
from tokenloom.kernels.cpu_native import ops_for


def _fused(x: torch.Tensor, activation: str) -> torch.Tensor | None:
    ops = ops_for(x) if x.dim() == 2 and x.stride(-1) == 1 else None
    return None if ops is None else ops.act_and_mul(x, activation)


class SiluAndMul(nn.Module):
    """SwiGLU: ``silu(gate) * up`` over a ``[..., 2 * d]`` input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = _fused(x, "silu")
        if fused is not None:
            return fused
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """GeGLU: ``gelu(gate) * up``; ``approximate`` is ``"tanh"`` or ``"none"`` (exact erf)."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ConfigError(f"GELU approximation must be 'none' or 'tanh', not {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = _fused(x, "gelu_tanh" if self.approximate == "tanh" else "gelu")
        if fused is not None:
            return fused
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


# Hugging Face ``hidden_act`` names -> the gated module computing them
_GATED_ACTIVATIONS = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu": lambda: GeluAndMul("none"),
    "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"),
    "gelu_new": lambda: GeluAndMul("tanh"),
    "gelu_fast": lambda: GeluAndMul("tanh"),
}


def get_act_and_mul(hidden_act: str) -> nn.Module:
    """The gated activation for a config's ``hidden_act`` / ``hidden_activation`` name."""
    factory = _GATED_ACTIVATIONS.get(hidden_act)
    if factory is None:
        raise ConfigError(
            f"unsupported gated activation {hidden_act!r}; supported: {', '.join(sorted(_GATED_ACTIVATIONS))}"
        )
    return factory()
