"""StopStringMatcher (tokenloom.core.detokenizer): the automaton the detokenizer feeds its new
text, checked against the direct definitions on random texts, stop sets and splits."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.core.detokenizer import StopStringMatcher

# a small alphabet, so that overlaps and shared prefixes between stop strings are common
ALPHABET = "abcé😀"
texts = st.text(alphabet=ALPHABET, max_size=40)
stop_sets = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=6), min_size=1, max_size=6)


def longest_partial_match(text: str, stops: list[str]) -> int:
    """The definition: the longest suffix of ``text`` that some stop string starts with."""
    for length in range(len(text), 0, -1):
        if any(stop.startswith(text[-length:]) for stop in stops):
            return length
    return 0


@settings(max_examples=400, deadline=None)
@given(text=texts, stops=stop_sets, cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=6))
def test_feeding_pieces_agrees_with_the_definitions(text, stops, cuts):
    matcher = StopStringMatcher(stops)
    bounds = sorted({0, len(text), *(cut for cut in cuts if cut <= len(text))})
    for start, end in zip(bounds, bounds[1:]):
        matched = matcher.feed(text[start:end])
        # a stop string ends inside this piece, and the text before it held none
        expected_match = any(
            text.find(stop, 0, end) != -1 and text.find(stop, 0, end) + len(stop) > start for stop in stops
        )
        assert matched == expected_match
        if matched:
            return  # the detokenizer stops feeding once a stop string is found
        assert matcher.partial_match_len == longest_partial_match(text[:end], stops)


def test_a_partial_match_is_held_across_feeds_and_a_mismatch_falls_back():
    matcher = StopStringMatcher(["</stop>", "top!"])
    assert not matcher.feed("hello </st")
    assert matcher.partial_match_len == 4  # "</st"
    assert not matcher.feed("x")
    assert matcher.partial_match_len == 0
    assert not matcher.feed("</sto")
    assert matcher.partial_match_len == 5
    assert matcher.feed("p!")  # "top!" ends here, inside "</stop!"
