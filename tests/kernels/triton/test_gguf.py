"""The Triton GGUF dequantize-matmul under the interpreter against the torch reference
(``dequantize_blocks`` then a dense matmul) on blocks ``gguf.quants`` quantized: Q4_0, Q4_1,
Q8_0; row counts across the tile edges; a bias; 16-bit activations; shape errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (the `gpu` extra)")

from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from tokenloom.builtin_plugins.quantization.gguf_blocks import dequantize_blocks  # noqa: E402
from tokenloom.errors import ConfigError  # noqa: E402
from tokenloom.kernels.triton.gguf import gguf_matmul  # noqa: E402

TYPES = {2: GGMLQuantizationType.Q4_0, 3: GGMLQuantizationType.Q4_1, 8: GGMLQuantizationType.Q8_0}


def quantized_weight(ggml_type, num_outputs, num_inputs, seed=0):
    dense = np.random.default_rng(seed).standard_normal((num_outputs, num_inputs)).astype(np.float32)
    blocks = torch.from_numpy(quantize(dense, TYPES[ggml_type]).copy())  # [N, K / 32 * block_bytes] uint8
    reference = dequantize_blocks(blocks, ggml_type, (num_outputs, num_inputs))
    return blocks, reference


@pytest.mark.parametrize("ggml_type", [2, 3, 8], ids=["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("num_rows", [1, 17])
def test_matches_dequantize_then_matmul(ggml_type, num_rows):
    blocks, dense = quantized_weight(ggml_type, num_outputs=40, num_inputs=96, seed=ggml_type)
    x = torch.randn(num_rows, 96, generator=torch.Generator().manual_seed(num_rows))
    bias = torch.randn(40)
    torch.testing.assert_close(gguf_matmul(x, blocks, ggml_type, 40, bias), x @ dense.T + bias, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_activations_in_leading_dimensions(dtype):
    blocks, dense = quantized_weight(3, num_outputs=32, num_inputs=64, seed=5)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    output = gguf_matmul(x, blocks, 3, 32)
    assert output.shape == (2, 3, 32) and output.dtype == dtype
    torch.testing.assert_close(output.float(), x.float() @ dense.T, atol=5e-2, rtol=2e-2)


def test_no_rows_and_bad_inputs():
    blocks, _ = quantized_weight(2, num_outputs=16, num_inputs=64)
    assert gguf_matmul(torch.empty(0, 64), blocks, 2, 16).shape == (0, 16)
    with pytest.raises(ConfigError, match="not GGML type 12"):
        gguf_matmul(torch.ones(1, 64), blocks, 12, 16)
    with pytest.raises(ConfigError, match="does not hold 16 rows of 96 inputs"):
        gguf_matmul(torch.ones(1, 96), blocks, 2, 16)


def test_the_gguf_method_keeps_blocks_on_a_gpu_and_multiplies_them_with_the_kernel(monkeypatch):
    """The gguf quantization method as on a GPU (``runs_on`` faked: the interpreter runs the
    kernel on CPU tensors): a fused layer of Q4_1 shards keeps them as stored, no dense
    weight, and computes what the dequantized weight computes; a layer mixing Q4_1 and Q8_0
    shards is dequantized."""
    from torch import nn

    from tokenloom.builtin_plugins.quantization import gguf as gguf_method_module
    from tokenloom.builtin_plugins.quantization.gguf import GGUFQuantizationMethod
    from tokenloom.builtin_plugins.quantization.gguf_blocks import GGUFWeight

    monkeypatch.setattr(gguf_method_module.triton_gguf, "runs_on", lambda weight: True)
    method = GGUFQuantizationMethod()

    def shard(ggml_type, rows, seed):
        blocks, dense = quantized_weight(ggml_type, rows, 64, seed)
        return GGUFWeight(blocks, ggml_type, (rows, 64), name=f"w{seed}"), dense

    layer = nn.Module()
    method.create_weights(layer, 64, 48, torch.float32)
    (first, first_dense), (second, second_dense) = shard(3, 32, 1), shard(3, 16, 2)
    method.load_weight(layer, first, 0, 32)
    method.load_weight(layer, second, 32, 16)
    method.process_weights_after_loading(layer)
    assert layer.weight.is_meta and layer.gguf_type == 3
    assert torch.equal(layer.gguf_blocks, torch.cat([first.data, second.data]))
    x = torch.randn(3, 64)
    expected = x @ torch.cat([first_dense, second_dense]).T
    torch.testing.assert_close(method.apply(layer, x, None), expected, atol=1e-4, rtol=1e-4)

    mixed = nn.Module()
    method.create_weights(mixed, 64, 48, torch.float32)
    (q8, q8_dense) = shard(8, 16, 3)
    method.load_weight(mixed, first, 0, 32)
    method.load_weight(mixed, q8, 32, 16)
    method.process_weights_after_loading(mixed)
    assert mixed.gguf_blocks is None
    torch.testing.assert_close(
        mixed.weight.to_dense() if mixed.weight.is_mkldnn else mixed.weight, torch.cat([first_dense, q8_dense])
    )
