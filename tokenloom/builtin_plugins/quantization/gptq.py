"""The ``gptq`` quantization plugin: GPTQ checkpoints (auto-gptq, gptqmodel, optimum), read from
config.json's ``quantization_config`` (``quant_method: gptq``) and multiplied by tokenloom's CPU
kernels, never through a dense float copy of a weight.

A GPTQ layer stores ``qweight`` int32 ``[K / p, N]`` (``p = 32 / bits`` codes per word, packed
along the input features, the first in the low bits), ``qzeros`` int32 ``[groups, N / p]``
(zero points packed along the output features), ``scales`` ``[groups, N]`` and ``g_idx`` int32
``[K]``, each input feature's group; a weight is ``(code - zero_point) * scale``. In the classic
format (``checkpoint_format: gptq``, auto-gptq's) ``qzeros`` holds each zero point minus one; in
gptqmodel's ``gptq_v2`` the zero point itself.

Served: 4-bit codes (symmetric or not) on the int4 kernel, symmetric 8-bit codes on the int8
kernel, any group size (``-1``: one group per output feature), act-order (``desc_act``: ``g_idx``
not monotone) and ``static_groups``: :mod:`~tokenloom.builtin_plugins.quantization.grouped_int`
sorts the input features by group and gathers the activations' columns in that order per call.
``true_sequential``, ``damp_percent`` and the like only shaped quantization and are ignored.
A quantized LM head (``lm_head: true``, as gptqmodel writes it: ``lm_head.qweight`` and the rest
beside a dense ``embed_tokens.weight``) is such a layer too, on the same kernels, in a model whose
head is then never tied to its embedding (:class:`~tokenloom.layers.embedding.QuantizedLMHead`).
Refused by name: 2- and 3-bit codes, asymmetric 8-bit codes (the int8 kernel has no zero point),
per-module ``dynamic`` overrides, and the marlin/bitblas checkpoint formats. Layers a
``modules_in_block_to_quantize`` list leaves out stay dense.
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
    shard_count,
    unpack_int32,
)
from tokenloom.errors import ConfigError, ModelLoadError
from tokenloom.layers.quantization import (
    ParameterLayout,
    QuantizationConfig,
    add_parameter,
    checkpoint_quantization,
)

_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint format -> what is added to a stored zero point
_NAMES = ("qweight", "qzeros", "scales", "g_idx")


def _refuse(what: str) -> ConfigError:
    return ConfigError(
        f"GPTQ checkpoint: {what} is not supported; tokenloom serves 4-bit GPTQ (symmetric or asymmetric) and "
        "symmetric 8-bit GPTQ in the gptq and gptq_v2 checkpoint formats",
        param="quantization",
    )


class GPTQConfig(QuantizationConfig):
    """``quantization_config`` of a GPTQ checkpoint."""

    name = "gptq"

    def __init__(
        self,
        bits: int,
        group_size: int,
        symmetric: bool,
        zero_point_offset: int,
        block_modules: tuple[str, ...] | None = None,
        lm_head: bool = False,
    ):
        self.bits = bits
        self.group_size = group_size  # -1: one group per output feature
        self.symmetric = symmetric
        self.zero_point_offset = zero_point_offset
        self.block_modules = block_modules  # modules_in_block_to_quantize, flattened (None: all)
        self.quantizes_lm_head = lm_head

    @classmethod
    def from_checkpoint(cls, hf_config: Any) -> GPTQConfig:
        config = checkpoint_quantization(hf_config)
        if config is None or config.get("quant_method") != "gptq":
            raise ConfigError(
                "--quantization gptq needs a checkpoint whose config.json has a GPTQ quantization_config "
                "(quant_method 'gptq')",
                param="quantization",
            )
        bits = int(config.get("bits") or 0)
        if bits not in (4, 8):
            raise _refuse(f"{bits}-bit weights")
        group_size = int(config_value(config, "group_size", default=-1))
        if group_size == 0 or group_size < -1:
            raise _refuse(f"a group size of {group_size}")
        symmetric = bool(config_value(config, "sym", default=True))
        if bits == 8 and not symmetric:
            raise _refuse("asymmetric 8-bit weights (sym: false; tokenloom's int8 kernel has no zero point)")
        checkpoint_format = str(config_value(config, "checkpoint_format", default="gptq"))
        if config.get("is_marlin_format"):
            checkpoint_format = "marlin"
        if checkpoint_format not in _FORMATS:
            raise _refuse(f"checkpoint_format {checkpoint_format!r}")
        if config.get("dynamic"):
            raise _refuse("per-module overrides (dynamic)")
        blocks = config.get("modules_in_block_to_quantize")
        block_modules = None if not blocks else tuple(name for block in blocks for name in block)
        lm_head = bool(config.get("lm_head"))
        return cls(bits, group_size, symmetric, _FORMATS[checkpoint_format], block_modules, lm_head)

    def quantizes(self, name: str) -> bool:
        """Whether the checkpoint module ``name`` is quantized (modules_in_block_to_quantize; the
        LM head by ``lm_head``)."""
        if name == "lm_head" or name.endswith(".lm_head"):
            return self.quantizes_lm_head
        if self.block_modules is None:
            return True
        return any(name == module or name.endswith("." + module) for module in self.block_modules)

    def get_method(self, layer, prefix, shard_prefixes):
        if not fused_choice("GPTQ", prefix, shard_prefixes, self.quantizes):
            return None
        _, total_input = layer_columns(layer)
        pack = 32 // self.bits
        if self.group_size != -1 and total_input % self.group_size:
            raise ModelLoadError(
                f"layer {prefix}: {total_input} input features are not a whole number of GPTQ groups of "
                f"{self.group_size}"
            )
        if layer.input_size % pack:
            raise ModelLoadError(
                f"layer {prefix}: this rank's {layer.input_size} input features are not whole int32 words of "
                f"{pack} codes"
            )
        check_rows(prefix, layer.output_size, pack)
        method = GPTQMethod(self, prefix)
        method.exact_dtype = self.exact_dtype
        return method


class GPTQMethod(GroupedIntMethod):
    """A GPTQ layer: ``qweight``, ``qzeros``, ``scales`` and ``g_idx`` loaded as the checkpoint
    stores them (scales and zero points whole on every rank, since an act-order rank's features
    may fall in any group), repacked for the kernels after loading."""

    name = "gptq"

    def __init__(self, config: GPTQConfig, prefix: str):
        super().__init__(config.bits, prefix)
        self.config = config

    def create_weights(self, layer, input_size, output_size, dtype):
        pack = 32 // self.bits
        _, total_input = layer_columns(layer)
        groups = 1 if self.config.group_size == -1 else total_input // self.config.group_size
        add_parameter(
            layer,
            "qweight",
            torch.empty(input_size // pack, output_size, dtype=torch.int32),
            ParameterLayout(output_dim=1, input_dim=0),
        )
        add_parameter(
            layer,
            "qzeros",
            torch.empty(groups, output_size // pack, dtype=torch.int32),
            ParameterLayout(output_dim=1, input_dim=None, output_pack=pack),
        )
        add_parameter(
            layer,
            "scales",
            torch.empty(groups, output_size, dtype=torch.float32),
            ParameterLayout(output_dim=1, input_dim=None),
        )
        # one per fused shard: q, k and v (gate and up) see the same inputs, so GPTQ orders them alike
        add_parameter(
            layer,
            "g_idx",
            torch.empty(shard_count(layer), input_size, dtype=torch.int32),
            ParameterLayout(output_dim=None, input_dim=0, per_shard=True),
        )

    def checkpoint_names(self, layer):
        return _NAMES

    def read_checkpoint(self, layer):
        g_idx = layer.g_idx.data
        if not bool((g_idx == g_idx[0]).all()):
            raise ModelLoadError(
                f"layer {self.prefix}: the GPTQ modules fused into it order their input features differently "
                "(their g_idx differ); tokenloom multiplies them as one layer"
            )
        codes = unpack_int32(layer.qweight.data, self.bits, dim=0).t()
        zero_points = unpack_int32(layer.qzeros.data, self.bits, dim=1).t() + self.config.zero_point_offset
        scales = layer.scales.data.t()
        drop_parameters(layer, *_NAMES)
        return codes, scales, zero_points, g_idx[0].clone()
