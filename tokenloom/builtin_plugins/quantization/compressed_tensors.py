"""The ``compressed-tensors`` quantization plugin: checkpoints written by llm-compressor (or the
compressed-tensors library), read from config.json's ``quantization_config`` and multiplied by
tokenloom's CPU kernels, never through a dense float copy of a weight.

Schemes served (each a ``config_groups`` entry, chosen per layer by its ``targets``; layers the
``ignore`` list names stay dense, as does every layer no group targets):

- **W4A16**, format ``pack-quantized``: 4-bit integer weights, symmetric or asymmetric, one scale
  per group of 32, 64, 128 ... input features or per output channel. The int32-packed codes are
  repacked at load into :mod:`tokenloom.kernels.int4_matmul`'s layout: the same codes, each
  group's scale repeated over its groups of 32 (a channel scale over all of them), the zero point
  folded into the kernel's per-group offset. No value is re-quantized.
- **W8A8 int8**, format ``int-quantized``: 8-bit symmetric weights with one scale per output
  channel, activations 8-bit symmetric, dynamic per token or static per tensor. The int8 weight is
  repacked once into :mod:`tokenloom.kernels.w8a8_matmul`'s layout, whose kernel quantizes each
  token's activations dynamically (one scale per row, as vLLM's ``scaled_int8_quant``), sums
  int32 products over the whole row (AMX-INT8 for many rows where the CPU has it) and scales
  each output once by token scale x channel scale. A static per-tensor ``input_scale`` is read
  and checked but not used: those layers are quantized dynamically per token too (finer).

- **W8A16 int8**, format ``pack-quantized`` (four codes to an int32, what llm-compressor writes)
  or ``int-quantized``: 8-bit symmetric weights with channel or group scales, float activations.
  The codes are kept one byte each and multiplied by :mod:`tokenloom.kernels.w8a16_matmul`'s
  kernel, which widens them to float in registers: weight-only arithmetic, the activations are
  not quantized.
- **FP8**, format ``float-quantized``: float8_e4m3fn weights with one scale per output channel or
  per tensor (a fused layer's shards each keep theirs, spread over their rows), weight-only
  (W8A16) or with 8-bit float activations (W8A8, dynamic per token or per tensor, or a static
  ``input_scale``). The fp8 bytes go to the same kernel (one byte per weight read, widened in
  registers; no CPU here has fp8 arithmetic). The activations are NOT quantized to fp8: they are
  multiplied in float32, more precise than the checkpoint assumes, and a static ``input_scale``
  is read and checked but not used. (vLLM's CPU backend instead quantizes the activations to fp8
  and calls ``torch._scaled_mm``, its torch FP8 kernels being the CPU's only FP8 choice.)

Every other scheme (block-wise FP8, activation ordering with ``g_idx``, asymmetric 8-bit weights,
sparsity, a quantized KV cache, a checkpoint not yet compressed) is refused by name when the config
is read, before any worker starts. The config is parsed from its JSON; the compressed-tensors
library is not needed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenloom.builtin_plugins.quantization.grouped_int import drop_parameters, shard_count, unpack_int32
from tokenloom.errors import ConfigError, ModelLoadError
from tokenloom.kernels.int4_matmul import INT4_DTYPES, NATIVE_GROUP_SIZE, can_pack, int4_linear, pack_int4
from tokenloom.kernels.w8a8_matmul import pack_w8a8, w8a8_linear
from tokenloom.kernels.w8a16_matmul import pack_w8, w8a16_linear
from tokenloom.layers.quantization import (
    ParameterLayout,
    QuantizationConfig,
    QuantizationMethod,
    add_parameter,
    checkpoint_quantization,
)

# how 4-bit values sit in a compressed-tensors int32: eight per element, the first in the low
# bits (grouped_int.unpack_int32's order), each stored as value + 8
_INT4_PER_INT32 = 8
_INT4_OFFSET = 8
# 8-bit values (W8A16 pack-quantized): four per int32, the first in the low bits, each value + 128
_INT8_PER_INT32 = 4
_INT8_OFFSET = 128
_INT8_SHIFTS = torch.arange(0, 32, 8, dtype=torch.int32)

_SERVED = (
    "W4A16 (pack-quantized, int4 weights by group or channel), W8A8 (int-quantized, int8 channel weights), "
    "W8A16 (int8 weights by group or channel) and FP8 (float-quantized, e4m3 weights by channel or tensor)"
)


@dataclass(frozen=True)
class Scheme:
    """One config group's quantization of a layer, as tokenloom serves it."""

    kind: str  # "w4a16", "w8a8" (int8 weights and activations), "w8a16" (int8 weights) or "fp8"
    group_size: int | None  # input features per weight scale (None: one per output channel)
    symmetric: bool
    static_input_scale: bool = False
    tensor_scale: bool = False  # fp8: one weight scale per tensor (each shard's, in a fused layer)
    packed: bool = False  # w8a16: the codes packed four to an int32 (pack-quantized)


def _refuse(group: str, what: str) -> ConfigError:
    return ConfigError(
        f"compressed-tensors config group {group!r}: {what} is not supported; tokenloom serves {_SERVED}",
        param="quantization",
    )


def parse_scheme(group_name: str, group: dict[str, Any], checkpoint_format: str | None) -> Scheme:
    """A config group's scheme, or a ConfigError naming what tokenloom does not serve."""
    weights = group.get("weights") or {}
    activations = group.get("input_activations")
    if group.get("output_activations"):
        raise _refuse(group_name, "output activation quantization")
    fmt = group.get("format") or checkpoint_format
    bits, kind, strategy = weights.get("num_bits"), weights.get("type", "int"), weights.get("strategy")
    symmetric = bool(weights.get("symmetric", True))
    if kind == "float":
        return parse_fp8_scheme(group_name, weights, activations, fmt)
    if kind != "int":
        raise _refuse(group_name, f"{kind} weights")
    if weights.get("actorder") not in (None, "static", "weight"):
        raise _refuse(group_name, f"activation ordering {weights.get('actorder')!r} (weights with g_idx)")
    group_size = None
    if strategy == "group":
        group_size = int(weights.get("group_size") or 0)
        if group_size <= 0 or group_size % NATIVE_GROUP_SIZE:
            raise _refuse(group_name, f"a group size of {group_size} (it must be a multiple of {NATIVE_GROUP_SIZE})")
    elif strategy != "channel":
        raise _refuse(group_name, f"{strategy!r} weight scales")
    if bits == 4 and activations is None:
        if fmt != "pack-quantized":
            raise _refuse(group_name, f"4-bit weights in format {fmt!r}")
        return Scheme("w4a16", group_size, symmetric)
    if bits == 8 and activations is not None:
        if fmt not in ("int-quantized", "naive-quantized"):
            raise _refuse(group_name, f"8-bit weights and activations in format {fmt!r}")
        if not symmetric or group_size is not None:
            raise _refuse(group_name, "int8 weights other than symmetric per-channel")
        if activations.get("num_bits") != 8 or activations.get("type", "int") != "int":
            raise _refuse(group_name, f"{activations.get('num_bits')}-bit {activations.get('type')} activations")
        if not activations.get("symmetric", True):
            raise _refuse(group_name, "asymmetric activations")
        dynamic = bool(activations.get("dynamic"))
        if (
            dynamic
            and activations.get("strategy") != "token"
            or not dynamic
            and activations.get("strategy") != "tensor"
        ):
            raise _refuse(group_name, f"{activations.get('strategy')!r} activation scales (dynamic={dynamic})")
        return Scheme("w8a8", None, True, static_input_scale=not dynamic)
    if bits == 8:
        if fmt not in ("pack-quantized", "int-quantized", "naive-quantized"):
            raise _refuse(group_name, f"8-bit weights in format {fmt!r}")
        if not symmetric:
            raise _refuse(group_name, "asymmetric 8-bit weights")
        return Scheme("w8a16", group_size, True, packed=fmt == "pack-quantized")
    raise _refuse(group_name, f"{bits}-bit weights with {'quantized' if activations else 'float'} activations")


def parse_fp8_scheme(
    group_name: str, weights: dict[str, Any], activations: dict[str, Any] | None, fmt: str | None
) -> Scheme:
    """An FP8 config group's scheme (float8_e4m3fn weights), or a ConfigError naming what is not served."""
    strategy = weights.get("strategy")
    if weights.get("num_bits") != 8:
        raise _refuse(group_name, f"{weights.get('num_bits')}-bit float weights")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(group_name, f"8-bit float weights in format {fmt!r}")
    if not weights.get("symmetric", True):
        raise _refuse(group_name, "asymmetric fp8 weights")
    if strategy not in ("channel", "tensor"):
        raise _refuse(group_name, f"{strategy!r} fp8 weight scales (block-wise or grouped FP8)")
    if weights.get("dynamic"):
        raise _refuse(group_name, "fp8 weights with dynamic scales")
    tensor_scale = strategy == "tensor"
    if activations is None:
        return Scheme("fp8", None, True, tensor_scale=tensor_scale)
    if activations.get("num_bits") != 8 or activations.get("type") != "float":
        raise _refuse(
            group_name, f"fp8 weights with {activations.get('num_bits')}-bit {activations.get('type')} activations"
        )
    if not activations.get("symmetric", True):
        raise _refuse(group_name, "asymmetric activations")
    dynamic = bool(activations.get("dynamic"))
    if activations.get("strategy") not in (("token", "tensor") if dynamic else ("tensor",)):
        raise _refuse(group_name, f"{activations.get('strategy')!r} fp8 activation scales (dynamic={dynamic})")
    return Scheme("fp8", None, True, static_input_scale=not dynamic, tensor_scale=tensor_scale)


def _matches(target: str, name: str, layer: nn.Module) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target == "Linear"


class CompressedTensorsConfig(QuantizationConfig):
    """``quantization_config`` of a compressed-tensors checkpoint: its schemes and ignore list."""

    name = "compressed-tensors"

    def __init__(self, groups: list[tuple[list[str], Scheme]], ignore: list[str]):
        self.groups = groups
        self.ignore = ignore

    @classmethod
    def from_checkpoint(cls, hf_config: Any) -> CompressedTensorsConfig:
        config = checkpoint_quantization(hf_config)
        if config is None:
            raise ConfigError(
                "--quantization compressed-tensors needs a checkpoint whose config.json has a compressed-tensors "
                "quantization_config (as llm-compressor writes it)",
                param="quantization",
            )
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise ConfigError(
                f"the compressed-tensors checkpoint is in state {status!r}, not 'compressed': save it compressed "
                "(llm-compressor's save_pretrained(..., save_compressed=True))",
                param="quantization",
            )
        sparsity = config.get("sparsity_config") or {}
        if sparsity and sparsity.get("format", "dense") != "dense":
            raise ConfigError(f"compressed-tensors sparsity ({sparsity.get('format')}) is not supported")
        if config.get("kv_cache_scheme"):
            raise ConfigError("a compressed-tensors quantized KV cache (kv_cache_scheme) is not supported")
        groups = [
            (list(group.get("targets") or []), parse_scheme(name, group, config.get("format")))
            for name, group in (config.get("config_groups") or {}).items()
        ]
        if not groups:
            raise ConfigError("the compressed-tensors quantization_config has no config_groups")
        return cls(groups, list(config.get("ignore") or []))

    def scheme_for(self, name: str, layer: nn.Module) -> Scheme | None:
        """The scheme of the checkpoint module ``name`` (None: ignored or targeted by no
        group); a module named exactly wins over a regular expression, which wins over
        "Linear"."""
        if any(_matches(target, name, layer) and target != "Linear" for target in self.ignore):
            return None
        ranked = []
        for targets, scheme in self.groups:
            for target in targets:
                if _matches(target, name, layer):
                    ranked.append((0 if target == name else 1 if target.startswith("re:") else 2, scheme))
        return min(ranked, key=lambda pair: pair[0])[1] if ranked else None

    def get_method(self, layer, prefix, shard_prefixes):
        schemes = {self.scheme_for(name, layer) for name in shard_prefixes}
        if len(schemes) > 1:
            raise ConfigError(
                f"the compressed-tensors checkpoint quantizes the modules fused into {prefix} "
                f"({', '.join(shard_prefixes)}) differently; tokenloom multiplies them as one layer"
            )
        scheme = schemes.pop()
        if scheme is None:
            return None
        method: QuantizationMethod
        if scheme.kind == "w4a16":
            method = Int4PackedMethod(scheme)
        elif scheme.kind == "w8a8":
            method = Int8ChannelMethod(scheme)
        else:
            method = Weight8Method(scheme)
        method.exact_dtype = self.exact_dtype
        check_shape(prefix, layer.input_size, layer.output_size, scheme)
        return method


def check_shape(prefix: str, input_size: int, output_size: int, scheme: Scheme) -> None:
    """ModelLoadError naming the layer when the kernel's layout cannot hold its weight."""
    group = scheme.group_size or input_size
    if not can_pack(output_size, input_size, NATIVE_GROUP_SIZE) or input_size % group:
        raise ModelLoadError(
            f"layer {prefix}: a [{output_size}, {input_size}] weight (this rank's) with "
            f"{'channel' if scheme.group_size is None else f'{group}-feature group'} scales does not fit the "
            f"quantized kernels, which take output features in multiples of 16 and input features in multiples of "
            f"{NATIVE_GROUP_SIZE} (and of the group size)"
        )


def _per_32(scales: torch.Tensor, input_size: int) -> torch.Tensor:
    """``[out, groups]`` scales as ``[out, input_size / 32]``: each repeated over its groups of 32."""
    return scales.repeat_interleave(input_size // NATIVE_GROUP_SIZE // scales.shape[1], dim=1)


def _add_input_scale(layer: nn.Module) -> None:
    """A static activation scale per shard of the layer (read and checked, see the module doc)."""
    add_parameter(
        layer,
        "input_scale",
        torch.empty(shard_count(layer), dtype=torch.float32),
        ParameterLayout(output_dim=None, input_dim=None, per_shard=True),
    )


def _check_input_scale(layer: nn.Module) -> None:
    if not bool((layer.input_scale.data > 0).all()):
        raise ModelLoadError(f"an input_scale of this layer is not positive: {layer.input_scale.data.tolist()}")


def _float32_out(layer: nn.Module, x: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A float32 product of ``x``'s rows in ``x``'s dtype and shape, plus the bias."""
    if not (getattr(layer, "sums_partials", False) and x.dtype != torch.float32):
        out = out.to(x.dtype)  # a row-parallel shard keeps float32 until summed over ranks
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


class Int4PackedMethod(QuantizationMethod):
    """W4A16 pack-quantized weights, repacked for the int4 kernel (``layer.int4_weight``)."""

    name = "compressed-tensors"

    def __init__(self, scheme: Scheme):
        self.scheme = scheme

    def create_weights(self, layer, input_size, output_size, dtype):
        groups = 1 if self.scheme.group_size is None else input_size // self.scheme.group_size
        by_group = ParameterLayout(input_dim=1 if self.scheme.group_size is not None else None)
        add_parameter(
            layer,
            "weight_packed",
            torch.empty(output_size, input_size // _INT4_PER_INT32, dtype=torch.int32),
            ParameterLayout(),
        )
        add_parameter(layer, "weight_scale", torch.empty(output_size, groups, dtype=torch.float32), by_group)
        if not self.scheme.symmetric:
            add_parameter(
                layer,
                "weight_zero_point",
                torch.empty(output_size // _INT4_PER_INT32, groups, dtype=torch.int32),
                ParameterLayout(input_dim=by_group.input_dim, output_pack=_INT4_PER_INT32),
            )
        add_parameter(
            layer,
            "weight_shape",
            torch.empty(shard_count(layer), 2, dtype=torch.int64),
            ParameterLayout(output_dim=None, input_dim=None, per_shard=True),
        )

    def checkpoint_names(self, layer):
        names = ("weight_packed", "weight_scale", "weight_shape")
        return names if self.scheme.symmetric else (*names, "weight_zero_point")

    def process_weights_after_loading(self, layer):
        codes = unpack_int32(layer.weight_packed.data, 4, dim=1)
        scales = layer.weight_scale.data
        if self.scheme.symmetric:
            zeros = torch.zeros_like(scales)
        else:  # (code - zero_point) * scale = (code - 8) * scale + (8 - zero_point) * scale
            zero_points = unpack_int32(layer.weight_zero_point.data, 4, dim=0)[: scales.shape[0]]
            zeros = (_INT4_OFFSET - zero_points.float()) * scales
        input_size = codes.shape[1]
        dtype = layer.params_dtype if layer.params_dtype in INT4_DTYPES else torch.bfloat16
        layer.int4_weight = pack_int4(codes, _per_32(scales, input_size), _per_32(zeros, input_size), dtype)
        drop_parameters(layer, "weight_packed", "weight_scale", "weight_zero_point", "weight_shape")

    def apply(self, layer, x, bias):
        if getattr(layer, "sums_partials", False) and x.dtype != torch.float32:
            # a row-parallel shard: summed over ranks in float32, rounded once after
            return int4_linear(x.float(), layer.int4_weight, None if bias is None else bias.float())
        return int4_linear(x, layer.int4_weight, bias)


class Int8ChannelMethod(QuantizationMethod):
    """W8A8 int8 weights with channel scales, packed for the W8A8 kernel (``layer.w8a8_weight``):
    activations quantized dynamically per token in the kernel, also for a scheme with a static
    per-tensor ``input_scale`` (read and checked, not used: a token's own scale is finer). Where
    that kernel is not built, the int8 codes are kept and each call multiplies them scaled in the
    activations' dtype (no activation quantization)."""

    name = "compressed-tensors"

    def __init__(self, scheme: Scheme):
        self.scheme = scheme

    def create_weights(self, layer, input_size, output_size, dtype):
        add_parameter(layer, "weight", torch.empty(output_size, input_size, dtype=torch.int8), ParameterLayout())
        add_parameter(
            layer, "weight_scale", torch.empty(output_size, 1, dtype=torch.float32), ParameterLayout(input_dim=None)
        )
        if self.scheme.static_input_scale:
            _add_input_scale(layer)

    def checkpoint_names(self, layer):
        return (
            ("weight", "weight_scale", "input_scale") if self.scheme.static_input_scale else ("weight", "weight_scale")
        )

    def process_weights_after_loading(self, layer):
        if self.scheme.static_input_scale:
            _check_input_scale(layer)
        codes, scales = layer.weight.data, layer.weight_scale.data
        layer.w8a8_weight = pack_w8a8(codes, scales)
        if layer.w8a8_weight is None:  # no kernel here: the int8 codes themselves, scaled per call
            layer.int8_codes, layer.int8_scales = codes.clone(), scales.clone()
        drop_parameters(layer, "weight", "weight_scale", "input_scale")

    def apply(self, layer, x, bias):
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if layer.w8a8_weight is None:
            out = torch.nn.functional.linear(rows, layer.int8_codes.to(rows.dtype)) * layer.int8_scales.t().to(
                rows.dtype
            )
            return _float32_out(layer, x, out, bias)
        # a row-parallel shard keeps float32 until its partial sums are added over the ranks
        float_out = getattr(layer, "sums_partials", False) and x.dtype != torch.float32
        out = w8a8_linear(rows, layer.w8a8_weight, bias, float_out=float_out)
        if out.dtype != x.dtype and not float_out:  # rows of another float dtype, computed from float32
            out = out.to(x.dtype)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


class Weight8Method(QuantizationMethod):
    """8-bit weights times float activations (``layer.w8_weight``, one byte per weight): W8A16 int8
    codes (channel or group scales) and FP8 e4m3 codes (channel or tensor scales, with or without
    8-bit activations, which are computed in float32: see the module doc)."""

    name = "compressed-tensors"

    def __init__(self, scheme: Scheme):
        self.scheme = scheme

    def create_weights(self, layer, input_size, output_size, dtype):
        scheme = self.scheme
        if scheme.packed:
            add_parameter(
                layer,
                "weight_packed",
                torch.empty(output_size, input_size // _INT8_PER_INT32, dtype=torch.int32),
                ParameterLayout(),
            )
            add_parameter(
                layer,
                "weight_shape",
                torch.empty(shard_count(layer), 2, dtype=torch.int64),
                ParameterLayout(output_dim=None, input_dim=None, per_shard=True),
            )
        else:
            code_dtype = torch.float8_e4m3fn if scheme.kind == "fp8" else torch.int8
            add_parameter(layer, "weight", torch.empty(output_size, input_size, dtype=code_dtype), ParameterLayout())
        if scheme.tensor_scale:  # one per shard, spread over the shard's rows after loading
            scale = torch.empty(shard_count(layer), dtype=torch.float32)
            layout = ParameterLayout(output_dim=None, input_dim=None, per_shard=True)
        elif scheme.group_size is not None:
            scale = torch.empty(output_size, input_size // scheme.group_size, dtype=torch.float32)
            layout = ParameterLayout(input_dim=1)
        else:
            scale = torch.empty(output_size, 1, dtype=torch.float32)
            layout = ParameterLayout(input_dim=None)
        add_parameter(layer, "weight_scale", scale, layout)
        if scheme.static_input_scale:
            _add_input_scale(layer)

    def checkpoint_names(self, layer):
        names = ("weight_packed", "weight_shape") if self.scheme.packed else ("weight",)
        return (*names, "weight_scale", "input_scale") if self.scheme.static_input_scale else (*names, "weight_scale")

    def process_weights_after_loading(self, layer):
        if self.scheme.static_input_scale:
            _check_input_scale(layer)
        if self.scheme.packed:
            packed = layer.weight_packed.data
            unsigned = (packed.unsqueeze(-1) >> _INT8_SHIFTS) & 0xFF
            codes = (unsigned.reshape(packed.shape[0], -1) - _INT8_OFFSET).to(torch.int8)
        else:
            codes = layer.weight.data
        scales = layer.weight_scale.data
        if self.scheme.tensor_scale:
            channel = torch.empty(codes.shape[0], 1, dtype=torch.float32)
            for index, shard_id in enumerate(getattr(layer, "shard_ids", (None,))):
                offset, size, _ = layer.shard_rows(shard_id)
                channel[offset : offset + size] = scales[index]
            scales = channel
        layer.w8_weight = pack_w8(codes, scales)
        drop_parameters(layer, "weight", "weight_packed", "weight_shape", "weight_scale", "input_scale")

    def apply(self, layer, x, bias):
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        return _float32_out(layer, x, w8a16_linear(rows, layer.w8_weight), bias)
