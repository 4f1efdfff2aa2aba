"""The ``gguf`` quantization method: linear layers whose checkpoint weights are GGML blocks
(:class:`GGUFWeight`, yielded by the ``gguf`` load format).

In mode ``"auto"`` (the default) a layer whose weight is all 4-bit blocks (Q4_0, Q4_1, Q4_K)
keeps those blocks, repacked for the CPU's int4 matmul (:mod:`tokenloom.kernels.int4_matmul`).
Where tokenloom's own kernel is built (every CPU kernel level: AVX512-VNNI, AVX2, plain C++; see
:mod:`tokenloom.kernels.cpu_native`) it computes every batch, in llama.cpp's Q4 x Q8
arithmetic, and the layer holds no dense weight at all. Elsewhere (kernels switched off or not
built) torch's kernel serves
small batches and the layer also keeps the weight dequantized into the model dtype (packed for
oneDNN's matmul, as :class:`UnquantizedMethod` does) for large ones. The int4 kernels work in
bfloat16 or better, so a float32 model uses them only when the platform chose float32
(``--dtype auto`` on a CPU without native bfloat16); ``--dtype float32`` keeps float32 exact.
Every other weight, and every weight in mode ``"dequantize"``, is dequantized at load into a
dense weight of the model dtype.

On a GPU (with triton installed) a layer whose weight is all Q4_0, all Q4_1 or all Q8_0 blocks
keeps them as stored in device memory and multiplies them with the Triton dequantize-matmul
(:mod:`tokenloom.kernels.triton.gguf`); other layers are dequantized as above.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenloom.builtin_plugins.quantization.gguf_blocks import (  # noqa: F401  (GGUFWeight re-exported)
    DEQUANTIZERS,
    FLOAT_TYPES,
    GGUFWeight,
    supported_type_names,
)
from tokenloom.builtin_plugins.quantization.gguf_int4 import int4_groups, is_int4_type
from tokenloom.errors import ConfigError, ModelLoadError
from tokenloom.kernels.int4_matmul import INT4_DTYPES, can_pack, int4_linear, pack_int4, prefers_int4
from tokenloom.kernels.triton import gguf as triton_gguf
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
            if (
                self.mode == "auto"
                and loaded_weight.ggml_type in triton_gguf.BLOCK_BYTES
                and triton_gguf.runs_on(layer.weight)
            ):
                # kept as stored until the whole layer is loaded: one type for every shard, or dense
                layer._gguf_block_shards = {**getattr(layer, "_gguf_block_shards", {}), output_offset: loaded_weight}
                return
            if (
                self.mode == "auto"
                and is_int4_type(loaded_weight.ggml_type)
                and self._int4_dtype(layer.weight.dtype) is not None
            ):
                # kept as blocks until the whole layer is loaded: packed, and dequantized only if needed
                layer._int4_shards = {**getattr(layer, "_int4_shards", {}), output_offset: loaded_weight}
                return
        super().load_weight(layer, dequantize_to(loaded_weight, layer.weight.dtype), output_offset, output_size)

    def process_weights_after_loading(self, layer) -> None:
        if self._keep_gguf_blocks(layer):
            return
        shards = getattr(layer, "_int4_shards", {})
        layer._int4_shards = {}
        layer.int4_weight = None
        # all rows from 4-bit shards: no shard of another type was loaded
        if shards and sum(shard.shape[0] for shard in shards.values()) == layer.weight.shape[0]:
            codes, scales, zeros = (
                torch.cat([int4_groups(shards[offset])[part] for offset in sorted(shards)]) for part in range(3)
            )
            if can_pack(*codes.shape, codes.shape[1] // scales.shape[1]):
                layer.int4_weight = pack_int4(codes, scales, zeros, self._int4_dtype(layer.weight.dtype))
                if layer.int4_weight.kernel is not None:  # it takes every batch: no dense weight
                    layer.weight = nn.Parameter(
                        torch.empty(layer.weight.shape, dtype=layer.weight.dtype, device="meta"), requires_grad=False
                    )
                    return
        for offset, shard in shards.items():  # the dense weight, for batches the int4 kernel does not take
            super().load_weight(layer, shard.dequantize(layer.weight.dtype), offset, shard.shape[0])
        super().process_weights_after_loading(layer)

    def _keep_gguf_blocks(self, layer) -> bool:
        """A GPU layer loaded wholly from blocks of one Triton-multiplied type keeps them (and
        no dense weight): True. Other block shards are dequantized into the dense weight."""
        shards = getattr(layer, "_gguf_block_shards", {})
        layer._gguf_block_shards = {}
        layer.gguf_blocks = None
        types = {shard.ggml_type for shard in shards.values()}
        if len(types) == 1 and sum(shard.shape[0] for shard in shards.values()) == layer.weight.shape[0]:
            device = layer.weight.device
            layer.gguf_blocks = torch.cat([shards[offset].data for offset in sorted(shards)]).to(device)
            layer.gguf_type = types.pop()
            layer.weight = nn.Parameter(
                torch.empty(layer.weight.shape, dtype=layer.weight.dtype, device="meta"), requires_grad=False
            )
            return True
        for offset, shard in shards.items():
            super().load_weight(layer, shard.dequantize(layer.weight.dtype), offset, shard.shape[0])
        return False

    def _int4_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        """The activation dtype the int4 kernel runs in for a layer of ``dtype``; None when
        the layer must stay dense (float32 the user asked for by name)."""
        if dtype in INT4_DTYPES:
            return dtype
        return torch.bfloat16 if dtype == torch.float32 and not self.exact_dtype else None

    def int4_groups(self, loaded_weight, dtype):
        if (
            self.mode == "auto"
            and isinstance(loaded_weight, GGUFWeight)
            and is_int4_type(loaded_weight.ggml_type)
            and self._int4_dtype(dtype) is not None
        ):
            return int4_groups(loaded_weight)
        return None

    def apply(self, layer, x, bias):
        gguf_blocks = getattr(layer, "gguf_blocks", None)
        if gguf_blocks is not None:
            return triton_gguf.gguf_matmul(x, gguf_blocks, layer.gguf_type, gguf_blocks.shape[0], bias)
        int4_weight = getattr(layer, "int4_weight", None)
        if int4_weight is not None and prefers_int4(x, int4_weight):
            if int4_weight.kernel is not None and getattr(layer, "sums_partials", False) and x.dtype != torch.float32:
                # a row-parallel shard: its partial product stays float32 until summed over the
                # ranks, so the sum is rounded once, as one worker's kernel rounds it
                return int4_linear(x.float(), int4_weight, None if bias is None else bias.float())
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
