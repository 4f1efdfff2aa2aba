"""The engine end to end with a tiny random Llama saved as safetensors: greedy output of a batch
equals transformers' greedy output token for token, also under preemption (a tiny KV pool),
chunked prefill (a tiny token budget), and with prefix caching on and off; and prompt logprobs
complete and equal to an unchunked run's however the prefill is split or recomputed."""

from __future__ import annotations

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
            generated = model.generate(
                input_ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        expected.append(generated[0, input_ids.shape[1] :].tolist())
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


# ---- prompt logprobs, however the prompt's prefill is split ------------------------------------

LONG_PROMPT = "Once upon a time, in a small village by the sea, there lived a fisherman who " * 3


def prompt_logprob_runs(llm, prompts, params):
    return {tuple(output.prompt_token_ids): output.prompt_logprobs for output in llm.generate(prompts, params)}


def check_prompt_logprobs(prompt_ids, entries, reference, num_top):
    assert len(entries) == len(prompt_ids)
    assert entries[0] is None
    for position in range(1, len(prompt_ids)):
        entry, expected = entries[position], reference[position]
        assert prompt_ids[position] in entry, position
        assert len(entry) in (num_top, num_top + 1)  # the prompt token may be among the top ones
        assert entry.keys() == expected.keys(), position
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(expected[token_id].logprob, abs=1e-4)
            # a far-down prompt token's rank moves among near-ties when the batch shape changes
            assert logprob.rank == pytest.approx(expected[token_id].rank, rel=1e-3)


@pytest.fixture(scope="module")
def unchunked_prompt_logprobs(tiny_llama_dir):
    """Each prompt's prompt logprobs with its whole prefill in one step."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_num_batched_tokens=2048, enable_chunked_prefill=False)
    prompts = [LONG_PROMPT] + PROMPTS
    return prompt_logprob_runs(llm, prompts, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2))


@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param(dict(max_num_batched_tokens=16, enable_prefix_caching=False), id="chunked"),
        # the repeated prompts would hit the prefix cache, but these requests recompute every position
        pytest.param(
            dict(max_num_batched_tokens=16, enable_prefix_caching=True, block_size=4), id="chunked-prefix-cache"
        ),
        # a KV pool too small for all of them: sequences are preempted after their first tokens
        pytest.param(dict(max_num_batched_tokens=16, block_size=4, num_gpu_blocks_override=24), id="chunked-preempted"),
    ],
)
def test_prompt_logprobs_of_a_chunked_prefill_are_complete(tiny_llama_dir, unchunked_prompt_logprobs, engine_args):
    llm = LLM(model=tiny_llama_dir, dtype="float32", **engine_args)
    prompts = [LONG_PROMPT] * 3 + PROMPTS  # the long one (~50 tokens) takes several 16-token chunks
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=2)
    outputs = llm.generate(prompts, params)
    assert len(outputs[0].prompt_token_ids) > 3 * 16
    for output in outputs:
        prompt_ids = output.prompt_token_ids
        check_prompt_logprobs(prompt_ids, output.prompt_logprobs, unchunked_prompt_logprobs[tuple(prompt_ids)], 2)
    if "num_gpu_blocks_override" in engine_args:
        assert llm.engine.stats().num_preemptions > 0


def test_prompt_logprobs_come_once_and_complete_in_delta_outputs(tiny_llama_dir, unchunked_prompt_logprobs):
    from tokenloom.core.sampling_params import RequestOutputKind

    llm = LLM(model=tiny_llama_dir, dtype="float32", max_num_batched_tokens=16)
    engine = llm.engine
    params = SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2, n=2, output_kind=RequestOutputKind.DELTA
    )
    for index, prompt in enumerate([LONG_PROMPT, LONG_PROMPT, PROMPTS[0]]):
        engine.add_request(f"r{index}", prompt, params)
    received: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            received.setdefault(output.request_id, []).append(output)
    assert len(received) == 3
    for outputs in received.values():
        with_prompt_logprobs = [output.prompt_logprobs for output in outputs if output.prompt_logprobs is not None]
        assert len(with_prompt_logprobs) == 1
        assert outputs[0].prompt_logprobs is not None  # with the first output
        prompt_ids = outputs[0].prompt_token_ids
        check_prompt_logprobs(prompt_ids, with_prompt_logprobs[0], unchunked_prompt_logprobs[tuple(prompt_ids)], 2)


def test_prompt_logprobs_are_not_repeated_when_a_sequence_is_recomputed(tiny_llama_dir, unchunked_prompt_logprobs):
    # 12 blocks of 4 tokens: the sequences are preempted while decoding, and their prompts
    # (whose logprobs were already reported) are computed again when they resume
    llm = LLM(model=tiny_llama_dir, dtype="float32", block_size=4, num_gpu_blocks_override=12)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=2)
    outputs = llm.generate([PROMPTS[2]] * 4, params)
    assert llm.engine.stats().num_preemptions > 0
    for output in outputs:
        prompt_ids = output.prompt_token_ids
        check_prompt_logprobs(prompt_ids, output.prompt_logprobs, unchunked_prompt_logprobs[tuple(prompt_ids)], 2)


# --- seeds: --seed for unseeded requests, and a request's own seed across preemption -----------


def sampled_tokens(llm, params, prompts=PROMPTS):
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params)]


def test_seeded_requests_sample_the_same_tokens_with_and_without_preemption(tiny_llama_dir):
    # a random tiny model's distribution is nearly flat: every draw shows in the tokens
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=1234)
    roomy = LLM(model=tiny_llama_dir, dtype="float32", block_size=4)
    expected = sampled_tokens(roomy, params)
    assert roomy.engine.stats().num_preemptions == 0
    tight = LLM(model=tiny_llama_dir, dtype="float32", block_size=4, num_gpu_blocks_override=10)
    assert sampled_tokens(tight, params) == expected
    assert tight.engine.stats().num_preemptions > 0
    # nothing is left behind for the preempted requests once they finished
    assert tight.engine.executor.worker.runner._preempted_generators == {}


def test_seed_flag_makes_unseeded_sampling_repeatable(tiny_llama_dir):
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = sampled_tokens(LLM(model=tiny_llama_dir, dtype="float32", seed=7), params)
    second = sampled_tokens(LLM(model=tiny_llama_dir, dtype="float32", seed=7), params)
    other = sampled_tokens(LLM(model=tiny_llama_dir, dtype="float32", seed=8), params)
    assert first == second
    assert first != other
