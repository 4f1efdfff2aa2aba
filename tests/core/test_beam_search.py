"""Beam search over the engine with a tiny random Llama: width 1 is greedy decoding, wider
beams come back sorted by score with cumulative logprobs that the model itself confirms; and the
search itself on scripted logprobs: exact length-penalised ranking, early stopping, stop token
ids, and the async driver searching exactly like the blocking one."""

from __future__ import annotations

import asyncio
import math

import pytest

from tokenloom import LLM, BeamSearchParams, SamplingParams
from tokenloom.core.beam_search import BeamSearch, beam_search, beam_search_async, beam_search_score
from tokenloom.core.outputs import CompletionOutput, Logprob, RequestOutput
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


# --- the search itself, on scripted logprobs: exact scores, early stopping, stop tokens ----------


EOS = 0


def scripted_generate(table):
    """An engine whose next-token logprobs depend on the last token: ``table[last] = {token: p}``."""

    def outputs(beams, params):
        assert params.max_tokens == 1 and params.logprobs is not None
        result = []
        for tokens in beams:
            logprobs = {token: Logprob(math.log(p)) for token, p in table[tokens[-1]].items()}
            completion = CompletionOutput(0, "", [next(iter(logprobs))], None, [logprobs], "length")
            result.append(RequestOutput("r", None, tokens, None, [completion], True))
        return result

    return outputs


# from the prompt (9): EOS at once with 0.4, or 1 (0.6) which goes on to 2 (0.9) or EOS (0.1);
# 2 goes on to 3 (1.0), and 3 ends with EOS (1.0)
TABLE = {9: {EOS: 0.4, 1: 0.6}, 1: {2: 0.9, EOS: 0.1}, 2: {3: 1.0}, 3: {EOS: 1.0}, EOS: {EOS: 1.0}}


def run_search(**options):
    params = BeamSearchParams(beam_width=2, max_tokens=options.pop("max_tokens", 5), **options)
    return beam_search(scripted_generate(TABLE), [[9]], params, {EOS})[0].sequences


def test_finished_beams_are_ranked_by_length_penalised_score():
    # finished: [9,0] cum log .4 (length 1), [9,1,0] log .06 (2), [9,1,2,3,0] log .54 (4)
    sequences = run_search(length_penalty=1.0)
    assert [s.output_token_ids for s in sequences] == [[1, 2, 3, EOS], [EOS]]
    assert sequences[0].cum_logprob == pytest.approx(math.log(0.54))
    assert all(s.finish_reason == "stop" for s in sequences)
    # the length counts the prompt, not a final EOS (as vLLM): 1, 2 and 4 here. With
    # length_penalty 0 the score is the cumulative logprob: log .54 > log .4 > log .06
    assert [s.output_token_ids for s in run_search(length_penalty=0.0)] == [[1, 2, 3, EOS], [EOS]]
    # a negative penalty multiplies by the length: log .4 * 1 > log .54 * 4 > log .06 * 2
    penalised = run_search(length_penalty=-1.0)
    assert [s.output_token_ids for s in penalised] == [[EOS], [1, 2, 3, EOS]]
    assert beam_search_score(penalised[1], {EOS}, -1.0) == pytest.approx(math.log(0.54) * 4)


def test_early_stopping_ends_the_search_once_beam_width_beams_finished():
    # after two steps [9,0] and [9,1,0] have finished: width 2 is reached, the longer beam is dropped
    sequences = run_search(early_stopping=True)
    assert sorted(s.output_token_ids for s in sequences) == [[EOS], [1, EOS]]
    assert run_search(early_stopping=False)[0].output_token_ids == [1, 2, 3, EOS]


def test_max_tokens_stops_live_beams_with_reason_length():
    sequences = run_search(max_tokens=2)
    by_tokens = {tuple(s.output_token_ids): s.finish_reason for s in sequences}
    assert by_tokens == {(1, 2): "length", (EOS,): "stop"}


def test_stop_token_ids_finish_a_beam_and_say_which_token():
    sequences = run_search(stop_token_ids=(2,), ignore_eos=True, max_tokens=3)
    stopped = [s for s in sequences if s.output_token_ids == [1, 2]]
    assert stopped and stopped[0].finish_reason == "stop" and stopped[0].stop_reason == 2


def test_the_async_driver_searches_exactly_like_the_blocking_one():
    generate = scripted_generate(TABLE)

    async def agenerate(beams, params):
        return generate(beams, params)

    params = BeamSearchParams(beam_width=2, max_tokens=5)
    blocking = beam_search(generate, [[9], [1]], params, {EOS})
    concurrent = asyncio.run(beam_search_async(agenerate, [[9], [1]], params, {EOS}))
    assert [[s.tokens for s in o.sequences] for o in concurrent] == [[s.tokens for s in o.sequences] for o in blocking]


def test_pending_is_empty_once_every_beam_finished():
    search = BeamSearch([[3]], BeamSearchParams(beam_width=1, max_tokens=10), {EOS})
    search.advance([{EOS: Logprob(0.0)}])
    assert search.pending() == []
