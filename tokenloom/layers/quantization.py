"""The ``QuantizationMethod`` interface linear layers carry, and the unquantized default.

A method creates a layer's weight parameters, loads checkpoint tensors into them, and runs
the layer's matmul; keeping weights packed with a dequantize-on-the-fly matmul, or
dequantizing at load, is each method's own choice.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenloom.kernels.onednn_linear import pack_weight, packable, packed_linear


def materialize(loaded_weight: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A checkpoint tensor as a dense torch tensor (packed weights are dequantized)."""
    if hasattr(loaded_weight, "dequantize") and not isinstance(loaded_weight, torch.Tensor):
        loaded_weight = loaded_weight.dequantize()
    tensor = torch.as_tensor(loaded_weight)
    return tensor.to(dtype) if dtype is not None else tensor


class QuantizationMethod:
    """Registered with ``register_quantization_methods``; one instance per model, in the worker.

    ``create_weights`` is called from each linear layer's constructor; the layer's weight
    loader then receives checkpoint tensors (``loaded_weight`` may be packed, e.g. a GGUF
    block-quantized tensor); ``process_weights_after_loading`` runs once after all weights
    are loaded; ``apply`` is the layer's forward.
    """

    name: str = "none"

    # set by the loader before any layer is built: False when the platform chose the model
    # dtype (``--dtype auto``), and the method may then compute small batches in a narrower
    # dtype where that is faster; True (the default, and whenever the user named ``--dtype``)
    # means no lower precision than that dtype
    exact_dtype: bool = True

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        """Create ``layer.weight`` (``[output_size, input_size]`` logical shape)."""
        raise NotImplementedError

    def load_weight(self, layer: nn.Module, loaded_weight: Any, output_offset: int, output_size: int) -> None:
        """Copy ``loaded_weight`` (rows ``output_offset:output_offset+output_size`` of the
        layer's output, a shard of a fused layer) into the layer's weight."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack weights once loading is complete (e.g. to a fast kernel's layout)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias``."""
        raise NotImplementedError

    def int4_groups(
        self, loaded_weight: Any, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(codes, scales, zeros)`` (see :mod:`tokenloom.kernels.int4_matmul`) of a checkpoint
        weight this method would keep 4-bit in a layer of ``dtype``, else None (it is loaded
        dense): how layers that are not linear (:mod:`tokenloom.layers.fused_moe`) ask."""
        return None


class UnquantizedMethod(QuantizationMethod):
    """Dense weights in the model dtype. Once loaded, a CPU weight oneDNN multiplies natively
    is replaced by its oneDNN-packed form (:mod:`tokenloom.kernels.onednn_linear`): the same
    values in the matmul's own layout (``layer.weight.to_dense()`` reads them back)."""

    name = "none"

    def create_weights(self, layer, input_size, output_size, dtype):
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)

    def load_weight(self, layer, loaded_weight, output_offset, output_size):
        tensor = materialize(loaded_weight, layer.weight.dtype)
        if tensor.shape[0] != output_size or tensor.shape[1:] != layer.weight.shape[1:]:
            raise ValueError(
                f"weight shape {tuple(tensor.shape)} does not fit rows {output_offset}:{output_offset + output_size} "
                f"of a parameter of shape {tuple(layer.weight.shape)}"
            )
        layer.weight.data[output_offset : output_offset + output_size].copy_(tensor)

    def process_weights_after_loading(self, layer):
        if packable(layer.weight):
            layer.weight = nn.Parameter(pack_weight(layer.weight), requires_grad=False)

    def apply(self, layer, x, bias):
        if layer.weight.is_mkldnn:
            return packed_linear(x, layer.weight, bias)
        return torch.nn.functional.linear(x, layer.weight, bias)
