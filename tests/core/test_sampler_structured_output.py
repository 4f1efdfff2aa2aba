"""Structured-output masks in the batched sampler: packed bitmask rows constrain exactly their
rows (greedy and random, seeded or not), compose with allowed_token_ids and logprobs, and a
row with nothing allowed fails alone."""

from __future__ import annotations

import torch

from tokenloom.core.sampler import Sampler, SamplingMetadata, SamplingState
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.structured_output_backend import allocate_bitmask, set_allowed_tokens

VOCAB_SIZE = 100


def masks(*allowed: list[int], vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    bitmask = allocate_bitmask(len(allowed), vocab_size)
    for row, token_ids in enumerate(allowed):
        set_allowed_tokens(bitmask[row], token_ids)
    return bitmask


def states(*params: SamplingParams) -> list[SamplingState]:
    return [SamplingState(p, [1, 2, 3]) for p in params]


def sample(logits, batch, grammar_rows, bitmask, sampler=None):
    metadata = SamplingMetadata.build(batch, logits.shape[-1], grammar_rows=grammar_rows, grammar_bitmask=bitmask)
    return (sampler or Sampler())(logits, metadata)


def test_greedy_rows_take_the_best_allowed_token_and_other_rows_are_untouched():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB_SIZE)
    batch = states(*(SamplingParams(temperature=0.0) for _ in range(3)))
    allowed_row0, allowed_row2 = [7, 40, 63], [31, 32, 99]
    out = sample(logits, batch, [0, 2], masks(allowed_row0, allowed_row2))
    assert out.token_ids[0] == max(allowed_row0, key=lambda t: logits[0, t])
    assert out.token_ids[1] == int(logits[1].argmax())
    assert out.token_ids[2] == max(allowed_row2, key=lambda t: logits[2, t])
    assert not out.errors


def test_random_rows_only_ever_sample_allowed_tokens():
    torch.manual_seed(1)
    allowed = [3, 31, 64, 65, 98]
    seen = set()
    for seed in range(200):
        logits = torch.randn(2, VOCAB_SIZE) * 3
        batch = states(SamplingParams(temperature=1.0, seed=seed), SamplingParams(temperature=1.5, top_p=0.9))
        out = sample(logits, batch, [0, 1], masks(allowed, allowed))
        seen.update(out.token_ids)
    assert seen <= set(allowed) and len(seen) == len(allowed)  # every allowed token is reachable


def test_a_seeded_constrained_row_does_not_depend_on_the_rest_of_the_batch():
    torch.manual_seed(2)
    logits = torch.randn(3, VOCAB_SIZE)
    allowed = list(range(0, VOCAB_SIZE, 3))
    alone = sample(logits[:1], states(SamplingParams(seed=7)), [0], masks(allowed))
    in_batch = sample(
        logits,
        states(SamplingParams(seed=7), SamplingParams(), SamplingParams(temperature=0.0)),
        [0, 2],
        masks(allowed, [5]),
    )
    assert alone.token_ids[0] == in_batch.token_ids[0] and in_batch.token_ids[2] == 5


def test_masks_intersect_with_allowed_token_ids():
    logits = torch.zeros(1, VOCAB_SIZE)
    logits[0, 50] = 10.0  # allowed by the grammar, not by allowed_token_ids
    batch = states(SamplingParams(temperature=0.0, allowed_token_ids=[4, 9]))
    assert sample(logits, batch, [0], masks([4, 50])).token_ids == [4]


def test_processed_logprobs_see_the_mask_and_raw_logprobs_do_not():
    torch.manual_seed(3)
    logits = torch.randn(1, VOCAB_SIZE)
    batch = states(SamplingParams(temperature=0.0, logprobs=3))
    processed = sample(logits, batch, [0], masks([10, 20]), Sampler("processed_logprobs")).logprobs[0]
    assert set(processed.token_ids[1:3]) == {10, 20} and processed.logprobs[3] == float("-inf")
    raw = sample(logits, batch, [0], masks([10, 20]), Sampler("raw_logprobs")).logprobs[0]
    assert raw.token_ids[1] == int(logits[0].argmax())


def test_a_mask_narrower_than_the_logits_disallows_the_extra_tokens():
    logits = torch.zeros(1, VOCAB_SIZE + 28)
    logits[0, VOCAB_SIZE + 5] = 50.0  # a padded vocabulary entry past the mask
    logits[0, 2] = 1.0
    out = sample(logits, states(SamplingParams(temperature=0.0)), [0], masks([1, 2], vocab_size=VOCAB_SIZE))
    assert out.token_ids == [2]


def test_a_row_with_nothing_allowed_fails_alone():
    logits = torch.randn(2, VOCAB_SIZE)
    batch = states(SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, min_tokens=1))
    # row 1: the grammar allows only token 0, which min_tokens bans as the stop token
    batch[1] = SamplingState(SamplingParams(temperature=0.0, min_tokens=1), [1], eos_token_ids=[0])
    out = sample(logits, batch, [0, 1], masks([5], [0]))
    assert out.token_ids[0] == 5 and out.token_ids[1] == -1
    assert "structured-output constraint" in out.errors[1] and 0 not in out.errors
