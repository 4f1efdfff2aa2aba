"""The ``gguf`` quantization method: linear layers whose checkpoint weights are GGML blocks
(:class:`GGUFWeight`, yielded by the ``gguf`` load format).

Mode ``"dequantize"`` (the only one so far) unpacks each weight once, at load, into a dense
parameter of the model dtype, so the forward is a plain matmul. A ``"packed"`` mode (keep the
blocks, dequantize on the fly in the matmul) fits the same interface later.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenloom.builtin_plugins.quantization.gguf_blocks import (  # noqa: F401  (GGUFWeight re-exported)
    DEQUANTIZERS,
    FLOAT_TYPES,
    GGUFWeight,
    supported_type_names,
)
from tokenloom.errors import ConfigError, ModelLoadError
from tokenloom.layers.quantization import UnquantizedMethod, materialize

MODES = ("dequantize",)


class GGUFQuantizationMethod(UnquantizedMethod):
    """GGML-quantized weights, dequantized at load; see the module docstring."""

    name = "gguf"

    def __init__(self, mode: str = "dequantize"):
        if mode not in MODES:
            raise ConfigError(f"gguf quantization mode {mode!r} is not implemented; available: {', '.join(MODES)}")
        self.mode = mode

    def load_weight(self, layer, loaded_weight: Any, output_offset: int, output_size: int) -> None:
        if isinstance(loaded_weight, GGUFWeight):
            check_supported(loaded_weight)
            if tuple(loaded_weight.shape[1:]) != tuple(layer.weight.shape[1:]) or loaded_weight.shape[0] != output_size:
                raise ModelLoadError(
                    f"GGUF tensor {loaded_weight.name!r} of {loaded_weight.path} has shape {tuple(loaded_weight.shape)}, "
                    f"but the layer expects {output_size} rows of {tuple(layer.weight.shape[1:])}"
                )
            tensor = loaded_weight.dequantize(layer.weight.dtype)
        else:
            tensor = materialize(loaded_weight, layer.weight.dtype)
        super().load_weight(layer, tensor, output_offset, output_size)


def check_supported(weight: GGUFWeight) -> None:
    """ModelLoadError naming the tensor, its file and its type when it cannot be dequantized."""
    if weight.ggml_type not in DEQUANTIZERS and weight.ggml_type not in FLOAT_TYPES:
        raise ModelLoadError(
            f"GGUF tensor {weight.name!r} of {weight.path} is stored as GGML type {weight.type_name}, which the "
            f"gguf quantization method cannot dequantize; supported types: {supported_type_names()}"
        )


def dequantize_to(weight: Any, dtype: torch.dtype) -> torch.Tensor:
    """Any checkpoint tensor (packed or dense) as a dense tensor of ``dtype``."""
    return weight.dequantize(dtype) if isinstance(weight, GGUFWeight) else materialize(weight, dtype)
