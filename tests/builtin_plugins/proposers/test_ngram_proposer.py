"""The built-in ``ngram`` proposer: prompt lookup, longest n-gram first, and its registration."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tokenloom.core.config import EngineArgs, SpeculativeConfig
from tokenloom.plugin_api import DraftRequest, ProposerSpec
from tokenloom.plugins.manager import load_plugins


def proposer(min_n: int, max_n: int):
    from tokenloom.builtin_plugins.proposers.ngram import NgramProposer

    speculative = SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=min_n, prompt_lookup_max=max_n
    )
    return NgramProposer(ProposerSpec(speculative, EngineArgs().create_engine_config(), model_info=None))


def test_proposes_what_followed_the_suffix_earlier():
    # suffix [7, 8] occurred at 1..2, followed by 9, 10, 11
    assert proposer(1, 3).lookup([5, 7, 8, 9, 10, 11, 12, 7, 8], 3) == [9, 10, 11]


def test_longest_match_wins_over_a_more_recent_shorter_one():
    # [1, 2, 3] matches at the start (then 40); [2, 3] alone also matches later (then 50)
    tokens = [1, 2, 3, 40, 41, 9, 2, 3, 50, 51, 1, 2, 3]
    assert proposer(2, 3).lookup(tokens, 2) == [40, 41]
    assert proposer(2, 2).lookup(tokens, 2) == [50, 51]


def test_the_latest_match_with_a_full_draft_else_the_earliest():
    # a period-1 loop: the latest match of [5, 5] is followed by one token only
    assert proposer(2, 2).lookup([1, 5, 5, 5, 5, 5], 3) == [5, 5, 5]
    # [1, 2] matched twice, both followed by a full draft: the latest wins
    assert proposer(2, 2).lookup([1, 2, 3, 3, 3, 1, 2, 4, 4, 4, 1, 2], 3) == [4, 4, 4]


def test_the_most_frequent_continuation_wins_over_a_more_recent_one():
    # [7] occurred three times: followed by 1 twice, then by 2 most recently
    tokens = [7, 1, 5, 6, 7, 1, 5, 6, 7, 2, 8, 9, 7]
    assert proposer(1, 1).lookup(tokens, 3) == [1, 5, 6]
    # a tie keeps both continuations, and the more recent one wins
    assert proposer(1, 1).lookup([7, 1, 5, 6, 7, 2, 8, 9, 7], 3) == [2, 8, 9]
    # only occurrences followed by a full draft vote: 4 twice against 3 once (the last [7, 3]
    # is followed by two tokens only, else 3 would tie and, more recent, win)
    assert proposer(1, 1).lookup([7, 4, 5, 6, 9, 7, 4, 5, 6, 0, 7, 3, 7, 3, 7], 3) == [4, 5, 6]


def reference_lookup(tokens: list[int], min_n: int, max_n: int, max_tokens: int) -> list[int]:
    """The documented rule, written plainly: the longest suffix with an earlier occurrence; among
    its occurrences followed by a whole draft (all when none is), those followed by the most
    frequent next token; the latest of them, or the earliest when none is followed by a whole draft."""
    length = len(tokens)
    if max_tokens <= 0 or length < min_n + 1:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        matches = [i for i in range(length - n) if tokens[i : i + n] == tokens[length - n :]]
        if not matches:
            continue
        full = [i for i in matches if i + n + max_tokens <= length]
        candidates = full or matches
        votes = Counter(tokens[i + n] for i in candidates)
        most = max(votes.values())
        candidates = [i for i in candidates if votes[tokens[i + n]] == most]
        start = (candidates[-1] if full else candidates[0]) + n
        return tokens[start : start + max_tokens]
    return []


def test_lookup_follows_the_rule_on_random_sequences():
    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice((2, 3, 5, 50))) for _ in range(rng.randrange(1, 40))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        max_tokens = rng.randrange(0, 6)
        assert proposer(min_n, max_n).lookup(tokens, max_tokens) == reference_lookup(
            tokens, min_n, max_n, max_tokens
        ), (tokens, min_n, max_n, max_tokens)


def test_no_match_or_too_short_proposes_nothing():
    assert proposer(2, 3).lookup([1, 2, 3, 4], 3) == []
    assert proposer(3, 3).lookup([1, 1], 3) == []
    assert proposer(1, 1).lookup([1, 2, 1], 0) == []


def test_propose_returns_one_point_mass_draft_per_request():
    drafts = proposer(1, 2).propose([DraftRequest("a", [4, 5, 6, 4], 3, 2), DraftRequest("b", [1, 2, 3], 3, 2)])
    assert [draft.token_ids for draft in drafts] == [[5, 6], []]
    assert all(draft.probs is None for draft in drafts)


@pytest.mark.hook("register_proposers")
def test_ngram_is_registered_as_a_proposer():
    from tokenloom.builtin_plugins.proposers.ngram import NgramProposer
    from tokenloom.plugin_api import Proposer

    # the entry point (builtin_proposers) loads this module; loading it by name is the same
    plugins = load_plugins(modules=["tokenloom.builtin_plugins.proposers"])
    proposer_class = plugins.registry("proposer").get("ngram")
    assert proposer_class is NgramProposer and issubclass(proposer_class, Proposer)
