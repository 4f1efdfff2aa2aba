"""The input processor: prompts in every accepted form, the model's limits, and the n
sequences of a request (ids, seeds), checked without a model."""

from __future__ import annotations

import pytest

from tokenloom.core.engine.input_processor import InputProcessor, ModelLimits, PreparedPrompt, make_seq_id
from tokenloom.core.sampling_params import PoolingParams, RequestOutputKind, SamplingParams
from tokenloom.core.sequence import SequenceStatus
from tokenloom.errors import ContextLengthError, InvalidRequestError


class WordTokenizer:
    """One token per word: its length (so the ids are predictable), after a BOS of 1."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [len(word) for word in text.split()]


def limits(**changes) -> ModelLimits:
    values = dict(max_model_len=16, vocab_size=100, block_size=4, num_blocks=3, max_logprobs=5, eos_token_ids=(2,))
    values.update(changes)
    return ModelLimits(**values)


WORD_TOKENIZER = WordTokenizer()


def processor(tokenizer=WORD_TOKENIZER, **changes) -> InputProcessor:
    return InputProcessor(tokenizer, limits(**changes))


def test_prompts_as_text_token_ids_and_dicts():
    params = SamplingParams()
    assert processor().prepare_prompt("one three", params) == PreparedPrompt([1, 3, 5], "one three")
    assert processor().prepare_prompt([7, 8], params) == PreparedPrompt([7, 8], None)
    assert processor().prepare_prompt({"prompt_token_ids": [9]}, params) == PreparedPrompt([9], None)
    assert processor().prepare_prompt({"prompt": "ab"}, params) == PreparedPrompt([1, 2], "ab")
    assert processor().prepare_prompt([5, 6, 7, 8], SamplingParams(truncate_prompt_tokens=2)).prompt_token_ids == [7, 8]


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "the prompt is empty"),
        ([3, 100], "token id 100 is out of the vocabulary"),
        ([3, True], "prompt must be a string or a list of token ids"),
        (3.5, "prompt must be a string or a list of token ids"),
        ({"text": "x"}, "needs 'prompt' or 'prompt_token_ids'"),
    ],
)
def test_bad_prompts_are_refused_naming_the_prompt(prompt, message):
    with pytest.raises(InvalidRequestError, match=message) as refused:
        processor().prepare_prompt(prompt, SamplingParams())
    assert refused.value.param == "prompt"


def test_text_needs_the_tokenizer():
    with pytest.raises(InvalidRequestError, match="--skip-tokenizer-init"):
        processor(tokenizer=None).prepare_prompt("hello", SamplingParams())


def test_a_prompt_must_fit_the_context_and_the_kv_cache():
    with pytest.raises(ContextLengthError, match="the prompt has 16 tokens, but the model's context length is 16"):
        processor().prepare_prompt(list(range(16)), SamplingParams())
    # 3 blocks of 4 tokens hold the prompt and one output token up to 11 prompt tokens
    assert len(processor().prepare_prompt(list(range(11)), SamplingParams()).prompt_token_ids) == 11
    with pytest.raises(InvalidRequestError, match=r"more than the whole KV cache holds \(3 blocks of 4\)"):
        processor().prepare_prompt(list(range(12)), SamplingParams())


def test_parameters_are_checked_against_the_model():
    with pytest.raises(InvalidRequestError, match="logprobs 6 is more than --max-logprobs 5") as refused:
        processor().prepare_prompt([3], SamplingParams(logprobs=6))
    assert refused.value.param == "logprobs"
    with pytest.raises(InvalidRequestError, match="prompt_logprobs 9 is more than --max-logprobs 5"):
        processor().prepare_prompt([3], SamplingParams(prompt_logprobs=9))
    with pytest.raises(InvalidRequestError, match="100"):
        processor().prepare_prompt([3], SamplingParams(allowed_token_ids=[100]))


def test_the_sequences_of_a_request():
    prepared = PreparedPrompt([1, 3], "abc")
    [single] = processor().build_sequences("r", prepared, SamplingParams(seed=7), priority=2, arrival_time=5.0)
    assert (single.seq_id, single.request_id, single.index, single.sampling_params.seed) == ("r", "r", 0, 7)
    assert (single.priority, single.arrival_time, single.eos_token_ids, single.prompt) == (2, 5.0, {2}, "abc")
    assert single.status is SequenceStatus.WAITING

    sequences = processor().build_sequences("r", prepared, SamplingParams(n=3, seed=7))
    assert [seq.seq_id for seq in sequences] == ["r#0", "r#1", "r#2"] == [make_seq_id("r", i, 3) for i in range(3)]
    assert [seq.sampling_params.seed for seq in sequences] == [7, 8, 9]  # distinct but reproducible
    assert {seq.request_id for seq in sequences} == {"r"} and [seq.index for seq in sequences] == [0, 1, 2]
    # every sequence has its own prompt list: one growing never changes another
    sequences[0].prompt_token_ids.append(4)
    assert sequences[1].prompt_token_ids == prepared.prompt_token_ids == [1, 3]
    unseeded = processor().build_sequences("u", prepared, SamplingParams(n=2))
    assert [seq.sampling_params.seed for seq in unseeded] == [None, None]


def test_the_pooling_sequence_is_prefill_only():
    sequence = processor().build_pooling_sequence("p", PreparedPrompt([1, 3], None), PoolingParams(dimensions=4))
    assert sequence.pooling_params == PoolingParams(dimensions=4)
    assert sequence.sampling_params.max_tokens == 1 and sequence.sampling_params.detokenize is False
    assert sequence.sampling_params.output_kind is RequestOutputKind.FINAL_ONLY


def test_bad_words_are_tokenized_once_for_the_worker(smollm2_tokenizer):
    params = SamplingParams(bad_words=["hello"])
    with_ids = InputProcessor(smollm2_tokenizer, limits(vocab_size=len(smollm2_tokenizer))).with_bad_words(params)
    assert with_ids.extra_args["bad_words_token_ids"][0] == smollm2_tokenizer.encode("hello", add_special_tokens=False)
    assert params.extra_args is None  # the caller's params are not changed
    assert processor().with_bad_words(SamplingParams()) == SamplingParams()
