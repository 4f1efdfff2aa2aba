"""Draft-model speculation through the real engine, with a tiny random Llama: the target as
its own draft (greedy acceptance must be 100%) and a bfloat16-rounded copy of it (a differently
quantized draft, which is sometimes wrong); greedy token ids identical to plain decoding, plain
and structured, alone and in mixed batches, under preemption, chunked prefill and prefix
caching; the draft's KV freed with its request (block-manager counters); the pool's blocks
sized for target + draft; and the sampled distribution unchanged (chi-square over a 4-token
vocabulary with a draft that disagrees with the target)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.core.spec_decode.test_spec_decode_engine import (
    PROMPTS,
    PROPOSERS,
    assert_sequences_follow,
    exact_sequence_probs,
    four_token_model,  # noqa: F401  (a fixture)
    greedy,
    token_ids,
)
from tokenloom import LLM, SamplingParams


def draft_config(model: str, k: int = 3, **extra) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, **extra}


def stats(llm: LLM):
    spec = llm.engine.stats().spec_decoding
    assert spec is not None
    return spec


def assert_no_blocks_held(llm: LLM) -> None:
    block_manager = llm.engine.scheduler.block_manager
    assert block_manager.num_free_blocks == block_manager.num_blocks


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32")


@pytest.fixture(scope="module")
def self_draft(tiny_llama_dir):
    """Always k drafts (not the adaptive length, which starts shorter where the platform's
    verified rows cost more: one draft on the avx2 level), so the counts below hold on every CPU."""
    return LLM(
        model=tiny_llama_dir,
        dtype="float32",
        plugins=PROPOSERS,
        speculative_config=draft_config(tiny_llama_dir, adaptive_num_speculative_tokens=False),
    )


@pytest.fixture(scope="module")
def rounded_copy_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with every weight rounded to bfloat16 (and its tokenizer): run in float32
    beside the float32 target, a differently quantized copy whose argmax sometimes differs."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("tiny-llama-bf16")
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def rounded_draft(tiny_llama_dir, rounded_copy_dir):
    return LLM(
        model=tiny_llama_dir, dtype="float32", plugins=PROPOSERS, speculative_config=draft_config(rounded_copy_dir, 4)
    )


def test_target_as_its_own_draft_is_identical_and_fully_accepted(plain, self_draft):
    before = stats(self_draft)
    assert token_ids(self_draft, PROMPTS, greedy()) == token_ids(plain, PROMPTS, greedy())
    after = stats(self_draft)
    num_draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    assert num_draft_tokens > 0
    # the draft computes what the target computes: every greedy draft is the target's argmax
    assert after.num_accepted_tokens - before.num_accepted_tokens == num_draft_tokens
    assert_no_blocks_held(self_draft)


def test_single_stream_is_identical(plain, self_draft, rounded_draft):
    expected = token_ids(plain, PROMPTS[1], greedy(max_tokens=60))
    assert token_ids(self_draft, PROMPTS[1], greedy(max_tokens=60)) == expected
    assert token_ids(rounded_draft, PROMPTS[1], greedy(max_tokens=60)) == expected


def test_differently_quantized_draft_is_identical(plain, rounded_draft):
    before = stats(rounded_draft)
    assert token_ids(rounded_draft, PROMPTS, greedy()) == token_ids(plain, PROMPTS, greedy())
    after = stats(rounded_draft)
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    assert 0 < accepted <= after.num_draft_tokens - before.num_draft_tokens
    assert_no_blocks_held(rounded_draft)


def test_mixed_batch_with_sampling_parameters(plain, rounded_draft):
    params = [
        greedy(frequency_penalty=0.5, presence_penalty=0.3),
        greedy(repetition_penalty=1.3, logprobs=3),
        greedy(logit_bias={11: 3.0}, min_tokens=10, max_tokens=25),
        greedy(bad_words=["the"], max_tokens=30),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30),  # sampled: drafts carry probs
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    expected = plain.generate(prompts, params)
    got = rounded_draft.generate(prompts, params)
    for want, have in list(zip(expected, got))[:4]:
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
    for want_entry, have_entry in zip(expected[1].outputs[0].logprobs, got[1].outputs[0].logprobs, strict=True):
        assert list(have_entry) == list(want_entry)
    assert len(got[4].outputs[0].token_ids) == 30
    assert_no_blocks_held(rounded_draft)


def test_structured_output_is_identical_and_valid(plain, self_draft):
    schema = {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 8, "maxItems": 8}
    params = greedy(
        max_tokens=60, ignore_eos=False, structured_outputs={"json": schema, "disable_any_whitespace": True}
    )
    mixed = [params, greedy(), params, greedy(max_tokens=20)]
    expected = plain.generate(PROMPTS, mixed)
    before = stats(self_draft).num_accepted_tokens
    got = self_draft.generate(PROMPTS, mixed)
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
    for index in (0, 2):
        assert len(json.loads(got[index].outputs[0].text)) == 8
    assert stats(self_draft).num_accepted_tokens > before


@pytest.mark.parametrize(
    "engine_args",
    [
        {"block_size": 4, "num_gpu_blocks_override": 14},  # preemption
        {"max_num_batched_tokens": 6, "block_size": 4},  # chunked prefill, budgets below 1 + k
        {"block_size": 4, "enable_prefix_caching": True},
    ],
    ids=["preemption", "chunked-prefill", "prefix-caching"],
)
def test_greedy_is_identical_under_scheduler_pressure(tiny_llama_dir, rounded_copy_dir, plain, engine_args):
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        plugins=PROPOSERS,
        speculative_config=draft_config(rounded_copy_dir),
        **engine_args,
    )
    expected = token_ids(plain, PROMPTS, greedy())
    assert token_ids(llm, PROMPTS, greedy()) == expected
    assert token_ids(llm, PROMPTS, greedy()) == expected  # again: prefix hits, reused blocks
    assert_no_blocks_held(llm)
    assert stats(llm).num_accepted_tokens > 0
    if "num_gpu_blocks_override" in engine_args:
        assert llm.engine.stats().num_preemptions > 0


def test_draft_forgets_finished_requests(self_draft):
    proposer = self_draft.engine.executor.worker.runner.proposer
    self_draft.generate(PROMPTS, greedy(max_tokens=10))
    first_batch = set(proposer.computed_token_ids)
    assert first_batch
    # the worker hears of finished requests with the next step's schedule
    self_draft.generate(PROMPTS[0], greedy(max_tokens=10))
    assert not first_batch & set(proposer.computed_token_ids)


def test_a_block_holds_target_and_draft_kv(tiny_llama_dir, plain):
    budget = 8 * 1024 * 1024
    alone = LLM(model=tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=budget, max_num_seqs=256)
    both = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        kv_cache_memory_bytes=budget,
        max_num_seqs=256,
        plugins=PROPOSERS,
        speculative_config=draft_config(tiny_llama_dir),
    )
    # the draft is the same model: a block costs twice the bytes, and the pool has half the blocks
    assert both.engine.num_blocks == alone.engine.num_blocks // 2
    runner = both.engine.executor.worker.runner
    draft_cache = runner.proposer.kv_caches
    assert [cache.shape for cache in draft_cache] == [cache.shape for cache in runner.kv_caches]


def test_scheduler_allocates_lookahead_slots_for_the_draft(self_draft):
    """Right after a request's prefill the draft writes the KV of its first k - 1 drafts: the
    scheduler's lookahead slots hold them, so the first decode step already verifies k drafts
    even when the prompt ends a block exactly (without them: none, then k - 1)."""
    before = stats(self_draft)
    prompt = {"prompt_token_ids": list(range(100, 116))}  # 16 tokens: one whole block
    output = self_draft.generate([prompt], greedy(max_tokens=5))[0]
    assert len(output.outputs[0].token_ids) == 5
    after = stats(self_draft)
    assert (after.num_drafts - before.num_drafts, after.num_draft_tokens - before.num_draft_tokens) == (1, 3)
    assert_no_blocks_held(self_draft)


def test_sampled_sequences_follow_the_target_distribution(four_token_model, tmp_path_factory):  # noqa: F811
    """A draft that disagrees with the target (another random 4-token model): its drafts are
    drawn from its own distribution, and the rejection sampler keeps the target's exactly."""
    from transformers import LlamaForCausalLM

    directory, model = four_token_model
    draft_directory = tmp_path_factory.mktemp("four-token-draft")
    torch.manual_seed(5)
    draft = LlamaForCausalLM(model.config).eval()
    with torch.no_grad():
        draft.lm_head.weight.mul_(4.0)
    draft.save_pretrained(draft_directory, safe_serialization=True)
    prompt = [0, 1, 2, 3, 0, 1, 2, 3]
    length = 2
    num_samples = 1500
    llm = LLM(
        model=directory,
        dtype="float32",
        skip_tokenizer_init=True,
        plugins=PROPOSERS,
        speculative_config=draft_config(str(draft_directory), 2),
        seed=11,
        max_waiting_requests=0,
    )
    # one more token than is counted, so the counted ones come from a verification step
    params = SamplingParams(temperature=1.0, max_tokens=length + 1, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": prompt}] * num_samples, params)
    spec = stats(llm)
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # acceptance and rejection both ran
    assert_sequences_follow(outputs, exact_sequence_probs(model, prompt, length), length)
    assert_no_blocks_held(llm)


def test_a_draft_with_another_vocabulary_is_refused_naming_both(tiny_llama_dir):
    """Gemma 3's tokenizer as the draft of a model with SmolLM2's: refused before loading."""
    from tokenloom.errors import ConfigError

    with pytest.raises(ConfigError, match="different vocabularies") as error:
        LLM(model=tiny_llama_dir, plugins=PROPOSERS, speculative_config=draft_config("gemma3-270m"))
    assert "gemma3-270m" in str(error.value) and tiny_llama_dir in str(error.value)


def test_an_unknown_draft_model_is_refused_naming_it(tiny_llama_dir, tmp_path):
    from tokenloom.errors import ConfigError

    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ConfigError, match="draft model") as error:
        LLM(model=tiny_llama_dir, plugins=PROPOSERS, speculative_config=draft_config(missing))
    assert missing in str(error.value)


def test_draft_max_model_len_bounds_the_positions_drafted(tiny_llama_dir, plain):
    """The draft's context (``max_model_len``, --speculative-max-model-len) is smaller than the
    target's: the draft never computes a position past it, and decoding goes on without drafts."""
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        plugins=PROPOSERS,
        speculative_config=draft_config(tiny_llama_dir, max_model_len=24),
    )
    expected = token_ids(plain, PROMPTS, greedy())
    assert token_ids(llm, PROMPTS, greedy()) == expected  # 40 tokens: past the draft's 24
    proposer = llm.engine.executor.worker.runner.proposer
    assert proposer.info.max_model_len == 24
    assert proposer.computed_token_ids
    assert max(len(tokens) for tokens in proposer.computed_token_ids.values()) <= 24
    assert stats(llm).num_accepted_tokens > 0


def test_the_draft_quantization_is_the_drafts_own(tiny_llama_dir):
    """``quantization`` (--speculative-model-quantization) reaches the draft model's loader: an
    unknown method is refused naming the draft model."""
    from tokenloom.errors import ConfigError

    with pytest.raises(ConfigError, match="draft model .*no-such-method") as error:
        LLM(
            model=tiny_llama_dir,
            plugins=PROPOSERS,
            speculative_config=draft_config(tiny_llama_dir, quantization="no-such-method"),
        )
    assert tiny_llama_dir in str(error.value)


def test_the_drafts_tokenizer_is_loaded_once_for_the_vocabulary_check(tiny_llama_dir, monkeypatch):
    """The target's tokenizer and the draft's for the vocabulary check: loading the draft model
    needs its files and config only (a Gemma 3 self-draft loaded its 262k vocabulary three times)."""
    from tokenloom.builtin_plugins.loaders.hf_files import HfDirectoryFormat

    loaded = []
    load_tokenizer = HfDirectoryFormat.load_tokenizer

    def counting(self, path, model_config):
        loaded.append(path)
        return load_tokenizer(self, path, model_config)

    monkeypatch.setattr(HfDirectoryFormat, "load_tokenizer", counting)
    LLM(model=tiny_llama_dir, dtype="float32", plugins=PROPOSERS, speculative_config=draft_config(tiny_llama_dir))
    assert loaded == [tiny_llama_dir, tiny_llama_dir]
