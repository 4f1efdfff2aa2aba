"""Pipeline stages in the layers SDK: the layer split, the per-stage KV-cache numbering, and a
Gemma 3 built as two stages in one process: each holds only its modules, loads only its
tensors, and stage 1 after stage 0 computes exactly the whole model's logits."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from helpers.attention import PagedBatcher, allocate_kv_caches
from helpers.model_parity import perturb_parameters
from transformers import Gemma3ForCausalLM as HFGemma3ForCausalLM
from transformers import Gemma3TextConfig

from tokenloom.builtin_plugins.models.modeling_gemma3 import Gemma3ForCausalLM
from tokenloom.core.distributed import Communicator, ParallelRank, ParallelState
from tokenloom.core.model_interface import IntermediateTensors, ModelContext
from tokenloom.errors import ConfigError
from tokenloom.kernels.paged_attention import TorchPagedAttention
from tokenloom.layers.attention import Attention
from tokenloom.layers.pipeline import MissingLayer, stage_layers


def split(num_layers: int, pp_size: int) -> list[list[int]]:
    return [list(stage_layers(num_layers, ParallelRank.of(rank, 1, pp_size))) for rank in range(pp_size)]


def test_stage_layers_split_evenly_with_the_extra_layers_before_the_last_stage():
    assert split(5, 2) == [[0, 1, 2], [3, 4]]
    assert split(5, 3) == [[0, 1], [2, 3], [4]]
    assert split(30, 4) == [list(range(0, 7)), list(range(7, 15)), list(range(15, 23)), list(range(23, 30))]
    assert split(4, 4) == [[0], [1], [2], [3]]
    assert split(7, 1) == [list(range(7))]
    assert list(stage_layers(7, None)) == list(range(7))
    # tensor-parallel ranks of one stage hold the same layers
    assert stage_layers(5, ParallelRank.of(3, 2, 2)) == stage_layers(5, ParallelRank.of(2, 2, 2)) == range(3, 5)


def test_more_stages_than_layers_is_a_config_error_naming_both():
    with pytest.raises(ConfigError, match="2 decoder layers, fewer than the 3 pipeline stages"):
        stage_layers(2, ParallelRank.of(0, 1, 3))


def test_a_missing_layer_refuses_to_run():
    with pytest.raises(RuntimeError, match="another pipeline stage"):
        MissingLayer()(torch.zeros(1))


def tiny_config(**overrides) -> Gemma3TextConfig:
    settings = (
        dict(
            vocab_size=160,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=4,
            max_position_embeddings=128,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
        )
        | overrides
    )
    return Gemma3TextConfig(**settings)


def build(config, state_dict, place: ParallelRank | None):
    parallel = None if place is None else ParallelState(place=place, tp=Communicator(), pp=Communicator())
    ctx = ModelContext(hf_config=config, dtype=torch.float32, device=torch.device("cpu"), parallel=parallel)
    model = Gemma3ForCausalLM(ctx)
    loaded = model.load_weights(state_dict.items())
    return model.eval(), loaded


@pytest.mark.parametrize("tie_word_embeddings", [True, False], ids=["tied", "untied"])
def test_two_gemma3_stages_hold_their_modules_and_compute_the_whole_model(tie_word_embeddings, caplog):
    torch.manual_seed(5)
    config = tiny_config(tie_word_embeddings=tie_word_embeddings)
    state_dict = perturb_parameters(HFGemma3ForCausalLM(config).eval(), seed=5).state_dict()
    whole, _ = build(config, state_dict, None)
    with caplog.at_level(logging.WARNING):
        first, first_loaded = build(config, state_dict, ParallelRank.of(0, 1, 2))
        last, last_loaded = build(config, state_dict, ParallelRank.of(1, 1, 2))
    assert "skipped" not in caplog.text  # the other stage's tensors are not "unexpected"

    assert {name.split(".")[2] for name in first_loaded if name.startswith("model.layers.")} == {"0", "1"}
    assert {name.split(".")[2] for name in last_loaded if name.startswith("model.layers.")} == {"2", "3"}
    assert "model.embed_tokens.weight" in first_loaded and "model.norm.weight" not in first_loaded
    assert not any(name.startswith("lm_head.") for name in first_loaded)
    # the last stage keeps the embedding only when the LM head shares its weight
    assert ("model.embed_tokens.weight" in last_loaded) == tie_word_embeddings
    assert "model.norm.weight" in last_loaded
    assert first.kv_cache_spec.num_layers == last.kv_cache_spec.num_layers == 2
    assert first.kv_cache_spec.sliding_windows == [4, 4] and last.kv_cache_spec.sliding_windows == [None, None]
    for stage in (first, last):
        indices = [module.layer_index for module in stage.modules() if isinstance(module, Attention)]
        assert indices == [0, 1]

    # one prefill step of two prompts, then a decode step: the stages' caches are the whole
    # model's layers 0-1 and 2-3
    block_size = 4
    whole_caches = allocate_kv_caches(4, 16, block_size, 1, 16, torch.float32)
    stage_caches = allocate_kv_caches(4, 16, block_size, 1, 16, torch.float32)
    whole_batcher = PagedBatcher(whole_caches, block_size, TorchPagedAttention())
    stage_batcher = PagedBatcher(stage_caches, block_size, TorchPagedAttention())
    for new_tokens in ({"a": [2, 17, 99, 3, 42, 7, 8], "b": [2, 120, 4]}, {"a": [11], "b": [12]}):
        input_ids, positions, metadata = whole_batcher.step(new_tokens)
        stage_input_ids, stage_positions, stage_metadata = stage_batcher.step(new_tokens)
        with torch.no_grad():
            expected = whole.compute_logits(whole(input_ids, positions, metadata))
            intermediate = first(
                stage_input_ids, stage_positions, dataclasses.replace(stage_metadata, kv_caches=stage_caches[:2])
            )
            assert isinstance(intermediate, IntermediateTensors)
            hidden_states = last(
                None,
                stage_positions,
                dataclasses.replace(stage_metadata, kv_caches=stage_caches[2:]),
                intermediate_tensors=intermediate,
            )
            logits = last.compute_logits(hidden_states)
        assert torch.equal(logits, expected)
