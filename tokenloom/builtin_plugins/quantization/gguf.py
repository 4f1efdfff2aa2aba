"""The ``gguf`` quantization method: linear layers whose checkpoint weights are GGML blocks
(:class:`GGUFWeight`, yielded by the ``gguf`` load format).

Every weight is unpacked once, at load, into a dense parameter of the model dtype (then packed
for oneDNN's CPU matmul, as :class:`UnquantizedMethod` does). In mode
``"auto"`` (the default) a layer whose weight is all 4-bit blocks (Q4_0, Q4_1, Q4_K) also keeps
those blocks, repacked for the CPU's int4 kernel: decode steps of a few rows then read a
quarter (bfloat16, float16) or an eighth (float32) of the bytes, and
:mod:`tokenloom.kernels.int4_matmul` says where the dense matmul takes over. The kernel works
in bfloat16, so a float32 model uses it only when the platform chose float32 (``--dtype auto``
on a CPU without native bfloat16); ``--dtype float32`` keeps float32 exact. Mode
``"dequantize"`` keeps only the dense weight.
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
from tokenloom.builtin_plugins.quantization.gguf_int4 import int4_groups, is_int4_type
from tokenloom.errors import ConfigError, ModelLoadError
from tokenloom.kernels.int4_matmul import INT4_DTYPES, can_pack, int4_linear, pack_int4, prefers_int4
from tokenloom.layers.quantization import UnquantizedMethod, materialize

MODES = ("auto", "dequantize")


class GGUFQuantizationMethod(UnquantizedMethod):
    """GGML-quantized weights, dequantized at load; see the module docstring."""

    name = "gguf"

    def __init__(self, mode: str = "auto"):
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
        self._keep_int4_shard(layer, loaded_weight, output_offset)

    def _keep_int4_shard(self, layer, loaded_weight: Any, output_offset: int) -> None:
        """Remember this shard's 4-bit codes until the whole layer is loaded; one shard that
        is not 4-bit blocks leaves the layer dense."""
        shards = getattr(layer, "_int4_shards", {})
        if shards is None:
            return
        if (self.mode == "auto" and self._int4_dtype(layer.weight.dtype) is not None
                and isinstance(loaded_weight, GGUFWeight) and is_int4_type(loaded_weight.ggml_type)):
            shards[output_offset] = int4_groups(loaded_weight)
            layer._int4_shards = shards
        else:
            layer._int4_shards = None

    def process_weights_after_loading(self, layer) -> None:
        shards = getattr(layer, "_int4_shards", None)
        layer._int4_shards = None
        layer.int4_weight = None
        if shards:
            codes, scales, zeros = (torch.cat([shards[offset][part] for offset in sorted(shards)]) for part in range(3))
            if codes.shape == layer.weight.shape and can_pack(*codes.shape, codes.shape[1] // scales.shape[1]):
                layer.int4_weight = pack_int4(codes, scales, zeros, self._int4_dtype(layer.weight.dtype))
        super().process_weights_after_loading(layer)  # the dense weight, packed for larger batches

    def _int4_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        """The activation dtype the int4 kernel runs in for a layer of ``dtype``; None when
        the layer must stay dense (float32 the user asked for by name)."""
        if dtype in INT4_DTYPES:
            return dtype
        return torch.bfloat16 if dtype == torch.float32 and not self.exact_dtype else None

    def apply(self, layer, x, bias):
        int4_weight = getattr(layer, "int4_weight", None)
        if int4_weight is not None and prefers_int4(x):
            return int4_linear(x, int4_weight, bias)
        return super().apply(layer, x, bias)


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
