"""Gated activations against transformers' activation functions."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from tokenloom.errors import ConfigError
from tokenloom.layers.activation import GeluAndMul, SiluAndMul, get_act_and_mul


@pytest.mark.parametrize("hidden_act", ["silu", "gelu", "gelu_pytorch_tanh", "gelu_new"])
def test_gated_activation_matches_transformers(hidden_act):
    x = torch.randn(4, 2 * 24, generator=torch.Generator().manual_seed(0)) * 3
    gate, up = x[:, :24], x[:, 24:]
    expected = ACT2FN[hidden_act](gate) * up
    torch.testing.assert_close(get_act_and_mul(hidden_act)(x), expected)


def test_module_types_and_errors():
    assert isinstance(get_act_and_mul("swish"), SiluAndMul)
    assert get_act_and_mul("gelu_pytorch_tanh").approximate == "tanh"
    with pytest.raises(ConfigError, match="relu2"):
        get_act_and_mul("relu2")
    with pytest.raises(ConfigError, match="approximation"):
        GeluAndMul("fast")
