"""Integer weight codes with one scale and zero point per group of input features, as GPTQ and
AWQ checkpoints store them, repacked at load into tokenloom's kernels: 4-bit codes into
:mod:`tokenloom.kernels.int4_matmul`'s layout, symmetric 8-bit codes into
:mod:`tokenloom.kernels.int8_matmul`'s. No dense float copy of a weight is kept.

What this module owns: unpacking int32 words of 4- or 8-bit codes (compressed-tensors' packing
too), dropping a layer's checkpoint-form parameters once repacked, the column plan that maps a
checkpoint's groups (``g_idx``: any input feature in any group, as GPTQ's act-order writes it)
onto the kernels' groups of 32 consecutive features, and :class:`GroupedIntMethod`, the method
both plugins share once each has read its tensors into ``codes [N, K]``, ``scales [N, G]``,
``zero_points [N, G]`` and ``g_idx [K]``.

The column plan: input features are sorted by group, and each group's run is padded with zero
columns to a multiple of 32, so every group of 32 the kernel sees lies in one checkpoint group
and takes its scale (a group of 128 becomes four of 32 with the same scale). When the sort moves
nothing and no run needs padding (every checkpoint without act-order whose group size is a
multiple of 32) the activations go to the kernel as they are; otherwise each call gathers the
activations' columns in that order first (an act-order layer, a group of 16, a tensor-parallel
rank whose features fall in parts of groups). Such a layer keeps its weight as
``layer.permuted_weight``, not ``layer.int4_weight``, which the fused decode operator would
multiply with unpermuted activations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenloom.errors import ConfigError, ModelLoadError
from tokenloom.kernels.int4_matmul import CODE_OFFSET, INT4_DTYPES, NATIVE_GROUP_SIZE, int4_linear, pack_int4
from tokenloom.kernels.int8_matmul import int8_linear, pack_int8
from tokenloom.layers.quantization import QuantizationMethod

# 8-bit codes 0..255 stand for code - 128 in a symmetric checkpoint
INT8_MIDPOINT = 128
# the output rows the kernels pack together
_ROW_MULTIPLE = 16


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words of ``32 / bits`` codes each (the first in the low bits) -> the unsigned codes
    as int32, unpacked along ``dim`` (a ``[R, C]`` tensor becomes ``[R * 32 / bits, C]`` for
    ``dim=0``)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    moved = packed.movedim(dim, -1)
    codes = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*moved.shape[:-1], -1).movedim(-1, dim).contiguous()


@dataclass(frozen=True)
class ColumnPlan:
    """Where each of the kernel's input columns comes from, and each group of 32's group."""

    # [padded K] indices into the activations' columns (index K is a zero column), or None when
    # the kernel takes the columns as they are
    columns: torch.Tensor | None
    # [padded K / 32] the checkpoint group of each of the kernel's groups of 32
    chunk_groups: torch.Tensor
    # whether a zero column is appended to the activations before the gather
    padded: bool


def plan_columns(g_idx: torch.Tensor, groups: int, prefix: str) -> ColumnPlan:
    """The column plan for features whose checkpoint groups are ``g_idx [K]`` (in ``0..groups-1``)."""
    g_idx = g_idx.to(torch.int64)
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise ModelLoadError(
            f"layer {prefix}: g_idx names groups {int(g_idx.min())}..{int(g_idx.max())}, but the checkpoint has "
            f"scales for {groups}"
        )
    features = g_idx.numel()
    order = torch.argsort(g_idx, stable=True)
    counts = torch.bincount(g_idx, minlength=groups)
    padded_counts = (counts + NATIVE_GROUP_SIZE - 1) // NATIVE_GROUP_SIZE * NATIVE_GROUP_SIZE
    chunk_groups = torch.repeat_interleave(torch.arange(groups), padded_counts // NATIVE_GROUP_SIZE)
    if torch.equal(counts, padded_counts) and torch.equal(order, torch.arange(features)):
        return ColumnPlan(None, chunk_groups, padded=False)
    starts = torch.cumsum(counts, 0) - counts
    padded_starts = torch.cumsum(padded_counts, 0) - padded_counts
    sorted_groups = g_idx[order]
    destination = padded_starts[sorted_groups] + torch.arange(features) - starts[sorted_groups]
    columns = torch.full((int(padded_counts.sum()),), features, dtype=torch.int64)
    columns[destination] = order
    return ColumnPlan(columns, chunk_groups, padded=bool((counts != padded_counts).any()))


def drop_parameters(layer: nn.Module, *names: str) -> None:
    """Remove the checkpoint-form parameters a method repacked."""
    for name in names:
        if name in layer._parameters:
            delattr(layer, name)


def shard_count(layer: nn.Module) -> int:
    """How many checkpoint tensors a (fused) layer loads per parameter."""
    return len(getattr(layer, "shard_ids", (None,)))


class GroupedIntMethod(QuantizationMethod):
    """A layer of 4-bit codes (the int4 kernel, any zero points) or symmetric 8-bit codes (the
    int8 kernel) with group scales. Subclasses create and read the checkpoint's tensors
    (:meth:`read_checkpoint`); this class repacks and multiplies them."""

    def __init__(self, bits: int, prefix: str):
        self.bits = bits
        self.prefix = prefix  # the layer's module name, for errors

    def read_checkpoint(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(codes [N, K], scales [N, G], zero_points [N, G], g_idx [K])`` of this rank, the
        codes and zero points unsigned integers, a weight being ``(code - zero_point) * scale``;
        and drop the checkpoint's parameters."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer):
        prefix = self.prefix
        codes, scales, zero_points, g_idx = self.read_checkpoint(layer)
        plan = plan_columns(g_idx, scales.shape[1], prefix)
        if plan.columns is not None:
            codes = torch.cat([codes, torch.zeros_like(codes[:, :1])], dim=1).index_select(1, plan.columns)
        scales = scales.float().index_select(1, plan.chunk_groups)
        zero_points = zero_points.index_select(1, plan.chunk_groups)
        layer.input_columns, layer.pads_input = plan.columns, plan.padded
        if self.bits == 4:
            # (code - zero_point) * scale = (code - 8) * scale + (8 - zero_point) * scale
            zeros = (CODE_OFFSET - zero_points.float()) * scales
            dtype = layer.params_dtype if layer.params_dtype in INT4_DTYPES else torch.bfloat16
            weight = pack_int4(codes, scales, zeros, dtype)
            if plan.columns is None:
                layer.int4_weight = weight
            else:
                layer.permuted_weight = weight
            return
        if not bool((zero_points == INT8_MIDPOINT).all()):
            raise ModelLoadError(
                f"layer {prefix}: 8-bit zero points other than {INT8_MIDPOINT} (an asymmetric weight); tokenloom's "
                "int8 kernel takes symmetric 8-bit weights only"
            )
        signed = (codes - INT8_MIDPOINT).to(torch.int8)
        layer.int8_weight = pack_int8(signed, scales)
        if layer.int8_weight is None:  # no kernel here: the codes themselves, scaled per call
            layer.int8_codes, layer.int8_scales = signed, scales

    def apply(self, layer, x, bias):
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if layer.input_columns is not None:
            if layer.pads_input:
                rows = torch.nn.functional.pad(rows, (0, 1))
            rows = rows.index_select(1, layer.input_columns)
        wide = getattr(layer, "sums_partials", False) and x.dtype != torch.float32
        if self.bits == 4:
            weight = layer.permuted_weight if layer.input_columns is not None else layer.int4_weight
            # a row-parallel shard: summed over ranks in float32, rounded once after
            out = int4_linear(rows.float() if wide else rows, weight)
        elif layer.int8_weight is not None:
            out = int8_linear(rows, layer.int8_weight)
        else:
            codes = layer.int8_codes.view(layer.int8_codes.shape[0], -1, NATIVE_GROUP_SIZE)
            dense = (codes.to(rows.dtype) * layer.int8_scales.to(rows.dtype).unsqueeze(-1)).flatten(1)
            out = torch.nn.functional.linear(rows, dense)
        if not wide:
            out = out.to(x.dtype)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


def check_rows(prefix: str, output_size: int, pack: int = 1) -> None:
    """ModelLoadError naming the layer when this rank's output rows do not suit the kernels (or
    a packing of ``pack`` rows per element)."""
    if output_size % _ROW_MULTIPLE or output_size % pack:
        raise ModelLoadError(
            f"layer {prefix}: this rank's {output_size} output features are not a multiple of "
            f"{max(_ROW_MULTIPLE, pack)}, which the quantized kernels need"
        )


def layer_columns(layer: Any) -> tuple[int, int]:
    """``(first input feature of this rank, the layer's total input features)``: a row-parallel
    layer's rank holds a slice of the input features."""
    total = int(getattr(layer, "total_input_size", layer.input_size))
    return (layer.tp_rank * layer.input_size if total != layer.input_size else 0), total


def config_value(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of ``names`` the quantization_config states."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


def fused_choice(
    method_name: str, prefix: str, shard_prefixes: tuple[str, ...], quantized: Callable[[str], bool]
) -> bool:
    """Whether the layer at ``prefix`` is quantized, ``quantized(name)`` asked of each of its
    checkpoint modules; a ConfigError when a fused layer's modules disagree."""
    choices = {bool(quantized(name)) for name in shard_prefixes}
    if len(choices) > 1:
        raise ConfigError(
            f"the {method_name} checkpoint quantizes some of the modules fused into {prefix} "
            f"({', '.join(shard_prefixes)}) and not others; tokenloom multiplies them as one layer",
            param="quantization",
        )
    return choices.pop()
