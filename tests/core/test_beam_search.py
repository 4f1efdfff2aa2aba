"""Beam search over the engine with a tiny random Llama: width 1 is greedy decoding, wider
beams come back sorted by score with cumulative logprobs that the model itself confirms."""

from __future__ import annotations

import pytest

from tokenloom import LLM, BeamSearchParams, SamplingParams
from tokenloom.core.beam_search import beam_search_score
from tokenloom.errors import InvalidRequestError

PROMPT = "The weather today is"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", block_size=4)


def test_width_one_is_greedy(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    beams = llm.beam_search([PROMPT], BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))[0]
    assert beams.sequences[0].output_token_ids == greedy.outputs[0].token_ids


def test_beams_are_distinct_sorted_and_their_logprobs_check_out(llm):
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    output = llm.beam_search([PROMPT], params)[0]
    sequences = output.sequences
    assert len(sequences) == 3
    assert len({tuple(s.tokens) for s in sequences}) == 3
    scores = [beam_search_score(s, set(), params.length_penalty) for s in sequences]
    assert scores == sorted(scores, reverse=True)
    # the model scores each beam's tokens the same way when they are fed back as a prompt
    for sequence in sequences:
        assert len(sequence.output_token_ids) == 6
        check = llm.generate([{"prompt_token_ids": sequence.tokens}], SamplingParams(max_tokens=1, prompt_logprobs=0))[
            0
        ]
        tail = check.prompt_logprobs[sequence.num_prompt_tokens :]
        recomputed = sum(entry[token].logprob for entry, token in zip(tail, sequence.output_token_ids))
        assert recomputed == pytest.approx(sequence.cum_logprob, abs=1e-3)
        assert sequence.text == llm.get_tokenizer().decode(sequence.output_token_ids, skip_special_tokens=True)


def test_bad_beam_width_is_rejected():
    with pytest.raises(InvalidRequestError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
