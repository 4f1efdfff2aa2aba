"""The engine end to end with a tiny random Llama saved as safetensors: greedy output of a batch
equals transformers' greedy output token for token, also under preemption (a tiny KV pool),
chunked prefill (a tiny token budget), and with prefix caching on and off."""

from __future__ import annotations

import os

import pytest
import torch

from tokenloom import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4,",
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference_tokens(tiny_llama_dir):
    """transformers' greedy continuation of each prompt (token ids)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    expected = []
    for prompt in PROMPTS:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            generated = model.generate(input_ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)
        expected.append(generated[0, input_ids.shape[1]:].tolist())
    return expected


def run_engine(model_dir, **engine_args):
    llm = LLM(model=model_dir, dtype="float32", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm, [output.outputs[0].token_ids for output in llm.generate(PROMPTS, params)]


def test_greedy_batch_matches_transformers(tiny_llama_dir, reference_tokens):
    _, tokens = run_engine(tiny_llama_dir)
    assert tokens == reference_tokens


def test_greedy_matches_under_preemption(tiny_llama_dir, reference_tokens):
    # 6 blocks of 4 tokens: the four sequences (up to ~25 tokens each) cannot all run at once
    llm, tokens = run_engine(tiny_llama_dir, block_size=4, num_gpu_blocks_override=10)
    assert tokens == reference_tokens
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.scheduler.block_manager.num_free_blocks == 10


def test_greedy_matches_with_chunked_prefill(tiny_llama_dir, reference_tokens):
    _, tokens = run_engine(tiny_llama_dir, max_num_batched_tokens=5, block_size=4)
    assert tokens == reference_tokens


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_greedy_matches_with_prefix_caching(tiny_llama_dir, reference_tokens, enable_prefix_caching):
    llm, first = run_engine(tiny_llama_dir, block_size=4, enable_prefix_caching=enable_prefix_caching)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    second = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, params)]
    assert first == reference_tokens
    assert second == reference_tokens
    stats = llm.engine.stats()
    assert (stats.prefix_cache_hits > 0) == enable_prefix_caching
