"""The GPTQ and AWQ plugins: checkpoints in the layouts auto-gptq/gptqmodel and AutoAWQ save
(written here with a few lines of torch, tests/helpers/gptq_awq_files.py) served with the
quantization detected from config.json, agreeing with transformers on the same weights
dequantized by the helper's own unpacking (greedy tokens and top-5 logprobs, vLLM's
check_logprobs_close), with no dense float weight in any quantized layer: offline for each
layout, and once over HTTP with the openai client; the column plan act-order needs; the
loaders' tensor-parallel cuts and fused shards; every unsupported field refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import openai
import pytest
import torch
from helpers.compressed_tensors_files import write_random_llama
from helpers.gptq_awq_files import (
    awq_config,
    awq_dequantize,
    awq_layer,
    gptq_config,
    gptq_dequantize,
    gptq_layer,
    write_quantized,
)
from helpers.quantized_parity import (
    MAX_TOKENS,
    PROMPTS,
    TOP_LOGPROBS,
    check_logprobs_close,
    tokenloom_greedy,
    transformers_greedy,
)

from tokenloom.builtin_plugins.quantization import grouped_int
from tokenloom.builtin_plugins.quantization.awq import AWQConfig, AWQMethod
from tokenloom.builtin_plugins.quantization.gptq import GPTQConfig, GPTQMethod
from tokenloom.builtin_plugins.quantization.grouped_int import plan_columns
from tokenloom.errors import ConfigError, ModelLoadError
from tokenloom.layers.embedding import ParallelLMHead, QuantizedLMHead
from tokenloom.layers.linear import ColumnParallelLinear, LinearBase, QKVParallelLinear, RowParallelLinear


@pytest.fixture(scope="module")
def dense_llama_dir(tmp_path_factory, smollm2_gguf):
    return write_random_llama(tmp_path_factory.mktemp("dense-llama"), smollm2_gguf)


# (the other layouts differ from these only in what the layer tests below cover)
CASES = {
    "gptq-4bit-symmetric-group128": ("gptq", dict(bits=4, group_size=128)),
    "gptq-4bit-asymmetric-act-order-group32": ("gptq", dict(group_size=32, symmetric=False, desc_act=True)),
    "gptq-8bit-symmetric-group128": ("gptq", dict(bits=8, group_size=128)),
    # gptqmodel's lm_head=True: the (tied) head's codes on the int4 kernel, the embedding dense
    "gptq-4bit-asymmetric-group32-lm-head": ("gptq", dict(group_size=32, symmetric=False, lm_head=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_is_detected_and_agrees_with_transformers(case, dense_llama_dir, tmp_path, monkeypatch):
    from tokenloom import LLM

    monkeypatch.setenv("TOKENLOOM_CPU_KERNELS", "require")
    method, options = CASES[case]
    quantized, reference = write_quantized(dense_llama_dir, tmp_path, method, **options)
    llm = LLM(model=quantized, dtype="float32", max_model_len=128, seed=0)
    try:
        assert llm.engine.model_info.quantization == method  # from config.json, no flag
        check_logprobs_close(transformers_greedy(reference), tokenloom_greedy(llm))
        model = llm.engine.executor.worker.runner.model
        layers = [module for module in model.modules() if isinstance(module, LinearBase)]
        if options.get("lm_head"):
            assert isinstance(model.lm_head, QuantizedLMHead) and model.lm_head in layers
            assert model.model.embed_tokens.weight.shape == (model.lm_head.output_size, 128)  # dense, untied
        else:
            assert isinstance(model.lm_head, ParallelLMHead)  # dense
        # qkv, o, gate_up, down of each layer (and the head)
        assert len(layers) == 2 * 4 + bool(options.get("lm_head"))
        for layer in layers:
            assert isinstance(layer.quant_method, GPTQMethod if method == "gptq" else AWQMethod)
            # no dense weight, nor the checkpoint's tensors: the kernel's packed bytes only
            assert not [name for name, _ in layer.named_parameters(recurse=False)]
            if options.get("bits") == 8:
                packed = layer.int8_weight
            elif options.get("desc_act"):
                # act-order: columns gathered per call, so the fused decode operator (which reads
                # int4_weight) must not take the layer
                assert layer.input_columns is not None and not hasattr(layer, "int4_weight")
                packed = layer.permuted_weight
            else:
                assert layer.input_columns is None
                packed = layer.int4_weight
            assert packed.kernel is not None and packed.packed.dtype == torch.uint8
    finally:
        llm.engine.shutdown()


def test_a_quantization_flag_that_disagrees_with_the_checkpoint_is_refused(dense_llama_dir, tmp_path):
    from tokenloom import LLM

    quantized, _ = write_quantized(dense_llama_dir, tmp_path, "gptq", group_size=128)
    with pytest.raises(ConfigError, match="--quantization awq does not match .* 'gptq'"):
        LLM(model=quantized, quantization="awq", max_model_len=128)
    with pytest.raises(ConfigError, match="--quantization gptq needs a checkpoint whose config.json has a GPTQ"):
        LLM(model=dense_llama_dir, quantization="gptq", max_model_len=128)
    with pytest.raises(ConfigError, match="--quantization awq needs a checkpoint whose config.json has an AWQ"):
        LLM(model=dense_llama_dir, quantization="awq", max_model_len=128)


# -- over HTTP -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def awq_server(dense_llama_dir, tmp_path_factory):
    from tests.e2e.conftest import start_server, stop_server

    directory = tmp_path_factory.mktemp("awq")
    quantized, reference = write_quantized(dense_llama_dir, directory, "awq", group_size=64)
    server = start_server([quantized, "--dtype", "float32", "--max-model-len", "128"], str(directory / "serve.log"))
    yield server, reference
    stop_server(server)


def token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def test_an_awq_checkpoint_served_over_http_agrees_with_transformers(awq_server):
    server, reference = awq_server
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    served = []
    for prompt in PROMPTS:
        response = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=TOP_LOGPROBS,
            extra_body={"return_tokens_as_token_ids": True},  # "token_id:N", comparable with transformers' ids
        )
        logprobs = response.choices[0].logprobs
        tokens = [token_id(token) for token in logprobs.tokens]
        tops = [{token_id(token): value for token, value in top.items()} for top in logprobs.top_logprobs]
        served.append((tokens, tops))
    expected = transformers_greedy(reference)
    assert [len(tokens) for tokens, _ in served] == [MAX_TOKENS] * len(PROMPTS)
    check_logprobs_close(expected, served)


# -- the column plan --------------------------------------------------------------------------------


def test_the_column_plan_sorts_features_by_group_and_pads_each_group_to_32():
    identity = plan_columns(torch.arange(64) // 32, 2, "layer")
    assert identity.columns is None and identity.chunk_groups.tolist() == [0, 1]
    swapped = plan_columns(torch.tensor([1] * 32 + [0] * 32), 2, "layer")
    assert swapped.columns.tolist() == list(range(32, 64)) + list(range(32)) and not swapped.padded
    # groups of 16 (or a rank's part of a group): each run padded with the zero column (index 32)
    halves = plan_columns(torch.tensor([0, 1] * 16), 2, "layer")
    assert halves.columns.tolist() == list(range(0, 32, 2)) + [32] * 16 + list(range(1, 32, 2)) + [32] * 16
    assert halves.chunk_groups.tolist() == [0, 1] and halves.padded
    # a group no feature of this rank falls in takes no columns
    assert plan_columns(torch.full((32,), 2), 3, "layer").chunk_groups.tolist() == [2]
    with pytest.raises(ModelLoadError, match="layer x: g_idx names groups 0..3, but the checkpoint has scales for 2"):
        plan_columns(torch.tensor([0, 3]), 2, "x")


# -- layers: each layout's unpacking, tensor-parallel cuts, fused shards ---------------------------


class IdentityGroup:
    """A stand-in tensor-parallel group for one rank: ``all_reduce`` returns the partial sum."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def all_reduce(self, tensor):
        return tensor


def config_of(quantization_config):
    hf_config = SimpleNamespace(quantization_config=quantization_config)
    if quantization_config["quant_method"] == "gptq":
        return GPTQConfig.from_checkpoint(hf_config)
    return AWQConfig.from_checkpoint(hf_config)


def layer_tensors(method: str, weight: torch.Tensor, options: dict, order=None):
    """``(checkpoint tensors, their dequantized [N, K] weight, quantization_config)``."""
    if method == "awq":
        tensors = awq_layer(weight, options["group_size"])
        return tensors, awq_dequantize(tensors, options["group_size"]), awq_config(**options)
    config = gptq_config(**options)
    bits, fmt = config["bits"], config["checkpoint_format"]
    tensors = gptq_layer(weight, bits, config["group_size"], config["sym"], fmt, order)
    return tensors, gptq_dequantize(tensors, bits, fmt), config


def bound_layer(layer, config, prefix="model.layers.0.mlp.down_proj", shards=None):
    layer.quant_method = None
    layer._create_weights(config.get_method(layer, prefix, shards or (prefix,)))
    return layer


def loaded(layer, tensors, shard_id=None):
    for name, tensor in tensors.items():
        layer.load_checkpoint_weight(name, tensor, shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def assert_matches(actual: torch.Tensor, x: torch.Tensor, dense: torch.Tensor):
    """``actual`` is ``x @ dense.T`` up to the kernels' 8-bit activations (a per-32 scale)."""
    expected = x @ dense.T
    torch.testing.assert_close(actual, expected, atol=0.02 * float(expected.abs().max()), rtol=0)


LAYER_CASES = {
    "gptq-4bit-asymmetric-channel-v2": ("gptq", dict(group_size=-1, symmetric=False, checkpoint_format="gptq_v2")),
    "gptq-4bit-symmetric-group32": ("gptq", dict(group_size=32)),
    "gptq-4bit-act-order-group64": ("gptq", dict(group_size=64, symmetric=False, desc_act=True)),
    "gptq-8bit-act-order-group128": ("gptq", dict(bits=8, group_size=128, desc_act=True)),
    "awq-group64": ("awq", dict(group_size=64)),
    "awq-group128": ("awq", dict(group_size=128)),
}


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_tensor_parallel_ranks_cut_codes_along_their_packing(case, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CPU_KERNELS", "require")
    method, options = LAYER_CASES[case]
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(32, 256, generator=generator)
    order = torch.randperm(256, generator=generator) if options.get("desc_act") else None
    tensors, dense, quantization_config = layer_tensors(method, weight, options, order)
    config = config_of(quantization_config)
    x = torch.randn(3, 256, generator=generator)
    # row-parallel: each rank 128 input features (GPTQ packs them 8 or 4 to a word); its g_idx part,
    # and an act-order rank's features fall in parts of every group
    total = torch.zeros(3, 32)
    for rank in range(2):
        layer = bound_layer(RowParallelLinear(256, 32, quant_method=config, tp_group=IdentityGroup(rank, 2)), config)
        total += loaded(layer, tensors)(x[:, rank * 128 : (rank + 1) * 128])
    assert_matches(total, x, dense)
    # column-parallel rank 1: output features 16..31 (AWQ packs them 8 to a word, as both pack zero points)
    layer = bound_layer(ColumnParallelLinear(256, 32, quant_method=config, tp_group=IdentityGroup(1, 2)), config)
    assert_matches(loaded(layer, tensors)(x), x, dense[16:])
    assert not [name for name, _ in layer.named_parameters(recurse=False)]


def test_fused_shards_land_at_their_rows_and_must_order_features_alike(monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CPU_KERNELS", "require")
    generator = torch.Generator().manual_seed(5)
    order = torch.randperm(64, generator=generator)
    options = dict(group_size=32, desc_act=True)
    config = config_of(gptq_config(**options))
    shards = tuple(f"model.layers.0.self_attn.{name}_proj" for name in "qkv")

    def qkv_layer(orders):
        layer = QKVParallelLinear(64, 16, 2, 1, quant_method=config)
        bound_layer(layer, config, "model.layers.0.self_attn.qkv_proj", shards)
        dense = []
        for shard, rows in (("q", 32), ("k", 16), ("v", 16)):
            tensors, value, _ = layer_tensors(
                "gptq", torch.randn(rows, 64, generator=generator), options, orders[shard]
            )
            for name, tensor in tensors.items():
                layer.load_checkpoint_weight(name, tensor, shard)
            dense.append(value)
        return layer, torch.cat(dense)

    layer, dense = qkv_layer({"q": order, "k": order, "v": order})
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(2, 64, generator=generator)
    assert_matches(layer(x), x, dense)
    layer, _ = qkv_layer({"q": order, "k": order, "v": torch.randperm(64, generator=generator)})
    with pytest.raises(ModelLoadError, match="qkv_proj: the GPTQ modules fused into it .*g_idx differ"):
        layer.quant_method.process_weights_after_loading(layer)


class GatherGroup(IdentityGroup):
    """A stand-in group for rank 1 of 2 whose ``all_gather`` puts rank 0's logits (zeros) first."""

    def all_gather(self, tensor, dim):
        return torch.cat([torch.zeros_like(tensor), tensor], dim=dim)


def test_a_quantized_head_gives_float32_logits_of_its_share_of_the_vocabulary(monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CPU_KERNELS", "require")
    generator = torch.Generator().manual_seed(7)
    options = dict(group_size=32, symmetric=False, lm_head=True)
    tensors, dense, quantization_config = layer_tensors("gptq", torch.randn(64, 64, generator=generator), options)
    config = config_of(quantization_config)
    head = QuantizedLMHead(64, 64, quant_method=config, params_dtype=torch.bfloat16, tp_group=GatherGroup(1, 2))
    loaded(bound_layer(head, config, "lm_head"), tensors)
    assert isinstance(head.quant_method, GPTQMethod) and head.int4_weight.packed.dtype == torch.uint8
    x = torch.randn(3, 64, generator=generator)
    logits = head.compute_logits(x.to(torch.bfloat16))
    assert logits.dtype == torch.float32 and logits.shape == (3, 64)
    assert not logits[:, :32].any()  # rank 0's part, from the gather
    assert_matches(logits[:, 32:], x, dense[32:])
    # the config names the head by lm_head alone, whatever modules_in_block_to_quantize lists
    blocks = config_of({**quantization_config, "modules_in_block_to_quantize": [["mlp.down_proj"]]})
    assert blocks.quantizes("lm_head") and not config_of(gptq_config()).quantizes("lm_head")


def test_without_the_int8_kernel_the_codes_are_kept_and_scaled_per_call(monkeypatch):
    monkeypatch.setattr(grouped_int, "pack_int8", lambda codes, scales: None)  # kernels not built
    options = dict(bits=8, group_size=32)
    tensors, dense, quantization_config = layer_tensors("gptq", torch.randn(32, 64), options)
    config = config_of(quantization_config)
    layer = loaded(bound_layer(RowParallelLinear(64, 32, quant_method=config), config), tensors)
    assert layer.int8_codes.dtype == torch.int8 and not [name for name, _ in layer.named_parameters(recurse=False)]
    x = torch.randn(2, 64)
    torch.testing.assert_close(layer(x), x @ dense.T, atol=1e-4, rtol=1e-4)


def test_an_asymmetric_8bit_layer_in_a_symmetric_checkpoint_is_refused_at_load():
    options = dict(bits=8, group_size=32, symmetric=False)
    tensors, _, _ = layer_tensors("gptq", torch.randn(32, 64), options)
    config = config_of(gptq_config(bits=8, group_size=32))
    layer = bound_layer(RowParallelLinear(64, 32, quant_method=config), config)
    with pytest.raises(ModelLoadError, match="down_proj: 8-bit zero points other than 128"):
        loaded(layer, tensors)


def test_layers_left_out_stay_dense_and_a_fused_layer_must_agree():
    config = config_of({**gptq_config(), "modules_in_block_to_quantize": [["self_attn.q_proj"], ["mlp.down_proj"]]})
    down = RowParallelLinear(128, 32, quant_method=config)
    assert isinstance(
        config.get_method(down, "model.layers.0.mlp.down_proj", ("model.layers.0.mlp.down_proj",)), GPTQMethod
    )
    assert config.get_method(down, "model.layers.0.mlp.up_proj", ("model.layers.0.mlp.up_proj",)) is None
    qkv = QKVParallelLinear(128, 32, 4, 2, quant_method=config)
    shards = tuple(f"model.layers.0.self_attn.{name}_proj" for name in "qkv")
    with pytest.raises(ConfigError, match="GPTQ checkpoint quantizes some of the modules fused into .*qkv_proj"):
        config.get_method(qkv, "model.layers.0.self_attn.qkv_proj", shards)
    awq = config_of({**awq_config(), "modules_to_not_convert": ["down_proj"]})
    assert awq.get_method(down, "model.layers.1.mlp.down_proj", ("model.layers.1.mlp.down_proj",)) is None
    assert isinstance(awq.get_method(qkv, "model.layers.0.self_attn.qkv_proj", shards), AWQMethod)


# -- refusals ---------------------------------------------------------------------------------------


def refused(quantization_config) -> str:
    with pytest.raises(ConfigError) as error:
        config_of(quantization_config)
    return str(error.value)


def test_unsupported_fields_are_refused_by_name():
    assert "3-bit weights" in refused({**gptq_config(), "bits": 3})
    assert "2-bit weights" in refused({**gptq_config(), "bits": 2})
    assert "asymmetric 8-bit weights (sym: false" in refused(gptq_config(bits=8, symmetric=False))
    assert "checkpoint_format 'marlin'" in refused(gptq_config(checkpoint_format="marlin"))
    assert "checkpoint_format 'marlin'" in refused({**gptq_config(), "is_marlin_format": True})
    assert "per-module overrides (dynamic)" in refused({**gptq_config(), "dynamic": {"-:.*down": {}}})
    assert "a group size of 0" in refused(gptq_config(group_size=0))
    assert "the 'gemv' layout (version)" in refused({**awq_config(), "version": "GEMV"})
    assert "the 'exllama' layout (version)" in refused({**awq_config(), "version": "exllama"})
    assert "without zero points" in refused({**awq_config(), "zero_point": False})
    assert "8-bit weights" in refused({**awq_config(), "bits": 8})
    # static_groups and true_sequential only shaped quantization: served
    assert config_of({**gptq_config(desc_act=True), "static_groups": True}).bits == 4


def test_a_layer_the_kernels_cannot_hold_is_refused_by_name():
    config = config_of(gptq_config(group_size=128))
    with pytest.raises(ModelLoadError, match="layer m.o_proj: 96 input features are not a whole number of GPTQ groups"):
        config.get_method(RowParallelLinear(96, 32, quant_method=config), "m.o_proj", ("m.o_proj",))
    with pytest.raises(ModelLoadError, match="layer m.o_proj: this rank's 24 output features are not a multiple of 16"):
        config.get_method(RowParallelLinear(128, 24, quant_method=config), "m.o_proj", ("m.o_proj",))
