"""The ``gguf`` quantization method: linear layers whose checkpoint weights are GGML blocks
(:class:`GGUFWeight`, yielded by the ``gguf`` load format).

In mode ``"auto"`` (the default) a CPU layer keeps the file's codes of every shard stored as
Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K or Q8_0 blocks, and multiplies them with tokenloom's
own kernels (every CPU kernel level: AVX512-VNNI, AVX2, plain C++; see
:mod:`tokenloom.kernels.cpu_native`) in llama.cpp's Q x Q8 arithmetic: 4-bit codes with
:mod:`tokenloom.kernels.int4_matmul`, 5- and 6-bit ones with :mod:`tokenloom.kernels.kquant_matmul`,
2- and 3-bit ones with :mod:`tokenloom.kernels.lowbit_matmul`, 8-bit ones with
:mod:`tokenloom.kernels.int8_matmul`. Such a layer holds no dense weight at all.
A fused layer whose shards differ in type (a Q4_K_M file's Q4_K q and k beside a Q6_K v) keeps
one packed weight per run of shards of one kernel, and concatenates their outputs.

Where tokenloom's kernels are not available (switched off or not built), a layer whose weight is
all 4-bit blocks runs small batches on torch's int4 kernel and also keeps the weight dequantized
into the model dtype (packed for oneDNN's matmul, as :class:`UnquantizedMethod` does) for large
ones. The kernels work in bfloat16 or better, so a float32 model uses them only when the platform
chose float32 (``--dtype auto`` on a CPU without native bfloat16); ``--dtype float32`` keeps
float32 exact. Every other weight, and every weight in mode ``"dequantize"``, is dequantized at
load into a dense weight of the model dtype.

On a GPU (with triton installed) a layer whose weight is all Q4_0, all Q4_1 or all Q8_0 blocks
keeps them as stored in device memory and multiplies them with the Triton dequantize-matmul
(:mod:`tokenloom.kernels.triton.gguf`); other layers are dequantized as above.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from tokenloom.builtin_plugins.quantization.gguf_blocks import (  # noqa: F401  (GGUFWeight re-exported)
    DEQUANTIZERS,
    FLOAT_TYPES,
    Q3_K,
    Q6_K,
    Q8_0,
    GGUFWeight,
    supported_type_names,
)
from tokenloom.builtin_plugins.quantization.gguf_int4 import int4_groups, is_int4_type, pack_native
from tokenloom.builtin_plugins.quantization.gguf_kquant import KQUANT_TYPES, pack_kquant, superblock_groups
from tokenloom.builtin_plugins.quantization.gguf_lowbit import LOWBIT_TYPES, pack_lowbit
from tokenloom.errors import ConfigError, ModelLoadError
from tokenloom.kernels.int4_matmul import (
    INT4_DTYPES,
    Int4Weight,
    bf16_amx_available,
    can_pack,
    int4_linear,
    int4_linear_bf16,
    pack_int4,
    prefers_int4,
)
from tokenloom.kernels.int8_matmul import Int8Weight, int8_linear, pack_int8
from tokenloom.kernels.kquant_matmul import KQuantWeight, kquant_linear, kquant_linear_bf16
from tokenloom.kernels.lowbit_matmul import LowbitWeight, lowbit_linear
from tokenloom.kernels.triton import gguf as triton_gguf
from tokenloom.layers.quantization import UnquantizedMethod, materialize
from tokenloom.layers.row_roles import split_by_role

MODES = ("auto", "dequantize")


# rows of a 5-bit expert weight packed at a time by pack_expert_rows (a multiple of 32: whole pairs
# of blocks): bounds the torch packer's temporaries when a layer passes every expert at once
KQUANT_EXPERT_PACK_ROWS = 16384


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
                and native_kernel_family(loaded_weight.ggml_type) is not None
                and self._int4_dtype(layer.weight.dtype) is not None
            ):
                # kept as blocks until the whole layer is loaded: packed, and dequantized only if needed
                layer._native_shards = {**getattr(layer, "_native_shards", {}), output_offset: loaded_weight}
                return
        super().load_weight(layer, dequantize_to(loaded_weight, layer.weight.dtype), output_offset, output_size)
        release_file_pages([loaded_weight])

    def process_weights_after_loading(self, layer) -> None:
        if self._keep_gguf_blocks(layer):
            return
        shards = getattr(layer, "_native_shards", {})
        layer._native_shards = {}
        self._pack_native_shards(layer, shards)
        release_file_pages(shards.values())

    def _pack_native_shards(self, layer, shards: dict[int, GGUFWeight]) -> None:
        """The layer's kernel weights from the block shards it kept (or its dense weight)."""
        layer.int4_weight = None
        layer.native_segments = None
        # all rows from shards a kernel takes: no shard of another type was loaded
        if shards and sum(shard.shape[0] for shard in shards.values()) == layer.weight.shape[0]:
            if all(is_int4_type(shard.ggml_type) for shard in shards.values()):
                layer.int4_weight = self._pack_int4([shards[offset] for offset in sorted(shards)], layer.weight.dtype)
                native = layer.int4_weight is not None and layer.int4_weight.kernel is not None
            else:
                layer.native_segments = self._native_segments(shards, layer.weight.dtype)
                native = layer.native_segments is not None
            if native:  # the kernels take every batch: no dense weight
                layer.weight = nn.Parameter(
                    torch.empty(layer.weight.shape, dtype=layer.weight.dtype, device="meta"), requires_grad=False
                )
                return
        for offset, shard in shards.items():  # the dense weight, for batches no kernel takes
            super().load_weight(layer, shard.dequantize(layer.weight.dtype), offset, shard.shape[0])
        super().process_weights_after_loading(layer)

    def _pack_int4(self, shards: list[GGUFWeight], dtype: torch.dtype) -> Int4Weight | None:
        """4-bit row shards stacked and packed for an int4 kernel; None when the shape does not suit it."""
        native = pack_native(shards, self._int4_dtype(dtype))
        if native is not None:
            return native
        codes, scales, zeros = (torch.cat([int4_groups(shard)[part] for shard in shards]) for part in range(3))
        if not can_pack(*codes.shape, codes.shape[1] // scales.shape[1]):
            return None
        return pack_int4(codes, scales, zeros, self._int4_dtype(dtype))

    def _native_segments(self, shards: dict[int, GGUFWeight], dtype: torch.dtype) -> list | None:
        """The layer's rows as runs of shards one of tokenloom's kernels takes, each packed for
        it (a list of Int4Weight, Int8Weight, KQuantWeight, LowbitWeight in row order); None when a run cannot
        be packed (kernels not available, rows not in blocks of 16), and the layer stays dense."""
        runs: list[list[GGUFWeight]] = []
        for offset in sorted(shards):
            family = native_kernel_family(shards[offset].ggml_type)
            if runs and native_kernel_family(runs[-1][0].ggml_type) == family:
                runs[-1].append(shards[offset])
            else:
                runs.append([shards[offset]])
        segments: list[Int4Weight | Int8Weight | KQuantWeight | LowbitWeight | None] = []
        for run in runs:
            if is_int4_type(run[0].ggml_type):
                weight = self._pack_int4(run, dtype)
                segments.append(weight if weight is not None and weight.kernel is not None else None)
            elif run[0].ggml_type == Q8_0:
                codes, scales = (torch.cat(parts) for parts in zip(*(shard.int8_groups() for shard in run)))
                segments.append(pack_int8(codes, scales))
            elif run[0].ggml_type in LOWBIT_TYPES:
                segments.append(pack_lowbit(run))
            else:
                segments.append(pack_kquant(run))
        return None if any(segment is None for segment in segments) else segments

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
            release_file_pages(shards.values())
            layer.gguf_type = types.pop()
            layer.weight = nn.Parameter(
                torch.empty(layer.weight.shape, dtype=layer.weight.dtype, device="meta"), requires_grad=False
            )
            return True
        for offset, shard in shards.items():
            super().load_weight(layer, shard.dequantize(layer.weight.dtype), offset, shard.shape[0])
        release_file_pages(shards.values())
        return False

    def _int4_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        """The activation dtype the int4 kernel runs in for a layer of ``dtype``; None when
        the layer must stay dense (float32 the user asked for by name)."""
        if dtype in INT4_DTYPES:
            return dtype
        return torch.bfloat16 if dtype == torch.float32 and not self.exact_dtype else None

    def pack_expert_rows(self, loaded_weight, dtype):
        if (
            self.mode != "auto"
            or not isinstance(loaded_weight, GGUFWeight)
            # the expert kernel takes 4-, 5- and 6-bit codes; 8-, 3- and 2-bit experts run dense
            or (native_kernel_family(loaded_weight.ggml_type) or ("",))[0] not in ("int4", "int5", "int6")
            or self._int4_dtype(dtype) is None
        ):
            return None
        if not is_int4_type(loaded_weight.ggml_type):
            rows = loaded_weight.shape[0]
            if loaded_weight.ggml_type == Q6_K or rows <= KQUANT_EXPERT_PACK_ROWS:
                return pack_kquant([loaded_weight])  # (Q6_K: the native packer, one pass, nothing beside its output)
            # a 5-bit packer is a chain of torch operations whose temporaries grow with its rows (a
            # layer may pass every expert's at once): parts of at most KQUANT_EXPERT_PACK_ROWS rows,
            # their packed bytes joined (each part whole pairs of blocks, so the bytes are the same)
            parts = [
                pack_kquant([loaded_weight.narrow_rows(start, min(KQUANT_EXPERT_PACK_ROWS, rows - start))])
                for start in range(0, rows, KQUANT_EXPERT_PACK_ROWS)
            ]
            if any(part is None for part in parts):
                return None
            joined = torch.cat([part.packed for part in parts if part is not None])
            return dataclasses.replace(parts[0], packed=joined, out_features=rows)
        packed = self._pack_int4([loaded_weight], dtype)  # a linear layer's packing: one native pass
        return packed if packed is not None and packed.kernel is not None else None

    def apply(self, layer, x, bias):
        gguf_blocks = getattr(layer, "gguf_blocks", None)
        if gguf_blocks is not None:
            return triton_gguf.gguf_matmul(x, gguf_blocks, layer.gguf_type, gguf_blocks.shape[0], bias)
        segments = getattr(layer, "native_segments", None)
        int4_weight = getattr(layer, "int4_weight", None)
        if segments is None and int4_weight is not None and int4_weight.kernel is not None:
            segments = [int4_weight]
        if segments is not None:
            if getattr(layer, "sums_partials", False) and x.dtype != torch.float32:
                # a row-parallel shard: its partial product stays float32 until summed over the
                # ranks, so the sum is rounded once, as one worker's kernel rounds it
                x, bias = x.float(), None if bias is None else bias.float()
            native = segments

            def prompt_rows(rows: torch.Tensor) -> torch.Tensor:
                return joined([prompt_segment_linear(rows, segment) for segment in native])

            out = split_by_role(
                x,
                lambda rows: joined([segment_linear(rows, segment) for segment in native]),
                prompt_rows if x.dtype == torch.bfloat16 and bf16_amx_available() else None,
            )
            return out if bias is None else out + bias
        if int4_weight is not None and prefers_int4(x, int4_weight):
            return int4_linear(x, int4_weight, bias)
        return super().apply(layer, x, bias)


def joined(outputs: list[torch.Tensor]) -> torch.Tensor:
    """A fused layer's outputs, one per run of rows, side by side."""
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


def native_kernel_family(ggml_type: int) -> tuple[str, int] | None:
    """Which of tokenloom's kernels multiplies blocks of this type, and in superblocks of how
    many groups (shards of one family are packed together); None for types dequantized at load."""
    if is_int4_type(ggml_type):
        return ("int4", 1)
    if ggml_type == Q8_0:
        return ("int8", 1)
    if ggml_type in KQUANT_TYPES:
        return ("int6" if ggml_type == Q6_K else "int5", superblock_groups(ggml_type))
    if ggml_type in LOWBIT_TYPES:
        return ("int3" if ggml_type == Q3_K else "int2", 8)
    return None


def segment_linear(x: torch.Tensor, weight: Int4Weight | Int8Weight | KQuantWeight | LowbitWeight) -> torch.Tensor:
    """``x @ W.T`` for one packed run of a layer's rows, in ``x``'s dtype."""
    if isinstance(weight, Int4Weight):
        return int4_linear(x, weight)
    if isinstance(weight, KQuantWeight):
        return kquant_linear(x, weight)
    if isinstance(weight, LowbitWeight):
        return lowbit_linear(x, weight)
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out = int8_linear(rows, weight).to(x.dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.out_features)


def prompt_segment_linear(
    x: torch.Tensor, weight: Int4Weight | Int8Weight | KQuantWeight | LowbitWeight
) -> torch.Tensor:
    """``x @ W.T`` for prompt rows (bfloat16): the AMX-BF16 kernels where the run has one (4-, 5-
    and 6-bit codes), else the run's own kernel; in ``x``'s dtype."""
    if isinstance(weight, Int4Weight) and weight.kernel is not None:
        return int4_linear_bf16(x, weight)
    if isinstance(weight, KQuantWeight):
        return kquant_linear_bf16(x, weight)
    return segment_linear(x, weight)


def release_file_pages(weights: Any) -> None:
    """Drop the file pages behind checkpoint tensors a layer has packed or dequantized into memory
    of its own (:attr:`GGUFWeight.release`; dense tensors have none), so that no second copy of a
    weight stays resident once the model is loaded."""
    for weight in weights:
        release = getattr(weight, "release", None)
        if release is not None:
            release()


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
