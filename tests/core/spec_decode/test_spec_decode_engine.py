"""Speculative decoding (n-gram) through the real engine, with a tiny random Llama (which loops,
so prompt lookup finds drafts): greedy token ids identical to plain decoding in batches mixing
sampling parameters, structured outputs, stop strings, preemption and chunked prefill; the
metrics count drafts; speculation off above disable_by_batch_size; and the sampled
distribution unchanged (chi-square over a 4-token vocabulary)."""

from __future__ import annotations

import json

import pytest
import torch

from tokenloom import LLM, SamplingParams

PROPOSERS = ["tokenloom.builtin_plugins.proposers"]  # the entry point until it is installed
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4,",
]


def greedy(**changes) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 40, "ignore_eos": True, **changes})


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32")


@pytest.fixture(scope="module")
def speculative(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", plugins=PROPOSERS, speculative_config=NGRAM)


def accepted_tokens(llm: LLM) -> int:
    stats = llm.engine.stats().spec_decoding
    assert stats is not None
    return stats.num_accepted_tokens


def test_greedy_batch_is_identical_and_drafts_are_accepted(plain, speculative):
    before = accepted_tokens(speculative)
    assert token_ids(speculative, PROMPTS, greedy()) == token_ids(plain, PROMPTS, greedy())
    assert accepted_tokens(speculative) > before  # the test exercised verification


def test_single_stream_is_identical(plain, speculative):
    assert token_ids(speculative, PROMPTS[1], greedy(max_tokens=60)) == token_ids(
        plain, PROMPTS[1], greedy(max_tokens=60)
    )


def test_mixed_batch_with_every_sampling_parameter(plain, speculative):
    params = [
        greedy(frequency_penalty=0.5, presence_penalty=0.3),
        greedy(repetition_penalty=1.3, logprobs=3),
        greedy(logit_bias={11: 3.0}, min_tokens=10, max_tokens=25),
        greedy(bad_words=["the"], max_tokens=30),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30),  # sampled: only shares the batch
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    expected = plain.generate(prompts, params)
    got = speculative.generate(prompts, params)
    for want, have in list(zip(expected, got))[:4]:
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
    want_logprobs, have_logprobs = expected[1].outputs[0].logprobs, got[1].outputs[0].logprobs
    assert len(have_logprobs) == len(want_logprobs) == len(got[1].outputs[0].token_ids)
    for want_entry, have_entry in zip(want_logprobs, have_logprobs):
        assert list(have_entry) == list(want_entry)
        for token_id, logprob in want_entry.items():
            assert have_entry[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-4)
    assert len(got[4].outputs[0].token_ids) == 30


def test_stop_strings_and_tokens_end_at_the_same_token(plain, speculative):
    reference = token_ids(plain, PROMPTS, greedy())
    tokenizer = plain.get_tokenizer()
    # stop on text and on a token that occur mid-way through each greedy output
    stops = [tokenizer.decode(tokens[12:14]) for tokens in reference]
    params = [greedy(stop=[stop]) for stop in stops]
    expected = plain.generate(PROMPTS, params)
    got = speculative.generate(PROMPTS, params)
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert have.outputs[0].text == want.outputs[0].text
        assert have.outputs[0].finish_reason == want.outputs[0].finish_reason == "stop"
    stop_token_params = [greedy(stop_token_ids=[tokens[9]]) for tokens in reference]
    assert token_ids(speculative, PROMPTS, stop_token_params) == token_ids(plain, PROMPTS, stop_token_params)


def test_structured_output_is_identical_and_valid(plain, speculative):
    schema = {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 8, "maxItems": 8}
    params = greedy(
        max_tokens=60, ignore_eos=False, structured_outputs={"json": schema, "disable_any_whitespace": True}
    )
    mixed = [params, greedy(), params, greedy(max_tokens=20)]
    expected = plain.generate(PROMPTS, mixed)
    before = accepted_tokens(speculative)
    got = speculative.generate(PROMPTS, mixed)
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
    for index in (0, 2):
        assert len(json.loads(got[index].outputs[0].text)) == 8
    assert accepted_tokens(speculative) > before


@pytest.mark.parametrize(
    "engine_args",
    [
        {"block_size": 4, "num_gpu_blocks_override": 14},  # preemption
        {"max_num_batched_tokens": 6, "block_size": 4},  # chunked prefill, budgets below 1 + k
        {"block_size": 4, "enable_prefix_caching": True},
    ],
    ids=["preemption", "chunked-prefill", "prefix-caching"],
)
def test_greedy_is_identical_under_scheduler_pressure(tiny_llama_dir, plain, engine_args):
    llm = LLM(model=tiny_llama_dir, dtype="float32", plugins=PROPOSERS, speculative_config=NGRAM, **engine_args)
    expected = token_ids(plain, PROMPTS, greedy())
    assert token_ids(llm, PROMPTS, greedy()) == expected
    assert token_ids(llm, PROMPTS, greedy()) == expected  # again: prefix hits, reused blocks
    scheduler = llm.engine.scheduler
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    assert accepted_tokens(llm) > 0
    if "num_gpu_blocks_override" in engine_args:
        assert llm.engine.stats().num_preemptions > 0


def test_no_speculation_above_disable_by_batch_size(tiny_llama_dir, plain):
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        plugins=PROPOSERS,
        speculative_config={**NGRAM, "disable_by_batch_size": 2},
    )
    assert token_ids(llm, PROMPTS, greedy()) == token_ids(plain, PROMPTS, greedy())
    assert llm.engine.stats().spec_decoding.num_drafts == 0  # four requests: never speculated
    before = accepted_tokens(llm)
    assert token_ids(llm, PROMPTS[0], greedy()) == token_ids(plain, PROMPTS[0], greedy())
    assert accepted_tokens(llm) > before  # one request: speculates


def test_unregistered_vllm_methods_are_refused_by_name(tiny_llama_dir):
    from tokenloom.errors import ConfigError

    with pytest.raises(ConfigError, match="method 'eagle' is not implemented yet"):
        LLM(
            model=tiny_llama_dir,
            plugins=PROPOSERS,
            speculative_config={"method": "eagle", "model": tiny_llama_dir, "num_speculative_tokens": 2},
        )


# ---- the sampled distribution is the target's --------------------------------------------


@pytest.fixture(scope="module")
def four_token_model(tmp_path_factory):
    """A tiny random Llama over a 4-token vocabulary (no tokenizer: prompts are token ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("four-token-llama")
    config = LlamaConfig(
        vocab_size=4,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=3,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # less uniform: drafts get both accepted and rejected
    model.save_pretrained(directory, safe_serialization=True)
    return str(directory), model


def exact_sequence_probs(model, prompt: list[int], length: int) -> dict[tuple[int, ...], float]:
    """P(the first ``length`` generated tokens) under the model at temperature 1."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, p in probs.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1].float()
            for token_id, q in enumerate(torch.softmax(logits, dim=-1).tolist()):
                grown[prefix + (token_id,)] = p * q
        probs = grown
    return probs


def assert_sequences_follow(outputs, expected: dict[tuple[int, ...], float], length: int) -> None:
    """A chi-square test that the first ``length`` tokens of every output were drawn from
    ``expected`` (from :func:`exact_sequence_probs`)."""
    cells = sorted(expected)
    observed = torch.zeros(len(cells))
    index = {cell: i for i, cell in enumerate(cells)}
    for output in outputs:
        observed[index[tuple(output.outputs[0].token_ids[:length])]] += 1
    expected_counts = torch.tensor([expected[cell] for cell in cells]) * len(outputs)
    # pool the cells too rare for the chi-square approximation into one
    rare = expected_counts < 5
    if rare.any():
        observed = torch.cat([observed[~rare], observed[rare].sum().reshape(1)])
        expected_counts = torch.cat([expected_counts[~rare], expected_counts[rare].sum().reshape(1)])
    statistic = ((observed - expected_counts) ** 2 / expected_counts).sum()
    pvalue = float(
        torch.special.gammaincc(torch.tensor((len(observed) - 1) / 2, dtype=torch.float64), statistic.double() / 2)
    )
    assert pvalue > 1e-3, (observed, expected_counts)


def test_sampled_sequences_follow_the_target_distribution(four_token_model):
    directory, model = four_token_model
    prompt = [0, 1, 2, 3, 0, 1, 2, 3]  # every token occurs: prompt lookup drafts after any token
    length = 2
    num_samples = 1500
    llm = LLM(
        model=directory,
        dtype="float32",
        skip_tokenizer_init=True,
        plugins=PROPOSERS,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 2,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 2,
        },
        seed=11,
        max_waiting_requests=0,  # all the samples queue at once
    )
    # one more token than is counted, so the counted ones come from a verification step
    params = SamplingParams(temperature=1.0, max_tokens=length + 1, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": prompt}] * num_samples, params)
    stats = llm.engine.stats().spec_decoding
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # acceptance and rejection both ran
    assert_sequences_follow(outputs, exact_sequence_probs(model, prompt, length), length)


def boost_token_after_last(output_token_ids, logits):
    """A request logits processor whose effect depends on the output so far: each verified
    position must see the drafts before it as output."""
    if output_token_ids:
        logits[(output_token_ids[-1] + 1) % logits.shape[-1]] += 5.0
    return logits


def test_request_logits_processors_see_each_positions_output(plain, speculative):
    params = greedy(logits_processors=[boost_token_after_last], max_tokens=30)
    assert token_ids(speculative, PROMPTS, params) == token_ids(plain, PROMPTS, params)
    assert token_ids(plain, PROMPTS, params) != token_ids(plain, PROMPTS, greedy(max_tokens=30))


def test_seed_flag_makes_speculative_sampling_repeatable(tiny_llama_dir):
    params = SamplingParams(temperature=1.0, max_tokens=30)
    runs = [
        token_ids(
            LLM(model=tiny_llama_dir, dtype="float32", plugins=PROPOSERS, speculative_config=NGRAM, seed=11),
            PROMPTS,
            params,
        )
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
