"""The adaptive draft length (tokenloom/core/spec_decode/draft_length.py): the acceptance
estimate, the length rule, and the lengths a history of verifies leads to."""

from __future__ import annotations

import pytest

from tokenloom.core.spec_decode.draft_length import (
    MAX_TRIALS,
    AcceptanceEstimate,
    DraftLengthPolicy,
    best_draft_length,
    expected_tokens_per_cost,
)


def test_a_new_request_starts_at_even_odds():
    estimate = AcceptanceEstimate()
    assert estimate.probability == 0.5
    assert (estimate.accepted, estimate.trials) == (1.0, 2.0)


def test_a_verify_adds_its_accepted_drafts_and_one_rejection():
    estimate = AcceptanceEstimate()
    estimate.observe(4, 1)  # one accepted, the second rejected
    assert estimate.accepted == pytest.approx(1.0 * 0.8 + 1)
    assert estimate.trials == pytest.approx(2.0 * 0.8 + 2)
    estimate.observe(3, 3)  # all accepted: no rejection was seen
    assert estimate.accepted == pytest.approx(1.8 * 0.8 + 3)
    assert estimate.trials == pytest.approx(3.6 * 0.8 + 3)


def test_nothing_drafted_is_no_evidence():
    estimate = AcceptanceEstimate()
    estimate.observe(0, 0)
    assert (estimate.accepted, estimate.trials) == (1.0, 2.0)


def test_the_evidence_is_capped_keeping_the_rate():
    estimate = AcceptanceEstimate()
    estimate.observe(8, 8)  # 1.6 + 8 trials: scaled to the cap
    assert estimate.trials == MAX_TRIALS
    assert estimate.probability == pytest.approx(8.8 / 9.6)


def test_expected_tokens_per_cost():
    # 1 + 0.5 + 0.25 tokens for 1 + 2 * 0.1 decode steps
    assert expected_tokens_per_cost(0.5, 2, 0.1) == pytest.approx(1.75 / 1.2)
    assert expected_tokens_per_cost(0.9, 0, 0.1) == 1.0


@pytest.mark.parametrize(
    ("probability", "row_cost", "length"),
    [
        (0.0, 0.06, 1),  # never accepted: still one, so the estimate can recover
        (0.2, 0.06, 1),
        (0.3, 0.06, 2),
        (0.5, 0.06, 3),  # 1.875/1.18 beats 1.75/1.12 and 1.9375/1.24
        (0.7, 0.06, 5),
        (0.8, 0.06, 7),
        (0.9, 0.06, 8),
        (1.0, 0.06, 8),
        (0.5, 0.2, 1),  # a dearer row: the same odds pay for fewer drafts
        (0.7, 0.2, 3),
        (0.8, 0.2, 4),
        (0.9, 0.2, 7),
        (0.3, 0.0, 8),  # free rows: every draft that may be accepted pays
        (0.0, 0.0, 1),  # all lengths equal: the shortest
    ],
)
def test_best_draft_length(probability, row_cost, length):
    assert best_draft_length(probability, 8, row_cost) == length


def test_the_length_never_exceeds_num_speculative_tokens():
    assert best_draft_length(1.0, 3, 0.06) == 3
    assert best_draft_length(1.0, 1, 0.06) == 1


def lengths_after(history: list[bool], policy: DraftLengthPolicy) -> list[int]:
    """The length asked before each verify, when each verify accepts all drafts (True) or none."""
    estimate = AcceptanceEstimate()
    lengths = []
    for all_accepted in history:
        length = policy.next_length(estimate)
        lengths.append(length)
        estimate.observe(length, length if all_accepted else 0)
    lengths.append(policy.next_length(estimate))
    return lengths


def test_lengths_follow_a_history_of_verifies():
    # a request that copies, stops copying, then copies again
    history = [True] * 6 + [False] * 6 + [True] * 4
    assert lengths_after(history, DraftLengthPolicy(8, True, 0.06)) == [
        3, 8, 8, 8, 8, 8, 8, 8, 6, 4, 3, 2, 2, 3, 5, 8, 8,
    ]  # fmt: skip
    assert lengths_after(history, DraftLengthPolicy(8, True, 0.2)) == [
        1, 3, 6, 8, 8, 8, 8, 5, 3, 2, 2, 1, 1, 1, 2, 3, 4,
    ]  # fmt: skip


def test_a_request_that_never_accepts_drafts_one_token():
    assert lengths_after([False] * 5, DraftLengthPolicy(4, True, 0.06)) == [3, 2, 1, 1, 1, 1]


def test_off_always_drafts_num_speculative_tokens():
    assert lengths_after([False] * 5 + [True] * 2, DraftLengthPolicy(4, False, 0.06)) == [4] * 8


class FakePlatform:
    def __init__(self):
        self.asked = 0

    def verify_row_cost(self) -> float:
        self.asked += 1
        return 0.33


def test_the_runner_takes_the_row_cost_from_the_config_else_the_platform():
    from tokenloom.core.config import SpeculativeConfig
    from tokenloom.core.model_runner import ModelRunner

    platform = FakePlatform()
    policy = ModelRunner._draft_length_policy(SpeculativeConfig(num_speculative_tokens=5), platform)
    assert policy == DraftLengthPolicy(5, adaptive=True, verify_row_cost=0.33)
    given = SpeculativeConfig(num_speculative_tokens=5, verify_row_cost=0.5)
    assert ModelRunner._draft_length_policy(given, platform).verify_row_cost == 0.5
    off = SpeculativeConfig(num_speculative_tokens=5, adaptive_num_speculative_tokens=False)
    assert not ModelRunner._draft_length_policy(off, platform).adaptive
    assert platform.asked == 1  # only when adaptive and the config gives no cost
