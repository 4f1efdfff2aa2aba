"""Draft-model speculation on the real packaged checkpoints through the engine: Gemma 3 270M
(Q4_K_M GGUF) as its own draft, every greedy draft accepted; and SmolLM2 (Q4_1 GGUF) with a
differently quantized copy of itself as the draft (the same weights dequantized by
transformers and stored in bfloat16, run beside the 4-bit target), sometimes wrong. Greedy
token ids identical to plain decoding, plain and structured, alone and in mixed batches, and
no block left held. (SmolLM2 as its own draft runs over HTTP in
tests/e2e/test_spec_decode_draft_model_smollm2.py.)"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tokenloom import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROPOSERS = ["tokenloom.builtin_plugins.proposers"]
# float32: a verification step's kernels then compute what a one-token step computes (in
# bfloat16 their rounding may flip a near tie, as in vLLM)
ENGINE = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 64 * 2**20}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List the days of the week:",
    "Q: What is 12 times 7?\nA:",
]
SCHEMA = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 6, "maxItems": 6}


def greedy(**changes) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 48, **changes})


def run(llm: LLM, prompts, params) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params)]


def mixed_params() -> list[SamplingParams]:
    return [
        greedy(),
        greedy(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}, max_tokens=60),
        greedy(logprobs=2, stop=["\n\n"]),
        SamplingParams(temperature=0.9, seed=3, max_tokens=30),  # sampled: shares the batch
    ]


def check_identical(plain: LLM, speculative: LLM) -> tuple[int, int]:
    """Greedy outputs equal one by one and in a mixed batch; returns (drafted, accepted)."""
    before = speculative.engine.stats().spec_decoding
    for prompt in PROMPTS:
        assert run(speculative, [prompt], greedy()) == run(plain, [prompt], greedy())
    params = mixed_params()
    expected = plain.generate(PROMPTS, params)
    got = speculative.generate(PROMPTS, params)
    for want, have in list(zip(expected, got))[:3]:
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
    assert len(json.loads(got[1].outputs[0].text)) == 6
    after = speculative.engine.stats().spec_decoding
    block_manager = speculative.engine.scheduler.block_manager
    assert block_manager.num_free_blocks == block_manager.num_blocks
    return (
        after.num_draft_tokens - before.num_draft_tokens,
        after.num_accepted_tokens - before.num_accepted_tokens,
    )


def test_gemma3_as_its_own_draft():
    plain = LLM(model="gemma3-270m", **ENGINE)
    speculative = LLM(
        model="gemma3-270m",
        plugins=PROPOSERS,
        speculative_config={"method": "draft_model", "model": "gemma3-270m", "num_speculative_tokens": 3},
        **ENGINE,
    )
    drafted, accepted = check_identical(plain, speculative)
    assert drafted > 0
    assert accepted == drafted  # greedy: the draft is the target, acceptance 100%


@pytest.fixture(scope="module")
def smollm2_bf16_copy(smollm2_gguf, tmp_path_factory):
    """SmolLM2's Q4_1 GGUF dequantized by transformers and stored in bfloat16, with its tokenizer."""
    from transformers import AutoModelForCausalLM

    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat

    directory = tmp_path_factory.mktemp("smollm2-bf16")
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf), dtype=torch.bfloat16
    )
    model.save_pretrained(directory, safe_serialization=True)
    GGUFLoadFormat().load_tokenizer(smollm2_gguf, None).save_pretrained(directory)
    return str(directory)


def test_smollm2_with_a_differently_quantized_copy_as_draft(smollm2_bf16_copy):
    plain = LLM(model="smollm2", **ENGINE)
    speculative = LLM(
        model="smollm2",
        plugins=PROPOSERS,
        speculative_config={"method": "draft_model", "model": smollm2_bf16_copy, "num_speculative_tokens": 4},
        **ENGINE,
    )
    drafted, accepted = check_identical(plain, speculative)
    assert 0 < accepted <= drafted
    print(f"acceptance of the bfloat16 copy: {accepted}/{drafted} = {accepted / drafted:.1%}")
