"""The ``gguf`` quantization method: packed weights dequantized into a linear layer at load."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from torch import nn

from tokenloom.builtin_plugins import quantization as gguf_quantization
from tokenloom.builtin_plugins.quantization.gguf import GGUFQuantizationMethod
from tokenloom.builtin_plugins.quantization.gguf_blocks import GGUFWeight
from tokenloom.errors import ConfigError, ModelLoadError
from tokenloom.kernels import int4_matmul
from tokenloom.kernels.int4_matmul import int4_linear
from tokenloom.kernels.int8_matmul import int8_linear
from tokenloom.layers.quantization import QuantizationConfig, QuantizationMethod
from tokenloom.plugins.registry import resolve_target

# on every CPU kernel level the host runs
pytestmark = pytest.mark.usefixtures("isa_level")


def q8_weight(rows: int, cols: int, seed: int, name: str = "blk.0.attn_q.weight") -> GGUFWeight:
    values = np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32)
    packed = quantize(values, GGMLQuantizationType.Q8_0)
    return GGUFWeight(
        torch.from_numpy(packed.copy()), int(GGMLQuantizationType.Q8_0), (rows, cols), name=name, path="/m/model.gguf"
    )


def make_layer(method: QuantizationMethod, input_size: int, output_size: int, dtype=torch.float32) -> nn.Module:
    layer = nn.Module()
    method.create_weights(layer, input_size, output_size, dtype)
    return layer


def test_loads_packed_shards_into_row_ranges_and_matmuls_with_the_dequantized_weight():
    method = GGUFQuantizationMethod()
    layer = make_layer(method, 64, 10)
    first, second = q8_weight(6, 64, seed=1), q8_weight(4, 64, seed=2)
    method.load_weight(layer, first, 0, 6)
    method.load_weight(layer, second, 6, 4)
    expected_weight = torch.cat([first.dequantize(), second.dequantize()])
    assert torch.equal(layer.weight, expected_weight)
    x = torch.randn(3, 64)
    bias = torch.randn(10)
    torch.testing.assert_close(method.apply(layer, x, bias), x @ expected_weight.T + bias)
    method.process_weights_after_loading(layer)


def test_dequantizes_into_the_model_dtype():
    """A shard no kernel takes (6 rows: not a block of 16) is dequantized once the layer is loaded."""
    method = GGUFQuantizationMethod()
    layer = make_layer(method, 64, 6, torch.bfloat16)
    weight = q8_weight(6, 64, seed=3)
    method.load_weight(layer, weight, 0, 6)
    method.process_weights_after_loading(layer)
    dense = layer.weight.to_dense() if layer.weight.is_mkldnn else layer.weight
    assert dense.dtype == torch.bfloat16
    assert torch.equal(dense, weight.dequantize().to(torch.bfloat16))


def test_dense_checkpoint_tensors_still_load():
    method = GGUFQuantizationMethod()
    layer = make_layer(method, 8, 4)
    dense = torch.randn(4, 8, dtype=torch.float16)
    method.load_weight(layer, dense, 0, 4)
    assert torch.equal(layer.weight, dense.float())


def test_shape_mismatch_names_the_tensor():
    method = GGUFQuantizationMethod()
    layer = make_layer(method, 32, 6)
    with pytest.raises(ModelLoadError, match="blk.0.attn_q.weight"):
        method.load_weight(layer, q8_weight(6, 64, seed=4), 0, 6)


def test_unsupported_quant_type_names_tensor_file_and_type():
    method = GGUFQuantizationMethod()
    layer = make_layer(method, 32, 2)
    weight = GGUFWeight(
        torch.zeros(2, 18, dtype=torch.uint8),
        int(GGMLQuantizationType.IQ4_NL),
        (2, 32),
        name="blk.7.ffn_down.weight",
        path="/m/model.gguf",
    )
    with pytest.raises(ModelLoadError) as error:
        method.load_weight(layer, weight, 0, 2)
    assert all(part in str(error.value) for part in ("blk.7.ffn_down.weight", "/m/model.gguf", "IQ4_NL"))


def test_modes_are_auto_by_default_and_unknown_ones_are_refused_by_name():
    assert GGUFQuantizationMethod().mode == "auto"
    with pytest.raises(ConfigError, match="packed.*auto, dequantize"):
        GGUFQuantizationMethod(mode="packed")


def q4_weight(rows: int, cols: int, seed: int, quant_type=GGMLQuantizationType.Q4_1) -> GGUFWeight:
    values = np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32)
    packed = quantize(values, quant_type)
    return GGUFWeight(torch.from_numpy(packed.copy()), int(quant_type), (rows, cols), name="blk.0.ffn_up.weight")


@pytest.fixture(params=["tokenloom", "torch"])
def int4_kernel(request):
    """Which int4 kernel the layers of the test pack their weights for."""
    if request.param == "tokenloom":
        if int4_matmul._native_kernel() is None:
            pytest.skip("tokenloom's CPU kernels are switched off or did not build")
        yield request.param
    else:
        with mock.patch.object(int4_matmul, "_native_kernel", lambda: None):
            yield request.param


def test_a_bfloat16_layer_of_4_bit_shards_keeps_them_packed(int4_kernel):
    method = GGUFQuantizationMethod()
    layer = make_layer(method, 64, 32, torch.bfloat16)
    first, second = q4_weight(16, 64, seed=1), q4_weight(16, 64, seed=2, quant_type=GGMLQuantizationType.Q4_0)
    method.load_weight(layer, first, 0, 16)
    method.load_weight(layer, second, 16, 16)
    method.process_weights_after_loading(layer)
    assert layer.int4_weight is not None
    dense = torch.cat([first.dequantize(), second.dequantize()])
    one_row, many_rows = torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(64, 64, dtype=torch.bfloat16)
    # the int4 kernel runs for one row, close to the exact dequantized weight
    expected = one_row.float() @ dense.T
    torch.testing.assert_close(
        method.apply(layer, one_row, None).float(), expected, rtol=0, atol=0.03 * expected.abs().max().item()
    )
    assert torch.equal(method.apply(layer, one_row, None), int4_linear(one_row, layer.int4_weight))
    if int4_kernel == "tokenloom":  # every batch: no dense weight is kept
        assert layer.weight.is_meta and layer.weight.shape == (32, 64)
        assert torch.equal(method.apply(layer, many_rows, None), int4_linear(many_rows, layer.int4_weight))
    else:  # large batches on the dense weight
        assert torch.equal(
            method.apply(layer, many_rows, None), torch.nn.functional.linear(many_rows, dense.to(torch.bfloat16))
        )


def test_a_float32_layer_runs_the_int4_kernel_unless_float32_was_asked_for(int4_kernel):
    method = GGUFQuantizationMethod()
    method.exact_dtype = False  # the platform chose float32 (--dtype auto)
    layer = make_layer(method, 64, 16, torch.float32)
    weight = q4_weight(16, 64, seed=3)
    method.load_weight(layer, weight, 0, 16)
    method.process_weights_after_loading(layer)
    assert layer.int4_weight is not None
    one_row = torch.randn(1, 64)
    out = method.apply(layer, one_row, None)
    expected = one_row @ weight.dequantize().T
    assert out.dtype == torch.float32 and torch.equal(out, int4_linear(one_row, layer.int4_weight))
    torch.testing.assert_close(out, expected, rtol=0, atol=0.03 * expected.abs().max().item())
    many_rows = torch.randn(64, 64)
    dense_product = torch.nn.functional.linear(many_rows, weight.dequantize())
    if int4_kernel == "tokenloom":  # float32 rows go into the kernel as they are
        assert torch.equal(method.apply(layer, many_rows, None), int4_linear(many_rows, layer.int4_weight))
    else:  # torch's kernel computes small batches in bfloat16, large ones stay dense float32
        assert layer.int4_weight.scales_and_zeros.dtype == torch.bfloat16
        assert torch.equal(method.apply(layer, many_rows, None), dense_product)

    exact = GGUFQuantizationMethod()  # exact_dtype True by default, as for --dtype float32
    float32_layer = make_layer(exact, 64, 16, torch.float32)
    exact.load_weight(float32_layer, q4_weight(16, 64, seed=3), 0, 16)
    exact.process_weights_after_loading(float32_layer)
    assert float32_layer.int4_weight is None
    assert torch.equal(exact.apply(float32_layer, many_rows, None), dense_product)


def test_mixed_shards_keep_one_packed_run_each_and_dequantize_mode_stays_dense():
    mixed_method = GGUFQuantizationMethod()
    mixed = make_layer(mixed_method, 64, 32, torch.bfloat16)
    mixed_method.load_weight(mixed, q4_weight(16, 64, seed=4), 0, 16)
    mixed_method.load_weight(mixed, q8_weight(16, 64, seed=5), 16, 16)
    mixed_method.process_weights_after_loading(mixed)
    assert mixed.int4_weight is None  # the fused decode operator takes all-int4 layers only
    rows = torch.randn(3, 64, dtype=torch.bfloat16)
    if int4_matmul._native_kernel() is not None:  # the Q4_1 rows on the int4 kernel, the Q8_0 rows on the int8 one
        int4_rows, int8_rows = mixed.native_segments
        assert mixed.weight.is_meta
        expected = torch.cat([int4_linear(rows, int4_rows), int8_linear(rows, int8_rows).to(torch.bfloat16)], dim=-1)
        assert torch.equal(mixed_method.apply(mixed, rows, None), expected)
    else:
        dense = torch.cat([q4_weight(16, 64, seed=4).dequantize(), q8_weight(16, 64, seed=5).dequantize()])
        assert torch.equal(mixed_method.apply(mixed, rows, None), torch.nn.functional.linear(rows, dense.bfloat16()))

    dense_only = GGUFQuantizationMethod(mode="dequantize")
    layer = make_layer(dense_only, 64, 16, torch.bfloat16)
    dense_only.load_weight(layer, q4_weight(16, 64, seed=6), 0, 16)
    dense_only.process_weights_after_loading(layer)
    assert layer.int4_weight is None and layer.native_segments is None and not layer.weight.is_meta


@pytest.mark.hook("register_quantization_methods")
def test_hook_registers_gguf_lazily_by_module_path():
    registered = []
    gguf_quantization.register_quantization_methods(
        register=lambda name, target, **o: registered.append((name, target))
    )
    assert registered[0] == ("gguf", "tokenloom.builtin_plugins.quantization.gguf_config:GGUFConfig")
    config_class = resolve_target(registered[0][1])
    assert issubclass(config_class, QuantizationConfig) and config_class.name == "gguf"
    # every linear layer of a GGUF model gets the one gguf method, whatever its name
    config = config_class.from_checkpoint(None)
    method = config.get_method(None, "model.layers.0.mlp.down_proj", ("model.layers.0.mlp.down_proj",))
    assert isinstance(method, GGUFQuantizationMethod) and method is config.get_method(None, "lm_head", ("lm_head",))


# -- tensor parallelism: each rank loads its slice of the packed tensor --------------------------


class IdentityGroup:
    """A stand-in tensor-parallel group for one rank (the collectives are tested in
    tests/distributed): ``all_reduce`` returns the partial product unchanged."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def all_reduce(self, tensor):
        return tensor


@pytest.mark.parametrize("mode", ["auto", "dequantize"])
def test_row_parallel_ranks_load_whole_block_column_slices_of_a_4bit_tensor(mode):
    from tokenloom.layers.linear import ColumnParallelLinear, RowParallelLinear

    values = np.random.default_rng(7).normal(size=(32, 192)).astype(np.float32)
    packed = GGUFWeight(
        torch.from_numpy(quantize(values, GGMLQuantizationType.Q4_1).copy()),
        int(GGMLQuantizationType.Q4_1),
        (32, 192),
        name="blk.0.ffn_down.weight",
    )
    dense = packed.dequantize()
    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(1))
    total = torch.zeros(3, 32)
    for rank in range(3):
        layer = RowParallelLinear(192, 32, quant_method=GGUFQuantizationMethod(mode), tp_group=IdentityGroup(rank, 3))
        layer.load_checkpoint_weight("weight", packed)
        layer.quant_method.process_weights_after_loading(layer)
        assert (layer.int4_weight is not None) == (
            mode == "auto" and layer.quant_method._int4_dtype(torch.float32) is not None
        )
        total += layer(x[:, rank * 64 : (rank + 1) * 64])
    torch.testing.assert_close(total, x @ dense.T, atol=1e-4, rtol=1e-4)
    # column-parallel ranks take whole packed rows
    layer = ColumnParallelLinear(192, 32, quant_method=GGUFQuantizationMethod(mode), tp_group=IdentityGroup(1, 2))
    layer.load_checkpoint_weight("weight", packed)
    layer.quant_method.process_weights_after_loading(layer)
    torch.testing.assert_close(layer(x), x @ dense[16:].T, atol=1e-4, rtol=1e-4)


def test_a_row_parallel_shard_inside_a_block_names_the_tensor():
    from tokenloom.layers.linear import RowParallelLinear

    packed = q8_weight(16, 64, seed=3, name="blk.2.attn_output.weight")
    layer = RowParallelLinear(64, 16, quant_method=GGUFQuantizationMethod(), tp_group=IdentityGroup(1, 4))
    with pytest.raises(ModelLoadError, match="blk.2.attn_output.weight.*inside a block"):
        layer.load_checkpoint_weight("weight", packed)
