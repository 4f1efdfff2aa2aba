"""Tests for tokenloom.core.sampler: each parameter's effect on hand-made logits, seeds,
sampling distributions and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from tokenloom.core.sampler import (
    Sampler,
    SamplingMetadata,
    SamplingState,
    compute_prompt_logprobs,
    row_argmax,
    tokenize_bad_words,
)
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.errors import ConfigError, InvalidRequestError

NEG_INF = float("-inf")


def make_state(prompt=(10,), output=(), bad_words=None, eos=(), **params) -> SamplingState:
    return SamplingState(
        SamplingParams(**params), list(prompt), list(output), bad_words_token_ids=bad_words, eos_token_ids=eos
    )


def run(logits, states, mode="raw_logprobs", **build_options):
    logits = torch.as_tensor(logits, dtype=torch.float32)
    if logits.dim() == 1:
        logits = logits[None, :]
    metadata = SamplingMetadata.build(states, logits.shape[1], "cpu", **build_options)
    return Sampler(mode)(logits, metadata)


def processed_logits(logits, state) -> list[float]:
    """The row's logits after every processor, indexed by token id (via processed_logits mode)."""
    vocab_size = len(logits)
    state.sampling_params.logprobs = vocab_size
    entry = run(logits, [state], mode="processed_logits").logprobs[0]
    values = [None] * vocab_size
    for token_id, value in zip(entry.token_ids[1:], entry.logprobs[1:]):
        values[token_id] = value
    return values


def probs_of(*probs):
    return [math.log(p) for p in probs]


# --- greedy and the fast path --------------------------------------------------------------


def test_greedy_is_argmax_and_builds_no_tensors():
    torch.manual_seed(0)
    logits = torch.randn(6, 40)
    states = [make_state(temperature=0.0) for _ in range(6)]
    metadata = SamplingMetadata.build(states, 40, "cpu")
    assert metadata.all_greedy and not metadata.modifies_logits
    assert metadata.temperature is None and metadata.top_k is None and metadata.min_p is None
    before = logits.clone()
    output = Sampler()(logits, metadata)
    assert output.token_ids == logits.argmax(-1).tolist()
    assert output.logprobs == [None] * 6
    assert torch.equal(logits, before)


def test_row_argmax_is_torch_argmax_with_the_first_of_equal_values():
    torch.manual_seed(0)
    for values in (torch.randn(9, 49152), torch.randn(49152), torch.randn(5, 7).T, torch.randn(4, 12)[:, ::3]):
        assert torch.equal(row_argmax(values), values.argmax(dim=-1))
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0], [NEG_INF, NEG_INF, 2.0, 2.0]])
    assert row_argmax(ties).tolist() == [1, 2]
    assert row_argmax(torch.zeros(0, 5)).tolist() == []
    assert row_argmax(torch.tensor([[0.0, 1.0]], dtype=torch.float64)).tolist() == [1]  # torch's own path


def test_processors_do_not_modify_the_callers_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    before = logits.clone()
    state = make_state(temperature=0.7, presence_penalty=1.0, output=[3], logit_bias={0: 1.0}, top_k=2, logprobs=2)
    Sampler("processed_logits")(logits, SamplingMetadata.build([state], 4))
    assert torch.equal(logits, before)


# --- truncation ----------------------------------------------------------------------------


def test_top_k_keeps_exactly_k_even_with_ties():
    values = processed_logits([0.0] * 10, make_state(temperature=1.0, top_k=3))
    assert sum(math.isfinite(v) for v in values) == 3
    values = processed_logits([5.0, 1.0, 4.0, 2.0, 3.0], make_state(temperature=1.0, top_k=2))
    assert values == [5.0, NEG_INF, 4.0, NEG_INF, NEG_INF]


def test_top_k_zero_and_top_p_one_disable_truncation():
    values = processed_logits([5.0, 1.0, 4.0, 2.0], make_state(temperature=1.0, top_k=0, top_p=1.0))
    assert values == [5.0, 1.0, 4.0, 2.0]


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    logits = probs_of(0.05, 0.5, 0.15, 0.3)
    kept = [math.isfinite(v) for v in processed_logits(logits, make_state(temperature=1.0, top_p=0.75))]
    assert kept == [False, True, False, True]
    kept = [math.isfinite(v) for v in processed_logits(logits, make_state(temperature=1.0, top_p=0.85))]
    assert kept == [False, True, True, True]
    kept = [math.isfinite(v) for v in processed_logits(logits, make_state(temperature=1.0, top_p=0.1))]
    assert kept == [False, True, False, False]


def test_top_p_logprobs_are_renormalised_over_the_nucleus():
    state = make_state(temperature=1.0, top_p=0.75, logprobs=2)
    entry = run(probs_of(0.05, 0.5, 0.15, 0.3), [state], mode="processed_logprobs").logprobs[0]
    assert entry.token_ids[1:] == [1, 3]
    assert entry.logprobs[1:] == pytest.approx([math.log(0.5 / 0.8), math.log(0.3 / 0.8)], abs=1e-5)


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    logits = probs_of(0.5, 0.3, 0.15, 0.05)
    kept = [math.isfinite(v) for v in processed_logits(logits, make_state(temperature=1.0, min_p=0.35))]
    assert kept == [True, True, False, False]  # threshold 0.175
    kept = [math.isfinite(v) for v in processed_logits(logits, make_state(temperature=1.0, min_p=0.2))]
    assert kept == [True, True, True, False]  # threshold 0.1


def test_temperature_divides_logits_before_truncation():
    values = processed_logits([1.0, 2.0, 4.0], make_state(temperature=0.5, top_k=2))
    assert values == [NEG_INF, 4.0, 8.0]


# --- penalties, bias, masks -----------------------------------------------------------------


def test_presence_and_frequency_penalties_are_exact():
    logits = [1.0, 2.0, 3.0, -1.0, 0.5]
    state = make_state(temperature=0.0, output=[1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25)
    assert processed_logits(logits, state) == [1.0, 2.0 - 0.5 - 0.5, 3.0 - 0.25 - 0.5, -1.0, 0.5]


def test_repetition_penalty_covers_prompt_and_output_and_comes_after_presence():
    logits = [2.0, 3.0, -1.0, 4.0, -2.0]
    state = make_state(temperature=0.0, prompt=[0, 2], output=[3, 3], repetition_penalty=2.0, presence_penalty=1.0)
    # token 3: 4 - 1 (presence) = 3, then / 2; prompt tokens 0 and 2: / 2 and * 2
    assert processed_logits(logits, state) == [1.0, 3.0, -2.0, 1.5, -2.0]


def test_penalties_count_tokens_appended_between_steps():
    state = make_state(temperature=0.0, frequency_penalty=1.0)
    logits = [0.0, 0.0, 0.0]
    assert processed_logits(logits, state) == [0.0, 0.0, 0.0]
    state.output_token_ids.append(1)
    assert processed_logits(logits, state) == [0.0, -1.0, 0.0]
    state.output_token_ids.extend([1, 2])
    assert processed_logits(logits, state) == [0.0, -2.0, -1.0]


def test_penalties_apply_only_to_their_own_row():
    logits = torch.zeros(3, 4)
    states = [
        make_state(temperature=0.0, output=[1], logprobs=4, frequency_penalty=1.0),
        make_state(temperature=0.0, output=[1], logprobs=4),
        make_state(temperature=0.0, output=[2], logprobs=4, presence_penalty=2.0),
    ]
    output = Sampler("processed_logits")(logits, SamplingMetadata.build(states, 4))
    by_row = [dict(zip(entry.token_ids[1:], entry.logprobs[1:])) for entry in output.logprobs]
    assert by_row[0] == {0: 0.0, 1: -1.0, 2: 0.0, 3: 0.0}
    assert by_row[1] == {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}
    assert by_row[2] == {0: 0.0, 1: 0.0, 2: -2.0, 3: 0.0}


def test_logit_bias_is_added():
    state = make_state(temperature=0.0, logit_bias={0: 5.0, 2: -1.5})
    assert processed_logits([1.0, 3.0, 2.0], state) == [6.0, 3.0, 0.5]
    assert run([1.0, 3.0, 2.0], [make_state(temperature=0.0, logit_bias={0: 5.0})]).token_ids == [0]


def test_allowed_token_ids_mask_everything_else():
    values = processed_logits([5.0, 1.0, 4.0, 2.0], make_state(temperature=0.0, allowed_token_ids=[1, 3]))
    assert values == [NEG_INF, 1.0, NEG_INF, 2.0]
    torch.manual_seed(0)
    states = [make_state(temperature=1.0, allowed_token_ids=[1, 3]) for _ in range(200)]
    assert set(run(torch.zeros(200, 4), states).token_ids) == {1, 3}


def test_step_allowed_tokens_intersect_with_allowed_token_ids():
    states = [make_state(temperature=0.0, allowed_token_ids=[1, 2, 3]), make_state(temperature=0.0)]
    logits = torch.tensor([[9.0, 1.0, 2.0, 3.0], [9.0, 1.0, 2.0, 3.0]])
    output = run(logits, states, step_allowed_token_ids=[[0, 1, 2], None])
    assert output.token_ids == [2, 0]


def test_bad_words_ban_the_last_token_when_the_output_ends_with_the_rest():
    bad = [[5, 7], [9]]
    logits = [0.0] * 10
    after_5 = processed_logits(logits, make_state(temperature=0.0, output=[1, 5], bad_words=bad))
    assert [i for i, v in enumerate(after_5) if not math.isfinite(v)] == [7, 9]
    after_other = processed_logits(logits, make_state(temperature=0.0, output=[5, 1], bad_words=bad))
    assert [i for i, v in enumerate(after_other) if not math.isfinite(v)] == [9]
    at_start = processed_logits(logits, make_state(temperature=0.0, output=[], bad_words=bad))
    assert [i for i, v in enumerate(at_start) if not math.isfinite(v)] == [9]


def test_tokenize_bad_words_adds_the_mid_sentence_variant():
    class WordTokenizer:
        vocab = {"hello": 1, " hello": 2, "big": 3, " big": 3, "dog": 4, " dog": 5}

        def encode(self, text, add_special_tokens=False):
            return [self.vocab[word] for word in text.replace(" ", "\0 ").split("\0") if word]

    assert tokenize_bad_words(WordTokenizer(), ["hello", "  big dog"]) == [[1], [2], [3, 5]]


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = [5.0, 4.0, 3.0, 0.0]  # eos=0 is the argmax, stop token 1 the runner-up
    state = make_state(temperature=0.0, eos=[0], stop_token_ids=[1], min_tokens=2, output=[3])
    assert run(logits, [state]).token_ids == [2]
    state.output_token_ids.append(3)
    assert run(logits, [state]).token_ids == [0]
    ignoring_eos = make_state(temperature=0.0, eos=[0], stop_token_ids=[1], min_tokens=2, ignore_eos=True)
    assert run(logits, [ignoring_eos]).token_ids == [0]


def test_a_row_with_every_token_banned_fails_alone():
    states = [
        make_state(temperature=0.0, allowed_token_ids=[0], eos=[0], min_tokens=1),
        make_state(temperature=0.8, allowed_token_ids=[0], bad_words=[[0]], seed=3),
        make_state(temperature=0.0),
    ]
    output = run(torch.tensor([[1.0, 2.0]] * 3), states)
    assert output.token_ids == [-1, -1, 1]
    assert set(output.errors) == {0, 1} and "ban every token" in output.errors[0]


# --- seeds and distributions ----------------------------------------------------------------


def step_logits(step: int, vocab_size: int = 50) -> torch.Tensor:
    return torch.randn(vocab_size, generator=torch.Generator().manual_seed(1000 + step))


def seeded_sequence(position: int, companions: list[dict], num_steps: int = 12, seed: int = 1234) -> list[int]:
    seeded = make_state(temperature=1.0, top_p=0.95, seed=seed)
    tokens = []
    for step in range(num_steps):
        others = [make_state(**options) for options in companions]
        states = others[:position] + [seeded] + others[position:]
        logits = torch.randn(len(states), 50)
        logits[position] = step_logits(step)
        output = run(logits, states)
        tokens.append(output.token_ids[position])
        seeded.output_token_ids.append(output.token_ids[position])
    return tokens


def test_a_seeded_row_samples_the_same_tokens_in_any_batch():
    alone = seeded_sequence(0, [])
    mixed = [
        {"temperature": 0.9},
        {"temperature": 0.0},
        {"temperature": 1.3, "top_k": 5, "seed": 7},
        {"temperature": 0.5, "min_p": 0.1},
    ]
    assert seeded_sequence(2, mixed) == alone
    assert seeded_sequence(1, mixed[1:2] + mixed[:1]) == alone
    assert seeded_sequence(0, [{"temperature": 0.7}] * 6) == alone
    assert seeded_sequence(0, [], seed=99) != alone


def test_temperature_sampling_follows_the_tempered_distribution():
    torch.manual_seed(0)
    base = torch.tensor([0.1, 0.2, 0.3, 0.4])
    num_draws = 20000
    states = [make_state(temperature=0.5) for _ in range(num_draws)]
    tokens = torch.tensor(run(base.log().expand(num_draws, 4), states).token_ids)
    frequencies = torch.bincount(tokens, minlength=4).float() / num_draws
    expected = base**2 / (base**2).sum()  # temperature 0.5 squares the probabilities
    assert torch.allclose(frequencies, expected, atol=0.015)


def test_a_seeded_row_follows_the_distribution_across_steps():
    base = torch.tensor([0.1, 0.2, 0.3, 0.4])
    state = make_state(temperature=1.0, seed=5)
    metadata = SamplingMetadata.build([state], 4)
    sampler = Sampler()
    tokens = torch.tensor([sampler(base.log()[None, :], metadata).token_ids[0] for _ in range(3000)])
    frequencies = torch.bincount(tokens, minlength=4).float() / 3000
    assert torch.allclose(frequencies, base, atol=0.03)


# --- logprobs -------------------------------------------------------------------------------


def test_logprobs_hold_the_sampled_token_its_rank_and_the_top_alternatives():
    logits = torch.tensor([[0.5, 3.0, 1.0, 2.0, -1.0], [0.0, 1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    states = [
        make_state(temperature=0.0, allowed_token_ids=[0, 4], logprobs=3),
        make_state(temperature=0.0, logprobs=0),
        make_state(temperature=0.0),
    ]
    output = run(logits, states)
    expected = torch.log_softmax(logits, dim=-1)
    first = output.logprobs[0]
    assert output.token_ids[0] == 0
    assert first.token_ids == [0, 1, 3, 2]
    assert first.rank == 4  # raw logprobs: the sampled token is the 4th most likely by the model
    assert first.logprobs == pytest.approx(expected[0, [0, 1, 3, 2]].tolist(), abs=1e-6)
    second = output.logprobs[1]
    assert second.token_ids == [4] and second.rank == 1
    assert second.logprobs == pytest.approx([expected[1, 4].item()], abs=1e-6)
    assert output.logprobs[2] is None


def test_logprobs_modes():
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    state = make_state(temperature=0.5, top_k=2, logprobs=3, seed=1)
    raw_logits = run(logits, [state], mode="raw_logits").logprobs[0]
    assert raw_logits.token_ids[1:] == [2, 1, 0] and raw_logits.logprobs[1:] == [4.0, 2.0, 1.0]
    processed = run(logits, [state], mode="processed_logits").logprobs[0]
    assert processed.logprobs[1:] == [8.0, 4.0, NEG_INF]
    processed_logprobs = run(logits, [state], mode="processed_logprobs").logprobs[0]
    expected = torch.log_softmax(torch.tensor([8.0, 4.0]), dim=-1).tolist()
    assert processed_logprobs.logprobs[1:3] == pytest.approx(expected, abs=1e-6)


def test_compute_prompt_logprobs():
    logits = torch.tensor([[1.0, 2.0, 3.0], [3.0, 0.0, 1.0]])
    entries = compute_prompt_logprobs(logits, [0, 0], num_top=2)
    expected = torch.log_softmax(logits, dim=-1)
    assert [entry.rank for entry in entries] == [3, 1]
    assert entries[0].token_ids == [0, 2, 1]
    assert entries[0].logprobs == pytest.approx(expected[0, [0, 2, 1]].tolist(), abs=1e-6)
    assert entries[1].token_ids == [0, 0, 2]


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, param",
    [
        ({"allowed_token_ids": [1, 10]}, "allowed_token_ids"),
        ({"logit_bias": {12: 1.0}}, "logit_bias"),
        ({"stop_token_ids": [99]}, "stop_token_ids"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_rejected(options, param):
    state = make_state(**options)
    with pytest.raises(InvalidRequestError) as error:
        state.validate(10)
    assert error.value.param == param


def test_unknown_eos_ids_are_dropped_not_rejected():
    state = make_state(temperature=0.0, eos=[0, 50], min_tokens=1)
    state.validate(4)
    assert state.min_tokens_banned_ids == [0]


def test_unknown_logprobs_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="logprobs-mode"):
        Sampler("probabilities")
