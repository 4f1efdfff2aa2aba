"""load_checkpoint_weights: stacked shards, plain parameters of custom modules, skipped
prefixes, unknown tensors refused by name unless the model lists them as ignorable, and missing
tensors named in the error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenloom.errors import ModelLoadError
from tokenloom.layers.decoder import GatedMLP
from tokenloom.layers.layernorm import RMSNorm
from tokenloom.layers.quantization import QuantizationMethod
from tokenloom.layers.weight_loading import ROTARY_BUFFERS, load_checkpoint_weights


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = GatedMLP(4, 6, "silu")
        self.norm = RMSNorm(4)
        self.gate_scale = nn.Parameter(torch.zeros(2), requires_grad=False)  # a plain parameter


def checkpoint():
    generator = torch.Generator().manual_seed(0)
    return {
        "mlp.gate_proj.weight": torch.randn(6, 4, generator=generator),
        "mlp.up_proj.weight": torch.randn(6, 4, generator=generator),
        "mlp.down_proj.weight": torch.randn(4, 6, generator=generator),
        "norm.weight": torch.randn(4, generator=generator),
        "gate_scale": torch.tensor([1.5, 2.5]),
    }


def test_loads_shards_plain_parameters_and_reports_names():
    block, weights = Block(), checkpoint()
    loaded = load_checkpoint_weights(block, weights.items())
    assert loaded == {"mlp.gate_up_proj.weight", "mlp.down_proj.weight", "norm.weight", "gate_scale"}
    # linear weights are oneDNN-packed once loaded: to_dense() reads their values back
    torch.testing.assert_close(
        block.mlp.gate_up_proj.weight.to_dense(),
        torch.cat([weights["mlp.gate_proj.weight"], weights["mlp.up_proj.weight"]]),
    )
    torch.testing.assert_close(block.gate_scale, torch.tensor([1.5, 2.5]))


def test_a_tensor_no_parameter_takes_is_refused_by_name():
    """A model without, say, q/k norms would serve wrong text if their tensors were dropped."""
    weights = [*checkpoint().items(), ("self_attn.q_norm.weight", torch.ones(4))]
    with pytest.raises(
        ModelLoadError, match=r"Block has no parameter for: self_attn\.q_norm\.weight; .*ignored_checkpoint_weights"
    ):
        load_checkpoint_weights(Block(), weights)
    # skipped prefixes are still no error
    load_checkpoint_weights(
        Block(), [*checkpoint().items(), ("vision.proj.weight", torch.ones(1))], skip_prefixes=("vision.",)
    )


def test_ignored_patterns_leave_only_the_tensors_they_match_unread():
    extra = {
        "rotary_emb.inv_freq": torch.ones(2),
        "layers.3.self_attn.rotary_emb.cos_cached": torch.ones(2),
        "vision.tower.0.weight": torch.ones(3),
    }
    weights = [*checkpoint().items(), *extra.items()]
    loaded = load_checkpoint_weights(Block(), weights, ignored=(*ROTARY_BUFFERS, "vision.*"))
    assert loaded == {"mlp.gate_up_proj.weight", "mlp.down_proj.weight", "norm.weight", "gate_scale"}
    with pytest.raises(ModelLoadError, match=r"has no parameter for: vision\.tower\.0\.weight;"):
        load_checkpoint_weights(Block(), weights, ignored=ROTARY_BUFFERS)


def test_missing_shard_is_named():
    weights = checkpoint()
    del weights["mlp.up_proj.weight"]
    with pytest.raises(ModelLoadError, match=r"mlp\.gate_up_proj\.weight \(shard 1\)"):
        load_checkpoint_weights(Block(), weights.items())


def test_skip_prefixes_neither_load_nor_require():
    weights = checkpoint()
    del weights["norm.weight"]
    weights["norm.weight_extra"] = torch.zeros(1)
    loaded = load_checkpoint_weights(Block(), weights.items(), skip_prefixes=("norm.",))
    assert "norm.weight" not in loaded


def test_rename_maps_checkpoint_names_to_the_model_s():
    weights = {"inner." + name: tensor for name, tensor in checkpoint().items()}
    loaded = load_checkpoint_weights(Block(), weights.items(), rename=lambda name: name.removeprefix("inner."))
    assert "norm.weight" in loaded


class RenamingMethod(QuantizationMethod):
    """A quantization method that keeps a linear weight under names of its own."""

    name = "renaming"

    def create_weights(self, layer, input_size, output_size, dtype):
        layer.qweight = nn.Parameter(torch.zeros(output_size, input_size), requires_grad=False)
        layer.scales = nn.Parameter(torch.ones(output_size), requires_grad=False)

    def load_weight(self, layer, loaded_weight, output_offset, output_size):
        layer.qweight.data[output_offset : output_offset + output_size].copy_(loaded_weight)

    def process_weights_after_loading(self, layer):
        pass


def test_parameters_a_quantization_method_created_count_as_filled():
    block = Block()
    block.mlp = GatedMLP(4, 6, "silu", quant_method=RenamingMethod())
    loaded = load_checkpoint_weights(block, checkpoint().items())
    assert {"mlp.gate_up_proj.qweight", "mlp.gate_up_proj.scales", "mlp.down_proj.qweight"} <= loaded
    assert {name for name, _ in block.named_parameters()} <= loaded
