"""LoRA on the other decoder families tokenloom serves: a tiny random Qwen2 (q/k/v biases the
adapter leaves alone) and Gemma 3 (q/k norms, GeGLU, sliding layers, scaled embeddings) saved with
SmolLM2's tokenizer; tokenloom's greedy ids with an adapter on every projection, and with one on
the (tied) embedding and LM head, equal transformers + PEFT's."""

from __future__ import annotations

import pytest
import torch
from helpers.lora_adapters import ALL_PROJECTIONS, peft_greedy, save_random_adapter
from helpers.model_parity import perturb_parameters

from tokenloom import LLM, LoRARequest, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 8


def tiny_config(family, vocab_size, tokenizer):
    from transformers import Gemma3TextConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    if family == "qwen2":
        return Qwen2Config(**common)
    return Gemma3TextConfig(**common, head_dim=16, sliding_window=4, query_pre_attn_scalar=16)


@pytest.fixture(scope="module", params=["qwen2", "gemma3"])
def family_dir(request, tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    directory = tmp_path_factory.mktemp(request.param)
    tokenizer.save_pretrained(directory)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(tiny_config(request.param, len(tokenizer), tokenizer)).eval()
    perturb_parameters(model, seed=5)
    model.save_pretrained(directory, safe_serialization=True)
    return str(directory), [tokenizer(prompt).input_ids for prompt in PROMPTS]


def load_base(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    "targets", [ALL_PROJECTIONS, ["embed_tokens", "lm_head", "o_proj"]], ids=["projections", "embedding-head"]
)
def test_greedy_ids_equal_transformers_peft(family_dir, tmp_path, targets):
    """Gemma 3 scales its embeddings by sqrt(hidden): PEFT scales the embedding's delta too."""
    directory, prompt_ids = family_dir
    base = load_base(directory)
    adapter = save_random_adapter(base, tmp_path / "adapter", r=8, alpha=16, targets=targets, seed=9)
    llm = LLM(model=directory, dtype="float32", enable_lora=True, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    inputs = [{"prompt_token_ids": ids} for ids in prompt_ids]
    got = [out.outputs[0].token_ids for out in llm.generate(inputs, params, lora_request=LoRARequest("a", 1, adapter))]
    without = [out.outputs[0].token_ids for out in llm.generate(inputs, params)]
    assert got == peft_greedy(base, adapter, prompt_ids, MAX_TOKENS)
    assert got != without
