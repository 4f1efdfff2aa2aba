"""The rejection sampler: exact tokens for greedy rows, every sampling parameter applied per
verified position, logprobs of the emitted tokens, and the target distribution preserved
(a chi-square test over a 4-token vocabulary, fixed seed)."""

from __future__ import annotations

import pytest
import torch

from tokenloom.core.sampling_metadata import SamplingMetadata, SamplingState
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.spec_decode.rejection_sampler import DraftPrefixState, RejectionSampler

VOCAB = 8


def chi_square_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit: P(X >= statistic) for ``len - 1`` degrees of
    freedom (the regularized upper incomplete gamma function)."""
    statistic = ((observed - expected) ** 2 / expected).sum()
    degrees = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(degrees, statistic.double() / 2))


def rows_for(state: SamplingState, drafts: list[int]) -> list:
    return [DraftPrefixState(state, drafts[:position]) if position else state for position in range(len(drafts) + 1)]


def verify(params_and_drafts, logits, draft_probs=None, logprobs_mode="raw_logprobs"):
    states, row_states, drafts = [], [], []
    for params, draft in params_and_drafts:
        state = SamplingState(params, prompt_token_ids=[0], eos_token_ids=[7])
        states.append(state)
        row_states.extend(rows_for(state, draft))
        drafts.append(draft)
    metadata = SamplingMetadata.build(row_states, logits.shape[-1])
    return RejectionSampler(logprobs_mode)(logits, metadata, drafts, draft_probs), states


def one_hot_logits(token_ids: list[int], vocab: int = VOCAB) -> torch.Tensor:
    logits = torch.zeros(len(token_ids), vocab)
    for row, token_id in enumerate(token_ids):
        logits[row, token_id] = 5.0
    return logits


GREEDY = SamplingParams(temperature=0.0, max_tokens=100)


def test_greedy_accepts_drafts_while_they_equal_the_argmax():
    # argmax per row: 3, 4, 5, 6; drafts 3, 4, 1: two accepted, the third replaced by 5
    verified, _ = verify([(GREEDY, [3, 4, 1])], one_hot_logits([3, 4, 5, 6]))
    assert verified.token_ids == [[3, 4, 5]]
    assert verified.num_accepted == [2]


def test_greedy_all_accepted_gets_the_bonus_token():
    verified, _ = verify([(GREEDY, [3, 4]), (GREEDY, [])], one_hot_logits([3, 4, 6, 2]))
    assert verified.token_ids == [[3, 4, 6], [2]]
    assert verified.num_accepted == [2, 0]


def test_first_draft_rejected_gives_one_token():
    verified, _ = verify([(GREEDY, [1, 4])], one_hot_logits([3, 4, 6]))
    assert verified.token_ids == [[3]]
    assert verified.num_accepted == [0]


def test_min_tokens_counts_the_accepted_drafts():
    # eos (7) is the argmax everywhere, 2 the runner-up; min_tokens=2 bans eos at positions 0
    # and 1 (0 and 1 tokens output) but not at position 2
    logits = torch.zeros(3, VOCAB)
    logits[:, 7] = 5.0
    logits[:, 2] = 4.0
    params = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=10)
    verified, _ = verify([(params, [2, 2])], logits)
    assert verified.token_ids == [[2, 2, 7]]


def test_penalties_see_the_drafts_before_each_position():
    # 3 leads 4 by 1.0 at every row; a frequency penalty of 2 per occurrence flips row 1
    # (3 drafted once before it), so draft [3, 3] keeps only the first 3, then 4
    logits = torch.zeros(3, VOCAB)
    logits[:, 3] = 2.0
    logits[:, 4] = 1.0
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0, max_tokens=10)
    verified, _ = verify([(params, [3, 3])], logits)
    assert verified.token_ids == [[3, 4]]


def test_logit_bias_applies_at_every_position():
    logits = one_hot_logits([3, 3, 3])
    params = SamplingParams(temperature=0.0, logit_bias={5: 10.0}, max_tokens=10)
    verified, _ = verify([(params, [5, 5])], logits)
    assert verified.token_ids == [[5, 5, 5]]


def test_logprobs_of_each_emitted_token():
    logits = one_hot_logits([3, 4, 5])
    params = SamplingParams(temperature=0.0, logprobs=2, max_tokens=10)
    verified, _ = verify([(params, [3, 1])], logits)
    assert verified.token_ids == [[3, 4]]
    entries = verified.logprobs[0]
    assert entries is not None and len(entries) == 2
    expected = torch.log_softmax(logits, dim=-1)
    assert [entry.token_ids[0] for entry in entries] == [3, 4]
    assert entries[0].logprobs[0] == pytest.approx(float(expected[0, 3]))
    assert entries[1].logprobs[0] == pytest.approx(float(expected[1, 4]))
    assert [entry.rank for entry in entries] == [1, 1]
    assert len(entries[0].token_ids) == 3  # the chosen token and the 2 best


def test_random_point_mass_draft_with_all_target_mass_is_always_accepted():
    logits = torch.full((3, VOCAB), float("-inf"))
    logits[0, 2] = logits[1, 6] = logits[2, 1] = 0.0
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=10)
    verified, _ = verify([(params, [2, 6])], logits)
    assert verified.token_ids == [[2, 6, 1]]


def test_random_draft_the_target_bans_is_never_accepted():
    logits = torch.zeros(2, VOCAB)
    logits[0, 2] = float("-inf")
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=10)
    for _ in range(20):
        verified, _ = verify([(params, [2])], logits)
        assert len(verified.token_ids[0]) == 1 and verified.token_ids[0][0] != 2


def test_every_token_banned_fails_only_that_sequence():
    logits = torch.zeros(2, VOCAB)
    params = SamplingParams(temperature=0.0, allowed_token_ids=[1], bad_words=None, max_tokens=10)
    state = SamplingState(params, prompt_token_ids=[0], bad_words_token_ids=[[1]])
    other = SamplingState(GREEDY, prompt_token_ids=[0])
    metadata = SamplingMetadata.build([state, other], VOCAB)
    verified = RejectionSampler()(logits, metadata, [[], []])
    assert 0 in verified.errors and verified.token_ids[0] == []
    assert verified.token_ids[1] == [0]


# ---- the target distribution is preserved -------------------------------------------------


def first_token_counts(target_logits, drafts, draft_probs, num_samples):
    """How often each token comes out first, over ``num_samples`` independent verifications
    of ``drafts[i]`` (one draft token each)."""
    vocab = target_logits.shape[-1]
    params = SamplingParams(temperature=1.0, max_tokens=10)
    states = [SamplingState(params, prompt_token_ids=[0]) for _ in range(num_samples)]
    row_states = [row for state, draft in zip(states, drafts) for row in rows_for(state, draft)]
    logits = target_logits.repeat(num_samples, 1)
    metadata = SamplingMetadata.build(row_states, vocab)
    probs = [draft_probs] * num_samples if draft_probs is not None else None
    verified = RejectionSampler()(logits, metadata, drafts, probs)
    counts = torch.zeros(vocab)
    for tokens in verified.token_ids:
        counts[tokens[0]] += 1
    return counts, sum(verified.num_accepted)


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_sampled_distribution_is_the_target_distribution(with_draft_probs):
    torch.manual_seed(1234)
    target = torch.tensor([[1.0, 0.2, -0.5, 0.7], [0.0, 0.0, 0.0, 0.0]])
    target_p = torch.softmax(target[0], dim=-1)
    num_samples = 6000
    if with_draft_probs:
        # a draft model's distribution unlike the target's; its drafts are drawn from it
        draft_probs = torch.tensor([[0.1, 0.6, 0.2, 0.1]])
        drafts = [[int(t)] for t in torch.multinomial(draft_probs[0], num_samples, replacement=True)]
    else:
        draft_probs = None  # n-gram: a fixed token, a point mass
        drafts = [[0]] * num_samples
    counts, num_accepted = first_token_counts(target, drafts, draft_probs, num_samples)
    assert 0 < num_accepted < num_samples  # both acceptance and the residual path are exercised
    assert chi_square_pvalue(counts, target_p * num_samples) > 1e-3, (counts, target_p * num_samples)


def test_chi_square_detects_a_wrong_distribution():
    """The test above can fail: accepting every draft would skew the counts decisively."""
    torch.manual_seed(1234)
    target = torch.tensor([[1.0, 0.2, -0.5, 0.7], [0.0, 0.0, 0.0, 0.0]])
    target_p = torch.softmax(target[0], dim=-1)
    num_samples = 6000
    counts = torch.zeros(4)
    counts[0] = num_samples * 0.5  # what a sampler that favoured the draft half the time would give
    counts[1:] = (num_samples - counts[0]) * target_p[1:] / target_p[1:].sum()
    assert chi_square_pvalue(counts, target_p * num_samples) < 1e-6
