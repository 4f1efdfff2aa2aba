"""The real SmolLM2-135M-Instruct GGUF through the offline API: greedy 32-token continuations
(across two or three 16-token KV blocks) are identical to transformers running the same
dequantized weights in float32."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.gguf_reference import transformers_model

from tokenloom import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Here is a Python function that reverses a string:\n",
    "Q: What is 12 times 7?\nA:",
    "Les fleurs du printemps",
]
NUM_TOKENS = 32


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    return LLM(model=smollm2_gguf, dtype="float32", max_model_len=512)


@pytest.fixture(scope="module")
def transformers_greedy(smollm2_gguf):
    from transformers import AutoTokenizer

    directory, name = os.path.dirname(smollm2_gguf), os.path.basename(smollm2_gguf)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = transformers_model(smollm2_gguf)
    results = []
    for prompt in PROMPTS:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            generated = model.generate(
                input_ids,
                max_new_tokens=NUM_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tokenizer.eos_token_id,
            )
        results.append((input_ids[0].tolist(), generated[0, input_ids.shape[1] :].tolist()))
    return results


def test_greedy_continuations_match_transformers(llm, transformers_greedy):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    for output, (prompt_ids, expected) in zip(outputs, transformers_greedy):
        assert output.prompt_token_ids == prompt_ids
        assert output.outputs[0].token_ids == expected


def test_text_matches_tokenizer_decode(llm):
    params = SamplingParams(temperature=0.0, max_tokens=24)
    output = llm.generate(["Write a haiku about the sea."], params)[0].outputs[0]
    assert output.text == llm.get_tokenizer().decode(output.token_ids, skip_special_tokens=True)


def narrowed_layers(llm) -> tuple[int, str]:
    """(how many projections keep int4 weights, what the LM head multiplies: "int8" codes, a
    narrower copy's dtype, or "dense")."""
    model = llm.engine.executor.worker.runner.model
    int4 = sum(getattr(module, "int4_weight", None) is not None for module in model.modules())
    head = model.lm_head
    if head.kernel_weight is not None:
        return int4, "int8"
    return int4, "dense" if head.small_batch_weight is None else str(head.small_batch_weight.dtype)


def test_float32_named_stays_dense_and_auto_narrows_small_batches_only_where_the_platform_chose(llm):
    assert narrowed_layers(llm) == (0, "dense")  # --dtype float32: the exact path the parity test checks
    auto = LLM(model=llm.engine.model_info.path, max_model_len=512)
    # every q/k/v, o, gate/up and down projection of the 30 layers is Q4_1: all keep int4 codes;
    # the tied Q8_0 head keeps its codes for the int8 kernel, in bfloat16 (native bfloat16) and in
    # the float32 the platform chose (without it) alike
    assert narrowed_layers(auto) == (4 * 30, "int8")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    text = auto.generate(["The capital of France is"], params)[0].outputs[0].text
    assert "Paris" in text
