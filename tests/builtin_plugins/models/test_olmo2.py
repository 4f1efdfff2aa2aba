"""Olmo2ForCausalLM against transformers on tiny random models, from safetensors and from GGUF
(llama.cpp's ``olmo2`` architecture): norms after attention and after the MLP and none before,
q/k RMSNorm over the whole projection (grouped-query, so the key norm is narrower), tied and
untied; every position's logits through the paged cache, greedy ids through the engine; the
projection norm split over tensor-parallel ranks; and checkpoints with a tensor too many or
too few refused by name."""

from __future__ import annotations

import pytest
import torch
from helpers.model_parity import (
    assert_greedy_agrees,
    assert_matches_transformers,
    assert_served_greedy_agrees,
    build_model,
    hf_greedy_top_k,
    load_checkpoint,
    randomize_parameters,
    saved_checkpoint,
    served_greedy_top_k,
)
from transformers import Olmo2Config
from transformers import Olmo2ForCausalLM as HFOlmo2ForCausalLM

from tokenloom import LLM
from tokenloom.builtin_plugins.models import register_models
from tokenloom.builtin_plugins.models.modeling_olmo2 import Olmo2ForCausalLM, ProjectionRMSNorm
from tokenloom.errors import ModelLoadError

PROMPTS = [[9, 14, 130, 3, 57, 71], [100, 6, 28], [45, 2, 19, 88, 110, 7, 36, 52, 9, 140]]
TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rope_theta=500000.0,
    rms_norm_eps=1e-6,
    pad_token_id=1,
    eos_token_id=2,
)


def hf_olmo2(seed: int = 0, **overrides) -> HFOlmo2ForCausalLM:
    torch.manual_seed(seed)
    return randomize_parameters(HFOlmo2ForCausalLM(Olmo2Config(**{**TINY, **overrides})).eval(), seed)


@pytest.mark.parametrize("load_format", ["safetensors", "gguf"])
@pytest.mark.parametrize("tie_word_embeddings", [False, True], ids=["untied", "tied"])
def test_olmo2_matches_transformers(load_format, tie_word_embeddings, tmp_path):
    hf_model = hf_olmo2(seed=3, tie_word_embeddings=tie_word_embeddings)
    config, weights = load_checkpoint(load_format, hf_model, tmp_path)
    assert config.tie_word_embeddings == tie_word_embeddings
    model, loaded = build_model(Olmo2ForCausalLM, config, weights)
    assert {
        "model.layers.2.self_attn.q_norm.weight",
        "model.layers.2.self_attn.k_norm.weight",
        "model.layers.2.post_feedforward_layernorm.weight",
    } <= loaded
    attention = model.model.layers[0].self_attn
    assert (attention.q_norm.num_features, attention.k_norm.num_features) == (64, 32)
    assert_matches_transformers(model, hf_model, PROMPTS, num_new_tokens=8)


@pytest.mark.parametrize("load_format", ["safetensors", "gguf"])
def test_olmo2_served_greedy_matches_transformers(load_format, tmp_path):
    """Through the engine (scheduler, paged cache, sampler) as a server runs it."""
    hf_model = hf_olmo2(seed=8)
    assert_served_greedy_agrees(hf_model, saved_checkpoint(load_format, hf_model, tmp_path), PROMPTS)


def test_olmo2_with_two_tensor_parallel_ranks_matches_transformers(tmp_path):
    """-tp 2 with one KV head: each rank normalises its half of the queries and the replicated
    key over the whole projection (the sum of squares all-reduced)."""
    hf_model = hf_olmo2(seed=8, num_key_value_heads=1)
    with torch.no_grad():
        # rank 1's query heads 4x rank 0's: a norm over one rank's half would equalise them
        for layer in hf_model.model.layers:
            layer.self_attn.q_proj.weight[32:] *= 4
    expected = [hf_greedy_top_k(hf_model, prompt, 10) for prompt in PROMPTS]
    hf_model.save_pretrained(str(tmp_path))
    llm = LLM(
        model=str(tmp_path),
        dtype="float32",
        tensor_parallel_size=2,
        max_model_len=64,
        kv_cache_memory_bytes=2**20,
        skip_tokenizer_init=True,
    )
    try:
        assert_greedy_agrees(served_greedy_top_k(llm, PROMPTS, 10), expected)
    finally:
        llm.engine.shutdown()


class TwoRanks:
    """Rank ``rank`` of a two-rank group whose other rank contributed ``other`` to the sum."""

    size = 2

    def __init__(self, rank: int, other: torch.Tensor | None = None):
        self.rank, self.other = rank, other

    def all_reduce(self, tensor):
        return tensor + self.other


@pytest.mark.parametrize(
    ("total_features", "rows"),
    [(8, [(0, 4), (4, 4)]), (4, [(0, 4), (0, 4)])],
    ids=["split", "replicated-kv-head"],
)
def test_projection_norm_over_ranks_equals_the_whole(total_features, rows):
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(5, total_features, generator=generator), torch.randn(total_features, generator=generator)
    whole = ProjectionRMSNorm(total_features, (0, total_features), 1e-6)
    whole.load_checkpoint_weight("weight", weight)
    parts = []
    for rank, (first, count) in enumerate(rows):
        other_first, other_count = rows[1 - rank]
        other = x[:, other_first : other_first + other_count].pow(2).sum(-1, keepdim=True)
        norm = ProjectionRMSNorm(total_features, (first, count), 1e-6, tp_group=TwoRanks(rank, other))
        norm.load_checkpoint_weight("weight", weight)
        parts.append(norm(x[:, first : first + count]))
    expected = whole(x)
    if rows[0] == rows[1]:
        torch.testing.assert_close(parts[0], expected)
        torch.testing.assert_close(parts[1], expected)
    else:
        torch.testing.assert_close(torch.cat(parts, dim=-1), expected)


def test_a_checkpoint_without_q_k_norms_is_refused():
    hf_model = hf_olmo2()
    weights = [(name, tensor) for name, tensor in hf_model.state_dict().items() if "k_norm" not in name]
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.k_norm\.weight"):
        build_model(Olmo2ForCausalLM, hf_model.config, weights)


def test_a_pre_norm_in_the_checkpoint_is_refused():
    """OLMo (1) style pre-norms have no place in OLMo 2: named, not dropped."""
    hf_model = hf_olmo2()
    weights = [*hf_model.state_dict().items(), ("model.layers.1.input_layernorm.weight", torch.ones(64))]
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.input_layernorm\.weight"):
        build_model(Olmo2ForCausalLM, hf_model.config, weights)


def test_registration():
    registered = {}
    register_models(lambda name, target, **options: registered.setdefault(name, target))
    expected = {"Olmo2ForCausalLM": "tokenloom.builtin_plugins.models.modeling_olmo2:Olmo2ForCausalLM"}
    assert {name: registered[name] for name in expected} == expected
