"""The Transformers fallback (``--model-impl``): transformers' own modeling code with tokenloom's
paged attention plugged into its attention interface. Tiny random checkpoints of architectures
with no native plugin (GPT-NeoX: fused QKV, partial rotary, parallel residual, a renamed LM head;
Starcoder2: GQA, biases, a 4-token sliding window; Cohere: tied head, logit scale) and of ones with
a native plugin (Qwen2, forced with ``--model-impl transformers``, also from a Q8_0 GGUF; Gemma 2:
its own attention scale, soft caps and alternating windows), compared with transformers:
every position's logits through the paged cache, greedy ids through the engine (a concurrent
batch of mixed lengths, prefilled in chunks, then a prefix-cache hit); and the start-up errors
of ``--model-impl`` and of models the fallback cannot run."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.model_parity import (
    assert_greedy_agrees,
    assert_matches_transformers,
    build_model,
    hf_greedy_top_k,
    randomize_parameters,
    served_greedy_top_k,
)

from tokenloom import LLM, SamplingParams
from tokenloom.builtin_plugins.models import register_models
from tokenloom.builtin_plugins.models.transformers_fallback import TransformersForCausalLM
from tokenloom.core.config import EngineArgs
from tokenloom.core.model_loader import TRANSFORMERS_FALLBACK, resolve_model
from tokenloom.errors import ConfigError, ModelLoadError, UnknownNameError
from tokenloom.plugins.manager import load_plugins

PROMPTS = [[9, 14, 130, 3, 57, 71], [100, 6, 28], [45, 2, 19, 88, 110, 7, 36, 52, 9, 140]]
SHAPE = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
CONFIGS = {
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**SHAPE, rotary_pct=0.5),
    "starcoder2": lambda: transformers.Starcoder2Config(**SHAPE, num_key_value_heads=2, sliding_window=4),
    "cohere": lambda: transformers.CohereConfig(**SHAPE, num_key_value_heads=2, logit_scale=0.5),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE, num_key_value_heads=2, tie_word_embeddings=False),
    # a scale from query_pre_attn_scalar, attention and final soft caps, alternating sliding windows
    "gemma2": lambda: transformers.Gemma2Config(
        **SHAPE,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=4,
        attn_logit_softcapping=6.0,
        final_logit_softcapping=5.0,
    ),
}
MODEL_CLASSES = {
    "gpt_neox": transformers.GPTNeoXForCausalLM,
    "starcoder2": transformers.Starcoder2ForCausalLM,
    "cohere": transformers.CohereForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "gemma2": transformers.Gemma2ForCausalLM,
}


def hf_tiny(architecture: str, seed: int = 1):
    """A tiny random model whose greedy decoding is not degenerate: ``randomize_parameters``'
    weights with biases around 0 rather than 1 (a LayerNorm bias of 1 in every feature would
    make each position's hidden state alike)."""
    torch.manual_seed(seed)
    config = CONFIGS[architecture]()
    config.architectures = [MODEL_CLASSES[architecture].__name__]
    hf_model = randomize_parameters(MODEL_CLASSES[architecture](config).eval(), seed=seed)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("bias"):
                param.sub_(1.0)
    return hf_model


def make_llm(path: str, **options) -> LLM:
    return LLM(
        model=path,
        dtype="float32",
        max_model_len=64,
        kv_cache_memory_bytes=2**20,
        skip_tokenizer_init=True,
        **options,
    )


@pytest.mark.parametrize("architecture", ["gpt_neox", "starcoder2", "cohere", "gemma2"])
def test_every_position_matches_transformers_through_the_paged_cache(architecture):
    hf_model = hf_tiny(architecture)
    model, loaded = build_model(TransformersForCausalLM, hf_model.config, hf_model.state_dict().items())
    assert loaded == {name for name, _ in model.named_parameters()}
    windows = {"starcoder2": [4, 4], "gemma2": [4, None]}.get(architecture, [None, None])
    assert model.kv_cache_spec.sliding_windows == windows
    assert_matches_transformers(model, hf_model, PROMPTS, num_new_tokens=6, atol=1e-3)


def test_a_quantized_gguf_checkpoint_runs_dequantized_by_transformers_names(tmp_path):
    """A GGUF file's config (plain attributes) becomes transformers' config class of its type;
    its Q8_0 matrices are dequantized into the float32 parameters by their transformers names."""
    from gguf import GGMLQuantizationType
    from helpers.gguf_files import write_model_gguf

    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat
    from tokenloom.core.config import LoadConfig, ModelConfig

    hf_model = hf_tiny("qwen2")
    path = write_model_gguf(
        str(tmp_path / "model.gguf"),
        "qwen2",
        hf_model.config,
        hf_model.state_dict(),
        quant_type=GGMLQuantizationType.Q8_0,
    )
    reader = GGUFLoadFormat()
    config = reader.load_config(path, ModelConfig())
    weights = list(reader.iterate_weights(path, ModelConfig(), LoadConfig(use_tqdm_on_load=False)))
    assert not isinstance(config, transformers.PreTrainedConfig)
    assert any(hasattr(tensor, "dequantize") for _, tensor in weights)
    model, loaded = build_model(TransformersForCausalLM, config, weights)
    assert model.architecture == "Qwen2ForCausalLM"
    assert loaded == {name for name, _ in model.named_parameters()}
    # transformers' model with the same dequantized weights
    dequantized = {name: tensor.dequantize() if hasattr(tensor, "dequantize") else tensor for name, tensor in weights}
    assert set(dequantized) == set(hf_model.state_dict())
    hf_model.load_state_dict(dequantized)
    assert_matches_transformers(model, hf_model, PROMPTS, num_new_tokens=4, atol=1e-3)


@pytest.mark.parametrize(
    "architecture, model_impl",
    [("gpt_neox", "auto"), ("starcoder2", "auto"), ("qwen2", "transformers")],
    ids=["gpt_neox-no-native-plugin", "starcoder2-no-native-plugin", "qwen2-forced"],
)
def test_served_greedy_matches_transformers_with_chunked_prefill_and_a_prefix_hit(architecture, model_impl, tmp_path):
    """Through the engine: the three prompts at once (the longest prefilled in chunks of the
    8-token budget beside the others' decodes), then the longest again from the prefix cache."""
    hf_model = hf_tiny(architecture)
    expected = [hf_greedy_top_k(hf_model, prompt, 10) for prompt in PROMPTS]
    assert all(len(set(tokens)) > 3 for tokens, _ in expected), "greedy decoding is degenerate"
    hf_model.save_pretrained(str(tmp_path))
    llm = make_llm(str(tmp_path), model_impl=model_impl, block_size=4, max_num_batched_tokens=8)
    assert llm.engine.model_info.architecture == TRANSFORMERS_FALLBACK
    served = served_greedy_top_k(llm, PROMPTS, 10)
    assert_greedy_agrees(served, expected)

    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    again = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params)[0]
    assert again.num_cached_tokens == 8  # two full 4-token blocks of the 10-token prompt
    assert list(again.outputs[0].token_ids) == served[2][0]


def test_auto_prefers_the_native_plugin(tmp_path):
    hf_tiny("qwen2").save_pretrained(str(tmp_path))
    assert resolved_architecture(tmp_path, "auto") == "Qwen2ForCausalLM"
    assert resolved_architecture(tmp_path, "native") == "Qwen2ForCausalLM"


def resolved_architecture(path, model_impl: str, **options) -> str:
    config = EngineArgs(
        model=str(path), model_impl=model_impl, skip_tokenizer_init=True, **options
    ).create_engine_config()
    info, _ = resolve_model(config, load_plugins())
    return info.architecture


def test_vllm_refuses_an_architecture_without_a_native_plugin_naming_the_fallback(tmp_path):
    hf_tiny("gpt_neox").save_pretrained(str(tmp_path))
    with pytest.raises(UnknownNameError, match=r"GPTNeoXForCausalLM.*--model-impl transformers") as raised:
        resolved_architecture(tmp_path, "vllm")
    assert TRANSFORMERS_FALLBACK not in str(raised.value)


def test_terratorch_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"--model-impl: 'terratorch' is not implemented.*use auto, vllm"):
        EngineArgs(model_impl="terratorch").create_engine_config()


@pytest.mark.parametrize(
    "options, flag",
    [({"tensor_parallel_size": 2}, "--tensor-parallel-size 2"), ({"enable_lora": True}, "--enable-lora")],
)
def test_the_fallback_refuses_what_needs_a_native_plugin(tmp_path, options, flag):
    hf_tiny("gpt_neox").save_pretrained(str(tmp_path))
    with pytest.raises(ConfigError, match=f"{flag}.*GPTNeoXForCausalLM"):
        resolved_architecture(tmp_path, "auto", **options)


def save_config(tmp_path, config) -> None:
    """A checkpoint directory with a config and one tensor (the architecture is refused before
    any weight is read)."""
    from safetensors.torch import save_file

    config.save_pretrained(str(tmp_path))
    save_file({"unused": torch.zeros(1)}, str(tmp_path / "model.safetensors"))


def test_an_architecture_transformers_does_not_have_is_refused_at_start_up(tmp_path):
    config = transformers.LlamaConfig(**SHAPE)
    config.architectures = ["MadeUpForCausalLM"]
    save_config(tmp_path, config)
    with pytest.raises(ModelLoadError) as raised:
        make_llm(str(tmp_path))
    message = str(raised.value)
    assert "no native model plugin serves MadeUpForCausalLM" in message
    assert f"transformers {transformers.__version__} has no class MadeUpForCausalLM, so the" in message
    assert "write a model plugin" in message


def test_an_encoder_only_model_is_refused_by_the_fallback(tmp_path):
    config = transformers.BertConfig(vocab_size=160, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    config.architectures = ["BertModel"]
    save_config(tmp_path, config)
    with pytest.raises(ModelLoadError, match=r"BertModel is not a decoder-only causal language model"):
        make_llm(str(tmp_path), model_impl="transformers")


def test_a_model_whose_attention_bypasses_the_interface_is_refused(tmp_path):
    config = transformers.MptConfig(vocab_size=160, d_model=32, n_heads=2, n_layers=1, max_seq_len=64)
    config.architectures = ["MptForCausalLM"]
    save_config(tmp_path, config)
    with pytest.raises(ModelLoadError, match=r"MptForCausalLM's attention does not go through transformers' attention"):
        make_llm(str(tmp_path))


def test_a_model_with_recurrent_layers_is_refused(tmp_path):
    """Their state would run across the flat batch's sequences: refused, not silently wrong."""
    config = transformers.Qwen3NextConfig(
        vocab_size=160, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, num_experts=0
    )
    config.architectures = ["Qwen3NextForCausalLM"]
    save_config(tmp_path, config)
    with pytest.raises(ModelLoadError, match=r"Qwen3NextForCausalLM has linear_attention layers"):
        make_llm(str(tmp_path), model_impl="transformers")


def test_registration():
    registered = {}
    register_models(lambda name, target, **options: registered.setdefault(name, target))
    expected = {TRANSFORMERS_FALLBACK: "tokenloom.builtin_plugins.models.transformers_fallback:TransformersForCausalLM"}
    assert {name: registered[name] for name in expected} == expected
