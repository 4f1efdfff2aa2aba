"""The compressed-tensors plugin: checkpoints as llm-compressor writes them (made here with a few
lines of torch, tests/helpers/compressed_tensors_files.py) served by the offline LLM with the
quantization detected from config.json, agreeing with transformers on the same weights
dequantized (greedy tokens and top-5 logprobs, as vLLM's check_logprobs_close compares), with no
dense float weight in any quantized layer; the loaders' tensor-parallel cuts; the per-layer
choice; every unsupported scheme refused by name."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from helpers.compressed_tensors_files import (
    quantize_fp8,
    quantize_w4a16,
    quantize_w8a8,
    quantize_w8a16,
    scheme_config,
    write_compressed,
    write_random_llama,
)
from helpers.quantized_parity import check_logprobs_close, tokenloom_greedy, transformers_greedy

from tokenloom.builtin_plugins.quantization.compressed_tensors import (
    CompressedTensorsConfig,
    Int4PackedMethod,
    Int8ChannelMethod,
    Scheme,
    Weight8Method,
)
from tokenloom.errors import ConfigError, ModelLoadError
from tokenloom.layers.linear import ColumnParallelLinear, LinearBase, QKVParallelLinear, RowParallelLinear


@pytest.fixture(scope="module")
def dense_llama_dir(tmp_path_factory, smollm2_gguf):
    return write_random_llama(tmp_path_factory.mktemp("dense-llama"), smollm2_gguf)


# (groups of 32 and static activation scales differ from these only in what the unit tests
# below cover: the repeat factor of the scales, and loading input_scale)
SCHEMES = {
    "w4a16-group128-asymmetric": dict(scheme="W4A16", group_size=128, symmetric=False),
    "w4a16-channel-symmetric": dict(scheme="W4A16", group_size=None, symmetric=True),
    "w8a8-dynamic-per-token": dict(scheme="W8A8"),
    "w8a16-int8-group128-packed": dict(scheme="W8A16", group_size=128),
    "fp8-tensor-weights-static-activations": dict(scheme="FP8"),
    "fp8-channel-weights-dynamic-per-token": dict(scheme="FP8_DYNAMIC"),
    "fp8-channel-weights-only": dict(scheme="FP8_W8A16"),
}
METHODS = {"W4A16": Int4PackedMethod, "W8A8": Int8ChannelMethod}


@pytest.mark.parametrize("case", list(SCHEMES))
def test_a_checkpoint_is_detected_and_agrees_with_transformers(case, dense_llama_dir, tmp_path, monkeypatch):
    from tokenloom import LLM

    monkeypatch.setenv("TOKENLOOM_CPU_KERNELS", "require")
    compressed, reference = write_compressed(dense_llama_dir, tmp_path, **SCHEMES[case])
    llm = LLM(model=compressed, dtype="float32", max_model_len=128, seed=0)
    try:
        assert llm.engine.model_info.quantization == "compressed-tensors"  # from config.json, no flag
        check_logprobs_close(transformers_greedy(reference), tokenloom_greedy(llm))
        model = llm.engine.executor.worker.runner.model
        quantized = [module for module in model.modules() if isinstance(module, LinearBase)]
        assert len(quantized) == 2 * 4  # qkv, o, gate_up, down of each layer; the LM head is ignored
        method_class = METHODS.get(SCHEMES[case]["scheme"], Weight8Method)
        for layer in quantized:
            assert isinstance(layer.quant_method, method_class)
            # no dense weight: the kernel's packed bytes only
            assert not [name for name, p in layer.named_parameters(recurse=False) if p.is_floating_point()]
            if method_class is Weight8Method:  # one byte per weight
                w8 = layer.w8_weight
                assert w8.kernel is not None and w8.codes.dtype == torch.uint8
                assert w8.codes.numel() == layer.output_size * layer.input_size
                assert w8.fp8 == SCHEMES[case]["scheme"].startswith("FP8")
            else:
                packed = layer.w8a8_weight if method_class is Int8ChannelMethod else layer.int4_weight
                assert packed.kernel is not None and packed.packed.dtype == torch.uint8
    finally:
        llm.engine.shutdown()


def test_a_quantization_flag_that_disagrees_with_the_checkpoint_is_refused(dense_llama_dir, tmp_path):
    from tokenloom import LLM

    compressed, _ = write_compressed(dense_llama_dir, tmp_path, scheme="W8A8")
    with pytest.raises(ConfigError, match="--quantization gguf does not match .* 'compressed-tensors'"):
        LLM(model=compressed, quantization="gguf", max_model_len=128)
    with pytest.raises(ConfigError, match="needs a checkpoint whose config.json has a compressed-tensors"):
        LLM(model=dense_llama_dir, quantization="compressed-tensors", max_model_len=128)


# -- the config: per-layer schemes and refusals ---------------------------------------------------


def config_of(quantization_config):
    return CompressedTensorsConfig.from_checkpoint(SimpleNamespace(quantization_config=quantization_config))


def test_each_layer_gets_its_group_by_name_and_the_ignore_list_wins():
    quantization_config = scheme_config("W4A16", group_size=32)
    w8a8 = scheme_config("W8A8")["config_groups"]["group_0"]
    quantization_config["config_groups"]["down"] = {**w8a8, "targets": ["re:.*mlp\\.down_proj$"]}
    quantization_config["ignore"] = ["lm_head", "model.layers.1.mlp.down_proj"]
    config = config_of(quantization_config)
    layer = RowParallelLinear(64, 32, quant_method=config)
    assert isinstance(
        config.get_method(layer, "model.layers.0.mlp.down_proj", ("model.layers.0.mlp.down_proj",)), Int8ChannelMethod
    )
    assert config.get_method(layer, "model.layers.1.mlp.down_proj", ("model.layers.1.mlp.down_proj",)) is None
    qkv = QKVParallelLinear(64, 16, 2, 2, quant_method=config)
    shards = tuple(f"model.layers.0.self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj"))
    method = config.get_method(qkv, "model.layers.0.self_attn.qkv_proj", shards)
    assert isinstance(method, Int4PackedMethod) and method.scheme == Scheme("w4a16", 32, True)
    # a fused layer whose checkpoint modules are quantized differently cannot be one matmul
    quantization_config["ignore"] = ["model.layers.0.self_attn.k_proj"]
    with pytest.raises(ConfigError, match="qkv_proj .*k_proj.* differently"):
        config_of(quantization_config).get_method(qkv, "model.layers.0.self_attn.qkv_proj", shards)


def test_bind_layers_gives_each_layer_its_method_by_module_name():
    from tokenloom.layers.decoder import GatedMLP

    quantization_config = scheme_config("W4A16", group_size=32)
    quantization_config["ignore"] = ["mlp.down_proj"]
    config = config_of(quantization_config)
    model = torch.nn.Module()
    model.mlp = GatedMLP(64, 32, "silu", quant_method=config)
    model.stacked_params = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
    assert model.mlp.gate_up_proj.quant_method is None and not hasattr(model.mlp.gate_up_proj, "weight")
    config.bind_layers(model)
    assert isinstance(model.mlp.gate_up_proj.quant_method, Int4PackedMethod)
    assert model.mlp.down_proj.quant_method.name == "none" and model.mlp.down_proj.weight.shape == (64, 32)
    assert model.mlp.gate_up_proj.weight_packed.shape == (64, 64 // 8)


def refused(mutate) -> str:
    quantization_config = copy.deepcopy(scheme_config("W4A16", group_size=32))
    mutate(quantization_config, quantization_config["config_groups"]["group_0"])
    with pytest.raises(ConfigError) as error:
        config_of(quantization_config)
    return str(error.value)


def test_w8a16_and_fp8_schemes_are_read():
    assert config_of(scheme_config("W8A16", group_size=None)).groups[0][1] == Scheme("w8a16", None, True, packed=True)
    int_quantized = scheme_config("W8A16", group_size=64)
    int_quantized["config_groups"]["group_0"]["format"] = "int-quantized"
    assert config_of(int_quantized).groups[0][1] == Scheme("w8a16", 64, True)
    assert config_of(scheme_config("FP8")).groups[0][1] == Scheme(
        "fp8", None, True, static_input_scale=True, tensor_scale=True
    )
    assert config_of(scheme_config("FP8_DYNAMIC")).groups[0][1] == Scheme("fp8", None, True)
    assert config_of(scheme_config("FP8_W8A16")).groups[0][1] == Scheme("fp8", None, True)


def refused_fp8(mutate, scheme="FP8_DYNAMIC") -> str:
    quantization_config = copy.deepcopy(scheme_config(scheme))
    mutate(quantization_config, quantization_config["config_groups"]["group_0"])
    with pytest.raises(ConfigError) as error:
        config_of(quantization_config)
    return str(error.value)


def test_unsupported_schemes_are_refused_by_name():
    assert "8-bit float weights in format 'pack-quantized'" in refused(
        lambda c, g: g["weights"].update(type="float", num_bits=8)
    )
    assert "'group' fp8 weight scales (block-wise" in refused_fp8(lambda c, g: g["weights"].update(strategy="group"))
    assert "'block' fp8 weight scales" in refused_fp8(lambda c, g: g["weights"].update(strategy="block"))
    assert "4-bit float weights" in refused_fp8(lambda c, g: g["weights"].update(num_bits=4))
    assert "asymmetric fp8 weights" in refused_fp8(lambda c, g: g["weights"].update(symmetric=False))
    assert "in format 'int-quantized'" in refused_fp8(lambda c, g: g.update(format="int-quantized"))
    assert "8-bit int activations" in refused_fp8(lambda c, g: g["input_activations"].update(type="int"))
    assert "'group' fp8 activation scales" in refused_fp8(lambda c, g: g["input_activations"].update(strategy="group"))
    assert "'token' fp8 activation scales (dynamic=False)" in refused_fp8(
        lambda c, g: g["input_activations"].update(dynamic=False)
    )
    assert "kv_cache_scheme" in refused_fp8(lambda c, g: c.update(kv_cache_scheme={"num_bits": 8, "type": "float"}))
    assert "asymmetric 8-bit weights" in refused(lambda c, g: g["weights"].update(num_bits=8, symmetric=False))
    assert "8-bit weights in format 'float-quantized'" in refused(
        lambda c, g: (g["weights"].update(num_bits=8), g.update(format="float-quantized"))
    )
    assert "'group' (weights with g_idx)" in refused(lambda c, g: g["weights"].update(actorder="group"))
    assert "group size of 16" in refused(lambda c, g: g["weights"].update(group_size=16))
    assert "'tensor' weight scales" in refused(lambda c, g: g["weights"].update(strategy="tensor"))
    assert "not 'compressed'" in refused(lambda c, g: c.update(quantization_status="frozen"))
    assert "kv_cache_scheme" in refused(lambda c, g: c.update(kv_cache_scheme={"num_bits": 8}))
    assert "sparsity" in refused(lambda c, g: c.update(sparsity_config={"format": "sparse-24-bitmask"}))
    assert "'float-quantized'" in refused(lambda c, g: g.update(format="float-quantized"))


# -- the loaders: tensor-parallel cuts of packed tensors ------------------------------------------


class IdentityGroup:
    """A stand-in tensor-parallel group for one rank: ``all_reduce`` returns the partial sum."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def all_reduce(self, tensor):
        return tensor


def kernel_reference(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """``x @ dense.T`` with ``x`` quantized per group of 32 as the kernels quantize it."""
    from tokenloom.kernels.int4_matmul import quantize_activations

    codes, scales = quantize_activations(x)
    return (codes.view(x.shape[0], -1, 32) * scales.unsqueeze(-1)).view(x.shape) @ dense.T


def per_token_reference(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """``x @ dense.T`` with ``x`` quantized per token as the W8A8 kernel quantizes it."""
    from tokenloom.kernels.w8a8_matmul import quantize_tokens

    codes, scales = quantize_tokens(x)
    return (codes.float() * scales.unsqueeze(-1)) @ dense.T


def load(layer, tensors, shard_id=None):
    for name, tensor in tensors.items():
        layer.load_checkpoint_weight(name, tensor, shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("group_size, symmetric", [(64, False), (None, True), (32, True)])
def test_tensor_parallel_ranks_cut_packed_codes_scales_and_zero_points(group_size, symmetric, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CPU_KERNELS", "require")
    weight = torch.randn(32, 256, generator=torch.Generator().manual_seed(3))
    tensors, dense = quantize_w4a16(weight, group_size, symmetric)
    method = Int4PackedMethod(Scheme("w4a16", group_size, symmetric))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    expected = kernel_reference(x, dense)
    # row-parallel: each rank whole rows of its 128 columns (codes, group scales); a channel scale whole
    total = torch.zeros(3, 32)
    for rank in range(2):
        layer = load(RowParallelLinear(256, 32, quant_method=method, tp_group=IdentityGroup(rank, 2)), tensors)
        total += layer(x[:, rank * 128 : (rank + 1) * 128])
    torch.testing.assert_close(total, expected, atol=2e-3, rtol=1e-3)
    # column-parallel rank 1: rows 16..31, and zero points packed 8 rows to an element: elements 2..3
    layer = load(ColumnParallelLinear(256, 32, quant_method=method, tp_group=IdentityGroup(1, 2)), tensors)
    torch.testing.assert_close(layer(x), expected[:, 16:], atol=2e-3, rtol=1e-3)


def test_fused_shards_land_at_their_rows_and_static_scales_per_shard(monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CPU_KERNELS", "require")
    generator = torch.Generator().manual_seed(5)
    weights = {shard: torch.randn(rows, 64, generator=generator) for shard, rows in (("q", 32), ("k", 16), ("v", 16))}
    layer = QKVParallelLinear(64, 16, 2, 1, quant_method=Int8ChannelMethod(Scheme("w8a8", None, True, True)))
    dense = []
    for shard, weight in weights.items():
        tensors, value = quantize_w8a8(weight)
        tensors["input_scale"] = torch.tensor([0.5 if shard == "k" else 0.25])
        for name, tensor in tensors.items():
            layer.load_checkpoint_weight(name, tensor, shard)
        dense.append(value)
    assert layer.input_scale.tolist() == [0.25, 0.5, 0.25]
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(2, 64, generator=generator)
    torch.testing.assert_close(layer(x), per_token_reference(x, torch.cat(dense)), atol=2e-4, rtol=1e-4)


def test_fp8_tensor_scales_of_fused_shards_cover_their_rows(monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CPU_KERNELS", "require")
    generator = torch.Generator().manual_seed(8)
    scheme = Scheme("fp8", None, True, static_input_scale=True, tensor_scale=True)
    layer = QKVParallelLinear(64, 16, 2, 1, quant_method=Weight8Method(scheme))
    dense = []
    for shard, rows in (("q", 32), ("k", 16), ("v", 16)):
        # each shard its own magnitude, so its own per-tensor scale
        weight = torch.randn(rows, 64, generator=generator) * (4.0 if shard == "k" else 1.0)
        tensors, value = quantize_fp8(weight, per_tensor=True)
        tensors["input_scale"] = torch.tensor([0.1])
        for name, tensor in tensors.items():
            layer.load_checkpoint_weight(name, tensor, shard)
        dense.append(value)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (3,)
    layer.quant_method.process_weights_after_loading(layer)
    assert not hasattr(layer, "weight") and layer.w8_weight.fp8
    x = torch.randn(3, 64, generator=generator)
    torch.testing.assert_close(layer(x), x @ torch.cat(dense).T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("group_size", [None, 64])
def test_tensor_parallel_ranks_cut_packed_8bit_codes_and_scales(group_size, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CPU_KERNELS", "require")
    weight = torch.randn(32, 256, generator=torch.Generator().manual_seed(3))
    tensors, dense = quantize_w8a16(weight, group_size)
    method = Weight8Method(Scheme("w8a16", group_size, True, packed=True))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    total = torch.zeros(3, 32)
    for rank in range(2):
        layer = load(RowParallelLinear(256, 32, quant_method=method, tp_group=IdentityGroup(rank, 2)), tensors)
        assert not layer.w8_weight.fp8 and layer.w8_weight.codes.numel() == 32 * 128
        total += layer(x[:, rank * 128 : (rank + 1) * 128])
    torch.testing.assert_close(total, x @ dense.T, atol=1e-4, rtol=1e-4)
    layer = load(ColumnParallelLinear(256, 32, quant_method=method, tp_group=IdentityGroup(1, 2)), tensors)
    torch.testing.assert_close(layer(x), x @ dense[16:].T, atol=1e-4, rtol=1e-4)


def test_a_tensor_the_method_did_not_create_is_refused_by_name():
    layer = RowParallelLinear(64, 32, quant_method=Int4PackedMethod(Scheme("w4a16", 32, True)))
    with pytest.raises(ModelLoadError, match="no parameter 'weight_g_idx'.* loads weight_packed, weight_scale"):
        layer.load_checkpoint_weight("weight_g_idx", torch.zeros(64, dtype=torch.int32))
    with pytest.raises(ModelLoadError, match="'weight_scale': checkpoint shape \\(32, 4\\) does not fit \\(32, 2\\)"):
        layer.load_checkpoint_weight("weight_scale", torch.zeros(32, 4))


def test_without_the_int8_kernel_the_codes_are_kept_and_scaled_per_call(monkeypatch):
    from tokenloom.builtin_plugins.quantization import compressed_tensors

    monkeypatch.setattr(compressed_tensors, "pack_w8a8", lambda codes, scales: None)  # kernels not built
    tensors, dense = quantize_w8a8(torch.randn(32, 64, generator=torch.Generator().manual_seed(6)))
    layer = load(RowParallelLinear(64, 32, quant_method=Int8ChannelMethod(Scheme("w8a8", None, True))), tensors)
    assert layer.int8_codes.dtype == torch.int8 and not hasattr(layer, "weight")
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(layer(x), x @ dense.T, atol=1e-4, rtol=1e-4)
