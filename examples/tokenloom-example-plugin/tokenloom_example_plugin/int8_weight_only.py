"""An int8 weight-only quantization plugin: a checkpoint whose config.json says
``"quantization_config": {"quant_method": "example-int8", "ignore": [...]}`` holds, for each
linear layer, an int8 ``weight`` and one float ``weight_scale`` per output row. The config
chooses per layer (the modules named in ``ignore`` stay dense); the method creates the two
parameters with their layouts, and tokenloom's layers load them (fused q/k/v and gate/up shards,
tensor-parallel slices) with no load-format plugin. The matmul is the simple reference:
dequantized per call, in the activations' dtype."""

from __future__ import annotations

import torch

from tokenloom.plugin_api import ParameterLayout, QuantizationConfig, QuantizationMethod, add_parameter


class Int8WeightOnlyConfig(QuantizationConfig):
    name = "example-int8"

    def __init__(self, ignore: list[str]):
        self.ignore = ignore

    @classmethod
    def from_checkpoint(cls, hf_config):
        config = getattr(hf_config, "quantization_config", None) or {}
        return cls(list(config.get("ignore", [])))

    def get_method(self, layer, prefix, shard_prefixes):
        return None if any(name in self.ignore for name in shard_prefixes) else Int8WeightOnlyMethod()


class Int8WeightOnlyMethod(QuantizationMethod):
    name = "example-int8"

    def create_weights(self, layer, input_size, output_size, dtype):
        # rows follow the output features and columns the input features (the defaults); the
        # scale has no input dimension, so a row-parallel rank takes it whole
        add_parameter(layer, "weight", torch.empty(output_size, input_size, dtype=torch.int8), ParameterLayout())
        add_parameter(
            layer, "weight_scale", torch.empty(output_size, dtype=torch.float32), ParameterLayout(input_dim=None)
        )

    def checkpoint_names(self, layer):
        return ("weight", "weight_scale")

    def apply(self, layer, x, bias):
        weight = layer.weight.to(x.dtype) * layer.weight_scale.to(x.dtype).unsqueeze(1)
        return torch.nn.functional.linear(x, weight, bias)
