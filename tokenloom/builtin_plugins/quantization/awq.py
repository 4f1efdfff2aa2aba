"""The ``awq`` quantization plugin: AWQ checkpoints in the GEMM layout (AutoAWQ's ``version:
gemm``, what transformers and vLLM load), read from config.json's ``quantization_config``
(``quant_method: awq``) and repacked at load into tokenloom's int4 kernel, never through a dense
float copy of a weight.

An AWQ GEMM layer stores ``qweight`` int32 ``[K, N / 8]``: eight 4-bit codes per word packed
along the output features, word bits ``4i..4i+3`` holding output feature ``8w + (0, 2, 4, 6, 1,
3, 5, 7)[i]``; ``qzeros`` int32 ``[groups, N / 8]`` the zero points in the same order; and
``scales`` ``[groups, N]``, groups of ``group_size`` consecutive input features. A weight is
``(code - zero_point) * scale``.

Refused by name: the GEMV, GEMV-fast, exllama, marlin and ipex layouts (``version``), weights
without zero points (``zero_point: false``) and other widths than 4 bits. Modules
``modules_to_not_convert`` names stay dense.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenloom.builtin_plugins.quantization.grouped_int import (
    GroupedIntMethod,
    check_rows,
    config_value,
    drop_parameters,
    fused_choice,
    layer_columns,
    unpack_int32,
)
from tokenloom.errors import ConfigError, ModelLoadError
from tokenloom.layers.quantization import (
    ParameterLayout,
    QuantizationConfig,
    add_parameter,
    checkpoint_quantization,
)

_CODES_PER_WORD = 8
# AWQ's packing: the output feature (within its word's eight) of each 4-bit field, low bits first
_FIELD_FEATURES = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
_NAMES = ("qweight", "qzeros", "scales")


def _refuse(what: str) -> ConfigError:
    return ConfigError(
        f"AWQ checkpoint: {what} is not supported; tokenloom serves 4-bit AWQ with zero points in the GEMM "
        "layout (version 'gemm')",
        param="quantization",
    )


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """``[R, C / 8]`` AWQ words -> ``[R, C]`` unsigned codes in output-feature order."""
    fields = unpack_int32(packed, 4, dim=1).view(packed.shape[0], -1, _CODES_PER_WORD)
    in_order = torch.empty_like(fields)
    in_order[..., _FIELD_FEATURES] = fields
    return in_order.view(packed.shape[0], -1)


class AWQConfig(QuantizationConfig):
    """``quantization_config`` of an AWQ checkpoint."""

    name = "awq"

    def __init__(self, group_size: int, skipped: tuple[str, ...]):
        self.group_size = group_size
        self.skipped = skipped  # modules_to_not_convert

    @classmethod
    def from_checkpoint(cls, hf_config: Any) -> AWQConfig:
        config = checkpoint_quantization(hf_config)
        if config is None or config.get("quant_method") != "awq":
            raise ConfigError(
                "--quantization awq needs a checkpoint whose config.json has an AWQ quantization_config "
                "(quant_method 'awq')",
                param="quantization",
            )
        version = str(config_value(config, "version", default="gemm")).lower()
        if version != "gemm":
            raise _refuse(f"the {version!r} layout (version)")
        bits = int(config_value(config, "bits", "w_bit", default=0))
        if bits != 4:
            raise _refuse(f"{bits}-bit weights")
        if not config_value(config, "zero_point", default=True):
            raise _refuse("weights without zero points (zero_point: false)")
        group_size = int(config_value(config, "group_size", "q_group_size", default=0))
        if group_size <= 0:
            raise _refuse(f"a group size of {group_size}")
        return cls(group_size, tuple(config.get("modules_to_not_convert") or ()))

    def quantizes(self, name: str) -> bool:
        """Whether the checkpoint module ``name`` is quantized (not in modules_to_not_convert,
        matched as vLLM and transformers match it: a part of the name)."""
        return not any(skipped in name for skipped in self.skipped)

    def get_method(self, layer, prefix, shard_prefixes):
        if not fused_choice("AWQ", prefix, shard_prefixes, self.quantizes):
            return None
        _, total_input = layer_columns(layer)
        if total_input % self.group_size:
            raise ModelLoadError(
                f"layer {prefix}: {total_input} input features are not a whole number of AWQ groups of "
                f"{self.group_size}"
            )
        check_rows(prefix, layer.output_size, _CODES_PER_WORD)
        method = AWQMethod(self.group_size, prefix)
        method.exact_dtype = self.exact_dtype
        return method


class AWQMethod(GroupedIntMethod):
    """An AWQ GEMM layer: ``qweight``, ``qzeros`` and ``scales`` loaded as the checkpoint stores
    them (scales and zero points whole on every rank), repacked for the int4 kernel."""

    name = "awq"

    def __init__(self, group_size: int, prefix: str):
        super().__init__(4, prefix)
        self.group_size = group_size

    def create_weights(self, layer, input_size, output_size, dtype):
        _, total_input = layer_columns(layer)
        groups = total_input // self.group_size
        words = output_size // _CODES_PER_WORD
        add_parameter(
            layer,
            "qweight",
            torch.empty(input_size, words, dtype=torch.int32),
            ParameterLayout(output_dim=1, input_dim=0, output_pack=_CODES_PER_WORD),
        )
        add_parameter(
            layer,
            "qzeros",
            torch.empty(groups, words, dtype=torch.int32),
            ParameterLayout(output_dim=1, input_dim=None, output_pack=_CODES_PER_WORD),
        )
        add_parameter(
            layer,
            "scales",
            torch.empty(groups, output_size, dtype=torch.float32),
            ParameterLayout(output_dim=1, input_dim=None),
        )

    def checkpoint_names(self, layer):
        return _NAMES

    def read_checkpoint(self, layer):
        first_column, _ = layer_columns(layer)
        codes = unpack_awq(layer.qweight.data).t()
        zero_points = unpack_awq(layer.qzeros.data).t()
        scales = layer.scales.data.t()
        g_idx = (torch.arange(layer.input_size) + first_column) // self.group_size
        drop_parameters(layer, *_NAMES)
        return codes, scales, zero_points, g_idx
