"""The model runner's KV cache by ``--kv-cache-dtype``: the element type it allocates, how many
blocks a memory budget buys (an fp8 cache twice those of a 16-bit one), the per-layer scales
(1.0, or set by ``--calculate-kv-scales`` from the first step), and the refusals that name the
flag: ``fp8_inc``, and an attention backend that cannot read an fp8 cache. On a tiny random
Llama GGUF through the offline API (``LLM``)."""

from __future__ import annotations

import logging
from unittest import mock

import pytest
import torch
from gguf import GGMLQuantizationType
from helpers.gguf_files import tiny_model_state_dict, write_model_gguf

from tokenloom import LLM, SamplingParams
from tokenloom.core.config import EngineArgs
from tokenloom.errors import ConfigError
from tokenloom.kernels.paged_attention import NativeCpuPagedAttention, TorchPagedAttention

KV_CACHE_BYTES = 3 * 2**20
PROMPTS = [[5 + (7 * index + 3 * position) % 80 for position in range(9 + 5 * index)] for index in range(3)]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    config, state_dict = tiny_model_state_dict("llama", seed=3)
    path = str(tmp_path_factory.mktemp("llama") / "model.gguf")
    return write_model_gguf(path, "llama", config, state_dict, quant_type=GGMLQuantizationType.Q4_1)


def make_llm(model: str, **engine_args) -> LLM:
    return LLM(
        model=model,
        dtype="bfloat16",
        max_model_len=128,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        skip_tokenizer_init=True,
        **engine_args,
    )


def runner_of(llm: LLM):
    return llm.engine.executor.worker.runner


def greedy(llm: LLM, max_tokens: int = 8) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params)
    return [output.outputs[0].token_ids for output in outputs]


@pytest.fixture(scope="module")
def bfloat16_llm(tiny_llama):
    return make_llm(tiny_llama)


@pytest.mark.parametrize(
    "cache_dtype, element_type",
    [("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)],
)
def test_an_fp8_cache_holds_twice_the_blocks_in_the_same_memory(tiny_llama, bfloat16_llm, cache_dtype, element_type):
    llm = make_llm(tiny_llama, cache_dtype=cache_dtype)
    runner, bfloat16_runner = runner_of(llm), runner_of(bfloat16_llm)
    assert bfloat16_runner.kv_caches[0].dtype == torch.bfloat16
    assert all(cache.dtype == element_type for cache in runner.kv_caches)
    bytes_16 = sum(cache.numel() * cache.element_size() for cache in bfloat16_runner.kv_caches)
    bytes_8 = sum(cache.numel() * cache.element_size() for cache in runner.kv_caches)
    assert bytes_16 <= KV_CACHE_BYTES and bytes_8 <= KV_CACHE_BYTES
    # the budget is what limits both (not max_num_seqs * max_model_len)
    assert llm.engine.num_blocks in (2 * bfloat16_llm.engine.num_blocks, 2 * bfloat16_llm.engine.num_blocks + 1)
    # the scales of a cache nobody asked to calibrate: 1.0, as vLLM's defaults
    assert [(scales.k_scale, scales.v_scale, scales.pending) for scales in runner.kv_scales] == [
        (1.0, 1.0, False)
    ] * len(runner.kv_caches)
    tokens = greedy(llm)
    assert all(len(sequence) == 8 for sequence in tokens)
    assert runner.kv_caches[0].view(torch.uint8).any()  # the cache was written, in fp8


def test_a_16_bit_cache_has_no_scales(bfloat16_llm):
    assert runner_of(bfloat16_llm).kv_scales is None


def test_calculate_kv_scales_sets_each_layers_scales_from_the_first_step(tiny_llama):
    llm = make_llm(tiny_llama, cache_dtype="fp8", calculate_kv_scales=True)
    runner = runner_of(llm)
    assert all(scales.pending for scales in runner.kv_scales)
    greedy(llm, max_tokens=2)
    first = [(scales.k_scale, scales.v_scale) for scales in runner.kv_scales]
    assert all(not scales.pending for scales in runner.kv_scales)
    assert all(k_scale != 1.0 and v_scale != 1.0 for k_scale, v_scale in first)
    assert len(set(first)) == len(first)  # per layer
    # each layer's largest cached key is max|k| / 200 / k_scale = 200 (within fp8 rounding)
    largest_key = runner.kv_caches[0][0].float().abs().max().item()
    assert 192 <= largest_key <= 208
    greedy(llm, max_tokens=2)
    assert [(scales.k_scale, scales.v_scale) for scales in runner.kv_scales] == first


def test_calculate_kv_scales_with_a_16_bit_cache_is_said_to_do_nothing(tiny_llama, caplog):
    with caplog.at_level(logging.WARNING, logger="tokenloom.core.model_runner_kv_cache"):
        llm = make_llm(tiny_llama, calculate_kv_scales=True)
    assert runner_of(llm).kv_scales is None
    assert "--calculate-kv-scales has no effect" in caplog.text


def test_fp8_inc_is_refused_by_name():
    with pytest.raises(ConfigError, match="--kv-cache-dtype: fp8_inc .* use fp8, fp8_e4m3 or fp8_e5m2"):
        EngineArgs(model="x", cache_dtype="fp8_inc").create_engine_config()


def test_a_cache_type_tokenloom_does_not_build_is_refused_by_name(tiny_llama):
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8_ds_mla: not a KV-cache type"):
        make_llm(tiny_llama, cache_dtype="fp8_ds_mla")


def test_an_attention_backend_that_cannot_read_fp8_is_refused_by_name(tiny_llama):
    with (
        mock.patch.object(TorchPagedAttention, "supports_fp8_kv_cache", False),
        mock.patch.object(NativeCpuPagedAttention, "supports_fp8_kv_cache", False),
        pytest.raises(ConfigError, match="--kv-cache-dtype fp8_e5m2: the attention backend .* cannot read an fp8"),
    ):
        make_llm(tiny_llama, cache_dtype="fp8_e5m2")


def test_a_steps_never_used_blocks_are_mapped_before_it_runs_and_once():
    """Blocks from the mapped mark up to the high-water mark go to Platform.map_blocks before the
    step writes them; blocks already mapped (by it or the idle loop) never again; a platform that
    maps nothing is not asked again."""
    from tokenloom.core.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)
    runner.kv_caches = [torch.zeros((2, 100, 4, 1, 2)) for _ in range(2)]
    runner._kv_high_water, runner._kv_prefaulted, runner._kv_map_blocks_off = 0, 0, False
    runner.platform = mock.Mock()
    runner.platform.map_blocks.return_value = True
    runner.map_new_blocks()  # nothing handed out yet
    runner._kv_high_water = 7
    runner.map_new_blocks()
    runner.map_new_blocks()
    runner._kv_prefaulted = 30  # the idle loop mapped on
    runner._kv_high_water = 31
    runner.map_new_blocks()
    assert [call.args[1:] for call in runner.platform.map_blocks.call_args_list] == [(0, 7), (30, 31)]
    assert runner.platform.map_blocks.call_args_list[0].args[0] is runner.kv_caches
    assert runner._kv_prefaulted == 31
    runner.platform.map_blocks.return_value = False
    runner._kv_high_water = 40
    runner.map_new_blocks()
    runner._kv_high_water = 50
    runner.map_new_blocks()
    assert runner.platform.map_blocks.call_count == 3 and runner._kv_prefaulted == 31


def test_the_cpu_platform_maps_each_layers_k_and_v_pages_of_the_blocks():
    from tokenloom.builtin_plugins.platforms.cpu import CpuPlatform
    from tokenloom.kernels import page_mapping

    caches = [torch.zeros((2, 10, 4, 1, 2)) for _ in range(3)]
    with mock.patch.object(page_mapping, "populate") as populate:
        assert CpuPlatform().map_blocks(caches, 2, 5) is page_mapping.available()
    if page_mapping.available():
        spans = [(call.args[0].data_ptr(), call.args[0].shape) for call in populate.call_args_list]
        assert spans == [(cache[half, 2].data_ptr(), (3, 4, 1, 2)) for cache in caches for half in (0, 1)]
