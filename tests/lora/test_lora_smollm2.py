"""LoRA adapters on the real SmolLM2-135M-Instruct GGUF: in float32 (the GGUF dequantized)
tokenloom's greedy ids equal transformers + PEFT's on the same dequantized weights; on the
int4 kernels (``--dtype auto``) the adapter runs beside the packed weights, which stay packed,
and a batch mixing the base model and three adapters (one on the tied embedding and int8 LM
head) gives each request what it gets alone."""

from __future__ import annotations

import os

import pytest
from helpers.gguf_reference import transformers_model
from helpers.lora_adapters import ALL_PROJECTIONS, peft_greedy, save_random_adapter

from tokenloom import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Here is a Python function that reverses a string:\n"]
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def dequantized(smollm2_gguf):
    """transformers' SmolLM2 on the GGUF's dequantized weights, loaded once."""
    return transformers_model(smollm2_gguf)


@pytest.fixture(scope="module")
def adapters(dequantized, tmp_path_factory):
    base = dequantized
    root = tmp_path_factory.mktemp("smollm2-adapters")
    return {
        "all": save_random_adapter(base, root / "all", r=8, alpha=16, targets=ALL_PROJECTIONS, seed=1, scale=0.05),
        "attn": save_random_adapter(
            base, root / "attn", r=16, alpha=16, targets=["q_proj", "v_proj"], seed=2, scale=0.08, use_rslora=True
        ),
        # the tied embedding and LM head (Q8_0 in the GGUF: the int8 head kernel at --dtype auto)
        "embed-head": save_random_adapter(
            base, root / "embed-head", r=8, alpha=8, targets=["embed_tokens", "lm_head"], seed=3, scale=0.3
        ),
    }


@pytest.fixture(scope="module")
def prompt_ids(smollm2_gguf):
    from transformers import AutoTokenizer

    directory, name = os.path.dirname(smollm2_gguf), os.path.basename(smollm2_gguf)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return [tokenizer(prompt).input_ids for prompt in PROMPTS]


def greedy(llm, prompts, lora_request=None):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    return [output.outputs[0].token_ids for output in llm.generate(inputs, params, lora_request=lora_request)]


@pytest.mark.timeout(1800)
def test_float32_greedy_ids_equal_transformers_peft(smollm2_gguf, dequantized, adapters, prompt_ids):
    llm = LLM(model=smollm2_gguf, dtype="float32", max_model_len=256, enable_lora=True, max_loras=3)
    base = greedy(llm, prompt_ids)
    for index, (name, path) in enumerate(adapters.items()):
        got = greedy(llm, prompt_ids, LoRARequest(name, index + 1, path))
        expected = peft_greedy(dequantized, path, prompt_ids, NUM_TOKENS, pad_token_id=2)
        assert got == expected, name
        assert got != base, name


@pytest.mark.timeout(1800)
def test_int4_base_stays_packed_and_mixed_batch_equals_alone(smollm2_gguf, adapters, prompt_ids):
    llm = LLM(model=smollm2_gguf, max_model_len=256, enable_lora=True, max_loras=3)
    model = llm.engine.executor.worker.runner.model
    int4_before = sum(getattr(module, "int4_weight", None) is not None for module in model.modules())
    requests = {name: LoRARequest(name, index + 1, path) for index, (name, path) in enumerate(adapters.items())}
    alone = {None: greedy(llm, prompt_ids)}
    for name, request in requests.items():
        alone[name] = greedy(llm, prompt_ids, request)
        assert alone[name] != alone[None], name
    prompts, lora_requests, keys = [], [], []
    for index, ids in enumerate(prompt_ids):
        for name in [None, *requests]:
            prompts.append(ids)
            lora_requests.append(None if name is None else requests[name])
            keys.append((name, index))
    for (name, index), got in zip(keys, greedy(llm, prompts, lora_requests)):
        assert got == alone[name][index], (name, index)
    # the quantized projections were never dequantized for the adapters
    assert int4_before == 30 * 4
    assert sum(getattr(module, "int4_weight", None) is not None for module in model.modules()) == int4_before
