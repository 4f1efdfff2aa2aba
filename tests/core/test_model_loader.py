"""The model loader's refusals that name what a model is: a mixture-of-experts checkpoint of an
architecture tokenloom does not serve is refused as one, through the offline API (``LLM``),
rather than as an unknown architecture or a checkpoint lacking its MLP weights; a Mixtral GGUF
(llama with experts), once refused so, loads."""

from __future__ import annotations

import types

import pytest
import torch
from helpers.gguf_files import write_mixtral_gguf

from tokenloom import LLM, SamplingParams
from tokenloom.core.config import ModelConfig
from tokenloom.core.model_interface import mixture_of_experts_error
from tokenloom.core.model_loader import derive_max_model_len
from tokenloom.errors import ConfigError, ModelLoadError

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def make_llm(model: str) -> LLM:
    return LLM(model=model, dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**20, skip_tokenizer_init=True)


def test_a_mixtral_gguf_loads_as_mixtral(tmp_path):
    """llama.cpp writes Mixtral as the llama architecture with expert_count: it was refused as an
    MoE model; it now builds MixtralForCausalLM (with all-zero experts here) and generates."""
    path = write_mixtral_gguf(str(tmp_path / "mixtral.gguf"), num_experts=4, experts_per_token=2)
    llm = make_llm(path)
    assert llm.engine.model_info.architecture == "MixtralForCausalLM"
    output = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(output[0].outputs[0].token_ids) == 3


def test_an_unserved_mixture_of_experts_checkpoint_is_refused_as_one(tmp_path):
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    torch.manual_seed(0)
    config = GraniteMoeConfig(**TINY, num_local_experts=8, num_experts_per_tok=2)
    GraniteMoeForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as raised:
        make_llm(str(tmp_path))
    message = str(raised.value)
    assert "GraniteMoeForCausalLM is a mixture-of-experts model (8 experts, 2 per token)" in message
    assert "Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, OlmoeForCausalLM and MixtralForCausalLM" in message
    assert "lacks" not in message


def test_a_dense_architecture_with_experts_in_its_config_is_refused_when_built(tmp_path):
    """A config naming a dense built-in (here by --hf-overrides) but stating experts: the dense
    layer refuses it instead of reporting its MLP weights as missing."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(**TINY, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8)
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"is a mixture-of-experts model \(6 experts, 2 per token\)"):
        LLM(
            model=str(tmp_path),
            dtype="float32",
            max_model_len=64,
            kv_cache_memory_bytes=2**20,
            skip_tokenizer_init=True,
            hf_overrides={"architectures": ["LlamaForCausalLM"]},
        )


@pytest.mark.parametrize(
    "fields",
    [{}, {"num_experts": None}, {"num_local_experts": 1}, {"num_experts": 0}],
    ids=["none", "none-value", "one-expert", "zero"],
)
def test_dense_configs_are_not_taken_for_mixtures(fields):
    assert mixture_of_experts_error(types.SimpleNamespace(**fields), "LlamaForCausalLM") is None


def test_a_max_model_len_past_the_models_context_is_a_flag_error_saying_what_to_pass():
    """A start-up flag error (the CLI: exit 2, one line, no traceback hint), not a request's
    ContextLengthError; the message gives the largest value that works."""
    hf_config = types.SimpleNamespace(max_position_embeddings=128)
    with pytest.raises(
        ConfigError,
        match=r"^--max-model-len 4096 is larger than the model's context length 128; "
        r"pass --max-model-len 128 or less \(or leave it out\)$",
    ):
        derive_max_model_len(hf_config, ModelConfig(max_model_len=4096))
    assert derive_max_model_len(hf_config, ModelConfig(max_model_len=128)) == 128
