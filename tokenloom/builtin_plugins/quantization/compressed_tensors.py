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
  repacked into :mod:`tokenloom.kernels.int8_matmul`'s layout (the channel scale repeated over
  the groups of 32). That kernel quantizes activations dynamically per group of 32 features of
  each token: finer than a per-token scale, and finer than a static ``input_scale``, which is read
  and checked but not used.

Every other scheme (FP8, W8A16, activation ordering with ``g_idx``, sparsity, a quantized KV
cache, a checkpoint not yet compressed) is refused by name when the config is read, before any
worker starts. The config is parsed from its JSON; the compressed-tensors library is not needed.
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
from tokenloom.kernels.int8_matmul import GROUP_SIZE as INT8_GROUP_SIZE
from tokenloom.kernels.int8_matmul import int8_linear, pack_int8
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

_SERVED = "W4A16 (pack-quantized, int4 weights by group or channel) and W8A8 (int-quantized, int8 channel weights)"


@dataclass(frozen=True)
class Scheme:
    """One config group's quantization of a layer, as tokenloom serves it."""

    kind: str  # "w4a16" or "w8a8"
    group_size: int | None  # input features per weight scale (None: one per output channel)
    symmetric: bool
    static_input_scale: bool = False


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
        raise _refuse(group_name, "8-bit weight-only quantization (W8A16)")
    raise _refuse(group_name, f"{bits}-bit weights with {'quantized' if activations else 'float'} activations")


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
        method: QuantizationMethod = Int4PackedMethod(scheme) if scheme.kind == "w4a16" else Int8ChannelMethod(scheme)
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
    """W8A8 int8 weights with channel scales, repacked for the int8 kernel
    (``layer.int8_weight``); where that kernel is not built, the int8 codes are kept and each
    call multiplies them scaled in the activations' dtype."""

    name = "compressed-tensors"

    def __init__(self, scheme: Scheme):
        self.scheme = scheme

    def create_weights(self, layer, input_size, output_size, dtype):
        add_parameter(layer, "weight", torch.empty(output_size, input_size, dtype=torch.int8), ParameterLayout())
        add_parameter(
            layer, "weight_scale", torch.empty(output_size, 1, dtype=torch.float32), ParameterLayout(input_dim=None)
        )
        if self.scheme.static_input_scale:
            add_parameter(
                layer,
                "input_scale",
                torch.empty(shard_count(layer), dtype=torch.float32),
                ParameterLayout(output_dim=None, input_dim=None, per_shard=True),
            )

    def checkpoint_names(self, layer):
        return (
            ("weight", "weight_scale", "input_scale") if self.scheme.static_input_scale else ("weight", "weight_scale")
        )

    def process_weights_after_loading(self, layer):
        if self.scheme.static_input_scale and not bool((layer.input_scale.data > 0).all()):
            raise ModelLoadError(f"an input_scale of this layer is not positive: {layer.input_scale.data.tolist()}")
        codes, scales = layer.weight.data, layer.weight_scale.data
        layer.int8_weight = pack_int8(codes, scales.expand(-1, codes.shape[1] // INT8_GROUP_SIZE))
        if layer.int8_weight is None:  # no kernel here: the int8 codes themselves, scaled per call
            layer.int8_codes, layer.int8_scales = codes.clone(), scales.clone()
        drop_parameters(layer, "weight", "weight_scale", "input_scale")

    def apply(self, layer, x, bias):
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if layer.int8_weight is not None:
            out = int8_linear(rows, layer.int8_weight)
        else:
            out = torch.nn.functional.linear(rows, layer.int8_codes.to(rows.dtype)) * layer.int8_scales.t().to(
                rows.dtype
            )
        if not (getattr(layer, "sums_partials", False) and x.dtype != torch.float32):
            out = out.to(x.dtype)  # a row-parallel shard keeps float32 until summed over ranks
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])
